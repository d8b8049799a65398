"""Shared fixtures. Integration tests (marker ``integration``) run a real vLLM CPU engine and
real CRIU; they need root, CRIU >= 4.2, and the venv + tiny model from scripts/setup.sh. They
are skipped with a reason when those are missing -- except under CI (``CI=true``), where a
missing prerequisite is an error, never a silent skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot"))
TINY = CACHE / "models" / "tiny-llama"
#: Random "secrets" in the environment of the session snapshot's create: they must not reach
#: the engine (test_no_planted_secret_in_images searches every image for them).
#: set in the environment of the session snapshot's create: none may reach an image (VLLM_API_KEY
#: included: vllm serve would read it; the key belongs to restore)
PLANTED_SECRETS = {"HF_TOKEN": "hf_" + os.urandom(12).hex(), "OPENAI_API_KEY": "sk-" + os.urandom(12).hex(),
                   "VLLM_API_KEY": "vk-" + os.urandom(12).hex()}
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
               "--served-model-name", "tiny-llama"]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CRIU)"
    try:
        from vllm_snapshot import criu

        b = criu.find_criu()
        if not criu.version_ok(criu.criu_version(b)):
            return f"CRIU at {b} is older than 4.2"
    except Exception as e:  # noqa: BLE001
        return f"CRIU unavailable: {e}"
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed in this interpreter"
        if importlib.util.find_spec("pycriu") is None:
            return "pycriu is not importable"
    except Exception as e:  # noqa: BLE001
        return str(e)
    if not (TINY / "config.json").is_file():
        return f"tiny model missing at {TINY} (run scripts/setup.sh)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _missing()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        raise pytest.UsageError(f"integration prerequisites missing in CI: {reason}")
    mark = pytest.mark.skip(reason=f"integration: {reason}")
    for item in items:
        if "integration" in item.keywords:
            item.add_marker(mark)


@pytest.fixture(autouse=True)
def _environ_restored():
    """Put os.environ back after every test: importing vLLM in this process (the parser tests)
    sets TORCHINDUCTOR_CACHE_DIR, PYTORCH_NVML_BASED_CUDA_CHECK, ... in it, which would reach
    every later CLI run through engine_env() -- e.g. a serve whose key's env part then differs
    from the session snapshot's, created before the import (order-dependent failure)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV cache size is an engine arg
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli(*args: str, timeout: float = 900, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m vllm_snapshot ARGS`` and capture its output (text)."""
    p = subprocess.run([sys.executable, "-m", "vllm_snapshot", *args], capture_output=True, text=True,
                       timeout=timeout, env=env or engine_env(), cwd=ROOT)
    if check and p.returncode != 0:
        raise AssertionError(f"vllm-snapshot {' '.join(args)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="session")
def snap_root(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("snapshots")
    os.chmod(d, 0o700)
    return d


@pytest.fixture(scope="session")
def snapshot(snap_root) -> Path:
    """One real snapshot of the tiny model, created once per test session (~1 min)."""
    target = snap_root / "tiny"
    cli("create", str(TINY), "--snapshot-dir", str(target), "--", *ENGINE_ARGS, check=True,
        env={**engine_env(), **PLANTED_SECRETS})
    return target


@pytest.fixture()
def clone_snapshot(snapshot, tmp_path):
    """A hard-linked copy of the session snapshot (images shared, manifest private)."""
    def make(name: str = "clone") -> Path:
        d = tmp_path / name
        subprocess.run(["cp", "-al", str(snapshot), str(d)], check=True)
        os.chmod(tmp_path, 0o700)
        return d
    return make


@pytest.fixture()
def engine_tmp():
    """A temp dir the unprivileged engine user can search (0711, under /var/tmp), for models and
    TLS files a test makes: pytest's own tmp dirs are root-only, and every pytest session that
    starts resets /tmp/pytest-of-root to 0700, so a search bit added there does not stay."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="vsnap-engine-", dir="/var/tmp"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)
