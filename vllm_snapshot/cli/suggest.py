"""What a person meant: close matches for a mistyped option or snapshot name (``difflib``, as
click and argparse do), and the snapshot a model path or name selects. Pure functions apart
from :func:`snapshots_of_model`, which reads manifests."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path


def close_matches(word: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``candidates`` close to ``word``: those that start with it (a model name
    for its ``MODEL-KEYPREFIX`` snapshots), then difflib's closest (ratio >= 0.6), without
    duplicates, best first. Pure."""
    cands = sorted(set(candidates))
    prefixed = [c for c in cands if c != word and c.startswith(word) and len(word) >= 3]
    close = difflib.get_close_matches(word, cands, n=n, cutoff=0.6)
    out: list[str] = []
    for c in [*prefixed, *close]:
        if c not in out and c != word:
            out.append(c)
    return out[:n]


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """``"did you mean X?"`` / ``"did you mean X or Y?"`` for :func:`close_matches`, or None."""
    m = close_matches(word, candidates)
    if not m:
        return None
    return "did you mean " + (m[0] if len(m) == 1 else ", ".join(m[:-1]) + " or " + m[-1]) + "?"


def snapshots_of_model(model: str, snapshots: Iterable[Path]) -> list[Path]:
    """The snapshots (of ``snapshots``, directories) whose manifest's model is ``model``: a
    path (anything with a ``/``: compared with the recorded model directory, both resolved) or a
    name (the recorded directory's last part, what was requested, or the served name). A
    snapshot whose manifest does not read is left out (``list`` shows why)."""
    from ..errors import SnapshotError
    from ..store import manifest

    as_path = "/" in model or model in (".", "..")
    want = os.path.realpath(model) if as_path else model.rstrip("/")
    out = []
    for snap in snapshots:
        try:
            m = manifest.read(snap).model
        except (SnapshotError, OSError, ValueError):
            continue
        if as_path:
            if os.path.realpath(m.path) == want:
                out.append(snap)
        elif want in (Path(m.path).name, m.requested.rstrip("/"), m.served_name):
            out.append(snap)
    return out
