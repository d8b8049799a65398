"""The snapshot as an OCI artifact (docs/oci-format.md is the description another tool reads).

* The OCI image manifest has ``artifactType`` :data:`ARTIFACT_TYPE`; its config is the
  snapshot's own ``manifest.json``, byte for byte (:data:`CONFIG_TYPE`).
* Layers: one per member file of the snapshot directory (``images/*``, ``files/*``,
  ``code.json``, the logs, ``stats-dump``); a file larger than :data:`PART_BYTES` is cut into
  parts of that size (one layer each, byte ranges in file order), so the big memory-pages image
  moves over several streams and a retry re-sends one part, not the file. Each layer says
  where its bytes go (:data:`A_MEMBER`, :data:`A_OFFSET`, :data:`A_FILE_SIZE`).
* The weights file a CPU snapshot references (:mod:`vllm_snapshot.store.weights`) is not a
  member: it travels as layers of its own media type (:data:`WEIGHTS_TYPE`, cut into parts like
  a member), annotated with its BLAKE3 and the absolute path the pulling node must place it at
  (:data:`A_WEIGHTS_BLAKE3`, :data:`A_WEIGHTS_PATH`); :attr:`Artifact.weights` holds them apart
  from the members' :attr:`Artifact.parts`.
* Manifest annotations carry what a node needs to decide, before any blob, whether the
  snapshot fits it: the host *class* fields (:data:`A_CLASS` + field), the *machine* it was
  built on (:data:`A_MACHINE` + field), the engine user, the external mounts, the model path
  and digest, the engine kind, and that create scrubbed the environment.

Pure: nothing here reads or writes files except :func:`plan` (stat of the members) and
:func:`digest_parts` (reads them to hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import CorruptSnapshotError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
ARTIFACT_TYPE = "application/vnd.vllm-snapshot.snapshot.v1"
CONFIG_TYPE = "application/vnd.vllm-snapshot.manifest.v1+json"
#: layer media types: a CRIU image (``images/NAME``), one stored as zstd frames
#: (``images/NAME.zst``), a link-remap file (``files/NAME``), any other member
IMAGE_TYPE = "application/vnd.vllm-snapshot.criu-image.v1"
IMAGE_ZSTD_TYPE = "application/vnd.vllm-snapshot.criu-image.v1+zstd"
REMAP_TYPE = "application/vnd.vllm-snapshot.remap-file.v1"
#: a copy of a host file the tree mapped outside the model, the Python environment and the
#: system (``carried/BLAKE3``, ``carried/BLAKE3.zst`` stored as zstd frames: checkpoint/carry.py)
CARRIED_TYPE = "application/vnd.vllm-snapshot.carried-file.v1"
CARRIED_ZSTD_TYPE = "application/vnd.vllm-snapshot.carried-file.v1+zstd"
MEMBER_TYPE = "application/vnd.vllm-snapshot.member.v1"
LAYER_TYPES = frozenset({IMAGE_TYPE, IMAGE_ZSTD_TYPE, REMAP_TYPE, CARRIED_TYPE, CARRIED_ZSTD_TYPE, MEMBER_TYPE})
#: the weights file a CPU engine maps (``ROOT/.weights/BLAKE3.weights``, store/weights.py): not a
#: member of the snapshot directory; placed by a pull at its recorded absolute path
WEIGHTS_TYPE = "application/vnd.vllm-snapshot.weights-file.v1"

#: Bytes per layer of a large file: 256 MiB parts give the pages image of the tiny CPU model
#: (1.3 GB) five streams; a lost connection re-sends at most one part.
PART_BYTES = 256 << 20

NS = "org.vllm-snapshot."
A_TITLE = "org.opencontainers.image.title"
A_CREATED = "org.opencontainers.image.created"
A_MEMBER = NS + "member"
A_OFFSET = NS + "offset"
A_FILE_SIZE = NS + "file-size"
A_CLASS = NS + "class."
A_MACHINE = NS + "machine."
A_KIND = NS + "engine.kind"
A_USER = NS + "engine.user"
A_MOUNTS = NS + "mounts"
A_MODEL_PATH = NS + "model.path"
A_MODEL_DIGEST = NS + "model.digest"
A_MODEL_BYTES = NS + "model.bytes"
A_ENV_SCRUBBED = NS + "env-scrubbed"
A_SNAPSHOT_DIGEST = NS + "snapshot.digest"
A_TOOL_VERSION = NS + "tool-version"
A_KEY = NS + "key"
A_STORED_BYTES = NS + "stored-bytes"
#: on a weights layer, and on the manifest of a snapshot that references a weights file: the
#: file's BLAKE3 (hex), the absolute path it must be at (CRIU re-opens the mapping by it), and
#: (manifest only) its size
A_WEIGHTS_BLAKE3 = NS + "weights.blake3"
A_WEIGHTS_PATH = NS + "weights.path"
A_WEIGHTS_BYTES = NS + "weights.bytes"

#: Host identity fields that pin one machine, not a class of identical machines
#: (:data:`vllm_snapshot.host.identity.MACHINE_FIELDS`, and the GPU the engine used,
#: :data:`~vllm_snapshot.host.identity.GPU_USED_FIELDS`: one physical GPU, its device minor and
#: model, from which pull, as restore, places the GPU state on the node:
#: :func:`vllm_snapshot.checkpoint.gpu.place`): annotated as where the snapshot was built, not
#: required to match on a node that pulls it.
MACHINE_FIELDS = frozenset({"machine_id", "hostname", "gpu_uuid_used", "gpu_minor_used", "gpu_name_used"})

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:+@-]{0,254}$")
_SHA = re.compile(r"^sha256:[0-9a-f]{64}$")
_B3 = re.compile(r"^[0-9a-f]{64}$")


def weights_path_ok(path: str, blake3: str) -> bool:
    """True when ``path`` is where a weights file of BLAKE3 ``blake3`` may be placed: an
    absolute, normalized path ``/ROOT.../.weights/BLAKE3.weights`` (the store's layout; ROOT not
    ``/``), printable, at most 4096 bytes. Anything else in an artifact would let it write a file
    anywhere on the pulling node. Pure."""
    from ..store import weights as sw

    if not isinstance(path, str) or not isinstance(blake3, str) or not _B3.match(blake3):
        return False
    if len(path.encode()) > 4096 or not path.isprintable() or not os.path.isabs(path) or os.path.normpath(path) != path:
        return False
    p = Path(path)
    return p.name == f"{blake3}{sw.SUFFIX}" and p.parent.name == sw.DIR and len(p.parts) >= 4


@dataclass(frozen=True)
class Part:
    """One layer: ``size`` bytes of snapshot member ``member`` (a path relative to the
    snapshot dir) from ``offset``; ``file_size`` is the member's whole size; ``digest`` the
    layer's ``sha256:HEX`` ("" until hashed)."""

    member: str
    offset: int
    size: int
    file_size: int
    media_type: str
    digest: str = ""
    #: a part of the weights file (:data:`WEIGHTS_TYPE`): its absolute path and BLAKE3 ("" for
    #: a member's part; ``member`` is then "")
    weights_path: str = ""
    weights_blake3: str = ""

    @property
    def is_weights(self) -> bool:
        """True for a part of the weights file, not of a member."""
        return self.media_type == WEIGHTS_TYPE

    def source(self, snapshot: Path) -> Path:
        """The file this part's bytes are read from at push: the member under ``snapshot``,
        or the weights file at its absolute path."""
        return Path(self.weights_path) if self.is_weights else Path(snapshot) / self.member

    def descriptor(self) -> dict:
        """The OCI descriptor of this layer (digest must be set)."""
        whole = self.offset == 0 and self.size == self.file_size
        if self.is_weights:
            ann = {A_WEIGHTS_PATH: self.weights_path, A_WEIGHTS_BLAKE3: self.weights_blake3,
                   A_OFFSET: str(self.offset), A_FILE_SIZE: str(self.file_size)}
            if whole:
                ann[A_TITLE] = Path(self.weights_path).name
        else:
            ann = {A_MEMBER: self.member, A_OFFSET: str(self.offset), A_FILE_SIZE: str(self.file_size)}
            if whole:
                ann[A_TITLE] = self.member
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, "annotations": ann}


