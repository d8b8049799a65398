"""The engine channel has one owner (engine/protocol.py): its docstring lists exactly the
commands and events the code knows, and every participant uses its encoders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_snapshot.engine import protocol

ROOT = Path(__file__).resolve().parent.parent


def test_docstring_lists_exactly_the_commands_and_events():
    doc = protocol.__doc__
    cmds_part = doc.split("Commands", 1)[1].split("Events", 1)[0]
    events_part = doc.split("Events", 1)[1]
    assert set(re.findall(r"^\* ``([a-z-]+)``", cmds_part, re.M)) == set(protocol.COMMANDS)
    listed = set(re.findall(r"``([a-z-]+)``", events_part)) & (set(protocol.EVENTS) | {"serving"})
    assert listed == set(protocol.EVENTS)


def test_encoders_refuse_unknown_names():
    with pytest.raises(ValueError):
        protocol.encode_command("serving")
    with pytest.raises(ValueError):
        protocol.encode_event("serving")
    assert protocol.decode(protocol.encode_event("binding", address="http://x")) == {"event": "binding", "address": "http://x"}
    assert protocol.decode(b"not json") is None and protocol.decode(b"[1]") is None


def test_every_event_the_engine_emits_is_declared():
    emitted = set()
    for f in (ROOT / "vllm_snapshot" / "entrypoints" / "engine_root.py", ROOT / "tests" / "fake_engine.py",
              ROOT / "vllm_snapshot" / "dev" / "gpu_engine.py"):
        emitted |= set(re.findall(r'emit\("([a-z-]+)"', f.read_text()))
    assert emitted and emitted <= set(protocol.EVENTS)


def test_every_command_the_operations_send_is_declared():
    sent = set()
    for f in (ROOT / "vllm_snapshot" / "ops").glob("*.py"):
        sent |= set(re.findall(r'\.send\("([a-z-]+)"', f.read_text()))
    assert sent and sent <= set(protocol.COMMANDS)


def test_the_encoder_enforces_each_events_fields():
    assert tuple(protocol.EVENT_FIELDS) == protocol.EVENTS
    with pytest.raises(ValueError, match="modules"):
        protocol.encode_event("dump-ready")  # what tests/fake_engine.py once sent
    with pytest.raises(ValueError):
        protocol.encode_event("binding", address="http://x", extra=1)
    with pytest.raises(ValueError, match="info"):
        protocol.encode_event("initialized", oracle={}, info={"kind": "cpu"})
    info = dict.fromkeys(protocol.INFO_FIELDS, "x")
    assert protocol.decode(protocol.encode_event("initialized", oracle={}, info=info))["info"] == info
    assert protocol.decode(protocol.encode_event("initialized", oracle={}, canary={"p": 1}, info=info))["canary"] == {"p": 1}
    with pytest.raises(ValueError, match="optional: \\['canary'\\]"):
        protocol.encode_event("initialized", info=info, canary={})  # an optional field replaces no required one
    with pytest.raises(ValueError):
        protocol.encode_event("oracle", oracle={}, canary={})  # optional only where the table says
    line = protocol.encode_event("dump-ready", modules=["vllm"], sys_path=["/s"])
    assert protocol.missing_fields(protocol.decode(line)) == []
    assert protocol.missing_fields({"event": "dump-ready", "modules": []}) == ["sys_path"]


def emit_calls(path: Path) -> list[tuple[int, str, set[str] | None]]:
    """Each ``emit("name", k=...)`` call in ``path``: (line, event, its keywords; None when it
    passes ``**kw``, which only the encoder can check)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "emit" and node.args \
                and isinstance(node.args[0], ast.Constant):
            kws = {k.arg for k in node.keywords}
            out.append((node.lineno, node.args[0].value, None if None in kws else kws))
    return out


@pytest.mark.parametrize("path", ["vllm_snapshot/entrypoints/engine_root.py", "tests/fake_engine.py",
                                  "vllm_snapshot/dev/gpu_engine.py"])
def test_the_engine_and_the_fake_engine_send_each_events_fields(path):
    # read from the source, so the fake engine's payloads are checked without running it
    calls = emit_calls(ROOT / path)
    assert calls
    wrong = [(line, ev, sorted(kws)) for line, ev, kws in calls
             if kws is not None and not set(protocol.EVENT_FIELDS[ev]) <= kws
             <= set(protocol.EVENT_FIELDS[ev]) | set(protocol.OPTIONAL_FIELDS.get(ev, ()))]
    assert wrong == []
    # each records the HTTP canary's expectation (optional only for the supervisor's sake)
    assert [kws for _, ev, kws in calls if ev == "initialized"] == [{"oracle", "canary", "info"}]


def test_the_supervisor_refuses_an_event_without_its_fields(tmp_path):
    # wait_event checks the awaited event against EVENT_FIELDS (an old fake's bare dump-ready)
    import os

    from vllm_snapshot.errors import EngineError
    from vllm_snapshot.supervise.supervisor import EngineHandle

    r, w = os.pipe()
    os.write(w, b'{"event": "dump-ready"}\n{"event": "slept"}\n')
    ep = EngineHandle(root_pid=os.getpid(), control=None, events_fd=r, log=None)
    try:
        assert ep.wait_event("slept", 5) == {"event": "slept"}  # an event without fields passes
        os.write(w, b'{"event": "dump-ready", "modules": ["vllm"]}\n')
        with pytest.raises(EngineError, match="sys_path"):
            ep.wait_event("dump-ready", 5)
    finally:
        os.close(r)
        os.close(w)
