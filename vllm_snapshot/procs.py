"""Process-tree helpers shared by the supervisor, inventory, registry and operations (one
walk, one way to set the parent-death signal)."""

from __future__ import annotations

import ctypes

import psutil

PR_SET_PDEATHSIG = 1


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (host PIDs), root first; empty when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def command(p: psutil.Process, limit: int = 200) -> str:
    """A process's command line with whitespace squeezed (``"?"`` when unreadable)."""
    try:
        cmd = " ".join(" ".join(p.cmdline()).split()) or p.name()
    except (psutil.Error, OSError):
        cmd = "?"
    return cmd[:limit]


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` seconds for ``procs`` to exit; return the PIDs still alive."""
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive]


def set_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) for the calling thread's process (0 clears it)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
