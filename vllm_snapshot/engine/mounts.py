"""The engine's mount namespace: which host mounts it keeps, detaches, or hands to CRIU as
external mounts (runs inside the namespace before vLLM starts; the parsing and the policy are
pure and shared with the supervisor, see :mod:`vllm_snapshot.checkpoint.mountpolicy`).

A namespace made by ``unshare --mount`` starts as a copy of the host's, and CRIU dumps every
mount of it. CRIU 4.2.1 can re-create only some file systems (criu/filesystems.c): proc,
sysfs, devtmpfs, devpts, tmpfs (by tarring its *content*), mqueue, cgroup/cgroup2, debugfs,
fusectl, securityfs, pstore, binfmt_misc; tracefs it silently skips; ext4, xfs, btrfs, vfat,
squashfs, ramfs, bpf, hugetlbfs, NFS, ... fail the dump with "FS mnt ... unsupported", and a
bind mount whose file system root is not mounted in the namespace (a container's single-file
bind over /etc/hosts) with "... doesn't have a proper root mount". The root mount is never a
problem: restore re-creates it from ``--root /``. Measured in MOUNTS-INTEGRATION.md.

So the policy (:func:`classify`) is:

* ``keep``: the root mount, and the pseudo file systems the engine uses at their usual places
  (/proc, /sys, /sys/fs/cgroup and its cgroup mounts, /dev, /dev/pts, /dev/mqueue);
* ``detach`` (lazily, ``umount2(MNT_DETACH)``, deepest first, by :func:`make_private`): every
  other mount the engine does not need, and the host's /dev/shm and the engine TMPDIR, which
  are replaced by private tmpfs (CRIU dumps tmpfs *content*: without this a snapshot held the
  host's /dev/shm, i.e. other processes' shared memory);
* ``external``: mounts that hold a needed path (model, Python and venv, vllm_snapshot, caches,
  the working directory, whatever the engine root has open or mapped, and the NVIDIA driver as
  the dynamic loader finds it: :func:`driver_paths`), their ancestors (lazy
  detach of a parent takes its children along), and the name-service file binds of containers
  (/etc/hosts, /etc/resolv.conf, /etc/hostname: the engine should resolve names as the host
  it runs on does). CRIU gets them as ``--external mnt[MOUNTPOINT]:COOKIE`` and binds the same
  host path back at restore, as runc/podman do for volumes;
* ``refuse``: a needed path under a private tmpfs (/dev/shm, the engine TMPDIR: the engine would
  not see the host's files there), on FUSE (the daemon lives outside the tree; CRIU 4.2.1
  refuses fuse mounts) or under an autofs trigger, or a mount point CRIU's ``--external``
  syntax cannot carry.

Besides, with mount propagation already private (unshare's default), :func:`make_private`
mounts fresh tmpfs on ``/dev/shm`` and :data:`ENGINE_TMPDIR` (mode 1777: POSIX semaphores,
vLLM's shared-memory queues, ZMQ ipc sockets and CRIU's link-remap files live there and are
dumped with the tree) and links ``$TMPDIR/torchinductor_$USER`` to ``$TORCHINDUCTOR_CACHE_DIR``
on disk (torch inductor writes its ~150 MB precompiled header under its tempdir-based
``default_cache_dir()`` regardless of the variable; it would be re-made at every create and
tarred into every image).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

from ..paths import ENGINE_TMPDIR

MNT_DETACH = 2
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
KEEP = ("/dev",)
#: The engine's private temp dir (TMPDIR, :data:`vllm_snapshot.paths.ENGINE_TMPDIR`): a tmpfs
#: mounted inside the namespace on this directory of the host's root filesystem (so the host's
#: /tmp, where code or models may live, stays visible). vLLM's ZMQ ipc sockets and torch's temp
#: files go there. The private mounts:
PRIVATE = ("/dev/shm", ENGINE_TMPDIR)

#: Actions of :func:`classify`.
KEEP_ACTION, DETACH, EXTERNAL, REFUSE = "keep", "detach", "external", "refuse"

#: File systems CRIU 4.2.1 re-creates itself (criu/filesystems.c). tracefs is left out on
#: purpose: CRIU "skips" it (it is simply missing after a restore).
CRIU_NATIVE_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "tmpfs", "mqueue", "cgroup", "cgroup2",
                            "debugfs", "fusectl", "securityfs", "pstore", "binfmt_misc"})
#: Pseudo file systems the engine keeps, by mount point: (mount point or prefix + "/", types).
PSEUDO_KEEP: tuple[tuple[str, frozenset[str]], ...] = (
    ("/proc", frozenset({"proc"})),
    ("/sys", frozenset({"sysfs"})),
    ("/sys/fs/cgroup", frozenset({"tmpfs", "cgroup2"})),
    ("/sys/fs/cgroup/", frozenset({"cgroup", "cgroup2"})),
    ("/dev", frozenset({"devtmpfs", "tmpfs"})),
    ("/dev/pts", frozenset({"devpts"})),
    ("/dev/mqueue", frozenset({"mqueue"})),
)
#: Single-file binds a container runtime puts over the name-service files.
NAME_FILES = ("/etc/hosts", "/etc/resolv.conf", "/etc/hostname")
#: Needed paths on these types refuse (see the module doc).
REFUSE_TYPES = frozenset({"fuse", "fuseblk", "autofs"})


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/PID/mountinfo`` (proc(5))."""

    mount_id: int
    parent_id: int
    major_minor: str  # "254:0"
    root: str  # the path inside the file system that is mounted (a bind mount's subtree)
    mount_point: str
    options: str  # per-mount options
    fs_type: str
    source: str
    super_options: str

    @property
    def is_bind_of_subtree(self) -> bool:
        return self.root != "/"


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1:i + 4].isdigit() and len(path[i + 1:i + 4]) == 3:
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Records of ``/proc/PID/mountinfo`` text, in file order (a later mount on the same mount
    point is on top). Lines that do not parse are skipped. Pure."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f, r = left.split(), right.split()
        if len(f) < 6 or not r:
            continue
        try:
            mid, pid = int(f[0]), int(f[1])
        except ValueError:
            continue
        out.append(Mount(mount_id=mid, parent_id=pid, major_minor=f[2], root=_unescape(f[3]),
                         mount_point=_unescape(f[4]), options=f[5], fs_type=r[0],
                         source=_unescape(r[1]) if len(r) > 1 else "",
                         super_options=r[2] if len(r) > 2 else ""))
    return out


