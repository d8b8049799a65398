"""Checking a snapshot's stored files against their manifest's checksums without unpacking
them: :func:`verify` (every file, in parallel, largest first; ``verify`` and a pull's pass),
:class:`Checking` (the same in a background thread while CRIU restores from hard links) and
:class:`Assembling` (files hashed while a pull writes their parts, in any order). Each reads a
file's raw bytes (:func:`open_raw`: decompressed on the fly) and compares their size and
BLAKE3 with its :class:`~vllm_snapshot.store.manifest.ImageFile`; a mismatch raises
CorruptSnapshotError naming the file. Packing and unpacking are :mod:`vllm_snapshot.store.archive`'s."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import blake3
import zstandard

from ..errors import CorruptSnapshotError
from .archive import CHUNK, check_digest, hashed, stored_name, workers
from .manifest import ImageFile


def _lowest_priority() -> None:
    """Give the calling thread nice 19 (Linux: a thread's own priority, ``setpriority`` on its
    TID). Never raises (a kernel that refuses leaves the priority as it was)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


@contextmanager
def open_raw(src_dir: Path, img: ImageFile) -> Iterator:
    """A binary reader (``read(n)``) of ``img``'s raw bytes from its stored file in ``src_dir``,
    decompressed on the fly whatever its compression. Raises FileNotFoundError; reading raises
    zstandard.ZstdError on a damaged stream."""
    with open(src_dir / stored_name(img), "rb") as f:
        yield f if img.compression == "none" else zstandard.ZstdDecompressor().stream_reader(
            f, read_size=CHUNK, read_across_frames=True)


#: bytes per read of an uncompressed image's checksum: one buffer refilled in place, hashed
#: while still in the CPU's cache (the demo model's 1.6 GB of pages, page cache warm: 0.53
#: CPU-s against 0.7 with 4 MiB reads into new buffers, one thread; 0.43 against 0.45 in the
#: pull's parallel pass -- docs/benchmarks.md, "Fleet: a lighter download")
VERIFY_BUF = 256 << 10


def _raw_chunks(reader, plain: bool) -> Iterator:
    """The raw bytes ``reader`` (:func:`open_raw`) gives: from an uncompressed file, memoryviews
    of one :data:`VERIFY_BUF` buffer refilled by ``readinto`` (each valid until the next is
    asked for); from a zstd stream, its decompressed chunks."""
    if not plain:
        while chunk := reader.read(CHUNK):
            yield chunk
        return
    buf = memoryview(bytearray(VERIFY_BUF))
    while n := reader.readinto(buf):
        yield buf[:n]


def verify(src_dir: Path, images: tuple[ImageFile, ...], cancel: threading.Event | None = None,
           background: bool = False) -> None:
    """Check every image's checksum without writing anything (files in parallel, largest
    first). ``cancel`` (set by another thread) stops the check early, raising
    CorruptSnapshotError("cancelled"). ``background``: the hashing threads run at nice 19, so
    that CRIU, restoring at the same time, gets the CPUs first (measured on 2 CPUs, 4 restores
    each, docs/history.md: CRIU's phase 1.22 -> 1.15 s, restore 1.39 -> 1.30 s median; the
    hashing is still done before the verdict). Raises CorruptSnapshotError."""
    def one(img: ImageFile) -> None:
        src = src_dir / stored_name(img)
        with hashed(src, img) as got, open_raw(src_dir, img) as reader:
            for chunk in _raw_chunks(reader, img.compression == "none"):
                if cancel is not None and cancel.is_set():
                    raise CorruptSnapshotError(f"checksum verification of {src} cancelled")
                got.update(chunk)

    with ThreadPoolExecutor(workers(), initializer=_lowest_priority if background else None) as ex:
        list(ex.map(one, sorted(images, key=lambda i: -i.raw_bytes)))


class Checking:
    """The checksums of a snapshot's uncompressed images, verified in a background thread
    while CRIU restores from their hard links (:func:`link_stage`). :meth:`wait` is the
    decision: it blocks until every checksum was verified and raises CorruptSnapshotError on
    a mismatch; restore calls it before the HTTP port is bound, so nothing unverified is
    served. :meth:`cancel` stops the thread early (a failed restore) and waits for it."""

    def __init__(self, src_dir: Path, images: tuple[ImageFile, ...]) -> None:
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(src_dir, images), daemon=True,
                                        name="vllm-snapshot-checksums")
        self._thread.start()

    def _run(self, src_dir: Path, images: tuple[ImageFile, ...]) -> None:
        try:
            verify(src_dir, images, self._cancel, background=True)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e

    def wait(self) -> None:
        """Block until done. Raises CorruptSnapshotError (a mismatch, or cancelled)."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop the verification and wait for its thread (at most one chunk per worker)."""
        self._cancel.set()
        self._thread.join()


