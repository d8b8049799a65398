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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol
from urllib.parse import urljoin

from ..errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from . import oci
from .reference import LayoutRef, RegistryRef

CHUNK = 1 << 20
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


DAMAGED_HINT = "the stored artifact is damaged (or was changed): push the snapshot again"


def _check_stream(chunks, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
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


def _sha256_file(p: Path) -> str | None:
    """``sha256:HEX`` of file ``p`` (None when it cannot be read)."""
    h = hashlib.sha256()
    try:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK * 4):
                h.update(chunk)
    except OSError:
        return None
    return "sha256:" + h.hexdigest()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dirs(path: Path) -> None:
    """Create directory ``path`` and every missing parent 0700 (``Path.mkdir(parents=True)``
    makes the parents with the umask's mode, not the one asked for)."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


# ---------------------------------------------------------------------------- image layout

class Layout:
    """An OCI image-layout directory (``oci-layout``, ``index.json``, ``blobs/sha256/``):
    blobs written to a temp name, flushed and renamed once their digest checked; ``index.json``
    read, changed and written (temp + fsync + rename) under an exclusive ``flock`` of the
    layout directory, so pushes from several processes into one layout each add their tags.
    Files 0600, dirs 0700, missing parents too (a snapshot holds process memory).

    ``create``: the directory may be absent, empty, or a layout already; it is checked here
    and written only on the first blob or manifest (so a push refused later, e.g. by a snapshot
    checksum, writes nothing). Raises UsageError, naming the path and what to do, for a path
    that is a file, or an existing non-empty directory that is not a layout (no ``oci-layout``
    file); without ``create`` also for an absent directory or one that is not a layout.

    :meth:`has_blob` with a size hashes the blob it finds: one that does not match its digest
    (damaged at rest) is reported absent, so a push writes it again (replaced by rename), and
    its digest is listed in :attr:`repaired`."""

    def __init__(self, path: Path, create: bool = False):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._ready = False
        #: digests of damaged blobs :meth:`has_blob` found (a push then replaces them)
        self.repaired: list[str] = []
        if self.path.is_dir():
            with self._locked():  # not half-way through another process's making of it
                check_layout_dir(self.path, create)
        else:
            check_layout_dir(self.path, create)
        self._ready = (self.path / "oci-layout").is_file()

    @contextlib.contextmanager
    def _locked(self):
        """This thread holds the layout's lock (a ``flock`` of its directory: other processes
        too) inside the block."""
        with self._lock:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _ensure(self) -> None:
        """Create the layout (dir 0700 and missing parents 0700, ``oci-layout``, an empty
        ``index.json``) if it is not one yet, under the layout's lock (a second process creating
        it at once never overwrites an index the first already tagged in). Raises
        EnvironmentProblem when the directory cannot be written."""
        if self._ready:
            return
        try:
            with self._lock:
                if self._ready:
                    return
                if not os.path.lexists(self.path):
                    check_layout_dir(self.path, True)  # again: it may have changed since the check
                    make_private_dirs(self.path)
            with self._locked():
                if self._ready:
                    return
                check_layout_dir(self.path, True)  # under the lock: another process's half-made layout is not seen
                (self.path / "blobs" / "sha256").mkdir(mode=0o700, parents=True, exist_ok=True)
                for d in (self.path / "blobs", self.path / "blobs" / "sha256"):
                    os.chmod(d, 0o700)
                if not (self.path / "index.json").exists():
                    self._write(self.path / "index.json", json.dumps(
                        {"schemaVersion": 2, "mediaType": oci.OCI_INDEX, "manifests": []}).encode())
                if not (self.path / "oci-layout").exists():
                    self._write(self.path / "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
                self._ready = True
        except OSError as e:
            raise EnvironmentProblem(f"cannot create the OCI image layout {self.path}: {e.strerror or e}",
                                     hint="name a directory this user can write (oci:DIR)") from e

    def describe(self) -> str:
        return f"oci:{self.path}"

    @staticmethod
    def _write(p: Path, data: bytes) -> None:
        """Replace file ``p`` by ``data``: a temp file, fsynced, renamed over it, the dir fsynced."""
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, p)
        _fsync_dir(p.parent)

    def _blob(self, digest: str) -> Path:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise CorruptSnapshotError(f"{digest!r} is not a sha256 digest")
        return self.path / "blobs" / "sha256" / digest.split(":", 1)[1]

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        """True when the layout holds blob ``digest``; with ``size``, only when it is a file of
        that size whose bytes hash to ``digest`` (else it is damaged: listed in
        :attr:`repaired`, and False)."""
        p = self._blob(digest)
        if size is None:
            return p.is_file()
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return False
        import stat as _stat

        if _stat.S_ISREG(st.st_mode) and st.st_size == size and _sha256_file(p) == digest:
            return True
        with self._lock:
            self.repaired.append(digest)
        return False

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        self._ensure()
        dst = self._blob(digest)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                _check_stream(_read_range(path, offset, size), digest, size, out.write, str(path))
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, dst)  # over a damaged one too: replaced, never written into
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get_blob(self, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                 h=None) -> int:
        p = self._blob(digest)
        if not p.is_file():
            raise NotFound(f"blob {digest} is not in {self.describe()}")
        return _check_stream(_read_range(p, start, max(0, p.stat().st_size - start)), digest, size, sink, what,
                             start, h)

    def _index(self) -> dict:
        try:
            idx = json.loads((self.path / "index.json").read_bytes())
        except (OSError, ValueError) as e:
            raise CorruptSnapshotError(f"{self.path}/index.json is not readable JSON: {e}") from e
        if not isinstance(idx, dict) or not isinstance(idx.get("manifests"), list):
            raise CorruptSnapshotError(f"{self.path}/index.json is not an OCI image index")
        return idx

    def put_manifest(self, tag: str, raw: bytes, media_type: str = oci.OCI_MANIFEST) -> str:
        self._ensure()
        digest = oci.sha256(raw)
        p = self._blob(digest)
        if not (p.is_file() and _sha256_file(p) == digest):
            self._write(p, raw)
        doc = json.loads(raw)
        desc = {"mediaType": media_type, "digest": digest, "size": len(raw),
                "annotations": {"org.opencontainers.image.ref.name": tag}}
        if doc.get("artifactType"):
            desc["artifactType"] = doc["artifactType"]
        with self._locked():  # read, change, write: no other process's tag lost in between
            idx = self._index()
            idx["manifests"] = [d for d in idx["manifests"]
                                if (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") != tag] + [desc]
            self._write(self.path / "index.json", json.dumps(idx, indent=1).encode())
        return digest

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        if reference.startswith("sha256:"):
            digest = reference
        else:
            hits = [d for d in self._index()["manifests"]
                    if (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") == reference]
            if not hits:
                raise NotFound(f"{self.describe()} has no tag {reference!r}")
            digest = hits[-1]["digest"]
        p = self._blob(digest)
        if not p.is_file():
            raise NotFound(f"manifest {digest} is not in {self.describe()}")
        raw = p.read_bytes()[:MAX_MANIFEST + 1]
        if oci.sha256(raw) != digest:
            raise CorruptSnapshotError(f"{self.describe()}: manifest {digest} does not match its digest",
                                       hint=DAMAGED_HINT, details={"blob": digest, "member": "the manifest"})
        return raw, digest


def check_layout_dir(path: Path, create: bool) -> None:
    """Refuse ``path`` as an image layout (UsageError, naming it and what to do): a file or
    anything not a directory; a directory that is not a layout (no ``oci-layout`` file), unless
    ``create`` and it is empty; an absent one unless ``create`` (then its nearest existing
    ancestor must be a directory). Reads only."""
    p = Path(path)
    usage = "name a new or empty directory, or an image layout `vllm-snapshot push` wrote (oci:DIR[:TAG])" \
        if create else "name a directory written by `vllm-snapshot push SNAPSHOT oci:DIR`"
    if p.exists() and not p.is_dir():
        raise UsageError(f"{p} is a file, not a directory (an OCI image layout is a directory)", hint=usage)
    if not p.exists():
        if not create:
            raise UsageError(f"{p} does not exist (no OCI image layout there)", hint=usage)
        up = p.parent
        while not up.exists() and up != up.parent:
            up = up.parent
        if not up.is_dir():
            raise UsageError(f"{up} is a file, not a directory, so the OCI image layout {p} cannot be made "
                             "beneath it", hint=usage)
        return
    if (p / "oci-layout").is_file():
        return
    try:
        entries = sorted(os.listdir(p))
    except OSError as e:
        raise UsageError(f"{p} cannot be read ({e.strerror or e})", hint=usage) from e
    if not create:
        raise UsageError(f"{p} is not an OCI image layout (no oci-layout file)", hint=usage)
    if entries:
        shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
        raise UsageError(f"{p} is not empty ({shown}) and not an OCI image layout (no oci-layout file); nothing "
                         "was written there", hint="push into a new or empty directory, or one a push wrote "
                                                   "(oci:DIR[:TAG]); nothing in that directory was changed")


def _read_range(path: Path, offset: int, size: int):
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = size
        while left:
            chunk = f.read(min(CHUNK * 4, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


class _Slice:
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

class _Again(Exception):
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
    short body (:class:`_Again`). Not a TLS verification failure, not a refusal."""
    import http.client

    import requests
    import urllib3

    if isinstance(exc, requests.exceptions.SSLError) or isinstance(exc, urllib3.exceptions.SSLError):
        return False
    return isinstance(exc, (_Again, requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                            requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError,
                            urllib3.exceptions.TimeoutError, urllib3.exceptions.IncompleteRead,
                            http.client.HTTPException, ConnectionError, TimeoutError))