def tmpfs_mounts(mountinfo: str) -> list[str]:
    """Mount points of tmpfs mounts listed in ``/proc/self/mountinfo`` text. Pure."""
    return [m.mount_point for m in parse_mountinfo(mountinfo) if m.fs_type == "tmpfs"]


def to_detach(mounts: list[str]) -> list[str]:
    """Which tmpfs mount points to detach, deepest first: all but ``/dev`` and ``/sys/...``."""
    keep = [m for m in mounts if m in KEEP or m == "/sys" or m.startswith("/sys/")]
    out = sorted({m for m in mounts if m not in keep}, key=lambda m: (-m.count("/"), m))
    return out


def hidden_prefixes(mountinfo: str, needed_paths: list[str] | None = None) -> list[str]:
    """Host paths the engine will not see: the private mounts plus, without ``needed_paths``,
    the host's tmpfs mounts (the behaviour before the mount policy), with them, every mount
    point :func:`classify` detaches."""
    if needed_paths is None:
        return sorted(set(to_detach(tmpfs_mounts(mountinfo))) | set(PRIVATE))
    got = classify(parse_mountinfo(mountinfo), needed_paths)
    return sorted({m.mount_point for m, a, _ in got if a == DETACH} | set(PRIVATE))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or prefix == "/" or path.startswith(prefix.rstrip("/") + "/")


