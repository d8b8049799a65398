"""Bad input found by a new-user trial: each gets a clear error and the right exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_snapshot.store import layout, store
from vllm_snapshot import ops
from vllm_snapshot.host import ports
from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, UsageError

ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "vllm_snapshot", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cpu_engine_without_kv_cache_size_is_refused():
    with pytest.raises(UsageError, match="size it explicitly"):
        ops.check_cpu_kv_cache(["--dtype", "float32"], {}, "cpu")
    ops.check_cpu_kv_cache(["--kv-cache-memory-bytes", "1G"], {}, "cpu")
    ops.check_cpu_kv_cache(["--kv-cache-memory-bytes=1G"], {}, "cpu")
    ops.check_cpu_kv_cache([], {"VLLM_CPU_KVCACHE_SPACE": "2"}, "cpu")
    ops.check_cpu_kv_cache([], {}, "cuda")


def test_the_kv_cache_guard_follows_the_vllm_build_not_the_gpu(tmp_path):
    # vLLM 0.32 picks CUDA only for a build whose version lacks "cpu" (vllm-cpu counts as
    # "<v>+cpu"): a CPU build on a GPU host is a CPU engine, and the guard must hold there.
    from vllm_snapshot.checkpoint import gpu

    gpus = tmp_path / "gpus"
    gpus.mkdir()
    cpu_build = {"vllm-cpu": "0.32.0"}.get
    cuda_build = {"vllm": "0.32.0"}.get
    assert gpu.engine_device(cpu_build, str(gpus)) == "cpu"  # was: skipped on any GPU host
    assert gpu.engine_device({"vllm": "0.32.0+cpu"}.get, str(gpus)) == "cpu"
    assert gpu.engine_device(cuda_build, str(gpus)) == "cuda"
    assert gpu.engine_device(cuda_build, str(tmp_path / "none")) == "cpu"
    with pytest.raises(UsageError, match="size it explicitly"):
        ops.check_cpu_kv_cache([], {}, gpu.engine_device(cpu_build, str(gpus)))


def test_create_checks_the_kv_cache_again_on_the_device_the_engine_chose(tmp_path):
    # predicted CUDA, but vLLM came up on CPU: refused after start, nothing published
    from fakes import FakeWorld
    from vllm_snapshot.report.progress import Reporter

    t = FakeWorld(kind="cpu")
    t.device = "cuda"
    with pytest.raises(UsageError, match="size it explicitly"):
        ops.create(ops.CreateRequest(model="/m", target=tmp_path / "s"), Reporter(), tools=t.tools)
    assert "launch_engine" in t.calls and "dump" not in t.calls and t.published == []


@pytest.mark.parametrize("host", ["999.1.1.1", "not-a-host.invalid", "localhost"])
def test_bad_host_is_a_usage_error(host):
    with pytest.raises(UsageError, match="--host"):
        ports.port_free(host, 1)


def test_host_not_on_this_machine_is_a_usage_error():
    with pytest.raises(UsageError, match="not an address of this host"):
        ports.port_free("192.0.2.77", 8000)  # TEST-NET-1: never assigned here


def test_bare_name_prefers_a_directory_here_and_refuses_ambiguity(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.chdir(tmp_path)
    assert store.resolve("snap", root) == root / "snap"          # nothing here: the root
    (tmp_path / "snap").mkdir()
    assert store.resolve("snap", root) == tmp_path / "snap"      # made by --snapshot-dir snap
    (root / "snap").mkdir()
    with pytest.raises(UsageError, match="ambiguous"):
        store.resolve("snap", root)
    assert store.resolve("./snap", root) == tmp_path / "snap"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a symlink as another user")
def test_symlinked_parent_owned_by_another_user_is_refused(tmp_path):
    real = tmp_path / "real"
    (real / "snap").mkdir(parents=True, mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    layout.check_dir_safety(link / "snap")  # a root-owned symlink is trusted
    os.lchown(link, 12345, 12345)
    with pytest.raises(EnvironmentProblem, match="symlink owned by uid 12345"):
        layout.check_dir_safety(link / "snap")


def test_non_utf8_manifest_is_corrupt(tmp_path):
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    (d / "manifest.json").write_bytes(b"\xff\xfe{}")
    p = run("inspect", str(d))
    assert p.returncode == 5 and "not UTF-8" in p.stderr and "Traceback" not in p.stderr


def test_inspect_of_a_regular_file_is_a_usage_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    p = run("inspect", str(f))
    assert p.returncode == 2 and "not a directory" in p.stderr


def test_create_under_a_file_says_so(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UsageError, match=f"{f} is a file, not a directory"):
        store.prepare_target(f / "snap")


def test_create_in_a_proc_dir_is_a_usage_error():
    with pytest.raises(UsageError):
        store.prepare_target(Path("/proc/self/nope"))


def test_urls_bracket_ipv6_literals():
    from vllm_snapshot.store.registry import Entry

    assert ports.url("::1", 8000) == "http://[::1]:8000"
    assert ports.url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert Entry("/s", 1, 0, "::1", 8000, 0.0, "detached").url == "http://[::1]:8000"


def test_doctor_checks_the_root_the_command_uses(monkeypatch, tmp_path):
    from vllm_snapshot.cli import app as cli, doctor

    seen = {}

    def fake_run_checks(probes=None, snapshot_root=None):
        seen["root"] = snapshot_root
        return []

    monkeypatch.setattr(doctor, "run_checks", fake_run_checks)
    assert cli.main(["--root", str(tmp_path), "doctor", "--json"]) == 0
    assert seen["root"] == str(tmp_path)
