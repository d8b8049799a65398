"""The management commands: ``list`` rows, ``delete``, ``prune``, ``status``, ``stop``,
``switch``. Sequencing only; side effects through :class:`Tools`."""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

from ..host import identity
from ..store import layout
from ..errors import (BusyError, CorruptSnapshotError, IncompatibleHostError, ModelChangedError, SnapshotError, UsageError,
                      first_lines, from_os_error, q)
from ..store.registry import Entry
from ..report.results import (Deleted, EngineRow, Engines, KeptUnusable, Listed, NotDeleted, Pruned, SnapshotRow, Stopped,
                              StoppedRow)
from ..effects.protocols import RuntimeTools, StoreTools
from ..effects.tools import Tools, local_tools


def describe(snapshot: Path, tools: Tools | None = None) -> SnapshotRow:
    """One ``list`` row (:class:`~vllm_snapshot.report.results.SnapshotRow`): name, path, model,
    key, created, kind, sleep level, raw/stored bytes, whether this host can restore it
    (``compatible`` + ``why``: a refusal ``serve`` recorded since its last restore, else host
    identity and model files), last restore (unix s or None); None for what an unreadable
    manifest cannot say.

    Cheap by design (a ``list`` of many snapshots stays fast): trust checks, manifest, layout
    (stat), host identity (probed once per command, not per row) and the model's stat; image
    checksums, mapped-file hashes and the port are left to ``verify``/``restore``."""
    return _judge(snapshot, tools or local_tools())[0]


def lost_for_good(e: BaseException) -> bool:
    """The one judgement of ``prune --unusable``: True when the failed check ``e`` (one of
    :func:`describe`'s) means the snapshot can never be restored here as it is -- a host
    identity that is not this host's (IncompatibleHostError), model or weights files whose
    *content* differs (a ModelChangedError whose ``details["changed"]`` names files); False for
    what an operator can fix (modes, owners, trust of the root or the snapshot, a missing or
    unreadable model directory, model file or weights file, a file added to the model, an
    unreadable manifest, anything else). A refusal recorded by restore/serve/verify is judged
    by :func:`_judge`. Pure."""
    if isinstance(e, IncompatibleHostError):
        return True
    if isinstance(e, ModelChangedError):
        d = e.details if isinstance(e.details, dict) else {}
        return bool(d.get("changed"))
    return False


def _judge(snapshot: Path, t: Tools) -> tuple[SnapshotRow, SnapshotError | None, bool]:
    """:func:`describe`'s row, the error of the first fixable problem found (None: none), and
    whether the snapshot can never be restored here as it is (:func:`lost_for_good`, or a
    refusal a restore/serve/verify recorded; never while a fixable problem is found: it may be
    what the refusal met). Every check runs also for a refused snapshot (a stat each)."""
    row: dict = {"name": snapshot.name, "path": str(snapshot), "last_restore": t.store.last_restore(snapshot)}
    try:
        m = t.files.open_snapshot(snapshot)
    except Exception as e:  # noqa: BLE001 - a broken snapshot is still listed, as incompatible
        row.update(model=None, key=None, created=None, kind=None, sleep_level=None, raw_bytes=None, stored_bytes=None,
                   weights=None, weights_bytes=None, compatible=False, why=first_lines(e))
        return row, _as_error(e), False  # type: ignore[return-value]
    row.update(model=m.model.requested, created=m.created_at, kind=m.engine.kind, sleep_level=m.engine.sleep_level,
               raw_bytes=m.sizes["raw"], stored_bytes=m.sizes["stored"], key=m.key.value if m.key else None,
               weights=m.weights.path if m.weights else None, weights_bytes=m.weights.size if m.weights else None,
               compatible=True, why="")
    found: Exception | None = None
    try:
        hard = [d for d in identity.compare(m.host, t.host.host_identity(m.engine.kind),
                                            machine=t.files.pulled_from(snapshot) is None) if not d.overridden]
        if hard:
            raise IncompatibleHostError("this host differs: " + "; ".join(map(str, hard)))
        t.model.verify_model(Path(m.model.path), m.model.files, "quick")
        t.files.check_weights(m)  # by stat (re-hashed only when it changed)
    except Exception as e:  # noqa: BLE001
        found = e
        row.update(compatible=False, why=first_lines(e))
    refused = t.store.refusal(snapshot)
    if refused is not None:  # `serve` restored it and it failed (oracle, CRIU, ...): say so
        row.update(compatible=False, why=f"refused by {refused.get('by', 'serve')}: {refused['reason']}")
    if found is not None and not lost_for_good(found):
        return row, _as_error(found), False  # type: ignore[return-value]
    return row, None, found is not None or refused is not None  # type: ignore[return-value]


