"""Part C of scripts/gpu_check.sh: dump and restore a CUDA process tree the way vllm-snapshot
does, to prove on a GPU what the product's GPU path needs (issue 20 item 7).

What is the product's and what is not:

* CRIU runs through pycriu ``criu swrk`` via :class:`vllm_snapshot.criu.Criu`, with the
  environment the product gives it (``CRIU_LIBS_DIR`` = the plugin directory, our
  ``cuda-checkpoint`` wrapper first on ``PATH``: :func:`vllm_snapshot.criu.cuda_env`'s two
  variables), the product's flags (:data:`vllm_snapshot.criu.SHARED_FLAGS`), its freeze
  timeout (:func:`vllm_snapshot.criu.freeze_timeout`), ``--root /`` and restore-sibling.
  Afterwards the product's own checks run: :func:`vllm_snapshot.criu.check_cuda_run` on both
  logs, :func:`vllm_snapshot.gpu.restored_states` / ``check_restored`` on the restored tree.
* The tree is PID 1 of its own PID + mount + network namespace, started with the product's
  ``unshare`` arguments (CRIU ``--network-lock skip`` as the product), and its root brings
  ``lo`` up and applies the product's mount policy first
  (:func:`vllm_snapshot.engine.mounts.make_private`: host mounts it does not need detached,
  private tmpfs on /dev/shm); the mounts CRIU gets as external ones come from
  :mod:`vllm_snapshot.mountpolicy`, as at create. A **non-CUDA root** (like vLLM's API
  process) and one CUDA child (like EngineCore); stdio opened inside the namespace, all other
  fds closed. (A GPU container's bind-mounted driver files or /dev/nvidia* nodes that the
  policy detached would show here as a child that cannot start CUDA.)
* The child holds a deterministic torch CUDA state: a "weights" tensor (int32, seeded
  generator) and a small "runtime" tensor. ``sleep`` frees the weights and empties the caching
  allocator (like vLLM's level-2 sleep discarding weights), the dump happens asleep, and after
  restore ``wake`` re-allocates and regenerates them (like the reload) and answers a checksum:
  a kernel launch on the restored context plus a device-to-host copy of every byte, compared
  with the answer before the dump. vLLM itself is not run (it does not fit the 64 MiB carry).

``--fake`` runs the same sequence without torch or a GPU: the child is a plain Python
process with a thread named ``fakecuda-rst`` and the checksum is over host bytes; with
tests/fakecuda first on PYTHONPATH and ``CRIU_FAULT=138`` this exercises the harness through
real CRIU on a CPU host (tests/test_gpu_check_script.py).

Usage: python scripts/gpu_check_tree.py --criu BIN --plugin-dir DIR --out DIR [--mib N] [--fake]
Prints one ``RESULT PASS|FAIL name: detail`` line per check and exits 0 (all passed) or 1.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = r'''
import ctypes, hashlib, json, os, signal, sys, threading, time
os.closerange(3, 1 << 16)
out_path, mib, fake = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fake"
pending = []
for sig, name in ((signal.SIGUSR1, "answer"), (signal.SIGUSR2, "sleep"), (signal.SIGHUP, "wake")):
    signal.signal(sig, lambda *_, n=name: pending.append(n))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
n = mib * 1024 * 1024 // 4
if fake:
    def rst():
        ctypes.CDLL(None).prctl(15, b"fakecuda-rst", 0, 0, 0)
        threading.Event().wait()
    threading.Thread(target=rst, daemon=True).start()
    def make():
        return bytearray(hashlib.shake_256(b"weights-20250101").digest(n * 4))
    def checksum(w):
        return "sum=%d sha=%s" % (sum(w[::4096]), hashlib.sha256(w).hexdigest()[:16])
    runtime = None
else:
    import torch
    def make():
        g = torch.Generator(device="cuda").manual_seed(20250101)
        return torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=g)
    def checksum(w):
        s = int(w.sum(dtype=torch.int64).item())  # a kernel launch on the (restored) context
        h = hashlib.sha256()
        for c in w.split(1 << 24):
            c = c.cpu()  # device-to-host copies of every byte
            h.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
        m = (runtime.float() @ runtime.float().T).sum().item()  # a cuBLAS kernel, deterministic inputs
        return "sum=%d sha=%s mm=%r" % (s, h.hexdigest()[:16], m)
    runtime = torch.arange(64 * 64, dtype=torch.int32, device="cuda").reshape(64, 64) % 7
    torch.cuda.synchronize()
weights = make()
out = open(out_path, "a", buffering=1)
out.write(json.dumps({"event": "ready", "pid": os.getpid(), "checksum": checksum(weights)}) + "\n")
while True:
    while pending:
        what = pending.pop(0)
        if what == "sleep":
            weights = None
            if not fake:
                torch.cuda.synchronize(); torch.cuda.empty_cache()
            out.write(json.dumps({"event": "slept"}) + "\n")
        elif what == "wake":
            weights = make()
            out.write(json.dumps({"event": "woken"}) + "\n")
        else:
            out.write(json.dumps({"event": "answer", "checksum": checksum(weights)}) + "\n")
    time.sleep(0.05)
'''

ROOT = r'''
import os, subprocess, sys, time
os.closerange(3, 1 << 16)
os.setsid()  # as the engine root: the session leader must be inside the namespace (CRIU)
from vllm_snapshot.engine.mounts import make_private, needed_paths, _open_and_mapped
from vllm_snapshot.engine.net import loopback_up
# the engine root's own set-up (engine/main.py runs it first): detach what is not needed, lo up
detached = make_private(needed_paths(None, dict(os.environ), [os.path.dirname(sys.argv[1]), *_open_and_mapped()]))
loopback_up()
print("detached:", detached, flush=True)
child = subprocess.Popen([sys.executable, "-W", "ignore", "-c", open(sys.argv[1]).read(), *sys.argv[2:]],
                         stdin=subprocess.DEVNULL, stdout=open(sys.argv[2] + ".stdout", "ab"),
                         stderr=subprocess.STDOUT, close_fds=True)
while True:
    time.sleep(3600)  # the non-CUDA root, like vLLM's API process
'''

RESULTS: list[tuple[str, str, str]] = []


def result(status: str, name: str, detail: str = "") -> None:
    RESULTS.append((status, name, detail))
    print(f"RESULT {status} {name}" + (f": {detail}" if detail else ""), flush=True)


def events(path: Path) -> list[dict]:
    try:
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, ValueError):
        return []


def wait_event(path: Path, name: str, nth: int, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [e for e in events(path) if e.get("event") == name]
        if len(got) >= nth:
            return got[nth - 1]
        time.sleep(0.1)
    return None


def tree_pids(root: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(root)
        return [root] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--criu", required=True)
    ap.add_argument("--plugin-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--fake", action="store_true", help="no torch/GPU: see the module docstring")
    a = ap.parse_args()

    from vllm_snapshot import criu, cuda_checkpoint, gpu
    from vllm_snapshot.errors import SnapshotError

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:  # the product's mount policy; it needs pydantic + blake3 (the manifest's records)
        from vllm_snapshot import mountpolicy
    except ImportError as e:
        mountpolicy = None
        print(f"note: vllm_snapshot.mountpolicy unavailable ({e}): no external mounts passed to CRIU", flush=True)
    from vllm_snapshot.engine.mounts import ENGINE_TMPDIR

    os.makedirs(ENGINE_TMPDIR, mode=0o700, exist_ok=True)  # the private tmpfs' mount point (as supervisor.launch)
    # on the repo's disk: /tmp may be a tmpfs the tree's mount policy would treat differently
    work = Path(tempfile.mkdtemp(prefix=".gpu-check-tree.", dir=REPO))
    os.chmod(work, 0o755)
    evf = work / "child.events"
    (work / "child.py").write_text(CHILD)
    (work / "root.py").write_text(ROOT)
    helper_dir = cuda_checkpoint.helper_dir(work / "cache")
    env = {"CRIU_LIBS_DIR": a.plugin_dir, "PATH": f"{helper_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    helper_env = {**os.environ, **env}

    def helper(args):
        t0 = time.monotonic()
        p = subprocess.run(["cuda-checkpoint", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=helper_env, cwd="/", stdin=subprocess.DEVNULL, timeout=120)
        print(f"helper {' '.join(args)} -> {p.returncode} in {1000 * (time.monotonic() - t0):.0f} ms", flush=True)
        return p.returncode, p.stdout

    restored = None
    root = None
    try:
        # the tree: PID 1 of its own PID + mount namespace, stdio opened inside it
        cmd = (f"exec {sys.executable} -W ignore {work / 'root.py'} {work / 'child.py'} {evf} {a.mib} "
               f"{'fake' if a.fake else 'cuda'} </dev/null >{work / 'root.stdout'} 2>&1")
        root_env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
        # supervisor.launch's arguments
        launcher = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                                     "--net", "--kill-child", "--", "sh", "-c", cmd], env=root_env, cwd="/",
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    close_fds=True, start_new_session=True)
        ready = wait_event(evf, "ready", 1, 240)
        if ready is None:
            said = [(work / f).read_text(errors="replace")[-600:] for f in ("root.stdout", "child.events.stdout")
                    if (work / f).exists()]
            result("FAIL", "C tree start", " | ".join(said) or "no output")
            return 1
        # the namespace's init is the unshare child; the root is its only child
        import psutil

        kids = psutil.Process(launcher.pid).children()
        root = kids[0].pid if kids else None
        pids = tree_pids(root) if root else []
        child = ready["pid"]  # a namespace PID; the host PID is the root's child
        host_child = pids[1] if len(pids) > 1 else None
        result("PASS", "C tree started", f"root (no CUDA) {root}, child {host_child} (ns pid {child}): {ready['checksum']}")
        ref = ready["checksum"]
        rc, text = helper(["--get-restore-tid", "--pid", str(root)])
        result("PASS" if rc == 1 else "FAIL", "C root has no CUDA", f"--get-restore-tid exit {rc}: {text.strip()[:160]}")
        rc, text = helper(["--get-state", "--pid", str(host_child)])
        result("PASS" if (rc, text.strip()) == (0, "running") else "FAIL", "C child is a running CUDA process",
               f"exit {rc}: {text.strip()[:160]}")
        os.kill(host_child, signal.SIGUSR2)  # sleep: free the weights, empty the allocator
        if wait_event(evf, "slept", 1, 60) is None:
            result("FAIL", "C sleep", "no answer")
            return 1
        result("PASS", "C sleep (weights freed)")

        images = work / "images"
        images.mkdir()
        timeout = criu.freeze_timeout("cuda", len(pids), 1, dict(os.environ))
        runner = criu.Criu(a.criu, env, keep_log_dir=out)
        externals = mountpolicy.describe_externals(root) if mountpolicy else []
        print(f"external mounts: {[e.mount_point for e in externals]}", flush=True)
        ext_dump = mountpolicy.dump_args(externals) if mountpolicy else ()
        ext_restore = mountpolicy.restore_args(externals) if mountpolicy else ()
        t0 = time.monotonic()
        try:
            runner.dump(criu.DumpOptions(pid=root, timeout_s=timeout, external=ext_dump,
                                         network_lock=criu.NETWORK_LOCK_ISOLATED), images, images)
            criu.check_cuda_run(images / criu.DUMP_LOG, "dump", out)
        except SnapshotError as e:
            result("FAIL", "C criu dump (swrk, product env)", f"{e.message} {e.hint or ''}"[:1500])
            return 1
        finally:
            shutil.copy(images / criu.DUMP_LOG, out / "partC-dump.log") if (images / criu.DUMP_LOG).exists() else None
        result("PASS", "C criu dump (swrk, product env)", f"{time.monotonic() - t0:.1f} s, --timeout {timeout} s, "
               f"images {sum(f.stat().st_size for f in images.iterdir()) >> 20} MiB")
        launcher.wait(timeout=30)  # the namespace is gone with its init
        time.sleep(1)

        t0 = time.monotonic()
        try:
            restored = runner.restore(criu.RestoreOptions(external=ext_restore, network_lock=criu.NETWORK_LOCK_ISOLATED), images, images)
            criu.check_cuda_run(images / criu.RESTORE_LOG, "restore", out)
            rpids = tree_pids(restored)
            gpu.check_restored(gpu.restored_states(rpids, helper))
        except SnapshotError as e:
            result("FAIL", "C criu restore (swrk, product env, product checks)", f"{e.message} {e.hint or ''}"[:1500])
            return 1
        finally:
            if (images / criu.RESTORE_LOG).exists():
                shutil.copy(images / criu.RESTORE_LOG, out / "partC-restore.log")
        result("PASS", "C criu restore (swrk, product env, product checks)",
               f"{time.monotonic() - t0:.1f} s, root {restored}, every CUDA process running")
        new_child = rpids[1] if len(rpids) > 1 else None
        os.kill(new_child, signal.SIGHUP)  # wake: re-allocate and regenerate the weights
        if wait_event(evf, "woken", 1, 120) is None:
            result("FAIL", "C wake (re-allocate on the restored context)", "no answer")
            return 1
        os.kill(new_child, signal.SIGUSR1)
        ans = wait_event(evf, "answer", 1, 120)
        got = ans and ans["checksum"]
        result("PASS" if got == ref else "FAIL", "C same output after restore + wake", f"{got} vs {ref}")
        return 0 if all(s == "PASS" for s, _, _ in RESULTS) else 1
    finally:
        if restored:
            criu.kill_restored_children()
        if root:
            try:
                os.kill(root, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in ("child.events", "child.events.stdout", "root.stdout"):
            if (work / f).exists():
                shutil.copy(work / f, out / f"partC-{f}")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
