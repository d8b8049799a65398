#!/usr/bin/env python3
"""Benchmark of `switch` (time-sharing one port), both ways measured in one run, alternating:

* ``stop-then-restore``: ``vllm-snapshot switch --no-handover`` -- validate the target, tell
  the old engine to stop (it closes the port and drains), restore the target;
* ``hand-over``: ``vllm-snapshot switch`` -- validate, restore and check the target while the
  old engine serves, hand it the old engine's listening socket, then drain the old one.

Across every switch a client polls the port every ``--poll-ms`` (50) ms with a one-token
completion (connect, POST, read the answer; 10 s timeout) and records each poll:

* ``refused``: the connection was refused (nothing listening);
* ``failed``: the connection was accepted and then failed (reset, closed, a non-200 answer);
* ``dark``: the longest time from a poll that was refused or failed until the next poll
  answered (0 when none was) -- how long a client saw nothing serve;
* ``wait``: the longest time one answered poll took (a connection waiting in the backlog).

Usage (root, venv from scripts/setup.sh):
    python scripts/bench_switch.py SNAPSHOT_A SNAPSHOT_B [--port 8190] [--rounds 3] [--poll-ms 50]
Prints one line per switch, then per way the medians of the switch's own timings and the worst
of dark, refused, failed and wait over its switches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from vllm_snapshot.dev.bench import VS, Poller, cli  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--poll-ms", type=float, default=50.0)
    ap.add_argument("--model", default="tiny-llama", help="the served model name the polls ask for")
    a = ap.parse_args()
    port = str(a.port)
    ways = {"stop-then-restore": ["--no-handover"], "hand-over": []}
    res: dict[str, list[dict]] = {w: [] for w in ways}
    cli("restore", a.a, "--port", port, "--detach", "-q")
    cur = a.a
    try:
        for i in range(a.rounds * 2):
            way = list(ways)[i % 2]
            nxt = a.b if cur == a.a else a.a
            time.sleep(1.0)  # the previous old engine's drain and exit are over
            poller = Poller(a.port, a.poll_ms / 1000, a.model)
            time.sleep(0.5)  # polls answered before the switch
            r = cli("switch", nxt, "--port", port, *ways[way])
            time.sleep(0.5)
            s = poller.stop()
            if way == "hand-over" and not r.get("handover"):
                raise SystemExit(f"the switch did not hand over: {r.get('fallback')}")
            row = {**s, "stop_s": r["stop_s"], "restore_s": r["restore_s"], "switch_s": r["switch_s"]}
            res[way].append(row)
            print(f"{way:17s} -> {os.path.basename(nxt)}: switch {r['switch_s']:.2f} s (stop {r['stop_s']:.2f} s, "
                  f"restore {r['restore_s']:.2f} s); {s['polls']} polls: dark {s['dark']:.3f} s, refused "
                  f"{s['refused']}, failed {s['failed']} {s['first_failure']}, longest answer {s['wait']:.3f} s",
                  flush=True)
            cur = nxt
    finally:
        subprocess.run([*VS, "stop", "--port", port], capture_output=True, timeout=120)
    for way, rows in res.items():
        med = {k: statistics.median(x[k] for x in rows) for k in ("stop_s", "restore_s", "switch_s")}
        print(f"{way}: median switch {med['switch_s']:.2f} s (stop {med['stop_s']:.2f} s, restore "
              f"{med['restore_s']:.2f} s); worst dark {max(x['dark'] for x in rows):.3f} s, refused "
              f"{sum(x['refused'] for x in rows)}, failed {sum(x['failed'] for x in rows)}, longest answer "
              f"{max(x['wait'] for x in rows):.3f} s ({len(rows)} switches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