def _as_error(e: BaseException) -> SnapshotError:
    """``e`` as a SnapshotError (an OSError as :func:`~vllm_snapshot.errors.from_os_error` words it)."""
    if isinstance(e, SnapshotError):
        return e
    return (from_os_error(e) if isinstance(e, OSError) else None) or SnapshotError(first_lines(e))


def list_snapshots(root: Path, tools: Tools | None = None) -> Listed:
    """``list``: a :func:`describe` row per published snapshot under ``root``; ``warnings``
    says why create and restore would refuse snapshots there (a root writable by
    group/others, ...), in create's words, and names each directory there whose manifest was
    lost (``images/`` and no manifest: not a row, nothing says what it is)."""
    t = tools or local_tools()
    if t.host.path_exists(root) and not Path(root).is_dir():
        raise UsageError(f"the snapshot root {root} is not a directory", hint="check --root / VLLM_SNAPSHOT_ROOT")
    problem = t.store.root_problem(root)
    lost = [f"{d} holds {layout.IMAGES}/ but no {layout.MANIFEST}: a snapshot whose manifest was lost, which "
            f"cannot be listed or restored; `vllm-snapshot inspect {q(d)}` shows what is left, "
            f"`rm -r {q(d)}` removes it" for d in t.store.without_manifest(Path(root))]
    return Listed(str(root), [describe(p, t) for p in t.store.list_snapshots(root)], t.host.path_exists(root),
                  ((f"{_in_words(problem)}; create and restore refuse snapshots below it",) if problem else ())
                  + tuple(lost))


def _in_words(e: SnapshotError) -> str:
    """``e``'s message with its hint, on one line: ``MESSAGE (fix: HINT)``."""
    return e.message + (f" (fix: {e.hint})" if e.hint else "")


def _engines_of(store: StoreTools, rt: RuntimeTools, snapshot: Path, entries: list[Entry] | None = None) -> list[Entry]:
    """Registered engines (``entries``, default the registry's) restored from ``snapshot``,
    compared by canonical path (a symlinked root or ``..`` names the same snapshot)."""
    me = store.canonical(snapshot)
    return [e for e in (rt.engines() if entries is None else entries) if store.canonical(Path(e.snapshot)) == me]


