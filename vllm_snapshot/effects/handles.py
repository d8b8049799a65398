"""The handles the seam's roles (:mod:`.protocols`) return: a running engine tree, the pipes of
a restored one, create's end of an engine's weights channel, and a restore's staged images with
their checksum verdict. Each has one real implementation (named in its docstring) and one
recording fake in ``tests/fakes.py``, checked against each other by ``tests/test_protocols.py``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..store.manifest import WeightsFile


class Engine(Protocol):
    """A running engine tree we supervise (:class:`vllm_snapshot.supervise.supervisor.EngineHandle`)."""

    root_pid: int

    def send(self, cmd: str, **kw) -> None:
        """Send one command (:mod:`vllm_snapshot.engine.protocol`). Raises EngineError."""

    def wait_event(self, name: str, timeout: float) -> dict:
        """The next event ``name``. Raises EngineError (error event, exit, timeout)."""

    def alive(self) -> bool: ...

    def kill(self, grace: float = 0.0) -> None:
        """SIGTERM, ``grace`` seconds, SIGKILL; wait until every process is gone."""

    def close(self) -> None:
        """Close our ends of the channel."""

    def reap(self, block: bool = True) -> int | None:
        """The root's exit code when it is our child and has exited."""

    def log_tail(self, n: int = 20) -> str: ...

    def drain_log(self, timeout_s: float = 5.0) -> None: ...


class EngineChannel(Protocol):
    """Fresh pipes for a restored engine (:class:`vllm_snapshot.supervise.supervisor.Channel`)."""

    def inherit_fds(self, keys: dict[str, str]) -> tuple[tuple[str, int], ...]: ...

    def close(self) -> None: ...


class WeightsChannel(Protocol):
    """Create's end of an engine's weights channel (:class:`vllm_snapshot.store.weights_channel.WeightsServer`)."""

    def result(self) -> WeightsFile | None:
        """The weights file the engine's worker wrote and mapped (None: no worker used the
        channel). Raises EngineError naming what failed."""

    def close(self) -> None: ...


class StagedImages(Protocol):
    """A restore's staged images and their checksum verdict (:class:`vllm_snapshot.store.checksums.Checking`:
    uncompressed images hard-linked, verified in the background while CRIU restores)."""

    def wait(self) -> None:
        """Block until every checksum was verified. Raises CorruptSnapshotError (a mismatch)."""

    def cancel(self) -> None:
        """Stop the verification and wait for it."""


@runtime_checkable
class UnpackingImages(StagedImages, Protocol):
    """Staged images of a compressed snapshot whose memory pages are still being unpacked
    (:class:`vllm_snapshot.store.archive.Unpacking`): :meth:`ready` must return before CRIU reads
    a pages image."""

    waited_s: float  # seconds ready() blocked

    def ready(self) -> None:
        """Block until every image is staged. Raises CorruptSnapshotError."""
