"""Close matches for a mistyped name -- an option, an engine arg, a snapshot -- with
``difflib`` (as click and argparse do), for "did you mean" hints. Pure."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_matches(word: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` of ``candidates`` close to ``word``: those that start with it (a model name
    for its ``MODEL-KEYPREFIX`` snapshots), then difflib's closest (ratio >= ``cutoff``),
    without duplicates, best first. For an option (``word`` starts with ``-``) only options of
    the same kind (``--long`` or ``-short``) are candidates. Pure."""
    cands = sorted(set(candidates))
    if word.startswith("-"):
        cands = [c for c in cands if c.startswith("--") == word.startswith("--")]
    prefixed = [c for c in cands if c != word and c.startswith(word) and len(word.lstrip("-")) >= 3]
    close = difflib.get_close_matches(word, cands, n=n, cutoff=cutoff)
    out: list[str] = []
    for c in [*prefixed, *close]:
        if c not in out and c != word:
            out.append(c)
    return out[:n]


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """``"did you mean X?"`` / ``"did you mean X or Y?"`` for :func:`close_matches`, or None.
    Options are matched more strictly (ratio >= 0.75: hundreds of vLLM options look alike). Pure."""
    m = close_matches(word, candidates, cutoff=max(cutoff, 0.75) if word.startswith("-") else cutoff)
    if not m:
        return None
    return "did you mean " + (m[0] if len(m) == 1 else ", ".join(m[:-1]) + " or " + m[-1]) + "?"
