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
    # every component of the path as given: a symlink is trusted only when root owns it
    # (system layout such as /var/run -> /run); anyone else could redirect us
    probe = Path(path.absolute().anchor)
    for part in path.absolute().parts[1:-1]:
        probe = probe / part
        lst = os.lstat(probe)
        if stat.S_ISLNK(lst.st_mode) and lst.st_uid != 0:
            raise CorruptSnapshotError(f"parent {probe} is a symlink owned by uid {lst.st_uid}; refusing to follow it")
    for parent in path.resolve().parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid):
            raise CorruptSnapshotError(f"parent directory {parent} is owned by uid {pst.st_uid}")
        writable = stat.S_IMODE(pst.st_mode) & 0o022
        sticky_root = pst.st_mode & stat.S_ISVTX and pst.st_uid == 0
        if writable and not sticky_root:
            raise CorruptSnapshotError(f"parent directory {parent} is writable by group/others")


def check_file_modes(path: Path) -> None:
    """Refuse files/dirs inside a snapshot that are symlinks, owned by another user, or
    readable by group/others."""
    uid = os.geteuid()
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise CorruptSnapshotError(f"{p} is a symlink; snapshots hold none")
            if st.st_uid != uid:
                raise CorruptSnapshotError(f"{p} is owned by uid {st.st_uid}, not by us (uid {uid}); refusing to trust it",
                                           hint=f"chown -R {uid} {path} if you trust its origin")
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
    if not parent.exists():
        raise UsageError(f"parent directory {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{parent} is not a directory")
    clean_stale_temps(parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_MARK}", dir=parent))
    except OSError as e:
        raise UsageError(f"cannot create the snapshot in {parent}: {e.strerror}") from e
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


# ----------------------------------------------------------------------------- names, root

def default_root() -> Path:
    """Where named snapshots live: ``$VLLM_SNAPSHOT_ROOT``, else ``/var/lib/vllm-snapshot``
    as root, else ``$XDG_DATA_HOME/vllm-snapshot`` (``~/.local/share/vllm-snapshot``)."""
    env = os.environ.get("VLLM_SNAPSHOT_ROOT")
    if env:
        return Path(env).absolute()
    if os.geteuid() == 0:
        return Path("/var/lib/vllm-snapshot")
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "vllm-snapshot"


def valid_name(name: str) -> bool:
    """Names: letters, digits, ``.``, ``_``, ``-``; not starting with ``.``; <= 128 chars."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", name))


def resolve(ref: str | Path, root: Path | None = None) -> Path:
    """A snapshot reference -> its directory: a bare valid name means ``ROOT/NAME``; anything
    with a ``/`` (or ``.``/``..``) is a path. Raises UsageError for an invalid name."""
    s = str(ref)
    if "/" in s or s in (".", ".."):
        return Path(s).absolute()
    if not valid_name(s):
        raise UsageError(f"{s!r} is neither a path nor a valid snapshot name (letters, digits, . _ -)")
    named = (root or default_root()) / s
    local = Path(s).absolute()
    if local.is_dir() and local != named:
        if named.exists():
            raise UsageError(f"{s!r} is ambiguous: both ./{s} and {named} exist",
                             hint=f"write ./{s} for the directory here, or {named}")
        return local  # e.g. made by `create --snapshot-dir NAME` in this directory
    return named


def ensure_root(root: Path) -> Path:
    """Create the snapshot root (0700) if missing; return it."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def _state_file(snapshot: Path) -> Path:
    import hashlib

    from .locks import RUN_DIR

    key = hashlib.sha256(str(snapshot.absolute()).encode()).hexdigest()[:24]
    d = Path(os.environ.get("VLLM_SNAPSHOT_STATE_DIR", "/var/lib/vllm-snapshot/.state" if os.geteuid() == 0 else str(RUN_DIR / "state")))
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d / f"{key}.json"


def record_restore(snapshot: Path, overrides: list[str] | None = None) -> None:
    """Remember when ``snapshot`` was last restored and which identity overrides that restore
    used (outside the snapshot: it stays unchanged)."""
    import json

    p = _state_file(snapshot)
    p.write_text(json.dumps({"snapshot": str(snapshot.absolute()), "last_restore": time.time(),
                             "overrides": list(overrides or [])}))
    os.chmod(p, 0o600)


def last_restore(snapshot: Path) -> float | None:
    """Unix time of the last successful restore, or None."""
    import json

    try:
        return float(json.loads(_state_file(snapshot).read_text())["last_restore"])
    except (OSError, ValueError, KeyError):
        return None


def list_snapshots(root: Path) -> list[Path]:
    """Published snapshots (dirs with a manifest) directly under ``root``, sorted by name.
    Temp dirs of creates in progress (hidden) are not listed."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()
                  and (p / "manifest.json").is_file())


def delete(snapshot: Path) -> None:
    """Remove a snapshot: first renamed to a hidden temp name (so it vanishes from listings
    atomically), then removed."""
    tmp = snapshot.parent / f".{snapshot.name}{TMP_MARK}deleting-{os.getpid()}"
    os.rename(snapshot, tmp)
    shutil.rmtree(tmp)
