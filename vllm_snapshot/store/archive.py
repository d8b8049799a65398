"""Image payload: per-file BLAKE3 checksums, zstd pack at create, verified unpack at restore.

Pack reads each CRIU image once, hashing the raw bytes and (with zstd) compressing them in the
same pass. With zstd each image is cut into independent zstd frames of :data:`FRAME_BYTES` raw
bytes (``zstd-frames``), compressed in parallel; the manifest lists every frame with the BLAKE3
of its stored bytes. Unpack writes raw images into a staging directory (tmpfs when memory
allows): a frame is verified (BLAKE3 of its stored bytes, then zstd's own checksum of its
content) before it is decompressed and written at its offset, frames in parallel on every
core, so one big pages image no longer decompresses on one core. :class:`Unpacking` does this
in the background: restore starts CRIU when the small images are staged and holds it (a CRIU
notification, :meth:`vllm_snapshot.checkpoint.criu.Criu.restore`) before it reads any memory page
until every pages image is staged and verified. Snapshots made before frames (one zstd frame
per file, ``zstd``) still unpack, each file on one core.

With ``none`` the staged entries are hard links to the snapshot's files (staged beside the
snapshot), verified in the background while CRIU restores (:class:`Checking`), so nothing is
copied and the snapshot is never written to (CRIU writes its log and stats into the staging dir
instead).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import blake3
import zstandard

from ..errors import CorruptSnapshotError, UsageError
from .manifest import Frame, ImageFile
# where to stage and the staging dirs' lifecycle live in .staging; their names are archive's too
from .staging import (SHM, STAGE_PREFIX, new_stage, own_staging, remove_staging, stale_staging,  # noqa: F401
                      staging_parent, staging_parents)

CHUNK = 4 << 20  # bytes per read
DEFAULT_LEVEL = 3
#: The default for ``create --compress``. Measured on the tiny-model CPU engine (1280 MiB raw,
#: docs/history.md, "The targets, final run"): ``none`` restores in 1.07 s (checksums over
#: hard-linked images), zstd:3 stores 18.8% of raw but restore takes 2.87 s on 2 cores with the
#: images in the page cache (decompression is CPU work CRIU waits for); read from disk, both take
#: ~3.7 s ("Page cache cold vs warm"). Start time is what this tool exists for, and restored
#: snapshots stay cached, so ``none`` is the default; zstd is one flag away.
DEFAULT_COMPRESSION = "none"


#: Raw bytes per independent zstd frame (``zstd-frames``). Measured on the tiny model's images
#: (docs/benchmarks.md, "Compressed images"): 8 MiB frames decompress on 2 cores in ~0.8 s per
#: GB into tmpfs (32 MiB: ~1.1 s, the output no longer stays in cache) and store the same share
#: as 16 MiB frames (17.5% at level 3).
FRAME_BYTES = 8 << 20


@dataclass(frozen=True)
class Compression:
    """``kind`` is ``none`` or ``zstd``; ``level`` 1..19 for zstd. ``frame_bytes``: raw bytes
    per independent zstd frame; 0 writes one frame per file (the format before frames, kept
    so tests can make such snapshots; ``parse`` never returns it)."""

    kind: str = "zstd"
    level: int = DEFAULT_LEVEL
    frame_bytes: int = FRAME_BYTES

    @classmethod
    def parse(cls, text: str) -> "Compression":
        """Parse ``none``, ``zstd`` or ``zstd:LEVEL``. Raises UsageError."""
        kind, _, lvl = text.partition(":")
        if kind == "none" and not lvl:
            return cls("none", 0)
        if kind == "zstd":
            try:
                level = int(lvl) if lvl else DEFAULT_LEVEL
            except ValueError:
                level = -1
            if 1 <= level <= 19:
                return cls("zstd", level)
        raise UsageError(f"--compress {text!r}: expected none, zstd or zstd:LEVEL (1..19)")

    def __str__(self) -> str:
        return "none" if self.kind == "none" else f"zstd:{self.level}"


def _workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _pack_one(src: Path, comp: Compression) -> ImageFile:
    h = blake3.blake3()
    raw = 0
    if comp.kind == "none":
        with open(src, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                raw += len(chunk)
        os.chmod(src, 0o600)
        return ImageFile(name=src.name, raw_bytes=raw, stored_bytes=raw, blake3=h.hexdigest())
    dst = src.with_name(src.name + ".zst")
    cctx = zstandard.ZstdCompressor(level=comp.level, threads=_workers(), write_checksum=True)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
        with cctx.stream_writer(out, closefd=False) as w:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                raw += len(chunk)
                w.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.unlink(src)
    return ImageFile(
        name=src.name, raw_bytes=raw, stored_bytes=dst.stat().st_size, blake3=h.hexdigest(), compression="zstd"
    )


def _compress_frame(data: memoryview, params: zstandard.ZstdCompressionParameters) -> bytes:
    return zstandard.ZstdCompressor(compression_params=params).compress(data)


def _pack_frames(src: Path, comp: Compression, ex: ThreadPoolExecutor) -> ImageFile:
    """Compress ``src`` into ``src.zst`` as independent frames of ``comp.frame_bytes`` raw bytes,
    compressed on ``ex`` (at most two frames per worker in flight), written in order."""
    params = zstandard.ZstdCompressionParameters.from_level(comp.level, write_checksum=1, write_content_size=1)
    dst = src.with_name(src.name + ".zst")
    h = blake3.blake3()
    frames: list[Frame] = []
    pending: deque[tuple[int, Future]] = deque()
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(src, "rb", buffering=0) as f, os.fdopen(fd, "wb") as out:
        def drain() -> None:
            raw, fut = pending.popleft()
            data = fut.result()
            out.write(data)
            frames.append(Frame(raw_bytes=raw, stored_bytes=len(data), blake3=blake3.blake3(data).hexdigest()))

        first = True
        while (chunk := f.read(comp.frame_bytes)) or first:  # an empty file: one empty frame
            first = False
            h.update(chunk)
            pending.append((len(chunk), ex.submit(_compress_frame, chunk, params)))
            if len(pending) >= 2 * _workers():
                drain()
        while pending:
            drain()
        out.flush()
        os.fsync(out.fileno())
    os.unlink(src)
    return ImageFile(name=src.name, raw_bytes=sum(x.raw_bytes for x in frames),
                     stored_bytes=sum(x.stored_bytes for x in frames), blake3=h.hexdigest(),
                     compression="zstd-frames", frames=tuple(frames))


def pack(images_dir: Path, comp: Compression, exclude: frozenset[str] = frozenset()) -> tuple[ImageFile, ...]:
    """Checksum (and compress, in place) every regular file in ``images_dir`` except
    ``exclude``. With zstd (``comp.frame_bytes`` > 0) each file becomes ``NAME.zst``, a run of
    independent frames compressed on every core (``zstd-frames``). Returns entries sorted by
    name. Raises OSError (e.g. ENOSPC)."""
    files = sorted(p for p in images_dir.iterdir() if p.is_file() and p.name not in exclude)
    # largest first so the big pages image starts at once
    files.sort(key=lambda p: -p.stat().st_size)
    with ThreadPoolExecutor(_workers()) as ex:
        if comp.kind == "zstd" and comp.frame_bytes > 0:
            out = [_pack_frames(p, comp, ex) for p in files]
        else:
            out = list(ex.map(lambda p: _pack_one(p, comp), files))
    return tuple(sorted(out, key=lambda i: i.name))


def stored_name(img: ImageFile) -> str:
    """File name of ``img`` inside the snapshot's images dir."""
    return img.name + ("" if img.compression == "none" else ".zst")


