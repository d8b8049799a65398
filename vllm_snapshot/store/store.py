"""The snapshot store: names under a root, temp dirs and atomic publish, listing, deletion,
and per-snapshot bookkeeping kept outside snapshots (last restore). The layout of one snapshot
directory and its trust checks live in :mod:`vllm_snapshot.store.layout`.

A create writes into a hidden sibling ``.DIR.tmp-XXXX`` and publishes it with one rename.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import CorruptSnapshotError, UsageError, q

from .layout import CARRIED, FILES, IMAGES, MANIFEST, OWNER_PID
from .. import paths

TMP_MARK = ".tmp-"
#: A temp dir without ``owner.pid`` younger than this may be a create that has not written it
#: yet: never removed as stale.
NO_PID_GRACE_S = 60.0


def prepare_target(target: Path) -> Path:
    """Check ``target`` can be created, clean stale temp siblings, and return a new private
    temp dir beside it (with ``images/``, ``files/`` and ``carried/``). Raises UsageError."""
    if os.path.lexists(target):
        raise UsageError(f"{target} already exists; refusing to overwrite a snapshot",
                         hint="choose another --snapshot-dir, or delete the old one first")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"cannot create {target}: " + paths.why_not_a_dir(parent))
    from .layout import check_parents

    check_parents(target)  # restore would refuse a snapshot there: say so before the engine starts
    clean_stale_temps(parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_MARK}", dir=parent))
    except OSError as e:
        raise UsageError(f"cannot create the snapshot in {parent}: {e.strerror}") from e
    os.chmod(tmp, 0o700)
    (tmp / OWNER_PID).write_text(str(os.getpid()))
    (tmp / IMAGES).mkdir(mode=0o700)
    (tmp / FILES).mkdir(mode=0o700)
    (tmp / CARRIED).mkdir(mode=0o700)
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
    removed = stale_temps(parent, name, min_age_s)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def stale_temps(parent: Path, name: str | None = None, min_age_s: float = 0.0) -> list[Path]:
    """The ``.NAME.tmp-*`` dirs :func:`clean_stale_temps` would remove (owner dead)."""
    removed = []
    for p in parent.glob(f".{name or '*'}{TMP_MARK}*"):
        if not p.is_dir() or p.is_symlink():
            continue
        try:
            pid = int((p / OWNER_PID).read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid):
            continue
        age = time.time() - p.stat().st_mtime
        if age < min_age_s or (not pid and age < NO_PID_GRACE_S):
            continue
        removed.append(p)
    return removed


def publish(tmp: Path, target: Path) -> None:
    """Atomically rename the finished temp dir to ``target`` and fsync the parent.

    Raises UsageError when ``target`` appeared meanwhile."""
    (tmp / OWNER_PID).unlink(missing_ok=True)
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
    """Where named snapshots live (see :func:`vllm_snapshot.paths.snapshot_root`)."""
    return paths.snapshot_root()


NAME_RULE = "letters, digits, '.', '_' and '-', not starting with '.' or '-', at most 128 characters"


def valid_name(name: str) -> bool:
    """Names: letters, digits, ``.``, ``_``, ``-``; not starting with ``.`` (hidden) or ``-``
    (every command would read it as an option: ``inspect -dash``); <= 128 chars. Pure."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", name))


def canonical(path: str | Path) -> Path:
    """The one identity of a snapshot path, used for every comparison, lock, registry entry
    and deletion: absolute, with ``..`` and symlinked parent directories resolved (the final
    component is kept as it is: a snapshot that *is* a symlink is refused by its trust check).
    A parent symlink is followed only when root owns it (system layout such as
    /var/run -> /run), as the trust check requires. Raises EnvironmentProblem otherwise."""
    from .layout import check_parent_symlinks

    p = Path(path).absolute()
    if p.name in ("", ".", ".."):
        p = Path(os.path.realpath(p))
    check_parent_symlinks(p, stop_at_missing=True)
    return Path(os.path.realpath(p.parent)) / p.name


def resolve(ref: str | Path, root: Path | None = None) -> Path:
    """A snapshot reference -> its canonical directory (:func:`canonical`): a bare valid name
    means ``ROOT/NAME``; anything with a ``/`` (or ``.``/``..``) is a path. Raises UsageError
    for an invalid name."""
    s = str(ref)
    if "/" in s or s in (".", ".."):
        return canonical(s)
    if not valid_name(s):
        raise UsageError(f"{s!r} is neither a path nor a valid snapshot name ({NAME_RULE})",
                         hint=f"give a directory named so by its path (./{s}, or under the root)"
                         if s.startswith("-") else None)
    named = (root or default_root()) / s
    local = Path(s).absolute()
    if local.is_dir() and local != named:
        if named.exists():
            raise UsageError(f"{s!r} is ambiguous: both ./{s} and {named} exist",
                             hint=f"write ./{s} for the directory here, or {named}")
        return canonical(local)  # e.g. made by `create --snapshot-dir NAME` in this directory
    return canonical(named)


