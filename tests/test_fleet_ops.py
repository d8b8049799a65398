"""ops.fleet's sequencing without root, CRIU or a network: push then pull through an OCI
image layout, with tools whose host identity a test sets. Refusals come before any blob; a
failed pull publishes nothing and leaves no staging dir."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from helpers import manifest_fields, write_snapshot_dir
from test_fleet import _b3, _keypair
from vllm_snapshot.store import manifest, model_digest, store
from vllm_snapshot.errors import (CorruptSnapshotError, EnvironmentProblem, IncompatibleHostError, ModelChangedError,
                                  UsageError)
from vllm_snapshot.fleet import oci, partial, sign, transport
from vllm_snapshot.effects.checkpoint import CriuRunners
from vllm_snapshot.effects.files import LocalSnapshotFiles
from vllm_snapshot.effects.host import LocalHostTools
from vllm_snapshot.effects.store import LocalStoreTools
from vllm_snapshot.effects.tools import local_tools
from vllm_snapshot.effects.fleet import LocalFleetTools
from vllm_snapshot.fleet.tools import PULLED
from vllm_snapshot.ops import fleet
from vllm_snapshot.report.progress import Reporter

HOST = {"kernel": "6.18.0", "cpu_flags": "f00d", "vllm": "0.32.0", "machine_id": "a" * 32, "hostname": "node-a"}


class CountingLayout(transport.Layout):
    gets: list[str] = []
    #: where each download began (member -> the ``start`` of each call)
    starts: dict[str, list[int]] = {}
    #: a member whose blob download fails after ``fail_after`` bytes (default half a chunk), as a
    #: dropped connection does (None: none)
    fail_member: str | None = None
    fail_after: int | None = None
    #: downloads in progress (the pull runs several at once)
    active = 0
    #: the artifact's number of layers (set by the fixture that pushed it): a failing download
    #: waits until each of them has begun, so no layer is still queued when the connection drops
    layers_total: int | None = None
    _lock = threading.Lock()

    def get_blob(self, digest, size, sink, what, start=0, h=None):
        with CountingLayout._lock:
            CountingLayout.gets.append(what)
            CountingLayout.starts.setdefault(what, []).append(start)
            CountingLayout.active += 1
        try:
            return self._get(digest, size, sink, what, start, h)
        finally:
            with CountingLayout._lock:
                CountingLayout.active -= 1

    def _get(self, digest, size, sink, what, start, h):
        if what == CountingLayout.fail_member:
            sent = [0]

            def cut(chunk):
                limit = CountingLayout.fail_after if CountingLayout.fail_after is not None else len(chunk) // 2
                for i in range(0, len(chunk), 1000):  # as a socket delivers it: in pieces
                    piece = chunk[i:i + 1000][: max(0, limit - sent[0])]
                    if piece:
                        sink(piece)
                        sent[0] += len(piece)
                    if sent[0] >= limit:
                        # the connection drops once every other download of the pull has ended
                        # (the tests count what a resume fetches again: which layers were still in
                        # flight must not depend on the machine's load)
                        deadline = time.monotonic() + 30
                        while time.monotonic() < deadline and (
                                CountingLayout.active > 1 or len(set(CountingLayout.gets)) < (CountingLayout.layers_total or 0)):
                            time.sleep(0.005)
                        raise EnvironmentProblem(f"connection to the registry lost while fetching {what}")
            return super().get_blob(digest, size, cut, what, start, h)
        return super().get_blob(digest, size, sink, what, start, h)


class _Fleet(LocalFleetTools):
    """Real transports, the image layout counting its blob downloads."""

    def open_target(self, ref, plain_http, create):
        return CountingLayout(ref.path, create=create)


class _Host(LocalHostTools):
    """This "node": its identity is ``ident``; no GPU, the engine user and mounts as recorded."""

    def __init__(self, ident: dict[str, str]):
        super().__init__(CriuRunners())
        self.ident = ident

    def host_identity(self, kind):
        return dict(self.ident)

    def gpu_uuids(self):
        return [s.uuid for s in self.slots]

    slots: list = []  # this node's GPUs (GpuSlot): none unless a test gives some

    def gpu_slots(self):
        return list(self.slots)

    def user_problems(self, u):
        return []

    def check_external_mounts(self, mounts):
        return []


class _Store(LocalStoreTools):
    """The real store without the host-wide lock files and leftovers of other commands."""

    def snapshot_lock(self, snapshot, shared, must_exist=True):
        return contextlib.nullcontext()

    def reclaim(self, near, dry_run=False):
        return [str(p) for p in store.clean_stale_temps(near)]


class _Files(LocalSnapshotFiles):
    """Snapshot directories read without the trust checks (tmp_path is not root's private dir)."""

    def open_snapshot(self, p):
        return manifest.read(p)

    def verify_images(self, p, m):
        from vllm_snapshot.store import checksums

        checksums.verify(p / "images", m.images)

    def discard(self, tmp):
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_layer_count():
    """Each test starts without a layer count (only pushed6 sets one)."""
    CountingLayout.layers_total = None


def Tools(host: dict[str, str] | None = None):  # noqa: N802 - reads as the bundle it builds
    """The local roles, with this node's identity ``host`` and the overrides above."""
    CountingLayout.gets = []
    CountingLayout.starts = {}
    CountingLayout.fail_member = None
    CountingLayout.fail_after = None
    return dataclasses.replace(local_tools(), host=_Host(dict(host or HOST)), store=_Store(), files=_Files(),
                               fleet=_Fleet())


@pytest.fixture
def model(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(os.urandom(3000))
    return d


def make_snapshot(d: Path, model: Path, scrubbed: bool = True, pages_files: int = 1,
                  page_bytes: int = 50000) -> manifest.Manifest:
    """A snapshot dir of ``inventory.img`` and ``pages_files`` random ``pages-N.img``
    (``page_bytes`` each)."""
    inv = b"inventory"
    pages = [os.urandom(page_bytes) for _ in range(pages_files)]
    files = model_digest.digest_dir(model)
    f = manifest_fields(host=dict(HOST))
    f["engine"] = f["engine"].model_copy(update={"env_scrubbed": scrubbed})
    f["model"] = manifest.ModelIdentity(requested=str(model), path=str(model), served_name="tiny", files=files,
                                        total_bytes=sum(x.size for x in files))
    f["images"] = (manifest.ImageFile(name="inventory.img", raw_bytes=len(inv), stored_bytes=len(inv), blake3=_b3(inv)),
                   *(manifest.ImageFile(name=f"pages-{i}.img", raw_bytes=len(pg), stored_bytes=len(pg), blake3=_b3(pg))
                     for i, pg in enumerate(pages, 1)))
    m = manifest.seal(manifest.Manifest(**f))
    write_snapshot_dir(d, m)
    for sub in ("images", "files"):
        (d / sub).mkdir(mode=0o700)
    for name, data in (("inventory.img", inv), *((f"pages-{i}.img", pg) for i, pg in enumerate(pages, 1))):
        (d / "images" / name).write_bytes(data)
        os.chmod(d / "images" / name, 0o600)
    return m


@pytest.fixture
def pushed(tmp_path, model):
    snap = tmp_path / "snaps" / "tiny"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model)
    image = f"oci:{tmp_path / 'layout'}:v1"
    r = fleet.push(fleet.PushRequest(snapshot=snap, image=image), Reporter(), Tools())
    return {"image": image, "snapshot": snap, "result": r, "layout": tmp_path / "layout"}


def _root(tmp_path) -> Path:
    r = tmp_path / "store-b"
    r.mkdir(mode=0o700)
    return r


def test_pull_publishes_the_same_bytes_with_a_pull_record(tmp_path, pushed):
    root = _root(tmp_path)
    t = Tools({**HOST, "machine_id": "b" * 32, "hostname": "node-b"})  # another machine of the class
    r = fleet.pull(fleet.PullRequest(image=pushed["image"], root=root, name="tiny"), Reporter(), t)
    got = root / "tiny"
    assert r.snapshot == str(got) and r.digest == pushed["result"].digest
    assert (got / "manifest.json").read_bytes() == (pushed["snapshot"] / "manifest.json").read_bytes()
    for n in ("inventory.img", "pages-1.img"):
        assert (got / "images" / n).read_bytes() == (pushed["snapshot"] / "images" / n).read_bytes()
    rec = json.loads((got / PULLED).read_text())
    assert rec["image"] == pushed["image"].replace("oci:", "oci:", 1) and rec["machine_id"] == "b" * 32
    assert rec["hostname"] == "node-b" and rec["digest"] == r.digest
    assert os.listdir(root) == ["tiny"]
    assert manifest.read(got).digest == manifest.read(pushed["snapshot"]).digest


def test_a_host_class_field_that_differs_refuses_before_any_blob(tmp_path, pushed):
    root = _root(tmp_path)
    t = Tools({**HOST, "kernel": "5.4.0"})
    with pytest.raises(IncompatibleHostError) as e:
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root), Reporter(), t)
    assert "kernel: artifact has '6.18.0', this host has '5.4.0'" in e.value.message
    assert CountingLayout.gets == [] and os.listdir(root) == []


