"""The fleet's format and transports (no vLLM, no CRIU): IMAGE references, the artifact's
layer plan and manifest checks, push/download through an OCI image layout and through a real
registry (Debian's docker-registry on loopback), digests checked while streaming, manifest
last, cosign-layout signatures."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from helpers import make_manifest, manifest_fields, write_snapshot_dir
from vllm_snapshot.dev.registry_server import RegistryServer
from vllm_snapshot.store import manifest
from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from vllm_snapshot.fleet import oci, reference, sign, transfer, transport
from vllm_snapshot.fleet.reference import LayoutRef, RegistryRef


# --------------------------------------------------------------------------- references

@pytest.mark.parametrize("text,want", [
    ("127.0.0.1:5000/snaps/tiny:v1", RegistryRef("127.0.0.1:5000", "snaps/tiny", "v1")),
    ("localhost/tiny", RegistryRef("localhost", "tiny", "latest")),
    ("reg.example:443/a/b/c@sha256:" + "a" * 64, RegistryRef("reg.example:443", "a/b/c", None, "sha256:" + "a" * 64)),
    ("oci:/srv/layout", LayoutRef(Path("/srv/layout"), "latest")),
    ("oci:/srv/layout:v2", LayoutRef(Path("/srv/layout"), "v2")),
    ("oci:rel/dir@sha256:" + "b" * 64, LayoutRef(Path("rel/dir"), None, "sha256:" + "b" * 64)),
])
def test_references_parse(text, want):
    assert reference.parse(text) == want


@pytest.mark.parametrize("text", ["tiny", "127.0.0.1:5000/", "127.0.0.1:5000/UPPER:v1", "h:1/r:bad tag",
                                  "h:1/r@sha256:xyz", "oci:", "/abs/path"])
def test_bad_references_are_usage_errors(text):
    with pytest.raises(UsageError, match="not an image reference|names no directory|not valid|digest|tag"):
        reference.parse(text)


def test_looks_like_image_tells_names_from_references():
    assert reference.looks_like_image("127.0.0.1:5000/snaps/tiny:v1")
    assert reference.looks_like_image("oci:/x")
    assert reference.looks_like_image("localhost/x")
    assert not reference.looks_like_image("tiny")
    assert not reference.looks_like_image("/var/lib/vllm-snapshot/snapshots/tiny")
    assert not reference.looks_like_image("./tiny")


# --------------------------------------------------------------------------- a snapshot dir

def _snapshot(d: Path, pages: bytes = b"\x01" * 8192, **over) -> tuple[Path, manifest.Manifest]:
    inv = b"inventory"
    fields = manifest_fields(**over)
    fields["images"] = (
        manifest.ImageFile(name="inventory.img", raw_bytes=len(inv), stored_bytes=len(inv), blake3=_b3(inv)),
        manifest.ImageFile(name="pages-1.img", raw_bytes=len(pages), stored_bytes=len(pages), blake3=_b3(pages)),
    )
    fields["engine"] = fields["engine"].model_copy(update={"env_scrubbed": True}) \
        if "env_scrubbed" in manifest.EngineInfo.model_fields else fields["engine"]
    m = manifest.seal(manifest.Manifest(**fields))
    write_snapshot_dir(d, m)
    (d / "images").mkdir(mode=0o700)
    (d / "files").mkdir(mode=0o700)
    for name, data in (("inventory.img", inv), ("pages-1.img", pages)):
        p = d / "images" / name
        p.write_bytes(data)
        os.chmod(p, 0o600)
    (d / "criu-dump.log").write_bytes(b"dump log\n")
    os.chmod(d / "criu-dump.log", 0o600)
    return d, m


def _b3(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


def _staging(d: Path) -> Path:
    d.mkdir(mode=0o700)
    (d / "images").mkdir(mode=0o700)
    (d / "files").mkdir(mode=0o700)
    return d


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != "manifest.json"}


def test_plan_cuts_big_files_into_parts_that_tile_them(tmp_path):
    snap, _ = _snapshot(tmp_path / "s", pages=os.urandom(10000))
    parts = oci.plan(snap, part_bytes=4096)
    pages = [p for p in parts if p.member == "images/pages-1.img"]
    assert [(p.offset, p.size) for p in pages] == [(0, 4096), (4096, 4096), (8192, 1808)]
    assert {p.member for p in parts} == {"criu-dump.log", "images/inventory.img", "images/pages-1.img"}
    assert all(p.media_type == oci.IMAGE_TYPE for p in parts if p.member.startswith("images/"))


def test_plan_refuses_a_member_a_snapshot_may_not_hold(tmp_path):
    snap, _ = _snapshot(tmp_path / "s")
    (snap / "images" / "link").symlink_to("/etc/passwd")
    with pytest.raises(CorruptSnapshotError, match="not a member"):
        oci.plan(snap)


def _artifact(parts, ann=None) -> bytes:
    return oci.build_manifest(b"{}", [p if p.digest else oci.Part(p.member, p.offset, p.size, p.file_size, p.media_type,
                                                                    "sha256:" + "0" * 64) for p in parts], ann or {})


@pytest.mark.parametrize("member", ["../etc/passwd", "images/../../x", "images/a/b", "manifest.json", "other"])
def test_manifest_with_an_unsafe_member_is_refused(member):
    raw = _artifact([oci.Part(member, 0, 3, 3, oci.MEMBER_TYPE)])
    with pytest.raises(CorruptSnapshotError, match="unsafe member"):
        oci.parse_manifest(raw, "IMG")


def test_manifest_whose_parts_do_not_tile_the_file_is_refused():
    raw = _artifact([oci.Part("images/p.img", 0, 4, 10, oci.IMAGE_TYPE), oci.Part("images/p.img", 5, 5, 10, oci.IMAGE_TYPE)])
    with pytest.raises(CorruptSnapshotError, match="do not tile"):
        oci.parse_manifest(raw, "IMG")
    raw = _artifact([oci.Part("images/p.img", 0, 4, 10, oci.IMAGE_TYPE)])
    with pytest.raises(CorruptSnapshotError, match="stop short"):
        oci.parse_manifest(raw, "IMG")


def test_a_foreign_artifact_is_refused():
    doc = json.loads(_artifact([]))
    doc["artifactType"] = "application/vnd.cncf.helm.chart"
    with pytest.raises(CorruptSnapshotError, match="not a vllm-snapshot artifact"):
        oci.parse_manifest(json.dumps(doc).encode(), "IMG")


def test_annotations_split_host_class_from_machine_and_read_back():
    m = make_manifest(host={"kernel": "6.18.0", "cpu_flags": "ab12", "machine_id": "m1", "hostname": "node-a",
                            "gpu_uuid": "old"})
    ann = oci.annotations(m, "d" * 64)
    assert ann[oci.A_CLASS + "kernel"] == "6.18.0" and ann[oci.A_MACHINE + "machine_id"] == "m1"
    assert oci.A_CLASS + "machine_id" not in ann and oci.A_CLASS + "gpu_uuid" not in ann
    f = oci.facts(ann, "IMG")
    assert f.host_class == {"kernel": "6.18.0", "cpu_flags": "ab12"}
    assert f.machine == {"machine_id": "m1", "hostname": "node-a"}
    assert f.user == m.engine.user and f.model_path == m.model.path and f.kind == "cpu"
    del ann[oci.A_KIND]
    with pytest.raises(CorruptSnapshotError, match="engine.kind is missing"):
        oci.facts(ann, "IMG")


# --------------------------------------------------------------------------- transports

@pytest.fixture
def registry(tmp_path):
    r = RegistryServer(tmp_path / "registry")
    yield r
    r.stop()


def _targets(kind: str, tmp_path: Path, registry_factory):
    if kind == "layout":
        return transport.Layout(tmp_path / "layout", create=True)
    return transport.Registry(RegistryRef(registry_factory().host, "snaps/tiny", "v1"), plain_http=True)


@pytest.mark.parametrize("kind", ["layout", "registry"])
def test_push_then_download_gives_the_same_bytes(kind, tmp_path, request):
    snap, m = _snapshot(tmp_path / "s", pages=os.urandom(20000))
    target = _targets(kind, tmp_path, lambda: request.getfixturevalue("registry"))
    config = (snap / "manifest.json").read_bytes()
    pushed = transfer.push(snap, config, oci.annotations(m, "d" * 64), target, "v1", part_bytes=8192)
    assert pushed.blobs == 5 and pushed.skipped == 0  # log, inventory, pages in 3 parts
    art = transfer.fetch_manifest(target, "v1", "IMG")
    assert art.digest == pushed.digest and art.annotations[oci.A_SNAPSHOT_DIGEST] == m.digest
    assert transfer.fetch_bytes(target, art.config_digest, art.config_size, "config") == config
    out = _staging(tmp_path / "out")
    transfer.download(target, art, out)
    assert _tree(out) == _tree(snap)
    assert {oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()} == {"0o600"}
    again = transfer.push(snap, config, oci.annotations(m, "d" * 64), target, "v2", part_bytes=8192)
    assert again.skipped == 5 and again.sent_bytes == 0 and again.digest == pushed.digest


@pytest.mark.parametrize("kind", ["layout", "registry"])
def test_a_ranged_get_continues_a_blob_and_checks_the_digest_over_all_of_it(kind, tmp_path, request):
    """A resumed layer: the caller hashed the first ``start`` bytes it holds; the transport
    fetches the rest (an HTTP range from the registry) and checks the digest over the whole."""
    import hashlib

    data = os.urandom(300000)
    blob = tmp_path / "blob"
    blob.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    target = _targets(kind, tmp_path, lambda: request.getfixturevalue("registry"))
    target.put_blob(digest, len(data), blob)
    got = bytearray()
    target.get_blob(digest, len(data), got.extend, "pages", start=123456, h=hashlib.sha256(data[:123456]))
    assert bytes(got) == data[123456:]
    if kind == "registry":  # the registry sent only the rest (its access log line may come a moment later)
        reg = request.getfixturevalue("registry")
        deadline = time.monotonic() + 10
        while not (ranged := [x for x in reg.requests_log() if f"/blobs/{digest}" in x and '" 206 ' in x]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ranged, reg.requests_log()[-3:]
    other = bytearray(data[:123456])
    other[7] ^= 1  # the caller's prefix does not hold: refused, the digest covers it
    with pytest.raises(CorruptSnapshotError, match="does not match its digest"):
        target.get_blob(digest, len(data), bytearray().extend, "pages", start=123456, h=hashlib.sha256(other))


def test_a_blob_damaged_at_rest_is_refused_naming_it(tmp_path, registry):
    snap, m = _snapshot(tmp_path / "s", pages=os.urandom(20000))
    target = transport.Registry(RegistryRef(registry.host, "snaps/tiny", "v1"), plain_http=True)
    transfer.push(snap, (snap / "manifest.json").read_bytes(), oci.annotations(m, "d" * 64), target, "v1")
    art = transfer.fetch_manifest(target, "v1", "IMG")
    pages = next(p for p in art.parts if p.member == "images/pages-1.img")
    blob = registry.blob_path(pages.digest)
    data = bytearray(blob.read_bytes())
    data[1234] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match=rf"blob {pages.digest} \(images/pages-1.img\) does not match"):
        transfer.download(target, art, _staging(tmp_path / "out"))


def _layout_artifact(tmp_path: Path, pages: bytes, part_bytes: int = 8192):
    snap, m = _snapshot(tmp_path / "s", pages=pages)
    target = transport.Layout(tmp_path / "layout", create=True)
    transfer.push(snap, (snap / "manifest.json").read_bytes(), oci.annotations(m, "d" * 64), target, "v1",
                  part_bytes=part_bytes)
    return snap, m, target, transfer.fetch_manifest(target, "v1", "IMG")


def test_a_downloads_flushes_are_made_beside_the_streams_and_every_layer_ends_flushed_then_marked(
        tmp_path, monkeypatch):
    """No blob stream calls fdatasync (the flush thread does, for the progress records and the
    markers); the download ends with every layer marked and no progress record left."""
    from vllm_snapshot.fleet import partial

    monkeypatch.setattr(transfer, "PROGRESS_BYTES", 4096)
    snap, _, target, art = _layout_artifact(tmp_path, os.urandom(60000))
    synced: list[tuple[str, str]] = []
    real = os.fdatasync

    def fdatasync(fd):
        synced.append((__import__("threading").current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    out = _staging(tmp_path / "out")
    (out / partial.MARKS).mkdir(mode=0o700)
    transfer.download(target, art, out, resumable=True)
    assert {k: v for k, v in _tree(out).items() if not k.startswith(partial.MARKS)} == _tree(snap)
    assert synced and {name for name, _ in synced} == {"vllm-snapshot-flush"}
    assert str(out / "images" / "pages-1.img") in {path for _, path in synced}
    assert sorted(os.listdir(out / partial.MARKS)) == sorted(str(i) for i in range(len(art.parts)))


def test_a_flush_that_fails_fails_the_download_and_marks_nothing(tmp_path, monkeypatch):
    """A marker says its layer's bytes are on disk: when the flush before it fails (EIO), the
    download raises that error and no layer is marked."""
    import errno

    from vllm_snapshot.fleet import partial

    _, _, target, art = _layout_artifact(tmp_path, os.urandom(30000))

    def fdatasync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    out = _staging(tmp_path / "out")
    (out / partial.MARKS).mkdir(mode=0o700)
    with pytest.raises(OSError, match="Input/output error"):
        transfer.download(target, art, out, resumable=True)
    assert os.listdir(out / partial.MARKS) == []


def test_on_blob_names_each_layer_once_its_bytes_are_written_and_checked(tmp_path):
    """What a pull's checksum pass relies on to hash a file while it is assembled: on_blob comes
    after the layer's bytes are in its region of the member, for every layer downloaded."""
    snap, _, target, art = _layout_artifact(tmp_path, os.urandom(50000))
    out = _staging(tmp_path / "out")
    seen = []

    def on_blob(p):
        with open(out / p.member, "rb") as f:
            f.seek(p.offset)
            seen.append((p.member, p.offset, f.read(p.size) == (snap / p.member).read_bytes()[p.offset:p.offset + p.size]))

    transfer.download(target, art, out, on_blob=on_blob)
    assert sorted(seen) == sorted((p.member, p.offset, True) for p in art.parts)


