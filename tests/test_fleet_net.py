"""The fleet over real networks (issue 40): transfers through a fault-injecting proxy
(tests/faultproxy.py) in front of a real registry (Debian's docker-registry, CNCF distribution
2.8, on loopback) -- resets, stalls, short bodies, 5xx, 416, a 206 at another offset, a
registry that ignores ranges, body limits (413), a token that expires mid-transfer; retries
with backoff, resuming from the byte reached, chunked uploads; what a failure that is given up
on says (exit 11, the partial kept, the command that resumes -- run here), what repairs a
damaged artifact (each hint's commands run here), ``oci:DIR`` written by several processes at
once. Small synthetic artifacts: no vLLM, no CRIU."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from faultproxy import Fault, FaultProxy
from vllm_snapshot.dev.registry_server import RegistryServer
from test_fleet import _keypair
from test_fleet_ops import Tools, _root, make_snapshot, model  # noqa: F401 - a fixture
from vllm_snapshot.cli import app as cli
from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from vllm_snapshot.fleet import oci, partial, sign, transfer, transport
from vllm_snapshot.fleet.reference import RegistryRef
from vllm_snapshot.effects.fleet import LocalFleetTools
from vllm_snapshot.ops import fleet
from vllm_snapshot.report.progress import Reporter

REPO = "snaps/six"
FAST = transport.Net(tries=4, backoff_s=0.01, backoff_max_s=0.05, timeout_s=1.0)


@pytest.fixture
def registry(tmp_path):
    r = RegistryServer(tmp_path / "registry")
    yield r
    r.stop()


@pytest.fixture
def proxy(registry):
    with FaultProxy(registry.host) as p:
        yield p


@pytest.fixture
def fast(monkeypatch):
    """Quick retries for the commands (the environment every Registry reads), and small reads
    (so that a blob of a few hundred kB is received in several pieces and can be resumed)."""
    monkeypatch.setenv(transport.TRIES_ENV, "4")
    monkeypatch.setenv(transport.BACKOFF_ENV, "0.01")
    monkeypatch.setenv(transport.TIMEOUT_ENV, "1.5")
    monkeypatch.setattr(transport, "CHUNK", 16 << 10)


def _blob(tmp_path: Path, n: int, name: str = "blob") -> tuple[Path, bytes, str]:
    data = os.urandom(n)
    p = tmp_path / name
    p.write_bytes(data)
    return p, data, "sha256:" + hashlib.sha256(data).hexdigest()


def _reg(host: str, net: transport.Net = FAST, repo: str = "t/blob") -> transport.Registry:
    return transport.Registry(RegistryRef(host, repo, "v1"), plain_http=True, net=net)


def net_tools(host=None):
    """The ops' tools of test_fleet_ops (this node's identity, no trust checks of tmp dirs) with
    the real transports: a registry reference is a :class:`transport.Registry`."""
    return dataclasses.replace(Tools(host), fleet=LocalFleetTools())


def _run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``vllm-snapshot ARGV`` in this process with :func:`net_tools` (so the synthetic snapshots
    fit "this node"): exit code, stdout, stderr."""
    import vllm_snapshot.effects.tools as et

    monkeypatch.setattr(et, "local_tools", lambda: net_tools())
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _hint_commands(hint: str) -> list[str]:
    """The commands a hint names (between backquotes)."""
    return re.findall(r"`([^`]+)`", hint)




# --------------------------------------------------------------------------- settings, sorting failures

def test_transient_sorts_network_failures_from_refusals():
    import http.client

    import urllib3

    for e in (requests.exceptions.ChunkedEncodingError("reset"), requests.exceptions.ConnectionError("refused"),
              requests.exceptions.ReadTimeout("stall"), urllib3.exceptions.ProtocolError("broken"),
              urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"), http.client.IncompleteRead(b"x", 3),
              ConnectionResetError(104, "reset"), TimeoutError("slow"), transport.Again("503")):
        assert transport.transient(e), e
    for e in (requests.exceptions.SSLError("certificate verify failed"), CorruptSnapshotError("bad"),
              EnvironmentProblem("refused"), ValueError("x"), transport.Stopped("ctrl-c")):
        assert not transport.transient(e), e
    # the partial dir is kept for each of them, requests' own exceptions included (they got out once)
    assert partial._keep_for_resume(requests.exceptions.ChunkedEncodingError("reset"))
    assert not partial._keep_for_resume(CorruptSnapshotError("bad"))


