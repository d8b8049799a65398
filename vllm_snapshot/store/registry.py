"""Runtime registry of engines restored on this host (for status/stop/switch/delete).

One JSON file per engine in ``RUN_DIR/engines/PID.json`` (``paths.run_dir()``, ``/run/vllm-snapshot``) (tmpfs: gone at reboot,
like the engines). Entries whose engine PID is dead are removed whenever the registry is read;
an engine found dead that no ``stop`` was stopping (it exited or was killed on its own) leaves a
record in ``engines/exited/`` (:func:`exited`), which ``status`` shows until ``prune`` forgets it
(:func:`forget_exited`), as ``systemctl`` shows a failed unit until ``reset-failed``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from .. import paths
from ..engine.spec import ROOT_MARK
from ..host import ports
from ..host.procs import ns_pids, socket_inodes, tree, wait_gone
from ..host.sockets import TCP_ESTABLISHED, TCP_LISTEN, tcp_table


#: How long ``stop`` lets in-flight HTTP requests finish by default (seconds);
#: ``--drain-timeout`` / ``$VLLM_SNAPSHOT_DRAIN_TIMEOUT`` override it.
DRAIN_S = 30.0
DRAIN_ENV = "VLLM_SNAPSHOT_DRAIN_TIMEOUT"
#: After the drain: how long an engine gets to shut its engine client, EngineCore and workers
#: down (vLLM's teardown takes 1-2 s) before it is SIGKILLed (seconds).
TEARDOWN_S = 10.0


def _dir() -> Path:
    return paths.ensure_private_dir(paths.run_dir() / "engines")


def _exited_dir() -> Path:
    return paths.ensure_private_dir(_dir() / "exited")


#: Fields of an exited engine's record (:func:`exited`).
EXITED_FIELDS = ("pid", "snapshot", "host", "port", "mode", "started_at", "log_file", "noticed_at")


@dataclass(frozen=True)
class Entry:
    """A restored engine: snapshot path, engine root PID, supervisor PID (0 when detached),
    host, port, start time (unix seconds), mode (``foreground``/``detached``)."""

    snapshot: str
    pid: int
    supervisor_pid: int
    host: str
    port: int
    started_at: float
    mode: str
    create_time: float = 0.0
    #: ``https`` when the engine serves TLS (front-end options given at restore)
    scheme: str = "http"
    #: the cgroup a detached engine was placed in (:mod:`vllm_snapshot.host.cgroups`), else ""
    cgroup: str = ""
    #: salted digest of the front-end options it serves with (:func:`vllm_snapshot.supervise.frontend.fingerprint`)
    frontend: str = ""
    #: True when it requires an API key (never the key itself): ``switch`` refuses to replace it
    #: with an engine that requires none
    auth: bool = False
    #: seconds it lets requests in flight finish when stopped (``restore --drain-timeout``);
    #: ``stop``'s default. Kept in a file of its own beside the entry (``PID.drain``): a
    #: vllm-snapshot from before this field removes an entry with a field it does not know
    drain_s: float = DRAIN_S
    #: the front-end option tokens it was restored with, secrets left out (the API key:
    #: :func:`vllm_snapshot.supervise.frontend.without_secrets`), which ``switch`` carries over
    #: to the engine that replaces it; None when not recorded (an engine registered by an
    #: older vllm-snapshot). Kept in a file of its own beside the entry (``PID.frontend``, a
    #: JSON list), like ``drain_s``
    frontend_args: tuple[str, ...] | None = None
    #: a detached engine's log file ("" when none: a foreground engine logs to its command's
    #: stderr). Kept in a file of its own beside the entry (``PID.log``), like ``drain_s``
    log_file: str = ""

    @property
    def url(self) -> str:
        return ports.url(self.host, self.port, self.scheme)


#: Fields written to ``PID.json``; the others have files of their own (see Entry.drain_s).
_JSON_FIELDS = ("snapshot", "pid", "supervisor_pid", "host", "port", "started_at", "mode", "create_time", "scheme",
                "cgroup", "frontend", "auth")


def _write(p: Path, text: str) -> None:
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.rename(tmp, p)


def register(e: Entry) -> Path:
    """Write ``e`` atomically (``PID.json``; first its drain timeout in ``PID.drain`` and its
    front-end tokens in ``PID.frontend``, which the caller has stripped of secrets); returns
    the entry's file."""
    try:
        ct = psutil.Process(e.pid).create_time()
    except psutil.Error:
        ct = 0.0
    e = Entry(**{**asdict(e), "create_time": ct})
    p = _dir() / f"{e.pid}.json"
    _write(p.with_suffix(".drain"), repr(float(e.drain_s)))
    if e.frontend_args is not None:
        _write(p.with_suffix(".frontend"), json.dumps(list(e.frontend_args)))
    if e.log_file:
        _write(p.with_suffix(".log"), e.log_file)
    _write(p, json.dumps({k: v for k, v in asdict(e).items() if k in _JSON_FIELDS}))
    return p