def delete(snapshot: Path, force: bool = False, tools: Tools | None = None) -> Deleted:
    """Delete ``snapshot`` under its exclusive lock. Refuses (BusyError) while an engine
    restored from it runs, unless ``force`` (then they are stopped first). Raises UsageError
    (missing, a file, a directory without a manifest), CorruptSnapshotError (a manifest that is
    not a snapshot's, a damaged snapshot), EnvironmentProblem (a read-only filesystem, a mount
    point: nothing was deleted)."""
    t = tools or local_tools()
    snapshot = t.store.canonical(snapshot)
    if not t.host.path_exists(snapshot / layout.MANIFEST):
        if not t.host.path_exists(snapshot):
            raise UsageError(f"{snapshot} does not exist")
        if not snapshot.is_dir():  # the exit-code rule: a file is a usage error, as for inspect
            raise UsageError(f"{snapshot} is not a directory (a snapshot is a directory)")
        # a usage error, as a file is: a path that names no snapshot (a damaged snapshot, with its
        # manifest, is a corrupt one: store.delete)
        raise UsageError(f"{snapshot} is not a snapshot (it has no {layout.MANIFEST}); nothing was deleted",
                         hint="check the path (`vllm-snapshot list` names the snapshots); remove other directories "
                              "with rm, not vllm-snapshot")
    running = _engines_of(t.store, t.runtime, snapshot)
    if running and not force:
        raise BusyError(f"engines restored from {snapshot} are running: PIDs {[e.pid for e in running]}",
                        hint="stop them (vllm-snapshot stop), or pass --force")
    for e in running:
        t.runtime.stop_engine(e)
    with t.store.snapshot_lock(snapshot, shared=False):
        t.store.delete_snapshot(snapshot)
    # the weights file it mapped goes with the last snapshot that names it (counted from the manifests)
    gone = t.store.remove_unused_weights(snapshot.parent)
    return Deleted(str(snapshot), [e.pid for e in running], [str(p) for p in gone], t.store.weights_blocked(snapshot.parent))


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"2w"`` -> seconds. Raises UsageError."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise UsageError(f"--older-than {text!r}: expected a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def prune(root: Path, keep: int | None, older_than_s: float | None, dry_run: bool,
          tools: Tools | None = None, unusable: bool = False) -> Pruned:
    """Select snapshots under ``root`` beyond the ``keep`` newest per model (those a restore or
    ``serve`` refused here count after the others; ties go to the last restored), or older than
    ``older_than_s`` seconds (with both: beyond the ``keep`` newest *and* older: ``--keep`` always
    keeps the newest, as restic's ``--keep-last`` with ``--keep-within`` does), and/or
    (``unusable``) those that can never be restored here as they are (a refusal a restore,
    ``serve`` or ``verify`` recorded, another host's identity, model or weights files whose
    content changed: :func:`lost_for_good`); delete them unless ``dry_run``; skip those with
    running engines. A ✗ of ``list`` an operator can fix (modes, owners, trust, a missing model
    directory or weights file, an unreadable manifest, ...) is kept and listed in
    ``kept_unusable`` with why and what to do, as is any selected directory ``delete`` would
    refuse as not surely a snapshot (a symlink, never followed; a damaged manifest: in
    ``delete``'s words), in a dry run as in a real one. A snapshot that cannot be deleted (a
    mount point in it, busy, read-only, denied: :func:`vllm_snapshot.store.store.delete`'s
    EnvironmentProblem, or such an OSError) is left whole and listed in ``not_deleted`` with
    why; the others still go. Always removes what killed commands left (temp dirs of crashed
    creates, staging dirs of killed restores, stale lock files); without
    ``keep``/``older_than_s``/``unusable`` only that. Lists, and keeps, the partial dirs
    interrupted pulls left for resuming (``.pull-*``: the next pull removes stale ones).

    Raises the root's EnvironmentProblem (exit 11), deleting nothing at all, when create and
    restore would refuse snapshots under ``root`` (writable by group/others, another owner:
    ``StoreTools.root_problem``)."""
    t = tools or local_tools()
    problem = t.store.root_problem(root)
    if problem is not None:  # what lies below an unsafe root may have been swapped: touch none of it
        raise type(problem)(f"refusing to prune {root}: {problem.message}; nothing was deleted", hint=problem.hint,
                            details=problem.details)
    rows = []
    for p in t.store.list_snapshots(root) if (keep is not None or older_than_s is not None) else []:
        try:
            m = t.files.open_snapshot(p)
            rows.append((m.model.path, _dt.datetime.fromisoformat(m.created_at).timestamp(), p))
        except (SnapshotError, OSError, ValueError):  # unreadable snapshots are left to `delete`
            continue
    victims: set[Path] = set()
    aged: set[Path] = {p for _, _, p in rows}
    if keep is not None:
        # kept first: those not refused here, then the newest, then the last restored (a trial:
        # `--keep 2` kept a copy restore had refused and dropped the usable one made the same second)
        by_model: dict[str, list] = {}
        for model, created, p in rows:
            rank = (t.store.refusal(p) is None, created, t.store.last_restore(p) or 0.0, str(p))
            by_model.setdefault(model, []).append((rank, p))
        aged = {p for items in by_model.values() for _, p in sorted(items, key=lambda x: x[0], reverse=True)[keep:]}
    if older_than_s is not None:
        now = t.clock.now()
        aged &= {p for _, created, p in rows if now - created > older_than_s}
    if keep is not None or older_than_s is not None:
        victims |= aged
    held: dict[Path, SnapshotError] = {}  # ✗ only for what an operator can fix: kept, with why
    for p in t.store.list_snapshots(root) if unusable else []:
        if p in victims:
            continue
        _row, fixable, lost = _judge(p, t)
        if fixable is not None:
            held[p] = fixable
        elif lost:
            victims.add(p)
    deleted, kept, failed, kept_unusable = [], [], [], []

    def keep_for(p: Path, err: SnapshotError) -> None:
        kept_unusable.append(KeptUnusable(path=str(p), error=err.code, message=err.message, hint=err.hint))

    for p in sorted(victims | set(held)):
        refused = t.store.delete_refusal(p)  # asked in a dry run too: both say the same
        if refused is not None or p in held:
            keep_for(p, refused or held[p])
            continue
        if _engines_of(t.store, t.runtime, p):
            kept.append(str(p))
            continue
        if not dry_run:
            try:
                with t.store.snapshot_lock(p, shared=False):
                    t.store.delete_snapshot(p)
            except CorruptSnapshotError as e:  # no longer surely a snapshot (changed since asked): never removed
                keep_for(p, e)
                continue
            except (SnapshotError, OSError) as e:  # one that cannot go (mounted, busy, read-only): the rest still go
                err = e if isinstance(e, SnapshotError) else from_os_error(e)
                if err is None:
                    raise
                failed.append(NotDeleted(path=str(p), error=err.code, exit_code=err.exit_code, message=err.message,
                                         hint=err.hint))
                continue
        deleted.append(str(p))
    temps = t.store.reclaim(root, dry_run=True) if dry_run else [str(x) for x in t.store.clean_stale_temps(root)] + t.store.reclaim(root)
    temps += t.runtime.forget_exited_engines(dry_run)  # what `status` said died on its own: said, now forgotten
    weights_gone = [str(p) for p in t.store.remove_unused_weights(root, dry_run=dry_run)]
    return Pruned(deleted, kept, temps, dry_run, weights_gone, t.store.weights_blocked(root), t.fleet.partial_pulls(root),
                  failed, kept_unusable)


