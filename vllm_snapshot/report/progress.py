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

    def detail(self, text: str) -> None:
        """The latest line of what the current phase is doing (the engine's log while it
        starts): shown under a terminal's spinner, nowhere else (a log or the journal gets the
        phase lines only; ``-v`` streams the whole engine log)."""

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
    """Per phase a rich spinner with the elapsed time, and under it the phase's latest
    :meth:`detail` line (the engine's log while it starts, with a pointer to ``-v``); a ✓/✗ line
    with its duration when it ends."""

    #: what the detail line says besides the latest log line
    DETAIL_HINT = "(-v streams the engine log)"

    def __init__(self) -> None:
        super().__init__()
        from rich.console import Console

        self.console = Console(stderr=True)
        self._live = None
        self._detail = None
        self._task = None

    def start(self, name: str, label: str) -> None:
        from rich.console import Group
        from rich.live import Live
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            TextColumn("[dim]{task.fields[hint]}"), console=self.console)
        self._task = (progress, progress.add_task(f"{label} …", total=None, hint=""))
        self._detail = Text("", style="dim", no_wrap=True, overflow="ellipsis")
        self._live = Live(Group(progress, self._detail), console=self.console, transient=True, refresh_per_second=4)
        self._live.start()

    def detail(self, text: str) -> None:
        if self._detail is not None:
            self._detail.plain = f"  {text}"
            progress, task = self._task
            progress.update(task, hint=self.DETAIL_HINT)

    def end(self, name: str, label: str, seconds: float, ok: bool) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = self._detail = None
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

    def detail(self, text: str) -> None:
        self.inner.detail(text)


class LastLine:
    """A log sink (``(bytes) -> None``, what the engine's log is streamed to) that hands the
    last complete non-empty line, without terminal escapes, to ``show`` (at most ``width``
    characters): the reporter's :meth:`Reporter.detail`."""

    def __init__(self, show, width: int = 200) -> None:
        self.show = show
        self.width = width
        self._rest = b""

    def __call__(self, chunk: bytes) -> None:
        import re

        lines = (self._rest + chunk).split(b"\n")
        self._rest = lines.pop()[-4096:]
        for raw in reversed(lines):
            text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]", "", raw.decode("utf-8", "replace")).strip()
            if text:
                self.show(text[:self.width])
                return


def make_reporter(quiet: bool = False) -> Reporter:
    """Silent with ``quiet``; rich on a terminal; plain lines otherwise."""
    if quiet:
        return Reporter()
    if sys.stderr.isatty():
        return RichReporter()
    return PlainReporter()
