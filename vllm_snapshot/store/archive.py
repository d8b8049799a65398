"""Image payload: per-file BLAKE3 checksums, zstd pack at create, verified unpack at restore
(checking stored files without unpacking them: :mod:`vllm_snapshot.store.checksums`).

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
snapshot), verified in the background while CRIU restores (:class:`~vllm_snapshot.store.checksums.Checking`), so nothing is
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
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
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


def workers() -> int:
    """Threads for packing, unpacking and checking images: the CPUs, at least 1, at most 4."""
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
    cctx = zstandard.ZstdCompressor(level=comp.level, threads=workers(), write_checksum=True)
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
            if len(pending) >= 2 * workers():
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
    with ThreadPoolExecutor(workers()) as ex:
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


def check_digest(src: Path, img: ImageFile, raw: int, hexdigest: str) -> None:
    """The verdict on a stored file ``src``: ``raw`` bytes read with BLAKE3 ``hexdigest`` must
    be ``img``'s. Raises CorruptSnapshotError naming the file."""
    if raw != img.raw_bytes or hexdigest != img.blake3:
        raise CorruptSnapshotError(f"image {src} fails its checksum (BLAKE3 of {raw} raw bytes differs)")


class _Hashed:
    """BLAKE3 and count of the bytes given to :meth:`update`."""

    def __init__(self) -> None:
        self.h, self.raw = blake3.blake3(), 0

    def update(self, chunk) -> None:
        self.h.update(chunk)
        self.raw += len(chunk)


@contextmanager
def hashed(src: Path, img: ImageFile) -> Iterator[_Hashed]:
    """Hash ``img``'s raw bytes, read from its stored file ``src`` in the block, into the object
    yielded (``update(chunk)``); leaving the block is the verdict (:func:`check_digest`). A
    damaged zstd stream or a missing file in the block is a CorruptSnapshotError naming ``src``."""
    got = _Hashed()
    try:
        yield got
    except zstandard.ZstdError as e:
        raise CorruptSnapshotError(f"image {src} cannot be decompressed: {e}") from e
    except FileNotFoundError as e:
        raise CorruptSnapshotError(f"image file {src} is missing") from e
    check_digest(src, img, got.raw, got.h.hexdigest())


def _unpack_one(src_dir: Path, dst_dir: Path, img: ImageFile, dst_name: str | None = None) -> None:
    if img.compression == "zstd-frames":
        _unpack_frames(src_dir, dst_dir, img, dst_name)
        return
    src = src_dir / stored_name(img)
    with hashed(src, img) as got:
        if img.compression == "none":
            with open(src, "rb") as f:
                while chunk := f.read(CHUNK):
                    got.update(chunk)
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
                    got.update(chunk)
                    out.write(chunk)


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
    before it is written, on :func:`workers` threads, each into ``NAME.part`` renamed to
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

            with ThreadPoolExecutor(workers()) as ex:
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


def link_stage(src_dir: Path, images: tuple[ImageFile, ...], parent: Path) -> Path:
    """Stage uncompressed images as hard links (copies across file systems) in a new private
    dir under ``parent``, WITHOUT verifying them: the caller verifies concurrently
    (:class:`~vllm_snapshot.store.checksums.Checking`) and must decide before serving. Returns the staging dir. Raises
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
            with ThreadPoolExecutor(workers()) as ex:
                list(ex.map(lambda i: _unpack_one(src_dir, stage, i), sorted(images, key=lambda i: -i.raw_bytes)))
    except BaseException:
        remove_staging(stage)
        raise
    return stage
