"""Stopping an engine that is busy (issue 29, S2), end to end (real engine + CRIU): ``stop``,
SIGTERM to a foreground restore and ``switch`` drain -- no new connection, the requests in
flight finish -- instead of aborting them and waiting 30 s for their connections; a drain
timeout shorter than the request bounds the stop and says so; two switches of one port run
one after the other and the second names what serves.

The long request: ``n`` completions of ``max_tokens`` each with ``ignore_eos`` (4 s on an idle
2-core box for n=96, max_tokens=500; n=192 fills 3/4 of the 64 MiB KV cache and takes ~8 s);
each test checks that it was still in flight when the stop's SIGTERM was sent, so a fast
machine cannot make a test pass without exercising the drain. Traffic
stays on loopback; every loop is bounded."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, cli, engine_env, started
from test_integration import free_port, port_accepts, wait_gone

pytestmark = pytest.mark.integration

N, MAX_TOKENS = 288, 500  # waves enough to outlast the stop on a quiet box (192 once ended first)


class LongRequest(threading.Thread):
    """One completion of N x MAX_TOKENS tokens on ``port``, in a thread; ``status`` (HTTP code,
    or the exception's name), ``body``, ``started``/``ended`` (monotonic seconds)."""

    def __init__(self, port: int, timeout: float = 120, n: int = N) -> None:
        super().__init__(daemon=True)
        self.port, self.timeout, self.n = port, timeout, n
        self.status: int | str | None = None
        self.body: dict | None = None
        self.started = self.ended = 0.0

    def run(self) -> None:
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": self.n}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        self.started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                self.status, self.body = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            self.status = e.code
        except Exception as e:  # noqa: BLE001 - an empty reply, a reset: what a cut request gets
            self.status = type(e).__name__
        finally:
            self.ended = time.monotonic()

    def complete(self) -> bool:
        """HTTP 200 with every completion at full length."""
        return (self.status == 200 and self.body is not None and len(self.body["choices"]) == self.n
                and self.body["usage"]["completion_tokens"] == self.n * MAX_TOKENS)


def _busy(port: int, **kw) -> LongRequest:
    """Start a long request and give the engine a second to take it."""
    r = LongRequest(port, **kw)
    r.start()
    time.sleep(1.0)
    assert r.is_alive(), f"the long request ended before the stop: {r.status}"
    return r


def _cleanup(port: int) -> None:
    """Stop what serves on ``port`` at once (a test that failed may leave it busy)."""
    if cli("stop", "--port", str(port), "--drain-timeout", "0", env=engine_env(), timeout=120).returncode == 2:
        cli("stop", "--port", str(port), env=engine_env(), timeout=120)  # the code before --drain-timeout


def _restore(snapshot, port: int, *extra: str) -> int:
    p = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", *extra, env=engine_env(),
            timeout=300, check=True)
    return json.loads(p.stdout)["pid"]


