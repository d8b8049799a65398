"""CRIU: options built by pure code from a frozen value, and a runner over pycriu (RPC/swrk).

The flags shared by dump and restore are one constant, :data:`SHARED_FLAGS`, recorded in the
manifest. They were measured to dump and restore a vLLM CPU engine tree with CRIU 4.2.1
(design notes §1): ``--shell-job --ext-unix-sk --tcp-established --link-remap --file-locks``.
The engine tree is the init of its own PID + mount namespace, so restore passes ``--root /``
(CRIU: "The --root option is required to restore a mount namespace").

Engine stdio and control pipes are recorded at dump as ``pipe:[inode]`` keys and handed back at
restore with ``--inherit-fd`` (as runc does), so logs and the control channel continue.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CriuError, EnvironmentProblem

#: Flags for both dump and restore (CRIU option names without the leading dashes).
SHARED_FLAGS: tuple[str, ...] = ("shell-job", "ext-unix-sk", "tcp-established", "link-remap", "file-locks")
MIN_VERSION = (4, 2)
LOG_LEVEL = 4
DUMP_LOG = "criu-dump.log"
RESTORE_LOG = "criu-restore.log"


@dataclass(frozen=True)
class DumpOptions:
    """What a dump needs: root PID (host PID), and the CRIU plugin dir (GPU) if any."""

    pid: int
    flags: tuple[str, ...] = SHARED_FLAGS
    leave_running: bool = False
    plugin_dir: str | None = None
    external: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestoreOptions:
    """What a restore needs. ``inherit_fds`` maps a dump-time key (``pipe:[123]``) to an fd
    number of this process (>= 3, not close-on-exec) that replaces it."""

    flags: tuple[str, ...] = SHARED_FLAGS
    root: str = "/"
    inherit_fds: tuple[tuple[str, int], ...] = ()
    plugin_dir: str | None = None
    external: tuple[str, ...] = ()


_FLAG_TO_OPT = {
    "shell-job": "shell_job",
    "ext-unix-sk": "ext_unix_sk",
    "tcp-established": "tcp_established",
    "link-remap": "link_remap",
    "file-locks": "file_locks",
}


def dump_argv(opts: DumpOptions, images_dir: str, log: str = DUMP_LOG) -> list[str]:
    """The equivalent ``criu dump`` command line (for the manifest and for humans). Pure."""
    argv = ["dump", "-t", str(opts.pid), "-D", images_dir, "-v4", "-o", log]
    argv += [f"--{f}" for f in opts.flags]
    if opts.leave_running:
        argv.append("--leave-running")
    if opts.plugin_dir:
        argv += ["-L", opts.plugin_dir]
    for e in opts.external:
        argv += ["--external", e]
    return argv


def restore_argv(opts: RestoreOptions, images_dir: str, log: str = RESTORE_LOG) -> list[str]:
    """The equivalent ``criu restore`` command line. Pure."""
    argv = ["restore", "-D", images_dir, "-v4", "-o", log, "--restore-detached", "--restore-sibling"]
    argv += [f"--{f}" for f in opts.flags]
    argv += ["--root", opts.root]
    for key, fd in opts.inherit_fds:
        argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
    if opts.plugin_dir:
        argv += ["-L", opts.plugin_dir]
    for e in opts.external:
        argv += ["--external", e]
    return argv


def apply_flags(rpc_opts, flags: tuple[str, ...]) -> None:
    """Set the pycriu ``criu_opts`` booleans for ``flags``. Raises ValueError on unknown ones."""
    for f in flags:
        if f not in _FLAG_TO_OPT:
            raise ValueError(f"unknown CRIU flag {f!r}")
        setattr(rpc_opts, _FLAG_TO_OPT[f], True)


def find_criu() -> str:
    """Path of the criu binary: ``$VLLM_SNAPSHOT_CRIU``, the setup cache, then ``$PATH``.

    Raises EnvironmentProblem when none is found.
    """
    cands = [os.environ.get("VLLM_SNAPSHOT_CRIU")]
    cache = os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot")
    cands.append(os.path.join(cache, "bin", "criu"))
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
    m = re.search(r"Version:\s*(\S+)", out)
    if not m:
        raise EnvironmentProblem(f"cannot parse `{binary} --version` output: {out!r}")
    return m.group(1)


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


def _cache_dir() -> Path:
    return Path(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot"))


def cuda_env(criu_binary: str) -> dict[str, str]:
    """Environment for a CRIU run on a CUDA engine: ``CRIU_LIBS_DIR`` = the directory of the
    CUDA plugin built with CRIU (CRIU 4.2.1 criu/plugin.c reads it when no ``-L`` is given),
    and ``PATH`` with our ``cuda-checkpoint`` helper first (the plugin execs it from PATH),
    unless ``VLLM_SNAPSHOT_CUDA_CHECKPOINT`` names NVIDIA's binary. Raises EnvironmentProblem
    when the plugin is missing."""
    from . import cuda_checkpoint, gpu

    src = Path(os.path.realpath(criu_binary)).parent.parent  # <src>/criu/criu -> <src>
    try:
        plugin = gpu.cuda_plugin_path(src)
    except EnvironmentProblem:
        plugin = gpu.cuda_plugin_path(_cache_dir() / "criu-4.2.1")
    own = os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")
    helper = Path(own).parent if own else cuda_checkpoint.helper_dir(_cache_dir())
    return {"CRIU_LIBS_DIR": str(plugin.parent), "PATH": f"{helper}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


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

    def dump(self, opts: DumpOptions, images_dir: Path, work_dir: Path) -> None:
        """Dump the tree rooted at ``opts.pid`` into ``images_dir``; log into ``work_dir``.

        The tree is killed by CRIU after a successful dump unless ``leave_running``.
        """
        c, pycriu = self._client()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            c.opts.images_dir_fd = dfd
            c.opts.work_dir_fd = wfd
            c.opts.pid = opts.pid
            c.opts.log_level = LOG_LEVEL
            c.opts.log_file = DUMP_LOG
            c.opts.leave_running = opts.leave_running
            apply_flags(c.opts, opts.flags)
            for e in opts.external:
                c.opts.external.append(e)
            try:
                with _env(self.env):
                    c.dump()
            except pycriu.CRIUException as e:
                raise CriuError(
                    f"CRIU dump failed; log excerpt:\n{log_excerpt(work_dir / DUMP_LOG)}",
                    hint=f"full log: {work_dir / DUMP_LOG}",
                ) from e
        finally:
            os.close(dfd)
            os.close(wfd)

    def restore(self, opts: RestoreOptions, images_dir: Path, work_dir: Path) -> int:
        """Restore the tree from ``images_dir`` as a child of this process (restore-sibling,
        detached); returns the restored root's host PID."""
        c, pycriu = self._client()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            c.opts.images_dir_fd = dfd
            c.opts.work_dir_fd = wfd
            c.opts.log_level = LOG_LEVEL
            c.opts.log_file = RESTORE_LOG
            c.opts.root = opts.root
            c.opts.rst_sibling = True
            apply_flags(c.opts, opts.flags)
            for key, fd in opts.inherit_fds:
                c.opts.inherit_fd.add(key=key, fd=fd)
            for e in opts.external:
                c.opts.external.append(e)
            try:
                with _env(self.env):
                    resp = c.restore()
            except pycriu.CRIUException as e:
                raise CriuError(
                    f"CRIU restore failed; log excerpt:\n{log_excerpt(work_dir / RESTORE_LOG)}",
                    hint=f"full log: {work_dir / RESTORE_LOG}",
                ) from e
            return int(resp.pid)
        finally:
            os.close(dfd)
            os.close(wfd)
