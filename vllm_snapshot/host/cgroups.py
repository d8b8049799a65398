"""A cgroup of its own for every detached engine, so that it outlives its launcher's session.

Why: CRIU restores a tree into the cgroups of the process that runs the restore (measured:
``restore --detach`` from a shell in ``memory:/throwaway`` left all four engine processes in
``memory:/throwaway``, ``pids:/throwaway`` and ``0::/throwaway``). Whoever then cleans up that
shell's cgroup -- logind ending an SSH session (``KillUserProcesses=yes``), a CI job runner, a
``systemctl stop`` of the unit a script ran in, a container exec's cgroup -- kills the engine
that ``--detach`` promised to keep. ``podman`` and ``systemd-run`` put such a workload in a
scope/cgroup of its own; this does the same over cgroupfs, for cgroup v1 and v2 alike (this
machine mounts v1 controllers and a v2 hierarchy at ``/sys/fs/cgroup/unified``).

How: before CRIU runs, a leaf ``vllm-snapshot/<name>`` is made under the root of every writable
hierarchy mounted here (v1: one per controller set, cpuset's ``cpus``/``mems`` copied from the
parent so a task may join; v2: no controllers are enabled for it, so the "no internal
processes" rule never applies). The restoring process joins the leaves just for the CRIU run
(every process CRIU forks is born there and v1 memory charges belong there), then goes back to
its own cgroups. The tree stays. ``stop`` and ``reclaim`` remove leaves that became empty. A
read-only cgroupfs (an unprivileged container) is not an error: the engine then stays in the
restorer's cgroups, and restore says so.

Reference: the kernel's cgroup-v1 and cgroup-v2 documentation (``cgroup.procs`` moves a whole
process; v1 cpuset needs ``cpuset.cpus``/``cpuset.mems`` before a task can attach).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

#: The directory under each hierarchy's root that holds the engines' leaves.
PARENT = "vllm-snapshot"
_GENERIC_OPTS = {"rw", "ro", "relatime", "noatime", "nosuid", "nodev", "noexec", "nsdelegate", "memory_recursiveprot",
                 "clone_children", "noprefix", "xattr", "favordynmods", "memory_localevents"}


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy: ``key`` is its controller field as ``/proc/PID/cgroup``
    writes it (``memory``, ``cpu,cpuacct``, ``name=systemd``; ``""`` for v2), ``mount`` the
    mount point, ``root`` the cgroup path mounted there (``/`` unless a container bind-mounts
    its own subtree)."""

    key: str
    mount: Path
    root: str
    writable: bool

    def path(self, cgroup: str) -> Path:
        """The directory of ``cgroup`` (a ``/proc/PID/cgroup`` path) under this mount."""
        rel = cgroup
        if self.root != "/" and (rel == self.root or rel.startswith(self.root + "/")):
            rel = rel[len(self.root):]
        return self.mount / rel.lstrip("/")


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/PID/cgroup`` text -> {controller field: path}. Pure."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def parse_mountinfo(text: str, keys: set[str]) -> list[Hierarchy]:
    """The cgroup hierarchies of ``/proc/self/mountinfo`` text whose controller field is in
    ``keys`` (from :func:`parse_proc_cgroup`), first mount of each. Pure."""
    found: dict[str, Hierarchy] = {}
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_f = pre.split(), post.split()
        if len(fields) < 6 or len(post_f) < 3 or post_f[0] not in ("cgroup", "cgroup2"):
            continue
        root, mount, mount_opts = fields[3], fields[4], fields[5].split(",")
        writable = "ro" not in mount_opts and "ro" not in post_f[2].split(",")
        if post_f[0] == "cgroup2":
            key = ""
        else:
            opts = [o for o in post_f[2].split(",") if o not in _GENERIC_OPTS and "=" not in o or o.startswith("name=")]
            key = next((k for k in keys if k and set(k.split(",")) == set(opts)), ",".join(opts))
        if key in keys and key not in found:
            found[key] = Hierarchy(key, Path(mount.replace("\\040", " ")), root, writable)
    return list(found.values())


def hierarchies() -> list[Hierarchy]:
    """The cgroup hierarchies this process is in and can see mounted."""
    mine = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    return parse_mountinfo(Path("/proc/self/mountinfo").read_text(), set(mine))


def where(pid: int) -> str:
    """Where a process runs, in words (:func:`where_in` of its /proc/PID/cgroup); ``"?"`` when
    it is gone."""
    try:
        cg = parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return "?"
    return where_in(cg)