def member_ok(member: str) -> bool:
    """A member path a snapshot may hold: a top-level member file, or ``images/NAME`` /
    ``files/NAME`` / ``carried/NAME`` with a plain name (no ``..``, no further ``/``)."""
    from ..store.layout import CARRIED, CODE_TABLE, CREATE_LOG, DUMP_LOG, FILES, IMAGES, STATS_DUMP

    top, sep, name = member.partition("/")
    if not sep:
        return member in {CODE_TABLE, CREATE_LOG, DUMP_LOG, STATS_DUMP}
    return top in (IMAGES, FILES, CARRIED) and "/" not in name and name not in (".", "..") and bool(_NAME.match(name))


def _media_type(member: str) -> str:
    if member.startswith("images/"):
        return IMAGE_ZSTD_TYPE if member.endswith(".zst") else IMAGE_TYPE
    if member.startswith("files/"):
        return REMAP_TYPE
    if member.startswith("carried/"):
        return CARRIED_ZSTD_TYPE if member.endswith(".zst") else CARRIED_TYPE
    return MEMBER_TYPE


def plan(snapshot: Path, part_bytes: int = PART_BYTES) -> list[Part]:
    """The layers of the snapshot directory ``snapshot`` (every regular file but
    ``manifest.json`` and ``pulled.json``), unhashed, in member order. Raises CorruptSnapshotError for a member
    that is not a plain file of an allowed name."""
    from ..store.layout import CARRIED, FILES, IMAGES, MANIFEST, PULLED

    members = []
    for name in sorted(os.listdir(snapshot)):
        if name in (MANIFEST, PULLED):  # the config; this node's pull record
            continue
        if name in (IMAGES, FILES, CARRIED):
            members += [f"{name}/{n}" for n in sorted(os.listdir(snapshot / name))]
        else:
            members.append(name)
    parts: list[Part] = []
    for member in members:
        p = snapshot / member
        if not member_ok(member) or p.is_symlink() or not p.is_file():
            raise CorruptSnapshotError(f"{p} is not a member a snapshot may hold; nothing was pushed")
        size = p.stat().st_size
        off = 0
        while True:
            n = min(part_bytes, size - off)
            parts.append(Part(member, off, n, size, _media_type(member)))
            off += n
            if off >= size:
                break
    return parts