def _words(exc: BaseException) -> str:
    """What went wrong, in the registry's or the network stack's words (one line)."""
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def _retry_after(r) -> float | None:
    v = (r.headers.get("Retry-After") or "").strip()
    return float(v) if v.isdigit() else None


def _answer(r, limit: int = 300) -> str:
    """``STATUS: body`` of a response whose body is small (an error), in one line."""
    try:
        body = r.text[:limit] if r.headers.get("Content-Length", "0").isdigit() and int(
            r.headers.get("Content-Length", "0")) <= 64 << 10 else ""
    except Exception:  # noqa: BLE001 - a body that cannot be read: the status alone
        body = ""
    return f"{r.status_code}" + (f": {' '.join(body.split())}" if body.strip() else "")


# ---------------------------------------------------------------------------- registry

AUTH_HINT = ("log in with `podman login HOST` or `docker login HOST` (or set REGISTRY_AUTH_FILE to an auth file); "
             "--plain-http only for a registry on loopback")
GAVE_UP_HINT = (f"check the network and the registry; over a worse link raise {TRIES_ENV} (tries in a row without "
                f"progress) or {TIMEOUT_ENV} (seconds of silence before a connection counts as stalled)")


def auth_files() -> list[Path]:
    """The auth files looked at, in order (podman's, then docker's)."""
    out = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        out.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        out.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    home = Path(os.path.expanduser("~"))
    out.append(home / ".config" / "containers" / "auth.json")
    out.append(Path(os.environ.get("DOCKER_CONFIG", home / ".docker")) / "config.json")
    return out