def where_in(cg: dict[str, str]) -> str:
    """The cgroup path that says where a process runs, from its :func:`parse_proc_cgroup`
    (``{controller set or "" for v2: path}``): the v2 path when it is not ``/`` or v2 is the
    only hierarchy (a pure v2 host), else the ``memory`` v1 path, else the first v1 path;
    ``"?"`` for an empty table. Pure."""
    if cg.get("", "/") != "/" or len(cg) == 1:
        return cg.get("", "?")
    return cg.get("memory") or next(iter(cg.values()), "?")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class Placement:
    """The leaves ``vllm-snapshot/<name>`` of one detached engine. ``leaves``: hierarchy key ->
    directory; ``skipped``: hierarchies that could not hold one, with why."""

    name: str
    leaves: dict[str, Path] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    #: the hierarchies the leaves were made in (by :func:`create`)
    hierarchies: list[Hierarchy] = field(default_factory=list)
    _back: dict[str, Path] = field(default_factory=dict)

    @property
    def cgroup(self) -> str:
        """The leaf's cgroup path (``/vllm-snapshot/<name>``)."""
        return f"/{PARENT}/{self.name}"

    def enter(self) -> None:
        """Move this process (all its threads) into the leaves, remembering where it was."""
        mine = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
        for h in self.hierarchies:
            if h.key in self.leaves:
                self._back[h.key] = h.path(mine.get(h.key, "/"))
                _write(self.leaves[h.key] / "cgroup.procs", str(os.getpid()))

    def leave(self) -> None:
        """Move this process back where :meth:`enter` found it (what it forked meanwhile stays)."""
        for key, back in self._back.items():
            try:
                _write(back / "cgroup.procs", str(os.getpid()))
            except OSError:
                pass
        self._back.clear()

    def remove(self, wait_s: float = 5.0) -> None:
        """rmdir the leaves once empty (processes of a killed tree take a moment to leave),
        waiting up to ``wait_s`` seconds. Leaves still busy then stay (``reclaim`` removes them
        later)."""
        deadline = time.monotonic() + wait_s
        for leaf in self.leaves.values():
            _rmdir_once_empty(leaf, deadline)


def _rmdir_once_empty(leaf: Path, deadline: float) -> bool:
    """rmdir ``leaf``, retrying on EBUSY (processes still leaving) until ``deadline``
    (``time.monotonic()`` seconds); True when this call removed it. Never raises."""
    while True:
        try:
            leaf.rmdir()
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def create(name: str) -> Placement:
    """Make the leaves ``vllm-snapshot/<name>`` (a suffix is added when one exists) in every
    writable hierarchy this process is in. Never raises for a hierarchy that cannot hold one:
    it is listed in ``skipped``."""
    hs = hierarchies()
    base = name
    for n in range(1, 1000):
        if not any((h.mount / PARENT / name).exists() for h in hs):
            break
        name = f"{base}-{n}"
    p = Placement(name, hierarchies=hs)
    for h in hs:
        if not h.writable:
            p.skipped.append(f"{h.mount} (read-only)")
            continue
        parent = h.mount / PARENT
        leaf = parent / name
        try:
            parent.mkdir(exist_ok=True)
            if (h.mount / "cpuset.cpus").exists() or (parent / "cpuset.cpus").exists():
                for f in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset: empty sets take no task
                    if (parent / f).exists() and not (parent / f).read_text().strip():
                        _write(parent / f, (h.mount / f).read_text().strip())
            leaf.mkdir()
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (leaf / f).exists() and not (leaf / f).read_text().strip():
                    _write(leaf / f, (parent / f).read_text().strip())
            p.leaves[h.key] = leaf
        except OSError as e:
            p.skipped.append(f"{h.mount} ({e.strerror})")
    return p


def empty_leaves(hs: list[Hierarchy] | None = None) -> list[Path]:
    """The leaves under ``vllm-snapshot/`` that hold no process (in every writable hierarchy of
    ``hs``, default :func:`hierarchies`): what engines that exited or were killed left. Only
    reads; unreadable leaves are left out."""
    found = []
    for h in hierarchies() if hs is None else hs:
        parent = h.mount / PARENT
        if not h.writable or not parent.is_dir():
            continue
        for leaf in sorted(parent.iterdir()):
            try:
                if leaf.is_dir() and not (leaf / "cgroup.procs").read_text().strip():
                    found.append(leaf)
            except OSError:
                continue
    return found


def remove_leaf(cgroup: str, wait_s: float = 5.0, hs: list[Hierarchy] | None = None) -> list[str]:
    """rmdir the leaf ``cgroup`` (``/vllm-snapshot/<name>``, what :attr:`Placement.cgroup`
    recorded) in every writable hierarchy of ``hs`` (default :func:`hierarchies`) once its
    processes have left, waiting up to ``wait_s`` seconds on EBUSY: what ``stop`` does for the
    engine it stopped, without the CRIU lock :func:`remove_empty` needs (a stopped engine's leaf
    is never one a restore is about to enter: :func:`create` picks another name while it exists).
    Anything not directly under ``vllm-snapshot/`` is left alone. The paths removed; never raises."""
    name = cgroup.strip("/")
    parts = name.split("/")
    if len(parts) != 2 or parts[0] != PARENT or parts[1] in ("", ".", ".."):
        return []
    gone = []
    deadline = time.monotonic() + wait_s
    for h in hierarchies() if hs is None else hs:
        if h.writable and _rmdir_once_empty(h.mount / name, deadline):
            gone.append(str(h.mount / name))
    return gone


def remove_empty() -> list[str]:
    """Remove :func:`empty_leaves` (engines that exited); the paths removed."""
    gone = []
    for leaf in empty_leaves():
        try:
            leaf.rmdir()  # EBUSY when a process entered it since it was read
            gone.append(str(leaf))
        except OSError:
            continue
    return gone
