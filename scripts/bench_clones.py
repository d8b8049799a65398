#!/usr/bin/env python3
"""Benchmark of clones: one snapshot restored N times side by side (each engine in its own
network namespace), measured in one run.

For clone k = 1..N (the earlier clones keep running): the wall time from starting
``vllm-snapshot restore SNAPSHOT --port P --detach`` until the first completion answered on
that port (restore returns only after the oracle matched and the HTTP canary passed, so this is
"restore -> first validated completion"), then the memory of every clone's process tree:
RSS (resident bytes, counting pages shared with other processes in full) and PSS (proportional
set size: shared pages divided among their sharers, from /proc/PID/smaps_rollup), in MiB.
All clones are stopped at the end.

Usage (root, venv from scripts/setup.sh):
    python scripts/bench_clones.py SNAPSHOT [--clones 3] [--port 8190] [--json-out FILE]
Prints one line per clone and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from vllm_snapshot.dev.bench import VS, cli, tree_memory  # noqa: E402

MIB = 1 << 20


def complete(port: int, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot")
    ap.add_argument("--clones", type=int, default=3)
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    model = cli("inspect", a.snapshot)["manifest"]["model"]["served_name"]
    clones: list[dict] = []
    try:
        for k in range(a.clones):
            port = a.port + k
            t0 = time.monotonic()
            r = cli("restore", a.snapshot, "--port", str(port), "--detach", "-q")
            complete(port, model)
            took = time.monotonic() - t0
            clones.append({"clone": k + 1, "pid": r["pid"], "port": port, "restore_to_completion_s": round(took, 3),
                           "criu_restore_s": r["timings"].get("criu_restore")})
            print(f"clone {k + 1}: restore -> first validated completion {took:.2f} s "
                  f"(CRIU restore {r['timings'].get('criu_restore', 0):.2f} s)", flush=True)
        time.sleep(2)  # let the trees settle before reading memory
        for c in clones:
            mem = tree_memory(c["pid"])
            c.update(processes=mem["processes"], rss_mib=round(mem["rss"] / MIB, 1), pss_mib=round(mem["pss"] / MIB, 1))
    finally:
        for c in clones:
            subprocess.run([*VS, "stop", "--pid", str(c["pid"])], capture_output=True, timeout=120)
    print("\n| clone | restore -> first validated completion | CRIU restore | processes | RSS of the tree | PSS of the tree |")
    print("|---|---|---|---|---|---|")
    for c in clones:
        print(f"| {c['clone']} | {c['restore_to_completion_s']:.2f} s | {c['criu_restore_s']:.2f} s | {c['processes']} | "
              f"{c['rss_mib']:.0f} MiB | {c['pss_mib']:.0f} MiB |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"snapshot": a.snapshot, "clones": clones}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
