"""``restore`` and ``verify``: the steps, in order (each side effect through
:class:`Tools`).

:func:`validate` -- every check before CRIU, metadata first (podman reads metadata before the
payload): trust (owner, modes, members) -> manifest (schema, digest) -> layout (stat) ->
recorded CRIU flags known -> host identity field by field -> (CUDA) the GPU the state goes onto
(:func:`vllm_snapshot.checkpoint.gpu.place`: the recorded one, else the same model at the same
device minor, remapped) -> the engine user (same name, uid,
gid and groups here) -> the HTTP port free -> files the
tree had open or mapped (those the snapshot carries: only what cannot be put back refuses,
:mod:`vllm_snapshot.checkpoint.carry`) -> model files (re-hashing last: a taken port is found in
milliseconds, not after every model byte was read).

:func:`restore` -- validate -> stage (compressed images: decompressed and verified; uncompressed:
hard-linked; meanwhile the code identity of :mod:`vllm_snapshot.host.codeid` starts) -> put back
link-remap files -> fresh
channel -> under the CRIU lock: the carried files verified and put back where missing -> CRIU restore with the recorded flags (into a fresh network namespace) -> adopt the
tree -> its credentials are the recorded ones -> (CUDA: wake; level 2: the model files re-checked
against the stats validation saw, :func:`vllm_snapshot.store.model_digest.recheck`) -> oracle inside the engine ->
the image checksums' verdict (uncompressed images are verified in a background thread while
CRIU restores from their hard links and the oracle runs) -> the code identity's verdict (a
changed Python file kills the tree) -> only then bind -> /health -> HTTP canary -> registry.
Any failure kills the tree, releases the port, removes staging; a failing cleanup is reported
together with its cause.

Network: a snapshot made with ``engine.network`` ``isolated`` (every snapshot since the engine
got its own network namespace) is restored into a fresh namespace that CRIU creates, holding
only ``lo`` and the tree's own loopback listeners, so any number of restores of one snapshot
run at once (clones) and no recorded loopback port can collide with anything. The HTTP port is
bound by this process in the host's namespace (``--host``/``--port`` mean what they mean to
``vllm serve``) only after the oracle matched, and the listening socket is handed to the
engine with the ``serve`` command (:mod:`vllm_snapshot.supervise.handoff`). A socket keeps the namespace
it was created in, so the engine accepts the host's connections while its own traffic stays in
its namespace. This is simpler than the alternatives: a veth pair + NAT or a proxy would add
an address plan, forwarding rules or a copy of every byte, and CRIU's ``--inherit-fd`` cannot
hand over a TCP socket. Snapshots made before (``host``) keep the old
path: their recorded loopback listeners are checked free under the CRIU lock, and the engine
binds the port itself.
"""

from __future__ import annotations

import os
import signal
import socket
from contextlib import ExitStack, contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from ..checkpoint import carry, criu, mountpolicy

if TYPE_CHECKING:
    from ..checkpoint.gpu import GpuPlacement
from ..supervise import frontend
from ..host import identity, ports, privilege, resources
from ..store import layout, oracle
from ..errors import (
    BusyError,
    CorruptSnapshotError,
    CriuError,
    EngineError,
    EnvironmentProblem,
    IncompatibleHostError,
    InsufficientResources,
    Interrupted,
    OracleMismatchError,
    UsageError,
)
from ..store.manifest import Manifest
from ..report.progress import Reporter
from ..host.cgroups import Placement
from ..store.registry import DRAIN_S, TEARDOWN_S, Entry
from ..report.results import Restored, Verified
from ..effects.protocols import (
    CheckpointTools,
    Clock,
    Engine,
    EngineChannel,
    EngineTools,
    HostTools,
    ModelTools,
    RuntimeTools,
    SnapshotFiles,
    StagedImages,
    UnpackingImages,
)
from ..effects.tools import Tools, local_tools
from .cleanup import report_reclaimed, run_cleanups
from .create import check_access, wake_timeout_s

RESTORE_ORACLE_TIMEOUT_S = 300.0
BIND_TIMEOUT_S = 120.0
HEALTH_POLL_S = 0.05
#: Seconds between two looks at a foreground engine (has it exited? is its grace over?).
FOREGROUND_POLL_S = 0.2
#: Restore's warning for a snapshot made before engines dropped privileges (no engine user).
LEGACY_ROOT_NOTE = ("this snapshot was made before engines ran unprivileged: its engine tree runs as root "
                    "with every capability; re-create it to run as an unprivileged user")


