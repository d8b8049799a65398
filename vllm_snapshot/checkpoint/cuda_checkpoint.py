"""Our ``cuda-checkpoint``: the program CRIU's CUDA plugin runs, written over ``cuda-bindings``.

CRIU's CUDA plugin does not talk to the driver itself: it runs a program named
``cuda-checkpoint`` found on ``$PATH`` (NVIDIA ships one; this module is ours, so the tool has no
binary download). :func:`helper_dir` makes a private directory holding an executable
``cuda-checkpoint`` wrapper that runs this module; put that directory first on CRIU's ``PATH``.

The contract, read from CRIU 4.2.1 ``plugins/cuda/cuda_plugin.c`` (functions named):

* Every call is ``execvp("cuda-checkpoint", args)`` with **stdout and stderr both dup2'ed into
  one pipe** (``launch_cuda_checkpoint``); the exit status is the success test (0 = success,
  anything else or a signal = failure) and the output is kept in a buffer of
  ``CUDA_CKPT_BUF_SIZE`` = 128 bytes (2048 for ``-h``). So nothing may be written before the
  answer on success: this program prints only the answer, and the wrapper runs Python with
  ``-W ignore`` so no warning lands in front of it.
* ``cuda-checkpoint -h`` (``cuda_checkpoint_supports_flag``, called from ``cuda_plugin_init``):
  must exit 0 and its output must contain ``--action`` within the first 2047 bytes, otherwise
  the plugin disables itself ("an r555 or higher version driver is required"; a non-zero exit:
  "check that cuda-checkpoint is present in $PATH"). Our ``-h`` therefore **probes the
  driver** (:func:`probe`): it names ``--action`` only when this driver has the checkpoint API,
  and exits :data:`EXIT_UNAVAILABLE` when the helper cannot work at all (no ``cuda-bindings``,
  ``cuInit`` failed), so the plugin never runs with a helper that would answer "no CUDA here"
  for every process.
* ``cuda-checkpoint --get-restore-tid --pid N`` (``get_cuda_restore_tid``): output is parsed
  with ``atoi``, so it must start with the decimal TID. A non-zero exit means "not a CUDA
  process": every hook then skips that PID ("No need to checkpoint devices on pid"). So a
  process without CUDA **must** make this exit non-zero, never print ``0``.
* ``cuda-checkpoint --get-state --pid N`` (``get_cuda_state``, called from
  ``cuda_plugin_pause_devices`` with the **restore thread's TID**, not the PID): output is
  compared with ``strncmp`` against ``running`` / ``locked`` / ``checkpointed`` at offset 0;
  anything else is "Unknown CUDA state" and fails the dump. We therefore map a TID to its
  process (``Tgid:`` of ``/proc/N/status``) before calling the driver, and print ``failed`` for
  ``CU_PROCESS_STATE_FAILED``; the transient states (checkpointing, restoring) exit 1.
* ``cuda-checkpoint --action lock --pid N [--timeout MS]`` (``cuda_process_checkpoint_action``
  from ``cuda_plugin_pause_devices``): ``--timeout`` is passed only when > 0, as
  ``opts.timeout * 1000`` -- CRIU's ``--timeout`` (seconds, default ``DEFAULT_TIMEOUT`` = 10 in
  ``criu/include/cr_options.h``) in **milliseconds**. ``--action checkpoint`` (from
  ``cuda_plugin_checkpoint_devices``), ``--action restore`` and ``--action unlock`` (from
  ``resume_device``) never get ``--timeout``. All PIDs are host PIDs (``item->pid->real``).
* ``--action restore`` may take ``--device-map OLD=NEW[,OLD=NEW...]`` (NVIDIA's cuda-checkpoint
  r580+ spelling): restore the GPU state checkpointed on GPU ``OLD`` onto GPU ``NEW`` (UUIDs as
  nvidia-smi prints them, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``). CRIU 4.2.1's plugin
  passes no map (``--plugin-option cuda.device-map`` is CRIU 4.3), so vllm-snapshot sets
  :data:`DEVICE_MAP_ENV` in CRIU's environment, which the plugin's ``execvp`` hands to this
  program; a ``--device-map`` on the command line wins over it, and other actions ignore it.
  The map becomes ``CUcheckpointRestoreArgs.gpuPairs``/``gpuPairsCount`` (an array of
  ``CUcheckpointGpuPair{oldUuid, newUuid}``; the driver requires every checkpointed GPU in it).
  ``-h`` lists ``--device-map`` (:data:`REMAP_HELP`) only when this driver and these bindings
  can remap (:data:`MIN_REMAP_DRIVER_API`, the ``gpuPairs`` field); vllm-snapshot asks before a
  restore that needs a remap.
* Order during ``criu dump``: get-restore-tid, get-state(tid), lock (PAUSE_DEVICES, before the
  freeze); checkpoint (CHECKPOINT_DEVICES, frozen); and on ``--leave-running`` or error,
  restore + unlock (``cuda_plugin_fini`` -> ``resume_device``). During ``criu restore``:
  get-restore-tid, restore, unlock (``cuda_plugin_resume_devices_late``).

The driver calls (``cuda.bindings.driver`` of ``cuda-bindings`` 13.5.0, introspected; each
returns a tuple whose first item is a ``CUresult``): ``cuInit(0) -> (err,)``,
``cuCheckpointProcessGetState(pid) -> (err, CUprocessState)``,
``cuCheckpointProcessGetRestoreThreadId(pid) -> (err, tid)``,
``cuCheckpointProcessLock(pid, CUcheckpointLockArgs | None) -> (err,)`` (``timeoutMs``:
milliseconds, 0 = no timeout), ``cuCheckpointProcessCheckpoint(pid, None)``,
``cuCheckpointProcessRestore(pid, None | CUcheckpointRestoreArgs)``, ``cuCheckpointProcessUnlock(pid,
None)`` (``None`` = default arguments: GPU memory goes to/comes from host memory, no GPU
remapping). A remap passes ``CUcheckpointRestoreArgs`` with ``gpuPairs`` = a list of
``CUcheckpointGpuPair`` and ``gpuPairsCount``; ``CUuuid.bytes`` is read-only in cuda-bindings
13.5.0, so a ``CUuuid`` is built over 16 bytes of our memory (``CUuuid(address)``) and
assigning it to a pair copies the bytes (introspected; tests/test_cuda_checkpoint.py checks
it against the installed bindings).
``CUprocessState``: RUNNING 0, LOCKED 1, CHECKPOINTED 2, FAILED 3, CHECKPOINTING 4,
RESTORING 5. ``cuInit(0)`` is called first: the driver documents that process restore
"requires persistence mode to be enabled or cuInit to have been called".

Exit codes: 0 success; 1 the driver refused the operation (e.g. ``CUDA_ERROR_INVALID_VALUE``
for a process without CUDA); 2 bad command line; 3 (:data:`EXIT_UNAVAILABLE`) this helper cannot
talk to the driver: ``cuda-bindings`` missing, ``cuInit`` failed, or the driver is older than the
checkpoint API. CRIU's plugin reads every non-zero exit of ``--get-restore-tid`` as "not a CUDA
process", so it cannot tell 1 from 3; the message of a 3 starts with :data:`UNAVAILABLE`
(``cuda-checkpoint: unavailable:``), which CRIU copies into its log (``get_cuda_restore_tid`` logs
the first 127 bytes of the output at error level) and vllm-snapshot looks for there
(:func:`vllm_snapshot.checkpoint.criu.check_cuda_log`), and before CRIU runs it probes the helper itself.

The checkpoint driver API (``cuCheckpointProcess*``) is public from driver r570 / CUDA 12.8 on
(NVIDIA/cuda-checkpoint README, "570 Features": "CUDA Driver interfaces";
https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CHECKPOINT.html); ``cuDriverGetVersion``
reports 12080 for CUDA 12.8, hence :data:`MIN_DRIVER_API`.
This module imports only the standard library at import time (it runs on hosts without the
rest of the tool's dependencies); ``cuda.bindings`` is imported on first driver use.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import stat
import sys
import tempfile
from pathlib import Path
from collections.abc import Sequence
from typing import Protocol

PROG = "cuda-checkpoint"
#: States ``--get-state`` prints; the first three are the ones CRIU's plugin understands.
STATES: tuple[str, ...] = ("running", "locked", "checkpointed", "failed")
ACTIONS: tuple[str, ...] = ("lock", "checkpoint", "restore", "unlock")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
#: How a message of an :data:`EXIT_UNAVAILABLE` exit starts (searched for in CRIU's logs).
UNAVAILABLE = f"{PROG}: unavailable:"
#: ``cuDriverGetVersion`` of the first driver with the checkpoint API (CUDA 12.8, driver r570).
MIN_DRIVER_API = 12080
#: The NVIDIA driver branch that ships it (``nvidia-smi`` driver_version major).
MIN_DRIVER_BRANCH = 570
#: ``cuDriverGetVersion`` of the first driver that restores onto another GPU (``gpuPairs``):
#: driver r580 (CUDA 13.0), the branch whose cuda-checkpoint offers ``--device-map``.
MIN_REMAP_DRIVER_API = 13000
MIN_REMAP_DRIVER_BRANCH = 580
#: CRIU's environment variable carrying a ``--device-map`` value to ``--action restore``.
DEVICE_MAP_ENV = "VLLM_SNAPSHOT_CUDA_DEVICE_MAP"
#: The line of ``-h`` that says this helper can remap GPUs (absent when it cannot).
REMAP_HELP = "  --device-map OLD=NEW[,...]"
#: How the line of ``-h`` that says why it cannot starts.
NO_REMAP_HELP = "GPU remapping (--device-map): not available:"
#: What identifies this helper's behaviour in a snapshot's host identity. Bump it when the
#: command-line contract or the driver calls change (not for comments): a snapshot made with
#: one protocol is restored only by a helper of the same protocol.
PROTOCOL = 2
#: ``CUcheckpointLockArgs.timeoutMs`` is an unsigned int (milliseconds).
MAX_TIMEOUT_MS = 2**32 - 1
#: Name of the directory :func:`helper_dir` creates under the cache dir.
HELPER_DIRNAME = "cuda-checkpoint-helper"

_HELP_NO_API = f"""\
usage: {PROG} -h

