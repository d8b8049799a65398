"""``--merge-pages`` (restored memory KSM-mergeable, docs/weights.md "Clones that share their
identical pages"): the mark reaches the ``criu swrk`` a restore spawns (and only with the
option), the request carries it from the command line to the CRIU runner, a kernel without the
prctl is refused in words, and the readers of KSM's state and of a process's marks."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_criu_options import _fake_swrk
from tests.test_ops_order import _restore
from tests.fakes import FakeWorld
from vllm_snapshot.checkpoint import criu
from vllm_snapshot.checkpoint.criu import RestoreOptions, merge
from vllm_snapshot.errors import EnvironmentProblem

ROOT = Path(__file__).resolve().parent.parent


def _own_merge() -> int:
    """PR_GET_MEMORY_MERGE of this process: 0 or 1, -1 on a kernel without it."""
    return ctypes.CDLL(None).prctl(merge.PR_GET_MEMORY_MERGE, 0, 0, 0, 0)


def _restore_with_fake(tmp_path, monkeypatch, merge_pages: bool) -> dict:
    fake = _fake_swrk(tmp_path)
    out = tmp_path / "out.json"
    monkeypatch.setenv("FAKE_SWRK_OUT", str(out))
    r, w = os.pipe()
    os.set_inheritable(r, True)
    try:
        runner = criu.Criu(str(fake), keep_log_dir=tmp_path / "logs", timeout_s=30)
        pid = runner.restore(RestoreOptions(inherit_fds=(("pipe:[1]", r),), merge_pages=merge_pages),
                             tmp_path / "images", tmp_path / "work")
    finally:
        os.close(r)
        os.close(w)
    got = json.loads(out.read_text())
    assert pid == 4343 and got["argv"][0] == "swrk"
    assert got["open"] == [r], "the fds handed to the tree must survive the launcher's exec"
    return got


def test_merge_pages_marks_the_swrk_process_and_off_leaves_it_unmarked(tmp_path, monkeypatch):
    assert _own_merge() in (0, -1), "this test process must not be marked itself"
    if _own_merge() == -1:  # a kernel without PR_SET_MEMORY_MERGE: refused in words before CRIU
        with pytest.raises(EnvironmentProblem, match="cannot mark a process's memory mergeable"):
            _restore_with_fake(tmp_path, monkeypatch, True)
        return
    on = _restore_with_fake(tmp_path, monkeypatch, True)
    assert on["merge"] == 1
    for d in ("images", "work"):
        os.rmdir(tmp_path / d)
    off = _restore_with_fake(tmp_path, monkeypatch, False)
    assert off["merge"] == 0
    assert _own_merge() == 0, "the mark must stay in the child"


def test_launch_argv_runs_the_command_through_the_launcher():
    argv = merge.launch_argv(["/usr/sbin/criu", "swrk", "7"], python="/py")
    assert argv[:4] == ["/py", "-I", "-S", "-c"] and argv[5:] == ["/usr/sbin/criu", "swrk", "7"]
    assert f"prctl({merge.PR_SET_MEMORY_MERGE}, 1" in argv[4] and "execv" in argv[4]


def test_the_launcher_execs_the_command_marked(tmp_path):
    if _own_merge() == -1:
        pytest.fail("this kernel has no PR_SET_MEMORY_MERGE: the test host needs Linux >= 6.4 with KSM")
    probe = "import ctypes; print(ctypes.CDLL(None).prctl(68, 0, 0, 0, 0))"
    p = subprocess.run(merge.launch_argv([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "1", (p.returncode, p.stdout, p.stderr)
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "0"


def test_a_kernel_without_the_prctl_is_refused_in_words():
    def no_prctl(*args):
        ctypes.set_errno(22)
        return -1

    with pytest.raises(EnvironmentProblem, match="cannot mark a process's memory mergeable") as ei:
        merge.check_available(no_prctl)
    assert "PR_GET_MEMORY_MERGE failed: Invalid argument" in ei.value.message
    assert "Linux >= 6.4" in ei.value.hint and "without --merge-pages" in ei.value.hint
    merge.check_available(lambda *a: 0)  # a kernel that has it: no error


def test_the_request_carries_merge_pages_to_the_criu_runner_and_the_result():
    t = FakeWorld()
    r, _engine = _restore(t, merge_pages=True)
    assert t.restore_opts.merge_pages is True and r.merge_pages is True and r.to_json()["merge_pages"] is True
    t = FakeWorld()
    r, _engine = _restore(t)
    assert t.restore_opts.merge_pages is False and r.to_json()["merge_pages"] is False


CLI_SCRIPT = r"""
import sys
from vllm_snapshot.cli import app as cli, common, render; from vllm_snapshot import ops
from vllm_snapshot.checkpoint.criu.merge import KsmState

class Engine:
    def close(self):
        pass

def fake(req, rep, tools=None):
    print("MERGE", type(req).__name__, req.merge_pages)
    return object(), Engine()

