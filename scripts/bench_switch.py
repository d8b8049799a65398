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
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

VS = [sys.executable, "-m", "vllm_snapshot"]
BODY = json.dumps({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1})


def cli(*args: str) -> dict:
    p = subprocess.run([*VS, *args, "--json"], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"vllm-snapshot {' '.join(args)} failed ({p.returncode}): {p.stdout[-1500:]} {p.stderr[-1500:]}")
    return json.loads(p.stdout)


def poll_once(port: int, model: str) -> str:
    """One poll: ``ok``, ``refused`` or ``failed: WHY``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        try:
            conn.connect()
        except ConnectionRefusedError:
            return "refused"
        except OSError as e:
            return f"failed: connect {type(e).__name__}: {e}"
        try:
            conn.request("POST", "/v1/completions", BODY.replace("tiny-llama", model),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            return "ok" if r.status == 200 else f"failed: HTTP {r.status}"
        except (OSError, http.client.HTTPException) as e:
            return f"failed: {type(e).__name__}: {e}"
    finally:
        conn.close()


class Poller:
    """Polls ``port`` every ``every_s`` seconds in a thread; ``rows``: (start, end, outcome)."""

    def __init__(self, port: int, every_s: float, model: str) -> None:
        self.rows: list[tuple[float, float, str]] = []
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                t0 = time.monotonic()
                out = poll_once(port, model)
                self.rows.append((t0, time.monotonic(), out))
                self._stop.wait(max(0.0, every_s - (time.monotonic() - t0)))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(30)
        return summarize(self.rows)


def summarize(rows: list[tuple[float, float, str]]) -> dict:
    """``dark`` (s), ``refused``, ``failed`` (counts, with the first failure), ``wait`` (s),
    ``polls`` of a poll log. Pure."""
    dark, since = 0.0, None
    for t0, t1, out in rows:
        if out == "ok":
            if since is not None:
                dark = max(dark, t1 - since)
                since = None
        elif since is None:
            since = t0
    if since is not None:
        dark = max(dark, rows[-1][1] - since)
    failed = [o for _, _, o in rows if o.startswith("failed")]
    return {"dark": dark, "refused": sum(o == "refused" for _, _, o in rows), "failed": len(failed),
            "first_failure": failed[0] if failed else "", "polls": len(rows),
            "wait": max((t1 - t0 for t0, t1, o in rows if o == "ok"), default=0.0)}


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
