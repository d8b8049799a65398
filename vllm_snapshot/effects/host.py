"""This host and this process: :class:`LocalHostTools`, :class:`~vllm_snapshot.effects.protocols.HostTools`
over ``/proc``, the user database, mounts, devices and sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..host.privilege import User
from ..host.resources import Offer
from ..store.manifest import EngineUser, ExternalMount
from .checkpoint import CriuRunners
from .protocols import HostTools

if TYPE_CHECKING:
    from ..checkpoint.gpu import GpuSlot


class LocalHostTools(HostTools):
    """:class:`HostTools` over this host (``criu``: shared with
    :class:`vllm_snapshot.effects.checkpoint.LocalCheckpointTools`)."""

    def __init__(self, criu: CriuRunners) -> None:
        self.criu = criu
        self._identity: dict[str, dict[str, str]] = {}

    def require_root(self) -> None:
        from ..host.privilege import require_root

        require_root("create/restore")

    def criu_version(self) -> str:
        return self.criu.binary()[1]

    def host_identity(self, kind: str) -> dict[str, str]:
        if kind not in self._identity:
            from ..checkpoint import criu, gpu
            from ..host import identity

            ident = identity.collect(self.criu_version(), gpu.gpu_identity())
            if kind == "cuda":
                ident.update(gpu.cuda_identity(criu.find_cuda_plugin(self.criu.binary()[0]),
                                               os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")))
            self._identity[kind] = ident
        return dict(self._identity[kind])

    def gpu_uuids(self) -> list[str]:
        from ..checkpoint import gpu

        return sorted(gpu.uuids_by_minor().values())

    def gpu_slots(self) -> list[GpuSlot]:
        from ..checkpoint import gpu

        return gpu.slots()

    def engine_device(self) -> str:
        from ..checkpoint import gpu

        return gpu.engine_device()

    def environ(self) -> dict[str, str]:
        return dict(os.environ)

    def path_exists(self, path: Path) -> bool:
        return os.path.lexists(path)

    def path_kind(self, path: Path) -> str:
        import stat

        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return "nothing"
        return ("a directory" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode)
                else "a symlink" if stat.S_ISLNK(mode) else "a special file")

    def code_paths(self) -> dict[str, Path]:
        return {"Python environment": Path(sys.prefix).resolve(),
                "vllm_snapshot package": Path(__file__).resolve().parents[1]}

    def engine_user(self, name: str) -> User:
        from ..host import privilege
        from ..errors import EnvironmentProblem, UsageError

        try:
            u = privilege.lookup(name)
        except KeyError:
            hint = privilege.USERADD_HINT if name == privilege.DEFAULT_USER else f"create the user {name} or pick another --user"
            raise EnvironmentProblem(f"the engine user {name!r} does not exist on this host", hint=hint) from None
        if u.uid == 0:
            raise UsageError(f"--user {name}: the engine tree would run as root with every capability",
                             hint=f"use an unprivileged user (default: {privilege.DEFAULT_USER})")
        return u

    def engine_access(self, user: User, model_dir: Path) -> dict[str, list[str]]:
        from ..host import privilege
        from ..errors import EnvironmentProblem

        py = privilege.python_paths()
        try:
            model = privilege.access_problems(user, read=[model_dir])
            code = privilege.access_problems(user, reach=list(py.values()),
                                             nowrite=[py[k] for k in py if k.endswith(("environment", "package"))])
            home = privilege.access_problems(user, write=[Path(user.home)])
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise EnvironmentProblem(f"cannot check what the engine user {user.name} can read: {e}") from e
        return {"model": model, "code": code, "home": home}

    def user_problems(self, u: EngineUser) -> list[str]:
        from ..host import privilege

        return privilege.identity_problems(u.name, u.uid, u.gid, u.groups)

    def unreadable_by(self, u: EngineUser, paths: list[Path]) -> list[str]:
        from ..host import privilege
        from ..errors import EnvironmentProblem

        try:
            return privilege.access_problems(privilege.User(u.name, u.uid, u.gid, u.groups, u.home), read=paths)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise EnvironmentProblem(f"cannot check what the engine user {u.name} can read: {e}") from e

    def check_mounts(self, model_dir: Path, env: dict[str, str], also: tuple[str, ...] = ()) -> None:
        from ..checkpoint import mountpolicy

        mountpolicy.check_create(str(model_dir), env, also=also)

    def check_external_mounts(self, mounts: tuple[ExternalMount, ...]) -> list[str]:
        from ..checkpoint import mountpolicy

        return mountpolicy.check_restore(mounts) if mounts else []

    def check_cuda_ready(self) -> None:
        self.criu.cuda_preflight(self.criu.runner("cuda").env)

    def memory_offer(self, detached: bool = False) -> Offer:
        from ..host import cgroups, resources

        return resources.offer(f"/{cgroups.PARENT}/_" if detached else None)

    def port_free(self, host: str, port: int) -> None:
        from ..host import ports

        ports.port_free(host, port)

    def listeners_taken(self, listeners: tuple[tuple[str, int], ...]) -> list[str]:
        from ..host import ports

        return ports.listeners_taken(listeners)

    def take_listener(self, pid: int, host: str, port: int) -> socket.socket:
        from ..host import ports

        return ports.take_listener(pid, host, port)

    def holds_socket(self, pid: int, sock: socket.socket) -> bool:
        from ..host import ports

        return ports.holds_socket(pid, sock)

    def accepting(self, pid: int, sock: socket.socket) -> bool:
        from ..host import ports

        return ports.accepting(pid, sock)

    def ports_held_by(self, pid: int) -> set[int]:
        import psutil

        from ..host.procs import socket_inodes, tree
        from ..host.sockets import TCP_LISTEN, read_tcp_table

        try:
            inodes = set().union(*(socket_inodes(p.pid) for p in tree(pid)))
            return {e.local[1] for e in read_tcp_table() if e.state == TCP_LISTEN and e.inode in inodes}
        except (psutil.Error, OSError, ValueError, IndexError):
            return set()