def unregister(pid: int) -> None:
    (_dir() / f"{pid}.stopping").unlink(missing_ok=True)
    (_dir() / f"{pid}.json").unlink(missing_ok=True)
    (_dir() / f"{pid}.drain").unlink(missing_ok=True)
    (_dir() / f"{pid}.frontend").unlink(missing_ok=True)
    (_dir() / f"{pid}.log").unlink(missing_ok=True)


def _drain_of(f: Path) -> float:
    """The drain timeout recorded beside the entry file ``f`` (the default when none is)."""
    try:
        v = float(f.with_suffix(".drain").read_text())
        return v if v >= 0 else DRAIN_S
    except (OSError, ValueError):
        return DRAIN_S


def _frontend_of(f: Path) -> tuple[str, ...] | None:
    """The front-end tokens recorded beside the entry file ``f``; None when none are (or the
    file is not a JSON list of strings)."""
    try:
        v = json.loads(f.with_suffix(".frontend").read_text())
    except (OSError, ValueError):
        return None
    return tuple(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else None


def _log_of(f: Path) -> str:
    """The log file recorded beside the entry file ``f`` ("" when none is)."""
    try:
        return f.with_suffix(".log").read_text().strip()
    except OSError:
        return ""


def _alive(e: Entry) -> bool:
    try:
        p = psutil.Process(e.pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return not e.create_time or abs(p.create_time() - e.create_time) < 1.0
    except psutil.Error:
        return False


def entries() -> list[Entry]:
    """Live entries, sorted by port; stale files (dead PIDs, reused PIDs) are removed."""
    out = []
    d = _dir()
    for f in d.glob("*.json"):
        try:
            raw = json.loads(f.read_text())
            # a field this version does not know (a newer vllm-snapshot's) is not a reason to
            # forget a live engine
            e = Entry(**{k: v for k, v in raw.items() if k in _JSON_FIELDS}, drain_s=_drain_of(f),
                      frontend_args=_frontend_of(f), log_file=_log_of(f))
        except (OSError, ValueError, TypeError):
            unregister(int(f.stem)) if f.stem.isdigit() else f.unlink(missing_ok=True)
            continue
        if _alive(e):
            out.append(e)
        else:
            if not f.with_suffix(".stopping").exists():  # gone on its own: said by `status` until `prune`
                _note_exited(e)
            unregister(e.pid)
    for f in [*d.glob("*.drain"), *d.glob("*.frontend"), *d.glob("*.log"), *d.glob("*.stopping")]:  # an entry removed by a vllm-snapshot
        if not f.with_suffix(".json").exists():                # that knew no such file
            f.unlink(missing_ok=True)
    return sorted(out, key=lambda e: (e.port, e.pid))


def _note_exited(e: Entry) -> None:
    """Record that the engine of ``e`` was found gone with no ``stop`` stopping it. Best effort
    (an unwritable run dir loses the record, never the command)."""
    rec = {k: getattr(e, k) for k in EXITED_FIELDS if k != "noticed_at"} | {"noticed_at": time.time()}
    try:
        _write(_exited_dir() / f"{e.pid}-{int(e.create_time)}.json", json.dumps(rec))
    except OSError:
        pass


def exited() -> list[dict]:
    """Engines found gone without a ``stop`` (exited or killed on their own) since the last
    :func:`forget_exited`, oldest first: dicts of :data:`EXITED_FIELDS` (``noticed_at``: Unix
    seconds when a command first found it gone, an upper bound of when it died). Reads the
    registry first (:func:`entries`), so an engine that died since is among them. Unreadable
    records are skipped."""
    entries()
    out = []
    for f in _exited_dir().glob("*.json"):
        try:
            raw = json.loads(f.read_text())
            out.append({k: raw[k] for k in EXITED_FIELDS})
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return sorted(out, key=lambda r: (r["noticed_at"], r["pid"]))


def forget_exited(dry_run: bool = False) -> list[str]:
    """Remove the records :func:`exited` lists (``prune``); returns one line per record."""
    gone = []
    for f in sorted(_exited_dir().glob("*.json")):
        pid = f.stem.split("-", 1)[0]
        if not dry_run:
            f.unlink(missing_ok=True)
        gone.append(f"the record of engine PID {pid}, which exited or was killed without a stop")
    return gone


def drain_timeout(given: float | None = None, environ: dict | None = None) -> float:
    """The drain timeout in seconds: ``given`` (a command's ``--drain-timeout``), else
    ``$VLLM_SNAPSHOT_DRAIN_TIMEOUT``, else :data:`DRAIN_S`. Raises UsageError for a negative,
    non-finite or non-numeric value."""
    import math

    from ..errors import UsageError

    env = os.environ if environ is None else environ
    raw, what = (given, "--drain-timeout") if given is not None else (env.get(DRAIN_ENV), DRAIN_ENV)
    if raw is None or raw == "":
        return DRAIN_S
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{what} {raw!r}: expected a number of seconds >= 0",
                         hint="e.g. --drain-timeout 30 (0: cut requests in flight at once)")
    return value


@dataclass(frozen=True)
class StopReport:
    """How a stop went: ``seconds`` taken (until every process of the tree was gone);
    ``drained``: every request in flight finished within the drain (False: the drain timeout
    ran out); ``cut``: client connections still open on the engine's port when it ran out
    (requests that got no complete answer); ``killed``: SIGKILL was needed (the engine did not
    exit by itself within the drain and :data:`TEARDOWN_S`)."""

    seconds: float
    drained: bool = True
    cut: int = 0
    killed: bool = False



def _socket_inodes(procs: list[psutil.Process]) -> set[int]:
    """Inodes of the sockets the processes ``procs`` have open (a process that exited has none)."""
    return set().union(*(socket_inodes(p.pid) for p in procs))


def _port_sockets(procs: list[psutil.Process], port: int) -> tuple[bool, int] | None:
    """(whether the tree listens on TCP ``port``, how many established connections it has
    there: requests in flight), from this network namespace's /proc/net/tcp{,6} (the served
    socket lives in the host's namespace, bound by the restore) and the tree's own fds. None
    when it cannot be told (a read failed): never taken for "drained"."""
    inodes = _socket_inodes(procs)
    listening, established = False, 0
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for e in tcp_table(table):
                if e.local[1] == port and e.inode in inodes:
                    listening |= e.state == TCP_LISTEN
                    established += e.state == TCP_ESTABLISHED
    except (OSError, ValueError, IndexError):
        return None
    return listening, established


#: Polls in a row that must see a draining engine with neither its listener nor a connection
#: before ``stop`` kills it at once: /proc/net/tcp is read in pieces while the host's sockets
#: change, and a read can miss a line -- once, in CI, a request in flight was cut so.
IDLE_POLLS = 3


def _client_connections(procs: list[psutil.Process], port: int) -> int:
    """Established TCP connections of the tree on its served ``port`` (requests in flight);
    0 when they cannot be counted."""
    got = _port_sockets(procs, port)
    return got[1] if got is not None else 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop(e: Entry, drain_s: float | None = None, teardown_s: float = TEARDOWN_S, poll_s: float = 0.05) -> StopReport:
    """Stop an engine, draining it first, and wait until every process of its tree is gone
    (memory released).

    SIGTERM goes to the supervisor of a foreground engine (it forwards it and exits with the
    engine's code: 0 for systemd) or to the root of a detached one. The engine then drains
    (``entrypoints/engine_root.install_drain``): it closes its listening socket at once (no new
    connection), lets requests in flight finish, and exits. A detached engine that no longer
    listens and has no client connection left (seen in :data:`IDLE_POLLS` polls in a row) is
    SIGKILLed at once (vLLM's own teardown of
    EngineCore and workers takes 1-2 s and frees nothing the kernel does not free at once).
    When ``drain_s`` seconds (default: the engine's own, ``e.drain_s``) pass first, the requests still in
    flight are counted as cut and a second SIGTERM makes the engine cancel them and exit; after
    ``teardown_s`` more seconds what is left is SIGKILLed (also an engine of an older snapshot,
    which aborts its requests at the first signal and then waits for their connections)."""
    if drain_s is None:
        drain_s = e.drain_s
    t0 = time.monotonic()
    procs = tree(e.pid)
    if not procs:
        unregister(e.pid)
        return StopReport(0.0)
    try:  # a command reading the registry while it goes must not take it for one that died on its own
        _write(_dir() / f"{e.pid}.stopping", "")
    except OSError:
        pass
    foreground = bool(e.supervisor_pid and psutil.pid_exists(e.supervisor_pid))
    target = e.supervisor_pid if foreground else e.pid
    _signal(target, signal.SIGTERM)
    deadline = t0 + drain_s
    drained, cut, killed = True, 0, False
    idle = 0  # polls in a row that saw neither the listener nor a connection
    while True:
        alive_pids = set(wait_gone(procs, poll_s))
        alive = [p for p in procs if p.pid in alive_pids]
        if not alive:
            break
        idle = idle + 1 if not foreground and _port_sockets(alive, e.port) == (False, 0) else 0
        if idle >= IDLE_POLLS:
            break  # drained: nothing left to lose
        if time.monotonic() >= deadline:
            cut = _client_connections(alive, e.port)
            drained = cut == 0
            _signal(target, signal.SIGTERM)  # the second one: cancel what is in flight, exit now
            left = set(wait_gone(alive, teardown_s))
            alive = [p for p in alive if p.pid in left]
            killed = bool(alive)
            break
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_gone(alive, 10)
    unregister(e.pid)
    return StopReport(time.monotonic() - t0, drained, cut, killed)


#: Processes a dead parent's children are reparented to (init, and common subreapers).
REAPERS = frozenset({"systemd", "init", "tini", "dumb-init", "catatonit", "runit", "s6-svscan"})


def _is_engine_root(p: psutil.Process) -> bool:
    """An engine tree's root: its last argument is the engine spec (a JSON object holding
    :data:`~vllm_snapshot.engine.spec.ROOT_MARK`) and it is PID 1 of its own PID namespace."""
    try:
        argv = p.cmdline()
    except (psutil.Error, OSError):
        return False
    if not argv or not argv[-1].startswith("{") or ROOT_MARK not in argv[-1]:
        return False
    pids = ns_pids(p.pid)
    return len(pids) > 1 and pids[-1] == 1


def _serving_inodes() -> set[int]:
    """Inodes of the listening TCP sockets of this (the host's) network namespace: a served
    engine holds the one its restore bound and handed over; a never-served orphan has none.
    By inode, not by the PID ``psutil.net_connections`` names: a socket several processes hold
    (a switch's hand-over duplicates the old engine's) is named with one of them only."""
    return ports.listening_inodes()


def _serves(p: psutil.Process, serving: set[int]) -> bool:
    """Whether a process of the tree rooted at ``p`` holds one of the sockets ``serving``."""
    from ..host.procs import socket_inodes

    try:
        return any(socket_inodes(q.pid) & serving for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return False


def orphans() -> list[psutil.Process]:
    """Engine trees nobody owns: an engine root that is not registered, whose parent is gone
    (reparented to init or a subreaper) and that serves nothing -- what a SIGKILLed restore
    leaves when CRIU finished after its supervisor died (the tree never got its listening
    socket). A create's engine (child of ``unshare``), a restore in progress (child of its
    restore), every registered engine, every engine that was ever told to serve (its root took
    the name :data:`~vllm_snapshot.host.procs.SERVED_COMM`) and every serving engine are never
    listed: an engine missing from *this* registry (another ``VLLM_SNAPSHOT_RUN_DIR``, a wiped
    /run) that served is somebody's live server, not a leftover -- also while it drains with its
    listening socket closed, and whatever network namespace the caller runs in (whose table of
    listening sockets holds none of the host's). The socket check is what is left for a tree
    restored from a snapshot whose engine code predates the name."""
    from ..host.procs import marked_served

    known = {e.pid for e in entries()}
    out = []
    serving: set[int] | None = None
    for p in psutil.process_iter(["ppid"]):
        if p.pid in known or not _is_engine_root(p) or marked_served(p.pid):
            continue
        try:
            ppid = p.info["ppid"]
            parent = psutil.Process(ppid).name() if ppid else ""
        except psutil.Error:
            parent = ""
        if ppid in (0, 1) or parent in REAPERS:
            if serving is None:
                serving = _serving_inodes()
            if not _serves(p, serving):
                out.append(p)
    return out
