"""gpu: nvidia-smi parsing with a fake runner, CPU hosts (None), capacity check, plugin path."""

from __future__ import annotations

import os
import subprocess

import pytest

from vllm_snapshot import gpu, identity
from vllm_snapshot.errors import BusyError, EnvironmentProblem

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
        "gpu_uuid": "GPU-0c4a1b2e-1111-2222-3333-444455556666;GPU-ffff1b2e-1111-2222-3333-444455556666",
    }
    host = identity.collect("4.2.1", gpu=ident)
    assert host["gpu_uuid"] == ident["gpu_uuid"] and host["criu"] == "4.2.1"


def test_cpu_host_returns_none_without_running_anything(tmp_path):
    runner = FakeRunner()
    # No /proc/driver/nvidia/gpus: a CPU host, even if nvidia-smi happens to be installed.
    assert gpu.query(runner, which=lambda n: "/usr/bin/nvidia-smi", proc_gpus=tmp_path / "absent") is None
    assert gpu.gpu_identity(runner, which=lambda n: None, proc_gpus=tmp_path / "absent") is None
    assert runner.calls == []


def test_this_host_without_gpu_returns_none():
    if os.path.isdir(gpu.PROC_GPUS):
        pytest.skip("this host has NVIDIA GPUs")
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
    from vllm_snapshot import criu

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
    with pytest.raises(UnsnapshottableError, match="no process of its tree"):
        gpu.used_gpu([], [], {3: "GPU-abc"})
    with pytest.raises(UnsnapshottableError, match="uses 2 GPUs"):
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
