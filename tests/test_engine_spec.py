"""The engine spec: what create launches an engine root with, as the one JSON argument the
engine root, its mount policy and the registry read back (vllm_snapshot/engine/spec.py)."""

from __future__ import annotations

import json

import pytest

from vllm_snapshot.engine import mounts
from vllm_snapshot.engine.spec import ROOT_MARK, EngineSpec, RunAs

FULL = EngineSpec(model="/models/tiny", engine_args=("--max-model-len", "512"), oracle_prompt="Once upon a time",
                  sleep_level=1, user=RunAs(name="svc", uid=990, gid=990, groups=(990, 44), home="/var/lib/svc"),
                  weights_file=True, weights_root="/var/lib/vllm-snapshot", served_model_name="acme/tiny")


@pytest.mark.parametrize("spec", [FULL, EngineSpec(model="/m", engine_args=(), oracle_prompt="")])
def test_the_json_reads_back_as_the_same_spec(spec):
    assert EngineSpec.from_json(spec.to_json()) == spec


def test_the_json_is_the_engine_roots_argument_of_before_the_type():
    # the argument create passed when the spec was a dict: a restored tree's argv is the one
    # recorded at create, and the registry finds engine roots by it
    assert json.loads(FULL.to_json()) == {
        "model": "/models/tiny", "engine_args": ["--max-model-len", "512"], "oracle_prompt": "Once upon a time",
        "sleep_level": 1, "user": {"name": "svc", "uid": 990, "gid": 990, "groups": [990, 44], "home": "/var/lib/svc"},
        "weights_file": True, "weights_root": "/var/lib/vllm-snapshot", "served_model_name": "acme/tiny"}
    plain = EngineSpec(model="/m", engine_args=(), oracle_prompt="x")
    assert "served_model_name" not in json.loads(plain.to_json())  # vLLM's default name then
    assert ROOT_MARK in FULL.to_json() and ROOT_MARK in plain.to_json()


def test_the_mount_policy_reads_the_model_and_the_weights_store_from_the_argument(monkeypatch):
    monkeypatch.setattr("sys.argv", ["engine_root", FULL.to_json()])
    assert mounts._spec_model() == "/models/tiny" and mounts._spec_store() == ["/var/lib/vllm-snapshot"]
    monkeypatch.setattr("sys.argv", ["engine_root", EngineSpec(model="/m", engine_args=(), oracle_prompt="x").to_json()])
    assert mounts._spec_store() == []


@pytest.mark.parametrize("text", ["[]", '{"model": "/m"}', '{"oracle_prompt": "x"}', "not json",
                                  '{"model": "/m", "oracle_prompt": "x", "user": {"name": "svc"}}',
                                  '{"model": "/m", "oracle_prompt": "x", "sleep_level": "two"}'])
def test_what_is_not_a_spec_is_refused_with_a_value_error(text):
    with pytest.raises(ValueError):
        EngineSpec.from_json(text)
