"""Every double is tied to what it stands for: the real class and the fake define exactly the
Protocol's methods (no more, no less), with the same signatures (vLLM's own fake drifted from
its real class without such a test)."""

from __future__ import annotations

import inspect
from typing import Generic, Protocol

import pytest

from vllm_snapshot.checkpoint import cuda_checkpoint
from vllm_snapshot.cli import doctor
from vllm_snapshot.effects import checkpoint, engine, files, host, model, protocols, runtime, store, tools
from vllm_snapshot.fleet.tools import FleetTools, LocalFleetTools
from vllm_snapshot.store import archive
from vllm_snapshot.supervise import supervisor

import fakes
from test_cuda_checkpoint import FakeDriver
from test_doctor import FakeProbes


def _methods(cls) -> dict[str, inspect.Signature]:
    """Public methods ``cls`` defines or inherits: for a Protocol, from it and the Protocols it
    extends; for a class, from its own classes (not the Protocol stubs it declares)."""
    out: dict[str, inspect.Signature] = {}
    proto = getattr(cls, "_is_protocol", False)
    for k in reversed(cls.__mro__):
        if k in (object, Protocol, Generic) or getattr(k, "_is_protocol", False) != proto:
            continue
        for n, f in vars(k).items():
            if callable(f) and not n.startswith("_") and not isinstance(f, (staticmethod, classmethod, type)):
                out[n] = inspect.signature(f)
    return out


#: (Protocol, real class, fake): one row per role of the Tools bundle (the first nine), then
#: the other seams.
#: Every fake and every role's real class define exactly the Protocol's methods; the real
#: classes of the other seams may have more (their own side of the channel: ``tree``,
#: ``engine_ends``, ...).
PAIRS = [
    (protocols.HostTools, host.LocalHostTools, fakes.FakeHostTools),
    (protocols.ModelTools, model.LocalModelTools, fakes.FakeModelTools),
    (protocols.SnapshotFiles, files.LocalSnapshotFiles, fakes.FakeSnapshotFiles),
    (protocols.CheckpointTools, checkpoint.LocalCheckpointTools, fakes.FakeCheckpointTools),
    (protocols.EngineTools, engine.LocalEngineTools, fakes.FakeEngineTools),
    (protocols.StoreTools, store.LocalStoreTools, fakes.FakeStoreTools),
    (protocols.RuntimeTools, runtime.LocalRuntimeTools, fakes.FakeRuntimeTools),
    (protocols.Clock, runtime.LocalClock, fakes.FakeClock),
    (FleetTools, LocalFleetTools, fakes.FakeFleetTools),
    (protocols.StagedImages, archive.Checking, fakes.FakeChecking),
    (protocols.UnpackingImages, archive.Unpacking, fakes.FakeUnpacking),
    (protocols.Engine, supervisor.EngineHandle, fakes.FakeEngine),
    (protocols.EngineChannel, supervisor.Channel, fakes.FakeChannel),
    (doctor.Probes, doctor.RealProbes, FakeProbes),
    (cuda_checkpoint.Driver, cuda_checkpoint.CudaDriver, FakeDriver),
]


@pytest.mark.parametrize("proto,real,fake", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_real_and_fake_define_exactly_the_protocols_methods(proto, real, fake):
    want = _methods(proto)
    assert want, f"{proto.__name__} declares no methods"
    for cls in (real, fake):
        have = _methods(cls)
        missing = sorted(set(want) - set(have))
        assert not missing, f"{cls.__name__} does not define {missing} of {proto.__name__}"
        extra = sorted(set(have) - set(want))
        exact = cls is fake or (proto, real, fake) in PAIRS[:9]
        assert not (extra and exact), f"{cls.__name__} has public methods {extra} that {proto.__name__} does not declare"
        for name, sig in want.items():
            assert have[name] == sig, f"{cls.__name__}.{name}{have[name]} != {proto.__name__}.{name}{sig}"


@pytest.mark.parametrize("proto,fake", [(p[0], p[2]) for p in PAIRS], ids=[p[0].__name__ for p in PAIRS])
def test_fakes_declare_their_protocol(proto, fake):
    assert proto in fake.__mro__


def test_the_staged_images_data_member_is_on_both_sides():
    """restore reads ``waited_s`` of an :class:`~vllm_snapshot.effects.protocols.UnpackingImages`."""
    assert "waited_s" in protocols.UnpackingImages.__annotations__
    assert isinstance(fakes.FakeUnpacking(fakes.FakeWorld()), protocols.UnpackingImages)
    assert not isinstance(fakes.FakeChecking(fakes.FakeWorld()), protocols.UnpackingImages)
    assert "self.waited_s" in inspect.getsource(archive.Unpacking.__init__)


def test_every_role_of_the_bundle_has_a_row_and_the_local_bundle_fills_it():
    roles = {f.name: f.type for f in tools.Tools.__dataclass_fields__.values()}
    assert set(roles.values()) == {p[0].__name__ for p in PAIRS[:9]}
    local, fake = tools.local_tools(), fakes.FakeWorld().tools
    for name in roles:
        row = next(p for p in PAIRS if p[0].__name__ == roles[name])
        assert type(getattr(local, name)) is row[1] and type(getattr(fake, name)) is row[2]


def test_no_role_is_wider_than_thirty_methods():
    widths = {p.__name__: len(_methods(p)) for p, _, _ in PAIRS[:9]}
    assert max(widths.values()) <= 30, widths


def test_a_stand_in_with_another_signature_is_refused():
    # review: module-level replacements had other arities than what they replaced (lambda req, rep
    # for ops.restore(req, rep, tools=None); env= for frontend.check's environ=)
    from helpers import stand_in
    from vllm_snapshot import ops
    from vllm_snapshot.supervise import frontend

    with pytest.raises(AssertionError, match="does not stand for"):
        stand_in(ops.restore, lambda req, rep: None)
    with pytest.raises(AssertionError, match="does not stand for"):
        stand_in(frontend.check, lambda args, env=None: None)

    def ok(args, environ=None):
        return None

    assert stand_in(frontend.check, ok) is ok


def test_the_demo_calls_only_what_the_role_bundle_has():
    # `make demo` broke when the one seam became a bundle of roles (t.require_root() on Tools):
    # no test runs the demo command, so its calls on the bundle are checked here
    import ast
    import dataclasses
    import typing
    from pathlib import Path

    from vllm_snapshot.effects import tools as T

    hints = typing.get_type_hints(T.Tools)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(T.Tools)}
    src = Path(T.__file__).resolve().parents[1] / "cli" / "demo.py"
    used = [(n.value.attr, n.attr) if isinstance(n.value, ast.Attribute) else (n.attr, None)
            for n in ast.walk(ast.parse(src.read_text()))
            if isinstance(n, ast.Attribute) and (
                (isinstance(n.value, ast.Name) and n.value.id == "t" and not isinstance(getattr(n, "ctx", None), ast.Store))
                or (isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name) and n.value.value.id == "t"))]
    assert used, "the demo no longer uses the bundle named t: update this test"
    for role, method in used:
        assert role in fields, f"demo.py uses t.{role}: Tools has no such role ({sorted(fields)})"
        if method is not None:
            assert hasattr(fields[role], method), f"demo.py uses t.{role}.{method}: {fields[role].__name__} has no such method"
