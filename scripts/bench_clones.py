#!/usr/bin/env python3
"""Benchmark of clones: one snapshot restored N times side by side (each engine in its own
network namespace), measured in one run.

For clone k = 1..N (the earlier clones keep running): the wall time from starting
``vllm-snapshot restore SNAPSHOT --port P --detach`` until the first completion answered on
that port (restore returns only after the oracle matched and the HTTP canary passed, so this is
"restore -> first validated completion"), then the memory of every clone's process tree:
RSS (resident bytes, counting pages shared with other processes in full) and PSS (proportional
set size: shared pages divided among their sharers, from /proc/PID/smaps_rollup), in MiB.
The first clone's tree is also measured alone (before the second starts), so "total PSS vs one
engine" is read in the same run. All clones are stopped at the end.

``--merge-pages`` restores every clone with ``restore --merge-pages`` (KSM-mergeable memory,
docs/weights.md). ``--ksm-wait S``: after the last clone, wait up to S seconds for ksmd (run =
1, set by the operator or by ``--ksm-tune``) to stop finding new pages to merge (two full scans
in a row that change ``pages_sharing`` by < 1%; no wait when no clone has a mergeable
mapping), then measure; KSM's counters
(/sys/kernel/mm/ksm) and each tree's merged pages (/proc/PID/ksm_merging_pages) are printed.
``--ksm-tune PAGES:MS`` sets ``run`` = 1, ``pages_to_scan`` = PAGES and ``sleep_millisecs`` =
MS for the run and puts the three values it found back at the end (also on failure).

Usage (root, venv from scripts/setup.sh):
    python scripts/bench_clones.py SNAPSHOT [--clones 3] [--port 8190] [--json-out FILE]
        [--merge-pages] [--ksm-tune 5000:20] [--ksm-wait 300]
Prints one line per clone and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from vllm_snapshot.checkpoint.criu.merge import KSM_SYSFS, ksm_state, process_merge  # noqa: E402
from vllm_snapshot.dev.bench import VS, cli, tree_memory  # noqa: E402
from vllm_snapshot.host.procs import tree  # noqa: E402

MIB = 1 << 20
TUNED = ("run", "pages_to_scan", "sleep_millisecs")


def ksm_counters() -> dict:
    """KSM's host-wide counters that say what it merged (pages; absent ones as None)."""
    out = {}
    for name in ("run", "pages_to_scan", "sleep_millisecs", "full_scans", "pages_shared", "pages_sharing",
                 "pages_unshared", "pages_volatile", "general_profit"):
        try:
            out[name] = int((KSM_SYSFS / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            out[name] = None
    return out


def wait_for_ksm(limit_s: float) -> dict:
    """Wait until two full scans in a row changed ``pages_sharing`` by < 1% (or ``limit_s``);
    the counters then, with ``waited_s``."""
    t0 = time.monotonic()
    last = ksm_counters()
    steady = 0
    while time.monotonic() - t0 < limit_s and steady < 2:
        time.sleep(1)
        now = ksm_counters()
        if now["full_scans"] != last["full_scans"]:
            grew = abs((now["pages_sharing"] or 0) - (last["pages_sharing"] or 0))
            steady = steady + 1 if grew <= 0.01 * max(now["pages_sharing"] or 0, 1) else 0
            last = now
    return {**ksm_counters(), "waited_s": round(time.monotonic() - t0, 1)}


def ksmd_cpu_s() -> float | None:
    """CPU seconds ksmd (the kernel thread) has used since boot; None when there is none."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_text().strip() == "ksmd":
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return None


def measure(clones: list[dict], key: str) -> None:
    """PSS/RSS and merged pages of every clone's tree into ``c[key]``; one summary line."""
    for c in clones:
        mem = tree_memory(c["pid"])
        c[key] = {"processes": mem["processes"], "rss_mib": round(mem["rss"] / MIB, 1),
                  "pss_mib": round(mem["pss"] / MIB, 1), "ksm": tree_merge(c["pid"])}
    print(f"{key}: PSS per tree {[c[key]['pss_mib'] for c in clones]} MiB, total "
          f"{sum(c[key]['pss_mib'] for c in clones):.0f} MiB; merged pages per tree "
          f"{[c[key]['ksm']['merging_pages'] for c in clones]}", flush=True)


def tree_merge(pid: int) -> dict:
    """Summed :func:`process_merge` of ``pid``'s tree."""
    total = {"mergeable_vmas": 0, "anon_vmas": 0, "merging_pages": 0, "merge_any": 0}
    for p in tree(pid):
        got = process_merge(p.pid)
        for k in total:
            total[k] += (got or {}).get(k, 0)
    return total


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
    ap.add_argument("--merge-pages", action="store_true", help="restore with --merge-pages")
    ap.add_argument("--ksm-tune", help="PAGES:MS: run KSM with these for the run, then put back what was there")
    ap.add_argument("--ksm-wait", type=float, default=0.0, help="seconds to wait for ksmd before measuring")
    ap.add_argument("--traffic", type=int, default=0,
                    help="then N one-token completions per clone, measure again at once and after --ksm-wait")
    a = ap.parse_args()
    model = cli("inspect", a.snapshot)["manifest"]["model"]["served_name"]
    clones: list[dict] = []
    found = {n: (KSM_SYSFS / n).read_text().split()[0] for n in TUNED} if a.ksm_tune else {}
    ksm: dict = {"before": ksm_counters(), "ksmd_cpu_s_before": ksmd_cpu_s()}
    alone: dict = {}
    try:
        if a.ksm_tune:
            pages, ms = a.ksm_tune.split(":")
            for name, value in (("pages_to_scan", pages), ("sleep_millisecs", ms), ("run", "1")):
                (KSM_SYSFS / name).write_text(value)
        for k in range(a.clones):
            port = a.port + k
            t0 = time.monotonic()
            r = cli("restore", a.snapshot, "--port", str(port), "--detach", "-q",
                    *(["--merge-pages"] if a.merge_pages else []))
            complete(port, model)
            took = time.monotonic() - t0
            clones.append({"clone": k + 1, "pid": r["pid"], "port": port, "restore_to_completion_s": round(took, 3),
                           "criu_restore_s": r["timings"].get("criu_restore")})
            print(f"clone {k + 1}: restore -> first validated completion {took:.2f} s "
                  f"(CRIU restore {r['timings'].get('criu_restore', 0):.2f} s)", flush=True)
            if k == 0:  # the one engine alone, measured as the others are below
                time.sleep(2)
                mem = tree_memory(r["pid"])
                alone = {"rss_mib": round(mem["rss"] / MIB, 1), "pss_mib": round(mem["pss"] / MIB, 1)}
                print(f"clone 1 alone: RSS {alone['rss_mib']:.0f} MiB, PSS {alone['pss_mib']:.0f} MiB", flush=True)
        time.sleep(2)  # let the trees settle before reading memory
        if a.ksm_wait and not any(tree_merge(c["pid"])["mergeable_vmas"] for c in clones):
            print("no clone has a mergeable mapping: nothing for ksmd to do, not waiting", flush=True)
        elif a.ksm_wait:
            ksm["after_wait"] = wait_for_ksm(a.ksm_wait)
            print(f"KSM after {ksm['after_wait']['waited_s']} s: {ksm['after_wait']}", flush=True)
        for c in clones:
            mem = tree_memory(c["pid"])
            c.update(processes=mem["processes"], rss_mib=round(mem["rss"] / MIB, 1), pss_mib=round(mem["pss"] / MIB, 1),
                     ksm=tree_merge(c["pid"]))
        if a.traffic:  # requests write to the heaps: copy-on-write splits merged pages again
            for _ in range(a.traffic):
                for c in clones:
                    complete(c["port"], model)
            measure(clones, "after_traffic")
            if "after_wait" in ksm:
                ksm["after_traffic_wait"] = wait_for_ksm(a.ksm_wait)
                measure(clones, "after_traffic_and_wait")
        ksm["ksmd_cpu_s_after"] = ksmd_cpu_s()
    finally:
        for c in clones:
            subprocess.run([*VS, "stop", "--pid", str(c["pid"])], capture_output=True, timeout=120)
        for name in ("run", "pages_to_scan", "sleep_millisecs"):  # run first: ksmd stops before the others change
            if name in found:
                (KSM_SYSFS / name).write_text(found[name])
        if found:
            print(f"KSM settings put back: {ksm_counters()}", flush=True)
    print("\n| clone | restore -> first validated completion | CRIU restore | processes | RSS of the tree | PSS of the tree |")
    print("|---|---|---|---|---|---|")
    for c in clones:
        print(f"| {c['clone']} | {c['restore_to_completion_s']:.2f} s | {c['criu_restore_s']:.2f} s | {c['processes']} | "
              f"{c['rss_mib']:.0f} MiB | {c['pss_mib']:.0f} MiB |")
    total = sum(c["pss_mib"] for c in clones)
    ratio = total / alone["pss_mib"] if alone.get("pss_mib") else float("nan")
    print(f"\ntotal PSS of {len(clones)} clones: {total:.0f} MiB = {ratio:.2f}x one engine alone "
          f"({alone.get('pss_mib', 0):.0f} MiB); merge-pages {'on' if a.merge_pages else 'off'}; "
          f"merged pages per tree: {[c['ksm']['merging_pages'] for c in clones]}; "
          f"mergeable/anon VMAs per tree: {[(c['ksm']['mergeable_vmas'], c['ksm']['anon_vmas']) for c in clones]}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"snapshot": a.snapshot, "merge_pages": a.merge_pages, "alone": alone, "clones": clones,
                       "total_pss_mib": round(total, 1), "ratio_to_alone": round(ratio, 3), "ksm": ksm,
                       "loadavg": os.getloadavg()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
