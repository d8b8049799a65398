"""Memory a restore needs vs what this host and the engine's memory cgroup offer, checked
before CRIU runs (a CRIU run that hits the cgroup limit is OOM-killed halfway and says only
"Killed").

The need is the snapshot's raw image bytes: CRIU loads the page images into anonymous memory
and unpacks the tmpfs archives into tmpfs, so the restored tree's memory is about the size of
its images (measured: 1.3 GiB of images, 1.4 GiB resident after restore for the tiny CPU
engine).

What is offered is the smaller of ``MemAvailable`` (``/proc/meminfo``: the kernel's estimate of
memory available without swapping) and the headroom of the memory cgroup the restore runs in
(the restored tree is created by CRIU, our child, in our cgroup), taken over that cgroup and
every ancestor: ``limit - (usage - inactive file cache)``, the working set as the kubelet counts
it. cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``) are both read, from wherever they are mounted (a hybrid host has v1
controllers and a v2 tree at ``/sys/fs/cgroup/unified``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: v1 reports "no limit" as a page-rounded LONG_MAX.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Offer:
    """Memory on offer (bytes): ``available`` the smaller of MemAvailable and the cgroup
    headroom; ``why`` names which bound it and its numbers."""

    available: int
    why: str


def mem_available(meminfo: str | None = None) -> int:
    """``MemAvailable`` in bytes. Raises OSError/ValueError when /proc/meminfo lacks it."""
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("MemAvailable missing from /proc/meminfo")


def _mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """(cgroup v2 mount point, cgroup v1 memory controller mount point) from mountinfo text."""
    v2 = v1 = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rf = left.split(), right.split()
        if len(fields) < 5 or len(rf) < 3:
            continue
        fstype, opts = rf[0], rf[2].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = fields[4]
        elif fstype == "cgroup" and "memory" in opts and v1 is None:
            v1 = fields[4]
    return v2, v1


def _read_int(p: Path) -> int | None:
    try:
        t = p.read_text().strip()
    except OSError:
        return None
    if t == "max":
        return None
    try:
        return int(t)
    except ValueError:
        return None


def _stat(p: Path, key: str) -> int:
    try:
        for line in p.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_headroom(proc_cgroup: str, mountinfo: str) -> tuple[int, str] | None:
    """The smallest ``limit - working set`` (bytes) over our memory cgroup and its ancestors,
    with the cgroup's path and numbers in words; None when no limit applies. Pure over the two
    texts plus reads under the cgroup mounts."""
    v2, v1 = _mounts(mountinfo)
    paths: list[tuple[str, Path, str, str, str, str]] = []
    for line in proc_cgroup.splitlines():
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "" and v2:
            paths.append(("v2", Path(v2), path, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in ctrls.split(",") and v1:
            paths.append(("v1", Path(v1), path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                          "total_inactive_file"))
    best: tuple[int, str] | None = None
    for ver, mount, path, limit_f, usage_f, inactive_k in paths:
        rel = Path(path.lstrip("/"))
        for d in [rel, *rel.parents]:
            cg = mount / d
            limit = _read_int(cg / limit_f)
            if limit is None or limit >= _V1_UNLIMITED:
                continue
            usage = _read_int(cg / usage_f) or 0
            working = max(0, usage - _stat(cg / "memory.stat", inactive_k))
            room = max(0, limit - working)
            if best is None or room < best[0]:
                best = (room, f"memory cgroup {'/' + str(d) if str(d) != '.' else '/'} ({ver}): limit "
                              f"{_gib(limit)}, in use {_gib(working)}, free {_gib(room)}")
    return best


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def offer(under: str | None = None) -> Offer:
    """What this host offers a restore now (see the module doc): our memory cgroup's headroom,
    or with ``under`` (a cgroup path such as ``/vllm-snapshot``: where a detached engine gets
    a cgroup of its own) that cgroup's and its ancestors' in every hierarchy. Raises OSError."""
    avail = mem_available()
    text = Path("/proc/self/cgroup").read_text()
    if under is not None:
        text = "\n".join(":".join(line.split(":", 2)[:2] + [under]) for line in text.splitlines() if line.count(":") >= 2)
    cg = cgroup_headroom(text, Path("/proc/self/mountinfo").read_text())
    if cg is not None and cg[0] < avail:
        return Offer(cg[0], cg[1])
    return Offer(avail, f"MemAvailable {_gib(avail)}")


def check(need: int, got: Offer) -> str | None:
    """The refusal text when ``need`` bytes exceed what is offered, else None. Pure."""
    if need <= got.available:
        return None
    return (f"restoring needs about {_gib(need)} of memory (the snapshot's images), but only "
            f"{_gib(got.available)} is available: {got.why}")


__all__ = ["Offer", "cgroup_headroom", "check", "mem_available", "offer"]
