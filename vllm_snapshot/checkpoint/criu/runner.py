"""The CRIU runner: one ``criu swrk`` process per dump or restore, spawned here and spoken to
over a socket pair in CRIU's RPC messages (pycriu's ``rpc_pb2`` ``criu_req``/``criu_resp``), as
runc's ``criuSwrk`` does: the runner owns the process (its environment is given to it, never
set in this process's ``os.environ``; its PID is the watchdog's to kill) and the transport (a
``SOCK_SEQPACKET`` pair, one message per packet; CRIU's notifications answered here).

:class:`Criu` runs dumps and restores with a given binary; :class:`Swrk` is the process and its
socket; :func:`dump_real_ids` says when CRIU must run with the tree's real ids (through
:data:`RUID_WRAPPER`).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import CriuError, EnvironmentProblem, UsageError
from ...store.layout import DUMP_LOG, RESTORE_LOG
from .logs import explain, keep_log, log_excerpt
from .options import DumpOptions, RestoreOptions, dump_rpc, restore_rpc

#: Upper bound of one CRIU dump or restore (seconds; ``$VLLM_SNAPSHOT_CRIU_TIMEOUT`` overrides).
#: A tiny CPU engine dumps in ~2 s and restores in ~1 s; a 3 GiB one in ~10 s. A run still
#: going after this is killed and reported ("hung") instead of blocking a service forever.
DEFAULT_TIMEOUT_S = 600.0
CAP_SYS_RESOURCE = 24
#: ``criu swrk`` run with other real ids (see :func:`dump_real_ids`)
RUID_WRAPPER = Path(__file__).resolve().parent.parent / "criu_ruid.sh"
#: The CRIU notification after which tasks map their memory (criu/cr-restore.c: the root task
#: waits for CR_STATE_FORKING, switched to only after the ``post-setup-namespaces`` scripts).
BEFORE_MEMORY_NOTIFY = "post-setup-namespaces"


def rpc_messages():
    """pycriu's generated RPC module (``criu_req``, ``criu_resp``, ``criu_opts``, ``DUMP``,
    ``RESTORE``, ``NOTIFY``). Raises EnvironmentProblem when pycriu is not importable."""
    try:
        import pycriu
    except ImportError as e:  # pragma: no cover - depends on setup
        raise EnvironmentProblem(
            "pycriu is not importable", hint="run scripts/setup.sh (it adds pycriu to the venv)"
        ) from e
    return pycriu.rpc


class RpcFailed(Exception):
    """CRIU answered a request with failure, or its channel broke (the process died, a message
    did not parse). The runner turns it into a :class:`CriuError` with CRIU's log."""


class Swrk:
    """One ``criu swrk`` process and our end of its socket pair. :meth:`spawn` starts it; a
    test may wrap any connected ``SOCK_SEQPACKET`` socket (``proc`` None)."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen | None = None):
        self.sock = sock
        self.proc = proc

    @classmethod
    def spawn(cls, argv0: str, env: Mapping[str, str], pass_fds: tuple[int, ...] = (),
              merge_pages: bool = False) -> Swrk:
        """Start ``argv0 swrk FD`` (FD: its end of a new socket pair) with exactly ``env`` as
        its environment, stdio on /dev/null, and only FD and ``pass_fds`` (the fds a restore
        hands to the tree with ``inherit_fd``) open besides. ``merge_pages``: started through
        :func:`merge.launch_argv`, so it and every process it forks are KSM-mergeable. Raises
        RpcFailed when it cannot be started."""
        from .merge import launch_argv

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [argv0, "swrk", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(launch_argv(argv) if merge_pages else argv, env=dict(env),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    pass_fds=(theirs.fileno(), *pass_fds))
        except OSError as e:
            ours.close()
            raise RpcFailed(f"cannot start {argv0} swrk: {e}") from e
        finally:
            theirs.close()
        return cls(ours, proc)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def kill(self) -> None:
        """SIGKILL the process (the watchdog's way out of a hung CRIU); its socket then reads EOF."""
        if self.proc is not None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    def _recv(self, rpc):
        try:
            n = len(self.sock.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))  # the whole packet's size
            buf = self.sock.recv(n) if n else b""
        except OSError as e:
            raise RpcFailed(f"reading CRIU's answer: {e}") from e
        if not buf:
            raise RpcFailed("criu swrk closed its socket without an answer (it died or was killed)")
        resp = rpc.criu_resp()
        try:
            resp.ParseFromString(buf)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
            raise RpcFailed(f"an answer of CRIU does not parse: {e}") from e
        return resp

    def _send(self, msg) -> None:
        try:
            self.sock.send(msg.SerializeToString())
        except OSError as e:
            raise RpcFailed(f"writing to criu swrk: {e}") from e

    def call(self, req, on_notify: Callable[[str], bool] | None = None):
        """Send ``req`` (a ``criu_req``); answer each NOTIFY CRIU sends with ``on_notify(script)``
        (True: go on, False: CRIU aborts; without ``on_notify`` every one succeeds); return the
        final ``criu_resp``. Raises RpcFailed when the answer says failure or the channel
        broke."""
        rpc = rpc_messages()
        self._send(req)
        while True:
            resp = self._recv(rpc)
            if resp.type != rpc.NOTIFY:
                break
            ack = rpc.criu_req()
            ack.type = rpc.NOTIFY
            ack.notify_success = True if on_notify is None else bool(on_notify(resp.notify.script))
            self._send(ack)
        if not resp.success:
            raise RpcFailed(f"CRIU answered request {req.type} with failure (errno {resp.cr_errno})")
        return resp

    def close(self) -> None:
        """Close our socket and reap the process."""
        self.sock.close()
        if self.proc is not None:
            self.proc.wait()