ops.restore = ops.serve = fake
ops.switch = lambda snapshot, host, port, log_file, rep, rollback, **k: print("MERGE switch", k["merge_pages"])
ops.switch_model = lambda req, host, rollback, rep, **k: (print("MERGE", type(req).__name__, req.merge_pages), None)
render.show = lambda *a, **k: None
common.root_only = lambda what: None
common.resolve = lambda ref: ref
real_notice = common.merge_pages_notice
common.merge_pages_notice = lambda rep: real_notice(rep, KsmState(0))
sys.argv = ["vllm-snapshot", *sys.argv[1:]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("argv, want", [
    (["restore", "snap", "--port", "18999", "--detach", "--merge-pages"], "MERGE RestoreRequest True"),
    (["restore", "snap", "--port", "18999", "--detach"], "MERGE RestoreRequest False"),
    (["switch", "snap", "--port", "18999", "--merge-pages"], "MERGE switch True"),
    (["switch", "snap", "--port", "18999"], "MERGE switch False"),
    (["switch", "--model", "m", "--port", "18999", "--merge-pages"], "MERGE ServeRequest True"),
])
def test_the_cli_option_reaches_the_request_and_says_when_ksm_does_not_run(argv, want):
    cp = subprocess.run([sys.executable, "-c", CLI_SCRIPT, *argv], capture_output=True, text=True, timeout=120,
                        cwd=ROOT)
    assert cp.returncode == 0, (cp.stdout, cp.stderr)
    assert want in cp.stdout
    said = "KSM is not running on this host (/sys/kernel/mm/ksm/run = 0)" in cp.stderr
    assert said == ("--merge-pages" in argv), cp.stderr


def test_ksm_state_reads_sysfs(tmp_path):
    for name, value in (("run", "1\n"), ("pages_shared", "322572\n"), ("pages_sharing", "658107\n"),
                        ("pages_to_scan", "5000\n"), ("sleep_millisecs", "20\n")):
        (tmp_path / name).write_text(value)
    s = merge.ksm_state(tmp_path)
    assert s == merge.KsmState(1, 322572, 658107, 5000, 20) and s.running
    (tmp_path / "run").write_text("0\n")
    assert not merge.ksm_state(tmp_path).running
    assert merge.ksm_state(tmp_path / "absent").run is None


SMAPS = """\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
VmFlags: rd wr mr mw me ac mg
7f0000000000-7f0000100000 rw-p 00000000 00:00 0 
Size:               1024 kB
VmFlags: rd wr mr mw me ac mg
7f0000100000-7f0000200000 rw-p 00000000 00:00 0 
Size:               1024 kB
VmFlags: rd wr mr mw me ac
7f0000200000-7f0000300000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
Size:               1024 kB
VmFlags: rd mr mw me mg
"""


def test_process_merge_counts_marked_anonymous_mappings(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "smaps").write_text(SMAPS)
    (tmp_path / "42" / "ksm_merging_pages").write_text("17\n")
    (tmp_path / "42" / "ksm_stat").write_text("ksm_rmap_items 0\nksm_merge_any: yes\nksm_mergeable: yes\n")
    assert merge.process_merge(42, tmp_path) == {"mergeable_vmas": 2, "anon_vmas": 3, "merging_pages": 17,
                                                 "merge_any": 1}
    assert merge.process_merge(43, tmp_path) is None
    assert merge.process_marked(42, tmp_path) and not merge.process_marked(43, tmp_path)
    (tmp_path / "42" / "ksm_stat").write_text("ksm_rmap_items 0\nksm_merge_any: no\nksm_mergeable: no\n")
    assert not merge.process_marked(42, tmp_path)


def test_serve_passes_merge_pages_to_its_restore_only_when_asked(tmp_path):
    from vllm_snapshot.ops.serve import ServeRequest, _restore_req

    assert _restore_req(ServeRequest(model="m", root=tmp_path, merge_pages=True), tmp_path / "s").merge_pages is True
    assert _restore_req(ServeRequest(model="m", root=tmp_path), tmp_path / "s").merge_pages is False


def test_status_says_which_engines_are_marked_and_what_ksm_merged():
    from vllm_snapshot import ops
    from vllm_snapshot.store.registry import Entry

    t = FakeWorld()
    t.entries = [Entry("/snaps/a", 77, 0, "127.0.0.1", 8101, 1.0, "detached"),
                 Entry("/snaps/a", 78, 0, "127.0.0.1", 8102, 1.0, "detached")]
    t.merged = {77: (True, 326745)}
    rows = {r["pid"]: r for r in ops.status(tools=t.tools).engines}
    assert (rows[77]["merge_pages"], rows[77]["ksm_merged_pages"]) == (True, 326745)
    assert (rows[78]["merge_pages"], rows[78]["ksm_merged_pages"]) == (False, 0)


def test_the_host_runtime_reads_an_unmarked_process_as_unmarked():
    from vllm_snapshot.effects.runtime import LocalRuntimeTools

    assert _own_merge() == 0
    marked, merged = LocalRuntimeTools().merge_of(os.getpid())
    assert marked is False and merged == 0
    assert LocalRuntimeTools().merge_marked(os.getpid()) is False


# ------------------------------------------------------------------ switch --merge-pages

def _switch_world(handover: bool, marked: bool = False):
    from tests.fakes import isolated_manifest
    from vllm_snapshot.store.registry import Entry

    # hand-over: an isolated target beside the old engine; else the old socket cannot be shared
    t = FakeWorld(manifest=isolated_manifest(), fail={} if handover else {"take_listener": LookupError("none")})
    t.entries = [Entry("/snaps/old", 77, 0, "127.0.0.1", 8101, 0.0, "detached")]
    if marked:
        t.merged = {77: (True, 1000)}
    opts = []
    real = t.tools.checkpoint.restore_tree
    t.tools.checkpoint.restore_tree = lambda kind, o, *a, **k: (opts.append(o.merge_pages), real(kind, o, *a, **k))[1]
    return t, opts


@pytest.mark.parametrize("handover", [True, False])
def test_switch_restores_the_new_engine_mergeable_only_when_asked(handover):
    from vllm_snapshot import ops
    from vllm_snapshot.report.progress import Reporter

    for asked in (True, False):
        t, opts = _switch_world(handover)
        res = ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools, merge_pages=asked)
        assert res.handover is handover and opts == [asked] and res.stopped == [77]