def test_a_missing_model_or_other_bytes_refuse_before_any_blob_naming_the_path(tmp_path, pushed, model):
    root = _root(tmp_path)
    (model / "model.safetensors").write_bytes(os.urandom(3000))
    with pytest.raises(ModelChangedError, match=f"other model bytes at {model}"):
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root), Reporter(), Tools())
    shutil.rmtree(model)
    with pytest.raises(ModelChangedError, match=f"needs the model at {model}, which this node lacks"):
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root), Reporter(), Tools())
    assert CountingLayout.gets == [] and os.listdir(root) == []


def test_a_damaged_blob_publishes_nothing_and_leaves_no_staging(tmp_path, pushed):
    root = _root(tmp_path)
    art = fleet.fetch(fleet.reference.parse(pushed["image"]), False, Tools())[1]
    part = next(p for p in art.parts if p.member == "images/pages-1.img")
    blob = pushed["layout"] / "blobs" / "sha256" / part.digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match=f"blob {part.digest} \\(images/pages-1.img\\)"):
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root), Reporter(), Tools())
    assert os.listdir(root) == []


def test_annotations_that_disagree_with_the_config_are_refused(tmp_path, pushed):
    root = _root(tmp_path)
    layout = transport.Layout(pushed["layout"])
    raw, _ = layout.get_manifest("v1")
    doc = json.loads(raw)
    doc["annotations"][oci.A_CLASS + "vllm"] = "0.33.0"  # claims another vLLM than the snapshot has
    layout.put_manifest("lying", json.dumps(doc).encode())
    image = pushed["image"].rsplit(":", 1)[0] + ":lying"
    with pytest.raises(CorruptSnapshotError, match="annotations disagree"):
        fleet.pull(fleet.PullRequest(image=image, root=root), Reporter(), Tools({**HOST, "vllm": "0.33.0"}))
    assert os.listdir(root) == []


