"""The snapshot manifest: strict pydantic models, schema version, digest, atomic read/write.

``manifest.json`` is written last when a snapshot is published; no manifest means the snapshot
is incomplete. Models are frozen and ``extra="forbid"``; non-finite floats are refused. The
``digest`` field is a BLAKE3 hex digest over the canonical JSON of every other field (which
includes every image's checksum), so a manifest edited by hand after create is detected.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, ValidationError, model_serializer, model_validator

from ..errors import CorruptSnapshotError
from .layout import MANIFEST, MANIFEST_TMP, damaged_hint, judge
from .oracle import Oracle

SCHEMA_VERSION = 1


class _Strict(BaseModel):
    # defer_build: the validators are compiled on first use, not at import; reading a manifest
    # then compiles one (Manifest's, nested models inline) instead of one per model class
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=False, defer_build=True)


class Frame(_Strict):
    """One independent zstd frame of a ``zstd-frames`` image, in file order: the bytes it
    decompresses to, its stored (compressed) bytes and the BLAKE3 of those stored bytes (hex),
    so each frame is verified before it is decompressed, in parallel with the others."""

    raw_bytes: int = Field(ge=0)
    stored_bytes: int = Field(gt=0)
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")


class ImageFile(_Strict):
    """One CRIU image file: name in ``images/``, raw and stored bytes, BLAKE3 of the raw
    bytes (hex), and its compression: ``none``; ``zstd`` (one zstd frame, stored as
    ``NAME.zst``; made by versions before frames); ``zstd-frames`` (stored as ``NAME.zst``: the
    concatenation of the independent zstd frames listed in ``frames``, a valid zstd stream).

    ``frames`` is absent from the JSON unless set, so manifests without framed images read
    exactly as before; versions that predate ``zstd-frames`` refuse a manifest holding them
    (``compression`` is not one they know, ``frames`` is an unknown field)."""

    name: str
    raw_bytes: int = Field(ge=0)
    stored_bytes: int = Field(ge=0)
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")
    compression: Literal["none", "zstd", "zstd-frames"] = "none"
    frames: tuple[Frame, ...] | None = None

    @model_validator(mode="after")
    def _frames_add_up(self) -> "ImageFile":
        if (self.compression == "zstd-frames") != (self.frames is not None):
            raise ValueError("frames are listed exactly for zstd-frames images")
        if self.frames is not None and (sum(f.raw_bytes for f in self.frames) != self.raw_bytes
                                        or sum(f.stored_bytes for f in self.frames) != self.stored_bytes):
            raise ValueError("the frames' raw and stored bytes do not add up to the image's")
        return self

    @model_serializer(mode="wrap")
    def _drop_absent_frames(self, handler, info: SerializationInfo) -> dict:
        d = handler(self)
        if self.frames is None:
            d.pop("frames", None)
        return d


class ModelFile(_Strict):
    """One model file the engine reads: path relative to the model dir, size (bytes), BLAKE3
    of the full content, and the stat fields used to skip re-hashing unchanged files."""

    path: str
    size: int = Field(ge=0)
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int


class ModelIdentity(_Strict):
    """The model: what the user asked for, the resolved local directory and its files."""

    requested: str
    path: str
    served_name: str
    files: tuple[ModelFile, ...]
    total_bytes: int = Field(ge=0)
    #: for a Hugging Face id: the commit the local cache resolved ``--revision`` (or main) to
    revision: str | None = None


class EngineUser(_Strict):
    """The unprivileged user the engine tree ran as (:mod:`vllm_snapshot.host.privilege`): name,
    uid, primary gid, supplementary gids (sorted) and HOME. Every process of the tree had
    exactly these ids, no capability and NoNewPrivs set; restore refuses when ``name`` does
    not map to the same ids on the restoring host, and checks the restored tree has them."""

    name: str
    uid: int = Field(gt=0)
    gid: int = Field(ge=0)
    groups: tuple[int, ...]
    home: str


class EngineInfo(_Strict):
    """Engine kind (cpu/cuda), sleep level used before the dump (0 = full state captured),
    the engine args (secrets redacted). ``env_hashes`` is always empty now: the restored
    engine keeps the environment it had at create (it is in its memory), so comparing hashes
    with the restoring host's environment would compare another process's; the field stays in
    schema 1 so older snapshots (which recorded hashes) still parse.

    ``network``: ``isolated`` -- the tree ran in a network namespace of its own holding only
    ``lo`` (checked from outside before the dump: no other interface, no route out), so the
    engine was offline at create and every restore gets a fresh namespace (no loopback port
    collisions; the supervisor passes it the listening socket). ``host`` (the default, for
    snapshots made before) -- it shared the host's namespace.

    ``user``: the unprivileged user the tree ran as; None for snapshots made before engines
    dropped privileges (their tree runs as root with every capability: restore still restores
    them, with a warning, and ``inspect`` says so).

    ``rehearsal_wake_s``: seconds the wake (weights reloaded at sleep level 2) of create's
    sleep rehearsal took; restore waits for its own wake at least twice that (None: no
    rehearsal, or a snapshot made before it was recorded)."""

    kind: Literal["cpu", "cuda"]
    sleep_level: int = Field(ge=0, le=2)
    engine_args: tuple[str, ...]
    env_hashes: dict[str, str]
    full_state_captured: bool
    network: Literal["host", "isolated"] = "host"
    user: EngineUser | None = None
    rehearsal_wake_s: float | None = Field(default=None, ge=0)
    #: True: create gave the engine the scrubbed environment (no variable kept with
    #: ``--keep-env`` that the scrubber would have dropped); False: it kept some; None: made
    #: before this was recorded. ``push`` refuses all but True (the images hold the engine's memory).
    env_scrubbed: bool | None = None


class TreeFile(_Strict):
    """A regular file the engine tree had open or mapped at dump (shared libraries, weights):
    size (bytes), mtime_ns, BLAKE3 for files <= 1 MiB (else None: size+mtime pin it)."""

    path: str
    size: int = Field(ge=0)
    mtime_ns: int
    blake3: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class ExternalMount(_Strict):
    """A mount the engine's namespace holds that CRIU cannot re-create itself: passed as
    ``--external mnt[MOUNT_POINT]:COOKIE`` at dump and bound back from the host at restore
    (:mod:`vllm_snapshot.checkpoint.mountpolicy`). ``identity`` names the file system across reboots:
    ``identity_kind`` ``uuid`` (block devices), ``fsid`` (statfs) or ``source`` (NFS and
    similar); ``major_minor`` is informational (loop/partition numbers change)."""

    mount_point: str
    fs_type: str
    source: str
    root: str
    major_minor: str
    cookie: str
    identity_kind: Literal["uuid", "fsid", "source"]
    identity: str

    def describe(self) -> str:
        return f"{self.fs_type} {self.identity_kind}={self.identity} (source {self.source})"


class CriuInfo(_Strict):
    """CRIU version, the flags shared by dump and restore, and the fd identities restore
    re-binds with ``--inherit-fd``: role (``control``, ``log``, ``events``) -> ``pipe:[ino]``."""

    version: str
    flags: tuple[str, ...]
    inherit: dict[str, str]
    pid_namespace: bool
    root_pid: int
    tree_pids: tuple[int, ...]
    tree_commands: tuple[str, ...]
    dump_argv: tuple[str, ...]
    listeners: tuple[tuple[str, int], ...] = ()
    tree_files: tuple[TreeFile, ...] = ()
    external_mounts: tuple[ExternalMount, ...] = ()
    #: CRIU ``--timeout`` (seconds) of the dump; None: CRIU's default (10 s) was used
    freeze_timeout_s: int | None = Field(default=None, gt=0)
    #: CUDA: the processes with a CUDA context at the dump, by their PID in the tree's PID
    #: namespace (restore checks the GPU state of these); empty: not CUDA, or made before
    #: they were recorded (restore then asks about every process of the tree)
    cuda_pids: tuple[int, ...] = ()


class CarriedFile(_Strict):
    """A host file the engine tree had open or mapped that travels with the snapshot
    (:mod:`vllm_snapshot.checkpoint.carry`): its absolute canonical ``path``, ``size`` (bytes),
    the BLAKE3 of its content (hex; also the name of its copy in ``carried/``), permission
    bits ``mode`` (CRIU refuses a mapped file whose mode differs), owner ``uid``/``gid`` and
    ``mtime_ns`` as they were at create; restore puts it back with exactly these."""

    path: str = Field(pattern=r"^/")
    size: int = Field(ge=0)
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")
    mode: int = Field(ge=0, le=0o7777)
    uid: int = Field(ge=0)
    gid: int = Field(ge=0)
    mtime_ns: int


class CarriedDir(_Strict):
    """A directory above a carried file, as it was at create: restore creates it with this
    ``mode`` (permission bits) and owner when it is missing (an empty HOME), never changes an
    existing one."""

    path: str = Field(pattern=r"^/")
    mode: int = Field(ge=0, le=0o7777)
    uid: int = Field(ge=0)
    gid: int = Field(ge=0)


class Carried(_Strict):
    """What travels with the snapshot besides the images: every file the tree had open or
    mapped outside the model, the Python environment and the system (compile caches under the
    engine user's HOME, ...), the directories above them, and ``blobs``, the stored copies in
    ``carried/`` (one per distinct content, named by the BLAKE3 of the raw content; compressed
    like the images)."""

    files: tuple[CarriedFile, ...]
    dirs: tuple[CarriedDir, ...]
    blobs: tuple[ImageFile, ...]

    @model_validator(mode="after")
    def _blobs_match(self) -> "Carried":
        want = {f.blake3 for f in self.files}
        have = {b.name for b in self.blobs}
        if want != have or any(b.name != b.blake3 for b in self.blobs):
            raise ValueError("each carried file's content is exactly one blob, named by its BLAKE3")
        if len({f.path for f in self.files}) != len(self.files):
            raise ValueError("a carried path is listed twice")
        return self


class WeightsFile(_Strict):
    """The weights file a CPU engine maps its post-processed weights from
    (:mod:`vllm_snapshot.store.weights`): absolute ``path`` (``ROOT/.weights/BLAKE3.weights``),
    ``size`` (bytes), the BLAKE3 of its full content (hex), the stat fields that let a restore
    skip re-hashing an unchanged file (as for model files), and what the engine mapped of it:
    ``tensors`` (parameters and buffers re-pointed) and ``mapped_bytes``. ``use``: ``map`` (a CPU
    engine computes with a private mapping of it) or ``wake`` (a GPU engine keeps it open and its
    level-2 wake copies the weights back from it instead of reloading the model files;
    ``tensors``/``mapped_bytes`` then count what it wrote)."""

    path: str = Field(pattern=r"^/")
    size: int = Field(ge=0)
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int
    tensors: int = Field(ge=0)
    mapped_bytes: int = Field(ge=0)
    use: Literal["map", "wake"] = "map"


class SnapshotKey(_Strict):
    """The snapshot key (:mod:`vllm_snapshot.store.snapkey`): ``value`` is BLAKE3 over the part
    digests ``parts`` (``model``, ``engine``, ``env``, ``host``); ``raw_args`` digests the
    engine args as given (with the model string and vLLM version) and ``normalized_args`` is
    what vLLM's parser made of them (``{dest: JSON text}``, secrets digested), so ``serve``
    can reuse the normalization without importing vLLM. ``env``: the variables of the ``env``
    part, ``{name: BLAKE3 hex of the value}`` (``"secret"`` for secret-looking names kept with
    ``--keep-env``), so a mismatch can name the variables (empty in older snapshots)."""

    value: str = Field(pattern=r"^[0-9a-f]{64}$")
    parts: dict[str, str]
    raw_args: str = Field(pattern=r"^[0-9a-f]{64}$")
    normalized_args: dict[str, str]
    env: dict[str, str] = Field(default_factory=dict)


class CodeIdentity(_Strict):
    """The pinned files of the Python distributions the engine imported from
    (:mod:`vllm_snapshot.host.codeid`): the table lives in the snapshot's ``code.json``;
    ``table_digest`` is its BLAKE3 hex digest, ``files`` the number of pinned files and
    ``distributions`` name -> version."""

    table_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    files: int = Field(ge=0)
    distributions: dict[str, str]


class Manifest(_Strict):
    """The whole manifest (``schema_version`` 1). ``timings`` are phase durations in seconds;
    ``sizes`` are bytes (``raw``: images as CRIU wrote them; ``stored``: on disk)."""

    schema_version: Literal[1]
    tool_version: str
    created_at: str
    host: dict[str, str]
    engine: EngineInfo
    model: ModelIdentity
    oracle: Oracle
    #: what the HTTP canary of a restore expects: the oracle's request on a short fixed prompt
    #: (engine/protocol.py CANARY_PROMPT), recorded at create right after the oracle; not part
    #: of the key (the engine behaves the same). Absent in snapshots made before it: their
    #: canary sends the oracle's prompt and expects the oracle.
    canary: Oracle | None = None
    criu: CriuInfo
    images: tuple[ImageFile, ...]
    extra_files: tuple[ImageFile, ...] = ()
    sizes: dict[str, int]
    timings: dict[str, float]
    #: absent in snapshots made before keys existed (``serve`` never picks those)
    key: SnapshotKey | None = None
    #: absent in snapshots made before code identity existed (restore then checks only the
    #: files the tree had open or mapped)
    code: CodeIdentity | None = None
    #: absent in snapshots made before files travelled with the snapshot (restore then only
    #: checks the files the tree had open or mapped, and refuses a vanished one)
    carried: Carried | None = None
    #: the weights file the engine maps its weights from (CPU engines made with a weights file;
    #: absent: the weights are in the images)
    weights: WeightsFile | None = None
    digest: str = ""


def _canonical(data: dict) -> bytes:
    d = dict(data)
    d.pop("digest", None)
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def compute_digest(m: Manifest) -> str:
    """BLAKE3 hex of the canonical JSON of ``m`` without its ``digest`` field."""
    return blake3.blake3(_canonical(m.model_dump(mode="json"))).hexdigest()


def seal(m: Manifest) -> Manifest:
    """Return ``m`` with its digest filled in."""
    return m.model_copy(update={"digest": compute_digest(m)})


def to_json(m: Manifest) -> str:
    """Stable, indented JSON text of a manifest."""
    return json.dumps(m.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def write_atomic(m: Manifest, directory: Path) -> Path:
    """Write ``directory/manifest.json`` (mode 0600) via a temp file, fsync, rename, fsync dir."""
    path = directory / MANIFEST
    tmp = directory / MANIFEST_TMP
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, to_json(m).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(directory, os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


@contextmanager
def _without_pydantic_plugins() -> Iterator[None]:
    """pydantic's documented switch ``PYDANTIC_DISABLE_PLUGINS``, set while a validator is
    compiled: before its first validator pydantic looks for plugins in the entry points of
    every installed distribution (importlib.metadata's import and ~160 files: ~25 ms of
    ``inspect``'s start-up), and these models use none. typer builds its option adapters the
    same way."""
    prev = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "1"
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("PYDANTIC_DISABLE_PLUGINS", None)
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = prev


def _loc(err: dict) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])


def parse(text: str, source: str = MANIFEST) -> Manifest:
    """Parse and verify manifest text strictly.

    Raises CorruptSnapshotError naming the JSON path of the first problems: invalid JSON, an
    unknown schema version, unknown/missing fields, wrong types, non-finite numbers, or a
    digest that does not match (the manifest was edited after create).
    """
    if not text.strip():
        raise CorruptSnapshotError(f"{source} is empty")
    try:
        raw = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError as e:
        cut = isinstance(e, json.JSONDecodeError) and e.pos >= len(text.rstrip())
        raise CorruptSnapshotError(f"{source} is not valid JSON: {e}" + (
            f"; the file ends there, after {len(text.encode())} bytes: it was cut short (truncated)" if cut else "")) from e
    if not isinstance(raw, dict):
        raise CorruptSnapshotError(f"{source}: $ must be an object")
    sv = raw.get("schema_version")
    if type(sv) is not int or sv != SCHEMA_VERSION:  # `true` and `1.0` equal 1 in Python
        raise CorruptSnapshotError(
            f"{source}: $.schema_version is {sv!r}; this vllm-snapshot reads version {SCHEMA_VERSION}",
            hint="use the vllm-snapshot version that created the snapshot, or re-create it",
        )
    if not Manifest.__pydantic_complete__:  # deferred (defer_build): compiled on the first read
        with _without_pydantic_plugins():
            Manifest.model_rebuild()
    try:
        # strict: no coercion of "1" to 1, 1.0 to 1, true to 1, ... (JSON arrays stay tuples)
        m = Manifest.model_validate_json(text, strict=True)
    except ValidationError as e:
        probs = [f"{_loc(x)}: {x['msg']}" for x in e.errors()[:5]]
        raise CorruptSnapshotError(f"{source} is invalid: " + "; ".join(probs)) from e
    # The digest covers the manifest as stored (not the parsed model with defaults filled in),
    # so fields added later with defaults do not invalidate older snapshots.
    if m.digest != blake3.blake3(_canonical(raw)).hexdigest():
        raise CorruptSnapshotError(
            f"{source}: $.digest does not match the manifest's content (edited after create?)",
            hint="re-create the snapshot; never edit manifest.json by hand",
        )
    return m


def read(directory: Path) -> Manifest:
    """Read and verify ``directory/manifest.json``; see :func:`parse` for the errors raised.

    A missing directory raises UsageError; a directory without a manifest raises
    CorruptSnapshotError (an incomplete or foreign directory)."""
    refused = judge(directory)
    if refused is not None:
        raise refused
    path = directory / MANIFEST
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptSnapshotError(f"{path} is not UTF-8 text: {e}") from e
    except FileNotFoundError as e:  # removed since the judgement
        raise CorruptSnapshotError(f"{path} not found: an incomplete snapshot") from e
    try:
        return parse(text, str(path))
    except CorruptSnapshotError as e:
        if e.hint is None:
            e.hint = damaged_hint(directory)
        raise
