"""The weights file in the fleet end to end (issue 39 item 3): real vLLM + CRIU + a real
registry (Debian's docker-registry on loopback).

Node A (its own root) creates two CPU snapshots of the tiny model that share one weights file
(the second with ``--max-num-seqs 8``), pushes them, then deletes them -- which removes the
weights file and node A's ``.weights`` directory with its root: nothing of node A's store is
left for a later pull or restore to find by chance. Node B (own mount + UTS namespaces, another
machine id and hostname, its own empty root) pulls the first: the weights file is downloaded to
its recorded path (in node A's root, created 0700) and the restore serves with its oracle
matching; then the second: no weights layer is fetched, only its own layers."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import requests

from conftest import EAGER_ARGS, TINY, cli
from vllm_snapshot.dev.registry_server import RegistryServer
from test_fleet import _keypair
from test_fleet_integration import _listed, _private, _stop, completion, on_node
from test_integration import free_port

from vllm_snapshot.store import manifest as mf
from vllm_snapshot.store import weights as sw

pytestmark = pytest.mark.integration

REPO = "fleet/weights"
WEIGHTS_TYPE = "application/vnd.vllm-snapshot.weights-file.v1"


def _docs(out: str) -> list[dict]:
    return [json.loads(x) for x in re.findall(r"^\{.*?^\}$", out, re.M | re.S)]


def _oci_manifest(reg: RegistryServer, tag: str) -> dict:
    return requests.get(f"http://{reg.host}/v2/{REPO}/manifests/{tag}",
                        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    r = RegistryServer(tmp_path_factory.mktemp("registry-weights"))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def node_a(registry, tmp_path_factory):
    """Two snapshots of one weights file made in node A's root, pushed (the first signed, and
    also to an image layout), then deleted with node A's root: the weights file is gone."""
    base = tmp_path_factory.mktemp("weights-fleet")
    os.chmod(base, 0o700)
    root_a = _private(base / "node-a-root")
    key, pub = _keypair(base, "k")
    made = {}
    for name, extra in (("tiny", []), ("tiny8", ["--max-num-seqs", "8"])):
        cli("create", str(TINY), "--snapshot-dir", str(root_a / name), "--", *EAGER_ARGS, *extra, check=True)
        made[name] = mf.read(root_a / name)
    rec = made["tiny"].weights
    assert rec is not None and made["tiny8"].weights is not None
    assert (made["tiny8"].weights.path, made["tiny8"].weights.blake3) == (rec.path, rec.blake3)  # one file
    assert Path(rec.path).parent == root_a / sw.DIR
    pushes = {}
    for name, tag in (("tiny", "v1"), ("tiny8", "v8")):
        args = ["push", str(root_a / name), f"{registry.host}/{REPO}:{tag}", "--plain-http", "--json"]
        if name == "tiny":
            args += ["--sign-key", str(key)]
        pushes[name] = json.loads(cli(*args, check=True).stdout)
    layout = base / "layout"
    cli("push", str(root_a / "tiny8"), f"oci:{layout}:v8", check=True)
    for name in made:
        cli("delete", str(root_a / name), check=True)
    assert not Path(rec.path).exists()  # the last delete removed the weights file
    shutil.rmtree(root_a)  # and node A's root: the pull must make the directory itself
    return {"base": base, "root_a": root_a, "rec": rec, "pushes": pushes, "pub": pub, "layout": layout,
            "images": {"tiny": f"{registry.host}/{REPO}:v1", "tiny8": f"{registry.host}/{REPO}:v8"}}


def test_a_second_snapshot_of_the_same_weights_pushes_only_its_images(node_a, registry):
    rec = node_a["rec"]
    first, second = node_a["pushes"]["tiny"], node_a["pushes"]["tiny8"]
    doc = _oci_manifest(registry, "v8")
    w = [d for d in doc["layers"] if d["mediaType"] == WEIGHTS_TYPE]
    assert w and sum(d["size"] for d in w) == rec.size
    assert w[0]["annotations"]["org.vllm-snapshot.weights.blake3"] == rec.blake3
    assert w[0]["annotations"]["org.vllm-snapshot.weights.path"] == rec.path
    assert first["sent_bytes"] >= rec.size  # the first push carried the file ...
    assert second["skipped"] >= len(w) and second["sent_bytes"] <= second["bytes"] - rec.size  # ... the second did not


def test_a_damaged_weights_blob_in_a_layout_fails_5_placing_and_listing_nothing(node_a, tmp_path):
    rec = node_a["rec"]
    aside = None
    if os.path.exists(rec.path):  # placed by another test of this module: out of the way meanwhile
        aside = tmp_path / "aside.weights"
        shutil.move(rec.path, aside)
    layout = node_a["layout"]
    try:
        idx = json.loads((layout / "index.json").read_text())
        digest = next(d["digest"] for d in idx["manifests"]
                      if d["annotations"]["org.opencontainers.image.ref.name"] == "v8")
        doc = json.loads((layout / "blobs" / "sha256" / digest.split(":")[1]).read_text())
        layer = next(d for d in doc["layers"] if d["mediaType"] == WEIGHTS_TYPE)
        copy = layout  # only this test reads it
        blob = copy / "blobs" / "sha256" / layer["digest"].split(":")[1]
        os.chmod(blob, 0o600)
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        root = _private(tmp_path / "store-c")
        p = cli("--root", str(root), "pull", f"oci:{copy}:v8", "--json")
        assert p.returncode == 5, p.stdout + p.stderr
        out = p.stdout + p.stderr  # --json: the error is on stdout
        assert layer["digest"] in out and f"{rec.blake3}.weights" in out
        assert not os.path.exists(rec.path)
        assert [n for n in os.listdir(Path(rec.path).parent)] == []  # no half file, no staging dir
        assert _listed(root) == [] and os.listdir(root) == []
    finally:
        if aside is not None:
            shutil.move(aside, rec.path)