def test_verify_key_refuses_an_unsigned_artifact_before_anything_is_written(tmp_path, pushed):
    root = _root(tmp_path)
    _, pub = _keypair(tmp_path, "k")
    with pytest.raises(sign.SignatureError, match="is not signed"):
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root, verify_key=pub), Reporter(), Tools())
    assert not root.exists() or os.listdir(root) == []


def test_signed_push_pulls_with_the_key_and_records_it(tmp_path, model):
    snap = tmp_path / "snaps" / "tiny"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model)
    key, pub = _keypair(tmp_path, "k")
    image = f"oci:{tmp_path / 'layout'}:v1"
    fleet.push(fleet.PushRequest(snapshot=snap, image=image, sign_key=key), Reporter(), Tools())
    r = fleet.pull(fleet.PullRequest(image=image, root=_root(tmp_path), verify_key=pub), Reporter(), Tools())
    assert r.verified_by == sign.fingerprint(sign.load_public(pub))
    assert json.loads((Path(r.snapshot) / PULLED).read_text())["verified_by"] == r.verified_by


def test_push_refuses_a_snapshot_whose_create_kept_variables(tmp_path, model):
    snap = tmp_path / "snaps" / "tiny"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model, scrubbed=False)
    with pytest.raises(UsageError, match="not made from a scrubbed environment"):
        fleet.push(fleet.PushRequest(snapshot=snap, image=f"oci:{tmp_path / 'layout'}:v1"), Reporter(), Tools())
    assert not (tmp_path / "layout").exists()


def test_pull_refuses_an_existing_name_and_a_bad_one(tmp_path, pushed):
    root = _root(tmp_path)
    fleet.pull(fleet.PullRequest(image=pushed["image"], root=root, name="tiny"), Reporter(), Tools())
    (root / "tiny" / PULLED).write_text(json.dumps({"image": "elsewhere:v1", "digest": "sha256:" + "1" * 64}))
    with pytest.raises(UsageError, match="already exists \\(pulled from elsewhere:v1") as e:
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root, name="tiny"), Reporter(), Tools())
    assert "--name NAME" in e.value.hint and "vllm-snapshot delete tiny" in e.value.hint
    with pytest.raises(UsageError, match="not a valid snapshot name"):
        fleet.pull(fleet.PullRequest(image=pushed["image"], root=root, name=".hidden"), Reporter(), Tools())


