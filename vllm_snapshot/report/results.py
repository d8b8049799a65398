"""What commands return: frozen data, no live handles. :mod:`vllm_snapshot.cli.render` turns each
into a table/lines for humans or a versioned JSON object; ``to_json()`` is the JSON body.

The rows inside a result (``list``'s snapshots, ``status``'s engines, ``stop``'s engines,
``serve``'s refused and not-matching snapshots, ``prune``'s not deleted and kept ones and partial pulls) are TypedDicts, not dataclasses: a row *is* the
JSON object ``--json`` prints (and an error's ``details`` carries), read by key in
:mod:`vllm_snapshot.cli.render`, so the type costs no conversion at the JSON edge and cannot
change a byte of the output; ``tests/test_result_shapes.py`` pins each row's keys against its
declaration."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from .inspected import Inspected  # noqa: F401 - a result like the others; its own module keeps `inspect` light

if TYPE_CHECKING:  # annotations only: importing results must not build the pydantic models
    from ..store.manifest import Manifest


class SnapshotRow(TypedDict):
    """One ``list`` row (:func:`vllm_snapshot.ops.manage.describe`). ``name``, ``path`` (the
    snapshot dir); ``last_restore``: Unix seconds of its last restore here, or None. From the
    manifest, each None when it cannot be read: ``model`` (as requested at create), ``key``
    (the snapshot key, hex, or None for a snapshot made without one), ``created`` (ISO 8601),
    ``kind`` (``cpu``/``cuda``), ``sleep_level`` (0-2), ``raw_bytes``/``stored_bytes`` (images,
    bytes), ``weights`` (the weights file's path, or None: in the images) and ``weights_bytes``.
    ``compatible``: whether this host can restore it; ``why``: the reason when not ("" when it can)."""

    name: str
    path: str
    last_restore: float | None
    model: str | None
    key: str | None
    created: str | None
    kind: str | None
    sleep_level: int | None
    raw_bytes: int | None
    stored_bytes: int | None
    weights: str | None
    weights_bytes: int | None
    compatible: bool
    why: str


class EngineRow(TypedDict):
    """One ``status`` row: a registry entry (:class:`vllm_snapshot.store.registry.Entry`, its
    front-end fingerprint left out) with its ``url``. ``snapshot`` (path), ``pid`` (the engine
    root's host PID), ``supervisor_pid`` (0 when detached), ``host``, ``port``, ``started_at``
    (Unix seconds), ``mode`` (``foreground``/``detached``), ``create_time`` (the root process's
    start, Unix seconds as psutil gives it: tells a reused PID from it; 0.0 when not recorded), ``scheme`` (``http``/``https``), ``cgroup`` (the
    cgroup it runs in now, read from /proc), ``auth`` (an API key is required), ``drain_s``
    (seconds, ``stop``'s default drain), ``frontend_args`` (front-end option tokens without
    secrets, None when not recorded), ``log_file`` ("" when none), ``url``, ``merge_pages``
    (its processes are marked KSM-mergeable: restored with ``--merge-pages``, read from /proc),
    ``ksm_merged_pages`` (pages of its tree KSM has merged now)."""

    snapshot: str
    pid: int
    supervisor_pid: int
    host: str
    port: int
    started_at: float
    mode: str
    create_time: float
    scheme: str
    cgroup: str
    auth: bool
    drain_s: float
    frontend_args: tuple[str, ...] | None
    log_file: str
    url: str
    merge_pages: bool
    ksm_merged_pages: int


class StoppedRow(TypedDict):
    """One engine ``stop`` stopped: root ``pid``, ``snapshot`` (path), ``port``, ``seconds`` the
    stop took, ``drain_s`` the drain timeout applied (seconds), ``drained`` (False when it ran
    out with ``cut`` requests still in flight), ``killed`` (SIGKILL was needed after it)."""

    pid: int
    snapshot: str
    port: int
    seconds: float
    drain_s: float
    drained: bool
    cut: int
    killed: bool


class Refused(TypedDict):
    """A snapshot ``serve`` refused on the way (and recorded as unusable here): ``snapshot``
    (path), ``code`` (the error's code, e.g. ``oracle-mismatch``), ``reason`` (its first line)."""

    snapshot: str
    code: str
    reason: str


class ExitedRow(TypedDict):
    """An engine found gone without a ``stop`` (it exited or was killed on its own), as
    ``status`` shows it until ``prune``: root ``pid``, ``snapshot`` (path), ``host``, ``port``,
    ``mode`` (``foreground``/``detached``), ``started_at`` and ``noticed_at`` (Unix seconds: its
    restore, and the first command that found it gone), ``log_file`` ("" when its output went to
    the command that restored it)."""

    pid: int
    snapshot: str
    host: str
    port: int
    mode: str
    started_at: float
    log_file: str
    noticed_at: float


class PartialPull(TypedDict):
    """The partial dir an interrupted pull left for resuming (:class:`vllm_snapshot.fleet.partial.Partial`):
    ``path``, ``bytes`` of disk, ``age_s`` since it last changed, ``live`` (a pull holds it now)."""

    path: str
    bytes: int
    age_s: float
    live: bool


class NotDeleted(TypedDict):
    """A snapshot ``prune`` could not delete, left whole: ``path``, ``error`` (the error's code,
    e.g. ``environment``), ``exit_code``, ``message`` (what failed), ``hint`` (what to do, or
    None)."""

    path: str
    error: str
    exit_code: int
    message: str
    hint: str | None


class KeptUnusable(TypedDict):
    """A snapshot ``prune`` selected (a ✗ of ``list`` with ``--unusable``, or by age) and kept,
    whole: what stops it can be fixed by an operator (a mode, an owner, a missing model directory
    or weights file, ...), or ``delete`` cannot tell it is a snapshot (a symlink, a damaged
    manifest). ``path``, ``error`` (the error's code, e.g. ``corrupt-snapshot``), ``message``
    (why), ``hint`` (what to do, or None)."""

    path: str
    error: str
    message: str
    hint: str | None


class NotMatching(TypedDict):
    """A snapshot of the same model directory whose key differs: ``snapshot`` (path), ``why``
    it does not match (what differs, in words)."""

    snapshot: str
    why: str


@dataclass(frozen=True)
class Created:
    """A published snapshot: its directory and manifest."""

    snapshot: str
    manifest: Manifest

    def to_json(self) -> dict:
        return {"snapshot": self.snapshot, "manifest": self.manifest.model_dump(mode="json")}


@dataclass(frozen=True)
class Restored:
    """A restored, validated, serving engine: root PID, URL, served model name, phase
    timings (seconds), warnings (identity overrides, extra model files)."""

    snapshot: str
    pid: int
    url: str
    served_name: str
    timings: dict[str, float]
    warnings: list[str]
    detached: bool = False
    #: front-end settings applied at restore, in words, no secret values (frontend.Frontend.describe)
    frontend: tuple[str, ...] = ()
    #: the cgroup of its own a detached engine runs in (vllm_snapshot.host.cgroups), else ""
    cgroup: str = ""
    #: salted digest of the front-end options (registry only; never shown)
    frontend_fp: str = ""
    #: requires an API key (registry only)
    auth: bool = False
    #: seconds the engine lets requests in flight finish when it is stopped (registry, foreground)
    drain_s: float = 30.0
    #: CUDA: the GPU the engine runs on, ``GPU <uuid>`` and, when its state was remapped from the
    #: GPU recorded at create, ``(recorded <uuid>)`` (GpuPlacement.describe); "" on CPU
    gpu: str = ""
    #: a detached engine's log file, else ""
    log_file: str = ""
    #: restored KSM-mergeable (``--merge-pages``)
    merge_pages: bool = False

    def to_json(self) -> dict:
        return {"snapshot": self.snapshot, "pid": self.pid, "url": self.url, "timings": self.timings,
                "warnings": self.warnings, "oracle": "match", "frontend": list(self.frontend),
                "cgroup": self.cgroup, "gpu": self.gpu, "log_file": self.log_file, "merge_pages": self.merge_pages}


@dataclass(frozen=True)
class Verified:
    """Every restore check passed, images and model fully re-hashed."""

    snapshot: str
    images: int
    model_files: int
    warnings: list[str]
    #: the weights file re-hashed whole (None: the snapshot has none)
    weights: str | None = None
    #: the recorded refusal this pass cleared (``{"code", "reason", "by", "at"}``; None: none was)
    cleared: dict | None = None

    def to_json(self) -> dict:
        return {"snapshot": self.snapshot, "ok": True, "warnings": self.warnings, "weights": self.weights,
                "cleared_refusal": self.cleared}


@dataclass(frozen=True)
class Served:
    """``serve``: which ``path`` was taken (``restored`` an existing snapshot, ``pulled`` one from
    ``--registry``, or ``built`` one and restored it), the serving engine (:class:`Restored`), the snapshot key, the snapshots
    refused on the way (:class:`Refused`), warnings, every phase's duration and the total
    (seconds)."""

    path: str
    restored: Restored
    key: str
    refused: list[Refused]
    warnings: list[str]
    timings: dict[str, float]
    total_s: float
    #: snapshots of the same model directory with another key
    others: list[NotMatching] = field(default_factory=list)
    #: seconds of the restore that serves (validation to canary), without key or build
    restore_s: float = 0.0
    #: ``--registry``: seconds of the push after the engine served (None: nothing pushed); it is
    #: in ``total_s`` but not in the time to serving (``total_s - push_s``)
    push_s: float | None = None

    def to_json(self) -> dict:
        r = self.restored
        return {"path": self.path, "snapshot": r.snapshot, "key": self.key, "pid": r.pid, "url": r.url,
                "served_name": r.served_name, "detached": r.detached, "oracle": "match", "refused": self.refused,
                "warnings": [*r.warnings, *self.warnings], "timings": self.timings, "total_s": self.total_s,
                "restore_s": self.restore_s, "push_s": self.push_s,
                "serving_after_s": round(self.total_s - (self.push_s or 0.0), 3), "not_matching": self.others}


@dataclass(frozen=True)
class Listed:
    """``list`` rows (:class:`SnapshotRow`) under ``root``."""

    root: str
    rows: list[SnapshotRow]
    root_exists: bool = True
    #: why create/restore would refuse snapshots under ``root`` (a 0777 root, ...), in words
    warnings: tuple[str, ...] = ()
    #: where else snapshots are that this user cannot read (root's, for another user), in words
    elsewhere: str = ""

    def to_json(self) -> dict:
        out = {"root": self.root, "root_exists": self.root_exists, "snapshots": self.rows}
        if self.warnings:
            out["warnings"] = list(self.warnings)
        if self.elsewhere:
            out["elsewhere"] = self.elsewhere
        return out


@dataclass(frozen=True)
class Deleted:
    """The snapshot deleted, the engines stopped first, and the weights files removed with it
    (no snapshot left names them)."""

    snapshot: str
    stopped_pids: list[int]
    weights_removed: list[str] = field(default_factory=list)
    #: snapshot dirs whose unreadable manifest kept unused weights files (it might name them)
    weights_kept_for: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"deleted": self.snapshot, "stopped_pids": self.stopped_pids, "weights_removed": self.weights_removed,
                "weights_kept_for": self.weights_kept_for}


@dataclass(frozen=True)
class Pruned:
    """Paths deleted (or that would be, with ``dry_run``), kept because an engine runs, and
    leftover temp dirs removed."""

    deleted: list[str]
    kept_running: list[str]
    temp_removed: list[str]
    dry_run: bool = False
    #: weights files no snapshot names any more, removed (or that would be, with ``dry_run``)
    weights_removed: list[str] = field(default_factory=list)
    #: snapshot dirs whose unreadable manifest kept unused weights files (it might name them)
    weights_kept_for: list[str] = field(default_factory=list)
    #: partial pulls kept for resuming (never removed by prune)
    partial_pulls: list[PartialPull] = field(default_factory=list)
    #: snapshots that could not be deleted, each left whole: ``path``, ``error`` (the error
    #: code), ``exit_code``, ``message``, ``hint``; the command exits with the first one's code
    not_deleted: list[NotDeleted] = field(default_factory=list)
    #: snapshots selected and kept on purpose (:class:`KeptUnusable`): fixable, or not surely a
    #: snapshot; they leave the exit code alone
    kept_unusable: list[KeptUnusable] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0, or the exit code of the first snapshot that could not be deleted."""
        return self.not_deleted[0]["exit_code"] if self.not_deleted else 0

    def to_json(self) -> dict:
        return {"deleted": self.deleted, "kept_running": self.kept_running, "temp_removed": self.temp_removed,
                "dry_run": self.dry_run, "weights_removed": self.weights_removed, "weights_kept_for": self.weights_kept_for,
                "partial_pulls": self.partial_pulls, "not_deleted": self.not_deleted,
                "kept_unusable": self.kept_unusable}


@dataclass(frozen=True)
class Engines:
    """``status``: restored engines on this host (:class:`EngineRow`), the root PIDs of
    engine trees nobody owns (``orphans``), the paths of engine cgroups left empty
    (``empty_cgroups``) and the engines that exited or were killed without a stop (``exited``)."""

    engines: list[EngineRow]
    orphans: list[int] = field(default_factory=list)
    empty_cgroups: list[str] = field(default_factory=list)
    #: engines found gone without a stop since the last ``prune`` (:class:`ExitedRow`)
    exited: list[ExitedRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"engines": self.engines, "orphans": self.orphans, "empty_cgroups": self.empty_cgroups,
                "exited": self.exited}


@dataclass(frozen=True)
class Stopped:
    """Engines stopped (:class:`StoppedRow`, one each)."""

    stopped: list[StoppedRow]
    #: when nothing matched: what matched none (``no restored engine matches port 8000``)
    nothing: str = ""

    def to_json(self) -> dict:
        return {"stopped": self.stopped, **({"nothing": self.nothing} if self.nothing else {})}


@dataclass(frozen=True)
class Switched:
    """A port switched to another snapshot; durations in seconds. ``unchanged``: the snapshot
    already served there with these front-end options, nothing was stopped or restored."""

    snapshot: str
    port: int
    pid: int
    url: str
    stop_s: float
    restore_s: float
    switch_s: float
    stopped: list[int] = field(default_factory=list)
    host: str = "127.0.0.1"
    unchanged: bool = False
    #: the new engine took over the old one's listening socket (the port never stopped
    #: listening); ``stop_s`` is then the old engine's drain after the hand-over
    handover: bool = False
    #: why there was no hand-over ("" when there was one, or nothing served the port)
    fallback: str = ""
    #: nothing served the port: this started a new engine there, none was replaced (a mistyped
    #: ``--port`` gives a second engine)
    new_engine: bool = False

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("port")
        d["serving"] = {"snapshot": self.snapshot, "pid": self.pid, "url": self.url}
        return d


@dataclass(frozen=True)
class DoctorReport:
    """``doctor``: every check (``doctor.Check``) and the exit code they imply."""

    checks: list[Any]
    exit_code: int

    def to_json(self) -> dict:
        return {"ok": self.exit_code == 0, "exit_code": self.exit_code, "checks": [asdict(c) for c in self.checks]}


@dataclass(frozen=True)
class DemoReport:
    """``demo``: create/restore timings (seconds), the completion, the measured speed-up."""

    snapshot: str
    url: str
    completion: str
    create_timings: dict[str, float]
    restore_timings: dict[str, float]
    restore_s: float
    cold_s: float | None
    raw_bytes: int
    stored_bytes: int
    #: every cold start measured, by name (``compiled``: the demo's args with a warm compile
    #: cache; ``eager``: with ``--enforce-eager``) -> seconds; ``cold_s`` is the faster
    cold_starts: dict[str, float] = field(default_factory=dict)
    #: which model the demo ran (a title with its licence), the prompt sent, a note for the reader
    model: str = ""
    prompt: str = ""
    note: str = ""

    def to_json(self) -> dict:
        return {
            "snapshot": self.snapshot, "url": self.url, "completion": self.completion,
            "model": self.model, "prompt": self.prompt,
            "cold_starts_s": {k: round(v, 3) for k, v in self.cold_starts.items()},
            "create_timings": self.create_timings, "create_s": round(sum(self.create_timings.values()), 3),
            "restore_timings": self.restore_timings, "restore_to_validated_completion_s": round(self.restore_s, 3),
            "cold_start_to_first_completion_s": round(self.cold_s, 3) if self.cold_s else None,
            "speedup": round(self.cold_s / self.restore_s, 1) if self.cold_s else None,
            "raw_image_bytes": self.raw_bytes, "stored_image_bytes": self.stored_bytes,
        }


@dataclass(frozen=True)
class Pushed:
    """``push``: the snapshot pushed to ``image`` (with the tag), the artifact's manifest
    ``digest``, bytes of every layer and of those sent (layers the target had are skipped),
    blob counts, ``seconds`` of the transfer, the signature tag (or None), the digests of
    blobs the target held damaged and that were written again (``repaired``: an image
    layout's, hashed before being skipped), ``warnings`` (those, a body limit met...)."""

    snapshot: str
    image: str
    digest: str
    bytes: int
    sent_bytes: int
    blobs: int
    skipped: int
    seconds: float
    signature: str | None
    repaired: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**asdict(self), "MB_s": round(self.bytes / 1e6 / max(self.seconds, 1e-9), 1)}


@dataclass(frozen=True)
class Pulled:
    """``pull``: the published snapshot directory, the ``image`` and artifact ``digest`` it came
    from, the layer ``bytes``, ``seconds`` (manifest to publish), the fingerprint of the key
    that verified its signature (or None), ``fetched_bytes`` downloaded now, ``reused_blobs``
    / ``reused_bytes`` an interrupted pull of the same artifact had verified already (resumed),
    warnings (leftovers removed), ``already``: True when the store held this artifact (the same
    manifest digest, by its pull record) as ``snapshot`` and nothing was downloaded.

    The weights file (a CPU snapshot's, placed at its recorded path ``weights``; None when the
    snapshot has none): ``weights_bytes`` its size, ``weights_fetched_bytes`` downloaded now,
    ``weights_reused``: ``present`` (a file at the path already held those bytes: no weights
    layer fetched), ``linked`` (hard-linked from this store's ``.weights``), ``resumed`` (part of
    it an interrupted pull had verified), None (downloaded whole). ``bytes`` counts every layer,
    the weights file's included; ``fetched_bytes`` + ``reused_bytes`` = ``bytes`` (the weights
    bytes not downloaded are in ``reused_bytes``, their layers in ``reused_blobs``)."""

    snapshot: str
    image: str
    digest: str
    bytes: int
    seconds: float
    verified_by: str | None
    fetched_bytes: int = 0
    reused_blobs: int = 0
    reused_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    already: bool = False
    weights: str | None = None
    weights_bytes: int = 0
    weights_fetched_bytes: int = 0
    weights_reused: str | None = None

    def to_json(self) -> dict:
        """The fields, and ``MB_s`` (layer bytes per second; 0 when nothing was downloaded)."""
        return {**asdict(self), "MB_s": 0.0 if self.already else round(self.bytes / 1e6 / max(self.seconds, 1e-9), 1)}


@dataclass(frozen=True)
class ImageInspected:
    """``inspect IMAGE``: what the artifact's manifest alone says (no blob is read): its
    ``digest``, layer count and bytes (every layer, the weights file's included), the
    annotations (docs/oci-format.md), and the weights file's layers (``weights``: path, blake3,
    bytes, layers, digests; None when the snapshot has none)."""

    image: str
    digest: str
    blobs: int
    bytes: int
    annotations: dict[str, str]
    weights: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)
