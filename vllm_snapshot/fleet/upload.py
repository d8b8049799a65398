"""One blob upload to a registry (:class:`Upload`, used by :meth:`.transport.Registry.put_blob`):
a session ``POST``ed, the blob sent in one ``PUT ?digest=`` or in ``PATCH`` chunks with
``Content-Range`` (configured, or after the registry refused a body as too large: 413), a
broken chunk resumed where the registry says the session is, the session cancelled when given up.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from urllib.parse import urljoin

from ..errors import CorruptSnapshotError, EnvironmentProblem
from .net import CHUNK_ENV, FALLBACK_CHUNK, MIN_CHUNK, RETRY_STATUS, Again, Slice, answer, retry_after, transient


def _range_end(r) -> int | None:
    """The offset an upload session reached, from its ``Range: 0-END`` (END + 1; ``0-0`` is
    read as 0, distribution's answer for an empty session); None without a Range."""
    m = re.fullmatch(r"\s*(?:bytes=)?0-(\d+)\s*", r.headers.get("Range") or "")
    if not m:
        return None
    end = int(m.group(1))
    return end + 1 if end else 0


class Upload:
    """One blob upload to a :class:`Registry`: its session (``loc``, the URL the registry gave
    last), how far the registry took it (``at``), bytes it took in all (``sent``: progress
    for the retry count). :meth:`attempt` is one try of the whole (a retry continues where the
    registry says it is); :meth:`abandon` cancels the session (``DELETE``)."""

    def __init__(self, reg, digest: str, size: int, path: Path, offset: int):
        self.reg, self.digest, self.size, self.path, self.offset = reg, digest, size, path, offset
        self.loc: str | None = None
        self.at = 0
        self.sent = 0
        self.min_len = 0
        self.unsure = False  # the last PATCH broke: ask the registry where the session is
        self.resynced = False  # the session continued after a break (a digest refusal then is ours to retry)
        self.retried_whole = False

    @property
    def chunk(self) -> int:
        return self.reg._chunk or self.reg.net.chunk_bytes

    def start(self) -> None:
        r = self.reg._send("POST", self.reg.base + "blobs/uploads/")
        with contextlib.closing(r):
            if r.status_code in RETRY_STATUS:
                raise Again(f"POST upload: {answer(r)}", retry_after(r))
            if r.status_code != 202 or "Location" not in r.headers:
                raise EnvironmentProblem(f"{self.reg.ref.host} did not start an upload ({answer(r)})")
            self.loc = urljoin(self.reg.base, r.headers["Location"])
            ml = (r.headers.get("OCI-Chunk-Min-Length") or "").strip()
            self.min_len = int(ml) if ml.isdigit() else 0
        self.at, self.unsure, self.resynced = 0, False, False

    def abandon(self) -> None:
        """Cancel the open session, if any (best effort, one short try: it may be gone)."""
        loc, self.loc, self.at = self.loc, None, 0
        if loc is None:
            return
        with contextlib.suppress(Exception):
            r = self.reg._session().delete(loc, timeout=(2.0, 5.0), headers=(
                {"Authorization": f"Bearer {self.reg._token}"} if self.reg._token else None),
                auth=None if self.reg._token else self.reg._basic)
            r.close()

    def attempt(self) -> None:
        if self.loc is None:
            self.start()
        try:
            if self.chunk <= 0:
                self._monolithic()
            else:
                self._chunked()
        except Exception as e:
            if transient(e) and self.chunk <= 0:
                self.abandon()  # a broken PUT: the session's state is unknown, a new one is cheaper
            elif transient(e):
                self.unsure = True
            raise

    def _finished(self, r) -> bool:
        """Whether the final PUT (or the monolithic one) ``r`` completed the blob."""
        if r.status_code in (201, 204):
            self.sent = max(self.sent, self.size)
            self.loc = None
            return True
        if r.status_code == 400 and "DIGEST_INVALID" in r.text:
            if self.resynced and not self.retried_whole:  # our resumed session, not the file: once more whole
                self.retried_whole = True
                self.abandon()
                raise Again("the registry computed another digest for a resumed upload")
            raise CorruptSnapshotError(f"{self.path} changed while it was pushed (the registry computed another digest "
                                       f"than {self.digest})", hint="push again")
        if r.status_code in RETRY_STATUS:
            self.abandon()
            raise Again(f"PUT blob {self.digest}: {answer(r)}", retry_after(r))
        raise EnvironmentProblem(f"{self.reg.ref.host} refused blob {self.digest} ({answer(r)})")

    def _monolithic(self) -> None:
        r = self.reg._send("PUT", self.loc, params={"digest": self.digest},
                           body=lambda: Slice(self.path, self.offset, self.size),
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(self.size)})
        with contextlib.closing(r):
            if r.status_code == 413:  # a body limit (the registry's or a proxy's): chunks from now on
                self.reg._chunk = self.reg._chunk or min(FALLBACK_CHUNK, max(MIN_CHUNK, self.size // 2))
                self.reg._note(f"{self.reg.ref.host} refused a {self.size}-byte body (413): uploads go in PATCH chunks "
                               f"of at most {self.reg._chunk} bytes (set {CHUNK_ENV} to choose the size)")
                self.abandon()
                self.start()
                return self._chunked()
            self._finished(r)

    def _resync(self) -> None:
        """Ask the registry how far the session got after a broken PATCH (``GET`` the session:
        204 with ``Range``); a session it no longer knows (distribution drops one whose PATCH
        broke half-way) is started again from byte 0."""
        r = self.reg._send("GET", self.loc)
        with contextlib.closing(r):
            got = _range_end(r) if r.status_code == 204 else None
            if got is None or got > self.size:
                self.abandon()
                self.start()
                return
            self.loc = urljoin(self.loc, r.headers.get("Location") or self.loc)
            self.at = got
        self.unsure = False
        self.resynced = True

    def _chunked(self) -> None:
        if self.unsure:
            self._resync()
        while self.at < self.size:
            n = min(self.chunk, self.size - self.at)
            if self.min_len and n < self.min_len:
                n = min(self.min_len, self.size - self.at)
            at = self.at
            r = self.reg._send("PATCH", self.loc, body=lambda: Slice(self.path, self.offset + at, n),
                               headers={"Content-Type": "application/octet-stream", "Content-Length": str(n),
                                        "Content-Range": f"{at}-{at + n - 1}"})
            with contextlib.closing(r):
                if r.status_code == 413:
                    smaller = max(MIN_CHUNK, self.min_len, n // 2)
                    if smaller >= n:
                        raise EnvironmentProblem(
                            f"{self.reg.ref.host} refuses even a {n}-byte chunk of blob {self.digest} (413: "
                            f"{answer(r)})", hint="raise the body limit of the registry or of the proxy in "
                                                   "front of it")
                    self.reg._chunk = smaller
                    self.reg._note(f"{self.reg.ref.host} refused a {n}-byte chunk (413): chunks of {smaller} bytes")
                    self.unsure = True  # a refused body may still have been written in part
                    self._resync()
                    continue
                if r.status_code == 416:  # not where the registry is: ask it
                    self.unsure = True
                    raise Again(f"PATCH at byte {at}: 416 {r.headers.get('Range')!r}")
                if r.status_code == 404:  # the session is gone
                    self.abandon()
                    raise Again(f"PATCH at byte {at}: the upload session is gone (404)")
                if r.status_code in RETRY_STATUS:
                    self.unsure = True
                    raise Again(f"PATCH at byte {at}: {answer(r)}", retry_after(r))
                if r.status_code != 202:
                    raise EnvironmentProblem(f"{self.reg.ref.host} refused a chunk of blob {self.digest} "
                                             f"({answer(r)})")
                self.loc = urljoin(self.loc, r.headers.get("Location") or self.loc)
                got = _range_end(r)
                got = at + n if got is None else got
                if not at < got <= at + n:  # it says it holds less than before, or more than sent
                    self.unsure = True
                    raise Again(f"PATCH at byte {at} of {n} bytes: the registry reports {r.headers.get('Range')!r}")
                self.at = got
                self.sent += got - at
        # the final PUT only once the registry holds every byte
        r = self.reg._send("PUT", self.loc, params={"digest": self.digest}, body=b"",
                           headers={"Content-Type": "application/octet-stream", "Content-Length": "0"})
        with contextlib.closing(r):
            if r.status_code == 416:  # the registry does not hold every byte after all: ask it, once more
                self.unsure = True
                raise Again(f"the final PUT of blob {self.digest}: 416 {r.headers.get('Range')!r}")
            self._finished(r)
