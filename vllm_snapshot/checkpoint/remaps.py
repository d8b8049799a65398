"""CRIU link-remap files: the one owner of their life cycle.

With ``--link-remap``, CRIU dumps a deleted-but-open file by hard-linking it back into its
directory as ``link_remap.N`` (on the host filesystem, outside the images). A snapshot keeps
copies of those in ``files/`` under a ``%``-encoded name (``/var/tmp/x/link_remap.3`` ->
``var%tmp%x%link_remap.3``) and puts them back right before each CRIU restore, which
consumes them. Files under the engine's private tmpfs mounts (where vLLM's semaphores live)
are dumped with the tmpfs and never reach this module.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PREFIX = "link_remap."


def watch_dirs(deleted_paths: tuple[str, ...] | list[str]) -> dict[str, set[str]]:
    """Directories of ``deleted_paths`` -> their current entries (taken before the dump)."""
    out: dict[str, set[str]] = {}
    for d in {str(Path(p).parent) for p in deleted_paths}:
        if os.path.isdir(d):
            out[d] = set(os.listdir(d))
    return out


def encode(path: Path) -> str:
    """``/a/b/link_remap.3`` -> ``a%b%link_remap.3`` (a flat name inside ``files/``)."""
    return str(path.parent).strip("/").replace("/", "%") + "%" + path.name


def decode(name: str) -> Path:
    """Inverse of :func:`encode`."""
    d, _, n = name.rpartition("%")
    return Path("/" + d.replace("%", "/")) / n


def collect(before: dict[str, set[str]]) -> list[Path]:
    """The link-remap files CRIU created in the watched directories during the dump."""
    out = []
    for d, names in before.items():
        for n in sorted(set(os.listdir(d)) - names):
            if n.startswith(PREFIX):
                out.append(Path(d) / n)
    return out


def save(found: list[Path], files_dir: Path) -> None:
    """Copy each found file into ``files_dir`` (mode 0600) under its encoded name."""
    for src in found:
        dst = files_dir / encode(src)
        shutil.copy2(src, dst)
        os.chmod(dst, 0o600)


def cleanup(found: list[Path]) -> None:
    """Remove the originals once the snapshot holds the copies (or the create failed)."""
    for p in found:
        p.unlink(missing_ok=True)


def _same_file(path: Path, saved: Path) -> bool:
    """``path`` is a regular file (not a symlink), ours, with the saved bytes."""
    import filecmp
    import stat

    st = os.lstat(path)
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
            and filecmp.cmp(path, saved, shallow=False))


def put_back(files_dir: Path, names: list[str]) -> list[Path]:
    """Create each saved file at its original path, exclusively and without following
    symlinks. An existing identical file (regular, ours, same bytes) is left for CRIU to use;
    anything else there refuses. Returns what was placed; on failure removes what it placed
    and raises BusyError (something else is at the path) or OSError."""
    from ..errors import BusyError

    placed: list[Path] = []
    try:
        for n in names:
            dst = decode(n)
            try:
                fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                if _same_file(dst, files_dir / n):
                    continue
                raise BusyError(f"{dst} exists and is not the snapshot's link-remap file (a symlink, another "
                                "owner or other content); refusing to use or overwrite it",
                                hint=f"remove {dst} if nothing needs it, then restore again") from None
            placed.append(dst)
            with os.fdopen(fd, "wb") as out, open(files_dir / n, "rb") as src:
                shutil.copyfileobj(src, out)
    except BaseException:
        cleanup(placed)
        raise
    return placed
