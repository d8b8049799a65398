"""The CLI's edges (issue: time-sharing without outages, paths, read-only stores, non-root,
usage errors): unit tests without an engine. The end-to-end cases are in
tests/test_switch_integration.py."""

from __future__ import annotations

import json
import os
import dataclasses
from pathlib import Path

import pytest

from helpers import stand_in, write_snapshot_dir

from vllm_snapshot.store import archive, locks, staging, store
from vllm_snapshot.cli import app as cli, common
from vllm_snapshot import ops
from vllm_snapshot.errors import BusyError, CorruptSnapshotError, CriuError, ModelChangedError, UsageError
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.store.registry import Entry

from fakes import FakeStoreTools, FakeWorld

SNAP = Path("/snaps/new")


# ------------------------------------------------------------------ switch

def _old(port=8101, host="::1", snap="/snaps/old"):
    return Entry(snap, 77, 0, host, port, 0.0, "detached")


def test_switch_to_a_bad_target_never_stops_the_old_engine():
    t = FakeWorld(fail={"open_snapshot": CorruptSnapshotError("manifest.json not found")})
    t.entries = [_old()]
    with pytest.raises(CorruptSnapshotError) as ei:
        ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    assert "stop_engine" not in t.calls and "restore_tree" not in t.calls
    # and says so, with what to do (a trial: no hint, no details)
    e = ei.value
    assert "nothing was stopped: PID 77 still serves http://[::1]:8101" in e.message
    assert e.details["stopped"] == [] and e.details["serving"]["pid"] == 77
    assert e.hint is not None and "damaged" in e.hint


def test_switch_to_a_port_where_nothing_serves_says_so():
    from vllm_snapshot.report.progress import Reporter as R

    said = []

    class Listening(R):
        def info(self, text):
            said.append(text)

    t = FakeWorld()
    r = ops.switch(SNAP, None, 8101, None, Listening(), tools=t.tools)
    assert any("nothing serves on port 8101" in x and "no engine is replaced" in x for x in said), said
    # the result says it too (a trial's output was only "stop 0.00 s + restore 2.63 s"): a typo'd
    # port gives a second engine
    assert r.new_engine and r.stopped == [] and r.to_json()["new_engine"] is True


def test_the_output_of_a_switch_that_started_a_new_engine_says_so(capsys):
    from vllm_snapshot.cli import render
    from vllm_snapshot.report.results import Switched

    render.show(Switched("/s/b", 8101, 4242, "http://127.0.0.1:8101", 0.0, 2.63, 2.63, [], new_engine=True))
    assert capsys.readouterr().out == ("nothing served on port 8101, so this started a new engine there: /s/b (engine "
                                       "PID 4242) in 2.63 s; no engine was replaced (`vllm-snapshot status` lists them "
                                       "all)\n")


def test_switch_to_a_changed_model_never_stops_the_old_engine():
    t = FakeWorld(fail={"verify_model:quick": ModelChangedError("content changed: config.json")})
    t.entries = [_old()]
    with pytest.raises(ModelChangedError):
        ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    assert "stop_engine" not in t.calls


def test_switch_keeps_the_old_engines_host():
    t = FakeWorld()
    t.entries = [_old(host="::1")]
    res = ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    assert t.registered[0].host == "::1" and res.url == "http://[::1]:8101"
    assert t.calls.index("stop_engine") < t.calls.index("restore_tree")


def test_switch_rolls_back_when_the_new_engine_fails_and_says_so():
    t = FakeWorld()
    t.entries = [_old()]
    tries = []

    def restore_tree(kind, opts, stage, before_memory=None, cuda_pids=(), gpu_map=()):
        tries.append(opts)
        t.calls.append("restore_tree")
        if len(tries) == 1:
            raise CriuError("CRIU restore failed")
        return 6000

    t.tools.checkpoint.restore_tree = restore_tree
    with pytest.raises(CriuError) as ei:
        ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    e = ei.value
    assert len(tries) == 2  # the new one failed, the old one came back
    assert "rolled back" in e.message and "/snaps/old serves on http://[::1]:8101 again" in e.message
    assert e.details["stopped"][0]["pid"] == 77 and e.details["serving"]["url"] == "http://[::1]:8101"
    assert [r.snapshot for r in t.registered] == ["/snaps/old"]


def test_switch_without_rollback_says_the_port_is_dark():
    t = FakeWorld(fail={"restore_tree": CriuError("CRIU restore failed")})
    t.entries = [_old()]
    with pytest.raises(CriuError) as ei:
        ops.switch(SNAP, None, 8101, None, Reporter(), rollback=False, tools=t.tools)
    assert "nothing serves on port 8101 now" in ei.value.message
    assert ei.value.details["serving"] is None and t.calls.count("restore_tree") == 1
    # the way back, ready to paste (a trial: an interrupted switch left the port dark, no hint)
    assert "`vllm-snapshot restore /snaps/old --port 8101 --detach`" in ei.value.hint


def test_switch_json_names_what_serves():
    t = FakeWorld()
    res = ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools).to_json()
    assert res["serving"] == {"snapshot": str(SNAP), "pid": 5151, "url": "http://127.0.0.1:8101"}
    assert res["stopped"] == []


# ------------------------------------------------------------------ one path identity

def test_canonical_resolves_symlinked_roots_and_dotdot(tmp_path):
    real = tmp_path / "real"
    (real / "snap").mkdir(parents=True)
    (tmp_path / "ln").symlink_to(real)  # root owns it (tests run as root where they matter)
    if os.geteuid() != 0:
        pytest.skip("a symlink not owned by root is refused; this case needs root")
    want = real / "snap"
    assert store.canonical(tmp_path / "ln" / "snap") == want
    assert store.canonical(real / "x" / ".." / "snap") == want
    assert store.resolve(str(tmp_path / "ln" / "snap")) == want