@dataclass
class RestoreRequest:
    """Inputs of :func:`restore`. ``engine_log`` receives the engine's log (foreground)."""

    snapshot: Path
    host: str = "127.0.0.1"
    port: int = 8000
    verify_model: str = "quick"
    allow: frozenset[str] = frozenset()
    detach: bool = False
    log_file: Path | None = None
    engine_log: Callable[[bytes], None] | None = None
    #: front-end option tokens (:mod:`vllm_snapshot.supervise.frontend`: API key, TLS, CORS, ...);
    #: ``VLLM_API_KEY`` of the environment is added by :func:`restore` when no key is given
    frontend: tuple[str, ...] = ()
    #: seconds the engine lets requests in flight finish when it is stopped (SIGTERM, ``stop``):
    #: :func:`vllm_snapshot.store.registry.drain_timeout`
    drain_s: float = DRAIN_S
    #: a socket already listening on ``host:port`` to serve on instead of binding one (a
    #: switch's hand-over: the old engine's own socket); the caller keeps and closes it, and the
    #: port is not probed (it is ours). Only for snapshots whose engine has a network namespace
    #: of its own (``engine.network`` ``isolated``).
    listener: socket.socket | None = None
    #: called with the engine once it took the socket, before ``/health`` and the canary (a
    #: switch's hand-over stops the old engine's accepting there, so both reach the new engine
    #: only); what it raises fails the restore
    on_serving: Callable[[Engine], None] | None = None


_POOL = None


def _pool():
    """One worker thread for checks that overlap staging (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-snapshot-check")
    return _POOL


def validate(snapshot: Path, verify_model: str = "quick", allow: frozenset[str] = frozenset(),
             check_images: bool = False, port: tuple[str, int] | None = None,
             tools: Tools | None = None, pins: list | None = None) -> tuple[Manifest, list[str]]:
    """Every check a restore makes before CRIU, in the order of the module doc (the GPU
    placement included, not whether that GPU is free: the restore decides that under its lock); ``port``
    (host, port) is probed before the model files are re-hashed; ``check_images`` adds every
    image checksum (``verify``); ``pins`` receives the model files' stats as the check saw
    them (:func:`vllm_snapshot.store.model_digest.stat_pins`). Returns (manifest, warnings). Raises UsageError,
    CorruptSnapshotError, IncompatibleHostError, ModelChangedError, BusyError,
    EnvironmentProblem."""
    t = tools or local_tools()
    return _validate(t.host, t.model, t.files, snapshot, verify_model, allow, check_images, port, pins)


def _validate(host: HostTools, model: ModelTools, files: SnapshotFiles, snapshot: Path, verify_model: str = "quick",
              allow: frozenset[str] = frozenset(), check_images: bool = False, port: tuple[str, int] | None = None,
              pins: list | None = None, gpu: list | None = None) -> tuple[Manifest, list[str]]:
    """:func:`validate` over the three roles it uses; ``gpu`` receives the CUDA snapshot's
    :class:`~vllm_snapshot.checkpoint.gpu.GpuPlacement` (nothing for a CPU snapshot)."""
    snapshot = snapshot.absolute()
    m = files.open_snapshot(snapshot)
    try:
        criu.check_flags(m.criu.flags)
    except ValueError as e:
        raise CorruptSnapshotError(f"{snapshot}: the manifest's CRIU flags are not restorable by this tool: {e}",
                                   hint="re-create the snapshot with this version of vllm-snapshot") from e
    here = host.host_identity(m.engine.kind)
    pulled = files.pulled_from(snapshot)  # pulled from a registry: any machine of its host class restores it
    try:
        diffs = identity.compare(m.host, here, allow, machine=pulled is None)
    except ValueError as e:
        raise UsageError(str(e)) from e
    warnings = [f"identity override: {d}" for d in diffs if d.overridden]
    hard = [d for d in diffs if not d.overridden]
    if hard:
        raise IncompatibleHostError(
            "this host differs from the one the snapshot was created on:\n  " + "\n  ".join(map(str, hard)),
            hint="restore on a matching host, or re-create the snapshot here",
            details=[d.__dict__ for d in hard])
    if "gpu_uuid_used" in m.host:  # the GPU its state goes onto: the recorded one, else one of its model, remapped
        from ..checkpoint import gpu as gpus

        recorded = m.host["gpu_uuid_used"]
        # the recorded GPU here: known from the driver's /proc files, without running nvidia-smi
        placed = (gpus.GpuPlacement(recorded, recorded) if recorded in host.gpu_uuids()
                  else gpus.place(m.host, host.gpu_slots()))
        if gpu is not None and placed is not None:
            gpu.append(placed)
    if m.engine.user is None:
        missing = files.caps_missing(snapshot, m)
        if missing:  # CRIU would log "Unable to restore capabilities" and hang (docs/operations.md)
            raise EnvironmentProblem(
                f"this snapshot's engine runs as root with capabilities this restore does not have "
                f"({', '.join(map(privilege.cap_name, missing))}; e.g. a systemd CapabilityBoundingSet=): CRIU "
                "could not give them back", hint="re-create the snapshot (engines now run unprivileged, with no capability), "
                                       "or restore it outside the narrower bounding set")
        warnings.append(LEGACY_ROOT_NOTE)
    else:
        who = host.user_problems(m.engine.user)
        if who:
            u = m.engine.user
            raise IncompatibleHostError(
                f"the snapshot's engine runs as {u.name} (uid {u.uid}, gid {u.gid}), which is not the same user "
                "on this host:\n  " + "\n  ".join(who),
                hint=f"give {u.name} uid {u.uid} and gid {u.gid} again (e.g. useradd --system --uid {u.uid} "
                     f"--gid {u.gid} {u.name}), or re-create the snapshot on this host",
                details={"engine_user": who})
    mount_problems = host.check_external_mounts(m.criu.external_mounts)
    if mount_problems:
        raise IncompatibleHostError(
            "mounts the snapshot binds from the host differ:\n  " + "\n  ".join(mount_problems),
            hint="mount the same file systems at the same places, or re-create the snapshot",
            details={"mounts": mount_problems})
    if port is not None:
        host.port_free(*port)
    if check_images:
        files.verify_images(snapshot, m)
    # the weights file the engine maps (a CPU snapshot's weights are not in its images):
    # missing or changed refuses now, naming it (CRIU would map whatever is at that path)
    files.check_weights(m, full=verify_model == "full")
    problems = files.check_tree_files(m)
    if problems:
        raise IncompatibleHostError(
            "files the engine had open or mapped changed since the snapshot was created:\n  " + "\n  ".join(problems),
            hint="restore with the same venv/libraries, or re-create the snapshot")
    # files the snapshot carries: their stored copies verified (a damaged one refuses, naming
    # the file); missing or replaceable ones are put back right before CRIU; what cannot be
    # (another owner's file differs, a live process holds a differing one) refuses now
    refused = carry.refusal(files.plan_carried(snapshot, m))
    if refused is not None:
        raise refused
    if pins is not None:  # before the check: a change made after it shows in the stat
        pins.extend(model.model_stats(Path(m.model.path), m.model.files))
    model.verify_model(Path(m.model.path), m.model.files, verify_model)  # added files: refused or ignored
    if m.engine.user is not None:  # as create refuses: a level-2 wake reloads the weights as that user
        model_dir = Path(m.model.path)
        check_access(m.engine.user, model_dir, {"model": host.unreadable_by(m.engine.user, [model_dir])})
    return m, warnings


def raise_code_changed(problems: list[str]) -> None:
    """Raise IncompatibleHostError when the code identity check found ``problems``."""
    if problems:
        raise IncompatibleHostError(
            "Python files the engine imports from changed since the snapshot was created "
            "(a restored engine would import them):\n  " + "\n  ".join(problems),
            hint="reinstall the recorded versions (`vllm-snapshot inspect` lists them), or re-create the snapshot",
            details={"code": problems})


@contextmanager
def _damaged_hint(snapshot: Path) -> Iterator[None]:
    """A CorruptSnapshotError (exit 5: an image failing its checksum, a manifest that is not
    JSON, ...) raised without a hint gets one: delete and re-create, or pull again."""
    try:
        yield
    except CorruptSnapshotError as e:
        if e.hint is None:
            e.hint = layout.damaged_hint(snapshot)
        raise


def verify(snapshot: Path, allow: frozenset[str] = frozenset(), tools: Tools | None = None) -> Verified:
    """``verify``: :func:`validate` with every image checksum and a full model re-hash, under
    the snapshot's shared lock. Returns :class:`Verified`."""
    t = tools or local_tools()
    snapshot = t.store.canonical(snapshot)
    with _damaged_hint(snapshot), t.store.snapshot_lock(snapshot, shared=True):
        m, warnings = _validate(t.host, t.model, t.files, snapshot, "full", allow, check_images=True)
        raise_code_changed(t.files.check_code(snapshot, m))
        try:  # what it re-checked passes now (e.g. the weights file put back): list stops showing the old ✗
            cleared = t.store.clear_refusal(snapshot, VERIFY_RECHECKS)
        except OSError:  # bookkeeping only
            cleared = None
    return Verified(str(snapshot), len(m.images), len(m.model.files), warnings, m.weights.path if m.weights else None,
                    cleared)


