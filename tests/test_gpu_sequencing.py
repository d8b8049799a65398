"""The GPU create/restore sequencing through real CRIU, without a GPU: a protocol-speaking
fake engine (tests/fake_engine.py, run through ``local_tools(engine_argv=...)``) that claims to
be a CUDA engine, with a non-CUDA root and a child the fake driver (tests/fakecuda) calls a
CUDA process.

CRIU runs with its CUDA plugin forced on (``CRIU_FAULT=138``, FI_PLUGIN_CUDA_FORCE_ENABLE in
CRIU 4.2.1 criu/include/fault-injection.h: the plugin otherwise disables itself without
/proc/driver/nvidia/gpus), so the real chain runs: pycriu ``swrk`` -> ``CRIU_LIBS_DIR`` -> the
plugin -> ``cuda-checkpoint`` from the PATH we give CRIU -> our wrapper -> our helper ->
``cuda.bindings.driver`` (the fake, first on PYTHONPATH). Only the driver is fake; a broken
PATH, plugin directory, helper or freeze timeout fails here, not on a GPU."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from vllm_snapshot.store import manifest as mf
from vllm_snapshot import ops
from vllm_snapshot.errors import CriuError, EnvironmentProblem, OracleMismatchError
from vllm_snapshot.report.progress import Reporter
import dataclasses

from vllm_snapshot.dev.fakegpu import FAKE_GPU, FakeGpuCheckpoint, FakeGpuHost
from vllm_snapshot.effects.tools import local_tools
from vllm_snapshot.engine.protocol import CANARY_PROMPT

from conftest import TINY
from test_integration import engine_pids, free_port

pytestmark = pytest.mark.integration
FAKE_ENGINE = (sys.executable, str(Path(__file__).resolve().parent / "fake_engine.py"))


FAKECUDA = Path(__file__).resolve().parent / "fakecuda"


@pytest.fixture()
def fake_cuda(monkeypatch, tmp_path):
    """The fake driver's directory (state, calls.log), wired into CRIU's environment."""
    from vllm_snapshot.checkpoint import criu

    d = tmp_path / "fakecuda"
    d.mkdir()
    monkeypatch.setenv("FAKE_CUDA_DIR", str(d))
    monkeypatch.setenv("PYTHONPATH", f"{FAKECUDA}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("CRIU_FAULT", "138")  # FI_PLUGIN_CUDA_FORCE_ENABLE
    monkeypatch.setenv("VLLM_FAKE_CUDA_CHILD", "1")
    # a private helper dir: the shared cache's wrapper may be rewritten by other checkouts' runs
    monkeypatch.setenv("VLLM_SNAPSHOT_CRIU", criu.find_criu())
    monkeypatch.setenv("VLLM_SNAPSHOT_CACHE", str(tmp_path / "cache"))
    return d


@pytest.fixture()
def fake_tools(monkeypatch, fake_cuda):
    # the fake engine ignores engine args; the KV-cache size only satisfies create's CPU check
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    t = local_tools(engine_argv=FAKE_ENGINE)
    return dataclasses.replace(t, checkpoint=FakeGpuCheckpoint(t.checkpoint.criu), host=FakeGpuHost(t.host.criu))


def our_children(settle_s: float = 10.0) -> list[int]:
    """Live descendants of this test process after up to ``settle_s`` s (an engine we started,
    or a tree CRIU restored as our child); other sessions' engines on the host do not count."""
    import time

    import psutil

    deadline = time.monotonic() + settle_s
    while True:
        alive = []
        for c in psutil.Process().children(recursive=True):
            try:
                if c.status() != psutil.STATUS_ZOMBIE:
                    alive.append(c.pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def calls(fake_cuda: Path) -> list[str]:
    return [" ".join(ln.split()[:1] + ln.split()[2:]) for ln in (fake_cuda / "calls.log").read_text().splitlines()
            if not ln.startswith("get-restore-tid")]


def prompts(port: int) -> list[str]:
    """The prompts of the completions the fake engine serving ``port`` answered."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/prompts", timeout=10) as resp:
        return json.loads(resp.read())["prompts"]


def calls_in_log(snap) -> list[str]:
    return [line.split()[1] for line in (snap / "engine-create.log").read_text().splitlines() if line.startswith("CALL ")]


def test_gpu_create_rehearses_then_sleeps_and_restore_wakes_before_oracle(tmp_path, fake_tools, fake_cuda):
    snap = tmp_path / "gpu"
    m = ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=2), Reporter(), tools=fake_tools).manifest
    assert m == mf.read(snap)
    assert m.engine.kind == "cuda" and m.engine.sleep_level == 2 and not m.engine.full_state_captured
    # rehearsal: sleep -> wake (reload) -> oracle, then the canary record, must match -> sleep
    # again, then the dump
    assert calls_in_log(snap) == ["sleep", "wake", "oracle", "oracle", "sleep", "prepare-dump"]
    assert m.canary is not None and m.canary.prompt == CANARY_PROMPT and m.canary.token_id != m.oracle.token_id
    assert m.host["cuda_checkpoint_helper"] == "vllm-snapshot protocol 2"
    assert m.host["gpu_uuid_used"] == FAKE_GPU and m.host["cuda_plugin"].startswith("sha256:")
    log = (snap / "criu-dump.log").read_text()
    # the plugin ran our helper from the PATH we gave CRIU, for every process of the tree
    assert "cuda_plugin: initialized: cuda_plugin stage" in log
    root_ns, child = m.criu.tree_pids[0], m.criu.tree_pids[1]
    assert f"no need to pause devices on pid {root_ns}" in log  # the non-CUDA root
    assert f"Checkpointing CUDA devices on pid {child}" in log
    # the freeze timeout reached the plugin through the RPC option: the lock's --timeout (ms)
    assert m.criu.freeze_timeout_s == 30 + 10 * (len(m.criu.tree_pids) + 2)
    assert calls(fake_cuda) == [f"lock timeoutMs={m.criu.freeze_timeout_s * 1000} CUDA_SUCCESS",
                                "checkpoint CUDA_SUCCESS"]
    port = free_port()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port, detach=True), Reporter(), tools=fake_tools)
    try:
        assert {"wake", "oracle", "criu_restore"} <= set(r.timings)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/calls", timeout=10) as resp:
            seen = json.loads(resp.read())["calls"]
        assert seen == ["attach", "wake", "oracle", "serve"]  # wake + reload before the oracle, bind last
        assert prompts(port) == [CANARY_PROMPT]  # the HTTP canary asked the recorded canary's prompt
        # CRIU's RESUME_DEVICES_LATE ran restore + unlock through the helper; the state is running
        assert calls(fake_cuda)[2:] == ["restore CUDA_SUCCESS", "unlock CUDA_SUCCESS"]
        assert (fake_cuda / "state").read_text() == "0"
        # the CUDA child was recorded by its namespace PID, and after CRIU only it was probed
        # (review gpu-path-2 L4: one driver attach per probe), not the non-CUDA root
        # (its number depends on what the root forked before it -- the mount policy runs ldconfig)
        assert len(m.criu.cuda_pids) == 1 and m.criu.cuda_pids[0] > 1
        log = (fake_cuda / "calls.log").read_text().splitlines()
        after = log[next(i for i, ln in enumerate(log) if ln.startswith("unlock ")) + 1:]
        assert [ln.split()[0] for ln in after] == ["get-restore-tid"] and after[0].endswith("CUDA_SUCCESS")
    finally:
        engine.kill(grace=5)
        engine.close()
        fake_tools.runtime.unregister(r.pid)


def test_gpu_dump_refused_when_the_helper_cannot_reach_the_driver(tmp_path, fake_tools, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_INIT", "fail")  # e.g. no driver/GPU for the helper's Python
    snap = tmp_path / "nodrv"
    with pytest.raises(EnvironmentProblem, match="unavailable: .*cuInit: CUDA_ERROR_NO_DEVICE"):
        ops.create(ops.CreateRequest(model=str(TINY), target=snap), Reporter(), tools=fake_tools)
    assert not snap.exists() and our_children() == []


def test_gpu_dump_refused_when_the_plugin_is_not_loaded(tmp_path, fake_tools, monkeypatch):
    """An empty plugin directory (a wrong CRIU_LIBS_DIR): CRIU dumps happily without the plugin;
    the log check refuses the images, which hold no GPU state."""
    from vllm_snapshot.checkpoint import criu

    empty = tmp_path / "no-plugins"
    empty.mkdir()
    real = criu.cuda_env
    monkeypatch.setattr(criu, "cuda_env", lambda b: {**real(b), "CRIU_LIBS_DIR": str(empty)})
    snap = tmp_path / "noplug"
    with pytest.raises(CriuError, match="did not load its CUDA plugin"):
        ops.create(ops.CreateRequest(model=str(TINY), target=snap), Reporter(), tools=fake_tools)
    assert not snap.exists()


def test_gpu_dump_refused_when_the_plugin_disables_itself(tmp_path, fake_tools, monkeypatch):
    monkeypatch.delenv("CRIU_FAULT")  # this host has no /proc/driver/nvidia/gpus
    snap = tmp_path / "disabled"
    with pytest.raises(CriuError, match="found no GPU"):
        ops.create(ops.CreateRequest(model=str(TINY), target=snap), Reporter(), tools=fake_tools)
    assert not snap.exists()


@pytest.mark.parametrize("fail, why", [
    ("restore", "restore of the GPU state failed"),  # logged by the plugin, ignored by CRIU
    ("stay-locked", r"PID \d+ is locked \(expected running\)"),  # not even logged: --get-state tells
])
def test_gpu_restore_fails_closed_when_the_gpu_state_does_not_come_back(tmp_path, fake_tools, fake_cuda,
                                                                        monkeypatch, fail, why):
    snap = tmp_path / "gpu"
    ops.create(ops.CreateRequest(model=str(TINY), target=snap), Reporter(), tools=fake_tools)
    monkeypatch.setenv("FAKE_CUDA_FAIL", fail)
    with pytest.raises(CriuError, match=why):
        ops.restore(ops.RestoreRequest(snapshot=snap, port=free_port(), detach=True), Reporter(), tools=fake_tools)
    assert our_children() == []  # the restored tree (our child: restore-sibling) was killed
    assert [e for e in fake_tools.runtime.engines() if e.snapshot == str(snap)] == []


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


def test_a_snapshot_without_a_canary_record_restores_with_the_oracles_prompt_as_canary(tmp_path, fake_tools):
    """A snapshot made before canary records (its manifest has no ``canary`` key, the digest
    over that text): the restore's HTTP canary sends the oracle's prompt and expects the oracle."""
    import blake3

    snap = tmp_path / "old"
    ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=0), Reporter(), tools=fake_tools)
    doc = json.loads((snap / mf.MANIFEST).read_text())
    assert doc.pop("canary")["prompt"] == CANARY_PROMPT
    doc["digest"] = blake3.blake3(mf._canonical(doc)).hexdigest()
    (snap / mf.MANIFEST).write_text(json.dumps(doc))
    assert mf.read(snap).canary is None
    port = free_port()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port, detach=True), Reporter(), tools=fake_tools)
    try:
        assert prompts(port) == [mf.read(snap).oracle.prompt]
    finally:
        engine.kill(grace=5)
        engine.close()
        fake_tools.runtime.unregister(r.pid)


def test_gpu_sleep_level_0_captures_everything(tmp_path, fake_tools):
    snap = tmp_path / "lvl0"
    m = ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=0), Reporter(), tools=fake_tools).manifest
    assert m.engine.sleep_level == 0 and m.engine.full_state_captured
    assert calls_in_log(snap) == ["prepare-dump"]


def test_gpu_restore_refused_before_criu_when_the_helper_cannot_reach_the_driver(tmp_path, fake_tools, fake_cuda,
                                                                                 monkeypatch):
    """Review gpu-path-2 L1: the restore probes the helper CRIU will run before CRIU, as the dump
    does; before, CRIU restored the whole tree with its plugin disabled and only the log check
    after it refused."""
    snap = tmp_path / "gpu"
    ops.create(ops.CreateRequest(model=str(TINY), target=snap), Reporter(), tools=fake_tools)
    monkeypatch.setenv("FAKE_CUDA_INIT", "fail")
    with pytest.raises(EnvironmentProblem, match="cannot checkpoint here .*cuInit: CUDA_ERROR_NO_DEVICE"):
        ops.restore(ops.RestoreRequest(snapshot=snap, port=free_port(), detach=True), Reporter(), tools=fake_tools)
    assert not (tmp_path / "criu-restore.log").exists() and our_children() == []
    assert "restore " not in (fake_cuda / "calls.log").read_text()  # CRIU's plugin never ran a GPU restore


def test_gpu_restore_onto_another_gpu_hands_the_device_map_through_criu_to_the_driver(tmp_path, fake_tools, fake_cuda,
                                                                                       monkeypatch):
    """Issue 31: a snapshot restores on another node of its class, whose GPU has another UUID.
    The map goes from restore through CRIU's environment, the plugin's exec of our helper, to
    the driver's gpuPairs (CRIU 4.2.1 passes none itself); a driver that refuses the remap
    fails the restore, and nothing is left running."""
    snap = tmp_path / "gpu"
    ops.create(ops.CreateRequest(model=str(TINY), target=snap, sleep_level=2), Reporter(), tools=fake_tools)
    other = "GPU-9f8e7d6c-aaaa-4bbb-8ccc-ddddeeeeffff"
    host = FakeGpuHost(fake_tools.host.criu)
    host.uuid = other
    elsewhere = dataclasses.replace(fake_tools, host=host)
    port = free_port()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port, detach=True), Reporter(), tools=elsewhere)
    try:
        assert r.gpu == f"GPU {other} (recorded {FAKE_GPU})"
        assert calls(fake_cuda)[2:] == [f"restore pairs={FAKE_GPU}>{other} CUDA_SUCCESS", "unlock CUDA_SUCCESS"]
        assert (fake_cuda / "state").read_text() == "0"
    finally:
        engine.kill(grace=5)
        engine.close()
        fake_tools.runtime.unregister(r.pid)
    assert our_children() == []
    # the same restore where the driver refuses to remap: CRIU's plugin only logs the failure;
    # the log check refuses and the restored tree is killed
    (fake_cuda / "state").write_text("2")  # checkpointed again, as the images say
    monkeypatch.setenv("FAKE_CUDA_FAIL", "remap")
    with pytest.raises(CriuError, match="restore of the GPU state failed"):
        ops.restore(ops.RestoreRequest(snapshot=snap, port=free_port(), detach=True), Reporter(), tools=elsewhere)
    assert f"restore pairs={FAKE_GPU}>{other} CUDA_ERROR_NOT_SUPPORTED" in calls(fake_cuda)
    assert our_children() == []