def test_net_settings_come_from_the_environment_and_a_bad_one_is_a_usage_error():
    assert transport.Net.from_env({}) == transport.Net()
    assert transport.Net().tries == 5 and transport.Net().timeout_s < 120
    n = transport.Net.from_env({transport.TRIES_ENV: "9", transport.BACKOFF_ENV: "0.25", transport.TIMEOUT_ENV: "7",
                                transport.CHUNK_ENV: "16M"})
    assert (n.tries, n.backoff_s, n.timeout_s, n.chunk_bytes) == (9, 0.25, 7.0, 16 << 20)
    for var, bad in ((transport.TRIES_ENV, "0"), (transport.TIMEOUT_ENV, "soon"), (transport.CHUNK_ENV, "12"),
                     (transport.BACKOFF_ENV, "-1")):
        with pytest.raises(UsageError, match=var):
            transport.Net.from_env({var: bad})
    assert [transport.parse_size(x) for x in ("65536", "64k", "16M", "1GiB", "0")] == [65536, 65536, 16 << 20,
                                                                                       1 << 30, 0]


def test_cli_refuses_a_bad_chunk_size_before_anything(capsys):
    assert cli.main(["push", "nothing", "oci:/nonexistent:v1", "--chunk-size", "lots"]) == 2
    assert "--chunk-size 'lots'" in capsys.readouterr().err


# --------------------------------------------------------------------------- downloads survive

@pytest.mark.parametrize("fault", [
    Fault("reset", method="GET", path="/blobs/", after=150_000),
    Fault("close", method="GET", path="/blobs/", after=150_000),
    Fault("short", method="GET", path="/blobs/", after=150_000),
    Fault("stall", method="GET", path="/blobs/", after=150_000, seconds=20),
    Fault("reset", method="GET", path="/blobs/", after=150_000, times=3),
], ids=["reset", "close-short-of-its-length", "short-clean-end", "stall", "three-resets"])
def test_a_download_cut_off_resumes_from_the_byte_it_reached(tmp_path, registry, proxy, monkeypatch, fault):
    monkeypatch.setattr(transport, "CHUNK", 16 << 10)
    path, data, digest = _blob(tmp_path, 400_000)
    _reg(registry.host).put_blob(digest, len(data), path)
    proxy.add(fault)
    got = bytearray()
    t0 = time.monotonic()
    wire = _reg(proxy.host).get_blob(digest, len(data), got.extend, "pages")
    assert bytes(got) == data and wire == len(data)  # nothing twice: each resume asked for the rest only
    gets = proxy.requests("GET", "/blobs/")
    # each cut one resumed from the byte it reached (an RST may drop bytes the client had not read yet:
    # then a picked fault can meet a rest shorter than its `after`, and the last request is whole)
    assert {g["fault"] for g in gets[:-1]} == {fault.action} and 1 <= len(gets) - 1 <= fault.times, gets
    assert gets[-1]["status"] == 206
    assert all(g["status"] == 206 for g in gets[1:])
    if fault.action == "stall":  # the read timeout (1 s here), not the proxy's 20 s
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("status,retry_after", [(500, None), (503, 1), (429, None)])
def test_a_registry_that_answers_5xx_or_429_is_asked_again(tmp_path, registry, proxy, status, retry_after):
    path, data, digest = _blob(tmp_path, 50_000)
    r = _reg(proxy.host, dataclasses.replace(FAST, backoff_max_s=3.0))
    proxy.add(Fault("status", status=status, retry_after=retry_after, times=2))
    t0 = time.monotonic()
    r.put_blob(digest, len(data), path)  # POST answered twice with the status, then through
    if retry_after:  # the registry's Retry-After is waited (up to the backoff's cap), twice
        assert time.monotonic() - t0 >= 2 * retry_after
    got = bytearray()
    proxy.add(Fault("status", method="GET", status=status, times=2))
    r.get_blob(digest, len(data), got.extend, "x")
    assert bytes(got) == data