def check_layout(images_dir: Path, images: tuple[ImageFile, ...]) -> None:
    """Refuse missing, extra or wrongly sized stored files (cheap: stat only).

    Raises CorruptSnapshotError naming the file.
    """
    if not images_dir.is_dir():
        raise CorruptSnapshotError(f"{images_dir} is missing")
    want = {stored_name(i): i for i in images}
    have = {p.name for p in images_dir.iterdir()}
    for name in sorted(set(want) - have):
        raise CorruptSnapshotError(f"image file {images_dir / name} is missing")
    for name in sorted(have - set(want)):
        raise CorruptSnapshotError(
            f"unexpected file {images_dir / name} in the images directory",
            hint="a snapshot's images directory holds only the files its manifest lists",
        )
    for name, img in want.items():
        p = images_dir / name
        if p.is_symlink() or not p.is_file():
            raise CorruptSnapshotError(f"image {p} is not a regular file")
        size = p.stat().st_size
        if size != img.stored_bytes:
            raise CorruptSnapshotError(
                f"image {p} has {size} bytes, the manifest records {img.stored_bytes} (truncated or replaced)"
            )


def _unpack_one(src_dir: Path, dst_dir: Path, img: ImageFile, dst_name: str | None = None) -> None:
    if img.compression == "zstd-frames":
        _unpack_frames(src_dir, dst_dir, img, dst_name)
        return
    src = src_dir / stored_name(img)
    h = blake3.blake3()
    raw = 0
    try:
        if img.compression == "none":
            with open(src, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    raw += len(chunk)
            # CRIU does not follow symlinked images: hard-link (same filesystem; staging for
            # uncompressed snapshots is made beside the snapshot), else copy.
            try:
                os.link(os.path.abspath(src), dst_dir / (dst_name or img.name))
            except OSError:
                shutil.copyfile(src, dst_dir / (dst_name or img.name))
        else:
            dctx = zstandard.ZstdDecompressor()
            fd = os.open(dst_dir / (dst_name or img.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
                reader = dctx.stream_reader(f, read_size=CHUNK)
                while chunk := reader.read(CHUNK):
                    h.update(chunk)
                    raw += len(chunk)
                    out.write(chunk)
    except zstandard.ZstdError as e:
        raise CorruptSnapshotError(f"image {src} cannot be decompressed: {e}") from e
    except FileNotFoundError as e:
        raise CorruptSnapshotError(f"image file {src} is missing") from e
    if raw != img.raw_bytes or h.hexdigest() != img.blake3:
        raise CorruptSnapshotError(f"image {src} fails its checksum (BLAKE3 of {raw} raw bytes differs)")


def _frame_jobs(src_fd: int, src: Path, img: ImageFile, dst_fd: int) -> list[tuple]:
    jobs, off, raw_off = [], 0, 0
    for n, fr in enumerate(img.frames or ()):
        jobs.append((src_fd, src, n, off, fr, dst_fd, raw_off))
        off += fr.stored_bytes
        raw_off += fr.raw_bytes
    return jobs


def _unpack_frame(src_fd: int, src: Path, n: int, off: int, fr: Frame, dst_fd: int, raw_off: int) -> None:
    """Verify frame ``n`` of ``src`` (BLAKE3 of its stored bytes, then zstd's content
    checksum) and write its raw bytes at ``raw_off`` of ``dst_fd``. Raises CorruptSnapshotError."""
    data = os.pread(src_fd, fr.stored_bytes, off)
    if len(data) != fr.stored_bytes or blake3.blake3(data).hexdigest() != fr.blake3:
        raise CorruptSnapshotError(f"image {src} fails its checksum (frame {n}: BLAKE3 of stored bytes "
                                   f"{off}..{off + fr.stored_bytes} differs)")
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=fr.raw_bytes)
    except zstandard.ZstdError as e:
        raise CorruptSnapshotError(f"image {src} cannot be decompressed (frame {n}): {e}") from e
    if len(raw) != fr.raw_bytes:
        raise CorruptSnapshotError(f"image {src} frame {n} decompresses to {len(raw)} bytes, "
                                   f"the manifest records {fr.raw_bytes}")
    mv, done = memoryview(raw), 0
    while done < len(mv):
        done += os.pwrite(dst_fd, mv[done:], raw_off + done)


def _unpack_frames(src_dir: Path, dst_dir: Path, img: ImageFile, dst_name: str | None = None) -> None:
    """Unpack a ``zstd-frames`` image frame by frame on this thread (small images)."""
    src = src_dir / stored_name(img)
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CorruptSnapshotError(f"image file {src} is missing") from e
    try:
        dfd = os.open(dst_dir / (dst_name or img.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for job in _frame_jobs(sfd, src, img, dfd):
                _unpack_frame(*job)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


#: The images CRIU reads only once the tree's namespaces exist (each task maps its memory
#: after CRIU's ``post-setup-namespaces`` notification): :class:`Unpacking` stages them in the
#: background, everything else before CRIU starts.
MEMORY_PAGES = re.compile(r"pages-\d+\.img")
PART_SUFFIX = ".part"


class Unpacking:
    """Stage a compressed snapshot's images into ``stage`` (an empty private dir): images not
    named like :data:`MEMORY_PAGES` are unpacked and verified in the constructor (CRIU reads
    them first); the memory pages images are unpacked in the background, every frame verified
    before it is written, on :func:`_workers` threads, each into ``NAME.part`` renamed to
    ``NAME`` once the whole image is staged (a CRIU that opened one early would fail on the
    missing file, never read a partial one).

    :meth:`ready` blocks until every image is staged and raises what failed; restore calls it
    from CRIU's ``post-setup-namespaces`` notification, before any memory page is read (or
    before CRIU starts, for a tree without namespaces). :meth:`wait` (the checksum verdict)
    is :meth:`ready`: every byte was verified before it was staged. :meth:`cancel` stops the
    workers (each finishes its frame) and waits for them.

    The constructor raises CorruptSnapshotError (a small image fails its checksum or is
    missing); the caller removes ``stage``."""

    def __init__(self, src_dir: Path, images: tuple[ImageFile, ...], stage: Path,
                 background=lambda img: bool(MEMORY_PAGES.fullmatch(img.name))) -> None:
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self.unpack_s = 0.0  # seconds the background unpacking took
        self.waited_s = 0.0  # seconds ready() blocked
        later = sorted((i for i in images if background(i)), key=lambda i: -i.raw_bytes)
        for img in images:
            if not background(img):
                _unpack_one(src_dir, stage, img)
        self._thread = threading.Thread(target=self._run, args=(src_dir, tuple(later), stage), daemon=True,
                                        name="vllm-snapshot-unpack")
        self._thread.start()

    def _run(self, src_dir: Path, images: tuple[ImageFile, ...], stage: Path) -> None:
        t0 = time.monotonic()
        fds: list[int] = []
        try:
            jobs: list[tuple] = []
            whole: list[ImageFile] = []
            for img in images:
                if img.compression != "zstd-frames":
                    whole.append(img)
                    continue
                src = src_dir / stored_name(img)
                try:
                    fds.append(os.open(src, os.O_RDONLY | os.O_CLOEXEC))
                except FileNotFoundError as e:
                    raise CorruptSnapshotError(f"image file {src} is missing") from e
                fds.append(os.open(stage / (img.name + PART_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                os.ftruncate(fds[-1], img.raw_bytes)
                jobs += _frame_jobs(fds[-2], src, img, fds[-1])

            def frame(job: tuple) -> None:
                if not self._cancel.is_set():
                    _unpack_frame(*job)

            def one(img: ImageFile) -> None:
                if not self._cancel.is_set():
                    _unpack_one(src_dir, stage, img, img.name + PART_SUFFIX)

            with ThreadPoolExecutor(_workers()) as ex:
                futs = [ex.submit(one, i) for i in whole] + [ex.submit(frame, j) for j in jobs]
                for f in futs:
                    try:
                        f.result()
                    except BaseException:
                        self._cancel.set()  # the others stop at their next frame
                        raise
            if self._cancel.is_set():
                raise CorruptSnapshotError("unpacking the images was cancelled")
            for img in images:
                os.rename(stage / (img.name + PART_SUFFIX), stage / img.name)
        except BaseException as e:  # noqa: BLE001 - handed to ready()
            self._error = e
        finally:
            for fd in fds:
                os.close(fd)
            self.unpack_s = time.monotonic() - t0

    def ready(self) -> None:
        """Block until every image is staged and verified. Raises CorruptSnapshotError (a
        frame fails its checksum, a file is missing, cancelled) or OSError (e.g. ENOSPC)."""
        t0 = time.monotonic()
        self._thread.join()
        self.waited_s += time.monotonic() - t0
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """The checksum verdict (nothing is staged unverified): blocks like :meth:`ready`;
        raises CorruptSnapshotError. Any other failure (an OSError: the staging dir removed
        under a failed restore, ENOSPC) is no verdict on the images: :meth:`ready` raised it
        to whoever waited for the images."""
        try:
            self.ready()
        except CorruptSnapshotError:
            raise
        except OSError:
            pass

    def cancel(self) -> None:
        """Stop unpacking and wait for the workers (at most one frame each)."""
        self._cancel.set()
        self._thread.join()


def start_unpack(src_dir: Path, images: tuple[ImageFile, ...], parent: Path) -> tuple[Path, Unpacking]:
    """A new private staging dir under ``parent`` and an :class:`Unpacking` into it. Raises
    CorruptSnapshotError or OSError (staging already removed)."""
    stage = new_stage(parent)
    try:
        return stage, Unpacking(src_dir, images, stage)
    except BaseException:
        remove_staging(stage)
        raise


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
        h = blake3.blake3()
        raw = 0
        try:
            with open_raw(src_dir, img) as reader:
                for chunk in _raw_chunks(reader, img.compression == "none"):
                    if cancel is not None and cancel.is_set():
                        raise CorruptSnapshotError(f"checksum verification of {src} cancelled")
                    h.update(chunk)
                    raw += len(chunk)
        except zstandard.ZstdError as e:
            raise CorruptSnapshotError(f"image {src} cannot be decompressed: {e}") from e
        except FileNotFoundError as e:
            raise CorruptSnapshotError(f"image file {src} is missing") from e
        if raw != img.raw_bytes or h.hexdigest() != img.blake3:
            raise CorruptSnapshotError(f"image {src} fails its checksum (BLAKE3 of {raw} raw bytes differs)")

    with ThreadPoolExecutor(_workers(), initializer=_lowest_priority if background else None) as ex:
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
    ready regions reach without a gap, on :func:`_workers` threads (one file on one thread at a
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
        self._ex = ThreadPoolExecutor(_workers(), thread_name_prefix="vllm-snapshot-assembled")
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
                if self._at[path] != img.raw_bytes or self._h[path].hexdigest() != img.blake3:
                    raise CorruptSnapshotError(
                        f"image {path} fails its checksum (BLAKE3 of {self._at[path]} raw bytes differs)")
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


def link_stage(src_dir: Path, images: tuple[ImageFile, ...], parent: Path) -> Path:
    """Stage uncompressed images as hard links (copies across file systems) in a new private
    dir under ``parent``, WITHOUT verifying them: the caller verifies concurrently
    (:class:`Checking`) and must decide before serving. Returns the staging dir. Raises
    ValueError for a compressed image, CorruptSnapshotError for a missing one (staging
    removed)."""
    if any(i.compression != "none" for i in images):
        raise ValueError("link_stage stages uncompressed images only")
    stage = new_stage(parent)
    try:
        for img in images:
            src = src_dir / stored_name(img)
            try:
                os.link(os.path.abspath(src), stage / img.name)
            except FileNotFoundError as e:
                raise CorruptSnapshotError(f"image file {src} is missing") from e
            except OSError:
                shutil.copyfile(src, stage / img.name)
    except BaseException:
        remove_staging(stage)
        raise
    return stage


def unpack(src_dir: Path, images: tuple[ImageFile, ...], parent: Path) -> Path:
    """Stage raw images into a new private dir under ``parent``, verifying checksums on the
    way (files, and the frames of ``zstd-frames`` images, in parallel). Returns the staging
    dir; the caller removes it with :func:`remove_staging`. Raises CorruptSnapshotError or
    OSError (staging already removed)."""
    stage = new_stage(parent)
    try:
        if any(i.compression == "zstd-frames" for i in images):
            Unpacking(src_dir, images, stage, background=lambda i: i.compression != "none").ready()
        else:
            with ThreadPoolExecutor(_workers()) as ex:
                list(ex.map(lambda i: _unpack_one(src_dir, stage, i), sorted(images, key=lambda i: -i.raw_bytes)))
    except BaseException:
        remove_staging(stage)
        raise
    return stage
