"""The layout of one snapshot directory, and the trust checks run once before anything in it
is read. The one owner of member names (the manifest is the member list *inside* ``images/``
and ``files/``; :data:`MEMBERS` is the list at the top level).

Layout of a published snapshot ``DIR`` (dir 0700, files 0600)::

    DIR/manifest.json      written last; its absence means "incomplete"
    DIR/images/            CRIU images (``NAME`` or ``NAME.zst``), exactly those in the manifest
    DIR/files/             host files CRIU consumes at restore (link-remap files, see
                           :mod:`vllm_snapshot.checkpoint.remaps`), put back before each restore
    DIR/carried/           copies of the host files the tree had open or mapped outside the
                           model, the Python environment and the system (compile caches),
                           one per content, named by its BLAKE3 (``NAME`` or ``NAME.zst``);
                           put back before CRIU where missing (:mod:`vllm_snapshot.checkpoint.carry`)
    DIR/code.json          the pinned files of the Python distributions the engine imported
                           from (:mod:`vllm_snapshot.host.codeid`; digest in the manifest)
    DIR/engine-create.log  the engine's log during create
    DIR/criu-dump.log      CRIU's dump log
    DIR/stats-dump         CRIU's dump statistics (protobuf)
    DIR/pulled.json        only in a snapshot made by ``pull``: where it came from
                           (:mod:`vllm_snapshot.fleet`); docs/oci-format.md

While a create runs, its temp dir also holds ``owner.pid`` (removed at publish).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import CorruptSnapshotError, EnvironmentProblem, UsageError, q

MANIFEST = "manifest.json"
IMAGES = "images"
FILES = "files"
CARRIED = "carried"
CREATE_LOG = "engine-create.log"
DUMP_LOG = "criu-dump.log"
RESTORE_LOG = "criu-restore.log"
STATS_DUMP = "stats-dump"
CODE_TABLE = "code.json"
#: written by ``pull`` (:mod:`vllm_snapshot.fleet`): where the snapshot came from (image,
#: digest, the key that verified it) and the machine that pulled it; absent in snapshots made here
PULLED = "pulled.json"
OWNER_PID = "owner.pid"
#: The manifest's temp name while :func:`vllm_snapshot.store.manifest.write_atomic` writes it.
MANIFEST_TMP = f".{MANIFEST}.tmp"
#: Every name a published snapshot may hold at its top level.
MEMBERS = frozenset({MANIFEST, IMAGES, FILES, CARRIED, CREATE_LOG, DUMP_LOG, STATS_DUMP, CODE_TABLE, PULLED})


@dataclass(frozen=True)
class SnapshotDir:
    """Paths of one snapshot's members. Pure: building one touches nothing."""

    path: Path

    @property
    def images(self) -> Path:
        return self.path / IMAGES

    @property
    def files(self) -> Path:
        return self.path / FILES

    @property
    def carried(self) -> Path:
        return self.path / CARRIED


NOT_OURS_HINT = "name a directory made by `vllm-snapshot create` (`vllm-snapshot list` shows them)"


def judge(path: Path) -> UsageError | CorruptSnapshotError | None:
    """The one judgement of "is ``path`` a snapshot directory at all?", made before anything in
    it is trusted or read (by :func:`open_trusted`, :func:`vllm_snapshot.store.manifest.read`
    and :func:`not_a_snapshot`). None when ``path`` is a directory holding :data:`MANIFEST`;
    else the error to raise -- a UsageError (exit 2: a wrong argument) when ``path`` does not
    exist, is not a directory, or is a directory with neither :data:`MANIFEST` nor
    :data:`IMAGES` (not ours at all); a CorruptSnapshotError (exit 5) when it holds
    :data:`IMAGES` but no :data:`MANIFEST` (ours, but the manifest never got written). Follows
    a symlink (the trust checks refuse one separately). Reads only directory entries. Raises
    EnvironmentProblem (exit 11) when this user may not look (:func:`vllm_snapshot.paths.lexists`)."""
    if not paths.lexists(path):
        return UsageError(f"{path} does not exist", hint=missing_hint(path))
    if not path.is_dir():
        return UsageError(f"{path} is not a directory (a snapshot is a directory)", hint=NOT_OURS_HINT)
    if paths.lexists(path / MANIFEST):
        return None
    if not paths.lexists(path / IMAGES):
        return UsageError(f"{path} is not a snapshot (no {MANIFEST}, no {IMAGES}/)", hint=NOT_OURS_HINT)
    return CorruptSnapshotError(f"{path} is an incomplete snapshot (no {MANIFEST})",
                                hint=f"remove the directory (`rm -r {q(path)}`: `vllm-snapshot delete` deletes only "
                                     "snapshots with a manifest) and create it again")