@pytest.mark.parametrize("action", ["range416", "bad206", "ignore-range"])
def test_a_resume_the_registry_does_not_honour_fetches_the_whole_blob_once_with_a_note(
        tmp_path, registry, proxy, monkeypatch, action):
    monkeypatch.setattr(transport, "CHUNK", 16 << 10)
    path, data, digest = _blob(tmp_path, 400_000)
    _reg(registry.host).put_blob(digest, len(data), path)
    proxy.add(Fault("reset", method="GET", path="/blobs/", after=150_000),
              Fault(action, method="GET", path="/blobs/", times=None))
    r = _reg(proxy.host)
    got = bytearray()
    wire = r.get_blob(digest, len(data), got.extend, "pages")
    assert bytes(got) == data
    assert wire > len(data)  # real bytes: the cut-off start, then the whole blob
    assert len(r.notes) == 1 and "ranges" in r.notes[0] and proxy.host in r.notes[0]
    # and a caller's prefix from disk (a resumed pull) is checked with the whole blob too
    h = hashlib.sha256(data[:100_000])
    got = bytearray()
    assert r.get_blob(digest, len(data), got.extend, "pages", start=100_000, h=h) == len(data)
    assert bytes(got) == data[100_000:]


def test_a_blob_the_registry_holds_shorter_is_refused_as_damaged_not_retried(tmp_path, registry):
    path, data, digest = _blob(tmp_path, 100_000)
    _reg(registry.host).put_blob(digest, len(data), path)
    registry.blob_path(digest).write_bytes(data[:60_000])
    t0 = time.monotonic()
    with pytest.raises(CorruptSnapshotError, match="60000 bytes on .*, not the 100000"):
        _reg(registry.host, transport.Net(tries=5, backoff_s=2)).get_blob(digest, len(data), bytearray().extend, "x")
    assert time.monotonic() - t0 < 2  # not one backoff


def test_giving_up_says_the_registrys_words_after_the_tries(tmp_path, registry, proxy):
    path, data, digest = _blob(tmp_path, 50_000)
    _reg(registry.host).put_blob(digest, len(data), path)
    proxy.add(Fault("status", method="GET", status=502, times=None))
    with pytest.raises(EnvironmentProblem, match=r"gave up after 4 tries in a row: GET blob .*: 502") as e:
        _reg(proxy.host).get_blob(digest, len(data), bytearray().extend, "x")
    assert e.value.exit_code == 11 and transport.TRIES_ENV in e.value.hint
    assert len(proxy.requests("GET")) == 4


def test_a_stop_during_a_backoff_stops_at_once(tmp_path, registry, proxy):
    """Ctrl-C while a transfer thread waits to retry: it stops within a slice, not after the wait."""
    path, data, digest = _blob(tmp_path, 50_000)
    _reg(registry.host).put_blob(digest, len(data), path)
    proxy.add(Fault("status", method="GET", status=503, times=None))
    r = _reg(proxy.host, transport.Net(tries=10, backoff_s=30, backoff_max_s=30, timeout_s=5))
    ev = threading.Event()
    out: list = []

    def run():
        transport.STOP.event = ev
        try:
            r.get_blob(digest, len(data), bytearray().extend, "x")
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            out.append(e)

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 10
    while not proxy.requests("GET") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    t0 = time.monotonic()
    ev.set()
    th.join(10)
    assert not th.is_alive() and time.monotonic() - t0 < 1 and isinstance(out[0], transport.Stopped)


# --------------------------------------------------------------------------- uploads survive, in chunks when they must

def test_an_upload_cut_off_is_sent_again_and_its_session_cancelled(tmp_path, registry, proxy):
    path, data, digest = _blob(tmp_path, 300_000)
    proxy.add(Fault("reset", method="PUT", path="/blobs/uploads/", after=100_000))
    _reg(proxy.host).put_blob(digest, len(data), path)
    assert requests.get(f"http://{registry.host}/v2/t/blob/blobs/{digest}", timeout=10).content == data
    methods = [(e["method"], e["status"]) for e in proxy.log]
    assert methods[:2] == [("POST", 202), ("PUT", 0)] and methods[-1] == ("PUT", 201), methods
    assert methods[2][0] == "DELETE", methods  # the broken session cancelled (or found gone), then a new one


def test_a_chunked_upload_patches_with_content_range_and_puts_once_every_byte_is_there(tmp_path, registry, proxy):
    path, data, digest = _blob(tmp_path, 300_000)
    _reg(proxy.host, dataclasses.replace(FAST, chunk_bytes=100_000)).put_blob(digest, len(data), path)
    patches = proxy.requests("PATCH")
    assert [p["received"] for p in patches] == [100_000, 100_000, 100_000] and all(p["status"] == 202 for p in patches)
    puts = proxy.requests("PUT")
    assert len(puts) == 1 and puts[0]["received"] == 0 and puts[0]["status"] == 201
    assert requests.get(f"http://{registry.host}/v2/t/blob/blobs/{digest}", timeout=10).content == data