#: The refusal codes whose causes ``verify`` re-checks in full (host, mounts, files, images,
#: model, weights, code): a pass clears such a recorded refusal. An oracle mismatch, a CRIU or an
#: engine failure is re-checked only by a restore, which clears any refusal when it serves.
VERIFY_RECHECKS = frozenset({"incompatible-host", "model-changed", "corrupt-snapshot"})


#: ``details["stage"]`` of an EngineError raised after the oracle matched, while the engine
#: started its HTTP server: what fails there is the front-end options' (TLS, ...) or the host's,
#: not the snapshot's, so ``serve`` does not hold it against the snapshot.
SERVER_START = "server-start"


def _exited_while_serving(et: EngineTools, engine: Engine, log_file: Path | None) -> EngineError:
    """The error for an engine that died between the bind and ``/health``: the last lines of
    its log (a detached engine's is ``log_file``: our end of its log pipe is /dev/null) and
    where the whole log is (``details``: ``{"stage": SERVER_START, "log": path or None}``)."""
    tail = engine.log_tail()
    if log_file is not None:
        from_file = et.read_log_tail(log_file)
        tail = tail if from_file is None else from_file
    return EngineError("engine exited while starting the server" + (f"; its log ends:\n{tail}" if tail.strip() else ""),
                       hint=f"full engine log: {log_file}" if log_file is not None else None,
                       details={"stage": SERVER_START, "log": str(log_file) if log_file is not None else None})


