"""Part C of scripts/gpu_check.sh: checkpoint and restore a CUDA process tree the way
vllm-snapshot's create and restore do, to prove on a GPU what the product's GPU path needs
(issue 20 item 7, issue 33 item 2).

What is the product's and what is not:

* CRIU runs through the product's own calls: :func:`vllm_snapshot.effects.tools.local_tools`
  ``dump("cuda", ...)`` and ``restore_tree("cuda", ...)`` (pycriu ``criu swrk``, the CUDA
  plugin paired with the binary given as ``$VLLM_SNAPSHOT_CRIU`` through ``CRIU_LIBS_DIR``, our
  ``cuda-checkpoint`` wrapper first on CRIU's ``PATH``, the helper probe before CRIU, CRIU with
  the tree's real ids where root lacks CAP_SYS_RESOURCE, the host-wide CRIU lock, the plugin log
  checks, and after the restore every CUDA process ``running``), with the options create and
  restore build: the external mounts of :mod:`vllm_snapshot.checkpoint.mountpolicy`, the isolated network
  lock, and :func:`vllm_snapshot.checkpoint.criu.freeze_timeout` for the tree :func:`inventory.inspect_tree`
  finds (the checks create makes before the dump).
* The tree is PID 1 of its own PID + mount + network namespace, started with
  ``supervisor.launch``'s ``unshare`` arguments, with the product's engine environment
  (:func:`vllm_snapshot.host.envpolicy.scrubbed_env` for the engine user, plus
  :func:`~vllm_snapshot.supervise.supervisor.engine_import_env`'s PYTHONPATH), cwd the work dir. Its root
  does what ``entrypoints/engine_root.py`` does before vLLM: :func:`vllm_snapshot.engine.mounts.make_private`
  (the product's own needed paths), ``lo`` up, then :func:`vllm_snapshot.host.privilege.drop_to` the
  engine user for good. It is a **non-CUDA root** (like vLLM's API process) with one CUDA child
  (like EngineCore); stdio opened inside the namespace, all other fds closed. A driver that the
  mount policy detached, or that the scrubbed environment cannot find, shows here as a child
  that cannot start CUDA ("C tree start").
* The child reproduces vLLM's level-2 sleep state with the driver API (``cuda.bindings.driver``,
  as vLLM's csrc/cumem_allocator.cpp does it): ``cuMemAddressReserve`` a VA range,
  ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` physical memory there, write a
  deterministic pattern ("weights"); at ``sleep`` ``cuMemUnmap`` + ``cuMemRelease`` while the
  **reservation stays**; the dump and restore happen asleep; at ``wake`` create and map again
  **at the same VA**, write the pattern again (the reload), and answer a checksum: a kernel on
  the re-mapped memory (torch over ``__cuda_array_interface__``), a device-to-host copy of every
  byte, and a cuBLAS product of a small torch tensor that stayed mapped through the dump. Before
  any of it the child calls ``torch.cuda.device_count()`` with
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` as vLLM sets it (NVML descriptors in the tree: what the
  inventory and CRIU make of them is in the results). vLLM itself is not run (it does not fit
  the 64 MiB carry).

The restore goes through the **GPU remap path** (issue 31: a snapshot restored onto another GPU
of its model): ``restore_tree(..., gpu_map=((U, U),))`` with the identity device map of the
GPU ``U`` the tree used (the machine has one GPU), so the product puts
``$VLLM_SNAPSHOT_CUDA_DEVICE_MAP`` in CRIU's environment, checks that the helper's ``-h`` offers
``--device-map``, and our helper calls ``cuCheckpointProcessRestore`` with ``gpuPairs``. When
the helper cannot remap here (driver before r580), the restore runs without a map and an INFO
line says why; ``--no-remap`` (``GPU_CHECK_REMAP=0``) restores without one, to tell a failing
remap from a failing restore.

``--fake`` runs the same sequence without torch or a GPU: the child imports the fake
``cuda.bindings.driver`` of tests/fakecuda (copied next to the package), which fakes the same
VMM calls over host memory (reservation = ``PROT_NONE`` mapping), has a thread named
``fakecuda-rst`` (what the fake driver calls a CUDA process), and its "kernel" is a host sum.
With tests/fakecuda first on PYTHONPATH and ``CRIU_FAULT=138`` this runs the harness through
real CRIU on a CPU host (tests/test_gpu_check_script.py).

Usage: python scripts/gpu_check_tree.py --criu BIN --user NAME --out DIR [--mib N] [--fake] [--no-nvml] [--no-remap]
``BIN`` must sit in a CRIU source layout (``<src>/criu/criu`` with ``<src>/plugins/cuda/
cuda_plugin.so``), as the product pairs binary and plugin. Prints one ``RESULT PASS|FAIL name:
detail`` line per check and exits 0 (all passed) or 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The work dirs' parent: on the root file system (not /tmp, which may be a tmpfs whose content
#: CRIU would dump), and readable by the engine user wherever the repo itself lives (the lent
#: machine's checkout may sit under a 0700 /root).
WORK_PARENT = Path("/var/lib/vllm-snapshot-gpu-check")

CHILD = r'''
import ctypes, hashlib, json, os, signal, sys, threading, time
os.closerange(3, 1 << 16)
out_path, mib, fake, nvml = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fake", sys.argv[4] == "nvml"
out = open(out_path, "a", buffering=1)
def emit(event, **kw):
    out.write(json.dumps({"event": event, **kw}) + "\n")
def nvidia_fds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia")
        except OSError:
            pass
    return n
pending = []
for sig, name in ((signal.SIGUSR1, "answer"), (signal.SIGUSR2, "sleep"), (signal.SIGHUP, "wake")):
    signal.signal(sig, lambda *_, n=name: pending.append(n))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
try:
    info = {"uid": os.getuid(), "euid": os.geteuid()}
    if fake:
        def rst():
            ctypes.CDLL(None).prctl(15, b"fakecuda-rst", 0, 0, 0)
            threading.Event().wait()
        threading.Thread(target=rst, daemon=True).start()
        torch = None
    else:
        # vLLM sets this at import (vllm/env_override.py); its usage-stats thread then asks
        # torch for the device count through NVML, which never calls nvmlShutdown
        if nvml:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        import torch
        info["nvidia_fds_before_nvml"] = nvidia_fds()
        info["device_count"] = torch.cuda.device_count() if nvml else None
        info["nvidia_fds_after_nvml"] = nvidia_fds()
    from cuda.bindings import driver as cu

    def ok(res, what):
        err = res[0]
        if int(err) != 0:
            raise RuntimeError(f"{what}: {getattr(err, 'name', err)}")
        return res[1] if len(res) > 1 else None

    ok(cu.cuInit(0), "cuInit")
    dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    # csrc/cumem_allocator.cpp ensure_context(): the device's primary context, current
    cur = ok(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if cur is None or int(cur) == 0:
        ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")), "cuCtxSetCurrent")
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.allocFlags.compressionType = cu.CUmemAllocationCompType.CU_MEM_ALLOCATION_COMP_NONE
    gran = ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity")
    size = -(-mib * 1024 * 1024 // gran) * gran
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))  # my_malloc: the VA, kept

    def create_and_map():  # csrc/cumem_allocator.cpp create_and_map()
        h = ok(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        ok(cu.cuMemMap(va, size, 0, h, 0), f"cuMemMap at {va:#x}")
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = 0
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ok(cu.cuMemSetAccess(va, size, [acc], 1), "cuMemSetAccess")
        return h

    def unmap_and_release(h):  # csrc/cumem_allocator.cpp unmap_and_release(): the VA stays reserved
        ok(cu.cuMemUnmap(va, size), "cuMemUnmap")
        ok(cu.cuMemRelease(h), "cuMemRelease")

    def load():  # the weights "reload": made on the host (not kept: the images stay small), host -> device
        ok(cu.cuMemcpyHtoD(va, hashlib.shake_256(b"weights-20250101").digest(size), size), "cuMemcpyHtoD")
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    if fake:
        def kernel_sum():
            a = (ctypes.c_int32 * (size // 4)).from_address(va)
            return sum(a[:: 4096])
        runtime = None
    else:
        class View:  # the VMM range as a torch tensor, without a copy
            __cuda_array_interface__ = {"shape": (size // 4,), "typestr": "<i4", "data": (va, False), "version": 2}
        def kernel_sum():
            return int(torch.as_tensor(View(), device="cuda").sum(dtype=torch.int64).item())
        runtime = torch.arange(64 * 64, dtype=torch.int32, device="cuda").reshape(64, 64) % 7

    def checksum():
        host = bytearray(size)
        ok(cu.cuMemcpyDtoH(host, va, size), "cuMemcpyDtoH")  # device-to-host copy of every byte
        s = "sum=%d sha=%s" % (kernel_sum(), hashlib.sha256(host).hexdigest()[:16])
        if runtime is not None:  # stayed mapped through the dump: a cuBLAS kernel, deterministic inputs
            s += " mm=%r" % (runtime.float() @ runtime.float().T).sum().item()
        return s

    handle = create_and_map()
    load()
    emit("ready", pid=os.getpid(), va=va, bytes=size, checksum=checksum(), **info)
except Exception as e:  # what failed, for the harness to report
    emit("error", where="start", error=f"{type(e).__name__}: {e}")
    raise
while True:
    while pending:
        what = pending.pop(0)
        try:
            if what == "sleep":
                unmap_and_release(handle)
                handle = None
                emit("slept", va=va, nvidia_fds=nvidia_fds())
            elif what == "wake":
                handle = create_and_map()  # at the same VA: the reservation survived
                load()
                emit("woken", va=va)
            else:
                emit("answer", checksum=checksum())
        except Exception as e:
            emit("error", where=what, error=f"{type(e).__name__}: {e}")
    time.sleep(0.05)
'''

ROOT = r'''
import json, os, subprocess, sys, time
os.closerange(3, 1 << 16)
os.setsid()  # as the engine root: the session leader must be inside the namespace (CRIU)
spec = json.loads(sys.argv[1])
from vllm_snapshot.engine.mounts import make_private, link_inductor_cache
from vllm_snapshot.engine.net import loopback_up
# entrypoints/engine_root.py's order: the mount policy (its own needed paths), lo up, then the engine user
detached = make_private(link_inductor=False)
loopback_up()
print("detached:", detached, flush=True)
if spec["user"]:
    from vllm_snapshot.host.privilege import drop_to
    u = spec["user"]
    drop_to(u["uid"], u["gid"], u["groups"])
    link_inductor_cache()
print("running as uid", os.getuid(), "gid", os.getgid(), "groups", os.getgroups(), flush=True)
child = subprocess.Popen([sys.executable, "-W", "ignore", "-c", open(spec["child"]).read(), spec["events"],
                          str(spec["mib"]), spec["mode"], spec["nvml"]],
                         stdin=subprocess.DEVNULL, stdout=open(spec["events"] + ".stdout", "ab"),
                         stderr=subprocess.STDOUT, close_fds=True)
while True:
    time.sleep(3600)  # the non-CUDA root, like vLLM's API process
'''

RESULTS: list[tuple[str, str, str]] = []


def result(status: str, name: str, detail: str = "") -> None:
    """Record and print one ``RESULT`` line (gpu_check.sh turns them into its own results)."""
    RESULTS.append((status, name, detail))
    print(f"RESULT {status} {name}" + (f": {' '.join(str(detail).split())}" if detail else ""), flush=True)


def events(path: Path) -> list[dict]:
    """The child's JSON events so far (one per line)."""
    try:
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, ValueError):
        return []


