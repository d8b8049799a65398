#!/usr/bin/env python3
"""Experiment: eager restore vs CRIU's lazy pages (userfaultfd), alternating in one run.

Not a product path: the lazy mode is patched into ``ops.restore`` here, for the measurement only.
In ``lazy`` rounds this script

* starts ``criu lazy-pages -D STAGE -W STAGE`` (the daemon, nice 0) before CRIU's restore, on the
  staging dir the restore made, and waits for its ``lazy-pages.socket``;
* sets ``lazy_pages`` in CRIU's restore RPC (CRIU then leaves private anonymous memory to the
  daemon: faulted pages first, the rest copied in the background once the restore finished);
* lets the restore's check "the restored tree is the recorded one" retry until the root's
  command line can be read: ``/proc/PID/cmdline`` reads the process's stack through the
  kernel's remote access, which fails (empty) on a page the daemon has not copied yet; the
  wait is reported as ``tree_wait``;
* keeps the staging dir until the daemon exited (it reads the pages images from there).

In ``eager`` rounds (today's restore) it clears the tree's referenced bits right after CRIU
returns (``/proc/PID/clear_refs``) and, after the first validated completion, sums
``Referenced`` over the anonymous memory of every process (``/proc/PID/smaps``): the share of
the image the oracle, the bind and the canary touch -- the most a lazy restore could leave for
later.

Usage (root, an uncompressed snapshot):
    python scripts/bench_lazy.py SNAPSHOT [--rounds 4] [--modes eager,lazy[,lazy-nice,lazy-notree]]
                                 [--daemon-log-level 1]
Prints one JSON line per restore (seconds; ``total`` = restore -> first validated completion),
then the medians per mode and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from vllm_snapshot import ops  # noqa: E402
from vllm_snapshot.checkpoint import criu  # noqa: E402
from vllm_snapshot.dev import bench  # noqa: E402
from vllm_snapshot.effects import checkpoint as effects_checkpoint  # noqa: E402
from vllm_snapshot.effects import files as effects_files  # noqa: E402
from vllm_snapshot.effects.tools import local_tools  # noqa: E402
from vllm_snapshot.host.procs import tree  # noqa: E402
from vllm_snapshot.report.progress import Reporter  # noqa: E402
from vllm_snapshot.store import manifest  # noqa: E402

STATE: dict = {"lazy": False, "level": "-v1", "recorded": ()}
DAEMON: dict = {}


def _cls(module, method: str) -> type:
    return next(c for c in vars(module).values()
                if isinstance(c, type) and c.__module__ == module.__name__ and method in vars(c))


_rpc = criu.restore_rpc
_criu_restore = criu.Criu._restore
_Files = _cls(effects_files, "unstage")
_unstage = _Files.unstage
_Checkpoint = _cls(effects_checkpoint, "tree_commands")
_tree_commands = _Checkpoint.tree_commands


#: the modes: today's restore, and lazy pages with the daemon at nice 0 / nice -10 / with the
#: tree check's wait skipped (the root's command taken as recorded: what an engine that reports
#: its own argv would cost; measurement only)
MODES = ("eager", "lazy", "lazy-nice", "lazy-notree")


def restore_rpc(opts, rpc) -> None:
    _rpc(opts, rpc)
    if STATE["lazy"]:
        rpc.lazy_pages = True


def restore(self, opts, images_dir, work_dir, before_memory=None):
    if STATE["lazy"]:
        sock = Path(work_dir) / "lazy-pages.socket"
        p = subprocess.Popen([self.binary, "lazy-pages", "-D", str(images_dir), "-W", str(work_dir),
                              "-o", "lazy-pages.log", STATE["level"]],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=(lambda: os.nice(-10)) if STATE["mode"] == "lazy-nice" else None)
        t0 = time.monotonic()
        DAEMON.update(p=p, log=Path(work_dir) / "lazy-pages.log")

        def waiter() -> None:
            p.wait()
            DAEMON["exit_at"] = time.monotonic()

        threading.Thread(target=waiter, daemon=True).start()
        while not sock.exists():
            if p.poll() is not None or time.monotonic() - t0 > 10:
                raise RuntimeError(f"criu lazy-pages did not start (exit {p.returncode})")
            time.sleep(0.002)
        DAEMON["socket_s"] = time.monotonic() - t0
    pid = _criu_restore(self, opts, images_dir, work_dir, before_memory)
    if not STATE["lazy"]:
        for proc in tree(pid):
            Path(f"/proc/{proc.pid}/clear_refs").write_text("1")
    return pid


def tree_commands(self, pid):
    t0 = time.monotonic()
    while True:
        got = _tree_commands(self, pid)
        if STATE["mode"] == "lazy-notree":
            DAEMON["tree_wait"] = 0.0
            return (*STATE["recorded"][:1], *got[1:])
        if not STATE["lazy"] or got[:1] == STATE["recorded"][:1] or time.monotonic() - t0 > 30:
            DAEMON["tree_wait"] = time.monotonic() - t0
            return got
        time.sleep(0.005)


def unstage(self, stage) -> None:
    if STATE["lazy"] and "p" in DAEMON:
        DAEMON["stage"] = (self, stage)  # removed once the daemon exited
        return
    _unstage(self, stage)


def touched(pid: int) -> tuple[int, int]:
    """(anonymous KiB, referenced anonymous KiB) over the tree of ``pid``."""
    anon = ref = 0
    for proc in tree(pid):
        blk: dict[str, int] = {}
        with open(f"/proc/{proc.pid}/smaps") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("Anonymous", "Referenced"):
                    blk[key] = int(line.split()[1])
                elif key == "VmFlags":
                    anon += blk.get("Anonymous", 0)
                    ref += min(blk.get("Referenced", 0), blk.get("Anonymous", 0))
                    blk = {}
    return anon, ref


def one(snap: Path, mode: str) -> dict:
    STATE["lazy"], STATE["mode"] = mode != "eager", mode
    DAEMON.clear()
    rep = Reporter()
    t0 = time.monotonic()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=bench.free_port()), rep)
    total = time.monotonic() - t0
    row = {"mode": mode, "total": round(total, 3), "phases": r.timings}
    try:
        if STATE["lazy"]:
            row["tree_wait"] = round(DAEMON["tree_wait"], 3)
            row["daemon_rc"] = DAEMON["p"].wait(120)
            time.sleep(0.05)
            row["memory_complete_s"] = round(DAEMON["exit_at"] - t0, 3)
            log = DAEMON["log"].read_text(errors="replace")
            row["faults"] = log.count("#PF")  # only at --daemon-log-level 4
            pages = re.findall(r"UFFD transferred pages: \((\d+)/(\d+)\)", log)
            row["pages_copied"] = sum(int(a) for a, _ in pages)
        else:
            row["tree_wait"] = round(DAEMON["tree_wait"], 3)
            anon, ref = touched(r.pid)
            row["anon_mib"], row["touched_mib"] = anon // 1024, ref // 1024
    finally:
        engine.kill(grace=15)
        engine.close()
        local_tools().runtime.unregister(r.pid)
        if "stage" in DAEMON:
            if DAEMON["p"].poll() is None:
                DAEMON["p"].kill()
                DAEMON["p"].wait()
            _unstage(*DAEMON["stage"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", default="eager,lazy")
    ap.add_argument("--daemon-log-level", type=int, default=1, choices=range(5),
                    help="4 counts the page faults the daemon served (slower)")
    a = ap.parse_args()
    STATE["level"] = f"-v{a.daemon_log_level}"
    STATE["recorded"] = manifest.read(a.snapshot).criu.tree_commands
    criu.runner.restore_rpc = restore_rpc  # the name the runner calls
    criu.Criu._restore = restore
    _Files.unstage = unstage
    _Checkpoint.tree_commands = tree_commands
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: each of {', '.join(MODES)}")
    rows: list[dict] = []
    print(json.dumps({"load": os.getloadavg(), "cpus": os.cpu_count()}), flush=True)
    for _ in range(a.rounds):
        for mode in modes:
            rows.append(one(a.snapshot, mode))
            print(json.dumps(rows[-1]), flush=True)
            time.sleep(1)
    med = {m: statistics.median(r["total"] for r in rows if r["mode"] == m) for m in modes}
    print(json.dumps({"median_total_s": med, "load_after": os.getloadavg(),
                      **({"eager_over_lazy": round(med["eager"] / med["lazy"], 3)}
                         if {"eager", "lazy"} <= set(med) else {})}))  # > 1: lazy faster
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
