"""The oracle: one greedy token recorded at create and replayed after restore.

A value is ``{"prompt", "token_id", "text", "logprob", "top_logprobs"}``. The match rule:

* ``token_id`` and ``text`` must be equal exactly: a different greedy token means different
  weights, tokenizer or state, and serving it would be wrong.
* ``logprob`` may differ by at most :data:`LOGPROB_ABS_TOL` (natural-log units). On CPU a
  restored engine computes bit-identical numbers (its memory is the dumped memory), so the
  tolerance only absorbs kernel-selection noise on GPU after a level-2 wake-up and weight
  reload, where reduction order can change in the last bits. 1e-3 nats is ~0.1% in probability:
  far below the shift any real change of weights produces (a one-element change in the tiny
  model moves it by > 1e-2), so it cannot hide a wrong model.
* ``top_logprobs`` (the 5 best token ids) must hold the same ids in the same order; their
  logprobs obey the same tolerance. A recorded top-5 that is empty (older snapshot) is skipped.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

LOGPROB_ABS_TOL = 1e-3
DEFAULT_PROMPT = "Once upon a time"


class TopLogprob(BaseModel):
    """One of the top-k alternatives: token id and its logprob (natural log)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)
    token_id: int
    logprob: float


class Oracle(BaseModel):
    """Greedy one-token result of ``prompt``: token id, decoded text, logprob, top-5."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)
    prompt: str
    token_id: int
    text: str
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = Field(default=())


def compare(expected: Oracle, actual: Oracle, tol: float = LOGPROB_ABS_TOL) -> list[str]:
    """Return human-readable differences (empty list = match), per the module's rule.

    Each entry reads ``"field: expected X, got Y"``. Pure; raises nothing.
    """
    diffs: list[str] = []
    if expected.prompt != actual.prompt:
        diffs.append(f"prompt: expected {expected.prompt!r}, got {actual.prompt!r}")
    if expected.token_id != actual.token_id:
        diffs.append(f"token_id: expected {expected.token_id}, got {actual.token_id}")
    if expected.text != actual.text:
        diffs.append(f"text: expected {expected.text!r}, got {actual.text!r}")
    if not math.isfinite(actual.logprob) or abs(expected.logprob - actual.logprob) > tol:
        diffs.append(
            f"logprob: expected {expected.logprob!r}, got {actual.logprob!r} (tolerance {tol})"
        )
    if expected.top_logprobs:
        exp_ids = [t.token_id for t in expected.top_logprobs]
        act_ids = [t.token_id for t in actual.top_logprobs]
        if exp_ids != act_ids:
            diffs.append(f"top_logprobs ids: expected {exp_ids}, got {act_ids}")
        else:
            for e, a in zip(expected.top_logprobs, actual.top_logprobs):
                if not math.isfinite(a.logprob) or abs(e.logprob - a.logprob) > tol:
                    diffs.append(
                        f"top_logprobs[{e.token_id}]: expected {e.logprob!r}, got {a.logprob!r}"
                        f" (tolerance {tol})"
                    )
    return diffs


def compare_http(expected: Oracle, text: object, logprob: object, token_id: object = None,
                 tol: float = LOGPROB_ABS_TOL) -> list[str]:
    """The canary's rule: an HTTP completion (``text``, first ``token_logprobs`` value, first
    ``token_ids`` value) must carry the oracle's token id (exact), text and logprob (within
    ``tol``). A missing, non-numeric or non-finite logprob or token id is a difference, never
    an exception. Pure."""
    diffs = []
    if token_id != expected.token_id:
        diffs.append(f"canary token_id: expected {expected.token_id}, got {token_id!r}")
    if text != expected.text:
        diffs.append(f"canary text: expected {expected.text!r}, got {text!r}")
    try:
        lp = float(logprob)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        lp = math.nan
    if not math.isfinite(lp) or abs(lp - expected.logprob) > tol:
        diffs.append(f"canary logprob: expected {expected.logprob!r}, got {logprob!r}")
    return diffs