def damaged_hint(snapshot: Path) -> str:
    """The hint of a refusal of a damaged snapshot (a corrupt image or manifest, a missing
    file: exit 5): what to do, with the command to run."""
    try:  # what `delete` would refuse, it must not be told to run
        why = not_a_snapshot(snapshot) if paths.lexists(snapshot) else None
    except Exception:  # noqa: BLE001 - a hint never fails the error it decorates
        why = None
    remove = (f"delete it (`vllm-snapshot delete {q(snapshot)}`)" if why is None else
              f"remove it (`rm -r {q(snapshot)}`: `vllm-snapshot delete` removes only what is surely a snapshot, and "
              f"{why})")
    return (f"its files are damaged: {remove} and re-create it "
            "(`create`; `serve` builds it again by itself), or pull it again (`vllm-snapshot pull IMAGE`)")


def missing_hint(path: Path) -> str:
    """The hint of a snapshot reference that names nothing: where to see the snapshots."""
    return f"`vllm-snapshot --root {q(path.parent)} list` shows the snapshots there (a name means ROOT/NAME)"


def not_a_snapshot(path: Path) -> str | None:
    """Why ``path`` is not a vllm-snapshot snapshot directory (None when it is one, possibly a
    damaged one): the removal judgement, stricter than :func:`judge` (which it applies first):
    only a directory with an ``images/`` directory and a ``manifest.json`` that is a JSON object
    with this tool's top-level fields (``schema_version``, ``criu``, ``images``) and no names
    outside :data:`MEMBERS` counts -- so ``delete``/``prune`` never remove a web app's or
    another tool's directory that merely has a ``manifest.json``. Reads only the manifest (at
    most 64 MiB)."""
    import json

    refused = judge(path)
    if refused is not None:
        return refused.message
    try:
        if not (path / IMAGES).is_dir() or (path / IMAGES).is_symlink():
            return f"it has no {IMAGES}/ directory"
        extra = sorted(set(os.listdir(path)) - MEMBERS - {MANIFEST_TMP})
        if extra:
            return "it holds " + ", ".join(extra[:5]) + " (a snapshot holds only " + ", ".join(sorted(MEMBERS)) + ")"
        with open(path / MANIFEST, "rb") as f:
            raw = json.loads(f.read(64 << 20))
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is not readable JSON ({e})"
    if not isinstance(raw, dict) or not {"schema_version", "criu", "images"} <= set(raw):
        return f"its {MANIFEST} is not a vllm-snapshot manifest"
    return None


def remains(path: Path, limit: int = 40) -> dict:
    """What can still be read of a snapshot directory whose manifest cannot be (``inspect`` of a
    damaged one): ``{"directory", "members": [{"name", "kind": "file"|"dir"|"other", "bytes",
    "files"}], "total_bytes", "unexpected": [names outside MEMBERS]}`` -- each top-level member
    with its size (a directory: its files' count and bytes, not followed into symlinks), at most
    ``limit`` members. Reads only directory entries and stats; what this user may not read
    is left out."""
    members: list[dict] = []
    total = 0
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
    for name in names[:limit]:
        p = path / name
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            count = size = 0
            for dirpath, _dirs, files in os.walk(p):
                for f in files:
                    try:
                        size += os.lstat(os.path.join(dirpath, f)).st_size
                        count += 1
                    except OSError:
                        pass
            members.append({"name": name, "kind": "dir", "bytes": size, "files": count})
        else:
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            members.append({"name": name, "kind": "file" if stat.S_ISREG(st.st_mode) else "other", "bytes": size,
                            "files": 1})
        total += size
    return {"directory": str(path), "members": members, "total_bytes": total,
            "unexpected": [n for n in names if n not in MEMBERS and n != MANIFEST_TMP]}


def open_trusted(path: Path) -> SnapshotDir:
    """Run the trust checks once -- :func:`judge` (a symlink is refused by the next check, not
    followed), :func:`check_dir_safety`, no unexpected top-level member, :func:`check_file_modes`
    -- and return the snapshot's :class:`SnapshotDir`. Raises UsageError (missing, not a
    directory, not a snapshot), CorruptSnapshotError (incomplete, untrusted or unexpected
    content)."""
    path = path.absolute()
    refused = None if path.is_symlink() else judge(path)
    if refused is not None:
        raise refused
    check_dir_safety(path)
    extra = sorted(set(os.listdir(path)) - MEMBERS)
    if extra:  # before the modes: a stray file is moved out, not chmod-ed and then refused again
        raise CorruptSnapshotError(f"{path} holds unexpected members: {', '.join(extra)}",
                                   hint=f"move {' and '.join(extra[:3])}{' ...' if extra[3:] else ''} out of the "
                                        "snapshot directory (a snapshot holds only " + ", ".join(sorted(MEMBERS)) + ")")
    check_file_modes(path)
    return SnapshotDir(path)


#: What :func:`private_dir_fault` finds wrong with a directory that holds private files.
LINK, NOT_DIR, OWNER, MODE = "symlink", "not a directory", "owner", "mode"


