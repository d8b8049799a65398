"""Push a snapshot directory as an OCI artifact; download one into a staging directory.

Push: hash every layer (parallel), upload the layers the target lacks (parallel), the config
(the snapshot's manifest.json), then the manifest under the tag -- last, so a push killed at
any point leaves the tag where it was (absent, or the previous complete artifact); then,
with a key, the cosign-layout signature (:mod:`.sign`).

Download: the config and every layer streamed with their digests checked as they arrive
(:mod:`.transport`), layers in parallel, each part written at its offset of its member file
(0600, dirs 0700) inside a staging directory the caller publishes by rename only when
everything -- blob digests, then the snapshot's own checksums -- checked. In a resumable
staging dir (:mod:`.partial`) each layer is marked once its verified bytes are on disk, and a
later pull of the same artifact downloads only the layers not marked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CorruptSnapshotError
from . import oci, sign
from .transport import STOP, NotFound, Stopped, Target

#: parallel streams per push/pull (measured: docs/benchmarks.md "Fleet")
WORKERS = 4


@dataclass(frozen=True)
class Pushed:
    """Result of :func:`push`: the artifact's manifest ``digest``, the ``tag``, bytes of every
    layer (``bytes``) and of those sent (``sent_bytes``: layers the target already had are
    skipped), ``blobs``/``skipped`` counts, ``seconds`` of the transfer, and the signature
    tag when signed."""

    digest: str
    tag: str
    bytes: int
    sent_bytes: int
    blobs: int
    skipped: int
    seconds: float
    signature_tag: str | None
    #: blobs the target held damaged (an image layout's, hashed before skipping) and that
    #: were written again
    repaired: tuple[str, ...] = ()
    #: what the operator should know about the target (a body limit met, ranges ignored)
    notes: tuple[str, ...] = ()


def _parallel(fn, items, workers: int) -> None:
    """Run ``fn`` over ``items`` on ``workers`` threads; the first error is raised once every
    started call returned (the rest are cancelled). An exception in the calling thread while
    it waits (an interruption: SIGINT/SIGTERM/SIGHUP raise there) sets the workers' stop event
    (:data:`.transport.STOP`): each running blob transfer stops at its next chunk
    (:class:`.transport.Stopped`) instead of finishing its layer, and calls not started are
    dropped, so an interrupted push or pull exits within about a chunk's time (a resumed pull
    continues a stopped layer from its last progress record)."""
    stop = threading.Event()

    def run(x):
        if stop.is_set():
            raise Stopped("not started: another transfer failed or the command was interrupted")
        STOP.event = stop
        try:
            return fn(x)
        finally:
            STOP.event = None

    ex = ThreadPoolExecutor(max(1, workers), thread_name_prefix="vllm-snapshot-blob")
    try:
        futs = [ex.submit(run, x) for x in items]
        err = None
        for f in futs:
            if err is not None:
                f.cancel()
                continue
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - a worker's error: the running ones finish (a
                err = e               # resumed pull reuses their layers), the rest are dropped
        if err is not None:
            raise err
    except BaseException:
        stop.set()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def push(snapshot: Path, config: bytes, ann: dict[str, str], target: Target, tag: str, *,
         signing_key=None, docker_reference: str = "", workers: int = WORKERS,
         part_bytes: int = oci.PART_BYTES, on_blob: Callable[[oci.Part], None] | None = None,
         weights=None) -> Pushed:
    """Push snapshot directory ``snapshot`` (trusted and checked by the caller) whose
    manifest.json bytes are ``config`` to ``target`` under ``tag``, with manifest annotations
    ``ann``; ``weights`` (:class:`~vllm_snapshot.store.manifest.WeightsFile`, checked by the
    caller) adds the weights file's layers (:data:`.oci.WEIGHTS_TYPE`), read from its path, and
    skipped like any blob the target has. ``signing_key``: an EC private key
    (:func:`.sign.load_private`). Raises EnvironmentProblem (registry), CorruptSnapshotError (a
    file changed while pushed), OSError (the weights file cannot be read)."""
    t0 = time.monotonic()
    parts = oci.digest_parts(snapshot, oci.plan(snapshot, part_bytes) + oci.plan_weights(weights, part_bytes),
                             workers)
    raw = oci.build_manifest(config, parts, ann)
    sent = [0, 0]  # bytes, skipped blobs
    lock = threading.Lock()
    seen: set[str] = set()

    def upload(p: oci.Part) -> None:
        with lock:
            dup = p.digest in seen
            seen.add(p.digest)
        if dup or target.has_blob(p.digest, p.size):
            with lock:
                sent[1] += 1
        else:
            target.put_blob(p.digest, p.size, p.source(snapshot), p.offset)
            with lock:
                sent[0] += p.size
        if on_blob:
            on_blob(p)

    order = sorted(parts, key=lambda p: -p.size)  # the big parts first: they set the wall time
    _parallel(upload, order, workers)
    cfg_digest = oci.sha256(config)
    if not target.has_blob(cfg_digest, len(config)):
        _put_bytes(target, cfg_digest, config)
    digest = target.put_manifest(tag, raw)
    sig_tag = None
    if signing_key is not None:
        body, scfg, sman = sign.sign(signing_key, docker_reference, digest)
        for data in (body, scfg):
            _put_bytes(target, oci.sha256(data), data)
        sig_tag = sign.sig_tag(digest)
        target.put_manifest(sig_tag, sman)
    return Pushed(digest=digest, tag=tag, bytes=sum(p.size for p in parts), sent_bytes=sent[0], blobs=len(parts),
                  skipped=sent[1], seconds=time.monotonic() - t0, signature_tag=sig_tag,
                  repaired=tuple(dict.fromkeys(getattr(target, "repaired", ()))),
                  notes=tuple(getattr(target, "notes", ())))


def _put_bytes(target: Target, digest: str, data: bytes) -> None:
    """Upload small ``data`` (the config, a signature's blobs) as blob ``digest``, through a
    0600 file in a private temp dir (the config describes process memory's snapshot)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=".vllm-snapshot-blob-") as d:
        p = Path(d) / "blob"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        target.put_blob(digest, len(data), p)


def fetch_manifest(target: Target, reference: str, where: str) -> oci.Artifact:
    """The artifact at ``reference`` (tag or digest), parsed and checked
    (:func:`.oci.parse_manifest`). Raises NotFound, CorruptSnapshotError."""
    raw, digest = target.get_manifest(reference)
    art = oci.parse_manifest(raw, where)
    assert art.digest == digest
    return art


def fetch_bytes(target: Target, digest: str, size: int, what: str) -> bytes:
    """A small blob (config, signature payload) into memory, digest checked."""
    buf = bytearray()
    target.get_blob(digest, size, buf.extend, what)
    return bytes(buf)


def verify_signature(target: Target, art: oci.Artifact, pub, where: str) -> str:
    """Refuse unless a signature tagged ``sha256-HEX.sig`` beside ``art`` verifies with public
    key ``pub`` and names ``art``'s digest. Returns the key's fingerprint. Raises
    SignatureError (unsigned, or no signature by that key)."""
    tag = sign.sig_tag(art.digest)
    try:
        raw, _ = target.get_manifest(tag)
    except NotFound as e:
        raise sign.SignatureError(f"{where} is not signed (no {tag} beside it); nothing was pulled",
                                  hint="push it with --sign-key, or pull without --verify-key if you trust the "
                                       "repository") from e
    stale: list[str] = []
    for digest, size, signature in sign.signature_layers(raw, where):
        if size > 1 << 20:
            continue
        body = fetch_bytes(target, digest, size, "signature payload")
        named = sign.signed_digest(pub, body, signature)
        if named == art.digest:
            return sign.fingerprint(pub)
        if named is not None:
            stale.append(named)
    if stale:
        raise sign.SignatureError(
            f"{where}: the signature tag {tag} read there is signed by the given key ({sign.fingerprint(pub)}) but "
            f"names another artifact, {stale[0]}, not {art.digest} (a stale signature: that tag was written for "
            "another push); nothing was pulled",
            hint="sign this artifact again: `vllm-snapshot push SNAPSHOT IMAGE --sign-key KEY` on the node that "
                 "holds the snapshot writes its signature tag anew", details={"tag": tag, "names": stale[0]})
    raise sign.SignatureError(f"{where}: no signature beside it verifies with the given key "
                              f"({sign.fingerprint(pub)}); nothing was pulled",
                              hint="check --verify-key names the public key of the key it was pushed with")


@dataclass(frozen=True)
class Downloaded:
    """Result of :func:`download`: layers (``fetched``) and bytes (``fetched_bytes``: every
    byte that came, a layer fetched again or a range a registry ignored counting each time)
    downloaded now, and what an interrupted pull of the same artifact had already put in place
    and that hashed to their digests again: whole layers (``reused``) and bytes
    (``reused_bytes``: those layers' and the flushed prefixes of layers it was cut off in that
    were not downloaded again)."""

    fetched: int
    fetched_bytes: int
    reused: int
    reused_bytes: int


#: a layer being downloaded into a partial dir records how far it got (flushed) every this many bytes
PROGRESS_BYTES = 32 << 20


def _region_matches(fd: int, offset: int, size: int, digest: str) -> bool:
    """True when ``size`` bytes of ``fd`` from ``offset`` hash to ``digest`` (``sha256:HEX``)."""
    h = oci.hash_region(fd, offset, size)
    return h is not None and "sha256:" + h.hexdigest() == digest


def _progress(marks: Path, i: int, size: int) -> int:
    """How many leading bytes of layer ``i`` (``size`` long) an earlier pull wrote and flushed
    (``.parts/INDEX.at``); 0 when unknown."""
    try:
        n = int((marks / f"{i}.at").read_text())
    except (OSError, ValueError):
        return 0
    return n if 0 < n < size else 0


def _record_progress(marks: Path, i: int, n: int) -> None:
    tmp = marks / f"{i}.at.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, str(n).encode())
    finally:
        os.close(fd)
    os.rename(tmp, marks / f"{i}.at")


class _Flusher:
    """The disk flushes of one download, on a thread of their own so that no blob stream waits
    for the disk: a stream hands over how far it wrote (:meth:`progress`, every
    :data:`PROGRESS_BYTES`) and each layer it verified (:meth:`verified`) and goes on reading
    the network. The thread takes everything handed over since its last pass, flushes each
    file named there once (``fdatasync``: every byte written to it before the hand-over is on
    disk after it), then -- with ``marks`` (a resumable download) -- writes the records in the
    order handed over: ``INDEX.at`` progress records, and for a verified layer its marker
    ``INDEX`` (its ``.at`` removed). So a record or marker never names bytes that are not on
    disk, as when each stream flushed for itself (measured: those flushes held the four streams
    1.9-3.7 s in all per 1.6 GB pull: docs/benchmarks.md, "Fleet: flushes off the streams, the
    checksum pass beside the download").
    Without ``marks`` it only flushes (the writeback spread over the download; the caller's
    final ``fsync`` has little left). :meth:`close` flushes and records what is still handed
    over -- on an error or an interruption too (the pass under way and one more), so a
    verified layer is marked as before -- and raises the thread's OSError, if any;
    :meth:`progress` and :meth:`verified` raise it as soon as it happened."""

    def __init__(self, marks: Path | None) -> None:
        self._marks = marks
        self._todo: list[tuple[int, int, int | None]] = []  # (fd, layer index, bytes | None: verified)
        self._cv = threading.Condition()
        self._closed = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-snapshot-flush")
        self._thread.start()

    def _put(self, item: tuple[int, int, int | None]) -> None:
        with self._cv:
            if self._error is not None:
                raise self._error
            self._todo.append(item)
            self._cv.notify()

    def progress(self, fd: int, i: int, n: int) -> None:
        """Layer ``i`` has its first ``n`` bytes written to ``fd``: record it once flushed."""
        self._put((fd, i, n))

    def verified(self, fd: int, i: int) -> None:
        """Layer ``i``'s bytes in ``fd`` matched its digest: mark it once flushed."""
        self._put((fd, i, None))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._todo and not self._closed:
                    self._cv.wait()
                if not self._todo:
                    return
                batch, self._todo = self._todo, []
            try:
                self._flush(batch)
            except OSError as e:
                with self._cv:
                    self._error = e
                return

    def _flush(self, batch: list[tuple[int, int, int | None]]) -> None:
        for fd in dict.fromkeys(fd for fd, _, _ in batch):
            os.fdatasync(fd)
        if self._marks is None:
            return
        for _, i, n in batch:
            if n is not None:
                _record_progress(self._marks, i, n)
            else:  # the bytes on disk before the mark: a marked layer survives a crash
                os.close(os.open(self._marks / str(i), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
                (self._marks / f"{i}.at").unlink(missing_ok=True)

    def close(self) -> None:
        """Flush and record everything handed over, stop the thread. Raises its OSError."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error


def download(target: Target, art: oci.Artifact, staging: Path, workers: int = WORKERS,
             on_blob: Callable[[oci.Part], None] | None = None, resumable: bool = False) -> Downloaded:
    """Download every layer of ``art`` into ``staging`` (an existing private dir with
    ``images/``, ``files/`` and ``carried/``): member files sized to their size, each part
    written at its offset as its digest-checked bytes stream in, in parallel. Raises
    CorruptSnapshotError naming the blob and member that did not match, NotFound for a missing
    blob (the caller discards ``staging``).

    ``resumable`` (a partial dir, :mod:`.partial`): member files already there are reused; a
    layer whose marker ``.parts/INDEX`` exists and whose region hashes to its digest again is
    not downloaded; every layer downloaded now is flushed to disk, then marked. A layer cut
    off half-way records every :data:`PROGRESS_BYTES` how far its flushed bytes reach
    (``.parts/INDEX.at``); the next pull hashes that prefix from disk and fetches only the
    rest (an HTTP range), the digest checked over the whole layer; a prefix that does not
    hold makes that layer be fetched whole once more.

    ``on_blob(part)`` is called (on a worker thread) for each layer downloaded now once its
    bytes matched its digest and are written: nothing writes into that region of its member
    again (each stream writes inside its own region only, and the layers tile each member);
    not for a layer reused from a partial dir. The flushes and those records are made
    by one thread beside the streams (:class:`_Flusher`), never by a stream; every file is
    ``fsync``-ed before this returns, and what that thread had yet to flush and record is
    flushed and recorded before an error or an interruption leaves."""
    from .partial import MARKS

    sizes: dict[str, int] = {}
    for p in art.parts:
        sizes[p.member] = p.file_size
    marks = staging / MARKS
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | (0 if resumable else os.O_EXCL)
    fds: dict[str, int] = {}
    counts = [0, 0, 0, 0]  # fetched, fetched bytes, reused, reused bytes
    lock = threading.Lock()
    try:
        for member, size in sizes.items():
            try:
                fd = os.open(staging / member, flags, 0o600)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.EEXIST):
                    raise
                raise CorruptSnapshotError(
                    f"{staging / member} in the pull's staging directory is not a regular file (a symbolic link or a "
                    "directory: nothing a pull writes); nothing was followed or written through it",
                    hint="pull again: the staging directory is removed and the pull starts afresh",
                    details={"path": str(staging / member)}) from e
            fds[member] = fd
            os.fchmod(fd, 0o600)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
        indexed = list(enumerate(art.parts))
        todo = indexed
        if resumable:
            def reusable(ip: tuple[int, oci.Part]) -> None:
                i, p = ip
                if (marks / str(i)).is_file() and _region_matches(fds[p.member], p.offset, p.size, p.digest):
                    with lock:
                        counts[2] += 1
                        counts[3] += p.size
                    done.add(i)
                else:
                    (marks / str(i)).unlink(missing_ok=True)

            done: set[int] = set()
            _parallel(reusable, indexed, workers)
            todo = [ip for ip in indexed if ip[0] not in done]

        def fetch(i: int, p: oci.Part, start: int) -> None:
            fd = fds[p.member]
            h = oci.hash_region(fd, p.offset, start) if start else None
            if start and h is None:
                start = 0
            at = [p.offset + start, 0]  # where the next byte goes, bytes since the last progress record
            end = p.offset + p.size

            def sink(chunk: bytes) -> None:
                if at[0] + len(chunk) > end:  # never past the layer's region (on_blob's promise)
                    raise CorruptSnapshotError(f"blob {p.digest} ({p.member}) is longer than its {p.size} bytes",
                                               details={"blob": p.digest, "member": p.member})
                os.pwrite(fd, chunk, at[0])
                at[0] += len(chunk)
                at[1] += len(chunk)
                if at[1] >= PROGRESS_BYTES:
                    flusher.progress(fd, i, at[0] - p.offset)
                    at[1] = 0

            try:
                got = target.get_blob(p.digest, p.size, sink, p.member, start=start, h=h)
            except NotFound as e:
                raise CorruptSnapshotError(f"{target.describe()}: blob {p.digest} ({p.member}) is missing",
                                           hint="push the snapshot again", details={"blob": p.digest,
                                                                                    "member": p.member,
                                                                                    "missing": True}) from e
            except CorruptSnapshotError as e:
                with lock:  # bytes that came and did not hold still came
                    counts[1] += int((e.details or {}).get("received") or 0) if isinstance(e.details, dict) else 0
                raise
            wire = got if isinstance(got, int) else p.size - start
            with lock:
                counts[0] += 1
                counts[1] += wire
                counts[3] += start if wire <= p.size - start else 0  # a registry that ignored the range sent it again

        def get(ip: tuple[int, oci.Part]) -> None:
            i, p = ip
            start = _progress(marks, i, p.size) if resumable else 0
            try:
                fetch(i, p, start)
            except CorruptSnapshotError as e:
                details = e.details if isinstance(e.details, dict) else {}
                if not (start or details.get("resumed")) or details.get("missing"):
                    raise
                # the kept prefix, or a resumed stream, did not hold: the whole layer once more
                (marks / f"{i}.at").unlink(missing_ok=True)
                fetch(i, p, 0)
            flusher.verified(fds[p.member], i)  # marked (resumable) once flushed
            if on_blob:
                on_blob(p)

        flusher = _Flusher(marks if resumable else None)
        try:
            _parallel(get, sorted(todo, key=lambda ip: -ip[1].size), workers)
        except BaseException:
            with contextlib.suppress(OSError):  # the first error is the one to tell
                flusher.close()
            raise
        flusher.close()
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return Downloaded(fetched=counts[0], fetched_bytes=counts[1], reused=counts[2], reused_bytes=counts[3])



def download_weights(target: Target, art: oci.Artifact, staging: Path, workers: int = WORKERS,
                     resumable: bool = True) -> Downloaded:
    """Download the weights file's layers of ``art`` into ``staging/BLAKE3.weights`` (the
    final name; ``staging`` an existing private dir with ``.parts/``, :func:`.weights.staging`), each
    layer's sha256 checked as it streams, resumable as :func:`download` (marks and progress in
    ``staging/.parts``). The file's BLAKE3 is the caller's to check. Raises what
    :func:`download` raises."""
    from dataclasses import replace

    as_member = tuple(replace(p, member=Path(p.weights_path).name) for p in art.weights)
    return download(target, replace(art, parts=as_member, weights=()), staging, workers, resumable=resumable)
