"""``serve``'s decisions and step order through the recording FakeWorld (no root, no CRIU):
which snapshot it restores, when it builds, what it records as refused, what --no-build and
--rebuild change. The real thing runs in tests/test_serve_integration.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_snapshot import ops
from vllm_snapshot.store import snapkey
from vllm_snapshot.errors import BusyError, ModelChangedError, OracleMismatchError, UsageError
from vllm_snapshot.ops.serve import MAX_REFUSED_PER_KEY, why_not
from vllm_snapshot.report.progress import Reporter

from fakes import FakeWorld
from vllm_snapshot.store.manifest import ModelFile

ROOT = Path("/snaps")
ARGS = ["--kv-cache-memory-bytes", "64M"]


class Rec(Reporter):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)


def _tools() -> FakeWorld:
    t = FakeWorld()
    t.snapshots = {}
    return t


def _serve(t: FakeWorld, rep: Reporter | None = None, **kw):
    req = ops.ServeRequest(model="/models/tiny", root=ROOT, engine_args=list(kw.pop("engine_args", ARGS)),
                           port=8123, **kw)
    return ops.serve(req, rep or Rec(), tools=t.tools)


def test_first_serve_builds_then_the_second_restores_without_a_cold_start():
    t = _tools()
    first, _ = _serve(t)
    assert first.path == "built" and "engine_start" in first.timings
    (built,) = t.snapshots
    assert built.name == f"tiny-{first.key[:12]}"
    assert t.snapshots[built].key.value == first.key  # create recorded the key serve computed
    assert first.warnings == []
    t.calls.clear()
    second, _ = _serve(t)
    assert second.path == "restored" and second.restored.snapshot == str(built) and second.key == first.key
    assert "launch_engine" not in t.calls and "engine_start" not in second.timings
    # the normalization came from the manifest (same raw args): vLLM's parser was not imported
    assert "normalize_engine_args" not in t.calls


def test_port_is_checked_before_anything_is_hashed_or_built():
    t = _tools()
    t.fail["port_free"] = BusyError("port 8123 is in use")
    with pytest.raises(BusyError):
        _serve(t)
    assert "digest_model" not in t.calls and "launch_engine" not in t.calls and not t.snapshots


def test_other_engine_args_build_a_new_snapshot_and_say_why_the_old_one_is_not_used():
    t = _tools()
    a, _ = _serve(t)
    rep = Rec()
    b, _ = _serve(t, rep, engine_args=[*ARGS, "--max-model-len", "256"])
    assert b.path == "built" and b.key != a.key and len(t.snapshots) == 2
    assert any("engine args differ (args --kv-cache-memory-bytes 64M -> --kv-cache-memory-bytes 64M --max-model-len 256)" in line for line in rep.lines), rep.lines
    assert t.refusals == {}  # another configuration is not "unusable"


def test_changed_model_file_builds_anew_and_names_the_file():
    t = _tools()
    a, _ = _serve(t)
    t.model_files = (ModelFile(path="model.safetensors", size=100, blake3="1" * 64, mtime_ns=9, ctime_ns=9,
                               inode=3, device=4),)
    rep = Rec()
    b, _ = _serve(t, rep)
    assert b.path == "built" and b.key != a.key
    assert any("model files differ (changed: model.safetensors)" in line for line in rep.lines), rep.lines


def _with(t: FakeWorld, *paths: str) -> None:
    """The model dir of ``t``'s snapshots with files ``paths`` added."""
    (built,) = t.snapshots
    t.model_files = t.snapshots[built].model.files + tuple(
        ModelFile(path=p, size=1, blake3="2" * 64, mtime_ns=9, ctime_ns=9, inode=9 + i, device=4)
        for i, p in enumerate(paths))


def test_added_docs_and_dot_dirs_keep_the_key_and_restore():
    """Issue 29 "two policies": a file restore ignores must not cost serve a cold rebuild."""
    t = _tools()
    a, _ = _serve(t)
    _with(t, "README.md", ".cache/huggingface/download/model.safetensors.metadata")
    b, _ = _serve(t)
    assert b.path == "restored" and b.key == a.key and len(t.snapshots) == 1


