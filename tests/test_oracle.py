"""oracle.compare: exact token/text, logprob tolerance, top-5 ids in order, non-finite values."""

from __future__ import annotations

import math

import pytest
from helpers import make_oracle
from pydantic import ValidationError

from vllm_snapshot.store.oracle import LOGPROB_ABS_TOL, Oracle, TopLogprob, compare


def _top(*pairs):
    return tuple(TopLogprob(token_id=i, logprob=lp) for i, lp in pairs)


def test_identical_oracles_match():
    assert compare(make_oracle(), make_oracle()) == []


def test_token_id_must_be_equal():
    diffs = compare(make_oracle(), make_oracle(token_id=12))
    assert len(diffs) == 1
    assert diffs[0].startswith("token_id:") and "11" in diffs[0] and "12" in diffs[0]


def test_text_must_be_equal_exactly():
    # same token id, text differs only by whitespace: still a mismatch
    diffs = compare(make_oracle(), make_oracle(text=", "))
    assert [d.split(":")[0] for d in diffs] == ["text"]


def test_prompt_must_be_equal():
    diffs = compare(make_oracle(), make_oracle(prompt="Once upon a time,"))
    assert [d.split(":")[0] for d in diffs] == ["prompt"]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_logprob_just_inside_tolerance_matches(sign):
    exp = make_oracle()
    act = make_oracle(logprob=exp.logprob + sign * LOGPROB_ABS_TOL * 0.99)
    assert compare(exp, act) == []


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_logprob_just_outside_tolerance_differs(sign):
    exp = make_oracle()
    act = make_oracle(logprob=exp.logprob + sign * LOGPROB_ABS_TOL * 1.01)
    diffs = compare(exp, act)
    assert len(diffs) == 1 and diffs[0].startswith("logprob:")
    assert "tolerance" in diffs[0]


def test_custom_tolerance_is_used():
    exp = make_oracle()
    act = make_oracle(logprob=exp.logprob + 0.05)
    assert compare(exp, act) != []
    assert compare(exp, act, tol=0.1) == []


def test_tolerance_is_small_enough_to_catch_a_real_model_change():
    # the module's rationale: a one-element weight change moves the logprob by > 1e-2
    assert LOGPROB_ABS_TOL <= 1e-2 / 10


def test_top5_same_ids_in_another_order_differs():
    exp = make_oracle()
    ids = [t.token_id for t in exp.top_logprobs]
    swapped = list(exp.top_logprobs)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    diffs = compare(exp, make_oracle(top_logprobs=tuple(swapped)))
    assert len(diffs) == 1 and diffs[0].startswith("top_logprobs ids:")
    assert str(ids) in diffs[0]


def test_top5_missing_entry_differs():
    exp = make_oracle()
    diffs = compare(exp, make_oracle(top_logprobs=exp.top_logprobs[:4]))
    assert any(d.startswith("top_logprobs ids:") for d in diffs)


def test_top5_other_id_differs():
    exp = make_oracle()
    top = list(exp.top_logprobs)
    top[4] = TopLogprob(token_id=999, logprob=top[4].logprob)
    assert any(d.startswith("top_logprobs ids:") for d in compare(exp, make_oracle(top_logprobs=tuple(top))))


def test_top5_logprob_tolerance():
    exp = make_oracle()
    top = list(exp.top_logprobs)
    top[3] = TopLogprob(token_id=top[3].token_id, logprob=top[3].logprob + LOGPROB_ABS_TOL * 0.5)
    assert compare(exp, make_oracle(top_logprobs=tuple(top))) == []
    top[3] = TopLogprob(token_id=top[3].token_id, logprob=exp.top_logprobs[3].logprob + LOGPROB_ABS_TOL * 2)
    diffs = compare(exp, make_oracle(top_logprobs=tuple(top)))
    assert diffs == [d for d in diffs if d.startswith(f"top_logprobs[{top[3].token_id}]")] and len(diffs) == 1


def test_empty_recorded_top5_is_skipped():
    exp = make_oracle(top_logprobs=())
    assert compare(exp, make_oracle()) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_actual_logprob_differs(bad):
    exp = make_oracle()
    # the model refuses non-finite values; bypass validation as a buggy producer could
    act = Oracle.model_construct(**{**dict(exp), "logprob": bad})
    diffs = compare(exp, act)
    assert len(diffs) == 1 and diffs[0].startswith("logprob:")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_actual_top_logprob_differs(bad):
    exp = make_oracle()
    top = list(exp.top_logprobs)
    top[0] = TopLogprob.model_construct(token_id=top[0].token_id, logprob=bad)
    act = Oracle.model_construct(**{**dict(exp), "top_logprobs": tuple(top)})
    diffs = compare(exp, act)
    assert len(diffs) == 1 and diffs[0].startswith(f"top_logprobs[{top[0].token_id}]")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_oracle_model_refuses_non_finite(bad):
    with pytest.raises(ValidationError):
        make_oracle(logprob=bad)
    with pytest.raises(ValidationError):
        TopLogprob(token_id=1, logprob=bad)


def test_oracle_model_refuses_extra_fields():
    with pytest.raises(ValidationError):
        Oracle.model_validate({**make_oracle().model_dump(), "temperature": 0.0})


def test_several_differences_are_all_reported():
    exp = make_oracle()
    act = make_oracle(token_id=12, text="!", logprob=exp.logprob - 1)
    fields = [d.split(":")[0] for d in compare(exp, act)]
    assert fields[:3] == ["token_id", "text", "logprob"]


def test_http_canary_rule_compares_token_id_and_refuses_nan_and_garbage():
    from vllm_snapshot.store.oracle import compare_http

    o = Oracle(prompt="p", token_id=11, text=",", logprob=-1.25)
    assert compare_http(o, ",", -1.2501, 11) == []
    assert any("token_id" in d for d in compare_http(o, ",", -1.25, 12))
    assert any("token_id" in d for d in compare_http(o, ",", -1.25, None))  # missing ids differ
    assert any("logprob" in d for d in compare_http(o, ",", float("nan"), 11))
    assert any("logprob" in d for d in compare_http(o, ",", "abc", 11))
    assert any("text" in d for d in compare_http(o, None, -1.25, 11))