def _assembling_files(tmp_path: Path, data: bytes, name: str = "pages-1.img"):
    from vllm_snapshot.store import checksums

    d = tmp_path / "images"
    d.mkdir(mode=0o700, exist_ok=True)
    path = d / name
    img = manifest.ImageFile(name=name, raw_bytes=len(data), stored_bytes=len(data), blake3=_b3(data))
    return checksums, path, img


def test_assembling_hashes_a_file_whose_parts_are_written_in_any_order(tmp_path):
    """Regions announced out of order are hashed in file order as far as they reach without a gap,
    before finish(); finish() hashes the rest (regions never announced: a resumed pull's reused
    layers) and accepts the file."""
    data = os.urandom(10 * 300_000 + 123)
    checksums, path, img = _assembling_files(tmp_path, data)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, len(data))
    a = checksums.Assembling({path: img})
    size = 300_000
    regions = [(off, min(size, len(data) - off)) for off in range(0, len(data), size)]
    for off, n in [regions[2], regions[0], regions[1], regions[4]]:  # regions[3] never announced
        os.pwrite(fd, data[off:off + n], off)
        a.ready(path, off, n)
    for off, n in regions[3:]:
        os.pwrite(fd, data[off:off + n], off)
    os.close(fd)
    deadline = time.monotonic() + 10
    while a.early_bytes < 3 * size and time.monotonic() < deadline:  # 0..3 reach without a gap
        time.sleep(0.01)
    assert a.early_bytes == 3 * size
    assert a.finish() == {path}


