"""The management commands: ``list`` rows, ``delete``, ``prune``, ``status``, ``stop``,
``switch``. Sequencing only; side effects through :class:`SnapshotTools`."""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

from .. import identity, manifest
from ..errors import BusyError, CorruptSnapshotError, SnapshotError, UsageError
from ..progress import Reporter
from ..registry import Entry
from ..results import Deleted, Engines, Listed, Pruned, Stopped, Switched
from ..tools import LocalTools, SnapshotTools
from .restore import RestoreRequest, restore


def _first_lines(e: Exception) -> str:
    lines = (getattr(e, "message", None) or str(e)).splitlines()
    return lines[0] + (" " + lines[1].strip() if len(lines) > 1 else "")


def describe(snapshot: Path, tools: SnapshotTools | None = None) -> dict:
    """One ``list`` row: name, path, model, created, kind, sleep level, raw/stored bytes,
    whether this host can restore it (``compatible`` + ``why``), last restore (unix s or None).

    Cheap by design (a ``list`` of many snapshots stays fast): trust checks, manifest, layout
    (stat), host identity (probed once per command, not per row) and the model's stat; image
    checksums, mapped-file hashes and the port are left to ``verify``/``restore``."""
    t = tools or LocalTools()
    row: dict = {"name": snapshot.name, "path": str(snapshot), "last_restore": t.last_restore(snapshot)}
    try:
        m = t.open_snapshot(snapshot)
    except Exception as e:  # noqa: BLE001 - a broken snapshot is still listed, as incompatible
        return {**row, "model": None, "created": None, "kind": None, "sleep_level": None,
                "raw_bytes": None, "stored_bytes": None, "compatible": False, "why": _first_lines(e)}
    row.update(model=m.model.requested, created=m.created_at, kind=m.engine.kind, sleep_level=m.engine.sleep_level,
               raw_bytes=m.sizes["raw"], stored_bytes=m.sizes["stored"])
    try:
        hard = [d for d in identity.compare(m.host, t.host_identity(m.engine.kind)) if not d.overridden]
        if hard:
            row.update(compatible=False, why="this host differs: " + "; ".join(map(str, hard)))
            return row
        t.verify_model(Path(m.model.path), m.model.files, "quick")
        row.update(compatible=True, why="")
    except Exception as e:  # noqa: BLE001
        row.update(compatible=False, why=_first_lines(e))
    return row


def list_snapshots(root: Path, tools: SnapshotTools | None = None) -> Listed:
    """``list``: a :func:`describe` row per published snapshot under ``root``."""
    t = tools or LocalTools()
    return Listed(str(root), [describe(p, t) for p in t.list_snapshots(root)])


def _engines_of(t: SnapshotTools, snapshot: Path) -> list[Entry]:
    return [e for e in t.engines() if Path(e.snapshot) == snapshot.absolute()]


def delete(snapshot: Path, force: bool = False, tools: SnapshotTools | None = None) -> Deleted:
    """Delete ``snapshot`` under its exclusive lock. Refuses (BusyError) while an engine
    restored from it runs, unless ``force`` (then they are stopped first). Raises UsageError
    (missing), CorruptSnapshotError (a directory that is not a snapshot)."""
    t = tools or LocalTools()
    snapshot = snapshot.absolute()
    if not t.path_exists(snapshot / manifest.MANIFEST_NAME):
        if not t.path_exists(snapshot):
            raise UsageError(f"{snapshot} does not exist")
        raise CorruptSnapshotError(f"{snapshot} has no manifest.json; refusing to delete a directory that is not a snapshot")
    running = _engines_of(t, snapshot)
    if running and not force:
        raise BusyError(f"engines restored from {snapshot} are running: PIDs {[e.pid for e in running]}",
                        hint="stop them (vllm-snapshot stop), or pass --force")
    for e in running:
        t.stop_engine(e)
    with t.snapshot_lock(snapshot, shared=False):
        t.delete_snapshot(snapshot)
    return Deleted(str(snapshot), [e.pid for e in running])


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"2w"`` -> seconds. Raises UsageError."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise UsageError(f"--older-than {text!r}: expected a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def prune(root: Path, keep: int | None, older_than_s: float | None, dry_run: bool,
          tools: SnapshotTools | None = None) -> Pruned:
    """Select snapshots under ``root`` beyond the ``keep`` newest per model and/or older than
    ``older_than_s`` seconds; delete them unless ``dry_run``; skip those with running engines.
    Also removes leftover temp dirs of crashed creates. Raises UsageError without a criterion."""
    t = tools or LocalTools()
    if keep is None and older_than_s is None:
        raise UsageError("give --keep N and/or --older-than DURATION")
    rows = []
    for p in t.list_snapshots(root):
        try:
            m = t.open_snapshot(p)
            rows.append((m.model.path, _dt.datetime.fromisoformat(m.created_at).timestamp(), p))
        except (SnapshotError, OSError, ValueError):  # unreadable snapshots are left to `delete`
            continue
    victims: set[Path] = set()
    if keep is not None:
        by_model: dict[str, list] = {}
        for model, created, p in rows:
            by_model.setdefault(model, []).append((created, p))
        for items in by_model.values():
            victims |= {p for _, p in sorted(items, reverse=True)[keep:]}
    if older_than_s is not None:
        now = t.now()
        victims |= {p for _, created, p in rows if now - created > older_than_s}
    deleted, kept = [], []
    for p in sorted(victims):
        if _engines_of(t, p):
            kept.append(str(p))
            continue
        if not dry_run:
            with t.snapshot_lock(p, shared=False):
                t.delete_snapshot(p)
        deleted.append(str(p))
    temps = [] if dry_run else [str(x) for x in t.clean_stale_temps(root)]
    return Pruned(deleted, kept, temps, dry_run)


def status(tools: SnapshotTools | None = None) -> Engines:
    """``status``: the registry's live engines, each with its URL."""
    t = tools or LocalTools()
    return Engines([{**e.__dict__, "url": e.url} for e in t.engines()])


def stop_engines(snapshot: Path | None, port: int | None, tools: SnapshotTools | None = None) -> Stopped:
    """Stop registered engines of ``snapshot`` or on ``port``; wait until their processes are
    gone. Raises UsageError when none matches."""
    t = tools or LocalTools()
    match = [e for e in t.engines()
             if (snapshot is not None and Path(e.snapshot) == snapshot.absolute()) or (port is not None and e.port == port)]
    if not match:
        raise UsageError("no restored engine matches " + (f"snapshot {snapshot}" if snapshot else f"port {port}"))
    return Stopped([{"pid": e.pid, "snapshot": e.snapshot, "port": e.port, "seconds": round(t.stop_engine(e), 3)}
                    for e in match])


def switch(snapshot: Path, host: str, port: int, log_file: Path | None, rep: Reporter,
           tools: SnapshotTools | None = None) -> Switched:
    """Stop the engine on ``port`` (if any), restore ``snapshot`` there detached. Durations
    in seconds."""
    t = tools or LocalTools()
    t0 = t.clock()
    stopped = [e.pid for e in t.engines() if e.port == port]
    if stopped:
        with rep.phase("stop_previous", f"stopping the engine on port {port}"):
            stop_engines(None, port, tools=t)
    t1 = t.clock()
    r, engine = restore(RestoreRequest(snapshot=snapshot, host=host, port=port, detach=True, log_file=log_file), rep, tools=t)
    engine.close()
    t2 = t.clock()
    return Switched(str(snapshot.absolute()), port, r.pid, r.url, round(t1 - t0, 3), round(t2 - t1, 3),
                    round(t2 - t0, 3), stopped)
