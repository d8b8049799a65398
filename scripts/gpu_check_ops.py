"""Part D of scripts/gpu_check.sh: the product's own ``create`` and ``restore`` (``ops.create``,
``ops.restore``, then ``ops.stop_engines``) of a CUDA engine, through the product's seam
(:func:`vllm_snapshot.effects.tools.local_tools` with ``engine_argv``), instead of part C's
re-sequencing of their CRIU calls. Once this passes on a GPU, part C can go.

The engine is :mod:`vllm_snapshot.dev.gpu_engine` (vLLM does not fit the 64 MiB carry): it speaks
the engine protocol, is a non-CUDA root with one CUDA child that holds a VMM range as vLLM's
level-2 sleep leaves it (reserved, physical memory released at ``sleep``; created and mapped at
the same VA and the weights copied back at ``wake`` -- from the weights file create wrote from
the GPU memory and the child keeps open, as a GPU vLLM engine made with ``--weights file`` does,
or with ``--weights in-image`` from the model directory), and its oracle is a checksum computed
on that GPU memory. So everything create and restore do runs as for
vLLM: the preconditions, the engine start through the supervisor (PID + mount + network
namespace, scrubbed environment, mount policy, the engine user), the sleep rehearsal (sleep,
wake, oracle, canary record, sleep), prepare-dump, the inventory and the GPU evidence, the CRIU dump with the
CUDA plugin and our helper, packing and publishing; then validation, staging, the CRIU restore,
``attach``, the wake, the oracle (which must match: the wake's proof), the image and code
checks, the bind, ``/health`` and the HTTP canary; then ``stop``. Afterwards one more
completion over HTTP must give the recorded oracle again.

``--fake`` runs it without a GPU: the fake ``cuda.bindings.driver`` of tests/fakecuda (copied
next to the package; tests/fakecuda first on PYTHONPATH for CRIU's helper, ``CRIU_FAULT=138``)
and :mod:`vllm_snapshot.dev.fakegpu`'s GPU checks (no nvidia-smi here). ``--break-restored-wake
no-reload|no-remap`` gives the engine a wake that does not bring the weights back after the
restore (tests: part D must then fail).

Like part C it runs a copy of the package under ``/var/lib/vllm-snapshot-gpu-check`` (readable
by the engine user wherever the repo is), and its model and snapshot are there too.

Usage: python scripts/gpu_check_ops.py --criu BIN --user NAME --out DIR [--mib N] [--fake]
[--break-restored-wake MODE]. ``BIN`` in a CRIU source layout, as for part C. Prints one
``RESULT PASS|FAIL|INFO name: detail`` line per check and exits 0 (all passed) or 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_tree import RESULTS, WORK_PARENT, copy_package, result  # part C's (this script's directory)

#: The engine calls create's sleep rehearsal makes, then the dump's (the engine's log, ``CALL``).
#: (``oracle`` twice: the oracle, then the HTTP canary's record asked with its prompt)
REHEARSAL = ["sleep", "wake", "oracle", "oracle", "sleep", "prepare-dump"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--criu", required=True, help="the criu binary, in a CRIU source layout")
    ap.add_argument("--user", required=True, help="the engine user (non-root)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=256, help="the model's weights (the VMM range), MiB")
    ap.add_argument("--fake", action="store_true", help="no torch/GPU: see the module docstring")
    ap.add_argument("--break-restored-wake", choices=("no-reload", "no-remap"), help="tests: a broken wake")
    ap.add_argument("--weights", choices=("file", "in-image"), default="file",
                    help="the wake's source: the weights file (default) or the model directory")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # gpu_check.sh's timeout: still clean up

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK_PARENT.mkdir(mode=0o755, exist_ok=True)
    os.chmod(WORK_PARENT, 0o755)
    work = Path(tempfile.mkdtemp(prefix="ops.", dir=WORK_PARENT))
    os.chmod(work, 0o755)
    print(f"work dir {work}", flush=True)
    pkg = copy_package(work, a.fake)
    sys.path.insert(0, str(pkg))  # engine_import_env then names the copy, as the product names its package
    os.environ["VLLM_SNAPSHOT_CRIU"] = a.criu
    os.environ["VLLM_SNAPSHOT_CACHE"] = str(work / "cache")  # the helper wrapper's dir: this run's own
    os.environ["VLLM_SNAPSHOT_LOG_DIR"] = str(work / "logs")  # kept engine and CRIU logs, copied to OUT
    # no vLLM here, so the product calls this host a CPU host (gpu.engine_device) until the
    # engine says "cuda": create's CPU check wants the KV cache sized
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        return run(a, out, work)
    finally:
        logs = work / "logs"
        if logs.is_dir():
            shutil.copytree(logs, out / "partD-logs", dirs_exist_ok=True)
        subprocess.run(["chattr", "-R", "-i", str(work)], capture_output=True)  # a published weights file
        shutil.rmtree(work, ignore_errors=True)


def lines():
    """A :class:`~vllm_snapshot.report.progress.Reporter` that prints each phase with its seconds
    and each info line (into partD.txt); imported late: the package is the work dir's copy."""
    from vllm_snapshot.report.progress import Reporter

    class Lines(Reporter):
        def end(self, name, label, seconds, ok):
            print(f"  phase {name}: {seconds:.2f} s{'' if ok else ' (failed)'}", flush=True)

        def info(self, text):
            print(f"  info: {text}", flush=True)

    return Lines()


