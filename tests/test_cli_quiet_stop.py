"""Small things an operator expects (issue "Operator experience", Low): ``stop`` with nothing
running succeeds (as ``systemctl stop``); ``-q`` on stop/list/status/doctor/verify; a detached
engine's log file is recorded and shown; errors in colour on a terminal only, click's own errors
in our format; ``inspect`` names the model path once and its phases in run order."""

from __future__ import annotations

import json
import os

import pytest

from helpers import write_snapshot_dir
from vllm_snapshot.cli import app as cli
from vllm_snapshot.cli import render
from vllm_snapshot.report import results as R
from vllm_snapshot.store import registry


@pytest.fixture()
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


@pytest.mark.skipif(os.geteuid() != 0, reason="stop checks root first")
def test_stop_with_nothing_running_succeeds_and_says_so(run_dir, capsys):
    assert cli.main(["stop", "--port", "8799"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("nothing to stop: no restored engine matches port 8799") and err == ""
    assert cli.main(["stop", "--port", "8799", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stopped"] == []
    assert cli.main(["stop", "--port", "8799", "-q"]) == 0 and capsys.readouterr() == ("", "")


def test_quiet_list_and_status_print_names_and_pids_only(capsys):
    render.show(R.Listed("/r", [{"name": "a"}, {"name": "b"}]), quiet=True)
    assert capsys.readouterr().out == "a\nb\n"
    render.show(R.Engines([{"pid": 11}, {"pid": 12}], orphans=[99]), quiet=True)
    assert capsys.readouterr().out == "11\n12\n"


def test_quiet_doctor_prints_only_what_failed(capsys):
    from vllm_snapshot.cli.doctor import Check

    checks = [Check("root", True, "error", "uid 0", ""), Check("criu", False, "error", "too old", "run setup")]
    render.show(R.DoctorReport(checks, 11), quiet=True)
    assert capsys.readouterr().out == "error: criu: too old (run setup)\n"
    render.show(R.DoctorReport(checks[:1], 0), quiet=True)
    assert capsys.readouterr().out == ""


def test_a_detached_engines_log_file_is_recorded_and_listed(run_dir, capsys):
    e = registry.Entry(snapshot="/s", pid=os.getpid(), supervisor_pid=0, host="127.0.0.1", port=8799,
                       started_at=0.0, mode="detached", log_file="/var/log/vllm-snapshot/s-8799.log")
    registry.register(e)
    try:
        got = [x for x in registry.entries() if x.pid == os.getpid()]
        assert got and got[0].log_file == "/var/log/vllm-snapshot/s-8799.log"
        render.engine_list([{**got[0].__dict__, "url": got[0].url, "cgroup": ""}])
        assert "log /var/log/vllm-snapshot/s-8799.log" in capsys.readouterr().out
    finally:
        registry.unregister(os.getpid())
    assert not list(run_dir.glob("engines/*"))


def test_errors_are_coloured_on_a_terminal_only(monkeypatch, capsys):
    from vllm_snapshot.errors import UsageError

    cli.main_error(UsageError("bad", hint="do this"))
    assert capsys.readouterr().err == "error [usage]: bad\nhint: do this\n"
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    cli.main_error(UsageError("bad", hint="do this"))
    assert capsys.readouterr().err == "\x1b[1;31merror [usage]\x1b[0m: bad\n\x1b[33mhint\x1b[0m: do this\n"


def test_clicks_own_errors_read_like_ours(capsys):
    # a trial: `list --keep 3` got click's "Possible options: --help" (not --json, not -q)
    assert cli.main(["list", "--keep", "3"]) == 2
    assert capsys.readouterr().err == ("error [usage]: no such option: --keep\n"
                                       "hint: `vllm-snapshot list` takes --help, --json, -q, --quiet; "
                                       "`vllm-snapshot list --help` says what they do\n")
    assert cli.main(["list", "--jsn"]) == 2
    assert capsys.readouterr().err == ("error [usage]: no such option: --jsn\n"
                                       "hint: did you mean --json? (`vllm-snapshot list` takes --help, --json, -q, "
                                       "--quiet)\n")
    assert cli.main(["list", "extra"]) == 2  # click's other errors keep their words
    assert "hint: `vllm-snapshot list --help` lists the options and arguments" in capsys.readouterr().err


def test_inspect_names_the_model_path_once_and_phases_in_run_order(tmp_path, capsys, monkeypatch):
    from helpers import make_manifest

    monkeypatch.setenv("COLUMNS", "200")
    m = make_manifest(timings={"pack": 1.0, "dump": 2.0, "engine_start": 3.0, "model_digest": 0.5})
    write_snapshot_dir(tmp_path / "snap", m)
    assert cli.main(["inspect", str(tmp_path / "snap")]) == 0
    out = capsys.readouterr().out
    assert out.count("/models/tiny") == 1, out
    phases = [ln.split("│")[1].strip() for ln in out.split("phase timings", 1)[1].splitlines() if ln.count("│") == 3]
    assert phases == ["model_digest", "engine_start", "dump", "pack", "total"], phases
