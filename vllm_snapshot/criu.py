"""CRIU: options built by pure code from a frozen value, and a runner over pycriu (RPC/swrk).

The flags shared by dump and restore are one constant, :data:`SHARED_FLAGS`, recorded in the
manifest. They were measured to dump and restore a vLLM CPU engine tree with CRIU 4.2.1
(design notes §1): ``--shell-job --ext-unix-sk --tcp-established --link-remap --file-locks``.
The engine tree is the init of its own PID + mount namespace, so restore passes ``--root /``
(CRIU: "The --root option is required to restore a mount namespace").

Engine stdio and control pipes are recorded at dump as ``pipe:[inode]`` keys and handed back at
restore with ``--inherit-fd`` (as runc does), so logs and the control channel continue.

The tree also lives in a network namespace of its own (loopback only, :mod:`vllm_snapshot.engine.net`):
CRIU dumps that namespace (``lo``, its addresses via ``ip addr save``, routes, nftables through
libnftables) and creates a fresh one at every restore. Both run with ``--network-lock skip``
(:data:`NETWORK_LOCK_ISOLATED`, see there for why).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .errors import CriuError, EnvironmentProblem

#: Flags for both dump and restore (CRIU option names without the leading dashes).
SHARED_FLAGS: tuple[str, ...] = ("shell-job", "ext-unix-sk", "tcp-established", "link-remap", "file-locks")
MIN_VERSION = (4, 2)
#: Upper bound of one CRIU dump or restore (seconds; ``$VLLM_SNAPSHOT_CRIU_TIMEOUT`` overrides).
#: A tiny CPU engine dumps in ~2 s and restores in ~1 s; a 3 GiB one in ~10 s. A run still
#: going after this is killed and reported ("hung") instead of blocking a service forever.
DEFAULT_TIMEOUT_S = 600.0
LOG_LEVEL = 4
#: CRIU's ``--network-lock`` for a tree in its own loopback-only network namespace: ``skip``.
#: The lock exists so that peers *outside* the dumped tree neither see a connection reset nor
#: send into sockets in repair mode while the tree is frozen (CRIU installs iptables/nftables
#: rules in the tree's namespace, or per connection in the host's). Here the namespace holds
#: only the tree's own processes and ``lo``: every TCP peer is in the tree (inventory refuses
#: outside peers), frozen and dumped together, so there is nobody to lock out. The default,
#: ``iptables``, would also need iptables-restore (absent on minimal hosts, and not needed by
#: anything else), and a failed restore can leave its rules behind (CRIU 4.2.1 criu/net.c
#: ``network_lock_internal``; ``skip`` returns before touching any rule).
NETWORK_LOCK_ISOLATED = "skip"
#: criu_network_lock_method values of CRIU 4.2.1's images/rpc.proto.
_NETWORK_LOCK_RPC = {"iptables": 1, "nftables": 2, "skip": 3}
from .layout import DUMP_LOG, RESTORE_LOG  # noqa: E402 - names of the logs CRIU writes


@dataclass(frozen=True)
class DumpOptions:
    """What a dump needs: the tree's root (host PID), the flags, ``external`` resources
    (CRIU ``--external`` values, e.g. ``mnt[/data]:m0``, ``unix[1234]``) and the network lock
    method (``None``: CRIU's default; :data:`NETWORK_LOCK_ISOLATED` for an engine in its own
    network namespace)."""

    pid: int
    flags: tuple[str, ...] = SHARED_FLAGS
    external: tuple[str, ...] = ()
    network_lock: str | None = None


@dataclass(frozen=True)
class RestoreOptions:
    """What a restore needs. ``flags`` are those recorded at dump (the manifest's
    ``criu.flags``); ``inherit_fds`` maps a dump-time key (``pipe:[123]``) to an fd number of
    this process (>= 3, not close-on-exec) that replaces it; ``external`` and ``network_lock``
    as for dump."""

    flags: tuple[str, ...] = SHARED_FLAGS
    root: str = "/"
    inherit_fds: tuple[tuple[str, int], ...] = ()
    external: tuple[str, ...] = ()
    network_lock: str | None = None


_FLAG_TO_OPT = {
    "shell-job": "shell_job",
    "ext-unix-sk": "ext_unix_sk",
    "tcp-established": "tcp_established",
    "link-remap": "link_remap",
    "file-locks": "file_locks",
}


def dump_argv(opts: DumpOptions, images_dir: str, log: str = DUMP_LOG) -> list[str]:
    """The equivalent ``criu dump`` command line (recorded in the manifest, for humans). Pure."""
    argv = ["dump", "-t", str(opts.pid), "-D", images_dir, "-v4", "-o", log]
    argv += [f"--{f}" for f in opts.flags]
    for e in opts.external:
        argv += ["--external", e]
    if opts.network_lock:
        argv += ["--network-lock", opts.network_lock]
    return argv


def check_flags(flags: tuple[str, ...]) -> None:
    """Raise ValueError naming the first flag this tool does not know (a manifest written by
    another version, or edited)."""
    for f in flags:
        if f not in _FLAG_TO_OPT:
            raise ValueError(f"unknown CRIU flag {f!r}")


def dump_rpc(opts: DumpOptions, rpc) -> None:
    """Fill pycriu's ``criu_opts`` message ``rpc`` for a dump from ``opts`` (no I/O)."""
    rpc.pid = opts.pid
    rpc.log_level = LOG_LEVEL
    rpc.log_file = DUMP_LOG
    apply_flags(rpc, opts.flags)
    for e in opts.external:
        rpc.external.append(e)
    _network_lock(rpc, opts.network_lock)


