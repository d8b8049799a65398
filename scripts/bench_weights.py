#!/usr/bin/env python3
"""Benchmark of weights files: one model, measured in one run, ``--weights file`` against
``--weights in-image`` and against the fastest cold start a user could choose.

For each mode: a create (its page images, raw bytes), ``--restores`` restores -> first validated
completion (restore returns after the oracle matched and the HTTP canary passed; then the
completion a cold start's timing ends at -- one token of "Hello", ``bench.first_completion``
-- is timed on the port too, so both sides end at the same request). Then, for the ``file`` snapshot, ``--clones`` restores side by
side and the total PSS of their process trees against one engine's (shared weights pages are
divided among their sharers). Then the cold starts after the creates (warm compile cache): the
given engine args and, when they compile, with ``--enforce-eager``; the ratio is against the
faster. Prints a JSON object (``--json-out`` writes it too) and a Markdown table.

    /var/cache/vllm-snapshot/venv/bin/python scripts/bench_weights.py --model DIR [--restores 2]
        [--clones 3] [--json-out F] [-- ENGINE ARGS]

Default engine args: the demo's with ``--enforce-eager`` (the 3.1 GiB model is measured
eager: a compiled cold start of it is slower). A big model: ``python -m
vllm_snapshot.dev.tiny_model --hidden 2048 --layers 16 --out DIR`` (3.1 GiB float32).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_snapshot import ops  # noqa: E402
from vllm_snapshot.dev import bench, tiny_model  # noqa: E402
from vllm_snapshot.effects.tools import local_tools  # noqa: E402
from vllm_snapshot.report.progress import Reporter  # noqa: E402

ARGS = [*tiny_model.ENGINE_ARGS, "--enforce-eager"]


def complete(port: int) -> float:
    """Seconds of the cold start's own last request (:func:`bench.first_completion`: one token of
    "Hello") on ``port``. Raises RuntimeError for an answer other than HTTP 200."""
    t0 = time.monotonic()
    status, body = bench.first_completion(port, tiny_model.SERVED_NAME, timeout=300)
    if status != 200:
        raise RuntimeError(f"completion on port {port}: HTTP {status}: {str(body)[:200]}")
    return time.monotonic() - t0


def restore(snap: Path) -> tuple[float, object, int]:
    """(seconds to the first validated completion, engine handle, root PID)."""
    port = bench.free_port()
    t0 = time.monotonic()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port), Reporter())
    complete(port)
    return time.monotonic() - t0, engine, r.pid


def stop(engine, pid: int) -> None:
    engine.kill(grace=15)
    engine.close()
    local_tools().runtime.unregister(pid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--restores", type=int, default=2)
    ap.add_argument("--clones", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("engine_args", nargs="*")
    a = ap.parse_args()
    args = a.engine_args or ARGS
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-weights-", dir="/var/tmp"))
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    res: dict = {"model": str(a.model), "engine_args": args, "modes": {}}
    snaps = {}
    for mode in ("file", "in-image"):
        snap = snaps[mode] = work / f"snap-{mode}"
        t0 = time.monotonic()
        m = ops.create(ops.CreateRequest(model=str(a.model), target=snap, engine_args=args, weights=mode),
                       Reporter()).manifest
        row = {"create_s": round(time.monotonic() - t0, 2), "images_raw_bytes": m.sizes["raw"],
               "weights_bytes": m.weights.size if m.weights else 0, "restores_s": []}
        print(f"{mode}: create {row['create_s']} s, images {m.sizes['raw'] / 2**30:.2f} GiB", file=sys.stderr)
        for _ in range(a.restores):
            s, engine, pid = restore(snap)
            if "memory" not in row:
                row["memory"] = bench.tree_memory(pid)
            stop(engine, pid)
            row["restores_s"].append(round(s, 3))
            print(f"  restore -> first validated completion {s:.2f} s", file=sys.stderr)
            time.sleep(1)
        row["restore_median_s"] = sorted(row["restores_s"])[len(row["restores_s"]) // 2]
        res["modes"][mode] = row
    # clones of the file snapshot, side by side
    clones = []
    try:
        for _ in range(a.clones):
            s, engine, pid = restore(snaps["file"])
            clones.append((engine, pid))
        pss = [bench.tree_memory(pid)["pss"] for _, pid in clones]
        res["clones"] = {"n": a.clones, "pss_total_bytes": sum(pss), "pss_each_bytes": pss,
                         "one_engine_pss_bytes": res["modes"]["file"]["memory"]["pss"],
                         "ratio_vs_one": round(sum(pss) / max(1, res["modes"]["file"]["memory"]["pss"]), 2)}
    finally:
        for engine, pid in clones:
            stop(engine, pid)
    # switch between two snapshots of the same weights (other engine args): the second create
    # reuses the weights file; a client polls every 50 ms through the hand-over
    other = work / "snap-file-seqs8"
    m2 = ops.create(ops.CreateRequest(model=str(a.model), target=other, engine_args=[*args, "--max-num-seqs", "8"]),
                    Reporter()).manifest
    from vllm_snapshot.store import manifest

    first = manifest.read(snaps["file"])
    res["second_snapshot"] = {"images_raw_bytes": m2.sizes["raw"],
                              "same_weights_file": m2.weights is not None and m2.weights.path == first.weights.path}
    port = bench.free_port()
    bench.cli("restore", str(snaps["file"]), "--port", str(port), "--detach", "-q")
    rows = []
    try:
        for nxt in (other, snaps["file"]):
            time.sleep(1.0)
            poller = bench.Poller(port, 0.05, tiny_model.SERVED_NAME)
            time.sleep(0.5)
            t0 = time.monotonic()
            r = bench.cli("switch", str(nxt), "--port", str(port), "-q")
            took = time.monotonic() - t0
            time.sleep(0.5)
            got = poller.stop()
            rows.append({"to": nxt.name, "command_s": round(took, 2), "handover": r.get("handover"),
                         "dark_s": round(got["dark"], 3), "failed": got["failed"], "refused": got["refused"]})
            print(f"switch -> {nxt.name}: {took:.2f} s, dark {got['dark']:.3f} s, failed {got['failed']}", file=sys.stderr)
    finally:
        subprocess.run([*bench.VS, "stop", "--port", str(port)], capture_output=True, timeout=120)
    res["switch"] = rows
    cold = {}
    eager = "--enforce-eager" in args
    for name, cargs in [("given", args)] + ([] if eager else [("eager", [*args, "--enforce-eager"])]):
        cold[name] = round(bench.cold_start(a.model, bench.free_port(), cargs), 2)
        print(f"cold start ({name}) -> first completion {cold[name]} s", file=sys.stderr)
    res["cold_starts_s"] = cold
    best = min(cold.values())
    for mode, row in res["modes"].items():
        row["speedup_vs_fastest_cold"] = round(best / row["restore_median_s"], 2)
    print(json.dumps(res, indent=2))
    if a.json_out:
        a.json_out.write_text(json.dumps(res, indent=2) + "\n")
    f, i = res["modes"]["file"], res["modes"]["in-image"]
    print("\n| | --weights file | --weights in-image |\n|---|---|---|")
    print(f"| page images | {f['images_raw_bytes'] / 2**30:.2f} GiB | {i['images_raw_bytes'] / 2**30:.2f} GiB |")
    print(f"| weights file | {f['weights_bytes'] / 2**30:.2f} GiB | - |")
    print(f"| restore -> first validated completion (median of {a.restores}) | {f['restore_median_s']} s | "
          f"{i['restore_median_s']} s |")
    print(f"| ratio vs fastest cold start ({best} s) | {f['speedup_vs_fastest_cold']}x | {i['speedup_vs_fastest_cold']}x |")
    for sw in res.get("switch", []):
        print(f"| switch to {sw['to']} (same weights, other args): whole command, dark, failed | {sw['command_s']} s, "
              f"{sw['dark_s']} s, {sw['failed']} | |")
    if "clones" in res:
        print(f"| {a.clones} clones, total PSS vs one engine | {res['clones']['ratio_vs_one']}x | (not measured) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
