"""store/reclaim: one way to find what killed commands and exited engines left, shared by
``prune``'s reclaim (which removes it) and ``doctor`` (which lists it)."""

from __future__ import annotations

from pathlib import Path

from helpers import stand_in
from vllm_snapshot.cli import doctor
from vllm_snapshot.host import cgroups
from vllm_snapshot.store import archive, reclaim, registry, store


class _Proc:
    pid = 4242

    def kill(self):  # pragma: no cover - a dry run kills nothing
        raise AssertionError("a dry run must not kill")


def _leftovers_here(monkeypatch, tmp_path: Path) -> dict[str, Path]:
    left = {"staging": tmp_path / f"{archive.STAGE_PREFIX}999999999-x", "temp": tmp_path / ".tmp-dead",
            "cgroup": Path("/sys/fs/cgroup/vllm-snapshot/eng-1")}
    monkeypatch.setattr(archive, "stale_staging", stand_in(archive.stale_staging, lambda parents: [left["staging"]]))
    monkeypatch.setattr(store, "stale_temps", stand_in(store.stale_temps, lambda parent, name=None, min_age_s=0.0: [left["temp"]]))
    monkeypatch.setattr(registry, "orphans", stand_in(registry.orphans, lambda: [_Proc()]))
    monkeypatch.setattr(registry, "entries", stand_in(registry.entries, lambda: []))
    monkeypatch.setattr(cgroups, "empty_leaves", stand_in(cgroups.empty_leaves, lambda hs=None: [left["cgroup"]]))
    return left


def test_a_dry_reclaim_and_doctor_list_the_same_leftovers(monkeypatch, tmp_path):
    left = _leftovers_here(monkeypatch, tmp_path)
    listed = reclaim.reclaim(tmp_path, dry_run=True)
    said = doctor.RealProbes().leftovers(str(tmp_path))
    assert len(listed) == len(said) == 4  # staging, temp, orphan, empty cgroup: each named by both
    for kind in ("staging", "temp"):
        assert any(str(left[kind]) in x for x in listed) and any(str(left[kind]) in x for x in said), kind
    assert any("4242" in x for x in listed) and any("4242" in x for x in said)
    assert any("eng-1" in x for x in listed) and any("eng-1" in x for x in said)  # the drift: dry runs missed it
