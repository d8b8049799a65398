"""Process-tree helpers shared by the supervisor, inventory, registry and operations (one
walk, one way to set the parent-death signal, one way to run code in another process's
namespace)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
#: setns(2) flags by namespace kind (CLONE_NEWNET, CLONE_NEWIPC)
NS_FLAGS = {"net": 0x40000000, "ipc": 0x08000000}
_T = TypeVar("_T")


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (host PIDs), root first; empty when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def socket_fds(pid: int) -> dict[int, int]:
    """Descriptor -> socket inode of every socket process ``pid`` has open (``socket:[N]``
    links of its fds); empty when it is gone or its fds cannot be read."""
    out: dict[int, int] = {}
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
            out[int(fd)] = int(target[8:-1])
    return out


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` has open (see :func:`socket_fds`); empty when it
    is gone or its fds cannot be read."""
    return set(socket_fds(pid).values())


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
    vllm-snapshot engine root (``python -m vllm_snapshot.entrypoints.engine_root {JSON}``, any
    name of :data:`vllm_snapshot.engine.protocol.PROGRAMS`) as ``vllm-snapshot engine (model
    M)``. Whitespace squeezed. Pure."""
    import json

    from ..engine.protocol import PROGRAMS

    args = [" ".join(a.split()) for a in argv]
    program = next((p for p in PROGRAMS if p in args), None)
    if program is not None:
        i = args.index(program)
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


def run_in_namespace(pid: int, kind: Literal["net", "ipc"], fn: Callable[[], _T]) -> _T:
    """``fn()`` run in PID ``pid``'s ``kind`` namespace, its result returned: directly when that
    namespace is ours (or ``pid``'s cannot be read), else in a helper thread that setns()-es
    first (needs CAP_SYS_ADMIN), so this thread never changes namespace. Used by the inventory
    (sockets and SysV IPC of the engine tree) and the serve hand-off (a socket in the engine's
    network namespace). Raises OSError when setns fails; whatever ``fn`` raises, re-raised."""
    try:
        theirs = os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return fn()
    if theirs == os.readlink(f"/proc/thread-self/ns/{kind}"):
        return fn()
    box: dict = {}

    def body() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, NS_FLAGS[kind]) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"setns({kind}) into PID {pid}: {os.strerror(e)}")
            finally:
                os.close(fd)
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            box["e"] = e

    t = threading.Thread(target=body, name=f"setns-{kind}", daemon=True)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def set_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) for the calling thread's process (0 clears it)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


#: The command name (``/proc/PID/comm``, at most 15 bytes) an engine root takes once it is told
#: to serve (:func:`mark_served`). Until then it keeps the name it had at dump, which its restore
#: gives back; so the name tells, host-wide and whatever registry or network namespace the
#: reader has, whether a tree ever served: a served tree is somebody's server, even while it
#: drains with its listening socket closed, never a killed restore's leftover.
SERVED_COMM = "vllm-served"


def mark_served() -> None:
    """Give this process (its main thread: ``/proc/self/comm``, what ``ps`` shows) the name
    :data:`SERVED_COMM`. Best effort: an unwritable ``/proc`` falls back to ``prctl(PR_SET_NAME)``,
    which names the calling thread (call it from the main thread)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(SERVED_COMM)
    except OSError:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, SERVED_COMM.encode(), 0, 0, 0)


def marked_served(pid: int) -> bool:
    """Whether process ``pid`` took the name :data:`SERVED_COMM` (:func:`mark_served`); False
    when it is gone or its name cannot be read."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == SERVED_COMM
    except OSError:
        return False


def kill_restored_children() -> list[int]:
    """SIGKILL our children that live in another PID namespace (a tree CRIU restored as our
    child, ``rst_sibling``: its init dies, so does the namespace), and wait up to 10 s for them
    to be gone. Returns their PIDs."""
    try:
        mine = os.readlink("/proc/self/ns/pid")
        kids = psutil.Process().children()
    except (OSError, psutil.Error):
        return []
    out = []
    for k in kids:
        try:
            if os.readlink(f"/proc/{k.pid}/ns/pid") != mine:
                k.kill()
                out.append(k.pid)
        except (OSError, psutil.Error):
            continue
    wait_gone([k for k in kids if k.pid in out], 10)
    return out
