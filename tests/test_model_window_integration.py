"""Issue 29 S1 end to end: the manifest's model digest must describe the bytes the engine
loaded. A model file changed while the engine reads it -- during create's cold start (real
vLLM + CRIU), or before a level-2 wake at restore (the GPU sequencing through real CRIU with the
protocol-speaking fake CUDA engine of test_gpu_sequencing.py) -- refuses, publishing or serving
nothing. Unit level: test_model_recheck.py; step order: test_ops_order.py."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from vllm_snapshot import ops
from vllm_snapshot.errors import ModelChangedError
from vllm_snapshot.report.progress import Reporter

from conftest import EAGER_ARGS, ROOT, TINY, engine_env
from helpers import readable_by_engine
from test_gpu_sequencing import FakeGpuCheckpoint, fake_cuda, fake_tools, our_children  # noqa: F401 - fixtures
from test_integration import free_port

pytestmark = pytest.mark.integration
WEIGHTS = "model.safetensors"


def _model_copy(base: Path) -> Path:
    model = base / "model"
    shutil.copytree(TINY, model)
    readable_by_engine(model)
    return model


def _other_weights(w: Path, tensor: str = "model.norm.weight") -> bytes:
    """The weights with one F32 tensor x3, as in the trial: same size, same safetensors header,
    finite values (an engine loads them and answers)."""
    import json
    import struct

    import numpy as np

    data = bytearray(w.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    info = json.loads(data[8:8 + n])[tensor]
    assert info["dtype"] == "F32"
    a, b = (8 + n + off for off in info["data_offsets"])
    data[a:b] = (np.frombuffer(bytes(data[a:b]), dtype="<f4") * 3).astype("<f4").tobytes()
    assert len(data) == w.stat().st_size and bytes(data) != w.read_bytes()
    return bytes(data)


def _processes_naming(text: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(p.info["cmdline"] or []):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def test_weights_replaced_during_create_and_put_back_refuse_it(engine_tmp, tmp_path):
    """The trial's reproduction: a few seconds after "starting engine" the weights are replaced
    (the engine loads those), and put back once create has ended. Before the fix create
    exited 0 with the original file's digest, and restore served the replaced weights."""
    model = _model_copy(engine_tmp)
    w = model / WEIGHTS
    original = w.read_bytes()
    other = _other_weights(w)
    target = tmp_path / "snaps" / "s1"
    target.parent.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "create", str(model), "--snapshot-dir", str(target),
                             "--", *EAGER_ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=engine_env(), cwd=ROOT)
    err: list[str] = []
    replaced = threading.Event()

    def watch() -> None:
        for line in proc.stderr:
            err.append(line)
            if "starting engine" in line and not replaced.is_set():
                w.write_bytes(other)  # as `cp changed model.safetensors`: in place, same inode
                replaced.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        proc.wait(timeout=900)  # stderr is the watcher's alone
    finally:
        if proc.poll() is None:
            proc.kill()
    t.join(10)
    w.write_bytes(original)  # the rollback after create ended
    stderr = "".join(err)
    assert replaced.is_set(), stderr[-3000:]
    assert proc.returncode == 4, f"exit {proc.returncode}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr
    assert WEIGHTS in stderr and "content changed" in stderr and "run create again" in stderr
    assert "CRIU dump" not in stderr  # refused before the dump
    assert not target.exists() and list(target.parent.iterdir()) == []  # nothing published, no temp dir
    deadline = time.monotonic() + 30
    while _processes_naming(str(model)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_naming(str(model)) == []  # no engine left


def test_weights_changed_before_a_level2_wake_refuse_the_restore(tmp_path, engine_tmp, fake_tools, fake_cuda):
    """On GPU a level-2 wake reloads the weights from disk after restore checked the model: a
    file changed in between (here: right after CRIU restored the tree) refuses; nothing serves
    and the tree is gone."""
    model = _model_copy(engine_tmp)
    snap = tmp_path / "gpu"
    m = ops.create(ops.CreateRequest(model=str(model), target=snap, sleep_level=2), Reporter(), tools=fake_tools).manifest
    assert m.engine.sleep_level == 2
    w = model / WEIGHTS
    other = _other_weights(w)

    class ChangedAtRestore(FakeGpuCheckpoint):
        def restore_tree(self, *args, **kwargs):  # the real signature, whatever it grows
            pid = super().restore_tree(*args, **kwargs)
            w.write_bytes(other)
            return pid

    tools = dataclasses.replace(fake_tools, checkpoint=ChangedAtRestore(fake_tools.checkpoint.criu))
    port = free_port()
    with pytest.raises(ModelChangedError) as ei:
        ops.restore(ops.RestoreRequest(snapshot=snap, port=port, detach=True), Reporter(), tools=tools)
    e = ei.value
    assert WEIGHTS in e.message and "wake" in e.message and "nothing serves" in e.hint
    assert e.exit_code == 4
    assert our_children() == []
    assert [x for x in tools.runtime.engines() if x.snapshot == str(snap)] == []
    import socket

    with socket.socket() as s:  # never bound (or free again)
        s.bind(("127.0.0.1", port))
