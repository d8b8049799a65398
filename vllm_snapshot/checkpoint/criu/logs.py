"""CRIU's logs: the excerpt an error shows (:func:`log_excerpt`, the CUDA plugin's benign
lines left out), known failures said in words (:func:`explain`), the checks of a CUDA run's
log (:func:`check_cuda_log`), and the copy kept after a failure (:func:`keep_log`)."""

from __future__ import annotations

import re
from pathlib import Path

from ... import paths
from ...errors import CriuError


#: What CRIU 4.2.1's CUDA plugin logs as an ``Error`` for every process that is not a CUDA
#: process (``plugins/cuda/cuda_plugin.c:221``: ``--get-restore-tid`` exited non-zero, which
#: the plugin reads as "skip this task"): one line per non-CUDA process of every CUDA dump and
#: restore, benign unless our helper says it could not reach the driver (``unavailable:``).
BENIGN_CUDA_ERROR = "Failed to launch cuda-checkpoint to retrieve restore tid"


def _benign(line: str) -> bool:
    from ..cuda_checkpoint import UNAVAILABLE

    return BENIGN_CUDA_ERROR in line and UNAVAILABLE not in line


def log_excerpt(log_path: Path, context: int = 4, limit: int = 30) -> str:
    """The ``Error`` lines of a CRIU log with ``context`` lines before each (at most ``limit``
    lines). The CUDA plugin's benign "not a CUDA process" lines (:data:`BENIGN_CUDA_ERROR`)
    are left out, so they cannot push the real error out of the excerpt. Returns "" when the
    log is missing."""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if not _benign(ln)]
    except OSError:
        return ""
    keep: list[int] = []
    for i, line in enumerate(lines):
        if "Error" in line and "RLIMIT_NOFILE" not in line:
            keep.extend(range(max(0, i - context), i + 1))
    if not keep:
        keep = list(range(max(0, len(lines) - context * 2), len(lines)))
    seen: list[str] = []
    for i in sorted(set(keep)):
        seen.append(lines[i])
    return "\n".join(seen[-limit:])


#: CRIU log lines (4.2.1 wording) -> what they mean, in words. Pure patterns; see :func:`explain`.
_EXPLAIN = (
    (r"FS mnt \.(\S+) dev \S+ root \S+ unsupported",
     "the engine's mount namespace holds {0}, a file system CRIU cannot re-create, and it was neither "
     "detached nor passed as an external mount"),
    (r"\d+:\.(\S+) doesn't have a proper root mount",
     "{0} is a bind mount whose source file system is not mounted in the engine's namespace (a container's "
     "file bind?), and it was not passed as an external mount"),
    (r"No mapping for \d+:\(null\) mountpoint",
     "an external mount recorded at dump was not given back at restore"),
    (r"Can't lookup mount=\d+ for fd=(\d+) path=(\S+)",
     "a process of the tree has fd {0} ({1}) opened in a mount namespace outside the tree"),
    (r"Process with requested pid already exists",
     "a PID the tree needs is taken (the dumped tree not yet reaped?)"),
    (r"Can't dump.*io_uring|anon_inode:\[io_uring\]",
     "a process of the tree uses io_uring, which CRIU cannot dump"),
    (r"No space left on device", "the disk is full"),
)


def explain(log_text: str) -> str | None:
    """The first known failure in a CRIU log, said in words (mount point, fd, process), or
    None. Pure."""
    for pat, text in _EXPLAIN:
        m = re.search(pat, log_text)
        if m:
            return text.format(*m.groups())
    return None


#: CRIU 4.2.1 CUDA plugin log lines (plugins/cuda/cuda_plugin.c) -> what they mean.
_CUDA_LOG = (
    ("No GPU device found; CUDA plugin is disabled",
     "CRIU's CUDA plugin found no GPU (/proc/driver/nvidia/gpus) and disabled itself"),
    ("check that cuda-checkpoint is present in $PATH",
     "CRIU's CUDA plugin could not run `cuda-checkpoint -h` from PATH and disabled itself"),
    ("--action flag not supported",
     "`cuda-checkpoint -h` does not offer --action: the NVIDIA driver has no checkpoint API (r570+ needed)"),
)


def check_cuda_run(log: Path, what: str, keep_dir: Path | None = None) -> None:
    """:func:`check_cuda_log` over the CRIU log file ``log`` of a finished CUDA ``what``
    (``dump``/``restore``); on failure the log is kept (:func:`keep_log`) and the error's hint
    names the copy. Raises CriuError."""
    try:
        check_cuda_log(log.read_text(errors="replace"), what)
    except CriuError as e:
        kept = keep_log(log, what, keep_dir)
        e.hint = f"full log: {kept} (grep cuda_plugin)" if kept else e.hint
        e.details = {"log": str(kept) if kept else None}
        raise


def check_cuda_log(log_text: str, what: str = "dump") -> None:
    """Raise CriuError unless a CRIU log of a CUDA ``dump`` (or ``restore``) shows the CUDA
    plugin loaded, initialized, and never told by our helper that it cannot reach the driver
    (a helper that cannot work answers "not a CUDA process" to the plugin, which would then
    skip the GPU state). For a restore, also refuses logged restore/unlock failures, which
    CRIU 4.2.1 only logs (criu/cr-restore.c:2259-2274) before resuming the tree. Pure."""
    from ..cuda_checkpoint import UNAVAILABLE

    def fail(why: str) -> None:
        raise CriuError(f"CRIU {what} of a CUDA engine: {why}",
                        hint="run `vllm-snapshot doctor`; the CRIU log has the plugin's lines (grep cuda_plugin)")

    if "cuda_plugin" not in log_text:
        fail("CRIU did not load its CUDA plugin (CRIU_LIBS_DIR did not reach it, or a config file's libdir won)")
    if UNAVAILABLE in log_text:
        line = next(ln for ln in log_text.splitlines() if UNAVAILABLE in ln)
        fail("our cuda-checkpoint helper could not use the driver: " + line[line.index(UNAVAILABLE):].strip())
    for needle, text in _CUDA_LOG:
        if needle in log_text:
            fail(text)
    if "initialized: cuda_plugin" not in log_text:
        fail("CRIU's CUDA plugin never initialized")
    if what == "dump" and "Checkpointing CUDA devices on pid" not in log_text:
        fail("the CUDA plugin checkpointed no process: every process of the tree answered 'no CUDA here' "
             "to `cuda-checkpoint --get-restore-tid` (their messages are the plugin's 'Failed to launch' lines)")
    m = re.search(r"RESUME_DEVICES (RESTORE|UNLOCK) failed with ?(.*)", log_text)
    if m:
        fail(f"the plugin's {m.group(1).lower()} of the GPU state failed: {m.group(2).strip()[:200]}")


def keep_log(log: Path, what: str, keep_dir: Path | None = None) -> Path | None:
    """Copy a CRIU log to ``keep_dir`` (default :func:`paths.log_dir`) as
    ``criu-WHAT-YYYYmmdd-HHMMSS-PID.log`` (0600); return the copy, or None when it could not
    be kept."""
    return paths.keep_log_copy(log, f"criu-{what}", keep_dir)
