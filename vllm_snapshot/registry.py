"""Runtime registry of engines restored on this host (for status/stop/switch/delete).

One JSON file per engine in ``RUN_DIR/engines/PID.json`` (``paths.run_dir()``, ``/run/vllm-snapshot``) (tmpfs: gone at reboot,
like the engines). Entries whose engine PID is dead are removed whenever the registry is read.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from . import paths, ports
from .procs import tree, wait_gone


def _dir() -> Path:
    return paths.ensure_private_dir(paths.run_dir() / "engines")


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
    #: the cgroup a detached engine was placed in (:mod:`vllm_snapshot.cgroups`), else ""
    cgroup: str = ""
    #: salted digest of the front-end options it serves with (:func:`vllm_snapshot.frontend.fingerprint`)
    frontend: str = ""
    #: True when it requires an API key (never the key itself): ``switch`` refuses to replace it
    #: with an engine that requires none
    auth: bool = False

    @property
    def url(self) -> str:
        return ports.url(self.host, self.port, self.scheme)


def register(e: Entry) -> Path:
    """Write ``e`` atomically; returns its file."""
    try:
        ct = psutil.Process(e.pid).create_time()
    except psutil.Error:
        ct = 0.0
    e = Entry(**{**asdict(e), "create_time": ct})
    p = _dir() / f"{e.pid}.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(e)))
    os.chmod(tmp, 0o600)
    os.rename(tmp, p)
    return p


def unregister(pid: int) -> None:
    (_dir() / f"{pid}.json").unlink(missing_ok=True)


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
    for f in _dir().glob("*.json"):
        try:
            e = Entry(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            f.unlink(missing_ok=True)
            continue
        if _alive(e):
            out.append(e)
        else:
            f.unlink(missing_ok=True)
    return sorted(out, key=lambda e: (e.port, e.pid))


#: How long ``stop`` lets in-flight HTTP requests of a detached engine finish (seconds).
DRAIN_S = 30.0


def _client_connections(procs: list[psutil.Process], port: int) -> int:
    """Established TCP connections of the tree on its served ``port`` (requests in flight)."""
    pids = {p.pid for p in procs}
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return 0
    return sum(1 for c in conns if c.pid in pids and c.laddr and c.laddr.port == port
               and c.status == psutil.CONN_ESTABLISHED)


def stop(e: Entry, grace_s: float = 30.0, drain_s: float = DRAIN_S) -> float:
    """Stop an engine and wait until every process of its tree is gone (memory released).
    Returns seconds taken.

    Foreground engines: SIGTERM to their supervisor (it stops the engine cleanly and exits 0,
    so a service manager sees a clean stop), SIGKILL after ``grace_s``. Detached engines:
    SIGTERM to the root (the HTTP server stops accepting), then, as soon as no request is in
    flight on its port (at most ``drain_s``), SIGKILL of the tree -- vLLM's own shutdown of
    EngineCore and workers takes 1-2 s and frees nothing the kernel does not free at once."""
    t0 = time.monotonic()
    procs = tree(e.pid)
    if not procs:
        unregister(e.pid)
        return 0.0
    foreground = bool(e.supervisor_pid and psutil.pid_exists(e.supervisor_pid))
    try:
        os.kill(e.supervisor_pid if foreground else e.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if foreground:
        alive_pids = set(wait_gone(procs, grace_s))
        alive = [p for p in procs if p.pid in alive_pids]
    else:
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and _client_connections(procs, e.port):
            time.sleep(0.05)
        alive = procs
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_gone(alive, 10)
    unregister(e.pid)
    return time.monotonic() - t0


#: Processes a dead parent's children are reparented to (init, and common subreapers).
REAPERS = frozenset({"systemd", "init", "tini", "dumb-init", "catatonit", "runit", "s6-svscan"})


def _is_engine_root(p: psutil.Process) -> bool:
    """An engine tree's root: its last argument is the engine spec (JSON with the oracle
    prompt) and it is PID 1 of its own PID namespace."""
    try:
        argv = p.cmdline()
        if not argv or not argv[-1].startswith("{") or '"oracle_prompt"' not in argv[-1]:
            return False
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return line.split()[-1] == "1" and len(line.split()) > 2
    except (psutil.Error, OSError):
        return False
    return False


def _serving_pids() -> set[int]:
    """PIDs holding a listening TCP socket of this (the host's) network namespace: a served
    engine holds the one its restore bound and handed over; a never-served orphan has none."""
    try:
        return {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid}
    except (psutil.Error, OSError):
        return set()


def _serves(p: psutil.Process, serving: set[int]) -> bool:
    try:
        return p.pid in serving or any(c.pid in serving for c in p.children(recursive=True))
    except psutil.Error:
        return False


def orphans() -> list[psutil.Process]:
    """Engine trees nobody owns: an engine root that is not registered, whose parent is gone
    (reparented to init or a subreaper) and that serves nothing -- what a SIGKILLed restore
    leaves when CRIU finished after its supervisor died (the tree never got its listening
    socket). A create's engine (child of ``unshare``), a restore in progress (child of its
    restore), every registered engine and every serving engine are never listed: an engine
    that serves but is missing from *this* registry (another ``VLLM_SNAPSHOT_RUN_DIR``, a wiped
    /run) is somebody's live server, not a leftover."""
    known = {e.pid for e in entries()}
    out = []
    serving: set[int] | None = None
    for p in psutil.process_iter(["ppid"]):
        if p.pid in known or not _is_engine_root(p):
            continue
        try:
            ppid = p.info["ppid"]
            parent = psutil.Process(ppid).name() if ppid else ""
        except psutil.Error:
            parent = ""
        if ppid in (0, 1) or parent in REAPERS:
            if serving is None:
                serving = _serving_pids()
            if not _serves(p, serving):
                out.append(p)
    return out
