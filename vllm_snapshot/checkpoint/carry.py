"""Files that travel with a snapshot: the one owner of the ``carried/`` member.

An engine that compiled (no ``--enforce-eager``) maps kernels from the engine user's compile
caches (vLLM's ``torch_compile_cache``, TorchInductor, Triton, under its HOME). CRIU does not
copy a mapped file into the images: it re-opens it by path at restore and only checks its size,
ELF build-id and mode. Such files are rotated by other creates, removed by whoever cleans
``~/.cache``, and never present on a fresh node; before this module every restore then
refused ("... vanished").

So at create (:func:`select`, :func:`collect`) every regular file the tree has open or mapped
*outside* the model, the Python environment and the system is copied into the snapshot's
``carried/`` directory, one copy per content, named by its BLAKE3, and recorded in the manifest
(:class:`~vllm_snapshot.store.manifest.Carried`: path, size, digest, mode, owner, mtime, and the
directories above it). The model is pinned by its own digest; the Python environment by the
code identity and the host's versions; the system by the host identity: those must match on
the restoring host and are not copied (copying 1.5 GB of torch libraries into every snapshot,
or writing into another node's ``/usr``, would be wrong), so a change there still refuses.

At restore (:func:`plan`, then :func:`put_back`, right before CRIU under the host-wide CRIU
lock, so no concurrent restore replaces a file between our put-back and our CRIU) each carried
file is one of:

- **missing** -> put back: written to a temp name in its directory (directories above it
  created with the recorded mode and owner when missing), owner, mode and mtime set, renamed
  into place;
- **present, same stat** (size, mtime, mode) -> used as is;
- **present, other stat** -> re-hashed: same content and mode -> used as is (a rotation that
  rewrote identical bytes; CRIU checks only size, build-id and mode);
- **present, other content (or mode)** -> replaced, by rename, when it is the engine user's own
  file (a cache entry it wrote: the snapshot's copy is a valid entry for the same key) and no
  live process has it open or mapped; a rename never changes what a live process mapped, but
  a create in progress that maps it would find its mapping deleted at its dump, so a held file
  is left alone and the restore refuses as *busy*, naming the file and the holders (retry when
  they are gone). A file of another owner that differs is the host's software: refused as a
  host difference, naming it (never overwritten);
- **not a regular file, or a symlink/non-directory above it** -> refused, naming it (the
  recorded path is canonical; nothing is ever written through a symlink: every directory is
  opened with ``O_NOFOLLOW`` from ``/`` down).

Files put back stay after the restore, whatever its outcome: they are the cache entries the
engine expects (it may open them again by path), as a create would have left them.

Fail closed: every stored copy's digest is checked before anything is placed; a copy that fails
refuses (CorruptSnapshotError naming the host path), and a copy is hashed again as it is
written.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import blake3

from ..errors import BusyError, CorruptSnapshotError, IncompatibleHostError
from ..store.manifest import Carried, CarriedDir, CarriedFile, ImageFile, TreeFile

CHUNK = 1 << 20
#: The system: files here are the host's, pinned by the host identity (kernel, glibc, driver,
#: ...); a snapshot never carries them.
SYSTEM_PREFIXES: tuple[str, ...] = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc")
#: Prefix of the temp names a put-back writes before its rename.
TMP_PREFIX = ".vllm-snapshot-carry."


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def python_prefixes(sys_prefixes: Iterable[str], sys_path: Iterable[str]) -> tuple[str, ...]:
    """The Python environment as directory prefixes: the interpreter's prefixes
    (``sys.prefix``, ``sys.base_prefix``, ...) and the engine's ``sys.path`` entries, resolved;
    ``/``, relative and empty entries are dropped (the engine runs in ``/``, which ``-m`` puts
    on ``sys.path``: it must not swallow every file). Pure over the file system's symlinks."""
    out = []
    for p in [*sys_prefixes, *sys_path]:
        if not p or not os.path.isabs(p):
            continue
        r = os.path.realpath(p)
        if r != "/" and r not in out:
            out.append(r)
    return tuple(out)


