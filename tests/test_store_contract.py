"""One behavioural contract for the store role, run against the real StoreTools (on this run's
own state dir) and the fake of tests/fakes.py: the signature checks of test_protocols.py
cannot see a fake that accepts what the real one refuses, or forgets what it should keep."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fakes import FakeWorld
from vllm_snapshot.effects.store import LocalStoreTools


@pytest.fixture(params=["local", "fake"])
def store_tools(request):
    return LocalStoreTools() if request.param == "local" else FakeWorld().tools.store


def test_a_restore_clears_a_refusal_and_a_refusal_keeps_the_last_restore(store_tools, tmp_path):
    snap = tmp_path / f"snap-{time.monotonic_ns()}"
    snap.mkdir()
    st = store_tools
    assert st.refusal(snap) is None and st.last_restore(snap) is None  # never seen
    st.record_refusal(snap, "model-changed", "weights changed", by="serve")
    r = st.refusal(snap)
    assert r is not None and (r["code"], r["reason"], r["by"]) == ("model-changed", "weights changed", "serve")
    assert st.last_restore(snap) is None  # a refusal is no restore
    before = time.time()
    st.record_restore(snap, [])
    assert st.refusal(snap) is None  # a restore that succeeded makes it usable again
    t = st.last_restore(snap)
    assert t is not None and before - 1 <= t <= time.time() + 1
    st.record_refusal(snap, "corrupt-snapshot", "frame 3", by="restore")
    assert st.refusal(snap)["by"] == "restore" and st.last_restore(snap) == t  # the time is kept


def test_canonical_paths_are_absolute(store_tools, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert store_tools.canonical(Path("x")).is_absolute()