def _network_lock(rpc, method: str | None) -> None:
    if method is not None:
        if method not in _NETWORK_LOCK_RPC:
            raise ValueError(f"unknown CRIU network lock method {method!r}")
        rpc.network_lock = _NETWORK_LOCK_RPC[method]


def restore_rpc(opts: RestoreOptions, rpc) -> None:
    """Fill pycriu's ``criu_opts`` message ``rpc`` for a restore from ``opts`` (no I/O): the
    tree becomes our child (``rst_sibling``), ``--root`` for its mount namespace."""
    rpc.log_level = LOG_LEVEL
    rpc.log_file = RESTORE_LOG
    rpc.root = opts.root
    rpc.rst_sibling = True
    apply_flags(rpc, opts.flags)
    for key, fd in opts.inherit_fds:
        rpc.inherit_fd.add(key=key, fd=fd)
    for e in opts.external:
        rpc.external.append(e)
    _network_lock(rpc, opts.network_lock)


def apply_flags(rpc_opts, flags: tuple[str, ...]) -> None:
    """Set the pycriu ``criu_opts`` booleans for ``flags``. Raises ValueError on unknown ones."""
    check_flags(flags)
    for f in flags:
        setattr(rpc_opts, _FLAG_TO_OPT[f], True)


def find_criu() -> str:
    """Path of the criu binary: ``$VLLM_SNAPSHOT_CRIU``, the setup cache, then ``$PATH``.

    Raises EnvironmentProblem when none is found.
    """
    cands = [os.environ.get("VLLM_SNAPSHOT_CRIU")]
    cands.append(str(paths.cache_dir() / "bin" / "criu"))
    cands.append(shutil.which("criu"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    raise EnvironmentProblem(
        "CRIU not found", hint="run scripts/setup.sh, or install CRIU >= 4.2 (criu check must pass)"
    )


def criu_version(binary: str) -> str:
    """``criu --version``'s ``Version:`` value, e.g. ``"4.2.1"``. Raises EnvironmentProblem."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError as e:
        raise EnvironmentProblem(f"cannot run {binary}: {e}") from e
    v = parse_version(out)
    if v is None:
        raise EnvironmentProblem(f"cannot parse `{binary} --version` output: {out!r}")
    return v


def parse_version(text: str) -> str | None:
    """The ``Version:`` value of ``criu --version`` output (``"4.2.1"``), or None. Pure."""
    m = re.search(r"Version:\s*(\S+)", text)
    return m.group(1) if m else None


def version_ok(version: str) -> bool:
    """True for CRIU >= :data:`MIN_VERSION` (4.1.1 fails on kernels >= 6.16, design notes)."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return tuple(parts) >= MIN_VERSION


def log_excerpt(log_path: Path, context: int = 4, limit: int = 30) -> str:
    """The ``Error`` lines of a CRIU log with ``context`` lines before each (at most ``limit``
    lines). Returns "" when the log is missing."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep: list[int] = []
    for i, line in enumerate(lines):
        if "Error" in line and "RLIMIT_NOFILE" not in line:
            keep.extend(range(max(0, i - context), i + 1))
    if not keep:
        keep = list(range(max(0, len(lines) - context * 2), len(lines)))
    seen: list[str] = []
    for i in sorted(set(keep)):
        seen.append(lines[i])
    return "\n".join(seen[-limit:])


#: CRIU log lines (4.2.1 wording) -> what they mean, in words. Pure patterns; see :func:`explain`.
_EXPLAIN = (
    (r"FS mnt \.(\S+) dev \S+ root \S+ unsupported",
     "the engine's mount namespace holds {0}, a file system CRIU cannot re-create, and it was neither "
     "detached nor passed as an external mount"),
    (r"\d+:\.(\S+) doesn't have a proper root mount",
     "{0} is a bind mount whose source file system is not mounted in the engine's namespace (a container's "
     "file bind?), and it was not passed as an external mount"),
    (r"No mapping for \d+:\(null\) mountpoint",
     "an external mount recorded at dump was not given back at restore"),
    (r"Can't lookup mount=\d+ for fd=(\d+) path=(\S+)",
     "a process of the tree has fd {0} ({1}) opened in a mount namespace outside the tree"),
    (r"Process with requested pid already exists",
     "a PID the tree needs is taken (the dumped tree not yet reaped?)"),
    (r"Can't dump.*io_uring|anon_inode:\[io_uring\]",
     "a process of the tree uses io_uring, which CRIU cannot dump"),
    (r"No space left on device", "the disk is full"),
)


def explain(log_text: str) -> str | None:
    """The first known failure in a CRIU log, said in words (mount point, fd, process), or
    None. Pure."""
    for pat, text in _EXPLAIN:
        m = re.search(pat, log_text)
        if m:
            return text.format(*m.groups())
    return None


#: Where distributions install CRIU plugins (Debian/Ubuntu ``criu`` >= 4.0 ships
#: ``cuda_plugin.so`` in the first; CRIU's ``make install`` uses the second).
SYSTEM_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib/x86_64-linux-gnu/criu")
CUDA_PLUGIN = "cuda_plugin.so"


def plugin_candidates(criu_binary: str | None, cache: Path | None = None) -> list[Path]:
    """Where CRIU's CUDA plugin may be, in the order used: beside a source-built binary
    (``<src>/plugins/cuda``; pass the resolved binary path), the setup cache's build (``cache``,
    default :func:`paths.cache_dir`), then the system plugin directories. Pure. Doctor and
    CRIU runs both use this list."""
    out = []
    if criu_binary:
        src = Path(criu_binary).parent.parent  # <src>/criu/criu -> <src>
        out.append(src / "plugins" / "cuda" / CUDA_PLUGIN)
    out.append((cache or paths.cache_dir()) / "criu-4.2.1" / "plugins" / "cuda" / CUDA_PLUGIN)
    out += [Path(d) / CUDA_PLUGIN for d in SYSTEM_PLUGIN_DIRS]
    return list(dict.fromkeys(out))


def find_cuda_plugin(criu_binary: str | None, is_file=os.path.isfile) -> Path:
    """The first existing :func:`plugin_candidates` entry. Raises EnvironmentProblem listing
    where it looked."""
    cands = plugin_candidates(os.path.realpath(criu_binary) if criu_binary else None)
    for c in cands:
        if is_file(str(c)):
            return c
    raise EnvironmentProblem(
        "CRIU's CUDA plugin (cuda_plugin.so) is missing; looked in: " + ", ".join(map(str, cands)),
        hint="run scripts/setup.sh (it builds the plugin with CRIU), or install your distribution's criu package")


def cuda_env(criu_binary: str) -> dict[str, str]:
    """Environment for a CRIU run on a CUDA engine: ``CRIU_LIBS_DIR`` = the directory of the
    CUDA plugin (CRIU 4.2.1 criu/plugin.c reads it when no ``-L`` is given), and ``PATH`` with
    our ``cuda-checkpoint`` helper first (the plugin execs it from PATH), unless
    ``VLLM_SNAPSHOT_CUDA_CHECKPOINT`` names NVIDIA's binary. Raises EnvironmentProblem when
    the plugin is missing."""
    from . import cuda_checkpoint

    plugin = find_cuda_plugin(criu_binary)
    own = os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")
    helper = Path(own).parent if own else cuda_checkpoint.helper_dir(paths.cache_dir())
    return {"CRIU_LIBS_DIR": str(plugin.parent), "PATH": f"{helper}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def keep_log(log: Path, what: str, keep_dir: Path | None = None) -> Path | None:
    """Copy a CRIU log to ``keep_dir`` (default :func:`paths.log_dir`) as
    ``criu-WHAT-YYYYmmdd-HHMMSS-PID.log`` (0600); return the copy, or None when it could not
    be kept."""
    import shutil
    import time

    d = keep_dir or paths.log_dir()
    try:
        paths.ensure_private_dir(d)
        dst = d / f"criu-{what}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        shutil.copyfile(log, dst)
        os.chmod(dst, 0o600)
        return dst
    except OSError:
        return None


class _env:
    """Set environment variables for the duration of a CRIU RPC call (criu swrk is forked
    from this process and inherits them)."""

    def __init__(self, extra: dict[str, str] | None):
        self.extra = extra or {}
        self.saved: dict[str, str | None] = {}

    def __enter__(self):
        for k, v in self.extra.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Criu:
    """Runs CRIU over RPC (pycriu, ``criu swrk``) with a given binary.

    ``dump`` and ``restore`` raise :class:`CriuError` carrying the log excerpt.
    """

    binary: str
    env: dict = field(default_factory=dict)
    keep_log_dir: Path | None = None
    timeout_s: float | None = None

    def _client(self):
        try:
            import pycriu
        except ImportError as e:  # pragma: no cover - depends on setup
            raise EnvironmentProblem(
                "pycriu is not importable", hint="run scripts/setup.sh (it adds pycriu to the venv)"
            ) from e
        c = pycriu.criu()
        c.use_binary(self.binary)
        return c, pycriu

    def _failed(self, what: str, work_dir: Path, log_name: str, lead: str | None = None) -> CriuError:
        log = work_dir / log_name
        kept = keep_log(log, what, self.keep_log_dir)
        try:
            why = explain(log.read_text(errors="replace"))
        except OSError:
            why = None
        return CriuError(
            f"{lead or f'CRIU {what} failed'}{': ' + why if why else ''}; log excerpt:\n{log_excerpt(log)}",
            hint=f"full log: {kept}" if kept else f"the CRIU log could not be kept ({log})",
            details={"log": str(kept) if kept else None})

    def _call(self, c, pycriu, what: str, work_dir: Path, log_name: str):
        """Run ``c.dump()``/``c.restore()`` with signals deferred (:mod:`interrupts`) and a
        watchdog that SIGKILLs CRIU's ``swrk`` process after :attr:`timeout_s`. Raises CriuError."""
        import signal
        import threading

        from .interrupts import deferred

        limit = self.timeout_s or float(os.environ.get("VLLM_SNAPSHOT_CRIU_TIMEOUT") or DEFAULT_TIMEOUT_S)
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            pid = getattr(getattr(c, "_comm", None), "swrk", None)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        timer = threading.Timer(limit, kill)
        timer.daemon = True
        try:
            with deferred(), _env(self.env):
                timer.start()
                try:
                    return getattr(c, what)()
                finally:
                    timer.cancel()
        except Exception as e:  # noqa: BLE001 - pycriu raises CRIUException, or anything on a killed swrk
            if fired.is_set():
                raise self._failed(what, work_dir, log_name,
                                   f"CRIU {what} did not finish within {limit:.0f} s and was killed "
                                   "(set VLLM_SNAPSHOT_CRIU_TIMEOUT to allow more)") from e
            if isinstance(e, pycriu.CRIUException):
                raise self._failed(what, work_dir, log_name) from e
            raise

    def dump(self, opts: DumpOptions, images_dir: Path, work_dir: Path) -> None:
        """Dump the tree rooted at ``opts.pid`` into ``images_dir``; log into ``work_dir``.
        CRIU kills the tree after a successful dump. Raises CriuError (its log kept under
        :func:`paths.log_dir`, the hint names the copy; also when it hung and was killed).
        Signals are deferred for the whole call (:mod:`interrupts`)."""
        from .interrupts import deferred

        with deferred():
            self._dump(opts, images_dir, work_dir)

    def _dump(self, opts: DumpOptions, images_dir: Path, work_dir: Path) -> None:
        c, pycriu = self._client()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            c.opts.images_dir_fd = dfd
            c.opts.work_dir_fd = wfd
            dump_rpc(opts, c.opts)
            self._call(c, pycriu, "dump", work_dir, DUMP_LOG)
        finally:
            os.close(dfd)
            os.close(wfd)

    def restore(self, opts: RestoreOptions, images_dir: Path, work_dir: Path) -> int:
        """Restore the tree from ``images_dir`` as a child of this process (restore-sibling,
        detached); returns the restored root's host PID. Raises CriuError (log kept); after a
        failure, a half-restored tree left as our child is killed. Signals are deferred for
        the whole call; an interruption right after it kills the restored tree."""
        from .interrupts import deferred

        try:
            with deferred():
                return self._restore(opts, images_dir, work_dir)
        except BaseException:
            kill_restored_children()
            raise

    def _restore(self, opts: RestoreOptions, images_dir: Path, work_dir: Path) -> int:
        c, pycriu = self._client()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            c.opts.images_dir_fd = dfd
            c.opts.work_dir_fd = wfd
            restore_rpc(opts, c.opts)
            resp = self._call(c, pycriu, "restore", work_dir, RESTORE_LOG)
            return int(resp.pid)
        finally:
            os.close(dfd)
            os.close(wfd)


def kill_restored_children() -> list[int]:
    """SIGKILL our children that live in another PID namespace (a tree CRIU restored as our
    child, ``rst_sibling``: its init dies, so does the namespace). Returns their PIDs."""
    import psutil

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
    from .procs import wait_gone

    wait_gone([k for k in kids if k.pid in out], 10)
    return out
