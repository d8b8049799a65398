"""Moving blobs and manifests: a registry over the OCI distribution API (:class:`Registry`),
or an OCI image-layout directory (:class:`Layout`). Both check every blob's sha256 digest as
it streams in (a blob written to a file is written only from bytes already hashed, and the
digest is compared before the caller is told it is complete), and both publish a manifest
only when asked, after every blob it names is in place (manifest last).

The registry client is a thin one on ``requests`` (docs/oci-format.md, "Why not oras-py"):
blob uploads streamed from the file (``POST`` then ``PUT ?digest=``; in ``PATCH`` chunks with
``Content-Range`` when configured or when the registry refuses the body as too large),
``HEAD`` to skip blobs the registry has, ranged parts read from the snapshot's files without
copying. Every request survives what networks do (:class:`Net`): a reset, a stall (the read
timeout), a short body, a 5xx or 429, an expired token -- bounded retries with exponential
backoff, a download continuing from the byte it reached (``Range``), one fresh token shared by
the threads. Credentials come from the docker/podman auth files and credential helpers through
the ``docker`` package's ``docker.auth`` (Docker's maintained SDK): ``$REGISTRY_AUTH_FILE``,
``$XDG_RUNTIME_DIR/containers/auth.json``, ``~/.config/containers/auth.json``,
``$DOCKER_CONFIG/config.json`` / ``~/.docker/config.json``, first that names the host.

Here: the :class:`Target` both are, the :class:`Registry` (its requests, retries, token and
downloads) and :func:`open_target`. The rest lives by job, and every name is offered here too:
:mod:`.net` (the :class:`Net` settings, which failures are worth a retry, the backoff wait, the
stop of a thread's transfers, the hashing of a blob's stream), :mod:`.auth` (credentials and
certificate authorities), :mod:`.layout` (the ``oci:DIR`` image layout) and :mod:`.upload` (one
blob upload's session, monolithic or in chunks).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
import threading
from pathlib import Path
from typing import Callable, Protocol

from ..errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from . import oci
from .auth import AUTH_HINT, CERTS_DIRS, auth_files, ca_bundle, credentials
from .layout import Layout, check_layout_dir, make_private_dirs
from .net import (BACKOFF_ENV, CHUNK, CHUNK_ENV, CONNECT_TIMEOUT, DAMAGED_HINT, FALLBACK_CHUNK, GAVE_UP_HINT,
                  MAX_MANIFEST, MIN_CHUNK, RETRY_STATUS, STOP, TIMEOUT_ENV, TRIES_ENV, Again, Net, NotFound, Slice,
                  Stopped, answer, check_stop, check_stream, parse_size, read_range, retry_after, sleep, transient,
                  words)
from .reference import LayoutRef, RegistryRef
from .upload import Upload

#: what this module offers, its own and those of net, auth, layout and upload it hands on
__all__ = [
    "AUTH_HINT", "BACKOFF_ENV", "CERTS_DIRS", "CHUNK", "CHUNK_ENV", "CONNECT_TIMEOUT", "DAMAGED_HINT",
    "FALLBACK_CHUNK", "GAVE_UP_HINT", "MAX_MANIFEST", "MIN_CHUNK", "RETRY_STATUS", "STOP", "TIMEOUT_ENV",
    "TRIES_ENV", "Again", "Layout", "Net", "NotFound", "Registry", "Slice", "Stopped", "Target", "Upload",
    "answer", "auth_files", "ca_bundle", "check_layout_dir", "check_stop", "check_stream", "credentials",
    "make_private_dirs", "open_target", "parse_size", "read_range", "retry_after", "sleep", "transient", "words",
]


class Target(Protocol):
    """Where artifacts live: one repository of a registry, or one image-layout directory."""

    def describe(self) -> str:
        """The repository or directory in words (for messages)."""

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        """True when the blob ``digest`` (``sha256:HEX``) is already there (an image layout,
        given ``size``, hashes it: a damaged one is not "there")."""

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        """Upload ``size`` bytes of ``path`` from ``offset`` as blob ``digest``. Raises
        EnvironmentProblem (network/registry, after the retries), CorruptSnapshotError (the
        registry refused the digest)."""

    def get_blob(self, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                 h=None) -> int:
        """Stream blob ``digest`` into ``sink`` chunk by chunk, hashing as it goes; raise
        CorruptSnapshotError naming ``what`` and the digest when the bytes do not hash to
        ``digest`` or are not ``size`` long (the sink has then seen bad bytes: the caller
        discards what it wrote). NotFound when absent. ``start`` > 0 (a resumed download):
        only the bytes from ``start`` on are fetched and given to ``sink``; ``h`` is a sha256
        object already fed with the first ``start`` bytes (the caller's copy), and the digest
        checked covers them too. Returns the bytes received (more than ``size - start`` when
        a registry ignored a range or a cut-off transfer was asked again whole)."""

    def put_manifest(self, tag: str, raw: bytes, media_type: str = oci.OCI_MANIFEST) -> str:
        """Publish manifest ``raw`` under ``tag``; returns its digest."""

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """The manifest at tag or digest ``reference`` and its digest (checked against the
        reference when it is a digest). NotFound when absent."""


class Registry:
    """One repository of a registry (OCI distribution API v2). ``plain_http`` uses http://
    (refused for a host that is not loopback); ``net`` how it meets the network (default:
    :meth:`Net.from_env`). Thread-safe: one ``requests.Session`` per thread, one bearer token
    shared (refreshed once when it expires, whichever threads met the 401). :attr:`notes`
    collects what an operator should know about this registry (it ignored ranges, it took only
    small bodies), said once each."""

    def __init__(self, ref: RegistryRef, plain_http: bool = False, net: Net | None = None):
        import requests  # noqa: F401  (imported here: the CLI's other commands never pay for it)

        host = ref.host.split(":")[0].strip("[]") if not ref.host.startswith("[") else ref.host[1:ref.host.index("]")]
        if plain_http and host not in ("localhost", "127.0.0.1", "::1") and not host.startswith("127."):
            raise UsageError(f"--plain-http is for a registry on loopback, not {ref.host}",
                             hint="use the registry's HTTPS endpoint")
        self.ref = ref
        self.net = net if net is not None else Net.from_env()
        self.base = f"{'http' if plain_http else 'https'}://{ref.host}/v2/{ref.repo}/"
        self._verify = True if plain_http else ca_bundle(ref.host)
        self._local = threading.local()
        self._token: str | None = None
        self._auth_gen = 0
        self._basic: tuple[str, str] | None = None
        self._creds_read = False
        self._lock = threading.Lock()
        self._auth_lock = threading.Lock()
        #: False once the registry (or a proxy before it) answered a resume with 416 or a 206 at
        #: another offset: later resumes ask for the whole blob and skip what they hold
        self._ranges = True
        #: an upload chunk size learnt from a 413 (0: none yet)
        self._chunk = 0
        self.notes: list[str] = []
        #: token fetches made (one per expiry, shared by the threads)
        self.token_fetches = 0

    def describe(self) -> str:
        return f"{self.ref.host}/{self.ref.repo}"

    def _note(self, text: str) -> None:
        with self._lock:
            if text not in self.notes:
                self.notes.append(text)

    def _session(self):
        import requests

        s = getattr(self._local, "s", None)
        if s is None:
            s = self._local.s = requests.Session()
            s.trust_env = False  # no proxies from the environment for registry traffic
            s.verify = self._verify  # a private registry's own authority (certs.d, $REQUESTS_CA_BUNDLE)
        return s

    def _creds(self) -> tuple[str, str] | None:
        with self._lock:
            if not self._creds_read:
                self._basic = credentials(self.ref.host)
                self._creds_read = True
            return self._basic

    def _authenticate(self, challenge: str) -> None:
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic":
            if self._creds() is None:
                raise EnvironmentProblem(f"{self.ref.host} asks for a login and no credentials for it were found",
                                         hint=AUTH_HINT)
            return
        if scheme.lower() != "bearer":
            raise EnvironmentProblem(f"{self.ref.host} asks for {scheme!r} authentication, which this tool does not speak")
        kv = dict(re.findall(r'(\w+)="([^"]*)"', params))
        if "realm" not in kv:
            raise EnvironmentProblem(f"{self.ref.host}: a bearer challenge without a realm: {challenge!r}")
        q = {k: v for k, v in kv.items() if k in ("service", "scope")}
        q.setdefault("scope", f"repository:{self.ref.repo}:pull,push")
        self.token_fetches += 1
        r = self._session().get(kv["realm"], params=q, auth=self._creds(),
                                timeout=(CONNECT_TIMEOUT, self.net.timeout_s))
        if r.status_code in RETRY_STATUS:
            raise Again(f"the token service {kv['realm']} answered {answer(r)}", retry_after(r))
        if r.status_code != 200:
            raise EnvironmentProblem(f"{self.ref.host}: the token service {kv['realm']} answered {r.status_code}",
                                     hint=AUTH_HINT)
        body = r.json()
        self._token = body.get("token") or body.get("access_token")

    def _refresh(self, used: int, challenge: str) -> None:
        """A request sent with credentials generation ``used`` met a 401: fetch a fresh token,
        unless another thread did since (then that one is used: one fetch per expiry)."""
        with self._auth_lock:
            if self._auth_gen != used:
                return
            self._authenticate(challenge)
            self._auth_gen += 1

    def _send(self, method: str, url: str, body=None, headers: dict | None = None, **kw):
        """One request; on a 401 with a challenge, fresh credentials (:meth:`_refresh`) and the
        request once more, its body made again (``body`` may be a callable making it: an upload
        re-sent from its file). Raises what ``requests`` raises (the caller's retry loop sorts
        it: :func:`transient`), EnvironmentProblem for a refusal (401 again, 403)."""
        for attempt in range(2):
            hdrs = dict(headers or {})
            auth = None
            used = self._auth_gen
            if self._token:
                hdrs["Authorization"] = f"Bearer {self._token}"
            elif self._basic is not None:
                auth = self._basic
            data = body() if callable(body) else body
            try:
                r = self._session().request(method, url, headers=hdrs, auth=auth, data=data,
                                            timeout=(CONNECT_TIMEOUT, self.net.timeout_s), **kw)
            finally:
                if callable(body) and hasattr(data, "close"):
                    data.close()
            if r.status_code == 401 and attempt == 0 and "WWW-Authenticate" in r.headers:
                r.close()
                self._refresh(used, r.headers["WWW-Authenticate"])
                continue
            if r.status_code in (401, 403):
                r.close()
                raise EnvironmentProblem(f"{self.ref.host} refused access to {self.ref.repo} ({r.status_code})",
                                         hint=AUTH_HINT)
            return r
        return r

    def _retrying(self, what: str, fn, progress: Callable[[], int] = lambda: 0):
        """``fn()``, again after a backoff while it fails :func:`transient`-ly, at most
        ``net.tries`` times in a row without ``progress()`` moving; then EnvironmentProblem
        ``what: gave up after N tries: <the registry's / network's words>``."""
        from ..host import interrupts

        fails, last = 0, progress()
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - sorted right below
                if not transient(e):
                    tls = self._tls_refusal(e)
                    if tls is not None:
                        raise tls from e
                    raise
                fired = interrupts.fired()
                if fired is not None:  # a signal a C extension turned into a network error
                    raise fired from e
                now = progress()
                fails = 1 if now != last else fails + 1
                last = now
                if fails >= self.net.tries:
                    raise EnvironmentProblem(f"{what}: gave up after {fails} tries in a row: {words(e)}",
                                             hint=GAVE_UP_HINT, details={"registry": self.ref.host,
                                                                         "error": words(e)}) from e
                wait = min(self.net.backoff_max_s, self.net.backoff_s * 2 ** (fails - 1)) * random.uniform(0.75, 1.25)
                if getattr(e, "wait", None) is not None:
                    wait = min(self.net.backoff_max_s, max(wait, e.wait))
                sleep(wait)

    def _tls_refusal(self, e: BaseException) -> EnvironmentProblem | None:
        """The refusal (exit 11) for a TLS failure ``e`` -- the registry's certificate is not
        signed by an authority trusted here (a private registry's own) -- naming where this client
        looks for one; None for any other error."""
        import requests
        import urllib3

        if not isinstance(e, (requests.exceptions.SSLError, urllib3.exceptions.SSLError)):
            return None
        d = " or ".join(f"{c}/{self.ref.host}/ca.crt" for c in CERTS_DIRS)
        return EnvironmentProblem(
            f"the TLS connection to {self.ref.host} failed: {words(e)}",
            hint=f"if the registry's certificate comes from your own authority, put that authority's PEM at {d}, "
                 "or name it in REQUESTS_CA_BUNDLE (as podman, skopeo and docker do)",
            details={"registry": self.ref.host, "trusted": self._verify if isinstance(self._verify, str) else "public"})

    def _unreachable(self) -> str:
        return f"cannot reach the registry {self.ref.host}"

    # -- blobs ---------------------------------------------------------------------------------

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        def attempt() -> bool:
            r = self._send("HEAD", self.base + f"blobs/{digest}")
            r.close()
            if r.status_code in RETRY_STATUS:
                raise Again(f"HEAD blob {digest}: {r.status_code}", retry_after(r))
            return r.status_code == 200

        return self._retrying(f"{self._unreachable()} (HEAD blob {digest})", attempt)

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        up = Upload(self, digest, size, Path(path), offset)
        try:
            self._retrying(f"cannot upload blob {digest} ({path}) to {self.ref.host}", up.attempt,
                           progress=lambda: up.sent)
        except BaseException:
            up.abandon()  # an upload session left open holds storage on the registry until it expires
            raise

    def get_blob(self, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                 h=None) -> int:
        """See :meth:`Target.get_blob`. A connection that breaks, stalls or ends short is asked
        again from the byte reached (``Range``), the bytes so far kept in the hash; a registry
        that answers such a resume with 416 or a 206 at another offset is asked for the whole
        blob from then on (what is held is skipped); one that ignores Range (200) too. Returns
        the bytes received (skipped ones included)."""
        h = h if h is not None else hashlib.sha256()
        st = {"n": start, "wire": 0, "resumed": bool(start)}
        url = self.base + f"blobs/{digest}"

        def attempt() -> None:
            n = st["n"]
            ranged = n > 0 and self._ranges
            r = self._send("GET", url, stream=True, headers={"Range": f"bytes={n}-"} if ranged else None)
            try:
                if r.status_code == 404:
                    raise NotFound(f"blob {digest} ({what}) is not in {self.describe()}")
                if r.status_code in RETRY_STATUS:
                    raise Again(f"GET blob {digest}: {r.status_code}", retry_after(r))
                skip = 0
                if ranged and r.status_code == 206:
                    cr = r.headers.get("Content-Range", "")
                    if not cr.startswith(f"bytes {n}-"):
                        self._no_ranges(f"answered a resume at byte {n} with {cr!r}")
                        raise Again("a 206 at another offset")
                    total = cr.rpartition("/")[2]
                    if total.isdigit() and int(total) != size:
                        raise self._wrong_size(digest, what, int(total), size)
                elif ranged and r.status_code == 416:
                    total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
                    if total.isdigit() and int(total) < size:
                        raise self._wrong_size(digest, what, int(total), size)
                    self._no_ranges(f"answered a resume at byte {n} with 416")
                    raise Again("416 to a resume")
                elif r.status_code == 200:
                    cl = r.headers.get("Content-Length", "")
                    if cl.isdigit() and int(cl) != size:
                        raise self._wrong_size(digest, what, int(cl), size)
                    if n:
                        skip = n
                        if ranged:
                            self._note(f"{self.ref.host} ignores HTTP ranges (answered a resume with the whole blob): "
                                       "a layer cut off half-way was downloaded whole again")
                else:
                    raise EnvironmentProblem(f"{self.ref.host} answered {answer(r)} for blob {digest} ({what})")
                if n > start:
                    st["resumed"] = True
                for chunk in _body(r):
                    check_stop()
                    if not chunk:
                        continue
                    st["wire"] += len(chunk)
                    if skip:
                        if skip >= len(chunk):
                            skip -= len(chunk)
                            continue
                        chunk, skip = chunk[skip:], 0
                    if st["n"] + len(chunk) > size:
                        raise CorruptSnapshotError(f"blob {digest} ({what}) is longer than its {size} bytes",
                                                   hint=DAMAGED_HINT, details={"blob": digest, "member": what})
                    h.update(chunk)
                    sink(chunk)
                    st["n"] += len(chunk)
                if st["n"] < size:
                    raise Again(f"the body of blob {digest} ended after {st['n']} of its {size} bytes")
            finally:
                r.close()

        self._retrying(f"cannot download blob {digest} ({what}) from {self.ref.host}", attempt,
                       progress=lambda: st["n"])
        got = "sha256:" + h.hexdigest()
        if got != digest:
            raise CorruptSnapshotError(
                f"blob {digest} ({what}) does not match its digest: {size} bytes hashing to {got}",
                hint=DAMAGED_HINT, details={"blob": digest, "member": what, "resumed": st["resumed"],
                                            "received": st["wire"]})
        return st["wire"]

    def _no_ranges(self, how: str) -> None:
        self._ranges = False
        self._note(f"{self.ref.host} {how}: it (or a proxy in front of it) does not honour HTTP ranges, so a "
                   "download cut off half-way is fetched whole again (what was held is skipped, the digest checked "
                   "over all of it)")

    def _wrong_size(self, digest: str, what: str, has: int, size: int) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"blob {digest} ({what}) is {has} bytes on {self.ref.host}, not the {size} its "
                                    "manifest says", hint=DAMAGED_HINT, details={"blob": digest, "member": what})

    # -- manifests -----------------------------------------------------------------------------

    def put_manifest(self, tag: str, raw: bytes, media_type: str = oci.OCI_MANIFEST) -> str:
        def attempt() -> None:
            r = self._send("PUT", self.base + f"manifests/{tag}", body=raw, headers={"Content-Type": media_type})
            with contextlib.closing(r):
                if r.status_code in RETRY_STATUS:
                    raise Again(f"PUT manifest {tag}: {answer(r)}", retry_after(r))
                if r.status_code not in (201, 204):
                    raise EnvironmentProblem(f"{self.ref.host} refused the manifest for tag {tag} ({answer(r)})")

        self._retrying(f"cannot push the manifest for tag {tag} to {self.ref.host}", attempt)
        return oci.sha256(raw)

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        def attempt() -> bytes:
            r = self._send("GET", self.base + f"manifests/{reference}", headers={"Accept": oci.OCI_MANIFEST},
                           stream=True)
            with contextlib.closing(r):
                if r.status_code == 404:
                    raise NotFound(f"{self.describe()} has no manifest {reference!r}")
                if r.status_code in RETRY_STATUS:
                    raise Again(f"GET manifest {reference}: {r.status_code}", retry_after(r))
                if r.status_code != 200:
                    raise EnvironmentProblem(f"{self.ref.host} answered {answer(r)} for manifest {reference}")
                raw = r.raw.read(MAX_MANIFEST + 1, decode_content=True)
                cl = r.headers.get("Content-Length", "")
                if cl.isdigit() and len(raw) < int(cl) <= MAX_MANIFEST:
                    raise Again(f"the manifest {reference} ended after {len(raw)} of its {cl} bytes")
                return raw

        what = f"{self._unreachable()}" + ("" if self.base.startswith("http:") else
                                          " (for a loopback test registry pass --plain-http)")
        raw = self._retrying(f"{what}: manifest {reference}", attempt)
        if len(raw) > MAX_MANIFEST:
            raise CorruptSnapshotError(f"{self.describe()}: manifest {reference} is larger than {MAX_MANIFEST} bytes")
        digest = oci.sha256(raw)
        if reference.startswith("sha256:") and digest != reference:
            raise CorruptSnapshotError(f"{self.describe()}: manifest {reference} does not match its digest ({digest})")
        return raw, digest


def _body(r):
    """The body of the streamed response ``r`` as chunks of at most :data:`CHUNK` bytes. Where
    the connection's own response (http.client's, under urllib3) can fill a buffer in place and
    the body has no Content-Encoding: memoryviews of **one** buffer refilled by its ``readinto``
    -- each chunk valid only until the next is asked for (a sink copies what it keeps) -- so a
    blob's bytes are copied once from the socket and then hashed and written from a buffer that
    stays in the CPU's cache, with no allocation per chunk (measured: docs/benchmarks.md, "Fleet:
    a lighter download"); a body read to its end hands the connection back for the next request.
    Otherwise ``requests``' ``iter_content``. Raises what the connection raises (a timeout, a
    reset, http.client's IncompleteRead: :func:`.net.transient`)."""
    fp = getattr(r.raw, "_fp", None)
    encoding = (r.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity" or not all(callable(getattr(fp, a, None)) for a in ("readinto", "isclosed")):
        yield from r.iter_content(CHUNK)
        return
    buf = memoryview(bytearray(CHUNK))
    while n := fp.readinto(buf):
        yield buf[:n]
    # the whole body came over a connection that stays open (not one cut short, not one the
    # server closes after this answer): hand it back for the next request
    if fp.isclosed() and not getattr(fp, "length", None) and not getattr(fp, "will_close", True):
        r.raw.release_conn()


def open_target(ref, plain_http: bool = False, create: bool = False) -> Target:
    """The :class:`Target` of a parsed reference (a Layout is created when ``create``)."""
    if isinstance(ref, LayoutRef):
        return Layout(ref.path, create=create)
    return Registry(ref, plain_http)