def plan_weights(rec, part_bytes: int = PART_BYTES) -> list[Part]:
    """The layers of the weights file ``rec`` (:class:`~vllm_snapshot.store.manifest.WeightsFile`;
    None: none), unhashed: one per ``part_bytes`` of its ``size`` (one empty layer for an empty
    file). Pure."""
    if rec is None:
        return []
    parts, off = [], 0
    while True:
        n = min(part_bytes, rec.size - off)
        parts.append(Part("", off, n, rec.size, WEIGHTS_TYPE, weights_path=rec.path, weights_blake3=rec.blake3))
        off += n
        if off >= rec.size:
            return parts


def hash_region(fd: int, offset: int, size: int):
    """A sha256 object fed ``size`` bytes of the open file ``fd`` from byte ``offset`` (pread:
    the file position is left alone); None when the file ends before that."""
    h = hashlib.sha256()
    at, end = offset, offset + size
    while at < end:
        chunk = os.pread(fd, min(4 << 20, end - at), at)
        if not chunk:
            return None
        h.update(chunk)
        at += len(chunk)
    return h


def _sha256_range(path: Path, offset: int, size: int) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        h = hash_region(fd, offset, size)
    finally:
        os.close(fd)
    if h is None:
        raise CorruptSnapshotError(f"{path} shrank while it was being hashed")
    return "sha256:" + h.hexdigest()