def ensure_root(root: Path) -> Path:
    """Create the snapshot root (0700) if missing; return it. Raises UsageError when it
    exists and is not a directory."""
    from ..errors import UsageError

    if root.exists() and not root.is_dir():
        raise UsageError(f"the snapshot root {root} is not a directory", hint="check --root / VLLM_SNAPSHOT_ROOT")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def _state_file(snapshot: Path) -> Path:
    import hashlib

    key = hashlib.sha256(str(snapshot.absolute()).encode()).hexdigest()[:24]
    d = paths.ensure_private_dir(paths.state_dir())
    return d / f"{key}.json"


def record_restore(snapshot: Path, overrides: list[str] | None = None) -> None:
    """Remember when ``snapshot`` was last restored and which identity overrides that restore
    used (outside the snapshot: it stays unchanged)."""
    import json

    p = _state_file(snapshot)
    p.write_text(json.dumps({"snapshot": str(snapshot.absolute()), "last_restore": time.time(),
                             "overrides": list(overrides or [])}))
    os.chmod(p, 0o600)


def record_refusal(snapshot: Path, code: str, reason: str, by: str = "serve") -> None:
    """Remember that ``by`` (``serve``; ``restore`` when the snapshot's images or files proved
    corrupt) refused ``snapshot`` on this host (error ``code``, one-line ``reason``), keeping
    its last-restore time; ``list`` shows it as unusable until a restore
    of it succeeds again (:func:`record_restore` rewrites the record). The snapshot itself is
    never written to."""
    import json

    p = _state_file(snapshot)
    try:
        state = json.loads(p.read_text())
    except (OSError, ValueError):
        state = {"snapshot": str(snapshot.absolute()), "last_restore": None, "overrides": []}
    state["refused"] = {"at": time.time(), "code": code, "reason": reason, "by": by}
    p.write_text(json.dumps(state))
    os.chmod(p, 0o600)


def clear_refusal(snapshot: Path, codes: frozenset[str]) -> dict | None:
    """Forget the refusal recorded for ``snapshot`` when its error code is one of ``codes`` (the
    checks a passing ``verify`` has just re-run: a weights file or model put back, a damaged
    image replaced); return the refusal forgotten, or None (none, or one of another code, e.g.
    an oracle mismatch that only a restore re-checks). Raises OSError."""
    import json

    p = _state_file(snapshot)
    try:
        state = json.loads(p.read_text())
    except (FileNotFoundError, ValueError):  # no record, or one refusal() cannot read either
        return None
    r = state.get("refused") if isinstance(state, dict) else None
    if not isinstance(r, dict) or r.get("code") not in codes:
        return None
    del state["refused"]
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)
    return r


def refusal(snapshot: Path) -> dict | None:
    """``{"at": unix s, "code": error code, "reason": text}`` of the last refusal recorded for
    ``snapshot`` since its last successful restore, or None."""
    import json

    try:
        r = json.loads(_state_file(snapshot).read_text()).get("refused")
    except (OSError, ValueError, AttributeError):
        return None
    return r if isinstance(r, dict) and isinstance(r.get("reason"), str) else None


