"""store: safety checks on snapshot dirs, private temp dirs, stale temp cleanup, publish."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_snapshot.store import layout, store
from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, UsageError


@pytest.fixture
def base(tmp_path) -> Path:
    """A private parent dir (pytest's tmp dirs are 0700 under sticky /tmp)."""
    d = tmp_path / "snaps"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    return d


def _snapdir(base: Path, name: str = "s", mode: int = 0o700) -> Path:
    d = base / name
    d.mkdir()
    os.chmod(d, mode)
    return d


def test_private_dir_is_trusted(base):
    # the trust checks' false refusal: a private snapshot of ours under a private parent passes
    d = _snapdir(base)
    assert layout.check_dir_safety(d) is None
    (d / layout.IMAGES).mkdir(mode=0o700)
    (d / layout.MANIFEST).write_text("{}")
    os.chmod(d / layout.MANIFEST, 0o600)
    assert layout.open_trusted(d) == layout.SnapshotDir(d)


def test_missing_dir_is_a_usage_error(base):
    with pytest.raises(UsageError, match="does not exist"):
        layout.check_dir_safety(base / "nope")


def test_symlink_is_refused(base):
    real = _snapdir(base, "real")
    link = base / "link"
    link.symlink_to(real)
    # a usage error naming where it points (a trial: a link to a good snapshot was "corrupt", exit 5,
    # with a hint to delete it)
    with pytest.raises(UsageError, match="symlink") as ei:
        layout.check_dir_safety(link)
    assert str(link) in ei.value.message and ei.value.exit_code == 2 and str(real.resolve()) in ei.value.hint


def test_the_damaged_hint_names_a_command_that_removes_the_snapshot(base):
    # a trial: restore's hint said `vllm-snapshot delete`, which refuses a snapshot whose manifest
    # itself is damaged (it removes only what is surely a snapshot)
    from helpers import write_snapshot_dir

    good = base / "good"
    write_snapshot_dir(good)
    (good / layout.IMAGES).mkdir(mode=0o700)
    assert f"`vllm-snapshot delete {good}`" in layout.damaged_hint(good)
    bad = base / "bad"
    write_snapshot_dir(bad)
    (bad / layout.IMAGES).mkdir(mode=0o700)
    (bad / "manifest.json").write_text("{")
    hint = layout.damaged_hint(bad)
    assert f"`rm -r {bad}`" in hint and "not readable JSON" in hint and "vllm-snapshot delete " not in hint


def test_regular_file_is_refused(base):
    f = base / "file"
    f.write_text("x")
    with pytest.raises(CorruptSnapshotError, match="not a directory"):
        layout.check_dir_safety(f)


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o750, 0o701, 0o707])
def test_snapshot_dir_not_0700_is_refused(base, mode):
    d = _snapdir(base, mode=mode)
    with pytest.raises(CorruptSnapshotError) as ei:
        layout.check_dir_safety(d)
    assert f"{mode:04o}" in ei.value.message and str(d) in ei.value.message