def restore(req: RestoreRequest, rep: Reporter, tools: Tools | None = None) -> tuple[Restored, Engine]:
    """Validate, stage, CRIU-restore, replay the oracle inside the engine, and only then bind
    ``host:port`` and serve; then a canary request over HTTP. Returns the result and the live
    engine handle (foreground: :func:`serve_foreground`; detached: close it). Fails closed: on
    any error the restored tree is killed, the port is released, staging is removed, the
    snapshot is untouched. Raises the errors of :func:`validate`, BusyError, CriuError,
    EngineError, OracleMismatchError."""
    t = tools or local_tools()
    t.host.require_root()
    criu.env_timeout(t.host.environ())  # a bad $VLLM_SNAPSHOT_CRIU_TIMEOUT is a usage error now, not after minutes
    snapshot = t.store.canonical(req.snapshot)
    served = False
    try:
        with _damaged_hint(snapshot), t.store.snapshot_lock(snapshot, shared=True):
            r, engine = _restore_locked(t, req, rep, snapshot)
        served = True
        # signals are held from the moment the engine serves validated (hold_signals in
        # _restore_locked): the registry must learn of an engine that keeps running
        try:
            t.runtime.register(Entry(snapshot=str(snapshot), pid=r.pid, supervisor_pid=0 if req.detach else os.getpid(),
                             host=req.host, port=req.port, started_at=t.clock.now(),
                             mode="detached" if req.detach else "foreground",
                             scheme=r.url.split(":", 1)[0], cgroup=r.cgroup, frontend=r.frontend_fp, auth=r.auth,
                             drain_s=req.drain_s,
                             frontend_args=tuple(frontend.without_secrets(list(req.frontend))),
                             log_file=r.log_file))
            t.store.record_restore(snapshot, [w for w in r.warnings if w.startswith("identity override")])
        except OSError as e:  # bookkeeping only: never fail a served restore for it
            rep.info(f"could not record the engine in the registry: {e}")
    finally:
        if served and not req.detach:  # foreground: a signal that came meanwhile stops it now (it dies with us)
            t.runtime.release_signals()
    return r, engine


@dataclass
class _Restoring:
    """What a restore holds between its phases, and what a failure must undo: each phase sets
    what it made, the cleanup (:func:`_undo`) reads it."""

    snapshot: Path
    m: Manifest | None = None
    stage: Path | None = None
    checking: StagedImages | None = None
    placed: list[Path] = field(default_factory=list)
    channel: EngineChannel | None = None
    engine: Engine | None = None
    code_check: Future | None = None
    placement: Placement | None = None
    gpu_held: ExitStack = field(default_factory=ExitStack)  # CUDA: the GPU's lock until the engine woke
    gpu: GpuPlacement | None = None  # CUDA: the GPU the state goes onto (validation placed it)

    @property
    def gpu_uuid(self) -> str:
        """The UUID of the GPU the state goes onto ("" for a CPU snapshot)."""
        return self.gpu.target if self.gpu is not None else ""


def _restore_locked(t: Tools, req: RestoreRequest, rep: Reporter, snapshot: Path) -> tuple[Restored, Engine]:
    """The phases of a restore, in order: validate -> stage -> CRIU -> adopt and verify ->
    serve; any failure undoes what the phases made (:func:`_undo`)."""
    report_reclaimed(rep, t.store.reclaim(snapshot.parent))
    with rep.phase("validate", "validating snapshot, host and model"):
        m, warnings, fe, pins, log_file, placed = _validate_request(t, req, snapshot)
    for w in warnings:
        rep.info(w)
    if placed is not None and placed.remapped:
        rep.info(f"the snapshot's GPU {placed.recorded} is not on this host: restoring its GPU state onto "
                 f"GPU {placed.target} (/dev/nvidia{placed.minor}, the same model and device minor), remapped")
    st = _Restoring(snapshot, m, gpu=placed)
    try:
        return _restore_phases(t, req, rep, st, m, warnings, fe, pins, log_file)
    except CorruptSnapshotError as e:  # an image or a saved file failed its checksum: mark it for list/prune
        line = e.message.splitlines()[0]  # the verdict; not what else had failed already (CRIU's excerpt)
        try:
            t.store.record_refusal(snapshot, e.code, line, by="restore")
        except OSError as err:  # bookkeeping only
            rep.info(f"could not record the refusal of {snapshot.name}: {err}")
        raise


