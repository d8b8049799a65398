"""Restored trees whose anonymous memory KSM may merge (``restore --merge-pages``).

Every CRIU restore re-creates a snapshot's anonymous pages privately, so N clones of one
snapshot hold N copies of identical Python heaps. ``prctl(PR_SET_MEMORY_MERGE, 1)`` (Linux >=
6.4, ``CONFIG_KSM``) marks a process's mm "merge any": every anonymous VMA it maps from then on
is ``VM_MERGEABLE`` (smaps ``VmFlags: mg``), and the mark survives fork and execve. ``criu
swrk`` started with it passes it to every process it forks for the tree, so the restorer's
mappings are mergeable, and ksmd -- when the host runs KSM (``/sys/kernel/mm/ksm/run`` = 1) --
merges the identical pages across clones. Without ksmd running the mark costs nothing.

The mark is set by a launcher (:func:`launch_argv`: this interpreter runs ``prctl`` and then
execs CRIU), not by a ``preexec_fn``: a restore has threads, and code between fork and exec in
a threaded process can deadlock. Design and numbers: docs/weights.md, "Clones that share their
identical pages".
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ...errors import EnvironmentProblem

PR_SET_MEMORY_MERGE = 67
PR_GET_MEMORY_MERGE = 68
#: where the kernel exposes KSM's controls and counters
KSM_SYSFS = Path("/sys/kernel/mm/ksm")
#: exit status of the launcher when its prctl fails (CRIU never ran)
LAUNCH_FAILED = 97

#: run as ``python -I -S -c LAUNCHER CRIU ARGS...``: mark this process, then become CRIU
LAUNCHER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MEMORY_MERGE}, 1, 0, 0, 0) != 0:\n"
    f"    os._exit({LAUNCH_FAILED})\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def launch_argv(argv: list[str], python: str | None = None) -> list[str]:
    """``argv`` (a command, e.g. ``[criu, "swrk", FD]``) run through the launcher: ``python``
    (default: this interpreter) sets ``PR_SET_MEMORY_MERGE`` and execs ``argv[0]`` with
    ``argv``; fds it was given stay open across the exec. Pure."""
    return [python or sys.executable, "-I", "-S", "-c", LAUNCHER, *argv]


def check_available(prctl=None) -> None:
    """Raise EnvironmentProblem when this kernel cannot mark a process mergeable
    (``PR_GET_MEMORY_MERGE`` fails: Linux < 6.4, or built without ``CONFIG_KSM``). ``prctl``:
    the libc ``prctl`` to call (tests pass a fake; it returns -1 and leaves errno on failure)."""
    if prctl is None:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    if prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) < 0:
        err = ctypes.get_errno() or errno.EINVAL
        raise EnvironmentProblem(
            f"--merge-pages: this kernel cannot mark a process's memory mergeable (prctl "
            f"PR_GET_MEMORY_MERGE failed: {os.strerror(err)})",
            hint="it needs Linux >= 6.4 built with CONFIG_KSM; restore without --merge-pages")


@dataclass(frozen=True)
class KsmState:
    """KSM's host-wide state (``/sys/kernel/mm/ksm``). ``run``: 0 stopped, 1 running, 2 unmerge
    all, None when the kernel has no KSM; ``pages_sharing``/``pages_shared``: pages (of the
    host's page size) saved by / backing merged pages; ``pages_to_scan`` per wake-up, every
    ``sleep_millisecs``."""

    run: int | None
    pages_shared: int = 0
    pages_sharing: int = 0
    pages_to_scan: int = 0
    sleep_millisecs: int = 0

    @property
    def running(self) -> bool:
        return self.run == 1


def ksm_state(sysfs: Path = KSM_SYSFS) -> KsmState:
    """Read :class:`KsmState` from ``sysfs``; ``run`` None when it is missing or unreadable."""
    def num(name: str) -> int | None:
        try:
            return int((sysfs / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    run = num("run")
    if run is None:
        return KsmState(None)
    return KsmState(run, num("pages_shared") or 0, num("pages_sharing") or 0,
                    num("pages_to_scan") or 0, num("sleep_millisecs") or 0)


def process_marked(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether process ``pid`` is marked ``ksm_merge_any`` (``/proc/PID/ksm_stat``, Linux >=
    6.6), as :func:`process_merge` reads it but without its pass over ``smaps`` (tens of ms
    for an engine); False when the process is gone or the kernel does not say."""
    try:
        return "ksm_merge_any: yes" in (proc / str(pid) / "ksm_stat").read_text()
    except OSError:
        return False


def process_merge(pid: int, proc: Path = Path("/proc")) -> dict[str, int] | None:
    """KSM's view of process ``pid``: ``{"mergeable_vmas", "anon_vmas", "merging_pages",
    "merge_any"}`` -- anonymous VMAs (no path, or ``[heap]``/``[stack]``) in
    ``/proc/PID/smaps`` and how many of them carry ``VmFlags: mg``, ``ksm_merging_pages``
    (pages of it KSM merged now), and 1 when ``ksm_stat`` says the process is marked
    ``ksm_merge_any`` (else 0). None when the process is gone or its smaps unreadable."""
    try:
        smaps = (proc / str(pid) / "smaps").read_text()
    except OSError:
        return None
    anon = mergeable = 0
    name = ""
    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a VMA's header line
            name = head[5].strip() if len(head) > 5 else ""
        elif line.startswith("VmFlags:") and (not name or name in ("[heap]", "[stack]")):
            anon += 1
            mergeable += " mg" in line
    try:
        merging = int((proc / str(pid) / "ksm_merging_pages").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        merging = 0
    try:  # Linux >= 6.6: "ksm_merge_any: yes" for a process marked with PR_SET_MEMORY_MERGE
        merge_any = int("ksm_merge_any: yes" in (proc / str(pid) / "ksm_stat").read_text())
    except OSError:
        merge_any = 0
    return {"mergeable_vmas": mergeable, "anon_vmas": anon, "merging_pages": merging, "merge_any": merge_any}
