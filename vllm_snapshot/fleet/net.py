"""What the transports share: how they meet a real network (:class:`Net`, its settings from the
environment; :func:`transient`, which failures another attempt may not meet; :func:`sleep`,
the backoff wait a stop event cuts short), the words of a failure or of a registry's answer
(:func:`words`, :func:`answer`, :func:`retry_after`), the stop of a thread's transfers
(:data:`STOP`, :func:`check_stop`, :class:`Stopped`), :class:`NotFound`, and the streaming of
a blob's bytes: hashed as they pass (:func:`check_stream`), read from a file's range
(:func:`read_range`, :class:`Slice`).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..errors import CorruptSnapshotError, UsageError

#: bytes per read of a blob download (one buffer per blob, refilled in place: small enough to
#: stay in a core's cache between the socket read, the SHA-256 and the write; measured 128 KiB
#: vs 1 MiB: docs/benchmarks.md, "Fleet: a lighter download"), and the unit of an image
#: layout's reads (4 chunks)
CHUNK = 128 << 10
#: seconds to connect
CONNECT_TIMEOUT = 10.0
MAX_MANIFEST = 4 << 20

#: the environment variables of :class:`Net` (docs/oci-format.md, "Networks")
TRIES_ENV = "VLLM_SNAPSHOT_NET_TRIES"
BACKOFF_ENV = "VLLM_SNAPSHOT_NET_BACKOFF"
TIMEOUT_ENV = "VLLM_SNAPSHOT_NET_TIMEOUT"
CHUNK_ENV = "VLLM_SNAPSHOT_PUSH_CHUNK"
#: the chunk size of an upload that fell back to PATCH chunks after a 413 (body too large),
#: halved on each further 413 down to :data:`MIN_CHUNK`
FALLBACK_CHUNK = 16 << 20
MIN_CHUNK = 64 << 10
#: answers worth another try (a registry restarting, overloaded or rate-limiting)
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def parse_size(text: str) -> int:
    """``"16M"``, ``"16MiB"``, ``"65536"``, ``"64k"`` -> bytes (K/M/G are powers of 1024).
    Raises ValueError."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text or "")
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 16M, 65536)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


@dataclass(frozen=True)
class Net:
    """How the registry client meets a real network. ``tries``: attempts of one request or
    one blob in a row that fail without moving a byte further (a failure after progress starts
    the count again, so a long transfer over a flaky link is bounded by its size, not by a
    count); ``backoff_s``: the wait after the first failure, doubled after each next one (up to
    ``backoff_max_s``, +-25% jitter; a ``Retry-After`` is honoured up to that); ``timeout_s``:
    the read timeout -- a connection that sends nothing for this long is a stall, cut and
    resumed; ``chunk_bytes``: upload in ``PATCH`` chunks of this size (0: one ``PUT`` per blob,
    falling back to chunks when the registry answers 413)."""

    tries: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 15.0
    timeout_s: float = 30.0
    chunk_bytes: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Net":
        """Defaults overridden by ``$VLLM_SNAPSHOT_NET_TRIES`` (>= 1),
        ``$VLLM_SNAPSHOT_NET_BACKOFF`` (seconds >= 0), ``$VLLM_SNAPSHOT_NET_TIMEOUT`` (seconds
        > 0) and ``$VLLM_SNAPSHOT_PUSH_CHUNK`` (a size: ``16M``; 0 for one PUT per blob).
        Raises UsageError naming a bad value."""
        env = os.environ if env is None else env
        kw: dict = {}
        for var, key, conv, ok in ((TRIES_ENV, "tries", int, lambda v: v >= 1),
                                   (BACKOFF_ENV, "backoff_s", float, lambda v: 0 <= v <= 3600),
                                   (TIMEOUT_ENV, "timeout_s", float, lambda v: 0 < v <= 86400),
                                   (CHUNK_ENV, "chunk_bytes", parse_size, lambda v: v == 0 or v >= 1024)):
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            try:
                v = conv(raw)
            except ValueError:
                v = None
            if v is None or not ok(v):
                raise UsageError(f"${var}={raw!r} is not valid",
                                 hint=f"unset it, or see docs/oci-format.md (\"Networks\") for what {var} takes")
            kw[key] = v
        return cls(**kw)


class NotFound(Exception):
    """The registry or layout has no manifest or blob of that name."""


class Stopped(Exception):
    """A blob transfer stopped between two chunks because its stop event was set (another
    transfer failed, or the command was interrupted: :func:`.transfer._parallel`)."""


#: per thread: ``STOP.event`` is the :class:`threading.Event` that stops this thread's blob
#: transfers (set by :func:`.transfer._parallel` on its worker threads; None elsewhere)
STOP = threading.local()