def _restore_phases(t: Tools, req: RestoreRequest, rep: Reporter, st: _Restoring, m: Manifest, warnings: list[str],
                    fe, pins: list, log_file: Path | None) -> tuple[Restored, Engine]:
    """Stage -> CRIU -> adopt and verify -> serve, after validation; undoes what they made on
    any failure."""
    snapshot = st.snapshot
    try:
        _stage(t.files, t.checkpoint, rep, st)
        pid = _criu_restore(t.host, t.engine, t.checkpoint, t.runtime, req, rep, st, log_file)
        _adopt_and_verify(t.engine, t.checkpoint, t.files, t.model, t.clock, req, rep, st, pid, pins)
        url = _serve_verified(t.engine, t.clock, req, rep, st, fe, log_file)
        t.runtime.hold_signals()  # serving, validated: see restore()
        placement = st.placement
        return Restored(str(snapshot), pid, url, m.model.served_name, dict(rep.timings), warnings, req.detach,
                        tuple(fe.describe()), placement.cgroup if placement and placement.leaves else "",
                        frontend.fingerprint(fe.args), bool(fe.api_keys), req.drain_s,
                        st.gpu.describe() if st.gpu is not None else "",
                        str(log_file) if req.detach and log_file is not None else ""), st.engine
    except BaseException as e:
        _undo(t.files, t.checkpoint, st, e)
        raise


def _validate_request(t: Tools, req: RestoreRequest, snapshot: Path):
    """Phase 1, before anything is staged: the front-end options (values and files), every
    check of :func:`validate` (the port before the model), the TLS files readable to the engine
    user, the memory the engine will need, the log file. Returns (manifest, warnings, front
    end, the model files' stats as checked, log file or None, the GPU placement or None)."""
    fe = frontend.check(list(req.frontend), t.host.environ())  # the options' values and files, before CRIU
    pins: list = []  # the model files' stats as checked: a level-2 wake reloads from them
    placed: list = []
    m, warnings = _validate(t.host, t.model, t.files, snapshot, req.verify_model, req.allow,
                            port=None if req.listener is not None else (req.host, req.port), pins=pins, gpu=placed)
    if fe.files and m.engine.user is not None:  # the unprivileged engine opens them when it serves
        unreadable = t.host.unreadable_by(m.engine.user, [Path(p) for p in fe.files])
        if unreadable:
            u = m.engine.user.name
            raise UsageError(f"the engine runs as {u}, which cannot read the TLS files:\n  " + "\n  ".join(unreadable),
                             hint=f"make them readable to {u} only, e.g. `chgrp {u} FILE && chmod 0640 FILE`, and "
                                  f"every directory above them searchable to it (e.g. `setfacl -m u:{u}:x DIR`)")
    short = resources.check(m.sizes["raw"], t.host.memory_offer(req.detach))
    if short:
        raise InsufficientResources(short, hint="free memory (stop other engines: vllm-snapshot status / stop), "
                                                "raise the memory limit of the cgroup, or restore on a larger host")
    log_file = None
    if req.detach:
        if req.log_file is not None:
            t.engine.check_log_file(req.log_file)
        log_file = req.log_file or t.engine.default_log_file(snapshot, req.port)
    return m, warnings, fe, pins, log_file, (placed[0] if placed else None)


def _stage(files: SnapshotFiles, cp: CheckpointTools, rep: Reporter, st: _Restoring) -> None:
    """Phase 2: (CUDA: the GPU's lock) the code identity check started alongside, the images
    staged with their checksums verified in the background, link-remap files put back."""
    m = st.m
    if m.engine.kind == "cuda":
        # before staging (a waiter holds no staged images in RAM) and before the CRIU lock (a
        # waiter never blocks restores onto other GPUs); held until the engine has woken
        st.gpu_held.enter_context(cp.gpu_lock(st.gpu_uuid, rep.info))
    # the code identity check (0.1-0.6 s of stat calls) runs alongside staging, CRIU and the
    # oracle, like the image checksums; it is decided with them, before anything is bound
    st.code_check = _pool().submit(files.check_code, st.snapshot, m)
    with rep.phase("stage", "staging images (checksums verified alongside CRIU)"):
        st.stage, st.checking = files.stage_checking(st.snapshot, m)
        st.placed = cp.put_back_remaps(st.snapshot, m)


