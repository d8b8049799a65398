"""A restored engine's log appends (issue 29: a detached engine's --log-file was written from
offset 0 after a restore). Unit level: the log pipe carries O_APPEND (the flags CRIU dumps and
re-opens an inherited fd with), and :func:`supervisor.append_restored_log` fixes the log fd of
a tree restored from a snapshot made before. End to end: test_log_append_integration.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vllm_snapshot.supervise import supervisor


def _flags(pid: int, fd: int) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError("no flags line")


def test_the_engine_log_pipe_is_dumped_with_o_append():
    ch = supervisor.Channel.open()
    try:
        assert _flags(os.getpid(), ch.log_w) & os.O_APPEND
        assert not _flags(os.getpid(), ch.ctl_r) & os.O_APPEND  # only the log
    finally:
        ch.close()


@pytest.fixture()
def child_writing_to(tmp_path):
    """A process whose fd 1 is ``tmp_path/log`` opened without O_APPEND (what CRIU's re-open
    of the inherited log gave a tree dumped before the fix), and our O_APPEND fd of that file."""
    log = tmp_path / "log"
    log.write_bytes(b"previous run\n")
    procs = []

    def start(target: Path = log):
        fd = os.open(target, os.O_WRONLY)
        p = subprocess.Popen(["sleep", "60"], stdout=fd)
        os.close(fd)
        procs.append(p)
        ours = os.open(log, os.O_WRONLY | os.O_APPEND)
        return p, ours

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_append_restored_log_sets_o_append_on_the_engines_log_fd(child_writing_to):
    p, ours = child_writing_to()
    try:
        assert not _flags(p.pid, 1) & os.O_APPEND
        assert supervisor.append_restored_log(p.pid, ours) is True
        assert _flags(p.pid, 1) & os.O_APPEND
        assert supervisor.append_restored_log(p.pid, ours) is False  # already appending
    finally:
        os.close(ours)


def test_append_restored_log_leaves_a_foreground_pipe_and_another_file_alone(child_writing_to, tmp_path):
    other = tmp_path / "other"
    other.write_bytes(b"")
    p, ours = child_writing_to(other)  # its fd 1 is not the file we handed over
    r, w = os.pipe()
    try:
        assert supervisor.append_restored_log(p.pid, w) is False
        assert supervisor.append_restored_log(p.pid, ours) is False
        assert not _flags(p.pid, 1) & os.O_APPEND
    finally:
        for fd in (ours, r, w):
            os.close(fd)
