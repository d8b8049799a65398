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
    (snap / "images").mkdir(mode=0o700)
    (snap / "manifest.json").write_text('{"schema_version": 1,')
    with pytest.raises(CorruptSnapshotError, match="not valid JSON") as ei:
        manifest.read(snap)
    # `delete` refuses a directory whose manifest is not readable (it removes only what is surely a
    # snapshot): the hint names what does remove it, and the command is right (a trial ran it)
    hint = ei.value.hint
    assert f"`rm -r {snap}`" in hint and "vllm-snapshot delete " not in hint and "re-create" in hint, hint
    from vllm_snapshot.cli import app as cli

    assert cli.main(["delete", str(snap)]) == 5 and snap.exists()


def test_restore_of_a_name_that_does_not_exist_points_at_list(tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(root))
    for cmd in (["restore", "nosuch", "--port", "8999", "--json"], ["verify", "nosuch", "--json"],
                ["inspect", "nosuch", "--json"]):
        code = cli.main(cmd)
        err = json.loads(capsys.readouterr().out)["error"]
        assert code == 2 and "does not exist" in err["message"], (cmd, err)
        assert err["hint"] and "`vllm-snapshot list` shows the snapshots there" in err["hint"], (cmd, err)  # the root of the env


def test_the_lock_of_a_missing_snapshot_points_at_list(tmp_path):
    from vllm_snapshot.store import locks

    with pytest.raises(UsageError) as ei:
        with locks.snapshot_lock(tmp_path / "nosuch", shared=True):
            pass
    assert "list" in (ei.value.hint or ""), ei.value.hint


def test_list_under_a_world_writable_root_warns_in_creates_words(tmp_path, monkeypatch, capsys):
    # a trial: `--root` on a 0777 folder: create refuses, list said nothing
    import os

    from vllm_snapshot.errors import EnvironmentProblem
    from vllm_snapshot.store import layout

    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(EnvironmentProblem) as ei:  # what create says (store.prepare_target)
        layout.check_parents(root / "new")
    assert cli.main(["--root", str(root), "list"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {ei.value.message}" in err and "(fix: chmod 0700" in err, err
    assert "create and restore refuse snapshots below it" in err
    assert cli.main(["--root", str(root), "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"][0].startswith(ei.value.message)
    os.chmod(root, 0o700)
    assert cli.main(["--root", str(root), "list"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_create_onto_a_file_says_it_is_a_file_not_a_snapshot(tmp_path):
    from vllm_snapshot.effects.tools import local_tools

    f = tmp_path / "passwd"
    f.write_text("root:x:0:0\n")
    t = FakeWorld()
    t.tools.host.path_exists = lambda p: p == f
    t.tools.host.path_kind = local_tools().host.path_kind
    with pytest.raises(UsageError) as ei:
        ops.create(ops.CreateRequest(model="/m", target=f, engine_args=["--kv-cache-memory-bytes", "1M"]),
                   Reporter(), tools=t.tools)
    assert ei.value.message == f"{f} already exists and is a file, not a snapshot; refusing to overwrite it"
    assert "launch_engine" not in t.calls
    t.tools.host.path_exists = lambda p: p in (SNAP, SNAP / "manifest.json")  # a snapshot: said as before
    with pytest.raises(UsageError, match="refusing to overwrite a snapshot"):
        ops.create(ops.CreateRequest(model="/m", target=SNAP, engine_args=["--kv-cache-memory-bytes", "1M"]),
                   Reporter(), tools=t.tools)
    assert local_tools().host.path_kind(tmp_path) == "a directory"
    assert local_tools().host.path_kind(tmp_path / "none") == "nothing"
