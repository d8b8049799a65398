"""The files a dumped tree holds open or mapped: their records (:func:`file_record`: path,
size, mtime, and a BLAKE3 for small files and JIT caches) and restore's check that each is
still the same (:func:`check_files`). :mod:`.inventory` records them at create."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping

import blake3

from ..store.manifest import TreeFile

#: Files up to this many bytes get a BLAKE3 content digest in their record.
HASH_LIMIT_BYTES = 1 << 20
#: JIT caches that are rotated or cleaned between runs: (path marker, name, remedy).
JIT_CACHES: tuple[tuple[str, str, str], ...] = (
    ("/torch_compile_cache/", "vLLM torch.compile cache",
     "keep VLLM_CACHE_ROOT (default ~/.cache/vllm) unchanged between create and restore, "
     "or re-create the snapshot (a snapshot made now carries these files and puts them back)"),
    ("/.triton/", "Triton kernel cache",
     "set TRITON_CACHE_DIR to a directory nothing cleans (default ~/.triton/cache), "
     "or re-create the snapshot (a snapshot made now carries these files and puts them back)"),
    ("/torchinductor_", "TorchInductor cache",
     "set TORCHINDUCTOR_CACHE_DIR to a directory nothing cleans (default /tmp/torchinductor_USER), "
     "or re-create the snapshot (a snapshot made now carries these files and puts them back)"),
)


def _hash_file(path: str) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _digested(path: str, size: int) -> bool:
    """Files that get a content digest: small ones, and JIT-cache files of any size (caches are
    rewritten in place by other runs; size+mtime alone would not pin them)."""
    return size <= HASH_LIMIT_BYTES or _jit_cache(path) is not None


def file_record(path: str) -> TreeFile:
    """:class:`TreeFile` of the regular file at ``path`` now (size in bytes, mtime in ns,
    BLAKE3 hex of the content when ``size <= HASH_LIMIT_BYTES`` or the file is in a JIT cache).
    Raises OSError (e.g. FileNotFoundError) when it cannot be read, ValueError when it is not a
    regular file."""
    for _ in range(3):
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        digest = _hash_file(path) if _digested(path, st.st_size) else None
        st2 = os.stat(path)
        if (st2.st_size, st2.st_mtime_ns, st2.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
            return TreeFile(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, blake3=digest)
    return TreeFile(path=path, size=st2.st_size, mtime_ns=st2.st_mtime_ns,
                    blake3=_hash_file(path) if _digested(path, st2.st_size) else None)


def _jit_cache(path: str) -> tuple[str, str] | None:
    for marker, name, remedy in JIT_CACHES:
        if marker in path:
            return name, remedy
    return None


def check_files(records: Iterable[TreeFile | Mapping]) -> list[str]:
    """Compare recorded files (:class:`TreeFile` or their JSON dicts) with the host now.

    Returns one human-readable problem per file that vanished, is no longer a regular file,
    changed size, or changed content (BLAKE3, files <= ``HASH_LIMIT_BYTES``; a changed mtime
    with identical content is fine) -- for larger files, which have no digest, a changed mtime
    is a problem. Problems on JIT caches (torch.compile, Triton, Inductor) name the cache and
    its remedy. Empty list = all unchanged. Raises nothing (unreadable files are problems).
    """
    problems = []
    for r in records:
        rec = r if isinstance(r, TreeFile) else TreeFile.model_validate(dict(r))
        problem = None
        try:
            st = os.stat(rec.path)
            if not stat.S_ISREG(st.st_mode):
                problem = f"{rec.path} is no longer a regular file"
            elif st.st_size != rec.size:
                problem = f"{rec.path} changed: size {rec.size} -> {st.st_size} bytes"
            elif rec.blake3 is not None and (rec.size <= HASH_LIMIT_BYTES or st.st_mtime_ns != rec.mtime_ns):
                # small files always; a large (JIT-cache) file when its mtime moved
                got = _hash_file(rec.path)
                if got != rec.blake3:
                    problem = f"{rec.path} changed: content differs (BLAKE3 {rec.blake3[:16]}… -> {got[:16]}…)"
            elif st.st_mtime_ns != rec.mtime_ns:
                problem = (f"{rec.path} changed: mtime {rec.mtime_ns} -> {st.st_mtime_ns} ns "
                           f"(larger than {HASH_LIMIT_BYTES} bytes, content not re-hashed)")
        except FileNotFoundError:
            problem = f"{rec.path} vanished"
        except OSError as e:
            problem = f"{rec.path} cannot be read: {e.strerror or e}"
        if problem:
            jit = _jit_cache(rec.path)
            if jit:
                problem += f" -- it is in the {jit[0]}, which is rotated/cleaned between runs; remedy: {jit[1]}"
            problems.append(problem)
    return problems
