"""Advisory locks (flock): per snapshot, per snapshot key, per GPU, and host-wide around CRIU
runs.

flock locks vanish with their holder, so a lock left by a dead process is taken over safely
without any stale-file logic. When a lock is busy, the holders are found through
/proc/locks (inode match) and named in the error.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import BusyError

from .. import paths
from ..host import procs


def snapshot_lock_path(snapshot: Path) -> Path:
    """``/run/vllm-snapshot/locks/<sha256 of the absolute path>.lock``: outside the snapshot
    and its parent, so locking works on read-only filesystems and leaves nothing beside the
    snapshot."""
    import hashlib

    key = hashlib.sha256(str(snapshot.absolute()).encode()).hexdigest()[:32]
    return paths.run_dir() / "locks" / f"{key}.lock"


def holders(path: Path) -> list[str]:
    """``"PID (command)"`` of the processes holding a lock on ``path`` (from /proc/locks)."""
    try:
        ino = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:00:5678 0 EOF"
        try:
            idx = 4 if parts[1] != "->" else 5
            pid = int(parts[idx])
            if int(parts[idx + 1].rsplit(":", 1)[1]) != ino:
                continue
        except (IndexError, ValueError):
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            cmd = procs.brief([a for a in raw.split("\0") if a])[:200] or "?"
        except OSError:
            cmd = "?"
        out.append(f"{pid} ({cmd})")
    return sorted(set(out))


@contextmanager
def lock(path: Path, what: str, shared: bool = False, wait_s: float = 0.0, label: str = "") -> Iterator[None]:
    """Hold a flock on ``path`` (created 0600, ``label`` written into a new file). Refuses at
    once (``wait_s`` 0) or after ``wait_s`` seconds with BusyError naming the holders' PIDs and
    commands. After the flock is taken, the file must still be the one at ``path`` (lock files
    are removed by :func:`remove_lock_file` / :func:`clean_stale` under their exclusive lock; a
    waiter that got an unlinked file retries on the new one)."""
    run = paths.run_dir()
    if path.parent == run or path.parent.parent == run:
        paths.ensure_private_dir(path.parent)
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if time.monotonic() >= deadline:
                        who = ", ".join(holders(path)) or "another process"
                        raise BusyError(f"{what} is in use by {who}",
                                        hint="wait for that command to finish, or stop it") from e
                    time.sleep(0.1)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # the file was removed while we waited: lock the new one
    try:
        if label and os.fstat(fd).st_size == 0:
            os.write(fd, label.encode())
        yield
    finally:
        os.close(fd)


def remove_lock_file(snapshot: Path) -> None:
    """Remove ``snapshot``'s lock file; call it while holding that lock exclusively (delete)."""
    snapshot_lock_path(snapshot).unlink(missing_ok=True)