def _err(e) -> str:
    return f"{type(e).__name__}: {getattr(e, 'message', e)} {getattr(e, 'hint', '') or ''}".strip()[:1500]


def run(a, out: Path, work: Path) -> int:
    """The sequence (see the module doc); ``work`` is removed by the caller."""
    try:
        from vllm_snapshot import ops
        from vllm_snapshot.dev import free_port, gpu_engine
        from vllm_snapshot.effects import http
        from vllm_snapshot.effects.tools import local_tools
        from vllm_snapshot.host import privilege
        from vllm_snapshot.store import layout
    except ImportError as e:
        result("FAIL", "D harness imports", f"{e} (gpu_check.sh installs the carried wheels: run scripts/gpu_carry.sh "
                                            "and carry .criu-carry)")
        return 1
    try:
        privilege.lookup(a.user)
    except KeyError:
        result("FAIL", "D engine user", f"no user {a.user!r} ({privilege.USERADD_HINT})")
        return 1
    tools = local_tools(engine_argv=gpu_engine.ENGINE_ARGV)
    if a.fake:
        from vllm_snapshot.dev.fakegpu import FakeGpuCheckpoint, FakeGpuHost

        tools = dataclasses.replace(tools, checkpoint=FakeGpuCheckpoint(tools.checkpoint.criu),
                                    host=FakeGpuHost(tools.host.criu))
    model = gpu_engine.write_model(work / "model", a.mib)
    (work / "snaps").mkdir(mode=0o755)
    snap = work / "snaps" / "gpu-check"

    print("== create", flush=True)
    t0 = time.monotonic()
    try:
        m = ops.create(ops.CreateRequest(
            model=str(model), target=snap, sleep_level=2, user=a.user, weights=a.weights,
            engine_args=["--break-restored-wake", a.break_restored_wake] if a.break_restored_wake else []),
            lines(), tools=tools).manifest
    except Exception as e:  # noqa: BLE001 - SnapshotError with its hint; anything else is a finding too
        result("FAIL", "D create (ops.create)", _err(e))
        return 1
    finally:
        for f in (layout.CREATE_LOG, layout.DUMP_LOG):
            if (snap / f).exists():
                shutil.copy(snap / f, out / f"partD-{f}")
    result("PASS", "D create (ops.create)",
           f"{time.monotonic() - t0:.1f} s, engine {m.engine.kind}, sleep level {m.engine.sleep_level}, CUDA PIDs "
           f"{list(m.criu.cuda_pids)} of {list(m.criu.tree_pids)}, GPU {m.host.get('gpu_uuid_used')}, freeze timeout "
           f"{m.criu.freeze_timeout_s} s, images {m.sizes['raw'] >> 20} MiB, oracle {m.oracle.text!r}")
    calls = [ln.split()[1] for ln in (snap / layout.CREATE_LOG).read_text(errors="replace").splitlines()
             if ln.startswith("CALL ")]
    result("PASS" if calls == REHEARSAL else "FAIL", "D create's sleep rehearsal, then prepare-dump",
           f"the engine's commands {calls}" + ("" if calls == REHEARSAL else f" (expected {REHEARSAL})"))
    dump_log = (snap / layout.DUMP_LOG).read_text(errors="replace")
    # the plugin logs host PIDs (the manifest's tree_pids); the CUDA holders are recorded by
    # their PIDs in the engine's namespace, where the root is 1
    root, children, cuda_ns = m.criu.tree_pids[0], m.criu.tree_pids[1:], list(m.criu.cuda_pids)
    plugin_ok = (m.engine.kind == "cuda" and m.engine.sleep_level == 2 and len(cuda_ns) == 1 and cuda_ns[0] != 1
                 and len(children) == 1 and f"no need to pause devices on pid {root}" in dump_log
                 and f"Checkpointing CUDA devices on pid {children[0]}" in dump_log)
    result("PASS" if plugin_ok else "FAIL", "D the plugin checkpointed the CUDA child, not the root",
           f"tree {list(m.criu.tree_pids)}, CUDA holders (namespace PIDs) {cuda_ns}; see partD-{layout.DUMP_LOG}")

    if a.weights == "file":
        w = m.weights
        result("PASS" if w is not None and w.use == "wake" and w.mapped_bytes == a.mib << 20 else "FAIL",
               "D create wrote the weights file from the GPU memory (the wake's source)",
               f"{w.path}, {w.mapped_bytes} bytes, use {w.use}" if w is not None else "no weights file in the manifest")

    print("== restore", flush=True)
    port = free_port()
    t0 = time.monotonic()
    try:
        r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port, detach=True), lines(), tools=tools)
    except Exception as e:  # noqa: BLE001 - as for create
        result("FAIL", "D restore (ops.restore with wake, oracle, canary)", _err(e))
        return 1
    try:
        result("PASS", "D restore (ops.restore with wake, oracle, canary)",
               f"{time.monotonic() - t0:.1f} s, root {r.pid}, {r.url}, {r.gpu or 'no GPU recorded'}, phases "
               + ", ".join(f"{k} {v:.2f} s" for k, v in r.timings.items()))
        if a.weights == "file" and m.weights is not None:  # CRIU re-opened it for the engine user
            import psutil

            held = {p.pid: [f.path for f in p.open_files()] for p in psutil.Process(r.pid).children(recursive=True)}
            ok = any(m.weights.path in paths for paths in held.values())
            result("PASS" if ok else "FAIL", "D the restored CUDA child holds the weights file open",
                   f"open files of the tree's children: {held}")
        try:  # one more completion, computed on the GPU memory now
            status, body = http.http_json(f"{r.url}/v1/completions", http.canary_request(m), timeout=120)
            got = body["choices"][0]["text"] if status == 200 and isinstance(body, dict) else f"HTTP {status}: {body}"
        except Exception as e:  # noqa: BLE001
            got = _err(e)
        result("PASS" if got == m.oracle.text else "FAIL", "D same output after restore + wake",
               f"{got!r} vs {m.oracle.text!r} (recorded at create)")
        print("== stop", flush=True)
        try:
            stopped = ops.stop_engines(snap, None, tools=tools)
            rows = stopped.stopped
            ok = len(rows) == 1 and rows[0]["pid"] == r.pid and not rows[0]["killed"]
            result("PASS" if ok else "FAIL", "D stop (ops.stop_engines)", f"{rows or stopped.nothing}")
        except Exception as e:  # noqa: BLE001
            result("FAIL", "D stop (ops.stop_engines)", _err(e))
    finally:
        if engine.alive():  # what stop left (or a failed step before it)
            engine.kill(grace=5)
        engine.close()
        try:
            tools.runtime.unregister(r.pid)
        except OSError as e:
            print(f"could not unregister the engine {r.pid}: {e}", flush=True)
    if a.fake:
        log = Path(os.environ.get("FAKE_CUDA_DIR", "/nonexistent"), "calls.log")
        seen = [ln.split()[0] for ln in (log.read_text().splitlines() if log.exists() else [])
                if not ln.startswith("get-restore-tid")]
        want = ["lock", "checkpoint", "restore", "unlock"]
        result("PASS" if seen == want else "FAIL", "D the fake driver's checkpoint calls", f"{seen} (expected {want})")
    return 0 if all(s in ("PASS", "INFO") for s, _, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
