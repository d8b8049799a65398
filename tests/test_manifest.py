"""manifest: build, seal, atomic write + read round trip, strict parse with JSON paths, digest."""

from __future__ import annotations

import json
import os
import stat

import pytest
from helpers import make_canary, make_manifest, manifest_fields
from pydantic import ValidationError

from vllm_snapshot.store import layout, manifest
from vllm_snapshot.errors import CorruptSnapshotError


def _doc(m=None) -> dict:
    return json.loads(manifest.to_json(m or make_manifest()))


def _parse_err(doc_or_text) -> str:
    text = doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text)
    with pytest.raises(CorruptSnapshotError) as ei:
        manifest.parse(text)
    assert ei.value.exit_code == 5
    return ei.value.message


def test_seal_fills_a_digest_over_the_content():
    unsealed = manifest.Manifest(**manifest_fields())
    assert unsealed.digest == ""
    sealed = manifest.seal(unsealed)
    assert len(sealed.digest) == 64 and int(sealed.digest, 16) >= 0
    other = manifest.seal(manifest.Manifest(**manifest_fields(tool_version="0.1.1")))
    assert other.digest != sealed.digest
    # the digest itself is not part of what it covers: resealing is stable
    assert manifest.seal(sealed).digest == sealed.digest


def test_write_atomic_and_read_round_trip(tmp_path):
    m = make_manifest()
    path = manifest.write_atomic(m, tmp_path)
    assert path == tmp_path / layout.MANIFEST
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == [layout.MANIFEST]  # no temp file left
    back = manifest.read(tmp_path)
    assert back == m
    assert back.oracle.top_logprobs == m.oracle.top_logprobs
    assert back.images[1].name == "pages-1.img"


def test_write_atomic_replaces_an_existing_manifest_keeping_mode(tmp_path):
    (tmp_path / layout.MANIFEST).write_text("old")
    m = make_manifest()
    manifest.write_atomic(m, tmp_path)
    assert manifest.read(tmp_path) == m
    assert stat.S_IMODE(os.stat(tmp_path / layout.MANIFEST).st_mode) == 0o600


def test_read_missing_manifest_is_corrupt_in_a_snapshot_dir_else_a_usage_error(tmp_path):
    from vllm_snapshot.errors import UsageError

    with pytest.raises(UsageError, match="is not a snapshot"):
        manifest.read(tmp_path)
    (tmp_path / "images").mkdir()
    with pytest.raises(CorruptSnapshotError, match="incomplete snapshot"):
        manifest.read(tmp_path)


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_parse_refuses_empty_text(text):
    assert "empty" in _parse_err(text)


