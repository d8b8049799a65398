"""Model identity: full-content BLAKE3 digest of every file in a model directory, stat pinning.

At create every regular file under the model directory is hashed in full (BLAKE3, multi-
threaded over an mmap) and its size, mtime_ns, ctime_ns, inode and device are kept. At restore
(``quick`` mode) a file whose stat is unchanged is trusted; any stat change triggers a full
re-hash and only a content difference refuses (so ``touch`` alone never refuses). ``full`` mode
re-hashes everything. A metadata-only fingerprint (safetensors headers, first KiB of each
tensor) misses changes past the fingerprinted bytes; hashing every byte cannot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3

from .errors import ModelChangedError, UsageError
from .manifest import ModelFile

SKIP_DIRS = {".git", "__pycache__"}


def hash_file(path: Path) -> str:
    """BLAKE3 hex digest of a file's full content (multi-threaded). Raises OSError."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size == 0:
        return h.hexdigest()
    h.update_mmap(path)
    return h.hexdigest()


def _walk(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.is_file():
                out.append(p)
    return out


def resolve_model(model: str, revision: str | None = None) -> tuple[Path, str | None]:
    """``(local directory, revision)`` for ``model``: an existing directory (revision None), or
    a Hugging Face id already in the local hub cache at ``revision`` (a branch, tag or commit;
    default the cache's ``main``), looked up offline, never downloaded; the revision returned
    is the commit the cache resolved it to (the ``snapshots/<commit>`` directory name).

    Raises UsageError when neither exists (naming the revision when one was asked for).
    """
    p = Path(model).expanduser()
    if p.is_dir():
        return p.resolve(), None
    if p.exists():
        raise UsageError(f"model {model!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means "not available offline"
        at = f" at revision {revision!r}" if revision else ""
        raise UsageError(
            f"model {model!r}{at} is neither a local directory nor in the local Hugging Face cache",
            hint="pass a local model directory, or a revision the cache holds; vllm-snapshot never downloads models",
        ) from e
    return d.resolve(), d.name


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def digest_dir(root: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
    """Hash every regular file under ``root`` (sorted, following symlinks as the hub cache
    uses them). Returns ModelFile entries with paths relative to ``root``. A file whose path
    and full stat (size, mtime_ns, ctime_ns, inode, device) equal one of ``known`` (records
    of earlier digests, e.g. from manifests) takes that record's digest instead of being read
    again -- the rule restore's quick check uses. Raises OSError."""
    by_path = {(f.path, (f.size, f.mtime_ns, f.ctime_ns, f.inode, f.device)): f.blake3 for f in known}
    files = []
    for p in _walk(root):
        st = p.stat()
        rel = str(p.relative_to(root))
        files.append(
            ModelFile(
                path=rel,
                size=st.st_size,
                blake3=by_path.get((rel, _stat_key(st))) or hash_file(p),
                mtime_ns=st.st_mtime_ns,
                ctime_ns=st.st_ctime_ns,
                inode=st.st_ino,
                device=st.st_dev,
            )
        )
    return tuple(files)


@dataclass(frozen=True)
class ModelCheck:
    """Outcome of :func:`verify`: files re-hashed, files added (reported, not refused)."""

    rehashed: tuple[str, ...]
    added: tuple[str, ...]


def verify(root: Path, recorded: tuple[ModelFile, ...], mode: Literal["quick", "full"] = "quick") -> ModelCheck:
    """Check ``root`` against ``recorded``.

    Raises ModelChangedError naming every file whose content differs or that is missing
    (details: ``{"changed": [...], "missing": [...], "added": [...]}``).
    """
    if not root.is_dir():
        raise ModelChangedError(f"the model directory {root} does not exist (moved or deleted after create)",
                                hint="put the model back at that path, or re-create the snapshot",
                                details={"changed": [], "missing": [f.path for f in recorded], "added": []})
    changed, missing, rehashed = [], [], []
    for f in recorded:
        p = root / f.path
        try:
            st = p.stat()
        except FileNotFoundError:
            missing.append(f.path)
            continue
        same_stat = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev) == (
            f.size, f.mtime_ns, f.ctime_ns, f.inode, f.device)
        if mode == "quick" and same_stat:
            continue
        rehashed.append(f.path)
        if st.st_size != f.size or hash_file(p) != f.blake3:
            changed.append(f.path)
    known = {f.path for f in recorded}
    added = tuple(str(p.relative_to(root)) for p in _walk(root) if str(p.relative_to(root)) not in known) if root.is_dir() else ()
    if changed or missing:
        parts = []
        if changed:
            parts.append("content changed: " + ", ".join(changed))
        if missing:
            parts.append("missing: " + ", ".join(missing))
        raise ModelChangedError(
            f"model files under {root} differ from the snapshot's: " + "; ".join(parts),
            hint="re-create the snapshot from the current model files",
            details={"changed": changed, "missing": missing, "added": list(added)},
        )
    return ModelCheck(tuple(rehashed), added)
