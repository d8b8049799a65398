"""The policies that lived in the side-effect seam (effects/tools.py) and now live in the leaf
that owns their concern, tested where they landed: the code table's integrity
(host/codeid.py), the CUDA helper's usability and the CUDA identity fields (checkpoint/gpu.py),
CRIU core-image capabilities (checkpoint/criu/images.py), the CRIU timeout's environment
(checkpoint/criu/runner.py), the engine log file (supervise/supervisor.py), reclaim (store/reclaim.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import blake3
import pytest

from vllm_snapshot.checkpoint import criu, gpu
from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from vllm_snapshot.host import codeid


def test_a_code_table_missing_altered_or_unparsable_is_a_corrupt_snapshot(tmp_path):
    table = tmp_path / "code.json"
    with pytest.raises(CorruptSnapshotError, match="is missing .*pins 7 Python files"):
        codeid.check_pinned(table, "0" * 64, 7)
    table.write_bytes(b"[]")
    with pytest.raises(CorruptSnapshotError, match="does not match its digest"):
        codeid.check_pinned(table, "0" * 64, 7)
    table.write_bytes(b"not json")
    with pytest.raises(CorruptSnapshotError, match=str(table)):
        codeid.check_pinned(table, blake3.blake3(b"not json").hexdigest(), 7)


def test_an_intact_code_table_is_checked_file_by_file(tmp_path, monkeypatch):
    table = tmp_path / "code.json"
    table.write_bytes(b"TABLE")
    monkeypatch.setattr(codeid, "check", lambda t: [f"changed: {t.decode()}"])
    assert codeid.check_pinned(table, blake3.blake3(b"TABLE").hexdigest(), 1) == ["changed: TABLE"]


def test_the_cuda_helper_must_exit_0_and_offer_action():
    gpu.check_helper_usable(0, "usage: cuda-checkpoint --action {lock,checkpoint,restore,unlock} --pid PID")
    with pytest.raises(EnvironmentProblem, match=r"\(exit 3\): cuda-checkpoint: unavailable"):
        gpu.check_helper_usable(3, "cuda-checkpoint: unavailable:\n cuInit")
    with pytest.raises(EnvironmentProblem, match="NOT AVAILABLE"):
        gpu.check_helper_usable(0, "usage: cuda-checkpoint -h ... NOT AVAILABLE")


def test_cuda_identity_pins_the_plugin_by_content_and_our_helper_by_protocol(tmp_path):
    from vllm_snapshot.checkpoint.cuda_checkpoint import PROTOCOL

    plugin = tmp_path / "cuda_plugin.so"
    plugin.write_bytes(b"plugin")
    ident = gpu.cuda_identity(plugin, None)
    assert ident["cuda_plugin"] == "sha256:" + gpu.file_sha256(plugin)[:16]
    assert ident["cuda_checkpoint_helper"] == f"vllm-snapshot protocol {PROTOCOL}"
    nvidia = tmp_path / "cuda-checkpoint"
    nvidia.write_bytes(b"nvidia")
    assert gpu.cuda_identity(plugin, str(nvidia))["cuda_checkpoint_helper"] == \
        f"{nvidia} sha256:{gpu.file_sha256(nvidia)[:16]}"
    assert gpu.file_sha256(tmp_path / "missing") == "unreadable"


def test_caps_missing_reads_the_roots_core_image_and_is_empty_without_one(tmp_path, monkeypatch):
    from helpers import make_manifest

    m = make_manifest()
    assert criu.caps_missing(tmp_path, m, "") == []  # no core image of the root: CRIU decides
    root = 1 if m.criu.pid_namespace else m.criu.root_pid
    img = m.images[0].model_copy(update={"name": f"core-{root}.img"})
    m2 = m.model_copy(update={"images": (img,)})
    assert criu.caps_missing(tmp_path, m2, "") == []  # unreadable: CRIU decides


def test_the_criu_timeout_is_read_from_the_environment_it_is_given():
    assert criu.env_timeout({}) == criu.DEFAULT_TIMEOUT_S
    assert criu.env_timeout({"VLLM_SNAPSHOT_CRIU_TIMEOUT": "90"}) == 90.0
    with pytest.raises(UsageError, match="positive number"):
        criu.env_timeout({"VLLM_SNAPSHOT_CRIU_TIMEOUT": "-1"})


def test_reclaim_dry_run_lists_without_removing(tmp_path, monkeypatch):
    from vllm_snapshot.store import archive, reclaim, registry, store

    stale = tmp_path / "vllm-snapshot-stage-1"
    stale.mkdir()
    monkeypatch.setattr(archive, "stale_staging", lambda parents: [stale] if tmp_path in parents else [])
    monkeypatch.setattr(store, "stale_temps", lambda near: [near / ".x.tmp-1"])
    monkeypatch.setattr(registry, "entries", lambda: [])
    monkeypatch.setattr(registry, "orphans", lambda: [])
    from vllm_snapshot.host import cgroups

    monkeypatch.setattr(cgroups, "empty_leaves", lambda hs=None: [])  # this host's own leftovers stay out of it
    removed = []
    monkeypatch.setattr(archive, "remove_staging", removed.append)
    assert reclaim.reclaim(tmp_path, dry_run=True) == [str(stale), str(tmp_path / ".x.tmp-1")]
    assert removed == [] and stale.exists()
    monkeypatch.setattr(reclaim, "remove_empty_cgroups", lambda: ["/sys/fs/cgroup/vllm-snapshot/a-1"])
    from vllm_snapshot.store import locks

    monkeypatch.setattr(locks, "clean_stale", lambda: [Path("/run/x.lock")])
    assert reclaim.reclaim(tmp_path) == [str(stale), "/run/x.lock", "empty cgroup /sys/fs/cgroup/vllm-snapshot/a-1"]
    assert removed == [stale]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a PID namespace")
@pytest.mark.parametrize("state", ["idle", "serving", "served"])
def test_an_engine_root_whose_parent_died_is_an_orphan_unless_it_serves_or_served(state):
    # what a SIGKILLed restore leaves: PID 1 of its own namespace, spec as last argument,
    # reparented to init, serving nothing; the same tree with its parent alive is no orphan,
    # nor one that listens on a TCP port of this namespace (somebody's live server), nor one
    # that was told to serve and listens on nothing (it drains; or its socket is in a network
    # namespace the caller cannot read): CI saw a draining engine of the other xdist worker's
    # run dir killed so by this worker's reclaim, its requests in flight cut
    import subprocess
    import sys
    import time

    import psutil

    from vllm_snapshot.store import registry

    spec = '{"oracle_prompt": "test-orphan-%d"}' % os.getpid()
    code = {"idle": "import time; time.sleep(60)",
            "serving": "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); time.sleep(60)",
            "served": "import time; from vllm_snapshot.host.procs import mark_served; mark_served(); time.sleep(60)"}[state]
    p = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", code, spec], start_new_session=True)
    root = None
    try:
        deadline = time.monotonic() + 10
        while root is None and time.monotonic() < deadline:
            kids = psutil.Process(p.pid).children()
            root = kids[0].pid if kids and kids[0].cmdline()[-1:] == [spec] else None
            time.sleep(0.02)
        assert root is not None, "the namespace's init did not start"
        assert root not in [o.pid for o in registry.orphans()]  # its parent (unshare) lives
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while psutil.Process(root).ppid() == p.pid and time.monotonic() < deadline:
            time.sleep(0.02)
        if state == "serving":  # listening by now: the same process bound before it slept
            deadline = time.monotonic() + 10
            while not psutil.Process(root).net_connections() and time.monotonic() < deadline:
                time.sleep(0.02)
        if state == "served":  # named by now: the same process did so before it slept
            deadline = time.monotonic() + 10
            while psutil.Process(root).name() != "vllm-served" and time.monotonic() < deadline:
                time.sleep(0.02)
        assert (root in [o.pid for o in registry.orphans()]) is (state == "idle")
    finally:
        p.kill()
        p.wait()
        if root is not None:
            try:
                psutil.Process(root).kill()
            except psutil.Error:
                pass
