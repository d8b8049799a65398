"""A filesystem that refuses a write (read-only, full, a mount point, denied) is this host's
problem, not a bug: exit 11 ``environment`` naming the path and what to do, never exit 1
``internal`` with a raw OSError. No root, no engine: the refusals are simulated."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from helpers import write_snapshot_dir

from vllm_snapshot import errors
from vllm_snapshot.cli import app as cli
from vllm_snapshot.store import layout, store


@pytest.mark.parametrize("code,words,hint", [
    (errno.EROFS, "is read-only", "remount it read-write"),
    (errno.ENOSPC, "no space left on the filesystem of", "free space there"),
    (errno.EDQUOT, "disk quota is used up", "free space there"),
    (errno.EBUSY, "is busy", "umount"),
    (errno.EACCES, "permission denied", "root"),
    (errno.EPERM, "permission denied", "lsattr"),
])
def test_the_cli_maps_a_refusing_filesystem_to_exit_11_naming_the_path(code, words, hint, tmp_path, capsys,
                                                                          monkeypatch):
    from vllm_snapshot import ops

    def refused(*a, **kw):
        raise OSError(code, os.strerror(code), "/mnt/ro/store/a", "/mnt/ro/store/.a.tmp-deleting-1")

    monkeypatch.setattr(ops, "list_snapshots", refused)
    rc = cli.main(["--root", str(tmp_path), "list"])
    out, err = capsys.readouterr()
    assert rc == 11, err
    assert err.startswith("error [environment]: ") and words in err and "/mnt/ro/store/a" in err, err
    assert "hint: " in err and hint in err and "internal" not in err and "OSError" not in err
    rc = cli.main(["--root", str(tmp_path), "list", "--json"])
    e = json.loads(capsys.readouterr().out)["error"]
    assert rc == 11 and e["code"] == "environment" and e["details"]["path"] == "/mnt/ro/store/a"
    assert e["details"]["errno"] == errno.errorcode[code]


def test_other_os_errors_stay_internal(tmp_path, capsys, monkeypatch):
    from vllm_snapshot import ops

    def broken(*a, **kw):
        raise OSError(errno.EIO, "Input/output error", "/x")

    monkeypatch.setattr(ops, "list_snapshots", broken)
    assert cli.main(["--root", str(tmp_path), "list"]) == 1
    assert "error [internal]: OSError" in capsys.readouterr().err
    assert errors.from_os_error(OSError(errno.EIO, "x")) is None


def _snapshot(tmp_path: Path) -> Path:
    snap = tmp_path / "store" / "a"
    write_snapshot_dir(snap)
    (snap / layout.IMAGES).mkdir(mode=0o700)
    os.chmod(tmp_path / "store", 0o700)
    return snap


@pytest.mark.parametrize("code,words,hint", [
    (errno.EROFS, "is on a read-only filesystem; nothing was deleted", "remount"),
    (errno.EBUSY, "is busy (a mount point, or in use); nothing was deleted", "umount"),
])
def test_delete_on_a_read_only_store_or_of_a_mount_point_says_so(code, words, hint, tmp_path, monkeypatch):
    snap = _snapshot(tmp_path)

    def rename(src, dst):
        raise OSError(code, os.strerror(code), str(src), str(dst))

    monkeypatch.setattr(store.os, "rename", rename)
    with pytest.raises(errors.EnvironmentProblem) as e:
        store.delete(snap)
    assert e.value.exit_code == 11 and str(snap) in e.value.message and words in e.value.message
    assert hint in e.value.hint and str(snap.parent) in e.value.hint
    monkeypatch.undo()
    assert (snap / layout.MANIFEST).is_file()  # nothing was lost
    store.delete(snap)
    assert not snap.exists()


MOUNTINFO = """22 1 8:1 / / rw - ext4 /dev/sda1 rw
40 22 0:50 / {root} rw - tmpfs tmpfs rw
41 40 8:1 /data {root}/store/a/images rw - ext4 /dev/sda1 rw
42 40 8:1 /data {root}/store/ab rw - ext4 /dev/sda1 rw
"""


def test_delete_refuses_a_snapshot_with_a_filesystem_mounted_in_it_before_touching_anything(tmp_path, monkeypatch):
    # a trial: a bind mount in a snapshot's images/ -- rmtree emptied the mounted directory (another
    # filesystem's files) and then failed with "[Errno 16] Device or resource busy: 'images'"
    snap = _snapshot(tmp_path)
    info = MOUNTINFO.format(root=tmp_path)
    assert store.mounts_within(snap, info) == [str(snap / "images")]  # not .../ab, a sibling
    assert store.mounts_within(tmp_path / "store" / "ab", info) == [str(tmp_path / "store" / "ab")]
    assert store.mounts_within(tmp_path / "store" / "x", info) == []
    (snap / layout.IMAGES / "pages-1.img").write_bytes(b"x")
    monkeypatch.setattr(store, "_mountinfo", lambda: info)
    with pytest.raises(errors.EnvironmentProblem) as e:
        store.delete(snap)
    assert e.value.exit_code == 11
    assert f"{snap} is a mount point or has filesystems mounted in it ({snap / 'images'}); nothing was deleted" \
        in e.value.message
    assert f"`umount {snap / 'images'}`" in e.value.hint
    assert (snap / layout.IMAGES / "pages-1.img").exists() and (snap / layout.MANIFEST).exists()


def test_prune_goes_past_a_snapshot_it_cannot_delete_and_exits_with_its_code(tmp_path, monkeypatch, capsys):
    # noticed in a review: the first snapshot delete refused (a mount in it) ended the prune --
    # the other old snapshots stayed and no leftover was reclaimed; `rm a b` goes on past `a`
    from helpers import make_manifest

    from vllm_snapshot.report import results as R

    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(tmp_path / "store"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for name in ("a", "b", "c"):
        snap = tmp_path / "store" / name
        write_snapshot_dir(snap, make_manifest(images=(), created_at="2026-12-01T10:00:00+00:00"))
        for sub in ("images", "files"):
            (snap / sub).mkdir(mode=0o700)
    os.chmod(tmp_path / "store", 0o700)
    stale = tmp_path / "store" / f".x{store.TMP_MARK}1"  # a crashed create's temp dir (its owner is gone)
    stale.mkdir(mode=0o700)
    (stale / store.OWNER_PID).write_text("999999999")
    monkeypatch.setattr(store, "_mountinfo", lambda: MOUNTINFO.format(root=tmp_path))  # a mount in a/images
    assert cli.main(["prune", "--older-than", "1h", "--json"]) == 11
    got = json.loads(capsys.readouterr().out)
    assert sorted(Path(p).name for p in got["deleted"]) == ["b", "c"]
    [nd] = got["not_deleted"]
    assert set(nd) == set(R.NotDeleted.__annotations__)  # the row is its declaration
    assert nd["path"] == str(tmp_path / "store" / "a") and nd["error"] == "environment" and nd["exit_code"] == 11
    assert "mounted in it" in nd["message"] and "umount" in nd["hint"]
    assert (tmp_path / "store" / "a" / layout.MANIFEST).is_file()  # left whole
    assert not (tmp_path / "store" / "b").exists() and not stale.exists()  # the rest went, leftovers too
    write_snapshot_dir(tmp_path / "store" / "d", make_manifest(images=(), created_at="2026-12-01T10:00:00+00:00"))
    for sub in ("images", "files"):
        (tmp_path / "store" / "d" / sub).mkdir(mode=0o700)
    assert cli.main(["prune", "--older-than", "1h"]) == 11
    out = capsys.readouterr().out
    assert f"could not delete {tmp_path / 'store' / 'a'}: {tmp_path / 'store' / 'a'} is a mount point" in out
    assert f"deleted {tmp_path / 'store' / 'd'}" in out


def test_a_delete_that_fails_half_way_names_what_is_left(tmp_path, monkeypatch):
    snap = _snapshot(tmp_path)

    def busy(path, *a, **kw):
        raise OSError(errno.EBUSY, "Device or resource busy", "images")

    monkeypatch.setattr(store.shutil, "rmtree", busy)
    with pytest.raises(errors.EnvironmentProblem) as e:
        store.delete(snap)
    left = list((tmp_path / "store").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".a.tmp-deleting-")
    assert f"{snap} was only partly deleted: Device or resource busy (images); what is left is {left[0]}" \
        in e.value.message and f"rm -r {left[0]}" in e.value.hint


def test_a_read_only_log_directory_refuses_a_detached_restore_before_it_starts(tmp_path, monkeypatch):
    from vllm_snapshot.effects.engine import LocalEngineTools

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    monkeypatch.setenv("VLLM_SNAPSHOT_LOG_DIR", str(logs))
    real = os.open

    def ro_open(path, flags, *a, **kw):
        if str(path).startswith(str(logs)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", ro_open)
    with pytest.raises(errors.EnvironmentProblem) as e:
        LocalEngineTools().default_log_file(Path("/srv/snaps/tiny"), 8000)
    assert e.value.exit_code == 11
    assert f"the engine log directory {logs} is on a read-only filesystem" in e.value.message
    assert "nothing was started" in e.value.message
    assert "VLLM_SNAPSHOT_LOG_DIR" in e.value.hint and "--log-file" in e.value.hint
    monkeypatch.setattr(os, "open", real)
    assert LocalEngineTools().default_log_file(Path("/srv/snaps/tiny"), 8000) == logs / "tiny-8000.log"


def test_list_names_a_snapshot_whose_manifest_was_lost(tmp_path, monkeypatch, capsys):
    # a trial: `rm store/tiny1m/manifest.json` made 1.3 GiB invisible to list, prune and doctor
    from helpers import make_manifest

    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(tmp_path / "store"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    good = tmp_path / "store" / "good"
    write_snapshot_dir(good, make_manifest(images=()))
    for sub in ("images", "files"):
        (good / sub).mkdir(mode=0o700)
    lost = tmp_path / "store" / "tiny copy"
    (lost / layout.IMAGES).mkdir(parents=True, mode=0o700)
    (lost / layout.IMAGES / "pages-1.img").write_bytes(b"x" * 100)
    (tmp_path / "store" / "not-a-snapshot").mkdir(mode=0o700)  # no images/: somebody else's dir, not named
    os.chmod(tmp_path / "store", 0o700)
    assert cli.main(["list", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in got["snapshots"]] == ["good"]
    (w,) = got["warnings"]
    assert f"{lost} holds images/ but no manifest.json" in w and f"`rm -r '{lost}'`" in w
    assert cli.main(["list"]) == 0
    assert f"{lost} holds images/ but no manifest.json" in capsys.readouterr().err
