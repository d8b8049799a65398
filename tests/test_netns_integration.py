"""Every engine in its own network namespace, end to end (real vLLM + CRIU): clones of one
snapshot at once, one stopped while the others serve, two snapshots with the same recorded
loopback ports, --host ::1 and --host 127.0.0.2, offline create. Traffic stays on this host's
loopback addresses. Replaces the test that refused a second concurrent restore (exit 9):
such restores now run side by side."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import psutil
import pytest

from vllm_snapshot.store import manifest as mf
from vllm_snapshot.checkpoint.inventory import read_tcp_table

from conftest import ROOT, cli, engine_env
from test_integration import free_port, post, wait_gone

pytestmark = pytest.mark.integration

HOST_NS = os.readlink("/proc/self/ns/net")


def accepts(host: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def restore_many(snapshots: list, ports: list[int], host: str = "127.0.0.1") -> list[dict]:
    """Start one detached restore per (snapshot, port) at the same time; their JSON results
    (asserts each succeeded)."""
    procs = [subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "restore", str(s), "--host", host,
                               "--port", str(p), "--detach", "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=engine_env(), cwd=ROOT)
             for s, p in zip(snapshots, ports)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out) for out, _ in outs]


def completion(host: str, port: int) -> dict:
    h = f"[{host}]" if ":" in host else host
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0.0,
            "logprobs": 2, "seed": 0}
    c = post(f"http://{h}:{port}/v1/completions", body)["choices"][0]
    lps = c["logprobs"]["token_logprobs"]
    assert len(lps) == 3, c  # three tokens generated (their text may be partial bytes: '')
    return {"text": c["text"], "logprobs": lps}


def listening_ports(pid: int) -> set[int]:
    """Ports listening in the network namespace of ``pid``."""
    return {e.local[1] for e in read_tcp_table(pid) if e.state == 10}


def stop_all(results: list[dict]) -> None:
    """Stop the restored engines and assert that every process of their trees is gone (only
    ours: other engines may run on this host meanwhile)."""
    procs = []
    for r in results:
        try:
            root = psutil.Process(r["pid"])
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        cli("stop", "--pid", str(r["pid"]), timeout=120)
    _gone, alive = psutil.wait_procs(procs, timeout=15)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes of stopped engines still run: {alive}"


def test_two_clones_of_one_snapshot_at_once(snapshot):
    """Two restores of one snapshot at the same time on two ports: both validated, both serve
    the same greedy answer; each tree has its own namespace with the recorded loopback
    listeners, none of which is in the host's."""
    m = mf.read(snapshot)
    assert m.engine.network == "isolated" and len(m.criu.listeners) > 0
    ports = [free_port(), free_port()]
    rs = restore_many([snapshot, snapshot], ports)
    try:
        assert [r["oracle"] for r in rs] == ["match", "match"]
        namespaces = {os.readlink(f"/proc/{r['pid']}/ns/net") for r in rs}
        assert len(namespaces) == 2 and HOST_NS not in namespaces
        recorded = {p for _a, p in m.criu.listeners}
        for r in rs:
            assert recorded <= listening_ports(r["pid"])  # restored inside its own namespace
        assert not recorded & listening_ports(os.getpid())  # and not in the host's
        a, b = (completion("127.0.0.1", p) for p in ports)
        assert a == b
    finally:
        stop_all(rs)


