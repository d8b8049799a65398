"""The files a snapshot carries (vllm_snapshot/checkpoint/carry.py): which tree files travel, how
they are copied and recorded at create, and the put-back rules at restore -- missing, same
content, other content (the engine's own file, free or held; another owner's), a symlink on
the way, and a stored copy that fails its digest. Real files under tmp_path, no CRIU.
End to end (a compiled snapshot restored after the engine user's HOME was emptied):
test_carry_integration.py."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from vllm_snapshot.checkpoint import carry
from vllm_snapshot.errors import BusyError, CorruptSnapshotError, IncompatibleHostError
from vllm_snapshot.store import archive
from vllm_snapshot.store.manifest import Carried, CarriedFile, TreeFile

from helpers import b3, make_manifest

#: The engine user's ids for the files made here: a file of root's is never "the engine's own"
#: (carry.plan), so as root (CI) they are given to an unprivileged uid.
OWNER = (4242, 4242) if os.geteuid() == 0 else (os.getuid(), os.getgid())


def _tree(path: str, size: int = 1) -> TreeFile:
    return TreeFile(path=path, size=size, mtime_ns=1)


def test_select_keeps_only_what_is_outside_the_model_the_python_environment_and_the_system():
    files = [_tree("/var/lib/eng/.cache/vllm/torch_compile_cache/x/inductor_cache/ab/k.main.so"),
             _tree("/models/tiny/model.safetensors"),
             _tree("/hf/blobs/0123abcd"),  # a Hugging Face model file's target (the model dir holds a symlink)
             _tree("/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"),
             _tree("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0"),
             _tree("/usr/lib/x86_64-linux-gnu/libc.so.6"),
             _tree("/lib64/ld-linux-x86-64.so.2"),
             _tree("/etc/ld.so.cache"),
             _tree("/opt/custom/plugin.so")]
    env = carry.python_prefixes(["/venv", "/root/.pyenv/versions/3.11.7"], ["/", "", "relative", "/venv/lib/python3.11/site-packages"])
    assert "/" not in env  # the engine runs in /, which `-m` puts first on sys.path
    got = carry.select(files, ["/models/tiny", "/hf/blobs/0123abcd"], env)
    assert got == ["/opt/custom/plugin.so", "/var/lib/eng/.cache/vllm/torch_compile_cache/x/inductor_cache/ab/k.main.so"]


def _make(tmp_path: Path, files: dict[str, bytes], mode: int = 0o755, compression: str = "none") -> tuple[Carried, Path]:
    """Real files under tmp_path/host, collected into tmp_path/snap/carried and packed."""
    paths = []
    for rel, data in files.items():
        p = tmp_path / "host" / rel
        for d in reversed([*p.relative_to(tmp_path).parents][:-1]):
            if not (tmp_path / d).exists():
                (tmp_path / d).mkdir()
                os.chmod(tmp_path / d, 0o750)
                os.chown(tmp_path / d, *OWNER)
        p.write_bytes(data)
        os.chmod(p, mode)
        os.chown(p, *OWNER)
        paths.append(str(p))
    blobs_dir = tmp_path / "snap" / "carried"
    (tmp_path / "snap").mkdir(mode=0o700)
    recs, dirs = carry.collect(paths, blobs_dir)
    blobs = archive.pack(blobs_dir, archive.Compression.parse(compression))
    return carry.carried(recs, dirs, blobs), blobs_dir


def test_collect_records_owner_mode_mtime_and_stores_one_copy_per_content(tmp_path):
    c, blobs_dir = _make(tmp_path, {"a/k1.so": b"kernel", "b/k2.so": b"kernel", "b/k3.so": b"other"})
    assert [f.path for f in c.files] == sorted(str(tmp_path / "host" / r) for r in ("a/k1.so", "b/k2.so", "b/k3.so"))
    f = c.files[0]
    st = os.stat(f.path)
    assert (f.size, f.blake3, f.mode, f.uid, f.gid, f.mtime_ns) == (6, b3(b"kernel"), 0o755, st.st_uid, st.st_gid,
                                                                    st.st_mtime_ns)
    assert sorted(os.listdir(blobs_dir)) == sorted({b3(b"kernel"), b3(b"other")})  # deduplicated
    assert all(stat.S_IMODE(os.stat(blobs_dir / n).st_mode) == 0o600 for n in os.listdir(blobs_dir))
    assert str(tmp_path / "host" / "a") in {d.path for d in c.dirs}
    assert {d.mode for d in c.dirs if d.path.startswith(str(tmp_path / "host" / ""))} == {0o750}


def test_a_missing_file_is_put_back_with_its_directories_owner_mode_and_mtime(tmp_path):
    c, blobs_dir = _make(tmp_path, {"home/.cache/vllm/k.so": b"compiled kernel"}, compression="zstd")
    f = c.files[0]
    home = tmp_path / "host" / "home"
    import shutil

    shutil.rmtree(home / ".cache")  # the engine user's HOME emptied
    p = carry.plan(c, held_by=lambda path: pytest.fail("nothing differs: no holder look-up"))
    assert [x.path for x in p.place] == [f.path] and not (p.kept or p.differs or p.held)
    assert carry.refusal(p) is None
    assert carry.put_back(c, blobs_dir, p.place) == [f.path]
    st = os.stat(f.path)
    assert Path(f.path).read_bytes() == b"compiled kernel"
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (0o755, f.uid, f.gid, f.mtime_ns)
    assert stat.S_IMODE(os.stat(home / ".cache").st_mode) == 0o750  # the recorded mode, not the default
    assert not [n for n in os.listdir(Path(f.path).parent) if n.startswith(carry.TMP_PREFIX)]
    assert carry.plan(c).kept == [f.path]  # and now it is simply there


def test_a_same_content_rotation_is_kept_and_a_different_content_of_the_engines_own_file_is_replaced(tmp_path):
    c, blobs_dir = _make(tmp_path, {"k1.so": b"same bytes", "k2.so": b"ours"})
    k1, k2 = (Path(f.path) for f in c.files)
    # a create of another model rewrote k1 with identical bytes (new inode, new mtime) ...
    tmp = k1.with_name("k1.tmp")
    tmp.write_bytes(b"same bytes")
    os.chmod(tmp, 0o755)
    os.chown(tmp, *OWNER)
    os.rename(tmp, k1)
    os.utime(k1, ns=(1, 1))
    # ... and k2 with other bytes, held open by a reader (a live process, as far as it knows)
    k2.write_bytes(b"theirs")
    reader = open(k2, "rb")
    try:
        p = carry.plan(c, held_by=lambda path: [])
        assert p.kept == [str(k1)] and [x.path for x in p.place] == [str(k2)]
        carry.put_back(c, blobs_dir, p.place)
        assert k2.read_bytes() == b"ours"
        assert reader.read() == b"theirs"  # a rename never changes what an open/mapped file holds
    finally:
        reader.close()


def test_a_differing_file_a_live_process_holds_refuses_as_busy_naming_it_and_the_holder(tmp_path):
    c, _ = _make(tmp_path, {"k.so": b"ours"})
    k = Path(c.files[0].path)
    k.write_bytes(b"theirs!")
    with open(k, "rb"):  # this process holds it: the real /proc look-up finds us
        me = carry.holders(str(k))
        assert f"PID {os.getpid()}" in " ".join(me)
        p = carry.plan(c)
    assert not p.place and len(p.held) == 1 and str(k) in p.held[0] and f"PID {os.getpid()}" in p.held[0]
    err = carry.refusal(p)
    assert isinstance(err, BusyError) and str(k) in err.message
    assert k.read_bytes() == b"theirs!"


def test_a_differing_file_of_another_owner_is_never_replaced(tmp_path):
    c, _ = _make(tmp_path, {"lib.so": b"ours"})
    f = c.files[0]
    other = Carried(files=(f.model_copy(update={"uid": f.uid + 1}),), dirs=c.dirs, blobs=c.blobs)
    Path(f.path).write_bytes(b"host's")
    p = carry.plan(other, held_by=lambda path: [])
    assert not p.place and len(p.differs) == 1 and f.path in p.differs[0]
    err = carry.refusal(p)
    assert isinstance(err, IncompatibleHostError) and f.path in err.message
    assert Path(f.path).read_bytes() == b"host's"


def test_a_mode_change_is_a_difference_crius_mode_check_would_refuse(tmp_path):
    c, blobs_dir = _make(tmp_path, {"k.so": b"ours"})
    k = Path(c.files[0].path)
    os.chmod(k, 0o700)
    p = carry.plan(c, held_by=lambda path: [])
    assert [x.path for x in p.place] == [str(k)]
    carry.put_back(c, blobs_dir, p.place)
    assert stat.S_IMODE(os.stat(k).st_mode) == 0o755


def test_a_symlink_on_the_way_refuses_and_nothing_is_written_through_it(tmp_path):
    c, blobs_dir = _make(tmp_path, {"home/.cache/k.so": b"ours"})
    home = tmp_path / "host" / "home"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    import shutil

    shutil.rmtree(home / ".cache")
    os.symlink(elsewhere, home / ".cache")  # planted by whoever can write the HOME
    p = carry.plan(c, held_by=lambda path: [])
    assert not p.place and "symlink" in p.differs[0]
    assert isinstance(carry.refusal(p), IncompatibleHostError)
    with pytest.raises(OSError) as e:  # even when asked to: the walk never follows it
        carry.put_back(c, blobs_dir, c.files)
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_stored_copy_that_fails_its_digest_refuses_naming_the_file_and_places_nothing(tmp_path, compression):
    c, blobs_dir = _make(tmp_path, {"k.so": b"x" * 4096}, compression=compression)
    f = c.files[0]
    os.unlink(f.path)
    stored = blobs_dir / archive.stored_name(c.blobs[0])
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError) as e:
        carry.verify(c, blobs_dir)
    assert f.path in e.value.message
    with pytest.raises(CorruptSnapshotError):  # put_back checks again as it writes
        carry.put_back(c, blobs_dir, c.files)
    assert not os.path.exists(f.path)
    assert not [n for n in os.listdir(Path(f.path).parent) if n.startswith(carry.TMP_PREFIX)]


def test_changed_since_names_a_file_replaced_between_the_inventory_and_the_copy():
    f = CarriedFile(path="/c/k.so", size=4, blake3=b3(b"ours"), mode=0o644, uid=1, gid=1, mtime_ns=5)
    assert carry.changed_since([TreeFile(path="/c/k.so", size=4, mtime_ns=5, blake3=b3(b"ours"))], [f]) == []
    assert carry.changed_since([TreeFile(path="/c/k.so", size=4, mtime_ns=6)], [f])
    assert carry.changed_since([TreeFile(path="/c/k.so", size=4, mtime_ns=5, blake3=b3(b"them"))], [f])


def test_the_manifest_ties_every_carried_file_to_exactly_one_blob(tmp_path):
    c, _ = _make(tmp_path, {"k.so": b"ours"})
    m = make_manifest(carried=c)
    from vllm_snapshot.store import manifest

    assert manifest.parse(manifest.to_json(m)).carried == c
    with pytest.raises(ValueError):
        Carried(files=c.files, dirs=c.dirs, blobs=())


def test_check_tree_files_leaves_carried_files_to_the_put_back(tmp_path):
    """Today's refusal ("... vanished") for a file the snapshot carries is gone; a vanished file
    it does not carry (a library of the venv) still refuses."""
    from vllm_snapshot.effects.files import LocalSnapshotFiles

    c, _ = _make(tmp_path, {"k.so": b"ours"})
    gone = c.files[0].path
    os.unlink(gone)
    lib = str(tmp_path / "venv-lib.so")
    m = make_manifest(carried=c)
    m = m.model_copy(update={"criu": m.criu.model_copy(update={"tree_files": (
        TreeFile(path=gone, size=4, mtime_ns=1, blake3=b3(b"ours")), TreeFile(path=lib, size=1, mtime_ns=1))})})
    problems = LocalSnapshotFiles().check_tree_files(m)
    assert problems == [f"{lib} vanished"]
    assert [x.path for x in LocalSnapshotFiles().plan_carried(tmp_path / "snap", m).place] == [gone]
