"""Step order of create and restore, through the recording FakeWorld: no root, no CRIU, no
engine; the whole file runs in well under a second."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_snapshot.store import snapkey

from vllm_snapshot import ops
from vllm_snapshot.errors import (
    BusyError,
    CriuError,
    EngineError,
    IncompatibleHostError,
    OracleMismatchError,
    UsageError,
)
from vllm_snapshot.report.progress import Reporter

from fakes import HOST, FakeEngine, FakeEngineTools, FakeModelTools, FakeWorld, isolated_manifest, manifest_with
from helpers import make_canary, make_manifest, make_oracle

SNAP = Path("/snaps/tiny")


def _restore(t: FakeWorld, **kw):
    return ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123, **kw), Reporter(), tools=t.tools)


def _create(t: FakeWorld, **kw):
    req = ops.CreateRequest(model="/models/tiny", target=SNAP, engine_args=["--kv-cache-memory-bytes", "64M"], **kw)
    return ops.create(req, Reporter(), tools=t.tools)


def _before(calls: list[str], a: str, b: str) -> bool:
    return a in calls and b in calls and calls.index(a) < calls.index(b)


# ------------------------------------------------------------------ restore

def test_restore_happy_path_order():
    t = FakeWorld()
    r, engine = _restore(t)
    c = t.calls
    order = ["snapshot_lock", "open_snapshot", "host_identity", "check_external_mounts", "port_free", "check_tree_files",
             "verify_model:quick", "stage_checking", "put_back_remaps", "new_channel", "criu_lock", "listeners_taken",
             "restore_tree", "adopt", "unstage", "engine.oracle", "checksums", "engine.serve", "http_health",
             "http_canary", "register", "record_restore"]
    assert [x for x in c if x in order] == order
    assert r.pid == 5151 and r.url == "http://127.0.0.1:8123" and not engine.killed
    assert t.registered[0].port == 8123


def test_restore_of_an_isolated_snapshot_order():
    """Today's snapshots: the engine has its own network namespace, so no recorded listener can
    collide (no check), CRIU runs without a network lock, and the port is bound here and handed
    over only after the oracle matched."""
    t = FakeWorld(manifest=isolated_manifest())
    r, engine = _restore(t)
    c = t.calls
    order = ["port_free", "stage_checking", "new_channel", "criu_lock", "restore_tree", "adopt", "engine.oracle",
             "checksums", "serve_engine", "engine.serve", "http_health", "http_canary", "register"]
    assert [x for x in c if x in order] == order
    assert "listeners_taken" not in c
    assert t.restore_opts.network_lock == "skip"
    assert r.url == "http://127.0.0.1:8123"


def test_restore_of_a_host_network_snapshot_keeps_the_old_path():
    """Snapshots made before (``engine.network`` ``host``): listeners checked, the engine binds."""
    t = FakeWorld(manifest=manifest_with())
    _restore(t)
    assert "listeners_taken" in t.calls and "serve_engine" not in t.calls and "engine.serve" in t.calls
    assert t.restore_opts.network_lock is None


def test_isolated_oracle_mismatch_never_binds():
    t = FakeWorld(manifest=isolated_manifest(), oracles=[make_oracle(logprob=-9.0)])
    with pytest.raises(OracleMismatchError):
        _restore(t)
    assert "serve_engine" not in t.calls and t.engine.killed


def test_isolated_port_taken_at_bind_kills_the_tree():
    """The port was free at validation but taken before the bind: refused, nothing left."""
    t = FakeWorld(manifest=isolated_manifest(), fail={"serve_engine": BusyError("port 127.0.0.1:8123 is not free")})
    with pytest.raises(BusyError):
        _restore(t)
    assert t.engine.killed and t.engine.closed and "register" not in t.calls


def test_create_records_an_isolated_network_and_dumps_without_network_lock():
    t = FakeWorld()
    m = _create(t).manifest
    assert m.engine.network == "isolated"
    assert t.dump_opts.network_lock == "skip"
    assert m.criu.dump_argv[-2:] == ("--network-lock", "skip")


def test_create_refuses_a_tree_that_is_not_network_isolated():
    from vllm_snapshot.errors import UnsnapshottableError

    t = FakeWorld()
    t.net_problems = ("it shares the supervisor's network namespace (net:[1])",)
    with pytest.raises(UnsnapshottableError, match="not in an isolated, loopback-only network namespace"):
        _create(t)
    assert "dump" not in t.calls and "publish" not in t.calls and t.engine.killed


def test_restore_image_checksum_mismatch_found_after_criu_kills_the_tree_before_any_bind():
    """Uncompressed images are verified while CRIU restores from their hard links; the verdict
    comes before the port is bound: a mismatch kills the restored tree, nothing is served."""
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld(manifest=isolated_manifest())
    t.corrupt_images = CorruptSnapshotError("image pages-1.img fails its checksum")
    with pytest.raises(CorruptSnapshotError, match="pages-1.img"):
        _restore(t)
    assert _before(t.calls, "restore_tree", "checksums") and _before(t.calls, "engine.oracle", "checksums")
    assert not {"serve_engine", "engine.serve", "http_health", "register"} & set(t.calls)
    assert t.engine.killed and "unstage_all" in t.calls


def test_restore_failure_before_the_verdict_waits_for_it_after_the_tree_is_stopped():
    """Intact images: the original failure is reported; the verdict was awaited only after the
    restored engine was killed."""
    t = FakeWorld(manifest=isolated_manifest(), oracles=[make_oracle(logprob=-9.0)])
    with pytest.raises(OracleMismatchError):
        _restore(t)
    assert "checksums" in t.calls and t.engine.killed and "serve_engine" not in t.calls


def test_criu_failure_on_corrupt_images_reports_the_checksum():
    """CRIU (or the engine) failing on corrupt images: the checksum mismatch is the error, with
    the failure it caused in its message."""
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld(manifest=isolated_manifest(), fail={"restore_tree": CriuError("criu restore failed: see log")})
    t.corrupt_images = CorruptSnapshotError("image pages-1.img fails its checksum")
    with pytest.raises(CorruptSnapshotError, match="pages-1.img") as ei:
        _restore(t)
    assert "criu restore failed" in str(ei.value) and isinstance(ei.value.__cause__, CriuError)
    assert "unstage_all" in t.calls and "register" not in t.calls


def test_interrupted_restore_stops_the_checksum_thread():
    from vllm_snapshot.errors import Interrupted

    t = FakeWorld(manifest=isolated_manifest(), fail={"restore_tree": Interrupted("signal 2")})
    with pytest.raises(Interrupted):
        _restore(t)
    assert "checksums.cancel" in t.calls and "checksums" not in t.calls


def test_restore_uses_the_recorded_criu_flags():
    m = manifest_with()
    t = FakeWorld(manifest=m)
    _restore(t)
    assert t.restore_opts.flags == m.criu.flags == ("shell-job", "ext-unix-sk")  # not today's defaults
    assert t.restore_opts.inherit_fds == (("pipe:[123]", 10),)


def test_restore_refuses_unknown_recorded_flag_before_criu():
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld(manifest=manifest_with(criu=manifest_with().criu.model_copy(update={"flags": ("tcp-close",)})))
    with pytest.raises(CorruptSnapshotError, match="tcp-close"):
        _restore(t)
    assert "restore_tree" not in t.calls and "stage_checking" not in t.calls


def test_every_refusal_of_one_restore_is_said_at_once_with_the_first_ones_exit_code():
    # a trial: the operator fixed the kernel, reran, met the mounts, fixed them, met the model...
    from vllm_snapshot.errors import ModelChangedError

    t = FakeWorld(host={**HOST, "kernel": "6.1.0", "torch": "2.14.0"},
                  fail={"verify_model:quick": ModelChangedError("model files differ: config.json changed",
                                                                hint="put the model back, or re-create")})
    t.mount_problems = ["/models: nfs server:/a, now ext4 /dev/sdb1"]
    with pytest.raises(IncompatibleHostError) as e:
        _restore(t)
    msg = e.value.message
    assert msg.startswith("this host differs from the one the snapshot was created on:\n  "), msg
    assert "kernel" in msg and "torch" in msg, msg
    assert "and 2 more problems (fix each before running it again):" in msg, msg
    assert "  - [incompatible-host] mounts the snapshot binds from the host differ:\n      /models: nfs" in msg, msg
    assert "  - [model-changed] model files differ: config.json changed\n    hint: put the model back" in msg, msg
    assert e.value.exit_code == 3 and e.value.hint == "restore on a matching host, or re-create the snapshot here"
    assert isinstance(e.value.details, list)  # the identity's differing fields, as when it was alone
    # fail-closed as before: nothing probed, staged or run
    assert not {"stage_checking", "criu_lock", "restore_tree", "port_free", "register"} & set(t.calls)


def test_a_taken_port_stops_the_checks_before_the_model_is_checked():
    from vllm_snapshot.errors import ModelChangedError

    t = FakeWorld(fail={"port_free": BusyError("port 8123 is in use by PID 7 (nc)"),
                        "verify_model:quick": ModelChangedError("model files differ")})
    with pytest.raises(BusyError) as e:
        _restore(t)
    assert e.value.message == "port 8123 is in use by PID 7 (nc)" and "verify_model:quick" not in t.calls


def test_combined_refusals_keep_the_first_ones_class_and_list_the_others_in_details():
    from vllm_snapshot.errors import ModelChangedError
    from vllm_snapshot.errors import combined

    first = ModelChangedError("weights file /w changed", hint="serve builds a new one", details={"weights": "/w"})
    other = UsageError("the engine user cannot read /m", hint="setfacl -m u:vllm-snapshot:rx /m")
    assert combined([first]) is first
    both = combined([first, other])
    assert type(both) is ModelChangedError and both.exit_code == 4 and both.hint == "serve builds a new one"
    assert both.message == ("weights file /w changed\nand 1 more problem (fix each before running it again):\n"
                            "  - [usage] the engine user cannot read /m\n    hint: setfacl -m u:vllm-snapshot:rx /m")
    assert both.details == {"weights": "/w", "also": [{"code": "usage", "exit_code": 2, "message": other.message,
                                                        "hint": other.hint}]}


def test_identity_mismatch_never_calls_criu():
    t = FakeWorld(host={**HOST, "kernel": "6.1.0"})
    with pytest.raises(IncompatibleHostError, match="kernel"):
        _restore(t)
    assert not {"stage_checking", "criu_lock", "restore_tree", "port_free", "register"} & set(t.calls)


def test_port_is_checked_before_the_model_is_rehashed():
    t = FakeWorld(fail={"port_free": BusyError("port 127.0.0.1:8123 is not free")})
    with pytest.raises(BusyError):
        ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123, verify_model="full"), Reporter(), tools=t.tools)
    assert "port_free" in t.calls
    assert not any(c.startswith("verify_model") for c in t.calls)
    assert "check_tree_files" not in t.calls and "restore_tree" not in t.calls


def test_oracle_mismatch_kills_the_tree_and_never_binds():
    t = FakeWorld(oracles=[make_oracle(logprob=-9.0)])
    with pytest.raises(OracleMismatchError, match="logprob"):
        _restore(t)
    assert t.engine.killed and t.engine.closed
    assert "engine.serve" not in t.engine.sent and "http_health" not in t.calls
    assert "register" not in t.calls


def test_canary_mismatch_kills_the_served_engine():
    t = FakeWorld(canary_diffs=["canary logprob: expected -1.25, got nan"])
    with pytest.raises(OracleMismatchError, match="canary"):
        _restore(t)
    assert t.engine.killed and "register" not in t.calls


def test_busy_recorded_listener_refused_before_criu():
    t = FakeWorld()
    t.tools.host.listeners_taken = lambda listeners: (t.calls.append("listeners_taken"), ["127.0.0.1:40000 is taken"])[1]
    with pytest.raises(BusyError, match="40000"):
        _restore(t)
    assert "restore_tree" not in t.calls
    assert "unstage_all" in t.calls and t.channel.closed  # staging removed, pipes closed


def test_criu_restore_failure_removes_staging_and_names_the_kept_log():
    err = CriuError("CRIU restore failed; log excerpt:\n...", hint="full log: /var/log/vllm-snapshot/criu-restore-x.log")
    t = FakeWorld(fail={"restore_tree": err})
    with pytest.raises(CriuError) as ei:
        _restore(t)
    assert "unstage_all" in t.calls and t.channel.closed
    assert ei.value.hint.endswith("criu-restore-x.log")


def test_cleanup_failure_is_reported_with_the_failure_that_caused_it():
    t = FakeWorld(oracles=[make_oracle(token_id=99)], fail={"cleanup_remaps": OSError(30, "Read-only file system")})
    with pytest.raises(OracleMismatchError) as ei:
        _restore(t)
    msg = ei.value.message
    assert msg.startswith("the restored engine's oracle differs")
    assert "cleanup after this failure also failed" in msg and "Read-only file system" in msg


def test_detach_log_file_checked_during_validation():
    t = FakeWorld(fail={"check_log_file": UsageError("--log-file /nope/x.log: /nope does not exist")})
    with pytest.raises(UsageError):
        _restore(t, detach=True, log_file=Path("/nope/x.log"))
    assert "stage_checking" not in t.calls


def test_a_detached_restore_warns_when_the_log_files_filesystem_is_nearly_full():
    # a trial: a full 1 MiB tmpfs as --log-file's home gave rc 0 and no word
    t = FakeWorld()
    t.log_room = 512 * 1024
    r, _engine = _restore(t, detach=True, log_file=Path("/mnt/full/t.log"))
    said = [w for w in r.warnings if "/mnt/full/t.log" in w]
    assert said and "512.0 KiB free" in said[0] and "--log-file" in said[0], r.warnings
    t = FakeWorld()
    t.log_room = 10 * 1024 ** 3
    assert not [w for w in _restore(t, detach=True)[0].warnings if "free:" in w]


def test_prune_lists_the_partial_pulls_it_keeps_with_their_size(capsys):
    from vllm_snapshot.cli import render

    part = {"path": "/var/lib/vllm-snapshot/.pull-ab12", "bytes": 471 << 20, "age_s": 7200.0, "live": False}
    for dry in (True, False):
        t = FakeWorld()
        t.partial_pulls = [part]
        r = ops.prune(Path("/var/lib/vllm-snapshot"), None, None, dry, tools=t.tools)
        assert r.partial_pulls == [part] and r.to_json()["partial_pulls"] == [part]
        render.show(r, False)
        out = capsys.readouterr().out
        assert ("kept the partial pull /var/lib/vllm-snapshot/.pull-ab12 (471.0 MiB, last written 2.0 h ago) for "
                "resuming: the same pull resumes from it; `rm -r /var/lib/vllm-snapshot/.pull-ab12` removes it") in out


def test_cuda_restore_wakes_before_the_oracle():
    m = manifest_with(engine=manifest_with().engine.model_copy(update={"kind": "cuda", "sleep_level": 2,
                                                                      "full_state_captured": False}))
    t = FakeWorld(manifest=m)
    _restore(t)
    assert t.engine.sent == ["attach", "wake", "oracle", "serve"]


def test_cuda_restore_waits_for_the_wake_as_long_as_the_rehearsal_allowed():
    """Review gpu-path-2 M4: restore waited 300 s for ``woken`` where create's rehearsal waits
    600 s, so a model whose reload took 300-600 s at create never restored. Now: at least the
    rehearsal's allowance, and twice the rehearsal's measured wake (recorded at create)."""
    from vllm_snapshot.ops.create import WAKE_TIMEOUT_S

    t = FakeWorld(kind="cuda")
    m = _create(t).manifest
    assert m.engine.rehearsal_wake_s == 1.0  # FakeWorld' clock: one tick per call
    assert t.engine.timeouts["woken"] == WAKE_TIMEOUT_S
    engine = m.engine.model_copy(update={"kind": "cuda", "sleep_level": 2, "full_state_captured": False})
    r = FakeWorld(manifest=manifest_with(engine=engine))
    _restore(r)
    assert r.engine.timeouts["woken"] == WAKE_TIMEOUT_S
    slow = FakeWorld(manifest=manifest_with(engine=engine.model_copy(update={"rehearsal_wake_s": 450.0})))
    _restore(slow)
    assert slow.engine.timeouts["woken"] == 900.0


def _cuda_manifest(level: int):
    return manifest_with(engine=manifest_with().engine.model_copy(update={"kind": "cuda", "sleep_level": level,
                                                                         "full_state_captured": False}))


def test_level2_restore_rechecks_the_model_after_the_wake_before_the_bind():
    """Issue 29 S1: the wake reloads the weights from disk after the model check; the files are
    compared with the stats that check saw (taken before it) once the engine is woken."""
    t = FakeWorld(manifest=_cuda_manifest(2))
    _restore(t)
    c = t.calls
    order = ["model_stats", "verify_model:quick", "restore_tree", "engine.wake", "recheck_model", "engine.oracle",
             "engine.serve", "register"]
    assert [x for x in c if x in order] == order
    pinned, since_ns = t.rechecked
    assert pinned == t.manifest.model.files and since_ns == int(t.tools.clock.now() * 1e9)


@pytest.mark.parametrize("level", [0, 1])
def test_no_recheck_when_the_wake_reads_nothing_from_disk(level):
    t = FakeWorld(manifest=_cuda_manifest(level) if level else manifest_with())
    _restore(t)
    assert "recheck_model" not in t.calls and "engine.serve" in t.calls


def test_a_level2_wake_from_the_weights_file_rechecks_no_model_file():
    # the wake copied the weights from the weights file (checked before CRIU, written once),
    # not from the model directory: nothing there to re-check; the weights file's check came first
    m = _cuda_manifest(2)
    w = FakeWorld().weights_file.model_copy(update={"use": "wake"})
    t = FakeWorld(manifest=m.model_copy(update={"weights": w}))
    _restore(t)
    c = t.calls
    assert "recheck_model" not in c and _before(c, "check_weights", "restore_tree")
    assert _before(c, "engine.wake", "engine.oracle") and "engine.serve" in c


def test_a_gpu_create_with_a_weights_file_serves_the_channel_and_records_the_wake_source():
    t = FakeWorld(kind="cuda")
    t.device = "cuda"
    m = _create(t, weights="file").manifest
    assert _before(t.calls, "weights_channel", "engine.sleep") and m.weights is not None and m.weights.use == "wake"
    auto = _cuda_world()
    a = _create(auto).manifest
    assert a.weights is None and "weights_channel" not in auto.calls  # auto: in-image on a GPU
    assert a.key.parts["engine"] != m.key.parts["engine"]  # part of the key: a build with the default never reuses it
    level1 = _cuda_world()
    with pytest.raises(UsageError, match="source of the level-2 wake; with --sleep-level 1"):
        _create(level1, weights="file", sleep_level=1)
    assert "launch_engine" not in level1.calls and "prepare_target" not in level1.calls


def _cuda_world() -> FakeWorld:
    t = FakeWorld(kind="cuda")
    t.device = "cuda"
    return t


def test_model_changed_at_the_wake_refuses_before_anything_serves():
    from vllm_snapshot.errors import ModelChangedError

    t = FakeWorld(manifest=_cuda_manifest(2), fail={"recheck_model": ModelChangedError("model.safetensors changed")})
    with pytest.raises(ModelChangedError):
        _restore(t)
    assert "engine.oracle" not in t.calls and "engine.serve" not in t.calls and "register" not in t.calls
    assert t.engine.killed and "unstage_all" in t.calls


# ------------------------------------------------------------------ create

def test_create_happy_path_order_and_scrubbed_env():
    t = FakeWorld()
    res = _create(t)
    order = ["require_root", "criu_version", "resolve_model", "check_mounts", "snapshot_lock", "prepare_target",
             "digest_model", "launch_engine", "host_identity", "engine.prepare-dump", "inspect_tree",
             "channel_keys", "external_mounts", "dump",
             "wait_gone", "engine.close", "collect_remaps", "pack:images", "pack:files", "cleanup_remaps",
             "publish"]
    assert [x for x in t.calls if x in order] == order
    assert "HF_TOKEN" not in t.launch_env and t.launch_env["HF_HUB_OFFLINE"] == "1"
    assert res.manifest.criu.inherit == {"control": "pipe:[1]", "log": "pipe:[2]", "events": "pipe:[3]"}
    # the key covers what the engine reported of its args and the host it was made on
    k = res.manifest.key
    assert k is not None and k.normalized_args == {"args": "--kv-cache-memory-bytes 64M"}
    assert k.parts["host"] == snapkey.host_part(res.manifest.host)
    assert k.value == snapkey.combine(k.parts)
    assert res.manifest.criu.dump_argv[:3] == ("dump", "-t", "4242")
    assert "discard" not in t.calls
    assert res.manifest.engine.env_scrubbed is True  # push requires it


def test_create_records_that_keep_env_let_a_variable_through():
    res = _create(FakeWorld(), keep_env=("HF_TOKEN",))
    assert res.manifest.engine.env_scrubbed is False  # push refuses this snapshot
    res = _create(FakeWorld(), keep_env=("NOT_SET_HERE",))  # nothing added: still scrubbed
    assert res.manifest.engine.env_scrubbed is True


def test_create_refuses_unsized_cpu_kv_cache_before_the_engine_starts():
    t = FakeWorld()
    with pytest.raises(UsageError, match="KV cache"):
        ops.create(ops.CreateRequest(model="/m", target=SNAP), Reporter(), tools=t.tools)
    assert "launch_engine" not in t.calls and "prepare_target" not in t.calls


def test_create_refuses_a_model_the_engine_cannot_see_before_it_starts():
    t = FakeWorld()
    with pytest.raises(UsageError, match="/dev/shm"):
        ops.create(ops.CreateRequest(model="/dev/shm/m", target=SNAP, engine_args=["--kv-cache-memory-bytes", "1M"]),
                   Reporter(), tools=t.tools)
    assert "launch_engine" not in t.calls


def test_rehearsal_mismatch_publishes_nothing_and_kills_the_engine():
    t = FakeWorld(kind="cuda", oracles=[make_oracle(), make_oracle(logprob=-2.0)])
    with pytest.raises(OracleMismatchError, match="rehearsal"):
        _create(t)
    assert "publish" not in t.calls and "dump" not in t.calls
    assert t.engine.killed and t.discarded == [SNAP.parent / ".tiny.tmp-x"]


def test_create_records_the_canary_beside_the_oracle_not_in_the_key():
    res = _create(FakeWorld())
    assert res.manifest.canary == make_canary() and res.manifest.oracle == make_oracle()
    none = FakeWorld()
    none.canary = None  # an engine root that records no canary: restores ask the oracle's prompt
    plain = _create(none).manifest
    assert plain.canary is None and plain.key == res.manifest.key


def test_rehearsal_asks_the_canary_with_its_prompt_and_refuses_a_changed_one(monkeypatch):
    t = FakeWorld(kind="cuda")
    assert _create(t).manifest.canary == make_canary()
    assert [c for c in t.calls if c.startswith("engine.")][:5] == [
        "engine.sleep", "engine.wake", "engine.oracle", "engine.oracle", "engine.sleep"]
    real = FakeEngine.wait_event

    def woken_changes_the_canary(self, name, timeout):  # the reload moved the canary's logprob only
        ev = real(self, name, timeout)
        if name == "woken":
            self.canary = make_canary(logprob=-0.75)
        return ev

    monkeypatch.setattr(FakeEngine, "wait_event", woken_changes_the_canary)
    changed = FakeWorld(kind="cuda")
    with pytest.raises(OracleMismatchError, match="rehearsal changed the canary") as ei:
        _create(changed)
    assert "logprob" in ei.value.message and ei.value.exit_code == 6
    assert "publish" not in changed.calls and changed.engine.killed


def test_failed_dump_removes_the_temp_dir_and_keeps_the_criu_log():
    err = CriuError("CRIU dump failed; log excerpt:\nError (criu/mount.c): FS mnt ./mnt/x unsupported",
                    hint="full log: /var/log/vllm-snapshot/criu-dump-x.log")
    t = FakeWorld(fail={"dump": err})
    with pytest.raises(CriuError) as ei:
        _create(t)
    assert t.discarded and "publish" not in t.calls and t.engine.killed
    assert ei.value.hint == "full log: /var/log/vllm-snapshot/criu-dump-x.log"


def test_create_cleanup_failure_reported_with_its_cause():
    t = FakeWorld(fail={"dump": CriuError("CRIU dump failed"), "discard": OSError(16, "Device or resource busy")})
    with pytest.raises(CriuError) as ei:
        _create(t)
    assert ei.value.message.startswith("CRIU dump failed")
    assert "remove the temp dir" in ei.value.message and "Device or resource busy" in ei.value.message


def test_survivors_of_the_dump_fail_the_create():
    from vllm_snapshot.errors import EngineError

    t = FakeWorld()
    t.tools.checkpoint.wait_gone = lambda pids, timeout_s: [pids[1]]
    with pytest.raises(EngineError, match="survived the dump"):
        _create(t)
    assert "publish" not in t.calls and t.discarded


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_create_rechecks_the_model_after_the_engine_loaded_it_before_the_dump(kind):
    """Issue 29 S1: the digest taken before the cold start is compared again once the engine
    has read the files (its start and, on GPU, the rehearsal's wake), before the dump."""
    t = FakeWorld(kind=kind)
    res = _create(t)
    c = t.calls
    assert _before(c, "digest_model", "launch_engine") and _before(c, "launch_engine", "recheck_model")
    assert _before(c, "recheck_model", "dump")
    if kind == "cuda":  # after the rehearsal's wake (reload) and its last sleep
        assert max(i for i, x in enumerate(c) if x.startswith("engine.sleep")) < c.index("recheck_model")
        assert _before(c, "engine.wake", "recheck_model")
    pinned, since_ns = t.rechecked
    assert pinned == res.manifest.model.files and since_ns == int(t.tools.clock.now() * 1e9)


def test_model_changed_while_the_engine_loaded_refuses_the_create():
    from vllm_snapshot.errors import ModelChangedError

    t = FakeWorld(fail={"recheck_model": ModelChangedError("model.safetensors changed")})
    with pytest.raises(ModelChangedError):
        _create(t)
    assert "dump" not in t.calls and "publish" not in t.calls
    assert t.engine.killed and t.discarded == [SNAP.parent / ".tiny.tmp-x"]


def test_signals_are_held_once_the_engine_serves_validated_and_released_only_in_the_foreground():
    # the hold goes through the seam (a module-global hold left by an in-process detached
    # restore once made a later test's SIGTERM vanish)
    from vllm_snapshot.host import interrupts

    held = interrupts._state["depth"]
    t = FakeWorld()
    _restore(t, detach=True)
    assert _before(t.calls, "http_canary", "hold_signals") and "release_signals" not in t.calls
    t = FakeWorld()
    _restore(t, detach=False)
    assert _before(t.calls, "hold_signals", "register") and _before(t.calls, "register", "release_signals")
    assert interrupts._state["depth"] == held  # nothing held in this process by the fakes


# ------------------------------------------------------------------ management

def test_switch_stops_the_old_engine_then_restores_detached():
    from vllm_snapshot.store.registry import Entry

    t = FakeWorld()
    t.entries = [Entry("/snaps/old", 77, 0, "127.0.0.1", 8123, 0.0, "detached")]
    res = ops.switch(SNAP, "127.0.0.1", 8123, None, Reporter(), tools=t.tools)
    assert _before(t.calls, "stop_engine", "restore_tree")
    assert res.stopped == [77] and res.pid == 5151 and t.registered[0].mode == "detached"


def test_delete_refuses_while_an_engine_runs():
    from vllm_snapshot.store.registry import Entry

    t = FakeWorld()
    t.tools.host.path_exists = lambda p: True
    t.entries = [Entry(str(SNAP), 77, 0, "127.0.0.1", 8123, 0.0, "detached")]
    with pytest.raises(BusyError):
        ops.delete(SNAP, tools=t.tools)
    assert "delete_snapshot" not in t.calls


def test_list_probes_the_host_once_and_never_rehashes_images():
    t = FakeWorld()
    rows = ops.list_snapshots(Path("/snaps"), tools=t.tools).rows
    assert [r["compatible"] for r in rows] == [True, True]
    assert "verify_images" not in t.calls and "check_tree_files" not in t.calls
    assert "criu_version" not in t.calls  # the identity (with CRIU's version) comes from host_identity


def test_external_mounts_go_to_criu_and_the_manifest_and_are_checked_before_criu():
    from vllm_snapshot.store.manifest import ExternalMount

    ext = ExternalMount(mount_point="/mnt/data", fs_type="ext4", source="/dev/loop0", root="/", major_minor="7:0",
                        cookie="vsnap-m0", identity_kind="uuid", identity="45ab")
    t = FakeWorld()
    t.externals = [ext]
    m = _create(t).manifest
    assert t.dump_opts.external == ("mnt[/mnt/data]:vsnap-m0",)
    assert m.criu.external_mounts == (ext,) and "--external" in m.criu.dump_argv
    t2 = FakeWorld(manifest=m)
    _restore(t2)
    assert t2.restore_opts.external == ("mnt[vsnap-m0]:/mnt/data",)
    t3 = FakeWorld(manifest=m)
    t3.mount_problems = ["/mnt/data: expected ext4 uuid=45ab, found ext4 uuid=7e54 (source /dev/loop2)"]
    with pytest.raises(IncompatibleHostError, match="uuid=7e54") as ei:
        _restore(t3)
    assert ei.value.exit_code == 3
    assert not {"port_free", "stage_checking", "restore_tree"} & set(t3.calls)


def test_create_refuses_unusable_mounts_before_the_engine_starts():
    t = FakeWorld(fail={"check_mounts": UsageError("the engine needs mounts that cannot be checkpointed: /mnt/f (fuse)")})
    with pytest.raises(UsageError, match="fuse"):
        _create(t)
    assert "launch_engine" not in t.calls and "prepare_target" not in t.calls


def test_hf_id_is_served_by_its_id_and_its_revision_recorded():
    class HfModel(FakeModelTools):
        def resolve_model(self, model, revision):
            self.w.calls.append(f"resolve_model:{revision}")
            return Path("/hub/models--acme--tiny/snapshots/abc123"), "abc123"

    t = FakeWorld()
    t.tools = dataclasses.replace(t.tools, model=HfModel(t))
    m = ops.create(ops.CreateRequest(model="acme/tiny", target=SNAP,
                                     engine_args=["--kv-cache-memory-bytes", "1M", "--revision", "v1"]),
                   Reporter(), tools=t.tools).manifest
    assert "resolve_model:v1" in t.calls
    assert t.launch_spec.served_model_name == "acme/tiny" and t.launch_spec.model.endswith("abc123")
    assert m.model.revision == "abc123" and m.model.requested == "acme/tiny"
    t2 = FakeWorld()
    t2.tools = dataclasses.replace(t2.tools, model=HfModel(t2))
    ops.create(ops.CreateRequest(model="acme/tiny", target=SNAP,
                                 engine_args=["--kv-cache-memory-bytes", "1M", "--served-model-name", "x"]),
               Reporter(), tools=t2.tools)
    assert t2.launch_spec.served_model_name is None  # an explicit name wins


def test_cuda_create_records_the_gpu_used_and_restore_places_the_state_by_it():
    from vllm_snapshot.checkpoint.gpu import GpuSlot
    from vllm_snapshot.errors import UnsnapshottableError

    t = FakeWorld(kind="cuda")
    m = _create(t).manifest
    assert m.host["gpu_uuid_used"] == "GPU-fake-0" and m.criu.cuda_pids == (2,)
    assert m.host["gpu_minor_used"] == "0" and m.host["gpu_name_used"] == "Fake GPU"
    ok = FakeWorld(manifest=m)
    r, _ = _restore(ok)
    assert ok.restore_cuda_pids == (2,)  # restore probes the recorded CUDA processes only
    assert ok.restore_gpu_map == () and ok.capacity_uuid == "GPU-fake-0" and r.gpu == "GPU GPU-fake-0"
    assert "gpu_slots" not in ok.calls  # its own GPU is found in /proc: no nvidia-smi on the usual path
    # another GPU of the same model at the same minor (a node of the same class): remapped onto it
    moved = FakeWorld(manifest=m)
    moved.slots = [GpuSlot("GPU-other", "Fake GPU", 0), GpuSlot("GPU-fake-1", "Fake GPU", 1)]
    r, _ = _restore(moved)
    assert moved.restore_gpu_map == (("GPU-fake-0", "GPU-other"),)
    assert "gpu_lock:GPU-other" in moved.calls and moved.capacity_uuid == "GPU-other"
    assert r.gpu == "GPU GPU-other (recorded GPU-fake-0)" and r.to_json()["gpu"] == r.gpu
    assert moved.calls.count("gpu_slots") == 1  # validated once; the placement is kept for the phases
    # no GPU of that model at that minor: refused before anything is staged, naming what is here
    for slots, says in (([GpuSlot("GPU-other", "Other GPU", 0)], "/dev/nvidia0 here is a Other GPU"),
                        ([GpuSlot("GPU-other", "Fake GPU", 1)], "needs a Fake GPU at /dev/nvidia0")):
        gone = FakeWorld(manifest=m)
        gone.slots = slots
        with pytest.raises(IncompatibleHostError, match="used GPU GPU-fake-0, which this host does not have") as ei:
            _restore(gone)
        assert says in ei.value.message and "GPU-other" in ei.value.message
        assert "stage_checking" not in gone.calls and "restore_tree" not in gone.calls
    # the helper cannot remap (driver before r580): refused before CRIU, nothing served
    from vllm_snapshot.errors import EnvironmentProblem

    old = FakeWorld(manifest=m)
    old.uuids = ["GPU-other"]
    old.remap_refusal = EnvironmentProblem("restoring onto another GPU needs a driver that remaps GPUs")
    with pytest.raises(EnvironmentProblem, match="remaps GPUs"):
        _restore(old)
    assert "engine.serve" not in old.calls and "gpu_unlock" in old.calls
    # a snapshot made before the minor and model were recorded: only onto its own GPU
    legacy = make_manifest(engine=m.engine, host={k: v for k, v in m.host.items()
                                                  if k not in ("gpu_minor_used", "gpu_name_used")})
    gone = FakeWorld(manifest=legacy)
    gone.uuids = ["GPU-other"]
    with pytest.raises(IncompatibleHostError, match="made before GPU remapping"):
        _restore(gone)
    nogpu = FakeWorld(kind="cuda", fail={"gpu_used": UnsnapshottableError("no process of its tree has a /dev/nvidia*")})
    with pytest.raises(UnsnapshottableError):
        _create(nogpu)
    assert "dump" not in nogpu.calls


def test_http_canary_sends_the_oracles_request_and_treats_garbage_as_a_mismatch():
    import json as _json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from vllm_snapshot.effects.tools import local_tools

    m = manifest_with()
    replies = [{"choices": [{"text": m.oracle.text, "token_ids": [m.oracle.token_id],
                             "logprobs": {"token_logprobs": [m.oracle.logprob]}}]},
               {"choices": []}, {"choices": [{"text": m.oracle.text, "token_ids": [m.oracle.token_id],
                                              "logprobs": {"token_logprobs": ["NaN"]}}]}]
    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            seen.append(_json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            data = _json.dumps(replies[len(seen) - 1]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        t = local_tools().engine
        assert t.http_canary(url, m) == []
        body = seen[0]
        assert body["min_tokens"] == 1 and body["max_tokens"] == 1 and body["seed"] == 0
        assert body["temperature"] == 0.0 and body["repetition_penalty"] == 1.0 and body["return_token_ids"] is True
        assert any("malformed" in d for d in t.http_canary(url, m))  # no choice: a mismatch, not a crash
        assert any("logprob" in d for d in t.http_canary(url, m))  # NaN: a mismatch
    finally:
        srv.shutdown()


class _Completions:
    """A loopback ``/v1/completions`` answering each prompt with the oracle ``answers`` holds
    for it (another prompt: 404); ``prompts``: the prompts asked, in order."""

    def __init__(self, *answers):
        import json as _json
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        by_prompt = {o.prompt: o for o in answers}
        prompts = self.prompts = []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                prompt = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
                prompts.append(prompt)
                o = by_prompt.get(prompt)
                data = _json.dumps({"choices": [{"text": o.text, "token_ids": [o.token_id],
                                                 "logprobs": {"token_logprobs": [o.logprob]}}]} if o else {}).encode()
                self.send_response(200 if o else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.srv = HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def wire(self, t: FakeWorld) -> None:
        """Make ``t``'s restore run the real HTTP canary against this server."""
        from vllm_snapshot.effects import http

        t.tools.engine.http_canary = lambda url, m, api_key=None: http.canary(self.url, m, api_key)


def test_canary_request_asks_the_recorded_canary_else_the_oracles_prompt():
    from vllm_snapshot.effects.http import canary_expected, canary_request

    new, old = manifest_with(canary=make_canary()), manifest_with()
    assert canary_expected(new) == make_canary() and canary_request(new)["prompt"] == make_canary().prompt
    assert canary_expected(old) == old.oracle and canary_request(old)["prompt"] == old.oracle.prompt
    # the same request otherwise: greedy, one token, seeded, neutral sampling values
    assert {**canary_request(new), "prompt": None} == {**canary_request(old), "prompt": None}


@pytest.mark.parametrize("recorded", [make_canary(), None])
def test_restore_sends_the_recorded_canary_or_for_an_older_snapshot_the_oracles_prompt(recorded):
    srv = _Completions(make_oracle(), make_canary())
    try:
        t = FakeWorld(manifest=manifest_with(canary=recorded))
        srv.wire(t)
        r, engine = _restore(t)
        assert "register" in t.calls and not engine.killed
        assert srv.prompts == [make_canary().prompt if recorded else make_oracle().prompt]
    finally:
        srv.srv.shutdown()


def test_a_wrong_recorded_canary_refuses_as_a_canary_mismatch():
    srv = _Completions(make_oracle(), make_canary())
    try:
        t = FakeWorld(manifest=manifest_with(canary=make_canary(token_id=18, text=" here")))
        srv.wire(t)
        with pytest.raises(OracleMismatchError) as ei:
            _restore(t)
    finally:
        srv.srv.shutdown()
    e = ei.value
    assert e.exit_code == 6 and e.code == "oracle-mismatch"
    assert e.message.startswith("the HTTP canary differs from the oracle; stopped the engine:\n  ")
    assert "canary token_id: expected 18, got 17" in e.message and "canary text: expected ' here'" in e.message
    assert srv.prompts == [make_canary().prompt] and t.engine.killed and "register" not in t.calls


def test_not_enough_memory_refuses_before_staging_or_criu():
    from vllm_snapshot.errors import InsufficientResources
    from vllm_snapshot.host.resources import Offer

    t = FakeWorld()
    t.offer = Offer(1000, "memory cgroup /x (v1): limit 0.00 GiB, in use 0.00 GiB, free 0.00 GiB")
    with pytest.raises(InsufficientResources) as e:
        _restore(t)
    assert "only 0.00 GiB is available: memory cgroup /x" in e.value.message
    assert "stage_checking" not in t.calls and "restore_tree" not in t.calls and "register" not in t.calls
    assert e.value.exit_code == 12


def _entry(pid: int, port: int, host: str = "127.0.0.1", snapshot: str = "/snaps/tiny"):
    from vllm_snapshot.store.registry import Entry

    return Entry(snapshot=snapshot, pid=pid, supervisor_pid=0, host=host, port=port, started_at=0.0, mode="detached")


def test_stop_one_clone_by_pid_or_all_of_a_snapshot():
    t = FakeWorld()
    t.entries = [_entry(11, 8001), _entry(12, 8002), _entry(13, 8003), _entry(14, 8004, snapshot="/snaps/other")]
    assert [s["pid"] for s in ops.stop_engines(None, None, tools=t.tools, pid=12).stopped] == [12]
    assert [s["pid"] for s in ops.stop_engines(SNAP, None, tools=t.tools).stopped] == [11, 12, 13]
    # one port on two loopback addresses: --port stops both
    t.entries = [_entry(21, 8000, "127.0.0.1"), _entry(22, 8000, "127.0.0.2")]
    assert [s["pid"] for s in ops.stop_engines(None, 8000, tools=t.tools).stopped] == [21, 22]
    # nothing matching: nothing to do, as `systemctl stop` of a stopped unit (exit 0)
    none = ops.stop_engines(None, None, tools=t.tools, pid=99)
    assert none.stopped == [] and none.nothing == "no restored engine matches PID 99"
    # a child of an engine tree: named, pointing to the root PID, nothing stopped
    stops = t.calls.count("stop_engine")
    with pytest.raises(UsageError, match="PID 23 is not an engine root: it belongs to the engine with root PID 22") as ei:
        ops.stop_engines(None, None, tools=t.tools, pid=23)
    assert ei.value.hint == "vllm-snapshot stop --pid 22" and t.calls.count("stop_engine") == stops


def test_cuda_create_checks_host_room_and_records_the_freeze_timeout():
    from vllm_snapshot.checkpoint import criu
    from vllm_snapshot.errors import UnsnapshottableError

    t = FakeWorld(kind="cuda")
    m = _create(t).manifest
    assert _before(t.calls, "gpu_used", "check_dump_room") and _before(t.calls, "check_dump_room", "dump")
    # FakeWorld' tree: 2 processes, none holding /dev/nvidia* -> one CUDA process assumed
    assert t.dump_opts.timeout_s == criu.freeze_timeout("cuda", 2, 0, {}) == m.criu.freeze_timeout_s
    assert m.criu.dump_argv[-2:] == ("--timeout", str(m.criu.freeze_timeout_s))
    cpu = FakeWorld()
    assert _create(cpu).manifest.criu.freeze_timeout_s is None and "check_dump_room" not in cpu.calls
    full = FakeWorld(kind="cuda", fail={"check_dump_room": UnsnapshottableError("no room")})
    with pytest.raises(UnsnapshottableError):
        _create(full, sleep_level=0)
    assert "dump" not in full.calls and full.engine.killed and full.published == []


def test_cuda_restore_checks_gpu_capacity_before_criu():
    m = manifest_with(engine=manifest_with().engine.model_copy(update={"kind": "cuda", "sleep_level": 2,
                                                                      "full_state_captured": False}))
    t = FakeWorld(manifest=m)
    _restore(t)
    assert _before(t.calls, "listeners_taken", "check_gpu_capacity") and _before(t.calls, "check_gpu_capacity", "restore_tree")
    busy = FakeWorld(manifest=m, fail={"check_gpu_capacity": BusyError("GPU full")})
    with pytest.raises(BusyError):
        _restore(busy)
    assert "restore_tree" not in busy.calls and "unstage_all" in busy.calls


def test_cuda_restore_holds_the_gpu_lock_from_the_capacity_check_until_the_engine_woke():
    """Review gpu-path-2 M6: two restores onto one GPU both passed the capacity check (the
    memory is taken at the wake, after the CRIU lock); the GPU's lock spans both. Taken before
    staging and the CRIU lock (a waiter holds no staged images and does not block restores onto
    other GPUs), released on failure."""
    engine = manifest_with().engine.model_copy(update={"kind": "cuda", "sleep_level": 2, "full_state_captured": False})
    m = make_manifest(engine=engine, host={**HOST, "gpu_uuid_used": "GPU-fake-0"})
    t = FakeWorld(manifest=m)
    _restore(t)
    c = t.calls
    order = ["verify_model:quick", "gpu_lock:GPU-fake-0", "stage_checking", "criu_lock", "check_gpu_capacity", "restore_tree",
             "engine.wake", "gpu_unlock", "engine.oracle", "engine.serve"]
    assert [x for x in c if x in order] == order
    failed = FakeWorld(manifest=m, fail={"restore_tree": CriuError("criu restore failed")})
    with pytest.raises(CriuError):
        _restore(failed)
    assert failed.calls.count("gpu_unlock") == 1 and _before(failed.calls, "restore_tree", "gpu_unlock")
    cpu = FakeWorld()
    _restore(cpu)
    assert not any(x.startswith("gpu_lock") for x in cpu.calls)


def test_cuda_create_checks_plugin_helper_and_driver_before_the_engine_starts():
    from vllm_snapshot.errors import EnvironmentProblem

    t = FakeWorld(kind="cuda")
    t.device = "cuda"
    _create(t)
    assert _before(t.calls, "check_cuda_ready", "launch_engine")
    old = FakeWorld(kind="cuda", fail={"check_cuda_ready": EnvironmentProblem("driver API 12040 < 12080")})
    old.device = "cuda"
    with pytest.raises(EnvironmentProblem):
        _create(old)
    assert "launch_engine" not in old.calls and "prepare_target" not in old.calls
    cpu = FakeWorld()
    _create(cpu)
    assert "check_cuda_ready" not in cpu.calls


# ------------------------------------------------------------------ code identity (issue 15 item 3)

def test_changed_python_files_refuse_before_the_bind_and_leave_nothing():
    """The code identity runs alongside staging, CRIU and the oracle (like the image checksums)
    and is decided before anything is bound: a changed file kills the restored tree."""
    t = FakeWorld()
    t.code_problems = ["/venv/site-packages/vllm/entrypoints/run_batch.py (vllm 0.32.0) changed since the snapshot was created"]
    with pytest.raises(IncompatibleHostError, match="run_batch.py") as ei:
        _restore(t)
    assert "re-create" in ei.value.hint
    c = t.calls
    assert "check_code" in c and t.engine is not None and t.engine.killed
    assert not {"engine.serve", "serve_engine", "http_health", "register"} & set(c)
    assert "unstage_all" in c  # staging removed


def test_code_check_runs_on_every_restore_and_an_unchanged_tree_serves():
    t = FakeWorld()
    r, engine = _restore(t)
    assert "check_code" in t.calls and not engine.killed and "register" in t.calls


def test_create_pins_the_code_the_engine_imported():
    t = FakeWorld()
    created = _create(t)
    assert t.pinned_modules == ["vllm", "torch"]  # what the engine's dump-ready said
    assert created.manifest.code is not None and created.manifest.code.distributions == {"vllm": "0.32.0"}
    assert _before(t.calls, "dump", "pin_code") and _before(t.calls, "pin_code", "publish")


def test_verify_reports_changed_python_files():
    t = FakeWorld()
    t.code_problems = ["/x/torch/__init__.py (torch 2.13.0) is missing"]
    with pytest.raises(IncompatibleHostError, match="torch/__init__.py"):
        ops.verify(SNAP, tools=t.tools)


def test_a_detached_engine_that_dies_before_health_is_reported_with_its_log(tmp_path):
    # our end of a detached engine's log pipe is /dev/null: the error quotes the log file
    log = tmp_path / "tiny-8123.log"
    from fakes import FakeEngine

    class Dying(FakeEngine):
        def alive(self) -> bool:
            return "http_health" not in self.calls

    class DyingEngineTools(FakeEngineTools):
        def adopt(self, pid, channel, echo):
            super().adopt(pid, channel, echo)
            self.w.engine.__class__ = Dying
            return self.w.engine

    t = FakeWorld()
    t.tools = dataclasses.replace(t.tools, engine=DyingEngineTools(t))
    t.health_after = 10**6  # never healthy
    t.log_file_tail = "ssl.SSLError: ('No cipher can be selected.',)"  # the log file's tail, not the pipe's
    with pytest.raises(EngineError) as ei:
        _restore(t, detach=True, log_file=log)
    e = ei.value
    assert "starting the server" in e.message and "No cipher can be selected" in e.message
    assert "read_log_tail" in t.calls
    assert e.hint == f"full engine log: {log}" and e.details == {"stage": "server-start", "log": str(log)}
    assert t.engine.killed


# ------------------------------------------------------------------ compressed snapshots

def test_compressed_isolated_restore_unpacks_while_criu_starts():
    """The pages images unpack while CRIU starts: CRIU calls ready() (its post-setup-namespaces
    notification) before any task maps memory; the restore goes on only after it."""
    t = FakeWorld(manifest=isolated_manifest())
    t.unpacking = True
    r, engine = _restore(t)
    order = ["stage_checking", "criu_lock", "restore_tree", "unpack_ready", "adopt", "engine.oracle", "checksums",
             "serve_engine", "register"]
    assert [x for x in t.calls if x in order] == order
    assert "unpack_wait" in r.timings


def test_compressed_restore_without_namespaces_unpacks_before_criu():
    t = FakeWorld()
    t.unpacking = True
    r, _engine = _restore(t)
    assert _before(t.calls, "unpack_ready", "restore_tree") and _before(t.calls, "criu_lock", "unpack_ready")
    # CRIU was not held: the wait is the "unpack" phase, and nothing is taken out of CRIU's
    assert "unpack" in r.timings and "unpack_wait" not in r.timings and r.timings["criu_restore"] >= 0


@pytest.mark.parametrize("isolated", [True, False])
def test_a_corrupted_frame_stops_the_restore_before_anything_serves(isolated):
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld(manifest=isolated_manifest()) if isolated else FakeWorld()
    t.unpacking = True
    t.corrupt_frame = t.corrupt_images = CorruptSnapshotError("image pages-1.img.zst fails its checksum (frame 3)")
    with pytest.raises(CorruptSnapshotError, match="frame 3") as ei:
        _restore(t)
    assert "already failed" not in ei.value.message  # reported once, not as the cause of itself
    assert not {"adopt", "engine.oracle", "serve_engine", "engine.serve", "http_health", "register"} & set(t.calls)
    assert "unstage_all" in t.calls


@pytest.mark.parametrize("compressed", [True, False])
def test_a_restore_refused_for_corrupt_images_marks_the_snapshot_for_list_and_prune(compressed):
    # a trial: a restore refused with exit 5 (an image failing its checksum) left `list` at ✓
    # and `prune --unusable` found nothing; serve's refusals were recorded, restore's were not
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld()
    t.unpacking = compressed
    bad = CorruptSnapshotError("image pages-1.img fails its checksum")
    if compressed:
        t.corrupt_frame = bad
    t.corrupt_images = bad
    with pytest.raises(CorruptSnapshotError):
        _restore(t)
    assert t.refusals[str(SNAP)]["code"] == "corrupt-snapshot" and t.refusals[str(SNAP)]["by"] == "restore"
    row = ops.describe(SNAP, t.tools)
    assert row["compatible"] is False and row["why"] == "refused by restore: image pages-1.img fails its checksum"


def test_a_failed_verify_marks_the_snapshot_for_list_and_prune_as_a_refused_restore_does():
    # a trial: `verify NAME` failed with exit 5 (a checksum) and `list` still showed ✓
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld()
    t.snapshots = {SNAP: manifest_with()}  # a store holding it (its manifest is there)
    t.fail["verify_images"] = CorruptSnapshotError("image pages-1.img fails its checksum\n(more)")
    with pytest.raises(CorruptSnapshotError):
        ops.verify(SNAP, tools=t.tools)
    assert t.refusals[str(SNAP)]["code"] == "corrupt-snapshot" and t.refusals[str(SNAP)]["by"] == "verify"
    row = ops.describe(SNAP, t.tools)
    assert row["compatible"] is False and row["why"] == "refused by verify: image pages-1.img fails its checksum"
    del t.fail["verify_images"]  # a passing verify clears it again
    assert ops.verify(SNAP, tools=t.tools).cleared["by"] == "verify"
    assert ops.describe(SNAP, t.tools)["compatible"] is True
    # a directory that is not a snapshot (no manifest) is no snapshot to mark
    other = Path("/snaps/notsnap")
    t.fail["open_snapshot"] = CorruptSnapshotError(f"{other} has no manifest.json")
    with pytest.raises(CorruptSnapshotError):
        ops.verify(other, tools=t.tools)
    assert str(other) not in t.refusals


def test_a_restore_that_fails_for_another_reason_marks_nothing():
    # CRIU, a busy port, the engine: not the snapshot's fault (serve records those, restore does not)
    t = FakeWorld(fail={"restore_tree": CriuError("CRIU restore failed; log excerpt:\nError (x): y")})
    with pytest.raises(CriuError):
        _restore(t)
    assert "record_refusal" not in t.calls and ops.describe(SNAP, t.tools)["compatible"] is True


class _Lines(Reporter):
    """A reporter that keeps its info lines."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)


def test_reclaimed_lock_files_are_not_reported_and_leftovers_one_each():
    # a trial saw 30 "removed a leftover of a killed command: ...lock" lines before one restore,
    # then "removed 5 lock file(s) of snapshot paths that no longer exist" before every one:
    # host-wide bookkeeping, not news about this command
    from vllm_snapshot.ops.cleanup import report_reclaimed

    rep = _Lines()
    report_reclaimed(rep, ["/dev/shm/vllm-snapshot-stage-99-x", "orphaned engine tree PID 7",
                           *(f"/run/vllm-snapshot/locks/{i:032x}.lock" for i in range(30))])
    assert rep.lines == ["removed a leftover of a killed command: /dev/shm/vllm-snapshot-stage-99-x",
                         "removed a leftover of a killed command: orphaned engine tree PID 7"]
    rep = _Lines()
    report_reclaimed(rep, ["/run/vllm-snapshot/locks/0.lock"])
    assert rep.lines == []


def test_reclaimed_empty_cgroups_are_one_line_not_blamed_on_a_killed_command():
    # an engine that exited left its cgroup; the next restore said "a leftover of a killed command"
    from vllm_snapshot.ops.cleanup import report_reclaimed

    rep = _Lines()
    report_reclaimed(rep, ["empty cgroup /sys/fs/cgroup/memory/vllm-snapshot/tiny-8000",
                           "empty cgroup /sys/fs/cgroup/unified/vllm-snapshot/tiny-8000"])
    assert rep.lines == ["removed the empty cgroups of 1 engine(s) that exited: tiny-8000 "
                         "(under /vllm-snapshot in 2 hierarchy path(s))"]


def test_create_refuses_before_the_engine_when_the_last_snapshot_of_the_model_would_not_fit():
    # the trial: a full disk was found only at the dump, after the whole cold start
    from vllm_snapshot.errors import EnvironmentProblem
    from vllm_snapshot.ops.create import check_disk_room

    t = FakeWorld()
    t.room = (("/var/lib/vllm-snapshot/tiny-old", 1300 << 20), 200 << 20)
    with pytest.raises(EnvironmentProblem) as e:
        ops.create(ops.CreateRequest(model="/models/tiny", target=SNAP, engine_args=["--kv-cache-memory-bytes", "64M"]),
                   Reporter(), tools=t.tools)
    assert f"200.0 MiB free on the filesystem of {SNAP.parent}" in e.value.message and "1.3 GiB" in e.value.message
    assert "tiny-old" in e.value.message and "disk_room" in t.calls
    assert "launch_engine" not in t.calls and "prepare_target" not in t.calls
    check_disk_room(Path("/snaps/new"), ("/snaps/old", 100), 100)  # it fits: nothing refused
    check_disk_room(Path("/snaps/new"), None, 0)  # no earlier snapshot: no estimate, nothing refused


def test_disk_room_reads_the_newest_snapshot_of_the_model_beside_the_target(tmp_path):
    import json

    from helpers import write_snapshot_dir

    from vllm_snapshot.effects.tools import local_tools

    root = tmp_path / "root"
    write_snapshot_dir(root / "old")
    m = json.loads((root / "old" / "manifest.json").read_text())
    prev, free = local_tools().store.disk_room(root / "new", Path(m["model"]["path"]))
    assert prev == (str(root / "old"), m["sizes"]["raw"]) and free > 0
    assert local_tools().store.disk_room(root / "new", tmp_path / "another-model")[0] is None
    assert local_tools().store.disk_room(tmp_path / "missing" / "new", tmp_path)[0] is None  # a root not made yet


def test_a_bad_criu_timeout_in_the_environment_refuses_create_and_restore_first():
    """$VLLM_SNAPSHOT_CRIU_TIMEOUT is read from the host role's environment, before anything."""
    for run in (_create, _restore):
        t = FakeWorld()
        t.tools.host.environ = lambda: {"VLLM_SNAPSHOT_CRIU_TIMEOUT": "soon"}
        with pytest.raises(UsageError, match="VLLM_SNAPSHOT_CRIU_TIMEOUT"):
            run(t)
        assert t.calls == ["require_root"]


# ------------------------------------------------------------------ carried files

def _carried():
    from vllm_snapshot.store.manifest import Carried, CarriedFile, ImageFile

    digest = "ab" * 32
    f = CarriedFile(path="/var/lib/eng/.cache/vllm/k.so", size=3, blake3=digest, mode=0o644, uid=990, gid=990,
                    mtime_ns=1)
    return Carried(files=(f,), dirs=(), blobs=(ImageFile(name=digest, raw_bytes=3, stored_bytes=3, blake3=digest),))


def test_carried_files_are_checked_at_validate_and_put_back_under_the_criu_lock_right_before_criu():
    """The put-back runs under the host-wide CRIU lock (no other restore replaces a carried file
    between it and this CRIU), after staging, right before CRIU; the stored copies and what
    cannot be put back are decided at validate, before anything is staged."""
    t = FakeWorld(manifest=isolated_manifest(carried=_carried()))
    t.carry_written = ["/var/lib/eng/.cache/vllm/k.so"]
    _restore(t)
    order = ["check_tree_files", "plan_carried", "verify_model:quick", "stage_checking", "criu_lock",
             "check_gpu_capacity", "put_back_carried", "restore_tree"]
    assert [x for x in t.calls if x in order] == order


@pytest.mark.parametrize("err,code", [(IncompatibleHostError("another owner's file differs"), 3),
                                      (BusyError("a live process holds a differing carried file"), 9)])
def test_what_cannot_be_put_back_refuses_at_validate_before_anything_is_staged(err, code):
    from vllm_snapshot.checkpoint.carry import Plan

    t = FakeWorld(manifest=isolated_manifest(carried=_carried()))
    t.carry_plan = Plan(differs=["/x: differs"]) if code == 3 else Plan(held=["/x: held by PID 1"])
    with pytest.raises(type(err)) as e:
        _restore(t)
    assert e.value.exit_code == code and "/x" in e.value.message
    assert not {"stage_checking", "criu_lock", "put_back_carried", "restore_tree"} & set(t.calls)


def test_a_snapshot_made_before_carried_files_puts_nothing_back():
    t = FakeWorld(manifest=isolated_manifest())
    _restore(t)
    assert "put_back_carried" not in t.calls


def test_create_copies_the_carried_files_before_the_dump_and_packs_them_like_the_images():
    t = FakeWorld()
    _create(t)
    assert _before(t.calls, "inspect_tree", "carry_files") and _before(t.calls, "carry_files", "dump")
    assert "pack:carried" in t.calls


def test_a_passing_verify_clears_a_refusal_it_rechecked_and_keeps_one_it_cannot():
    # a trial: serve refused a snapshot whose weights file had been changed; the operator put the
    # file back and `verify` passed, yet `list` kept showing ✗ "refused by serve" until a restore
    from vllm_snapshot.errors import CorruptSnapshotError

    t = FakeWorld()
    t.tools.store.record_refusal(SNAP, "corrupt-snapshot", "image pages-1.img fails its checksum", by="restore")
    t.fail["verify_images"] = CorruptSnapshotError("image pages-1.img fails its checksum")
    with pytest.raises(CorruptSnapshotError):  # still damaged: verify fails and the mark stays
        ops.verify(SNAP, tools=t.tools)
    assert ops.describe(SNAP, t.tools)["compatible"] is False
    del t.fail["verify_images"]  # the image put back
    v = ops.verify(SNAP, tools=t.tools)
    assert v.cleared["code"] == "corrupt-snapshot" and v.to_json()["cleared_refusal"]["code"] == "corrupt-snapshot"
    assert ops.describe(SNAP, t.tools)["compatible"] is True
    # an oracle mismatch is re-checked only by a restore: a passing verify keeps the mark
    t.tools.store.record_refusal(SNAP, "oracle-mismatch", "the restored engine answered another token")
    assert ops.verify(SNAP, tools=t.tools).cleared is None
    assert ops.describe(SNAP, t.tools)["why"] == "refused by serve: the restored engine answered another token"


def test_create_refuses_an_untrusted_weights_dir_before_the_engine_starts():
    # a trial: a symlinked ROOT/.weights was refused only once the engine (15 s) handed its weights
    # over, as a corrupt snapshot (exit 5); one owned by another user was adopted
    from vllm_snapshot.errors import EnvironmentProblem

    t = FakeWorld(fail={"check_weights_dir": EnvironmentProblem("the weights directory /snaps/.weights is a symlink")})
    with pytest.raises(EnvironmentProblem, match="weights directory"):
        _create(t)
    assert "launch_engine" not in t.calls and "prepare_target" not in t.calls
    t = FakeWorld()
    _create(t, weights="in-image")  # no weights file: the directory is not used, nor judged
    assert "check_weights_dir" not in t.calls
