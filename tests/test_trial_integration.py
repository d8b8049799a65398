"""What a new-user trial found, end to end (real vLLM on CPU + real CRIU): a foreground engine
killed with `kill -9` was reported with no message (exit 137); SIGHUP to `restore -q` was
logged only as the engine's "SIGTERM: draining" (now: only as the command's "received SIGHUP"); a model folder vLLM cannot load gave a wall of
traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EAGER_ARGS, ROOT, TINY, cli, engine_env
from helpers import readable_by_engine
from test_integration import free_port, port_accepts, wait_gone

pytestmark = pytest.mark.integration


def _serve_foreground(snap: Path, port: int) -> tuple[subprocess.Popen, int]:
    """A foreground `restore -q` of ``snap`` on ``port``, serving; (the command, the engine PID)."""
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "restore", str(snap), "--port", str(port), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env(), cwd=ROOT)
    deadline = time.monotonic() + 300
    while not port_accepts(port):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the foreground restore never served"
        time.sleep(0.2)
    engines = json.loads(cli("status", "--json", check=True).stdout)["engines"]
    pid = next(e["pid"] for e in engines if e["port"] == port)
    return proc, pid


def test_an_engine_killed_under_a_foreground_restore_exits_8_naming_pid_signal_and_log(clone_snapshot):
    port = free_port()
    proc, pid = _serve_foreground(clone_snapshot("killed-fg"), port)
    try:
        time.sleep(0.5)  # past the canary
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 8, err[-3000:]
    assert "error [engine-failed]" in err and f"the engine (PID {pid})" in err, err[-3000:]
    assert "killed by SIGKILL (exit status 137)" in err and "journalctl" in err, err[-3000:]
    assert wait_gone(pid, 10) and not port_accepts(port)
    assert all(e["pid"] != pid for e in json.loads(cli("status", "--json", check=True).stdout)["engines"])


def test_sighup_to_a_quiet_foreground_restore_is_named_as_sighup(clone_snapshot):
    port = free_port()
    proc, pid = _serve_foreground(clone_snapshot("hup-fg"), port)
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, err[-3000:]
    assert "vllm-snapshot: received SIGHUP; stopping the engine (draining" in err, err[-3000:]
    assert "SIGTERM: draining" not in err, err[-3000:]  # one line for the signal: the one received
    assert wait_gone(pid, 10)


def test_create_with_a_bad_model_folder_says_why_in_a_few_lines(tmp_path, engine_tmp):
    # config.json `{}`: refused before the engine starts, in seconds
    bad = engine_tmp / "empty-config"
    shutil.copytree(TINY, bad)
    (bad / "config.json").write_text("{}")
    readable_by_engine(bad)
    t0 = time.monotonic()
    p = cli("create", str(bad), "--snapshot-dir", str(tmp_path / "a"), "--", *EAGER_ARGS)
    assert p.returncode == 2 and time.monotonic() - t0 < 20, p.stderr
    assert "names neither model_type nor architectures" in p.stderr and "check the model folder" in p.stderr
    # weights vLLM cannot read: the engine fails; its error in a few lines, the full log kept
    broken = engine_tmp / "broken-weights"
    shutil.copytree(TINY, broken)
    for w in broken.glob("*.safetensors"):
        w.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    readable_by_engine(broken)
    p = cli("create", str(broken), "--snapshot-dir", str(tmp_path / "b"), "--", *EAGER_ARGS)
    assert p.returncode == 8, p.stderr[-3000:]
    err = p.stderr[p.stderr.index("error [engine-failed]"):]
    message, hint = err.split("\nhint: ")
    assert message.startswith("error [engine-failed]: the engine failed while starting (loading the model): ")
    assert len(message.splitlines()) <= 5 and "File \"" not in message, err
    kept = Path(hint.split("the engine's full log: ")[1].split(";")[0])
    assert kept.is_file() and "Traceback" in kept.read_text(errors="replace"), hint
    assert f"check the model folder {broken}" in hint
    kept.unlink()
    assert not (tmp_path / "b").exists()
