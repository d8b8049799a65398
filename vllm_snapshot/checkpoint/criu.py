"""CRIU: options built by pure code from a frozen value, and a runner over pycriu (RPC/swrk).

The flags shared by dump and restore are one constant, :data:`SHARED_FLAGS`, recorded in the
manifest. They were measured to dump and restore a vLLM CPU engine tree with CRIU 4.2.1
(docs/how-it-works.md; docs/mounts-experiments.md uses the same):
``--shell-job --ext-unix-sk --tcp-established --link-remap --file-locks``.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from ..errors import CriuError, EnvironmentProblem, UsageError

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
from ..store.layout import DUMP_LOG, RESTORE_LOG  # noqa: E402 - names of the logs CRIU writes


@dataclass(frozen=True)
class DumpOptions:
    """What a dump needs: the tree's root (host PID), the flags, ``external`` resources
    (CRIU ``--external`` values, e.g. ``mnt[/data]:m0``, ``unix[1234]``), the network lock
    method (``None``: CRIU's default; :data:`NETWORK_LOCK_ISOLATED` for an engine in its own
    network namespace) and ``timeout_s``, CRIU's ``--timeout`` in seconds (None: CRIU's
    default, 10 s; see :func:`freeze_timeout`)."""

    pid: int
    flags: tuple[str, ...] = SHARED_FLAGS
    external: tuple[str, ...] = ()
    network_lock: str | None = None
    timeout_s: int | None = None


#: CRIU's own ``--timeout`` default (``DEFAULT_TIMEOUT`` in CRIU 4.2.1 criu/include/cr_options.h:88).
CRIU_DEFAULT_TIMEOUT_S = 10
#: Seconds budgeted for one ``cuda-checkpoint`` run inside CRIU's freeze alarm. Each run is a
#: new process paying the driver attach in ``cuInit``; measured by others: ~2.7 s per run
#: (NVIDIA/nvcf#263: "6 successive --get-state calls ... all ~2.7s"), min 0.38 / median 2.5 /
#: max 7.1 s per ``--get-state`` (modal-labs/modal-client#3603), 2.3-2.4 s per unlock
#: (ai-dynamo/dynamo#7773). 10 s is above the worst of those.
HELPER_RUN_S = 10
#: Seconds on top: seizing the tree itself and the lock's wait for in-flight GPU work.
FREEZE_MARGIN_S = 30
#: ``$VLLM_SNAPSHOT_FREEZE_TIMEOUT`` (whole seconds) replaces the estimate.
FREEZE_TIMEOUT_ENV = "VLLM_SNAPSHOT_FREEZE_TIMEOUT"


def freeze_timeout(kind: str, n_processes: int, n_cuda: int, env: dict[str, str]) -> int | None:
    """CRIU ``--timeout`` (seconds) for dumping a tree of ``n_processes`` processes of which
    ``n_cuda`` use CUDA; None for a CPU engine (CRIU's default 10 s holds there). Pure.

    Why: CRIU 4.2.1 arms ``alarm(opts.timeout)`` at the start of ``collect_pstree``
    (criu/seize.c:1061) and runs the CUDA plugin's PAUSE_DEVICES hook for every task inside
    that window (seize.c:1069/1084, :716). The hook runs ``cuda-checkpoint --get-restore-tid``
    once per task and, for a CUDA task, ``--get-state`` and ``--action lock --timeout
    <timeout*1000>`` too (plugins/cuda/cuda_plugin.c:405-471). So the window must hold
    ``n_processes + 2 * n_cuda`` helper runs: :data:`HELPER_RUN_S` each plus
    :data:`FREEZE_MARGIN_S`; at least one CUDA process is assumed for ``kind == "cuda"``.
    The same value bounds the lock (in milliseconds). ``env[FREEZE_TIMEOUT_ENV]`` overrides
    it for any kind. Raises UsageError for an override that is not a positive integer.
    """
    raw = env.get(FREEZE_TIMEOUT_ENV)
    if raw:
        try:
            val = int(raw)
        except ValueError:
            val = 0
        if val <= 0:
            raise UsageError(f"${FREEZE_TIMEOUT_ENV}={raw!r}: expected a whole number of seconds > 0",
                             hint=f"unset {FREEZE_TIMEOUT_ENV} to use the estimate")
        return val
    if kind != "cuda":
        return None
    runs = max(n_processes, 1) + 2 * max(n_cuda, 1)
    return FREEZE_MARGIN_S + HELPER_RUN_S * runs


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
    if opts.timeout_s is not None:
        argv += ["--timeout", str(opts.timeout_s)]
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
    if opts.timeout_s is not None:
        rpc.timeout = opts.timeout_s  # images/rpc.proto:122, applied at criu/cr-service.c:677
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
    """True for CRIU >= :data:`MIN_VERSION` (4.1.1 fails on kernels >= 6.16: docs/operations.md, "Distro CRIU")."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return tuple(parts) >= MIN_VERSION


#: What CRIU 4.2.1's CUDA plugin logs as an ``Error`` for every process that is not a CUDA
#: process (``plugins/cuda/cuda_plugin.c:221``: ``--get-restore-tid`` exited non-zero, which
#: the plugin reads as "skip this task"): one line per non-CUDA process of every CUDA dump and
#: restore, benign unless our helper says it could not reach the driver (``unavailable:``).
BENIGN_CUDA_ERROR = "Failed to launch cuda-checkpoint to retrieve restore tid"


def _benign(line: str) -> bool:
    from .cuda_checkpoint import UNAVAILABLE

    return BENIGN_CUDA_ERROR in line and UNAVAILABLE not in line


def log_excerpt(log_path: Path, context: int = 4, limit: int = 30) -> str:
    """The ``Error`` lines of a CRIU log with ``context`` lines before each (at most ``limit``
    lines). The CUDA plugin's benign "not a CUDA process" lines (:data:`BENIGN_CUDA_ERROR`)
    are left out, so they cannot push the real error out of the excerpt. Returns "" when the
    log is missing."""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if not _benign(ln)]
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
#: Binary directory -> the plugin directories of the same installation (one package/prefix).
_SYSTEM_PAIRS = {"/usr/sbin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/usr/bin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/sbin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/bin": ("/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
                 "/usr/local/sbin": ("/usr/local/lib/criu",), "/usr/local/bin": ("/usr/local/lib/criu",)}


def plugin_candidates(criu_binary: str | None, cache: Path | None = None) -> list[Path]:
    """Where CRIU's CUDA plugin may be, in the order used: beside a source-built binary
    (``<src>/plugins/cuda``; pass the resolved binary path), the setup cache's build (``cache``,
    default :func:`paths.cache_dir`), then the system plugin directories. Pure. Doctor and
    CRIU runs both use this list (through :func:`find_cuda_plugin`)."""
    out = []
    if criu_binary:
        src = Path(criu_binary).parent.parent  # <src>/criu/criu -> <src>
        out.append(src / "plugins" / "cuda" / CUDA_PLUGIN)
    out.append((cache or paths.cache_dir()) / "criu-4.2.1" / "plugins" / "cuda" / CUDA_PLUGIN)
    out += [Path(d) / CUDA_PLUGIN for d in SYSTEM_PLUGIN_DIRS]
    return list(dict.fromkeys(out))


def _same_file(a: str, b: str) -> bool:
    import filecmp

    if a == b:
        return True
    try:
        return os.path.samefile(a, b) or filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def paired(plugin: Path, criu_binary: str, same_file=_same_file) -> bool:
    """True when ``plugin`` comes from the same build as ``criu_binary`` (resolved path). Pure
    but for ``same_file`` (a content comparison of two binaries).

    The plugin is not a stable ABI: it reads CRIU's internal ``opts`` struct
    (``opts.timeout``, ``opts.final_state``: CRIU 4.2.1 plugins/cuda/cuda_plugin.c:451, :621)
    and calls CRIU's own functions, and CRIU only checks a coarse plugin version
    (``CRIU_PLUGIN_VERSION`` 0.2.0, criu/include/criu-plugin.h:29-36). Paired are: the plugin of
    a source tree whose ``criu/criu`` is this binary (same file or same bytes), and a
    distribution's plugin directory for a binary of the same prefix (``/usr/sbin/criu`` with
    ``/usr/lib/criu``, ``/usr/local/sbin/criu`` with ``/usr/local/lib/criu``)."""
    src_bin = plugin.parent.parent.parent / "criu" / "criu"  # <src>/plugins/cuda/x.so -> <src>/criu/criu
    if plugin.parent.name == "cuda" and plugin.parent.parent.name == "plugins":
        return same_file(str(src_bin), criu_binary)
    return str(plugin.parent) in _SYSTEM_PAIRS.get(os.path.dirname(criu_binary), ())


def find_cuda_plugin(criu_binary: str | None, is_file=os.path.isfile, cache: Path | None = None,
                     same_file=_same_file) -> Path:
    """The first :func:`plugin_candidates` entry that exists and is :func:`paired` with
    ``criu_binary``. Raises EnvironmentProblem listing where it looked, or naming a plugin
    that exists but belongs to another CRIU build (refused: loading it into this binary
    reads that binary's internals with another layout)."""
    binary = os.path.realpath(criu_binary) if criu_binary else None
    cands = plugin_candidates(binary, cache)
    found = [c for c in cands if is_file(str(c))]
    for c in found:
        if binary and paired(c, binary, same_file):
            return c
    if found:
        raise EnvironmentProblem(
            f"CRIU's CUDA plugin {found[0]} was built for another CRIU than the one that would load it "
            f"({binary}); the plugin reads CRIU's internal option struct, so both must come from one build",
            hint="use the criu binary of the same build (set VLLM_SNAPSHOT_CRIU), or build the plugin with "
                 "this CRIU (`make cuda_plugin` in its source tree; scripts/setup.sh does it for its own build)")
    raise EnvironmentProblem(
        "CRIU's CUDA plugin (cuda_plugin.so) is missing; looked in: " + ", ".join(map(str, cands)),
        hint="run scripts/setup.sh (it builds the plugin with CRIU), or install your distribution's criu package")


#: CRIU's configuration files, read in this order also by ``criu swrk`` (CRIU 4.2.1
#: criu/config.c:320-370 ``next_config``: GLOBAL_CONFIG_DIR ``/etc/criu/``, ``$HOME/.criu/``,
#: then ``$CRIU_CONFIG_FILE``).
CONFIG_FILES = ("/etc/criu/default.conf", "~/.criu/default.conf")


def config_libdirs(read_text, env: dict[str, str]) -> list[tuple[str, str]]:
    """``(file, directory)`` of every ``libdir``/``L`` setting in CRIU's configuration files
    (:data:`CONFIG_FILES`, ``env["CRIU_CONFIG_FILE"]``). ``read_text(path)`` returns the
    file's text or None. Pure over it.

    Such a setting beats ``CRIU_LIBS_DIR``: CRIU 4.2.1 criu/plugin.c:214-222 reads the
    environment only when ``opts.libdir`` is unset, and config files set it before any RPC
    request is read."""
    home = env.get("HOME", "/root")
    files = [f.replace("~", home, 1) for f in CONFIG_FILES]
    if env.get("CRIU_CONFIG_FILE"):
        files.append(env["CRIU_CONFIG_FILE"])
    out = []
    for f in files:
        text = read_text(f)
        for line in (text or "").splitlines():
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            key = words[0].lstrip("-")
            if key in ("libdir", "L") and len(words) > 1:
                out.append((f, words[1]))
            elif key.startswith("libdir="):
                out.append((f, key.split("=", 1)[1]))
    return out


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def check_config_libdir(plugin_dir: Path, read_text=_read_text, env: dict[str, str] | None = None) -> None:
    """Raise EnvironmentProblem when a CRIU configuration file sets a plugin directory other
    than ``plugin_dir`` (CRIU would silently load its plugins instead of ours, or none)."""
    for f, d in config_libdirs(read_text, dict(os.environ) if env is None else env):
        if os.path.realpath(d) != os.path.realpath(plugin_dir):
            raise EnvironmentProblem(
                f"{f} sets CRIU's plugin directory to {d}; CRIU would load plugins from there instead of "
                f"{plugin_dir} (a libdir in a config file beats CRIU_LIBS_DIR)",
                hint=f"remove the libdir line from {f}, or point it to {plugin_dir}")


def cuda_env(criu_binary: str) -> dict[str, str]:
    """Environment for a CRIU run on a CUDA engine: ``CRIU_LIBS_DIR`` = the directory of the
    CUDA plugin paired with ``criu_binary`` (CRIU 4.2.1 criu/plugin.c reads it when no ``-L``
    is given), and ``PATH`` with our ``cuda-checkpoint`` helper first (the plugin execs it from
    PATH), unless ``VLLM_SNAPSHOT_CUDA_CHECKPOINT`` names NVIDIA's binary. Raises
    EnvironmentProblem when the plugin is missing or of another build, when a CRIU config file
    redirects the plugin directory, or when ``VLLM_SNAPSHOT_CUDA_CHECKPOINT`` is not an
    executable named ``cuda-checkpoint`` (the plugin runs that name only)."""
    from . import cuda_checkpoint

    plugin = find_cuda_plugin(criu_binary)
    check_config_libdir(plugin.parent)
    own = os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")
    if own and (os.path.basename(own) != cuda_checkpoint.PROG or not os.access(own, os.X_OK)):
        raise EnvironmentProblem(
            f"VLLM_SNAPSHOT_CUDA_CHECKPOINT={own} must be an executable file named cuda-checkpoint "
            "(CRIU's plugin runs that name from PATH)", hint="point it to NVIDIA's cuda-checkpoint binary, or unset it")
    helper = Path(own).parent if own else cuda_checkpoint.helper_dir(paths.cache_dir())
    return {"CRIU_LIBS_DIR": str(plugin.parent), "PATH": f"{helper}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


#: CRIU 4.2.1 CUDA plugin log lines (plugins/cuda/cuda_plugin.c) -> what they mean.
_CUDA_LOG = (
    ("No GPU device found; CUDA plugin is disabled",
     "CRIU's CUDA plugin found no GPU (/proc/driver/nvidia/gpus) and disabled itself"),
    ("check that cuda-checkpoint is present in $PATH",
     "CRIU's CUDA plugin could not run `cuda-checkpoint -h` from PATH and disabled itself"),
    ("--action flag not supported",
     "`cuda-checkpoint -h` does not offer --action: the NVIDIA driver has no checkpoint API (r570+ needed)"),
)


def check_cuda_run(log: Path, what: str, keep_dir: Path | None = None) -> None:
    """:func:`check_cuda_log` over the CRIU log file ``log`` of a finished CUDA ``what``
    (``dump``/``restore``); on failure the log is kept (:func:`keep_log`) and the error's hint
    names the copy. Raises CriuError."""
    try:
        check_cuda_log(log.read_text(errors="replace"), what)
    except CriuError as e:
        kept = keep_log(log, what, keep_dir)
        e.hint = f"full log: {kept} (grep cuda_plugin)" if kept else e.hint
        e.details = {"log": str(kept) if kept else None}
        raise


def check_cuda_log(log_text: str, what: str = "dump") -> None:
    """Raise CriuError unless a CRIU log of a CUDA ``dump`` (or ``restore``) shows the CUDA
    plugin loaded, initialized, and never told by our helper that it cannot reach the driver
    (a helper that cannot work answers "not a CUDA process" to the plugin, which would then
    skip the GPU state). For a restore, also refuses logged restore/unlock failures, which
    CRIU 4.2.1 only logs (criu/cr-restore.c:2259-2274) before resuming the tree. Pure."""
    from .cuda_checkpoint import UNAVAILABLE

    def fail(why: str) -> None:
        raise CriuError(f"CRIU {what} of a CUDA engine: {why}",
                        hint="run `vllm-snapshot doctor`; the CRIU log has the plugin's lines (grep cuda_plugin)")

    if "cuda_plugin" not in log_text:
        fail("CRIU did not load its CUDA plugin (CRIU_LIBS_DIR did not reach it, or a config file's libdir won)")
    if UNAVAILABLE in log_text:
        line = next(ln for ln in log_text.splitlines() if UNAVAILABLE in ln)
        fail("our cuda-checkpoint helper could not use the driver: " + line[line.index(UNAVAILABLE):].strip())
    for needle, text in _CUDA_LOG:
        if needle in log_text:
            fail(text)
    if "initialized: cuda_plugin" not in log_text:
        fail("CRIU's CUDA plugin never initialized")
    if what == "dump" and "Checkpointing CUDA devices on pid" not in log_text:
        fail("the CUDA plugin checkpointed no process: every process of the tree answered 'no CUDA here' "
             "to `cuda-checkpoint --get-restore-tid` (their messages are the plugin's 'Failed to launch' lines)")
    m = re.search(r"RESUME_DEVICES (RESTORE|UNLOCK) failed with ?(.*)", log_text)
    if m:
        fail(f"the plugin's {m.group(1).lower()} of the GPU state failed: {m.group(2).strip()[:200]}")


def keep_log(log: Path, what: str, keep_dir: Path | None = None) -> Path | None:
    """Copy a CRIU log to ``keep_dir`` (default :func:`paths.log_dir`) as
    ``criu-WHAT-YYYYmmdd-HHMMSS-PID.log`` (0600); return the copy, or None when it could not
    be kept."""
    return paths.keep_log_copy(log, f"criu-{what}", keep_dir)


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


CAP_SYS_RESOURCE = 24
#: ``criu swrk`` run with other real ids (see :func:`dump_real_ids`)
RUID_WRAPPER = Path(__file__).resolve().parent / "criu_ruid.sh"


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
    from ..host.privilege import parse_status

    tree, own = parse_status(tree_status), parse_status(own_status)
    if tree.uids[0] == 0 or own.cap_eff & (1 << CAP_SYS_RESOURCE):
        return None
    return tree.uids[0], tree.gids[0]


def own_caps_setpriv() -> str:
    """Our effective capabilities as setpriv(1) wants them (``+chown,+dac_override,...``;
    ``setpriv --list-caps`` lists the names in capability-number order). Raises OSError."""
    import subprocess

    from ..host.privilege import parse_status

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
    """Runs CRIU over RPC (pycriu, ``criu swrk``) with a given binary. ``real_ids`` (uid,
    gid): run it with these real ids (:func:`dump_real_ids`; through :data:`RUID_WRAPPER`).

    ``dump`` and ``restore`` raise :class:`CriuError` carrying the log excerpt.
    """

    binary: str
    env: dict = field(default_factory=dict)
    keep_log_dir: Path | None = None
    timeout_s: float | None = None
    real_ids: tuple[int, int] | None = None

    def _client(self):
        try:
            import pycriu
        except ImportError as e:  # pragma: no cover - depends on setup
            raise EnvironmentProblem(
                "pycriu is not importable", hint="run scripts/setup.sh (it adds pycriu to the venv)"
            ) from e
        c = pycriu.criu()
        if self.real_ids is not None:
            if not os.access(RUID_WRAPPER, os.X_OK):
                raise EnvironmentProblem(f"{RUID_WRAPPER} is not executable",
                                         hint="reinstall vllm-snapshot (the file's mode must be 0755)")
            c.use_binary(str(RUID_WRAPPER))
        else:
            c.use_binary(self.binary)
        return c, pycriu

    def _call_env(self) -> dict[str, str]:
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

    def _call(self, c, pycriu, what: str, work_dir: Path, log_name: str, floor: float = 0.0, run=None):
        """Run ``c.dump()``/``c.restore()`` (or ``run()`` in their stead) with signals deferred
        (:mod:`interrupts`) and a watchdog that SIGKILLs CRIU's ``swrk`` process after
        :attr:`timeout_s` (at least ``floor`` seconds: never before CRIU's own freeze
        timeout). Raises CriuError."""
        import signal
        import threading

        from ..host.interrupts import deferred

        limit = self.timeout_s or env_timeout()
        limit = max(limit, floor)
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
            with deferred(), _env(self._call_env()):
                timer.start()
                try:
                    return run() if run is not None else getattr(c, what)()
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
        from ..host.interrupts import deferred

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
            if self.real_ids is not None:  # CRIU runs as the tree's user (with capabilities)
                c.opts.unprivileged = True
            self._call(c, pycriu, "dump", work_dir, DUMP_LOG, floor=opts.timeout_s + 120.0 if opts.timeout_s else 0.0)
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
        from ..host.interrupts import deferred

        try:
            with deferred():
                return self._restore(opts, images_dir, work_dir, before_memory)
        except BaseException:
            kill_restored_children()
            raise

    def _restore(self, opts: RestoreOptions, images_dir: Path, work_dir: Path,
                 before_memory: Callable[[], None] | None = None) -> int:
        c, pycriu = self._client()
        dfd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        try:
            c.opts.images_dir_fd = dfd
            c.opts.work_dir_fd = wfd
            restore_rpc(opts, c.opts)
            if before_memory is None:
                resp = self._call(c, pycriu, "restore", work_dir, RESTORE_LOG)
            else:
                failed: list[BaseException] = []
                c.opts.notify_scripts = True
                try:
                    resp = self._call(c, pycriu, "restore", work_dir, RESTORE_LOG,
                                      run=lambda: _restore_notified(c, pycriu, before_memory, failed))
                except CriuError:
                    if failed:  # CRIU aborted because we said so: ours is the cause
                        raise failed[0] from None
                    raise
            return int(resp.pid)
        finally:
            os.close(dfd)
            os.close(wfd)


#: The CRIU notification after which tasks map their memory (criu/cr-restore.c: the root task
#: waits for CR_STATE_FORKING, switched to only after the ``post-setup-namespaces`` scripts).
BEFORE_MEMORY_NOTIFY = "post-setup-namespaces"


def _restore_notified(c, pycriu, before_memory: Callable[[], None], failed: list[BaseException]):
    """pycriu's ``restore()`` with ``notify_scripts`` set: answer CRIU's notifications (every
    one succeeds, except :data:`BEFORE_MEMORY_NOTIFY` when ``before_memory`` raises: its
    exception goes into ``failed`` and CRIU is told the script failed, so it aborts). Returns
    CRIU's restore response; raises pycriu's CRIUException like ``restore()``."""
    import socket

    rpc = pycriu.rpc
    req = rpc.criu_req()
    req.type = rpc.RESTORE
    req.opts.MergeFrom(c.opts)
    seen = False
    try:
        s = c._comm.connect(False)
        try:
            s.send(req.SerializeToString())
            while True:
                buf = s.recv(len(s.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK)))
                resp = rpc.criu_resp()
                resp.ParseFromString(buf)
                if resp.type != rpc.NOTIFY:
                    break
                ok = True
                if resp.notify.script == BEFORE_MEMORY_NOTIFY and not seen:
                    seen = True
                    try:
                        before_memory()
                    except BaseException as e:  # noqa: BLE001 - raised by the caller
                        failed.append(e)
                        ok = False
                ack = rpc.criu_req()
                ack.type = rpc.NOTIFY
                ack.notify_success = ok
                s.send(ack.SerializeToString())
        finally:
            c._comm.disconnect()
    except Exception as e:  # noqa: BLE001 - as pycriu reports a broken channel
        import importlib

        raise importlib.import_module("pycriu.criu").CRIUExceptionInternal(req.type, str(e)) from e
    if not resp.success:
        raise pycriu.CRIUExceptionExternal(req.type, resp.type, resp.cr_errno)
    if not seen:  # no namespaces after all: CRIU opened every pages image, so each was staged whole
        before_memory()
    return resp.restore


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
    from ..host.procs import wait_gone

    wait_gone([k for k in kids if k.pid in out], 10)
    return out


def caps_missing(images_dir: Path, m, own_status: str) -> list[int]:
    """Capabilities the dumped engine root of the snapshot ``m`` held that a process with
    ``/proc/self/status`` text ``own_status`` cannot give back
    (:func:`vllm_snapshot.host.privilege.caps_beyond` over the root's core image in
    ``images_dir``); [] when the image is absent or cannot be read (CRIU then decides)."""
    from ..host import privilege

    root = 1 if m.criu.pid_namespace else m.criu.root_pid  # the images name namespace PIDs
    img = next((i for i in m.images if i.name.split(".")[0] == f"core-{root}"), None)
    if img is None:
        return []
    try:
        import io

        import pycriu

        from ..store.archive import open_raw

        with open_raw(images_dir, img) as r:
            raw = b"".join(iter(lambda: r.read(1 << 20), b""))
        creds = pycriu.images.load(io.BytesIO(raw))["entries"][0]["thread_core"]["creds"]
        return privilege.caps_beyond(creds, own_status)
    except Exception:  # noqa: BLE001 - an unreadable image is CRIU's to report
        return []
