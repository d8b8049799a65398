"""Phase timing and progress reporting, shared by every long operation.

Operations call ``reporter.phase(name)`` as a context manager; the reporter measures the phase
(seconds, monotonic clock) into ``reporter.timings`` and shows it (rich spinner on a terminal,
plain lines otherwise, nothing with ``quiet``).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator


class Reporter:
    """Collects ``timings`` ({phase: seconds}); prints nothing. Base for the renderers."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    def start(self, name: str, label: str) -> None:  # noqa: D401 - hooks
        pass

    def end(self, name: str, label: str, seconds: float, ok: bool) -> None:
        pass

    def info(self, text: str) -> None:
        pass

    @contextmanager
    def phase(self, name: str, label: str | None = None) -> Iterator[None]:
        label = label or name.replace("_", " ")
        self.start(name, label)
        t0 = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            dt = time.monotonic() - t0
            self.timings[name] = round(self.timings.get(name, 0.0) + dt, 3)
            self.end(name, label, dt, ok)


class PlainReporter(Reporter):
    """One line per finished phase on stderr: ``[vllm-snapshot] label ... 1.23 s``."""

    def __init__(self, stream=None) -> None:
        super().__init__()
        self.stream = stream or sys.stderr

    def start(self, name: str, label: str) -> None:
        print(f"[vllm-snapshot] {label} ...", file=self.stream, flush=True)

    def end(self, name: str, label: str, seconds: float, ok: bool) -> None:
        print(f"[vllm-snapshot] {label}: {'done' if ok else 'FAILED'} in {seconds:.2f} s", file=self.stream, flush=True)

    def info(self, text: str) -> None:
        print(f"[vllm-snapshot] {text}", file=self.stream, flush=True)


class RichReporter(Reporter):
    """A rich status spinner per phase, and a ✓/✗ line with its duration when it ends."""

    def __init__(self) -> None:
        super().__init__()
        from rich.console import Console

        self.console = Console(stderr=True)
        self._status = None

    def start(self, name: str, label: str) -> None:
        self._status = self.console.status(f"{label} …")
        self._status.start()

    def end(self, name: str, label: str, seconds: float, ok: bool) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        mark = "[green]✓[/]" if ok else "[red]✗[/]"
        self.console.print(f"{mark} {label} [dim]{seconds:.2f} s[/]")

    def info(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/]")


class NotifyingReporter(Reporter):
    """Wraps another reporter: forwards start/end/info to ``inner`` and tells the service
    manager the current phase as ``STATUS=<label>`` (sd_notify(3), via :mod:`.notify`) when a
    phase starts, and ``STATUS=<label>: failed`` when one fails. Shares ``inner.timings``.

    ``send`` is the STATUS sender (default :func:`notify.status`); tests inject a fake.
    """

    def __init__(self, inner: Reporter, send=None) -> None:
        super().__init__()
        from ..host import notify

        self.inner = inner
        self.timings = inner.timings
        self._send = send or notify.status

    def start(self, name: str, label: str) -> None:
        self._send(label)
        self.inner.start(name, label)

    def end(self, name: str, label: str, seconds: float, ok: bool) -> None:
        if not ok:
            self._send(f"{label}: failed")
        self.inner.end(name, label, seconds, ok)

    def info(self, text: str) -> None:
        self.inner.info(text)


def make_reporter(quiet: bool = False) -> Reporter:
    """Silent with ``quiet``; rich on a terminal; plain lines otherwise."""
    if quiet:
        return Reporter()
    if sys.stderr.isatty():
        return RichReporter()
    return PlainReporter()