def wait_event(path: Path, name: str, nth: int, timeout: float) -> dict | None:
    """The ``nth`` event called ``name``; None on timeout or when the child reports an error
    (the error event is then printed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = events(path)
        got = [e for e in evs if e.get("event") == name]
        if len(got) >= nth:
            return got[nth - 1]
        errs = [e for e in evs if e.get("event") == "error"]
        if errs:
            print(f"child error: {errs[-1]}", flush=True)
            return None
        time.sleep(0.1)
    return None


def child_error(path: Path) -> str:
    """The child's last error event, as text ('' when none)."""
    errs = [e for e in events(path) if e.get("event") == "error"]
    return f"{errs[-1].get('where')}: {errs[-1].get('error')}" if errs else ""


def copy_package(work: Path, fake: bool) -> Path:
    """A copy of the vllm_snapshot package (and, for ``fake``, the fake ``cuda`` package) under
    ``work/pkg``: the engine user reads its code from there, wherever the repo is."""
    pkg = work / "pkg"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "vllm_snapshot", pkg / "vllm_snapshot", ignore=ignore)
    if fake:
        shutil.copytree(REPO / "tests" / "fakecuda" / "cuda", pkg / "cuda", ignore=ignore)
    for d, dirs, files in os.walk(pkg):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    os.chmod(pkg / "vllm_snapshot" / "checkpoint" / "criu_ruid.sh", 0o755)
    return pkg


