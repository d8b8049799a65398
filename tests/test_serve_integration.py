"""``serve MODEL [engine args]`` end to end (real vLLM on CPU + real CRIU): the first serve
builds then serves, the second restores without a cold start, ``--no-build`` refuses with
nothing bound, a changed model file builds anew and lists the old snapshot as unusable,
``create``'s snapshot is found by ``serve`` (the key computed before building equals the one
the engine's own parse recorded), and two concurrent serves of one key build once."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EAGER_ARGS, ENGINE_ARGS, ROOT, TINY, cli, engine_env
from helpers import readable_by_engine
from test_integration import free_port, port_accepts, post

pytestmark = pytest.mark.integration


def _complete(port: int) -> str:
    return post(f"http://127.0.0.1:{port}/v1/completions",
                {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1})["choices"][0]["text"]


def _serve(root: Path, model: Path, port: int, *extra: str, args=ENGINE_ARGS) -> subprocess.CompletedProcess:
    return cli("--root", str(root), "serve", str(model), "--port", str(port), "--detach", "--json", *extra, "--",
               *args, timeout=900)


def _stop(port: int) -> None:
    cli("stop", "--port", str(port), check=True)
    assert not port_accepts(port)


def _private_dir(p: Path) -> Path:
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    return p


def test_serve_builds_then_restores_refuses_no_build_and_rebuilds_after_a_model_change(tmp_path, engine_tmp):
    # eager: its two builds are about serve's choices, not compilation (conftest.EAGER_ARGS)
    serve = functools.partial(_serve, args=EAGER_ARGS)
    root = _private_dir(tmp_path / "store")
    model = engine_tmp / "models" / "tiny-copy"
    shutil.copytree(TINY, model)
    readable_by_engine(model)  # the engine runs as the unprivileged engine user
    port = free_port()
    # 1. nothing there: builds (cold start), then restores and serves
    p = serve(root, model, port)
    assert p.returncode == 0, p.stderr
    first = json.loads(p.stdout)
    try:
        assert first["path"] == "built" and first["oracle"] == "match"
        assert "engine_start" in first["timings"] and "criu_restore" in first["timings"]
        assert _complete(port)
    finally:
        _stop(port)
    built = Path(first["snapshot"])
    assert built.parent == root and built.name == f"tiny-copy-{first['key'][:12]}"
    assert json.loads(cli("inspect", str(built), "--json", check=True).stdout)["manifest"]["key"]["value"] == first["key"]
    # 2. same model + args: restored, no cold start (no engine_start phase at all)
    p = serve(root, model, port)
    assert p.returncode == 0, p.stderr
    second = json.loads(p.stdout)
    try:
        assert second["path"] == "restored" and second["snapshot"] == str(built) and second["key"] == first["key"]
        assert "engine_start" not in second["timings"] and "dump" not in second["timings"]
        assert _complete(port)
    finally:
        _stop(port)
    # 3. --no-build with args no snapshot was made for: clear error, nothing bound, nothing built
    p = _serve(root, model, port, "--no-build", args=[*EAGER_ARGS, "--max-num-seqs", "8"])
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)["error"]
    assert "no snapshot under" in err["message"] and "without --no-build" in err["hint"]
    assert not port_accepts(port)
    assert sorted(x.name for x in root.iterdir() if x.name != ".weights") == [built.name]
    # 4. a model file changed: the old snapshot no longer matches; a new one is built; `list`
    # shows the old one as unusable, naming the file; prune --unusable removes only it
    cfg = model / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()), indent=4) + "\n")  # same config, other bytes
    p = serve(root, model, port)
    assert p.returncode == 0, p.stderr
    third = json.loads(p.stdout)
    try:
        assert third["path"] == "built" and third["key"] != first["key"]
        assert [o["snapshot"] for o in third["not_matching"]] == [str(built)]
        assert "model files differ (changed: config.json)" in third["not_matching"][0]["why"]
        assert _complete(port)
    finally:
        _stop(port)
    rows = {r["name"]: r for r in json.loads(cli("--root", str(root), "list", "--json", check=True).stdout)["snapshots"]}
    assert rows[built.name]["compatible"] is False and "config.json" in rows[built.name]["why"]
    assert rows[Path(third["snapshot"]).name]["compatible"] is True
    pr = json.loads(cli("--root", str(root), "prune", "--unusable", "--json", check=True).stdout)
    assert pr["deleted"] == [str(built)]
    assert sorted(x.name for x in root.iterdir() if x.name != ".weights") == [Path(third["snapshot"]).name]


#: Runs the CLI as ``python -m vllm_snapshot`` does and, at exit, writes the names in its
#: ``sys.modules`` to ``$MODULES_OUT`` (the form of tests/test_startup.py: a fact, not a timing).
MODULES_AT_EXIT = """
import atexit, json, os, runpy, sys
out = os.environ["MODULES_OUT"]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["vllm_snapshot", *sys.argv[1:]]
runpy.run_module("vllm_snapshot", run_name="__main__", alter_sys=True)
"""
#: vLLM's argument parser (what engine.args.normalize_args imports; ~10-16 s)
VLLM_PARSER = ("vllm.entrypoints.launchers.cli_args", "vllm.engine.arg_utils")


def test_serve_finds_the_snapshot_create_made(snapshot, snap_root, tmp_path):
    """The key serve computes before building (args normalized from the manifest, no vLLM
    import) is the one create recorded from the engine's own parse."""
    port = free_port()
    out = tmp_path / "modules.json"
    p = subprocess.run([sys.executable, "-c", MODULES_AT_EXIT, "--root", str(snap_root), "serve", str(TINY),
                        "--port", str(port), "--detach", "--json", "--no-build", "--", *ENGINE_ARGS],
                       capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**engine_env(), "MODULES_OUT": str(out)})
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    try:
        assert r["path"] == "restored" and Path(r["snapshot"]) == snapshot
        modules = json.loads(out.read_text())
        assert "vllm_snapshot.ops.serve" in modules  # the report is of this run
        assert [m for m in modules if m in VLLM_PARSER] == []  # no vLLM parser import on this path
        assert _complete(port)
    finally:
        _stop(port)