def clean_stale() -> list[Path]:
    """Remove lock files of snapshot paths that no longer exist and that nobody holds (taken
    exclusively first, so a racing command is never left holding a removed file). Returns what
    was removed. Key locks of ``serve`` (``key-*.lock``), GPU locks (``gpu-*.lock``) and port
    locks of ``switch`` (``port-*.lock``) are not snapshot paths: they are left alone (one small
    file per key, GPU or port)."""
    removed = []
    d = paths.run_dir() / "locks"
    for f in d.glob("*.lock") if d.is_dir() else []:
        if f.name.startswith(("key-", "gpu-", "port-")):
            continue
        try:
            target = f.read_text().strip()
        except OSError:
            continue
        if not target or os.path.lexists(target):
            continue
        try:
            fd = os.open(f, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            f.unlink(missing_ok=True)
            removed.append(f)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def snapshot_lock(snapshot: Path, shared: bool = False, must_exist: bool = True):
    """The per-snapshot lock: exclusive for create/delete, shared for restore/verify.
    Raises UsageError when the snapshot (with ``must_exist``; create passes False) or its
    parent directory does not exist, so no lock file is left beside a non-snapshot."""
    from ..errors import UsageError

    from .. import paths

    if not snapshot.absolute().parent.is_dir():
        raise UsageError(paths.why_not_a_dir(snapshot.absolute().parent))

    if must_exist and not paths.lexists(snapshot):
        from .layout import missing_hint

        raise UsageError(f"snapshot {snapshot} does not exist", hint=missing_hint(snapshot))
    return lock(snapshot_lock_path(snapshot), f"snapshot {snapshot}", shared=shared, label=str(snapshot.absolute()))


#: How long a ``serve`` waits for another one building the snapshot of the same key (seconds):
#: a cold start + dump of a large model takes minutes.
KEY_WAIT_S = 3600.0


@contextmanager
def _waiting_lock(path: Path, what: str, label: str, why: str, on_wait, wait_s: float) -> Iterator[None]:
    """:func:`lock` ``path`` at once, or -- when it is busy -- say ``"waiting for HOLDER: why"``
    through ``on_wait`` and wait up to ``wait_s`` seconds. Raises BusyError after that."""
    with ExitStack() as held:
        try:
            held.enter_context(lock(path, what, label=label))
        except BusyError:
            if on_wait is not None:
                who = ", ".join(holders(path)) or "another process"
                on_wait(f"waiting for {who}: {why}")
            held.enter_context(lock(path, what, wait_s=wait_s, label=label))
        yield


@contextmanager
def key_lock(key: str, on_wait=None, wait_s: float = KEY_WAIT_S) -> Iterator[None]:
    """Exclusive lock of one snapshot key (``locks/key-<key>.lock``): held by ``serve`` from
    its lookup until the snapshot is restored (or built, then restored), so two ``serve`` of
    one key build once. When busy, ``on_wait(message)`` names the holder, then waits up to
    ``wait_s`` seconds. Raises BusyError after that."""
    path = paths.run_dir() / "locks" / f"key-{key[:32]}.lock"
    what, label = f"snapshot key {key[:12]}", f"key {key}"
    with _waiting_lock(path, what, label, f"it is building or restoring the snapshot for this key ({key[:12]})", on_wait, wait_s):
        yield


#: How long a CUDA restore waits for another one onto the same GPU (seconds): that one holds
#: the GPU's lock until its engine woke, and a wake may take twice create's rehearsal allowance
#: (:func:`vllm_snapshot.ops.create.wake_timeout_s`), after its CRIU restore.
GPU_WAIT_S = 1800.0


@contextmanager
def gpu_lock(uuid: str, on_wait=None, wait_s: float = GPU_WAIT_S) -> Iterator[None]:
    """Exclusive lock of one GPU (``locks/gpu-<sha256 of the UUID>.lock``): a CUDA restore holds
    it from its capacity check until its engine has woken (the memory is taken at the wake, or
    by CRIU at sleep level 0), so two restores onto one GPU cannot both pass the check and one
    die at the wake. When busy, ``on_wait(message)`` names the holder, then waits up to
    ``wait_s`` seconds. Raises BusyError after that."""
    import hashlib

    path = paths.run_dir() / "locks" / f"gpu-{hashlib.sha256(uuid.encode()).hexdigest()[:32]}.lock"
    what, label = f"GPU {uuid}", f"gpu {uuid}"
    with _waiting_lock(path, what, label, f"it is restoring an engine onto GPU {uuid} (until that engine has woken)", on_wait, wait_s):
        yield


#: How long a ``switch`` waits for another ``switch`` of the same port (seconds): one that
#: drains the old engine and restores the next takes seconds to a minute.
PORT_WAIT_S = 600.0


@contextmanager
def port_lock(port: int, on_wait=None, wait_s: float = PORT_WAIT_S) -> Iterator[None]:
    """Exclusive lock of one TCP port (``locks/port-<port>.lock``), held by ``switch`` from
    reading which engine serves there until the next one serves (or the rollback ended), so
    two switches of one port run one after the other: the second sees the first's engine as
    the one it replaces. When busy, ``on_wait(message)`` names the holder, then waits up to
    ``wait_s`` seconds. Raises BusyError after that."""
    path = paths.run_dir() / "locks" / f"port-{int(port)}.lock"
    what, label = f"port {port}", f"port {port}"
    with _waiting_lock(path, what, label, f"it is switching port {port}", on_wait, wait_s):
        yield


def criu_lock(wait_s: float = 300.0):
    """Host-wide lock around one CRIU dump/restore (they serialize; a waiter waits)."""
    return lock(paths.run_dir() / "criu.lock", "CRIU", shared=False, wait_s=wait_s)
