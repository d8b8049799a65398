#!/usr/bin/env python3
"""Benchmark of the fleet, measured on loopback in one run:

* push and pull throughput (MB/s of layer bytes) through a real registry (Debian's
  docker-registry on 127.0.0.1, filesystem storage) and an ``oci:`` layout, against a plain
  ``cp -a`` of the same snapshot directory (alone, and followed by ``sync`` of the copy: pull
  fsyncs what it writes), for ``--compress none`` and zstd frames;
* "fresh node -> first validated completion": pull into an empty store + restore, against a
  cold start (``vllm serve``'s API server, same engine args) on the same machine;
* our pull beside other clients' pulls of the same artifact from the same registry, in the
  same run: ``skopeo copy docker://... oci:DIR`` (Debian's skopeo, when installed) and
  oras-py's ``OrasClient.pull`` (when the ``oras`` package is importable); a client that is
  not installed is reported as such, not timed.

Run with the project's venv as root:

    /var/cache/vllm-snapshot/venv/bin/python scripts/bench_fleet.py [--compress none --compress zstd:3]
        [--json-out F] [--no-cold-start] [-- ENGINE ARGS]

The registry, the store and the copies share one disk and the page cache is warm (the bytes
were just written): these are the tool's and the protocol's costs, not a network's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_snapshot import ops  # noqa: E402
from vllm_snapshot.dev import bench, tiny_model  # noqa: E402
from vllm_snapshot.dev.registry_server import RegistryServer  # noqa: E402
from vllm_snapshot.effects.tools import local_tools  # noqa: E402
from vllm_snapshot.ops import fleet  # noqa: E402
from vllm_snapshot.report.progress import Reporter  # noqa: E402
from vllm_snapshot.store import archive, weights  # noqa: E402


def other_pulls(host: str, image: str, work: Path) -> dict:
    """Seconds of other clients' pulls of ``image`` (``HOST/REPO:TAG`` on the loopback
    registry ``host``) into fresh directories under ``work``: ``skopeo copy`` to an ``oci:``
    layout, oras-py's pull; each None with a ``*_missing`` reason when not installed, or an
    ``*_error`` when it failed."""
    out: dict = {}
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        out["skopeo_s"], out["skopeo_missing"] = None, "skopeo is not installed (apt-get install skopeo)"
    else:
        dst = work / "skopeo-oci"
        shutil.rmtree(dst, ignore_errors=True)
        t0 = time.monotonic()
        p = subprocess.run([skopeo, "copy", "--src-tls-verify=false", f"docker://{image}", f"oci:{dst}:x"],
                           capture_output=True, text=True)
        out["skopeo_s"] = round(time.monotonic() - t0, 3) if p.returncode == 0 else None
        if p.returncode:
            out["skopeo_error"] = p.stderr.strip()[-500:]
        shutil.rmtree(dst, ignore_errors=True)
    try:
        import oras.client  # noqa: F401
    except ImportError:
        out["oras_s"], out["oras_missing"] = None, "oras-py is not installed (pip install oras)"
    else:
        dst = work / "oras-out"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(mode=0o700)
        t0 = time.monotonic()
        try:
            oras.client.OrasClient(hostname=host, insecure=True).pull(target=image, outdir=str(dst))
            out["oras_s"] = round(time.monotonic() - t0, 3)
        except Exception as e:  # noqa: BLE001 - another client's failure is a result, not ours
            out["oras_s"], out["oras_error"] = None, str(e)[-500:]
        shutil.rmtree(dst, ignore_errors=True)
    return out


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and p.name != "manifest.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    ap.add_argument("--compress", action="append", default=None)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--no-cold-start", action="store_true",
                    help="skip the cold start (a before/after pair of runs where the other one measures it)")
    ap.add_argument("engine_args", nargs="*")
    a = ap.parse_args()
    comps = a.compress or ["none", "zstd:3"]
    if a.model is None:
        a.model = str(tiny_model.generate(tiny_model.default_model_dir()))
    engine_args = a.engine_args or list(tiny_model.ENGINE_ARGS)
    t = local_tools()
    work = Path(tempfile.mkdtemp(prefix="vsnap-fleet-bench-", dir="/var/tmp"))
    os.chmod(work, 0o700)
    reg = RegistryServer(work / "registry", access_log=False)
    host = reg.host
    res: dict = {"model": a.model, "engine_args": engine_args, "runs": {}}
    try:
        res["load_before"] = [round(x, 2) for x in os.getloadavg()]
        for comp in comps:
            tag = comp.replace(":", "-")
            snap = work / "node-a" / f"snap-{tag}"
            snap.parent.mkdir(mode=0o700, exist_ok=True)
            print(f"{comp}: create ...", file=sys.stderr)
            ops.create(ops.CreateRequest(model=a.model, target=snap, engine_args=engine_args,
                                         compression=archive.Compression.parse(comp)), Reporter())
            size = dir_bytes(snap)
            run: dict = {"bytes": size}
            subprocess.run(["sync"], check=True)
            t0 = time.monotonic()
            subprocess.run(["cp", "-a", str(snap), str(work / f"copy-{tag}")], check=True)
            run["cp_s"] = round(time.monotonic() - t0, 3)
            # pull fsyncs what it wrote; the fair copy is the copy on disk too
            subprocess.run(["sync", "-f", str(work / f"copy-{tag}")], check=True)
            run["cp_sync_s"] = round(time.monotonic() - t0, 3)
            shutil.rmtree(work / f"copy-{tag}")
            for kind, image in (("registry", f"{host}/bench/tiny:{tag}"), ("oci", f"oci:{work / 'layout'}:{tag}")):
                push_rep, pull_rep = Reporter(), Reporter()
                r = fleet.push(fleet.PushRequest(snap, image, plain_http=True), push_rep, t)
                root = work / f"node-b-{kind}-{tag}"
                root.mkdir(mode=0o700)
                p = fleet.pull(fleet.PullRequest(image, root, "tiny", plain_http=True), pull_rep, t)
                # push_s: hashing + upload (not the checksum pass before it); pull_s: manifest to publish
                run[kind] = {"push_s": r.seconds, "pull_s": p.seconds,
                             "push_phases": {k: round(v, 3) for k, v in push_rep.timings.items()},
                             "pull_phases": {k: round(v, 3) for k, v in pull_rep.timings.items()}}
                print(f"  {kind}: push {r.seconds:.2f} s, pull {p.seconds:.2f} s, cp {run['cp_s']:.2f} s "
                      f"({size / 1e6:.0f} MB)", file=sys.stderr)
                if kind == "registry":  # the same artifact, other clients, this run
                    others = other_pulls(host, image, work)
                    run[kind]["others"] = others

                    def show(k: str) -> str:
                        return (f"{others[k + '_s']:.2f} s" if others.get(k + "_s") is not None
                                else others.get(k + "_missing") or "failed: " + others.get(k + "_error", "?"))
                    print(f"  registry pull side by side: ours {p.seconds:.2f} s, skopeo copy to oci: "
                          f"{show('skopeo')}, oras-py {show('oras')}", file=sys.stderr)
                if kind == "registry":  # a fresh node: pull + restore -> first validated completion
                    shutil.rmtree(root)
                    root.mkdir(mode=0o700)
                    fresh_pull, fresh_restore = Reporter(), Reporter()
                    t0 = time.monotonic()
                    pulled = fleet.pull(fleet.PullRequest(image, root, "tiny", plain_http=True), fresh_pull, t)
                    rr, engine = ops.restore(ops.RestoreRequest(snapshot=Path(pulled.snapshot),
                                                                port=bench.free_port()), fresh_restore)
                    run["fresh_node_s"] = round(time.monotonic() - t0, 3)
                    run["fresh_node_pull_s"] = pulled.seconds
                    # where the fresh node's seconds went (each phase as its reporter timed it)
                    run["fresh_node_pull_phases"] = {k: round(v, 3) for k, v in fresh_pull.timings.items()}
                    run["fresh_node_restore_phases"] = {k: round(v, 3) for k, v in fresh_restore.timings.items()}
                    run["images_bytes"] = {f.name: f.stat().st_size for f in sorted((snap / "images").glob("pages-*.img"))}
                    engine.kill(grace=15)
                    engine.close()
                    t.runtime.unregister(rr.pid)
                    print(f"  fresh node pull + restore -> validated completion {run['fresh_node_s']:.2f} s",
                          file=sys.stderr)
                shutil.rmtree(root)
            res["runs"][comp] = run
        if not a.no_cold_start:
            print("cold start -> first completion ...", file=sys.stderr)
            res["cold_start_s"] = round(bench.cold_start(Path(a.model), bench.free_port(), engine_args), 3)
            print(f"  {res['cold_start_s']:.2f} s", file=sys.stderr)
        res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        reg.stop()
        for w in work.glob("*/.weights/*.weights"):  # immutable once published: rmtree alone leaves them
            with contextlib.suppress(OSError):
                weights.unprotect(w)
        shutil.rmtree(work, ignore_errors=True)
    for comp, run in res["runs"].items():
        mb = run["bytes"] / 1e6
        run["cp_MB_s"] = round(mb / run["cp_s"], 1)
        run["cp_sync_MB_s"] = round(mb / run["cp_sync_s"], 1)
        for kind in ("registry", "oci"):
            run[kind]["push_MB_s"] = round(mb / run[kind]["push_s"], 1)
            run[kind]["pull_MB_s"] = round(mb / run[kind]["pull_s"], 1)
    bench.emit(res, a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
