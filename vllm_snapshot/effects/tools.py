"""Every side effect the operations (:mod:`vllm_snapshot.ops`) have, as one bundle of roles.

:class:`Tools` holds one implementation of each role Protocol of :mod:`.protocols` (this host,
the model directory, snapshot directories, CRIU, the engine, the store, running engines, time,
registries: :class:`vllm_snapshot.effects.protocols.FleetTools`);
:func:`local_tools` builds the real ones, each in a module of its own (:mod:`.host`,
:mod:`.model`, :mod:`.files`, :mod:`.checkpoint`, :mod:`.engine`, :mod:`.store`,
:mod:`.runtime`); ``tests/fakes.py`` has one recording fake per role over one call log.

The operations only sequence calls to these methods; each step function takes the roles it
uses. Heavy imports (pycriu, vLLM) happen inside the methods that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocols import (
    CheckpointTools,
    Clock,
    EngineTools,
    FleetTools,
    HostTools,
    ModelTools,
    RuntimeTools,
    SnapshotFiles,
    StoreTools,
)


@dataclass(frozen=True)
class Tools:
    """One implementation of each role (tests swap one with :func:`dataclasses.replace`)."""

    host: HostTools
    model: ModelTools
    files: SnapshotFiles
    checkpoint: CheckpointTools
    engine: EngineTools
    store: StoreTools
    runtime: RuntimeTools
    clock: Clock
    fleet: FleetTools


def local_tools(engine_argv: tuple[str, ...] | None = None) -> Tools:
    """The roles over this host. ``engine_argv`` replaces the engine root's command (tests run
    a protocol-speaking fake engine through it)."""
    from .fleet import LocalFleetTools
    from .checkpoint import CriuRunners, LocalCheckpointTools
    from .engine import LocalEngineTools
    from .files import LocalSnapshotFiles
    from .host import LocalHostTools
    from .model import LocalModelTools
    from .runtime import LocalClock, LocalRuntimeTools
    from .store import LocalStoreTools

    criu = CriuRunners()  # one CRIU probe for the host's identity and every CRIU run
    return Tools(host=LocalHostTools(criu), model=LocalModelTools(), files=LocalSnapshotFiles(),
                 checkpoint=LocalCheckpointTools(criu), engine=LocalEngineTools(engine_argv),
                 store=LocalStoreTools(), runtime=LocalRuntimeTools(), clock=LocalClock(), fleet=LocalFleetTools())
