"""The GPU create/restore sequencing through real CRIU, without a GPU: a protocol-speaking
fake engine (vllm_snapshot.testing.fake_engine) that claims to be a CUDA engine. CRIU runs with
the CUDA plugin loaded and our cuda-checkpoint helper on its PATH (the plugin disables itself
when it finds no GPU device)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from vllm_snapshot import manifest as mf

from conftest import TINY, cli, engine_env
from test_integration import engine_pids, free_port, stop

pytestmark = pytest.mark.integration
# the fake engine ignores engine args; the KV-cache size only satisfies create's CPU check
FAKE = {"VLLM_SNAPSHOT_ENGINE_MODULE": "vllm_snapshot.testing.fake_engine", "VLLM_CPU_KVCACHE_SPACE": "1"}


def calls_in_log(snap) -> list[str]:
    return [line.split()[1] for line in (snap / "engine-create.log").read_text().splitlines() if line.startswith("CALL ")]


def test_gpu_create_rehearses_then_sleeps_and_restore_wakes_before_oracle(tmp_path):
    snap = tmp_path / "gpu"
    env = {**engine_env(), **FAKE}
    p = cli("create", str(TINY), "--snapshot-dir", str(snap), "--sleep-level", "2", env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    m = mf.read(snap)
    assert m.engine.kind == "cuda" and m.engine.sleep_level == 2 and not m.engine.full_state_captured
    # rehearsal: sleep -> wake (reload) -> oracle must match -> sleep again, then the dump
    assert calls_in_log(snap) == ["sleep", "wake", "oracle", "sleep", "prepare-dump"]
    assert m.host["cuda_checkpoint_helper"].startswith("vllm-snapshot:")
    assert "cuda_plugin" in (snap / "criu-dump.log").read_text()  # CRIU loaded the CUDA plugin
    port = free_port()
    r = cli("restore", str(snap), "--port", str(port), "--detach", "--json", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    try:
        assert {"wake", "oracle", "criu_restore"} <= set(res["timings"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/calls", timeout=10) as resp:
            calls = json.loads(resp.read())["calls"]
        assert calls == ["wake", "oracle", "serve"]  # wake + reload before the oracle, bind last
    finally:
        stop(res["pid"])


def test_gpu_rehearsal_mismatch_refuses_create(tmp_path):
    """A wake-up whose reload changes the oracle: create refuses, publishes nothing, leaves
    no process."""
    before = engine_pids()
    snap = tmp_path / "bad"
    env = {**engine_env(), **FAKE, "VLLM_FAKE_ORACLE_SHIFT": "0.5"}
    p = cli("create", str(TINY), "--snapshot-dir", str(snap), env=env, timeout=120)
    assert p.returncode == 6, p.stderr
    assert "rehearsal changed the oracle" in p.stderr and "logprob" in p.stderr
    assert not snap.exists() and not list(tmp_path.glob(".bad.tmp-*"))
    assert engine_pids(10, before) - before == set()


def test_gpu_sleep_level_0_captures_everything(tmp_path):
    snap = tmp_path / "lvl0"
    p = cli("create", str(TINY), "--snapshot-dir", str(snap), "--sleep-level", "0",
            env={**engine_env(), **FAKE}, timeout=120)
    assert p.returncode == 0, p.stderr
    m = mf.read(snap)
    assert m.engine.sleep_level == 0 and m.engine.full_state_captured
    assert calls_in_log(snap) == ["prepare-dump"]