def test_a_chunked_upload_follows_the_range_the_registry_reports_and_its_minimum_chunk(tmp_path, registry, proxy):
    """The registry took only part of a PATCH (its Range says so): the next chunk starts there.
    OCI-Chunk-Min-Length larger than the chunk size: chunks of that length."""
    path, data, digest = _blob(tmp_path, 300_000)
    proxy.add(Fault("truncate-body", method="PATCH", after=30_000))
    _reg(proxy.host, dataclasses.replace(FAST, chunk_bytes=100_000)).put_blob(digest, len(data), path)
    ranges = [p["received"] for p in proxy.requests("PATCH")]
    assert ranges[0] == 30_000 and sum(ranges) == 300_000, ranges
    assert requests.get(f"http://{registry.host}/v2/t/blob/blobs/{digest}", timeout=10).content == data
    proxy.log.clear()
    proxy.chunk_min_length = 120_000
    path, data, digest = _blob(tmp_path, 300_000, "other")
    _reg(proxy.host, dataclasses.replace(FAST, chunk_bytes=65536)).put_blob(digest, len(data), path)
    assert [p["received"] for p in proxy.requests("PATCH")] == [120_000, 120_000, 60_000]


def test_a_chunk_cut_off_starts_a_new_session_where_the_registry_lost_it(tmp_path, registry, proxy):
    path, data, digest = _blob(tmp_path, 300_000)
    proxy.add(Fault("reset", method="PATCH", after=50_000, skip=1))  # the second chunk breaks half-way
    _reg(proxy.host, dataclasses.replace(FAST, chunk_bytes=100_000)).put_blob(digest, len(data), path)
    assert requests.get(f"http://{registry.host}/v2/t/blob/blobs/{digest}", timeout=10).content == data
    # distribution drops a session whose PATCH broke (its status GET: 404): a new one, from byte 0
    assert any(e["method"] == "GET" and "/blobs/uploads/" in e["path"] for e in proxy.log)
    assert len(proxy.requests("POST")) == 2


def test_a_body_limit_413_falls_back_to_chunks_halving_them_until_they_pass(tmp_path, registry, proxy):
    path, data, digest = _blob(tmp_path, 700_000)
    proxy.body_limit = 200_000
    r = _reg(proxy.host)
    r.put_blob(digest, len(data), path)
    assert requests.get(f"http://{registry.host}/v2/t/blob/blobs/{digest}", timeout=10).content == data
    assert proxy.requests("PUT")[0]["status"] == 413
    sizes = [p["received"] for p in proxy.requests("PATCH") if p["status"] == 202]
    assert sizes and max(sizes) <= 200_000 and sum(sizes) == 700_000
    assert any("413" in n and "PATCH chunks" in n for n in r.notes)
    # every abandoned session was cancelled: none is left open on the registry
    posts = [e for e in proxy.requests("POST") if e["status"] == 202]
    assert len(proxy.requests("DELETE")) >= len(posts) - 1


def test_a_failed_upload_cancels_its_session(tmp_path, registry, proxy):
    path, data, digest = _blob(tmp_path, 300_000)
    proxy.add(Fault("status", method="PATCH", status=400, times=None))
    with pytest.raises(EnvironmentProblem, match="refused a chunk"):
        _reg(proxy.host, dataclasses.replace(FAST, chunk_bytes=100_000)).put_blob(digest, len(data), path)
    assert len(proxy.requests("POST")) == 1
    dels = proxy.requests("DELETE", "/blobs/uploads/")
    assert len(dels) == 1 and dels[0]["status"] == 204, proxy.log


# --------------------------------------------------------------------------- an expired token

