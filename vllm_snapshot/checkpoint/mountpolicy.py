"""Host side of the engine's mount policy (engine/mounts.py): refuse at create, record the
external mounts at dump, build CRIU's ``--external`` options, and check them at restore.

* :func:`check_create` -- before the engine starts: the mounts the engine would need but that
  cannot be checkpointed (``refuse`` in :func:`vllm_snapshot.engine.mounts.classify`) raise
  UsageError naming mount point, type and a remedy.
* :func:`describe_externals` -- after the engine is ready, before the dump: the mounts of the
  *engine's* namespace (``/proc/PID/mountinfo``, after its policy ran) that CRIU cannot dump as
  they are, each with a cookie and an identity that survives a reboot (file system UUID, else
  statfs ``f_fsid``, else the source, e.g. ``server:/export`` for NFS). They go into the
  manifest (:class:`vllm_snapshot.store.manifest.ExternalMount`).
* :func:`dump_args` / :func:`restore_args` -- ``mnt[MOUNTPOINT]:COOKIE`` at dump,
  ``mnt[COOKIE]:MOUNTPOINT`` at restore (CRIU binds the host's mount point back, like
  runc/podman volumes). Pure.
* :func:`check_restore` -- before CRIU runs: each recorded mount point must be a mount on this
  host with the same file system type and identity; the problems name mount point, expected and
  actual.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable

from ..engine import mounts as M
from ..store.manifest import ExternalMount

#: Network/virtual file systems without a UUID: the source names the export.
SOURCE_IDENTITY_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre", "virtiofs"})
COOKIE_PREFIX = "vsnap-m"
BY_UUID = "/dev/disk/by-uuid"


# ---------------------------------------------------------------------------------- identity


def _uuid_by_devnum(major_minor: str, by_uuid: str = BY_UUID) -> str | None:
    try:
        names = os.listdir(by_uuid)
    except OSError:
        return None
    want = tuple(int(x) for x in major_minor.split(":"))
    for n in names:
        try:
            st = os.stat(os.path.join(by_uuid, n))
        except OSError:
            continue
        if (os.major(st.st_rdev), os.minor(st.st_rdev)) == want:
            return n
    return None


def _devname(major_minor: str) -> str | None:
    try:
        with open(f"/sys/dev/block/{major_minor}/uevent") as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    return "/dev/" + line.split("=", 1)[1].strip()
    except OSError:
        return None
    return None


def _blkid_uuid(dev: str) -> str | None:
    try:
        p = subprocess.run(["blkid", "-p", "-o", "value", "-s", "UUID", dev],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = p.stdout.strip()
    return out if p.returncode == 0 and out else None


def fs_identity(m: M.Mount, path: str, *, uuid_of: Callable[[str], str | None] | None = None,
                fsid_of: Callable[[str], int] | None = None) -> tuple[str, str]:
    """``(kind, value)`` naming ``m``'s file system across reboots: ``uuid`` (from
    /dev/disk/by-uuid, else ``blkid -p`` on the block device), for network file systems
    ``source``, else ``fsid`` (statfs f_fsid of ``path``, which on ext4/xfs/btrfs derives from
    the UUID), else ``source``. ``path`` is where the mount can be reached from this process
    (``/proc/PID/root/MOUNTPOINT`` for another namespace)."""
    if m.fs_type in SOURCE_IDENTITY_FS:
        return "source", m.source
    uuid = (uuid_of or default_uuid_of)(m.major_minor)
    if uuid:
        return "uuid", uuid
    try:
        fsid = (fsid_of or (lambda p: os.statvfs(p).f_fsid))(path)
    except OSError:
        fsid = 0
    if fsid:
        return "fsid", f"{fsid:016x}"
    return "source", m.source


def default_uuid_of(major_minor: str) -> str | None:
    if major_minor.split(":")[0] == "0":  # anonymous device (tmpfs, proc, overlay, NFS...)
        return None
    u = _uuid_by_devnum(major_minor)
    if u:
        return u
    dev = _devname(major_minor)
    return _blkid_uuid(dev) if dev else None


# ---------------------------------------------------------------------------------- create


def create_refusals(mountinfo: str, needed: list[str]) -> list[str]:
    """Lines for each mount that must refuse (mount point, type, source, why). Pure."""
    return M.refusals(M.classify(M.parse_mountinfo(mountinfo), needed))


REFUSE_HINT = ("copy the model (or venv/cache, or the LD_LIBRARY_PATH directory) to a local disk directory "
               "outside /dev/shm and the engine's TMPDIR, not on FUSE or an automount, and pass that path")


def check_create(model_dir: str, env: dict[str, str], mountinfo: str | None = None,
                 also: tuple[str, ...] = ()) -> list[tuple[M.Mount, str, str]]:
    """Before the engine starts: classify the host's mounts for the engine's needed paths
    (model, Python, packages, caches from the engine's ``env``, and ``also``: the snapshot root
    whose weights file the engine maps); raise UsageError when one must refuse. Returns the
    classification (for ``-v`` output)."""
    from ..errors import UsageError

    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    needed = M.needed_paths(model_dir, env, list(also))
    got = M.classify(M.parse_mountinfo(mountinfo), needed)
    bad = M.refusals(got)
    if bad:
        raise UsageError("the engine needs mounts that cannot be checkpointed:\n  " + "\n  ".join(bad),
                         hint=REFUSE_HINT)
    return got


# ---------------------------------------------------------------------------------- dump


def externals_of(mounts: list[M.Mount], reach: Callable[[str], str],
                 identity: Callable[[M.Mount, str], tuple[str, str]] = fs_identity) -> list[ExternalMount]:
    """Records for the mounts of ``mounts`` that CRIU cannot dump (:func:`dump_externals`),
    cookies ``vsnap-m0``, ``vsnap-m1``, ... in table order. ``reach(mount_point)`` is the path
    this process reaches it by. Raises ValueError for a mount point --external cannot name."""
    out = []
    for i, m in enumerate(M.dump_externals(mounts)):
        if "]" in m.mount_point or "\n" in m.mount_point:
            raise ValueError(f"CRIU's --external mnt[...] cannot name the mount point {m.mount_point!r}")
        kind, value = identity(m, reach(m.mount_point))
        out.append(ExternalMount(mount_point=m.mount_point, fs_type=m.fs_type, source=m.source, root=m.root,
                                 major_minor=m.major_minor, cookie=f"{COOKIE_PREFIX}{i}",
                                 identity_kind=kind, identity=value))
    return out


def describe_externals(engine_pid: int) -> list[ExternalMount]:
    """The external mounts of the engine tree rooted at ``engine_pid`` (read its namespace's
    mount table now: call it after the engine is ready, right before the dump)."""
    with open(f"/proc/{engine_pid}/mountinfo") as f:
        mounts = M.parse_mountinfo(f.read())
    return externals_of(mounts, lambda mp: f"/proc/{engine_pid}/root{mp}")


def dump_args(records: list[ExternalMount] | tuple[ExternalMount, ...]) -> tuple[str, ...]:
    """CRIU dump ``--external`` values (RPC ``opts.external``). Pure."""
    return tuple(f"mnt[{r.mount_point}]:{r.cookie}" for r in records)


def restore_args(records: list[ExternalMount] | tuple[ExternalMount, ...]) -> tuple[str, ...]:
    """CRIU restore ``--external`` values: bind the host's mount point back. Pure."""
    return tuple(f"mnt[{r.cookie}]:{r.mount_point}" for r in records)


