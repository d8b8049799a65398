"""``vllm-snapshot demo``: the main job end to end on the embedded tiny model.

Creates a snapshot if none exists (or the existing one no longer validates), measures a cold
start of ``python -m vllm.entrypoints.openai.api_server`` to its first completion, restores
the snapshot to its first validated completion, sends one completion, prints the phase timings
and the cold-vs-restore ratio measured in this run (against the faster of a compiled cold start
with a warm compile cache and one with ``--enforce-eager``), then stops the engine.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..store import layout
from .. import ops
from ..dev import tiny_model
from ..dev.bench import cold_start, free_port
from ..dev.tiny_model import ENGINE_ARGS
from ..errors import EngineError, SnapshotError
from ..report.progress import make_reporter
from ..report.results import DemoReport
from ..effects.http import http_json
from ..effects.tools import Tools, local_tools

#: The demo's snapshot name under the snapshot root.
DEFAULT_NAME = "demo-tiny-llama"


def run(snap: Path, port: int, skip_cold: bool, as_json: bool, tools: Tools | None = None) -> DemoReport:
    """Run the demo (see module doc) on the snapshot ``snap``; returns the report (rendered by
    the caller). ``tools``: the side effects, as the ops take them (default
    :func:`local_tools`; the tests pass a fake world). Raises SnapshotError subclasses on failure."""
    t = tools if tools is not None else local_tools()
    t.host.require_root()
    rep = make_reporter(as_json)
    snap = snap.absolute()
    with rep.phase("model", "tiny model"):
        model = tiny_model.generate(tiny_model.default_model_dir())
    m = None
    if (snap / layout.MANIFEST).exists():
        try:
            m, _ = ops.validate(snap, tools=t)
            if list(m.engine.engine_args) != ENGINE_ARGS:
                rep.info(f"existing snapshot {snap} was made with other engine args; re-creating it")
                m = None
            else:
                rep.info(f"using existing snapshot {snap}")
        except SnapshotError as e:
            rep.info(f"existing snapshot {snap} does not validate ({e.code}); re-creating it")
        if m is None:
            ops.delete(snap, tools=t)  # under its lock; refuses while an engine from it runs
    elif snap.exists() and not any(snap.iterdir()):
        snap.rmdir()
    if m is None:
        snap.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        m = ops.create(ops.CreateRequest(model=str(model), target=snap, engine_args=list(ENGINE_ARGS)),
                       make_reporter(as_json), tools=t).manifest
    cold = None
    colds: dict[str, float] = {}
    if not skip_cold:  # the faster start a user could choose instead: compiled (warm cache) or eager
        with rep.phase("cold_start", "measuring a cold start for comparison (start, first completion, stop)"):
            colds["compiled"] = cold_start(model, free_port())
        with rep.phase("cold_start_eager", "measuring a cold start with --enforce-eager for comparison"):
            colds["eager"] = cold_start(model, free_port(), [*ENGINE_ARGS, "--enforce-eager"])
        cold = min(colds.values())
    port = port or free_port()
    t0 = time.monotonic()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port), make_reporter(as_json), tools=t)
    restore_s = time.monotonic() - t0
    try:
        status, body = http_json(f"{r.url}/v1/completions", {
            "model": m.model.served_name, "prompt": "Hello world", "max_tokens": 8, "temperature": 0.0})
        if status != 200:
            raise EngineError(f"completion failed: HTTP {status}: {body}")
        text = body["choices"][0]["text"]
    finally:
        engine.kill(grace=15)
        engine.close()
        t.runtime.unregister(r.pid)
    return DemoReport(str(snap), r.url, text, dict(m.timings), dict(r.timings), restore_s, cold,
                      m.sizes["raw"], m.sizes["stored"], colds)
