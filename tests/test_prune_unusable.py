"""``prune --unusable`` deletes only snapshots that can never be restored here as they are (a
recorded refusal, another host's identity, changed model content); a ✗ an operator can fix
(modes, a missing model directory, ...) and a directory ``delete`` cannot tell is a snapshot
(a damaged manifest, a symlink) are kept and named with why, in a dry run as in a real one; an
unsafe store root stops the whole prune. Real files under tmp_path, in-process ``cli.main``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import b3, make_manifest, write_snapshot_dir

from vllm_snapshot.cli import app as cli
from vllm_snapshot.effects.host import LocalHostTools
from vllm_snapshot.ops import manage
from vllm_snapshot.store import layout, manifest, store

HOST = dict(make_manifest().host)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(tmp_path / "store"))
    monkeypatch.setattr(LocalHostTools, "host_identity", lambda self, kind: dict(HOST))  # this host: the manifests'
    r = tmp_path / "store"
    r.mkdir(mode=0o700)
    os.chmod(r, 0o700)
    return r


def _model(path: Path, data: bytes = b"weights " * 16) -> manifest.ModelIdentity:
    """A model directory with one file, and the identity a snapshot of it records."""
    path.mkdir(parents=True, exist_ok=True)
    f = path / "model.safetensors"
    f.write_bytes(data)
    st = f.stat()
    rec = manifest.ModelFile(path=f.name, size=len(data), blake3=b3(data), mtime_ns=st.st_mtime_ns,
                             ctime_ns=st.st_ctime_ns, inode=st.st_ino, device=st.st_dev)
    return manifest.ModelIdentity(requested=str(path), path=str(path), served_name="m", files=(rec,),
                                  total_bytes=len(data))


def _snapshot(root: Path, name: str, model: manifest.ModelIdentity, **over) -> Path:
    snap = root / name
    write_snapshot_dir(snap, make_manifest(images=(), model=model, **over))
    for sub in ("images", "files"):
        (snap / sub).mkdir(mode=0o700)
    return snap


def _prune(capsys, *args: str) -> tuple[int, dict]:
    rc = cli.main(["prune", "--unusable", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_prune_unusable_deletes_only_what_can_never_be_restored_and_names_what_it_keeps(root, tmp_path, capsys):
    # a trial: `--dry-run` said "would delete" for a manifest at 0644, a model directory not
    # mounted yet and a moved weights file -- all fixed by a chmod, a mount or a `mv`
    model = _model(tmp_path / "model")
    ok = _snapshot(root, "ok", model)
    refused = _snapshot(root, "refused", model)
    store.record_refusal(refused, "oracle-mismatch", "the oracle differs", by="serve")
    other_host = _snapshot(root, "other-host", model, host={**HOST, "kernel": "5.4.0"})
    changed = _snapshot(root, "changed", _model(tmp_path / "model2"))
    (tmp_path / "model2" / "model.safetensors").write_bytes(b"other bytes, same length" * 5 + b"12345678")
    modes = _snapshot(root, "modes", model)
    os.chmod(modes / layout.MANIFEST, 0o644)
    unmounted = _snapshot(root, "unmounted", _model(tmp_path / "nfs" / "model"))
    os.rename(tmp_path / "nfs" / "model", tmp_path / "nfs" / "away")  # the mount is not up yet
    # a refusal recorded while the model was away: what it met may be that, so it is kept too
    refused_away = _snapshot(root, "refused-away", _model(tmp_path / "nfs2" / "model"))
    store.record_refusal(refused_away, "model-changed", "the model directory does not exist", by="serve")
    os.rename(tmp_path / "nfs2" / "model", tmp_path / "nfs2" / "away")

    rc, dry = _prune(capsys, "--dry-run")
    assert rc == 0
    lost = sorted(str(p) for p in (refused, other_host, changed))
    assert sorted(dry["deleted"]) == lost and dry["kept_running"] == [] and dry["not_deleted"] == []
    kept = {Path(k["path"]).name: k for k in dry["kept_unusable"]}
    assert sorted(kept) == ["modes", "refused-away", "unmounted"]
    assert kept["modes"]["error"] == "corrupt-snapshot" and "mode 0644" in kept["modes"]["message"]
    assert kept["modes"]["hint"] == f"chmod -R go-rwx {modes}"
    assert kept["unmounted"]["error"] == "model-changed" and "does not exist" in kept["unmounted"]["message"]
    assert kept["unmounted"]["hint"] == "put the model back at that path, or re-create the snapshot"

    rc, real = _prune(capsys)
    assert rc == 0 and sorted(real["deleted"]) == lost and real["kept_unusable"] == dry["kept_unusable"]
    assert sorted(p.name for p in root.iterdir()) == ["modes", "ok", "refused-away", "unmounted"]
    assert (ok / layout.MANIFEST).is_file() and (modes / layout.MANIFEST).is_file()

    os.rename(tmp_path / "nfs" / "away", tmp_path / "nfs" / "model")  # mounted: nothing to keep it for
    cli.main(["prune", "--unusable", "--dry-run"])
    out = capsys.readouterr().out
    assert f"kept {modes}, not deleted: {modes / layout.MANIFEST} has mode 0644" in out
    assert f"; chmod -R go-rwx {modes}" in out and "unmounted" not in out and "would delete" not in out


def test_prune_refuses_to_delete_anything_under_a_root_its_trust_check_refuses(root, tmp_path, capsys):
    # a trial: a store root at 0777 (list's hint: "chmod 0700 ..."); `prune --unusable` deleted an
    # intact snapshot and its weights file there, exit 0
    snap = _snapshot(root, "intact", _model(tmp_path / "model"), created_at="2020-01-01T00:00:00+00:00")
    stale = root / f".x{store.TMP_MARK}1"  # a crashed create's temp dir: not removed either
    stale.mkdir(mode=0o700)
    (stale / store.OWNER_PID).write_text("999999999")
    os.chmod(root, 0o777)
    for args in (["--unusable"], ["--unusable", "--dry-run"], ["--older-than", "1d"], []):
        assert cli.main(["prune", *args, "--json"]) == 11
        err = json.loads(capsys.readouterr().out)["error"]
        assert err["code"] == "environment" and err["message"].startswith(f"refusing to prune {root}: ")
        assert "is writable by group/others" in err["message"] and "nothing was deleted" in err["message"]
        assert err["hint"].startswith(f"chmod 0700 {root}")
    assert (snap / layout.MANIFEST).is_file() and stale.is_dir()


def test_a_damaged_manifest_and_a_symlink_are_kept_with_deletes_words_in_dry_and_real_runs(root, tmp_path, capsys):
    # a trial: `--dry-run` said "would delete .../play", the real run "kept .../play (an engine
    # restored from it is running)" with no engine running: delete's refusal was taken for one
    play = _snapshot(root, "play", _model(tmp_path / "model"))
    with open(play / layout.MANIFEST, "r+b") as f:  # `truncate -s 5000 manifest.json`
        f.truncate(5000)
    elsewhere = _snapshot(tmp_path / "elsewhere", "target", _model(tmp_path / "model"))
    (root / "link").symlink_to(elsewhere)
    runs = [_prune(capsys, "--dry-run"), _prune(capsys)]
    for rc, got in runs:
        assert rc == 0 and got["deleted"] == [] and got["kept_running"] == [] and got["not_deleted"] == []
        kept = {Path(k["path"]).name: k for k in got["kept_unusable"]}
        assert sorted(kept) == ["link", "play"]
        want = store.delete_refusal(play)  # delete's own words and hint
        assert (kept["play"]["error"], kept["play"]["message"], kept["play"]["hint"]) == \
               (want.code, want.message, want.hint)
        assert "manifest.json is not readable JSON" in want.message and f"rm -r {play}" in want.hint
        assert kept["link"]["message"] == f"{root / 'link'} is a symlink, not a snapshot; nothing was deleted"
    assert runs[0][1]["kept_unusable"] == runs[1][1]["kept_unusable"]
    assert (root / "link").is_symlink() and (elsewhere / layout.MANIFEST).is_file() and play.is_dir()
    cli.main(["prune", "--unusable"])
    out = capsys.readouterr().out
    assert "is running" not in out and f"kept {root / 'link'}, not deleted: {root / 'link'} is a symlink" in out


def test_lost_for_good_is_content_and_identity_not_what_an_operator_fixes():
    from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, IncompatibleHostError, ModelChangedError

    assert manage.lost_for_good(IncompatibleHostError("this host differs: kernel"))
    assert manage.lost_for_good(ModelChangedError("x", details={"changed": ["a"], "missing": [], "added": []}))
    assert not manage.lost_for_good(ModelChangedError("x", details={"changed": [], "missing": ["a"], "added": []}))
    assert not manage.lost_for_good(ModelChangedError("x", details={"changed": [], "missing": [], "added": ["b"]}))
    assert not manage.lost_for_good(CorruptSnapshotError("mode 0644"))
    assert not manage.lost_for_good(EnvironmentProblem("parent writable"))
    assert not manage.lost_for_good(OSError(13, "denied"))


def test_a_weights_file_moved_away_is_fixable_one_with_other_bytes_is_not(tmp_path):
    from vllm_snapshot.errors import ModelChangedError
    from vllm_snapshot.store import weights

    data = b"w" * 64
    w = tmp_path / "w.bin"
    rec = manifest.WeightsFile(path=str(w), size=len(data), blake3=b3(data), mtime_ns=1, ctime_ns=2, inode=3, device=4,
                               tensors=1, mapped_bytes=len(data))
    with pytest.raises(ModelChangedError) as e:  # moved away
        weights.refuse(rec)
    assert e.value.details == {"weights": str(w), "changed": []} and not manage.lost_for_good(e.value)
    w.write_bytes(b"x" * 65)
    os.chmod(w, 0o600)
    with pytest.raises(ModelChangedError) as e:  # other bytes
        weights.refuse(rec)
    assert e.value.details == {"weights": str(w), "changed": [str(w)]} and manage.lost_for_good(e.value)
