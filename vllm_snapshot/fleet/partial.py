"""Resumable pulls: the staging dir of a pull, kept when the pull is interrupted so that the
next pull of the same artifact downloads only the layers still missing.

A pull of the artifact whose manifest digest is ``sha256:HEX`` stages into
``STORE/.pull-HEX`` (0700; files 0600), locked (``flock``) by that pull for as long as it runs.
Each layer is written at its offset of its member file; only after the layer's bytes matched
its digest (:mod:`.transport` hashes them as they stream) and were flushed to disk does the
pull write the layer's marker ``.parts/INDEX`` (the layer's index in the manifest, which the
digest fixes). A later pull of the same manifest digest hashes the marked regions again and
skips those that still match; a layer whose bytes no longer match is downloaded again. A
layer cut off half-way continues from the bytes it had flushed (``.parts/INDEX.at``, written
every :data:`.transfer.PROGRESS_BYTES`): that prefix is hashed from disk and only the rest is
fetched, the digest checked over the whole layer (:func:`.transfer.download`). Nothing in ``.pull-*`` is ever
listed (hidden names) or restorable (it is published by rename only after the snapshot's own
checksums passed, as before).

Stale partial dirs are removed by the next pull in the same store: any not locked by a live
pull that holds another artifact (one partial per store is kept), or older than
:data:`MAX_AGE_S`; a pull that fails verification (a digest or checksum that does not match, a
refused config) removes its own. A pull that finds the partial dir locked by another pull of
the same artifact (``pull --name a`` and ``pull --name b`` at once) stages into a fresh private
dir of its own (``.NAME.tmp-*``, removed as before) instead: the two never write one file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EnvironmentProblem

PREFIX = ".pull-"
#: marker dir inside a partial dir: one empty file per layer whose bytes are in place and verified
MARKS = ".parts"
#: a partial dir untouched for this long is removed by the next pull in its store (seconds)
MAX_AGE_S = 24 * 3600.0


@dataclass
class Staging:
    """Where one pull writes: ``path`` (a private dir with ``images/``, ``files/``,
    ``carried/``), ``resumable`` (True for a ``.pull-HEX`` dir whose layers are marked, False
    for a private dir of this pull's own), ``removed`` (stale partial dirs removed, as paths)."""

    path: Path
    resumable: bool
    removed: list[str] = field(default_factory=list)


def partial_dir(root: Path, digest: str) -> Path:
    """The partial dir of the artifact ``digest`` (``sha256:HEX``) in the store ``root``."""
    return Path(root) / (PREFIX + digest.split(":", 1)[-1])


def lock_dir(path: Path, wait: bool = False) -> int | None:
    """An fd of directory ``path`` holding an exclusive flock on it, or None when another
    process holds it (``wait``: wait for it instead) or the dir is gone or was replaced
    meanwhile. The caller closes the fd to unlock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    try:  # locked the dir the path names now (not one renamed away meanwhile)
        same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except OSError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _age_s(path: Path) -> float:
    """Seconds since anything in partial dir ``path`` last changed (its newest marker, the dir)."""
    newest = path.stat().st_mtime
    with contextlib.suppress(OSError):
        newest = max(newest, (path / MARKS).stat().st_mtime)
    return time.time() - newest


def clean_stale(root: Path, keep: str | None, max_age_s: float = MAX_AGE_S) -> list[str]:
    """Remove the partial dirs under ``root`` that no live pull holds and that hold another
    artifact than the dir named ``keep``, or are older than ``max_age_s``. Returns them."""
    removed = []
    for p in sorted(Path(root).glob(PREFIX + "*")):
        if p.is_symlink() or not p.is_dir():
            continue
        fd = lock_dir(p)
        if fd is None:  # a live pull's
            continue
        try:
            if p.name != keep or _age_s(p) > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(str(p))
        finally:
            os.close(fd)
    return removed


def disk_bytes(path: Path) -> int:
    """Bytes of disk the partial dir ``path`` takes (its files' allocated blocks: a member file
    is written layer by layer at its offsets, so it may be sparse); 0 when it cannot be read."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


@dataclass(frozen=True)
class Partial:
    """A partial dir kept for resuming: ``path``, ``bytes`` of disk it takes, ``age_s`` since it
    last changed, ``live`` (a pull holds it now)."""

    path: str
    bytes: int
    age_s: float
    live: bool


def kept(root: Path) -> list[Partial]:
    """The partial dirs under the store ``root`` (interrupted or failed pulls kept for resuming,
    and those of pulls running now), oldest name first. Reads only; never raises for one it
    cannot read (its size is then 0)."""
    out = []
    for p in sorted(Path(root).glob(PREFIX + "*")):
        if p.is_symlink() or not p.is_dir():
            continue
        fd = lock_dir(p)
        if fd is not None:
            os.close(fd)
        try:
            age = _age_s(p)
        except OSError:
            age = 0.0
        out.append(Partial(str(p), disk_bytes(p), round(age, 1), fd is None))
    return out


def _make(path: Path) -> None:
    from ..store.layout import CARRIED, FILES, IMAGES

    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)
    for sub in (IMAGES, FILES, CARRIED, MARKS):
        os.mkdir(path / sub, 0o700)


