"""The result of ``inspect`` (one of :mod:`vllm_snapshot.report.results`, which re-exports it).

It lives alone so that ``inspect`` does not build the other result classes: each frozen
dataclass costs ~1 ms to create (its methods are compiled from source at import), and
``inspect``'s whole process has a start-up budget (within 0.3 s: docs/benchmarks.md, target 5;
tests/test_startup.py checks what it imports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.manifest import Manifest


@dataclass(frozen=True)
class Inspected:
    """A snapshot's manifest, read and checked (schema, digest), not validated against the host;
    ``pulled``: the record ``pull`` left (image, digest, pulled_at, machine_id, hostname,
    verified_by), None for a snapshot made here."""

    snapshot: str
    manifest: Manifest
    pulled: dict | None = None

    @property
    def built(self) -> dict:
        """Where the snapshot was built: ``{"machine_id", "hostname"}`` (None when not recorded),
        and for a CUDA snapshot ``"gpu"``: the GPU its engine used, ``<uuid>`` with ``(<model>,
        /dev/nvidia<minor>)`` when recorded (a restore elsewhere goes onto that model at that minor)."""
        h = self.manifest.host
        out = {k: h.get(k) for k in ("machine_id", "hostname")}
        if h.get("gpu_uuid_used"):
            where = [x for x in (h.get("gpu_name_used"), f"/dev/nvidia{h['gpu_minor_used']}"
                                 if h.get("gpu_minor_used") else None) if x]
            out["gpu"] = h["gpu_uuid_used"] + (f" ({', '.join(where)})" if where else "")
        return out

    def to_json(self) -> dict:
        return {"snapshot": self.snapshot, "manifest": self.manifest.model_dump(mode="json"), "built": self.built,
                "pulled": self.pulled}
