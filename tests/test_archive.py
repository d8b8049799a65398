"""archive: compression spec, pack/unpack round trip, and the corruption matrix (fail closed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import blake3
import pytest

from vllm_snapshot.store import archive, checksums, staging
from vllm_snapshot.store.archive import Compression
from vllm_snapshot.errors import CorruptSnapshotError, UsageError

PAGES = "pages-1.img"


# ----------------------------------------------------------------------------- Compression

@pytest.mark.parametrize("text,kind,level", [
    ("none", "none", 0), ("zstd", "zstd", archive.DEFAULT_LEVEL), ("zstd:5", "zstd", 5),
    ("zstd:1", "zstd", 1), ("zstd:19", "zstd", 19),
])
def test_compression_parse(text, kind, level):
    c = Compression.parse(text)
    assert (c.kind, c.level) == (kind, level)
    assert Compression.parse(str(c)) == c


@pytest.mark.parametrize("text", ["", "gzip", "zstd:0", "zstd:20", "zstd:-3", "zstd:x", "none:3", "ZSTD", "zstd:5:1",
                                  "lz4:3"])
def test_compression_parse_refuses(text):
    with pytest.raises(UsageError) as ei:
        Compression.parse(text)
    assert ei.value.exit_code == 2 and repr(text) in ei.value.message


def test_compression_str():
    assert str(Compression("none", 0)) == "none"
    assert str(Compression("zstd", 7)) == "zstd:7"


# ----------------------------------------------------------------------------- helpers

def _make_images(d: Path) -> dict[str, bytes]:
    """A CRIU-like images dir: a large, partly random pages image and small ones."""
    d.mkdir(parents=True, exist_ok=True)
    files = {
        PAGES: os.urandom(48 * 1024) + b"\x00" * (64 * 1024) + os.urandom(16 * 1024),
        "pagemap-1.img": os.urandom(512),
        "inventory.img": b"\x01\x02inventory",
        "core-1.img": b"core" * 100,
        "empty.img": b"",
    }
    for n, data in files.items():
        (d / n).write_bytes(data)
        os.chmod(d / n, 0o644)  # CRIU writes some files 0644
    return files


#: kinds beside the ``--compress`` specs: ``zstd-legacy`` is one zstd frame per file (the format
#: before frames, which snapshots made by older versions have); ``zstd-small`` cuts the pages
#: image into several 16 KiB frames
KINDS = {"zstd-legacy": Compression("zstd", 1, frame_bytes=0), "zstd-small": Compression("zstd", 3, frame_bytes=16 << 10)}
ZSTD_KINDS = ["zstd", "zstd-legacy", "zstd-small"]


def _packed(tmp_path: Path, kind: str):
    snap = tmp_path / "snap" / "images"
    files = _make_images(snap)
    comp = KINDS.get(kind) or Compression.parse(kind)
    images = archive.pack(snap, comp)
    return snap, files, images


def _stage_parent(tmp_path: Path) -> Path:
    p = tmp_path / "stage-parent"
    p.mkdir(exist_ok=True)
    return p


def _raw_of(img_dir: Path, name: str) -> bytes:
    return (img_dir / name).read_bytes()


# ----------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("kind", ["none", "zstd", "zstd:9", "zstd-legacy", "zstd-small"])
def test_pack_then_unpack_round_trip(tmp_path, kind):
    snap, files, images = _packed(tmp_path, kind)
    zstd = kind.startswith("zstd")
    assert [i.name for i in images] == sorted(files)
    for img in images:
        data = files[img.name]
        assert img.raw_bytes == len(data)
        assert img.blake3 == blake3.blake3(data).hexdigest()
        assert img.compression == ("none" if not zstd else "zstd" if kind == "zstd-legacy" else "zstd-frames")
        if img.compression == "zstd-frames":
            assert sum(f.raw_bytes for f in img.frames) == img.raw_bytes
            assert all(f.raw_bytes <= (16 << 10 if kind == "zstd-small" else archive.FRAME_BYTES) for f in img.frames)
            if kind == "zstd-small" and img.name == PAGES:
                assert len(img.frames) == 8  # 128 KiB in 16 KiB frames
        stored = snap / archive.stored_name(img)
        assert stored.stat().st_size == img.stored_bytes
        assert stat.S_IMODE(stored.stat().st_mode) == 0o600
        if zstd:
            assert stored.name == img.name + ".zst"
            assert not (snap / img.name).exists()  # original removed
    if zstd:
        pages = next(i for i in images if i.name == PAGES)
        assert pages.stored_bytes < pages.raw_bytes  # the zero run compresses
    archive.check_layout(snap, images)
    checksums.verify(snap, images)
    parent = _stage_parent(tmp_path)
    stage = archive.unpack(snap, images, parent)
    try:
        assert stage.parent == parent and stage.name.startswith("vllm-snapshot-stage-")
        assert stat.S_IMODE(stage.stat().st_mode) == 0o700
        assert sorted(os.listdir(stage)) == sorted(files)
        for n, data in files.items():
            assert (stage / n).read_bytes() == data
            assert not (stage / n).is_symlink()  # CRIU does not follow symlinked images
            if not zstd and (stage / n).stat().st_dev == (snap / n).stat().st_dev:
                assert (stage / n).stat().st_ino == (snap / n).stat().st_ino  # none: hard link, nothing copied
    finally:
        archive.remove_staging(stage)
    assert not stage.exists()
    # removing the staging never removes the snapshot's files
    for img in images:
        assert (snap / archive.stored_name(img)).exists()


def test_pack_excludes_names(tmp_path):
    d = tmp_path / "images"
    _make_images(d)
    images = archive.pack(d, Compression("none", 0), exclude=frozenset({"inventory.img"}))
    assert "inventory.img" not in [i.name for i in images]


def test_unpack_none_with_a_relative_source_dir(tmp_path, monkeypatch):
    snap, files, images = _packed(tmp_path, "none")
    monkeypatch.chdir(tmp_path)
    rel = snap.relative_to(tmp_path)
    stage = archive.unpack(rel, images, _stage_parent(tmp_path))
    try:
        for n, data in files.items():
            assert (stage / n).read_bytes() == data
    finally:
        archive.remove_staging(stage)


# ----------------------------------------------------------------------------- corruption

def _check_all(snap: Path, images, parent: Path) -> None:
    """The restore order: cheap layout check, then verified unpack."""
    archive.check_layout(snap, images)
    stage = archive.unpack(snap, images, parent)
    archive.remove_staging(stage)


@pytest.mark.parametrize("kind", ["none", *ZSTD_KINDS])
def test_truncated_pages_image_is_refused_by_layout(tmp_path, kind):
    snap, _, images = _packed(tmp_path, kind)
    img = next(i for i in images if i.name == PAGES)
    p = snap / archive.stored_name(img)
    assert img.stored_bytes > 4096
    os.truncate(p, img.stored_bytes - 4096)
    with pytest.raises(CorruptSnapshotError, match=str(p)) as ei:
        archive.check_layout(snap, images)
    assert "bytes" in ei.value.message
    # and the checksum pass refuses it too, leaving no staging behind
    parent = _stage_parent(tmp_path)
    with pytest.raises(CorruptSnapshotError, match=PAGES):
        archive.unpack(snap, images, parent)
    assert os.listdir(parent) == []


@pytest.mark.parametrize("kind", ["none", *ZSTD_KINDS])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.97])
def test_one_flipped_byte_in_pages_image_is_refused(tmp_path, kind, where):
    snap, _, images = _packed(tmp_path, kind)
    img = next(i for i in images if i.name == PAGES)
    p = snap / archive.stored_name(img)
    off = int(img.stored_bytes * where)
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    assert p.stat().st_size == img.stored_bytes
    archive.check_layout(snap, images)  # same size: the cheap check cannot see it
    with pytest.raises(CorruptSnapshotError, match=str(p)):
        checksums.verify(snap, images)
    parent = _stage_parent(tmp_path)
    with pytest.raises(CorruptSnapshotError, match=str(p)):
        archive.unpack(snap, images, parent)
    assert os.listdir(parent) == []  # no staging dir left behind


@pytest.mark.parametrize("kind", ["none", *ZSTD_KINDS])
def test_missing_inventory_is_refused(tmp_path, kind):
    snap, _, images = _packed(tmp_path, kind)
    img = next(i for i in images if i.name == "inventory.img")
    (snap / archive.stored_name(img)).unlink()
    with pytest.raises(CorruptSnapshotError, match="inventory.img") as ei:
        archive.check_layout(snap, images)
    assert "missing" in ei.value.message
    parent = _stage_parent(tmp_path)
    with pytest.raises(CorruptSnapshotError, match="inventory.img"):
        archive.unpack(snap, images, parent)
    assert os.listdir(parent) == []
    with pytest.raises(CorruptSnapshotError, match="inventory.img"):
        checksums.verify(snap, images)


@pytest.mark.parametrize("kind", ["none", *ZSTD_KINDS])
def test_unexpected_extra_file_is_refused(tmp_path, kind):
    snap, _, images = _packed(tmp_path, kind)
    (snap / "pages-2.img").write_bytes(b"\x00" * 4096)
    with pytest.raises(CorruptSnapshotError, match="pages-2.img") as ei:
        _check_all(snap, images, _stage_parent(tmp_path))
    assert "unexpected" in ei.value.message


def test_uncompressed_image_where_zstd_is_recorded_is_refused(tmp_path):
    snap, files, images = _packed(tmp_path, "zstd")
    img = next(i for i in images if i.name == "core-1.img")
    (snap / archive.stored_name(img)).unlink()
    (snap / img.name).write_bytes(files[img.name])
    with pytest.raises(CorruptSnapshotError, match="core-1.img"):
        archive.check_layout(snap, images)


def test_image_replaced_by_symlink_is_refused(tmp_path):
    snap, _, images = _packed(tmp_path, "none")
    img = next(i for i in images if i.name == "core-1.img")
    p = snap / img.name
    real = tmp_path / "elsewhere.img"
    real.write_bytes(p.read_bytes())
    p.unlink()
    p.symlink_to(real)
    with pytest.raises(CorruptSnapshotError, match="not a regular file"):
        archive.check_layout(snap, images)


def test_same_size_replacement_of_a_zstd_frame_is_refused(tmp_path):
    # a valid zstd frame of other content with the recorded size must fail the checksum
    snap, files, images = _packed(tmp_path, "zstd")
    img = next(i for i in images if i.name == "core-1.img")
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    (other_dir / img.name).write_bytes(b"eroc" * 100)
    (other,) = archive.pack(other_dir, Compression("zstd", 3))
    assert other.stored_bytes == img.stored_bytes and other.blake3 != img.blake3
    os.replace(other_dir / archive.stored_name(other), snap / archive.stored_name(img))
    archive.check_layout(snap, images)
    with pytest.raises(CorruptSnapshotError, match="core-1.img"):
        checksums.verify(snap, images)
    with pytest.raises(CorruptSnapshotError, match="core-1.img"):
        archive.unpack(snap, images, _stage_parent(tmp_path))


def test_missing_images_dir_is_refused(tmp_path):
    snap, _, images = _packed(tmp_path, "none")
    with pytest.raises(CorruptSnapshotError, match="missing"):
        archive.check_layout(snap.parent / "nope", images)


def test_staging_parent_falls_back_when_too_big(tmp_path):
    assert archive.staging_parent(1 << 60, tmp_path) == tmp_path


def test_background_verification_hashes_at_the_lowest_priority(tmp_path, monkeypatch):
    # restore verifies in the background while CRIU restores: the hashing threads yield the CPUs
    import os
    import threading

    from blake3 import blake3 as real_blake3

    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(1 << 16))
    images = archive.pack(src, archive.Compression("none", 0))
    seen = []

    def hasher(*a, **kw):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_blake3(*a, **kw)

    monkeypatch.setattr(archive.blake3, "blake3", hasher)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checksums.verify(src, images)
    checksums.Checking(src, images).wait()
    assert seen == [mine, 19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


# ----------------------------------------------------------------------------- frames, background unpack

def _flip(p: Path, off: int) -> None:
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def test_unpacking_stages_small_images_first_and_pages_in_the_background(tmp_path):
    snap, files, images = _packed(tmp_path, "zstd-small")
    stage = tmp_path / "stage"
    stage.mkdir()
    u = archive.Unpacking(snap, images, stage)
    # the constructor returns with every image but the pages staged and verified
    for n, data in files.items():
        if n != PAGES:
            assert (stage / n).read_bytes() == data
    u.ready()
    assert (stage / PAGES).read_bytes() == files[PAGES]
    assert sorted(os.listdir(stage)) == sorted(files)  # no .part left
    u.wait()
    u.cancel()  # after the fact: harmless


@pytest.mark.parametrize("frame", [0, 3, 7])
def test_a_corrupted_frame_is_refused_before_the_pages_image_exists(tmp_path, frame):
    """One flipped byte in one frame of the pages image: ready() (what CRIU waits for before it
    reads memory) and wait() (the verdict before the bind) refuse it, naming the file and the
    frame; the pages image never appears under its own name, so CRIU cannot read it."""
    snap, _, images = _packed(tmp_path, "zstd-small")
    img = next(i for i in images if i.name == PAGES)
    p = snap / archive.stored_name(img)
    off = sum(f.stored_bytes for f in img.frames[:frame]) + img.frames[frame].stored_bytes // 2
    _flip(p, off)
    stage = tmp_path / "stage"
    stage.mkdir()
    u = archive.Unpacking(snap, images, stage)
    with pytest.raises(CorruptSnapshotError, match=rf"{p}.*frame {frame}"):
        u.ready()
    with pytest.raises(CorruptSnapshotError, match=f"frame {frame}"):
        u.wait()
    assert not (stage / PAGES).exists()
    # the synchronous unpack and the full verification refuse it too
    parent = _stage_parent(tmp_path)
    with pytest.raises(CorruptSnapshotError, match=str(p)):
        archive.unpack(snap, images, parent)
    assert os.listdir(parent) == []
    with pytest.raises(CorruptSnapshotError, match=str(p)):
        checksums.verify(snap, images)


def test_a_corrupted_small_image_is_refused_by_the_constructor(tmp_path):
    snap, _, images = _packed(tmp_path, "zstd")
    img = next(i for i in images if i.name == "core-1.img")
    _flip(snap / archive.stored_name(img), img.stored_bytes // 2)
    parent = _stage_parent(tmp_path)
    with pytest.raises(CorruptSnapshotError, match="core-1.img"):
        archive.start_unpack(snap, images, parent)
    assert os.listdir(parent) == []  # staging removed


def test_swapped_frames_are_refused(tmp_path):
    # two valid frames of the right sizes, in the wrong order: each frame's checksum is its own
    snap, files, images = _packed(tmp_path, "zstd-small")
    img = next(i for i in images if i.name == PAGES)
    sizes = [f.stored_bytes for f in img.frames]
    i = next(k for k in range(len(sizes) - 1) if sizes[k] == sizes[k + 1] and
             img.frames[k].blake3 != img.frames[k + 1].blake3)
    p = snap / archive.stored_name(img)
    data = bytearray(p.read_bytes())
    a = sum(sizes[:i])
    n = sizes[i]
    data[a:a + n], data[a + n:a + 2 * n] = data[a + n:a + 2 * n], data[a:a + n]
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match=f"frame {i}"):
        archive.unpack(snap, images, _stage_parent(tmp_path))


def test_legacy_pages_image_unpacks_in_the_background(tmp_path):
    snap, files, images = _packed(tmp_path, "zstd-legacy")
    stage = tmp_path / "stage"
    stage.mkdir()
    u = archive.Unpacking(snap, images, stage)
    u.ready()
    for n, data in files.items():
        assert (stage / n).read_bytes() == data


def test_unpacking_cancel_stops_and_joins(tmp_path):
    snap, _, images = _packed(tmp_path, "zstd-small")
    stage = tmp_path / "stage"
    stage.mkdir()
    u = archive.Unpacking(snap, images, stage)
    u.cancel()
    assert not u._thread.is_alive()


def test_framed_stored_file_is_one_zstd_stream(tmp_path):
    # the frames concatenate into a valid zstd stream: `zstd -d` (any zstd tool) reads it
    import zstandard

    snap, files, images = _packed(tmp_path, "zstd-small")
    img = next(i for i in images if i.name == PAGES)
    with open(snap / archive.stored_name(img), "rb") as f:
        r = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        assert b"".join(iter(lambda: r.read(1 << 16), b"")) == files[PAGES]


def test_staging_order_and_ram_only_when_memory_holds_staging_and_tree(tmp_path, monkeypatch):
    # a trial: a read-only store's images went to /dev/shm, not to the staging dir docs/cli.md names;
    # tmpfs is kept (faster), but only when memory holds the staged copy and the restored tree
    from vllm_snapshot.store.manifest import ImageFile

    ro, stage, gib = tmp_path / "ro", tmp_path / "stage", 1 << 30
    ro.mkdir()
    monkeypatch.setattr(staging, "_read_only", lambda p: Path(p) == ro)
    monkeypatch.setattr(staging, "_free", lambda p: 100 * gib)  # room everywhere
    monkeypatch.setenv("VLLM_SNAPSHOT_STAGING_DIR", str(stage))
    raw = (ImageFile(name="pages-1.img", raw_bytes=10 * gib, stored_bytes=10 * gib, blake3="0" * 64),)
    zst = (ImageFile(name="pages-1.img", raw_bytes=10 * gib, stored_bytes=2 * gib, blake3="0" * 64,
                     compression="zstd"),)
    monkeypatch.setattr(staging, "_memory_room", lambda: 64 * gib, raising=False)
    assert archive.staging_parent(10 * gib, tmp_path, raw) == tmp_path  # hard links beside it
    assert archive.staging_parent(10 * gib, ro, raw) == Path("/dev/shm")
    assert archive.staging_parent(10 * gib, tmp_path, zst) == Path("/dev/shm")
    monkeypatch.setattr(staging, "_memory_room", lambda: 15 * gib, raising=False)  # the images fit once, not twice
    assert archive.staging_parent(10 * gib, ro, raw) == stage
    assert archive.staging_parent(10 * gib, tmp_path, zst) == tmp_path


@pytest.mark.parametrize("off", [checksums.VERIFY_BUF - 1, checksums.VERIFY_BUF, 2 * checksums.VERIFY_BUF + 100])
def test_an_uncompressed_image_of_several_reads_is_checked_whole(tmp_path, off):
    """The checksum pass reads an uncompressed image into one buffer refilled in place: every
    read counts, the first, one across a read's boundary and the last short one."""
    d = tmp_path / "images"
    d.mkdir()
    (d / PAGES).write_bytes(os.urandom(2 * checksums.VERIFY_BUF + 12345))
    images = archive.pack(d, Compression.parse("none"))
    checksums.verify(d, images)
    p = d / PAGES
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptSnapshotError, match=str(p)):
        checksums.verify(d, images)
