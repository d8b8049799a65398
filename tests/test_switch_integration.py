"""Time-sharing without outages and the store's edges, end to end (real engine + CRIU):
switch to a bad target keeps the old engine serving; a switch hands the port over with no
refused connection and no failed request; a switch whose restore fails after the old engine
stopped (no hand-over) rolls the old snapshot back; a snapshot on a read-only mount restores; delete through a symlinked root
refuses while the engine runs; faster stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from conftest import ROOT, cli, engine_env, staging_left
from test_integration import free_port, port_accepts, post, wait_gone
from test_integration_more import _break_link

pytestmark = pytest.mark.integration


def _status(env) -> list[dict]:
    return json.loads(cli("status", "--json", env=env, check=True).stdout)["engines"]


def _complete(port: int, host: str = "127.0.0.1") -> str:
    h = f"[{host}]" if ":" in host else host
    return post(f"http://{h}:{port}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1})["choices"][0]["text"]


def _greedy(port: int, host: str = "127.0.0.1") -> tuple:
    """A greedy 3-token completion's text and token logprobs (the same engine state answers the same)."""
    h = f"[{host}]" if ":" in host else host
    c = post(f"http://{h}:{port}/v1/completions", {"model": "tiny-llama", "prompt": "Once upon a time",
                                                   "max_tokens": 3, "temperature": 0, "logprobs": 1})["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def test_switch_bad_target_keeps_serving_and_failed_restore_rolls_back(clone_snapshot, tmp_path):
    from vllm_snapshot.store import manifest as mf

    a = clone_snapshot("sw-a")
    corrupt = clone_snapshot("sw-corrupt")
    # a flipped byte in an image: found by the hand-over's restore (its checksums, before the
    # socket is handed over), the old engine untouched
    pages = max((corrupt / "images").glob("pages-*"), key=lambda x: x.stat().st_size)
    _break_link(pages)
    raw = bytearray(pages.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pages.write_bytes(bytes(raw))
    # a recorded oracle the engine will not reproduce: passes every check before CRIU, fails
    # after the old engine was stopped -> rollback
    wrong = clone_snapshot("sw-wrong")
    m = mf.read(wrong)
    mf.write_atomic(mf.seal(m.model_copy(update={"oracle": m.oracle.model_copy(
        update={"token_id": m.oracle.token_id + 1})})), wrong)
    env = engine_env()
    port = free_port()
    r = json.loads(cli("restore", str(a), "--host", "::1", "--port", str(port), "--detach", "--json",
                       env=env, timeout=300, check=True).stdout)
    try:
        # 1. a typo, 2. a corrupt image: refused before anything is stopped
        for target, code in ((tmp_path / "nope", 2), (corrupt, 5)):
            p = cli("switch", str(target), "--port", str(port), "--json", env=env, timeout=300)
            assert p.returncode == code, p.stderr
            assert [e["pid"] for e in _status(env) if e["port"] == port] == [r["pid"]]
            assert _complete(port, "::1") is not None
        # 3. the target fails its oracle: a hand-over restores and checks it while the old engine
        # serves: nothing changes (same engine, same answer) and the error says so
        before = _greedy(port, "::1")
        p = cli("switch", str(wrong), "--port", str(port), "--json", env=env, timeout=300)
        assert p.returncode == 6, p.stderr
        err = json.loads(p.stdout)["error"]
        assert f"was not touched: it still serves http://[::1]:{port}" in err["message"], err["message"]
        assert err["details"]["stopped"] == [] and err["details"]["serving"]["pid"] == r["pid"]
        assert [e["pid"] for e in _status(env) if e["port"] == port] == [r["pid"]]
        assert _greedy(port, "::1") == before
        # 4. the same target on another address: no hand-over (the old engine stops first), the
        # target fails after the old engine was stopped: rolled back, and said so
        p = cli("switch", str(wrong), "--port", str(port), "--host", "::", "--json", env=env, timeout=300)
        assert p.returncode == 6, p.stderr
        assert "(no hand-over: the new engine is to listen on ::, the old one listens on ::1)" in \
            json.loads(p.stdout)["error"]["message"], p.stdout
        err = json.loads(p.stdout)["error"]
        assert "rolled back" in err["message"] and err["details"]["stopped"][0]["pid"] == r["pid"]
        serving = err["details"]["serving"]
        assert serving["url"] == f"http://[::1]:{port}" and serving["snapshot"] == str(a)
        assert wait_gone(r["pid"], 5)
        assert [(e["pid"], e["host"]) for e in _status(env) if e["port"] == port] == [(serving["pid"], "::1")]
        assert _complete(port, "::1") is not None
        # 5. switching to what already serves there is a no-op
        p = json.loads(cli("switch", str(a), "--port", str(port), "--json", env=env, timeout=120, check=True).stdout)
        assert p["pid"] == serving["pid"] and p["switch_s"] == 0.0
    finally:
        cli("stop", "--port", str(port), env=env, timeout=120)
    assert not port_accepts(port)


@pytest.fixture()
def ro_mount(tmp_path):
    mounted = []

    def make(src: Path) -> Path:
        dst = tmp_path / "ro"
        dst.mkdir(mode=0o700)
        subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
        mounted.append(dst)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True)
        return dst

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_snapshot_on_a_read_only_mount_restores(clone_snapshot, ro_mount):
    src = clone_snapshot("rostore")
    ro = ro_mount(src.parent)
    snap = ro / src.name
    env = engine_env()
    port = free_port()
    p = cli("restore", str(snap), "--port", str(port), "--detach", "--json", env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    pid = json.loads(p.stdout)["pid"]
    try:
        assert _complete(port) is not None
    finally:
        s = cli("stop", "--port", str(port), "--json", env=env, timeout=120, check=True)
    assert json.loads(s.stdout)["stopped"][0]["pid"] == pid
    assert staging_left() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_delete_through_a_symlinked_root_refuses_while_serving(clone_snapshot, tmp_path):
    snap = clone_snapshot("symdel")
    link = tmp_path.parent / f"{tmp_path.name}-link"
    link.symlink_to(snap.parent)
    env = engine_env()
    port = free_port()
    r = json.loads(cli("restore", str(snap), "--port", str(port), "--detach", "--json", env=env, timeout=300,
                       check=True).stdout)
    try:
        d = cli("delete", str(link / snap.name), env=env, timeout=60)
        assert d.returncode == 9 and str(r["pid"]) in d.stderr
        assert snap.exists()
        st = json.loads(cli("stop", str(link / snap.name), "--json", env=env, timeout=120, check=True).stdout)
        assert [s["pid"] for s in st["stopped"]] == [r["pid"]]
    finally:
        cli("stop", "--port", str(port), env=env, timeout=60)
        link.unlink()


def test_switch_keeps_the_front_end_options_of_the_engine_it_replaces(snapshot, clone_snapshot):
    """A trial: `switch` kept the API key and TLS but silently dropped --allowed-origins: the new
    engine answered the browser app's CORS preflight with vLLM's default ("*"). The registry
    records the options an engine was restored with (the key left out, which switch needs
    again); switch carries them over."""
    from test_integration_more import _request
    from vllm_snapshot import paths

    b = clone_snapshot("sw-cors")
    key = "sk-" + os.urandom(12).hex()
    env = {**engine_env(), "VLLM_API_KEY": key}
    port = free_port()
    origin = "https://app.example"
    r = json.loads(cli("restore", str(snapshot), "--port", str(port), "--detach", "--json",
                       "--allowed-origins", json.dumps([origin]), "--root-path", "/api",
                       env=env, timeout=300, check=True).stdout)
    base = f"http://127.0.0.1:{port}"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "GET"}
    try:
        assert _request(f"{base}/v1/models", method="OPTIONS", headers=preflight)[1].get(
            "access-control-allow-origin") == origin
        p = cli("switch", str(b), "--port", str(port), env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        new = [e for e in _status(env) if e["port"] == port]
        assert [e["snapshot"] for e in new] == [str(b)] and new[0]["pid"] != r["pid"]
        status, headers = _request(f"{base}/v1/models", method="OPTIONS", headers=preflight)
        assert status == 200 and headers.get("access-control-allow-origin") == origin, headers
        assert (f"keeping the front-end options of the engine on port {port}: --allowed-origins, --root-path"
                in p.stderr), p.stderr
        assert _request(f"{base}/v1/models")[0] == 401 and _request(f"{base}/v1/models", key)[0] == 200
        # the key the switch was given is on no file of the registry (nor of the state dir)
        for d in (paths.run_dir(), paths.state_dir()):
            for f in d.rglob("*") if d.exists() else []:
                if f.is_file():
                    assert key.encode() not in f.read_bytes(), f"key in {f}"
    finally:
        cli("stop", "--port", str(port), env=env, timeout=120)
    assert not port_accepts(port)


def _hammer(port: int, stop: threading.Event, out: list, pause_s: float = 0.02) -> None:
    """POST one-token completions to ``port`` back to back until ``stop``; each outcome into
    ``out`` as (start, end, error or None): a refused or reset connection, a timeout or a
    non-200 answer is an error."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            _complete(port)
            out.append((t0, time.monotonic(), None))
        except (OSError, urllib.error.URLError, ValueError, KeyError) as e:  # HTTPError is a URLError
            out.append((t0, time.monotonic(), f"{type(e).__name__}: {e}"))
        time.sleep(pause_s)


def test_switch_hands_over_with_no_refused_connection_and_no_failed_request(clone_snapshot):
    """Issue 32, target 4: while a client hammers the port and a long request runs on the old
    engine, `switch` restores the new engine beside it, hands it the old engine's own listening
    socket, then drains the old one: no connection is refused, no request fails, the long
    request (accepted by the old engine) completes, the answers stay the same."""
    a, b = clone_snapshot("ho-a"), clone_snapshot("ho-b")
    env = engine_env()
    port = free_port()
    r = json.loads(cli("restore", str(a), "--port", str(port), "--detach", "--json",
                       env=env, timeout=300, check=True).stdout)
    results: list = []
    stop = threading.Event()

    longs: list[dict] = []
    handed = threading.Event()

    def long_requests() -> None:
        # back to back until the old engine has been told to stop, so that one of them is in
        # flight then (one takes ~0.7 s on this CPU: too short to aim a single one)
        while True:
            x = {"t0": time.monotonic()}
            try:
                x["text"] = post(f"http://127.0.0.1:{port}/v1/completions",
                                 {"model": "tiny-llama", "prompt": "Once", "max_tokens": 480, "ignore_eos": True},
                                 timeout=120)["choices"][0]["text"]
            except (OSError, urllib.error.URLError) as e:
                x["error"] = f"{type(e).__name__}: {e}"
            x["t1"] = time.monotonic()
            longs.append(x)
            if handed.is_set() or "error" in x or len(longs) > 300:
                return

    try:
        before = _greedy(port)
        hammer = threading.Thread(target=_hammer, args=(port, stop, results), daemon=True)
        hammer.start()
        p = cli("switch", str(b), "--port", str(port), "--json", env=env, timeout=300)
        # the long request starts once the switch's own work is under way: it goes to whichever
        # engine accepts it; in flight when the old one is told to stop, it must finish anyway
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        stop.set()
        hammer.join(60)
        assert out["handover"] is True and out["fallback"] == "" and out["stopped"] == [r["pid"]], out
        failed = [x for x in results if x[2] is not None]
        assert not failed, failed[:5]
        assert len(results) > 20, len(results)
        assert wait_gone(r["pid"], 30)
        assert [e["pid"] for e in _status(env) if e["port"] == port] == [out["pid"]]
        assert _greedy(port) == before
        # a long request the old engine accepted right before the hand-over completes: sent when
        # the switch checks the new engine's code identity, its last check before the hand-over
        # (the old engine alone accepts then)
        c = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "switch", str(a), "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        t = threading.Thread(target=long_requests)
        err_lines = []
        handed_at = None
        for line in c.stderr:
            err_lines.append(line)
            if "checking the Python files the engine imports from ..." in line and not t.is_alive():
                t.start()
            if "accepts no more and drains" in line and handed_at is None:
                handed_at = time.monotonic()
                handed.set()
        out_text = c.stdout.read()
        assert c.wait(300) == 0, "".join(err_lines)[-3000:]
        assert "by hand-over" in out_text, out_text
        t.join(150)
        assert handed_at is not None and longs, (handed_at, longs)
        assert all("error" not in x and len(x.get("text", "")) > 0 for x in longs), longs
        # one was in flight when the old engine was told to stop, and it completed
        assert [x for x in longs if x["t0"] < handed_at < x["t1"]], (handed_at, [(x["t0"], x["t1"]) for x in longs])
    finally:
        stop.set()
        cli("stop", "--port", str(port), env=env, timeout=120)
    assert not port_accepts(port)
