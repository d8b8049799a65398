#!/usr/bin/env python3
"""Benchmark: cold start vs restore, measured in one run, with phase breakdowns.

Run with the project's venv as root:

    /var/cache/vllm-snapshot/venv/bin/python scripts/bench.py [--model DIR] [--restores 3]
        [--compress zstd:3 --compress none] [--quick] [--json-out F] [--md docs/history.md]
        [--plot docs/bench.png] [-- ENGINE ARGS]

Measures, on one model (default: the embedded tiny model with the demo's engine args): for each
compression setting a create (with its phases) and N restores -> first validated completion
(phases: validate, stage, CRIU restore, oracle, checksums, bind, canary); then the cold starts
-> first completion (``python -m vllm.entrypoints.openai.api_server``) a user could choose
instead, each measured after the creates so the compile cache is warm: the same engine args
(compiled) and with ``--enforce-eager`` added; the headline ratio is against the faster of the
two. Also raw vs stored bytes, a bare ``criu restore`` of the same staged images (the overhead
figure), and the timings of ``vllm-snapshot --help`` and ``inspect``. Prints ratios and the speed
targets 1-5 (value, target, met?) per model; never asserts them.
``--quick`` (CI smoke test): one compression, one restore, one cold start (the given args), no
bare CRIU run, no switch, no plot. ``--cold-start-s S``: no cold start is run, the ratios are
against ``S`` seconds measured elsewhere (the test suite gives its snapshot's engine start). A full run also switches one port between its two snapshots
(hand-over, a client polling every 50 ms: target 4).
``--big-model DIR``: the same for a second model in the same run (target 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from vllm_snapshot.store import archive, manifest  # noqa: E402
from vllm_snapshot.checkpoint import criu  # noqa: E402
from vllm_snapshot import ops  # noqa: E402
from vllm_snapshot.dev import bench, tiny_model  # noqa: E402
from vllm_snapshot.dev.bench_targets import DEMO_BASELINE_RAW, cold_variants, figures, targets, targets_md  # noqa: E402
from vllm_snapshot.effects.tools import local_tools  # noqa: E402
from vllm_snapshot.report.progress import Reporter  # noqa: E402


REPO = Path(__file__).resolve().parent.parent

#: ``vllm-snapshot ARGS`` as the console script pip writes runs it (``from vllm_snapshot.cli.app
#: import main; sys.exit(main())``), here on this checkout's code
CONSOLE_SCRIPT = "import sys; from vllm_snapshot.cli.app import main; sys.argv[0] = 'vllm-snapshot'; sys.exit(main())"


def cli_env() -> dict[str, str]:
    """The environment of a user's ``vllm-snapshot``: this checkout first on the path, and
    bytecode caching on (an installed package has its .pyc files; with PYTHONDONTWRITEBYTECODE
    inherited, every run would compile the package's sources again)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def timed_cmd(argv: list[str], n: int = 5, env: dict[str, str] | None = None) -> float:
    """Median wall seconds of running ``argv`` ``n`` times (output discarded), each the whole
    process; one untimed run first (writes missing .pyc files, warms the page cache)."""
    ts = []
    for i in range(n + 1):
        t0 = time.monotonic()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env)
        if i:
            ts.append(time.monotonic() - t0)
    return sorted(ts)[len(ts) // 2]


def bare_criu_restore(snap: Path) -> float:
    """Seconds of a plain ``criu restore`` of the snapshot's images, with only the flags CRIU
    needs; the restored tree is killed afterwards. The images are staged as restore stages them
    (hard links, or unpacked when compressed) and verified first, not timed."""
    m = manifest.read(snap)
    stage, staged = local_tools().files.stage_checking(snap, m)
    try:
        staged.wait()
    except BaseException:
        archive.remove_staging(stage)
        raise
    b = criu.find_criu()
    # the same fresh pipes the real restore hands in (an engine whose control pipe is gone
    # exits at once, which fails CRIU's final detach)
    ctl_r, ctl_w = os.pipe()
    ev_r, ev_w = os.pipe()
    log_r, log_w = os.pipe()
    keep = (ctl_r, ev_w, log_w)
    inherit = []
    for fd, role in ((ctl_r, "control"), (log_w, "log"), (ev_w, "events")):
        os.set_inheritable(fd, True)
        inherit += ["--inherit-fd", f"fd[{fd}]:{m.criu.inherit[role]}"]
    try:
        pidfile = stage / "bare.pid"
        argv = [b, "restore", "-D", str(stage), "-o", "bare-restore.log", "--restore-detached",
                "--pidfile", str(pidfile), "--root", "/", *[f"--{f}" for f in criu.SHARED_FLAGS], *inherit]
        t0 = time.monotonic()
        r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=keep, timeout=120)
        dt = time.monotonic() - t0
        for fd in keep:
            os.close(fd)
        if r.returncode != 0:
            raise RuntimeError(f"bare criu restore failed: {criu.log_excerpt(stage / 'bare-restore.log')}")
        pid = int(pidfile.read_text())
        os.kill(pid, 9)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        return dt
    finally:
        for fd in (ctl_w, ev_r, log_r):
            os.close(fd)
        archive.remove_staging(stage)


