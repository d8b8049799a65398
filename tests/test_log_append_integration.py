"""Issue 29: a detached engine's ``--log-file`` must be appended to after a restore, not
written from offset 0 (CRIU 4.2.1 restores the inherited log pipe by re-opening the fd it is
handed with the *dumped* flags: a new open file description at offset 0, without O_APPEND
unless the dumped pipe had it). Two restores onto one log file keep both runs' lines -- with a
real vLLM snapshot, and (fake engine) with a snapshot made the old way (log pipe without
O_APPEND), whose restored log fd the restore fixes itself (supervisor.append_restored_log)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from vllm_snapshot import ops
from vllm_snapshot.supervise import supervisor
from vllm_snapshot.report.progress import Reporter

from conftest import TINY, cli
from test_gpu_sequencing import fake_cuda, fake_tools  # noqa: F401 - fixtures
from test_integration import free_port

pytestmark = pytest.mark.integration
MARK = b"=== written between the two runs ===\n"


def _tree_log_flags(root_pid: int) -> dict[int, int]:
    """PID -> the flags of fd 1 (the log) of every process of the tree."""
    out = {}
    for p in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]:
        for line in Path(f"/proc/{p.pid}/fdinfo/1").read_text().splitlines():
            if line.startswith("flags:"):
                out[p.pid] = int(line.split()[1], 8)
    return out


def test_two_detached_restores_onto_one_log_file_keep_both_runs(snapshot, tmp_path):
    log = tmp_path / "engine.log"
    runs = []
    for run in (1, 2):
        port = free_port()
        r = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", "--log-file", str(log), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        pid = json.loads(r.stdout)["pid"]
        try:
            flags = _tree_log_flags(pid)
            assert flags and all(f & os.O_APPEND for f in flags.values()), flags
            from test_integration import post

            post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny-llama", "prompt": f"run {run}",
                                                             "max_tokens": 2})
        finally:
            cli("stop", "--port", str(port), check=True)
        runs.append(log.read_bytes())
        if run == 1:
            assert runs[0].strip(), "the first run logged nothing"
            with open(log, "ab") as f:
                f.write(MARK)
    first, both = runs
    assert both.startswith(first + MARK), "the second restore wrote over the first run's log"
    second = both[len(first + MARK):]
    assert second.strip(), "the second run logged nothing"
    # the same kind of lines from each run: the server started twice
    common = [ln for ln in first.splitlines() if b"Application startup complete" in ln]
    assert common and any(b"Application startup complete" in ln for ln in second.splitlines())


def _calls(log: Path) -> list[str]:
    return [ln.split()[1] for ln in log.read_text().splitlines() if ln.startswith("CALL ")]


@pytest.mark.parametrize("made_appending, restore_sets_append, runs_kept", [
    (True, False, 2),   # a snapshot made now: its dumped log pipe has O_APPEND, CRIU's re-open keeps it
    (False, True, 2),   # made before the fix: restore sets O_APPEND on the restored log fd itself
    (False, False, 1),  # control, the bug: the second run writes from offset 0 over the first
])
def test_two_restores_of_a_fake_engine_append_to_one_log(tmp_path, fake_tools, fake_cuda, monkeypatch,
                                                          made_appending, restore_sets_append, runs_kept):
    """Both halves of the fix on their own, through real CRIU with the protocol-speaking fake
    engine (it logs ``CALL <cmd>`` for each command: attach, wake, oracle, serve per restore)."""
    snap = tmp_path / "snap"
    with monkeypatch.context() as before_the_fix:
        if not made_appending:
            before_the_fix.setattr(supervisor, "_set_append", lambda fd: None)
        ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=2), Reporter(), tools=fake_tools)
    if not restore_sets_append:
        monkeypatch.setattr(supervisor, "append_restored_log", lambda pid, fd: False)
    log = tmp_path / "engine.log"
    for _ in range(2):
        (fake_cuda / "state").write_text("2")  # the fake driver's one process: checkpointed, as in the images
        r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=free_port(), detach=True, log_file=log),
                                Reporter(), tools=fake_tools)
        try:
            assert _calls(log)[-1] == "serve"
        finally:
            engine.kill(grace=5)
            engine.close()
            fake_tools.runtime.unregister(r.pid)
    assert _calls(log) == ["attach", "wake", "oracle", "serve"] * runs_kept