def test_pulled_on_a_node_without_the_weights_it_restores_and_the_second_fetches_only_its_images(
        node_a, registry, tmp_path):
    rec = node_a["rec"]
    if os.path.exists(rec.path):
        os.unlink(rec.path)  # (a rerun in one session) the node starts without it
    root_b = _private(tmp_path / "node-b-root")
    assert root_b != node_a["root_a"]
    port = free_port()
    mark = len(registry.requests_log())
    p = on_node([["--root", str(root_b), "pull", node_a["images"]["tiny"], "--plain-http", "--name", "tiny",
                  "--verify-key", str(node_a["pub"]), "--json"],
                 ["--root", str(root_b), "restore", "tiny", "--port", str(port), "--detach", "--json"]])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    pulled, restored = _docs(p.stdout)
    try:
        assert restored["oracle"] == "match" and not restored["warnings"], restored
        assert len(completion(port)["logprobs"]) == 4
    finally:
        _stop(restored["pid"])
    assert pulled["weights"] == rec.path and pulled["weights_reused"] is None
    assert pulled["weights_fetched_bytes"] == rec.size == pulled["weights_bytes"]
    assert pulled["verified_by"]
    w1 = [d["digest"] for d in _oci_manifest(registry, "v1")["layers"] if d["mediaType"] == WEIGHTS_TYPE]
    time.sleep(0.5)  # the registry logs a moment after the response
    assert all(any(d in line for line in registry.blob_gets(mark)) for d in w1)  # downloaded
    f = Path(rec.path)
    assert sw.hash_file(f) == rec.blake3 and f.stat().st_mode & 0o777 == 0o600 and f.stat().st_uid == 0
    assert f.parent.stat().st_mode & 0o777 == 0o700 and sorted(os.listdir(f.parent)) == [f.name, sw.pin_path(f).name]
    assert f.parent.parent == node_a["root_a"]  # node A's root path, made by the pull
    assert _listed(root_b) == ["tiny"]

    # the second snapshot of the same model: only its own layers are fetched
    doc8 = _oci_manifest(registry, "v8")
    w8 = [d for d in doc8["layers"] if d["mediaType"] == WEIGHTS_TYPE]
    images8 = sum(d["size"] for d in doc8["layers"] if d["annotations"].get("org.vllm-snapshot.member", "")
                  .startswith("images/"))
    others8 = sum(d["size"] for d in doc8["layers"] if d["mediaType"] != WEIGHTS_TYPE)
    ino = f.stat().st_ino
    port = free_port()
    mark = len(registry.requests_log())
    p = on_node([["--root", str(root_b), "pull", node_a["images"]["tiny8"], "--plain-http", "--name", "tiny8",
                  "--json"],
                 ["--root", str(root_b), "restore", "tiny8", "--port", str(port), "--detach", "--json"]])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    pulled8, restored8 = _docs(p.stdout)
    try:
        assert restored8["oracle"] == "match", restored8
    finally:
        _stop(restored8["pid"])
    time.sleep(0.5)
    gets = registry.blob_gets(mark)
    by_kind: dict[str, int] = {}
    for d in doc8["layers"]:
        kind = d["annotations"].get("org.vllm-snapshot.member", "weights/").split("/")[0]
        by_kind[kind] = by_kind.get(kind, 0) + d["size"]
    print(f"second snapshot: fetched {pulled8['fetched_bytes']} bytes; its images {images8} bytes, all its "
          f"non-weights layers {others8} bytes ({by_kind}); weights file {rec.size} bytes not fetched")
    assert pulled8["weights_reused"] == "present" and pulled8["weights_fetched_bytes"] == 0
    assert not any(d["digest"] in line for d in w8 for line in gets)  # the weights layer was not fetched
    assert pulled8["fetched_bytes"] == others8 and pulled8["fetched_bytes"] + rec.size == pulled8["bytes"]
    # beyond the images' stored bytes only the snapshot's other members (logs, code table, carried files)
    assert images8 <= pulled8["fetched_bytes"] <= others8
    assert f.stat().st_ino == ino  # the file was left as it was (written once)
    # inspect IMAGE shows the weights layer (manifest only)
    mark = len(registry.requests_log())
    ins = json.loads(cli("inspect", node_a["images"]["tiny8"], "--plain-http", "--json", check=True).stdout)
    assert ins["weights"]["path"] == rec.path and ins["weights"]["blake3"] == rec.blake3
    assert ins["weights"]["media_type"] == WEIGHTS_TYPE and ins["weights"]["bytes"] == rec.size
    text = cli("inspect", node_a["images"]["tiny8"], "--plain-http", check=True).stdout
    assert f"placed at {rec.path}" in text
    time.sleep(0.3)
    assert registry.blob_gets(mark) == []