#: Where podman/skopeo (containers-certs.d(5)) and docker look for a registry's own certificate
#: authorities: ``DIR/HOST[:PORT]/*.crt``.
CERTS_DIRS = (Path("/etc/containers/certs.d"), Path("/etc/docker/certs.d"))
_BUNDLES: dict[str, str] = {}
_BUNDLES_LOCK = threading.Lock()


def ca_bundle(host: str, certs_dirs: tuple[Path, ...] = CERTS_DIRS, environ=None) -> str | bool:
    """What to trust for ``host`` (``name[:port]``) over HTTPS, as ``requests``' ``verify``: the
    ``*.crt`` files of ``certs_dirs/HOST`` (podman's, skopeo's and docker's per-registry
    authorities; several are joined into one private bundle file, 0600, removed at exit), else
    ``$REQUESTS_CA_BUNDLE`` / ``$SSL_CERT_FILE`` (read on purpose: the sessions ignore the
    environment so that no proxy variable redirects registry traffic), else True (the public
    authorities certifi ships). Raises EnvironmentProblem naming a named file that does not exist."""
    env = os.environ if environ is None else environ
    for d in certs_dirs:
        reg = d / host
        try:
            crts = sorted(p for p in reg.iterdir() if p.suffix == ".crt" and p.is_file())
        except OSError:
            continue
        if len(crts) == 1:
            return str(crts[0])
        if crts:
            key = "\0".join(map(str, crts))
            with _BUNDLES_LOCK:
                if key not in _BUNDLES:
                    import atexit
                    import tempfile

                    fd, path = tempfile.mkstemp(prefix="vllm-snapshot-ca-", suffix=".pem")
                    with os.fdopen(fd, "wb") as f:  # mkstemp: 0600
                        for c in crts:
                            f.write(c.read_bytes().rstrip(b"\n") + b"\n")
                    atexit.register(lambda q=path: os.path.exists(q) and os.unlink(q))
                    _BUNDLES[key] = path
                return _BUNDLES[key]
    for var in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        named = env.get(var)
        if named:
            if not os.path.exists(named):
                raise EnvironmentProblem(f"${var} names {named}, which does not exist",
                                         hint=f"point {var} at the PEM file of your registry's certificate authority, "
                                              "or unset it")
            return named
    return True