def test_a_killed_pulls_staging_dir_is_removed_by_the_next_pull(tmp_path, pushed):
    root = _root(tmp_path)
    dead = root / ".tiny.tmp-dead"
    dead.mkdir(mode=0o700)
    (dead / "owner.pid").write_text("999999999")
    r = fleet.pull(fleet.PullRequest(image=pushed["image"], root=root, name="tiny"), Reporter(), Tools())
    assert os.listdir(root) == ["tiny"] and str(dead) in r.warnings[0]


# --------------------------------------------------------------------------- resumed pulls

@pytest.fixture
def pushed6(tmp_path, model):
    """A snapshot of seven layers pushed to an image layout."""
    snap = tmp_path / "snaps" / "six"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model, pages_files=6)
    image = f"oci:{tmp_path / 'layout6'}:v1"
    r = fleet.push(fleet.PushRequest(snapshot=snap, image=image), Reporter(), Tools())
    CountingLayout.layers_total = r.blobs
    return {"image": image, "snapshot": snap, "result": r}


def _layers(gets: list[str]) -> list[str]:
    return [g for g in gets if g.startswith("images/")]


def _interrupted(root: Path, image: str, member: str) -> Path:
    """Pull ``image`` with ``member``'s download failing half-way (a lost connection; the
    smallest member is downloaded last, so every other layer has completed): the partial dir
    it leaves."""
    t = Tools()
    CountingLayout.fail_member = member
    with pytest.raises(EnvironmentProblem, match="connection to the registry lost"):
        fleet.pull(fleet.PullRequest(image=image, root=root, name="six"), Reporter(), t)
    [left] = os.listdir(root)
    assert left.startswith(partial.PREFIX) and store.list_snapshots(root) == []  # nothing listed
    return root / left


def test_an_interrupted_pull_is_resumed_downloading_only_the_layers_it_lacked(tmp_path, pushed6):
    root = _root(tmp_path)
    left = _interrupted(root, pushed6["image"], "images/inventory.img")
    digest = pushed6["result"].digest
    assert left == partial.partial_dir(root, digest)
    assert os.stat(left).st_mode & 0o777 == 0o700
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in (left / "images").iterdir())
    marked = len(os.listdir(left / partial.MARKS))
    assert marked == pushed6["result"].blobs - 1  # every layer but the one that failed half-way
    t = Tools()
    r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), t)
    assert _layers(CountingLayout.gets) == ["images/inventory.img"]  # only the missing layer
    assert r.reused_blobs == marked and r.fetched_bytes == len(b"inventory") and r.reused_bytes + r.fetched_bytes == r.bytes
    assert os.listdir(root) == ["six"] and not (root / "six" / partial.MARKS).exists()
    for n in os.listdir(pushed6["snapshot"] / "images"):
        assert (root / "six" / "images" / n).read_bytes() == (pushed6["snapshot"] / "images" / n).read_bytes()


def test_a_marked_layer_whose_bytes_changed_since_is_downloaded_again(tmp_path, pushed6):
    root = _root(tmp_path)
    left = _interrupted(root, pushed6["image"], "images/inventory.img")
    with open(left / "images" / "pages-2.img", "r+b") as f:  # verified then, damaged since
        f.seek(10)
        f.write(b"\x00\x01")
    r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    assert sorted(_layers(CountingLayout.gets)) == ["images/inventory.img", "images/pages-2.img"]
    assert (root / "six" / "images" / "pages-2.img").read_bytes() == \
        (pushed6["snapshot"] / "images" / "pages-2.img").read_bytes()
    assert r.reused_blobs == pushed6["result"].blobs - 2


