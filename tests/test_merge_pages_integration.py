"""``restore --merge-pages`` on a real restore of the session snapshot (real CRIU): every
process of the restored engine is marked ``ksm_merge_any`` and every anonymous mapping it has
is ``VM_MERGEABLE`` (smaps ``mg``); a clone restored beside it without the option has neither.
A ``switch --merge-pages`` onto the unmarked one's port hands it to a marked engine. ksmd need
not run (the mark is what is tested; docs/benchmarks.md measures the merging)."""

from __future__ import annotations

import json

import pytest

from vllm_snapshot.checkpoint.criu.merge import process_merge
from vllm_snapshot.host.procs import tree

from conftest import cli
from test_integration import engine_pids, free_port, stop

pytestmark = pytest.mark.integration


def _marks(pid: int) -> list[dict]:
    procs = tree(pid)
    assert len(procs) >= 3, f"the restored tree {pid} has {len(procs)} processes"
    return [process_merge(p.pid) for p in procs]


def test_merge_pages_marks_every_restored_process_and_only_with_the_option(snapshot):
    before = engine_pids()
    pids = []
    try:
        on = json.loads(cli("restore", str(snapshot), "--port", str(free_port()), "--detach", "--merge-pages", "--json",
                            timeout=300, check=True).stdout)
        pids.append(on["pid"])
        off = json.loads(cli("restore", str(snapshot), "--port", str(free_port()), "--detach", "--json",
                             timeout=300, check=True).stdout)
        pids.append(off["pid"])
        assert on["merge_pages"] is True and off["merge_pages"] is False
        for m in _marks(on["pid"]):
            assert m["merge_any"] == 1, m
            assert m["anon_vmas"] > 0 and m["mergeable_vmas"] == m["anon_vmas"], m
        for m in _marks(off["pid"]):
            assert m["merge_any"] == 0 and m["mergeable_vmas"] == 0 and m["anon_vmas"] > 0, m
        rows = {r["pid"]: r for r in json.loads(cli("status", "--json", check=True).stdout)["engines"]}
        assert rows[on["pid"]]["merge_pages"] is True and rows[off["pid"]]["merge_pages"] is False
        # switch --merge-pages onto the unmarked engine's port: the same snapshot, only the mark
        # differs, so it is no no-op; the new engine (handed the port) is marked, the old one gone
        port = int(off["url"].rsplit(":", 1)[1])
        sw = json.loads(cli("switch", str(snapshot), "--port", str(port), "--merge-pages", "--json",
                            timeout=300, check=True).stdout)
        pids[pids.index(off["pid"])] = sw["pid"]  # the switch stopped the old one
        assert sw["handover"] is True and sw["stopped"] == [off["pid"]] and sw["pid"] != off["pid"]
        assert all(m["merge_any"] == 1 for m in _marks(sw["pid"]))
        rows = {r["pid"]: r for r in json.loads(cli("status", "--json", check=True).stdout)["engines"]}
        assert rows[sw["pid"]]["merge_pages"] is True and off["pid"] not in rows
    finally:
        for pid in pids:
            stop(pid)
    assert engine_pids(10, before) - before == set()
