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
    for f in (ROOT / "vllm_snapshot" / "engine" / "main.py", ROOT / "tests" / "fake_engine.py"):
        emitted |= set(re.findall(r'emit\("([a-z-]+)"', f.read_text()))
    assert emitted and emitted <= set(protocol.EVENTS)


def test_every_command_the_operations_send_is_declared():
    sent = set()
    for f in (ROOT / "vllm_snapshot" / "ops").glob("*.py"):
        sent |= set(re.findall(r'\.send\("([a-z-]+)"', f.read_text()))
    assert sent and sent <= set(protocol.COMMANDS)
