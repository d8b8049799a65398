"""Reclaiming what killed commands left (staging dirs, orphaned engine trees, stale registry
entries and lock files, empty engine cgroups): every prune and the start of every create and
restore."""

from __future__ import annotations

from pathlib import Path


def reclaim(near: Path, dry_run: bool = False) -> list[str]:
    """Remove what killed commands left, and say what (one line each): staging dirs of dead
    restores (/dev/shm, the staging dir, ``near``), orphaned engine trees (killed), stale
    registry entries and lock files, empty engine cgroups. Never a live one's. ``dry_run``:
    only list them (and the temp dirs of crashed creates under ``near``)."""
    import psutil

    from . import archive, locks, registry, store

    gone = []
    for d in archive.stale_staging(archive.staging_parents(near)):
        if not dry_run:
            archive.remove_staging(d)
        gone.append(str(d))
    if dry_run:
        gone += [str(p) for p in store.stale_temps(near)]
    registry.entries()  # drops entries of dead engines
    for p in registry.orphans():  # a SIGKILLed restore's tree: kill its namespace init
        try:
            if not dry_run:
                p.kill()
            gone.append(f"orphaned engine tree PID {p.pid}")
        except psutil.Error:
            pass
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
