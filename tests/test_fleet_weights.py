"""The weights file in the fleet (issue 39 item 3), without root, CRIU or a network: a snapshot
that references a weights file is pushed to an image layout with the file as layers of their own
media type and pulled on a "node" whose root differs and where the source's file is gone; the
file lands at its recorded path (0600 in a 0700 dir) verified; a node that has it downloads no
weights layer; a damaged weights blob places nothing; a path that cannot be made refuses before
any blob; an artifact naming a path outside a ``.weights`` dir is refused."""

from __future__ import annotations

import json
import os
import time
import shutil
from pathlib import Path

import pytest

from test_fleet_ops import HOST, CountingLayout, Tools, make_snapshot
from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, IncompatibleHostError, ModelChangedError
from vllm_snapshot.fleet import oci, partial, transport
from vllm_snapshot.ops import fleet
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.store import manifest
from vllm_snapshot.store import weights as sw

NODE_B = {**HOST, "machine_id": "b" * 32, "hostname": "node-b"}


@pytest.fixture
def model(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(os.urandom(3000))
    return d


def with_weights(snap: Path, root: Path, data: bytes) -> manifest.WeightsFile:
    """Give snapshot ``snap`` a weights file of ``data`` in ``root/.weights`` (written as create
    publishes it) and reseal its manifest naming it."""
    d = sw.ensure_dir(root)
    tmp = d / f"{sw.TMP_PREFIX}{os.getpid()}-t"
    tmp.write_bytes(data)
    final, digest, _ = sw.publish(tmp, root)
    rec = sw.record(final, digest, tensors=3, mapped_bytes=len(data))
    m = manifest.read(snap)
    os.unlink(snap / "manifest.json")
    manifest.write_atomic(manifest.seal(m.model_copy(update={"weights": rec})), snap)
    return rec


@pytest.fixture
def source(tmp_path, model):
    """Node A: root ``a`` with snapshots ``tiny`` and ``tiny8`` referencing one weights file
    (70 kB), ``tiny`` pushed to ``oci:layout:v1``."""
    root = tmp_path / "a"
    root.mkdir(mode=0o700)
    data = os.urandom(70000)
    snaps = {}
    for name in ("tiny", "tiny8"):
        make_snapshot(root / name, model)
        rec = with_weights(root / name, root, data)
        snaps[name] = root / name
    image = f"oci:{tmp_path / 'layout'}:v1"
    r = fleet.push(fleet.PushRequest(snapshot=snaps["tiny"], image=image), Reporter(), Tools())
    return {"root": root, "rec": rec, "data": data, "image": image, "result": r, "layout": tmp_path / "layout",
            "snaps": snaps}


def _away(rec: manifest.WeightsFile, tmp_path: Path) -> None:
    """The source node's weights dir moved out of sight (the "second node" does not see it)."""
    d = Path(rec.path).parent
    shutil.move(str(d), str(tmp_path / "moved-away-weights"))
    assert not Path(rec.path).exists()


def _root_b(tmp_path: Path) -> Path:
    r = tmp_path / "b"
    r.mkdir(mode=0o700)
    return r


def _weights_gets() -> list[str]:
    return [w for w in CountingLayout.gets if w.endswith(sw.SUFFIX)]


def test_push_carries_the_weights_file_as_its_own_layer_type(source):
    rec = source["rec"]
    doc = json.loads(transport.Layout(source["layout"]).get_manifest("v1")[0])
    layers = [d for d in doc["layers"] if d["mediaType"] == oci.WEIGHTS_TYPE]
    assert len(layers) == 1 and layers[0]["size"] == rec.size
    a = layers[0]["annotations"]
    assert a[oci.A_WEIGHTS_BLAKE3] == rec.blake3 and a[oci.A_WEIGHTS_PATH] == rec.path
    assert a["org.opencontainers.image.title"] == f"{rec.blake3}.weights" and oci.A_MEMBER not in a
    assert layers[0]["digest"] == oci.sha256(source["data"])
    assert doc["annotations"][oci.A_WEIGHTS_PATH] == rec.path and doc["annotations"][oci.A_WEIGHTS_BYTES] == "70000"
    assert source["result"].bytes >= rec.size
    # inspect IMAGE names it (manifest only)
    ins = fleet.inspect_image(source["image"], False, Tools())
    assert ins.weights["path"] == rec.path and ins.weights["blake3"] == rec.blake3 and ins.weights["layers"] == 1
    assert ins.weights["bytes"] == rec.size and ins.blobs == len(doc["layers"])


def test_a_second_snapshot_of_the_same_weights_pushes_only_its_images(source):
    r = fleet.push(fleet.PushRequest(snapshot=source["snaps"]["tiny8"], image=source["image"][:-3] + ":v8"),
                   Reporter(), Tools())
    assert r.skipped >= 1 and r.sent_bytes <= r.bytes - source["rec"].size


def test_pull_on_another_node_places_the_file_at_its_recorded_path(source, tmp_path, monkeypatch):
    rec = source["rec"]
    _away(rec, tmp_path)
    root_b = _root_b(tmp_path)
    r = fleet.pull(fleet.PullRequest(image=source["image"], root=root_b, name="tiny"), Reporter(), Tools(NODE_B))
    final = Path(rec.path)
    assert final.read_bytes() == source["data"] and sw.hash_file(final) == rec.blake3
    assert final.stat().st_mode & 0o777 == 0o600 and final.parent.stat().st_mode & 0o777 == 0o700
    # the staging dir is gone; the placed file's node-local stat pin is beside it (hashed at placing)
    assert sorted(os.listdir(final.parent)) == [final.name, sw.pin_path(final).name]
    assert r.weights == rec.path and r.weights_fetched_bytes == rec.size and r.weights_reused is None
    assert r.weights_bytes == rec.size and r.fetched_bytes + r.reused_bytes == r.bytes
    assert _weights_gets() == [final.name]
    hashed = []
    real = sw.hash_file
    monkeypatch.setattr(sw, "hash_file", lambda q: hashed.append(q) or real(q))
    # restore's check passes without hashing again: the pin written at placing vouches for this stat
    assert sw.check(manifest.read(root_b / "tiny").weights) is None and hashed == []
    monkeypatch.undo()
    assert os.listdir(root_b) == ["tiny"]  # nothing of the weights in the pulling store
    # the second snapshot of the same weights: the node has the file, no weights layer is fetched
    fleet.push(fleet.PushRequest(snapshot=source["snaps"]["tiny8"], image=source["image"][:-3] + ":v8"),
               Reporter(), Tools())
    ino = final.stat().st_ino
    t = Tools(NODE_B)
    r8 = fleet.pull(fleet.PullRequest(image=source["image"][:-3] + ":v8", root=root_b, name="tiny8"), Reporter(), t)
    assert r8.weights_reused == "present" and r8.weights_fetched_bytes == 0 and _weights_gets() == []
    assert r8.fetched_bytes == r8.bytes - rec.size and r8.reused_bytes == rec.size
    assert final.stat().st_ino == ino  # written once: the file was left as it was


def test_a_file_of_that_blake3_in_the_pulling_store_is_linked_not_downloaded(source, tmp_path):
    rec = source["rec"]
    _away(rec, tmp_path)
    root_b = _root_b(tmp_path)
    mine = sw.path_of(root_b, rec.blake3)
    sw.ensure_dir(root_b)
    mine.write_bytes(source["data"])
    r = fleet.pull(fleet.PullRequest(image=source["image"], root=root_b, name="tiny"), Reporter(), Tools(NODE_B))
    assert r.weights_reused == "linked" and r.weights_fetched_bytes == 0 and _weights_gets() == []
    assert os.stat(rec.path).st_ino == mine.stat().st_ino


def test_a_damaged_weights_blob_places_nothing_and_lists_nothing(source, tmp_path):
    rec = source["rec"]
    _away(rec, tmp_path)
    digest = oci.sha256(source["data"])
    blob = source["layout"] / "blobs" / "sha256" / digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[500] ^= 1
    blob.write_bytes(bytes(data))
    root_b = _root_b(tmp_path)
    with pytest.raises(CorruptSnapshotError, match=f"blob {digest} \\({rec.blake3}.weights\\)") as e:
        fleet.pull(fleet.PullRequest(image=source["image"], root=root_b), Reporter(), Tools(NODE_B))
    assert e.value.exit_code == 5
    assert not Path(rec.path).exists() and os.listdir(Path(rec.path).parent) == []
    assert os.listdir(root_b) == []


def test_an_interrupted_weights_download_keeps_its_staging_and_the_next_pull_places_it(source, tmp_path):
    rec = source["rec"]
    _away(rec, tmp_path)
    root_b = _root_b(tmp_path)
    t = Tools(NODE_B)
    CountingLayout.fail_member = f"{rec.blake3}.weights"
    with pytest.raises(EnvironmentProblem):
        fleet.pull(fleet.PullRequest(image=source["image"], root=root_b, name="tiny"), Reporter(), t)
    assert not Path(rec.path).exists()
    assert os.listdir(Path(rec.path).parent) == [f"{partial.PREFIX}{rec.blake3}"]  # hidden, resumable
    assert [n for n in os.listdir(root_b) if not n.startswith(".")] == []
    r = fleet.pull(fleet.PullRequest(image=source["image"], root=root_b, name="tiny"), Reporter(), Tools(NODE_B))
    assert Path(rec.path).read_bytes() == source["data"] and r.reused_blobs >= 1  # the image layers it had
    assert sorted(os.listdir(Path(rec.path).parent)) == [Path(rec.path).name, sw.pin_path(Path(rec.path)).name]


def test_a_weights_path_that_cannot_be_made_refuses_before_any_blob(source, tmp_path):
    rec = source["rec"]
    _away(rec, tmp_path)
    Path(rec.path).parent.write_text("in the way")  # a file where the .weights dir goes
    root_b = _root_b(tmp_path)
    with pytest.raises(IncompatibleHostError) as e:
        fleet.pull(fleet.PullRequest(image=source["image"], root=root_b), Reporter(), Tools(NODE_B))
    assert e.value.exit_code == 3 and f"{Path(rec.path).parent} is not a directory" in e.value.message
    assert f"install -d -m 0700 {Path(rec.path).parent}" in e.value.hint
    assert CountingLayout.gets == [] and os.listdir(root_b) == []
    # a symlink on the way is refused too (the file is placed through real directories only)
    os.unlink(Path(rec.path).parent)
    os.symlink(tmp_path, Path(rec.path).parent)
    with pytest.raises(IncompatibleHostError, match="is a symbolic link"):
        fleet.pull(fleet.PullRequest(image=source["image"], root=root_b), Reporter(), Tools(NODE_B))
    assert CountingLayout.gets == []


def test_push_refuses_a_snapshot_whose_weights_file_is_gone(source, tmp_path):
    _away(source["rec"], tmp_path)
    with pytest.raises(ModelChangedError, match="is missing"):
        fleet.push(fleet.PushRequest(snapshot=source["snaps"]["tiny8"], image=source["image"][:-3] + ":v8"),
                   Reporter(), Tools())


def _relabel(source, **ann) -> str:
    layout = transport.Layout(source["layout"])
    doc = json.loads(layout.get_manifest("v1")[0])
    for d in doc["layers"]:
        if d["mediaType"] == oci.WEIGHTS_TYPE:
            d["annotations"].update(ann)
    doc["annotations"].update({k: v for k, v in ann.items() if k == oci.A_WEIGHTS_PATH})
    layout.put_manifest("bad", json.dumps(doc).encode())
    return source["image"][:-3] + ":bad"


def test_an_artifact_naming_a_weights_path_outside_a_weights_dir_is_refused(source, tmp_path):
    root_b = _root_b(tmp_path)
    for path in ("/etc/ld.so.preload", f"/etc/{source['rec'].blake3}.weights",
                 f"/x/../etc/.weights/{source['rec'].blake3}.weights", f"/.weights/{source['rec'].blake3}.weights",
                 f"/a/.weights/{'0' * 64}.weights"):
        image = _relabel(source, **{oci.A_WEIGHTS_PATH: path})
        with pytest.raises(CorruptSnapshotError):
            fleet.pull(fleet.PullRequest(image=image, root=root_b), Reporter(), Tools(NODE_B))
    assert CountingLayout.gets == [] and os.listdir(root_b) == []


def test_weights_path_ok():
    b3 = "a" * 64
    assert oci.weights_path_ok(f"/var/lib/vs/.weights/{b3}.weights", b3)
    assert not oci.weights_path_ok(f"var/lib/vs/.weights/{b3}.weights", b3)
    assert not oci.weights_path_ok(f"/var/lib/vs//.weights/{b3}.weights", b3)
    assert not oci.weights_path_ok(f"/var/lib/vs/.weights/{b3}.weights", "b" * 64)
    assert not oci.weights_path_ok(f"/var/lib/vs/weights/{b3}.weights", b3)


def test_two_stagings_of_one_weights_file_take_turns_and_the_second_finds_it_placed(tmp_path):
    """The staging dir is locked: a second pull of the same weights file waits, then finds the
    file placed (and a stale staging dir of other weights beside it is removed)."""
    import threading

    import blake3

    from vllm_snapshot.fleet import weights as fw

    data = os.urandom(5000)
    b3 = blake3.blake3(data).hexdigest()
    final = tmp_path / "r" / ".weights" / f"{b3}.weights"
    stale = tmp_path / "r" / ".weights" / f"{partial.PREFIX}{'c' * 64}"
    entered, second = threading.Event(), []

    def later() -> None:
        entered.wait(10)
        with fw.staging(final, b3) as ws2:
            second.append(fw.present(final, b3, len(data)))
            assert ws2.dir.is_dir()

    th = threading.Thread(target=later)
    th.start()
    with fw.staging(final, b3) as ws:
        assert final.parent.stat().st_mode & 0o777 == 0o700 and ws.dir.stat().st_mode & 0o777 == 0o700
        stale.mkdir()
        entered.set()
        th.join(0.5)
        assert th.is_alive() and second == []  # waiting for the lock
        ws.data.write_bytes(data)
        ws.place()
    th.join(10)
    assert second == [True] and final.read_bytes() == data and final.stat().st_mode & 0o777 == 0o600
    # both staging dirs gone, the stale one too (the placed file's stat pin beside it)
    assert sorted(os.listdir(final.parent)) == [final.name, sw.pin_path(final).name]


def test_a_staged_file_that_does_not_hash_to_its_name_is_not_placed(tmp_path):
    from vllm_snapshot.fleet import weights as fw

    b3 = "d" * 64
    final = tmp_path / "r" / ".weights" / f"{b3}.weights"
    with pytest.raises(CorruptSnapshotError, match="does not hash to its name"):
        with fw.staging(final, b3) as ws:
            ws.data.write_bytes(b"not those bytes")
            ws.place()
    assert os.listdir(final.parent) == []


def test_present_hashes_a_file_once_then_trusts_this_nodes_pin_until_its_stat_changes(tmp_path, monkeypatch):
    """A weights file found at its path (a node that has it) is hashed whole the first time and
    pinned; the next pull trusts the pin for the same stat; a changed stat hashes again, and a
    changed byte is never present."""
    import blake3

    from vllm_snapshot.fleet import weights as fw
    from vllm_snapshot.store import weights as store_w

    data = os.urandom(5000)
    b3 = blake3.blake3(data).hexdigest()
    final = tmp_path / ".weights" / f"{b3}.weights"
    final.parent.mkdir(mode=0o700)
    final.write_bytes(data)
    os.chmod(final, 0o600)
    hashed = []
    real = store_w.hash_file
    monkeypatch.setattr(store_w, "hash_file", lambda p: hashed.append(p) or real(p))
    assert fw.present(final, b3, len(data)) and hashed == [final]
    assert sw.pin_path(final).exists()
    assert fw.present(final, b3, len(data)) and hashed == [final]  # this node's pin: not hashed again
    assert not fw.present(final, "b" * 64, len(data)) and len(hashed) == 2  # a pin names one digest
    time.sleep(0.05)  # file times tick with the kernel's clock (a few ms): past the pinned ones
    with open(final, "r+b") as f:  # same size, one byte changed: the stat (mtime, ctime) changes
        f.write(b"\x00" if data[:1] != b"\x00" else b"\x01")
    assert not fw.present(final, b3, len(data)) and len(hashed) == 3


def test_a_weights_dir_another_user_owns_or_may_write_fails_verify_and_list(source):
    # a trial: a /tmp/.weights made by nobody (mode 0777) was adopted; nobody then replaced the
    # pin with garbage, and verify and list still said OK
    from vllm_snapshot.ops import manage

    snap, rec = source["snaps"]["tiny"], source["rec"]
    d = Path(rec.path).parent
    assert manage.describe(snap, Tools())["compatible"]
    for owner, mode in ((65534, 0o700), (0, 0o777), (0, 0o750)):
        os.chown(d, owner, owner)
        os.chmod(d, mode)
        try:
            sw.pin_path(Path(rec.path)).write_text("garbage")
            row = manage.describe(snap, Tools())
            assert not row["compatible"] and f"the weights directory {d}" in row["why"], row
            with pytest.raises(EnvironmentProblem, match="weights directory") as ei:
                fleet_verify(snap)
            assert ei.value.exit_code == 11 and f"chmod 0700 {d}" in ei.value.hint
        finally:
            os.chown(d, 0, 0)
            os.chmod(d, 0o700)
    assert manage.describe(snap, Tools())["compatible"]  # put right, it is trusted again


def fleet_verify(snap: Path):
    from vllm_snapshot import ops

    return ops.verify(snap, tools=Tools())


def test_a_weights_dir_others_may_enter_refuses_the_pull_before_any_blob(source, tmp_path):
    rec = source["rec"]
    _away(rec, tmp_path)
    d = Path(rec.path).parent
    d.mkdir(mode=0o700)
    os.chmod(d, 0o777)  # what a restore would refuse (store/weights.py dir_problem): refused first
    root_b = _root_b(tmp_path)
    with pytest.raises(IncompatibleHostError, match=f"{d} has mode 0777, not 0700"):
        fleet.pull(fleet.PullRequest(image=source["image"], root=root_b), Reporter(), Tools(NODE_B))
    assert CountingLayout.gets == [] and os.listdir(root_b) == []
