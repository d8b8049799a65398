#!/usr/bin/env python3
"""Benchmark of `switch` (time-sharing one port), measured in one run:

* ``sigterm-wait``: what `stop` did before -- SIGTERM to the detached engine, wait until every
  process of its tree is gone (vLLM's own shutdown of EngineCore and workers) -- then
  ``restore --detach`` of the other snapshot;
* ``switch``: ``vllm-snapshot switch`` as it is now -- validate the target, SIGTERM, SIGKILL of
  the tree as soon as no request is in flight, restore.

Usage (root, venv from scripts/setup.sh):
    python scripts/bench_switch.py SNAPSHOT_A SNAPSHOT_B [--port 8190] [--rounds 4]
Prints one line per switch and the medians (seconds) of stop, restore and the whole switch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil

VS = [sys.executable, "-m", "vllm_snapshot"]


def cli(*args: str) -> dict:
    p = subprocess.run([*VS, *args, "--json"], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"vllm-snapshot {' '.join(args)} failed ({p.returncode}): {p.stdout[-1500:]} {p.stderr[-1500:]}")
    return json.loads(p.stdout)


def old_stop(pid: int) -> float:
    t0 = time.monotonic()
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    os.kill(pid, signal.SIGTERM)
    psutil.wait_procs(procs, timeout=60)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    port = str(a.port)
    res: dict[str, list[tuple[float, float, float]]] = {"sigterm-wait": [], "switch": []}
    pid = cli("restore", a.a, "--port", port, "--detach", "-q")["pid"]
    cur = a.a
    try:
        for i in range(a.rounds * 2):
            nxt = a.b if cur == a.a else a.a
            if i % 2 == 0:
                t0 = time.monotonic()
                stop_s = old_stop(pid)
                t1 = time.monotonic()
                pid = cli("restore", nxt, "--port", port, "--detach", "-q")["pid"]
                t2 = time.monotonic()
                res["sigterm-wait"].append((stop_s, t2 - t1, t2 - t0))
                kind = "sigterm-wait"
            else:
                r = cli("switch", nxt, "--port", port, "-q")
                pid = r["pid"]
                res["switch"].append((r["stop_s"], r["restore_s"], r["switch_s"]))
                kind = "switch"
            s, rs, tot = res[kind][-1]
            print(f"{kind:13s} -> {os.path.basename(nxt)}: stop {s:.2f} s + restore {rs:.2f} s = {tot:.2f} s")
            cur = nxt
    finally:
        subprocess.run([*VS, "stop", "--port", port], capture_output=True, timeout=120)
    for kind, rows in res.items():
        med = [statistics.median(x[k] for x in rows) for k in range(3)]
        print(f"{kind}: median stop {med[0]:.2f} s, restore {med[1]:.2f} s, switch {med[2]:.2f} s ({len(rows)} switches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
