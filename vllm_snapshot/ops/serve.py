"""``serve MODEL [engine args]``: restore the snapshot made for exactly this model, these args and
this host when a valid one exists; build one (a cold start, the oracle, a dump -- ``create``)
when none does or the one found is refused; either way the port is bound only after the oracle
matched (it is :func:`vllm_snapshot.ops.restore.restore` that serves).

Steps, in order (each side effect through :class:`Tools`):

1. preconditions: root, engine args that restore could never use refused, model resolved,
   ``host:port`` free -- before anything is hashed or built;
2. the **key** (:mod:`vllm_snapshot.store.snapkey`): engine args normalized (from a manifest made with
   the same raw args and vLLM, else by vLLM's parser), model content digest (files whose stat a
   manifest recorded keep that digest), scrubbed environment, host identity;
3. under the key's lock (a second ``serve`` of the same key waits, saying for whom): the
   snapshots under the root with this key, newest first, each restored as ``restore`` does;
   a refused one is recorded as unusable (``list`` shows why) and the next is tried;
4. none left: with ``--no-build`` refuse; else ``create`` a new snapshot
   (``<model>-<key prefix>``) and restore it.

Model files follow the one policy of :mod:`vllm_snapshot.store.model_digest`: what cannot change the
engine (dot-directories, docs) is not in the key; a weight, config or tokenizer file added to
the model directory since a snapshot of it was made refuses (naming it; ``--rebuild`` builds a
snapshot of the model as it is now) instead of a silent cold rebuild.

Refusals that make ``serve`` move on to another snapshot or build: host identity, model files,
corrupt snapshot, oracle mismatch, CRIU or engine failure at restore -- what lasts: the snapshot
will not restore here as it is, and the operator (at 3 a.m., under a unit that restarts serve)
wants the service back, validated, rather than a refusal loop. ``serve`` prints what differed
(every line of the refusal, with its hint) and that it builds a *replacement* of the same key,
keeping the refused one (✗ in ``list``). What passes by itself costs no rebuild: files the
snapshot carries that are missing or rotated in the engine user's compile cache are put back
(:mod:`vllm_snapshot.checkpoint.carry`; before, a cleaned cache made every restore refuse and
serve built a duplicate of the same key), and a differing carried file that a live process
holds, a busy port, a usage error, a missing host prerequisite or an interruption stop ``serve``
as they stop ``restore``, naming the cause, with nothing recorded against the snapshot. After
:data:`MAX_REFUSED_PER_KEY` refused snapshots of one key ``serve`` stops building (a host that
refuses every snapshot would otherwise fill the disk, one cold start per restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..supervise import frontend
from ..store import oracle, snapkey
from ..store.archive import DEFAULT_COMPRESSION, Compression
from ..errors import (
    CorruptSnapshotError,
    CriuError,
    EngineError,
    EnvironmentProblem,
    IncompatibleHostError,
    ModelChangedError,
    OracleMismatchError,
    SnapshotError,
    UsageError,
    first_lines,
)
from ..store.manifest import Manifest, ModelFile
from ..store.model_digest import ignored, kind
from ..report.progress import Reporter
from .restore import SERVER_START
from ..report.results import NotMatching, Refused, Served
from ..host.privilege import DEFAULT_USER
from ..store.registry import DRAIN_S
from ..host.envpolicy import scrubbed_env
from ..effects.protocols import HostTools, ModelTools, SnapshotFiles, StoreTools
from ..effects.handles import Engine
from ..effects.tools import Tools, local_tools
from ..engine.args import arg_value, check_engine_args, memoizable
from .create import weights_mode, CreateRequest, check_cpu_kv_cache, check_keep_env, create
from .restore import RestoreRequest, restore

#: Errors that mean "this snapshot cannot serve here": record it, try the next, or build.
REFUSALS = (IncompatibleHostError, ModelChangedError, CorruptSnapshotError, OracleMismatchError, CriuError,
            EngineError)
#: Refused snapshots of one key after which ``serve`` stops building new ones.
MAX_REFUSED_PER_KEY = 2


@dataclass
class ServeRequest:
    """Inputs of :func:`serve`: the model and ``vllm serve`` engine args, where snapshots live
    (``root``), where to serve, and how to build one (as ``create``). ``build``: ``auto``
    (restore, else build), ``never`` (``--no-build``), ``always`` (``--rebuild``)."""

    model: str
    root: Path
    engine_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    detach: bool = False
    log_file: Path | None = None
    verify_model: str = "quick"
    build: str = "auto"
    oracle_prompt: str = oracle.DEFAULT_PROMPT
    sleep_level: int = 2
    compression: Compression = field(default_factory=lambda: Compression.parse(DEFAULT_COMPRESSION))
    keep_env: tuple[str, ...] = ()
    engine_log: Callable[[bytes], None] | None = None
    create_log: Callable[[bytes], None] | None = None
    #: front-end option tokens (:mod:`vllm_snapshot.supervise.frontend`), applied at restore: not part
    #: of the key, never given to a build
    frontend: tuple[str, ...] = ()
    #: the unprivileged user a build's engine runs as (its HOME is in the engine environment,
    #: hence in the key)
    user: str = DEFAULT_USER
    #: seconds the engine lets requests in flight finish when stopped (RestoreRequest.drain_s)
    drain_s: float = DRAIN_S
    #: ``--registry``: a :class:`vllm_snapshot.ops.fleet.RegistryCache` (the key is the tag):
    #: with no usable local snapshot of the key, pull it when the repository has it and this
    #: node fits; a snapshot restored or built here is pushed when the repository lacks it
    registry: object | None = None
    #: where a build's engine keeps its weights: ``file`` (a weights file a CPU engine maps and
    #: a GPU engine's level-2 wake reads, :mod:`vllm_snapshot.store.weights`), ``in-image`` (in
    #: the CRIU images, or reloaded from the model files on a GPU) or ``auto`` (``file`` on CPU)
    weights: str = "auto"
    #: restore KSM-mergeable (:attr:`RestoreRequest.merge_pages`; not part of the key, never
    #: given to a build; `switch` does not take it yet)
    merge_pages: bool = False


def _published(host: HostTools, store: StoreTools, files: SnapshotFiles, root: Path) -> list[tuple[Path, Manifest]]:
    """(path, manifest) of every snapshot under ``root`` that opens (trust, schema, digest)."""
    out = []
    for p in store.list_snapshots(root) if host.path_exists(root) else []:
        try:
            out.append((p, files.open_snapshot(p)))
        except (SnapshotError, OSError):
            continue  # listed as unusable by `list`; never a candidate
    return out


def _normalized(model: ModelTools, snaps: list[tuple[Path, Manifest]], req: ServeRequest, vllm: str) -> dict[str, str]:
    """The normalized engine args: a manifest's, when it was made from the same raw args with
    the same vLLM (no vLLM import), else vLLM's parser."""
    if memoizable(req.engine_args):
        raw = snapkey.raw_args_digest(req.model, req.engine_args, vllm)
        for _, m in snaps:
            if m.key is not None and m.key.raw_args == raw:
                return dict(m.key.normalized_args)
    return model.normalize_engine_args(req.engine_args)


