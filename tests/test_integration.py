"""End to end with a real vLLM CPU engine and real CRIU (marker ``integration``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from vllm_snapshot.engine.protocol import PROGRAMS
from vllm_snapshot.store import manifest as mf

from conftest import ENGINE_ARGS, ROOT, TINY, cli, engine_env, owned_by_this_run, staging_left

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_pids(settle_s: float = 0.0, baseline: set[int] | None = None) -> set[int]:
    """PIDs of this run's engine roots (ours, or tests/fake_engine.py and its child, whose code
    names its ``fakecuda-rst`` thread) and vLLM engine processes that are still running
    (zombies waiting for their reaper are not running): :func:`conftest.owned_by_this_run`, so
    an engine of a service or of another test run on this host is not counted. With
    ``baseline``, waits up to ``settle_s`` seconds for the processes not in it to disappear."""
    deadline = time.monotonic() + settle_s
    while True:
        out = set()
        for p in psutil.process_iter(["cmdline", "name", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(p.info["cmdline"] or [])
                if (any(prog in cmd for prog in PROGRAMS) or "fake_engine.py" in cmd or "fakecuda-rst" in cmd
                        or (p.info["name"] or "").startswith("VLLM::")) and owned_by_this_run(p):
                    out.add(p.pid)
            except psutil.Error:
                continue
        if baseline is None or not (out - baseline) or time.monotonic() >= deadline:
            return out
        time.sleep(0.2)


def post(url: str, body: dict, timeout: float = 30) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def port_accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_gone(pid: int, timeout: float = 30) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid, 60), f"engine {pid} did not stop on SIGTERM"


def test_inspect_json(snapshot):
    p = cli("inspect", str(snapshot), "--json", check=True)
    doc = json.loads(p.stdout)
    m = doc["manifest"]
    assert doc["schema_version"] == 1
    assert m["engine"]["kind"] == "cpu" and m["engine"]["full_state_captured"] is True
    assert m["sizes"]["raw"] > 100 << 20
    assert m["model"]["files"] and all(len(f["blake3"]) == 64 for f in m["model"]["files"])
    assert m["host"]["vllm"] == "0.32.0"
    assert {"engine_start", "dump", "pack"} <= set(m["timings"])
    assert m["criu"]["pid_namespace"] is True and len(m["criu"]["tree_pids"]) >= 3
    # human table too
    t = cli("inspect", str(snapshot), check=True)
    assert "oracle" in t.stdout and "phase timings" in t.stdout


def test_snapshot_is_private(snapshot):
    for dirpath, dirs, files in os.walk(snapshot):
        assert os.stat(dirpath).st_mode & 0o077 == 0, dirpath
        for f in files:
            assert os.stat(os.path.join(dirpath, f)).st_mode & 0o077 == 0, f


def test_restore_detached_serves_openai_api(snapshot):
    before = engine_pids()
    port = free_port()
    p = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", timeout=300, check=True)
    res = json.loads(p.stdout)
    pid = res["pid"]
    try:
        assert res["oracle"] == "match"
        base = f"http://127.0.0.1:{port}"
        assert get(f"{base}/health")[0] == 200
        models = json.loads(get(f"{base}/v1/models")[1])
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        m = mf.read(snapshot)
        out = post(f"{base}/v1/completions", {"model": "tiny-llama", "prompt": m.oracle.prompt,
                                              "max_tokens": 1, "temperature": 0, "logprobs": 1})
        assert out["choices"][0]["text"] == m.oracle.text
        assert abs(out["choices"][0]["logprobs"]["token_logprobs"][0] - m.oracle.logprob) < 1e-3
        longer = post(f"{base}/v1/completions", {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8})
        assert longer["usage"]["completion_tokens"] == 8
    finally:
        stop(pid)
    assert not port_accepts(port)
    assert engine_pids(10, before) - before == set()


def test_ten_restores_in_a_row_foreground(snapshot):
    """Ten foreground restores of one snapshot, each serving after a matching oracle and
    stopped with SIGTERM to the supervisor; exit code 0 each time."""
    for i in range(10):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "restore", str(snapshot), "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env(), cwd=ROOT)
        try:
            deadline = time.monotonic() + 240
            ok = False
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    # /health alone can answer before the canary; a served completion proves serving
                    post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1}, timeout=5)
                    ok = True
                    break
                except OSError:
                    time.sleep(0.2)
            if not ok:
                proc.kill()
                _out, err = proc.communicate()
                raise AssertionError(f"restore #{i + 1} never served: rc={proc.returncode}\n{err[-4000:]}")
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, f"restore #{i + 1} exited {proc.returncode}\n{err[-3000:]}"
        assert "oracle" in err  # the phase lines and the engine log reach stderr
        assert not port_accepts(port)


def test_oracle_mismatch_fails_closed(clone_snapshot):
    """A snapshot whose recorded oracle differs from what the restored engine computes: the
    engine is restored by CRIU, replays the oracle, the supervisor refuses, kills the tree,
    never binds the port, and leaves the snapshot unchanged."""
    snap = clone_snapshot("mismatch")
    m = mf.read(snap)
    wrong = m.oracle.model_copy(update={"token_id": m.oracle.token_id + 1})
    mf.write_atomic(mf.seal(m.model_copy(update={"oracle": wrong})), snap)
    before_manifest = (snap / "manifest.json").read_bytes()
    before = engine_pids()
    port = free_port()
    seen_listening = threading.Event()
    done = threading.Event()

    def watch():
        while not done.is_set():
            if port_accepts(port):
                seen_listening.set()
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    p = cli("restore", str(snap), "--port", str(port), timeout=300)
    done.set()
    t.join()
    assert p.returncode == 6, p.stderr[-3000:]
    assert "token_id: expected" in p.stderr
    assert "CRIU restore: done" in p.stderr  # the mismatch was found in a really restored engine
    assert not seen_listening.is_set(), "the port was bound although the oracle did not match"
    time.sleep(1)
    assert engine_pids(10, before) - before == set(), "restored processes were left running"
    assert (snap / "manifest.json").read_bytes() == before_manifest
    assert staging_left(snap.parent) == []


def test_port_in_use_refused_before_criu(snapshot):
    before = engine_pids()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        p = cli("restore", str(snapshot), "--port", str(port), timeout=120)
        elapsed = time.monotonic() - t0
    assert p.returncode == 9, p.stderr
    assert f"port 127.0.0.1:{port} is not free" in p.stderr
    assert f"PID {os.getpid()}" in p.stderr  # names the holder
    assert "CRIU restore" not in p.stderr
    assert engine_pids(10, before) - before == set()
    assert elapsed < 60


def test_create_refuses_existing_dir(snapshot):
    p = cli("create", str(TINY), "--snapshot-dir", str(snapshot), timeout=60)
    assert p.returncode == 2
    assert "already exists" in p.stderr


def test_create_bad_engine_args_publishes_nothing(snap_root):
    before = engine_pids()
    target = snap_root / "bad-args"
    p = cli("create", str(TINY), "--snapshot-dir", str(target), "--", "--kv-cache-memory-bytes", "64M",
            "--dtype", "no-such-dtype", timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "invalid engine arguments" in p.stderr and "no-such-dtype" in p.stderr  # vLLM's reason
    assert not target.exists()
    assert not list(snap_root.glob(".bad-args.tmp-*"))
    assert engine_pids(10, before) - before == set()


def test_create_refuses_an_api_key_before_the_snapshot_exists(snap_root):
    """A key at create would sit in the images: refused before the engine starts, pointing to
    restore (which applies it when the server starts); nothing published."""
    before = engine_pids()
    target = snap_root / "with-key"
    p = cli("create", str(TINY), "--snapshot-dir", str(target), "--", *ENGINE_ARGS, "--api-key", "sk-planted",
            timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "--api-key" in p.stderr and "vllm-snapshot restore NAME --api-key" in p.stderr
    assert "sk-planted" not in p.stderr
    assert not target.exists() and not list(snap_root.glob(".with-key.tmp-*"))
    assert engine_pids(10, before) - before == set()


@pytest.mark.parametrize("extra,words", [
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "--speculative-config"),
    (["--logprobs-mode", "processed_logits"], "--logprobs-mode"),
    (["--prefill-context-parallel-size", "2"], "--prefill-context-parallel-size 2"),
    (["--decode-context-parallel-size", "2"], "--decode-context-parallel-size 2"),
    (["--ssl-keyfile", "/k.pem", "--ssl-certfile", "/c.pem"], "TLS"),
    (["--middleware", "x.y"], "--middleware"),
])
def test_vllm_parser_refuses_unrestorable_settings(extra, words):
    """The engine's own parse (vLLM's parser + our refusals), as create runs it before the
    model loads."""
    from vllm_snapshot.entrypoints.engine_root import parse_engine_args

    with pytest.raises(ValueError, match=words.replace("-", "\\-").replace("(", "\\(")):
        parse_engine_args(str(TINY), ["--dtype", "float32", *extra])
