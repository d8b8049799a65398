"""The engine process and its server: :class:`LocalEngineTools`,
:class:`~vllm_snapshot.effects.protocols.EngineTools` over :mod:`vllm_snapshot.supervise` and
:mod:`.http`."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

from .. import paths
from ..engine.spec import EngineSpec
from ..store.manifest import Manifest, WeightsFile
from .protocols import EngineTools
from .handles import Engine, EngineChannel, WeightsChannel


class LocalWeightsChannel(WeightsChannel):
    """:class:`vllm_snapshot.store.weights_channel.WeightsServer` whose result is the manifest's record."""

    def __init__(self, root_pid: int, root: Path, uid: int) -> None:
        from ..store.weights_channel import WeightsServer

        self.server = WeightsServer(root_pid, root, uid)

    def result(self) -> WeightsFile | None:
        from ..store import weights

        got = self.server.result()
        if got is None:
            return None
        path, digest, _reused, mapped = got
        return weights.record(path, digest, int(mapped.get("tensors") or 0), int(mapped.get("bytes") or 0))

    def close(self) -> None:
        self.server.close()


class LocalEngineTools(EngineTools):
    """:class:`EngineTools` over :mod:`vllm_snapshot.supervise` (``engine_argv`` replaces the engine
    root's command: tests run a protocol-speaking fake engine through it)."""

    def __init__(self, engine_argv: tuple[str, ...] | None = None) -> None:
        from ..supervise.supervisor import ENGINE_ARGV

        self.engine_argv = tuple(engine_argv or ENGINE_ARGV)

    def launch_engine(self, spec: EngineSpec, env: dict[str, str], log_path: Path,
                      echo: Callable[[bytes], None] | None) -> Engine:
        from ..supervise.supervisor import launch

        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        log = os.fdopen(fd, "ab", buffering=0)  # a write after close raises, never hits a reused fd
        try:
            h = launch(spec, env, [log.write] + ([echo] if echo else []), self.engine_argv)
        except BaseException:
            log.close()
            raise
        h.on_close.append(log.close)
        return h

    def new_channel(self, log_file: Path | None) -> EngineChannel:
        from ..supervise.supervisor import Channel

        return Channel.open(log_file)

    def adopt(self, pid: int, channel: EngineChannel, echo: Callable[[bytes], None] | None) -> Engine:
        from ..supervise.supervisor import restored_handle

        return restored_handle(pid, channel, [echo] if echo else [])

    def serve_engine(self, engine: Engine, host: str, port: int, die_with_parent: bool,
                     frontend: tuple[str, ...] = (), drain_s: float | None = None,
                     listener: socket.socket | None = None) -> None:
        from ..supervise import handoff

        handoff.serve_engine(engine, host, port, die_with_parent, frontend, drain_s, listener=listener)

    def http_health(self, url: str) -> bool:
        from . import http

        return http.health(url)

    def http_canary(self, url: str, m: Manifest, api_key: str | None = None) -> list[str]:
        from . import http

        return http.canary(url, m, api_key)

    def weights_channel(self, engine: Engine, root: Path, uid: int) -> WeightsChannel:
        return LocalWeightsChannel(engine.root_pid, root, uid)

    def check_log_file(self, path: Path) -> None:
        from ..supervise.supervisor import check_log_file

        check_log_file(path)

    def default_log_file(self, snapshot: Path, port: int) -> Path:
        import errno

        from ..errors import ENVIRONMENT_ERRNOS, EnvironmentProblem

        d = paths.log_dir()
        f = d / f"{snapshot.name}-{port}.log"
        try:  # before anything starts: a detached engine with nowhere to log is refused, not half-started
            paths.ensure_private_dir(d)
            os.close(os.open(f, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600))
        except OSError as e:
            if e.errno not in ENVIRONMENT_ERRNOS:
                raise
            why = {errno.EROFS: "is on a read-only filesystem", errno.ENOSPC: "is on a full filesystem",
                   errno.EDQUOT: "is on a filesystem whose disk quota is used up"}.get(e.errno, f"cannot be written ({e.strerror})")
            raise EnvironmentProblem(f"the engine log directory {d} {why}: the detached engine's log {f} cannot be "
                                     "created; nothing was started",
                                     hint="set VLLM_SNAPSHOT_LOG_DIR to a writable directory, or pass --log-file FILE",
                                     details={"log_dir": str(d), "errno": errno.errorcode.get(e.errno)}) from e
        return f

    def log_room(self, path: Path) -> int | None:
        try:
            st = os.statvfs(path if path.exists() else path.parent)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def keep_log(self, path: Path, what: str) -> Path | None:
        from ..supervise.supervisor import keep_log

        return keep_log(path, what)

    def read_log_tail(self, path: Path, lines: int = 20) -> str | None:
        from ..supervise.supervisor import log_file_tail

        return log_file_tail(path, lines)
