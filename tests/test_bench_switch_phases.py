"""scripts/bench_switch_phases.py's reading of a switch's phase lines (the pure part; the
switches themselves are the benchmark's, docs/benchmarks.md "Switch: where the time goes")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("bench_switch_phases", ROOT / "scripts" / "bench_switch_phases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_phase_lines_of_a_hand_over_are_read_with_the_spans_between():
    m = _script()
    p = "[vllm-snapshot] "
    stamped = [
        (0.30, p + "validating b before touching port 8731 ..."),
        (0.35, p + "validating b before touching port 8731: done in 0.05 s"),
        (0.36, p + "validating snapshot, host and model ..."),
        (0.39, p + "validating snapshot, host and model: done in 0.03 s"),
        (1.40, p + "CRIU restore ..."),  # 1.01 s between: the CRIU lock
        (2.00, p + "CRIU restore: done in 0.60 s"),
        (2.00, p + "checking the Python files the engine imports from ..."),
        (2.01, p + "checking the Python files the engine imports from: done in 0.01 s"),
        (2.02, p + "the new engine accepts on port 8731; the old one (PID 7) accepts no more and drains ..."),
        (2.10, p + "the new engine accepts on port 8731; the old one (PID 7) accepts no more and drains: done in 0.08 s"),
        (2.12, p + "canary request over HTTP: done in 0.02 s"),
    ]
    got = m.phases_of(stamped, 2.40)
    assert got["validate_target"] == 0.05 and got["restore_validate"] == 0.03 and got["criu_restore"] == 0.60
    assert got["code_check"] == 0.01 and got["hand_over"] == 0.08 and got["canary"] == 0.02
    assert got["before:criu_restore"] == pytest.approx(1.01)
    assert got["startup"] == 0.30 and got["tail"] == pytest.approx(0.28)
    assert "before:code_check" not in got  # a span of 0.05 s or less is none


def test_the_old_ways_own_image_check_is_its_own_phase():
    m = _script()
    line = "[vllm-snapshot] checking b's image checksums before stopping the engine on port 8731: done in 0.71 s"
    got = m.phases_of([(0.3, "[vllm-snapshot] checking b's image checksums before stopping ... ..."), (1.0, line)], 1.1)
    assert got["check_images"] == 0.71


def test_an_output_without_phases_is_refused():
    with pytest.raises(ValueError):
        _script().phases_of([(0.1, "error: no such snapshot")], 0.2)
