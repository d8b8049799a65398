"""What a new-user trial found with a bad model folder (`config.json` is `{}`): 24 s of cold
start, then ~25 lines of pydantic/vLLM traceback as the error. Now a config.json vLLM cannot
use is refused before the engine starts (exit 2), and an engine that fails to start says its
error in a few lines, where its full log is kept, and what to check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_snapshot import ops
from vllm_snapshot.errors import EngineError, UsageError
from vllm_snapshot.ops.create import START_ERROR_LINES, start_failure
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.store import model_digest

from fakes import FakeEngine, FakeWorld

VALID = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}


@pytest.mark.parametrize("text,needle", [
    ("{}", "names neither model_type nor architectures"),
    ('{"model_type": ""}', "names neither model_type nor architectures"),
    ('{"architectures": ["X"],', "is not JSON"),
    ("[1, 2]", "is a JSON list, not an object"),
    (b"\xff\xfe{}", "is not JSON"),
])
def test_a_config_json_vllm_cannot_use_is_refused_up_front(tmp_path, text, needle):
    (tmp_path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UsageError, match=needle) as ei:
        model_digest.check_config(tmp_path, [])
    assert ei.value.exit_code == 2 and "check the model folder" in ei.value.hint and "config.json" in ei.value.hint


@pytest.mark.parametrize("cfg", [VALID, {"model_type": "llama"}, {"architectures": ["LlamaForCausalLM"]}])
def test_a_valid_config_passes(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model_digest.check_config(tmp_path, [])


def test_the_tiny_model_the_tests_serve_passes(tmp_path):
    from vllm_snapshot.dev import tiny_model

    model_digest.check_config(tiny_model.generate(tmp_path / "tiny", hidden=16, layers=1), [])


@pytest.mark.parametrize("args", [["--config-format", "mistral"], ["--config-format=mistral"],
                                  ["--hf-config-path", "/elsewhere"]])
def test_no_check_where_vllm_reads_another_config_or_none(tmp_path, args):
    (tmp_path / "params.json").write_text("{}")
    model_digest.check_config(tmp_path, [])  # no config.json: a Mistral-format model (or a GGUF file)
    (tmp_path / "params.json").unlink()
    (tmp_path / "config.json").write_text("{}")
    model_digest.check_config(tmp_path, args)
    with pytest.raises(UsageError):
        model_digest.check_config(tmp_path, ["--config-format", "hf"])


def test_create_refuses_a_bad_config_before_the_engine_starts(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    t = FakeWorld()
    t.tools.model.check_model_config = lambda d, a: model_digest.check_config(d, a)
    with pytest.raises(UsageError, match="neither model_type"):
        ops.create(ops.CreateRequest(model=str(tmp_path), target=Path("/snaps/new"),
                                     engine_args=["--kv-cache-memory-bytes", "1M"]), Reporter(), tools=t.tools)
    assert "launch_engine" not in t.calls and "prepare_target" not in t.calls


TRACEBACK_MESSAGE = (
    "ValidationError: 1 validation error for ModelConfig\n"
    "  Value error, No model architectures are specified [type=value_error, input_value=ArgsKwargs((), "
    "{'model': '/m'}), input_type=ArgsKwargs]\n"
    "    For further information visit https://errors.pydantic.dev/2.11/v/value_error")


def test_an_engine_error_at_create_is_short_names_the_kept_log_and_the_model_folder():
    w = FakeWorld()

    class Failing(FakeEngine):
        def wait_event(self, name, timeout):
            if name == "initialized":
                ev = {"event": "error", "kind": "engine", "message": TRACEBACK_MESSAGE}
                raise EngineError(f"engine error (engine): {TRACEBACK_MESSAGE}\n" + "\n".join(
                    f'  File "/venv/vllm/x{i}.py", line {i}, in f' for i in range(20)), details=ev)
            return super().wait_event(name, timeout)

    def launch(spec, env, log_path, echo):
        w.calls.append("launch_engine")
        w.engine = Failing(w.calls)
        return w.engine

    w.tools.engine.launch_engine = launch
    with pytest.raises(EngineError) as ei:
        ops.create(ops.CreateRequest(model="/models/bad", target=Path("/snaps/new"),
                                     engine_args=["--kv-cache-memory-bytes", "1M"]), Reporter(), tools=w.tools)
    e = ei.value
    assert e.exit_code == 8
    assert e.message.splitlines() == [
        "the engine failed while starting (loading the model): ValidationError: 1 validation error for ModelConfig",
        "  Value error, No model architectures are specified [type=value_error, input_value=ArgsKwargs((), "
        "{'model': '/m'}), input_type=ArgsKwargs]"], e.message
    assert "File " not in e.message
    assert "/var/log/vllm-snapshot/engine-create-" in e.hint and "check the model folder /models/bad" in e.hint
    assert e.details["log"].startswith("/var/log/vllm-snapshot/engine-create-")
    assert w.calls.index("keep_log") < w.calls.index("discard") and w.engine.killed


def test_an_engine_that_died_without_an_error_event_shows_the_last_exception_line_of_its_log():
    tail = "\n".join([f'  File "/x{i}.py", line 1' for i in range(15)]
                     + ["RuntimeError: first", "  during handling", "torch.OutOfMemoryError: CPU ran out", "  File z"])
    e = start_failure(EngineError(f"engine exited while waiting for 'initialized'\n{tail}"), None, Path("/m"))
    assert e.message == ("the engine failed while starting (loading the model): engine exited while waiting for "
                         "'initialized'\n  torch.OutOfMemoryError: CPU ran out"), e.message
    assert "could not be kept" in e.hint and e.details == {"log": None}


def test_a_long_engine_error_is_cut_to_a_few_lines():
    msg = "\n".join(f"line {i} " + "x" * 400 for i in range(10))
    e = start_failure(EngineError("engine error", details={"message": msg}), Path("/l.log"), Path("/m"))
    lines = e.message.splitlines()
    assert len(lines) == START_ERROR_LINES + 1 and lines[-1].strip() == "(6 more line(s) in the log)"
    assert all(len(ln) < 400 for ln in lines[1:])


def test_an_engine_error_pointing_above_gets_the_logs_last_error():
    tail = "\n".join(['  File "/x.py", line 1', "safetensors_rust.SafetensorError: Error while deserializing header",
                      '  File "/y.py", line 2'])
    ev = {"event": "error", "kind": "engine", "message": "RuntimeError: Engine core initialization failed. "
                                                          "See root cause above."}
    e = start_failure(EngineError(f"engine error (engine): {ev['message']}\n{tail}", details=ev), Path("/l"), Path("/m"))
    assert e.message.splitlines()[1:] == [
        "  its log's last error: safetensors_rust.SafetensorError: Error while deserializing header"], e.message


def test_the_logs_copy_of_the_engines_own_error_is_not_repeated():
    ev = {"event": "error", "kind": "engine", "message": TRACEBACK_MESSAGE}
    tail = '  File "/x.py", line 1\npydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n  x'
    e = start_failure(EngineError(f"engine error (engine): {TRACEBACK_MESSAGE}\n{tail}", details=ev), None, Path("/m"))
    assert "its log's last error" not in e.message and len(e.message.splitlines()) == 2, e.message


@pytest.mark.parametrize("files,needle", [([], "is empty"), (["model.safetensors"], "has no config.json (it holds model.safetensors)")])
def test_an_empty_model_dir_or_one_without_config_is_refused_up_front(tmp_path, files, needle):
    # a trial: an empty directory, or one without config.json, failed after a 28 s cold start
    for f in files:
        (tmp_path / f).write_bytes(b"x")
    with pytest.raises(UsageError, match=re.escape(needle)) as ei:
        model_digest.check_config(tmp_path, [])
    assert ei.value.exit_code == 2 and "config.json" in ei.value.hint


def test_a_gguf_or_mistral_model_without_config_passes(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"x")
    model_digest.check_config(tmp_path, [])