def test_a_token_that_expires_mid_push_is_fetched_once_for_all_threads_and_the_body_sent_again(
        tmp_path, registry, model, fast, monkeypatch):
    # no stall here: the 1.5 s stall detector of `fast` would retry a token request that a loaded
    # box answers late, and the proxy would count that retry as a second fetch (seen at load ~10)
    monkeypatch.setenv(transport.TIMEOUT_ENV, "60")
    with FaultProxy(registry.host, token_auth=True) as px:
        snap = tmp_path / "snaps" / "six"
        snap.parent.mkdir(mode=0o700)
        make_snapshot(snap, model, pages_files=6, page_bytes=200_000)
        px.add(Fault("expire-token", method="PUT", path="/blobs/uploads/"))
        r = fleet.push(fleet.PushRequest(snapshot=snap, image=f"{px.host}/{REPO}:v1", plain_http=True), Reporter(),
                       net_tools())
        assert r.blobs == 7 and r.sent_bytes == r.bytes
        # the first token (4 threads met the first 401 at once: one fetch), one after the expiry
        assert px.token_requests == 2, px.log
        expired = [e for e in px.log if e["fault"] == "expire-token"]
        assert len(expired) == 1
        # and a pull whose token expires between two blobs
        px.add(Fault("expire-token", method="GET", path="/blobs/", skip=3))
        got = fleet.pull(fleet.PullRequest(image=f"{px.host}/{REPO}:v1", root=_root(tmp_path), name="six",
                                           plain_http=True), Reporter(), net_tools())
        assert got.fetched_bytes == got.bytes and px.token_requests == 4  # the pull's own first, one refresh


# --------------------------------------------------------------------------- a pull through a bad network

@pytest.fixture
def pushed(tmp_path, registry, model):
    """Six 200 kB pages and an inventory pushed straight to the registry."""
    snap = tmp_path / "snaps" / "six"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model, pages_files=6, page_bytes=200_000)
    r = fleet.push(fleet.PushRequest(snapshot=snap, image=f"{registry.host}/{REPO}:v1", plain_http=True), Reporter(),
                   net_tools())
    return {"snapshot": snap, "result": r}


def _same(snap: Path, got: Path) -> None:
    for n in os.listdir(snap / "images"):
        assert (got / "images" / n).read_bytes() == (snap / "images" / n).read_bytes(), n


def test_a_pull_through_resets_stalls_and_short_bodies_completes_fetching_each_byte_once(
        tmp_path, proxy, pushed, fast):
    art = transfer.fetch_manifest(_reg(proxy.host, repo=REPO), "v1", "IMG")
    pages = "|".join(p.digest for p in art.parts if p.size == 200_000)
    proxy.add(Fault("reset", method="GET", path=pages, after=70_000, times=2, ranged=False),
              Fault("stall", method="GET", path=pages, after=120_000, seconds=30, ranged=False),
              Fault("short", method="GET", path=pages, after=90_000, ranged=False),
              Fault("close", method="GET", path=pages, after=10_000, ranged=False))
    root = _root(tmp_path)
    r = fleet.pull(fleet.PullRequest(image=f"{proxy.host}/{REPO}:v1", root=root, name="six", plain_http=True),
                   Reporter(), net_tools())
    _same(pushed["snapshot"], Path(r.snapshot))
    assert r.fetched_bytes == r.bytes and r.reused_bytes == 0 and not r.warnings
    assert os.listdir(root) == ["six"]
    # each fault cut one whole download, and each cut cost one more request (a range from the byte
    # reached; from 0 when the client had not read a byte of it yet)
    assert len([e for e in proxy.requests("GET", pages)]) == 6 + 5
    assert [e["fault"] for e in proxy.requests("GET", pages)].count(None) == 6


