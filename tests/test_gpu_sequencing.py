"""The GPU create/restore sequencing through real CRIU, without a GPU: a protocol-speaking
fake engine (tests/fake_engine.py, run through ``LocalTools(engine_argv=...)``) that claims to
be a CUDA engine. CRIU runs with the CUDA plugin loaded and our cuda-checkpoint helper on its
PATH (the plugin disables itself when it finds no GPU device)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from vllm_snapshot import manifest as mf
from vllm_snapshot import ops
from vllm_snapshot.errors import OracleMismatchError
from vllm_snapshot.progress import Reporter
from vllm_snapshot.tools import LocalTools

from conftest import TINY
from test_integration import engine_pids, free_port

pytestmark = pytest.mark.integration
FAKE_ENGINE = (sys.executable, str(Path(__file__).resolve().parent / "fake_engine.py"))


class FakeGpuTools(LocalTools):
    """This host's real side effects, except the GPU evidence: the fake CUDA engine holds no
    /dev/nvidia* device (there is none here), so the GPU it "uses" is declared."""

    def gpu_used(self, inv):
        return "GPU-fake-0000"

    def gpu_uuids(self):
        return ["GPU-fake-0000"]


@pytest.fixture()
def fake_tools(monkeypatch):
    # the fake engine ignores engine args; the KV-cache size only satisfies create's CPU check
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return FakeGpuTools(engine_argv=FAKE_ENGINE)


def calls_in_log(snap) -> list[str]:
    return [line.split()[1] for line in (snap / "engine-create.log").read_text().splitlines() if line.startswith("CALL ")]


def test_gpu_create_rehearses_then_sleeps_and_restore_wakes_before_oracle(tmp_path, fake_tools):
    snap = tmp_path / "gpu"
    m = ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=2), Reporter(), tools=fake_tools).manifest
    assert m == mf.read(snap)
    assert m.engine.kind == "cuda" and m.engine.sleep_level == 2 and not m.engine.full_state_captured
    # rehearsal: sleep -> wake (reload) -> oracle must match -> sleep again, then the dump
    assert calls_in_log(snap) == ["sleep", "wake", "oracle", "sleep", "prepare-dump"]
    assert m.host["cuda_checkpoint_helper"].startswith("vllm-snapshot:")
    assert m.host["gpu_uuid_used"] == "GPU-fake-0000" and m.host["cuda_plugin"].startswith("sha256:")
    assert "cuda_plugin" in (snap / "criu-dump.log").read_text()  # CRIU loaded the CUDA plugin
    port = free_port()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port, detach=True), Reporter(), tools=fake_tools)
    try:
        assert {"wake", "oracle", "criu_restore"} <= set(r.timings)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/calls", timeout=10) as resp:
            calls = json.loads(resp.read())["calls"]
        assert calls == ["attach", "wake", "oracle", "serve"]  # wake + reload before the oracle, bind last
    finally:
        engine.kill(grace=5)
        engine.close()
        fake_tools.unregister(r.pid)


def test_gpu_rehearsal_mismatch_refuses_create(tmp_path, fake_tools, monkeypatch):
    """A wake-up whose reload changes the oracle: create refuses, publishes nothing, leaves
    no process."""
    monkeypatch.setenv("VLLM_FAKE_ORACLE_SHIFT", "0.5")
    before = engine_pids()
    snap = tmp_path / "bad"
    with pytest.raises(OracleMismatchError, match="rehearsal changed the oracle") as ei:
        ops.create(ops.CreateRequest(model=str(TINY), target=snap), Reporter(), tools=fake_tools)
    assert "logprob" in ei.value.message
    assert not snap.exists() and not list(tmp_path.glob(".bad.tmp-*"))
    assert engine_pids(10, before) - before == set()


def test_gpu_sleep_level_0_captures_everything(tmp_path, fake_tools):
    snap = tmp_path / "lvl0"
    m = ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=0), Reporter(), tools=fake_tools).manifest
    assert m.engine.sleep_level == 0 and m.engine.full_state_captured
    assert calls_in_log(snap) == ["prepare-dump"]