@pytest.mark.parametrize("handover", [True, False])
def test_a_switch_rollback_restores_the_old_engine_with_the_mark_it_had(handover):
    from vllm_snapshot import ops
    from vllm_snapshot.errors import CriuError, OracleMismatchError
    from vllm_snapshot.report.progress import Reporter

    for old_marked in (True, False):
        t, opts = _switch_world(handover, marked=old_marked)
        if handover:  # the new engine's canary fails after the old one stopped accepting
            canary = t.tools.engine.http_canary
            t.tools.engine.http_canary = lambda *a: ["token 1 != 2"] if len(opts) == 1 else canary(*a)
        else:  # the new engine's CRIU restore fails after the old one was stopped
            real = t.tools.checkpoint.restore_tree

            def restore_tree(kind, o, *a, **k):
                pid = real(kind, o, *a, **k)  # records the mark
                if len(opts) == 1:
                    raise CriuError("CRIU restore failed")
                return pid

            t.tools.checkpoint.restore_tree = restore_tree
        with pytest.raises(OracleMismatchError if handover else CriuError, match="rolled back"):
            ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools, merge_pages=not old_marked)
        assert opts == [not old_marked, old_marked], opts  # the new engine as asked, the old one as it was
        assert [r.snapshot for r in t.registered] == ["/snaps/old"]


def test_a_switch_that_changes_only_the_mark_is_not_unchanged():
    from vllm_snapshot import ops
    from vllm_snapshot.report.progress import Reporter
    from vllm_snapshot.store.registry import Entry

    t = FakeWorld()
    t.entries = [Entry("/snaps/new", 77, 0, "127.0.0.1", 8101, 0.0, "detached")]
    assert ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools).unchanged
    res = ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools, merge_pages=True)
    assert not res.unchanged and res.stopped == [77] and t.restore_opts.merge_pages is True
    t = FakeWorld()
    t.entries = [Entry("/snaps/new", 77, 0, "127.0.0.1", 8101, 0.0, "detached")]
    t.merged = {77: (True, 5)}
    assert ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools, merge_pages=True).unchanged
    assert "stop_engine" not in t.calls


def test_switch_refuses_a_kernel_without_the_prctl_before_anything_is_touched(monkeypatch):
    from vllm_snapshot import ops
    from vllm_snapshot.report.progress import Reporter

    def no_prctl(prctl=None):
        raise EnvironmentProblem("--merge-pages: this kernel cannot mark a process's memory mergeable",
                                 hint="it needs Linux >= 6.4 built with CONFIG_KSM; restore without --merge-pages")

    monkeypatch.setattr(merge, "check_available", no_prctl)
    for handover in (True, False):
        t, opts = _switch_world(handover)
        with pytest.raises(EnvironmentProblem, match="cannot mark") as ei:
            ops.switch(Path("/snaps/new"), None, 8101, None, Reporter(), tools=t.tools, merge_pages=True)
        assert "nothing was stopped: PID 77 still serves http://127.0.0.1:8101" in ei.value.message
        assert ei.value.details["stopped"] == [] and ei.value.details["serving"]["pid"] == 77
        assert opts == [] and "stop_engine" not in t.calls and "take_listener" not in t.calls
        assert "open_snapshot" not in t.calls  # refused before the target's validation