PHASES = ["validate", "stage", "unpack", "unpack_wait", "criu_restore", "wake", "oracle", "checksums", "bind", "http_ready", "canary"]


def plot(res: dict, path: Path) -> None:
    """Horizontal stacked bars (linear seconds): the cold start, and per compression the
    phases of the median restore. Needs matplotlib (the ``dev`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    colors = dict(zip(["cold start", *PHASES], plt.get_cmap("tab20").colors))
    rows = [("cold start", {"cold start": res["cold_start_s"]})]
    for comp, run in res["runs"].items():
        med = sorted(run["restores"], key=lambda x: x["to_validated_completion_s"])[len(run["restores"]) // 2]
        rows.append((f"restore ({comp})\n{med['to_validated_completion_s']:.2f} s", med["phases"]))
    fig, (ax, zoom) = plt.subplots(2, 1, figsize=(9, 5.5), gridspec_kw={"height_ratios": [1, 1.3]})
    for axis, subset in ((ax, rows), (zoom, rows[1:])):
        seen = set()
        for y, (label, ph) in enumerate(subset):
            left = 0.0
            for name in ["cold start", *PHASES]:
                v = ph.get(name, 0.0)
                if v:
                    axis.barh(y, v, left=left, color=colors[name], label=None if name in seen else name)
                    seen.add(name)
                    left += v
        axis.set_yticks(range(len(subset)), [r[0] for r in subset])
        axis.set_xlabel("seconds")
    ax.set_title(f"cold start -> first completion vs restore -> first validated completion ({res['when']})")
    zoom.set_title("restore phases (median restore)")
    zoom.legend(loc="lower right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cold_starts(model: Path, engine_args: list[str], quick: bool) -> tuple[dict[str, float], dict]:
    """Seconds from launch to the first completion for each of :func:`cold_variants` (one run
    each), and the process-tree memory (``rss``/``pss`` bytes) of the given args' cold tree."""
    out: dict[str, float] = {}
    mem: dict = {}
    for name, args in cold_variants(engine_args, quick).items():
        print(f"{model}: cold start ({name}) -> first completion ...", file=sys.stderr)
        m: dict = {}
        out[name] = round(bench.cold_start(model, bench.free_port(), args, m), 3)
        if args == engine_args:
            mem = m
        print(f"  {out[name]:.2f} s, RSS {m.get('rss', 0) >> 20} MiB", file=sys.stderr)
    return out, mem