def test_a_layer_cut_off_half_way_resumes_from_its_flushed_bytes(tmp_path, pushed6, monkeypatch):
    """The layer the connection dropped in recorded how far its flushed bytes reached; the next
    pull hashes that prefix from disk and fetches only the rest, the digest checked whole."""
    from vllm_snapshot.fleet import transfer

    monkeypatch.setattr(transfer, "PROGRESS_BYTES", 4096)
    root = _root(tmp_path)
    CountingLayout.fail_after = 30000  # of pages-3.img's 50000 bytes
    left = _interrupted(root, pushed6["image"], "images/pages-3.img")
    art = fleet.fetch(fleet.reference.parse(pushed6["image"]), False, Tools())[1]
    i = next(n for n, p in enumerate(art.parts) if p.member == "images/pages-3.img")
    kept = int((left / partial.MARKS / f"{i}.at").read_text())
    assert 4096 <= kept <= 30000  # a progress record: bytes flushed before the cut
    r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    assert _layers(CountingLayout.gets) == ["images/pages-3.img"] and CountingLayout.starts["images/pages-3.img"] == [kept]
    assert r.fetched_bytes == 50000 - kept and r.reused_bytes == r.bytes - r.fetched_bytes
    assert (root / "six" / "images" / "pages-3.img").read_bytes() == \
        (pushed6["snapshot"] / "images" / "pages-3.img").read_bytes()


def test_a_kept_prefix_that_does_not_hold_fetches_the_whole_layer_again(tmp_path, pushed6, monkeypatch):
    from vllm_snapshot.fleet import transfer

    monkeypatch.setattr(transfer, "PROGRESS_BYTES", 4096)
    root = _root(tmp_path)
    CountingLayout.fail_after = 30000
    left = _interrupted(root, pushed6["image"], "images/pages-3.img")
    with open(left / "images" / "pages-3.img", "r+b") as f:  # flushed then, damaged since
        f.seek(100)
        f.write(b"\xff\x00")
    r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    starts = CountingLayout.starts["images/pages-3.img"]
    assert len(starts) == 2 and starts[0] > 0 and starts[1] == 0  # the range, then the whole layer
    assert (root / "six" / "images" / "pages-3.img").read_bytes() == \
        (pushed6["snapshot"] / "images" / "pages-3.img").read_bytes()
    assert r.fetched_bytes == (50000 - starts[0]) + 50000  # real bytes: the rest that did not hold, then all of it
    assert r.reused_bytes + r.fetched_bytes > r.bytes


def test_stale_partial_dirs_are_removed_and_a_live_pulls_is_left_alone(tmp_path, pushed6):
    import fcntl

    root = _root(tmp_path)
    other = root / (partial.PREFIX + "1" * 64)  # a killed pull of another artifact
    old = _interrupted(root, pushed6["image"], "images/inventory.img")  # this artifact's, but a day old
    live = root / (partial.PREFIX + "2" * 64)  # another artifact's, its pull still running
    for d in (other, live):
        d.mkdir(mode=0o700)
    long_ago = time.time() - partial.MAX_AGE_S - 60
    for p in (old, old / partial.MARKS):
        os.utime(p, (long_ago, long_ago))
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    finally:
        os.close(fd)
    assert sorted(os.listdir(root)) == sorted(["six", live.name])
    assert any(str(other) in w for w in r.warnings) and any(str(old) in w for w in r.warnings)
    assert r.reused_blobs == 0 and len(_layers(CountingLayout.gets)) == pushed6["result"].blobs  # the old one unused


def test_a_second_pull_of_an_artifact_being_pulled_stages_on_its_own(tmp_path, pushed6):
    """Another pull holds the partial dir (a live pull of the same artifact under another name):
    this one writes none of its files and publishes from a dir of its own."""
    import fcntl

    root = _root(tmp_path)
    left = _interrupted(root, pushed6["image"], "images/inventory.img")
    before = {p.name: p.read_bytes() for p in (left / "images").iterdir()}
    marks = sorted(os.listdir(left / partial.MARKS))
    fd = os.open(left, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="other"), Reporter(), Tools())
    finally:
        os.close(fd)
    assert r.reused_blobs == 0 and sorted(os.listdir(root)) == sorted(["other", left.name])
    assert {p.name: p.read_bytes() for p in (left / "images").iterdir()} == before
    assert sorted(os.listdir(left / partial.MARKS)) == marks
    # and the held partial is resumed by the next pull once released
    r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    assert r.reused_blobs == len(marks) and sorted(os.listdir(root)) == ["other", "six"]


