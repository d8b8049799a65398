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
    # vLLM's parser takes `vllm serve --dtype float32 MODEL`; our command line wants MODEL first
    (["serve", "--dtype", "float32", "/m"], "vllm-snapshot serve MODEL --dtype ... (engine args after MODEL)"),
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


#: how many values each option of :data:`OPTIONS` takes (as vLLM's parser: parser_arities)
ARITY = {"--dtype": 1, "--max-model-len": 1, "--port": 1, "--host": 1, "-tp": 1, "--tensor-parallel-size": 1,
         "--enforce-eager": 0, "--no-enforce-eager": 0, "--lora-dtype": 1, "-O": "?", "--api-key": "+",
         "--hf-token": "?", "--compilation-config": 1}


@pytest.mark.parametrize("args,stray", [
    (["--dtype", "float32", "extra"], [("extra", None)]),
    (["--enforce-eager", "true", "--dtype", "float32"], [("true", "--enforce-eager")]),
    (["a", "--dtype=float32", "b"], [("a", None), ("b", None)]),
    (["--dtype=float32", "--max_model_len", "512", "--max-model", "64", "-tp", "1", "-O3"], []),
    (["--api-key", "k1", "k2", "--hf-token", "--compilation-config.mode", "3", "--port", "-1"], []),
    (["--enforce-eager", "-1"], []),  # a negative number is no word here: vLLM's parser says what it is
])
def test_a_word_no_option_takes_is_found_with_the_switch_before_it(args, stray):
    from vllm_snapshot.engine.args import stray_words

    assert stray_words(args, argnames.arity_lookup(ARITY)) == stray


def test_a_stray_word_is_refused_naming_it_and_where_the_model_goes():
    with pytest.raises(UsageError) as e:
        argnames.check_stray_words(["--dtype", "float32", "extra"], "serve", ARITY)
    assert e.value.message == ("unexpected argument 'extra' among the engine args: `vllm-snapshot serve` takes one "
                               "MODEL, and every other word must be an option's value")
    assert e.value.hint.startswith("the model goes first (`vllm-snapshot serve MODEL [engine args]`)")
    assert e.value.exit_code == 2 and e.value.details == {"unexpected": ["extra"]}
    with pytest.raises(UsageError) as e:
        argnames.check_stray_words(["--enforce-eager", "yes", "stray"], "create", ARITY)
    assert e.value.message.startswith("unexpected arguments 'yes', 'stray' among the engine args "
                                      "(--enforce-eager is a switch: it takes no value)")
    argnames.check_stray_words(["--dtype", "float32", "extra"], "serve", None)  # not known yet: vLLM's parse judges


def test_dotted_config_fields_are_known_options():
    # `--compilation-config.mode 3` is vLLM's own syntax: it used to be refused as unknown
    assert argnames.unknown_flags(["--compilation-config.mode", "3", "--x.y", "1"], OPTIONS | {"--compilation-config"}) \
        == ["--x.y"]


def test_the_arities_are_remembered_and_an_older_file_without_them_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_CACHE", str(tmp_path))
    argnames.remember(["--b", "--a"])  # as setup wrote it before arities were kept
    assert argnames.known_arities() is None and argnames.known_options() == {"--a", "--b"}
    argnames.remember(["--b", "--a"], {"--b": 0, "--a": 1})
    assert argnames.known_arities() == {"--a": 1, "--b": 0}
    argnames.remember(["--c"], {"--c": 1})  # a complete file is kept
    assert argnames.known_options() == {"--a", "--b"}


def _stray_cache(tmp_path) -> dict:
    """An environment whose option cache (VLLM_SNAPSHOT_CACHE) knows :data:`ARITY`."""
    import os

    env = {**os.environ, "VLLM_SNAPSHOT_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", "import json, sys; from vllm_snapshot.store import argnames; "
                    "a = json.loads(sys.argv[1]); argnames.remember(list(a), a)", json.dumps(ARITY)],
                   check=True, cwd=ROOT, env=env, timeout=60)
    return env