def test_a_pull_that_gives_up_exits_11_keeps_its_partial_and_its_hint_resumes_it(
        tmp_path, proxy, pushed, fast, monkeypatch, capsys):
    art = transfer.fetch_manifest(_reg(proxy.host, repo=REPO), "v1", "IMG")
    last = min(art.parts, key=lambda p: p.size)  # the smallest layer goes last: the others are in by then
    proxy.add(Fault("reset", method="GET", path=last.digest, after=0, times=None))
    root = _root(tmp_path)
    image = f"{proxy.host}/{REPO}:v1"
    code, out, err = _run_cli(["--root", str(root), "pull", image, "--plain-http", "--name", "six"], monkeypatch,
                              capsys)
    assert code == 11, err
    assert "gave up after 4 tries in a row" in err and last.digest in err, err
    left = partial.partial_dir(root, art.digest)
    assert left.is_dir() and len(os.listdir(left / partial.MARKS)) == len(art.parts) - 1
    hint = err.split("hint: ", 1)[1]
    [cmd] = [c for c in _hint_commands(hint) if " pull " in c]
    assert str(left) in hint and cmd == shlex.join(["vllm-snapshot", "--root", str(root), "pull", image, "--name",
                                                    "six", "--plain-http"])
    proxy.clear()  # the network is back: the hint's command resumes
    code, out, err = _run_cli(shlex.split(cmd)[1:] + ["--json"], monkeypatch, capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["reused_blobs"] == len(art.parts) - 1 and got["fetched_bytes"] == last.size
    _same(pushed["snapshot"], root / "six")


def test_a_resume_answered_416_fetches_the_layer_whole_and_counts_the_real_bytes(tmp_path, proxy, pushed, fast,
                                                                                 monkeypatch):
    """An interrupted pull left a layer half-way (its progress record); the registry's proxy
    refuses ranges: the next pull fetches that layer whole, says why, and fetched_bytes counts
    what came."""
    monkeypatch.setattr(transfer, "PROGRESS_BYTES", 32 << 10)
    art = transfer.fetch_manifest(_reg(proxy.host, repo=REPO), "v1", "IMG")
    big = max(art.parts, key=lambda p: p.size)
    proxy.add(Fault("reset", method="GET", path=big.digest, after=150_000),
              Fault("status", method="GET", path=big.digest, status=503, times=None))
    root = _root(tmp_path)
    image = f"{proxy.host}/{REPO}:v1"
    with pytest.raises(EnvironmentProblem):
        fleet.pull(fleet.PullRequest(image=image, root=root, name="six", plain_http=True), Reporter(), net_tools())
    i = art.parts.index(big)
    marks = partial.partial_dir(root, art.digest) / partial.MARKS
    kept = int((marks / f"{i}.at").read_text())
    marked = [int(m) for m in os.listdir(marks) if m.isdigit()]
    assert kept > 0 and i not in marked
    proxy.clear()
    proxy.add(Fault("range416", method="GET", times=None))
    r = fleet.pull(fleet.PullRequest(image=image, root=root, name="six", plain_http=True), Reporter(), net_tools())
    _same(pushed["snapshot"], Path(r.snapshot))
    reused = sum(art.parts[m].size for m in marked)
    assert r.reused_bytes == reused and r.fetched_bytes == r.bytes - reused  # its kept prefix came again too
    assert any("416" in w and "ranges" in w for w in r.warnings), r.warnings


# --------------------------------------------------------------------------- pushes through a bad network

def test_a_push_through_a_body_limit_and_resets_completes_and_one_that_gives_up_says_how_to_go_on(
        tmp_path, registry, model, fast, monkeypatch, capsys):
    snap = tmp_path / "snaps" / "six"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model, pages_files=6, page_bytes=200_000)
    with FaultProxy(registry.host, body_limit=150_000) as px:
        px.add(Fault("reset", method="PATCH", after=20_000, times=2))
        image = f"{px.host}/{REPO}:v1"
        r = fleet.push(fleet.PushRequest(snapshot=snap, image=image, plain_http=True), Reporter(), net_tools())
        assert any("413" in w for w in r.warnings), r.warnings
        got = fleet.pull(fleet.PullRequest(image=f"{registry.host}/{REPO}:v1", root=_root(tmp_path), name="six",
                                           plain_http=True), Reporter(), net_tools())
        _same(snap, Path(got.snapshot))
        # another tag, and the registry goes away for good after two blobs
        make_snapshot(snap2 := tmp_path / "snaps" / "seven", model, pages_files=3, page_bytes=100_000)
        px.add(Fault("status", status=503, skip=6, times=None))
        code, out, err = _run_cli(["push", str(snap2), f"{px.host}/{REPO}:v2", "--plain-http"], monkeypatch, capsys)
        assert code == 11 and "gave up after 4 tries in a row" in err and "503" in err, err
        [cmd] = [c for c in _hint_commands(err.split("hint: ", 1)[1]) if " push " in c]
        assert not requests.get(f"http://{registry.host}/v2/{REPO}/manifests/v2", timeout=10,
                                headers={"Accept": oci.OCI_MANIFEST}).ok  # the tag was never moved
        px.clear()
        code, out, err = _run_cli(shlex.split(cmd)[1:] + ["--json"], monkeypatch, capsys)
        assert code == 0, err
        assert json.loads(out)["skipped"] >= 1


