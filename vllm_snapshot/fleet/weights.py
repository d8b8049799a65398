"""A pulled snapshot's weights file on this node: where it goes, whether the node has it, and
how it is staged and placed.

A CPU snapshot maps its weights from ``/ROOT/.weights/BLAKE3.weights`` (store/weights.py) and
CRIU re-opens that mapping by its absolute path, so a pull places the file at exactly the path
the snapshot recorded -- in the source node's root, whatever root the pull writes the snapshot
into (docs/oci-format.md, "The weights file").

* :func:`destination_problem` (before any blob): the path's directories exist as real
  directories (no symlink on the way) or can be created, and its ``.weights`` directory is this
  user's and 0700 (what a restore trusts).
* :func:`present`: a regular file at the path whose bytes hash to the recorded BLAKE3 -- then
  nothing is downloaded for the weights layers.
* :func:`staging`: otherwise the layers are downloaded into ``DIR/.pull-BLAKE3/BLAKE3.weights`` (DIR the
  recorded ``.weights`` directory, 0700, created with its missing parents 0700; the staging dir
  0700, the file 0600), locked (``flock``, blocking: two pulls of the same weights file take
  turns, the second finds it placed); it is resumable like a pull's partial dir
  (:mod:`.partial`: ``.parts`` markers and progress records). :meth:`WeightsStaging.place`
  checks the whole file's BLAKE3 and renames it to ``BLAKE3.weights`` (written once); leaving
  by an interruption or a registry problem keeps the staging dir for the next pull, any other
  failure removes it. Nothing is ever at the recorded path but a complete, verified file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CorruptSnapshotError, IncompatibleHostError, q
from . import partial


def _problem_hint(path: Path) -> str:
    d = path.parent
    return (f"make {d} a real directory this user owns and can write (`install -d -m 0700 {q(d)}` as root, "
            f"after moving away whatever is in the way), then pull again; or pull on a node where {d} can be made")


def destination_problem(path: Path) -> str | None:
    """Why the weights file cannot be placed at ``path`` (absolute, ``.../.weights/NAME``) on
    this node, None when it can: a component on the way that is a symlink or not a directory,
    a missing directory whose parent this user cannot write or is read-only, a ``.weights``
    directory of another owner, with group/other permissions, or not writable. Reads only (lstat, access, statvfs)."""
    probe = Path("/")
    for comp in path.parts[1:-1]:
        parent, probe = probe, probe / comp
        try:
            st = os.lstat(probe)
        except FileNotFoundError:
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"{probe} does not exist and {parent} is not writable by this user"
            if os.statvfs(parent).f_flag & os.ST_RDONLY:
                return f"{probe} does not exist and {parent} is on a read-only file system"
            return None
        except OSError as e:
            return f"{probe} cannot be read: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode):
            return f"{probe} is a symbolic link (the weights file is placed through real directories only)"
        if not stat.S_ISDIR(st.st_mode):
            return f"{probe} is not a directory"
    d = path.parent
    st = os.lstat(d)
    if st.st_uid != os.geteuid():
        return f"{d} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & 0o077:  # as the restore would refuse it (store/weights.py dir_problem)
        return f"{d} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700 (others could replace the file)"
    if not os.access(d, os.W_OK | os.X_OK) or os.statvfs(d).f_flag & os.ST_RDONLY:
        return f"{d} is not writable here"
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return f"{path} is a directory"
    return None


def refusal(path: Path, why: str, where: str) -> IncompatibleHostError:
    """The refusal (exit 3) of a pull whose weights file cannot be placed at ``path``
    (``why``: :func:`destination_problem`), naming the path and a command that makes its
    directory."""
    return IncompatibleHostError(
        f"{where} references the weights file {path}, which this node cannot place there: {why} "
        "(CRIU re-opens the mapping by that absolute path; nothing was downloaded)",
        hint=_problem_hint(path), details={"weights": str(path)})


def present(path: Path, blake3: str, size: int) -> bool:
    """True when a regular file (not a symlink) of ``size`` bytes is at ``path`` and its bytes
    hash to ``blake3``: read whole (the manifest's stat is another node's), unless this node's
    own pin (:func:`..store.weights.write_pin`) vouches for exactly this stat and digest. A file
    hashed here and found right gets that pin, so the restores that follow (and the next pull
    of another snapshot of the same weights) do not hash it again. Never raises."""
    from ..store.weights import hash_file, pin_matches, write_pin

    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    if pin_matches(path, st, blake3):
        return True
    try:
        if hash_file(path) != blake3:
            return False
    except OSError:
        return False
    write_pin(path, blake3, st)  # the stat read before the hash: a change since makes the pin miss
    return True


def _open_dirs(path: Path) -> int:
    """A descriptor of ``path``'s parent directory, walked from ``/`` one component at a time
    with ``O_NOFOLLOW`` (a symlink on the way raises OSError ELOOP/ENOTDIR); missing
    directories are created 0700. The last one (``.weights``) is made 0700."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for comp in path.parts[1:-1]:
            try:
                os.mkdir(comp, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


@dataclass
class WeightsStaging:
    """The staging of one weights file: ``final`` (the recorded path), ``dir`` (its locked
    staging dir ``DIR/.pull-BLAKE3``), ``blake3`` (hex), ``removed`` (stale staging dirs of
    other weights files removed from DIR)."""

    final: Path
    dir: Path
    blake3: str
    removed: list[str] = field(default_factory=list)

    @property
    def data(self) -> Path:
        """The file the layers are written into (named as the final file)."""
        return self.dir / self.final.name

    def link_from(self, src: Path) -> bool:
        """Hard-link ``src`` (a file of the same BLAKE3 elsewhere on this node, e.g. in the
        pulling store's ``.weights``) as the staged data instead of downloading it; False when
        it cannot be linked (another file system) -- then download. The BLAKE3 is checked by
        :meth:`place` as for a download."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.data)
        try:
            os.link(src, self.data, follow_symlinks=False)
        except OSError:
            return False
        return True

    def place(self) -> None:
        """Check the staged file's BLAKE3 (CorruptSnapshotError naming the path when it is not
        the recorded one), make it 0600, flush it, and rename it to :attr:`final` (written
        once: a rename, never a write into an existing file; a mapping of a file that was there
        keeps its pages). Raises OSError."""
        from ..store.weights import hash_file, protect, unprotect, write_pin

        got = hash_file(self.data)
        if got != self.blake3:
            raise CorruptSnapshotError(
                f"the weights file for {self.final} does not hash to its name (BLAKE3 {got[:12]}…); nothing was "
                "placed", hint="the stored artifact is damaged (or was changed): push the snapshot again",
                details={"weights": str(self.final)})
        fd = os.open(self.data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.final.exists():  # a damaged file there (present() said so): replaced, never written into
            unprotect(self.final)
        os.rename(self.data, self.final)
        dfd = os.open(self.final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        protect(self.final)  # immutable, as create publishes it: every engine restored from it maps it
        write_pin(self.final, got)  # hashed above: restores on this node trust its stat (the manifest's is another node's)


@contextlib.contextmanager
def staging(final: Path, blake3: str, where: str = "the artifact"):
    """The locked :class:`WeightsStaging` of the weights file ``final`` (see the module doc):
    creates the missing directories above it (0700) and its staging dir, removes stale staging
    dirs of other weights files beside it (unlocked: :func:`.partial.clean_stale`). On an
    exception the staging dir is kept for an interruption or a registry problem and removed
    otherwise; the lock is released either way. Raises IncompatibleHostError (exit 3) when the
    directory cannot be made, OSError."""
    try:
        os.close(_open_dirs(final))
    except OSError as e:
        raise IncompatibleHostError(
            f"{where}: the directory of the weights file {final} cannot be made here: {e.strerror or e}; nothing "
            "was placed", hint=_problem_hint(final), details={"weights": str(final)}) from e
    d = final.parent
    path = d / f"{partial.PREFIX}{blake3}"
    removed = partial.clean_stale(d, path.name)
    fd = None
    for _ in range(3):
        if not os.path.lexists(path):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        fd = partial.lock_dir(path, wait=True)  # waits for another pull of the same weights
        if fd is not None:
            break
    if fd is None:
        raise OSError(f"the staging dir {path} of the weights file kept disappearing (another pull removing it?)")
    try:
        os.chmod(path, 0o700)
        partial.check_private_dirs(path, (partial.MARKS,))
        os.makedirs(path / partial.MARKS, mode=0o700, exist_ok=True)
        os.utime(path)
        yield WeightsStaging(final, path, blake3, removed)
    except BaseException as e:
        if not partial._keep_for_resume(e):
            shutil.rmtree(path, ignore_errors=True)
        raise
    else:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
