#!/usr/bin/env python3
"""Benchmark: how long `pull` and `push` take to exit after SIGINT (Ctrl-C) in the middle of
the transfer, for two source trees alternated in one run, through a real registry (Debian's
docker-registry on 127.0.0.1, its access log read to know the transfer is under way).

Run with the project's venv as root:

    /var/cache/vllm-snapshot/venv/bin/python scripts/bench_fleet_interrupt.py --snapshot DIR
        [--before TREE] [--rounds 3] [--json-out F]

``--snapshot DIR``: a snapshot to push (a hard-linked copy is used). ``--before TREE``: a
checkout of the code to compare with (e.g. ``git archive main | tar -x -C /tmp/main-tree``);
its CLI runs as ``python -m vllm_snapshot`` with that tree as the working directory, as this
tree's does with this one. Each round: a `pull` into an empty store, SIGINT once a layer has
been sent in full; a `push` to a new repository (every blob uploaded), SIGINT 0.5 s after its first upload began. Printed:
the seconds from SIGINT to exit, the exit code, and whether anything was listed or tagged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # this checkout's package

from vllm_snapshot.dev.bench import emit, private  # noqa: E402
from vllm_snapshot.dev.registry_server import RegistryServer  # noqa: E402


def interrupted(tree: Path, args: list[str], under_way) -> dict:
    """Start ``vllm-snapshot ARGS`` from ``tree``, SIGINT it once ``under_way()`` is true;
    returns ``{"after_s", "exit_s", "rc"}`` (seconds from start to SIGINT, SIGINT to exit)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", *args], cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not under_way():
        time.sleep(0.01)
    if proc.poll() is not None:
        raise SystemExit(f"{args[0:3]} ended before it could be interrupted: {proc.stderr.read()[-1000:]}")
    t1 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=300)[1]
    t2 = time.monotonic()
    return {"after_s": round(t1 - t0, 3), "exit_s": round(t2 - t1, 3), "rc": proc.returncode,
            "last_line": err.strip().splitlines()[-1][:160] if err.strip() else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", type=Path, required=True)
    ap.add_argument("--before", type=Path, help="the tree to compare with (default: none, this tree only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    import requests

    trees = ([("before", a.before.resolve())] if a.before else []) + [("after", HERE)]
    work = Path(tempfile.mkdtemp(prefix="vsnap-intr-bench-", dir="/var/tmp"))
    os.chmod(work, 0o700)
    reg = RegistryServer(work / "registry")
    res: dict = {"rounds": [], "trees": {k: str(v) for k, v in trees}}
    try:
        snap = private(work / "node-a") / "snap"
        subprocess.run(["cp", "-al", str(a.snapshot), str(snap)], check=True)
        image = f"{reg.host}/bench/intr:v1"
        p = subprocess.run([sys.executable, "-m", "vllm_snapshot", "push", str(snap), image, "--plain-http", "--json"],
                           cwd=HERE, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"push exited {p.returncode}: {p.stderr[-2000:]}")
        print(f"artifact: {json.loads(p.stdout)['blobs']} layers, {json.loads(p.stdout)['bytes'] / 1e6:.0f} MB",
              file=sys.stderr)
        n = 0
        for i in range(a.rounds):
            for label, tree in trees:
                n += 1
                rnd: dict = {"round": i, "code": label}
                root = private(work / f"store-{n}")
                mark = len(reg.requests_log())
                r = interrupted(tree, ["--root", str(root), "pull", image, "--plain-http", "--name", "s"],
                                lambda: len(reg.blob_gets(mark)) >= 2)  # the config and a layer sent
                r["listed"] = [x for x in os.listdir(root) if not x.startswith(".")]
                rnd["pull"] = r
                shutil.rmtree(root)
                tag = f"p{n}"
                mark = len(reg.requests_log())
                started: list[float] = []

                def upload_began() -> bool:
                    if not started and any('"POST /v2/' in x and "/blobs/uploads/" in x
                                           for x in reg.requests_log()[mark:]):
                        started.append(time.monotonic())
                    return bool(started) and time.monotonic() - started[0] >= 0.5
                r = interrupted(tree, ["push", str(snap), f"{reg.host}/bench/{tag}:v1", "--plain-http"],
                                upload_began)
                r["tagged"] = requests.get(f"http://{reg.host}/v2/bench/{tag}/manifests/v1", timeout=10,
                                           headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}
                                           ).status_code == 200
                rnd["push"] = r
                print(f"round {i} {label}: pull SIGINT after {rnd['pull']['after_s']:.2f} s -> exit "
                      f"{rnd['pull']['rc']} in {rnd['pull']['exit_s']:.2f} s (listed {rnd['pull']['listed']}); "
                      f"push SIGINT after {r['after_s']:.2f} s -> exit {r['rc']} in {r['exit_s']:.2f} s "
                      f"(tagged: {r['tagged']})", file=sys.stderr)
                res["rounds"].append(rnd)
        res["load"] = os.getloadavg()
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
    for kind in ("pull", "push"):
        for label, _ in trees:
            xs = [r[kind]["exit_s"] for r in res["rounds"] if r["code"] == label]
            res[f"{kind}_{label}_exit_s"] = xs
    if a.before:
        for kind in ("pull", "push"):
            b, f = res[f"{kind}_before_exit_s"], res[f"{kind}_after_exit_s"]
            res[f"{kind}_ratio_after_over_before"] = round(sum(f) / max(1e-9, sum(b)), 3)
    emit(res, a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
