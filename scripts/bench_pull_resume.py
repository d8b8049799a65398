#!/usr/bin/env python3
"""Benchmark of resumed pulls: a pull killed (SIGKILL) once a given share of the
layer bytes has been sent, then pulled again, against a full pull of the same artifact into an
empty store -- alternated in one run, through a real registry (Debian's docker-registry on
127.0.0.1, filesystem storage, its access log read to know when to kill).

Run with the project's venv as root:

    /var/cache/vllm-snapshot/venv/bin/python scripts/bench_pull_resume.py [--snapshot DIR]
        [--rounds 2] [--kill-at 0.5] [--json-out F]

``--snapshot DIR``: push a hard-linked copy of that snapshot (default: create one of the
embedded tiny model with the demo's engine args, ~1 min). Pulls run as ``vllm-snapshot pull``
subprocesses (a real SIGKILL). The second pull's time includes re-hashing the layers it reuses.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # this checkout's package

from vllm_snapshot.dev import bench  # noqa: E402
from vllm_snapshot.dev.bench import emit, private  # noqa: E402
from vllm_snapshot.dev.registry_server import RegistryServer  # noqa: E402


def cli(*args: str) -> dict:
    return bench.cli(*args, cwd=HERE)


def sent_bytes(reg: RegistryServer, since: int, sizes: dict[str, int]) -> int:
    """Layer bytes whose GET the registry has logged (answered in full) since ``since``."""
    n = 0
    for line in reg.blob_gets(since):
        m = re.search(r"/blobs/(sha256:[0-9a-f]{64})", line)
        n += sizes.get(m.group(1), 0) if m else 0
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=0.5, help="share of the layer bytes sent before the kill")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vsnap-resume-bench-", dir="/var/tmp"))
    os.chmod(work, 0o700)
    reg = RegistryServer(work / "registry")
    res: dict = {"kill_at": a.kill_at, "rounds": []}
    try:
        snap = private(work / "node-a") / "snap"
        if a.snapshot:
            subprocess.run(["cp", "-al", str(a.snapshot), str(snap)], check=True)
        else:
            from vllm_snapshot import ops
            from vllm_snapshot.dev import tiny_model
            from vllm_snapshot.report.progress import Reporter

            model = tiny_model.generate(tiny_model.default_model_dir())
            ops.create(ops.CreateRequest(model=str(model), target=snap, engine_args=list(tiny_model.ENGINE_ARGS)),
                       Reporter())
        image = f"{reg.host}/bench/resume:v1"
        pushed = cli("push", str(snap), image, "--plain-http")
        import requests

        doc = requests.get(f"http://{reg.host}/v2/bench/resume/manifests/v1",
                           headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
        sizes = {d["digest"]: d["size"] for d in doc["layers"]}
        total = sum(d["size"] for d in doc["layers"])
        res.update(bytes=total, blobs=len(doc["layers"]), digest=pushed["digest"])
        print(f"artifact: {len(doc['layers'])} layers, {total / 1e6:.0f} MB", file=sys.stderr)
        for i in range(a.rounds):
            rnd: dict = {}
            root = private(work / f"full-{i}")
            t0 = time.monotonic()
            full = cli("--root", str(root), "pull", image, "--plain-http", "--name", "s")
            rnd["full_s"] = round(time.monotonic() - t0, 3)
            rnd["full_fetched_bytes"] = full["fetched_bytes"]
            shutil.rmtree(root)

            root = private(work / f"resume-{i}")
            mark = len(reg.requests_log())
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "--root", str(root), "pull", image,
                                     "--plain-http", "--name", "s"], cwd=HERE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            while proc.poll() is None and sent_bytes(reg, mark, sizes) < a.kill_at * total:
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            if proc.wait() != -signal.SIGKILL:
                raise SystemExit("the pull finished before it could be killed")
            rnd["killed_after_s"] = round(time.monotonic() - t0, 3)
            time.sleep(1)
            rnd["sent_before_kill_bytes"] = sent_bytes(reg, mark, sizes)
            t0 = time.monotonic()
            again = cli("--root", str(root), "pull", image, "--plain-http", "--name", "s")
            rnd["resume_s"] = round(time.monotonic() - t0, 3)
            rnd.update(resume_fetched_bytes=again["fetched_bytes"], reused_bytes=again["reused_bytes"],
                       reused_blobs=again["reused_blobs"])
            rnd["time_ratio"] = round(rnd["resume_s"] / rnd["full_s"], 3)
            rnd["bytes_ratio"] = round(rnd["resume_fetched_bytes"] / max(1, rnd["full_fetched_bytes"]), 3)
            shutil.rmtree(root)
            print(f"round {i}: full {rnd['full_s']:.2f} s / {rnd['full_fetched_bytes'] / 1e6:.0f} MB; killed after "
                  f"{rnd['killed_after_s']:.2f} s ({rnd['sent_before_kill_bytes'] / 1e6:.0f} MB sent); resumed "
                  f"{rnd['resume_s']:.2f} s / {rnd['resume_fetched_bytes'] / 1e6:.0f} MB fetched, "
                  f"{rnd['reused_bytes'] / 1e6:.0f} MB reused -> time x{rnd['time_ratio']}, bytes "
                  f"x{rnd['bytes_ratio']}", file=sys.stderr)
            res["rounds"].append(rnd)
        res["load"] = os.getloadavg()
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
    emit(res, a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