def restore_notified(swrk: Swrk, req, before_memory: Callable[[], None], failed: list[BaseException]):
    """Run the restore request ``req`` (``notify_scripts`` set) on ``swrk``, answering CRIU's
    notifications: every one succeeds, except :data:`BEFORE_MEMORY_NOTIFY` when
    ``before_memory`` raises: its exception goes into ``failed`` and CRIU is told the script
    failed, so it aborts. Without that notification (no namespaces of the tree's own: CRIU
    opened every pages image, so each was staged whole) ``before_memory`` runs after CRIU.
    Returns CRIU's restore response; raises RpcFailed."""
    seen: list[str] = []

    def on_notify(script: str) -> bool:
        if script != BEFORE_MEMORY_NOTIFY or seen:
            return True
        seen.append(script)
        try:
            before_memory()
        except BaseException as e:  # noqa: BLE001 - raised by the caller
            failed.append(e)
            return False
        return True

    resp = swrk.call(req, on_notify)
    if not seen:
        before_memory()
    return resp.restore


def dump_real_ids(tree_status: str, own_status: str) -> tuple[int, int] | None:
    """The real (uid, gid) CRIU's dump must run with, from ``/proc/ROOT/status`` of the tree
    and ``/proc/self/status``: None normally; the tree's real ids when it runs as a non-root
    user and we (root) lack CAP_SYS_RESOURCE, as root in many containers does. CRIU 4.2.1
    reads each process's rlimits with prlimit(2) (criu/cr-dump.c ``dump_task_rlimits``), which
    on another process needs CAP_SYS_RESOURCE or the target's real, effective and saved ids
    equal to the caller's real ids (prlimit(2)). CRIU then runs as that user with our
    capabilities kept in its ambient set and ``--unprivileged`` (a real uid that differs from
    the effective one makes libxtables, which CRIU's nftables probe loads, exit with 111).
    Pure."""
    from ...host.privilege import parse_status

    tree, own = parse_status(tree_status), parse_status(own_status)
    if tree.uids[0] == 0 or own.cap_eff & (1 << CAP_SYS_RESOURCE):
        return None
    return tree.uids[0], tree.gids[0]


def own_caps_setpriv() -> str:
    """Our effective capabilities as setpriv(1) wants them (``+chown,+dac_override,...``;
    ``setpriv --list-caps`` lists the names in capability-number order). Raises OSError."""
    from ...host.privilege import parse_status

    names = subprocess.run(["setpriv", "--list-caps"], capture_output=True, text=True, check=True).stdout.split()
    eff = parse_status(Path("/proc/self/status").read_text()).cap_eff
    return ",".join(f"+{n}" for i, n in enumerate(names) if eff & (1 << i))