def compute_key(t: Tools, req: ServeRequest, model_dir: Path, snaps: list[tuple[Path, Manifest]],
                hf_id: bool = False):
    """The :class:`~vllm_snapshot.store.manifest.SnapshotKey` ``serve`` looks for (as ``create`` will
    record it). Model files whose stat a manifest of the same model directory recorded are not
    read again. Raises UsageError (args vLLM rejects), OSError."""
    kind = t.host.engine_device()  # what create will record (a CPU build of vLLM on a GPU host is "cpu")
    host = t.host.host_identity(kind)
    normalized = _normalized(t.model, snaps, req, host.get("vllm", ""))
    known: tuple[ModelFile, ...] = tuple(f for _, m in snaps if m.model.path == str(model_dir) for f in m.model.files)
    files = t.model.digest_model(model_dir, known)
    env = scrubbed_env(t.host.environ(), req.keep_env, t.host.engine_user(req.user))
    key = snapkey.build(requested_model=req.model, engine_args=req.engine_args, normalized=normalized,
                        model_identity=req.model if hf_id else str(model_dir), keep_env=req.keep_env,
                        model_files=files, oracle_prompt=req.oracle_prompt, sleep_level=req.sleep_level,
                        env=env, host=host, weights=weights_mode(req.weights, kind))
    return key, files, host


