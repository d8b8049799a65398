"""The pure half of scripts/bench.py: the speed targets and the earlier figures, the rows of
its tables and the cold starts it compares with (docs/benchmarks.md). Nothing here measures;
tests/test_bench_targets.py feeds it made-up results."""

from __future__ import annotations

#: The speed targets (docs/benchmarks.md), checked per model by :func:`targets` (printed, never asserted).
DEMO_TARGET_S = 0.5
DEMO_SPEEDUP_TARGET = 50.0
BIG_SPEEDUP_TARGET = 15.0
OVERHEAD_TARGET_S = 0.3
SWITCH_DARK_TARGET_S = 1.0
#: The phases of a restore that decide identity + model (validate), the oracle, the images'
#: checksums and the code identity: each must end before ``bind`` begins (target 5).
VERDICT_PHASES = ("validate", "oracle", "checksums", "code_check")
#: Earlier targets (image bytes, zstd, CLI start-up), kept in the table as "figures".
RAW_REDUCTION_TARGET = 0.30
STORED_TARGET = 0.15
ZSTD_SLOWDOWN_TARGET = 1.5
CLI_TARGET_S = 0.3
#: Raw image bytes of the demo snapshot before the image-size work (commit aced35d, 2026-11-30,
#: `create` of the tiny model with the demo's engine args): the reference of the raw-bytes figure.
DEMO_BASELINE_RAW = 1415497047


def cold_variants(engine_args: list[str], quick: bool) -> dict[str, list[str]]:
    """The cold starts a user could choose instead of a restore, by name -> engine args: the
    same args (``compiled`` unless they hold ``--enforce-eager``) and, when they compile, the
    same with ``--enforce-eager`` added (``eager``). ``quick``: only the given args."""
    eager = "--enforce-eager" in engine_args
    out = {("eager" if eager else "compiled"): list(engine_args)}
    if not (eager or quick):
        out["eager"] = [*engine_args, "--enforce-eager"]
    return out


def verdicts_before_bind(phases: dict[str, float]) -> tuple[bool, str]:
    """Whether every :data:`VERDICT_PHASES` entry of one restore's ``phases`` (the report's
    timings, in the order the phases ended) comes before ``bind``; and a text naming what is
    missing or late, and the phases after the bind."""
    names = list(phases)
    if "bind" not in names:
        return False, "no bind phase"
    at = names.index("bind")
    late = [p for p in VERDICT_PHASES if p not in names[:at]]
    after = ", ".join(names[at + 1:]) or "nothing"
    if late:
        return False, f"not decided before the bind: {', '.join(late)} (after it: {after})"
    return True, f"{', '.join(VERDICT_PHASES)} before the bind; after it: {after}"


def targets(res: dict, big: bool) -> list[tuple]:
    """Rows (number, what, value text, target text, met: bool | None) of the speed targets for
    one model's result (``res`` of :func:`bench_model`, with ``switch`` when it was measured);
    None = not measured in this run."""
    runs = res["runs"]
    plain = runs.get("none") or next(iter(runs.values()))
    cold = res["cold_starts_s"]
    best = min(cold, key=cold.get)
    vs = f"{plain['restore_median_s']:.2f} s vs cold {res['cold_start_s']:.2f} s ({best}; " + ", ".join(
        f"{k} {v:.2f} s" for k, v in cold.items()) + ")"
    rows = []
    if big:
        rows.append((2, "big model: restore -> first validated completion vs the faster cold start",
                     f"{plain['speedup_vs_cold']:.1f}× ({vs})", f"≥ {BIG_SPEEDUP_TARGET:.0f}×",
                     plain["speedup_vs_cold"] >= BIG_SPEEDUP_TARGET))
    else:
        rows.append((1, "restore -> first validated completion vs the faster cold start",
                     f"{plain['speedup_vs_cold']:.1f}× ({vs})",
                     f"≤ {DEMO_TARGET_S} s (≥ {DEMO_SPEEDUP_TARGET:.0f}×)",
                     plain["restore_median_s"] <= DEMO_TARGET_S and plain["speedup_vs_cold"] >= DEMO_SPEEDUP_TARGET))
    ov = plain.get("overhead_vs_bare_criu_s")
    rows.append((3, "overhead beyond a bare `criu restore`",
                 "–" if ov is None else f"{ov:.2f} s (bare {plain['bare_criu_restore_s']:.2f} s)",
                 f"≤ {OVERHEAD_TARGET_S} s", None if ov is None else ov <= OVERHEAD_TARGET_S))
    sw = res.get("switch")
    if sw:
        rows.append((4, "`switch` on one port: longest time nothing answers (client polling every 50 ms); accepted requests failed",
                     f"{sw['dark_max_s']:.2f} s; {sw['failed']} of {sw['accepted']} failed ({sw['switches']} switches, "
                     f"{sw.get('handovers', '?')} handed over)",
                     f"≤ {SWITCH_DARK_TARGET_S} s; 0", sw["dark_max_s"] <= SWITCH_DARK_TARGET_S and sw["failed"] == 0))
    else:
        rows.append((4, "`switch` on one port", "not measured in this run (needs two snapshots: a full run)", "", None))
    checks = [verdicts_before_bind(x["phases"]) for r in runs.values() for x in r["restores"]]
    bad = [why for ok, why in checks if not ok]
    rows.append((5, "fail-closed verdicts before the bind, every restore of this run",
                 bad[0] if bad else checks[0][1], "all before the bind", not bad))
    return rows