@pytest.mark.parametrize("argv", [
    ["serve", str(CACHE / "models" / "tiny-llama"), "--port", "8799", "--dtype", "float32", "extra"],
    ["create", str(CACHE / "models" / "tiny-llama"), "--name", "x", "--", "--dtype", "float32", "stray"],
    ["switch", "--model", str(CACHE / "models" / "tiny-llama"), "--port", "8799", "--", "--enforce-eager", "on"],
])
def test_a_stray_word_among_the_engine_args_is_a_usage_error_before_anything_runs(tmp_path, argv):
    env = _stray_cache(tmp_path)
    root = tmp_path / "root"
    p = subprocess.run([sys.executable, "-c", __import__("test_serve_integration").MODULES_AT_EXIT, "--root", str(root),
                        *argv], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**env, "MODULES_OUT": str(tmp_path / "modules.json")})
    assert p.returncode == 2, p.stderr
    word = argv[-1]
    assert p.stderr.startswith(f"error [usage]: unexpected argument {word!r} among the engine args"), p.stderr
    assert "hint: the model goes first" in p.stderr
    # nothing built, nothing left: no vLLM parser, no snapshot, not even the root's contents
    assert _vllm_modules(tmp_path / "modules.json") == []
    assert not root.exists() or not any(root.iterdir())


_PARSER_CHECK = r"""
import json
from vllm_snapshot.engine.args import normalize_args
from vllm_snapshot.errors import UsageError
from vllm_snapshot.store import argnames

options, arity = argnames._from_parser(arity=True)
try:
    normalize_args(["--dtype", "float32", "extra"])
    said = None
except UsageError as e:
    said = e.message
print(json.dumps({"arity": arity, "said": said, "plain": normalize_args(["--dtype", "float32"])}))
"""


