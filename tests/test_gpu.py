"""gpu: nvidia-smi parsing with a fake runner, CPU hosts (None), capacity check, plugin path."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import skip_on_gpu_host

from vllm_snapshot.checkpoint import gpu
from vllm_snapshot.host import identity
from vllm_snapshot.errors import BusyError, CriuError, EnvironmentProblem, UnsnapshottableError

H200 = "580.95.05, NVIDIA H200, GPU-0c4a1b2e-1111-2222-3333-444455556666, 1024, 142336\n"
GIB = 2**30


class FakeRunner:
    def __init__(self, stdout: str = H200, returncode: int = 0, stderr: str = "", exc: Exception | None = None):
        self.stdout, self.returncode, self.stderr, self.exc = stdout, returncode, stderr, exc
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(list(argv))
        if self.exc:
            raise self.exc
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, self.stderr)


@pytest.fixture
def gpu_host(tmp_path):
    """Keyword arguments that make query() see a GPU host with nvidia-smi at /fake/nvidia-smi."""
    proc = tmp_path / "proc-driver-nvidia-gpus"
    (proc / "0000:18:00.0").mkdir(parents=True)
    return {"which": lambda name: f"/fake/{name}", "proc_gpus": proc}


def test_parse_one_gpu_in_bytes():
    (g,) = gpu.parse_query(H200)
    assert g == gpu.GpuInfo(driver="580.95.05", name="NVIDIA H200",
                            uuid="GPU-0c4a1b2e-1111-2222-3333-444455556666",
                            memory_used_bytes=1024 * gpu.MIB, memory_free_bytes=142336 * gpu.MIB)


def test_parse_several_gpus_odd_names_and_na():
    text = ("580.95.05, NVIDIA H200, GPU-a, 1, 2\n"
            "\n"
            "580.95.05, Weird, Inc. GPU, GPU-b, [N/A], [N/A]\n")
    a, b = gpu.parse_query(text)
    assert (a.uuid, b.uuid) == ("GPU-a", "GPU-b")
    assert b.name == "Weird, Inc. GPU"
    assert (b.memory_used_bytes, b.memory_free_bytes) == (None, None)


@pytest.mark.parametrize("bad", ["580, H200, GPU-a, 1\n", "580, H200, GPU-a, lots, 2\n"])
def test_parse_rejects_malformed_lines(bad):
    with pytest.raises(ValueError):
        gpu.parse_query(bad)


def test_query_runs_the_documented_command(gpu_host):
    runner = FakeRunner()
    gpus = gpu.query(runner, **gpu_host)
    assert runner.calls == [["/fake/nvidia-smi",
                             "--query-gpu=driver_version,name,uuid,memory.used,memory.free",
                             "--format=csv,noheader,nounits"]]
    assert [g.name for g in gpus] == ["NVIDIA H200"]


def test_identity_fields_without_memory(gpu_host):
    ident = gpu.gpu_identity(FakeRunner(H200 + H200.replace("GPU-0c4a", "GPU-ffff")), **gpu_host)
    assert ident == {
        "gpu_driver": "580.95.05",
        "gpu_name": "NVIDIA H200;NVIDIA H200",
    }
    host = identity.collect("4.2.1", gpu=ident)
    assert host["gpu_name"] == ident["gpu_name"] and host["criu"] == "4.2.1"


def test_replacing_a_gpu_the_engine_did_not_use_keeps_the_identity(gpu_host):
    """Review gpu-path-2 L8: the identity pinned every GPU's UUID, so swapping an unused GPU
    blocked restore; the used one is pinned by gpu_uuid_used. Name and driver stay compared,
    and a snapshot that recorded every UUID (``gpu_uuid``) is not held to it."""
    other = H200.replace("GPU-0c4a", "GPU-ffff")
    at_create = identity.collect("4.2.1", gpu=gpu.gpu_identity(FakeRunner(H200 + other), **gpu_host))
    swapped = identity.collect("4.2.1", gpu=gpu.gpu_identity(FakeRunner(H200 + other.replace("GPU-ffff", "GPU-eeee")),
                                                            **gpu_host))
    assert identity.compare(at_create, swapped) == []
    legacy = {**at_create, "gpu_uuid": "GPU-0c4a1b2e-1111-2222-3333-444455556666;GPU-ffff1b2e"}
    assert identity.compare(legacy, swapped) == []
    newer = identity.collect("4.2.1", gpu=gpu.gpu_identity(FakeRunner(H200.replace("580.95.05", "590.1")), **gpu_host))
    assert [d.field for d in identity.compare(at_create, newer)] == ["gpu_driver", "gpu_name"]


def test_cpu_host_returns_none_without_running_anything(tmp_path):
    runner = FakeRunner()
    # No /proc/driver/nvidia/gpus: a CPU host, even if nvidia-smi happens to be installed.
    assert gpu.query(runner, which=lambda n: "/usr/bin/nvidia-smi", proc_gpus=tmp_path / "absent") is None
    assert gpu.gpu_identity(runner, which=lambda n: None, proc_gpus=tmp_path / "absent") is None
    assert runner.calls == []


def test_this_host_without_gpu_returns_none():
    if os.path.isdir(gpu.PROC_GPUS):
        skip_on_gpu_host("this host has NVIDIA GPUs")
    assert gpu.gpu_identity() is None


def test_gpu_host_without_nvidia_smi_is_an_environment_problem(gpu_host):
    with pytest.raises(EnvironmentProblem, match="nvidia-smi is not on PATH"):
        gpu.query(FakeRunner(), which=lambda n: None, proc_gpus=gpu_host["proc_gpus"])


@pytest.mark.parametrize("runner, match", [
    (FakeRunner(returncode=9, stdout="", stderr="NVIDIA-SMI has failed because it couldn't communicate"),
     "exit 9.*couldn't communicate"),
    (FakeRunner(exc=subprocess.TimeoutExpired(["nvidia-smi"], 30)), "cannot run nvidia-smi"),
    (FakeRunner(exc=PermissionError("denied")), "cannot run nvidia-smi"),
    (FakeRunner(stdout=""), "lists no GPU"),
    (FakeRunner(stdout="garbage\n"), "cannot parse"),
])
def test_nvidia_smi_failures_are_environment_problems(gpu_host, runner, match):
    with pytest.raises(EnvironmentProblem, match=match) as ei:
        gpu.query(runner, **gpu_host)
    assert ei.value.exit_code == 11


def test_check_free_memory():
    gpu.check_free_memory(10 * GIB, 10 * GIB)
    gpu.check_free_memory(0, 0)
    with pytest.raises(BusyError) as ei:
        gpu.check_free_memory(70 * GIB, 12 * GIB, gpu="GPU-a")
    e = ei.value
    assert e.exit_code == 9
    assert "70.00 GiB" in e.message and "12.00 GiB" in e.message and "GPU-a" in e.message
    assert e.details == {"gpu": "GPU-a", "required_bytes": 70 * GIB, "free_bytes": 12 * GIB}
    assert "nvidia-smi" in e.hint
    with pytest.raises(ValueError):
        gpu.check_free_memory(-1, 5)


def test_cuda_plugin_in_setup_cache():
    from vllm_snapshot.checkpoint import criu

    src = os.path.join(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot"), "criu-4.2.1")
    if not os.path.isdir(src):
        pytest.skip("scripts/setup.sh has not built CRIU here")
    p = criu.find_cuda_plugin(os.path.join(src, "criu", "criu"))
    assert p.name == "cuda_plugin.so" and p.is_file()


# ---- the one GPU a CUDA engine tree uses (parity with vLLM's own snapshot checks)

def test_gpu_minors_and_used_gpu():
    from vllm_snapshot.errors import UnsnapshottableError

    files = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia3"]
    assert gpu.gpu_minors(files) == {3}
    assert gpu.used_gpu([11, 12], files, {3: "GPU-abc"}) == "GPU-abc"
    with pytest.raises(UnsnapshottableError, match="no process of its tree has a CUDA context"):
        gpu.used_gpu([], [], {3: "GPU-abc"})
    with pytest.raises(UnsnapshottableError, match="nvidia-smi lists none of its CUDA processes .* 2 GPU device files"):
        gpu.used_gpu([11], files + ["/dev/nvidia4"], {3: "a", 4: "b"})
    with pytest.raises(EnvironmentProblem, match="UUID"):
        gpu.used_gpu([11], files, {})


def test_parse_driver_information(tmp_path):
    text = "Model: \t NVIDIA H200\nIRQ:   42\nGPU UUID: \t GPU-5d1c-aaaa\nDevice Minor: \t 0\nBus Type: \t PCIe\n"
    assert gpu.parse_information(text) == (0, "GPU-5d1c-aaaa")
    bus = tmp_path / "0000:01:00.0"
    bus.mkdir()
    (bus / "information").write_text(text)
    assert gpu.uuids_by_minor(str(tmp_path)) == {0: "GPU-5d1c-aaaa"}
    assert gpu.uuids_by_minor(str(tmp_path / "none")) == {}


# --- the CUDA path's checks (issue 20) ----------------------------------------------------------

def test_device_kind_refuses_platforms_other_than_cpu_and_cuda(monkeypatch):
    import sys
    import types

    from vllm_snapshot.entrypoints import engine_root as engine_main

    class Platform:
        device_name = "rocm"

        def __init__(self, cpu=False, cuda=False):
            self._cpu, self._cuda = cpu, cuda

        def is_cpu(self):
            return self._cpu

        def is_cuda(self):
            return self._cuda

    plat = types.ModuleType("vllm.platforms")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)
    plat.current_platform = Platform(cpu=True)
    assert engine_main._device_kind() == "cpu"
    plat.current_platform = Platform(cuda=True)
    assert engine_main._device_kind() == "cuda"
    plat.current_platform = Platform()  # ROCm/XPU/TPU: was reported as "cuda"
    with pytest.raises(RuntimeError, match="rocm.*CPU and NVIDIA CUDA engines only"):
        engine_main._device_kind()


def test_required_restore_bytes_is_vllms_own_request():
    total = 143771 * gpu.MIB  # an H200 as nvidia-smi reports it
    assert gpu.required_restore_bytes([], total) == -(-total * 9 // 10)  # ceil(total * 0.9)
    assert gpu.required_restore_bytes(["--gpu-memory-utilization", "0.5"], total) == -(-total // 2)
    assert gpu.required_restore_bytes(["--gpu-memory-utilization=0.25"], 4 * GIB) == GIB
    with pytest.raises(ValueError):
        gpu.required_restore_bytes(["--gpu-memory-utilization", "1.5"], total)


def test_memory_of_one_gpu_by_uuid():
    out = "GPU-a, 143771, 100000, 43771\nGPU-b, 143771, 2000, 141771\n"
    runner = FakeRunner(out)
    assert gpu.memory("GPU-b", runner, which=lambda n: "/x/nvidia-smi") == (143771 * gpu.MIB, 2000 * gpu.MIB,
                                                                          141771 * gpu.MIB)
    assert runner.calls[0][1:] == list(gpu.MEMORY_QUERY_ARGS)
    with pytest.raises(EnvironmentProblem, match="does not list the GPU GPU-c"):
        gpu.memory("GPU-c", runner, which=lambda n: "/x/nvidia-smi")
    with pytest.raises(EnvironmentProblem, match="no memory figures"):
        gpu.memory("GPU-a", FakeRunner("GPU-a, [N/A], [N/A], [N/A]\n"), which=lambda n: "/x/nvidia-smi")


def test_restore_capacity_refuses_naming_the_numbers():
    # wired: LocalCheckpointTools.check_gpu_capacity = check_free_memory(required_restore_bytes(args, total), free)
    need = gpu.required_restore_bytes([], 140 * GIB)
    with pytest.raises(BusyError, match=r"needs 126\.00 GiB .* on GPU-x, but only 20\.00 GiB .* is free"):
        gpu.check_free_memory(need, 20 * GIB, gpu="GPU-x")
    gpu.check_free_memory(need, 127 * GIB, gpu="GPU-x")


def test_tree_gpu_bytes_per_process_or_whole_gpu():
    which = lambda n: "/x/nvidia-smi"  # noqa: E731

    class Smi:
        def __init__(self, apps):
            self.apps = apps

        def __call__(self, argv):
            out = self.apps if "--query-compute-apps=pid,used_memory" in argv else "GPU-a, 1000, 100, 900\n"
            return subprocess.CompletedProcess(argv, 0, out, "")

    assert gpu.tree_gpu_bytes([10, 11], "GPU-a", Smi("11, 300\n99, 500\n"), which=which) == (300 * gpu.MIB, "per process")
    # the driver reports PIDs of another namespace (a container): the whole GPU, an upper bound
    assert gpu.tree_gpu_bytes([10, 11], "GPU-a", Smi("99, 500\n"), which=which) == (900 * gpu.MIB, "whole GPU")


def test_host_room_for_the_gpu_state():
    gpu.check_host_room(10 * GIB, "per process", 20 * GIB, 30 * GIB, "/snap")
    with pytest.raises(UnsnapshottableError) as ei:  # sleep level 0 on an H200: ~127 GiB to copy
        gpu.check_host_room(127 * GIB, "per process", 100 * GIB, 500 * GIB, "/snap")
    msg = ei.value.message
    assert "holds 127.00 GiB" in msg and "host RAM available 100.00 GiB" in msg and "disk" not in msg
    assert "--sleep-level 2" in ei.value.hint
    with pytest.raises(UnsnapshottableError, match="free disk on /snap 1.00 GiB"):  # noqa: RUF043
        gpu.check_host_room(2 * GIB, "whole GPU", 100 * GIB, GIB, "/snap")


class Helper:
    """A cuda-checkpoint over a table: pid -> state, or absent (no CUDA)."""

    def __init__(self, states, rc_unavailable=False):
        self.states, self.rc_unavailable, self.calls = states, rc_unavailable, []

    def __call__(self, args):
        self.calls.append(list(args))
        pid = int(args[-1])
        if self.rc_unavailable:
            return 3, "cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE\n"
        if pid not in self.states:
            return 1, f"cuda-checkpoint: --get-restore-tid --pid {pid} failed: CUDA_ERROR_INVALID_VALUE\n"
        return (0, f"{pid + 1}\n") if args[0] == "--get-restore-tid" else (0, self.states[pid] + "\n")


def test_restored_cuda_processes_must_be_running():
    h = Helper({11: "running"})
    states = gpu.restored_states([10, 11, 12], h)
    assert states == [(11, "running")]
    gpu.check_restored(states)
    assert h.calls == [["--get-restore-tid", "--pid", "10"], ["--get-restore-tid", "--pid", "11"],
                       ["--get-state", "--pid", "11"], ["--get-restore-tid", "--pid", "12"]]
    # a failed restore/unlock: CRIU 4.2.1 only logs it and resumes the tree
    for state in ("locked", "checkpointed", "failed"):
        with pytest.raises(CriuError, match=f"PID 11 is {state} \\(expected running\\)"):
            gpu.check_restored(gpu.restored_states([10, 11], Helper({11: state})))
    with pytest.raises(CriuError, match="no process of it has CUDA state"):
        gpu.check_restored(gpu.restored_states([10, 12], Helper({11: "running"})))
    with pytest.raises(EnvironmentProblem, match="unavailable: cuInit"):
        gpu.restored_states([10], Helper({}, rc_unavailable=True))
    with pytest.raises(EnvironmentProblem, match="exited 127"):
        gpu.restored_states([10], lambda args: (127, "cannot run cuda-checkpoint: No such file"))
    gone = gpu.restored_states([10], lambda args: (1, "cuda-checkpoint: --get-restore-tid --pid 10: no such process: 10"))
    assert gone == [(10, "gone")]
    with pytest.raises(CriuError, match=r"not every CUDA process of it is running: PID 10 exited \(expected running\)"):
        gpu.check_restored([(11, "running"), *gone])


def test_cuda_preflight_runs_the_helper_criu_would_run(tmp_path):
    # CriuRunners runs `cuda-checkpoint -h` from the PATH CRIU gets, as CRIU's plugin does at init
    from vllm_snapshot.effects.checkpoint import CriuRunners

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "cuda-checkpoint"
    helper.write_text("#!/bin/sh\necho 'cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE' >&2\nexit 3\n")
    helper.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    with pytest.raises(EnvironmentProblem, match=r"cannot checkpoint here \(exit 3\): cuda-checkpoint: unavailable"):
        CriuRunners().cuda_preflight(env)
    helper.write_text("#!/bin/sh\necho 'usage: cuda-checkpoint -h ... NOT AVAILABLE with this driver'\n")
    with pytest.raises(EnvironmentProblem, match="NOT AVAILABLE"):
        CriuRunners().cuda_preflight(env)
    helper.write_text("#!/bin/sh\necho 'usage: cuda-checkpoint --action {lock,checkpoint,restore,unlock} --pid PID'\n")
    CriuRunners().cuda_preflight(env)


def test_capacity_check_reads_the_utilization_the_engine_parsed_abbreviations_included(monkeypatch):
    """Review gpu-path-2 L3: argparse takes ``--gpu-mem 0.5`` for --gpu-memory-utilization; the
    capacity check must read the value the engine used (the manifest's normalized args), not
    fall back to 0.9 and refuse a restore that fits."""
    from fakes import HOST
    from helpers import make_manifest
    from vllm_snapshot.store import manifest as mf
    from vllm_snapshot.effects.tools import local_tools

    base = make_manifest()
    key = mf.SnapshotKey(value="0" * 64, parts={}, raw_args="0" * 64,
                         normalized_args={"gpu_memory_utilization": "0.5"})
    m = make_manifest(engine=base.engine.model_copy(update={"kind": "cuda", "engine_args": ("--gpu-mem", "0.5")}),
                      host={**HOST, "gpu_uuid_used": "GPU-a"}, key=key)
    asked = []
    monkeypatch.setattr(gpu, "memory", lambda uuid: asked.append(uuid) or (100 * GIB, 60 * GIB, 40 * GIB))  # 60 % free
    local_tools().checkpoint.check_gpu_capacity(m, "GPU-b")  # needs 50 GiB: fits
    assert asked == ["GPU-b"]  # the GPU the state goes onto (remapped), not the recorded one
    tight = m.model_copy(update={"key": key.model_copy(update={"normalized_args": {"gpu_memory_utilization": "0.7"}})})
    with pytest.raises(BusyError, match=r"needs 70\.00 GiB"):
        local_tools().checkpoint.check_gpu_capacity(tight, "GPU-a")
    # snapshots made before keys existed: the abbreviation in the recorded args
    assert gpu.gpu_memory_utilization(["--gpu-mem", "0.5"]) == 0.5
    assert gpu.gpu_memory_utilization(["--gpu_memory_utilization=0.25"]) == 0.25
    assert gpu.gpu_memory_utilization(["--gpu-memory-utilization", "0.5", "--dtype", "half"], {}) == 0.9


class _Runner:
    """Stands in for criu.Criu in LocalCheckpointTools.restore_tree: records whether CRIU ran."""

    env = {"PATH": "/helper:/usr/bin", "CRIU_LIBS_DIR": "/plugins"}

    def __init__(self):
        self.restored = False

    def restore(self, opts, images_dir, work_dir, before_memory=None):
        self.restored = True
        return 4242


def test_cuda_restore_probes_the_helper_before_criu(monkeypatch, tmp_path):
    """Review gpu-path-2 L1: the dump probes the helper before CRIU, the restore found a helper
    that cannot reach the driver only after CRIU had restored the whole tree."""
    from vllm_snapshot.effects.checkpoint import CriuRunners
    from vllm_snapshot.effects.tools import local_tools

    runner = _Runner()
    asked: list[list[str]] = []

    def helper(env):
        def run(args):
            asked.append(list(args))
            return 3, "cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE"
        return run

    monkeypatch.setattr(CriuRunners, "runner", lambda self, kind: runner)
    monkeypatch.setattr(CriuRunners, "helper", staticmethod(helper))
    with pytest.raises(EnvironmentProblem, match="cannot checkpoint here .*CUDA_ERROR_NO_DEVICE"):
        local_tools().checkpoint.restore_tree("cuda", None, tmp_path)
    assert asked == [["-h"]] and not runner.restored
    assert local_tools().checkpoint.restore_tree("cpu", None, tmp_path) == 4242 and asked == [["-h"]]


# ---- review gpu-path-2 M1, L4, L5: CUDA processes told from NVML holders; only they are probed

EIGHT = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]


def test_compute_apps_parse_and_query():
    text = "101, GPU-aaaa\n102, GPU-bbbb\nNo running processes found\n\n"
    assert gpu.parse_compute_apps(text) == [(101, "GPU-aaaa"), (102, "GPU-bbbb")]
    runner = FakeRunner("101, GPU-aaaa\n")
    assert gpu.compute_apps(runner, which=lambda n: "/x/nvidia-smi") == [(101, "GPU-aaaa")]
    assert runner.calls == [["/x/nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader,nounits"]]


def test_the_gpu_is_the_one_the_driver_lists_the_cuda_context_on_not_every_nvml_handle():
    """vLLM's usage-stats thread takes an NVML handle of every GPU (torch's NVML device count):
    the tree then holds /dev/nvidia0..7 and used to be refused as "uses 8 GPUs"."""
    uuids = {i: f"GPU-{i}" for i in range(8)}
    assert gpu.used_gpu([101], EIGHT, uuids, [(101, "GPU-3"), (555, "GPU-0")]) == "GPU-3"
    with pytest.raises(UnsnapshottableError, match="CUDA contexts on 2 GPUs"):
        gpu.used_gpu([101, 102], EIGHT, uuids, [(101, "GPU-3"), (102, "GPU-4")])
    # nvidia-smi lists none of them (another PID namespace): the device files decide
    assert gpu.used_gpu([101], ["/dev/nvidiactl", "/dev/nvidia5"], uuids, [(7, "GPU-0")]) == "GPU-5"


class _Inv:
    pids = (100, 101, 102)
    commands = ("vllm serve (API server)", "VLLM::EngineCore", "python -c tokenizer")
    nvidia_files = tuple(EIGHT)


def _local_gpu_tools(monkeypatch, cuda: set[int]):
    """The local checkpoint role whose helper finds a CUDA context in ``cuda`` only, over fake nvidia-smi
    (PID 101 on GPU-3) and /proc (namespace PID = host PID - 99)."""
    from vllm_snapshot.host import procs
    from vllm_snapshot.effects.checkpoint import CriuRunners
    from vllm_snapshot.effects.tools import local_tools

    asked: list[int] = []

    def helper(env):
        def run(args):
            pid = int(args[-1])
            asked.append(pid)
            if pid in cuda:
                return 0, f"{pid}\n"
            return 1, f"cuda-checkpoint: --get-restore-tid --pid {pid} failed: CUDA_ERROR_INVALID_VALUE\n"
        return run

    monkeypatch.setattr(CriuRunners, "runner", lambda self, kind: _Runner())
    monkeypatch.setattr(CriuRunners, "helper", staticmethod(helper))
    monkeypatch.setattr(gpu, "compute_apps", lambda: [(101, "GPU-3")])
    monkeypatch.setattr(gpu, "uuids_by_minor", lambda: {i: f"GPU-{i}" for i in range(8)})
    monkeypatch.setattr(gpu, "query", lambda: [gpu.GpuInfo("580.95.05", "NVIDIA H100 80GB HBM3", f"GPU-{i}", 0, 0)
                                               for i in range(8)])
    monkeypatch.setattr(procs, "ns_pid", lambda pid: pid - 99)
    return local_tools().checkpoint, asked


def test_create_refuses_a_process_holding_nvidia_files_without_a_cuda_context(monkeypatch):
    """Review gpu-path-2 M1: CRIU's CUDA plugin skips a process without a CUDA context (its
    --get-restore-tid fails), and CRIU then fails on its /dev/nvidia* files with no hint.
    Refused before CRIU, naming it."""
    inv = type("Inv", (_Inv,), {"cuda_pids": (100, 101)})()
    t, asked = _local_gpu_tools(monkeypatch, cuda={101})
    with pytest.raises(UnsnapshottableError, match=r"without a CUDA context.*PID 100 \(vllm serve \(API server\)\)") as ei:
        t.gpu_used(inv)
    assert "PID 101" not in ei.value.message and "VLLM_NO_USAGE_STATS=1" in ei.value.hint
    assert asked == [100, 101]


def test_create_picks_the_gpu_of_the_cuda_context_and_records_its_processes(monkeypatch):
    inv = type("Inv", (_Inv,), {"cuda_pids": (101,)})()
    t, _ = _local_gpu_tools(monkeypatch, cuda={101})
    # not "uses 8 GPUs"; namespace PID 2; its minor and model recorded for a restore elsewhere
    assert t.gpu_used(inv) == gpu.GpuUse("GPU-3", (2,), 3, "NVIDIA H100 80GB HBM3")
    assert t.gpu_used(inv).host_fields() == {"gpu_uuid_used": "GPU-3", "gpu_minor_used": "3",
                                             "gpu_name_used": "NVIDIA H100 80GB HBM3"}


def test_restore_probes_only_the_recorded_cuda_processes(monkeypatch, tmp_path):
    """Review gpu-path-2 L4: each probe is a driver attach (0.4-2.7 s): only the processes that
    had CUDA at the dump are asked. L5: one of them without CUDA state, or exited, fails."""
    from vllm_snapshot.checkpoint import criu
    from vllm_snapshot.host import procs

    t, asked = _local_gpu_tools(monkeypatch, cuda={101})
    monkeypatch.setattr(criu, "check_cuda_run", lambda log, what: None)
    monkeypatch.setattr(procs, "tree", lambda pid: [type("P", (), {"pid": p})() for p in (4242, 100, 101, 102)])
    states = {101: "running"}

    def helper(env):
        def run(args):
            if args == ["-h"]:
                return 0, "usage: cuda-checkpoint --action ..."
            pid = int(args[-1])
            asked.append(pid)
            if pid not in states:
                return 1, f"cuda-checkpoint: --get-restore-tid --pid {pid} failed: CUDA_ERROR_INVALID_VALUE\n"
            return (0, f"{pid}\n") if args[0] == "--get-restore-tid" else (0, states[pid] + "\n")
        return run

    monkeypatch.setattr(type(t.criu), "helper", staticmethod(helper))
    assert t.restore_tree("cuda", None, tmp_path, cuda_pids=(2,)) == 4242
    assert asked == [101, 101]  # --get-restore-tid and --get-state of PID 101 only
    asked.clear()
    from vllm_snapshot.host import procs

    monkeypatch.setattr(procs, "kill_restored_children", lambda: [])
    states.clear()  # PID 101 came back without CUDA state
    with pytest.raises(CriuError, match=r"PID 101 is without CUDA state \(expected running\)"):
        t.restore_tree("cuda", None, tmp_path, cuda_pids=(2,))
    with pytest.raises(CriuError, match="1 of its processes have CUDA state where the dump had 2"):
        gpu.check_restored([(101, "running")], expected=2)


# ---- GPU placement: a CUDA snapshot restores onto another GPU of its model (issue 31) --------

REC = {"gpu_uuid_used": "GPU-0c4a1b2e-1111-2222-3333-444455556666", "gpu_minor_used": "1",
       "gpu_name_used": "NVIDIA H200"}
OTHER = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"


def test_place_prefers_the_recorded_gpu_then_the_same_model_at_the_same_minor():
    S = gpu.GpuSlot
    assert gpu.place({"kernel": "6.18"}, [S(OTHER, "NVIDIA H200", 0)]) is None  # a CPU snapshot
    here = [S(OTHER, "NVIDIA H200", 0), S(REC["gpu_uuid_used"], "NVIDIA H200", 3)]
    p = gpu.place(REC, here)  # its own GPU, even at another minor: as before, no map
    assert (p.target, p.remapped, p.pairs, p.minor) == (REC["gpu_uuid_used"], False, (), 3)
    assert p.describe() == f"GPU {REC['gpu_uuid_used']}"
    p = gpu.place(REC, [S(OTHER, "NVIDIA H200", 0), S("GPU-1" + OTHER[5:], "NVIDIA H200", 1)])
    assert p.target == "GPU-1" + OTHER[5:] and p.minor == 1 and p.remapped
    assert p.pairs == ((REC["gpu_uuid_used"], "GPU-1" + OTHER[5:]),)
    assert p.describe() == f"GPU GPU-1{OTHER[5:]} (recorded {REC['gpu_uuid_used']})"


@pytest.mark.parametrize("recorded,here,says", [
    (REC, [gpu.GpuSlot(OTHER, "NVIDIA H200", 0)], "needs a NVIDIA H200 at /dev/nvidia1"),
    (REC, [gpu.GpuSlot(OTHER, "NVIDIA H100 80GB HBM3", 1)], "/dev/nvidia1 here is a NVIDIA H100 80GB HBM3"),
    (REC, [], "GPUs here: none"),
    ({"gpu_uuid_used": REC["gpu_uuid_used"]}, [gpu.GpuSlot(OTHER, "NVIDIA H200", 1)], "made before GPU remapping"),
    ({**REC, "gpu_uuid_used": "MIG-0c4a1b2e-1111-2222-3333-444455556666"}, [gpu.GpuSlot(OTHER, "NVIDIA H200", 1)],
     "MIG instance"),
])
def test_place_refuses_naming_the_recorded_gpu_and_the_gpus_here(recorded, here, says):
    from vllm_snapshot.errors import IncompatibleHostError

    with pytest.raises(IncompatibleHostError) as ei:
        gpu.place(recorded, here)
    msg = ei.value.message
    assert says in msg and recorded["gpu_uuid_used"] in msg and "which this host does not have" in msg
    assert all(s.uuid in msg for s in here) and ei.value.hint


def test_the_gpu_used_is_not_compared_as_identity_nor_part_of_the_key():
    from vllm_snapshot.store import snapkey

    base = {"kernel": "6.18.0", "gpu_name": "NVIDIA H200", "gpu_driver": "580.95.05"}
    assert identity.compare({**base, **REC}, dict(base)) == []
    assert snapkey.host_part({**base, **REC}) == snapkey.host_part(base)


def test_gpu_slots_join_the_proc_minors_with_nvidia_smi_names(tmp_path):
    for bus, minor, uuid in (("0000:01:00.0", 0, OTHER), ("0000:02:00.0", 1, REC["gpu_uuid_used"])):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t NVIDIA H200\nDevice Minor: \t {minor}\n"
                                                     f"GPU UUID: \t {uuid}\n")
    out = f"580.95.05, NVIDIA H200, {REC['gpu_uuid_used']}, 1, 2\n580.95.05, NVIDIA H200, {OTHER}, 1, 2\n"
    runner = FakeRunner(out)
    got = gpu.slots(runner, which=lambda n: "/x/nvidia-smi", proc_gpus=str(tmp_path))
    assert got == [gpu.GpuSlot(OTHER, "NVIDIA H200", 0), gpu.GpuSlot(REC["gpu_uuid_used"], "NVIDIA H200", 1)]
    assert gpu.slots(runner, proc_gpus=str(tmp_path / "none")) == []


def test_check_remap_usable_reads_the_helpers_help():
    from vllm_snapshot.checkpoint import cuda_checkpoint as cc

    gpu.check_remap_usable(0, f"usage: ... --action ...\n{cc.REMAP_HELP}  restore only\n")
    with pytest.raises(EnvironmentProblem, match="driver API 12080 restores only") as ei:
        gpu.check_remap_usable(0, f"usage: --action\n  ({cc.NO_REMAP_HELP} driver API 12080 restores only onto it)\n")
    assert "r580" in ei.value.hint
    with pytest.raises(EnvironmentProblem, match="VLLM_SNAPSHOT_CUDA_CHECKPOINT=/opt/cuda-checkpoint"):
        gpu.check_remap_usable(0, cc.REMAP_HELP, "/opt/cuda-checkpoint")


def test_cuda_restore_hands_the_device_map_to_criu_and_checks_the_helper_takes_it(monkeypatch, tmp_path):
    """The map reaches our helper through CRIU's environment (CRIU 4.2.1's plugin passes none);
    a helper whose -h does not offer --device-map refuses before CRIU."""
    from vllm_snapshot.checkpoint import criu
    from vllm_snapshot.checkpoint import cuda_checkpoint as cc
    from vllm_snapshot.host import procs

    t, asked = _local_gpu_tools(monkeypatch, cuda={101})
    runner = _Runner()
    monkeypatch.setattr(type(t.criu), "runner", lambda self, kind: runner)
    monkeypatch.setattr(criu, "check_cuda_run", lambda log, what: None)
    monkeypatch.setattr(procs, "tree", lambda pid: [type("P", (), {"pid": p})() for p in (4242, 101)])
    monkeypatch.delenv("VLLM_SNAPSHOT_CUDA_CHECKPOINT", raising=False)
    help_text = ["usage: cuda-checkpoint --action ...\n  (" + cc.NO_REMAP_HELP + " driver API 12080 restores only)\n"]
    envs = []

    def helper(env):
        def run(args):
            envs.append(dict(env))
            if args == ["-h"]:
                return 0, help_text[0]
            return (0, "101\n") if args[0] == "--get-restore-tid" else (0, "running\n")
        return run

    monkeypatch.setattr(type(t.criu), "helper", staticmethod(helper))
    pairs = ((REC["gpu_uuid_used"], OTHER),)
    with pytest.raises(EnvironmentProblem, match="needs a driver that remaps GPUs, and this one cannot: .*driver API 12080"):
        t.restore_tree("cuda", None, tmp_path, cuda_pids=(2,), gpu_map=pairs)
    assert not runner.restored
    help_text[0] = "usage: cuda-checkpoint --action ...\n" + cc.REMAP_HELP + "  restore only\n"
    assert t.restore_tree("cuda", None, tmp_path, cuda_pids=(2,), gpu_map=pairs) == 4242 and runner.restored
    assert runner.env[cc.DEVICE_MAP_ENV] == f"{REC['gpu_uuid_used']}={OTHER}"
    assert envs[-1][cc.DEVICE_MAP_ENV] == runner.env[cc.DEVICE_MAP_ENV]
    fresh = _Runner()  # no map: nothing set, and a helper without remapping is fine
    monkeypatch.setattr(type(t.criu), "runner", lambda self, kind: fresh)
    help_text[0] = "usage: cuda-checkpoint --action ...\n"
    assert t.restore_tree("cuda", None, tmp_path, cuda_pids=(2,)) == 4242 and cc.DEVICE_MAP_ENV not in fresh.env


def test_inspect_and_restore_say_which_gpu(capsys):
    """Where things ran: inspect's "built on" names the GPU the engine used (model, minor);
    restore says "restored on GPU NEW (recorded OLD)" when it remapped."""
    from fakes import HOST
    from helpers import make_manifest
    from vllm_snapshot.cli import render
    from vllm_snapshot.report.results import Inspected, Restored

    m = make_manifest(host={**HOST, **REC})
    built = Inspected("/s", m).built
    assert built["gpu"] == f"{REC['gpu_uuid_used']} (NVIDIA H200, /dev/nvidia1)"
    render._inspected(Inspected("/s", m), False)
    out = capsys.readouterr().out
    assert f"GPU {REC['gpu_uuid_used']} (NVIDIA H200, /dev/nvidia1)" in out.split("built on:")[1]
    assert "gpu" not in Inspected("/s", make_manifest()).built  # a CPU snapshot
    p = gpu.place(REC, [gpu.GpuSlot(OTHER, "NVIDIA H200", 1)])
    r = Restored("/s", 1, "http://127.0.0.1:8000", "tiny", {"criu_restore": 1.0}, [], gpu=p.describe())
    render._restored(r, False)
    assert f"restored on GPU {OTHER} (recorded {REC['gpu_uuid_used']})" in capsys.readouterr().err
