"""Engines running on this host, and time: :class:`LocalRuntimeTools` (the registry, engine
cgroups, the signals a foreground restore forwards) and :class:`LocalClock`."""

from __future__ import annotations

import os
import signal
import time
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator

from ..host.cgroups import Placement
from ..store.registry import Entry, StopReport
from ..report.results import ExitedRow
from .protocols import Clock, RuntimeTools

#: What a foreground engine's supervisor forwards: SIGHUP too (a closed terminal; it went to the
#: interrupt handler, and the command exited 130 while the tree was still dying and its port
#: still listening: a new-user trial).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class LocalRuntimeTools(RuntimeTools):
    """:class:`RuntimeTools` over the registry, cgroups and signals of this host."""

    def engines(self) -> list[Entry]:
        from ..store import registry

        return registry.entries()

    def orphan_pids(self) -> list[int]:
        from ..store import registry

        return [p.pid for p in registry.orphans()]

    def exited_engines(self) -> list[ExitedRow]:
        from ..store import registry

        return [ExitedRow(**r) for r in registry.exited()]

    def forget_exited_engines(self, dry_run: bool = False) -> list[str]:
        from ..store import registry

        return registry.forget_exited(dry_run)

    def empty_engine_cgroups(self) -> list[str]:
        from ..host import cgroups

        return [str(p) for p in cgroups.empty_leaves()]

    def register(self, entry: Entry) -> None:
        from ..store import registry

        registry.register(entry)

    def unregister(self, pid: int) -> None:
        from ..store import registry

        registry.unregister(pid)

    def stop_engine(self, entry: Entry, drain_s: float | None = None) -> StopReport:
        from ..store import reclaim, registry

        from ..host import cgroups

        report = registry.stop(entry, drain_s)
        if entry.cgroup:  # its own leaf at once: the reclaim below skips all while a CRIU run holds the lock
            cgroups.remove_leaf(entry.cgroup)
        reclaim.remove_empty_cgroups()
        return report

    def engine_owning(self, pid: int, entries: list[Entry]) -> Entry | None:
        import psutil

        try:
            chain = {p.pid for p in psutil.Process(pid).parents()}
        except psutil.Error:
            return None
        return next((e for e in entries if e.pid in chain or (e.supervisor_pid and e.supervisor_pid == pid)), None)

    def engine_cgroup(self, name: str) -> Placement:
        from ..host import cgroups

        return cgroups.create(name)

    def cgroup_of(self, pid: int) -> str:
        from ..host import cgroups

        return cgroups.where(pid)

    def merge_of(self, pid: int) -> tuple[bool, int]:
        from ..checkpoint.criu.merge import process_merge
        from ..host.procs import tree

        marks = [m for p in tree(pid) if (m := process_merge(p.pid)) is not None]
        return bool(marks) and marks[0]["merge_any"] == 1, sum(m["merging_pages"] for m in marks)

    def merge_marked(self, pid: int) -> bool:
        from ..checkpoint.criu.merge import process_marked

        return process_marked(pid)

    def forward_signals(self, handler: Callable[[int], None]) -> AbstractContextManager:
        return _forwarding(handler)

    def terminate(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def hold_signals(self) -> None:
        from ..host import interrupts

        interrupts.hold()

    def release_signals(self) -> None:
        from ..host import interrupts

        interrupts.release()


@contextmanager
def _forwarding(handler: Callable[[int], None]) -> Iterator[None]:
    old = {s: signal.signal(s, lambda signum, frame: handler(signum)) for s in FORWARDED}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class LocalClock(Clock):
    """:class:`Clock` of this process."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

