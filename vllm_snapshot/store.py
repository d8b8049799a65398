"""Snapshot layout, names, and the safety checks run before a snapshot is trusted.

Layout of a published snapshot ``DIR`` (dir 0700, files 0600)::

    DIR/manifest.json      written last; its absence means "incomplete"
    DIR/images/            CRIU images (``NAME`` or ``NAME.zst``), exactly those in the manifest
    DIR/files/             host files CRIU consumes at restore (link-remap files), put back
                           before each restore
    DIR/engine-create.log  the engine's log during create
    DIR/criu-dump.log      CRIU's dump log

A create writes into a hidden sibling ``.DIR.tmp-XXXX`` and publishes it with one rename.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from .errors import CorruptSnapshotError, UsageError

IMAGES = "images"
FILES = "files"
TMP_MARK = ".tmp-"
#: A temp dir without ``owner.pid`` younger than this may be a create that has not written it
#: yet: never removed as stale.
NO_PID_GRACE_S = 60.0


def check_dir_safety(path: Path) -> None:
    """Refuse a snapshot dir we should not trust.

    ``path`` and each parent must not be a symlink (``path`` itself), must be owned by us or
    root, and must not be group/world-writable unless sticky and root-owned (like /tmp).
    ``path`` itself must be mode 0700. Raises CorruptSnapshotError naming the path.
    """
    uid = os.geteuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise UsageError(f"{path} does not exist") from e
    if stat.S_ISLNK(st.st_mode):
        raise CorruptSnapshotError(f"{path} is a symlink; refusing to trust it")
    if not stat.S_ISDIR(st.st_mode):
        raise CorruptSnapshotError(f"{path} is not a directory")
    if st.st_uid != uid:
        raise CorruptSnapshotError(f"{path} is owned by uid {st.st_uid}, not by us (uid {uid})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise CorruptSnapshotError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; a snapshot holds process memory and must be 0700",
            hint=f"chmod -R go-rwx {path}",
        )
    for parent in path.resolve().parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid):
            raise CorruptSnapshotError(f"parent directory {parent} is owned by uid {pst.st_uid}")
        writable = stat.S_IMODE(pst.st_mode) & 0o022
        sticky_root = pst.st_mode & stat.S_ISVTX and pst.st_uid == 0
        if writable and not sticky_root:
            raise CorruptSnapshotError(f"parent directory {parent} is writable by group/others")


def check_file_modes(path: Path) -> None:
    """Refuse files/dirs inside a snapshot that are symlinks or readable by group/others."""
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise CorruptSnapshotError(f"{p} is a symlink; snapshots hold none")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise CorruptSnapshotError(
                    f"{p} has mode {stat.S_IMODE(st.st_mode):04o}; snapshot files must be private (0600/0700)",
                    hint=f"chmod -R go-rwx {path}",
                )


def prepare_target(target: Path) -> Path:
    """Check ``target`` can be created, clean stale temp siblings, and return a new private
    temp dir beside it (with ``images/`` and ``files/``). Raises UsageError."""
    if os.path.lexists(target):
        raise UsageError(f"{target} already exists; refusing to overwrite a snapshot",
                         hint="choose another --snapshot-dir, or delete the old one first")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"parent directory {parent} does not exist")
    clean_stale_temps(parent, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_MARK}", dir=parent))
    os.chmod(tmp, 0o700)
    (tmp / "owner.pid").write_text(str(os.getpid()))
    (tmp / IMAGES).mkdir(mode=0o700)
    (tmp / FILES).mkdir(mode=0o700)
    return tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def clean_stale_temps(parent: Path, name: str | None = None, min_age_s: float = 0.0) -> list[Path]:
    """Remove leftover ``.NAME.tmp-*`` dirs of crashed creates whose owner PID (recorded in
    ``owner.pid``) is dead. Returns what was removed."""
    removed = []
    for p in parent.glob(f".{name or '*'}{TMP_MARK}*"):
        if not p.is_dir() or p.is_symlink():
            continue
        try:
            pid = int((p / "owner.pid").read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid):
            continue
        age = time.time() - p.stat().st_mtime
        if age < min_age_s or (not pid and age < NO_PID_GRACE_S):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def publish(tmp: Path, target: Path) -> None:
    """Atomically rename the finished temp dir to ``target`` and fsync the parent.

    Raises UsageError when ``target`` appeared meanwhile."""
    (tmp / "owner.pid").unlink(missing_ok=True)
    if os.path.lexists(target):
        raise UsageError(f"{target} appeared while the snapshot was being created")
    os.rename(tmp, target)
    dfd = os.open(target.parent, os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