def why_not(m: Manifest, key, files: tuple[ModelFile, ...], host: dict[str, str]) -> str:
    """One line: why a snapshot of the same model directory does not match ``key`` -- the parts
    that differ, with the model files and host fields named. Pure."""
    from ..host import identity

    if m.key is None:
        return "made before snapshot keys existed (re-create it, or restore it by name)"
    said = []
    for p in snapkey.differing_parts(snapkey.parts_of(m), key.parts):
        if p == "model":
            was = {f.path: f.blake3 for f in m.model.files if not ignored(f.path)}
            now = {f.path: f.blake3 for f in files if not ignored(f.path)}
            changed = sorted(k for k in was if k in now and was[k] != now[k])
            gone = sorted(set(was) - set(now))
            new = sorted(set(now) - set(was))
            bits = ([f"changed: {', '.join(changed[:5])}"] if changed else []) + \
                   ([f"missing: {', '.join(gone[:5])}"] if gone else []) + ([f"added: {', '.join(new[:5])}"] if new else [])
            said.append("model files differ (" + "; ".join(bits) + ")" if bits else "model files differ")
        elif p == "host":
            diffs = [d for d in identity.compare(m.host, host) if d.field != "gpu_uuid_used"]
            said.append("host differs (" + "; ".join(str(d) for d in diffs[:3]) + ")" if diffs else "host differs")
        elif p == "engine":
            a, b = dict(m.key.normalized_args), dict(key.normalized_args)
            args = [f"{k.replace('_', '-')} {a.get(k, '(default)')} -> {b.get(k, '(default)')}"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            said.append("engine args differ (" + "; ".join(args[:5]) + ")" if args else
                        "the model path, oracle prompt or sleep level differ")
        elif p == "env" and m.key.env:
            diffs = snapkey.env_differences(m.key.env, key.env)
            said.append("the engine environment differs (" + "; ".join(diffs[:6]) + ")" if diffs else
                        f"{snapkey.PART_WORDS[p]} differs (a variable kept with --keep-env whose value is not recorded)")
        else:
            said.append(f"{snapkey.PART_WORDS[p]} differ{'s' if p in ('env', 'host') else ''}"
                        + (" (a snapshot made before the variables were recorded)" if p == "env" else ""))
    return "; ".join(said)


def added_since(m: Manifest, key, files: tuple[ModelFile, ...]) -> list[str]:
    """The model files ``serve`` refuses for the snapshot ``m`` of the same model directory:
    those added since ``m`` was made (not :func:`~vllm_snapshot.store.model_digest.ignored`) when
    they are the only difference from ``key`` -- every file ``m`` recorded is there unchanged
    and every other key part is equal. Empty otherwise (another model, other args or host:
    a snapshot of its own). Pure."""
    if m.key is None or snapkey.differing_parts(snapkey.parts_of(m), key.parts) != ["model"]:
        return []
    was = {f.path: f.blake3 for f in m.model.files if not ignored(f.path)}
    now = {f.path: f.blake3 for f in files if not ignored(f.path)}
    if any(now.get(p) != b for p, b in was.items()):
        return []
    return sorted(set(now) - set(was))


def _name_for(host: HostTools, root: Path, model: str, model_dir: Path, hf_id: bool, key: str) -> Path:
    """``<model dir name, or the Hugging Face id with / as -->-<key prefix>[-N]``, unused under ``root``."""
    base = model.strip("/").replace("/", "--") if hf_id else model_dir.name
    base = "".join(c if (c.isalnum() or c in "._-") else "-" for c in base.replace("/", "--")).lstrip(".-") or "model"
    stem = f"{base[:100]}-{key[:12]}"
    for n in range(1, 1000):
        p = root / (stem if n == 1 else f"{stem}-{n}")
        if not host.path_exists(p):
            return p
    raise UsageError(f"too many snapshots named {stem}-N under {root}", hint="vllm-snapshot prune")


def serve(req: ServeRequest, rep: Reporter, tools: Tools | None = None) -> tuple[Served, Engine]:
    """Restore the valid snapshot of this model + args + host, or build one and restore it.
    Returns the result (which path was taken, refusals met, timings in seconds) and the live
    engine (foreground: :func:`vllm_snapshot.ops.restore.serve_foreground`; detached: close
    it). Raises UsageError (bad args; ``--no-build`` and nothing valid), BusyError (port; the
    loopback listeners of a snapshot made before engines had their own network namespace), the refusal of the last snapshot tried (``--no-build``, or after
    :data:`MAX_REFUSED_PER_KEY` refusals), and the errors of create and restore."""
    t = tools or local_tools()
    t0 = t.clock.monotonic()
    model_dir, hf_id, key, files, host = _prepare(t, req, rep, check_port=True)
    took: dict[str, float] = {}

    def use(p: Path):
        start = t.clock.monotonic()
        out = restore(_restore_req(req, p), rep, tools=t)
        took["restore_s"] = round(t.clock.monotonic() - start, 3)
        return out

    path, (r, engine), refused, warnings, others = _find_or_build(
        t, req, rep, model_dir, hf_id, key, files, host, use)
    push_s = getattr(req.registry, "push_s", None) if req.registry is not None else None
    return Served(path, r, key.value, refused, warnings, dict(rep.timings), round(t.clock.monotonic() - t0, 3), others,
                  took["restore_s"], push_s), engine


def _prepare(t: Tools, req: ServeRequest, rep: Reporter, check_port: bool):
    """What serve and switch --model do before the key's lock: root, args restore could never
    use refused, model resolved, (``check_port``: the port free, before any hashing or cold
    start), the key. Returns (model dir, is a Hugging Face id, key, model files, host identity)."""
    t.host.require_root()
    if req.build not in ("auto", "never", "always"):
        raise UsageError(f"build must be auto, never or always, not {req.build!r}")
    check_engine_args(req.engine_args)
    check_keep_env(req.keep_env)
    frontend.check(list(req.frontend), t.host.environ())  # a bad TLS file is found before a build, not after
    model_dir, rev = t.model.resolve_model(req.model, arg_value(req.engine_args, "--revision"))
    t.model.check_model_config(model_dir, req.engine_args)
    # in milliseconds, not after the key's parse of the args (~16 s): no snapshot of a CPU
    # engine without a sized KV cache can exist (create refuses it), so neither can a build
    check_cpu_kv_cache(req.engine_args, t.host.environ(), t.host.engine_device())
    if check_port:
        t.host.port_free(req.host, req.port)
    problem = t.store.root_problem(req.root)
    if problem is not None:  # a trial: its valid snapshot passed over in silence, then a cold start refused at publishing
        raise EnvironmentProblem(f"{problem.message}; serve neither restores nor builds a snapshot below it",
                                 hint=problem.hint)
    with rep.phase("key", "computing the snapshot key (model digest, engine args, host)"):
        snaps = _published(t.host, t.store, t.files, req.root)
        key, files, host = compute_key(t, req, model_dir, snaps, rev is not None)
    rep.info(f"snapshot key {key.value[:12]}")
    return model_dir, rev is not None, key, files, host


def _find_or_build(t: Tools, req: ServeRequest, rep: Reporter, model_dir: Path, hf_id: bool, key, files,
                   host: dict[str, str], use: Callable[[Path], object]):
    """Under the key's lock: ``use`` (restore, or validate) each snapshot of ``key``, newest
    first, recording refusals; none left -> build one (unless ``never``) and ``use`` it.
    Returns (``"restored"`` | ``"built"``, what ``use`` returned, refused, warnings, others)."""
    with t.store.key_lock(key.value, rep.info):
        snaps = _published(t.host, t.store, t.files, req.root)  # again: a serve we waited for may have built it
        matching = sorted((x for x in snaps if x[1].key is not None and snapkey.key_of(x[1]) == key.value),
                          key=lambda x: x[1].created_at, reverse=True)
        refused: list[Refused] = []
        errors: list[SnapshotError] = []
        others: list[NotMatching] = [{"snapshot": str(p), "why": why_not(m, key, files, host)} for p, m in snaps
                  if m.model.path == str(model_dir) and (m.key is None or snapkey.key_of(m) != key.value)]
        for p, m in [] if req.build == "always" else matching:
            try:
                out = use(p)
                return "restored", out, refused, _offer(req, p, key.value, out), others
            except REFUSALS as e:
                if req.frontend and isinstance(e, EngineError) and (e.details or {}).get("stage") == SERVER_START:
                    # the oracle matched: the snapshot is good; a server that does not start
                    # with these front-end options would not start from a new build either
                    raise EngineError(e.message, hint=(e.hint + "; " if e.hint else "") +
                                      "the snapshot matched its oracle: check the front-end options "
                                      "(TLS, CORS, ...) given to serve", details=e.details) from e
                _refuse(t, rep, p, e, refused)
                errors.append(e)
        near = [(p, a) for p, m in ([] if req.build == "always" else snaps)
                if m.model.path == str(model_dir) and (a := added_since(m, key, files))]
        if near:  # the one model-file policy (model_digest): restore would refuse them too
            p, added = min(near, key=lambda x: len(x[1]))  # the snapshot closest to the files now
            raise ModelChangedError(
                f"files were added to {model_dir} since the snapshot {p.name} was made: "
                + ", ".join(f"{n} ({kind(n)})" for n in added),
                hint=f"move {'it' if len(added) == 1 else 'them'} out of the model directory (a cold start would "
                     "load added weights, config or tokenizer files), or build a snapshot of the model as it is "
                     "now with `serve --rebuild`",
                details={"snapshot": str(p), "changed": [], "missing": [], "added": added})
        if req.registry is not None and req.build != "always":
            target = _name_for(t.host, req.root, req.model, model_dir, hf_id, key.value)
            try:
                pulled = req.registry.fetch(key.value, target)
            except (IncompatibleHostError, ModelChangedError) as e:  # this node does not fit: build here
                rep.info(f"not pulling {req.registry.image(key.value)}: {first_lines(e)}")
                pulled = None
            if pulled is not None:
                try:
                    return "pulled", use(pulled), refused, [], others
                except REFUSALS as e:
                    _refuse(t, rep, pulled, e, refused)
                    errors.append(e)
        for o in others:
            rep.info(f"not {Path(o['snapshot']).name}: {o['why']}")
        if req.build == "never":
            if errors:
                raise errors[-1]
            raise UsageError(f"no snapshot under {req.root} matches {req.model} with these engine args on this "
                             f"host (key {key.value[:12]})" + "".join(
                                 f"\n  not {Path(o['snapshot']).name}: {o['why']}" for o in others),
                             hint="run without --no-build to build one (a cold start), or `vllm-snapshot create`",
                             details={"key": key.value, "not_matching": others})
        earlier = [(p, r) for p, _ in matching if (r := t.store.refusal(p)) is not None]
        if req.build == "auto" and len(earlier) >= MAX_REFUSED_PER_KEY:
            reasons = "\n  ".join(f"{p.name}: {r['reason']}" for p, r in earlier[:MAX_REFUSED_PER_KEY])
            raise (type(errors[-1]) if errors else CriuError)(
                f"{len(earlier)} snapshots built for this key were refused on this host; not building another:\n  "
                + reasons,
                hint="fix what the reasons name (see `vllm-snapshot list`), then `serve --rebuild`, or delete them "
                     "(`vllm-snapshot prune --unusable`)")
        target = _name_for(t.host, req.root, req.model, model_dir, hf_id, key.value)
        if errors:  # a second snapshot of this key: only for a refusal that lasts (see the module doc)
            rep.info(f"building snapshot {target.name} to replace {', '.join(Path(r['snapshot']).name for r in refused)} "
                     "(same key; cold start, oracle, dump): the refused snapshot is kept, marked ✗ in `list` with "
                     "the reason above (`vllm-snapshot prune --unusable` removes it)")
        else:
            rep.info(f"building snapshot {target.name} (cold start, oracle, dump)")
        created = create(CreateRequest(model=req.model, target=target, engine_args=list(req.engine_args),
                                       oracle_prompt=req.oracle_prompt, sleep_level=req.sleep_level,
                                       compression=req.compression, keep_env=req.keep_env, user=req.user,
                                       engine_log=req.create_log, weights=req.weights), rep, tools=t)
        warnings = []
        if created.manifest.key is None or created.manifest.key.value != key.value:
            warnings.append(f"the new snapshot's key ({created.manifest.key.value[:12] if created.manifest.key else '-'})"
                            f" differs from the one computed before building ({key.value[:12]}); the next serve "
                            "will not find it -- please report this")
        try:
            out = use(target)
            return "built", out, refused, warnings + _offer(req, target, key.value, out), others
        except REFUSALS as e:
            _refuse(t, rep, target, e, refused)
            raise


def _offer(req: ServeRequest, snapshot: Path, key: str, out=None) -> list[str]:
    """With ``--registry``: push the snapshot that serves when the repository lacks its key
    (after the restore: the engine already serves at ``out``'s URL, said before the push
    starts; the push's seconds are the registry's ``push_s``). Returns warnings."""
    if req.registry is None:
        return []
    url = getattr(out[0], "url", None) if isinstance(out, tuple) and out else None
    return req.registry.offer(snapshot, key, serving=url)


def switch_model(req: ServeRequest, host: str | None, rollback: bool, rep: Reporter,
                 tools: Tools | None = None, handover: bool = True):
    """``switch --model MODEL [engine args]``: the snapshot of this key (validated, or built now
    -- while whatever serves on ``req.port`` keeps serving), then :func:`~.switch.switch` to
    it. Returns (:class:`~vllm_snapshot.report.results.Switched`, path taken: ``restored`` when an
    existing snapshot was used, ``built``). Raises what :func:`serve` and ``switch`` raise."""
    from .switch import switch
    from .restore import validate

    t = tools or local_tools()
    model_dir, hf_id, key, files, host_id = _prepare(t, req, rep, check_port=False)  # the old engine holds it
    path, snapshot, _refused, _warnings, _others = _find_or_build(
        t, req, rep, model_dir, hf_id, key, files, host_id, lambda p: (validate(p, tools=t), p)[1])
    return switch(snapshot, host, req.port, req.log_file, rep, rollback, tools=t, frontend=req.frontend,
                  drain_s=req.drain_s, handover=handover, merge_pages=req.merge_pages), path


def _restore_req(req: ServeRequest, snapshot: Path) -> RestoreRequest:
    return RestoreRequest(snapshot=snapshot, host=req.host, port=req.port, verify_model=req.verify_model,
                          detach=req.detach, log_file=req.log_file, engine_log=req.engine_log, frontend=req.frontend,
                          drain_s=req.drain_s, merge_pages=req.merge_pages)


#: Lines of a refusal ``serve`` prints before it builds a replacement (what differed, named).
REFUSAL_LINES = 8


def _refuse(t: Tools, rep: Reporter, p: Path, e: SnapshotError, refused: list[Refused]) -> None:
    """Say why ``p`` was refused, append it to ``refused`` and record the refusal (``list``
    shows it); a refusal that cannot be recorded is only said."""
    line = first_lines(e)
    lines = (e.message or str(e)).splitlines()
    more = len(lines) - REFUSAL_LINES
    rep.info(f"snapshot {p.name} refused ({e.code}): " + "\n  ".join(x.strip() for x in lines[:REFUSAL_LINES])
             + (f"\n  ... and {more} more" if more > 0 else "") + (f"\n  hint: {e.hint}" if e.hint else ""))
    refused.append({"snapshot": str(p), "code": e.code, "reason": line})
    try:
        t.store.record_refusal(p, e.code, line)
    except OSError as err:  # bookkeeping only
        rep.info(f"could not record the refusal of {p.name}: {err}")


__all__ = ["MAX_REFUSED_PER_KEY", "REFUSALS", "ServeRequest", "compute_key", "serve", "switch_model", "why_not"]