def test_assembling_refuses_a_part_at_the_wrong_offset_or_a_file_of_another_size(tmp_path):
    """The bytes are read back from the file, not taken from the stream: a part written where it
    does not belong fails the file's checksum, as a file longer than recorded does."""
    from vllm_snapshot.store import checksums

    data = os.urandom(100_000)
    _, path, img = _assembling_files(tmp_path, data)
    swapped = data[50_000:] + data[:50_000]  # each half's bytes sound, at the other's offset
    path.write_bytes(swapped)
    a = checksums.Assembling({path: img})
    a.ready(path, 0, 50_000)
    a.ready(path, 50_000, 50_000)
    with pytest.raises(CorruptSnapshotError, match=rf"image {path} fails its checksum"):
        a.finish()
    path.write_bytes(data + b"x")
    a = checksums.Assembling({path: img})
    a.ready(path, 0, 100_000)
    with pytest.raises(CorruptSnapshotError, match="BLAKE3 of 100001 raw bytes differs"):
        a.finish()


def test_assembling_says_a_missing_file_is_missing_and_cancel_stops_it(tmp_path):
    from vllm_snapshot.store import checksums

    _, path, img = _assembling_files(tmp_path, b"abc")
    with pytest.raises(CorruptSnapshotError, match=rf"image file {path} is missing"):
        checksums.Assembling({path: img}).finish()
    path.write_bytes(b"abc")
    a = checksums.Assembling({path: img})
    a.cancel()
    a.ready(path, 0, 3)  # after cancel: ignored
    assert a.early_bytes == 0


