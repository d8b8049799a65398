#!/usr/bin/env python3
"""Where the time of a `switch` goes, phase by phase, and the same for another checkout's code,
alternating (A/B on the same box state: both checkouts restore both snapshots, turn about).

Each switch is ``python -m vllm_snapshot --root ROOT switch NEXT --port P`` run as a child
process (with ``PYTHONPATH`` set to the checkout), timed from launch to exit; its phases are
read from the plain reporter's lines on stderr (``LABEL: done in S s``), plus two spans that
are no phase of its own:

* ``startup``: from launch to the first phase (the interpreter, imports, the registry, the
  port's lock);
* ``tail``: from the last phase to exit (the old engine's end, the registry, the exit).
* ``before:PHASE``: time between the end of one phase and the start of PHASE, when over 0.05 s
  (work that is no phase: e.g. before ``criu_restore`` the host-wide CRIU lock, held by any
  other restore or dump on the host, and the engine's cgroup).

With ``--poll-ms`` a client polls the port across each switch as ``scripts/bench_switch.py``
does (one-token completions; refused, failed, longest time dark, longest answer).

Usage (root, venv from scripts/setup.sh; an engine of A serving on the port: the first switch goes to B):
    python scripts/bench_switch_phases.py ROOT A B --port 8731 [--rounds 6] [--before DIR]
        [--poll-ms 50] [-- extra switch options, e.g. --no-handover]
``--before DIR``: a checkout of the code to compare with (e.g. ``git worktree add`` or
``git archive REV | tar -x -C DIR``); without it only this checkout runs. Prints one line per
switch, then per checkout the medians of the wall time and of each phase.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # this checkout's package

from vllm_snapshot.dev.bench import Poller  # noqa: E402

#: a phase's label (its start) -> its short name
NAMES = (("validating snapshot, host", "restore_validate"), ("validating ", "validate_target"),
         ("checking the Python", "code_check"), ("checking ", "check_images"), ("stopping the engine", "stop_previous"),
         ("staging", "stage"), ("putting back", "carried"), ("CRIU restore", "criu_restore"),
         ("replaying the oracle", "oracle"), ("image checksums", "checksums"), ("binding", "bind"),
         ("waiting until the new engine accepts", "new_accepting"), ("the new engine accepts", "hand_over"),
         ("waiting for the HTTP", "http_ready"), ("canary", "canary"))
DONE = re.compile(r"\[vllm-snapshot\] (.*?): done in ([0-9.]+) s")


def short(label: str) -> str:
    return next((n for p, n in NAMES if label.startswith(p)), label[:24])


def phases_of(stamped: list[tuple[float, str]], wall: float) -> dict:
    """{phase: seconds, "startup", "tail", "before:PHASE"} from a switch's stderr lines, each
    with the seconds since launch it came at, and the whole run's ``wall`` seconds. Pure."""
    phases: dict = {}
    first = last = None
    for now, line in stamped:
        if line.rstrip().endswith("..."):
            first = now if first is None else first
            gap = now - last if last is not None else 0.0
            if gap > 0.05:
                k = "before:" + short(line.split("] ", 1)[-1])
                phases[k] = phases.get(k, 0.0) + gap
        m = DONE.search(line)
        if m:
            k = short(m.group(1))
            phases[k] = phases.get(k, 0.0) + float(m.group(2))
            last = now
    if first is None or last is None:
        raise ValueError("no phase in the output")
    phases["startup"] = first
    phases["tail"] = wall - last
    return phases


def one_switch(code: Path, root: str, snapshot: str, port: int, extra: list[str]) -> tuple[float, dict]:
    """(wall seconds, :func:`phases_of`) of one switch run with ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "--root", root, "switch", snapshot, "--port", str(port),
                          *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=code)
    stamped = [(time.monotonic() - t0, line) for line in p.stderr]
    p.wait()
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"switch {snapshot} ({code}) failed ({p.returncode}):\n{''.join(x for _, x in stamped)[-2000:]}")
    try:
        return wall, phases_of(stamped, wall)
    except ValueError:  # e.g. "already serves ...; nothing to switch"
        raise SystemExit(f"switch {snapshot} ({code}) ran no phase:\n{''.join(x for _, x in stamped)[-2000:]}") from None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--before", type=Path, help="a checkout of the code to compare with")
    ap.add_argument("--poll-ms", type=float, default=0.0)
    ap.add_argument("--model", default="tiny-llama", help="the served model name the polls ask for")
    ap.add_argument("extra", nargs="*", help="options given to every switch (after --)")
    a = ap.parse_args()
    codes = {"after": HERE, **({"before": a.before.resolve()} if a.before else {})}
    rows: dict[str, list] = {k: [] for k in codes}
    snaps, cur = [a.a, a.b], 0
    for i in range(a.rounds):
        for name in (list(codes) if i % 2 == 0 else list(codes)[::-1]):
            cur = 1 - cur
            time.sleep(1.0)  # the previous old engine's drain and exit are over
            load = os.getloadavg()[0]
            poller = Poller(a.port, a.poll_ms / 1000, a.model) if a.poll_ms else None
            if poller:
                time.sleep(0.5)  # polls answered before the switch
            wall, ph = one_switch(codes[name], a.root, snaps[cur], a.port, a.extra)
            if poller:
                time.sleep(0.5)
                s = poller.stop()
                ph.update(polls=s["polls"], refused=s["refused"], failed=s["failed"], dark=s["dark"], longest=s["wait"])
            rows[name].append((wall, ph))
            print(f"{name:6s} -> {os.path.basename(snaps[cur])} (load {load:4.1f}): {wall:5.2f} s | "
                  + "; ".join(f"{k} {v:.2f}" for k, v in ph.items() if v >= 0.03 and k not in ("polls",)), flush=True)
    for name, rs in rows.items():
        keys = list(dict.fromkeys(k for _, ph in rs for k in ph if k not in ("polls", "refused", "failed", "dark", "longest")))
        med = {k: statistics.median(ph.get(k, 0.0) for _, ph in rs) for k in keys}
        walls = [w for w, _ in rs]
        print(f"{name}: median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f}; "
              f"{len(rs)} switches); median phases: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items() if v >= 0.01))
        if a.poll_ms:
            print(f"{name}: {sum(ph['polls'] for _, ph in rs)} polls, refused {sum(ph['refused'] for _, ph in rs)}, "
                  f"failed {sum(ph['failed'] for _, ph in rs)}, worst dark {max(ph['dark'] for _, ph in rs):.3f} s, "
                  f"longest answer {max(ph['longest'] for _, ph in rs):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
