"""Cleanup after a failed step: run every cleanup, and report the ones that failed together
with the failure that caused them (never instead of it)."""

from __future__ import annotations

from typing import Callable

from ..errors import SnapshotError


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
