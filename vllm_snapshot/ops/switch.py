"""``switch``: serve another snapshot on a port without leaving it dark by mistake and without
cutting an accepted request -- the target validated first, then a hand-over of the listening
socket (both engines at once) or, when that cannot be, stop-then-restore with a rollback. The
old engines drain in a thread of their own (:class:`_Stopping`) while the target restores."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TypedDict

from ..store import layout
from ..errors import BusyError, CorruptSnapshotError, Interrupted, SnapshotError, UsageError
from ..report.progress import Reporter
from ..store.registry import Entry
from ..report.results import Switched
from ..effects.protocols import Clock, HostTools, RuntimeTools
from ..effects.tools import Tools, local_tools
from .restore import RestoreRequest, restore, validate


class OldEngine(TypedDict):
    """An engine a failed ``switch`` stopped, as its error's ``details["stopped"]`` lists it:
    root ``pid``, ``snapshot`` (path), ``host`` and ``port`` it served."""

    pid: int
    snapshot: str
    host: str
    port: int


class _Stopping:
    """The old engines of a ``switch`` being stopped in a thread of their own: each drains (no
    new connection, requests in flight finish, for at most ``drain_s`` seconds) while the next
    engine is restored. ``wait()`` joins it; ``reports`` holds each engine's StopReport."""

    def __init__(self, rt: RuntimeTools, old: list[Entry], drain_s: float | None) -> None:
        import threading

        self.reports: list = []
        self.error: BaseException | None = None
        self._began = threading.Event()

        def run() -> None:
            self._began.set()
            try:
                for e in old:
                    self.reports.append(rt.stop_engine(e, drain_s))
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self.error = e

        self._thread = threading.Thread(target=run, name="vllm-snapshot-drain", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> list:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.reports

    def wait_closed(self, net: HostTools, clock: Clock, pid: int, sock) -> None:
        """Until process ``pid`` (the old engine's root) has closed its descriptor of the shared
        listening socket ``sock`` (it accepts no more: what is queued goes to the new engine),
        or the old engines are gone."""
        self._began.wait()
        while not self.done() and net.holds_socket(pid, sock):
            clock.sleep(0.01)

    def wait_port(self, net: HostTools, clock: Clock, host: str, port: int) -> None:
        """Until ``host:port`` can be bound (the old engines closed their listening sockets:
        they drain now) or they are gone."""
        self._began.wait()
        while not self.done():
            try:
                net.port_free(host, port)
                return
            except BusyError:
                clock.sleep(0.05)


def switch(snapshot: Path, host: str | None, port: int, log_file: Path | None, rep: Reporter,
           rollback: bool = True, tools: Tools | None = None, frontend: tuple[str, ...] = (),
           drain_s: float | None = None, handover: bool = True, merge_pages: bool = False) -> Switched:
    """Serve ``snapshot`` on ``port`` instead of whatever serves there, never leaving the port
    dark by mistake and never cutting an accepted request:

    0. the port's lock is taken (:func:`vllm_snapshot.store.locks.port_lock`): a second switch of the
       same port waits, saying for whom, and then replaces the first one's engine;
    1. the target is validated first (everything restore checks before CRIU except the port,
       which the old engine still holds, and the image checksums, checked below before the old
       engine is touched): a typo, a changed model, an incompatible or damaged snapshot refuse
       here and the old engine keeps serving;

    then, as a **hand-over** (``handover``, the default) when one engine serves the port on the
    same address, the target's engine has a network namespace of its own and both engines fit
    at once (:func:`handover_blocker`: host memory, and GPU memory for a CUDA target):

    2h. the target is restored detached while the old engine serves, and checked completely
        (identity, model, code, image checksums, the oracle inside the engine); it is then handed
        the old engine's own listening socket (a duplicate taken with pidfd_getfd: the port never
        stops listening, connections waiting in its backlog are accepted by whichever engine
        accepts next, none is refused or reset); the old engine is told to stop (it closes its
        descriptor and drains its requests), and once it accepts no more the new engine's
        ``/health`` and canary run (they reach it alone); see :func:`_hand_over`. A failure
        before the hand-over leaves the old engine serving untouched and the error says so; a
        failed canary restores the old snapshot again on the same socket (``rollback``).

    Otherwise (the reason is said, and kept in ``Switched.fallback``) the old way:

    1b. every image checksum is verified while the old engine still serves (a corrupt image
        refuses here, nothing stopped; the hand-over's restore verifies them instead, alongside
        CRIU, before the socket is handed over);
    2. the old engine is told to stop: it closes its listening socket at once and drains
       (requests in flight finish, for at most its drain timeout; ``drain_s`` overrides it) in
       the background;
    3. as soon as the port is free, the target is restored detached on the old engine's host
       unless ``host`` is given -- while the old one drains (a CUDA target waits until the old
       engine is gone: its GPU memory must be free first; a restore refused for lack of memory
       is tried again once the old engine is gone);
    4. if that fails and ``rollback`` (the default), the old snapshot is restored again on its
       host and port. The error then says which engine was stopped and what serves now, read
       from the registry (``details``: ``{"stopped": [...], "serving": {...} | None}``).

    ``frontend``: front-end option tokens (API key, TLS, CORS, ...; :mod:`vllm_snapshot.supervise.frontend`)
    for the new engine. Every other front-end option the old engine was restored with (the
    registry records them, secrets left out: ``Entry.frontend_args``) is carried over
    (:func:`~vllm_snapshot.supervise.frontend.carry`): an option given replaces the old one of
    the same setting. The API key is never recorded: it must be given again (``--api-key``,
    ``VLLM_API_KEY``) -- an old engine that required one and a switch without one is refused,
    as is one that would drop TLS. A rollback restores the old engine with its own recorded
    options and the switch's key (an engine registered by an older vllm-snapshot, with no
    record: with the switch's options). The new engine's are checked before the old engine is
    touched.
    ``drain_s``: the old engine's drain (seconds; default its own) and the new one's (default
    :func:`vllm_snapshot.store.registry.drain_timeout`).
    ``merge_pages``: the new engine is restored KSM-mergeable (:attr:`RestoreRequest.merge_pages`);
    a rollback restores the old engine with the mark it had (read from /proc before it stops).

    Durations in seconds: ``stop_s`` until the restore could start (the old engine closed the
    port; after a hand-over: the old engine's drain, after the new engine took over),
    ``restore_s``, ``switch_s`` their sum. Raises the errors of :func:`restore`,
    BusyError (the port's lock, after :data:`vllm_snapshot.store.locks.PORT_WAIT_S`)."""
    t = tools or local_tools()
    t.host.require_root()
    with t.store.port_lock(port, rep.info):
        return _switch_locked(t, snapshot, host, port, log_file, rep, rollback, frontend, drain_s, handover,
                              merge_pages)


def _switch_locked(t: Tools, snapshot: Path, host: str | None, port: int, log_file: Path | None,
                   rep: Reporter, rollback: bool, frontend: tuple[str, ...], drain_s: float | None,
                   handover: bool = True, merge_pages: bool = False) -> Switched:
    from ..supervise import frontend as fe
    from ..errors import InsufficientResources
    from ..store.registry import drain_timeout

    old = [e for e in t.runtime.engines() if e.port == port]
    recorded = old[0].frontend_args if old else None
    tokens, carried = fe.carry(list(frontend), list(recorded or ()))
    wanted = fe.check(tokens, t.host.environ())
    back = list(frontend) if recorded is None else fe.carry(fe.secrets(list(frontend)), list(recorded))[0]
    new_drain = drain_timeout(drain_s, t.host.environ())
    snapshot = t.store.canonical(snapshot)
    dropped = [what for what, had, has in (("an API key", any(e.auth for e in old), bool(wanted.api_keys)),
                                           ("TLS (https)", any(e.scheme == "https" for e in old), wanted.tls))
               if had and not has]
    if dropped:
        raise UsageError(f"the engine on port {port} requires {' and '.join(dropped)}; the switch would serve "
                         "without: refused, nothing was stopped",
                         hint="give switch the same --api-key (or VLLM_API_KEY) and --ssl-* options; to serve "
                              f"without them on purpose, `vllm-snapshot stop --port {port}` first, then restore")
    host = host or (old[0].host if old else "127.0.0.1")
    # KSM-mergeable or not, each old engine (read from /proc while it runs): a rollback restores
    # it as it was, and a switch that would change only the mark is not "unchanged"
    marks = {e.pid: t.runtime.merge_marked(e.pid) for e in old}
    if old and all(t.store.canonical(Path(e.snapshot)) == snapshot and e.host == host for e in old) \
            and all(fe.same_settings(wanted.args, e.frontend) and marks[e.pid] == merge_pages for e in old):
        rep.info(f"{snapshot.name} already serves on port {port} (PID {old[0].pid}) with these front-end "
                  "options" + (" and --merge-pages" if merge_pages else "") + "; nothing to switch")
        return Switched(str(snapshot), port, old[0].pid, old[0].url, 0.0, 0.0, 0.0, [], host, unchanged=True)
    if not old:  # a mistyped port would otherwise start a second engine silently
        rep.info(f"nothing serves on port {port}: {snapshot.name} is restored there, no engine is replaced")
    if merge_pages:  # a kernel without the prctl is refused before anything is touched
        from ..checkpoint.criu import merge

        with _refused_target(snapshot, old):
            merge.check_available()
    with rep.phase("validate_target", f"validating {snapshot.name} before touching port {port}"):
        with _refused_target(snapshot, old):
            with t.store.snapshot_lock(snapshot, shared=True):
                # everything restore checks before CRIU except the port (the old engine holds
                # it) and the image checksums: a hand-over's restore verifies them before the
                # socket is handed over, the old way checks them before the old engine stops
                m, _ = validate(snapshot, tools=t)
        # an isolated snapshot's listeners live in its own fresh network namespace: nothing to check
        recorded = () if m.engine.network == "isolated" else m.criu.listeners
        held = set().union(*(t.host.ports_held_by(e.pid) for e in old)) if old else set()
        taken = t.host.listeners_taken(tuple(x for x in recorded if int(x[1]) not in held))
        if taken:
            raise BusyError("the target's recorded loopback ports are taken (the old engine keeps serving):\n  "
                            + "\n  ".join(taken), hint="stop what holds them, or re-create the snapshot")
    if carried:
        rep.info(f"keeping the front-end options of the engine on port {port}: {', '.join(dict.fromkeys(carried))} "
                 "(give one to switch to change it)")
    req = RestoreRequest(snapshot=snapshot, host=host, port=port, detach=True, log_file=log_file,
                         frontend=tuple(tokens), drain_s=new_drain, merge_pages=merge_pages)
    marked = bool(old) and marks[old[0].pid]  # the rollback's
    why = ""
    if old:
        why = (handover_blocker(t, m, old, host, port) or "") if handover else "--no-handover"
        listener = None
        if not why:
            try:
                listener = t.host.take_listener(old[0].pid, host, port)
            except (LookupError, OSError) as e:
                why = f"the old engine's listening socket cannot be shared ({e})"
        if listener is not None:
            try:
                done = _hand_over(t, req, old[0], listener, rep, rollback, tuple(back), drain_s, marked)
            finally:
                listener.close()
            if isinstance(done, Switched):
                return done
            why = done
        rep.info(f"no hand-over: {why}; the old engine stops first (the port refuses connections until the "
                 "new one serves)")
        with rep.phase("check_images", f"checking {snapshot.name}'s image checksums before stopping the engine "
                                       f"on port {port}"):
            with _refused_target(snapshot, old), t.store.snapshot_lock(snapshot, shared=True):
                t.files.verify_images(snapshot, m)
    t0 = t.clock.monotonic()
    stopping = None
    if old:
        drains = sorted({e.drain_s if drain_s is None else drain_s for e in old})
        with rep.phase("stop_previous", f"stopping the engine on port {port}: it takes no new connection and "
                                        f"drains (requests in flight finish, up to {drains[-1]:g} s)"):
            stopping = _Stopping(t.runtime, old, drain_s)
            if m.engine.kind == "cuda" or m.engine.network != "isolated":
                stopping.wait()  # GPU memory / loopback listeners of the old tree: released first
            else:
                stopping.wait_port(t.host, t.clock, host, port)
    t1 = t.clock.monotonic()
    stopped: list[OldEngine] = [{"pid": e.pid, "snapshot": e.snapshot, "host": e.host, "port": e.port} for e in old]
    try:
        try:
            r, engine = restore(req, rep, tools=t)
        except InsufficientResources as err:
            if stopping is None or stopping.done():
                raise
            rep.info(f"{err.message.splitlines()[0]}; waiting for the old engine to finish draining, then again")
            stopping.wait()
            r, engine = restore(req, rep, tools=t)
    except SnapshotError as err:
        # an interruption means "stop": no rollback then (the port ends free, the registry says so)
        if stopping is not None:
            _finish(stopping, rep)
        serving = _roll_back(t, old[0], rep, tuple(back), new_drain, merge_pages=marked) \
            if (old and rollback and not isinstance(err, Interrupted)) else None
        gone = {e.pid for e in old}
        _explain_switch_failure(err, port, stopped, serving, rollback,
                                [e for e in t.runtime.engines() if e.port == port and e.pid not in gone], why)
        raise
    except BaseException:
        if stopping is not None:
            _finish(stopping, rep)
        raise
    engine.close()
    t2 = t.clock.monotonic()
    if stopping is not None:
        _finish(stopping, rep)
    return Switched(str(snapshot), port, r.pid, r.url, round(t1 - t0, 3), round(t2 - t1, 3),
                    round(t2 - t0, 3), [e.pid for e in old], host, fallback=why, new_engine=not old)


@contextmanager
def _refused_target(snapshot: Path, old: list[Entry]) -> Iterator[None]:
    """A SnapshotError raised inside (the target refused before anything was touched) says
    that the engine on the port (``old``, when one serves) still serves, in its message and
    ``details`` (``stopped``: [], ``serving``); a corrupt snapshot's says how to repair it."""
    try:
        yield
    except SnapshotError as e:
        if old:
            e.message += f"\nnothing was stopped: PID {old[0].pid} still serves {old[0].url}"
            e.details = {**(e.details or {}), "stopped": [], "serving": {"pid": old[0].pid, "url": old[0].url,
                                                                         "snapshot": old[0].snapshot}}
        if e.hint is None and isinstance(e, CorruptSnapshotError):
            e.hint = layout.damaged_hint(snapshot)
        raise


def handover_blocker(t: Tools, m, old: list[Entry], host: str, port: int) -> str | None:
    """Why the engine of manifest ``m`` cannot take over ``port`` from ``old`` (the engines
    serving it, at least one) while they still serve, in words; None when it can: one engine
    serves the port, on the same address; the target's engine has a network namespace of its
    own (it is handed a socket: older snapshots bind the port themselves); and both engines fit
    at once -- host memory for the target's images beside the old engine (what a restore
    checks, :func:`vllm_snapshot.host.resources.check`), and for a CUDA target the free memory
    of the GPU it goes onto beside the old engine's (:meth:`CheckpointTools.check_gpu_capacity`).
    Raises the errors of :func:`vllm_snapshot.checkpoint.gpu.place` (validation passed them)."""
    from ..errors import InsufficientResources
    from ..host import resources

    if len(old) > 1:
        return f"{len(old)} engines serve port {port} (PIDs {', '.join(str(e.pid) for e in old)})"
    if old[0].host != host:
        return f"the new engine is to listen on {host}, the old one listens on {old[0].host}"
    if m.engine.network != "isolated":
        return "the target binds its port itself (made before engines had a network namespace of their own)"
    if m.engine.kind == "cuda":
        from ..checkpoint import gpu as gpus

        recorded = m.host.get("gpu_uuid_used", "")
        try:  # the GPU the restore will put the state on (as validation placed it)
            placed = gpus.GpuPlacement(recorded, recorded) if recorded in t.host.gpu_uuids() \
                else gpus.place(m.host, t.host.gpu_slots())
            t.checkpoint.check_gpu_capacity(m, placed.target if placed is not None else recorded)
        except (BusyError, InsufficientResources) as e:
            return f"the GPU has no room for both engines at once: {e.message.splitlines()[0]}"
    try:
        short = resources.check(m.sizes["raw"], t.host.memory_offer(True))
    except InsufficientResources as e:
        short = e.message.splitlines()[0]
    if short:
        return f"both engines do not fit in memory at once: {short}"
    return None


#: Seconds a handed-over engine has to start accepting on the shared socket (its HTTP server's
#: start-up) before the switch gives up, the old engine untouched.
HANDOVER_ACCEPT_S = 120.0


def _hand_over(t: Tools, req: RestoreRequest, prev: Entry, listener, rep: Reporter, rollback: bool,
               back: tuple[str, ...], drain_s: float | None, marked: bool = False) -> Switched | str:
    """Restore ``req`` while ``prev`` still serves, on ``prev``'s own listening socket
    (``listener``, a duplicate: the port never stops listening, its backlog is shared, so no
    connection is refused or reset). Every check of the restore (identity, model, code, image
    checksums, oracle inside the engine) passes before the new engine gets the socket; once its
    event loop waits on the socket (:meth:`HostTools.accepting`: no connection waits for its
    server's start-up) ``prev`` is told to stop (it closes its descriptor: accepts no more; the requests it
    accepted finish within its drain) and, once it stopped accepting, ``/health`` and the
    canary reach the new engine alone. A failure before that leaves ``prev`` serving untouched
    (the error says so); after it (``/health``/canary), ``prev``'s snapshot is restored again
    on the same socket unless ``rollback`` is false (KSM-mergeable when ``marked``). Returns
    the result, or a reason (str) when the restore found too little memory before anything was
    touched (the caller then stops first). Raises the errors of :func:`restore`."""
    from ..errors import EngineError, InsufficientResources
    import dataclasses

    port = req.port
    state: dict = {"stopping": None, "handed": None}

    def on_serving(engine) -> None:
        # the old engine keeps accepting until the new one's event loop waits on the socket:
        # no connection waits for the new server's start-up
        with rep.phase("new_accepting", f"waiting until the new engine accepts on port {port}"):
            deadline = t.clock.monotonic() + HANDOVER_ACCEPT_S
            while not t.host.accepting(engine.root_pid, listener):
                if not engine.alive():
                    raise EngineError("the new engine exited before it accepted on the port; the old one serves on",
                                      details={"stage": "handover"})
                if t.clock.monotonic() > deadline:
                    raise EngineError(f"the new engine did not accept on port {port} within {HANDOVER_ACCEPT_S:g} s; "
                                      "the old one serves on", details={"stage": "handover"})
                t.clock.sleep(0.01)
        state["handed"] = t.clock.monotonic()
        drains = prev.drain_s if drain_s is None else drain_s
        with rep.phase("hand_over", f"the new engine accepts on port {port}; the old one (PID {prev.pid}) "
                                    f"accepts no more and drains (requests in flight finish, up to {drains:g} s)"):
            state["stopping"] = _Stopping(t.runtime, [prev], drain_s)
            state["stopping"].wait_closed(t.host, t.clock, prev.pid, listener)

    t0 = t.clock.monotonic()
    try:
        r, engine = restore(dataclasses.replace(req, listener=listener, on_serving=on_serving), rep, tools=t)
    except SnapshotError as err:
        stopping = state["stopping"]
        if stopping is None:
            if isinstance(err, InsufficientResources):
                return f"the restore found too little memory beside the old engine ({err.message.splitlines()[0]})"
            serving = {"snapshot": prev.snapshot, "pid": prev.pid, "url": prev.url}
            err.message = (f"{err.message}\nswitch: the engine on port {port} (PID {prev.pid}, {prev.snapshot}) was "
                           f"not touched: it still serves {prev.url}")
            err.args = (err.message,)
            err.details = {"cause": err.details, "stopped": [], "serving": serving}
            raise
        # /health or the canary failed after the old engine stopped accepting: the socket is
        # still ours, the old snapshot takes it again (connections wait in its backlog)
        serving = _roll_back(t, prev, rep, back, req.drain_s, listener, marked) \
            if rollback and not isinstance(err, Interrupted) else None
        _finish(stopping, rep)
        _explain_switch_failure(err, port, [{"pid": prev.pid, "snapshot": prev.snapshot, "host": prev.host,
                                             "port": prev.port}], serving, rollback,
                                [e for e in t.runtime.engines() if e.port == port and e.pid != prev.pid])
        raise
    except BaseException:
        if state["stopping"] is not None:
            _finish(state["stopping"], rep)
        raise
    engine.close()
    t1 = t.clock.monotonic()
    if state["stopping"] is not None:
        _finish(state["stopping"], rep)
    t2 = t.clock.monotonic()
    return Switched(str(req.snapshot), port, r.pid, r.url, round(t2 - t1, 3), round(t1 - t0, 3), round(t2 - t0, 3),
                    [prev.pid], req.host, handover=True)


def _finish(stopping: _Stopping, rep: Reporter) -> None:
    """Wait for the old engines to be gone; say when their drain ran out with requests in flight."""
    for r in stopping.wait():
        if r.cut:
            rep.info(f"the old engine's drain ran out with {r.cut} request(s) in flight: they were cut")


def _roll_back(t: Tools, prev: Entry, rep: Reporter, frontend: tuple[str, ...] = (),
               drain_s: float | None = None, listener=None, merge_pages: bool = False) -> dict | None:
    """Restore the engine a failed switch stopped (with ``frontend``: its own recorded options
    and the switch's API key; on ``listener`` when the port's socket was kept; KSM-mergeable
    when ``merge_pages``: it was); its serving record, or None."""
    try:
        with rep.phase("rollback", f"restoring {Path(prev.snapshot).name} again on port {prev.port}"):
            r, engine = restore(RestoreRequest(snapshot=Path(prev.snapshot), host=prev.host, port=prev.port,
                                               detach=True, frontend=frontend,
                                               drain_s=prev.drain_s if drain_s is None else drain_s,
                                               listener=listener, merge_pages=merge_pages), rep, tools=t)
        engine.close()
        return {"snapshot": prev.snapshot, "pid": r.pid, "url": r.url}
    except SnapshotError as e:
        rep.info(f"rollback failed: {e.message.splitlines()[0]}")
        return None


def _explain_switch_failure(err: SnapshotError, port: int, stopped: list[OldEngine], serving: dict | None,
                            rollback: bool, now: list[Entry] | None = None, why: str = "") -> None:
    """Append to ``err`` what the failed switch stopped and what serves on ``port`` now:
    ``serving`` (the rollback's engine), else the registry's engines on the port (``now``:
    another command's, e.g. a restore that took the port meanwhile), else nothing; and ``why``
    the old engine was stopped before the restore (no hand-over), when it was."""
    rolled_back = serving is not None
    if not rolled_back and now:
        e = now[0]
        serving = {"snapshot": e.snapshot, "pid": e.pid, "url": e.url}
        here = f"{e.snapshot} serves on port {port} now ({e.url}, PID {e.pid}: started by another command)"
    else:
        here = f"nothing serves on port {port} now" + ("" if rollback else " (--no-rollback)")
    if not stopped:
        what = f"no engine of vllm-snapshot served on port {port} before" + (f"; {here}" if now else "")
    elif rolled_back:
        what = (f"the engine that served port {port} (PID {stopped[0]['pid']}, {stopped[0]['snapshot']}) was "
                f"stopped and rolled back: {serving['snapshot']} serves on {serving['url']} again (PID {serving['pid']})")
    else:
        what = (f"the engine that served port {port} (PID {stopped[0]['pid']}, {stopped[0]['snapshot']}) was "
                f"stopped; {here}")
    if why and stopped:
        what += f" (no hand-over: {why})"
    err.message = f"{err.message}\nswitch: {what}"
    err.args = (err.message,)
    if stopped and serving is None:  # the port is dark: the way back, ready to paste
        from ..errors import q

        err.hint = (f"to serve the old snapshot again: `vllm-snapshot restore {q(stopped[0]['snapshot'])} --port {port} "
                    "--detach` (with the front-end options it had)" + (f"; {err.hint}" if err.hint else ""))
    err.details = {"cause": err.details, "stopped": stopped, "serving": serving}