# --------------------------------------------------------------------------- a damaged artifact: what repairs it

def test_a_damaged_blob_in_a_layout_is_repaired_by_the_push_its_hint_names(tmp_path, model, monkeypatch, capsys):
    snap = tmp_path / "snaps" / "six"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model, pages_files=2)
    lay = tmp_path / "layout"
    image = f"oci:{lay}:v1"
    fleet.push(fleet.PushRequest(snapshot=snap, image=image), Reporter(), Tools())
    art = transfer.fetch_manifest(transport.Layout(lay), "v1", "IMG")
    blob = lay / "blobs" / "sha256" / art.parts[-1].digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    root = _root(tmp_path)
    code, out, err = _run_cli(["--root", str(root), "pull", image, "--name", "six"], monkeypatch, capsys)
    assert code == 5, err
    [cmd] = _hint_commands(err.split("hint: ", 1)[1])
    assert cmd == f"vllm-snapshot push SNAPSHOT {image}"
    code, out, err = _run_cli(shlex.split(cmd.replace("SNAPSHOT", str(snap)))[1:], monkeypatch, capsys)
    assert code == 0 and "written again" in out + err and art.parts[-1].digest in out + err, (out, err)
    code, out, err = _run_cli(["--root", str(root), "pull", image, "--name", "six"], monkeypatch, capsys)
    assert code == 0, err
    _same(snap, root / "six")


def test_a_damaged_blob_in_a_registry_is_repaired_by_what_its_hint_names_and_not_by_a_push_alone(
        tmp_path, registry, pushed, monkeypatch, capsys):
    snap = pushed["snapshot"]
    image = f"{registry.host}/{REPO}:v1"
    art = transfer.fetch_manifest(_reg(registry.host, repo=REPO), "v1", "IMG")
    part = art.parts[-1]
    data = bytearray(registry.blob_path(part.digest).read_bytes())
    data[100] ^= 1
    registry.blob_path(part.digest).write_bytes(bytes(data))
    root = _root(tmp_path)
    pull = ["--root", str(root), "pull", image, "--plain-http", "--name", "six"]
    code, out, err = _run_cli(pull, monkeypatch, capsys)
    assert code == 5, err
    hint = err.split("hint: ", 1)[1]
    rm, push, other = _hint_commands(hint)
    assert push == f"vllm-snapshot push SNAPSHOT {image} --plain-http"
    # what the hint says does not work, does not: the same push again leaves the damaged bytes
    code, out, err = _run_cli(shlex.split(push.replace("SNAPSHOT", str(snap)))[1:], monkeypatch, capsys)
    assert code == 0
    code, _, err = _run_cli(pull, monkeypatch, capsys)
    assert code == 5, err
    # the other way out it names: push to an image layout and pull from there
    lay = f"oci:{tmp_path / 'elsewhere'}:v1"
    other = other.replace("SNAPSHOT", str(snap)).replace("oci:DIR:TAG", lay)
    code, out, err = _run_cli(shlex.split(other)[1:], monkeypatch, capsys)
    assert code == 0, err
    code, out, err = _run_cli(["--root", str(root), "pull", lay, "--name", "from-layout"], monkeypatch, capsys)
    assert code == 0, err
    # the registry-side repair: remove the blob's data (ROOTDIR: the storage root), push, pull
    rm = rm.replace("ROOTDIR", str(registry.storage))
    subprocess.run(shlex.split(rm), check=True)
    code, out, err = _run_cli(shlex.split(push.replace("SNAPSHOT", str(snap)))[1:], monkeypatch, capsys)
    assert code == 0, err
    code, out, err = _run_cli(pull, monkeypatch, capsys)
    assert code == 0, err
    _same(snap, root / "six")


def test_a_missing_blob_is_repaired_by_the_push_its_hint_names(tmp_path, registry, pushed, monkeypatch, capsys):
    image = f"{registry.host}/{REPO}:v1"
    art = transfer.fetch_manifest(_reg(registry.host, repo=REPO), "v1", "IMG")
    shutil.rmtree(registry.blob_path(art.parts[0].digest).parent)
    root = _root(tmp_path)
    pull = ["--root", str(root), "pull", image, "--plain-http", "--name", "six"]
    code, out, err = _run_cli(pull, monkeypatch, capsys)
    assert code == 5 and "is missing" in err, err
    [push] = _hint_commands(err.split("hint: ", 1)[1])
    code, out, err = _run_cli(shlex.split(push.replace("SNAPSHOT", str(pushed["snapshot"])))[1:], monkeypatch, capsys)
    assert code == 0, err
    assert _run_cli(pull, monkeypatch, capsys)[0] == 0