def status(tools: Tools | None = None) -> Engines:
    """``status``: the registry's live engines, each with its URL and the cgroup it runs in
    now (read from /proc: detached engines have one of their own), the root PIDs of engine
    trees nobody owns (a killed restore's), the engine cgroups no process is in any more (an
    engine that exited or was killed) and the engines found gone without a stop since the last
    prune: ``prune`` removes the first two and forgets the last."""
    t = tools or local_tools()
    rows: list[EngineRow] = []
    for e in t.runtime.engines():
        marked, merged = t.runtime.merge_of(e.pid)
        rows.append({**{k: v for k, v in e.__dict__.items() if k != "frontend"}, "url": e.url,
                     "cgroup": t.runtime.cgroup_of(e.pid), "merge_pages": marked, "ksm_merged_pages": merged})
    return Engines(rows, t.runtime.orphan_pids(), t.runtime.empty_engine_cgroups(), t.runtime.exited_engines())


def stop_engines(snapshot: Path | None, port: int | None, tools: Tools | None = None,
                 pid: int | None = None, drain_s: float | None = None) -> Stopped:
    """Stop registered engines: every one restored from ``snapshot`` (clones included), those
    on ``port`` (on any host address), or the one whose root PID is ``pid``; wait until their
    processes are gone. Each drains first (no new connection; requests in flight finish) for at
    most ``drain_s`` seconds (default: the drain timeout it was restored with); requests still
    in flight then are cut and counted (``cut`` in each row). None matching is no error (as
    ``systemctl stop``: the wanted state holds): nothing stopped, ``nothing`` says what matched
    none. Raises UsageError for a PID of an engine's tree that is not its root (naming the root)."""
    t = tools or local_tools()
    entries = t.runtime.engines()
    mine = _engines_of(t.store, t.runtime, snapshot, entries) if snapshot is not None else []
    match = [e for e in entries
             if e in mine or (port is not None and e.port == port) or (pid is not None and e.pid == pid)]
    if not match:
        what = f"snapshot {snapshot}" if snapshot else (f"port {port}" if port is not None else f"PID {pid}")
        owner = t.runtime.engine_owning(pid, entries) if pid is not None else None
        if owner is not None:  # a child of an engine tree, or the supervisor of a foreground one
            raise UsageError(f"PID {pid} is not an engine root: it belongs to the engine with root PID {owner.pid} "
                             f"({owner.snapshot}, port {owner.port})", hint=f"vllm-snapshot stop --pid {owner.pid}")
        return Stopped([], nothing=f"no restored engine matches {what}")
    rows: list[StoppedRow] = []
    for e in match:
        r = t.runtime.stop_engine(e, drain_s)
        rows.append({"pid": e.pid, "snapshot": e.snapshot, "port": e.port, "seconds": round(r.seconds, 3),
                     "drain_s": e.drain_s if drain_s is None else drain_s, "drained": r.drained, "cut": r.cut,
                     "killed": r.killed})
    return Stopped(rows)
