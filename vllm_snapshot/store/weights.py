"""The store's weights files: a CPU engine's post-processed weights, outside the CRIU images.

A snapshot *references* its weights instead of copying them (the engine side is
:mod:`vllm_snapshot.engine.weights`): at create the worker writes its large parameters and
buffers into one file and maps it ``MAP_PRIVATE``; CRIU then dumps that memory as a reference to
the file, and a restore maps it again, its pages coming from the page cache, shared by every
engine restored from any snapshot of the same weights.

Layout: ``ROOT/.weights/BLAKE3.weights`` beside the snapshots of ``ROOT``; the directory is
0700, each file 0600, root-owned, written once (temp + fsync + rename) and never changed. The
name is the BLAKE3 of the file's bytes, so one file serves every snapshot of the same model
bytes, dtype and post-processing. A snapshot's manifest records the file (path, size, digest,
stat) in ``weights``; it is checked like the model files (:func:`check`: stat-pinned, re-hashed
when the stat changed, hashed whole by ``verify``) before CRIU runs, and a missing or changed
file refuses naming it (``serve`` builds a new snapshot). Which snapshots use a file is read
from their manifests, never from a counter: :func:`unreferenced` lists the files no manifest
under the root names, which ``delete`` and ``prune`` remove.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ..errors import EnvironmentProblem, ModelChangedError, SnapshotError, q
from .layout import LINK, MANIFEST, NOT_DIR, OWNER, private_dir_fault
from .manifest import WeightsFile, parse
from .model_digest import hash_file, stat_unchanged  # one BLAKE3 of a file and one stat pin, as for model files

#: The directory of weights files under a snapshot root.
DIR = ".weights"
SUFFIX = ".weights"
#: Prefix of the temp files a create writes before the rename.
TMP_PREFIX = ".incoming-"
#: Suffix of a weights file's node-local stat pin (``BLAKE3.weights.pin``, see :func:`write_pin`).
PIN_SUFFIX = ".pin"
#: A weights file larger than this is refused (bytes): a bound on what a worker can ask create
#: to allocate, far above any TP1 engine's host memory.
MAX_BYTES = 1 << 40


def directory(root: Path) -> Path:
    """``root/.weights``. Pure."""
    return root / DIR


def path_of(root: Path, digest: str) -> Path:
    """The weights file of ``digest`` under ``root``. Pure."""
    return directory(root) / f"{digest}{SUFFIX}"


def dir_problem(d: Path) -> EnvironmentProblem | None:
    """The refusal (exit 11, a fault of the store's directories: the snapshots themselves are
    intact) of the weights directory ``d`` when it exists but is not what docs/weights.md
    promises -- a real directory, root-owned, 0700 -- judged by the snapshot directories' own
    rule (:func:`vllm_snapshot.store.layout.private_dir_fault`, owner root): its owner or anyone a
    group/other bit lets in could replace the files (and pins) every engine restored from these
    snapshots maps. None when it is such a directory, or missing. Reads one ``lstat``."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    except OSError as e:
        return EnvironmentProblem(f"the weights directory {d} cannot be read: {e.strerror}")
    fault = private_dir_fault(st, 0)
    if fault is None:
        return None
    rebuild = "create makes it itself; snapshots whose weights file it held must be created again"
    if fault in (LINK, NOT_DIR):
        what = f"a symlink (to {os.path.realpath(d)})" if fault == LINK else "not a directory"
        return EnvironmentProblem(f"the weights directory {d} is {what}: the snapshots' weights files are kept in "
                                  "a real root-owned 0700 directory only",
                                  hint=f"move it away (`mv {q(d)} {q(str(d) + '.moved')}`); {rebuild}")
    why = (f"is owned by uid {st.st_uid}, not root" if fault == OWNER
           else f"has mode {st.st_mode & 0o7777:04o}, not 0700")
    return EnvironmentProblem(f"the weights directory {d} {why}: other users could replace the weights files (and "
                              "their pins) the snapshots' engines map", details={"weights_dir": str(d)},
                              hint=f"if you trust what is in it, `chown root:root {q(d)} && chmod 0700 {q(d)}` "
                                   f"(each file in it is checked again); else remove it (`chattr -R -i {q(d)} && "
                                   f"rm -r {q(d)}`): {rebuild}")