def last_restore(snapshot: Path) -> float | None:
    """Unix time of the last successful restore, or None (never restored: no state file, or
    one that ``serve`` wrote with ``"last_restore": null`` when it refused the snapshot)."""
    import json

    try:
        return float(json.loads(_state_file(snapshot).read_text())["last_restore"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_snapshots(root: Path) -> list[Path]:
    """Published snapshots (dirs with a manifest) directly under ``root``, sorted by name.
    Temp dirs of creates in progress (hidden) are not listed."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()
                  and (p / MANIFEST).is_file())


def without_manifest(root: Path) -> list[Path]:
    """Directories directly under ``root`` (not hidden) that hold an ``images/`` directory but
    no manifest: snapshots whose manifest was lost (removed, or a copy that stopped half-way).
    :func:`list_snapshots` cannot list them (nothing says what they are), yet they hold the
    images' disk. Sorted; empty when ``root`` cannot be read."""
    try:
        return sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir() and not p.is_symlink()
                      and (p / IMAGES).is_dir() and not (p / MANIFEST).exists())
    except OSError:
        return []


def mounts_within(path: Path, mountinfo: str) -> list[str]:
    """The mount points at or below ``path`` (absolute, canonical) in ``mountinfo`` (the text of
    ``/proc/self/mountinfo``), in file order, each once. Pure."""
    from ..engine.mounts import parse_mountinfo

    top = str(path).rstrip("/") or "/"
    seen: list[str] = []
    for m in parse_mountinfo(mountinfo):
        mp = m.mount_point
        if (mp == top or mp.startswith(top + "/")) and mp not in seen:
            seen.append(mp)
    return seen


def _mountinfo() -> str:
    try:
        with open("/proc/self/mountinfo") as f:
            return f.read()
    except OSError:
        return ""


def delete_refusal(snapshot: Path) -> CorruptSnapshotError | None:
    """Why :func:`delete` would refuse ``snapshot`` before touching it because it cannot tell it
    is a snapshot (a symlink, never followed; a directory :func:`vllm_snapshot.store.layout.not_a_snapshot`
    rejects, e.g. a manifest that is not JSON): the CorruptSnapshotError it raises, with its hint;
    None when it is surely a snapshot. ``prune`` asks this first, so a dry run and a real run
    say the same. Reads only the directory entries and the manifest."""
    if snapshot.is_symlink():
        return CorruptSnapshotError(f"{snapshot} is a symlink, not a snapshot; nothing was deleted",
                                    hint=f"remove the link itself with `rm {q(snapshot)}`, or delete the snapshot it names")
    from .layout import not_a_snapshot

    why = not_a_snapshot(snapshot)
    if not why:
        return None
    from .layout import IMAGES, MANIFEST

    damaged = why.startswith(f"its {MANIFEST}") and (snapshot / IMAGES).is_dir()
    return CorruptSnapshotError(
        f"{snapshot} is not a vllm-snapshot snapshot: {why}; nothing was deleted",
        hint=(f"it looks like a snapshot whose manifest is damaged (`vllm-snapshot inspect {q(snapshot)}` shows what "
              f"is left); delete removes only what is surely a snapshot: remove it with `rm -r {q(snapshot)}`")
        if damaged else
        ("if it is a snapshot with files put into it by hand, move them out and run delete again; otherwise "
         "remove the directory with rm, not vllm-snapshot") if why.startswith("it holds ") and (snapshot / IMAGES).is_dir()
        else "check the path; remove other directories with rm, not vllm-snapshot")


def delete(snapshot: Path) -> None:
    """Remove a snapshot: first renamed to a hidden temp name (so it vanishes from listings
    atomically), then removed. Raises CorruptSnapshotError (not a snapshot: :func:`delete_refusal`),
    EnvironmentProblem (a mount point at or below it, a read-only filesystem, denied: nothing was
    deleted; a failure half-way: what is left, hidden)."""
    refused = delete_refusal(snapshot)
    if refused is not None:
        raise refused
    mounted = mounts_within(snapshot, _mountinfo())
    if mounted:  # rmtree would empty a mounted filesystem (another one's files) before failing with EBUSY
        from ..errors import EnvironmentProblem

        raise EnvironmentProblem(
            f"{snapshot} is a mount point or has filesystems mounted in it ({', '.join(mounted)}); nothing was deleted "
            "(deleting would remove the files of the mounted filesystem too)",
            hint="unmount " + ("it" if len(mounted) == 1 else "them") + " (`umount "
                 + " ".join(q(m) for m in reversed(mounted)) + "`), then delete again", details={"mounts": mounted})
    tmp = snapshot.parent / f".{snapshot.name}{TMP_MARK}deleting-{os.getpid()}"
    try:
        os.rename(snapshot, tmp)
    except OSError as e:
        import errno

        from ..errors import EnvironmentProblem

        if e.errno == errno.EROFS:
            raise EnvironmentProblem(f"{snapshot} is on a read-only filesystem; nothing was deleted",
                                     hint=f"remount {snapshot.parent} read-write, then delete again") from e
        if e.errno == errno.EBUSY:
            raise EnvironmentProblem(f"{snapshot} is busy (a mount point, or in use); nothing was deleted",
                                     hint=f"unmount it (`umount {q(snapshot)}`; `findmnt {q(snapshot)}` shows the mount), "
                                          "then delete again") from e
        if e.errno in (errno.EACCES, errno.EPERM):
            raise EnvironmentProblem(f"{snapshot} cannot be renamed out of {snapshot.parent} ({e.strerror}); "
                                     "nothing was deleted",
                                     hint="run as root; as root, check `lsattr -d` of it and its directory "
                                          "(an immutable or append-only attribute)") from e
        raise
    try:
        shutil.rmtree(tmp)
    except OSError as e:
        from ..errors import ENVIRONMENT_ERRNOS, EnvironmentProblem

        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        raise EnvironmentProblem(f"{snapshot} was only partly deleted: {e.strerror} ({e.filename}); what is left is "
                                 f"{tmp}, hidden from list",
                                 hint=f"fix that, then `rm -r {q(tmp)}` (`vllm-snapshot prune` removes it a minute "
                                      "from now)") from e
    forget(snapshot)


def forget(snapshot: Path) -> None:
    """Remove what is kept about ``snapshot`` outside it (its last-restore record), so a new
    snapshot of the same name starts clean."""
    _state_file(snapshot).unlink(missing_ok=True)