def test_stop_with_a_request_in_flight_lets_it_finish(clone_snapshot, tmp_path):
    """The request is a streamed completion whose client reads nothing until the stop's SIGTERM
    has closed the listener: it is in flight when the drain begins on any machine (a long plain
    request once ended first on a loaded CI box, where the stop took seconds to start). Then the
    client reads it all: the drain lets it finish. Meanwhile a prune of another run dir must not
    take the draining engine for a killed restore's leftover (CI: the other xdist worker's
    reclaim killed it so, the request cut)."""
    snap = clone_snapshot("drain-stop")
    port = free_port()
    pid = _restore(snap, port)
    try:
        client = _stalled_stream(port)
        time.sleep(2.0)  # the engine took it and filled the buffers
        stopping = started(subprocess.Popen(
            [sys.executable, "-m", "vllm_snapshot", "stop", "--port", str(port), "--json", "--drain-timeout", "300"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env(), cwd=ROOT))
        deadline = time.monotonic() + 120
        while port_accepts(port) and time.monotonic() < deadline:  # until the SIGTERM closed the listener
            time.sleep(0.05)
        assert not port_accepts(port), "the stop did not begin the drain within 120 s"
        other = tmp_path / "other-run"
        other.mkdir(mode=0o700)
        pr = cli("prune", "--json", env={**engine_env(), "VLLM_SNAPSHOT_RUN_DIR": str(other)}, timeout=60)
        got = _read_all(client, timeout=300)  # now the client reads: the request goes on to its end
        client.close()
        out, err = stopping.communicate(timeout=300)
        p = subprocess.CompletedProcess(stopping.args, stopping.returncode, out, err)
    finally:
        _cleanup(port)
    assert pr.returncode == 0 and f"orphaned engine tree PID {pid}" not in pr.stdout, pr.stdout + pr.stderr
    assert p.returncode == 0, p.stderr
    assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got, got[-300:]  # it went on to its end
    row = json.loads(p.stdout)["stopped"][0]
    assert row["pid"] == pid and row["drained"] and row["cut"] == 0 and not row["killed"]
    assert wait_gone(pid, 5) and not port_accepts(port)


def _stalled_stream(port: int) -> socket.socket:
    """A streamed completion whose client reads nothing yet (a receive buffer of 4 KiB): once
    the buffers between them are full the server waits for it, so the request stays in flight
    for as long as the test wants, on any machine. Returns the connected socket."""
    body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "n": N, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    return s


def _read_all(s: socket.socket, timeout: float = 30) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except OSError:  # a reset: cut too
        pass
    return out


def test_a_drain_timeout_shorter_than_the_request_bounds_the_stop(clone_snapshot):
    snap = clone_snapshot("drain-short")
    port = free_port()
    pid = _restore(snap, port)
    try:
        client = _stalled_stream(port)
        time.sleep(2.0)  # the engine took it and filled the buffers
        t0 = time.monotonic()
        p = cli("stop", "--port", str(port), "--drain-timeout", "0.5", env=engine_env(), timeout=120)
        took = time.monotonic() - t0
        got = _read_all(client)
        client.close()
    finally:
        _cleanup(port)
    assert p.returncode == 0, p.stderr
    assert "the 0.5 s drain ran out with 1 request(s) in flight: they were cut" in p.stdout, p.stdout
    assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got  # it began, and was cut
    assert took < 15, f"stop took {took:.1f} s with a 0.5 s drain"
    assert wait_gone(pid, 5)


def test_sigterm_to_a_foreground_restore_drains_and_exits_0(clone_snapshot):
    snap = clone_snapshot("drain-fg")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "restore", str(snap), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not port_accepts(port):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the foreground restore never served"
            time.sleep(0.2)
        time.sleep(0.5)  # past the canary
        req = _busy(port)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
        req.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, err[-3000:]
    assert req.ended > t0 and req.complete(), f"the request was cut: {req.status}"
    assert "draining" in err
    assert took < 20, f"the foreground restore took {took:.1f} s to stop"
    assert not port_accepts(port)


def test_switch_with_a_request_in_flight_does_not_cut_it(clone_snapshot):
    """The stop-then-restore switch (--no-handover): the old engine is told to stop at once and
    drains. (A hand-over's old engine serves through the restore: its long request in flight at
    the hand-over is tests/test_switch_integration.py's.)"""
    a, b = clone_snapshot("drain-sw-a"), clone_snapshot("drain-sw-b")
    port = free_port()
    # a request long enough to outlast what the switch does before it stops the old engine (its
    # start, validating b) on a quiet box -- and a drain long enough for it on a loaded one: a
    # 96k-token request ended first on a quiet CI run, and was cut by the 30 s drain under load 17
    # (3 x 192 sequences: more than the KV cache holds at once; vLLM schedules them in turn)
    old = _restore(a, port, "--drain-timeout", "240")
    try:
        req = _busy(port, timeout=300, n=3 * N)
        p = cli("switch", str(b), "--port", str(port), "--json", "--no-handover", env=engine_env(), timeout=300)
        t1 = time.monotonic()
        req.join(280)
        assert p.returncode == 0, p.stderr
        res = json.loads(p.stdout)
        new = res["pid"]
        # the old engine got its SIGTERM at least switch_s (its stop + the new restore) before
        # the switch returned
        assert req.ended > t1 - res["switch_s"], "the request had ended before the switch stopped the old engine"
        assert req.complete(), f"the switch cut the request: {req.status}"
        assert wait_gone(old, 5)
        st = json.loads(cli("status", "--json", env=engine_env(), check=True).stdout)["engines"]
        assert [(e["pid"], e["snapshot"]) for e in st if e["port"] == port] == [(new, str(b))]
        assert _complete_one(port)
    finally:
        _cleanup(port)


def _complete_one(port: int) -> bool:
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status == 200


def test_two_switches_of_one_port_run_one_after_the_other(clone_snapshot):
    """Before the port lock both read the same old engine, both stopped it, one restore lost the
    port to the other, its rollback too, and it said "nothing serves on port P now" while the
    winner's engine served."""
    import re

    a, b, c = clone_snapshot("sw2-a"), clone_snapshot("sw2-b"), clone_snapshot("sw2-c")
    port = free_port()
    first = _restore(a, port)
    env = engine_env()
    cmd = [sys.executable, "-m", "vllm_snapshot", "switch"]
    try:
        procs = [subprocess.Popen([*cmd, str(x), "--port", str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for x in (b, c)]
        outs = [p.communicate(timeout=600) for p in procs]
        st = json.loads(cli("status", "--json", env=env, check=True).stdout)["engines"]
        here = [(e["pid"], e["snapshot"]) for e in st if e["port"] == port]
        # serialized: both succeed, the one that waited replaced the other's engine
        assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
        served = [re.search(rf"switched port {port} to (\S+) \(engine PID (\d+)\)", o[0]) for o in outs]
        assert all(served), [o[0] for o in outs]
        waited = [i for i, o in enumerate(outs) if "it is switching port" in o[1]]
        assert len(waited) == 1, [o[1] for o in outs]
        later, earlier = served[waited[0]], served[1 - waited[0]]
        assert here == [(int(later.group(2)), later.group(1))]
        assert wait_gone(int(earlier.group(2)), 5) and wait_gone(first, 5)
        assert _complete_one(port)
    finally:
        _cleanup(port)