def _criu_restore(host: HostTools, et: EngineTools, cp: CheckpointTools, rt: RuntimeTools, req: RestoreRequest,
                  rep: Reporter, st: _Restoring, log_file: Path | None) -> int:
    """Phase 3: a fresh channel, then under the host-wide CRIU lock: (host-network snapshots)
    their loopback listeners free, the GPU's room, (detached) a cgroup of its own, CRIU restore
    (a compressed snapshot's pages unpacked before CRIU reads them). Returns the root's PID."""
    m = st.m
    isolated = m.engine.network == "isolated"
    st.channel = et.new_channel(log_file)
    with cp.criu_lock():
        # Host-network snapshots (made before engines had a network namespace of their
        # own): checked under the host-wide CRIU lock, so a concurrent restore of the same
        # snapshot that just bound them is seen: refuse before CRIU would fail on them.
        taken = [] if isolated else host.listeners_taken(m.criu.listeners)
        if taken:
            raise BusyError(
                f"loopback ports the engine tree listened on at snapshot time ({len(m.criu.listeners)}) "
                "are taken (another engine restored from this snapshot?):\n  " + "\n  ".join(taken),
                hint="stop the engine holding them (vllm-snapshot status / stop), or re-create the snapshot")
        opts = criu.RestoreOptions(flags=m.criu.flags, inherit_fds=st.channel.inherit_fds(m.criu.inherit),
                                   external=mountpolicy.restore_args(m.criu.external_mounts),
                                   network_lock=criu.NETWORK_LOCK_ISOLATED if isolated else None)
        cp.check_gpu_capacity(m, st.gpu_uuid)  # CUDA: the GPU has room (after switch stopped the old engine)
        if m.carried is not None and m.carried.files:
            # under the CRIU lock: no other restore replaces a carried file between this
            # put-back and this CRIU (checkpoint/carry.py)
            with rep.phase("carried", "putting back the files the snapshot carries where missing"):
                written = cp.put_back_carried(st.snapshot, m)
            if written:
                rep.info(f"put back {len(written)} of the {len(m.carried.files)} files the snapshot carries "
                         f"(e.g. {written[0]})")
        if req.detach:  # a cgroup of its own: it must outlive whoever launched it (cgroups module doc)
            st.placement = rt.engine_cgroup(f"{st.snapshot.name}-{req.port}")
            if st.placement.skipped:
                rep.info("the engine stays in this command's cgroup in: " + ", ".join(st.placement.skipped))
        # A compressed snapshot's memory pages images are still being unpacked (and
        # verified, frame by frame): CRIU waits for them once the tree's namespaces exist,
        # before any task maps its memory; a tree without namespaces waits before CRIU.
        unpacking = st.checking if isinstance(st.checking, UnpackingImages) else None
        ready = unpacking.ready if unpacking is not None else None
        if ready is not None and not isolated:
            with rep.phase("unpack", "unpacking the memory images"):
                ready()
            ready = None
        with rep.phase("criu_restore", "CRIU restore"):
            if st.placement is not None:
                st.placement.enter()  # CRIU and every process it forks are born there
            try:
                pid = cp.restore_tree(m.engine.kind, opts, st.stage, before_memory=ready, cuda_pids=m.criu.cuda_pids,
                                      gpu_map=st.gpu.pairs if st.gpu is not None else ())
            finally:
                if st.placement is not None:
                    st.placement.leave()
        if ready is not None:  # CRIU held for the unpacking: its own phase (timings add up)
            waited = round(unpacking.waited_s, 3)
            rep.timings["criu_restore"] = round(rep.timings.get("criu_restore", 0.0) - waited, 3)
            rep.timings["unpack_wait"] = waited
    return pid


def _adopt_and_verify(et: EngineTools, cp: CheckpointTools, files: SnapshotFiles, model: ModelTools, clock: Clock,
                      req: RestoreRequest, rep: Reporter, st: _Restoring, pid: int, pins: list) -> None:
    """Phase 4: adopt the tree; it is the recorded one (processes, root, credentials); attach;
    staging and link-remap files removed; (sleep level: wake; level 2: the model re-checked);
    the oracle inside the engine; the images' checksums and the code identity decided."""
    m = st.m
    st.engine = engine = et.adopt(pid, st.channel, None if req.detach else req.engine_log)
    st.channel = None
    got_tree = cp.tree_commands(pid)
    if len(got_tree) != len(m.criu.tree_pids) or got_tree[:1] != m.criu.tree_commands[:1]:
        raise CriuError(
            f"CRIU restored a tree that is not the recorded one: {len(got_tree)} processes "
            f"(recorded {len(m.criu.tree_pids)}), root {got_tree[:1] or ['gone']} "
            f"(recorded {list(m.criu.tree_commands[:1])}); stopped it",
            hint="re-run the restore; if it repeats, re-create the snapshot")
    if m.engine.user is not None:  # CRIU restores the dumped credentials: check, never assume
        u = m.engine.user
        wrong = privilege.tree_problems(cp.tree_creds(pid), u.uid, u.gid, u.groups)
        if wrong:
            raise CriuError("the restored tree does not run with the recorded credentials "
                            f"({m.engine.user.name}, no capability, NoNewPrivs); stopped it:\n  "
                            + "\n  ".join(wrong[:10]), hint="re-create the snapshot with this CRIU")
    engine.send("attach")  # from now on the tree dies with us until `serve` decides
    engine.wait_event("attached", RESTORE_ORACLE_TIMEOUT_S)
    files.unstage(st.stage)
    st.stage = None
    try:  # CRIU consumed them; never leave ours behind (a leftover is harmless: warn)
        cp.cleanup_remaps(st.placed)
        st.placed = []
    except OSError as e:
        rep.info(f"could not remove link-remap files put back for CRIU: {e}")
    if m.engine.sleep_level:
        with rep.phase("wake", "waking engine (reload weights, reset prefix cache)"):
            reload_since_ns = int(clock.now() * 1e9)
            engine.send("wake")
            engine.wait_event("woken", wake_timeout_s(m))
            if m.engine.sleep_level >= 2:  # it read the weights from disk: still the checked ones?
                model.recheck_model(Path(m.model.path), tuple(pins), reload_since_ns,
                                    during="since restore checked them (the wake reloaded the weights from them)",
                                    hint="nothing serves; keep the model directory unchanged while restoring and "
                                         "restore again (if the change is meant, re-create the snapshot)")
    st.gpu_held.close()  # the engine holds its GPU memory now: another restore's capacity check sees it
    with rep.phase("oracle", "replaying the oracle inside the engine"):
        engine.send("oracle")
        got = oracle.Oracle.model_validate(engine.wait_event("oracle", RESTORE_ORACLE_TIMEOUT_S)["oracle"])
        diffs = oracle.compare(m.oracle, got)
        if diffs:
            raise OracleMismatchError("the restored engine's oracle differs; refusing to serve:\n  " + "\n  ".join(diffs),
                                      details={"expected": m.oracle.model_dump(), "actual": got.model_dump()})
    # The decision on the images' checksums, verified while CRIU and the oracle ran: before
    # anything is bound (a mismatch kills the restored tree; nothing unverified is served).
    with rep.phase("checksums", "image checksums"):
        st.checking.wait()
        st.checking = None
    with rep.phase("code_check", "checking the Python files the engine imports from"):
        raise_code_changed(st.code_check.result())