def figures(res: dict, help_s: float, inspect_s: float, baseline_raw: int | None,
            inspect_json_s: float | None = None) -> list[tuple]:
    """Rows (label, what, value text, target text, met) of earlier figures (the
    earlier targets: image bytes, zstd, CLI start-up, memory), kept to see them move."""
    runs = res["runs"]
    plain = runs.get("none")
    z = next((r for c, r in runs.items() if c.startswith("zstd")), None)
    rows = []
    if plain and baseline_raw:
        red = 1 - plain["raw_bytes"] / baseline_raw
        rows.append(("bytes", "raw image bytes vs before 2026-11-30",
                     f"{plain['raw_bytes'] / 2**20:.0f} MiB vs {baseline_raw / 2**20:.0f} MiB: -{100 * red:.1f}%",
                     f"≥ {100 * RAW_REDUCTION_TARGET:.0f}% less", red >= RAW_REDUCTION_TARGET))
    elif plain:
        rows.append(("bytes", "raw image bytes", f"{plain['raw_bytes'] / 2**20:.0f} MiB (no baseline)", "–", None))
    if z:
        rows.append(("zstd", "zstd: stored / raw", f"{100 * z['stored_ratio']:.1f}%", f"≤ {100 * STORED_TARGET:.0f}%",
                     z["stored_ratio"] <= STORED_TARGET))
        if plain:
            slow = z["restore_median_s"] / plain["restore_median_s"]
            rows.append(("zstd", "zstd restore / uncompressed restore", f"{slow:.2f}×", f"≤ {ZSTD_SLOWDOWN_TARGET}×",
                         slow <= ZSTD_SLOWDOWN_TARGET))
    ij = inspect_s if inspect_json_s is None else inspect_json_s
    rows.append(("cli", "`inspect` (`--json`) / `--help` (whole process, median of 5)",
                 f"{inspect_s:.2f} s ({ij:.2f} s) / {help_s:.2f} s",
                 f"≤ {CLI_TARGET_S} s", max(inspect_s, ij, help_s) <= CLI_TARGET_S))
    rm = (plain or z or {}).get("restored_memory")
    cm = res.get("cold_memory")
    if rm and cm:
        rows.append(("memory", "restored engine RSS vs cold engine RSS (PSS)",
                     f"{rm['rss'] / 2**20:.0f} vs {cm['rss'] / 2**20:.0f} MiB ({rm['pss'] / 2**20:.0f} vs {cm['pss'] / 2**20:.0f})",
                     "≤ cold", rm["rss"] <= cm["rss"]))
    return rows


def targets_md(rows: list[tuple]) -> list[str]:
    out = ["| # | target | measured | target | met? |", "|---|---|---|---|---|"]
    for n, what, val, want, met in rows:
        out.append(f"| {n} | {what} | {val} | {want} | {'–' if met is None else ('yes' if met else 'no')} |")
    return out