def switch_probe(snaps: list[Path], work: Path, rounds: int, poll_ms: float = 50.0) -> dict:
    """Target 4: ``rounds`` × 2 hand-over switches (``vllm-snapshot switch``) between two
    snapshots on one port while a client polls it every ``poll_ms`` ms with a one-token
    completion (the poller of :mod:`vllm_snapshot.dev.bench`). With one snapshot, a hard-linked copy is
    the second. Returns ``dark_max_s`` (longest time a client saw nothing answer), ``refused``,
    ``failed`` (accepted connections that then failed), ``accepted``, ``switches``,
    ``handovers`` (switches that handed the port over rather than falling back). Raises
    SystemExit when a switch fails."""
    a = snaps[0]
    b = snaps[1] if len(snaps) > 1 else work / f"{a.name}-copy"
    if b == work / f"{a.name}-copy" and not b.exists():
        shutil.copytree(a, b, copy_function=os.link)
    port = bench.free_port()
    bench.cli("restore", str(a), "--port", str(port), "--detach", "-q")
    rows, cur, handovers = [], a, 0
    try:
        for _ in range(rounds * 2):
            nxt = b if cur == a else a
            time.sleep(1.0)  # the previous old engine's drain is over
            poller = bench.Poller(port, poll_ms / 1000, tiny_model.SERVED_NAME)
            time.sleep(0.5)
            r = bench.cli("switch", str(nxt), "--port", str(port), "-q")
            time.sleep(0.5)
            rows.append(poller.stop())
            handovers += bool(r.get("handover"))
            print(f"  switch -> {nxt.name}: {r['switch_s']:.2f} s, handover {r.get('handover')}, "
                  f"dark {rows[-1]['dark']:.3f} s, refused {rows[-1]['refused']}, failed {rows[-1]['failed']}",
                  file=sys.stderr)
            cur = nxt
    finally:
        subprocess.run([*bench.VS, "stop", "--port", str(port)], capture_output=True, timeout=120)
    return {"dark_max_s": round(max(x["dark"] for x in rows), 3), "refused": sum(x["refused"] for x in rows),
            "failed": sum(x["failed"] for x in rows), "accepted": sum(x["polls"] - x["refused"] for x in rows),
            "switches": len(rows), "handovers": handovers}


