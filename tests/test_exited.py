"""An engine that dies on its own (exited, OOM-killed, ``kill -9``) is said by ``status`` until
``prune`` forgets it -- a trial's detached engine was SIGKILLed and ``status`` said only "no
restored engines running" -- while an engine a ``stop`` stopped leaves no such record. Real
processes and a real registry in a temp run dir; no engine, no root needed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from vllm_snapshot.cli import render
from vllm_snapshot.ops.manage import status
from vllm_snapshot.store import registry
from vllm_snapshot.store.registry import Entry


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _entry(p: subprocess.Popen, port: int, log: str = "") -> Entry:
    return Entry("/snaps/tiny", p.pid, 0, "127.0.0.1", port, time.time(), "detached", log_file=log)


def test_an_engine_killed_on_its_own_is_said_by_status_until_prune_forgets_it(run_dir, capsys):
    p = _sleeper()
    registry.register(_entry(p, 8101, "/var/log/vllm-snapshot/tiny.log"))
    assert [e.pid for e in registry.entries()] == [p.pid] and registry.exited() == []
    p.kill()
    p.wait()
    r = status()
    assert r.engines == [] and [x["pid"] for x in r.exited] == [p.pid]
    (x,) = r.exited
    assert x["port"] == 8101 and x["log_file"] == "/var/log/vllm-snapshot/tiny.log" and x["mode"] == "detached"
    assert abs(x["noticed_at"] - time.time()) < 60
    render.show(r, False, False)
    out = capsys.readouterr().out
    assert (f"engine PID {p.pid} (/snaps/tiny, port 8101) is gone: it exited or was killed without a "
            "`vllm-snapshot stop`") in out and "its log: /var/log/vllm-snapshot/tiny.log" in out and "prune" in out
    assert json.loads(json.dumps(r.to_json()))["exited"][0]["pid"] == p.pid
    assert [x["pid"] for x in status().exited] == [p.pid]  # said again: a record, not a one-time line
    assert registry.forget_exited(dry_run=True) and [x["pid"] for x in registry.exited()] == [p.pid]
    (line,) = registry.forget_exited()
    assert f"engine PID {p.pid}" in line and registry.exited() == []


def test_an_engine_a_stop_stopped_leaves_no_record(run_dir):
    p = _sleeper()
    e = _entry(p, 8102)
    registry.register(e)
    rep = registry.stop(e, drain_s=0, teardown_s=1)
    p.wait()
    assert rep.seconds >= 0 and registry.entries() == [] and registry.exited() == []
    assert not list((run_dir / "engines").glob("*.stopping"))  # the stop's own marker goes with the entry


def test_a_stop_marks_its_engine_before_it_signals_so_a_reader_meanwhile_does_not_record_it(run_dir, monkeypatch):
    # a `status` of another shell reading the registry between the engine's exit and the
    # stop's unregister must not report a stopped engine as one that died on its own
    p = _sleeper()
    e = _entry(p, 8103)
    registry.register(e)
    seen = []

    def signal_and_read(pid, sig):
        p.kill()
        p.wait()
        seen.append(registry.exited())

    monkeypatch.setattr(registry, "_signal", signal_and_read)
    registry.stop(e, drain_s=0, teardown_s=1)
    assert seen == [[]] and registry.exited() == []


def test_prune_forgets_the_exited_engines_status_said():
    from pathlib import Path

    from fakes import FakeWorld
    from vllm_snapshot import ops

    t = FakeWorld()
    t.exited = [{"pid": 41, "snapshot": "/snaps/a", "host": "127.0.0.1", "port": 8101, "mode": "detached",
                 "started_at": 1.0, "log_file": "", "noticed_at": 2.0}]
    assert [x["pid"] for x in status(tools=t.tools).exited] == [41]
    r = ops.prune(Path("/var/lib/vllm-snapshot"), None, None, True, tools=t.tools)
    assert any("engine PID 41" in x for x in r.temp_removed) and t.exited  # a dry run only says
    r = ops.prune(Path("/var/lib/vllm-snapshot"), None, None, False, tools=t.tools)
    assert any("engine PID 41" in x for x in r.temp_removed) and status(tools=t.tools).exited == []
