"""A bad engine-arg value is a usage error (exit 2), not "engine failed, a retry may work"
(exit 8): a trial's `create ... -- --max-model-len 99999999` and `--chat-template
/nonexistent.jinja` exited 8, a cold-start loop under a restarting unit; `-- --tensor-parallel-size 2`
was refused only after the engine had started and failed."""

from __future__ import annotations

import pydantic
import pytest

from vllm_snapshot.engine.args import check_engine_args, config_refusal
from vllm_snapshot.errors import UsageError


@pydantic.dataclasses.dataclass
class _ModelConfig:  # as vLLM's config classes are: pydantic dataclasses whose validators raise ValueError
    max_model_len: int

    @pydantic.field_validator("max_model_len")
    @classmethod
    def _fits(cls, v: int) -> int:
        if v > 2048:
            raise ValueError(f"User-specified max_model_len ({v}) is greater than the derived max_model_len "
                             "(max_position_embeddings=2048 or model_max_length=None in model's config.json).")
        return v


def create_engine_config(n: int):  # the name vLLM's EngineArgs method has
    if n < 0:
        raise ValueError(f"max_num_seqs ({n}) must be positive")
    return _ModelConfig(max_model_len=n)


def _raised(fn, *a) -> BaseException:
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("nothing raised")


def test_a_value_vllm_validates_while_building_its_config_is_a_refusal_in_its_own_words():
    e = _raised(create_engine_config, 99999999)
    assert type(e).__name__ == "ValidationError"
    assert config_refusal(e) == ("User-specified max_model_len (99999999) is greater than the derived max_model_len "
                                 "(max_position_embeddings=2048 or model_max_length=None in model's config.json).")
    try:  # wrapped by a caller: the chain is read
        try:
            create_engine_config(99999999)
        except Exception as inner:
            raise RuntimeError("building the engine client failed") from inner
    except RuntimeError as outer:
        assert config_refusal(outer).startswith("User-specified max_model_len (99999999)")
    assert config_refusal(_raised(create_engine_config, -1)) == "max_num_seqs (-1) must be positive"


def test_runtime_failures_stay_engine_failures():
    assert config_refusal(RuntimeError("Engine core initialization failed. See root cause above.")) is None
    assert config_refusal(MemoryError()) is None
    assert config_refusal(_raised(lambda: int("x"))) is None  # a ValueError outside the config build


@pytest.mark.parametrize("args,named", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
    (["--pipeline-parallel-size=2"], "--pipeline-parallel-size 2"),
    (["-tp", "4", "--dtype", "float32"], "-tp 4"),
    (["--data_parallel_size", "2"], "--data_parallel_size 2"),
    (["-dcp", "2"], "-dcp 2"),
])
def test_a_parallel_size_above_one_is_refused_before_the_engine_starts(args, named):
    with pytest.raises(UsageError) as e:
        check_engine_args(args)
    assert "single-device (TP1) engines only, not " + named in e.value.message
    check_engine_args(["--tensor-parallel-size", "1", "-pp", "1", "--dtype", "float32"])


def test_logits_as_logprobs_are_refused_before_the_engine_starts():
    with pytest.raises(UsageError, match="--logprobs-mode raw_logits: the oracle compares logprobs"):
        check_engine_args(["--logprobs-mode", "raw_logits"])
    check_engine_args(["--logprobs-mode", "processed_logprobs"])