def bench_model(model: Path, engine_args: list[str], comps: list[str], restores: int, quick: bool,
                work: Path, snapshot: Path | None, cold_given: float | None = None) -> tuple[dict, Path]:
    """Cold start (and its memory), then per compression a create and ``restores`` restores
    (and the first restored tree's memory), and a bare CRIU restore. ``cold_given``: a cold
    start measured elsewhere (seconds), used instead of running one (``cold_starts_s`` is then
    ``{"given": ...}``, no cold memory). Returns (result, the last snapshot)."""
    res: dict = {"model": str(model), "engine_args": engine_args, "runs": {}}
    snap = None
    for comp in comps:
        if snapshot and quick:
            snap = snapshot.absolute()
            m = manifest.read(snap)
            comp = ",".join(sorted({i.compression for i in m.images}))
            run = {"create_s": round(sum(m.timings.values()), 3), "create_phases": m.timings,
                   "raw_bytes": m.sizes["raw"], "stored_bytes": m.sizes["stored"], "restores": [],
                   "reused_snapshot": str(snap)}
        else:
            snap = work / f"snap-{Path(model).name}-{comp.replace(':', '-')}"
            rep = Reporter()
            t0 = time.monotonic()
            m = ops.create(ops.CreateRequest(model=str(model), target=snap, engine_args=engine_args,
                                             compression=archive.Compression.parse(comp)), rep).manifest
            run = {"create_s": round(time.monotonic() - t0, 3), "create_phases": m.timings,
                   "raw_bytes": m.sizes["raw"], "stored_bytes": m.sizes["stored"], "restores": []}
        print(f"{comp}: create {run['create_s']:.2f} s, raw {m.sizes['raw']} B, stored {m.sizes['stored']} B",
              file=sys.stderr)
        for i in range(restores):
            rep = Reporter()
            t0 = time.monotonic()
            r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=bench.free_port()), rep)
            total = time.monotonic() - t0
            if i == 0:
                run["restored_memory"] = bench.tree_memory(r.pid)
            engine.kill(grace=15)
            engine.close()
            local_tools().runtime.unregister(r.pid)
            run["restores"].append({"to_validated_completion_s": round(total, 3), "phases": r.timings})
            print(f"  restore {i + 1}: {total:.2f} s {r.timings}", file=sys.stderr)
            time.sleep(1)
        if not quick:  # median of as many bare runs as restores (one run swung 0.73-1.08 s)
            bare = [bare_criu_restore(snap) for _ in range(restores)]
            run["bare_criu_restores_s"] = [round(b, 3) for b in bare]
            run["bare_criu_restore_s"] = round(sorted(bare)[len(bare) // 2], 3)
        res["runs"][comp] = run
    if not quick:
        res["switch"] = switch_probe([work / f"snap-{Path(model).name}-{c.replace(':', '-')}" for c in comps],
                                     work, rounds=2)
    # after the creates: the compile cache holds what a compiled start of these args needs
    if cold_given is None:
        res["cold_starts_s"], res["cold_memory"] = cold_starts(Path(model), engine_args, quick)
    else:
        res["cold_starts_s"], res["cold_memory"] = {"given": round(cold_given, 3)}, {}
    res["cold_start_s"] = min(res["cold_starts_s"].values())
    for comp, run in res["runs"].items():
        med = sorted(x["to_validated_completion_s"] for x in run["restores"])[len(run["restores"]) // 2]
        run["restore_median_s"] = med
        run["speedup_vs_cold"] = round(res["cold_start_s"] / med, 2)
        run["stored_ratio"] = round(run["stored_bytes"] / max(1, run["raw_bytes"]), 4)
        if "bare_criu_restore_s" in run:
            crit = sorted(x["phases"].get("criu_restore", 0) for x in run["restores"])[len(run["restores"]) // 2]
            run["overhead_vs_bare_criu_s"] = round(med - run["bare_criu_restore_s"], 3)
            run["criu_phase_vs_bare_s"] = round(crit - run["bare_criu_restore_s"], 3)
    return res, snap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--big-model", type=Path, default=None,
                    help="a second, big model measured in the same run (target 7), e.g. from "
                         "`python -m vllm_snapshot.dev.tiny_model --out DIR --hidden 2048 --layers 16 --intermediate 7168`")
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--compress", action="append", default=None)
    ap.add_argument("--big-compress", action="append", default=None,
                    help="compressions for --big-model (default: those of --compress); random weights do not "
                         "compress, so `--big-compress none` saves its long zstd create")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--load", default="", help="what else ran on the machine (written into --md)")
    ap.add_argument("--snapshot", type=Path, default=None,
                    help="with --quick: restore this existing snapshot instead of creating one")
    ap.add_argument("--cold-start-s", type=float, default=None,
                    help="a cold start measured elsewhere, in seconds (e.g. a create's engine_start): no cold "
                         "start is run and the speed-up is against this one (the test suite's smoke run)")
    ap.add_argument("engine_args", nargs="*")
    ap.add_argument("--replot", type=Path, default=None, help="only draw --plot from a saved --json-out file")
    a = ap.parse_args()
    if a.replot:
        plot(json.loads(a.replot.read_text()), a.plot or Path("bench.png"))
        return 0
    local_tools().host.require_root()
    model = a.model or tiny_model.generate(tiny_model.default_model_dir())
    engine_args = a.engine_args or list(tiny_model.ENGINE_ARGS)
    comps = a.compress or (["zstd:3"] if a.quick else ["zstd:3", "none"])
    restores = 1 if a.quick else a.restores
    work = Path(tempfile.mkdtemp(prefix="vllm-snapshot-bench-", dir=a.workdir or "/var/tmp"))
    os.chmod(work, 0o700)
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        res, snap = bench_model(Path(model), engine_args, comps, restores, a.quick, work, a.snapshot, a.cold_start_s)
        res.update({"host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
                    "when": when, "quick": a.quick, "load": a.load})
        cli, env = [sys.executable, "-c", CONSOLE_SCRIPT], cli_env()
        res["help_s"] = round(timed_cmd(cli + ["--help"], env=env), 3)
        res["inspect_s"] = round(timed_cmd(cli + ["inspect", str(snap)], env=env), 3)
        res["inspect_json_s"] = round(timed_cmd(cli + ["inspect", str(snap), "--json"], env=env), 3)
        is_demo = a.model is None and not a.engine_args
        res["targets"] = targets(res, False)
        res["figures"] = figures(res, res["help_s"], res["inspect_s"], DEMO_BASELINE_RAW if is_demo else None,
                                 res["inspect_json_s"])
        if a.json_out:  # the first model's results survive a failure of the second
            a.json_out.write_text(json.dumps(res, indent=2))
        if a.big_model:
            try:
                big, _ = bench_model(a.big_model, engine_args, a.big_compress or comps, restores, a.quick, work, None)
                big["targets"] = targets(big, True)
                big["figures"] = figures(big, res["help_s"], res["inspect_s"], None, res["inspect_json_s"])
                res["big"] = big
            except Exception as e:  # noqa: BLE001 - report the first model anyway
                res["big_error"] = f"{type(e).__name__}: {e}"
                print(f"big model failed: {res['big_error']}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(res, indent=2)
    print(text)
    for r in [res, res.get("big")]:
        if r:
            print(f"\ntargets, {r['model']}:", file=sys.stderr)
            print("\n".join(targets_md(r["targets"])), file=sys.stderr)
            print("\n".join(targets_md(r["figures"])), file=sys.stderr)
    if a.json_out:
        a.json_out.write_text(text)
    if a.md:
        lines = [f"\n### Run {res['when']} ({'quick' if a.quick else 'full'}; {res['host']['cpus']} CPUs, kernel {res['host']['kernel']})\n",
                 f"Load: {a.load or 'not recorded'}. `--help` {res['help_s']:.2f} s, `inspect` {res['inspect_s']:.2f} s, "
                 f"`inspect --json` {res['inspect_json_s']:.2f} s (whole processes as the console script runs them, medians of 5).\n"]
        for r in [res, res.get("big")]:
            if not r:
                continue
            lines += [f"Model `{r['model']}`, engine args `{' '.join(r['engine_args'])}`. "
                      "Cold start -> first completion: " + ", ".join(f"{k} **{v:.2f} s**" for k, v in r["cold_starts_s"].items())
                      + " (the faster one is the ratios' baseline).\n",
                      *targets_md(r["targets"]), "", *targets_md(r["figures"]), "",
                      "| compression | create s | raw MiB | stored MiB | stored % | restore -> validated completion s (median) | speed-up vs cold | bare criu restore s | overhead s |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for comp, run in r["runs"].items():
                lines.append(f"| {comp} | {run['create_s']:.1f} | {run['raw_bytes'] / 2**20:.0f} | {run['stored_bytes'] / 2**20:.0f} | "
                             f"{100 * run['stored_ratio']:.1f} | {run['restore_median_s']:.2f} | {run['speedup_vs_cold']:.1f}× | "
                             f"{run.get('bare_criu_restore_s', float('nan')):.2f} | {run.get('overhead_vs_bare_criu_s', float('nan')):.2f} |")
            lines.append("")
            lines.append("Restore phases (seconds, each restore): " + "; ".join(
                f"{comp}: " + ", ".join(json.dumps(x["phases"]) for x in run["restores"]) for comp, run in r["runs"].items()))
            lines.append("")
        with open(a.md, "a") as f:
            f.write("\n".join(lines) + "\n")
    if a.plot and not a.quick:
        plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
