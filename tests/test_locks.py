"""locks: the per-GPU lock (review gpu-path-2 M6) between real processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_snapshot.store import locks
from vllm_snapshot.errors import BusyError


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


def test_a_second_restore_onto_one_gpu_waits_naming_the_holder(run_dir):
    """Another process holds GPU-a: a restore onto GPU-a is told who holds it and refused after
    its wait; one onto GPU-b goes ahead. The lock file survives the stale-lock cleanup."""
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from vllm_snapshot.store import locks
            with locks.gpu_lock("GPU-a"):
                print("held", flush=True)
                sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={"VLLM_SNAPSHOT_RUN_DIR": str(run_dir), "PATH": "/usr/bin:/bin",
             "PYTHONPATH": ":".join(p for p in sys.path if p)})
    try:
        assert holder.stdout.readline().strip() == "held"
        heard: list[str] = []
        with pytest.raises(BusyError, match=f"GPU GPU-a is in use by {holder.pid}"):
            with locks.gpu_lock("GPU-a", heard.append, wait_s=0.3):
                pass
        assert len(heard) == 1 and f"waiting for {holder.pid}" in heard[0] and "GPU-a" in heard[0]
        with locks.gpu_lock("GPU-b", heard.append, wait_s=0):
            pass
        assert len(heard) == 1
        assert locks.clean_stale() == []  # not a snapshot path: kept
    finally:
        holder.stdin.close()
        holder.wait(10)
    with locks.gpu_lock("GPU-a", wait_s=0):  # released with its holder
        pass