def test_an_added_weight_file_refuses_serve_naming_it_and_rebuild_builds():
    """Issue 29 / review gpu-path-2 M5: an added shard is refused by restore, so serve refuses it
    too (naming it and the way out), instead of building a second snapshot silently."""
    t = _tools()
    _serve(t)
    _with(t, "model-00002-of-00002.safetensors")
    t.calls.clear()
    with pytest.raises(ModelChangedError, match=r"model-00002-of-00002.safetensors \(weights\)") as ei:
        _serve(t)
    assert "serve --rebuild" in ei.value.hint and len(t.snapshots) == 1 and "launch_engine" not in t.calls
    with pytest.raises(ModelChangedError):
        _serve(t, build="never")
    b, _ = _serve(t, build="always")
    assert b.path == "built" and len(t.snapshots) == 2
    # another file added later: named against the snapshot closest to the files now (the rebuilt one)
    t.model_files = t.model_files + (ModelFile(path="tokenizer.json", size=1, blake3="4" * 64, mtime_ns=9,
                                               ctime_ns=9, inode=99, device=4),)
    with pytest.raises(ModelChangedError) as ei:
        _serve(t)
    assert ei.value.details["added"] == ["tokenizer.json"] and ei.value.details["snapshot"] == b.restored.snapshot


def test_a_snapshot_that_recorded_a_readme_still_matches_when_it_changes():
    """Manifests made before the policy recorded docs; their key is recomputed without them."""
    t = _tools()
    _with_readme = FakeWorld().manifest.model.files + (
        ModelFile(path="README.md", size=1, blake3="3" * 64, mtime_ns=9, ctime_ns=9, inode=7, device=4),)
    t.model_files = _with_readme
    a, _ = _serve(t)
    (built,) = t.snapshots
    m = t.snapshots[built]
    legacy_parts = {**m.key.parts, "model": snapkey._h(sorted((f.path, f.size, f.blake3) for f in _with_readme))}
    t.snapshots[built] = m.model_copy(update={"model": m.model.model_copy(update={"files": _with_readme}),
                                              "key": m.key.model_copy(update={"parts": legacy_parts,
                                                                              "value": snapkey.combine(legacy_parts)})})
    t.model_files = FakeWorld().manifest.model.files  # README.md edited: no longer hashed at all
    b, _ = _serve(t)
    assert b.path == "restored" and len(t.snapshots) == 1


def test_refused_snapshot_is_recorded_and_a_new_one_built():
    t = _tools()
    a, _ = _serve(t)
    (old,) = t.snapshots
    t.refuse[old] = OracleMismatchError("the restored engine's oracle differs")
    b, _ = _serve(t)
    assert b.path == "built" and b.key == a.key and len(t.snapshots) == 2
    new = next(p for p in t.snapshots if p != old)
    assert new.name == f"tiny-{a.key[:12]}-2"
    assert b.refused == [{"snapshot": str(old), "code": "oracle-mismatch",
                          "reason": "the restored engine's oracle differs"}]
    assert t.refusals[str(old)]["code"] == "oracle-mismatch"
    row = ops.describe(old, t.tools)
    assert row["compatible"] is False and row["why"].startswith("refused by serve:")


def test_an_unsafe_root_refuses_before_the_key_or_a_cold_start():
    # a trial: with the root at 0777 serve passed its valid snapshot over without a word, cold
    # started a build and only then refused to publish it (exit 11)
    from vllm_snapshot.errors import EnvironmentProblem

    t = FakeWorld()
    t.root_problem = EnvironmentProblem("the snapshot root /snaps is writable by group or others (mode 0777)",
                                        hint="chmod 0700 /snaps")
    with pytest.raises(EnvironmentProblem) as e:
        _serve(t)
    assert "mode 0777" in e.value.message and "serve neither restores nor builds" in e.value.message
    assert e.value.hint == "chmod 0700 /snaps"
    assert not {"launch_engine", "restore_tree", "list_snapshots"} & set(t.calls)


def test_no_build_without_a_snapshot_refuses_before_any_engine_starts():
    t = _tools()
    with pytest.raises(UsageError, match="no snapshot under /snaps matches"):
        _serve(t, build="never")
    assert "launch_engine" not in t.calls and "restore_tree" not in t.calls and "register" not in t.calls


def test_no_build_with_a_refused_snapshot_raises_its_refusal():
    t = _tools()
    _serve(t)
    (old,) = t.snapshots
    t.refuse[old] = ModelChangedError("model files under /models/tiny differ")
    with pytest.raises(ModelChangedError):
        _serve(t, build="never")
    assert len(t.snapshots) == 1


