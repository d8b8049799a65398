"""CRIU's options: frozen values (:class:`DumpOptions`, :class:`RestoreOptions`) and the pure
code that turns them into pycriu's ``criu_opts`` message (:func:`dump_rpc`, :func:`restore_rpc`)
or a command line for humans (:func:`dump_argv`). No I/O (as runc's ``criu_opts_linux.go``
holds CRIU's options apart from the runner in ``criu_linux.go``).

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

from dataclasses import dataclass

from ...errors import UsageError
from ...store.layout import DUMP_LOG, RESTORE_LOG

#: Flags for both dump and restore (CRIU option names without the leading dashes).
SHARED_FLAGS: tuple[str, ...] = ("shell-job", "ext-unix-sk", "tcp-established", "link-remap", "file-locks")
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
    as for dump. ``merge_pages``: start ``criu swrk`` with ``prctl(PR_SET_MEMORY_MERGE, 1)``,
    which every process it forks for the tree inherits, so every anonymous mapping the restorer
    makes is KSM-mergeable (:mod:`vllm_snapshot.checkpoint.criu.merge`)."""

    flags: tuple[str, ...] = SHARED_FLAGS
    root: str = "/"
    inherit_fds: tuple[tuple[str, int], ...] = ()
    external: tuple[str, ...] = ()
    network_lock: str | None = None
    merge_pages: bool = False


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