def ensure_dir(root: Path) -> Path:
    """Create ``root/.weights`` (0700, root's) if missing and return it. Raises OSError;
    EnvironmentProblem when one exists that :func:`dir_problem` refuses (it is never adopted)."""
    d = directory(root)
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        problem = dir_problem(d)
        if problem is not None:
            raise problem from None
    os.chmod(d, 0o700)
    return d


#: ``FS_IOC_GETFLAGS``/``FS_IOC_SETFLAGS`` (linux/fs.h, 64-bit) and ``FS_IMMUTABLE_FL``.
_GETFLAGS, _SETFLAGS, _IMMUTABLE = 0x80086601, 0x40086602, 0x00000010


def _flags(path: Path, set_: bool) -> bool:
    """Set (``set_``) or clear the immutable attribute (``chattr +i``) of ``path``. Returns
    False where the file system has no such attribute (tmpfs, ...). Raises OSError otherwise."""
    import array
    import errno
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        buf = array.array("l", [0])
        try:
            fcntl.ioctl(fd, _GETFLAGS, buf, True)
        except OSError as e:
            if e.errno in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
                return False
            raise
        want = (buf[0] | _IMMUTABLE) if set_ else (buf[0] & ~_IMMUTABLE)
        if want != buf[0]:
            fcntl.ioctl(fd, _SETFLAGS, array.array("l", [want]))
        return True
    finally:
        os.close(fd)


def protect(path: Path) -> bool:
    """Make the published weights file immutable (``chattr +i``): every running engine maps
    it, and a write to it (a ``cp`` of a "backup" over it, a ``truncate``) would change what
    they compute with, or kill them with SIGBUS. Returns False where the file system has no
    such attribute. Raises OSError."""
    return _flags(path, True)


def unprotect(path: Path) -> None:
    """Clear the immutable attribute before the file is removed or replaced. Raises OSError."""
    _flags(path, False)


def immutable(path: Path) -> bool:
    """True when ``path`` has the immutable attribute. Raises OSError."""
    import array
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        buf = array.array("l", [0])
        fcntl.ioctl(fd, _GETFLAGS, buf, True)
        return bool(buf[0] & _IMMUTABLE)
    finally:
        os.close(fd)


def record(path: Path, digest: str, tensors: int = 0, mapped_bytes: int = 0) -> WeightsFile:
    """The manifest's record of the weights file at ``path`` whose content has ``digest``:
    size, stat pins (mtime_ns, ctime_ns, inode, device), and what the engine mapped of it.
    Raises OSError."""
    st = os.stat(path)
    return WeightsFile(path=str(path), size=st.st_size, blake3=digest, mtime_ns=st.st_mtime_ns,
                       ctime_ns=st.st_ctime_ns, inode=st.st_ino, device=st.st_dev, tensors=tensors,
                       mapped_bytes=mapped_bytes)