def test_rebuild_builds_even_when_a_valid_snapshot_exists():
    t = _tools()
    _serve(t)
    t.calls.clear()
    b, _ = _serve(t, build="always")
    assert b.path == "built" and len(t.snapshots) == 2 and "launch_engine" in t.calls


def test_busy_restore_is_not_a_refusal_and_builds_nothing():
    t = _tools()
    _serve(t)
    (old,) = t.snapshots
    t.refuse[old] = BusyError("loopback ports taken")
    with pytest.raises(BusyError):
        _serve(t)
    assert len(t.snapshots) == 1 and t.refusals == {}


def test_serve_stops_building_after_repeated_refusals_of_one_key():
    """A host that refuses every snapshot must not get a new cold start + dump per restart."""
    t = _tools()
    t.refuse_all = OracleMismatchError("oracle differs")
    for n in range(1, MAX_REFUSED_PER_KEY + 1):
        with pytest.raises(OracleMismatchError, match="oracle differs"):
            _serve(t)  # builds one more, whose restore is refused
        assert len(t.snapshots) == n
    with pytest.raises(OracleMismatchError, match="not building another") as e:
        _serve(t)
    assert len(t.snapshots) == MAX_REFUSED_PER_KEY
    assert "prune --unusable" in e.value.hint


def test_bad_engine_args_are_refused_before_building():
    t = _tools()
    with pytest.raises(UsageError, match="--bogus"):
        _serve(t, engine_args=["--bogus", "--kv-cache-memory-bytes", "64M"])
    assert "launch_engine" not in t.calls
    # a CPU KV cache not sized: refused before the key (whose parse of the args takes ~16 s)
    t = _tools()
    with pytest.raises(UsageError, match="size it explicitly"):
        _serve(t, engine_args=["--dtype", "float32"])
    assert "normalize_engine_args" not in t.calls and "launch_engine" not in t.calls
    with pytest.raises(UsageError, match="serves TCP only"):
        _serve(t, engine_args=["--uds", "/tmp/x.sock"])


def test_key_parts_and_words_cover_every_part():
    assert set(snapkey.PART_WORDS) == set(snapkey.PARTS)


def test_why_not_names_host_fields():
    t = _tools()
    a, _ = _serve(t)
    (old,) = t.snapshots
    m = t.snapshots[old]
    key = m.key.model_copy(update={"parts": {**m.key.parts, "host": "0" * 64}})
    assert "host differs (vllm: snapshot has '0.32.0', this host has '0.33.0')" in why_not(
        m, key, m.model.files, {**m.host, "vllm": "0.33.0"})


def test_env_part_ignores_our_own_settings_but_not_engine_variables():
    base = {"PATH": "/usr/bin", "GLOO_SOCKET_IFNAME": "lo"}
    assert snapkey.env_part({**base, "VLLM_SNAPSHOT_ROOT": "/x", "VLLM_SNAPSHOT_RUN_DIR": "/y", "VLLM_SNAPSHOT": "/bin/v"}) == snapkey.env_part(base)
    assert snapkey.env_part({**base, "HOME": "/home/u", "TERM": "xterm"}) == snapkey.env_part(base)
    assert snapkey.env_part({**base, "OMP_NUM_THREADS": "4"}) != snapkey.env_part(base)
    assert snapkey.env_part({**base, "VLLM_CPU_KVCACHE_SPACE": "1"}) != snapkey.env_part(base)