def check_stop() -> None:
    """Raise :class:`Stopped` when this thread's stop event is set (checked once per chunk
    streamed in or out)."""
    ev = getattr(STOP, "event", None)
    if ev is not None and ev.is_set():
        raise Stopped("the transfer was stopped (another one failed, or the command was interrupted)")


DAMAGED_HINT = "the stored artifact is damaged (or was changed): push the snapshot again"


def check_stream(chunks, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                  h=None) -> int:
    """Hash and pass on ``chunks`` (the bytes of blob ``digest`` from ``start``); returns how
    many bytes came. Raises CorruptSnapshotError when they are more than ``size`` or do not end
    at ``size`` hashing to ``digest``."""
    h = h if h is not None else hashlib.sha256()
    n = start
    for chunk in chunks:
        check_stop()
        if not chunk:
            continue
        n += len(chunk)
        if n > size:
            raise CorruptSnapshotError(f"blob {digest} ({what}) is longer than its {size} bytes", hint=DAMAGED_HINT,
                                       details={"blob": digest, "member": what})
        h.update(chunk)
        sink(chunk)
    got = "sha256:" + h.hexdigest()
    if n != size or got != digest:
        raise CorruptSnapshotError(
            f"blob {digest} ({what}) does not match its digest: {n} bytes hashing to {got}",
            hint=DAMAGED_HINT, details={"blob": digest, "member": what, "received": n - start})
    return n - start


def read_range(path: Path, offset: int, size: int):
    """``size`` bytes of ``path`` from ``offset`` (fewer when the file ends first), as
    memoryviews of one buffer of :data:`CHUNK` bytes refilled in place: each chunk is valid
    only until the next is asked for (a sink copies what it keeps). Raises OSError."""
    buf = memoryview(bytearray(CHUNK))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = size
        while left:
            n = f.readinto(buf[:min(CHUNK, left)])
            if not n:
                return
            left -= n
            yield buf[:n]


class Slice:
    """A file-like view of ``size`` bytes of ``path`` from ``offset`` (a request body that
    streams from the file: requests sends it in blocks with a Content-Length)."""

    def __init__(self, path: Path, offset: int, size: int):
        self._f = open(path, "rb", buffering=0)
        self._f.seek(offset)
        self._left = size
        self.len = size

    def read(self, n: int = -1) -> bytes:
        check_stop()
        if self._left <= 0:
            return b""
        n = self._left if n is None or n < 0 else min(n, self._left)
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def __len__(self) -> int:
        return self.len

    def close(self) -> None:
        self._f.close()


# ---------------------------------------------------------------------------- failures worth a retry

class Again(Exception):
    """One attempt failed in a way another may not: a 5xx/429 answer, a body that ended short.
    ``wait``: seconds the registry asked for (``Retry-After``), None when it did not."""

    def __init__(self, words: str, wait: float | None = None):
        super().__init__(words)
        self.wait = wait


def transient(exc: BaseException) -> bool:
    """True for a failure of the network or of the registry's moment that another attempt may
    not meet: ``requests``' connection errors and timeouts (a reset, a refused connection, a
    stall past the read timeout, a body cut short -- ``ChunkedEncodingError``), urllib3's and
    http.client's equivalents, Python's ``ConnectionError``/``TimeoutError``, and a 5xx/429 or
    short body (:class:`Again`). Not a TLS verification failure, not a refusal."""
    import http.client

    import requests
    import urllib3

    if isinstance(exc, requests.exceptions.SSLError) or isinstance(exc, urllib3.exceptions.SSLError):
        return False
    return isinstance(exc, (Again, requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                            requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError,
                            urllib3.exceptions.TimeoutError, urllib3.exceptions.IncompleteRead,
                            http.client.HTTPException, ConnectionError, TimeoutError))


def words(exc: BaseException) -> str:
    """What went wrong, in the registry's or the network stack's words (one line)."""
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def retry_after(r) -> float | None:
    v = (r.headers.get("Retry-After") or "").strip()
    return float(v) if v.isdigit() else None


def answer(r, limit: int = 300) -> str:
    """``STATUS: body`` of a response whose body is small (an error), in one line."""
    try:
        body = r.text[:limit] if r.headers.get("Content-Length", "0").isdigit() and int(
            r.headers.get("Content-Length", "0")) <= 64 << 10 else ""
    except Exception:  # noqa: BLE001 - a body that cannot be read: the status alone
        body = ""
    return f"{r.status_code}" + (f": {' '.join(body.split())}" if body.strip() else "")


GAVE_UP_HINT = (f"check the network and the registry; over a worse link raise {TRIES_ENV} (tries in a row without "
                f"progress) or {TIMEOUT_ENV} (seconds of silence before a connection counts as stalled)")


def sleep(seconds: float) -> None:
    """Sleep ``seconds``, stopping (:class:`Stopped`) when this thread's stop event is set."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        check_stop()
        time.sleep(min(0.05, left))
    check_stop()