def credentials(host: str) -> tuple[str, str] | None:
    """``(username, password)`` for ``host`` from the first auth file that has an entry for
    it (credential helpers and stores included, through ``docker.auth``), or None."""
    from docker import auth as dauth

    for f in auth_files():
        if not f.is_file():
            continue
        try:
            cfg = dauth.load_config(config_path=str(f))
            found = dauth.resolve_authconfig(cfg, registry=host)
        except Exception as e:  # noqa: BLE001 - a helper that fails: say which file
            raise EnvironmentProblem(f"cannot read the credentials for {host} from {f}: {e}", hint=AUTH_HINT) from e
        if found:
            user = found.get("username") or found.get("Username") or ""
            pw = found.get("password") or found.get("Password") or found.get("IdentityToken") or ""
            if user or pw:
                return user, pw
    return None


def _sleep(seconds: float) -> None:
    """Sleep ``seconds``, stopping (:class:`Stopped`) when this thread's stop event is set."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        check_stop()
        time.sleep(min(0.05, left))
    check_stop()


def _range_end(r) -> int | None:
    """The offset an upload session reached, from its ``Range: 0-END`` (END + 1; ``0-0`` is
    read as 0, distribution's answer for an empty session); None without a Range."""
    m = re.fullmatch(r"\s*(?:bytes=)?0-(\d+)\s*", r.headers.get("Range") or "")
    if not m:
        return None
    end = int(m.group(1))
    return end + 1 if end else 0


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
            raise _Again(f"the token service {kv['realm']} answered {_answer(r)}", _retry_after(r))
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
                    raise EnvironmentProblem(f"{what}: gave up after {fails} tries in a row: {_words(e)}",
                                             hint=GAVE_UP_HINT, details={"registry": self.ref.host,
                                                                         "error": _words(e)}) from e
                wait = min(self.net.backoff_max_s, self.net.backoff_s * 2 ** (fails - 1)) * random.uniform(0.75, 1.25)
                if getattr(e, "wait", None) is not None:
                    wait = min(self.net.backoff_max_s, max(wait, e.wait))
                _sleep(wait)

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
            f"the TLS connection to {self.ref.host} failed: {_words(e)}",
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
                raise _Again(f"HEAD blob {digest}: {r.status_code}", _retry_after(r))
            return r.status_code == 200

        return self._retrying(f"{self._unreachable()} (HEAD blob {digest})", attempt)

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        up = _Upload(self, digest, size, Path(path), offset)
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
                    raise _Again(f"GET blob {digest}: {r.status_code}", _retry_after(r))
                skip = 0
                if ranged and r.status_code == 206:
                    cr = r.headers.get("Content-Range", "")
                    if not cr.startswith(f"bytes {n}-"):
                        self._no_ranges(f"answered a resume at byte {n} with {cr!r}")
                        raise _Again("a 206 at another offset")
                    total = cr.rpartition("/")[2]
                    if total.isdigit() and int(total) != size:
                        raise self._wrong_size(digest, what, int(total), size)
                elif ranged and r.status_code == 416:
                    total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
                    if total.isdigit() and int(total) < size:
                        raise self._wrong_size(digest, what, int(total), size)
                    self._no_ranges(f"answered a resume at byte {n} with 416")
                    raise _Again("416 to a resume")
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
                    raise EnvironmentProblem(f"{self.ref.host} answered {_answer(r)} for blob {digest} ({what})")
                if n > start:
                    st["resumed"] = True
                for chunk in r.iter_content(CHUNK):
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
                    raise _Again(f"the body of blob {digest} ended after {st['n']} of its {size} bytes")
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
                    raise _Again(f"PUT manifest {tag}: {_answer(r)}", _retry_after(r))
                if r.status_code not in (201, 204):
                    raise EnvironmentProblem(f"{self.ref.host} refused the manifest for tag {tag} ({_answer(r)})")

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
                    raise _Again(f"GET manifest {reference}: {r.status_code}", _retry_after(r))
                if r.status_code != 200:
                    raise EnvironmentProblem(f"{self.ref.host} answered {_answer(r)} for manifest {reference}")
                raw = r.raw.read(MAX_MANIFEST + 1, decode_content=True)
                cl = r.headers.get("Content-Length", "")
                if cl.isdigit() and len(raw) < int(cl) <= MAX_MANIFEST:
                    raise _Again(f"the manifest {reference} ended after {len(raw)} of its {cl} bytes")
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


class _Upload:
    """One blob upload to a :class:`Registry`: its session (``loc``, the URL the registry gave
    last), how far the registry took it (``at``), bytes it took in all (``sent``: progress
    for the retry count). :meth:`attempt` is one try of the whole (a retry continues where the
    registry says it is); :meth:`abandon` cancels the session (``DELETE``)."""

    def __init__(self, reg: Registry, digest: str, size: int, path: Path, offset: int):
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
                raise _Again(f"POST upload: {_answer(r)}", _retry_after(r))
            if r.status_code != 202 or "Location" not in r.headers:
                raise EnvironmentProblem(f"{self.reg.ref.host} did not start an upload ({_answer(r)})")
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
                raise _Again("the registry computed another digest for a resumed upload")
            raise CorruptSnapshotError(f"{self.path} changed while it was pushed (the registry computed another digest "
                                       f"than {self.digest})", hint="push again")
        if r.status_code in RETRY_STATUS:
            self.abandon()
            raise _Again(f"PUT blob {self.digest}: {_answer(r)}", _retry_after(r))
        raise EnvironmentProblem(f"{self.reg.ref.host} refused blob {self.digest} ({_answer(r)})")

    def _monolithic(self) -> None:
        r = self.reg._send("PUT", self.loc, params={"digest": self.digest},
                           body=lambda: _Slice(self.path, self.offset, self.size),
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
            r = self.reg._send("PATCH", self.loc, body=lambda: _Slice(self.path, self.offset + at, n),
                               headers={"Content-Type": "application/octet-stream", "Content-Length": str(n),
                                        "Content-Range": f"{at}-{at + n - 1}"})
            with contextlib.closing(r):
                if r.status_code == 413:
                    smaller = max(MIN_CHUNK, self.min_len, n // 2)
                    if smaller >= n:
                        raise EnvironmentProblem(
                            f"{self.reg.ref.host} refuses even a {n}-byte chunk of blob {self.digest} (413: "
                            f"{_answer(r)})", hint="raise the body limit of the registry or of the proxy in "
                                                   "front of it")
                    self.reg._chunk = smaller
                    self.reg._note(f"{self.reg.ref.host} refused a {n}-byte chunk (413): chunks of {smaller} bytes")
                    self.unsure = True  # a refused body may still have been written in part
                    self._resync()
                    continue
                if r.status_code == 416:  # not where the registry is: ask it
                    self.unsure = True
                    raise _Again(f"PATCH at byte {at}: 416 {r.headers.get('Range')!r}")
                if r.status_code == 404:  # the session is gone
                    self.abandon()
                    raise _Again(f"PATCH at byte {at}: the upload session is gone (404)")
                if r.status_code in RETRY_STATUS:
                    self.unsure = True
                    raise _Again(f"PATCH at byte {at}: {_answer(r)}", _retry_after(r))
                if r.status_code != 202:
                    raise EnvironmentProblem(f"{self.reg.ref.host} refused a chunk of blob {self.digest} "
                                             f"({_answer(r)})")
                self.loc = urljoin(self.loc, r.headers.get("Location") or self.loc)
                got = _range_end(r)
                got = at + n if got is None else got
                if not at < got <= at + n:  # it says it holds less than before, or more than sent
                    self.unsure = True
                    raise _Again(f"PATCH at byte {at} of {n} bytes: the registry reports {r.headers.get('Range')!r}")
                self.at = got
                self.sent += got - at
        # the final PUT only once the registry holds every byte
        r = self.reg._send("PUT", self.loc, params={"digest": self.digest}, body=b"",
                           headers={"Content-Type": "application/octet-stream", "Content-Length": "0"})
        with contextlib.closing(r):
            if r.status_code == 416:  # the registry does not hold every byte after all: ask it, once more
                self.unsure = True
                raise _Again(f"the final PUT of blob {self.digest}: 416 {r.headers.get('Range')!r}")
            self._finished(r)


def open_target(ref, plain_http: bool = False, create: bool = False) -> Target:
    """The :class:`Target` of a parsed reference (a Layout is created when ``create``)."""
    if isinstance(ref, LayoutRef):
        return Layout(ref.path, create=create)
    return Registry(ref, plain_http)
