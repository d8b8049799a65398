"""Default paths, one function each, each with its environment override (the pipx
``paths.py`` shape). Every other module asks here; none hard-codes a host path.

=================  ==============================  =====================================
function           default (as root)               override
=================  ==============================  =====================================
snapshot_root()    /var/lib/vllm-snapshot          ``--root`` / ``$VLLM_SNAPSHOT_ROOT``
                   (non-root: $XDG_DATA_HOME/vllm-snapshot)
cache_dir()        /var/cache/vllm-snapshot        ``$VLLM_SNAPSHOT_CACHE``
model_store()      cache_dir()/models              (with the cache)
run_dir()          /run/vllm-snapshot              ``$VLLM_SNAPSHOT_RUN_DIR``
state_dir()        /var/lib/vllm-snapshot/.state   ``$VLLM_SNAPSHOT_STATE_DIR``
                   (non-root: run_dir()/state)
log_dir()          /var/log/vllm-snapshot          ``$VLLM_SNAPSHOT_LOG_DIR``
staging_dir()      /var/tmp/vllm-snapshot-staging  ``$VLLM_SNAPSHOT_STAGING_DIR``
=================  ==============================  =====================================

``run_dir()`` holds locks (``locks/``) and the engine registry (``engines/``); ``log_dir()``
holds detached engines' logs and the CRIU logs of failed dumps and restores. ``staging_dir()``
is used only for snapshots on a read-only filesystem, and only when /dev/shm is not taken
(restore stages beside the snapshot, or in /dev/shm when memory allows: the order is
:func:`vllm_snapshot.store.archive.staging_parent`'s).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

DEFAULT_ROOT = Path("/var/lib/vllm-snapshot")
DEFAULT_CACHE = Path("/var/cache/vllm-snapshot")
DEFAULT_RUN = Path("/run/vllm-snapshot")
DEFAULT_LOG = Path("/var/log/vllm-snapshot")
#: The engine's private temp dir: a mount point on the host's disk (made by the launch), a
#: fresh tmpfs inside the engine's mount namespace (:func:`vllm_snapshot.engine.mounts.make_private`),
#: the engine's ``TMPDIR`` (:func:`vllm_snapshot.host.envpolicy.scrubbed_env`).
ENGINE_TMPDIR = "/var/tmp/.vllm-snapshot-engine"


def snapshot_root(cli_root: Path | None = None) -> Path:
    """Where named snapshots live: ``cli_root`` (``--root``), ``$VLLM_SNAPSHOT_ROOT``,
    ``/var/lib/vllm-snapshot`` as root, else ``$XDG_DATA_HOME/vllm-snapshot``."""
    if cli_root is not None:
        return Path(cli_root).absolute()
    env = os.environ.get("VLLM_SNAPSHOT_ROOT")
    if env:
        return Path(env).absolute()
    if os.geteuid() == 0:
        return DEFAULT_ROOT
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "vllm-snapshot"


def cache_dir(env: Callable[[str], str | None] = os.environ.get) -> Path:
    """Setup's cache (CRIU build, venv, tiny model, cuda-checkpoint helper). ``env`` reads one
    environment variable (default this process's; ``doctor`` passes its probe's)."""
    return Path(env("VLLM_SNAPSHOT_CACHE") or DEFAULT_CACHE)


def model_store(env: Callable[[str], str | None] = os.environ.get) -> Path:
    """Where setup puts models (the tiny model among them): ``cache_dir(env)/models``."""
    return cache_dir(env) / "models"


def run_dir() -> Path:
    """Runtime state that ends with the boot: locks and the engine registry (tmpfs)."""
    return Path(os.environ.get("VLLM_SNAPSHOT_RUN_DIR") or DEFAULT_RUN)


def state_dir() -> Path:
    """Per-snapshot bookkeeping kept outside the snapshot (last restore, overrides used)."""
    env = os.environ.get("VLLM_SNAPSHOT_STATE_DIR")
    if env:
        return Path(env)
    return DEFAULT_ROOT / ".state" if os.geteuid() == 0 else run_dir() / "state"


def log_dir() -> Path:
    """Detached engines' logs and kept CRIU logs of failed runs."""
    return Path(os.environ.get("VLLM_SNAPSHOT_LOG_DIR") or DEFAULT_LOG)


def staging_dir() -> Path:
    """Where restore stages images of a snapshot whose directory is read-only, when /dev/shm
    is short of room or memory (``archive.staging_parent``)."""
    return Path(os.environ.get("VLLM_SNAPSHOT_STAGING_DIR") or "/var/tmp/vllm-snapshot-staging")


def ensure_private_dir(d: Path) -> Path:
    """Create ``d`` (and parents) with mode 0700 if missing; return it. Raises OSError."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def keep_log_copy(src: Path, prefix: str, keep_dir: Path | None = None) -> Path | None:
    """Copy the log file ``src`` into ``keep_dir`` (default :func:`log_dir`, made 0700) as
    ``PREFIX-YYYYmmdd-HHMMSS-PID.log`` (0600) so it outlives the run that wrote it; return the
    copy, or None when it could not be kept (any OSError: the caller's message then names no
    file)."""
    import shutil
    import time

    try:
        d = ensure_private_dir(keep_dir or log_dir())
        dst = d / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o600)
        return dst
    except OSError:
        return None


def lexists(path: Path | str) -> bool:
    """``os.path.lexists`` that tells "absent" from "not allowed to look": True when ``path``
    exists (a dangling link too), False when it or a parent does not. Raises EnvironmentProblem
    (exit 11) when a parent directory cannot be searched by this user -- a snapshot under a
    root-only (0700) directory is not "missing" for a non-root user, it is not theirs to read."""
    try:
        os.lstat(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except PermissionError as e:
        raise not_allowed(path) from e


def why_not_a_dir(d: Path | str) -> str:
    """Why ``d`` cannot be used as a directory, in words, for a message: "``X`` is a file,
    not a directory" when ``d`` or the nearest of its parents that exists is not a directory
    (a regular file, say), else "``d`` does not exist"."""
    d = Path(d).absolute()
    for p in (d, *d.parents):
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            break
        if stat.S_ISDIR(st.st_mode):
            break
        kind = "a file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        return f"{p} is {kind}, not a directory"
    return f"{d} does not exist"


def not_allowed(path: Path | str):
    """The EnvironmentProblem (exit 11) for a snapshot path this user may not look at
    (``lstat`` refused: a parent directory it cannot search)."""
    from .errors import EnvironmentProblem

    return EnvironmentProblem(f"cannot look at {path}: permission denied (uid {os.geteuid()}); snapshot "
                              "directories and the snapshot root are root's (0700)", hint="run it with sudo, as root")
