"""model_digest — fail closed on model changes.

Models the real flow: digest a model directory (as create does), then change that same
directory in place and verify (as restore does). Every content change, however small or
wherever in the file, must refuse; metadata-only changes must not.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from vllm_snapshot.store import model_digest
from vllm_snapshot.errors import ModelChangedError, UsageError

# safetensors' numpy API writes the same file format as its torch API, without torch's ~3 s import
np = pytest.importorskip("numpy")
st_np = pytest.importorskip("safetensors.numpy")

WEIGHTS = "model.safetensors"


def _tensors() -> dict:
    g = np.random.default_rng(1234)
    return {
        "lm_head.weight": g.standard_normal((64, 32), dtype=np.float32),  # the largest
        "embed.weight": g.standard_normal((16, 32), dtype=np.float32),
        "norm.bias": g.standard_normal(32, dtype=np.float32),
        "layer.0.weight": g.standard_normal((8, 8), dtype=np.float32),
    }


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-model"
    d.mkdir()
    st_np.save_file(_tensors(), str(d / WEIGHTS))
    (d / "config.json").write_text('{"hidden_size": 32}')
    (d / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (d / "empty.txt").write_bytes(b"")
    (d / "sub").mkdir()
    (d / "sub" / "extra.bin").write_bytes(os.urandom(3000))
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return d


def _rewrite_tensors(path: Path, change) -> None:
    """Load, change with ``change(tensors)``, save over the same path (same layout)."""
    t = {k: v.copy() for k, v in st_np.load_file(str(path)).items()}
    change(t)
    before = path.read_bytes()
    size = len(before)
    st_np.save_file(t, str(path))
    assert path.stat().st_size == size, "a same-shape change keeps the size: only hashing can catch it"
    assert path.read_bytes() != before, "the change must change bytes"


def _refuses(root: Path, recorded, mode: str, name: str = WEIGHTS) -> ModelChangedError:
    with pytest.raises(ModelChangedError) as ei:
        model_digest.verify(root, recorded, mode)
    e = ei.value
    assert name in e.message and str(root) in e.message
    assert e.exit_code == 4
    return e


def test_digest_dir_lists_every_regular_file_sorted_and_skips_git(model_dir):
    files = model_digest.digest_dir(model_dir)
    # top-level files (sorted), then sub-directories (sorted): a deterministic order
    assert [f.path for f in files] == ["config.json", "empty.txt", WEIGHTS, "tokenizer.json", "sub/extra.bin"]
    by = {f.path: f for f in files}
    st = (model_dir / WEIGHTS).stat()
    w = by[WEIGHTS]
    assert (w.size, w.mtime_ns, w.ctime_ns, w.inode, w.device) == (
        st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    import blake3

    assert w.blake3 == blake3.blake3((model_dir / WEIGHTS).read_bytes()).hexdigest()
    assert by["empty.txt"].blake3 == blake3.blake3(b"").hexdigest()


def test_unchanged_dir_passes_without_rehash(model_dir):
    rec = model_digest.digest_dir(model_dir)
    check = model_digest.verify(model_dir, rec)
    assert check.rehashed == () and check.added == ()


def _noise(t):
    g = np.random.default_rng(7)
    for v in t.values():
        v += (g.standard_normal(v.shape) * 1e-4).astype(np.float32)


def _shift(t):
    t["norm.bias"] += np.float32(0.5)


def _zero_row(i):
    def f(t):
        t["lm_head.weight"][i] = 0
    return f


MUTATIONS = {
    "noise_on_every_tensor": _noise,
    "one_tensor_shifted": _shift,
    "first_row_of_largest_zeroed": _zero_row(0),
    "row_in_second_half_zeroed": _zero_row(48),
}


@pytest.mark.parametrize("mode", ["quick", "full"])
@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_tensor_change_refuses(model_dir, case, mode):
    rec = model_digest.digest_dir(model_dir)
    _rewrite_tensors(model_dir / WEIGHTS, MUTATIONS[case])
    e = _refuses(model_dir, rec, mode)
    assert e.details["changed"] == [WEIGHTS] and e.details["missing"] == []


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_one_element_near_the_end_changed_refuses(model_dir, mode):
    rec = model_digest.digest_dir(model_dir)
    p = model_dir / WEIGHTS
    size = p.stat().st_size
    with open(p, "r+b") as f:  # in place: same inode, same size
        f.seek(size - 4)
        (v,) = struct.unpack("<f", f.read(4))
        f.seek(size - 4)
        f.write(struct.pack("<f", v + 0.25))
    assert p.stat().st_size == size
    e = _refuses(model_dir, rec, mode)
    assert e.details["changed"] == [WEIGHTS]


def test_small_change_in_a_non_weight_file_refuses(model_dir):
    rec = model_digest.digest_dir(model_dir)
    p = model_dir / "sub" / "extra.bin"
    data = bytearray(p.read_bytes())
    data[1500] ^= 0x01
    p.write_bytes(bytes(data))
    _refuses(model_dir, rec, "quick", "sub/extra.bin")


def test_byte_identical_rewrite_with_new_inode_passes(model_dir):
    rec = model_digest.digest_dir(model_dir)
    p = model_dir / WEIGHTS
    old_ino = p.stat().st_ino
    tmp = model_dir / ".rewrite.tmp"
    tmp.write_bytes(p.read_bytes())
    os.replace(tmp, p)
    assert p.stat().st_ino != old_ino
    check = model_digest.verify(model_dir, rec)
    assert check.rehashed == (WEIGHTS,) and check.added == ()


def test_touch_only_passes_and_is_rehashed(model_dir):
    rec = model_digest.digest_dir(model_dir)
    p = model_dir / WEIGHTS
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns + 10**9, st.st_mtime_ns + 10**9))
    check = model_digest.verify(model_dir, rec)
    assert check.rehashed == (WEIGHTS,)


def test_content_change_with_restored_mtime_still_refuses(model_dir):
    # resetting mtime (touch -d / utime) cannot hide an edit: ctime still moves
    rec = model_digest.digest_dir(model_dir)
    p = model_dir / WEIGHTS
    st = p.stat()
    _rewrite_tensors(p, MUTATIONS["row_in_second_half_zeroed"])
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.stat().st_mtime_ns == st.st_mtime_ns
    _refuses(model_dir, rec, "quick")


def test_removed_file_refuses(model_dir):
    rec = model_digest.digest_dir(model_dir)
    (model_dir / "config.json").unlink()
    e = _refuses(model_dir, rec, "quick", "config.json")
    assert "missing" in e.message
    assert e.details["missing"] == ["config.json"] and e.details["changed"] == []


def test_replaced_by_a_dangling_symlink_refuses(model_dir):
    rec = model_digest.digest_dir(model_dir)
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.json").symlink_to(model_dir / "nowhere")
    e = _refuses(model_dir, rec, "quick", "tokenizer.json")
    assert e.details["missing"] == ["tokenizer.json"]


def test_truncated_file_refuses(model_dir):
    rec = model_digest.digest_dir(model_dir)
    p = model_dir / WEIGHTS
    os.truncate(p, p.stat().st_size - 1)
    _refuses(model_dir, rec, "quick")


def test_added_files_that_cannot_change_the_engine_are_ignored(model_dir):
    """Issue 29 / review gpu-path-2 M5, one policy: dot-directories (``huggingface-cli download
    --local-dir`` leaves ``.cache/huggingface``), dot-files and docs are not the model."""
    rec = model_digest.digest_dir(model_dir)
    (model_dir / "README.md").write_text("hi")
    (model_dir / "LICENSE").write_text("MIT")
    (model_dir / ".gitattributes").write_text("*.safetensors filter=lfs")
    (model_dir / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (model_dir / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("x")
    (model_dir / ".git" / "ORIG_HEAD").write_text("x")
    check = model_digest.verify(model_dir, rec)
    assert check.added == (".gitattributes", "LICENSE", "README.md")
    assert check.rehashed == ()
    # nor are they hashed at create (or in serve's key)
    assert [f.path for f in model_digest.digest_dir(model_dir)] == [f.path for f in rec]


@pytest.mark.parametrize("name, kind", [
    ("model-00002-of-00002.safetensors", "weights"), ("sub/new.bin", "weights"), ("extra.pt", "weights"),
    ("model.safetensors.index.json", "weights"), ("generation_config.json", "config"),
    ("tokenizer_config.json", "tokenizer"), ("merges.txt", "tokenizer"), ("notes.txt", "file"),
    ("modeling_x.py", "code"),
])
def test_an_added_weight_config_or_tokenizer_file_refuses_naming_it(model_dir, name, kind):
    """Review gpu-path-2 M5: restore only warned of an added shard, though vLLM's loader globs
    ``*.safetensors`` in the model dir (the level-2 wake reloads that way) and a cold start
    would load it. Anything added that the policy does not ignore refuses (fail closed)."""
    rec = model_digest.digest_dir(model_dir)
    (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (model_dir / name).write_bytes(b"\x00" * 10)
    e = _refuses(model_dir, rec, "quick", name)
    assert f"{name} ({kind})" in e.message and "added since the snapshot was made" in e.message
    assert e.details["added"] == [name] and "serve --rebuild" in e.hint and "move it out of" in e.hint


def test_added_files_are_listed_in_details_when_refusing(model_dir):
    rec = model_digest.digest_dir(model_dir)
    (model_dir / "README.md").write_text("hi")
    (model_dir / "new.safetensors").write_text("x")
    (model_dir / "config.json").write_text('{"hidden_size": 64}')
    e = _refuses(model_dir, rec, "quick", "config.json")
    assert e.details["added"] == ["new.safetensors"] and e.details["changed"] == ["config.json"]


def test_recorded_docs_of_an_older_snapshot_are_not_held_against_it(model_dir):
    """Snapshots made before the policy recorded README and the like: a changed or removed one
    no longer refuses (it cannot change the engine)."""
    (model_dir / "README.md").write_text("v1")
    rec = model_digest.digest_dir(model_dir)
    old = rec + (model_digest.ModelFile(path="README.md", size=2, blake3="0" * 64, mtime_ns=1, ctime_ns=1,
                                        inode=1, device=1),)
    (model_dir / "README.md").unlink()
    assert model_digest.verify(model_dir, old, "full").rehashed == tuple(f.path for f in rec)


def test_full_mode_rehashes_everything(model_dir):
    rec = model_digest.digest_dir(model_dir)
    check = model_digest.verify(model_dir, rec, "full")
    assert check.rehashed == tuple(f.path for f in rec)
    assert len(check.rehashed) == 5


def test_missing_model_dir_refuses_with_every_file(model_dir):
    rec = model_digest.digest_dir(model_dir)
    shutil.rmtree(model_dir)
    with pytest.raises(ModelChangedError, match="does not exist") as ei:
        model_digest.verify(model_dir, rec, "quick")
    assert str(model_dir) in ei.value.message and ei.value.exit_code == 4
    assert sorted(ei.value.details["missing"]) == sorted(f.path for f in rec)


def test_hub_cache_symlinks_are_followed_and_blob_changes_refuse(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_bytes(b"weights" * 1000)
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / WEIGHTS).symlink_to(blobs / "abc")
    rec = model_digest.digest_dir(snap)
    assert [(f.path, f.size) for f in rec] == [(WEIGHTS, 7000)]
    assert model_digest.verify(snap, rec).rehashed == ()
    with open(blobs / "abc", "r+b") as f:
        f.seek(6999)
        f.write(b"X")
    _refuses(snap, rec, "quick")


def test_resolve_model_local_dir_and_refusals(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    assert model_digest.resolve_model(str(d)) == (d.resolve(), None)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        model_digest.resolve_model(str(f))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(UsageError, match="neither a local directory"):
        model_digest.resolve_model("nobody/no-such-model-xyz")


def _fake_hub(tmp_path, rev="0123456789abcdef0123456789abcdef01234567"):
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text(rev)
    return hub, snap


def test_hf_id_resolves_offline_with_its_revision(tmp_path, monkeypatch):
    hub, snap = _fake_hub(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    assert model_digest.resolve_model("acme/tiny") == (snap.resolve(), snap.name)
    assert model_digest.resolve_model("acme/tiny", "main") == (snap.resolve(), snap.name)
    with pytest.raises(UsageError, match="revision 'v2'"):
        model_digest.resolve_model("acme/tiny", "v2")  # not in the cache: refused, never downloaded