def _hidden_ids(mounts: list[Mount]) -> set[int]:
    """Mounts that cannot be reached by path: one with another mount stacked on it (same mount
    point, parent = it) and everything else below it (``unshare --mount-proc`` mounts the
    namespace's /proc over the host's, whose children stay in the table). Pure."""
    kids: dict[int, list[Mount]] = {}
    for m in mounts:
        kids.setdefault(m.parent_id, []).append(m)
    hidden: set[int] = set()
    for m in mounts:
        over = [o for o in kids.get(m.mount_id, []) if o.mount_point == m.mount_point and o is not m]
        if not over:
            continue
        hidden.add(m.mount_id)
        stack = [k for k in kids.get(m.mount_id, []) if k not in over]
        while stack:
            k = stack.pop()
            if k.mount_id not in hidden:
                hidden.add(k.mount_id)
                stack.extend(kids.get(k.mount_id, []))
    return hidden


def _visible(mounts: list[Mount]) -> list[Mount]:
    """Mounts reachable by path (see :func:`_hidden_ids`), in file order."""
    hidden = _hidden_ids(mounts)
    return [m for m in mounts if m.mount_id not in hidden]


def mount_of(mounts: list[Mount], path: str) -> Mount | None:
    """The visible mount that ``path`` (absolute, symlinks resolved) lies on. Pure."""
    best = None
    for m in _visible(mounts):
        if _under(path, m.mount_point) and (best is None or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def _is_pseudo_keep(m: Mount) -> bool:
    for place, types in PSEUDO_KEEP:
        hit = m.mount_point.startswith(place) if place.endswith("/") else m.mount_point == place
        if hit and m.fs_type in types:
            return True
    return False


def _root_mounts(mounts: list[Mount]) -> list[Mount]:
    return [m for m in mounts if m.mount_point == "/"]


def criu_can_dump(m: Mount, mounts: list[Mount]) -> bool:
    """Whether CRIU 4.2.1 dumps ``m`` as it is (criu/mount.c validate_mounts): the root mount;
    a bind of the root's file system; a native file system whose root is mounted in the table
    (itself, or another mount of the same device with root ``/``). Pure."""
    if m.mount_point == "/":
        return True
    roots = _root_mounts(mounts)
    if any(r.major_minor == m.major_minor and r.root == "/" for r in roots):
        return True  # a bind mount from the root file system ("root bind")
    if m.fs_type not in CRIU_NATIVE_FS:
        return False
    if not m.is_bind_of_subtree:
        return True
    return any(o.major_minor == m.major_minor and o.root == "/" for o in mounts)


def dump_externals(mounts: list[Mount]) -> list[Mount]:
    """Mounts of a namespace's table that must be passed to CRIU as external mounts: those it
    cannot dump as they are, and host tmpfs mounts the engine kept because it needs them (a
    model or venv on a tmpfs /tmp): CRIU would tar their *content* into the images -- host
    data, gigabytes -- so they are bound back from the host instead. The engine's private
    tmpfs and the pseudo file systems it keeps are dumped by CRIU. Pure."""
    return [m for m in mounts if not criu_can_dump(m, mounts)
            or (m.fs_type == "tmpfs" and m.mount_point not in PRIVATE and not _is_pseudo_keep(m))]


def classify(mounts: list[Mount], needed_paths: list[str] | tuple[str, ...]) -> list[tuple[Mount, str, str]]:
    """The mount policy (see the module doc): ``(mount, action, reason)`` for every mount of
    ``mounts`` (file order), action one of ``keep``/``detach``/``external``/``refuse``.
    ``needed_paths`` are absolute paths with symlinks resolved (pass both a path and its
    real path when they differ). Pure."""
    by_id = {m.mount_id: m for m in mounts}
    need_reason: dict[int, str] = {}
    refusals: dict[int, str] = {}
    for p in needed_paths:
        for priv in PRIVATE:
            if _under(p, priv):
                m = mount_of(mounts, p)
                if m is not None:
                    refusals[m.mount_id] = (f"{p} is under {priv}, where the engine gets a private tmpfs "
                                            "and does not see the host's files")
        starts = [(mount_of(mounts, p), f"holds {p}")]
        if p != "/":  # mounts below a needed directory (a model shard on its own disk)
            starts += [(m, f"is inside {p}") for m in _visible(mounts)
                       if m.mount_point != p and _under(m.mount_point, p)]
        for m, first in starts:
            seen: set[int] = set()
            child = None
            while m is not None and m.mount_id not in seen:
                seen.add(m.mount_id)
                need_reason.setdefault(m.mount_id, first if child is None else
                                       f"is a parent of {child.mount_point}, which {need_reason[child.mount_id]}")
                child = m
                m = by_id.get(m.parent_id)
    out = []
    for m in mounts:
        mp = m.mount_point
        if m.mount_id in refusals:
            out.append((m, REFUSE, refusals[m.mount_id]))
        elif mp == "/":
            out.append((m, KEEP_ACTION, "the root mount (restored from --root /)"))
        elif mp in PRIVATE and m.fs_type == "tmpfs":
            out.append((m, DETACH, "replaced by a private tmpfs in the engine's namespace"))
        elif _is_pseudo_keep(m):
            out.append((m, KEEP_ACTION, f"{m.fs_type} the engine uses (CRIU re-creates it)"))
        elif m.mount_id in need_reason:
            why = need_reason[m.mount_id]
            if m.fs_type in REFUSE_TYPES or m.fs_type.startswith("fuse."):
                out.append((m, REFUSE, f"{why}, but {m.fs_type} mounts cannot be checkpointed "
                                       "(CRIU 4.2.1 refuses FUSE; an autofs trigger needs its daemon)"))
            elif "]" in mp or "\n" in mp:
                out.append((m, REFUSE, f"{why}, but CRIU's --external mnt[...] syntax cannot name this mount point"))
            else:
                out.append((m, EXTERNAL, f"{why}; bound back from the host at restore"))
        elif mp in NAME_FILES and not criu_can_dump(m, mounts):
            out.append((m, EXTERNAL, "a name-service file bind (container): the engine resolves names like its host"))
        else:
            out.append((m, DETACH, "not needed by the engine"))
    return out


def refusals(classified: list[tuple[Mount, str, str]]) -> list[str]:
    """Human lines for the ``refuse`` entries of :func:`classify`: mount point, type, why. Pure."""
    return [f"{m.mount_point} ({m.fs_type} {m.source}): {why}" for m, a, why in classified if a == REFUSE]


def _add_path(out: list[str], p: str | None) -> None:
    if not p:
        return
    p = os.path.abspath(os.path.expanduser(p))
    for q in (p, os.path.realpath(p)):
        if q not in out:
            out.append(q)


#: Environment variables naming caches or config dirs vLLM, torch, HF and triton use.
CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "HF_HOME", "HF_HUB_CACHE",
              "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME", "TRITON_CACHE_DIR",
              "TORCH_HOME", "VLLM_SNAPSHOT_CACHE")


