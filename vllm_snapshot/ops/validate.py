"""Every check a restore makes before CRIU, in the order of :mod:`.restore`'s module doc
(:func:`validate`, shared by ``verify``, ``list``, ``serve`` and ``switch``), and ``verify``
(the same checks plus every image checksum)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..checkpoint import carry, criu
from ..host import identity, privilege
from ..store import layout
from ..errors import (BusyError, CorruptSnapshotError, EnvironmentProblem, IncompatibleHostError, ModelChangedError,
                      SnapshotError, UsageError, combined, q)
from ..store.manifest import Manifest
from ..report.results import Verified
from ..effects.protocols import HostTools, ModelTools, SnapshotFiles
from ..effects.tools import Tools, local_tools
from .create import check_access


#: Restore's warning for a snapshot made before engines dropped privileges (no engine user).
LEGACY_ROOT_NOTE = ("this snapshot was made before engines ran unprivileged: its engine tree runs as root "
                    "with every capability; re-create it to run as an unprivileged user")


def validate(snapshot: Path, verify_model: str = "quick", allow: frozenset[str] = frozenset(),
             check_images: bool = False, port: tuple[str, int] | None = None,
             tools: Tools | None = None, pins: list | None = None) -> tuple[Manifest, list[str]]:
    """Every check a restore makes before CRIU, in the order of the module doc (the GPU
    placement included, not whether that GPU is free: the restore decides that under its lock); ``port``
    (host, port) is probed before the model files are re-hashed; ``check_images`` adds every
    image checksum (``verify``); ``pins`` receives the model files' stats as the check saw
    them (:func:`vllm_snapshot.store.model_digest.stat_pins`). Returns (manifest, warnings). Raises UsageError,
    CorruptSnapshotError, IncompatibleHostError, ModelChangedError, BusyError,
    EnvironmentProblem."""
    t = tools or local_tools()
    return validate_roles(t.host, t.model, t.files, snapshot, verify_model, allow, check_images, port, pins)


#: The refusals :func:`validate_roles` collects instead of stopping at the first: each a
#: problem of the snapshot against this host an operator fixes by hand (not an interruption).
COLLECTED = (UsageError, CorruptSnapshotError, IncompatibleHostError, ModelChangedError, BusyError, EnvironmentProblem)


def validate_roles(host: HostTools, model: ModelTools, files: SnapshotFiles, snapshot: Path, verify_model: str = "quick",
                   allow: frozenset[str] = frozenset(), check_images: bool = False,
                   port: tuple[str, int] | None = None, pins: list | None = None,
                   gpu: list | None = None) -> tuple[Manifest, list[str]]:
    """:func:`validate` over the three roles it uses; ``gpu`` receives the CUDA snapshot's
    :class:`~vllm_snapshot.checkpoint.gpu.GpuPlacement` (nothing for a CPU snapshot). Once the
    manifest is read, every check runs even when an earlier one refused (host identity, engine
    user, mounts, images, weights, open files, carried files, model files, access), and all
    their refusals are raised as one (:func:`vllm_snapshot.errors.combined`: the first one's exit code) -- except a
    port in use, which stops the checks there (nothing is re-hashed for a port that is taken;
    the port is not probed at all once a check before it refused)."""
    snapshot = snapshot.absolute()
    m = files.open_snapshot(snapshot)
    try:
        criu.check_flags(m.criu.flags)
    except ValueError as e:
        raise CorruptSnapshotError(f"{snapshot}: the manifest's CRIU flags are not restorable by this tool: {e}",
                                   hint="re-create the snapshot with this version of vllm-snapshot") from e
    found: list[SnapshotError] = []

    @contextmanager
    def collect() -> Iterator[None]:
        try:
            yield
        except COLLECTED as e:
            found.append(e)

    here = host.host_identity(m.engine.kind)
    pulled = files.pulled_from(snapshot)  # pulled from a registry: any machine of its host class restores it
    try:
        diffs = identity.compare(m.host, here, allow, machine=pulled is None)
    except ValueError as e:
        raise UsageError(str(e), hint="--allow-mismatch takes " + " or ".join(sorted(identity.OVERRIDABLE))
                         + "; anything else that differs needs a snapshot made on this host") from e
    warnings = [f"identity override: {d}" for d in diffs if d.overridden]
    hard = [d for d in diffs if not d.overridden]
    if hard:
        found.append(IncompatibleHostError(
            "this host differs from the one the snapshot was created on:\n  " + "\n  ".join(map(str, hard)),
            hint="restore on a matching host, or re-create the snapshot here",
            details=[d.__dict__ for d in hard]))
    if "gpu_uuid_used" in m.host:  # the GPU its state goes onto: the recorded one, else one of its model, remapped
        from ..checkpoint import gpu as gpus

        recorded = m.host["gpu_uuid_used"]
        # the recorded GPU here: known from the driver's /proc files, without running nvidia-smi
        with collect():
            placed = (gpus.GpuPlacement(recorded, recorded) if recorded in host.gpu_uuids()
                      else gpus.place(m.host, host.gpu_slots()))
            if gpu is not None and placed is not None:
                gpu.append(placed)
    if m.engine.user is None:
        missing = files.caps_missing(snapshot, m)
        if missing:  # CRIU would log "Unable to restore capabilities" and hang (docs/operations.md)
            found.append(EnvironmentProblem(
                f"this snapshot's engine runs as root with capabilities this restore does not have "
                f"({', '.join(map(privilege.cap_name, missing))}; e.g. a systemd CapabilityBoundingSet=): CRIU "
                "could not give them back", hint="re-create the snapshot (engines now run unprivileged, with no capability), "
                                       "or restore it outside the narrower bounding set"))
        warnings.append(LEGACY_ROOT_NOTE)
    else:
        who = host.user_problems(m.engine.user)
        if who:
            u = m.engine.user
            found.append(IncompatibleHostError(
                f"the snapshot's engine runs as {u.name} (uid {u.uid}, gid {u.gid}), which is not the same user "
                "on this host:\n  " + "\n  ".join(who),
                hint=f"give {u.name} uid {u.uid} and gid {u.gid} again (e.g. useradd --system --uid {u.uid} "
                     f"--gid {u.gid} {q(u.name)}), or re-create the snapshot on this host",
                details={"engine_user": who}))
    mount_problems = host.check_external_mounts(m.criu.external_mounts)
    if mount_problems:
        found.append(IncompatibleHostError(
            "mounts the snapshot binds from the host differ:\n  " + "\n  ".join(mount_problems),
            hint="mount the same file systems at the same places, or re-create the snapshot",
            details={"mounts": mount_problems}))
    if port is not None and not found:  # a port matters only to a snapshot that could restore here
        try:
            host.port_free(*port)
        except BusyError as e:  # transient: nothing is re-hashed for it; what was found so far is said too
            raise combined([*found, e]) from e
    if check_images:
        with collect():
            files.verify_images(snapshot, m)
    # the weights file the engine maps (a CPU snapshot's weights are not in its images):
    # missing or changed refuses now, naming it (CRIU would map whatever is at that path)
    with collect():
        files.check_weights(m, full=verify_model == "full")
    problems = files.check_tree_files(m)
    if problems:
        found.append(IncompatibleHostError(
            "files the engine had open or mapped changed since the snapshot was created:\n  " + "\n  ".join(problems),
            hint="restore with the same venv/libraries, or re-create the snapshot"))
    # files the snapshot carries: their stored copies verified (a damaged one refuses, naming
    # the file); missing or replaceable ones are put back right before CRIU; what cannot be
    # (another owner's file differs, a live process holds a differing one) refuses now
    with collect():
        refused = carry.refusal(files.plan_carried(snapshot, m))
        if refused is not None:
            raise refused
    if pins is not None:  # before the check: a change made after it shows in the stat
        pins.extend(model.model_stats(Path(m.model.path), m.model.files))
    with collect():
        model.verify_model(Path(m.model.path), m.model.files, verify_model)  # added files: refused or ignored
    if m.engine.user is not None:  # as create refuses: a level-2 wake reloads the weights as that user
        model_dir = Path(m.model.path)
        with collect():
            check_access(m.engine.user, model_dir, {"model": host.unreadable_by(m.engine.user, [model_dir])})
    if found:
        raise combined(found)
    return m, warnings


def raise_code_changed(problems: list[str]) -> None:
    """Raise IncompatibleHostError when the code identity check found ``problems``."""
    if problems:
        raise IncompatibleHostError(
            "Python files the engine imports from changed since the snapshot was created "
            "(a restored engine would import them):\n  " + "\n  ".join(problems),
            hint="reinstall the recorded versions (`vllm-snapshot inspect` lists them), or re-create the snapshot",
            details={"code": problems})


@contextmanager
def damaged_hint(snapshot: Path) -> Iterator[None]:
    """A CorruptSnapshotError (exit 5: an image failing its checksum, a manifest that is not
    JSON, ...) raised without a hint gets one: delete and re-create, or pull again."""
    try:
        yield
    except CorruptSnapshotError as e:
        if e.hint is None:
            e.hint = layout.damaged_hint(snapshot)
        raise


def verify(snapshot: Path, allow: frozenset[str] = frozenset(), tools: Tools | None = None) -> Verified:
    """``verify``: :func:`validate` with every image checksum and a full model re-hash, under
    the snapshot's shared lock. Returns :class:`Verified`. A pass clears a refusal recorded for
    what it re-checks (:data:`VERIFY_RECHECKS`); a CorruptSnapshotError (a checksum, a file) of a
    directory with a manifest is recorded as a refusal ``by`` verify, as a refused restore
    records it (``list`` shows ✗, ``prune --unusable`` selects it)."""
    t = tools or local_tools()
    snapshot = t.store.canonical(snapshot)
    try:
        with damaged_hint(snapshot), t.store.snapshot_lock(snapshot, shared=True):
            m, warnings = validate_roles(t.host, t.model, t.files, snapshot, "full", allow, check_images=True)
            raise_code_changed(t.files.check_code(snapshot, m))
            try:  # what it re-checked passes now (e.g. the weights file put back): list stops showing the old ✗
                cleared = t.store.clear_refusal(snapshot, VERIFY_RECHECKS)
            except OSError:  # bookkeeping only
                cleared = None
    except CorruptSnapshotError as e:
        if t.host.path_exists(snapshot / layout.MANIFEST):  # a snapshot, damaged (not some other directory)
            try:
                t.store.record_refusal(snapshot, e.code, e.message.splitlines()[0], by="verify")
            except OSError:  # bookkeeping only
                pass
        raise
    return Verified(str(snapshot), len(m.images), len(m.model.files), warnings, m.weights.path if m.weights else None,
                    cleared)


#: The refusal codes whose causes ``verify`` re-checks in full (host, mounts, files, images,
#: model, weights, code): a pass clears such a recorded refusal. An oracle mismatch, a CRIU or an
#: engine failure is re-checked only by a restore, which clears any refusal when it serves.
VERIFY_RECHECKS = frozenset({"incompatible-host", "model-changed", "corrupt-snapshot"})


#: ``details["stage"]`` of an EngineError raised after the oracle matched, while the engine
#: started its HTTP server: what fails there is the front-end options' (TLS, ...) or the host's,
#: not the snapshot's, so ``serve`` does not hold it against the snapshot.