def test_a_pull_that_fails_verification_removes_its_partial_dir(tmp_path, pushed6):
    root = _root(tmp_path)
    left = _interrupted(root, pushed6["image"], "images/inventory.img")
    t = Tools()

    def refuse(staging, m, assembled=None):
        raise CorruptSnapshotError("pages-2.img does not match its checksum")

    t.fleet.check_pulled = refuse
    with pytest.raises(CorruptSnapshotError):
        fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), t)
    assert not left.exists() and os.listdir(root) == []


def test_a_pull_whose_layers_disagree_with_the_snapshot_manifest_is_refused_and_publishes_nothing(tmp_path, pushed6):
    """Every layer's sha256 holds (the pusher hashed what it sent) but a file assembled from them
    is not the one the snapshot manifest's BLAKE3 names: the checksum pass that runs while the
    files are written refuses it, naming the file, and nothing is listed or left."""
    from vllm_snapshot.fleet import transfer

    snap = pushed6["snapshot"]
    layout = transport.Layout(Path(pushed6["image"].split(":")[1]), create=False)
    art = transfer.fetch_manifest(layout, "v1", "IMG")
    with open(snap / "images" / "pages-2.img", "r+b") as f:  # changed after the manifest was sealed
        f.seek(7)
        f.write(b"\xff\x00")
    transfer.push(snap, (snap / "manifest.json").read_bytes(), art.annotations, layout, "bad")
    root = _root(tmp_path)
    image = pushed6["image"].rsplit(":", 1)[0] + ":bad"
    with pytest.raises(CorruptSnapshotError, match=r"images/pages-2.img fails its checksum"):
        fleet.pull(fleet.PullRequest(image=image, root=root, name="six"), Reporter(), Tools())
    assert os.listdir(root) == []


def test_default_names():
    assert fleet.default_name(fleet.reference.parse("127.0.0.1:5000/fleet/tiny:v1")) == "tiny-v1"
    assert fleet.default_name(fleet.reference.parse("h:1/a@sha256:" + "c" * 64)) == "a-cccccccccccc"
    assert fleet.default_name(fleet.reference.parse("oci:/srv/lay:v2")) == "lay-v2"


# --------------------------------------------------------------------------- restore of a pulled snapshot

def test_restore_checks_a_pulled_snapshot_at_the_host_class_level(tmp_path):
    from fakes import HOST as FAKE_HOST, FakeWorld
    from vllm_snapshot.ops.restore import validate

    snap = tmp_path / "tiny"
    other_machine = FakeWorld(host={**FAKE_HOST, "machine_id": "another-machine"})
    with pytest.raises(IncompatibleHostError, match="machine_id"):  # made here, copied: pinned to its machine
        validate(snap, tools=other_machine.tools)
    other_machine.pulled[str(snap.absolute())] = {"image": "127.0.0.1:5000/fleet/tiny:v1", "digest": "sha256:" + "0" * 64}
    m, warnings = validate(snap, tools=other_machine.tools)  # pulled: any machine of its class, no override
    assert not [w for w in warnings if "identity override" in w]
    other_class = FakeWorld(host={**FAKE_HOST, "kernel": "5.4.0"})
    other_class.pulled[str(snap.absolute())] = {"image": "x", "digest": "y"}
    with pytest.raises(IncompatibleHostError, match="kernel"):
        validate(snap, tools=other_class.tools)


def test_identity_compare_at_the_class_level_skips_only_machine_fields():
    from vllm_snapshot.host import identity

    a = {"kernel": "6.18", "machine_id": "m1", "hostname": "a"}
    assert [d.field for d in identity.compare(a, {**a, "machine_id": "m2", "hostname": "b"})] == ["machine_id"]
    assert identity.compare(a, {**a, "machine_id": "m2", "hostname": "b"}, machine=False) == []
    assert [d.field for d in identity.compare(a, {**a, "kernel": "5.4"}, machine=False)] == ["kernel"]


def test_registry_cache_pushes_a_key_once_and_pulls_it_by_key(tmp_path, model):
    snap = tmp_path / "snaps" / "tiny"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model)
    cache = fleet.RegistryCache(f"oci:{tmp_path / 'layout'}", Tools(), Reporter())
    key = "f" * 64
    root = _root(tmp_path)
    assert cache.fetch(key, root / "tiny") is None  # nothing there yet: the caller builds
    assert cache.offer(snap, key) == [] and cache.has(key)
    first = transport.Layout(tmp_path / "layout").get_manifest(key)[1]
    assert cache.offer(snap, key) == []  # already there: not pushed again
    assert transport.Layout(tmp_path / "layout").get_manifest(key)[1] == first
    got = cache.fetch(key, root / "tiny")
    assert got == root / "tiny" and (got / PULLED).is_file()
    with pytest.raises(UsageError, match="names a tag"):
        fleet.RegistryCache("127.0.0.1:5000/fleet/tiny:v1", Tools(), Reporter())


