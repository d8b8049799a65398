"""What a new-user trial found without a hint: refusals of a damaged snapshot (exit 5) and of
a snapshot that does not exist (exit 2) say what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_snapshot import ops
from vllm_snapshot.cli import app as cli
from vllm_snapshot.errors import CorruptSnapshotError, UsageError
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.store import manifest

from fakes import FakeWorld, isolated_manifest
from helpers import write_snapshot_dir

SNAP = Path("/snaps/tiny")


def _damaged(hint: str | None, snap: Path = SNAP) -> None:
    assert hint is not None, "a damaged snapshot is refused without a hint"
    assert f"vllm-snapshot delete {snap}" in hint and "re-create" in hint and "pull it again" in hint, hint


def test_restore_refused_for_an_image_checksum_says_what_to_do():
    t = FakeWorld(manifest=isolated_manifest())
    t.corrupt_images = CorruptSnapshotError("image pages-1.img fails its checksum")
    with pytest.raises(CorruptSnapshotError, match="pages-1.img") as ei:
        ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123), Reporter(), tools=t.tools)
    _damaged(ei.value.hint)


def test_verify_refused_for_an_image_checksum_says_what_to_do():
    t = FakeWorld(fail={"verify_images": CorruptSnapshotError("image pages-4.img fails its checksum")})
    with pytest.raises(CorruptSnapshotError) as ei:
        ops.verify(SNAP, tools=t.tools)
    _damaged(ei.value.hint)


def test_a_hint_already_given_is_kept():
    t = FakeWorld(fail={"verify_images": CorruptSnapshotError("x", hint="do this")})
    with pytest.raises(CorruptSnapshotError) as ei:
        ops.verify(SNAP, tools=t.tools)
    assert ei.value.hint == "do this"


def test_a_manifest_that_is_not_json_says_what_to_do(tmp_path):
    snap = tmp_path / "s"
    write_snapshot_dir(snap)
    (snap / "manifest.json").write_text('{"schema_version": 1,')
    with pytest.raises(CorruptSnapshotError, match="not valid JSON") as ei:
        manifest.read(snap)
    _damaged(ei.value.hint, snap)


def test_restore_of_a_name_that_does_not_exist_points_at_list(tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(root))
    for cmd in (["restore", "nosuch", "--port", "8999", "--json"], ["verify", "nosuch", "--json"],
                ["inspect", "nosuch", "--json"]):
        code = cli.main(cmd)
        err = json.loads(capsys.readouterr().out)["error"]
        assert code == 2 and "does not exist" in err["message"], (cmd, err)
        assert err["hint"] and f"--root {root} list" in err["hint"], (cmd, err)


def test_the_lock_of_a_missing_snapshot_points_at_list(tmp_path):
    from vllm_snapshot.store import locks

    with pytest.raises(UsageError) as ei:
        with locks.snapshot_lock(tmp_path / "nosuch", shared=True):
            pass
    assert "list" in (ei.value.hint or ""), ei.value.hint
