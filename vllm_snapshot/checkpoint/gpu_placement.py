"""Where restored GPU state goes: this host's GPU slots (:class:`GpuSlot`), the placement of
a snapshot's recorded GPU onto one of them (:func:`place`: the recorded one, else its model at
its minor, else a remap), and whether a remap can run here (:func:`check_remap_usable`). Pure.
:mod:`vllm_snapshot.checkpoint.gpu` reads the slots and re-exports these names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import EnvironmentProblem
from ..host.identity import GPU_USED_FIELDS  # noqa: F401 - the fields place() reads


@dataclass(frozen=True)
class GpuSlot:
    """One GPU of this host: ``uuid`` (``GPU-...``), ``name`` (model, as nvidia-smi prints it),
    ``minor`` (N of its device file ``/dev/nvidiaN``)."""

    uuid: str
    name: str
    minor: int


@dataclass(frozen=True)
class GpuPlacement:
    """Where a restore puts a CUDA snapshot's GPU state: ``recorded`` (the UUID its tree used at
    the dump) and ``target`` (the UUID of this host's GPU it goes onto), ``minor`` the target's
    device minor (None when not known: the recorded GPU itself, on a host without its /proc
    file)."""

    recorded: str
    target: str
    minor: int | None = None

    @property
    def remapped(self) -> bool:
        """True when the GPU state goes onto another GPU than the one it was checkpointed on."""
        return self.target != self.recorded

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The device map (``((recorded, target),)``) when remapped, else ``()``."""
        return ((self.recorded, self.target),) if self.remapped else ()

    def describe(self) -> str:
        """``GPU <target>`` and, when remapped, ``(recorded <recorded>)``."""
        return f"GPU {self.target}" + (f" (recorded {self.recorded})" if self.remapped else "")


def _listing(here: Sequence[GpuSlot]) -> str:
    return "; ".join(f"/dev/nvidia{s.minor} {s.uuid} ({s.name})" for s in sorted(here, key=lambda s: s.minor)) or "none"


def place(recorded: Mapping[str, str], here: Sequence[GpuSlot]) -> GpuPlacement | None:
    """Which GPU of this host (``here``) a CUDA snapshot's GPU state goes onto, from the facts
    it recorded (``recorded``: the manifest's host fields or a pulled image's machine
    annotations, :data:`GPU_USED_FIELDS`). None for a snapshot without ``gpu_uuid_used`` (CPU).

    * The recorded GPU is here: onto it, as it was (no device map).
    * Else the GPU here with the **same device minor** (``/dev/nvidiaN``) and the **same
      model** (``gpu_name_used``), remapped (``pairs``). The same minor because CRIU restores
      every file the tree held by its path: a GPU device file left open (``/dev/nvidiaN``)
      would be re-opened as whatever GPU has that minor here, which must be the GPU the state
      goes onto; on identical nodes of a fleet the GPU at the same minor is the same slot. The
      same model because the driver restores only onto "the same chip type" (cuda-bindings'
      ``cuCheckpointProcessRestore``) and the engine's memory budget was profiled on it.
      Whether that GPU is free is decided later, under its lock (:func:`check_free_memory`).

    Pure. Raises IncompatibleHostError naming the recorded GPU, this host's GPUs and what to do
    when none fits, or when the snapshot predates ``gpu_minor_used``/``gpu_name_used`` (it
    restores on its own GPU only)."""
    from ..errors import IncompatibleHostError

    uuid = recorded.get("gpu_uuid_used")
    if not uuid:
        return None
    for s in here:
        if s.uuid == uuid:
            return GpuPlacement(uuid, uuid, s.minor)
    minor_text, name = recorded.get("gpu_minor_used", ""), recorded.get("gpu_name_used", "")
    lead = f"the snapshot's engine used GPU {uuid}, which this host does not have (GPUs here: {_listing(here)})"
    details = {"gpu_uuid_used": uuid, "gpus_here": [s.__dict__ for s in here]}
    if not minor_text.isdigit() or not name:
        raise IncompatibleHostError(
            lead + "; the snapshot does not record that GPU's device minor and model (made before GPU remapping), "
            "so it restores only onto that GPU", hint="restore it on the host that has that GPU, or re-create the "
                                                      "snapshot with this version", details=details)
    minor = int(minor_text)
    if uuid.startswith("MIG-"):
        raise IncompatibleHostError(lead + "; it is a MIG instance, which the driver does not remap",
                                    hint="restore it on the host that has that MIG instance", details=details)
    slot = next((s for s in here if s.minor == minor), None)
    if slot is None:
        raise IncompatibleHostError(
            lead + f"; a remap needs a {name} at /dev/nvidia{minor} (the device file the tree held), and there is none",
            hint=f"restore it on a node whose /dev/nvidia{minor} is a {name}, or re-create the snapshot here",
            details=details)
    if slot.name != name:
        raise IncompatibleHostError(
            lead + f"; /dev/nvidia{minor} here is a {slot.name}, the snapshot's GPU was a {name} (the driver restores "
            "only onto the same model)", hint=f"restore it on a node whose /dev/nvidia{minor} is a {name}",
            details=details)
    return GpuPlacement(uuid, slot.uuid, minor)


def check_remap_usable(rc: int, out: str, own_helper: str | None = None) -> None:
    """Before a CRIU restore that remaps GPUs: the ``cuda-checkpoint`` CRIU will run must take a
    device map. ``rc``, ``out``: the exit status and output of its ``-h``;
    ``own_helper``: ``$VLLM_SNAPSHOT_CUDA_CHECKPOINT`` (NVIDIA's binary: CRIU 4.2.1's plugin runs
    it without ``--device-map`` and it does not read our environment). Pure. Raises
    EnvironmentProblem saying why not and what to do."""
    from .cuda_checkpoint import NO_REMAP_HELP, REMAP_HELP

    if own_helper:
        raise EnvironmentProblem(
            f"restoring onto another GPU needs a device map, but VLLM_SNAPSHOT_CUDA_CHECKPOINT={own_helper} makes CRIU "
            "run that cuda-checkpoint, to which CRIU 4.2.1 passes none",
            hint="unset VLLM_SNAPSHOT_CUDA_CHECKPOINT (vllm-snapshot's own helper takes the map), or restore on the "
                 "host that has the recorded GPU")
    if rc != 0 or REMAP_HELP not in out:
        why = next((ln.strip(" ()") for ln in out.splitlines() if NO_REMAP_HELP in ln),
                   " ".join(out.split())[:300] or f"exit {rc}")
        raise EnvironmentProblem(
            f"restoring onto another GPU needs a driver that remaps GPUs, and this one cannot: {why}",
            hint=f"upgrade the NVIDIA driver to r580+ and cuda-bindings to 13, or restore on the host that has the "
                 "recorded GPU")