def select(files: Iterable[TreeFile], model_paths: Iterable[str], env_prefixes: Iterable[str],
           system_prefixes: Iterable[str] = SYSTEM_PREFIXES) -> list[str]:
    """Paths of the tree files a snapshot carries: every one not under ``model_paths`` (the
    model directory and the resolved path of each model file: a Hugging Face snapshot's files
    are symlinks into ``blobs/``), ``env_prefixes`` (:func:`python_prefixes`) or
    ``system_prefixes``. Sorted. Pure."""
    model = tuple(model_paths)
    skip = (*model, *env_prefixes, *system_prefixes)
    return sorted({f.path for f in files if not _under(f.path, skip)})


def _hash_copy(src_fd: int, dst: Path | None) -> tuple[str, int]:
    h = blake3.blake3()
    n = 0
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600) if dst is not None else None
    try:
        while chunk := os.read(src_fd, CHUNK):
            h.update(chunk)
            n += len(chunk)
            if out is not None:
                os.write(out, chunk)
    finally:
        if out is not None:
            os.close(out)
    return h.hexdigest(), n


def collect(paths: Iterable[str], dest: Path) -> tuple[tuple[CarriedFile, ...], tuple[CarriedDir, ...]]:
    """Copy each file at ``paths`` into ``dest`` (created 0700) as ``dest/<BLAKE3>`` (0600; one
    copy per content) and record it, with every directory above it. A file is opened without
    following a symlink and recorded from the descriptor it was read through (its size, mode,
    owner and mtime describe the bytes copied); a file that changed while it was copied is
    read again. A file gone meanwhile is skipped (the tree cannot have it mapped by that
    path). Returns (files, directories), sorted by path. Raises OSError."""
    dest.mkdir(mode=0o700, exist_ok=True)
    files: list[CarriedFile] = []
    dirs: dict[str, CarriedDir] = {}
    for path in paths:
        for _ in range(3):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                break
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    break
                tmp = dest / f".partial-{os.getpid()}"
                tmp.unlink(missing_ok=True)
                digest, n = _hash_copy(fd, tmp)
                st2 = os.fstat(fd)
            finally:
                os.close(fd)
            if (n, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                tmp.unlink(missing_ok=True)
                continue  # written to while we read it: again
            blob = dest / digest
            if blob.exists():
                tmp.unlink()
            else:
                os.rename(tmp, blob)
            files.append(CarriedFile(path=path, size=n, blake3=digest, mode=stat.S_IMODE(st.st_mode),
                                     uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns))
            for d in Path(path).parents:
                if str(d) == "/" or str(d) in dirs:
                    continue
                dst = os.lstat(d)
                dirs[str(d)] = CarriedDir(path=str(d), mode=stat.S_IMODE(dst.st_mode), uid=dst.st_uid, gid=dst.st_gid)
            break
        else:
            raise OSError(f"{path} kept changing while it was copied into the snapshot")
    return tuple(sorted(files, key=lambda f: f.path)), tuple(sorted(dirs.values(), key=lambda d: d.path))


def changed_since(records: Iterable[TreeFile], files: Iterable[CarriedFile]) -> list[str]:
    """Carried files whose size or mtime differ from the inventory's record of the same path
    (``records``: taken while the tree was inspected): the file was replaced between the
    inventory and the copy, so the copy may not hold the bytes the tree maps. Pure."""
    rec = {r.path: r for r in records}
    out = []
    for f in files:
        r = rec.get(f.path)
        if r is not None and ((r.size, r.mtime_ns) != (f.size, f.mtime_ns)
                              or (r.blake3 is not None and r.blake3 != f.blake3)):
            out.append(f"{f.path}: {r.size} bytes, mtime {r.mtime_ns} at the inventory; {f.size} bytes, "
                       f"mtime {f.mtime_ns} when copied")
    return out


def carried(files: tuple[CarriedFile, ...], dirs: tuple[CarriedDir, ...], blobs: tuple[ImageFile, ...]) -> Carried:
    """The manifest record. Pure. Raises ValueError (pydantic) when blobs and files disagree."""
    return Carried(files=files, dirs=dirs, blobs=blobs)


# ----------------------------------------------------------------------------- restore

@dataclass
class Plan:
    """What :func:`plan` found: ``place`` -- files to write (missing, or the engine user's own
    file with other content); ``kept`` -- present files used as they are; ``differs`` -- refusal
    lines for what must not be replaced (another owner's file, not a regular file, a symlink
    on the way); ``held`` -- refusal lines for differing files a live process has open or
    mapped."""

    place: list[CarriedFile] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    differs: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)