def _keep_for_resume(exc: BaseException) -> bool:
    """True for the failures after which the partial dir is worth keeping: an interruption
    (a signal, Ctrl-C), a registry/network problem (EnvironmentProblem, or any network error
    :func:`.transport.transient` knows -- ``requests``' and urllib3's included, should one get
    past the retries), or the disk (an OSError: full, read-only; what was verified stays
    verified). Anything else (a digest or checksum that did not match, a refused config, a name
    taken) removes it."""
    from ..errors import Interrupted
    from .transport import transient

    return isinstance(exc, (KeyboardInterrupt, SystemExit, EnvironmentProblem, Interrupted, OSError)) \
        or transient(exc)


def check_private_dirs(path: Path, subs) -> None:
    """Refuse (CorruptSnapshotError, exit 5) a staging dir ``path`` whose ``subs`` are not
    real directories -- a symbolic link there would have the pull write through it."""
    import stat

    from ..errors import CorruptSnapshotError

    for sub in subs:
        p = Path(path) / sub
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptSnapshotError(
                f"{p} in the pull's staging directory is not a directory ("
                + ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a file")
                + ": nothing a pull makes); nothing was written through it",
                hint="pull again: the staging directory was removed and the pull starts afresh",
                details={"path": str(p)})


@contextlib.contextmanager
def staging(dest: Path, digest: str, fresh, discard, max_age_s: float = MAX_AGE_S):
    """The staging dir of a pull of artifact ``digest`` to be published as ``dest`` (see the
    module doc), as a :class:`Staging`; the caller publishes it by rename inside the block.
    ``fresh(dest)`` makes a private dir of this pull's own (used when another pull holds the
    partial dir) and ``discard(path)`` removes one. On an exception the partial dir is kept
    when :func:`_keep_for_resume` says so, else removed; the lock is released either way.
    Raises OSError (the store cannot be written)."""
    root = Path(dest).parent
    path = partial_dir(root, digest)
    removed = clean_stale(root, path.name, max_age_s)
    fd = None
    for _ in range(3):
        if not os.path.lexists(path):
            with contextlib.suppress(FileExistsError):
                _make(path)
        fd = lock_dir(path)
        if fd is not None or os.path.lexists(path):
            break
    if fd is None:  # another pull of this artifact runs: one of our own, not resumable
        own = fresh(dest)
        try:
            yield Staging(own, False, removed)
        except BaseException:
            discard(own)
            raise
        return
    try:
        check_private_dirs(path, ("images", "files", "carried", MARKS))
        for sub in ("images", "files", "carried", MARKS):  # a partial dir from before carried/ existed
            if not os.path.lexists(path / sub):
                os.mkdir(path / sub, 0o700)
        os.utime(path)
        yield Staging(path, True, removed)
    except BaseException as e:
        if not _keep_for_resume(e) and os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def finish(path: Path) -> None:
    """Drop the resume bookkeeping (``.parts``) from a staging dir about to be published."""
    shutil.rmtree(Path(path) / MARKS, ignore_errors=True)
