"""Supervisor side of an engine tree: pipes, launch into PID + mount + network namespaces,
events, logs.

The engine root is started as ``unshare --pid --fork --mount-proc --net -- python -m
vllm_snapshot.entrypoints.engine_root SPEC``: it becomes PID 1 of a new PID namespace with its own /proc,
its own mount namespace and a network namespace holding only ``lo`` (engine/net.py), and
calls ``setsid()`` itself (CRIU refuses a tree whose session leader is outside its PID
namespace), and owns only fds opened inside the namespace plus three pipes from us (pipes have
no mount, so CRIU can dump them, while a /dev/null inherited from the caller could not be dumped).
"""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import psutil

from ..engine.protocol import FD_EVENTS, FD_LOG, PROGRAM, ROLES, decode, encode_command, missing_fields
from ..engine.spec import EngineSpec
from ..host.procs import set_parent_death_signal, tree, wait_gone
from ..errors import EngineError

def channel_keys(root_pid: int) -> dict[str, str]:
    """role -> ``pipe:[inode]`` of the engine root's channel fds (what CRIU's
    ``--inherit-fd`` matches at restore; recorded in the manifest at dump)."""
    return {role: os.readlink(f"/proc/{root_pid}/fd/{fd}") for role, fd in ROLES.items()}


@dataclass
class Channel:
    """The three pipes of :mod:`vllm_snapshot.engine.protocol`: the engine's ends
    (``ctl_r``, ``log_w``, ``ev_w``) and ours (``ctl_w``, ``log_r``, ``ev_r``). With a
    ``log_file`` (detached engines) the engine's log end is that file and ours is /dev/null."""

    ctl_r: int
    ctl_w: int
    log_r: int
    log_w: int
    ev_r: int
    ev_w: int

    @classmethod
    def open(cls, log_file: Path | None = None) -> "Channel":
        """Create the pipes (and open ``log_file`` for appending, mode 0600). Raises OSError."""
        ctl_r, ctl_w = os.pipe()
        ev_r, ev_w = os.pipe()
        if log_file is not None:
            log_w = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            log_r = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        else:
            log_r, log_w = os.pipe()
            _set_append(log_w)  # a no-op on a pipe, but the dumped flags: see _set_append
        return cls(ctl_r, ctl_w, log_r, log_w, ev_r, ev_w)

    def engine_ends(self) -> dict[str, int]:
        """role -> our fd of the engine's end."""
        return {"control": self.ctl_r, "log": self.log_w, "events": self.ev_w}

    def inherit_fds(self, keys: dict[str, str]) -> tuple[tuple[str, int], ...]:
        """CRIU ``--inherit-fd`` pairs (recorded key, our fd) for a restore; makes those fds
        inheritable (CRIU's swrk child must see them). Raises KeyError for a missing role."""
        ends = self.engine_ends()
        for fd in ends.values():
            os.set_inheritable(fd, True)
        return tuple((keys[role], ends[role]) for role in ROLES)

    def close_engine_ends(self) -> None:
        """Close the engine's ends here once the engine holds them."""
        for fd in self.engine_ends().values():
            _close(fd)
        self.ctl_r = self.log_w = self.ev_w = -1

    def close(self) -> None:
        """Close every fd still open (on failure, before a handle owns ours)."""
        for fd in (self.ctl_r, self.ctl_w, self.log_r, self.log_w, self.ev_r, self.ev_w):
            _close(fd)
        self.ctl_r = self.ctl_w = self.log_r = self.log_w = self.ev_r = self.ev_w = -1


