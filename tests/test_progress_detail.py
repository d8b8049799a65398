"""The long engine start on a terminal shows the elapsed time, the engine log's latest line and
a pointer to ``-v`` (issue "Operator experience": 55-70 s behind a bare spinner); a log or the
journal (not a terminal) gets the phase lines only, as before."""

from __future__ import annotations

import io

from vllm_snapshot.report.progress import LastLine, PlainReporter, RichReporter


def test_last_line_hands_on_the_latest_complete_line_without_escapes():
    got: list[str] = []
    sink = LastLine(got.append, width=12)
    sink(b"INFO one\n\x1b[32mINFO two\x1b[0m\npart")
    sink(b"ial line is long\n\n   \n")
    sink(b"no newline yet")
    assert got == ["INFO two", "partial line"]


def test_a_terminal_shows_elapsed_time_the_latest_log_line_and_the_v_pointer():
    from rich.console import Console

    rep = RichReporter()
    out = io.StringIO()
    rep.console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with rep.phase("engine_start", "starting engine"):
        rep.detail("(Worker pid=30) INFO loading weights")
        rep._live.refresh()
        shown = out.getvalue()
    assert "starting engine …" in shown and "0:00:0" in shown  # rich's elapsed-time column
    assert "(Worker pid=30) INFO loading weights" in shown and "-v streams the engine log" in shown
    assert "✓ starting engine" in out.getvalue()


def test_a_log_gets_the_phase_lines_only():
    out = io.StringIO()
    rep = PlainReporter(out)
    with rep.phase("engine_start", "starting engine"):
        rep.detail("(Worker pid=30) INFO loading weights")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[vllm-snapshot] starting engine ..." and lines[1].startswith("[vllm-snapshot] starting engine: done in ")
    assert len(lines) == 2
