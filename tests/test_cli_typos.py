"""A mistyped option is answered at once, with "did you mean" (issue "Operator experience"):
serve/create/restore pass unknown options through to vLLM, so a typo used to be reported only
after the ~16 s import of vLLM's parser (or, for create, as a failed engine start), and
``restore --prot 8603 NAME`` took ``--prot`` for the snapshot's name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import CACHE, ROOT
from vllm_snapshot.errors import UsageError
from vllm_snapshot.store import argnames
from vllm_snapshot.suggest import did_you_mean

OPTIONS = frozenset({"--dtype", "--max-model-len", "--port", "--host", "-tp", "--tensor-parallel-size",
                     "--enforce-eager", "--no-enforce-eager", "--lora-dtype", "-O"})


@pytest.mark.parametrize("args,bad", [
    (["--dtpye", "float32"], ["--dtpye"]),
    (["--dtype=float32", "--max_model_len", "512", "--enforce-eager"], []),  # vLLM takes _ for -
    (["--max-model", "512"], []),  # a unique abbreviation: argparse takes it
    (["-tp", "1", "-O3", "--no-enforce-eager"], []),  # a short option with its value attached
    (["--override", "-1", "-0.5"], ["--override"]),  # negative numbers are values
    (["--prot", "8603", "--x=1"], ["--prot", "--x"]),
])
def test_unknown_flags(args, bad):
    assert argnames.unknown_flags(args, OPTIONS) == bad


def test_an_unknown_flag_names_the_closest_option_of_the_command_or_of_vllm():
    with pytest.raises(UsageError) as e:
        argnames.check(["--dtpye", "float32"], ["--detach"], "serve", OPTIONS)
    assert "--dtpye is neither an option of `vllm-snapshot serve` nor a vLLM engine arg" in e.value.message
    assert e.value.hint == "did you mean --dtype?"
    with pytest.raises(UsageError) as e:
        argnames.check(["--detatch"], ["--detach"], "serve", OPTIONS)
    assert e.value.hint == "did you mean --detach?"
    argnames.check(["--dtpye"], [], "serve", None)  # not known yet: vLLM's parse judges


def test_an_abbreviation_of_our_own_option_is_refused_even_when_vllm_would_take_it():
    # a trial: `serve MODEL --weight file` became vLLM's --weight-transfer-config (a pydantic
    # error 13-50 s later); --weights is serve's own option
    options = OPTIONS | {"--weight-transfer-config"}
    with pytest.raises(UsageError) as e:
        argnames.check(["--weight", "file", "--dtype", "float32"], ["--weights", "--port"], "serve", options)
    assert e.value.message == ("--weight is not a whole option name: it abbreviates `vllm-snapshot serve`'s --weights, "
                               "and vLLM would read it as --weight-transfer-config")
    assert e.value.hint == "did you mean --weights? (write options out in full)"
    argnames.check(["--weight-transfer-config", "{}", "--max-model", "512"], ["--weights"], "serve", options)


def test_option_suggestions_are_strict_and_of_the_same_kind():
    assert did_you_mean("--prot", OPTIONS) == "did you mean --port?"
    assert did_you_mean("--zzz", OPTIONS) is None
    assert did_you_mean("-tpp", {"--tpp-size", "-tp"}) == "did you mean -tp?"


def test_the_option_names_are_remembered_atomically_per_vllm_version(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_CACHE", str(tmp_path))
    assert argnames.known_options() is None
    argnames.remember(["--b", "--a"])
    f = argnames.cache_file()
    assert f.parent == tmp_path and f.name.startswith("vllm-serve-options-")
    assert json.loads(f.read_text())["options"] == ["--a", "--b"] and argnames.known_options() == {"--a", "--b"}
    assert oct(f.stat().st_mode & 0o777) == "0o644" and [p.name for p in tmp_path.iterdir()] == [f.name]


def test_setup_remembered_vllms_own_option_names():
    """The cache setup wrote is what vLLM's parser has now (the import takes ~20 s)."""
    have = argnames.known_options()
    assert have is not None, f"run scripts/setup.sh: no {argnames.cache_file()}"
    # vLLM's parser in a process of its own: imported here, vLLM would stay in this test
    # process's sys.modules (tests/test_identity.py checks that nothing imports it by accident)
    p = subprocess.run([sys.executable, "-c", "import json; from vllm_snapshot.store import argnames; "
                        "print(json.dumps(sorted(argnames._from_parser())))"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, check=True)
    assert have == frozenset(json.loads(p.stdout.splitlines()[-1]))
    assert {"--dtype", "--max-model-len", "--kv-cache-memory-bytes", "--served-model-name"} <= have


def _vllm_modules(modules_out) -> list[str]:
    """The vLLM modules a :func:`_cli` run had loaded at exit (``modules_out``: its record)."""
    return [m for m in json.loads(modules_out.read_text()) if m == "vllm" or m.startswith("vllm.")]


def _cli(*argv, modules_out=None):
    """Run the CLI; with ``modules_out`` (a path), the names in its ``sys.modules`` at exit are
    written there (as tests/test_serve_integration.py's MODULES_AT_EXIT: a fact, not a timing)."""
    from test_serve_integration import MODULES_AT_EXIT

    env = None
    if modules_out is not None:
        import os

        env = {**os.environ, "MODULES_OUT": str(modules_out)}
        cmd = [sys.executable, "-c", MODULES_AT_EXIT, *argv]
    else:
        cmd = [sys.executable, "-m", "vllm_snapshot", *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    return p, None


@pytest.mark.parametrize("argv,hint", [
    (["serve", str(CACHE / "models" / "tiny-llama"), "--port", "8799", "--dtpye", "float32"], "did you mean --dtype?"),
    (["serve", "--prot", "8603", "/m"], "did you mean --port?"),
    (["restore", "--prot", "8603", "demo"], "did you mean --port?"),
    (["create", "/m", "--name", "x", "--", "--max-model-lne", "512"], "did you mean --max-model-len?"),
    (["serve", "/m", "--detatch"], "did you mean --detach?"),
])
def test_a_typo_is_a_usage_error_with_did_you_mean_in_well_under_a_second_of_work(tmp_path, argv, hint):
    if argnames.known_options() is None:
        pytest.fail(f"run scripts/setup.sh: no {argnames.cache_file()}")
    out = tmp_path / "modules.json"
    p, _ = _cli("--root", str(tmp_path), *argv, modules_out=out)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error [usage]: ") and f"hint: {hint}" in p.stderr, p.stderr
    assert "engine error" not in p.stderr
    # answered without vLLM (its import alone takes ~16 s here) and without an engine
    assert _vllm_modules(out) == []


@pytest.mark.parametrize("sub", [[], ["model.safetensors"]])
def test_an_empty_model_dir_is_refused_before_the_key(tmp_path, sub):
    model = tmp_path / "m"
    model.mkdir()
    for f in sub:
        (model / f).write_bytes(b"x")
    out = tmp_path / "modules.json"
    p, _ = _cli("--root", str(tmp_path / "root"), "serve", str(model), "--port", "8799",
                "--", "--dtype", "float32", modules_out=out)
    assert p.returncode == 2 and ("is empty" in p.stderr or "has no config.json" in p.stderr), p.stderr
    # refused before the key: no vLLM parser (~16 s), no cold start
    assert _vllm_modules(out) == []