CUDA checkpoint/restore of another process (vllm-snapshot, over cuda-bindings): NOT AVAILABLE
with this driver: {{why}}. It needs the driver's checkpoint API (NVIDIA driver r{MIN_DRIVER_BRANCH}+,
CUDA {MIN_DRIVER_API // 1000}.{MIN_DRIVER_API % 1000 // 10}).
"""

_HELP = f"""\
usage: {PROG} --action {{lock,checkpoint,restore,unlock}} --pid PID [--timeout MS] [--device-map MAP]
       {PROG} --get-state --pid PID
       {PROG} --get-restore-tid --pid PID

CUDA checkpoint/restore of another process (vllm-snapshot, over cuda-bindings).

  --action ACTION    lock | checkpoint | restore | unlock the CUDA state of PID
  --pid PID          host PID (a thread ID is mapped to its process)
  --timeout MS       lock only: give up locking after MS milliseconds (0 = wait forever)
@REMAP@
  --get-state        print running, locked, checkpointed or failed
  --get-restore-tid  print the TID of PID's CUDA restore thread
  -h, --help         show this help

Exit status: 0 success, 1 the driver refused (message on stderr), 2 bad command line,
3 unavailable (no cuda-bindings, cuInit failed, driver without the checkpoint API).
"""


class DriverError(Exception):
    """A driver call failed: ``call`` (e.g. ``cuCheckpointProcessLock``), ``code`` (the
    ``CUresult`` name, e.g. ``CUDA_ERROR_ILLEGAL_STATE``), ``detail`` (its description)."""

    def __init__(self, call: str, code: str, detail: str = ""):
        super().__init__(call, code, detail)
        self.call, self.code, self.detail = call, code, detail

    def __str__(self) -> str:
        return f"{self.call}: {self.code}" + (f" ({self.detail})" if self.detail else "")


class DriverUnavailable(DriverError):
    """This helper cannot use the driver at all: ``cuda-bindings`` missing, ``cuInit`` failed,
    or (``api_missing``) the driver is older than the checkpoint API."""

    def __init__(self, call: str, code: str, detail: str = "", *, api_missing: bool = False):
        super().__init__(call, code, detail)
        self.api_missing = api_missing


#: One GPU remap: (UUID checkpointed on, UUID to restore onto), each ``GPU-<uuid>`` lower-case.
GpuPair = tuple[str, str]

_UUID = re.compile(r"^(?:GPU-)?([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})$")


def normalize_uuid(text: str) -> str:
    """``GPU-<uuid>`` in lower case for a GPU UUID as nvidia-smi prints it (the ``GPU-`` prefix
    optional). Pure. Raises ValueError naming the text for anything else (MIG UUIDs included:
    the driver remaps whole GPUs)."""
    m = _UUID.match(text.strip())
    if not m:
        raise ValueError(f"{text.strip()!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as "
                         "`nvidia-smi -L` prints it)")
    return "GPU-" + m.group(1).lower()


def parse_device_map(text: str, recorded: Sequence[str] = ()) -> tuple[GpuPair, ...]:
    """The pairs of a ``--device-map`` value ``OLD=NEW[,OLD=NEW...]`` (NVIDIA's spelling), in
    order, UUIDs normalized (:func:`normalize_uuid`). ``recorded``: the GPUs the process was
    checkpointed on, each of which must be mapped (the driver requires every checkpointed GPU in
    the array). Pure. Raises ValueError saying what is wrong: an empty map, an item without
    ``=``, a bad UUID, a GPU mapped twice, two GPUs mapped onto one, a recorded GPU unmapped."""
    items = [i.strip() for i in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"device map {text!r} is empty or has an empty item; expected OLD=NEW[,OLD=NEW...]")
    pairs: list[GpuPair] = []
    for item in items:
        old, eq, new = item.partition("=")
        if not eq:
            raise ValueError(f"device map item {item!r} has no '='; expected OLD=NEW (GPU UUIDs)")
        pairs.append((normalize_uuid(old), normalize_uuid(new)))
    olds, news = [o for o, _ in pairs], [n for _, n in pairs]
    twice = sorted({o for o in olds if olds.count(o) > 1})
    if twice:
        raise ValueError(f"device map maps {', '.join(twice)} more than once")
    shared = sorted({n for n in news if news.count(n) > 1})
    if shared:
        raise ValueError(f"device map maps several GPUs onto {', '.join(shared)}; each GPU restores onto its own")
    missing = [u for u in (normalize_uuid(r) for r in recorded) if u not in olds]
    if missing:
        raise ValueError(f"device map {text!r} does not map {', '.join(missing)}, which the process was "
                         "checkpointed on (the driver needs every checkpointed GPU mapped)")
    return tuple(pairs)


def format_device_map(pairs: Sequence[GpuPair]) -> str:
    """The ``--device-map`` spelling of ``pairs`` (``OLD=NEW,...``). Pure."""
    return ",".join(f"{o}={n}" for o, n in pairs)


class Driver(Protocol):
    """The six checkpoint operations on another process, by host PID.

    Failures raise :class:`DriverError`. ``get_state`` returns the lower-case
    ``CU_PROCESS_STATE_*`` suffix: running, locked, checkpointed, failed, checkpointing or
    restoring. ``restore``'s ``pairs`` remap GPUs (:data:`GpuPair`; empty: back onto the GPUs
    checkpointed on); :meth:`remap_unavailable` says why this driver cannot (None: it can).
    """

    def get_state(self, pid: int) -> str: ...

    def get_restore_tid(self, pid: int) -> int: ...

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, pairs: Sequence[GpuPair] = ()) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def remap_unavailable(self) -> str | None: ...


class CudaDriver(Driver):
    """:class:`Driver` over ``cuda.bindings.driver``. Construction imports it, calls
    ``cuInit(0)`` and checks ``cuDriverGetVersion`` >= :data:`MIN_DRIVER_API` and the six
    ``cuCheckpointProcess*`` entry points; raises :class:`DriverUnavailable` when any of that
    fails (no cuda-bindings, no NVIDIA driver or GPU, a driver older than r570)."""

    def __init__(self) -> None:
        # cuInit otherwise preloads the JIT libraries (cuda-bindings' cuInit docstring); this
        # short-lived process never JIT-compiles, and CRIU runs it several times per process.
        os.environ.setdefault("CUDA_FORCE_PRELOAD_LIBRARIES", "0")
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise DriverUnavailable("import cuda.bindings", "ImportError",
                                    f"{e}; pip install 'vllm-snapshot[cuda]' (cuda-bindings)") from e
        self._d = driver
        try:
            self._call("cuInit", 0)
            (version,) = self._call("cuDriverGetVersion")
        except DriverError as e:
            raise DriverUnavailable(e.call, e.code, e.detail) from e
        missing = [n for n in _API if not hasattr(driver, n)]
        if int(version) < MIN_DRIVER_API or missing:
            raise DriverUnavailable(
                "cuDriverGetVersion", f"driver API {int(version)}",
                f"the checkpoint API needs {MIN_DRIVER_API} (NVIDIA driver r{MIN_DRIVER_BRANCH}+)"
                + (f"; cuda-bindings lacks {', '.join(missing)}" if missing else ""), api_missing=True)
        self._version = int(version)

    def _err_name(self, err) -> str:
        try:
            res = self._d.cuGetErrorName(err)
            if res[0] == self._d.CUresult.CUDA_SUCCESS and res[1]:
                return res[1].decode(errors="replace")
        except Exception:  # noqa: BLE001 - best effort naming
            pass
        return getattr(err, "name", str(err))

    def _err_text(self, err) -> str:
        try:
            res = self._d.cuGetErrorString(err)
            if res[0] == self._d.CUresult.CUDA_SUCCESS and res[1]:
                return res[1].decode(errors="replace")
        except Exception:  # noqa: BLE001
            pass
        return ""

    def _call(self, name: str, *args) -> tuple:
        """Call ``driver.<name>(*args)``; return the outputs after the ``CUresult``."""
        try:
            res = getattr(self._d, name)(*args)
        except Exception as e:  # e.g. cuda.pathfinder's DynamicLibNotFoundError: no libcuda
            raise DriverError(name, type(e).__name__, str(e)) from e
        res = res if isinstance(res, tuple) else (res,)
        if res[0] != self._d.CUresult.CUDA_SUCCESS:
            raise DriverError(name, self._err_name(res[0]), self._err_text(res[0]))
        return res[1:]

    def get_state(self, pid: int) -> str:
        (state,) = self._call("cuCheckpointProcessGetState", pid)
        name = getattr(state, "name", None) or self._d.CUprocessState(state).name
        return name.removeprefix("CU_PROCESS_STATE_").lower()

    def get_restore_tid(self, pid: int) -> int:
        (tid,) = self._call("cuCheckpointProcessGetRestoreThreadId", pid)
        return int(tid)

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = None
        if timeout_ms:
            args = self._d.CUcheckpointLockArgs()
            args.timeoutMs = timeout_ms
        self._call("cuCheckpointProcessLock", pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int, pairs: Sequence[GpuPair] = ()) -> None:
        if not pairs:
            self._call("cuCheckpointProcessRestore", pid, None)
            return
        why = self.remap_unavailable()
        if why:
            raise DriverError("cuCheckpointProcessRestore", "CUDA_ERROR_NOT_SUPPORTED", f"GPU remapping: {why}")
        args, _keep = restore_args(self._d, pairs)
        self._call("cuCheckpointProcessRestore", pid, args)

    def remap_unavailable(self) -> str | None:
        d = self._d
        if not (hasattr(d, "CUcheckpointGpuPair") and hasattr(d, "CUuuid")
                and hasattr(d, "CUcheckpointRestoreArgs") and hasattr(d.CUcheckpointRestoreArgs(), "gpuPairs")):
            return "these cuda-bindings have no CUcheckpointRestoreArgs.gpuPairs (install cuda-bindings 13)"
        if self._version < MIN_REMAP_DRIVER_API:
            return (f"driver API {self._version} restores only onto the GPU checkpointed on; remapping needs "
                    f"{MIN_REMAP_DRIVER_API} (NVIDIA driver r{MIN_REMAP_DRIVER_BRANCH}+)")
        return None

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, None)


def restore_args(driver, pairs: Sequence[GpuPair]) -> tuple[object, list]:
    """``(CUcheckpointRestoreArgs, buffers)`` of ``driver`` (the ``cuda.bindings.driver``
    module, or a fake with the same types) remapping ``pairs``: ``gpuPairs`` a list of
    ``CUcheckpointGpuPair`` (``oldUuid``/``newUuid`` set from the UUIDs' 16 bytes, in the order
    nvidia-smi prints them), ``gpuPairsCount`` their number. ``buffers``: the memory the
    ``CUuuid`` objects were built over; keep it alive until the call returned (assigning a
    ``CUuuid`` to a pair copies it, but nothing is lost by keeping it). Raises ValueError for a
    bad UUID, AttributeError when the bindings lack a field (a misspelt name fails here)."""
    import ctypes
    import uuid as uuidlib

    keep: list = []

    def cu_uuid(text: str):
        raw = uuidlib.UUID(normalize_uuid(text).removeprefix("GPU-")).bytes
        buf = ctypes.create_string_buffer(raw, 16)
        keep.append(buf)
        return driver.CUuuid(ctypes.addressof(buf))

    items = []
    for old, new in pairs:
        pair = driver.CUcheckpointGpuPair()
        pair.oldUuid = cu_uuid(old)
        pair.newUuid = cu_uuid(new)
        items.append(pair)
    keep.extend(items)
    args = driver.CUcheckpointRestoreArgs()
    args.gpuPairs = items
    args.gpuPairsCount = len(items)
    return args, keep


_API = ("cuCheckpointProcessGetState", "cuCheckpointProcessGetRestoreThreadId", "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")


def probe() -> Driver:
    """A working :class:`CudaDriver`, or raises :class:`DriverUnavailable` saying why not (what
    ``-h`` and vllm-snapshot's checks before CRIU run)."""
    return CudaDriver()


def resolve_pid(n: int, proc_root: str | os.PathLike = "/proc") -> int:
    """The process (thread group) ID of PID or TID ``n``, from ``Tgid:`` in
    ``<proc_root>/<n>/status``. Raises LookupError when there is no such process or thread."""
    try:
        text = Path(proc_root, str(n), "status").read_text()
    except FileNotFoundError:
        raise LookupError(f"no such process: {n}") from None
    except OSError as e:
        raise LookupError(f"cannot read process {n}: {e.strerror}") from None
    for line in text.splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return n


class _Parser(argparse.ArgumentParser):
    def format_help(self) -> str:
        return _HELP.replace("@REMAP@\n", "")

    def format_usage(self) -> str:
        return _HELP.split("\n\n", 1)[0] + "\n"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--action", choices=ACTIONS)
    what.add_argument("--get-state", action="store_true")
    what.add_argument("--get-restore-tid", action="store_true")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--timeout", type=int, default=None, metavar="MS")
    p.add_argument("--device-map", default=None, metavar="MAP")
    return p


def _help(driver: Driver) -> str:
    """The full help, with :data:`REMAP_HELP` when ``driver`` can remap GPUs, else the line
    saying why not (:data:`NO_REMAP_HELP`)."""
    why = driver.remap_unavailable()
    line = (REMAP_HELP + "  restore only: restore onto other GPUs (GPU UUIDs; $" + DEVICE_MAP_ENV + ")"
            if why is None else f"  ({NO_REMAP_HELP} {why})")
    return _HELP.replace("@REMAP@", line)


def main(argv: Sequence[str] | None = None, driver: Driver | None = None, *,
         proc_root: str | os.PathLike = "/proc") -> int:
    """Run one ``cuda-checkpoint`` command (see the module docstring); return the exit code.

    ``driver`` defaults to :class:`CudaDriver`, created only after the command line is valid.
    ``-h`` probes it (as CRIU's plugin uses ``-h`` to decide whether to run at all): full help
    naming ``--action`` with a working driver; a help without ``--action`` (exit 0) for a driver
    older than the checkpoint API; exit 3 with the reason when the driver cannot be used.
    Answers go to stdout, failures to stderr as one line.
    """
    args = list(sys.argv[1:] if argv is None else argv)

    def fail(msg: str, code: int = EXIT_FAILED) -> int:
        print(f"{PROG}: {msg}", file=sys.stderr)
        return code

    if "-h" in args or "--help" in args:
        try:
            drv = driver if driver is not None else probe()
        except DriverUnavailable as e:
            if e.api_missing:
                print(_HELP_NO_API.format(why=e), end="", flush=True)
                return EXIT_OK
            return fail(f"unavailable: {e}", EXIT_UNAVAILABLE)
        print(_help(drv), end="", flush=True)
        return EXIT_OK
    parser = _parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit as e:  # a usage error (2); argparse already wrote the text
        return int(e.code or 0)

    if ns.pid <= 0:
        return fail(f"--pid must be a positive integer, got {ns.pid}", EXIT_USAGE)
    if ns.timeout is not None:
        if ns.action != "lock":
            return fail("--timeout applies only to --action lock", EXIT_USAGE)
        if not 0 <= ns.timeout <= MAX_TIMEOUT_MS:
            return fail(f"--timeout must be 0..{MAX_TIMEOUT_MS} milliseconds, got {ns.timeout}", EXIT_USAGE)
    if ns.device_map is not None and ns.action != "restore":
        return fail("--device-map applies only to --action restore", EXIT_USAGE)
    pairs: tuple[GpuPair, ...] = ()
    if ns.action == "restore":
        text, where = ((ns.device_map, "--device-map") if ns.device_map is not None
                       else (os.environ.get(DEVICE_MAP_ENV), f"${DEVICE_MAP_ENV}"))
        if text is not None:
            try:
                pairs = parse_device_map(text)
            except ValueError as e:
                return fail(f"{where}: {e}", EXIT_USAGE)
    what = f"--action {ns.action}" if ns.action else ("--get-state" if ns.get_state else "--get-restore-tid")
    try:
        pid = resolve_pid(ns.pid, proc_root)
    except LookupError as e:
        return fail(f"{what} --pid {ns.pid}: {e}")
    try:
        drv = driver if driver is not None else CudaDriver()
        if ns.get_state:
            state = drv.get_state(pid)
            if state not in STATES:
                return fail(f"{what} --pid {ns.pid}: process is in transient state {state!r}; retry")
            print(state, flush=True)
        elif ns.get_restore_tid:
            print(drv.get_restore_tid(pid), flush=True)
        elif ns.action == "lock":
            drv.lock(pid, ns.timeout or 0)
        elif ns.action == "restore":
            drv.restore(pid, pairs)
        else:
            getattr(drv, ns.action)(pid)
    except DriverUnavailable as e:
        return fail(f"unavailable: {what} --pid {ns.pid}: {e}", EXIT_UNAVAILABLE)
    except DriverError as e:
        return fail(f"{what} --pid {ns.pid} failed: {e}")
    return EXIT_OK


def main_entry() -> None:
    """Console-script entry (``vllm-snapshot-cuda-checkpoint``): exit with :func:`main`'s code."""
    sys.exit(main())


def digest() -> str:
    """sha256 (hex) of this module's source file, for the manifest: which helper ran."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def wrapper_script(python: str | None = None) -> str:
    """Text of the ``cuda-checkpoint`` wrapper: ``cd /`` (so no module is picked up from CRIU's
    working directory), this package's parent prepended to ``PYTHONPATH`` (works without an
    install), then ``exec <python> -W ignore -m vllm_snapshot.checkpoint.cuda_checkpoint "$@" </dev/null``
    (stdin: see the comment in the script)."""
    python = python or sys.executable
    pkg_parent = str(Path(__file__).resolve().parents[2])  # the directory holding vllm_snapshot/
    return (
        "#!/bin/sh\n"
        "# Written by vllm-snapshot: CRIU's CUDA plugin runs `cuda-checkpoint` from PATH.\n"
        "cd / || exit 1\n"
        f"PYTHONPATH={shlex.quote(pkg_parent)}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        "export PYTHONPATH\n"
        # stdin from /dev/null: under `criu swrk` (how pycriu runs CRIU) fd 0 is whatever CRIU
        # reused it for -- pycriu closes fds 0-2 -- e.g. a directory, and Python refuses to start
        # with "init_sys_streams: <stdin> is a directory" (seen through real CRIU 4.2.1 here)
        f'exec {shlex.quote(python)} -W ignore -m vllm_snapshot.checkpoint.cuda_checkpoint "$@" </dev/null\n'
    )


def helper_dir(cache_dir: str | os.PathLike) -> Path:
    """Create (or refresh) ``<cache_dir>/cuda-checkpoint-helper/`` (mode 0700, owned by us)
    holding an executable ``cuda-checkpoint`` (mode 0700) that runs this module with
    ``sys.executable``; return the directory, to be put first on CRIU's ``PATH``.

    Raises :class:`~vllm_snapshot.errors.EnvironmentProblem` when the directory exists but is
    a symlink, not a directory, or owned by another user. The script is replaced atomically
    (write + rename).
    """
    from ..errors import EnvironmentProblem

    d = Path(cache_dir) / HELPER_DIRNAME
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise EnvironmentProblem(
            f"{d} is not a directory owned by uid {os.geteuid()}",
            hint="remove it; vllm-snapshot recreates it with mode 0700",
        )
    os.chmod(d, 0o700)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".cuda-checkpoint.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(wrapper_script())
        os.chmod(tmp, 0o700)
        os.replace(tmp, d / PROG)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return d


if __name__ == "__main__":
    main_entry()