def _set_append(fd: int) -> None:
    """Add O_APPEND to ``fd``'s open file description. On the engine's log pipe at create it
    changes no write (a pipe has no offset) but it is in the flags CRIU dumps, and CRIU 4.2.1
    restores an ``--inherit-fd`` pipe by re-opening the fd it is handed
    (``open("/proc/self/fd/N", dumped flags)``, criu/pipes.c ``reopen_pipe``): a new open file
    description at offset 0 with the dumped flags, not ours. Without O_APPEND among them a
    detached engine's ``--log-file`` is written from its first byte, over the previous run's
    log. Raises OSError."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)


def append_restored_log(root_pid: int, ours: int) -> bool:
    """Make a restored engine's log fd (``FD_LOG``, shared by the whole tree) append, when we
    handed it a log file (``ours``: our fd of it) and its snapshot was made before the log pipe
    was dumped with O_APPEND (see :func:`_set_append`): its description is then CRIU's re-open,
    at offset 0 without O_APPEND. Takes the engine's fd with ``pidfd_getfd`` (Linux >= 5.6,
    ptrace rights: root) and sets O_APPEND on it, before the engine is sent any command (a
    restored engine idles until ``attach``). Returns True when it changed the flags; False when
    there was nothing to do or it could not (the log is then overwritten as before: never a
    reason to fail a restore)."""
    import ctypes
    import fcntl
    import stat as _stat

    try:
        mine = os.fstat(ours)
        if not _stat.S_ISREG(mine.st_mode):
            return False  # foreground: a pipe to us
        pidfd = os.pidfd_open(root_pid)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.syscall(438, pidfd, FD_LOG, 0)  # SYS_pidfd_getfd, same number on every arch
            if fd < 0:
                return False
        finally:
            os.close(pidfd)
        try:
            theirs = os.fstat(fd)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if (theirs.st_dev, theirs.st_ino) != (mine.st_dev, mine.st_ino) or flags & os.O_APPEND:
                return False
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_APPEND)
            return True
        finally:
            os.close(fd)
    except OSError:
        return False


def _close(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


class LogPump(threading.Thread):
    """Copies engine log bytes from a pipe to sinks (our stderr, a file) until EOF."""

    def __init__(self, fd: int, sinks: list[Callable[[bytes], None]]):
        super().__init__(daemon=True, name="engine-log")
        self.fd = fd
        self.sinks = sinks
        self.tail: list[bytes] = []

    def run(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                break
            if not data:
                break
            for s in list(self.sinks):
                try:
                    s(data)
                except Exception:  # noqa: BLE001 - a broken sink must not stop the pump
                    pass
            buf = (buf + data)[-16384:]
            self.tail = buf.splitlines()[-40:]
        try:
            os.close(self.fd)
        except OSError:
            pass

    def tail_text(self, n: int = 20) -> str:
        return "\n".join(line.decode(errors="replace") for line in self.tail[-n:])


@dataclass
class EngineHandle:
    """A running engine tree we supervise. ``root_pid`` is the host PID of the namespace init
    (the tree's root); ``control`` is our write end, ``events_fd`` our read end."""

    root_pid: int
    control: IO[str]
    events_fd: int
    log: LogPump
    launcher: subprocess.Popen | None = None
    _buf: bytes = b""
    #: called by :meth:`close` after the log pump had a moment to drain (e.g. a log file's close)
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def send(self, cmd: str, **kw) -> None:
        """Send one command. Raises EngineError when the engine is gone."""
        try:
            self.control.write(encode_command(cmd, **kw))
            self.control.flush()
        except (BrokenPipeError, OSError) as e:
            raise EngineError(f"engine is gone (sending {cmd!r}: {e})\n{self.log.tail_text()}") from e

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.root_pid)
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def wait_event(self, name: str, timeout: float) -> dict:
        """Wait for event ``name``; return it. Raises EngineError on an ``error`` event, EOF,
        death of the engine, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                ev = decode(line)
                if ev is None:
                    continue
                if ev.get("event") == "error":
                    tail = "" if ev.get("kind") == "usage" else "\n" + self.log.tail_text()
                    raise EngineError(
                        f"engine error ({ev.get('kind', 'error')}): {ev.get('message')}{tail}",
                        details=ev,
                    )
                if ev.get("event") == name:
                    missing = missing_fields(ev)
                    if missing:
                        raise EngineError(f"the engine's {name!r} event lacks {', '.join(missing)} "
                                          "(engine/protocol.py EVENT_FIELDS)", details=ev)
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"timed out after {timeout:.0f} s waiting for the engine ({name})\n{self.log.tail_text()}")
            r, _, _ = select.select([self.events_fd], [], [], min(left, 0.5))
            if r:
                data = os.read(self.events_fd, 65536)
                if not data:
                    time.sleep(0.2)
                    self.log.join(timeout=2)
                    raise EngineError(
                        f"engine exited while waiting for {name!r}\n{self.log.tail_text()}",
                        hint="the engine log above says why",
                    )
                self._buf += data

    def tree(self) -> list[psutil.Process]:
        """The root and all its descendants (empty when gone)."""
        return tree(self.root_pid)

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the engine log seen so far."""
        return self.log.tail_text(n)

    def drain_log(self, timeout_s: float = 5.0) -> None:
        """Wait until the engine log reaches EOF (all writers gone) or ``timeout_s``."""
        self.log.join(timeout=timeout_s)

    def kill(self, grace: float = 0.0) -> None:
        """Stop the tree: SIGTERM + ``grace`` seconds, then SIGKILL the namespace init (which
        kills every process of its PID namespace); reap it when it is our child. Raises
        EngineError naming processes still alive 10 s after SIGKILL."""
        procs = self.tree()
        if grace > 0 and procs:
            try:
                os.kill(self.root_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            wait_gone(procs, grace)
        for p in self.tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        survivors = wait_gone(procs, 10)
        self.reap()
        if survivors:  # they hold memory (GPU memory on GPU): say so, never ignore it
            raise EngineError(f"engine processes survived SIGKILL: PIDs {survivors}",
                              hint="check them with `ps -o pid,stat,wchan -p PID` (a D-state process waits on the kernel)")

    def reap(self, block: bool = True) -> int | None:
        """waitpid the root if it is our child; returns its exit code (signal -> 128+sig)."""
        try:
            pid, status = os.waitpid(self.root_pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)

    def close(self) -> None:
        for closer in (self.control.close, lambda: os.close(self.events_fd)):
            try:
                closer()
            except OSError:
                pass
        if self.launcher is not None:
            try:
                self.launcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
        if self.on_close:
            self.log.join(timeout=2)
            for fn in self.on_close:
                try:
                    fn()
                except OSError:
                    pass
            self.on_close.clear()


#: The engine root's command (``SPEC`` JSON is appended). Tests pass another one (a
#: protocol-speaking fake engine) through ``local_tools(engine_argv=...)``.
ENGINE_ARGV: tuple[str, ...] = (sys.executable, "-m", PROGRAM)


def engine_import_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the directory holding this ``vllm_snapshot`` package first on
    ``PYTHONPATH``: the engine root must run the same code as the supervisor that speaks the
    protocol with it, whether the package is installed, installed editable elsewhere, or run
    from a checkout. Pure (over this module's path)."""
    parent = str(Path(__file__).resolve().parents[2])  # the directory holding vllm_snapshot/
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != parent]
    return {**env, "PYTHONPATH": os.pathsep.join([parent, *rest])}


def launch(spec: EngineSpec, env: dict[str, str], log_sinks: list[Callable[[bytes], None]],
           engine_argv: tuple[str, ...] = ENGINE_ARGV) -> EngineHandle:
    """Start the engine root (``ENGINE_ARGV SPEC``, ``SPEC`` the JSON of ``spec``) in a new PID +
    mount namespace; return its handle.

    Raises EngineError when it cannot be started.
    """
    from ..paths import ENGINE_TMPDIR

    os.makedirs(ENGINE_TMPDIR, mode=0o700, exist_ok=True)  # the mount point, on the host's disk
    ch = Channel.open()
    ctl_r, ctl_w, log_r, log_w, ev_r, ev_w = ch.ctl_r, ch.ctl_w, ch.log_r, ch.log_w, ch.ev_r, ch.ev_w

    def child_setup() -> None:
        # unshare dies with us (kill -9 of `create` included), and --kill-child makes the
        # engine root (PID 1 of the namespace, whose death ends the namespace) die with unshare.
        # The engine clears its own death signal before the dump (CRIU would deliver it right
        # after a restore).
        set_parent_death_signal(signal.SIGKILL)
        os.dup2(ev_w, FD_EVENTS)
        if ev_w != FD_EVENTS:
            os.close(ev_w)

    # The engine root makes its mount namespace private first (engine/mounts.py): host tmpfs
    # mounts are detached and fresh tmpfs are mounted on /dev/shm and /tmp. --net: a network
    # namespace with only lo (engine/net.py brings it up): no route out at create, and the
    # recorded loopback listeners live in a namespace CRIU re-creates fresh at every restore.
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private", "--net", "--kill-child", "--",
            *engine_argv, spec.to_json()]
    # engine fd 0 = control, 1 and 2 = log, 3 = events (engine/protocol.py)
    try:
        launcher = subprocess.Popen(
            argv, stdin=ctl_r, stdout=log_w, stderr=log_w, env=engine_import_env(env), close_fds=True,
            pass_fds=(FD_EVENTS,), start_new_session=True, preexec_fn=child_setup, cwd="/",
        )
    except OSError as e:
        for fd in (ctl_r, ctl_w, log_r, log_w, ev_r, ev_w):
            os.close(fd)
        raise EngineError(f"cannot start the engine: {e}") from e
    for fd in (ctl_r, log_w, ev_w):
        os.close(fd)
    pump = LogPump(log_r, log_sinks)
    pump.start()
    root = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(launcher.pid).children()
        except psutil.NoSuchProcess:
            kids = []
        if kids:
            root = kids[0].pid
            break
        if launcher.poll() is not None:
            break
        time.sleep(0.02)
    handle = EngineHandle(root or -1, os.fdopen(ctl_w, "w"), ev_r, pump, launcher)
    if root is None:
        handle.close()
        raise EngineError(f"the engine did not start (unshare exited {launcher.returncode})\n{pump.tail_text()}")
    return handle