def private_dir_fault(st: os.stat_result, owner: int) -> str | None:
    """The one judgement of a directory that holds private files -- a snapshot directory (owned by
    this user: :func:`check_dir_safety`), the store's ``.weights`` directory (owned by root:
    :func:`vllm_snapshot.store.weights.dir_problem`) -- from its ``lstat`` ``st``, in this order:
    :data:`LINK` (a symlink: it could be re-pointed between the check and the use), :data:`NOT_DIR`,
    :data:`OWNER` (``st_uid`` is not ``owner``: that user could swap or rewrite what it holds),
    :data:`MODE` (a group or other permission bit: such a directory is 0700); None when none.
    Pure; the caller words the refusal."""
    if stat.S_ISLNK(st.st_mode):
        return LINK
    if not stat.S_ISDIR(st.st_mode):
        return NOT_DIR
    if st.st_uid != owner:
        return OWNER
    if stat.S_IMODE(st.st_mode) & 0o077:
        return MODE
    return None


def check_dir_safety(path: Path) -> None:
    """Refuse a snapshot dir we should not trust.

    ``path`` and each parent must not be a symlink (``path`` itself), must be owned by us or
    root, and must not be group/world-writable unless sticky and root-owned (like /tmp).
    ``path`` itself must be mode 0700. Raises CorruptSnapshotError naming the path (the
    snapshot's own fault), EnvironmentProblem for a parent (:func:`check_parents`).
    """
    uid = os.geteuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise UsageError(f"{path} does not exist", hint=missing_hint(path)) from e
    except PermissionError as e:
        raise paths.not_allowed(path) from e
    fault = private_dir_fault(st, uid)
    if fault == LINK:  # a link could be re-pointed between the checks and CRIU: not followed
        raise UsageError(f"{path} is a symlink; snapshots are opened by their own path, not through a link",
                         hint=f"use the path it points to: {os.path.realpath(path)}")
    if fault == NOT_DIR:
        raise CorruptSnapshotError(f"{path} is not a directory")
    if fault == OWNER:
        raise CorruptSnapshotError(f"{path} is owned by uid {st.st_uid}, not by us (uid {uid})")
    if fault == MODE:
        raise CorruptSnapshotError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; a snapshot holds process memory and must be 0700",
            hint=f"chmod -R go-rwx {q(path)}",
        )
    check_parents(path)


def check_parent_symlinks(path: Path, stop_at_missing: bool = False) -> None:
    """Every directory component of ``path`` as given: a symlink is trusted only when root owns
    it (system layout such as /var/run -> /run); anyone else could redirect us. With
    ``stop_at_missing`` the walk ends at the first component that does not exist or is not a
    directory (a file: the caller then says so; else that raises FileNotFoundError or
    NotADirectoryError). Raises EnvironmentProblem (exit 11: a fault of this host's directories,
    not of a snapshot) naming the symlink."""
    probe = Path(path.absolute().anchor)
    for part in path.absolute().parts[1:-1]:
        probe = probe / part
        try:
            lst = os.lstat(probe)
        except (FileNotFoundError, NotADirectoryError):
            if stop_at_missing:
                return
            raise
        if stat.S_ISLNK(lst.st_mode) and lst.st_uid != 0:
            raise EnvironmentProblem(f"parent {probe} is a symlink owned by uid {lst.st_uid}; refusing to follow it "
                                     "(its owner could point it elsewhere)",
                                     hint=f"make root own it (chown -h root {q(probe)}) or name the real directory")


def check_parents(path: Path) -> None:
    """The rule for the directories above a snapshot (restore applies it through
    :func:`check_dir_safety`; create applies it to its target before anything starts, so it
    never spends minutes on a snapshot restore would refuse): a symlink among them only when
    root owns it, each owned by us or root, none writable by group/others unless sticky and
    root-owned (like /tmp). Raises EnvironmentProblem (exit 11) naming the directory: the
    snapshot itself is intact (not exit 5: nothing of its own is at fault);
    the store's directories need fixing, whichever of --root, $VLLM_SNAPSHOT_ROOT, the default
    root or a --snapshot-dir path named them."""
    uid = os.geteuid()
    check_parent_symlinks(path)
    for parent in path.absolute().parent.resolve().joinpath("x").parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid):
            raise EnvironmentProblem(f"parent directory {parent} is owned by uid {pst.st_uid}, not by root or us "
                                     f"(uid {uid}): its owner could swap the snapshots below it",
                                     hint=f"chown root {q(parent)}" if uid == 0 else f"chown {uid} {q(parent)} (as root)")
        writable = stat.S_IMODE(pst.st_mode) & 0o022
        sticky_root = pst.st_mode & stat.S_ISVTX and pst.st_uid == 0
        if writable and not sticky_root:
            raise EnvironmentProblem(f"parent directory {parent} (mode {stat.S_IMODE(pst.st_mode):04o}) is writable by "
                                     "group/others: they could swap the snapshots below it",
                                     hint=f"chmod 0700 {q(parent)} (or 0755 to let other users list it)")


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
                                           hint=f"chown -R {uid} {q(path)} if you trust its origin")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise CorruptSnapshotError(
                    f"{p} has mode {stat.S_IMODE(st.st_mode):04o}; snapshot files must be private (0600/0700)",
                    hint=f"chmod -R go-rwx {q(path)}",
                )