def test_parse_refuses_invalid_json():
    text = manifest.to_json(make_manifest())
    assert "not valid JSON" in _parse_err(text[: len(text) // 2])


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_parse_refuses_non_finite_constants(const):
    doc = _doc()
    doc["timings"]["dump"] = "__X__"
    text = json.dumps(doc).replace('"__X__"', const)
    assert const in text
    msg = _parse_err(text)
    assert "not valid JSON" in msg and const in msg


def test_parse_refuses_non_object():
    assert "$ must be an object" in _parse_err("[1, 2]")


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_parse_refuses_unknown_schema_version(version):
    doc = _doc()
    doc["schema_version"] = version
    msg = _parse_err(doc)
    assert "$.schema_version" in msg and repr(version) in msg


def test_parse_refuses_missing_schema_version():
    doc = _doc()
    del doc["schema_version"]
    assert "$.schema_version" in _parse_err(doc)


@pytest.mark.parametrize("where,path", [
    ((), "$.surprise"),
    (("engine",), "$.engine.surprise"),
    (("oracle",), "$.oracle.surprise"),
    (("criu",), "$.criu.surprise"),
])
def test_parse_refuses_unknown_field(where, path):
    doc = _doc()
    d = doc
    for k in where:
        d = d[k]
    d["surprise"] = 1
    msg = _parse_err(doc)
    assert path in msg


def test_parse_refuses_unknown_field_in_a_list_item():
    doc = _doc()
    doc["images"][1]["mode"] = "0600"
    assert "$.images[1].mode" in _parse_err(doc)


@pytest.mark.parametrize("where,key,path", [
    (("engine",), "kind", "$.engine.kind"),
    (("model",), "files", "$.model.files"),
    (("oracle",), "token_id", "$.oracle.token_id"),
    ((), "images", "$.images"),
    ((), "criu", "$.criu"),
])
def test_parse_refuses_missing_field(where, key, path):
    doc = _doc()
    d = doc
    for k in where:
        d = d[k]
    del d[key]
    msg = _parse_err(doc)
    assert path in msg and "required" in msg.lower()


@pytest.mark.parametrize("where,key,value,path", [
    (("engine",), "kind", "tpu", "$.engine.kind"),
    (("engine",), "kind", 5, "$.engine.kind"),
    (("engine",), "sleep_level", "two", "$.engine.sleep_level"),
    (("engine",), "sleep_level", 3, "$.engine.sleep_level"),
    (("engine",), "engine_args", "--max-model-len 512", "$.engine.engine_args"),
    (("oracle",), "logprob", "low", "$.oracle.logprob"),
    (("host",), "vllm", 32, "$.host.vllm"),
])
def test_parse_refuses_wrong_type(where, key, value, path):
    doc = _doc()
    d = doc
    for k in where:
        d = d[k]
    d[key] = value
    msg = _parse_err(doc)
    assert path in msg


def test_parse_refuses_bad_image_checksum_format():
    doc = _doc()
    doc["images"][0]["blake3"] = "XYZ"
    assert "$.images[0].blake3" in _parse_err(doc)


def test_hand_edit_without_reseal_is_refused_for_digest():
    doc = _doc()
    doc["oracle"]["text"] = doc["oracle"]["text"] + "x"
    msg = _parse_err(doc)
    assert "$.digest" in msg and "does not match" in msg


def test_hand_edit_of_an_image_checksum_is_refused_for_digest():
    doc = _doc()
    doc["images"][1]["blake3"] = "0" * 64
    assert "$.digest" in _parse_err(doc)


def test_hand_edit_of_a_valid_number_is_refused_for_digest():
    doc = _doc()
    doc["sizes"]["raw"] += 1
    assert "$.digest" in _parse_err(doc)


def test_removed_digest_is_refused():
    doc = _doc()
    del doc["digest"]
    assert "$.digest" in _parse_err(doc)


def test_reformatted_but_unchanged_manifest_is_accepted():
    m = make_manifest()
    text = json.dumps(json.loads(manifest.to_json(m)), separators=(",", ":"))  # other whitespace, same content
    assert manifest.parse(text) == m


def test_model_is_frozen_and_refuses_non_finite_timings():
    m = make_manifest()
    with pytest.raises(ValidationError):
        m.tool_version = "x"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        manifest.Manifest(**manifest_fields(timings={"dump": float("nan")}))


def test_parse_error_names_the_source():
    with pytest.raises(CorruptSnapshotError, match="/snap/manifest.json"):
        manifest.parse("{", source="/snap/manifest.json")


@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_schema_version_must_be_the_integer_1(tmp_path, value):
    import json as _json

    from helpers import write_snapshot_dir

    write_snapshot_dir(tmp_path / "s")
    raw = _json.loads((tmp_path / "s" / "manifest.json").read_text())
    raw["schema_version"] = value
    with pytest.raises(CorruptSnapshotError, match="schema_version"):
        manifest.parse(_json.dumps(raw))


def test_no_type_coercion_inside_the_manifest(tmp_path):
    import json as _json

    from helpers import write_snapshot_dir

    write_snapshot_dir(tmp_path / "s")
    raw = _json.loads((tmp_path / "s" / "manifest.json").read_text())
    raw["model"]["total_bytes"] = "100"  # a string where bytes (int) belong
    with pytest.raises(CorruptSnapshotError, match="total_bytes"):
        manifest.parse(_json.dumps(raw))


def test_network_defaults_to_host_for_older_snapshots():
    """Snapshots made before engines had their own network namespace have no
    ``engine.network``: they still parse (digest over the stored text) and read as ``host``."""
    doc = _doc()
    del doc["engine"]["network"]
    doc["digest"] = __import__("blake3").blake3(manifest._canonical(doc)).hexdigest()
    m = manifest.parse(json.dumps(doc))
    assert m.engine.network == "host"


def test_the_canary_record_round_trips_and_an_older_manifest_without_it_reads_as_none(tmp_path):
    m = make_manifest(canary=make_canary())
    manifest.write_atomic(m, tmp_path)
    assert manifest.read(tmp_path).canary == make_canary() and _doc(m)["canary"]["prompt"] == make_canary().prompt
    # a snapshot made before canary records: no key at all (the digest covers the stored text)
    doc = _doc(make_manifest())
    del doc["canary"]
    doc["digest"] = __import__("blake3").blake3(manifest._canonical(doc)).hexdigest()
    old = manifest.parse(json.dumps(doc))
    assert old.canary is None and old.oracle == make_manifest().oracle
    # the record is checked like the oracle's; an edit of it is refused by the digest
    bad = _doc(m)
    bad["canary"]["token_id"] = "17"
    assert "$.canary.token_id" in _parse_err(bad)
    edited = _doc(m)
    edited["canary"]["logprob"] = -0.4
    assert "digest" in _parse_err(edited)


def test_network_isolated_round_trips_and_unknown_values_are_refused(tmp_path):
    base = make_manifest()
    m = manifest.seal(base.model_copy(update={"engine": base.engine.model_copy(update={"network": "isolated"})}))
    manifest.write_atomic(m, tmp_path)
    assert manifest.read(tmp_path).engine.network == "isolated"
    doc = _doc(m)
    doc["engine"]["network"] = "bridge"
    assert "$.engine.network" in _parse_err(doc)


# ----------------------------------------------------------------------------- zstd frames

def _framed(raw=(8, 5), stored=(4, 3)) -> manifest.ImageFile:
    frames = tuple(manifest.Frame(raw_bytes=r, stored_bytes=s, blake3="ab" * 32) for r, s in zip(raw, stored))
    return manifest.ImageFile(name="pages-1.img", raw_bytes=sum(raw), stored_bytes=sum(stored),
                              blake3="cd" * 32, compression="zstd-frames", frames=frames)


def test_frames_round_trip_and_are_absent_from_unframed_images(tmp_path):
    m = make_manifest()
    m = manifest.seal(m.model_copy(update={"images": (*m.images, _framed())}))
    doc = json.loads(manifest.to_json(m))
    assert all("frames" not in i for i in doc["images"][:-1])  # older manifests read the same
    assert [f["raw_bytes"] for f in doc["images"][-1]["frames"]] == [8, 5]
    manifest.write_atomic(m, tmp_path)
    assert manifest.read(tmp_path) == m


@pytest.mark.parametrize("change", [
    {"raw_bytes": 14}, {"stored_bytes": 6}, {"frames": None}, {"compression": "zstd"},
])
def test_frames_that_do_not_add_up_are_refused(change):
    img = _framed().model_dump(mode="json")
    img.update(change)
    m = make_manifest()
    doc = json.loads(manifest.to_json(m))
    doc["images"].append(img)
    doc["digest"] = manifest.blake3.blake3(manifest._canonical(doc)).hexdigest()
    assert "$.images" in _parse_err(doc)


def test_frames_on_an_unframed_image_are_refused():
    doc = _doc()
    doc["images"][0]["frames"] = []
    doc["digest"] = manifest.blake3.blake3(manifest._canonical(doc)).hexdigest()
    assert "$.images[0]" in _parse_err(doc)
