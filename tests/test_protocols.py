"""Every fake is tied to its Protocol: the real class and the fake define exactly the
Protocol's methods, with the same signatures (vLLM's own fake drifted from its real class
without such a test)."""

from __future__ import annotations

import inspect

import pytest

from vllm_snapshot.checkpoint import cuda_checkpoint
from vllm_snapshot.cli import doctor
from vllm_snapshot.supervise import supervisor
from vllm_snapshot.effects import tools

import fakes
from test_cuda_checkpoint import FakeDriver
from test_doctor import FakeProbes


def _methods(cls) -> dict[str, inspect.Signature]:
    """Public methods defined by ``cls`` itself (not inherited from a Protocol stub)."""
    return {n: inspect.signature(f) for n, f in vars(cls).items()
            if callable(f) and not n.startswith("_") and not isinstance(f, (staticmethod, classmethod))}


def _protocol_methods(proto) -> dict[str, inspect.Signature]:
    return _methods(proto)


PAIRS = [
    (tools.SnapshotTools, tools.LocalTools, fakes.FakeTools),
    (tools.Engine, supervisor.EngineHandle, fakes.FakeEngine),
    (tools.EngineChannel, supervisor.Channel, fakes.FakeChannel),
    (doctor.Probes, doctor.RealProbes, FakeProbes),
    (cuda_checkpoint.Driver, cuda_checkpoint.CudaDriver, FakeDriver),
]


@pytest.mark.parametrize("proto,real,fake", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_real_and_fake_match_the_protocol(proto, real, fake):
    want = _protocol_methods(proto)
    assert want, f"{proto.__name__} declares no methods"
    for cls in (real, fake):
        have = _methods(cls)
        missing = sorted(set(want) - set(have))
        assert not missing, f"{cls.__name__} does not define {missing} of {proto.__name__}"
        for name, sig in want.items():
            assert have[name] == sig, f"{cls.__name__}.{name}{have[name]} != {proto.__name__}.{name}{sig}"


@pytest.mark.parametrize("proto,fake", [(p[0], p[2]) for p in PAIRS], ids=[p[0].__name__ for p in PAIRS])
def test_fakes_declare_their_protocol(proto, fake):
    assert proto in fake.__mro__


def test_fakes_have_no_public_methods_beyond_the_protocol():
    extra = sorted(set(_methods(fakes.FakeTools)) - set(_protocol_methods(tools.SnapshotTools)))
    assert extra == []