def test_restore_image_pulls_once_then_uses_the_store_and_refuses_a_name_holding_another_artifact(tmp_path, pushed):
    root = _root(tmp_path)
    req = fleet.PullRequest(image=pushed["image"], root=root)
    first = fleet.ensure_pulled(req, Reporter(), Tools())
    assert first == root / fleet.default_name(fleet.reference.parse(pushed["image"])) and CountingLayout.gets
    t = Tools()
    assert fleet.ensure_pulled(req, Reporter(), t) == first and CountingLayout.gets == []  # nothing downloaded again
    (first / PULLED).write_text(json.dumps({"image": "elsewhere", "digest": "sha256:" + "1" * 64}))
    with pytest.raises(UsageError, match="already exists \\(pulled from elsewhere"):  # a --name that holds another
        fleet.ensure_pulled(dataclasses.replace(req, name=first.name), Reporter(), Tools())
    beside = fleet.ensure_pulled(req, Reporter(), Tools())  # the default name: the artifact goes beside it
    assert beside == root / f"{first.name}-{pushed['result'].digest.split(':')[1][:12]}"


def test_a_node_fits_a_cuda_image_by_the_gpu_model_at_the_recorded_minor_not_by_its_uuid(model):
    """The GPU's UUID pins one machine: another node of the class has the same model at the same
    device minor under another UUID, and the restore remaps onto it; pull refuses (before any
    blob) a node whose GPU at that minor is another model, or that has none there."""
    from vllm_snapshot.checkpoint.gpu import GpuSlot
    from vllm_snapshot.store.snapkey import model_part

    files = model_digest.digest_dir(model)
    f = manifest_fields(host={**HOST, "gpu_name": "NVIDIA H200", "gpu_driver": "580.95.05",
                              "gpu_uuid_used": "GPU-0c4a1b2e-1111-2222-3333-444455556666",
                              "gpu_minor_used": "0", "gpu_name_used": "NVIDIA H200"})
    f["engine"] = f["engine"].model_copy(update={"kind": "cuda"})
    f["model"] = manifest.ModelIdentity(requested=str(model), path=str(model), served_name="tiny", files=files,
                                        total_bytes=sum(x.size for x in files))
    m = manifest.seal(manifest.Manifest(**f))
    ann = oci.annotations(m, model_part(files))
    assert ann[oci.A_MACHINE + "gpu_uuid_used"] == "GPU-0c4a1b2e-1111-2222-3333-444455556666"
    assert ann[oci.A_MACHINE + "gpu_minor_used"] == "0" and ann[oci.A_MACHINE + "gpu_name_used"] == "NVIDIA H200"
    assert ann[oci.A_CLASS + "gpu_name"] == "NVIDIA H200" and not any(k.startswith(oci.A_CLASS + "gpu_uuid") for k in ann)
    facts = oci.facts(ann, "IMG")
    node = {**HOST, "machine_id": "b" * 32, "hostname": "node-b", "gpu_name": "NVIDIA H200", "gpu_driver": "580.95.05"}
    t = Tools(node)
    t.host.slots = [GpuSlot("GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff", "NVIDIA H200", 0)]
    fleet.compatibility(facts, t, "IMG")  # fits: the restore remaps onto node-b's GPU
    for slots, says in (([GpuSlot("GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff", "NVIDIA H100", 0)],
                         "/dev/nvidia0 here is a NVIDIA H100"),
                        ([GpuSlot("GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff", "NVIDIA H200", 1)],
                         "needs a NVIDIA H200 at /dev/nvidia0")):
        t.host.slots = slots
        with pytest.raises(IncompatibleHostError, match="does not fit this node") as ei:
            fleet.compatibility(facts, t, "IMG")
        assert says in ei.value.message and "GPU-0c4a1b2e-1111-2222-3333-444455556666" in ei.value.message