def publish(tmp: Path, root: Path) -> tuple[Path, str, bool]:
    """Publish the written temp file ``tmp`` (in ``root/.weights``): fsync it, hash it, and
    rename it to ``BLAKE3.weights`` -- or, when a file of that name exists and its bytes hash to
    its name, drop ``tmp`` and use that one (written once: its inode, and every page cached of
    it, stays). A same-named file whose bytes do not match its name is replaced. Returns
    (final path, digest, True when an existing file was reused). Raises OSError."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    digest = hash_file(tmp)
    final = path_of(root, digest)
    reused = False
    if final.exists():
        try:
            reused = hash_file(final) == digest
        except OSError:
            reused = False
    if reused:
        tmp.unlink()
        st = final.stat()
        if (st.st_mode & 0o7777) != 0o600 or st.st_uid != 0 or st.st_gid != 0:  # put right what check() refuses
            unprotect(final)
            os.chown(final, 0, 0)
            os.chmod(final, 0o600)
    else:
        os.chmod(tmp, 0o600)
        if final.exists():
            unprotect(final)
        os.replace(tmp, final)
        dfd = os.open(final.parent, os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    protect(final)
    return final, digest, reused


def check(rec: WeightsFile, full: bool = False) -> str | None:
    """Why the weights file of ``rec`` cannot serve (None when it can): missing, not a regular
    file, another size, or -- when its stat changed since create, or ``full`` -- bytes whose
    BLAKE3 is not the recorded one. An unchanged stat is trusted (``quick``), as for model files."""
    found = problem(rec, full)
    return None if found is None else found[0]


def problem(rec: WeightsFile, full: bool = False) -> tuple[str, bool] | None:
    """:func:`check`'s reason, and whether it is the file's content (another size, other bytes:
    True -- no fix here brings the recorded bytes back) rather than something an operator fixes
    (missing, unreadable, not a regular file, its mode or owner: False); None when it can serve."""
    p = Path(rec.path)
    try:
        st = os.stat(p, follow_symlinks=False)
    except FileNotFoundError:
        return f"the weights file {p} is missing", False
    except OSError as e:
        return f"the weights file {p} cannot be read: {e.strerror}", False
    import stat as _stat

    if not _stat.S_ISREG(st.st_mode):
        return f"the weights file {p} is not a regular file", False
    if _stat.S_IMODE(st.st_mode) != 0o600 or st.st_uid != 0:
        # CRIU re-opens a mapped file only with the mode it had at the dump ("bad mode"), and a
        # file another user owns could have been rewritten by that user
        return (f"the weights file {p} has mode {_stat.S_IMODE(st.st_mode):04o} and owner uid {st.st_uid}, not 0600 "
                f"and root (fix: chattr -i {q(p)}; chown root:root {q(p)} && chmod 0600 {q(p)}; chattr +i {q(p)})"), False
    if st.st_size != rec.size:
        return f"the weights file {p} has {st.st_size} bytes, not the {rec.size} it had at create", True
    pinned = stat_unchanged(st, rec) or pin_matches(p, st, rec.blake3)
    if pinned and not full:
        return None
    try:
        got = hash_file(p)
    except OSError as e:
        return f"the weights file {p} cannot be read: {e.strerror}", False
    if got != rec.blake3:
        return f"the weights file {p} changed since create (BLAKE3 {got[:12]}…, recorded {rec.blake3[:12]}…)", True
    write_pin(p, got, st)  # hashed whole and right: the next check on this node trusts this stat
    return None


def pin_path(path: Path) -> Path:
    """The node-local stat pin of the weights file ``path`` (``path`` + ``.pin``). Pure."""
    return path.with_name(path.name + PIN_SUFFIX)


def write_pin(path: Path, blake3: str, st: os.stat_result | None = None) -> bool:
    """Record, beside the weights file ``path``, that its bytes hashed to ``blake3`` while it had
    the stat ``st`` (default: its stat now): size, mtime, ctime, inode, device. A manifest pins
    the stat the file had on the node that created it; a file placed by a pull, or re-hashed after
    its stat changed (a restore from backup, ``chattr``), has another, and without this pin every
    restore on this node would hash it whole again (seconds per GiB). The pin lives in the
    root-owned 0700 ``.weights`` directory (0600, temp + rename), so only root can vouch for a
    stat; :func:`check` trusts it exactly as it trusts the manifest's. Returns False when it
    cannot be written (not root, read-only store): the next check hashes again. Never raises."""
    try:
        st = os.stat(path, follow_symlinks=False) if st is None else st
        doc = {"blake3": blake3, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
               "inode": st.st_ino, "device": st.st_dev}
        dst = pin_path(path)
        tmp = dst.with_name(f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}{PIN_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, dst)
        return True
    except OSError:
        return False


def pin_matches(path: Path, st: os.stat_result, blake3: str) -> bool:
    """True when the node-local pin of ``path`` (:func:`write_pin`) names ``blake3`` and the stat
    ``st``, and the pin is a root-owned 0600 regular file. Never raises."""
    import stat as _stat

    pin = pin_path(path)
    try:
        pst = os.stat(pin, follow_symlinks=False)
        if not _stat.S_ISREG(pst.st_mode) or pst.st_uid != 0 or _stat.S_IMODE(pst.st_mode) & 0o077:
            return False
        doc = json.loads(pin.read_text())
        return (isinstance(doc, dict) and doc.get("blake3") == blake3
                and (doc.get("size"), doc.get("mtime_ns"), doc.get("ctime_ns"), doc.get("inode"), doc.get("device"))
                == (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    except (OSError, ValueError):
        return False


def refuse(rec: WeightsFile, full: bool = False) -> None:
    """Raise ModelChangedError (exit 4, before CRIU) when :func:`check` finds a problem: a
    restored engine would compute with other weights, or CRIU could not map them. ``details``:
    ``{"weights": path, "changed": [path] when its content differs (:func:`problem`), else []}``,
    the shape of a model check's ``changed``. First EnvironmentProblem (exit 11) when the file's
    directory is not a root-owned 0700 one (:func:`dir_problem`): whatever it holds now is not
    vouched for."""
    bad_dir = dir_problem(Path(rec.path).parent)
    if bad_dir is not None:
        raise bad_dir
    found = problem(rec, full)
    if found is not None:
        why, content = found
        raise ModelChangedError(why + "; the snapshot's engine maps its weights from that file",
                                hint="`vllm-snapshot serve` builds a new snapshot (and weights file); or delete this "
                                     "snapshot and create it again",
                                details={"weights": rec.path, "changed": [rec.path] if content else []})


def referenced(root: Path) -> tuple[set[str], list[str]]:
    """The weights-file paths the snapshots directly under ``root`` name in their manifests,
    and the snapshot directories whose manifest could not be read (a caller that removes files
    must then keep them all: such a snapshot may name any). Never raises for a bad manifest."""
    names: set[str] = set()
    unreadable: list[str] = []
    try:
        children = sorted(root.iterdir())
    except OSError:
        return names, [str(root)]
    for d in children:
        if d.name.startswith(".") or not d.is_dir() or d.is_symlink():
            continue
        mf = d / MANIFEST
        if not mf.exists():
            continue
        try:
            m = parse(mf.read_text(), str(mf))
        except (OSError, UnicodeDecodeError, SnapshotError):
            unreadable.append(str(d))
            continue
        if m.weights is not None:
            names.add(m.weights.path)
    return names, unreadable


def unreferenced(root: Path) -> list[Path]:
    """Weights files in ``root/.weights`` no snapshot under ``root`` names (none when a manifest
    there cannot be read: it might name any; none in a ``.weights`` :func:`dir_problem` refuses: a symlink
    would point ``delete`` at another directory's files). Temp files of creates are not listed."""
    d = directory(root)
    if not d.is_dir() or dir_problem(d) is not None:
        return []
    used, unreadable = referenced(root)
    if unreadable:
        return []
    return sorted(p for p in d.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")
                  and str(p) not in used)


def blocked(root: Path) -> list[str]:
    """The snapshot directories under ``root`` whose unreadable manifest keeps weights files that
    no readable manifest names (:func:`unreferenced` lists none while such a manifest exists: it
    might name any); empty when nothing is kept that way. Never raises."""
    d = directory(root)
    if not d.is_dir() or dir_problem(d) is not None:
        return []
    used, unreadable = referenced(root)
    if not unreadable:
        return []
    try:
        waiting = [p for p in d.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".") and str(p) not in used]
    except OSError:
        return []
    return unreadable if waiting else []