@pytest.mark.integration
def test_vllms_parser_gives_the_arities_and_its_parse_refuses_a_stray_word():
    """The arities read from vLLM's own parser are the ones the early check needs, and the
    parse itself (serve's key, create's engine) refuses the word vLLM would take as the model
    (before, it was dropped from the key and loaded as the model by create's engine).
    Integration: imports vLLM (~16 s), in a child process."""
    p = subprocess.run([sys.executable, "-c", _PARSER_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    a = got["arity"]
    assert (a["--dtype"], a["--enforce-eager"], a["--no-enforce-eager"], a["--api-key"], a["--hf-token"]) \
        == (1, 0, 0, "+", "?")
    assert got["said"].startswith("unexpected argument 'extra' among the engine args"), got
    assert got["plain"] == {"dtype": '"float32"'}


def test_an_option_without_its_value_is_said_with_the_stray_words_in_one_error():
    from vllm_snapshot.engine.args import valueless

    lookup = argnames.arity_lookup(ARITY)
    assert valueless(["--dtype", "--enforce-eager", "--max-model-len=512", "--api-key", "--port"], lookup) \
        == ["--dtype", "--api-key", "--port"]
    assert valueless(["--dtype", "float32", "--hf-token", "--port", "-1"], lookup) == []
    with pytest.raises(UsageError) as e:
        argnames.check_stray_words(["extra", "--max-model-len"], "serve", ARITY)
    assert e.value.message.startswith("unexpected argument 'extra' among the engine args"), e.value.message
    assert "and 1 more problem" in e.value.message and "  - [usage] --max-model-len needs a value" in e.value.message


@pytest.mark.parametrize("args", [["-O3"], ["-O", "3"], ["-O=3"], ["-Odecode"], ["--max_model_len", "512"],
                                  ["--compilation-config.mode", "3"], ["-tp", "1"], ["--dtype=float32"]])
def test_what_the_installed_vllms_parser_takes_passes_both_checks(args):
    """Against the installed vLLM's own option table (not :data:`OPTIONS`): `-O3` was refused as
    unknown, because vLLM's parser rewrites `-O...` to --optimization-level before argparse and
    `-O` is none of its option strings."""
    options, arity = argnames.known_options(load=True), argnames.known_arities(load=True)
    argnames.check(args, [], "serve", options)
    argnames.check_stray_words(args, "serve", arity)
    with pytest.raises(UsageError, match="unexpected argument 'stray'"):
        argnames.check_stray_words([*args, "stray"], "serve", arity)
    if args == ["-O3"]:
        with pytest.raises(UsageError, match=r"\(-O3 carries its value: it takes no other\)"):
            argnames.check_stray_words([*args, "stray"], "serve", arity)


def test_an_abbreviated_engine_arg_is_refused_naming_the_whole_name():
    # a trial: `--kv-cache-memory-byte 64M` passed the name check, then the CPU KV-cache check
    # (whole names) said the size was missing; `--dtyp` was keyed as dtype but shown as typed
    options = OPTIONS | {"--kv-cache-memory-bytes"}
    args = ["--dtyp", "float32", "--max_model_len", "512", "--kv-cache-memory-byte", "64M", "-tp", "1", "-O3"]
    assert argnames.abbreviated(args, options) == [("--dtyp", "--dtype"), ("--kv-cache-memory-byte",
                                                                            "--kv-cache-memory-bytes")]
    errs = argnames.abbreviation_errors(args, options)
    assert [e.message for e in errs] == [
        "--dtyp is an abbreviation of vLLM's --dtype: write it out in full: --dtype",
        "--kv-cache-memory-byte is an abbreviation of vLLM's --kv-cache-memory-bytes: write it out in full: "
        "--kv-cache-memory-bytes"]
    assert errs[0].exit_code == 2 and errs[0].hint == "did you mean --dtype? (engine args are written out in full)"
    assert argnames.abbreviation_errors(args, None) == []  # not known yet: vLLM's parse judges


def test_no_real_option_of_the_installed_vllm_counts_as_an_abbreviation():
    options = argnames.known_options()
    assert options is not None, f"run scripts/setup.sh: no {argnames.cache_file()}"
    real = sorted(options) + ["-O3", "-O", "--max_model_len", "--compilation-config.mode", "--no-enforce-eager"]
    assert argnames.abbreviated(real, options) == []
    assert argnames.abbreviated(["--kv-cache-memory-byte", "--max-model"], options) == [
        ("--kv-cache-memory-byte", "--kv-cache-memory-bytes"), ("--max-model", "--max-model-len")]


def test_create_refuses_an_abbreviated_engine_arg_before_the_kv_cache_check(tmp_path):
    from conftest import cli

    root = tmp_path / "root"
    p = cli("--root", str(root), "create", str(CACHE / "models" / "tiny-llama"), "--name", "x", "--",
            "--dtyp", "float32", "--max-model-len", "512", "--kv-cache-memory-byte", "64M", timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error [usage]: --dtyp is an abbreviation of vLLM's --dtype: write it out in full: "
                               "--dtype\nand 1 more problem"), p.stderr
    assert "write it out in full: --kv-cache-memory-bytes" in p.stderr and "size it explicitly" not in p.stderr
    assert not root.exists() or not any(root.iterdir())


def test_a_typo_an_abbreviation_and_a_stray_word_are_said_in_one_run(tmp_path):
    from conftest import cli

    root, model = tmp_path / "root", str(CACHE / "models" / "tiny-llama")
    p = cli("--root", str(root), "create", model, "--name", "x", "--", "--dtpye", "float32",
            "--kv-cache-memory-byte", "64M", timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error [usage]: --dtpye is neither an option"), p.stderr
    assert "and 1 more problem" in p.stderr and "write it out in full: --kv-cache-memory-bytes" in p.stderr
    p = cli("--root", str(root), "create", model, "--name", "x", "--", "--dtype", "float32",
            "--kv-cache-memory-byte", "64M", "stray", timeout=120)
    assert p.returncode == 2 and "write it out in full: --kv-cache-memory-bytes" in p.stderr, p.stderr
    assert "unexpected argument 'stray'" in p.stderr
