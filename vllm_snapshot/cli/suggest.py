"""What a person meant: the snapshot a model path or name selects (close names:
:mod:`vllm_snapshot.suggest`, re-exported here)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..suggest import close_matches, did_you_mean

__all__ = ["close_matches", "did_you_mean", "snapshots_of_model"]


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