def remove(path: Path) -> None:
    """Remove the weights file ``path`` (its immutable attribute cleared first) and its
    node-local pin (:func:`pin_path`). Raises OSError."""
    unprotect(path)
    path.unlink(missing_ok=True)
    pin_path(path).unlink(missing_ok=True)


def remove_orphan_pins(root: Path) -> list[Path]:
    """Remove the pins in ``root/.weights`` whose weights file is gone (removed by hand, or
    before pins went with their file); return them. Raises OSError."""
    d = directory(root)
    gone = []
    if d.is_dir() and dir_problem(d) is None:
        for pin in d.iterdir():
            if (pin.name.endswith(SUFFIX + PIN_SUFFIX) and not pin.name.startswith(".")
                    and not pin.with_name(pin.name[:-len(PIN_SUFFIX)]).exists()):
                pin.unlink(missing_ok=True)
                gone.append(pin)
    return gone


def remove_unreferenced(root: Path) -> list[Path]:
    """Remove the weights files no snapshot under ``root`` names (with their pins); return them.
    Raises OSError."""
    gone = []
    for p in unreferenced(root):
        remove(p)
        gone.append(p)
    remove_orphan_pins(root)
    return gone


def stale_temps(root: Path, older_than_s: float = 24 * 3600, now: float | None = None) -> list[Path]:
    """Temp files of creates in ``root/.weights`` (``.incoming-PID-...``) whose create is gone
    (the PID does not exist) or that are older than ``older_than_s`` seconds."""
    d = directory(root)
    if not d.is_dir() or dir_problem(d) is not None:
        return []
    now = time.time() if now is None else now
    out = []
    for p in d.iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        pid = p.name[len(TMP_PREFIX):].split("-", 1)[0]
        alive = pid.isdigit() and os.path.exists(f"/proc/{pid}")
        try:
            old = now - p.stat().st_mtime > older_than_s
        except OSError:
            continue
        if not alive or old:
            out.append(p)
    return sorted(out)