def _serve_verified(et: EngineTools, clock: Clock, req: RestoreRequest, rep: Reporter, st: _Restoring, fe,
                    log_file: Path | None) -> str:
    """Phase 5, only after everything was verified: bind ``host:port`` (isolated: here, handed
    to the engine), ``/health``, the HTTP canary. Returns the URL served."""
    m, engine = st.m, st.engine
    url = ports.url(req.host, req.port, fe.scheme)
    with rep.phase("bind", f"binding {ports.fmt_addr(req.host, req.port)}"):
        if m.engine.network == "isolated":  # bound here, in the host's namespace, and handed to the engine
            et.serve_engine(engine, req.host, req.port, die_with_parent=not req.detach, frontend=tuple(fe.args),
                            drain_s=req.drain_s, listener=req.listener)
        elif req.listener is not None:
            raise UsageError(f"{st.snapshot.name} binds its port itself (made before engines had a network "
                             "namespace of their own): it cannot take over a listening socket")
        else:
            engine.send("serve", host=req.host, port=req.port, die_with_parent=not req.detach, frontend=fe.args,
                        drain_s=req.drain_s)
        engine.wait_event("binding", BIND_TIMEOUT_S)
    if req.on_serving is not None:
        req.on_serving(engine)
    with rep.phase("http_ready", "waiting for the HTTP server (/health)"):
        deadline = clock.monotonic() + BIND_TIMEOUT_S
        while not et.http_health(url):
            if not engine.alive():
                raise _exited_while_serving(et, engine, log_file)
            if clock.monotonic() > deadline:
                raise EngineError(f"server did not become healthy within {BIND_TIMEOUT_S:.0f} s",
                                  details={"stage": SERVER_START})
            clock.sleep(HEALTH_POLL_S)
    with rep.phase("canary", "canary request over HTTP"):
        diffs = et.http_canary(url, m, fe.api_keys[0] if fe.api_keys else None)
        if diffs:
            raise OracleMismatchError("the HTTP canary differs from the oracle; stopped the engine:\n  " + "\n  ".join(diffs))
    return url


def _undo(files: SnapshotFiles, cp: CheckpointTools, st: _Restoring, e: BaseException) -> None:
    """After a failed phase: stop the tree, close the channel, remove staging and link-remap
    files, the cgroup, release the GPU lock; the checksums' verdict names corrupt images as
    the cause of a failure they may explain (then raised instead of ``e``, chained to it)."""
    if st.code_check is not None:
        st.code_check.cancel()
    steps = []
    if st.engine is not None:
        eng = st.engine
        steps += [("stop the restored engine", eng.kill), ("close the engine channel", eng.close)]
    if st.channel is not None:
        steps.append(("close the channel", st.channel.close))
    # by owner PID, not by the variable: a signal can land between a staging dir's
    # creation and the assignment that remembers it
    steps.append(("remove the staging dirs of this restore", lambda: files.unstage_all(st.snapshot.parent)))
    steps.append(("remove link-remap files put back", lambda: cp.cleanup_remaps(st.placed)))
    if st.placement is not None:
        steps.append(("remove the engine's cgroup", st.placement.remove))
    steps.append(("release the GPU lock", st.gpu_held.close))  # after the tree (and its GPU memory) is gone
    corrupt: list[CorruptSnapshotError] = []
    if st.checking is not None:
        if isinstance(e, Exception) and not isinstance(e, Interrupted):
            # a failure while the checksums were still being verified (CRIU, the engine, the
            # oracle) may come from corrupt images: their verdict names the cause
            pending = st.checking

            def verdict() -> None:
                try:
                    pending.wait()
                except CorruptSnapshotError as ce:
                    if ce is not e:  # an Unpacking's ready() raised it: it is e already
                        corrupt.append(ce)

            steps.append(("finish the checksum verification", verdict))
        else:  # interrupted: stop it
            steps.append(("stop the checksum verification", st.checking.cancel))
    run_cleanups(e, steps)
    if corrupt:
        ce = corrupt[0]
        ce.message = f"{ce.message}\n(the restore had already failed: {type(e).__name__}: {e}; the restored tree was stopped)"
        ce.args = (ce.message,)
        raise ce from e


