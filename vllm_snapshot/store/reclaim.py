"""Reclaiming what killed commands left (staging dirs, orphaned engine trees, stale registry
entries and lock files, empty engine cgroups): every prune and the start of every create and
restore."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Leftover:
    """One thing a killed command or an exited engine left. ``kind``: ``staging`` (a dead
    restore's staging dir, ``path``), ``temp`` (a crashed create's temp dir, ``path``),
    ``orphan`` (an engine tree nobody owns: ``proc``, a psutil.Process of its namespace init)
    or ``cgroup`` (an empty engine cgroup leaf, ``path``)."""

    kind: str
    path: Path | None = None
    proc: object = None


def leftovers(near: Path, temps: bool = True, cgroups: bool = True) -> list[Leftover]:
    """What killed commands and exited engines left, found the one way ``reclaim`` (which
    removes them) and ``doctor`` (which lists them) share: staging dirs of dead restores
    (/dev/shm, the staging dir, ``near``), with ``temps`` the temp dirs of crashed creates under
    ``near``, orphaned engine trees, with ``cgroups`` empty engine cgroup leaves. Only reads; a
    source that cannot be read (OSError) is left out."""
    from ..host import cgroups as cg
    from . import archive, registry, store

    out = [Leftover("staging", d) for d in archive.stale_staging(archive.staging_parents(near))]
    if temps:
        try:
            out += [Leftover("temp", p) for p in store.stale_temps(near)]
        except OSError:
            pass
    try:
        out += [Leftover("orphan", proc=p) for p in registry.orphans()]
    except OSError:
        pass
    if cgroups:
        try:
            out += [Leftover("cgroup", p) for p in cg.empty_leaves()]
        except OSError:
            pass
    return out


def reclaim(near: Path, dry_run: bool = False) -> list[str]:
    """Remove what killed commands left (:func:`leftovers`), and say what (one line each):
    staging dirs of dead restores, orphaned engine trees (killed), stale registry entries and
    lock files, empty engine cgroups. Never a live one's. ``dry_run``: only list them (and the
    temp dirs of crashed creates under ``near``, and the empty engine cgroups)."""
    import psutil

    from . import archive, locks, registry

    registry.entries()  # drops entries of dead engines
    gone = []
    for left in leftovers(near, temps=dry_run, cgroups=dry_run):
        if left.kind == "staging":
            if not dry_run:
                archive.remove_staging(left.path)
            gone.append(str(left.path))
        elif left.kind == "orphan":  # a SIGKILLed restore's tree: kill its namespace init
            try:
                if not dry_run:
                    left.proc.kill()
                gone.append(f"orphaned engine tree PID {left.proc.pid}")
            except psutil.Error:
                pass
        elif left.kind == "temp":
            gone.append(str(left.path))
        elif left.kind == "cgroup":
            gone.append(f"empty cgroup {left.path}")
    if not dry_run:
        gone += [str(p) for p in locks.clean_stale()]
        gone += [f"empty cgroup {p}" for p in remove_empty_cgroups()]
    return gone


def remove_empty_cgroups() -> list[str]:
    """:func:`vllm_snapshot.host.cgroups.remove_empty` under the host-wide CRIU lock, which every
    restore holds from creating its engine's cgroup until CRIU has put the tree in it: an empty
    leaf seen under that lock is an exited engine's, never one about to be entered (seen without
    it: two clones restored at once, one's reclaim removed the other's new leaf). When a CRIU
    run holds the lock, nothing is removed now; a later command does it."""
    from ..host import cgroups
    from . import locks
    from ..errors import BusyError

    try:
        with locks.criu_lock(wait_s=0):
            return cgroups.remove_empty()
    except BusyError:
        return []
