"""The record a pull leaves in a snapshot (``pulled.json``: where it came from) and its reader
(:func:`read_pulled`). The fleet's role in the tools seam, ``FleetTools``, and its real class
live with the other roles: :mod:`vllm_snapshot.effects.protocols`, :mod:`vllm_snapshot.effects.fleet`."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CorruptSnapshotError

from ..store.layout import PULLED  # noqa: F401 - the record a pull leaves (manifest.json stays as pushed)


def read_pulled(snapshot: Path) -> dict | None:
    """``snapshot/pulled.json`` as a dict, None when absent. Raises CorruptSnapshotError."""
    try:
        raw = (Path(snapshot) / PULLED).read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptSnapshotError(f"{snapshot}/{PULLED} is not JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("image"), str):
        raise CorruptSnapshotError(f"{snapshot}/{PULLED} is not a pull record")
    return doc
