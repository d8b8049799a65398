"""The keys of the rows the commands return and ``--json`` prints (``list``, ``status``,
``stop``, ``serve``, ``prune``, a failed ``switch``'s details): each row built by the operation (through
the recording FakeWorld) has exactly the keys of its TypedDict in vllm_snapshot/report/results.py
(or ops/switch.py), and those keys, with the result's own top-level keys, are pinned here: a key
renamed, added or dropped changes what scripts reading ``--json`` see, and must change this
test with it."""

from __future__ import annotations

from pathlib import Path
from typing import get_type_hints

import pytest

from fakes import FakeWorld
from vllm_snapshot import ops
from vllm_snapshot.errors import CriuError, ModelChangedError, OracleMismatchError
from vllm_snapshot.ops.switch import OldEngine
from vllm_snapshot.report import results as R
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.store.registry import Entry

ROOT = Path("/snaps")


def _keys(td) -> set[str]:
    """The keys a TypedDict declares (its annotations, resolved)."""
    return set(get_type_hints(td))


def test_list_rows_readable_and_broken_have_the_snapshot_row_keys(tmp_path):
    t = FakeWorld()
    t.snapshots = {tmp_path / "good": t.manifest}
    listed = ops.list_snapshots(tmp_path, tools=t.tools)  # list checks that its root is a directory
    (good,) = listed.rows
    broken = ops.describe(tmp_path / "gone", t.tools)  # open_snapshot refuses: listed as incompatible
    assert good["compatible"] is True and broken["compatible"] is False
    want = ["name", "path", "last_restore", "model", "key", "created", "kind", "sleep_level", "raw_bytes",
            "stored_bytes", "weights", "weights_bytes", "compatible", "why"]
    assert set(good) == set(broken) == _keys(R.SnapshotRow) == set(want)
    assert sorted(listed.to_json()) == ["root", "root_exists", "snapshots"]


def test_status_rows_have_the_engine_row_keys():
    t = FakeWorld()
    t.entries = [Entry("/snaps/a", 77, 0, "127.0.0.1", 8101, 1.0, "detached", frontend="f" * 16)]
    res = ops.status(tools=t.tools)
    (row,) = res.engines
    want = ["snapshot", "pid", "supervisor_pid", "host", "port", "started_at", "mode", "create_time", "scheme",
            "cgroup", "auth", "drain_s", "frontend_args", "log_file", "url", "merge_pages", "ksm_merged_pages"]
    assert set(row) == _keys(R.EngineRow) == set(want)
    assert "frontend" not in row  # the fingerprint is the registry's, never shown
    assert sorted(res.to_json()) == ["empty_cgroups", "engines", "exited", "orphans"]


def test_stop_rows_have_the_stopped_row_keys():
    t = FakeWorld()
    t.entries = [Entry("/snaps/a", 77, 0, "127.0.0.1", 8101, 1.0, "detached")]
    res = ops.stop_engines(None, 8101, tools=t.tools)
    (row,) = res.stopped
    want = ["pid", "snapshot", "port", "seconds", "drain_s", "drained", "cut", "killed"]
    assert set(row) == _keys(R.StoppedRow) == set(want)
    assert sorted(res.to_json()) == ["stopped"]
    assert sorted(ops.stop_engines(None, 9999, tools=t.tools).to_json()) == ["nothing", "stopped"]


def test_prune_kept_unusable_rows_have_their_keys():
    t = FakeWorld(fail={"verify_model:quick": ModelChangedError("the model directory /models/tiny does not exist",
                                                          details={"changed": [], "missing": ["a"], "added": []})})
    t.snapshots = {ROOT / "away": t.manifest}
    res = ops.prune(ROOT, None, None, True, tools=t.tools, unusable=True)
    (row,) = res.kept_unusable
    assert res.deleted == [] and "delete_snapshot" not in t.calls
    assert set(row) == _keys(R.KeptUnusable) == {"path", "error", "message", "hint"}
    assert row["path"] == str(ROOT / "away") and row["error"] == "model-changed"
    assert sorted(res.to_json()) == ["deleted", "dry_run", "kept_running", "kept_unusable", "not_deleted",
                                     "partial_pulls", "temp_removed", "weights_kept_for", "weights_removed"]


def _serve(t: FakeWorld, args: list[str]):
    req = ops.ServeRequest(model="/models/tiny", root=ROOT, engine_args=args, port=8123)
    return ops.serve(req, Reporter(), tools=t.tools)[0]


def test_serve_refused_and_not_matching_rows_have_their_keys():
    t = FakeWorld()
    t.snapshots = {}
    args = ["--kv-cache-memory-bytes", "64M"]
    _serve(t, [*args, "--max-model-len", "256"])  # another key: not matching
    first = _serve(t, args)
    (old,) = [p for p in t.snapshots if t.snapshots[p].key.value == first.key]
    t.refuse[old] = OracleMismatchError("the restored engine's oracle differs")
    served = _serve(t, args)
    (refused,) = served.refused
    (other,) = served.others
    assert set(refused) == _keys(R.Refused) == {"snapshot", "code", "reason"}
    assert set(other) == _keys(R.NotMatching) == {"snapshot", "why"}
    assert sorted(served.to_json()) == [
        "detached", "key", "not_matching", "oracle", "path", "pid", "push_s", "refused", "restore_s",
        "served_name", "serving_after_s", "snapshot", "timings", "total_s", "url", "warnings"]


def test_a_failed_switch_lists_what_it_stopped_with_the_old_engine_keys():
    t = FakeWorld(fail={"restore_tree": CriuError("CRIU restore failed")})
    t.entries = [Entry("/snaps/old", 77, 0, "::1", 8101, 0.0, "detached")]
    with pytest.raises(CriuError) as ei:
        ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools, rollback=False)
    (row,) = ei.value.details["stopped"]
    assert set(row) == _keys(OldEngine) == {"pid", "snapshot", "host", "port"}
