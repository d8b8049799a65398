"""An OCI image-layout directory as a transport target (``oci:DIR``): :class:`Layout`, and
:func:`check_layout_dir`, the refusal of a path that is not one (or cannot become one).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Callable

from ..errors import CorruptSnapshotError, EnvironmentProblem, UsageError
from . import oci
from .net import CHUNK, DAMAGED_HINT, MAX_MANIFEST, NotFound, check_stream, read_range


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


def make_private_dirs(path: Path) -> list[Path]:
    """Create directory ``path`` and every missing parent 0700 (``Path.mkdir(parents=True)``
    makes the parents with the umask's mode, not the one asked for); return those this call
    made, outermost first."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    made = []
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
            made.append(d)
    return made


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
        #: directories this object created (the layout's and missing parents), outermost first
        self._made_dirs: list[Path] = []
        #: True once this object turned the directory into a layout (it was absent or empty)
        self._made_layout = False

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
                    self._made_dirs = make_private_dirs(self.path)
            with self._locked():
                if self._ready:
                    return
                check_layout_dir(self.path, True)  # under the lock: another process's half-made layout is not seen
                self._made_layout = not (self.path / "oci-layout").exists()
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

    def abandon(self) -> list[Path]:
        """After a failed push: remove what this object made of a layout that nothing was
        published into -- when it turned an absent or empty directory into a layout and the
        index still names no manifest (no other push tagged into it meanwhile), the layout's
        files and the directories it created; otherwise nothing (the blobs of an existing layout
        may serve other pushes; the next push of the same snapshot reuses them). Returns the
        paths removed. Never raises (an OSError leaves the rest, e.g. on a read-only mount)."""
        import shutil

        if not self._made_layout:
            return []
        removed: list[Path] = []
        try:
            with self._locked():
                try:
                    named = json.loads((self.path / "index.json").read_bytes()).get("manifests")
                except (OSError, ValueError, AttributeError):
                    named = []
                if named:
                    return []
                for name in ("blobs", "index.json", "oci-layout"):
                    p = self.path / name
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif os.path.lexists(p):
                        p.unlink()
                    else:
                        continue
                    removed.append(p)
                for p in list(self.path.iterdir()):  # the temp files of index writes
                    if p.name.startswith((".index.json.tmp-", ".oci-layout.tmp-")):
                        p.unlink()
            for d in reversed(self._made_dirs):
                d.rmdir()  # OSError when not empty: another process's files are left
                removed.append(d)
            self._ready = self._made_layout = False
        except OSError:
            pass
        return removed

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
                check_stream(read_range(path, offset, size), digest, size, out.write, str(path))
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
        return check_stream(read_range(p, start, max(0, p.stat().st_size - start)), digest, size, sink, what,
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
