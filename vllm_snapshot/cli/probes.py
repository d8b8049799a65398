"""What ``vllm-snapshot doctor`` asks the host: the :class:`Probes` protocol, this host's
:class:`RealProbes`, the :class:`Check` a finding is, and the thresholds and tables the checks
(:mod:`vllm_snapshot.cli.doctor`) judge the answers by."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from ..checkpoint import criu as criu_mod
from .. import paths
from ..errors import EnvironmentProblem
from ..report.results import PartialPull

Severity = Literal["error", "warning", "info"]

#: The default snapshot root (``run_checks`` is given the root the command uses).
DEFAULT_SNAPSHOT_ROOT = str(paths.DEFAULT_ROOT)
DEV_SHM = "/dev/shm"
PROC_GPUS = "/proc/driver/nvidia/gpus"
IO_URING_SYSCTL = "/proc/sys/kernel/io_uring_disabled"
#: Below this much free space, a warning (a CPU snapshot holds the whole engine, weights included).
MIN_FREE_SNAPSHOT_ROOT = 2 << 30
#: Below this much free space in /dev/shm, a warning: restore stages images on disk instead.
MIN_FREE_DEV_SHM = 1 << 30
#: Seconds each ``criu check`` may take.
CRIU_CHECK_TIMEOUT_S = 60.0
#: (feature, severity when missing, why we need it)
CRIU_FEATURES: tuple[tuple[str, Severity, str], ...] = (
    ("ns_pid", "error", "engine in its own PID namespace"),
    ("clone3_set_tid", "warning", "exact PIDs at restore (else ns_last_pid fallback)"),
    ("move_mount_set_group", "warning", "mount-v2 restore of the private mount namespace"),
    ("fdinfo_lock", "error", "--file-locks"),
    ("kcmp_epoll", "warning", "epoll instances (asyncio, ZMQ)"),
)
#: Capabilities CRIU cannot do without here (bit numbers from linux/capability.h).
CAPS_REQUIRED: dict[str, int] = {
    "CAP_SYS_ADMIN": 21, "CAP_SYS_PTRACE": 19, "CAP_CHECKPOINT_RESTORE": 40,
    "CAP_SETUID": 7, "CAP_SETGID": 6,
}
#: Capabilities whose absence limits CRIU, and what for.
CAPS_RECOMMENDED: dict[str, int] = {"CAP_NET_ADMIN": 12, "CAP_SYS_RESOURCE": 24, "CAP_DAC_OVERRIDE": 1}
#: The NVIDIA driver branch our cuda-checkpoint needs: the public checkpoint driver API
#: (``cuCheckpointProcess*``) arrived with r570 / CUDA 12.8 (NVIDIA/cuda-checkpoint README, "570
#: Features"). CRIU's plugin itself only asks for r555 (plugins/cuda/cuda_plugin.c), which is
#: enough for NVIDIA's binary but not for a helper over the driver API.
MIN_GPU_DRIVER = 570
#: The vLLM release the engine child (entrypoints/engine_root.py, which imports private vLLM modules) was
#: checked against; the ``cuda`` and ``cpu`` extras pin it.
SUPPORTED_VLLM = "0.32.0"


@dataclass(frozen=True)
class Check:
    """One finding. ``remedy`` is what to do when ``ok`` is False (may be empty)."""

    name: str
    ok: bool
    severity: Severity
    detail: str
    remedy: str = ""


def empty_cgroups(leaves: list[str]) -> list[str]:
    """Empty engine cgroup leaves (one per hierarchy: ``/sys/fs/cgroup/memory/vllm-snapshot/X``,
    ``/sys/fs/cgroup/cpu/vllm-snapshot/X``, ...) as one leftover per engine, named by its
    ``/vllm-snapshot/X`` (what ``status`` names and ``prune`` removes at once). Pure."""
    by_name: dict[str, int] = {}
    for leaf in leaves:
        name = leaf.rstrip("/").rsplit("/", 1)[-1]
        by_name[name] = by_name.get(name, 0) + 1
    return [f"empty engine cgroup /vllm-snapshot/{n} (holds no process and no memory"
            + (f"; in {k} hierarchies)" if k > 1 else ")") for n, k in sorted(by_name.items())]


class Probes(Protocol):
    """Everything :func:`run_checks` asks the host. Implementations must not raise except
    where stated."""

    def euid(self) -> int: ...

    def read_text(self, path: str) -> str | None:
        """The file's text, None when it cannot be read."""

    def find_criu(self) -> str | None:
        """Path of the CRIU binary vllm-snapshot would use (:func:`criu.find_criu`), or None."""

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        """(exit status, stdout + stderr). A program that cannot start: (127, reason); one
        that times out: (124, reason)."""

    def kernel_release(self) -> str: ...

    def glibc(self) -> str:
        """e.g. ``glibc 2.36``; ``unknown`` when not glibc."""

    def lstat(self, path: str) -> os.stat_result | None: ...

    def stat(self, path: str) -> os.stat_result | None: ...

    def free_bytes(self, path: str) -> int | None:
        """Bytes available to us on the file system holding ``path``."""

    def writable(self, path: str) -> bool: ...

    def which(self, name: str) -> str | None: ...

    def vllm_version(self) -> str:
        """:func:`identity.vllm_version`: a version, ``absent`` or ``unknown``."""

    def import_error(self, module: str) -> str | None:
        """None when ``module`` imports, else the error as text."""

    def is_dir(self, path: str) -> bool: ...

    def is_file(self, path: str) -> bool: ...

    def gpus(self) -> list:
        """:func:`gpu.query`'s list of GpuInfo. May raise EnvironmentProblem."""

    def env(self, name: str) -> str | None: ...

    def mountinfo(self) -> str:
        """This process's ``/proc/self/mountinfo`` text ("" when unreadable)."""

    def leftovers(self, snapshot_root: str) -> list[str]:
        """Staging dirs of killed restores and temp dirs of killed creates near
        ``snapshot_root``, /dev/shm and the staging dir, orphaned engine trees, engine cgroups
        left empty (what ``prune`` would remove)."""

    def partial_pulls(self, snapshot_root: str) -> list[PartialPull]:
        """The partial dirs interrupted pulls left under ``snapshot_root`` for resuming
        (:func:`vllm_snapshot.fleet.partial.kept`, as dicts): not leftovers, prune keeps them."""

    def engine_user(self, name: str):
        """:func:`privilege.lookup` of ``name``, None when there is no such user."""

    def user_access(self, user, read: Sequence[str] = (), reach: Sequence[str] = (), nowrite: Sequence[str] = (),
                    write: Sequence[str] = ()) -> list[str]:
        """:func:`privilege.access_problems` as ``user``; a check that cannot run is one problem."""

    def python_paths(self) -> dict[str, str]:
        """:func:`privilege.python_paths` as text."""


