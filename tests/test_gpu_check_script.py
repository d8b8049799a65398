"""scripts/gpu_check.sh, gpu_check_tree.py and gpu_carry.sh: what can run without a GPU.

The device check itself needs a GPU machine; here: both shell scripts parse (and are
shellcheck-clean when shellcheck is installed), the script says NOT RUN -- never FAIL -- where
it cannot run (no GPU, a gVisor kernel), the carry holds pycriu and stays under the 64 MiB
limit, and part C's harness runs its whole sequence through real CRIU with the fake driver
(tests/fakecuda), so a harness bug is found here and not with the GPU's scarce minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import skip_on_gpu_host

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "gpu_check.sh"
CARRY = ROOT / "scripts" / "gpu_carry.sh"
TREE = ROOT / "scripts" / "gpu_check_tree.py"


@pytest.mark.parametrize("script", [CHECK, CARRY])
def test_scripts_parse_and_are_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    sc = shutil.which("shellcheck")
    if not sc:
        pytest.skip("shellcheck is not installed")
    cp = subprocess.run([sc, str(script)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout


def _run_check(tmp_path, path_dirs: list[Path]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_BUDGET_S")}
    env["PATH"] = ":".join([*map(str, path_dirs), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    env["OUT"] = str(tmp_path / "out")
    return subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


def _fake_program(d: Path, name: str, script: str) -> None:
    d.mkdir(exist_ok=True)
    (d / name).write_text("#!/bin/sh\n" + script)
    (d / name).chmod(0o755)


def test_no_gpu_is_not_run_not_fail(tmp_path):
    if any(shutil.which("nvidia-smi", path=p) for p in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")):
        skip_on_gpu_host("this host has nvidia-smi")
    cp = _run_check(tmp_path, [])
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "GPU_CHECK: NOT RUN" in cp.stdout and "FAIL" not in cp.stdout
    assert "NOTRUN  precondition: no GPU: nvidia-smi is not installed" in cp.stdout
    assert "GPU_CHECK: NOT RUN" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_gvisor_kernel_is_not_run_before_anything_else(tmp_path):
    fake = tmp_path / "bin"
    _fake_program(fake, "uname", 'echo 4.4.0\n')  # gVisor's runsc reports this kernel
    _fake_program(fake, "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-x)"\n')
    cp = _run_check(tmp_path, [fake])
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "gVisor kernel (uname -r = 4.4.0)" in cp.stdout and "GPU_CHECK: NOT RUN" in cp.stdout
    assert "FAIL" not in cp.stdout


@pytest.mark.integration
def test_carry_holds_criu_plugin_libraries_and_pycriu_under_the_limit(tmp_path):
    src = Path(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot")) / "criu-4.2.1"
    if not (src / "criu" / "criu").is_file():
        pytest.skip("scripts/setup.sh has not built CRIU here")
    (tmp_path / "scripts").mkdir()
    shutil.copy(CARRY, tmp_path / "scripts" / "gpu_carry.sh")  # it writes <its repo>/.criu-carry
    cp = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_carry.sh"), str(src)], capture_output=True,
                        text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    carry = tmp_path / ".criu-carry"
    for f in ("bin/criu", "plugins/cuda_plugin.so", "python/pycriu/__init__.py", "python/pycriu/rpc_pb2.py",
              "MANIFEST", ".gitignore"):
        assert (carry / f).is_file(), f
    total = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert total <= 60 * 2**20  # the 64 MiB carry limit, with room for the repo
    # the carried pycriu is importable on its own path (part C puts it first on PYTHONPATH)
    cp = subprocess.run([sys.executable, "-c", "import pycriu, sys; print(pycriu.__file__)"], capture_output=True,
                        text=True, env={**os.environ, "PYTHONPATH": str(carry / "python")}, timeout=60)
    assert cp.stdout.strip() == str(carry / "python" / "pycriu" / "__init__.py"), cp.stderr


@pytest.mark.integration
def test_part_c_harness_through_real_criu_with_the_fake_driver(tmp_path):
    """The whole part C sequence on this CPU host: product CRIU env/flags/timeout/mount policy,
    PID + mount namespace, non-CUDA root + 'CUDA' child, sleep, dump, restore, the product's
    log and state checks, wake, same output."""
    from vllm_snapshot import criu

    binary = criu.find_criu()
    plugin = criu.find_cuda_plugin(binary)
    fc = tmp_path / "fakecuda"
    fc.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'fakecuda'}:{ROOT}", "FAKE_CUDA_DIR": str(fc),
           "CRIU_FAULT": "138"}
    cp = subprocess.run([sys.executable, str(TREE), "--criu", binary, "--plugin-dir", str(plugin.parent),
                         "--out", str(tmp_path / "out"), "--mib", "4", "--fake"],
                        capture_output=True, text=True, env=env, timeout=300)
    results = [ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert results and all(r.startswith("RESULT PASS") for r in results), results
    names = " | ".join(results)
    for step in ("root has no CUDA", "child is a running CUDA process", "criu dump (swrk, product env)",
                 "criu restore (swrk, product env, product checks)", "same output after restore + wake"):
        assert step in names
    calls = [c for c in (fc / "calls.log").read_text().splitlines() if not c.startswith("get-restore-tid")]
    assert [c.split()[0] for c in calls] == ["lock", "checkpoint", "restore", "unlock"]
    assert "timeoutMs=" in calls[0] and calls[0].split("timeoutMs=")[1].split()[0] != "10000"  # not CRIU's 10 s
    assert not list(ROOT.glob(".gpu-check-tree.*"))  # its work dir is gone
    for log in ("partC-dump.log", "partC-restore.log"):
        assert "cuda_plugin: initialized" in (tmp_path / "out" / log).read_text()