# ---------------------------------------------------------------------------------- restore


def check_restore(records: list[ExternalMount] | tuple[ExternalMount, ...], mountinfo: str | None = None,
                  identity: Callable[[M.Mount, str], tuple[str, str]] = fs_identity) -> list[str]:
    """Problems (empty = fine) with the host's mounts for the recorded external mounts: each
    mount point must be the top mount there (not just a directory of its parent), with the
    recorded file system type and identity. Lines name mount point, expected and actual."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    mounts = M.parse_mountinfo(mountinfo)
    visible = M._visible(mounts)
    problems = []
    for r in records:
        here = [m for m in visible if m.mount_point == r.mount_point]
        if not here:
            on = M.mount_of(mounts, r.mount_point)
            where = f"{on.mount_point} ({on.fs_type} {on.source})" if on else "nothing"
            problems.append(f"{r.mount_point}: expected a mount of {r.describe()}, found no mount there "
                            f"(the path lies on {where})")
            continue
        m = here[-1]
        if m.fs_type != r.fs_type:
            problems.append(f"{r.mount_point}: expected {r.fs_type}, found {m.fs_type} (source {m.source})")
            continue
        kind, value = identity(m, r.mount_point)
        if (kind, value) != (r.identity_kind, r.identity):
            problems.append(f"{r.mount_point}: expected {r.fs_type} {r.identity_kind}={r.identity}, "
                            f"found {m.fs_type} {kind}={value} (source {m.source})")
    return problems
