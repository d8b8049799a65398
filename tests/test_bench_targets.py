"""scripts/bench.py's target table (vllm_snapshot/dev/bench_targets.py): the pure parts, on
made-up results.

Nothing here is timed: the figures are the script's own (docs/benchmarks.md)."""

from __future__ import annotations

from vllm_snapshot.dev import bench_targets as bench

PHASES = {"validate": 0.03, "stage": 0.01, "criu_restore": 0.8, "oracle": 0.02, "checksums": 0.0,
          "code_check": 0.01, "bind": 0.0, "http_ready": 0.01, "canary": 0.01}


def result(restore_s: float, cold: dict[str, float], phases=PHASES, switch=None) -> dict:
    best = min(cold.values())
    run = {"restore_median_s": restore_s, "speedup_vs_cold": round(best / restore_s, 2),
           "restores": [{"phases": dict(phases)}], "overhead_vs_bare_criu_s": 0.2, "bare_criu_restore_s": 0.8}
    res = {"runs": {"none": run}, "cold_starts_s": cold, "cold_start_s": best}
    if switch:
        res["switch"] = switch
    return res


def rows(res, big=False) -> dict:
    return {r[0]: r for r in bench.targets(res, big)}


def test_the_ratio_is_against_the_faster_cold_start():
    r = rows(result(0.45, {"compiled": 30.0, "eager": 24.0}))
    assert "eager" in r[1][2] and "53.3×" in r[1][2]
    assert r[1][4] is True
    # 0.45 s but only 40× the faster start: not met
    assert rows(result(0.45, {"compiled": 30.0, "eager": 18.0}))[1][4] is False
    # 50× but slower than 0.5 s: not met
    assert rows(result(0.6, {"compiled": 31.0}))[1][4] is False


def test_big_model_row_and_overhead():
    r = rows(result(2.0, {"compiled": 45.0, "eager": 40.0}), big=True)
    assert 1 not in r and r[2][4] is True  # 20×
    assert rows(result(3.0, {"eager": 40.0}), big=True)[2][4] is False
    assert r[3][4] is True


def test_switch_row_needs_no_failed_request_and_a_short_dark_time():
    ok = {"dark_max_s": 0.3, "failed": 0, "accepted": 40, "switches": 4}
    assert rows(result(0.4, {"eager": 30.0}, switch=ok))[4][4] is True
    assert rows(result(0.4, {"eager": 30.0}, switch={**ok, "failed": 1}))[4][4] is False
    assert rows(result(0.4, {"eager": 30.0}, switch={**ok, "dark_max_s": 1.2}))[4][4] is False
    assert rows(result(0.4, {"eager": 30.0}))[4][4] is None


def test_a_verdict_after_the_bind_fails_target_5():
    assert rows(result(0.4, {"eager": 30.0}))[5][4] is True
    late = {k: v for k, v in PHASES.items() if k != "checksums"} | {"checksums": 0.1}  # ends after the bind
    r = rows(result(0.4, {"eager": 30.0}, phases=late))[5]
    assert r[4] is False and "checksums" in r[2]
    missing = {k: v for k, v in PHASES.items() if k != "oracle"}
    assert rows(result(0.4, {"eager": 30.0}, phases=missing))[5][4] is False


def test_cold_variants_add_eager_only_to_compiled_args():
    assert bench.cold_variants(["--dtype", "float32"], quick=False) == {
        "compiled": ["--dtype", "float32"], "eager": ["--dtype", "float32", "--enforce-eager"]}
    assert bench.cold_variants(["--enforce-eager"], quick=False) == {"eager": ["--enforce-eager"]}
    assert bench.cold_variants(["--dtype", "float32"], quick=True) == {"compiled": ["--dtype", "float32"]}
