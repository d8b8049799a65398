"""Cleanup after a failed step: run every cleanup, and report the ones that failed together
with the failure that caused them (never instead of it)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import SnapshotError
from ..report.progress import Reporter


def run_cleanups(cause: BaseException, steps: list[tuple[str, Callable[[], object]]]) -> list[str]:
    """Run each ``(what, fn)``; collect ``"what: error"`` for those that raise. When any
    failed, the text is appended to ``cause`` (its message for a SnapshotError, a note
    otherwise) so the operator learns both. Returns the failures."""
    failures = []
    for what, fn in steps:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every cleanup runs; failures are reported
            failures.append(f"{what}: {type(e).__name__}: {e}")
    if failures:
        text = "cleanup after this failure also failed:\n  " + "\n  ".join(failures)
        if isinstance(cause, SnapshotError):
            cause.message = f"{cause.message}\n{text}"
            cause.args = (cause.message,)
        else:
            cause.add_note(text)
    return failures


def report_reclaimed(rep: Reporter, gone: list[str]) -> None:
    """Say what ``reclaim`` removed: each leftover of a killed command on a line of its own;
    engine cgroups left empty (by an engine that exited, was stopped outside vllm-snapshot or
    killed: not necessarily a killed command) in one line. Lock files of snapshot paths that no
    longer exist are removed silently: bookkeeping of the whole host (a deleted or renamed
    snapshot, a test's temp dir leaves one), not news about this command (a trial saw "removed 5
    lock file(s) ..." before every create and restore); ``prune`` lists them."""
    cgroups = [g.removeprefix("empty cgroup ") for g in gone if g.startswith("empty cgroup ")]
    for g in gone:
        if not g.endswith(".lock") and not g.startswith("empty cgroup "):
            rep.info(f"removed a leftover of a killed command: {g}")
    if cgroups:  # one leaf per hierarchy (v1 controllers, v2): named once, by the engine's leaf name
        names = sorted({Path(c).name for c in cgroups})
        rep.info(f"removed the empty cgroups of {len(names)} engine(s) that exited: {', '.join(names)} "
                 f"(under /vllm-snapshot in {len(cgroups)} hierarchy path(s))")