def test_env_part_covers_the_driver_location():
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    assert snapkey.env_part({**base, "LD_LIBRARY_PATH": "/opt/nvidia/lib64"}) != snapkey.env_part(base)
    assert snapkey.env_part({**base, "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}) != snapkey.env_part(base)


def test_a_changed_ld_library_path_is_another_key_and_serve_says_so(monkeypatch):
    """The driver found elsewhere (LD_LIBRARY_PATH reaches the engine): serve does not restore
    the snapshot made with the old one, and says the engine environment differs, naming it."""
    t = _tools()
    env = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    monkeypatch.setattr(t.tools.host, "environ", lambda: dict(env))
    a, _ = _serve(t)
    (old,) = t.snapshots
    env["LD_LIBRARY_PATH"] = "/opt/nvidia-580/lib64"
    with pytest.raises(UsageError) as e:
        _serve(t, build="never")
    assert f"not {old.name}: the engine environment differs (LD_LIBRARY_PATH changed)" in e.value.message
    b, _ = _serve(t)
    assert b.path == "built" and b.key != a.key


def test_switch_model_builds_before_stopping_the_old_engine_then_reuses_the_snapshot():
    from vllm_snapshot.store.registry import Entry

    t = _tools()
    t.entries = [Entry(snapshot="/snaps/other", pid=99, supervisor_pid=0, host="127.0.0.1", port=8123,
                       started_at=0.0, mode="detached")]
    req = ops.ServeRequest(model="/models/tiny", root=ROOT, engine_args=list(ARGS), port=8123, detach=True)
    sw, path = ops.switch_model(req, None, True, Rec(), tools=t.tools)
    assert path == "built" and sw.port == 8123 and sw.stopped == [99]
    assert t.calls.index("publish") < t.calls.index("stop_engine")  # the old engine served during the build
    (built,) = t.snapshots
    assert sw.snapshot == str(built)
    t.calls.clear()
    t.entries = []
    sw, path = ops.switch_model(req, None, True, Rec(), tools=t.tools)
    assert path == "restored" and sw.snapshot == str(built) and "launch_engine" not in t.calls


def test_no_build_names_the_other_snapshots_in_the_error_and_its_details():
    """A new-user trial: `serve --no-build --json` said the other snapshots were "listed above",
    but nothing was listed in JSON mode. The error itself names them, and --json has them."""
    t = _tools()
    _serve(t)  # a snapshot with ARGS
    with pytest.raises(UsageError) as ei:
        _serve(t, build="never", engine_args=[*ARGS, "--max-num-seqs", "3"])
    e = ei.value
    (built,) = t.snapshots
    assert f"not {built.name}:" in e.message and "listed above" not in e.message
    assert e.details["not_matching"][0]["snapshot"] == str(built) and e.details["not_matching"][0]["why"]


def test_a_server_that_does_not_start_with_front_end_options_is_not_held_against_the_snapshot():
    # the oracle matched, then the server died (e.g. a TLS setting uvicorn rejects): not the
    # snapshot's fault, and a new build would die the same way
    from vllm_snapshot.errors import EngineError
    from vllm_snapshot.ops.restore import SERVER_START

    t = _tools()
    first, _ = _serve(t)
    (built,) = t.snapshots
    t.refuse_all = EngineError("engine exited while starting the server", hint="full engine log: /x.log",
                               details={"stage": SERVER_START, "log": "/x.log"})
    with pytest.raises(EngineError) as e:
        _serve(t, frontend=("--root-path", "/api"))
    assert "check the front-end options" in e.value.hint and "/x.log" in e.value.hint
    assert t.refusals == {} and list(t.snapshots) == [built]  # not marked unusable, nothing built
    # without front-end options the same failure counts against the snapshot, as before
    with pytest.raises(EngineError):
        _serve(t)
    assert str(built) in t.refusals


@pytest.mark.parametrize("keep,older_than_s,want", [
    (1, None, {"a1", "a2", "b1"}),        # all but the newest per model
    (None, 2.5 * 86400, {"a1", "b1"}),    # older than 2.5 days, whatever the model
    (1, 2.5 * 86400, {"a1", "b1"}),       # both: older AND not the newest of its model
    (1, 0.5 * 86400, {"a1", "a2", "b1"}),
    (0, 10 * 86400, set()),               # nothing is that old
])
def test_prune_keep_always_keeps_the_newest(keep, older_than_s, want):
    """A trial read `prune --keep 1 --older-than 1m` as "keep the newest, delete the old ones":
    it deleted the only snapshot of every model (the two rules were a union)."""
    import datetime as dt

    from vllm_snapshot.ops.manage import prune

    t = _tools()
    now = dt.datetime.fromtimestamp(t.tools.clock.now(), dt.timezone.utc)
    _serve(t)  # one built snapshot: the template manifest
    (tmpl_path,) = t.snapshots
    tmpl = t.snapshots.pop(tmpl_path)
    for name, model, days in (("a1", "/models/a", 4), ("a2", "/models/a", 1), ("a3", "/models/a", 0),
                              ("b1", "/models/b", 3), ("b2", "/models/b", 0.1)):
        t.snapshots[ROOT / name] = tmpl.model_copy(update={
            "created_at": (now - dt.timedelta(days=days)).isoformat(),
            "model": tmpl.model.model_copy(update={"path": model})})
    res = prune(ROOT, keep, older_than_s, dry_run=True, tools=t.tools)
    assert {Path(p).name for p in res.deleted} == want


def test_the_key_records_the_env_variables_by_name_so_a_mismatch_names_them():
    # a trial: "the engine environment (VLLM_*, OMP_*, ...) differs" named no variable
    from vllm_snapshot.store import snapkey

    was = snapkey.env_record({"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2", "HF_TOKEN": "hf_x",
                              "PATH": "/usr/bin"}, keep=("HF_TOKEN",))
    assert set(was) == {"VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "HF_TOKEN"}  # PATH is not in the key
    assert was["HF_TOKEN"] == "secret"  # a kept token: not even its digest is written
    now = snapkey.env_record({"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "4", "VLLM_NO_USAGE_STATS": "1",
                              "HF_TOKEN": "hf_y"}, keep=("HF_TOKEN",))
    assert snapkey.env_differences(was, now) == ["OMP_NUM_THREADS changed", "VLLM_NO_USAGE_STATS set now"]
    assert snapkey.env_part({"OMP_NUM_THREADS": "2"}) == snapkey.env_part({"OMP_NUM_THREADS": "2", "PATH": "/x"})


# --------------------------------------------------------------------------- serve --registry

class FakeRegistry:
    """A repository of snapshots by key: ``held`` key -> the manifest a pull publishes;
    ``fits`` False makes a pull refuse as a node of another class would."""

    def __init__(self, t: FakeWorld, fits: bool = True) -> None:
        self.t, self.fits = t, fits
        self.held: dict[str, object] = {}
        self.calls: list[str] = []

    def image(self, key: str) -> str:
        return f"127.0.0.1:5000/fleet/tiny:{key}"

    def fetch(self, key: str, target: Path):
        self.calls.append("fetch")
        if key not in self.held:
            return None
        if not self.fits:
            from vllm_snapshot.errors import IncompatibleHostError

            raise IncompatibleHostError("kernel: artifact has '6.18.0', this host has '5.4.0'")
        self.t.snapshots[target] = self.held[key]
        return target

    def offer(self, snapshot: Path, key: str, serving: str | None = None) -> list[str]:
        self.calls.append(f"offer:{snapshot.name}")
        self.serving = serving
        self.held.setdefault(key, self.t.snapshots[snapshot])
        return []


def test_with_a_registry_the_first_node_builds_and_pushes_the_next_pulls_without_a_cold_start():
    a = _tools()
    reg = FakeRegistry(a)
    first, _ = _serve(a, registry=reg)
    assert first.path == "built" and reg.calls == ["fetch", f"offer:tiny-{first.key[:12]}"]
    assert first.key in reg.held
    b = _tools()  # another node of the class: empty store
    reg.t, reg.calls = b, []
    second, _ = _serve(b, registry=reg)
    assert second.path == "pulled" and second.key == first.key and reg.calls[0] == "fetch"
    assert "launch_engine" not in b.calls  # no cold start on the second node
    b.calls.clear()
    third, _ = _serve(b, registry=reg)  # now local: restored, nothing fetched
    assert third.path == "restored" and reg.calls[-1].startswith("offer")


def test_serve_reports_the_push_apart_from_the_time_to_serving(capsys):
    """A trial: `serve --registry --detach` said "restored snapshot ... in 39.14 s", 27 s of it
    the push that ran after the engine served. The push gets its own number (JSON ``push_s``,
    ``serving_after_s`` without it) and the serving URL is handed to the push, which says it."""
    from vllm_snapshot.cli import render

    a = _tools()

    class Timed(FakeRegistry):
        def offer(self, snapshot, key, serving=None):
            a._t += 27.0  # the push: 27 s after the engine served
            self.push_s = 27.0
            return super().offer(snapshot, key, serving)

    reg = Timed(a)
    r, _ = _serve(a, registry=reg)
    assert reg.serving == r.restored.url
    doc = r.to_json()
    assert doc["push_s"] == 27.0 and doc["serving_after_s"] == round(r.total_s - 27.0, 3) and r.total_s >= 27.0
    render.show(r, False, False)
    err = capsys.readouterr().err
    assert f"serving after {r.total_s - 27.0:.2f} s" in err and "the push to the registry then took 27.00 s" in err
    assert f"in {r.total_s:.2f} s" not in err


def test_a_node_that_does_not_fit_the_registrys_snapshot_builds_its_own():
    a = _tools()
    reg = FakeRegistry(a)
    first, _ = _serve(a, registry=reg)
    b = _tools()
    reg.t, reg.fits, reg.calls = b, False, []
    rep = Rec()
    second, _ = _serve(b, rep, registry=reg)
    assert second.path == "built" and "launch_engine" in b.calls
    assert any("not pulling" in line and "kernel" in line for line in rep.lines), rep.lines


def test_no_build_still_pulls_from_the_registry():
    a = _tools()
    reg = FakeRegistry(a)
    _serve(a, registry=reg)
    b = _tools()
    reg.t = b
    r, _ = _serve(b, registry=reg, build="never")
    assert r.path == "pulled"


def test_before_building_a_replacement_serve_says_everything_that_differed():
    """Issue 29: a refusal of the existing snapshot of the key must not be met by a silent second
    build: every line of what differed (not only the first), its hint, and that the new one
    replaces it, keeping it marked."""
    t = _tools()
    _serve(t)
    (old,) = t.snapshots
    from vllm_snapshot.errors import IncompatibleHostError

    t.refuse[old] = IncompatibleHostError("files the engine had open or mapped changed since the snapshot was created:"
                                          "\n  /venv/lib/libA.so changed: size 1 -> 2 bytes"
                                          "\n  /venv/lib/libB.so vanished",
                                          hint="restore with the same venv/libraries, or re-create the snapshot")
    rep = Rec()
    b, _ = _serve(t, rep)
    assert b.path == "built"
    said = "\n".join(rep.lines)
    assert "/venv/lib/libA.so changed" in said and "/venv/lib/libB.so vanished" in said
    assert "restore with the same venv/libraries" in said
    assert f"to replace {old.name}" in said and "marked ✗" in said


def test_a_missing_or_changed_weights_file_refuses_the_snapshot_and_serve_builds_a_new_one():
    """The weights file a CPU snapshot maps is checked before CRIU (check_weights): a refusal
    there is recorded against the snapshot and serve builds a new one (a new weights file)."""
    t = _tools()
    first, _ = _serve(t)
    (built,) = t.snapshots
    m = t.snapshots[built]
    assert m.weights == t.weights_file and m.key.value == first.key  # create recorded what the worker mapped
    assert t.launch_spec.weights_file is True and t.weights_root == ROOT  # the store's .weights beside it
    assert t.carry_also == (m.weights.path,)  # never copied into carried/
    assert t.mounts_also == (str(ROOT),)  # the engine's mount namespace keeps the store's mount
    assert t.launch_spec.weights_root == str(ROOT)
    t.weights_problems[m.weights.path] = f"the weights file {m.weights.path} is missing"
    t.weights_file = m.weights.model_copy(update={"path": "/snaps/.weights/" + "cd" * 32 + ".weights"})  # the rebuild's
    t.calls.clear()
    second, _ = _serve(t)
    assert second.path == "built" and "check_weights" in t.calls and "launch_engine" in t.calls
    assert "restore_tree" in t.calls and t.calls.index("check_weights") < t.calls.index("launch_engine")
    assert "missing" in t.refusals[str(built)]["reason"]


def test_weights_in_image_is_its_own_key_and_asks_the_engine_for_no_file():
    t = _tools()
    file_, _ = _serve(t)
    t.weights_file = None
    image, _ = _serve(t, weights="in-image")
    assert image.path == "built" and image.key != file_.key
    assert t.launch_spec.weights_file is False
    assert t.snapshots[Path(image.restored.snapshot)].weights is None
    t.calls.clear()
    again, _ = _serve(t, weights="in-image")
    assert again.path == "restored" and again.key == image.key


def test_a_cpu_engine_that_hands_no_weights_over_fails_the_create_and_publishes_nothing():
    t = _tools()
    t.weights_file = None
    from vllm_snapshot.errors import EngineError

    with pytest.raises(EngineError, match="did not hand its weights over") as e:
        _serve(t)
    assert "--weights in-image" in e.value.hint
    assert t.published == [] and "remove_unused_weights" in t.calls and "discard" in t.calls