#: The NVIDIA user-space driver libraries vLLM and torch load by name (CUDA driver API, NVML).
DRIVER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
#: The dynamic loader's cache: a container has its own (written by its runtime's ldconfig hook),
#: and every process the engine starts later (vLLM's spawned children) reads it.
LD_CACHE = "/etc/ld.so.cache"
LDCONFIG_CANDIDATES = ("/sbin/ldconfig", "/usr/sbin/ldconfig", "/usr/bin/ldconfig")


def parse_ldconfig(text: str) -> dict[str, list[str]]:
    """``ldconfig -p`` output -> ``{soname: [path, ...]}`` in cache order (the order the dynamic
    loader tries them; every architecture listed is kept). Lines that do not parse are skipped.
    Pure."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        left, sep, path = line.strip().partition(" => ")
        if not sep or not path.startswith("/"):
            continue
        name = left.split(" (", 1)[0].strip()
        if name:
            out.setdefault(name, []).append(path.strip())
    return out


def ld_library_dirs(env: dict[str, str]) -> list[str]:
    """The absolute directories of ``env["LD_LIBRARY_PATH"]``, in order, without repeats (the
    loader also splits on ``;``; empty and relative entries, which it resolves against the
    working directory of each process, are left out). Pure."""
    out: list[str] = []
    for d in env.get("LD_LIBRARY_PATH", "").replace(";", ":").split(":"):
        if d.startswith("/") and d not in out:
            out.append(d)
    return out


def ldconfig_cache() -> str:
    """``ldconfig -p`` of this host (the dynamic loader's cache, read from /etc/ld.so.cache);
    empty text when there is no ldconfig (musl) or it fails within 10 s."""
    import shutil
    import subprocess

    for exe in (*LDCONFIG_CANDIDATES, shutil.which("ldconfig")):
        if exe and os.access(exe, os.X_OK):
            try:
                p = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10,
                                   env={"LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
            except (OSError, subprocess.TimeoutExpired):
                return ""
            return p.stdout if p.returncode == 0 else ""
    return ""


def driver_library_paths(env: dict[str, str], ldconfig_text: str) -> list[str]:
    """Where the dynamic loader looks for :data:`DRIVER_LIBS` in a process with ``env``: in
    each ``LD_LIBRARY_PATH`` directory, then the cache entries (``ldconfig -p`` text). Every
    candidate, not only the first (a later one is used when an earlier one is missing or cannot
    be loaded; a missing one keeps no mount). Absolute paths as found, symlinks not resolved.
    Pure."""
    cache = parse_ldconfig(ldconfig_text)
    out: list[str] = []
    for lib in DRIVER_LIBS:
        for p in [os.path.join(d, lib) for d in ld_library_dirs(env)] + cache.get(lib, []):
            if p not in out:
                out.append(p)
    return out


def nvidia_devices(dev: str = "/dev") -> list[str]:
    """The ``DEV/nvidia*`` entries of this host, sorted (device nodes -- in a container possibly
    bind mounts of the host's -- and the ``nvidia-caps`` directory); empty without a GPU."""
    import glob

    return sorted(glob.glob(os.path.join(glob.escape(dev), "nvidia*")))


def driver_paths(env: dict[str, str], ldconfig_text: str | None = None, devices: list[str] | None = None) -> list[str]:
    """Paths the engine needs to reach the NVIDIA driver as ``vllm serve`` would with ``env``:
    the loader's cache (:data:`LD_CACHE`), every ``LD_LIBRARY_PATH`` directory (GKE-style
    hosts keep the driver in its own mount, e.g. ``/usr/local/nvidia``, found through it), each
    place the loader looks for a driver library (:func:`driver_library_paths`;
    nvidia-container-toolkit bind-mounts each library as a single *file*) with its directory
    (other driver libraries loaded later, e.g. the PTX JIT, sit beside it) and, symlinks
    resolved, the file and directory it points to, and the GPU device entries. ``ldconfig_text``
    defaults to :func:`ldconfig_cache`, ``devices`` to :func:`nvidia_devices`. Paths that do
    not exist keep no mount."""
    if ldconfig_text is None:
        ldconfig_text = ldconfig_cache()
    out = [LD_CACHE, *ld_library_dirs(env)]
    for p in driver_library_paths(env, ldconfig_text):
        real = os.path.realpath(p)
        for q in (p, os.path.dirname(p), real, os.path.dirname(real)):
            if q not in out:
                out.append(q)
    for d in nvidia_devices() if devices is None else devices:
        if d not in out:
            out.append(d)
    return out


def needed_paths(model: str | None, env: dict[str, str], extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Paths the engine needs to see: the model, this Python (prefix, base prefix, executable),
    the vllm_snapshot, vllm and torch packages, caches named by ``env`` (plus HOME/.cache),
    the working directory, the NVIDIA driver as the dynamic loader would find it with ``env``
    (:func:`driver_paths`: this host's loader cache and GPU devices) and ``extra``.
    Each as given and with symlinks resolved. Finds the packages without importing them."""
    out: list[str] = []
    import importlib.util

    _add_path(out, model)
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.executable):
        _add_path(out, p)
    _add_path(out, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vllm_snapshot
    for name in ("vllm", "torch"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            _add_path(out, loc)
    if env.get("HOME"):
        _add_path(out, os.path.join(env["HOME"], ".cache"))
    for k in CACHE_VARS:
        _add_path(out, env.get(k))
    try:
        _add_path(out, os.getcwd())
    except OSError:
        pass
    for p in driver_paths(env):
        _add_path(out, p)
    for p in extra:
        _add_path(out, p)
    return [p for p in out if not any(_under(p, priv) for priv in PRIVATE) or p == model]


def _open_and_mapped() -> list[str]:
    """Regular files this process has open or mapped (the engine root before vLLM starts)."""
    out: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    out.add(parts[5].strip().removesuffix(" (deleted)"))
    except OSError:
        pass
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                t = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if t.startswith("/") and not t.startswith(("/proc/", "/dev/")):
                out.add(t)
    except OSError:
        pass
    return sorted(out)


def _spec_model() -> str | None:
    import json

    try:
        return json.loads(sys.argv[1]).get("model")
    except (IndexError, ValueError, AttributeError):
        return None


def _spec_store() -> list[str]:
    """The snapshot root whose ``.weights`` the engine maps its weights from (engine spec
    ``weights_root``; none when the weights stay in the images)."""
    import json

    try:
        root = json.loads(sys.argv[1]).get("weights_root")
    except (IndexError, ValueError, AttributeError):
        return []
    return [root] if isinstance(root, str) and root else []


def make_private(needed: list[str] | None = None, link_inductor: bool = True) -> list[str]:
    """Apply the mount policy in this (new, private) mount namespace: detach every mount
    :func:`classify` marks ``detach``, then mount private tmpfs on /dev/shm and ENGINE_TMPDIR
    (which must exist: the supervisor creates it). ``needed`` defaults to :func:`needed_paths`
    for the model of the engine spec (``sys.argv[1]``), this process's environment, and the
    files it has open or mapped. Returns the mount points detached. Raises OSError when a
    private tmpfs cannot be mounted. ``refuse`` entries are left alone here: create refuses
    them on the host before the engine starts (:func:`vllm_snapshot.checkpoint.mountpolicy.check_create`).
    ``link_inductor=False`` leaves :func:`link_inductor_cache` to the caller (the engine root
    calls it once it runs as the engine user, who must own the cache)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if needed is None:
        needed = needed_paths(_spec_model(), dict(os.environ), [*_open_and_mapped(), *_spec_store()])
    detached: list[str] = []
    _peel_proc(libc)
    for _ in range(16):  # stacked mounts on one path come off one per pass
        with open("/proc/self/mountinfo") as f:
            mounts = parse_mountinfo(f.read())
        visible = {m.mount_id for m in _visible(mounts)}
        todo = sorted({m.mount_point for m, a, _ in classify(mounts, needed) if a == DETACH and m.mount_id in visible},
                      key=lambda p: (-p.count("/"), p))
        done = [mp for mp in todo if libc.umount2(mp.encode(), MNT_DETACH) == 0]
        detached += done
        if not done:
            break
    for mp in PRIVATE:
        os.makedirs(mp, exist_ok=True)
        if libc.mount(b"tmpfs", mp.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777") != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount a private tmpfs on {mp}: {os.strerror(err)}")
    if link_inductor:
        link_inductor_cache()
    return detached


def link_inductor_cache() -> None:
    """Create ``$TORCHINDUCTOR_CACHE_DIR`` (0700, as the calling user) and link
    ``ENGINE_TMPDIR/torchinductor_$USER`` to it (see the module doc). Raises OSError."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:
        import getpass

        os.makedirs(inductor, mode=0o700, exist_ok=True)
        os.symlink(inductor, os.path.join(ENGINE_TMPDIR, f"torchinductor_{getpass.getuser()}"))


def _peel_proc(libc) -> None:
    """``unshare --mount-proc`` mounts the namespace's /proc *over* the host's, so mounts under
    the host's /proc (binfmt_misc, systemd's autofs trigger on /proc/sys/fs/binfmt_misc) stay
    in the table but cannot be reached by path to detach them. Take both /proc mounts off (a
    lazy detach takes the children along) and mount a fresh proc for this PID namespace. Only
    when something is hidden there."""
    with open("/proc/self/mountinfo") as f:
        mounts = parse_mountinfo(f.read())
    procs = [m for m in mounts if m.mount_point == "/proc"]
    hidden = _hidden_ids(mounts)
    if len(procs) < 2 or not any(m.mount_point.startswith("/proc/") and m.mount_id in hidden for m in mounts):
        return
    for _ in procs:
        if libc.umount2(b"/proc", MNT_DETACH) != 0:
            break
    if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount /proc: {os.strerror(err)}")