def test_group_writable_parent_is_refused(base):
    mid = base / "shared"
    mid.mkdir()
    os.chmod(mid, 0o775)
    d = _snapdir(mid)
    with pytest.raises(EnvironmentProblem, match="writable by group/others") as ei:
        layout.check_dir_safety(d)
    assert str(mid) in ei.value.message and ei.value.hint.startswith(f"chmod 0700 {mid}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_sticky_parent_is_trusted_only_when_root_owned(base):
    mid = base / "tmpish"
    mid.mkdir()
    os.chmod(mid, 0o1777)
    d = _snapdir(mid)
    os.chown(mid, 0, 0)
    layout.check_dir_safety(d)  # like /tmp
    os.chown(mid, 1234, 1234)  # sticky and world-writable, owned by someone else
    with pytest.raises(EnvironmentProblem, match=str(mid)):
        layout.check_dir_safety(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_dir_owned_by_someone_else_is_refused(base):
    d = _snapdir(base)
    os.chown(d, 1234, 1234)
    with pytest.raises(CorruptSnapshotError, match="uid 1234"):
        layout.check_dir_safety(d)


def test_check_file_modes(base):
    d = _snapdir(base)
    (d / "images").mkdir(mode=0o700)
    f = d / "images" / "pages-1.img"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    layout.check_file_modes(d)
    os.chmod(f, 0o644)
    with pytest.raises(CorruptSnapshotError, match="pages-1.img"):
        layout.check_file_modes(d)
    os.chmod(f, 0o600)
    (d / "images" / "evil.img").symlink_to("/etc/passwd")
    with pytest.raises(CorruptSnapshotError, match="evil.img"):
        layout.check_file_modes(d)


def test_prepare_target_refuses_an_existing_target(base):
    t = _snapdir(base, "taken")
    with pytest.raises(UsageError, match="already exists"):
        store.prepare_target(t)
    dangling = base / "dangling"
    dangling.symlink_to(base / "nowhere")
    with pytest.raises(UsageError, match="already exists"):
        store.prepare_target(dangling)


def test_prepare_target_refuses_a_missing_parent(base):
    with pytest.raises(UsageError, match="does not exist"):
        store.prepare_target(base / "no" / "snap")


def test_prepare_target_creates_a_private_hidden_temp_sibling(base):
    target = base / "snap"
    tmp = store.prepare_target(target)
    assert tmp.parent == base
    assert tmp.name.startswith(".snap" + store.TMP_MARK)
    assert not target.exists()
    for d in (tmp, tmp / store.IMAGES, tmp / store.FILES):
        assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert (tmp / "owner.pid").read_text() == str(os.getpid())
    tmp2 = store.prepare_target(target)  # a concurrent create gets its own dir ...
    assert tmp2 != tmp and tmp2.is_dir()
    assert tmp.is_dir()  # ... and never removes the other's


def test_fresh_temp_without_owner_pid_is_not_removed(base):
    # a create between mkdtemp and writing owner.pid must not lose its dir to a concurrent clean
    young = _temp(base, "snap", None)
    assert store.clean_stale_temps(base, "snap") == []
    assert young.exists()
    old = time.time() - store.NO_PID_GRACE_S - 5
    os.utime(young, (old, old))
    assert store.clean_stale_temps(base, "snap") == [young]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _temp(base: Path, name: str, pid: int | None) -> Path:
    d = base / f".{name}{store.TMP_MARK}{os.urandom(3).hex()}"
    d.mkdir(mode=0o700)
    (d / "images").mkdir()
    if pid is not None:
        (d / "owner.pid").write_text(str(pid))
    return d


def test_clean_stale_temps_removes_dead_owners_and_keeps_live_ones(base):
    dead = _temp(base, "snap", _dead_pid())
    live = _temp(base, "snap", os.getpid())
    other = _temp(base, "other", _dead_pid())
    unrelated = _snapdir(base, "snap")
    removed = store.clean_stale_temps(base, "snap")
    assert removed == [dead]
    assert not dead.exists() and live.exists() and other.exists() and unrelated.exists()
    # without a name every stale temp dir goes
    assert store.clean_stale_temps(base) == [other]
    assert live.exists()


def test_clean_stale_temps_respects_min_age(base):
    d = _temp(base, "snap", _dead_pid())
    assert store.clean_stale_temps(base, "snap", min_age_s=3600) == []
    assert d.exists()
    os.utime(d, (1, 1))  # very old
    assert store.clean_stale_temps(base, "snap", min_age_s=3600) == [d]


def test_clean_stale_temps_never_follows_symlinks(base, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (base / f".snap{store.TMP_MARK}link").symlink_to(victim)
    assert store.clean_stale_temps(base, "snap") == []
    assert (victim / "keep").exists()


def test_prepare_target_cleans_stale_temps_of_the_same_name(base):
    dead = _temp(base, "snap", _dead_pid())
    tmp = store.prepare_target(base / "snap")
    assert not dead.exists() and tmp.exists()


def test_publish_renames_and_drops_owner_pid(base):
    target = base / "snap"
    tmp = store.prepare_target(target)
    (tmp / "owner.pid").write_text(str(os.getpid()))
    (tmp / "manifest.json").write_text("{}")
    store.publish(tmp, target)
    assert not tmp.exists()
    assert (target / "manifest.json").read_text() == "{}"
    assert not (target / "owner.pid").exists()
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    layout.check_dir_safety(target)


def test_publish_refuses_when_target_appeared(base):
    target = base / "snap"
    tmp = store.prepare_target(target)
    _snapdir(base, "snap")
    with pytest.raises(UsageError, match="appeared"):
        store.publish(tmp, target)
    assert tmp.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_check_file_modes_refuses_a_file_owned_by_another_user(tmp_path):
    from vllm_snapshot.store import layout, store
    from vllm_snapshot.errors import CorruptSnapshotError

    d = tmp_path / "snap"
    (d / "images").mkdir(parents=True, mode=0o700)
    f = d / "images" / "pages-1.img"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    layout.check_file_modes(d)
    os.chown(f, 12345, 12345)
    with pytest.raises(CorruptSnapshotError, match="owned by uid 12345"):
        layout.check_file_modes(d)


def test_a_path_under_a_regular_file_says_the_file_is_a_file(base, monkeypatch):
    # a trial: `create --snapshot-dir LOG/x` and `restore --log-file LOG/x` with LOG a regular
    # file said "LOG does not exist"; one level deeper (LOG/x/y) create was an internal error
    from vllm_snapshot import paths
    from vllm_snapshot.store import locks

    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(base / "run"))
    f = base / "create1.log"
    f.write_text("log\n")
    for target in (f / "x", f / "x" / "y"):
        assert store.canonical(target) == target  # no NotADirectoryError
        for refuse in (lambda: locks.snapshot_lock(target, must_exist=False), lambda: store.prepare_target(target)):
            with pytest.raises(UsageError) as e:
                refuse()
            assert f"{f} is a file, not a directory" in e.value.message and "does not exist" not in e.value.message
    assert paths.why_not_a_dir(base / "no" / "where") == f"{base / 'no' / 'where'} does not exist"
    assert f.read_text() == "log\n" and sorted(p.name for p in base.iterdir()) == ["create1.log"]