class Assembling:
    """The BLAKE3 checksums of uncompressed files being assembled from parts that are written
    in any order (a pull's layers, :func:`vllm_snapshot.fleet.transfer.download`), computed
    while they are written instead of in a pass after. ``files`` maps each file's path to its
    :class:`ImageFile` (``compression`` ``none``: the stored bytes are the raw bytes).

    :meth:`ready` says that a region of a file is written and will not be written again (the
    caller's promise: a pull calls it once a layer's bytes matched its digest, and the layers
    tile each file, checked when the manifest was read). Each file is hashed in order, from
    disk (the page cache: read back, not the bytes that were handed to ``pwrite``, so a part
    placed at a wrong offset or in a wrong file fails as in :func:`verify`), as far as its
    ready regions reach without a gap, on :func:`workers` threads (one file on one thread at a
    time). :meth:`finish` is the decision: every file is hashed on from where it got to, to its
    end, as :func:`verify` reads it, and compared with its size and BLAKE3. Raises
    CorruptSnapshotError naming the file (a mismatch, a missing file); :meth:`cancel` stops
    early (a failed pull) and waits for the threads."""

    def __init__(self, files: dict[Path, ImageFile]) -> None:
        self._files = dict(files)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._at = {f: 0 for f in self._files}  # bytes hashed so far
        self._ready: dict[Path, dict[int, int]] = {f: {} for f in self._files}  # offset -> end, not yet hashed
        self._h = {f: blake3.blake3() for f in self._files}
        self._fd: dict[Path, int] = {}
        self._busy: set[Path] = set()
        self._all = False  # finish(): every file to its end
        self._errors: list[BaseException] = []
        self._ex = ThreadPoolExecutor(workers(), thread_name_prefix="vllm-snapshot-assembled")
        self._futs: list[Future] = []
        #: bytes hashed before finish() was called (how much of the pass the writing hid)
        self.early_bytes = 0

    def ready(self, path: Path, offset: int, size: int) -> None:
        """Bytes ``[offset, offset + size)`` of ``path`` are written for good. A path not in
        ``files`` is ignored."""
        with self._lock:
            if path not in self._files or self._cancel.is_set():
                return
            self._ready[path][offset] = offset + size
            self._kick(path)

    def _kick(self, path: Path) -> None:
        """(lock held) Start hashing ``path`` unless a thread is on it already."""
        if path not in self._busy and (self._all or self._at[path] in self._ready[path]):
            self._busy.add(path)
            self._futs.append(self._ex.submit(self._run, path))

    def _run(self, path: Path) -> None:
        try:
            while True:
                with self._lock:
                    start = self._at[path]
                    end = self._ready[path].pop(start, None)
                    if end is None and not self._all:
                        self._busy.discard(path)
                        return
                    tail = end is None  # finish(): on to the end of the file
                n = self._hash(path, start, end)
                with self._lock:
                    self._at[path] = start + n
                    if not self._all:
                        self.early_bytes += n
                    if tail:
                        self._busy.discard(path)
                        return
        except BaseException as e:  # noqa: BLE001 - handed to finish()
            with self._lock:
                self._errors.append(e)
                self._busy.discard(path)
                self._cancel.set()

    def _hash(self, path: Path, start: int, end: int | None) -> int:
        """Hash ``path`` from ``start`` to ``end`` (None: to its end) into its hasher; the
        bytes hashed."""
        fd = self._fd.get(path)
        if fd is None:
            try:
                fd = self._fd[path] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError as e:
                raise CorruptSnapshotError(f"image file {path} is missing") from e
        buf = memoryview(bytearray(VERIFY_BUF))
        h, at = self._h[path], start
        while end is None or at < end:
            if self._cancel.is_set():
                raise CorruptSnapshotError(f"checksum verification of {path} cancelled")
            want = VERIFY_BUF if end is None else min(VERIFY_BUF, end - at)
            n = os.preadv(fd, [buf[:want]], at)
            if n == 0:
                break
            h.update(buf[:n])
            at += n
        return at - start

    def finish(self) -> set[Path]:
        """Hash every file on to its end and compare it with its size and BLAKE3; returns the
        paths checked (every one of ``files``). Raises CorruptSnapshotError."""
        try:
            with self._lock:
                self._all = True  # a thread on a file now goes on to its end; an idle file gets one
                for path in self._files:
                    self._kick(path)
                futs = list(self._futs)
            for f in futs:
                f.result()
            if self._errors:
                raise self._errors[0]
            for path, img in self._files.items():
                check_digest(path, img, self._at[path], self._h[path].hexdigest())
            return set(self._files)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop hashing and wait for the threads (at most one buffer each); close the files."""
        self._cancel.set()
        self._ex.shutdown(wait=True, cancel_futures=True)
        for fd in self._fd.values():
            os.close(fd)
        self._fd.clear()
