"""Private mounts for the engine's mount namespace (runs inside it, before vLLM starts).

CRIU dumps the *content* of every tmpfs mounted in a dumped mount namespace. A namespace made
by ``unshare --mount`` starts as a copy of the host's, so without this step a snapshot would
contain the host's /dev/shm (other processes' shared memory: seen here, 4 stale 170-250 MB
``psm_*`` segments), /run and other tmpfs: a privacy leak, gigabytes of images, and seconds of
tar at dump and restore. So, with mount propagation already private (unshare's default):

* every tmpfs mount except ``/dev`` and those under ``/sys`` is lazily detached
  (``umount2(MNT_DETACH)``; deepest first);
* fresh tmpfs are mounted on ``/dev/shm`` and on :data:`ENGINE_TMPDIR` (the engine's TMPDIR;
  mode 1777): POSIX semaphores, vLLM's shared-memory queues, ZMQ ipc sockets and CRIU's
  link-remap files live there, are dumped with the tree, and never collide with the host or with
  another engine. The host's /tmp stays visible unless it is itself a tmpfs (then it is detached
  like the others: keep code, venv and models elsewhere on such hosts);
* ``$TMPDIR/torchinductor_$USER`` is a symlink to ``$TORCHINDUCTOR_CACHE_DIR`` on disk: torch
  inductor writes its ~150 MB precompiled header under ``default_cache_dir()`` (tempdir-based,
  ignoring the variable; torch/_inductor/codecache.py ``_HEADER_DIR``), which would otherwise
  be re-made at every create and tarred into every image.
"""

from __future__ import annotations

import ctypes
import os

MNT_DETACH = 2
MS_NOSUID = 2
MS_NODEV = 4
KEEP = ("/dev",)
#: The engine's private temp dir (TMPDIR): a tmpfs mounted inside the namespace on this
#: directory of the host's root filesystem (so the host's /tmp, where code or models may live,
#: stays visible). vLLM's ZMQ ipc sockets and torch's temp files go there.
ENGINE_TMPDIR = "/var/tmp/.vllm-snapshot-engine"
PRIVATE = ("/dev/shm", ENGINE_TMPDIR)


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \\ooo
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 3 < len(path) + 0 and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def tmpfs_mounts(mountinfo: str) -> list[str]:
    """Mount points of tmpfs mounts listed in ``/proc/self/mountinfo`` text. Pure."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        fstype = right.split()[0] if right.split() else ""
        if fstype == "tmpfs" and len(fields) >= 5:
            out.append(_unescape(fields[4]))
    return out


def to_detach(mounts: list[str]) -> list[str]:
    """Which tmpfs mount points to detach, deepest first: all but ``/dev`` and ``/sys/...``."""
    keep = [m for m in mounts if m in KEEP or m == "/sys" or m.startswith("/sys/")]
    out = sorted({m for m in mounts if m not in keep}, key=lambda m: (-m.count("/"), m))
    return out


def hidden_prefixes(mountinfo: str) -> list[str]:
    """Host paths the engine will not see (detached tmpfs mounts and the private mounts)."""
    return sorted(set(to_detach(tmpfs_mounts(mountinfo))) | set(PRIVATE))


def make_private() -> list[str]:
    """Detach host tmpfs mounts and mount private tmpfs on /dev/shm and ENGINE_TMPDIR (which
    must exist: the supervisor creates it). Returns what was detached. Raises OSError when a
    private tmpfs cannot be mounted."""
    libc = ctypes.CDLL(None, use_errno=True)
    detached: list[str] = []
    for _ in range(16):  # stacked mounts on one path come off one per pass
        with open("/proc/self/mountinfo") as f:
            todo = to_detach(tmpfs_mounts(f.read()))
        done = [mp for mp in todo if libc.umount2(mp.encode(), MNT_DETACH) == 0]
        detached += done
        if not done:
            break
    for mp in PRIVATE:
        os.makedirs(mp, exist_ok=True)
        if libc.mount(b"tmpfs", mp.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777") != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount a private tmpfs on {mp}: {os.strerror(err)}")
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:
        import getpass

        os.makedirs(inductor, mode=0o700, exist_ok=True)
        os.symlink(inductor, os.path.join(ENGINE_TMPDIR, f"torchinductor_{getpass.getuser()}"))
    return detached