def test_a_push_that_fails_midway_leaves_no_tag(tmp_path):
    snap, m = _snapshot(tmp_path / "s", pages=os.urandom(20000))
    layout = transport.Layout(tmp_path / "layout", create=True)

    class Failing(transport.Layout):
        calls = 0

        def put_blob(self, *a, **kw):
            Failing.calls += 1
            if Failing.calls == 3:
                raise EnvironmentProblem("connection reset")
            return super().put_blob(*a, **kw)

    with pytest.raises(EnvironmentProblem):
        transfer.push(snap, (snap / "manifest.json").read_bytes(), oci.annotations(m, "d" * 64),
                      Failing(layout.path, create=True), "v1", part_bytes=4096, workers=1)
    with pytest.raises(transport.NotFound):
        layout.get_manifest("v1")


def test_plain_http_is_for_loopback_only():
    with pytest.raises(UsageError, match="loopback"):
        transport.Registry(RegistryRef("registry.example:5000", "a", "v1"), plain_http=True)


def test_credentials_come_from_the_auth_file(tmp_path, monkeypatch):
    f = tmp_path / "auth.json"
    f.write_text(json.dumps({"auths": {"reg.example:5000": {"auth": base64.b64encode(b"alice:s3cret").decode()}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(f))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert transport.credentials("reg.example:5000") == ("alice", "s3cret")
    assert transport.credentials("other.example") is None


# --------------------------------------------------------------------------- signatures

def _keypair(d: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    priv, pub = d / f"{name}.key", d / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def test_signed_push_verifies_and_unsigned_or_other_key_is_refused(tmp_path):
    snap, m = _snapshot(tmp_path / "s")
    priv, pub = _keypair(tmp_path, "good")
    _, other = _keypair(tmp_path, "other")
    target = transport.Layout(tmp_path / "layout", create=True)
    config = (snap / "manifest.json").read_bytes()
    pushed = transfer.push(snap, config, oci.annotations(m, "d" * 64), target, "signed",
                           signing_key=sign.load_private(priv), docker_reference="oci:layout")
    assert pushed.signature_tag == sign.sig_tag(pushed.digest)
    art = transfer.fetch_manifest(target, "signed", "IMG")
    assert transfer.verify_signature(target, art, sign.load_public(pub), "IMG") == sign.fingerprint(sign.load_public(pub))
    with pytest.raises(sign.SignatureError, match="no signature beside it verifies"):
        transfer.verify_signature(target, art, sign.load_public(other), "IMG")
    ann = oci.annotations(m, "d" * 64)
    ann["x"] = "unsigned twin"
    transfer.push(snap, config, ann, target, "unsigned")
    with pytest.raises(sign.SignatureError, match="is not signed"):
        transfer.verify_signature(target, transfer.fetch_manifest(target, "unsigned", "IMG"), sign.load_public(pub), "IMG")


def test_a_signature_for_another_digest_does_not_verify(tmp_path):
    priv, pub = _keypair(tmp_path, "k")
    body, _, _ = sign.sign(sign.load_private(priv), "r", "sha256:" + "1" * 64)
    sig = sign.load_private(priv).sign(body, ec.ECDSA(__import__("cryptography.hazmat.primitives.hashes",
                                                                fromlist=["SHA256"]).SHA256()))
    assert sign.verify(sign.load_public(pub), body, sig, "sha256:" + "1" * 64)
    assert not sign.verify(sign.load_public(pub), body, sig, "sha256:" + "2" * 64)


def test_a_key_that_is_not_p256_is_refused(tmp_path):
    p = tmp_path / "rsa.pem"
    from cryptography.hazmat.primitives.asymmetric import rsa

    p.write_bytes(rsa.generate_private_key(65537, 2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(UsageError, match="P-256"):
        sign.load_private(p)


# --------------------------------------------------------------------------- credentials, bearer tokens

def test_credentials_come_from_a_credential_helper(tmp_path, monkeypatch):
    """``credHelpers`` in the auth file: ``docker-credential-NAME get`` answers (as docker's
    and podman's helpers do)."""
    helper = tmp_path / "bin" / "docker-credential-fleettest"
    helper.parent.mkdir()
    helper.write_text('#!/bin/sh\nread host\necho "{\\"ServerURL\\": \\"$host\\", \\"Username\\": \\"bob\\", '
                      '\\"Secret\\": \\"from-helper\\"}"\n')
    helper.chmod(0o755)
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"credHelpers": {"reg.example:5000": "fleettest"}}))
    monkeypatch.setenv("PATH", f"{helper.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(f))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert transport.credentials("reg.example:5000") == ("bob", "from-helper")


@pytest.fixture
def token_registry():
    """A registry that wants a bearer token (as Harbor, GHCR, ECR... do): ``/v2/.../manifests/v1``
    answers 401 with a Bearer challenge; the token service gives a token for basic
    ``alice:s3cret`` only. Records the token requests."""
    import http.server
    import threading

    seen: list[dict] = []
    body = b'{"schemaVersion": 2}'

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            port = self.server.server_address[1]
            if self.path.startswith("/token"):
                from urllib.parse import parse_qs, urlparse

                seen.append({"auth": self.headers.get("Authorization"), **{k: v[0] for k, v in
                                                                         parse_qs(urlparse(self.path).query).items()}})
                if self.headers.get("Authorization") != "Basic " + base64.b64encode(b"alice:s3cret").decode():
                    self.send_response(401)
                    self.end_headers()
                    return
                out = b'{"token": "T0K3N"}'
            elif self.headers.get("Authorization") == "Bearer T0K3N":
                out = body
            else:
                self.send_response(401)
                self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{port}/token",'
                                 'service="fake",scope="repository:snaps/tiny:pull"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"127.0.0.1:{srv.server_address[1]}", seen, body
    srv.shutdown()


def test_a_bearer_token_is_fetched_with_the_auth_files_credentials(tmp_path, monkeypatch, token_registry):
    host, seen, body = token_registry
    f = tmp_path / "auth.json"
    f.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(b"alice:s3cret").decode()}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(f))
    monkeypatch.setenv("HOME", str(tmp_path))
    raw, digest = transport.Registry(RegistryRef(host, "snaps/tiny", "v1"), plain_http=True).get_manifest("v1")
    assert raw == body and digest == oci.sha256(body)
    assert seen[-1]["scope"] == "repository:snaps/tiny:pull" and seen[-1]["service"] == "fake"


def test_without_credentials_the_token_refusal_says_how_to_log_in(tmp_path, monkeypatch, token_registry):
    host, _, _ = token_registry
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    with pytest.raises(EnvironmentProblem, match="token service .* answered 401") as e:
        transport.Registry(RegistryRef(host, "snaps/tiny", "v1"), plain_http=True).get_manifest("v1")
    assert "podman login" in e.value.hint


def test_a_snapshots_carried_files_travel_as_layers_of_their_own_type(tmp_path):
    """The copies of the files the engine mapped outside the model, the Python environment and
    the system (its compile cache, checkpoint/carry.py) are pushed and pulled with the snapshot:
    a fresh node restores them from there."""
    snap, _ = _snapshot(tmp_path / "s")
    (snap / "carried").mkdir(mode=0o700)
    for name in ("ab" * 32, "cd" * 32 + ".zst"):
        (snap / "carried" / name).write_bytes(b"kernel")
        os.chmod(snap / "carried" / name, 0o600)
    parts = {p.member: p.media_type for p in oci.plan(snap)}
    assert parts["carried/" + "ab" * 32] == oci.CARRIED_TYPE
    assert parts["carried/" + "cd" * 32 + ".zst"] == oci.CARRIED_ZSTD_TYPE
    assert oci.member_ok("carried/" + "ab" * 32) and not oci.member_ok("carried/../x")