def test_two_concurrent_serves_of_one_key_build_once(snapshot, tmp_path):
    root = _private_dir(tmp_path / "store")
    subprocess.run(["cp", "-al", str(snapshot), str(root / "tiny")], check=True)  # another key: other args
    args = [*ENGINE_ARGS, "--max-num-seqs", "16"]
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    env = engine_env()
    procs = [subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "--root", str(root), "serve", str(TINY),
                               "--port", str(port), "--detach", "--", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for port in ports]
    outs = [p.communicate(timeout=900) for p in procs]
    try:
        codes = [p.returncode for p in procs]
        built = [x.name for x in root.iterdir() if x.name not in ("tiny", ".weights")]
        assert len(built) == 1, (built, outs)  # one create, never two
        errs = [e for _, e in outs]
        assert sum("built (cold start + dump) and restored" in e for e in errs) == 1, errs
        waiter = next(i for i, e in enumerate(errs) if "built (cold start" not in e)
        assert "waiting for" in errs[waiter] and "building or restoring the snapshot for this key" in errs[waiter]
        assert "not tiny: engine args differ (max-num-seqs (default) -> 16)" in errs[1 - waiter]  # the other snapshot, and why
        assert codes[1 - waiter] == 0 and _complete(ports[1 - waiter])
        # engines have their own network namespace: the waiter restores a clone of the same snapshot
        assert codes[waiter] == 0, errs[waiter]
        assert "restored snapshot" in errs[waiter] and _complete(ports[waiter])
    finally:
        for port in ports:
            if port_accepts(port):
                _stop(port)


def test_normalization_by_vllms_parser_is_spelling_free_and_leaves_the_environment_alone():
    """One key for equivalent spellings; importing vLLM (it sets TORCHINDUCTOR_CACHE_DIR,
    LD_LIBRARY_PATH, ... in os.environ) must not leak into the env part of a key or into the
    environment of an engine this process starts."""
    import os

    from vllm_snapshot.errors import UsageError
    from vllm_snapshot.effects.tools import local_tools

    t = local_tools().model
    before = dict(os.environ)
    a = t.normalize_engine_args(["--dtype", "float32", "--kv-cache-memory-bytes", "64M"])
    assert dict(os.environ) == before
    b = t.normalize_engine_args(["--kv-cache-memory-bytes=67108864", "--dtype=float32"])
    assert a == b == {"dtype": '"float32"', "kv_cache_memory_bytes": "67108864"}
    with pytest.raises(UsageError, match="invalid engine arguments"):
        t.normalize_engine_args(["--no-such-option", "1"])
    assert dict(os.environ) == before


def test_timeshare_script_switches_between_a_model_form_and_a_snapshot(snapshot, snap_root, clone_snapshot):
    """scripts/timeshare.sh (via `switch --model MODEL -- ARGS`): the model form finds the
    session snapshot by its key (nothing built), the other target is a snapshot path."""
    import os

    other = clone_snapshot("ts-b")
    port = free_port()
    env = {**engine_env(), "VLLM_SNAPSHOT_ROOT": str(snap_root),
           "VLLM_SNAPSHOT": str(Path(sys.executable).parent / "vllm-snapshot")}
    before = sorted(x.name for x in snap_root.iterdir())
    p = subprocess.run(["bash", str(ROOT / "scripts" / "timeshare.sh"), f"model={TINY} {' '.join(ENGINE_ARGS)}",
                        str(other), str(port), "3"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("switch 1 -> model=") and lines[1].startswith(f"switch 2 -> {other}:"), p.stdout
    # each switch: the whole command (the model form's key computation included) and, within
    # it, the time the port was not served
    import re

    # (the first switch has nothing to hand over from: the port is dark while it restores; the
    # later ones hand the port over, which the script counts as 0 s not served)
    for i, line in enumerate(lines[:3]):
        m = re.search(r": ([0-9.]+) s \(port not served: ([0-9.]+) s\)$", line)
        assert m and float(m[1]) >= float(m[2]) >= 0, line
        assert float(m[2]) > 0 if i == 0 else float(m[2]) == 0.0, line
    assert lines[-2].startswith("3 switches, whole switch command: median")
    assert lines[-1].startswith("3 switches, port not served: median")
    assert sorted(x.name for x in snap_root.iterdir()) == before  # found by key: nothing built
    assert not port_accepts(port)  # the script stops the last engine
    assert os.path.exists(snapshot / "manifest.json")