class RealProbes(Probes):
    """:class:`Probes` for this host."""

    def euid(self) -> int:
        return os.geteuid()

    def read_text(self, path: str) -> str | None:
        try:
            return Path(path).read_text(errors="replace")
        except OSError:
            return None

    def find_criu(self) -> str | None:
        try:
            return criu_mod.find_criu()
        except EnvironmentProblem:
            return None

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        try:
            p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL, cwd="/")
        except subprocess.TimeoutExpired:
            return 124, f"timed out after {timeout:.0f} s"
        except OSError as e:
            return 127, str(e)
        return p.returncode, (p.stdout or "") + (p.stderr or "")

    def kernel_release(self) -> str:
        return platform.release()

    def glibc(self) -> str:
        return os.confstr("CS_GNU_LIBC_VERSION") or "unknown"

    def lstat(self, path: str) -> os.stat_result | None:
        try:
            return os.lstat(path)
        except OSError:
            return None

    def stat(self, path: str) -> os.stat_result | None:
        try:
            return os.stat(path)
        except OSError:
            return None

    def free_bytes(self, path: str) -> int | None:
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def writable(self, path: str) -> bool:
        return os.access(path, os.W_OK)

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def vllm_version(self) -> str:
        from ..host.identity import vllm_version

        return vllm_version()

    def import_error(self, module: str) -> str | None:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure is the answer
            return f"{type(e).__name__}: {e}"
        return None

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def gpus(self) -> list:
        from ..checkpoint import gpu

        return gpu.query() or []

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def mountinfo(self) -> str:
        return self.read_text("/proc/self/mountinfo") or ""

    def leftovers(self, snapshot_root: str) -> list[str]:
        from ..store import archive, reclaim

        found = reclaim.leftovers(Path(snapshot_root))  # what prune's reclaim removes, found the same way
        out = [f"staging dir {x.path} of a killed restore ({'RAM' if x.path.is_relative_to(archive.SHM) else 'disk'})"
               for x in found if x.kind == "staging"]
        out += [f"engine tree PID {x.proc.pid} nobody owns (memory)" for x in found if x.kind == "orphan"]
        out += [f"temp dir {x.path} of a killed create (disk)" for x in found if x.kind == "temp"]
        return out + empty_cgroups([str(x.path) for x in found if x.kind == "cgroup"])

    def partial_pulls(self, snapshot_root: str) -> list[PartialPull]:
        import dataclasses

        from ..fleet import partial

        return [PartialPull(**dataclasses.asdict(x)) for x in partial.kept(Path(snapshot_root))]


    def engine_user(self, name: str):
        from ..host import privilege

        try:
            return privilege.lookup(name)
        except KeyError:
            return None

    def user_access(self, user, read: Sequence[str] = (), reach: Sequence[str] = (), nowrite: Sequence[str] = (),
                    write: Sequence[str] = ()) -> list[str]:
        from ..host import privilege

        try:
            return privilege.access_problems(user, read=[Path(x) for x in read], reach=[Path(x) for x in reach],
                                             nowrite=[Path(x) for x in nowrite], write=[Path(x) for x in write])
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            return [f"the check as {user.name} could not run: {e}"]

    def python_paths(self) -> dict[str, str]:
        from ..host import privilege

        return {k: str(v) for k, v in privilege.python_paths().items()}
