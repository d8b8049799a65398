"""``list`` at any width never wraps a snapshot's name (what an operator copies): at a narrow
width the least important columns are left out and named; piped output follows ``$COLUMNS``
(issue "Operator experience": at 100 columns names, keys and dates were split mid-word)."""

from __future__ import annotations

import pytest

from vllm_snapshot.cli import render

ROW = {"name": "trial-model-a711061d712f-with-a-long-name", "model": "/models/smollm2-135m-instruct",
       "key": "a711061d712f0000", "created": "2026-12-03T17:04:00", "kind": "cpu", "sleep_level": 0,
       "raw_bytes": 1 << 30, "stored_bytes": 1 << 30, "weights": "/w/d6b36aa7ffff", "weights_bytes": 515 << 20,
       "compatible": True, "why": None, "last_restore": 1.7e9}


def test_the_least_important_columns_go_first_and_the_name_stays():
    widths = {c: 10 for c in render.LIST_COLUMNS}
    assert render.fitting_columns(widths, 1000) == list(render._TABLE_ORDER)
    assert render.fitting_columns(widths, 13 * 3 + 1) == ["name", "model", "here"]
    assert render.fitting_columns(widths, 5) == ["name"]


@pytest.mark.parametrize("columns", [60, 100, 160])
def test_list_never_wraps_the_name_and_says_what_it_left_out(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    render.snapshot_list([ROW], "/var/lib/vllm-snapshot")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(ROW["name"] in ln for ln in lines), out
    assert all(len(ln) <= columns for ln in lines), out
    assert any("a711061d712f" in ln for ln in lines) or "key" in out.split("left out at this width")[-1]
    if columns < 160:
        assert f"left out at this width ({columns} columns): " in out


def test_piped_without_columns_shows_every_column_on_one_line_per_row(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    render.snapshot_list([ROW], "/r")
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ROW["name"] in ln)
    for cell in ("smollm2-135m-instruct", "a711061d712f", "2026-12-03 17:04", "d6b36aa7 515.0 MiB", "1.0 GiB"):
        assert cell in row, row
    assert "left out" not in out


def test_a_refused_snapshot_is_followed_by_what_to_run_next(monkeypatch, capsys):
    # a trial read "✗ dmg: ... manifest.json is not valid JSON" and did not know which command says more
    monkeypatch.setenv("COLUMNS", "200")
    render.snapshot_list([ROW, {**ROW, "name": "dmg", "compatible": False, "why": "manifest.json is not valid JSON"}],
                         "/r")
    out = capsys.readouterr().out
    assert "✗ dmg: manifest.json is not valid JSON" in out
    assert "✗: `vllm-snapshot verify NAME` runs every check" in out and "prune --unusable" in out, out
    render.snapshot_list([ROW], "/r")
    assert "prune --unusable" not in capsys.readouterr().out  # nothing refused: no pointer


LONG = "/var/cache/vllm-snapshot/criu-4.2.1/criu/criu-with-a-path-longer-than-a-narrow-terminal"


@pytest.mark.parametrize("columns", [80, 100, 140])
def test_doctor_never_cuts_a_path_or_a_remedy(columns, monkeypatch, capsys):
    # a trial at 80 columns read "CRIU 4.2.1 at /var/cache/vllm-…" and "sysctl -w kernel.io_uring…"
    from vllm_snapshot.cli.probes import Check
    from vllm_snapshot.report.results import DoctorReport

    remedy = "sysctl -w kernel.io_uring_disabled=0 (and in /etc/sysctl.d/99-vllm-snapshot-io-uring.conf)"
    checks = [Check("criu", True, "error", f"CRIU 4.2.1 at {LONG}"),
              Check("io_uring", False, "warning", "io_uring is disabled for this host's processes", remedy)]
    monkeypatch.setenv("COLUMNS", str(columns))
    render.show(DoctorReport(checks, 0))
    out = capsys.readouterr().out
    assert "…" not in out
    joined = "".join(ln.strip(" │") for ln in out.splitlines())  # what a fold split, joined again
    assert LONG in joined.replace(" ", "") or LONG in out.replace("\n", ""), out
    assert remedy.replace(" ", "") in joined.replace(" ", ""), out
    assert all(len(ln) <= columns for ln in out.splitlines()), out
