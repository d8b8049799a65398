"""Process-tree helpers shared by the supervisor, inventory, registry and operations (one
walk, one way to set the parent-death signal)."""

from __future__ import annotations

import ctypes
import os
import time

import psutil

PR_SET_PDEATHSIG = 1


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (host PIDs), root first; empty when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` has open (``socket:[N]`` links of its fds); empty
    when it is gone or its fds cannot be read."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def ns_pids(pid: int, proc: str = "/proc") -> list[int]:
    """The ``NSpid`` field of ``/proc/PID/status``: ``pid`` as each PID namespace from ours
    inwards names it (one entry when it is in ours only). Empty when the process is gone or the
    line is missing."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return []
    return []


def ns_pid(pid: int, proc: str = "/proc") -> int | None:
    """``pid`` (a PID of our namespace) as its own innermost PID namespace names it: the last
    field of ``NSpid`` (:func:`ns_pids`; the PID CRIU's images record for a tree in a PID
    namespace of its own). None when the process is gone or the line is missing."""
    pids = ns_pids(pid, proc)
    return pids[-1] if pids else None


def command(p: psutil.Process, limit: int = 200) -> str:
    """A process's command line with whitespace squeezed (``"?"`` when unreadable). This exact
    form is recorded in manifests (``criu.tree_commands``) and compared at restore: messages
    use :func:`brief` instead."""
    try:
        cmd = " ".join(" ".join(p.cmdline()).split()) or p.name()
    except (psutil.Error, OSError):
        cmd = "?"
    return cmd[:limit]


def brief(argv: list[str]) -> str:
    """A command line as an operator reads it: an interpreter running a script is named by the
    script (``vllm-snapshot --root /r restore x``, not ``/long/venv/bin/python3.11
    /long/venv/bin/vllm-snapshot ...``, whose first 120 characters held no subcommand), and a
    vllm-snapshot engine root (``python -m vllm_snapshot.engine.main {JSON}``) as
    ``vllm-snapshot engine (model M)``. Whitespace squeezed. Pure."""
    import json

    args = [" ".join(a.split()) for a in argv]
    if "vllm_snapshot.engine.main" in args:
        i = args.index("vllm_snapshot.engine.main")
        try:
            model = json.loads(argv[i + 1]).get("model", "?")
        except (IndexError, ValueError, AttributeError):
            model = "?"
        return f"vllm-snapshot engine (model {model})"
    if len(args) > 1 and os.path.basename(args[0]).startswith("python") and not args[1].startswith("-"):
        args = [os.path.basename(args[1]), *args[2:]]
    elif args:
        args = [os.path.basename(args[0]) if args[0].startswith("/") else args[0], *args[1:]]
    return " ".join(a for a in args if a)


def _exited(p: psutil.Process) -> bool:
    """Gone, or a zombie whose every thread has exited too (a killed multi-threaded process's
    leader turns zombie before its other threads finish, and their files -- sockets on a port
    we are about to bind -- are released only with the last thread)."""
    try:
        if p.status() != psutil.STATUS_ZOMBIE:
            return False
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X"):
                    return False
        return True
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return True
    except (psutil.Error, OSError):
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float, poll_s: float = 0.01) -> list[int]:
    """Wait up to ``timeout_s`` seconds for ``procs`` to exit; return the PIDs still alive.
    A zombie counts as gone: its memory is already released, and whether its reaper (init, a
    subreaper, or this process) has collected it yet does not matter (psutil.wait_procs waits
    for that: ~2 s per process where PID 1 reaps lazily)."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if not _exited(p)]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [p for p in left if not _exited(p)]
    return [p.pid for p in left]


def set_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) for the calling thread's process (0 clears it)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