def _hash_path(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return _hash_copy(fd, None)[0]
    finally:
        os.close(fd)


def _walk_problem(path: str) -> str | None:
    """Why the directories above ``path`` cannot be walked without following a symlink (None:
    each existing one is a real directory)."""
    probe = "/"
    for part in Path(path).parts[1:-1]:
        probe = os.path.join(probe, part)
        try:
            st = os.lstat(probe)
        except FileNotFoundError:
            return None  # created by the put-back
        if stat.S_ISLNK(st.st_mode):
            return f"{probe} is a symlink here (a real directory at create); nothing is written through it"
        if not stat.S_ISDIR(st.st_mode):
            return f"{probe} is not a directory here"
    return None


def holders(path: str, proc: str = "/proc") -> list[str]:
    """``PID (command)`` of every process that has the file now at ``path`` open or mapped
    (by device and inode, over ``proc``). Empty when the file is gone or nothing holds it."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    want_dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    out = []
    for pid in (p for p in os.listdir(proc) if p.isdigit()):
        hit = False
        try:
            with open(f"{proc}/{pid}/maps") as f:
                for line in f:
                    c = line.split(maxsplit=5)
                    if len(c) >= 5 and c[4] == str(st.st_ino) and c[3] == want_dev:
                        hit = True
                        break
            if not hit:
                for fd in os.listdir(f"{proc}/{pid}/fd"):
                    try:
                        fst = os.stat(f"{proc}/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                        hit = True
                        break
        except OSError:
            continue
        if hit:
            try:
                with open(f"{proc}/{pid}/comm") as f:
                    out.append(f"PID {pid} ({f.read().strip()})")
            except OSError:
                out.append(f"PID {pid}")
    return out


def plan(c: Carried, held_by: Callable[[str], list[str]] = holders) -> Plan:
    """Decide, per carried file, what restore does (see the module doc). Reads the host
    (lstat; a re-hash when the stat differs; ``held_by(path)`` only for a differing file);
    writes nothing. Never raises for a file's state: unreadable files are ``differs``."""
    out = Plan()
    for f in c.files:
        why = _walk_problem(f.path)
        if why:
            out.differs.append(f"{f.path}: {why}")
            continue
        try:
            st = os.lstat(f.path)
        except FileNotFoundError:
            out.place.append(f)
            continue
        except OSError as e:
            out.differs.append(f"{f.path} cannot be read: {e.strerror or e}")
            continue
        if not stat.S_ISREG(st.st_mode):
            out.differs.append(f"{f.path} is not a regular file here (a file of the snapshot, "
                               f"{f.size} bytes, at create)")
            continue
        mode_same = stat.S_IMODE(st.st_mode) == f.mode
        if mode_same and (st.st_size, st.st_mtime_ns) == (f.size, f.mtime_ns):
            out.kept.append(f.path)
            continue
        try:
            same = st.st_size == f.size and _hash_path(f.path) == f.blake3
        except OSError as e:
            out.differs.append(f"{f.path} cannot be read: {e.strerror or e}")
            continue
        if same and mode_same:
            out.kept.append(f.path)
            continue
        what = "mode " + f"{stat.S_IMODE(st.st_mode):04o} (was {f.mode:04o})" if same else \
            f"content differs ({st.st_size} bytes here, {f.size} in the snapshot)"
        if st.st_uid != f.uid or f.uid == 0:
            out.differs.append(f"{f.path}: {what}; it belongs to uid {st.st_uid} (not the engine's own file, "
                               "so it is not replaced)")
            continue
        who = held_by(f.path)
        if who:
            out.held.append(f"{f.path}: {what}, and it is open or mapped by {', '.join(who[:5])}")
            continue
        out.place.append(f)
    return out


def refusal(p: Plan) -> IncompatibleHostError | BusyError | None:
    """The error a restore raises for ``p`` (None: nothing refuses): a differing file of
    another owner or type -> IncompatibleHostError; otherwise a differing file held by a live
    process -> BusyError (transient: retry when the holder is gone; the snapshot is fine)."""
    if p.differs:
        return IncompatibleHostError(
            "files the engine had open or mapped, which the snapshot carries, differ here and are not "
            "the engine's own to replace:\n  " + "\n  ".join(p.differs),
            hint="restore on a host whose files match (or remove what is in the way), or re-create the snapshot",
            details={"carried": p.differs})
    if p.held:
        return BusyError(
            "files the snapshot carries differ here and a live process has them open or mapped; "
            "replacing them could break that process's next dump:\n  " + "\n  ".join(p.held),
            hint="restore again once that process is gone (a create in progress ends by itself); the snapshot "
                 "itself is fine",
            details={"carried": p.held})
    return None


def verify(c: Carried, blobs_dir: Path) -> None:
    """Every stored copy's BLAKE3 (decompressed as needed). Raises CorruptSnapshotError
    naming the host path(s) whose copy fails. Writes nothing."""
    from ..store import archive, checksums

    by_blob: dict[str, list[str]] = {}
    for f in c.files:
        by_blob.setdefault(f.blake3, []).append(f.path)
    for b in c.blobs:
        try:
            checksums.verify(blobs_dir, (b,))
        except CorruptSnapshotError as e:
            raise CorruptSnapshotError(
                f"the snapshot's copy of {', '.join(by_blob.get(b.name, ['?']))} ({blobs_dir.name}/"
                f"{archive.stored_name(b)}) fails its checksum: {e.message}",
                hint="the snapshot is damaged; restore its directory from a backup, or re-create it",
                details={"carried": by_blob.get(b.name, [])}) from e


def _open_dir_chain(path: str, dirs: dict[str, CarriedDir]) -> int:
    """An ``O_PATH``-free descriptor of ``path``'s parent directory, walked from ``/`` one
    component at a time with ``O_NOFOLLOW`` (a symlink anywhere raises OSError ELOOP or
    ENOTDIR); missing directories are created with their recorded mode and owner."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    probe = "/"
    try:
        for part in Path(path).parts[1:-1]:
            probe = os.path.join(probe, part)
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                rec = dirs.get(probe)
                mode = rec.mode if rec else 0o700
                os.mkdir(part, 0o700, dir_fd=fd)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if rec is not None:
                    os.fchown(nfd, rec.uid, rec.gid)
                os.fchmod(nfd, mode)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def put_back(c: Carried, blobs_dir: Path, todo: Iterable[CarriedFile]) -> list[str]:
    """Write each of ``todo`` at its path from its stored copy: a temp name in the same
    directory (``O_EXCL``), the content hashed as it is written (a mismatch removes the temp
    file and raises CorruptSnapshotError), owner, mode and mtime set, fsync, then one rename
    (atomic: a reader sees the old file or ours, a live mapping of the old one is untouched).
    Returns the paths written. Raises OSError (a symlink on the way: ELOOP/ENOTDIR),
    CorruptSnapshotError."""
    import zstandard

    from ..store import checksums

    blobs = {b.name: b for b in c.blobs}
    dirs = {d.path: d for d in c.dirs}
    placed = []
    for f in todo:
        dfd = _open_dir_chain(f.path, dirs)
        name = os.path.basename(f.path)
        tmp = f"{TMP_PREFIX}{os.getpid()}.{name}"[:255]
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                h = blake3.blake3()
                n = 0
                try:
                    with checksums.open_raw(blobs_dir, blobs[f.blake3]) as src:
                        while chunk := src.read(CHUNK):
                            h.update(chunk)
                            n += len(chunk)
                            os.write(out, chunk)
                except zstandard.ZstdError:
                    n = -1  # a damaged stream: the same refusal as a wrong digest
                if (n, h.hexdigest()) != (f.size, f.blake3):
                    raise CorruptSnapshotError(f"the snapshot's copy of {f.path} fails its checksum while it is "
                                               "put back", hint="the snapshot is damaged; re-create it")
                os.fchown(out, f.uid, f.gid)
                os.fchmod(out, f.mode)
                os.utime(out, ns=(f.mtime_ns, f.mtime_ns))
                os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        finally:
            os.close(dfd)
        placed.append(f.path)
    return placed


__all__ = ["SYSTEM_PREFIXES", "Plan", "carried", "changed_since", "collect", "holders", "plan", "put_back", "python_prefixes",
           "refusal", "select", "verify"]
