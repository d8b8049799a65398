"""Moving blobs and manifests: a registry over the OCI distribution API (:class:`Registry`),
or an OCI image-layout directory (:class:`Layout`). Both check every blob's sha256 digest as
it streams in (a blob written to a file is written only from bytes already hashed, and the
digest is compared before the caller is told it is complete), and both publish a manifest
only when asked, after every blob it names is in place (manifest last).

The registry client is a thin one on ``requests`` (docs/oci-format.md, "Why not oras-py"):
monolithic blob uploads streamed from the file (``POST`` then ``PUT ?digest=``), ``HEAD`` to
skip blobs the registry has, ranged parts read from the snapshot's files without copying.
Credentials come from the docker/podman auth files and credential helpers through the
``docker`` package's ``docker.auth`` (Docker's maintained SDK): ``$REGISTRY_AUTH_FILE``,
``$XDG_RUNTIME_DIR/containers/auth.json``, ``~/.config/containers/auth.json``,
``$DOCKER_CONFIG/config.json`` / ``~/.docker/config.json``, first that names the host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urljoin

from ..errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from . import oci
from .reference import LayoutRef, RegistryRef

CHUNK = 1 << 20
#: seconds to connect / between bytes of one response
TIMEOUT = (10.0, 120.0)
MAX_MANIFEST = 4 << 20


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

    def has_blob(self, digest: str) -> bool:
        """True when the blob ``digest`` (``sha256:HEX``) is already there."""

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        """Upload ``size`` bytes of ``path`` from ``offset`` as blob ``digest``. Raises
        EnvironmentProblem (network/registry), CorruptSnapshotError (the registry refused the
        digest)."""

    def get_blob(self, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                 h=None) -> None:
        """Stream blob ``digest`` into ``sink`` chunk by chunk, hashing as it goes; raise
        CorruptSnapshotError naming ``what`` and the digest when the bytes do not hash to
        ``digest`` or are not ``size`` long (the sink has then seen bad bytes: the caller
        discards what it wrote). NotFound when absent. ``start`` > 0 (a resumed download):
        only the bytes from ``start`` on are fetched and given to ``sink``; ``h`` is a sha256
        object already fed with the first ``start`` bytes (the caller's copy), and the digest
        checked covers them too."""

    def put_manifest(self, tag: str, raw: bytes, media_type: str = oci.OCI_MANIFEST) -> str:
        """Publish manifest ``raw`` under ``tag``; returns its digest."""

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """The manifest at tag or digest ``reference`` and its digest (checked against the
        reference when it is a digest). NotFound when absent."""


def _check_stream(chunks, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                  h=None) -> None:
    h = h if h is not None else hashlib.sha256()
    n = start
    for chunk in chunks:
        check_stop()
        if not chunk:
            continue
        n += len(chunk)
        if n > size:
            raise CorruptSnapshotError(f"blob {digest} ({what}) is longer than its {size} bytes",
                                       hint="the stored artifact is damaged: push the snapshot again")
        h.update(chunk)
        sink(chunk)
    got = "sha256:" + h.hexdigest()
    if n != size or got != digest:
        raise CorruptSnapshotError(
            f"blob {digest} ({what}) does not match its digest: {n} bytes hashing to {got}",
            hint="the stored artifact is damaged (or was changed): push the snapshot again", details={"blob": digest,
                                                                                                     "member": what})


# ---------------------------------------------------------------------------- image layout

class Layout:
    """An OCI image-layout directory (``oci-layout``, ``index.json``, ``blobs/sha256/``):
    blobs written to a temp name and renamed once their digest checked; ``index.json``
    rewritten atomically (temp + rename) when a manifest is tagged. Files 0600, dirs 0700
    (a snapshot holds process memory).

    ``create``: the directory may be absent (created 0700, parents too), empty, or a layout
    already; it is checked here and written only on the first blob or manifest (so a push
    refused later, e.g. by a snapshot checksum, writes nothing). Raises UsageError, naming the
    path and what to do, for a path that is a file, or an existing non-empty directory that is
    not a layout (no ``oci-layout`` file); without ``create`` also for an absent directory or
    one that is not a layout."""

    def __init__(self, path: Path, create: bool = False):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._ready = False
        check_layout_dir(self.path, create)
        self._ready = (self.path / "oci-layout").is_file()

    def _ensure(self) -> None:
        """Create the layout (dir 0700, ``oci-layout``, an empty ``index.json``) if it is not
        one yet. Raises EnvironmentProblem when the directory cannot be written."""
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            check_layout_dir(self.path, True)  # again: it may have changed since the check
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                (self.path / "blobs" / "sha256").mkdir(mode=0o700, parents=True, exist_ok=True)
                if not (self.path / "index.json").exists():
                    self._write(self.path / "index.json", json.dumps(
                        {"schemaVersion": 2, "mediaType": oci.OCI_INDEX, "manifests": []}).encode())
                if not (self.path / "oci-layout").exists():
                    self._write(self.path / "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            except OSError as e:
                raise EnvironmentProblem(f"cannot create the OCI image layout {self.path}: {e.strerror or e}",
                                         hint="name a directory this user can write (oci:DIR)") from e
            self._ready = True

    def describe(self) -> str:
        return f"oci:{self.path}"

    @staticmethod
    def _write(p: Path, data: bytes) -> None:
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, p)

    def _blob(self, digest: str) -> Path:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise CorruptSnapshotError(f"{digest!r} is not a sha256 digest")
        return self.path / "blobs" / "sha256" / digest.split(":", 1)[1]

    def has_blob(self, digest: str) -> bool:
        return self._blob(digest).is_file()

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        self._ensure()
        dst = self._blob(digest)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                _check_stream(_read_range(path, offset, size), digest, size, out.write, str(path))
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get_blob(self, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                 h=None) -> None:
        p = self._blob(digest)
        if not p.is_file():
            raise NotFound(f"blob {digest} is not in {self.describe()}")
        _check_stream(_read_range(p, start, max(0, p.stat().st_size - start)), digest, size, sink, what, start, h)

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
        if not p.is_file():
            self._write(p, raw)
        doc = json.loads(raw)
        desc = {"mediaType": media_type, "digest": digest, "size": len(raw),
                "annotations": {"org.opencontainers.image.ref.name": tag}}
        if doc.get("artifactType"):
            desc["artifactType"] = doc["artifactType"]
        with self._lock:
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
            raise CorruptSnapshotError(f"{self.describe()}: manifest {digest} does not match its digest")
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


def _skip(chunks, n: int):
    """``chunks`` without their first ``n`` bytes."""
    for chunk in chunks:
        if n >= len(chunk):
            n -= len(chunk)
            continue
        yield chunk[n:] if n else chunk
        n = 0


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


# ---------------------------------------------------------------------------- registry

AUTH_HINT = ("log in with `podman login HOST` or `docker login HOST` (or set REGISTRY_AUTH_FILE to an auth file); "
             "--plain-http only for a registry on loopback")


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


class Registry:
    """One repository of a registry (OCI distribution API v2). ``plain_http`` uses http://
    (refused for a host that is not loopback). Thread-safe: one ``requests.Session`` per
    thread, one bearer token shared."""

    def __init__(self, ref: RegistryRef, plain_http: bool = False):
        import requests  # noqa: F401  (imported here: the CLI's other commands never pay for it)

        host = ref.host.split(":")[0].strip("[]") if not ref.host.startswith("[") else ref.host[1:ref.host.index("]")]
        if plain_http and host not in ("localhost", "127.0.0.1", "::1") and not host.startswith("127."):
            raise UsageError(f"--plain-http is for a registry on loopback, not {ref.host}",
                             hint="use the registry's HTTPS endpoint")
        self.ref = ref
        self.base = f"{'http' if plain_http else 'https'}://{ref.host}/v2/{ref.repo}/"
        self._local = threading.local()
        self._token: str | None = None
        self._basic: tuple[str, str] | None = None
        self._creds_read = False
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"{self.ref.host}/{self.ref.repo}"

    def _session(self):
        import requests

        s = getattr(self._local, "s", None)
        if s is None:
            s = self._local.s = requests.Session()
            s.trust_env = False  # no proxies from the environment for registry traffic
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
        r = self._session().get(kv["realm"], params=q, auth=self._creds(), timeout=TIMEOUT)
        if r.status_code != 200:
            raise EnvironmentProblem(f"{self.ref.host}: the token service {kv['realm']} answered {r.status_code}",
                                     hint=AUTH_HINT)
        body = r.json()
        self._token = body.get("token") or body.get("access_token")

    def _request(self, method: str, url: str, **kw):
        import requests

        for attempt in range(2):
            headers = dict(kw.pop("headers", {}) or {})
            auth = None
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            elif self._basic is not None:
                auth = self._basic
            data = kw.get("data")
            if isinstance(data, _Slice) and attempt:
                raise EnvironmentProblem(f"{self.ref.host} asked for a login in the middle of an upload")
            try:
                r = self._session().request(method, url, headers=headers, auth=auth, timeout=TIMEOUT, **kw)
            except requests.RequestException as e:
                raise EnvironmentProblem(f"cannot reach the registry {self.ref.host}: {e}",
                                         hint="check the address and that the registry runs"
                                              + ("; for a loopback test registry pass --plain-http"
                                                 if self.base.startswith("https") else "")) from e
            if r.status_code == 401 and attempt == 0 and "WWW-Authenticate" in r.headers:
                r.close()
                self._authenticate(r.headers["WWW-Authenticate"])
                kw["headers"] = headers
                continue
            if r.status_code in (401, 403):
                raise EnvironmentProblem(f"{self.ref.host} refused access to {self.ref.repo} ({r.status_code})",
                                         hint=AUTH_HINT)
            return r
        return r

    def has_blob(self, digest: str) -> bool:
        r = self._request("HEAD", self.base + f"blobs/{digest}")
        r.close()
        return r.status_code == 200

    def put_blob(self, digest: str, size: int, path: Path, offset: int = 0) -> None:
        r = self._request("POST", self.base + "blobs/uploads/")
        if r.status_code != 202 or "Location" not in r.headers:
            raise EnvironmentProblem(f"{self.ref.host} did not start an upload ({r.status_code}: {r.text[:200]})")
        loc = urljoin(self.base, r.headers["Location"])
        body = _Slice(path, offset, size)
        try:
            r = self._request("PUT", loc, params={"digest": digest}, data=body,
                              headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        finally:
            body.close()
        if r.status_code == 400 and "DIGEST_INVALID" in r.text:
            raise CorruptSnapshotError(f"{path} changed while it was pushed (the registry computed another digest "
                                       f"than {digest})", hint="push again")
        if r.status_code not in (201, 204):
            raise EnvironmentProblem(f"{self.ref.host} refused blob {digest} ({r.status_code}: {r.text[:200]})")

    def get_blob(self, digest: str, size: int, sink: Callable[[bytes], None], what: str, start: int = 0,
                 h=None) -> None:
        ranged = {"Range": f"bytes={start}-"} if start else None
        r = self._request("GET", self.base + f"blobs/{digest}", stream=True, headers=ranged)
        try:
            if r.status_code == 404:
                raise NotFound(f"blob {digest} ({what}) is not in {self.describe()}")
            chunks = r.iter_content(CHUNK)
            if start and r.status_code == 206:
                if not r.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
                    raise EnvironmentProblem(f"{self.ref.host} answered another range than bytes {start}- for blob "
                                             f"{digest} ({what}): {r.headers.get('Content-Range')!r}")
            elif r.status_code == 200:
                chunks = _skip(chunks, start)  # a registry that ignores Range: the whole blob again
            else:
                raise EnvironmentProblem(f"{self.ref.host} answered {r.status_code} for blob {digest} ({what})")
            _check_stream(chunks, digest, size, sink, what, start, h)
        finally:
            r.close()

    def put_manifest(self, tag: str, raw: bytes, media_type: str = oci.OCI_MANIFEST) -> str:
        r = self._request("PUT", self.base + f"manifests/{tag}", data=raw, headers={"Content-Type": media_type})
        if r.status_code not in (201, 204):
            raise EnvironmentProblem(f"{self.ref.host} refused the manifest for tag {tag} ({r.status_code}: "
                                     f"{r.text[:300]})")
        return oci.sha256(raw)

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        r = self._request("GET", self.base + f"manifests/{reference}", headers={"Accept": oci.OCI_MANIFEST},
                          stream=True)
        try:
            if r.status_code == 404:
                raise NotFound(f"{self.describe()} has no manifest {reference!r}")
            if r.status_code != 200:
                raise EnvironmentProblem(f"{self.ref.host} answered {r.status_code} for manifest {reference}")
            raw = r.raw.read(MAX_MANIFEST + 1, decode_content=True)
        finally:
            r.close()
        if len(raw) > MAX_MANIFEST:
            raise CorruptSnapshotError(f"{self.describe()}: manifest {reference} is larger than {MAX_MANIFEST} bytes")
        digest = oci.sha256(raw)
        if reference.startswith("sha256:") and digest != reference:
            raise CorruptSnapshotError(f"{self.describe()}: manifest {reference} does not match its digest ({digest})")
        return raw, digest


def open_target(ref, plain_http: bool = False, create: bool = False) -> Target:
    """The :class:`Target` of a parsed reference (a Layout is created when ``create``)."""
    if isinstance(ref, LayoutRef):
        return Layout(ref.path, create=create)
    return Registry(ref, plain_http)
