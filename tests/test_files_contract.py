"""One behavioural contract for the snapshot-files role, run against the real SnapshotFiles (on
snapshot directories under this test's tmp dir) and the fake of tests/fakes.py in its store
mode (``FakeWorld.snapshots``: it keeps what is published): what create and restore rely on
from a snapshot that is missing, present, or whose image bytes were damaged at rest.

A snapshot "dumped" here holds the image bytes of :func:`helpers.make_manifest` (what the fake's
``pack`` answers); damaging one flips a byte of ``pages-1.img`` on disk (the real) or sets the
world's ``corrupt_images`` verdict (the fake: its stand-in for bad bytes). The signature checks
of test_protocols.py cannot see a fake that opens what the real refuses, overwrites what the
real keeps, or passes a checksum the real fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes import FakeWorld
from helpers import make_manifest
from vllm_snapshot.errors import CorruptSnapshotError, UsageError
from vllm_snapshot.effects.files import LocalSnapshotFiles
from vllm_snapshot.store import layout

#: the raw bytes of make_manifest()'s images (tests/helpers.py manifest_fields)
IMAGE_BYTES = {"inventory.img": b"inventory", "pages-1.img": b"\x01" * 8192}


class Real:
    """The real role over directories on this host."""

    def __init__(self) -> None:
        self.files = LocalSnapshotFiles()

    def dump(self, tmp: Path) -> None:
        """What CRIU leaves in a create's temp dir."""
        for name, data in IMAGE_BYTES.items():
            (tmp / layout.IMAGES / name).write_bytes(data)

    def damage(self, snapshot: Path) -> None:
        """One byte of the pages image flipped at rest (size unchanged)."""
        p = snapshot / layout.IMAGES / "pages-1.img"
        data = bytearray(p.read_bytes())
        data[100] ^= 0xFF
        p.write_bytes(bytes(data))


class Fake:
    """The fake role, keeping what is published (``snapshots``)."""

    def __init__(self) -> None:
        self.w = FakeWorld()
        self.w.snapshots = {}
        self.files = self.w.tools.files

    def dump(self, tmp: Path) -> None:
        pass  # the fake's pack answers the world's manifest's images

    def damage(self, snapshot: Path) -> None:
        self.w.corrupt_images = CorruptSnapshotError(f"image {snapshot}/images/pages-1.img fails its checksum")


@pytest.fixture(params=["local", "fake"])
def side(request):
    return Real() if request.param == "local" else Fake()


def _create(side, target: Path):
    """create's sequence: a temp dir, the dump, the images packed, the manifest published."""
    f = side.files
    tmp = f.prepare_target(target)
    side.dump(tmp)
    images = f.pack(tmp / layout.IMAGES, "none")
    m = make_manifest(images=images)
    f.publish(m, tmp, target)
    return m


def test_a_published_snapshot_opens_with_its_manifest_and_its_images_pack_to_their_checksums(side, tmp_path):
    f = side.files
    target = tmp_path / "snap"
    tmp = f.prepare_target(target)
    assert tmp != target and tmp.parent == target.parent  # beside it: the rename is atomic
    side.dump(tmp)
    images = f.pack(tmp / layout.IMAGES, "none")
    assert images == make_manifest().images  # names, raw/stored bytes, BLAKE3
    m = make_manifest(images=images)
    f.publish(m, tmp, target)
    assert f.open_snapshot(target) == m
    f.verify_images(target, m)  # intact: nothing raised
    assert f.pulled_from(target) is None  # made here, not pulled


def test_a_missing_snapshot_is_refused_as_a_usage_error(side, tmp_path):
    with pytest.raises(UsageError):
        side.files.open_snapshot(tmp_path / "never-made")


def test_a_discarded_create_publishes_nothing(side, tmp_path):
    f = side.files
    target = tmp_path / "snap"
    tmp = f.prepare_target(target)
    side.dump(tmp)
    f.discard(tmp)
    with pytest.raises(UsageError):
        f.open_snapshot(target)


def test_a_snapshot_is_never_overwritten(side, tmp_path):
    f = side.files
    target = tmp_path / "snap"
    m = _create(side, target)
    with pytest.raises(UsageError):
        f.prepare_target(target)  # create refuses before the engine starts
    tmp = tmp_path / "other-tmp"
    tmp.mkdir(mode=0o700)
    with pytest.raises(UsageError):
        f.publish(make_manifest(images=m.images, created_at="2026-01-01T00:00:00+00:00"), tmp, target)
    assert f.open_snapshot(target) == m


def test_what_a_snapshot_without_extras_needs_here_is_nothing(side, tmp_path):
    f = side.files
    target = tmp_path / "snap"
    m = _create(side, target)
    assert m.code is None and m.carried is None and m.weights is None and m.criu.tree_files == ()
    assert f.check_code(target, m) == []
    plan = f.plan_carried(target, m)
    assert (plan.place, plan.kept, plan.differs, plan.held) == ([], [], [], [])
    assert f.check_weights(m) is None
    assert f.check_tree_files(m) == []


def test_an_intact_snapshot_stages_and_its_verdict_passes(side, tmp_path):
    f = side.files
    target = tmp_path / "snap"
    m = _create(side, target)
    stage, verdict = f.stage_checking(target, m)
    try:
        verdict.wait()
    finally:
        f.unstage(stage)


def test_damaged_image_bytes_open_by_stat_and_fail_every_checksum(side, tmp_path):
    f = side.files
    target = tmp_path / "snap"
    m = _create(side, target)
    side.damage(target)
    assert f.open_snapshot(target) == m  # opening reads no image bytes: the size is unchanged
    with pytest.raises(CorruptSnapshotError, match="pages-1.img"):
        f.verify_images(target, m)
    stage, verdict = f.stage_checking(target, m)  # staging starts; the verdict says no
    try:
        with pytest.raises(CorruptSnapshotError, match="pages-1.img"):
            verdict.wait()
    finally:
        f.unstage(stage)