# --------------------------------------------------------------------------- oci:DIR from several processes

def test_two_processes_adding_many_tags_to_one_layout_keep_every_tag(tmp_path):
    lay = tmp_path / "a" / "b" / "layout"
    n = 150
    script = ("import sys, json\n"
              "from vllm_snapshot.fleet import transport\n"
              "lay = transport.Layout(sys.argv[1], create=True)\n"
              "for i in range(int(sys.argv[3])):\n"
              "    raw = json.dumps({'schemaVersion': 2, 'who': sys.argv[2], 'i': i}).encode()\n"
              "    lay.put_manifest(f'{sys.argv[2]}-{i}', raw)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(lay), who, str(n)],
                              cwd=Path(__file__).resolve().parent.parent) for who in ("one", "two")]
    assert [p.wait(300) for p in procs] == [0, 0]
    idx = json.loads((lay / "index.json").read_text())
    tags = {d["annotations"]["org.opencontainers.image.ref.name"] for d in idx["manifests"]}
    assert len(tags) == 2 * n and len(idx["manifests"]) == 2 * n
    for d in (tmp_path / "a", tmp_path / "a" / "b", lay, lay / "blobs", lay / "blobs" / "sha256"):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
    assert not [p for p in lay.iterdir() if p.name.startswith(".")]  # no temp file left


# --------------------------------------------------------------------------- smaller things

def test_a_stale_signature_names_the_tag_it_read_and_the_digest_it_names(tmp_path, model):
    snap = tmp_path / "snaps" / "six"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model)
    key, pub = _keypair(tmp_path, "k")
    lay = tmp_path / "layout"
    a = fleet.push(fleet.PushRequest(snapshot=snap, image=f"oci:{lay}:a", sign_key=key), Reporter(), Tools())
    make_snapshot(snap2 := tmp_path / "snaps" / "other", model)
    b = fleet.push(fleet.PushRequest(snapshot=snap2, image=f"oci:{lay}:b", sign_key=key), Reporter(), Tools())
    layout = transport.Layout(lay)
    raw, _ = layout.get_manifest(sign.sig_tag(b.digest))
    layout.put_manifest(sign.sig_tag(a.digest), raw)  # a's signature tag now holds b's signature
    with pytest.raises(sign.SignatureError) as e:
        fleet.pull(fleet.PullRequest(image=f"oci:{lay}:a", root=_root(tmp_path), verify_key=pub), Reporter(), Tools())
    msg = e.value.message
    assert sign.sig_tag(a.digest) in msg and b.digest in msg and "stale" in msg and e.value.exit_code == 13
    assert "--sign-key" in e.value.hint


@pytest.mark.parametrize("where", ["member", "subdir"])
def test_a_symlink_in_the_partial_dir_is_refused_naming_it_and_the_next_pull_starts_afresh(tmp_path, model, where):
    snap = tmp_path / "snaps" / "six"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model, pages_files=2)
    image = f"oci:{tmp_path / 'layout'}:v1"
    r = fleet.push(fleet.PushRequest(snapshot=snap, image=image), Reporter(), Tools())
    root = _root(tmp_path)
    left = partial.partial_dir(root, r.digest)
    for sub in ("images", "files", "carried", partial.MARKS):
        (left / sub).mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chmod(left, 0o700)
    victim = tmp_path / "victim"
    victim.mkdir()
    if where == "member":
        (left / "images" / "pages-1.img").symlink_to(victim / "x")
    else:
        shutil.rmtree(left / "images")
        (left / "images").symlink_to(victim)
    with pytest.raises(CorruptSnapshotError, match="symbolic link") as e:
        fleet.pull(fleet.PullRequest(image=image, root=root, name="six"), Reporter(), Tools())
    assert e.value.exit_code == 5 and str(left / "images") in e.value.message
    assert os.listdir(victim) == [] and not left.exists()
    fleet.pull(fleet.PullRequest(image=image, root=root, name="six"), Reporter(), Tools())
    _same(snap, root / "six")
