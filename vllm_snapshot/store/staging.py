"""Where restore stages a snapshot's images and the staging dirs' lifecycle: the places
(:func:`staging_parents`: /dev/shm, the staging dir, beside the snapshot), the choice among
them (:func:`staging_parent`), a new private dir named by its owner (:func:`new_stage`), and
the stale ones of dead owners (:func:`stale_staging`, :func:`own_staging`,
:func:`remove_staging`). The image codec that fills them is :mod:`.archive`."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .. import paths
from .manifest import ImageFile


#: Memory-backed staging for compressed images (:func:`staging_parent`).
SHM = Path("/dev/shm")


def staging_parents(near: Path) -> list[Path]:
    """Every directory :func:`staging_parent` may stage under for snapshots beside ``near``
    (/dev/shm, :func:`paths.staging_dir`, ``near``): where :func:`own_staging` and
    :func:`stale_staging` look. Pure."""
    from .. import paths

    return [SHM, paths.staging_dir(), near]


def staging_parent(raw_bytes: int, fallback: Path, images: tuple[ImageFile, ...] = ()) -> Path:
    """Where to stage, the first that fits of:

    1. ``fallback`` (the snapshot's parent: same filesystem, so uncompressed images are
       hard-linked, not copied; nothing is written) when no image is compressed and it is
       writable;
    2. /dev/shm (tmpfs: decompressing or copying there is ~3x faster than onto a disk, see
       docs/history.md) when its free space exceeds ``raw_bytes`` by 25% plus 1 GiB *and*
       the memory on offer (:func:`vllm_snapshot.host.resources.offer`) holds the staged images
       and the restored tree at once (twice ``raw_bytes`` plus 1 GiB): tmpfs pages are RAM until
       the restore removes its staging, and the memory check before CRIU counts the images once;
    3. ``fallback`` when writable (compressed images decompressed onto its disk);
    4. :func:`paths.staging_dir` (a read-only snapshot store: images are copied there).

    Raises EnvironmentProblem when that has too little free space."""
    from .. import paths
    from ..errors import EnvironmentProblem

    writable = os.access(fallback, os.W_OK | os.X_OK) and not _read_only(fallback)
    if writable and images and all(i.compression == "none" for i in images):
        return fallback
    if _free(SHM) > raw_bytes * 1.25 + (1 << 30) and _memory_room() > 2 * raw_bytes + (1 << 30):
        return SHM
    if writable:
        return fallback
    d = paths.ensure_private_dir(paths.staging_dir())
    if _free(d) < raw_bytes * 1.1:
        raise EnvironmentProblem(
            f"the snapshot's directory {fallback} is read-only, and the staging directory {d} has "
            f"{_free(d) >> 20} MiB free; staging needs {raw_bytes >> 20} MiB",
            hint="free space there, or point VLLM_SNAPSHOT_STAGING_DIR at a filesystem with room")
    return d


def _memory_room() -> int:
    """Bytes of memory on offer to this process (MemAvailable or its cgroup's headroom, the
    smaller); 0 when it cannot be read (then nothing is staged in RAM)."""
    from ..host import resources

    try:
        return resources.offer().available
    except (OSError, ValueError):
        return 0


def _free(p: Path) -> int:
    try:
        st = os.statvfs(p)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def _read_only(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return True


#: Staging dirs are ``vllm-snapshot-stage-<owner PID>-XXXX``: one whose owner is gone is stale.
STAGE_PREFIX = "vllm-snapshot-stage-"


def stale_staging(parents: list[Path]) -> list[Path]:
    """Staging dirs under ``parents`` whose owner process is gone (a SIGKILLed restore), or
    that carry no owner PID (made by an older version); a live owner's are never listed."""
    import psutil

    out = []
    for d in parents:
        try:
            entries = list(d.glob(f"{STAGE_PREFIX}*"))
        except OSError:
            continue
        for p in entries:
            if not p.is_dir() or p.is_symlink():
                continue
            head = p.name[len(STAGE_PREFIX):].split("-", 1)[0]
            pid = int(head) if head.isdigit() else 0
            if pid and psutil.pid_exists(pid):
                try:
                    if psutil.Process(pid).create_time() <= p.stat().st_mtime + 1:
                        continue  # its owner (not a reused PID) is still running
                except psutil.Error:
                    pass
            out.append(p)
    return sorted(out)


def own_staging(parents: list[Path], pid: int | None = None) -> list[Path]:
    """Staging dirs under ``parents`` made by process ``pid`` (default this one): how a failed
    or interrupted restore finds its staging even when a signal landed between creating it
    and remembering it."""
    mark = f"{STAGE_PREFIX}{pid or os.getpid()}-"
    out = []
    for d in parents:
        try:
            out += [p for p in d.glob(f"{mark}*") if p.is_dir() and not p.is_symlink()]
        except OSError:
            continue
    return sorted(out)


def remove_staging(stage: Path) -> None:
    """Remove a staging dir made by :func:`unpack` (never follows its symlinks)."""
    shutil.rmtree(stage, ignore_errors=True)


def new_stage(parent: Path) -> Path:
    """A new private (0700) staging dir under ``parent``, named by this process's PID
    (:data:`STAGE_PREFIX`), so that a later command can tell a dead owner's. Raises OSError."""
    return Path(tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=parent))