#: The GPU the fake run "uses" (any well-formed UUID: the fake driver logs the pairs it gets).
FAKE_GPU = "GPU-00000000-0000-4000-8000-00000000fa4e"


def remap_plan(a, helper, uuid: str) -> tuple:
    """The device map part C restores with: the identity map of ``uuid`` when the helper's
    ``-h`` offers ``--device-map``; ``()`` (with an INFO line saying why) otherwise."""
    from vllm_snapshot.checkpoint import cuda_checkpoint as cc

    if a.no_remap:
        result("INFO", "C remap path", "not run: --no-remap (GPU_CHECK_REMAP=0)")
        return ()
    if not uuid:
        result("INFO", "C remap path", "not run: the GPU the tree used is unknown (see the inventory line)")
        return ()
    rc, text = helper(["-h"])
    if rc != 0 or cc.REMAP_HELP not in text:
        why = next((ln.strip(" ()") for ln in text.splitlines() if cc.NO_REMAP_HELP in ln), f"exit {rc}: {text[:200]}")
        result("INFO", "C remap path", f"not run: our helper cannot remap on this host: {why}")
        return ()
    return ((uuid, uuid),)


def remap_result(a, gpu_map: tuple) -> None:
    """The RESULT of the remap path after a restore with ``gpu_map`` passed: with the fake
    driver, the pairs it got (its calls.log); on a GPU, the driver accepted them (the restore
    and every CUDA process ``running`` depend on it; the driver reports nothing more)."""
    want = f"pairs={gpu_map[0][0]}>{gpu_map[0][1]}"
    if a.fake:
        log = Path(os.environ.get("FAKE_CUDA_DIR", "/nonexistent"), "calls.log")
        got = [ln for ln in (log.read_text().splitlines() if log.exists() else []) if ln.startswith("restore ")]
        ok = any(want in ln and ln.endswith("CUDA_SUCCESS") for ln in got)
        result("PASS" if ok else "FAIL", "C restore with the identity device map (the remap path)",
               f"the fake driver's restore calls: {got}")
        return
    result("PASS", "C restore with the identity device map (the remap path)",
           f"{gpu_map[0][0]}={gpu_map[0][1]} through CRIU's environment ($VLLM_SNAPSHOT_CUDA_DEVICE_MAP) to our "
           "helper's cuCheckpointProcessRestore gpuPairs; the driver accepted it")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--criu", required=True, help="the criu binary, in a CRIU source layout")
    ap.add_argument("--user", required=True, help="the engine user (non-root) the tree drops to")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--fake", action="store_true", help="no torch/GPU: see the module docstring")
    ap.add_argument("--no-nvml", action="store_true", help="skip the child's NVML device count")
    ap.add_argument("--no-remap", action="store_true", help="restore without the identity device map")
    a = ap.parse_args()
    # gpu_check.sh runs this under `timeout`: its SIGTERM must still kill the tree, keep the
    # logs and remove the work dir (the finally blocks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK_PARENT.mkdir(mode=0o755, exist_ok=True)
    os.chmod(WORK_PARENT, 0o755)
    work = Path(tempfile.mkdtemp(prefix="tree.", dir=WORK_PARENT))
    os.chmod(work, 0o755)
    # the harness runs the copy too: engine_import_env then names the copy, as the product
    # names its installed package
    pkg = copy_package(work, a.fake)
    sys.path.insert(0, str(pkg))
    os.environ["VLLM_SNAPSHOT_CRIU"] = a.criu
    os.environ.setdefault("VLLM_SNAPSHOT_CACHE", str(work / "cache"))  # the helper wrapper's dir
    os.environ.setdefault("VLLM_SNAPSHOT_LOG_DIR", str(out / "kept-criu-logs"))  # a failed run's log
    try:
        return run(a, out, work, pkg)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(a, out: Path, work: Path, pkg: Path) -> int:
    """The sequence (see the module doc); ``work`` is removed by the caller."""
    try:
        import psutil

        from vllm_snapshot.checkpoint import criu, mountpolicy
        from vllm_snapshot.store import layout
        from vllm_snapshot.host import envpolicy, privilege, procs
        from vllm_snapshot.supervise import supervisor  # noqa: F401 - imports checked
        from vllm_snapshot.paths import ENGINE_TMPDIR
        from vllm_snapshot.errors import SnapshotError
        from vllm_snapshot.host.procs import tree
        from vllm_snapshot.effects.tools import local_tools
    except ImportError as e:
        result("FAIL", "C harness imports", f"{e} (gpu_check.sh installs the carried wheels: run scripts/gpu_carry.sh "
                                            "and carry .criu-carry)")
        return 1
    try:
        user = privilege.lookup(a.user)
    except KeyError:
        result("FAIL", "C engine user", f"no user {a.user!r} ({privilege.USERADD_HINT})")
        return 1
    if user.uid == 0:
        result("FAIL", "C engine user", f"{a.user} is root; the engine runs as a non-root user")
        return 1
    tools = local_tools()
    t, host = tools.checkpoint, tools.host
    evf = work / "run" / "child.events"
    (work / "run").mkdir(mode=0o700)
    os.chown(work / "run", user.uid, user.gid)
    (work / "child.py").write_text(CHILD)
    (work / "root.py").write_text(ROOT)
    for f in ("child.py", "root.py"):
        os.chmod(work / f, 0o644)
    try:
        problems = privilege.access_problems(user, read=[pkg, work / "child.py", work / "root.py"],
                                             reach=[Path(sys.executable), Path(sys.prefix)], write=[work / "run"])
    except OSError as e:
        problems = [str(e)]
    if problems:
        result("FAIL", "C engine user can read the tree's code", "; ".join(problems)[:800])
        return 1
    env = supervisor.engine_import_env(envpolicy.scrubbed_env(dict(os.environ), user=user))
    print("engine environment (names):", " ".join(sorted(env)), flush=True)
    os.makedirs(ENGINE_TMPDIR, mode=0o700, exist_ok=True)  # the private tmpfs' mount point (as supervisor.launch)
    spec = {"model": None, "child": str(work / "child.py"), "events": str(evf), "mib": a.mib,
            "mode": "fake" if a.fake else "cuda", "nvml": "no" if a.no_nvml else "nvml",
            "user": {"uid": user.uid, "gid": user.gid, "groups": list(user.groups)}}
    helper = t.criu.helper(criu.cuda_env(criu.find_criu()))  # what the plugin runs, as restore_tree asks it
    restored = None
    root = None
    try:
        cmd = (f"exec {shlex.quote(sys.executable)} -W ignore {shlex.quote(str(work / 'root.py'))} "
               f"{shlex.quote(json.dumps(spec))} </dev/null >{shlex.quote(str(work / 'root.stdout'))} 2>&1")
        # supervisor.launch's arguments
        launcher = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                                     "--net", "--kill-child", "--", "sh", "-c", cmd], env=env, cwd=str(work),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    close_fds=True, start_new_session=True)
        ready = wait_event(evf, "ready", 1, 240)
        if ready is None:
            said = [(work / f).read_text(errors="replace")[-600:] for f in ("root.stdout", "run/child.events.stdout")
                    if (work / f).exists()]
            result("FAIL", "C tree start", " | ".join([child_error(evf), *said]).strip(" |") or "no output")
            return 1
        kids = psutil.Process(launcher.pid).children()  # the namespace's init is the unshare child
        root = kids[0].pid if kids else None
        pids = [p.pid for p in tree(root)] if root else []
        host_child = pids[1] if len(pids) > 1 else None
        ref = ready["checksum"]
        result("PASS", "C tree started", f"root (no CUDA) {root}, child {host_child} (ns pid {ready['pid']}) as uid "
               f"{ready['uid']}, VMM range {ready['bytes'] >> 20} MiB at {ready['va']:#x}: {ref}")
        if not a.fake:
            result("INFO", "C NVML in the child", f"torch.cuda.device_count() = {ready.get('device_count')} with "
                   f"PYTORCH_NVML_BASED_CUDA_CHECK=1; /dev/nvidia* fds {ready.get('nvidia_fds_before_nvml')} before, "
                   f"{ready.get('nvidia_fds_after_nvml')} after")
        wrong = privilege.tree_problems(t.tree_creds(root), user.uid, user.gid, user.groups, pids)
        result("FAIL" if wrong else "PASS", "C tree runs as the engine user",
               "; ".join(wrong[:5]) if wrong else f"{user.name} (uid {user.uid}), no capability, NoNewPrivs")
        rc, text = helper(["--get-restore-tid", "--pid", str(root)])
        result("PASS" if rc == 1 else "FAIL", "C root has no CUDA", f"--get-restore-tid exit {rc}: {text.strip()[:160]}")
        rc, text = helper(["--get-state", "--pid", str(host_child)])
        result("PASS" if (rc, text.strip()) == (0, "running") else "FAIL", "C child is a running CUDA process",
               f"exit {rc}: {text.strip()[:160]}")
        os.kill(host_child, signal.SIGUSR2)  # sleep level 2: unmap + release, keep the reservation
        slept = wait_event(evf, "slept", 1, 60)
        if slept is None:
            result("FAIL", "C sleep (unmap + release, VA kept)", child_error(evf) or "no answer")
            return 1
        result("PASS", "C sleep (unmap + release, VA kept)", f"VA {slept['va']:#x}, /dev/nvidia* fds {slept['nvidia_fds']}")

        # create's checks before the dump, then its CRIU call
        try:
            inv = t.inspect_tree(root)
            externals = t.external_mounts(root)
        except SnapshotError as e:
            result("FAIL", "C inventory + external mounts (create's checks)", f"{e.message} {e.hint or ''}"[:1500])
            return 1
        used, gpu_uuid = "", FAKE_GPU if a.fake else ""
        if not a.fake:
            try:
                use = t.gpu_used(inv)
                used, gpu_uuid = f", GPU {use}", use.uuid
            except SnapshotError as e:
                result("FAIL", "C one GPU held by the tree (create's gpu_used)", f"{e.message} {e.hint or ''}"[:600])
        result("PASS", "C inventory + external mounts (create's checks)",
               f"CUDA holders {list(inv.cuda_pids)} of {list(inv.pids)}{used}; external: "
               f"{[e.mount_point for e in externals]}")
        timeout = criu.freeze_timeout("cuda", len(inv.pids), len(inv.cuda_pids), host.environ())
        dump_dir = work / "dump"
        (dump_dir / layout.IMAGES).mkdir(parents=True)
        t0 = time.monotonic()
        try:
            t.dump("cuda", criu.DumpOptions(pid=root, external=mountpolicy.dump_args(externals),
                                            network_lock=criu.NETWORK_LOCK_ISOLATED, timeout_s=timeout), dump_dir)
        except SnapshotError as e:
            result("FAIL", "C criu dump (product's LocalCheckpointTools.dump)", f"{e.message} {e.hint or ''}"[:1500])
            return 1
        finally:
            if (dump_dir / layout.DUMP_LOG).exists():
                shutil.copy(dump_dir / layout.DUMP_LOG, out / "partC-dump.log")
        images = dump_dir / layout.IMAGES
        result("PASS", "C criu dump (product's LocalCheckpointTools.dump)",
               f"{time.monotonic() - t0:.1f} s, --timeout {timeout} s, images "
               f"{sum(f.stat().st_size for f in images.iterdir()) >> 20} MiB")
        launcher.wait(timeout=30)  # the namespace is gone with its init
        alive = t.wait_gone(tuple(pids), 30)
        if alive:
            result("FAIL", "C tree gone after the dump", f"PIDs {alive} survived")
            return 1

        gpu_map = remap_plan(a, helper, gpu_uuid)
        t0 = time.monotonic()
        try:
            restored = t.restore_tree("cuda", criu.RestoreOptions(external=mountpolicy.restore_args(externals),
                                                                  network_lock=criu.NETWORK_LOCK_ISOLATED), images,
                                      gpu_map=gpu_map)
        except SnapshotError as e:
            result("FAIL", "C criu restore (product's LocalCheckpointTools.restore_tree)", f"{e.message} {e.hint or ''}"[:1500])
            return 1
        finally:
            if (images / layout.RESTORE_LOG).exists():
                shutil.copy(images / layout.RESTORE_LOG, out / "partC-restore.log")
        rpids = [p.pid for p in tree(restored)]
        result("PASS", "C criu restore (product's LocalCheckpointTools.restore_tree)",
               f"{time.monotonic() - t0:.1f} s, root {restored}, every CUDA process running"
               + (f", device map {gpu_map[0][0]}={gpu_map[0][1]}" if gpu_map else ", no device map"))
        if gpu_map:
            remap_result(a, gpu_map)
        wrong = privilege.tree_problems(t.tree_creds(restored), user.uid, user.gid, user.groups)
        result("FAIL" if wrong else "PASS", "C restored tree runs as the engine user",
               "; ".join(wrong[:5]) if wrong else f"{len(rpids)} processes")
        new_child = rpids[1] if len(rpids) > 1 else None
        if new_child is None:
            result("FAIL", "C wake (create + map at the same VA)", f"the restored tree has no child: {rpids}")
            return 1
        os.kill(new_child, signal.SIGHUP)  # wake: re-create and map at the same VA, reload
        woken = wait_event(evf, "woken", 1, 120)
        if woken is None:
            result("FAIL", "C wake (create + map at the same VA)", child_error(evf) or "no answer")
            return 1
        result("PASS", "C wake (create + map at the same VA)", f"VA {woken['va']:#x}")
        os.kill(new_child, signal.SIGUSR1)
        ans = wait_event(evf, "answer", 1, 120)
        got = ans and ans["checksum"]
        result("PASS" if got == ref else "FAIL", "C same output after restore + wake",
               f"{got} vs {ref}" if ans else child_error(evf) or "no answer")
        return 0 if all(s in ("PASS", "INFO") for s, _, _ in RESULTS) else 1
    finally:
        if restored:
            procs.kill_restored_children()
        if root:
            try:
                os.kill(root, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in ("run/child.events", "run/child.events.stdout", "root.stdout"):
            if (work / f).exists():
                shutil.copy(work / f, out / f"partC-{Path(f).name}")


if __name__ == "__main__":
    sys.exit(main())