def restored_handle(root_pid: int, ch: Channel, log_sinks: list[Callable[[bytes], None]]) -> EngineHandle:
    """Handle for a tree CRIU restored as our child, talking over ``ch`` (whose engine ends
    CRIU handed to the tree; they are closed here). The handle owns our ends from now on."""
    append_restored_log(root_pid, ch.log_w)  # a snapshot made before its log pipe was O_APPEND
    ch.close_engine_ends()
    pump = LogPump(ch.log_r, log_sinks)
    pump.start()
    h = EngineHandle(root_pid, os.fdopen(ch.ctl_w, "w"), ch.ev_r, pump, None)
    ch.ctl_w = ch.log_r = ch.ev_r = -1
    return h


__all__ = ["Channel", "EngineHandle", "channel_keys", "engine_import_env", "launch", "restored_handle"]


def check_log_file(path: Path) -> None:
    """Refuse what cannot be an engine log file (``--log-file``): a directory, a missing parent,
    a path on a pseudo filesystem, anything but a regular file this process can append to
    (the file is created, 0600, when absent). Raises UsageError naming why."""
    from .. import paths
    from ..errors import UsageError

    if path.is_dir() or not path.parent.is_dir():
        raise UsageError(f"--log-file {path}: " + ("is a directory" if path.is_dir() else paths.why_not_a_dir(path.parent)))
    real = os.path.realpath(path)
    if real.startswith(("/proc/", "/sys/", "/dev/")):
        raise UsageError(f"--log-file {path} is on a pseudo filesystem ({real}); name a regular file")
    try:  # the engine appends to it: it must be a writable regular file (not a fifo, a device)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"--log-file {path} is not a regular file")
        finally:
            os.close(fd)
    except OSError as e:
        raise UsageError(f"--log-file {path} cannot be written: {e.strerror}") from e


def keep_log(path: Path, what: str) -> Path | None:
    """Copy the engine log ``path`` to :func:`vllm_snapshot.paths.log_dir` as
    ``engine-WHAT-YYYYmmdd-HHMMSS-PID.log`` (0600); return the copy, or None when it could not
    be kept (then the error names no file)."""
    from .. import paths

    return paths.keep_log_copy(path, f"engine-{what}")


def log_file_tail(path: Path, lines: int = 20) -> str | None:
    """The last ``lines`` lines of the engine log file ``path`` (of its last 16 KiB); None when
    it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return None