def _full_after(monkeypatch, n: int) -> None:
    """The layout's filesystem fills up at the ``n``-th blob written (ENOSPC, as a small mount gives)."""
    import errno

    calls = [0]
    real = transport.Layout.put_blob

    def put_blob(self, digest, size, path, offset=0):
        calls[0] += 1
        if calls[0] >= n:
            raise OSError(errno.ENOSPC, "No space left on device")  # as write(2) raises it: no file named
        return real(self, digest, size, path, offset)

    monkeypatch.setattr(transport.Layout, "put_blob", put_blob)


def test_a_push_to_a_full_filesystem_is_an_environment_error_and_removes_the_layout_it_began(tmp_path, model,
                                                                                              monkeypatch):
    snap = tmp_path / "snaps" / "tiny"
    snap.parent.mkdir(mode=0o700)
    make_snapshot(snap, model)
    dest = tmp_path / "small" / "oci"  # neither exists: the push makes both
    _full_after(monkeypatch, 2)
    with pytest.raises(EnvironmentProblem) as e:
        fleet.push(fleet.PushRequest(snapshot=snap, image=f"oci:{dest}:v1"), Reporter(), Tools())
    assert e.value.exit_code == 11
    assert "no space left" in e.value.message and str(dest) in e.value.message
    assert "nothing was published" in e.value.message and e.value.hint
    assert not dest.exists() and not dest.parent.exists()  # a failed push publishes nothing


def test_a_failed_push_into_an_existing_layout_keeps_its_blobs(tmp_path, pushed, model, monkeypatch):
    lay = pushed["layout"]
    before = sorted(p.name for p in (lay / "blobs" / "sha256").iterdir())
    index = (lay / "index.json").read_bytes()
    other = tmp_path / "snaps" / "other"
    make_snapshot(other, model)  # other random pages: new blobs to write
    _full_after(monkeypatch, 2)  # one new blob written, then the filesystem is full
    with pytest.raises(EnvironmentProblem, match="blobs it wrote are kept") as e:
        fleet.push(fleet.PushRequest(snapshot=other, image=f"oci:{lay}:v2"), Reporter(), Tools())
    assert e.value.exit_code == 11
    after = sorted(p.name for p in (lay / "blobs" / "sha256").iterdir())
    assert set(before) < set(after)  # nothing of the layout another push made is removed
    assert (lay / "oci-layout").is_file() and (lay / "index.json").read_bytes() == index


def test_an_interrupted_pull_says_what_it_kept_where_its_size_and_how_to_resume_or_remove_it(tmp_path, pushed6,
                                                                                              monkeypatch):
    # a trial: "interrupted by SIGINT; stopped what was running and cleaned up", rc 130, and a
    # 471 MB .pull-<digest> left without a word
    from vllm_snapshot.errors import Interrupted
    from vllm_snapshot.fleet import transfer

    root = _root(tmp_path)
    real = transfer.download

    def interrupted(target, art, staging, *a, **kw):
        (Path(staging) / "images" / "pages-1.img").write_bytes(os.urandom(300 * 1024))  # what it had written
        raise Interrupted("interrupted by SIGINT; stopped what was running and cleaned up", details={"signal": "SIGINT"})

    monkeypatch.setattr(transfer, "download", interrupted)
    with pytest.raises(Interrupted) as e:
        fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    left = partial.partial_dir(root, pushed6["result"].digest)
    assert left.is_dir()
    msg, hint = e.value.message, e.value.hint
    assert msg.startswith("interrupted by SIGINT; stopped what was running and cleaned up, except the partial pull "
                          f"{left} (3") and "KiB" in msg and "the same pull resumes from it" in msg, msg
    assert f"vllm-snapshot --root {root} pull {pushed6['image']} --name six` resumes" in hint
    assert f"`rm -r {left}` removes it" in hint
    assert e.value.exit_code == 130 and e.value.details == {"signal": "SIGINT", "kept": str(left),
                                                            "kept_bytes": partial.disk_bytes(left)}
    assert partial.disk_bytes(left) >= 300 * 1024
    # prune and doctor list it (read by partial.kept), and keep it
    [k] = partial.kept(root)
    assert k.path == str(left) and k.bytes == partial.disk_bytes(left) and not k.live and 0 <= k.age_s < 60
    monkeypatch.setattr(transfer, "download", real)
    r = fleet.pull(fleet.PullRequest(image=pushed6["image"], root=root, name="six"), Reporter(), Tools())
    assert os.listdir(root) == ["six"] and r.snapshot == str(root / "six")
