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
import socket
from contextlib import ExitStack
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..checkpoint import carry, criu, mountpolicy

if TYPE_CHECKING:
    from ..checkpoint.gpu import GpuPlacement
from ..supervise import frontend
from ..host import identity, ports, privilege, resources
from ..store import layout, oracle
from .. import units
from ..errors import (
    BusyError,
    CorruptSnapshotError,
    CriuError,
    EngineError,
    InsufficientResources,
    Interrupted,
    OracleMismatchError,
    UsageError,
    q,
)
from ..store.manifest import Manifest
from ..report.progress import Reporter
from ..host.cgroups import Placement
from ..store.registry import DRAIN_S, Entry
from ..report.results import Restored
from ..effects.protocols import (
    CheckpointTools,
    Clock,
    EngineTools,
    HostTools,
    ModelTools,
    RuntimeTools,
    SnapshotFiles,
)
from ..effects.handles import Engine, EngineChannel, StagedImages, UnpackingImages
from ..effects.tools import Tools, local_tools
from .cleanup import report_reclaimed, run_cleanups
from .create import wake_timeout_s
# the checks before CRIU and the foreground server live beside restore; their names are restore's too
from .foreground import died_while_serving, how_it_ended, serve_foreground  # noqa: F401
from .validate import damaged_hint, raise_code_changed, validate, validate_roles, verify  # noqa: F401

RESTORE_ORACLE_TIMEOUT_S = 300.0
BIND_TIMEOUT_S = 120.0
#: a detached engine's log file on a filesystem with less free than this (bytes) is warned about:
#: an engine writes a few MiB of log lines in its first hours (vLLM's periodic stats, requests)
LOG_ROOM_MIN = 8 * 1024 * 1024
HEALTH_POLL_S = 0.05

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
    #: start CRIU's restore KSM-mergeable (``--merge-pages``): every anonymous mapping of the
    #: restored tree may then be merged with identical pages of other processes by ksmd, when
    #: the host runs KSM (:mod:`vllm_snapshot.checkpoint.criu.merge`)
    merge_pages: bool = False


_POOL = None


def _pool():
    """One worker thread for checks that overlap staging (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-snapshot-check")
    return _POOL


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
        with damaged_hint(snapshot), t.store.snapshot_lock(snapshot, shared=True):
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
                        str(log_file) if req.detach and log_file is not None else "", req.merge_pages), st.engine
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
    m, warnings = validate_roles(t.host, t.model, t.files, snapshot, req.verify_model, req.allow,
                            port=None if req.listener is not None else (req.host, req.port), pins=pins, gpu=placed)
    if fe.files and m.engine.user is not None:  # the unprivileged engine opens them when it serves
        unreadable = t.host.unreadable_by(m.engine.user, [Path(p) for p in fe.files])
        if unreadable:
            u = m.engine.user.name
            raise UsageError(f"the engine runs as {u}, which cannot read the TLS files:\n  " + "\n  ".join(unreadable),
                             hint=f"make them readable to {u} only, e.g. `chgrp {q(u)} FILE && chmod 0640 FILE`, and "
                                  f"every directory above them searchable to it (e.g. `setfacl -m u:{q(u)}:x DIR`)")
    short = resources.check(m.sizes["raw"], t.host.memory_offer(req.detach))
    if short:
        raise InsufficientResources(short, hint="free memory (stop other engines: vllm-snapshot status / stop), "
                                                "raise the memory limit of the cgroup, or restore on a larger host")
    log_file = None
    if req.detach:
        if req.log_file is not None:
            t.engine.check_log_file(req.log_file)
        log_file = req.log_file or t.engine.default_log_file(snapshot, req.port)
        room = t.engine.log_room(log_file)
        if room is not None and room < LOG_ROOM_MIN:
            warnings = [*warnings, f"the engine log {log_file} is on a filesystem with {units.human_bytes(room)} free: "
                                   "the engine's log lines will be lost once it is full (free space there, or "
                                   "restore again with --log-file on another filesystem)"]
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
                                   network_lock=criu.NETWORK_LOCK_ISOLATED if isolated else None,
                                   merge_pages=req.merge_pages)
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
        from_file = m.weights is not None and m.weights.use == "wake"  # checked before CRIU; written once, never changed
        with rep.phase("wake", "waking engine (weights from the weights file, reset prefix cache)" if from_file
                       else "waking engine (reload weights, reset prefix cache)"):
            reload_since_ns = int(clock.now() * 1e9)
            engine.send("wake")
            engine.wait_event("woken", wake_timeout_s(m))
            if m.engine.sleep_level >= 2 and not from_file:  # it read the weights from disk: still the checked ones?
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