class _CanonStore(FakeStoreTools):
    def canonical(self, path: Path) -> Path:
        return store.canonical(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="symlinks not owned by root are refused; needs root")
def test_delete_through_a_symlinked_root_refuses_while_the_engine_runs(tmp_path):
    real = tmp_path / "real"
    (real / "snap").mkdir(parents=True)
    (tmp_path / "ln").symlink_to(real)
    t = FakeWorld()
    t.tools = dataclasses.replace(t.tools, store=_CanonStore(t))
    t.tools.host.path_exists = lambda p: True
    t.entries = [Entry(str(real / "snap"), 77, 0, "127.0.0.1", 8101, 0.0, "detached")]
    with pytest.raises(BusyError):
        ops.delete(tmp_path / "ln" / "snap", tools=t.tools)
    t.entries = [Entry(str(tmp_path / "ln" / "snap"), 77, 0, "127.0.0.1", 8101, 0.0, "detached")]
    with pytest.raises(BusyError):
        ops.delete(real / "snap", tools=t.tools)  # and the other way round
    assert "delete_snapshot" not in t.calls


# ------------------------------------------------------------------ read-only store

def test_read_only_store_stages_in_the_staging_dir(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(staging, "_read_only", lambda p: Path(p) == ro)
    monkeypatch.setattr(staging, "_free", lambda p: 0 if str(p) == "/dev/shm" else 1 << 40)
    monkeypatch.setenv("VLLM_SNAPSHOT_STAGING_DIR", str(tmp_path / "stage"))
    from vllm_snapshot.store.manifest import ImageFile

    imgs = (ImageFile(name="a.img", raw_bytes=10, stored_bytes=10, blake3="0" * 64),)
    assert archive.staging_parent(10, ro, imgs) == tmp_path / "stage"
    assert archive.staging_parent(10, tmp_path, imgs) == tmp_path  # writable: beside the snapshot
    monkeypatch.setattr(staging, "_free", lambda p: 5)
    from vllm_snapshot.errors import EnvironmentProblem

    with pytest.raises(EnvironmentProblem, match="read-only") as ei:
        archive.staging_parent(1 << 30, ro, imgs)
    assert "VLLM_SNAPSHOT_STAGING_DIR" in ei.value.hint


# ------------------------------------------------------------------ create args, names

@pytest.mark.parametrize("arg", [["--port", "9000"], ["--host=0.0.0.0"], ["--uds", "/run/x.sock"]])
def test_create_refuses_args_that_belong_to_restore(arg):
    t = FakeWorld()
    with pytest.raises(UsageError, match="restore") as ei:
        ops.create(ops.CreateRequest(model="/m", target=SNAP, engine_args=["--kv-cache-memory-bytes", "1M", *arg]),
                   Reporter(), tools=t.tools)
    assert arg[0].split("=")[0] in ei.value.message
    assert "launch_engine" not in t.calls


@pytest.mark.skipif(os.geteuid() != 0, reason="create checks root first")
@pytest.mark.parametrize("name", ["a/b", "..", ".", ".hidden", "../escape", "has space", "x" * 300, ""])
def test_invalid_names_are_refused_as_names(name, capsys):
    assert cli.main(["create", "/models/good", "--name", name, "--", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "--name" in err and "not a valid snapshot name" in err


@pytest.mark.parametrize("argv,flag,nxt", [
    (["create", "/models/good", "--name", "--", "--dtype", "float32"], "--name", "'--'"),
    (["create", "/models/good", "--name", "--dtype", "float32"], "--name", "'--dtype'"),
    (["create", "/models/good", "--name", "x", "--oracle-prompt", "--", "--dtype", "float32"], "--oracle-prompt", "'--'"),
    (["pull", "127.0.0.1:5000/r:t", "--name", "-q"], "--name", "'-q'"),
])
def test_an_option_followed_by_another_option_or_the_end_of_options_needs_a_value(argv, flag, nxt, capsys):
    # a trial: `create M --name -- --dtype ...` named the snapshot `--` and started the engine
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error [usage]: {flag} needs a value: it is followed by {nxt}"), err


def test_a_negative_number_and_an_equals_sign_still_give_values():
    from vllm_snapshot.cli.helpformat import missing_values

    params = [p for p in __import__("typer").main.get_command(cli.app).commands["create"].params]
    missing_values(params, ["/m", "--sleep-level", "-1", "--oracle-prompt=-x", "--name", "x", "--", "--name", "--"])


@pytest.mark.parametrize("name", ["-dash", "--", "-"])
def test_a_snapshot_name_never_starts_with_a_dash(name, capsys):
    # `create --name=-dash` made ROOT/-dash, which `inspect -dash` / `delete -dash` then read as options
    from vllm_snapshot.store import store

    assert not store.valid_name(name) and store.valid_name("a-dash") and store.valid_name("_x")
    assert cli.main(["create", "/models/good", f"--name={name}", "--", "--dtype", "float32"]) == 2
    assert "not a valid snapshot name" in capsys.readouterr().err


def test_serve_builds_no_name_that_starts_with_a_dash(tmp_path):
    from vllm_snapshot.ops.serve import _name_for

    t = FakeWorld()
    assert _name_for(t.tools.host, tmp_path, "/m/-model", Path("/m/-model"), False, "ab" * 8).name == "model-abababababab"


# ------------------------------------------------------------------ non-root, usage errors

@pytest.mark.parametrize("argv", [["create", "/m"], ["restore", "x"], ["status"], ["stop", "--port", "8000"],
                                  ["switch", "x", "--port", "8000"], ["delete", "x"], ["prune", "--keep", "1"],
                                  ["verify", "x"], ["demo"]])
def test_non_root_gets_the_environment_exit_code(argv, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(argv) == 11
    assert "must run as root" in capsys.readouterr().err


@pytest.mark.parametrize("argv,got", [(["stop"], "none"), (["stop", "x", "--pid", "3"], "a snapshot and --pid"),
                                      (["stop", "--port", "8000", "--pid", "3"], "--port and --pid")])
def test_stop_takes_exactly_one_selector(argv, got, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"exactly one of them; got {got})" in err and "`vllm-snapshot status` lists the engines" in err, err


def test_usage_errors_honour_json(capsys):
    assert cli.main(["restore", "x", "--port", "99999", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["code"] == "usage" and "--port" in doc["error"]["message"]
    assert cli.main(["restore", "x", "--detatch", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["exit_code"] == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="restore checks root first")
def test_log_file_without_detach_is_refused(tmp_path, capsys):
    assert cli.main(["restore", str(tmp_path), "--log-file", str(tmp_path / "x.log")]) == 2
    assert "--detach" in capsys.readouterr().err
    assert not (tmp_path / "x.log").exists()


# ------------------------------------------------------------------ hygiene

def test_delete_forgets_the_last_restore(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    snap = tmp_path / "s"
    write_snapshot_dir(snap)
    (snap / "images").mkdir()
    store.record_restore(snap, [])
    assert store.last_restore(snap) is not None
    store.delete(snap)
    assert store.last_restore(snap) is None and not snap.exists()


def test_a_refused_snapshot_that_was_never_restored_is_listed(tmp_path, monkeypatch, capsys):
    # serve records a refusal with "last_restore": null; list and prune read it
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "root"
    snap = root / "s"
    write_snapshot_dir(snap)
    (snap / "images").mkdir()
    store.record_refusal(snap, "engine-failed", "engine exited while starting the server")
    assert store.last_restore(snap) is None
    assert cli.main(["--root", str(root), "list", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["snapshots"][0]
    assert row["last_restore"] is None and row["name"] == "s"


def test_clear_refusal_forgets_only_the_codes_asked_and_keeps_the_rest_of_the_state(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    snap = tmp_path / "root" / "s"
    write_snapshot_dir(snap)
    assert store.clear_refusal(snap, frozenset({"model-changed"})) is None  # no state at all
    store.record_restore(snap, ["identity override machine_id"])
    at = store.last_restore(snap)
    store.record_refusal(snap, "oracle-mismatch", "another token")
    assert store.clear_refusal(snap, frozenset({"model-changed"})) is None and store.refusal(snap)["reason"] == "another token"
    store.record_refusal(snap, "model-changed", "the weights file /w is missing")
    gone = store.clear_refusal(snap, frozenset({"model-changed"}))
    assert gone["reason"] == "the weights file /w is missing" and store.refusal(snap) is None
    assert store.last_restore(snap) == at  # the rest of the record kept


def test_delete_never_removes_a_directory_that_only_has_a_manifest_json(tmp_path, monkeypatch):
    """A typo'd path to a web app (its manifest.json) must not be wiped."""
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    app = tmp_path / "webapp"
    (app / "src").mkdir(parents=True)
    (app / "manifest.json").write_text('{"name": "my-pwa", "start_url": "/"}')
    for args in (["delete", str(app)], ["delete", str(app), "--force"]):
        assert cli.main(args) == 5
    assert (app / "manifest.json").exists() and (app / "src").is_dir()
    (app / "images").mkdir()  # an images/ dir alone does not make it a snapshot either
    assert cli.main(["delete", str(app)]) == 5 and app.exists()


def test_lock_files_of_gone_snapshots_are_cleaned(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    live, gone = tmp_path / "live", tmp_path / "gone"
    live.mkdir()
    gone.mkdir()
    for s in (live, gone):
        with locks.snapshot_lock(s):
            pass
    gone.rmdir()
    held = tmp_path / "held"
    held.mkdir()
    with locks.snapshot_lock(held, shared=True):
        held.rmdir()  # gone, but someone holds its lock: kept
        removed = locks.clean_stale()
    assert removed == [locks.snapshot_lock_path(gone)]
    assert locks.snapshot_lock_path(live).exists() and locks.snapshot_lock_path(held).exists()


def test_a_waiter_on_a_removed_lock_file_locks_the_new_one(tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    s = tmp_path / "s"
    s.mkdir()
    p = locks.snapshot_lock_path(s)
    seen = {}
    polling = threading.Event()  # set when the waiter's flock on the file it opened has failed

    class Clock:  # locks' clock; its sleep is the poll after a failed flock
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(s: float) -> None:
            polling.set()
            time.sleep(s)

    monkeypatch.setattr(locks, "time", Clock)

    def waiter():
        with locks.lock(p, "snapshot s", wait_s=10):
            seen["exists"] = p.exists()  # a waiter holding the unlinked file would see none

    with locks.snapshot_lock(s):
        th = threading.Thread(target=waiter)
        th.start()
        assert polling.wait(10)  # the waiter has opened the old file and is polling flock
        locks.remove_lock_file(s)
    th.join(10)
    assert seen == {"exists": True}


def test_demo_cold_start_uses_its_own_temp_dir_and_removes_it(monkeypatch):
    import subprocess as sp

    from vllm_snapshot.dev import bench
    from vllm_snapshot.engine.mounts import ENGINE_TMPDIR

    seen = {}

    class Exited:
        pid = 0
        returncode = 1

        def __init__(self, argv, env, **kw):
            seen["tmp"] = env["TMPDIR"]
            seen["existed"] = os.path.isdir(env["TMPDIR"])

        def poll(self):
            return 1

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(sp, "Popen", Exited)
    monkeypatch.setattr(os, "killpg", lambda pid, sig: None)
    from vllm_snapshot.errors import EngineError

    with pytest.raises(EngineError):
        bench.cold_start(Path("/m"), 1)
    assert seen["existed"] and seen["tmp"] != ENGINE_TMPDIR and seen["tmp"].startswith("/var/tmp/vllm-snapshot-cold-")
    assert not os.path.exists(seen["tmp"])


def test_the_weights_benchmark_times_after_a_restore_the_request_a_cold_start_ends_at(monkeypatch):
    """scripts/bench_weights.py compares restore -> first completion with a cold start: both
    must end at the same request (it once timed 8 tokens after a restore against the cold
    start's 1-token "Hello")."""
    import importlib.util
    import subprocess

    from vllm_snapshot.dev import bench

    sent = []
    monkeypatch.setattr(bench, "http_json", lambda url, body, timeout: (sent.append((url, body)), (200, {}))[1])
    spec = importlib.util.spec_from_file_location(
        "bench_weights", Path(__file__).resolve().parent.parent / "scripts" / "bench_weights.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.complete(8123)

    class Serving:  # a cold-start server that is up at once
        pid = 0
        returncode = None

        def __init__(self, argv, env, **kw):
            pass

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Serving)
    monkeypatch.setattr(os, "killpg", lambda pid, sig: None)
    bench.cold_start(Path("/m"), 8123, ["--served-model-name", script.tiny_model.SERVED_NAME])
    assert len(sent) == 2 and sent[0] == sent[1]
    assert sent[0][1] == {"model": script.tiny_model.SERVED_NAME, "prompt": "Hello", "max_tokens": 1}


def test_unrestorable_engine_settings_are_named():
    from argparse import Namespace

    from vllm_snapshot.engine.args import unrestorable

    assert unrestorable(Namespace()) == []
    got = unrestorable(Namespace(api_key=["k"], ssl_certfile="/c", uds="/s", middleware=["m"],
                                 speculative_config={"method": "ngram"}, logprobs_mode="raw_logits"))
    text = "\n".join(got)
    for flag in ("--api-key", "--ssl-certfile", "--uds", "--middleware", "--speculative-config", "--logprobs-mode"):
        assert flag in text
    assert unrestorable(Namespace(logprobs_mode="raw_logprobs")) == []


def test_create_target_under_a_world_writable_parent_refused_before_anything(tmp_path):
    # a trial: `--root DIR` with DIR 0777 was exit 5 "corrupt-snapshot" with no hint; the
    # snapshot is not at fault, the store's directory is (exit 11, the chmod that fixes it)
    from vllm_snapshot.errors import EnvironmentProblem

    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(EnvironmentProblem, match="writable by group/others") as e:
        store.prepare_target(d / "snap")
    assert e.value.exit_code == 11 and e.value.hint.startswith(f"chmod 0700 {d}")
    assert list(d.iterdir()) == []
    os.chmod(d, 0o755)  # the hint's alternative is accepted
    assert store.prepare_target(d / "snap").parent == d


def test_a_snapshot_dir_writable_by_others_is_still_corrupt(tmp_path):
    # the snapshot's own directory writable by others is the snapshot's fault: exit 5 stays
    from vllm_snapshot.store import layout

    d = tmp_path / "snap"
    (d / "images").mkdir(parents=True)
    os.chmod(d, 0o777)
    with pytest.raises(CorruptSnapshotError, match="0777"):
        layout.check_dir_safety(d)


def test_restored_tree_that_is_not_the_recorded_one_is_killed():
    t = FakeWorld()
    t.restored_tree = ["python3 -m something.else"]
    with pytest.raises(CriuError, match="not the recorded one"):
        ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123), Reporter(), tools=t.tools)
    assert t.engine.killed and "engine.oracle" not in t.calls and "register" not in t.calls


def test_link_remap_put_back_refuses_a_different_file_and_rolls_back(tmp_path):
    from vllm_snapshot.checkpoint import remaps

    files = tmp_path / "files"
    files.mkdir()
    d = tmp_path / "host"
    d.mkdir()
    a, b = d / "link_remap.1", d / "link_remap.2"
    (files / remaps.encode(a)).write_bytes(b"AAA")
    (files / remaps.encode(b)).write_bytes(b"BBB")
    names = sorted([remaps.encode(a), remaps.encode(b)])
    placed = remaps.put_back(files, names)  # fresh: both placed, exclusively
    assert sorted(placed) == [a, b] and a.read_bytes() == b"AAA"
    assert remaps.put_back(files, names) == []  # identical files already there: left for CRIU
    remaps.cleanup(placed)
    b.symlink_to(tmp_path / "elsewhere")  # a symlink where a remap goes: refused, never followed
    with pytest.raises(BusyError, match="link_remap.2"):
        remaps.put_back(files, names)
    assert not a.exists()  # rolled back
    assert not (tmp_path / "elsewhere").exists()


def test_failed_dump_removes_the_link_remaps_it_left():
    t = FakeWorld(fail={"dump": CriuError("CRIU dump failed")})
    with pytest.raises(CriuError):
        ops.create(ops.CreateRequest(model="/m", target=SNAP, engine_args=["--kv-cache-memory-bytes", "1M"]),
                   Reporter(), tools=t.tools)
    assert t.calls.index("find_remaps") < t.calls.index("cleanup_remaps") < t.calls.index("discard")


def test_switch_refuses_a_corrupt_image_before_stopping():
    t = FakeWorld(fail={"verify_images": CorruptSnapshotError("image pages-4.img fails its checksum")})
    t.entries = [_old()]
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    assert "stop_engine" not in t.calls


def test_switch_refuses_taken_recorded_ports_before_stopping():
    t = FakeWorld()
    t.entries = [_old()]
    t.tools.host.listeners_taken = lambda listeners: ["127.0.0.1:40000 is taken by PID 9 (x)"]
    with pytest.raises(BusyError, match="40000"):
        ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    assert "stop_engine" not in t.calls


def test_switch_to_what_already_serves_is_a_no_op():
    t = FakeWorld()
    t.entries = [_old(snap=str(SNAP), host="127.0.0.1")]
    res = ops.switch(SNAP, None, 8101, None, Reporter(), tools=t.tools)
    assert res.pid == 77 and res.switch_s == 0.0 and "stop_engine" not in t.calls and "restore_tree" not in t.calls


def test_create_refuses_a_target_inside_a_snapshot_and_secrets_early():
    t = FakeWorld()
    t.tools.host.path_exists = lambda p: p == Path("/snaps/tiny/manifest.json")
    with pytest.raises(UsageError, match="inside the snapshot /snaps/tiny"):
        ops.create(ops.CreateRequest(model="/m", target=Path("/snaps/tiny/images/x"),
                                     engine_args=["--kv-cache-memory-bytes", "1M"]), Reporter(), tools=t.tools)
    t2 = FakeWorld()
    with pytest.raises(UsageError, match="--api-key"):
        ops.create(ops.CreateRequest(model="/m", target=SNAP, engine_args=["--kv-cache-memory-bytes", "1M",
                                                                          "--api-key", "k"]), Reporter(), tools=t2.tools)
    assert "launch_engine" not in t.calls + t2.calls


@pytest.mark.skipif(os.geteuid() != 0, reason="delete checks root first")
def test_delete_of_a_symlink_refuses_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from helpers import write_snapshot_dir

    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    os.chmod(tmp_path, 0o700)
    write_snapshot_dir(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cli.main(["delete", str(tmp_path / "link")]) == 5
    assert "symlink" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "run") == ["link", "real"]


def test_a_directory_without_a_manifest_is_not_a_snapshot(tmp_path):
    from vllm_snapshot.store import layout

    d = tmp_path / "usr"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(UsageError, match="not a snapshot") as ei:  # a wrong argument: exit 2, not 5
        layout.open_trusted(d)
    assert "chmod" not in (ei.value.hint or "")
    (d / "images").mkdir()  # ours, but the manifest never got written: damaged, exit 5
    with pytest.raises(CorruptSnapshotError, match="incomplete snapshot"):
        layout.open_trusted(d)


def test_a_stray_readable_file_is_named_as_unexpected_first(tmp_path):
    # a trial: a 0644 file dropped into a snapshot was refused for its mode ("chmod -R go-rwx"),
    # and after the chmod for being there: one answer, the one that fixes it, comes first
    from vllm_snapshot.store import layout

    os.chmod(tmp_path, 0o700)
    d = tmp_path / "snap"
    write_snapshot_dir(d)
    (d / "notes.txt").write_text("mine")
    os.chmod(d / "notes.txt", 0o644)
    with pytest.raises(CorruptSnapshotError, match="unexpected members: notes.txt") as ei:
        layout.open_trusted(d)
    assert "move notes.txt out" in (ei.value.hint or "")


def test_log_file_must_be_a_writable_regular_file(tmp_path):
    from vllm_snapshot.supervise.supervisor import check_log_file

    with pytest.raises(UsageError, match="pseudo filesystem"):
        check_log_file(Path("/proc/version"))
    check_log_file(tmp_path / "ok.log")
    # a trial: `restore --detach --log-file LOG/x` with LOG a regular file said "LOG does not exist"
    for bad in (tmp_path / "ok.log" / "x", tmp_path / "ok.log" / "x" / "y"):
        with pytest.raises(UsageError, match=f"{tmp_path / 'ok.log'} is a file, not a directory"):
            check_log_file(bad)
    with pytest.raises(UsageError, match=f"{tmp_path / 'no'} does not exist"):
        check_log_file(tmp_path / "no" / "x.log")


def test_json_after_double_dash_belongs_to_the_engine_args(capsys):
    cli.main(["create", "--name", "a/b", "--", "--json"])
    err = capsys.readouterr()
    assert err.out == "" and "not a valid snapshot name" in err.err  # plain text: --json was vLLM's


def test_an_engine_log_files_tail_is_its_last_lines_and_none_when_unreadable(tmp_path):
    from vllm_snapshot.supervise.supervisor import log_file_tail

    log = tmp_path / "e.log"
    log.write_text("INFO starting\n" + "x\n" * 30 + "ssl.SSLError: ('No cipher can be selected.',)\n")
    tail = log_file_tail(log)
    assert tail.endswith("No cipher can be selected.',)") and "INFO starting" not in tail
    assert len(tail.splitlines()) == 20
    assert log_file_tail(tmp_path / "missing.log") is None


def test_log_file_fifo_refused(tmp_path):
    from vllm_snapshot.supervise.supervisor import check_log_file

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="not a regular file|cannot be written"):
        check_log_file(tmp_path / "fifo")


@pytest.mark.parametrize("value", ["bogus", "0", "-5", "inf"])
def test_a_bad_criu_timeout_is_a_usage_error_before_anything_runs(value, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("VLLM_SNAPSHOT_CRIU_TIMEOUT", value)
    assert cli.main(["restore", str(tmp_path), "--port", "18999"]) == 2
    assert "VLLM_SNAPSHOT_CRIU_TIMEOUT" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_SNAPSHOT_CRIU_TIMEOUT", "90")
    from vllm_snapshot.checkpoint import criu

    assert criu.env_timeout() == 90.0


@pytest.mark.parametrize("flag", ["--hf-token", "--hf-token=hf_x", "--hf-tok"])
def test_create_refuses_a_hugging_face_token(flag):
    # the engine runs offline; the token would only end up in the images
    from vllm_snapshot.engine.args import check_engine_args

    with pytest.raises(UsageError, match="Hugging Face token"):
        check_engine_args(["--dtype", "float32", flag] + ([] if "=" in flag else ["hf_x"]))


def test_an_incomplete_snapshot_gets_a_hint_that_works(tmp_path):
    from vllm_snapshot.store import layout

    (tmp_path / "images").mkdir()
    with pytest.raises(CorruptSnapshotError) as e:
        layout.open_trusted(tmp_path)
    assert f"rm -r {tmp_path}" in e.value.hint


def test_status_names_engine_trees_nobody_owns(capsys):
    # a trial SIGKILLed a restore mid-CRIU: its frozen tree held 1.3 GiB and status said nothing
    from fakes import FakeWorld
    from vllm_snapshot.cli import render
    from vllm_snapshot.ops.manage import status

    t = FakeWorld()
    t.orphans = [26423]
    r = status(tools=t.tools)
    assert r.to_json() == {"engines": [], "orphans": [26423], "empty_cgroups": [], "exited": []}
    render.show(r, False, False)
    out = capsys.readouterr()
    assert "root PID 26423" in out.out + out.err and "prune" in out.out + out.err


@pytest.mark.parametrize("argv", [["stop", "--port", "99999"], ["stop", "--port", "0"], ["demo", "--port", "99999"]])
def test_port_numbers_are_range_checked(argv, capsys):
    assert cli.main(argv) == 2
    assert "--port" in capsys.readouterr().err


# ------------------------------------------------------------------ -h, -q (new-user trial)

@pytest.mark.parametrize("command", ["create", "restore", "serve", "switch", "inspect", "verify", "list",
                                     "delete", "prune", "stop", "status", "doctor", "demo"])
def test_dash_h_is_help_for_every_command(command, capsys):
    # `vllm serve -h` works; ours took -h as a model or snapshot name, or refused it
    assert cli.main([command, "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: vllm-snapshot {command} ") and "--help" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="delete checks root first")
def test_delete_quiet_prints_nothing_and_deletes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    for flag in ("-q", "--quiet"):
        snap = tmp_path / f"s{flag}"
        write_snapshot_dir(snap)
        (snap / "images").mkdir()
        assert cli.main(["delete", str(snap), flag]) == 0
        out = capsys.readouterr()
        assert not snap.exists() and out.out == "" and out.err == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as another user")
def test_a_snapshot_another_user_may_not_read_is_a_permission_error_not_missing(engine_tmp):
    # the engine user ran `inspect /var/lib/vllm-snapshot/NAME` and was told it "does not exist"
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    top = engine_tmp / "root-only"  # engine_tmp: searchable by the engine user (0711)
    snap = top / "s"
    write_snapshot_dir(snap)
    os.chmod(top, 0o700)
    for args in (["inspect", str(snap)], ["inspect", "--json", str(snap)]):
        # the engine user setup made: it can run the venv's interpreter and read the checkout
        cp = subprocess.run(["runuser", "-u", "vllm-snapshot", "--", sys.executable, "-m", "vllm_snapshot", *args],
                            capture_output=True, text=True, timeout=120, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
        assert cp.returncode == 11, cp.stdout + cp.stderr
        assert f"cannot look at {snap}: permission denied" in cp.stdout + cp.stderr
        assert "does not exist" not in cp.stdout + cp.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as another user")
def test_a_snapshot_root_another_user_may_not_read_is_a_permission_error_not_a_usage_error(engine_tmp):
    # `vllm-snapshot --root /var/lib/vllm-snapshot list` as a plain user: exit 2, "Invalid value
    # for '--root' ... is not readable" (the option's own check), where a permission error is 11
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    top = engine_tmp / "root-only"
    write_snapshot_dir(top / "s")
    os.chmod(top, 0o700)
    for args in (["--root", str(top), "list"], ["--root", str(top), "list", "--json"], ["--root", str(top), "inspect", "s"]):
        cp = subprocess.run(["runuser", "-u", "vllm-snapshot", "--", sys.executable, "-m", "vllm_snapshot", *args],
                            capture_output=True, text=True, timeout=120, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
        assert cp.returncode == 11, (args, cp.stdout + cp.stderr)
        assert "permission denied" in cp.stdout + cp.stderr and str(top) in cp.stdout + cp.stderr, cp.stdout + cp.stderr
        assert "Invalid value" not in cp.stdout + cp.stderr


def test_list_and_status_never_cut_a_reason_or_a_path(capsys):
    # the trial: list and status truncated the reason and the path an operator needs ("…")
    from vllm_snapshot.cli import render

    why = "model files differ: " + ", ".join(f"/models/llama/model-{i:05d}-of-00042.safetensors changed" for i in range(6))
    render.snapshot_list([{"name": "llama", "model": "/models/llama", "key": "abcdef0123456789", "created": "2026-12-01T10:00",
                           "kind": "cpu", "sleep_level": 0, "raw_bytes": 1, "stored_bytes": 1, "compatible": False,
                           "why": why, "last_restore": None}], "/var/lib/vllm-snapshot")
    out = capsys.readouterr().out
    assert "…" not in out and f"✗ llama: {why}\n" in out
    path = "/var/lib/vllm-snapshot/" + "a-very-long-snapshot-name-" * 6
    cg = "/vllm-snapshot/" + "b" * 150
    render.engine_list([{"snapshot": path, "pid": 4242, "url": "http://127.0.0.1:8000", "started_at": None,
                         "mode": "detached", "cgroup": cg}])
    out = capsys.readouterr().out
    assert "…" not in out
    # a trial: the table folded the path and the cgroup mid-word ("…/m1-f015e7594" / "6da"):
    # not copyable; they are whole, each engine's on one line of its own
    assert f"\n4242: {path}  cgroup {cg}\n" in out, out
    assert out.count(path) == 1 and out.count(cg) == 1


def test_a_closed_pipe_is_exit_141_not_an_internal_error(tmp_path):
    # `inspect NAME | head -1` exited 1 ("internal" in the exit-code table): rich's own handler
    import subprocess
    import sys

    snap = tmp_path / "s"
    write_snapshot_dir(snap)
    root = Path(__file__).resolve().parent.parent
    for args in (["inspect", str(snap)], ["inspect", "--json", str(snap)]):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the first line is written
        try:
            cp = subprocess.run([sys.executable, "-m", "vllm_snapshot", *args], stdout=w, stderr=subprocess.PIPE,
                                text=True, timeout=120, cwd=root)
        finally:
            os.close(w)
        assert cp.returncode == 141 and cp.stderr == "", (args, cp.returncode, cp.stderr)


@pytest.mark.parametrize("argv", [["restore", "x", "--root", "/tmp", "--port", "8000"], ["list", "--root", "/tmp"],
                                  ["status", "--debug"], ["serve", "/m", "--root=/tmp", "--dtype", "float32"]])
def test_a_global_option_after_the_command_says_where_it_goes(argv, capsys):
    # a trial: `restore NAME --root DIR` was "not an option restore can apply" or "does not exist"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "is an option of vllm-snapshot itself: put it before the command" in err


def test_global_options_before_the_command_and_engine_args_after_dashdash_are_fine(tmp_path, capsys):
    assert cli.main(["--root", str(tmp_path), "list"]) == 0
    cli._global_options_first(["serve", "/m", "--", "--root-path", "/api"])  # vLLM's, after --
    cli._global_options_first(["serve", "/m", "--root-path", "/api"])  # a front-end option, not --root


def test_host_given_as_a_name_says_which_address_to_give():
    # a trial: `--host localhost` got "not a numeric address (Name or service not known)"
    from vllm_snapshot.host import ports

    with pytest.raises(UsageError) as e:
        ports.bind_listener("localhost", 0)
    assert "'localhost' is a name" in e.value.message and "127.0.0.1" in e.value.message
    assert e.value.hint in ("--host 127.0.0.1", "--host ::1")


def test_a_failure_after_a_signal_is_reported_as_the_interruption(monkeypatch, capsys, tmp_path):
    # a trial: Ctrl-C during `CRIU dump` reached CRIU too (one process group), which died; the
    # command cleaned up but said "CRIU dump failed" (exit 7) instead of interrupted (130)
    import signal

    from vllm_snapshot.host import interrupts

    def dump_cut_by_sigint(snapshot, allow=frozenset(), tools=None):
        interrupts._state["fired"] = signal.SIGINT  # what the handler records
        raise CriuError("CRIU dump failed; log excerpt: (00.742236) page-xfer: p 0x556c", hint="full log: /x.log")

    monkeypatch.setattr(ops, "verify", stand_in(ops.verify, dump_cut_by_sigint))
    monkeypatch.setattr(common, "root_only", lambda what: None)
    (tmp_path / "some-name").mkdir()
    (tmp_path / "some-name" / "manifest.json").write_text("{}")  # a name that exists (verify is the fake)
    assert cli.main(["--root", str(tmp_path), "verify", "some-name"]) == 130
    err = capsys.readouterr().err
    assert "interrupted by SIGINT" in err and "CRIU dump failed" in err and "full log: /x.log" in err
    interrupts.reset()
    assert cli.main(["--root", str(tmp_path), "verify", "some-name"]) == 130  # fired again by the fake
    interrupts.reset()
    # what CRIU said comes whole, not "what they reported: CRIU dump failed; log excerpt:)"
    for said, expect in (("CRIU dump failed; log excerpt:\n(00.1) x\n(00.2) Error (cr-dump.c:9): Interrupted",
                          "what they reported: CRIU dump failed (Error (cr-dump.c:9): Interrupted))"),
                         ("CRIU dump failed; log excerpt:\n", "what they reported: CRIU dump failed (its log: /k.log))"),
                         ("CRIU dump failed; its log /k.log is empty", "CRIU dump failed; its log /k.log is empty)")):
        def cutting(said):
            def cut(snapshot, allow=frozenset(), tools=None):
                interrupts._state["fired"] = signal.SIGINT
                raise CriuError(said, hint="full log: /k.log", details={"log": "/k.log"})
            return cut

        interrupts.reset()
        monkeypatch.setattr(ops, "verify", stand_in(ops.verify, cutting(said)))
        assert cli.main(["--root", str(tmp_path), "verify", "some-name"]) == 130
        err = capsys.readouterr().err
        assert expect in err and "excerpt:)" not in err, err
    interrupts.reset()
    def plain(snapshot, allow=frozenset(), tools=None):
        raise CriuError("plain failure")

    monkeypatch.setattr(ops, "verify", stand_in(ops.verify, plain))
    assert cli.main(["--root", str(tmp_path), "verify", "some-name"]) == 7  # no signal: CRIU's own code


HANDOFF_SCRIPT = r"""
import os, signal, sys
from vllm_snapshot.cli import app as cli, common, render; from vllm_snapshot import ops

class Engine:
    def close(self):
        pass

def fake_restore(req, rep, tools=None):  # a detached engine now serves and is registered
    return object(), Engine()

def show(r, as_json=False, quiet=False):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the result is printed
    print("serving (engine PID 4242)")

ops.restore = fake_restore
render.show = show
common.root_only = lambda what: None
common.resolve = lambda ref: ref
sys.argv = ["vllm-snapshot", "restore", "snap", "--port", "18999", "--detach", "-q"]
sys.exit(cli.main())
"""


def test_a_signal_after_a_detached_engine_was_handed_off_does_not_say_interrupted():
    # a trial: Ctrl-C right after `restore --detach` succeeded exited 130 with the engine serving
    import subprocess
    import sys

    cp = subprocess.run([sys.executable, "-c", HANDOFF_SCRIPT], capture_output=True, text=True, timeout=120,
                        cwd=Path(__file__).resolve().parent.parent)
    assert cp.returncode == 0, (cp.returncode, cp.stdout, cp.stderr)
    assert "serving (engine PID 4242)" in cp.stdout and "interrupted" not in cp.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="delete checks root first")
def test_a_file_as_snapshot_or_as_root_is_a_usage_error_that_says_so(tmp_path, monkeypatch, capsys):
    # a trial: `delete FILE` said "no manifest.json ... a directory" (exit 5); `--root FILE
    # restore x` said "x does not exist"; `--root FILE prune` said "nothing to prune"
    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    f = tmp_path / "afile"
    f.write_text("hi")
    assert cli.main(["delete", str(f)]) == 2
    assert "is not a directory (a snapshot is a directory)" in capsys.readouterr().err and f.read_text() == "hi"
    # a trial: `delete /tmp/notsnap` (a directory, no manifest) was exit 5 corrupt-snapshot
    d = tmp_path / "notsnap"
    (d / "sub").mkdir(parents=True)
    assert cli.main(["delete", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"error [usage]: {d} is not a snapshot (it has no manifest.json); nothing was deleted" in err, err
    assert (d / "sub").is_dir()
    for argv in (["restore", "x", "--port", "18999"], ["prune", "--dry-run"], ["list"], ["inspect", "x"]):
        assert cli.main(["--root", str(f), *argv]) == 2, argv
        assert f"the snapshot root {f} is not a directory" in capsys.readouterr().err, argv


def test_holders_are_named_by_their_script_and_engines_as_engines():
    # a trial: "in use by 23096 (…/vllm-snapshot --root /var/tmp/trial-root )" lost the subcommand;
    # a port held by our engine read "…engine.main {"model": "/var/cache/vllm-snapshot/models/tin"
    from vllm_snapshot.host import procs

    venv = "/var/cache/vllm-snapshot/venv/bin"
    assert procs.brief([f"{venv}/python3.11", f"{venv}/vllm-snapshot", "--root", "/var/tmp/trial-root", "restore",
                        "trial-b", "--port", "18031"]) == "vllm-snapshot --root /var/tmp/trial-root restore trial-b --port 18031"
    for program in ("vllm_snapshot.entrypoints.engine_root", "vllm_snapshot.engine.main"):  # today's, and a restored old one
        assert procs.brief([f"{venv}/python", "-m", program,
                            '{"model": "/var/cache/vllm-snapshot/models/tiny-llama", "engine_args": []}']) \
            == "vllm-snapshot engine (model /var/cache/vllm-snapshot/models/tiny-llama)"
    assert procs.brief(["/usr/bin/python3", "-m", "http.server", "8000"]) == "python3 -m http.server 8000"
    assert procs.brief(["sleep", "60"]) == "sleep 60"


def test_a_switch_to_what_already_serves_says_nothing_was_switched(capsys):
    # a trial: stderr said "nothing to switch", stdout "switched port 18020 ... = 0.00 s"
    from vllm_snapshot.cli import render
    from vllm_snapshot.report.results import Switched

    render.show(Switched("/s/trial-b", 18020, 4242, "http://127.0.0.1:18020", 0.0, 0.0, 0.0, [], unchanged=True))
    assert capsys.readouterr().out == "port 18020 already serves /s/trial-b (engine PID 4242): nothing switched\n"
    render.show(Switched("/s/trial-b", 18020, 4242, "http://127.0.0.1:18020", 0.5, 1.0, 1.5, [4000]))
    assert capsys.readouterr().out.startswith("switched port 18020 to /s/trial-b (engine PID 4242): stop 0.50 s")


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_create_refuses_an_empty_oracle_prompt_before_anything_starts(prompt):
    # a trial: `create ... --oracle-prompt ""` succeeded and recorded the default prompt instead
    t = FakeWorld()
    with pytest.raises(UsageError, match="--oracle-prompt is empty") as ei:
        ops.create(ops.CreateRequest(model="/m", target=SNAP, engine_args=["--kv-cache-memory-bytes", "1M"],
                                     oracle_prompt=prompt), Reporter(), tools=t.tools)
    assert ei.value.exit_code == 2 and "leave the option out" in ei.value.hint
    assert "launch_engine" not in t.calls and "prepare_target" not in t.calls


def test_create_command_hands_an_empty_oracle_prompt_on_instead_of_the_default(monkeypatch, tmp_path):
    seen = {}

    def fake_create(req, rep, tools=None):
        seen["prompt"] = req.oracle_prompt
        from vllm_snapshot.ops.create import check_oracle_prompt

        check_oracle_prompt(req.oracle_prompt)

    monkeypatch.setattr(ops, "create", stand_in(ops.create, fake_create))
    assert cli.main(["create", str(tmp_path), "--snapshot-dir", str(tmp_path / "s"), "--oracle-prompt", "", "-q"]) == 2
    assert seen["prompt"] == ""


def test_prune_keep_keeps_usable_snapshots_first_and_breaks_ties_by_last_restore(tmp_path, monkeypatch):
    # a trial: two snapshots made the same second; `prune --keep 1` dropped the usable, restored
    # one and kept the copy a restore had refused (the tie went to the path's sort order)
    from helpers import make_manifest

    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    for name in ("demo", "democopy", "demo-old"):  # no images to check on disk: the ranking is what is tested
        write_snapshot_dir(root / name, make_manifest(images=(), created_at="2026-12-03T10:00:00+00:00"
                                                      if name != "demo-old" else "2026-12-01T10:00:00+00:00"))
        for sub in ("images", "files"):
            (root / name / sub).mkdir(mode=0o700)
    store.record_restore(root / "demo", [])
    store.record_refusal(root / "democopy", "corrupt-snapshot", "image pages-1.img fails its checksum", by="restore")
    r = ops.prune(root, 1, None, True)
    assert sorted(Path(p).name for p in r.deleted) == ["demo-old", "democopy"]
    store.record_restore(root / "democopy", [])  # restored since: usable again, and the last restored wins the tie
    r = ops.prune(root, 1, None, True)
    assert sorted(Path(p).name for p in r.deleted) == ["demo", "demo-old"]
