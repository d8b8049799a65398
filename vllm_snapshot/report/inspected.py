"""The result of ``inspect`` (one of :mod:`vllm_snapshot.report.results`, which re-exports it).

It lives alone so that ``inspect`` does not build the other result classes: each frozen
dataclass costs ~1 ms to create (its methods are compiled from source at import), and
``inspect``'s whole process has a start-up budget (issue 22, target 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.manifest import Manifest


@dataclass(frozen=True)
class Inspected:
    """A snapshot's manifest, read and checked (schema, digest), not validated against the host."""

    snapshot: str
    manifest: Manifest

    def to_json(self) -> dict:
        return {"snapshot": self.snapshot, "manifest": self.manifest.model_dump(mode="json")}