def test_three_clones_one_stopped_the_others_keep_serving(snapshot):
    ports = [free_port() for _ in range(3)]
    rs = restore_many([snapshot] * 3, ports)
    try:
        st = json.loads(cli("status", "--json", check=True).stdout)["engines"]
        mine = {e["pid"]: e for e in st if e["pid"] in {r["pid"] for r in rs}}
        assert sorted(e["port"] for e in mine.values()) == sorted(ports)
        d = cli("delete", str(snapshot), timeout=60)  # refused while any clone runs
        assert d.returncode == 9 and all(str(r["pid"]) in d.stderr for r in rs)
        s = json.loads(cli("stop", "--pid", str(rs[1]["pid"]), "--json", timeout=120, check=True).stdout)
        assert [x["pid"] for x in s["stopped"]] == [rs[1]["pid"]] and wait_gone(rs[1]["pid"], 5)
        assert not accepts("127.0.0.1", ports[1])
        for i in (0, 2):
            completion("127.0.0.1", ports[i])
        st = json.loads(cli("status", "--json", check=True).stdout)["engines"]
        assert {r["pid"] for r in rs} & {e["pid"] for e in st} == {rs[0]["pid"], rs[2]["pid"]}
    finally:
        stop_all(rs)
    assert snapshot.exists()


def test_two_snapshots_with_the_same_recorded_loopback_ports_both_serve(snapshot, clone_snapshot):
    """A copy of the snapshot is another snapshot whose trees listened on exactly the same
    loopback ports: in the host's namespace they could not both run; now they can."""
    other = clone_snapshot("same-ports")
    assert mf.read(other).criu.listeners == mf.read(snapshot).criu.listeners
    ports = [free_port(), free_port()]
    rs = restore_many([snapshot, other], ports)
    try:
        assert {r["snapshot"] for r in rs} == {str(snapshot), str(other)}
        assert completion("127.0.0.1", ports[0]) == completion("127.0.0.1", ports[1])
    finally:
        stop_all(rs)


def _v6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_ipv6_loopback_serves(snapshot):
    if not _v6_loopback():  # an environment fact, never a silent pass
        pytest.fail("::1 cannot be bound on this host: IPv6 loopback is disabled")
    port = free_port()
    (r,) = restore_many([snapshot], [port], host="::1")
    try:
        assert r["url"] == f"http://[::1]:{port}"
        completion("::1", port)
        assert not accepts("127.0.0.1", port)
    finally:
        stop_all([r])


def test_another_loopback_address_serves_there_only(snapshot):
    port = free_port()
    (r,) = restore_many([snapshot], [port], host="127.0.0.2")
    try:
        assert r["url"] == f"http://127.0.0.2:{port}"
        completion("127.0.0.2", port)
        assert not accepts("127.0.0.1", port)
        # the same port on 127.0.0.1 is free for another clone
        (r2,) = restore_many([snapshot], [port], host="127.0.0.1")
        try:
            assert completion("127.0.0.1", port) == completion("127.0.0.2", port)
        finally:
            stop_all([r2])
        # and taken on 127.0.0.2: refused before CRIU, naming the engine that holds it
        p = cli("restore", str(snapshot), "--host", "127.0.0.2", "--port", str(port), timeout=120)
        assert p.returncode == 9 and f"127.0.0.2:{port} is not free" in p.stderr
        assert f"PID {r['pid']}" in p.stderr and "CRIU restore" not in p.stderr
    finally:
        stop_all([r])


def test_create_was_offline_and_the_images_hold_only_loopback(snapshot):
    """The engine at create had a network namespace with only lo: the manifest says so, and
    CRIU's image of that namespace lists one device, lo, with no route out."""
    import pycriu

    m = mf.read(snapshot)
    assert m.engine.network == "isolated"
    assert m.criu.dump_argv[-2:] == ("--network-lock", "skip")
    assert all(a in ("127.0.0.1", "::1") for a, _p in m.criu.listeners)
    images = snapshot / "images"
    names = [x.name for x in images.iterdir()]
    (netdev,) = [n for n in names if n.startswith("netdev-")]
    raw = (images / netdev).read_bytes()
    if (images / netdev).suffix == ".zst":  # a compressed snapshot stores NAME.zst
        import zstandard

        raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 24)
    import io

    devs = pycriu.images.load(io.BytesIO(raw))["entries"]
    assert [d["name"] for d in devs] == ["lo"]