def env_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``$VLLM_SNAPSHOT_CRIU_TIMEOUT`` of ``environ`` (default: this process's) in seconds,
    > 0, else :data:`DEFAULT_TIMEOUT_S`. Raises UsageError for a value that is not a positive
    number."""
    text = (os.environ if environ is None else environ).get("VLLM_SNAPSHOT_CRIU_TIMEOUT") or ""
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise UsageError(f"VLLM_SNAPSHOT_CRIU_TIMEOUT={text!r}: expected a positive number of seconds",
                         hint=f"unset it for the default ({DEFAULT_TIMEOUT_S:.0f} s), or give e.g. 900")
    return value


@dataclass
class Criu:
    """Runs CRIU with a given binary: one ``criu swrk`` per call (:class:`Swrk`), with this
    process's environment plus ``env`` given to it. ``real_ids`` (uid, gid): run it with these
    real ids (:func:`dump_real_ids`; through :data:`RUID_WRAPPER`).

    ``dump`` and ``restore`` raise :class:`CriuError` carrying the log excerpt.
    """

    binary: str
    env: dict = field(default_factory=dict)
    keep_log_dir: Path | None = None
    timeout_s: float | None = None
    real_ids: tuple[int, int] | None = None

    def _argv0(self) -> str:
        if self.real_ids is None:
            return self.binary
        if not os.access(RUID_WRAPPER, os.X_OK):
            raise EnvironmentProblem(f"{RUID_WRAPPER} is not executable",
                                     hint="reinstall vllm-snapshot (the file's mode must be 0755)")
        return str(RUID_WRAPPER)

    def _call_env(self) -> dict[str, str]:
        """What this runner adds to CRIU's environment (``env``; with ``real_ids``, what
        :data:`RUID_WRAPPER` reads)."""
        if self.real_ids is None:
            return dict(self.env)
        return {**self.env, "VLLM_SNAPSHOT_CRIU_BINARY": self.binary, "VLLM_SNAPSHOT_CRIU_CAPS": own_caps_setpriv(),
                "VLLM_SNAPSHOT_CRIU_RUID": str(self.real_ids[0]), "VLLM_SNAPSHOT_CRIU_RGID": str(self.real_ids[1])}

    def _failed(self, what: str, work_dir: Path, log_name: str, lead: str | None = None) -> CriuError:
        log = work_dir / log_name
        kept = keep_log(log, what, self.keep_log_dir)
        try:
            why = explain(log.read_text(errors="replace"))
        except OSError:
            why = None
        excerpt = log_excerpt(log)
        if excerpt.strip():
            tail = f"; log excerpt:\n{excerpt}"
        else:  # killed before it wrote a line (a Ctrl-C reaches CRIU too): say so, not "excerpt:" and nothing
            tail = f"; its log {kept or log} is empty" if log.is_file() else f"; it wrote no log ({log})"
        return CriuError(
            f"{lead or f'CRIU {what} failed'}{': ' + why if why else ''}{tail}",
            hint=f"full log: {kept}" if kept else f"the CRIU log could not be kept ({log})",
            details={"log": str(kept) if kept else None})

    def _call(self, what: str, req, work_dir: Path, log_name: str, floor: float = 0.0,
              run: Callable[[Swrk], object] | None = None, pass_fds: tuple[int, ...] = (),
              merge_pages: bool = False):
        """Spawn ``criu swrk`` (``merge_pages``: KSM-mergeable, :meth:`Swrk.spawn`) and run
        ``req`` on it (or ``run(swrk)`` in its stead), with
        signals deferred (:mod:`interrupts`) and a watchdog that SIGKILLs that process after
        :attr:`timeout_s` (at least ``floor`` seconds: never before CRIU's own freeze timeout).
        Returns CRIU's response (or what ``run`` returns). Raises CriuError."""
        import threading

        from ...host.interrupts import deferred

        limit = self.timeout_s or env_timeout()
        limit = max(limit, floor)
        fired = threading.Event()
        env = {**os.environ, **self._call_env()}  # CRIU's own; this process's stays as it is
        argv0 = self._argv0()
        with deferred():
            try:
                swrk = Swrk.spawn(argv0, env, pass_fds, merge_pages=merge_pages)
            except RpcFailed as e:
                raise self._failed(what, work_dir, log_name) from e

            def kill() -> None:
                fired.set()
                swrk.kill()

            timer = threading.Timer(limit, kill)
            timer.daemon = True
            try:
                timer.start()
                try:
                    return run(swrk) if run is not None else swrk.call(req)
                finally:
                    timer.cancel()
                    swrk.close()
            except RpcFailed as e:
                if fired.is_set():
                    raise self._failed(what, work_dir, log_name,
                                       f"CRIU {what} did not finish within {limit:.0f} s and was killed "
                                       "(set VLLM_SNAPSHOT_CRIU_TIMEOUT to allow more)") from e
                raise self._failed(what, work_dir, log_name) from e

    def dump(self, opts: DumpOptions, images_dir: Path, work_dir: Path) -> None:
        """Dump the tree rooted at ``opts.pid`` into ``images_dir``; log into ``work_dir``.
        CRIU kills the tree after a successful dump. Raises CriuError (its log kept under
        :func:`paths.log_dir`, the hint names the copy; also when it hung and was killed).
        Signals are deferred for the whole call (:mod:`interrupts`)."""
        from ...host.interrupts import deferred

        with deferred():
            self._dump(opts, images_dir, work_dir)

    def _dump(self, opts: DumpOptions, images_dir: Path, work_dir: Path) -> None:
        rpc = rpc_messages()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            req = rpc.criu_req()
            req.type = rpc.DUMP
            req.opts.images_dir_fd = dfd  # CRIU opens /proc/OUR_PID/fd/N (the socket's peer)
            req.opts.work_dir_fd = wfd
            dump_rpc(opts, req.opts)
            if self.real_ids is not None:  # CRIU runs as the tree's user (with capabilities)
                req.opts.unprivileged = True
            self._call("dump", req, work_dir, DUMP_LOG, floor=opts.timeout_s + 120.0 if opts.timeout_s else 0.0)
        finally:
            os.close(dfd)
            os.close(wfd)

    def restore(self, opts: RestoreOptions, images_dir: Path, work_dir: Path,
                before_memory: Callable[[], None] | None = None) -> int:
        """Restore the tree from ``images_dir`` as a child of this process (restore-sibling,
        detached); returns the restored root's host PID. ``before_memory``: called while CRIU
        waits at its ``post-setup-namespaces`` notification, after the namespaces exist and
        before any task maps its memory (reads a pages image); only for a tree with
        namespaces of its own (else CRIU sends no such notification: the caller must not
        pass it). When it raises, CRIU is told to abort and that exception is raised. Raises
        CriuError (log kept); after a failure, a half-restored tree left as our child is
        killed. Signals are deferred for the whole call; an interruption right after it kills
        the restored tree."""
        from ...host.interrupts import deferred
        from ...host.procs import kill_restored_children

        try:
            with deferred():
                return self._restore(opts, images_dir, work_dir, before_memory)
        except BaseException:
            kill_restored_children()
            raise

    def _restore(self, opts: RestoreOptions, images_dir: Path, work_dir: Path,
                 before_memory: Callable[[], None] | None = None) -> int:
        rpc = rpc_messages()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            req = rpc.criu_req()
            req.type = rpc.RESTORE
            req.opts.images_dir_fd = dfd
            req.opts.work_dir_fd = wfd
            restore_rpc(opts, req.opts)
            fds = tuple(fd for _key, fd in opts.inherit_fds)  # CRIU's own fds, handed to the tree
            if opts.merge_pages:  # before CRIU starts: a kernel without the prctl says so in words
                from .merge import check_available
                check_available()
            merge = opts.merge_pages
            if before_memory is None:
                return int(self._call("restore", req, work_dir, RESTORE_LOG, pass_fds=fds,
                                      merge_pages=merge).restore.pid)
            failed: list[BaseException] = []
            req.opts.notify_scripts = True
            try:
                resp = self._call("restore", req, work_dir, RESTORE_LOG, pass_fds=fds, merge_pages=merge,
                                  run=lambda swrk: restore_notified(swrk, req, before_memory, failed))
            except CriuError:
                if failed:  # CRIU aborted because we said so: ours is the cause
                    raise failed[0] from None
                raise
            return int(resp.pid)
        finally:
            os.close(dfd)
            os.close(wfd)