def digest_parts(snapshot: Path, parts: list[Part], workers: int = 4) -> list[Part]:
    """``parts`` with their sha256 digests (read in parallel: hashlib releases the GIL)."""
    with ThreadPoolExecutor(max(1, workers)) as ex:
        digests = list(ex.map(lambda p: _sha256_range(p.source(snapshot), p.offset, p.size), parts))
    return [replace(p, digest=d) for p, d in zip(parts, digests)]


def sha256(data: bytes) -> str:
    """``sha256:HEX`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def annotations(m, model_digest: str) -> dict[str, str]:
    """The manifest annotations of a snapshot whose manifest is ``m``
    (:class:`vllm_snapshot.manifest.Manifest`); ``model_digest`` is
    :func:`vllm_snapshot.snapkey.model_part` of its model files. Pure."""
    ann = {
        A_CREATED: m.created_at,
        A_TOOL_VERSION: m.tool_version,
        A_SNAPSHOT_DIGEST: m.digest,
        A_KIND: m.engine.kind,
        A_MODEL_PATH: m.model.path,
        A_MODEL_DIGEST: model_digest,
        A_MODEL_BYTES: str(m.model.total_bytes),
        A_ENV_SCRUBBED: "true" if getattr(m.engine, "env_scrubbed", None) else "false",
        A_MOUNTS: json.dumps([x.model_dump(mode="json") for x in m.criu.external_mounts], sort_keys=True,
                             separators=(",", ":")),
        A_STORED_BYTES: str(m.sizes.get("stored", 0)),
    }
    if m.engine.user is not None:
        ann[A_USER] = json.dumps(m.engine.user.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    if m.key is not None:
        ann[A_KEY] = m.key.value
    w = getattr(m, "weights", None)
    if w is not None:
        ann.update({A_WEIGHTS_PATH: w.path, A_WEIGHTS_BLAKE3: w.blake3, A_WEIGHTS_BYTES: str(w.size)})
    from ..host.identity import NOT_COMPARED

    for k, v in m.host.items():
        if k in NOT_COMPARED and k not in MACHINE_FIELDS:
            continue
        ann[(A_MACHINE if k in MACHINE_FIELDS else A_CLASS) + k] = v
    return ann


@dataclass(frozen=True)
class Facts:
    """What the manifest annotations say a node must be: ``kind`` (cpu/cuda), ``host_class``
    (identity fields a node of the class shares), ``machine`` (where it was built),
    ``user`` (:class:`~vllm_snapshot.manifest.EngineUser` or None), ``mounts``
    (:class:`~vllm_snapshot.manifest.ExternalMount` tuple), the model's ``model_path`` and
    ``model_digest``, and ``env_scrubbed``; ``weights_path`` / ``weights_blake3`` /
    ``weights_bytes``: the weights file the snapshot references (None when its weights are in
    its images)."""

    kind: str
    host_class: dict[str, str]
    machine: dict[str, str]
    user: object
    mounts: tuple
    model_path: str
    model_digest: str
    env_scrubbed: bool
    snapshot_digest: str
    weights_path: str | None = None
    weights_blake3: str | None = None
    weights_bytes: int | None = None


def facts(ann: dict[str, str], where: str) -> Facts:
    """Read :class:`Facts` from manifest annotations. Raises CorruptSnapshotError naming the
    annotation that is missing or malformed (``where`` names the artifact)."""
    from ..store.manifest import EngineUser, ExternalMount

    def need(key: str) -> str:
        v = ann.get(key)
        if not isinstance(v, str) or not v:
            raise CorruptSnapshotError(f"{where}: annotation {key} is missing: not a vllm-snapshot artifact "
                                       "or one made by an incompatible version")
        return v

    kind = need(A_KIND)
    if kind not in ("cpu", "cuda"):
        raise CorruptSnapshotError(f"{where}: annotation {A_KIND} is {kind!r} (cpu or cuda)")
    try:
        user = EngineUser.model_validate_json(ann[A_USER]) if A_USER in ann else None
        mounts = tuple(ExternalMount.model_validate(x) for x in json.loads(need(A_MOUNTS)))
    except (ValueError, TypeError) as e:
        raise CorruptSnapshotError(f"{where}: the engine user or mounts annotation is malformed: {e}") from e
    wpath, wb3, wbytes = ann.get(A_WEIGHTS_PATH), ann.get(A_WEIGHTS_BLAKE3), ann.get(A_WEIGHTS_BYTES)
    if wpath is not None or wb3 is not None or wbytes is not None:
        if not weights_path_ok(wpath, wb3) or not (wbytes or "").isdigit():
            raise CorruptSnapshotError(f"{where}: the weights annotations are malformed (path {wpath!r}, BLAKE3 "
                                       f"{wb3!r}, bytes {wbytes!r}; the path must be /ROOT/.weights/BLAKE3.weights)")
    return Facts(
        weights_path=wpath, weights_blake3=wb3, weights_bytes=int(wbytes) if wbytes is not None else None,
        kind=kind,
        host_class={k[len(A_CLASS):]: v for k, v in ann.items() if k.startswith(A_CLASS)},
        machine={k[len(A_MACHINE):]: v for k, v in ann.items() if k.startswith(A_MACHINE)},
        user=user, mounts=mounts, model_path=need(A_MODEL_PATH), model_digest=need(A_MODEL_DIGEST),
        env_scrubbed=ann.get(A_ENV_SCRUBBED) == "true", snapshot_digest=need(A_SNAPSHOT_DIGEST))


def build_manifest(config: bytes, parts: list[Part], ann: dict[str, str]) -> bytes:
    """The OCI image manifest (canonical JSON bytes) of an artifact whose config is
    ``config`` (the snapshot's manifest.json) and whose layers are ``parts`` (hashed)."""
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": sha256(config), "size": len(config)},
        "layers": [p.descriptor() for p in parts],
        "annotations": dict(sorted(ann.items())),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Artifact:
    """A parsed artifact manifest: its ``digest``, the ``config`` descriptor (digest, size),
    the members' layers as :class:`Part` (with digests), the manifest ``annotations``, and the
    weights file's layers (``weights``, in file order; empty when the snapshot has none)."""

    digest: str
    config_digest: str
    config_size: int
    parts: tuple[Part, ...]
    annotations: dict[str, str]
    weights: tuple[Part, ...] = ()

    @property
    def blob_bytes(self) -> int:
        """Bytes of every layer, the weights file's included (the download size, config aside)."""
        return sum(p.size for p in self.parts) + self.weights_bytes

    @property
    def weights_bytes(self) -> int:
        """Bytes of the weights file's layers (0: none)."""
        return sum(p.size for p in self.weights)


def parse_manifest(raw: bytes, where: str) -> Artifact:
    """Parse and check an artifact manifest: OCI image manifest with our artifactType and
    config media type; every layer of a known media type, with a valid digest, naming a member
    a snapshot may hold, and the layers of each member tiling it exactly. Raises
    CorruptSnapshotError naming what is wrong (``where`` names the artifact)."""
    def bad(why: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{where}: {why}", hint="push the snapshot again with `vllm-snapshot push`")

    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise bad(f"the manifest is not JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("mediaType", OCI_MANIFEST) != OCI_MANIFEST or doc.get("schemaVersion") != 2:
        raise bad("not an OCI image manifest (schemaVersion 2, " + OCI_MANIFEST + ")")
    cfg = doc.get("config") or {}
    if doc.get("artifactType") != ARTIFACT_TYPE or cfg.get("mediaType") != CONFIG_TYPE:
        raise bad(f"not a vllm-snapshot artifact (artifactType {doc.get('artifactType')!r}, "
                  f"config {cfg.get('mediaType')!r}; expected {ARTIFACT_TYPE})")
    if not _SHA.match(str(cfg.get("digest"))) or not isinstance(cfg.get("size"), int) or not 0 < cfg["size"] <= 64 << 20:
        raise bad("the config descriptor's digest or size is invalid")
    ann = doc.get("annotations") or {}
    if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
        raise bad("annotations are not a map of strings")
    parts, weights = [], []
    for i, d in enumerate(doc.get("layers") or []):
        a = d.get("annotations") or {} if isinstance(d, dict) else {}
        if isinstance(d, dict) and d.get("mediaType") == WEIGHTS_TYPE:
            try:
                part = Part(member="", offset=int(a[A_OFFSET]), size=d["size"], file_size=int(a[A_FILE_SIZE]),
                            media_type=WEIGHTS_TYPE, digest=d["digest"], weights_path=a[A_WEIGHTS_PATH],
                            weights_blake3=a[A_WEIGHTS_BLAKE3])
            except (KeyError, TypeError, ValueError) as e:
                raise bad(f"layer {i} (the weights file) lacks its path/BLAKE3/offset/size ({e})") from e
            if (not _SHA.match(str(part.digest)) or not isinstance(part.size, int) or part.size < 0 or part.offset < 0
                    or not weights_path_ok(part.weights_path, part.weights_blake3)):
                raise bad(f"layer {i} (the weights file {part.weights_path!r}) has a bad digest or size, or a path "
                          "that is not /ROOT/.weights/BLAKE3.weights")
            if weights and (part.weights_path, part.weights_blake3) != (weights[0].weights_path,
                                                                        weights[0].weights_blake3):
                raise bad(f"layer {i} names another weights file than layer {weights[0].weights_path!r}")
            weights.append(part)
            continue
        try:
            part = Part(member=a[A_MEMBER], offset=int(a[A_OFFSET]), size=d["size"], file_size=int(a[A_FILE_SIZE]),
                        media_type=d["mediaType"], digest=d["digest"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"layer {i} lacks its member/offset/size ({e})") from e
        if (part.media_type not in LAYER_TYPES or not _SHA.match(str(part.digest)) or not member_ok(part.member)
                or not isinstance(part.size, int) or part.size < 0 or part.offset < 0):
            raise bad(f"layer {i} ({part.member!r}) has an unknown media type, a bad digest or an unsafe member name")
        parts.append(part)
    if weights:  # the layers tile the file, and agree with the manifest's annotations (which pull compares
        at = 0   # with the snapshot manifest, the config)
        for p in weights:
            if p.offset != at or p.file_size != weights[0].file_size or p.offset + p.size > p.file_size:
                raise bad(f"the layers of the weights file do not tile it (offset {p.offset}, expected {at})")
            at += p.size
        if at != weights[0].file_size:
            raise bad("the layers of the weights file stop short of its size")
        w = weights[0]
        if (ann.get(A_WEIGHTS_PATH), ann.get(A_WEIGHTS_BLAKE3), ann.get(A_WEIGHTS_BYTES)) != (
                w.weights_path, w.weights_blake3, str(w.file_size)):
            raise bad("the weights layers disagree with the manifest's weights annotations")
    elif A_WEIGHTS_PATH in ann:
        raise bad(f"the manifest names a weights file ({ann[A_WEIGHTS_PATH]}) but no layer holds it")
    ends: dict[str, tuple[int, int]] = {}
    for p in parts:  # each member's layers are contiguous, in order, and add up to its size
        at, size = ends.get(p.member, (0, p.file_size))
        if p.offset != at or p.file_size != size or p.offset + p.size > size:
            raise bad(f"the layers of {p.member} do not tile it (offset {p.offset}, expected {at})")
        ends[p.member] = (at + p.size, size)
    short = [m for m, (at, size) in ends.items() if at != size]
    if short:
        raise bad(f"the layers of {short[0]} stop short of its size")
    return Artifact(digest=sha256(raw), config_digest=cfg["digest"], config_size=cfg["size"], parts=tuple(parts),
                    annotations=dict(ann), weights=tuple(weights))