def serve_foreground(r: Restored, engine: Engine, on_signal_msg: Callable[[str], None] | None = None,
                     stop_grace_s: float | None = None, tools: Tools | None = None) -> int:
    """Block until the restored engine exits; every SIGINT/SIGTERM/SIGHUP (a closed terminal)
    is forwarded to it as SIGTERM: the first makes it drain (no new connection, requests in flight finish within
    ``r.drain_s`` seconds) and exit 0, a second cuts the drain short. SIGKILL after
    ``stop_grace_s`` seconds from the first signal (default ``r.drain_s`` + the engine's
    teardown time, :data:`vllm_snapshot.store.registry.TEARDOWN_S`). Returns the engine's exit code
    (137 when it had to be killed); unregisters it. An engine that ends by itself with a
    status other than 0 (killed, crashed) while no signal asked it to stop raises
    EngineError (exit 8) naming its PID, the signal or status and where its log is
    (:func:`died_while_serving`); one stopped by ``vllm-snapshot stop`` exits 0 and returns 0."""
    t = tools or local_tools()
    return _serve_until_exit(t.runtime, t.clock, r, engine, on_signal_msg,
                             r.drain_s + TEARDOWN_S if stop_grace_s is None else stop_grace_s)


def _signame(signum: int) -> str:
    """``SIGINT`` for 2; ``signal N`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def how_it_ended(code: int) -> tuple[str, str | None]:
    """(in words, signal name or None) for an engine root's exit code as ``reap`` gives it
    (a signal N is ``128 + N``): ``("killed by SIGKILL (exit status 137)", "SIGKILL")``,
    ``("exited with status 3", None)``."""
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = None
        if name is not None:
            return f"killed by {name} (exit status {code})", name
    return f"exited with status {code}", None


def died_while_serving(r: Restored, code: int) -> EngineError:
    """The error for a foreground engine that ended while serving without being asked to
    (no signal to the command): its PID, what ended it (``code`` as ``reap`` gives it: a
    signal N is ``128 + N``) and where its log is (the command's stderr: the journal under
    systemd). ``details``: ``{"stage": "serving", "pid", "exit_status", "signal", "log": None}``."""
    said, sig = how_it_ended(code)
    return EngineError(
        f"the engine (PID {r.pid}) serving {r.served_name} on {r.url} ended while serving: {said}; "
        "it was not stopped through this command",
        hint="its log is the output above (stderr; under systemd: `journalctl -u UNIT`); "
             + ("a SIGKILL nobody sent by hand is often the kernel's OOM killer: `dmesg | grep -i oom`"
                if sig == "SIGKILL" else "its last lines say why"),
        details={"stage": "serving", "pid": r.pid, "exit_status": code, "signal": sig, "log": None})


def _serve_until_exit(rt: RuntimeTools, clock: Clock, r: Restored, engine: Engine,
                      on_signal_msg: Callable[[str], None] | None, stop_grace_s: float) -> int:
    """:func:`serve_foreground` over its two roles: signals and the registry (``rt``), time."""
    stopping: dict[str, float | None] = {"at": None}

    def _fwd(signum: int) -> None:
        if on_signal_msg:
            # by name (a trial's Ctrl-C read as "signal 15": the engine's own line names the
            # SIGTERM it is sent, this one what the command received)
            on_signal_msg(f"received {_signame(signum)}; stopping the engine" + (
                f" (draining: requests in flight may finish for up to {r.drain_s:g} s)" if stopping["at"] is None
                else " now (requests still in flight are cut)"))
        stopping["at"] = stopping["at"] or clock.monotonic()
        rt.terminate(engine.root_pid)

    try:
        with rt.forward_signals(_fwd):
            while True:
                code = engine.reap(block=False)
                if code is not None:
                    break
                at = stopping["at"]
                if at and clock.monotonic() - at > stop_grace_s:
                    engine.kill()
                    code = 128 + signal.SIGKILL
                    break
                clock.sleep(FOREGROUND_POLL_S)
            engine.drain_log(5.0)  # stragglers of the namespace die with its init
            if stopping["at"] is None and code != 0:
                raise died_while_serving(r, code)
            return code
    finally:
        engine.close()
        rt.unregister(r.pid)
