"""``create``: the steps, in order (each side effect through :class:`Tools`).

1. preconditions: root, CRIU >= 4.2, sleep level, model dir resolvable and visible to the
   engine's mount namespace, the engine user exists, target absent, CPU KV cache sized, the
   model, the Python environment and HOME usable by the engine user -- all before the engine
   starts;
2. per-snapshot lock, private temp dir beside the target;
3. model digest; scrubbed environment; engine start (PID + mount namespace) -> oracle and the
   HTTP canary's record;
4. CUDA: sleep rehearsal (sleep, wake, reload, oracle and canary record must match, sleep again);
5. prepare-dump (app prebuilt, parent-death signal cleared, GC heap frozen, children prepared:
   gc, malloc_trim, all-zero KV-cache pages given back -- see engine/prep.py);
6. inventory (refuse what CRIU cannot restore, and a tree not running as the engine user
   with no capability and NoNewPrivs), channel keys, link-remap watch; model re-check (a file
   whose stat changed since the digest is re-hashed; a change the engine may have read
   refuses: :func:`vllm_snapshot.store.model_digest.recheck`);
   the files the tree maps or holds open outside the model, the Python environment and the
   system copied into ``carried/`` (:mod:`vllm_snapshot.checkpoint.carry`);
7. CRIU dump (host-wide lock), tree gone, link-remap files saved;
8. checksums / compression; code identity (:mod:`vllm_snapshot.host.codeid`: the files of the
   distributions the engine imported from, pinned by stat); host identity; manifest (pure
   :func:`build_manifest`); publish.

On any failure: engine killed, temp dir removed, CRIU log kept (named in the error), and a
failing cleanup is reported together with the failure that caused it.
"""

from __future__ import annotations

import datetime as _dt
import errno
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import __version__
from ..checkpoint import carry, criu, mountpolicy
from ..store import layout, manifest, oracle, snapkey
from ..host import privilege
from ..engine.args import arg_value, check_engine_args, has_flag
from ..engine.mounts import PRIVATE as PRIVATE_MOUNTS
from ..engine.spec import EngineSpec, RunAs
from ..store.archive import DEFAULT_COMPRESSION, Compression
from ..errors import CriuError, EngineError, EnvironmentProblem, OracleMismatchError, UnsnapshottableError, UsageError, q
from ..checkpoint.inventory import Inventory
from ..report.progress import Reporter
from ..report.results import Created
from ..host.envpolicy import redact_args, scrubbed_env
from ..effects.protocols import EngineTools
from ..effects.handles import Engine
from ..effects.tools import Tools, local_tools
from .cleanup import report_reclaimed, run_cleanups

ENGINE_START_TIMEOUT_S = 900.0
SLEEP_TIMEOUT_S = 300.0
WAKE_TIMEOUT_S = 600.0
DUMP_READY_TIMEOUT_S = 120.0
#: After a successful dump CRIU has killed the tree; its processes must be gone by then.
TREE_GONE_TIMEOUT_S = 30.0


@dataclass
class CreateRequest:
    """Inputs of :func:`create`. ``engine_args`` are ``vllm serve`` args; ``engine_log``
    receives the engine's log bytes as they come (``-v``)."""

    model: str
    target: Path
    engine_args: list[str] = field(default_factory=list)
    oracle_prompt: str = oracle.DEFAULT_PROMPT
    sleep_level: int = 2
    compression: Compression = field(default_factory=lambda: Compression.parse(DEFAULT_COMPRESSION))
    keep_env: tuple[str, ...] = ()
    engine_log: Callable[[bytes], None] | None = None
    #: the unprivileged user the engine tree runs as (vllm_snapshot/host/privilege.py)
    user: str = privilege.DEFAULT_USER
    #: ``file``: a CPU engine maps its weights from a weights file of the store instead of
    #: holding them in the images (:mod:`vllm_snapshot.store.weights`), a GPU engine's level-2
    #: wake copies them back from it; ``in-image``: as before; ``auto``: :func:`weights_mode`
    weights: str = "auto"


#: The values of ``--weights``.
WEIGHTS_MODES = ("auto", "file", "in-image")


def weights_mode(requested: str, device: str) -> str:
    """What an engine on ``device`` does with ``requested`` (``auto``/``file``/``in-image``):
    ``file`` or ``in-image``. ``auto`` is ``file`` on CPU and ``in-image`` on a GPU (a GPU
    engine's weights leave the device at sleep level 2 and are not in its images; its wake
    reloads them from the model files); ``file`` on a GPU makes the weights file the level-2
    wake's source instead (not yet proven on a GPU: docs/weights.md). Raises UsageError for an
    unknown mode. Pure."""
    if requested not in WEIGHTS_MODES:
        raise UsageError(f"--weights {requested!r}: choose one of {', '.join(WEIGHTS_MODES)}")
    if requested == "auto":
        return "file" if device == "cpu" else "in-image"
    return requested


def check_cpu_kv_cache(engine_args: list[str], env: dict[str, str], device: str) -> None:
    """For an engine on ``device`` ``"cpu"`` (a CPU build of vLLM runs on CPU even on a GPU
    host), refuse a KV cache that is not sized explicitly: vLLM's CPU backend then reserves
    ``--gpu-memory-utilization`` (default 0.9) of host RAM for it, and a CPU snapshot captures
    all of it (22 GiB for a 1.4 MiB model seen here). Pure. Raises UsageError with the remedy."""
    if device != "cpu":
        return
    if has_flag(engine_args, "--kv-cache-memory-bytes") or env.get("VLLM_CPU_KVCACHE_SPACE"):
        return
    raise UsageError(
        "on CPU the whole engine memory is captured, KV cache included, and vLLM reserves 90% of "
        "host RAM for it unless told otherwise; size it explicitly",
        hint="add an engine arg like --kv-cache-memory-bytes 1G (or set VLLM_CPU_KVCACHE_SPACE=GiB)")


def check_oracle_prompt(prompt: str) -> None:
    """Refuse an empty or whitespace-only oracle prompt (UsageError, exit 2): it would record
    an oracle of nothing; leaving ``--oracle-prompt`` out gives :data:`oracle.DEFAULT_PROMPT`."""
    if not prompt.strip():
        raise UsageError(f"--oracle-prompt is empty{' (only whitespace)' if prompt else ''}: the oracle needs a prompt "
                         "to record the engine's first token for",
                         hint=f"give a prompt, or leave the option out for the default ({oracle.DEFAULT_PROMPT!r})")


def check_keep_env(keep_env: tuple[str, ...]) -> None:
    """Refuse ``--keep-env`` of what must never be in a snapshot's memory. Pure. Raises UsageError."""
    if "VLLM_API_KEY" in keep_env:
        raise UsageError("--keep-env VLLM_API_KEY would put an API key into the snapshot's memory",
                         hint="leave the key out of create; restore and serve read VLLM_API_KEY from their own "
                              "environment and apply it when the server starts")


def check_visible(needed: dict[str, Path], hidden: list[Path]) -> None:
    """Refuse when something the engine needs lies under a path its mount namespace hides.
    Pure. Raises UsageError naming both."""
    for what, path in needed.items():
        for h in hidden:
            if path == h or h in path.parents:
                raise UsageError(f"the {what} at {path} is under {h}, which the engine does not see (its "
                                 "mount namespace has its own private tmpfs there)",
                                 hint=f"move the {what} to a directory on a disk filesystem")


def check_offline(inv: Inventory) -> None:
    """Refuse a tree whose network namespace is not its own loopback-only one (the manifest
    records ``network: isolated``, i.e. offline at create, only after this). Pure. Raises
    UnsnapshottableError naming why."""
    if inv.net_problems:
        raise UnsnapshottableError(
            "the engine tree is not in an isolated, loopback-only network namespace: " + "; ".join(inv.net_problems),
            hint="the engine is started with `unshare --net`; something moved it or added an interface")


def _is_enospc(e: BaseException) -> bool:
    """True for ENOSPC from our own writes or from CRIU (its log says so)."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return isinstance(e, CriuError) and "No space left on device" in str(e)


def create(req: CreateRequest, rep: Reporter, tools: Tools | None = None) -> Created:
    """Launch the engine, record the oracle, dump it with CRIU, publish the snapshot.

    Returns :class:`Created`. Raises UsageError (bad args, target exists),
    EnvironmentProblem, EngineError, CriuError, UnsnapshottableError, OracleMismatchError,
    ModelChangedError (a model file changed while the engine loaded it). On any failure no
    snapshot is published and no engine process is left.
    """
    t = tools or local_tools()
    t.host.require_root()
    criu.env_timeout(t.host.environ())  # a bad $VLLM_SNAPSHOT_CRIU_TIMEOUT is a usage error now, not after minutes
    criu_ver = t.host.criu_version()
    if req.sleep_level not in (0, 1, 2):
        raise UsageError("--sleep-level must be 0, 1 or 2")
    weights_mode(req.weights, "cpu")
    check_oracle_prompt(req.oracle_prompt)
    check_engine_args(req.engine_args)
    check_keep_env(req.keep_env)
    target = t.store.canonical(req.target)
    model_dir, revision = t.model.resolve_model(req.model, arg_value(req.engine_args, "--revision"))
    t.model.check_model_config(model_dir, req.engine_args)  # a bad config.json: seconds, not a cold start
    check_visible({"model": model_dir, **t.host.code_paths()}, [Path(p) for p in PRIVATE_MOUNTS])
    user = t.host.engine_user(req.user)
    device = t.host.engine_device()  # vLLM's platform as predicted here: the engine reports the one it chose
    mode = weights_mode(req.weights, device)
    # the engine maps its weights file from ROOT/.weights: its namespace must keep that mount
    store = (str(target.parent),) if mode == "file" else ()
    t.host.check_mounts(model_dir, scrubbed_env(t.host.environ(), req.keep_env, user), also=store)
    if store:  # a ROOT/.weights another user owns or may write is refused now, not adopted after the cold start
        t.files.check_weights_dir(target.parent)
    inside = next((p for p in target.parents if t.host.path_exists(p / layout.MANIFEST)), None)
    if inside is not None:
        raise UsageError(f"{target} is inside the snapshot {inside}; a snapshot cannot hold another",
                         hint="choose a --snapshot-dir/--name outside any snapshot")
    if t.host.path_exists(target):
        if t.host.path_exists(target / layout.MANIFEST):
            raise UsageError(f"{target} already exists; refusing to overwrite a snapshot",
                             hint="choose another --snapshot-dir/--name, or delete the old one first")
        raise UsageError(f"{target} already exists and is {t.host.path_kind(target)}, not a snapshot; "
                         "refusing to overwrite it",
                         hint="choose another --snapshot-dir/--name (a path where nothing is yet)")
    check_disk_room(target, *t.store.disk_room(target, model_dir))  # not after minutes of cold start
    check_cpu_kv_cache(req.engine_args, t.host.environ(), device)
    check_access(user, model_dir, t.host.engine_access(user, model_dir))
    if device == "cuda":
        if mode == "file" and req.sleep_level < 2:
            raise UsageError(f"--weights file on a GPU makes the weights file the source of the level-2 wake; with "
                             f"--sleep-level {req.sleep_level} the weights never leave the GPU",
                             hint="create with --sleep-level 2, or without --weights file")
        t.host.check_cuda_ready()  # CRIU's plugin + our helper reach the driver, before minutes of engine start
    with t.store.snapshot_lock(target, shared=False, must_exist=False):
        return _create_locked(t, req, rep, target, model_dir, revision, criu_ver, user, mode)


def check_disk_room(target: Path, previous: tuple[str, int] | None, free: int) -> None:
    """Refuse a create whose images would not fit, before the engine starts: ``previous`` is
    (path, raw image bytes) of the newest earlier snapshot of the same model beside ``target``
    (None: no estimate, nothing refused), ``free`` the bytes free on ``target``'s filesystem.
    An engine's images are about its resident memory, so the last snapshot of the model is the
    estimate (engine args may differ: the message says so). Pure. Raises EnvironmentProblem
    (exit 11, as running out of space at the dump does)."""
    from ..units import human_bytes

    if previous is None or free >= previous[1]:
        return
    raise EnvironmentProblem(
        f"{human_bytes(free)} free on the filesystem of {target.parent}, but the last snapshot of this model "
        f"({previous[0]}) holds {human_bytes(previous[1])} of images: the dump would run out of space after the "
        "whole cold start. Nothing was started.",
        hint="free space there (`vllm-snapshot prune --keep 1`, or delete that snapshot if it is the one being "
             "replaced), or choose another --snapshot-dir/--root")


def check_access(user: privilege.User, model_dir: Path, problems: dict[str, list[str]]) -> None:
    """Refuse, before the engine starts, what the engine user cannot read or write (``problems``
    from :meth:`Tools.engine_access`), with the remedy. Pure. Raises UsageError (the
    model) or EnvironmentProblem (the Python environment, HOME)."""
    if problems.get("model"):
        raise UsageError(
            f"the engine runs as {user.name} (uid {user.uid}), which cannot read the model at {model_dir}:\n  "
            + "\n  ".join(problems["model"][:5]),
            hint=f"make it readable to that user, e.g. `setfacl -R -m u:{q(user.name)}:rX {q(model_dir)}` plus "
                 f"`setfacl -m u:{q(user.name)}:x` on each parent directory (or chmod -R o+rX), or move the model to "
                 "a readable place such as /var/cache/vllm-snapshot/models")
    if problems.get("code"):
        raise EnvironmentProblem(
            f"the engine user {user.name} must be able to read (and not write) the Python environment and "
            "vllm-snapshot's code:\n  " + "\n  ".join(problems["code"][:5]),
            hint="install vllm-snapshot where every user can read it (not under /root: its checkout is imported by "
                 "the engine), root-owned and not writable by others; `vllm-snapshot doctor` checks it")
    if problems.get("home"):
        raise EnvironmentProblem(
            f"the engine user {user.name} needs a writable HOME for vLLM's compile cache:\n  "
            + "\n  ".join(problems["home"]),
            hint=f"run scripts/setup.sh, or: install -d -o {q(user.name)} -g {user.gid} -m 0700 {q(user.home)}")


def engine_user_record(user: privilege.User) -> manifest.EngineUser:
    """The manifest's record of ``user``. Pure."""
    return manifest.EngineUser(name=user.name, uid=user.uid, gid=user.gid, groups=user.groups, home=user.home)


def _start_engine(et: EngineTools, req: CreateRequest, spec: EngineSpec, env: dict[str, str], tmp: Path,
                  model_dir: Path, weights_root: Path | None = None,
                  uid: int = 0) -> tuple[Engine, dict, manifest.WeightsFile | None]:
    """Launch the engine and wait for its oracle; with ``weights_root``, serve its weights
    channel meanwhile. Returns (engine, the ``initialized`` event, the weights file its worker
    mapped or None). Raises UsageError, EngineError (the engine is killed then)."""
    log = tmp / layout.CREATE_LOG
    engine = et.launch_engine(spec, env, log, req.engine_log)
    channel = None
    try:
        if weights_root is not None:
            channel = et.weights_channel(engine, weights_root, uid)
        init = engine.wait_event("initialized", ENGINE_START_TIMEOUT_S)
        got = channel.result() if channel is not None else None
        return engine, init, got
    except EngineError as e:
        engine.kill()
        engine.close()
        if channel is not None:
            channel.close()
            try:
                channel.result()  # the channel's own failure says more than "the engine exited"
            except EngineError as ce:
                raise ce from e
        if isinstance(e.details, dict) and e.details.get("kind") == "usage":
            raise UsageError(e.message, hint="the engine args are those of `vllm serve`") from e
        raise start_failure(e, et.keep_log(log, "create"), model_dir) from e
    except BaseException:
        engine.kill()
        engine.close()
        raise
    finally:
        if channel is not None:
            channel.close()


#: lines of the engine's own error message an engine start failure shows (the rest: its log)
START_ERROR_LINES = 4


def start_failure(e: EngineError, kept: Path | None, model_dir: Path) -> EngineError:
    """The error for an engine that failed to start at create, in words and short (a trial got
    ~25 lines of pydantic/vLLM traceback): the engine's error -- its exception type and message,
    at most :data:`START_ERROR_LINES` lines of 300 characters, and the last exception line of
    the log tail ``e.message`` carries when that is another one -- or, when it died without one,
    what ended the wait and the last exception line of its log; where the full log is kept
    (``kept``, None: not kept) and a hint to check ``model_dir``. ``details`` keeps the engine's
    event and adds ``log``. Pure."""
    import re

    ev = e.details if isinstance(e.details, dict) else {}
    first, *tail = e.message.splitlines() or [""]  # the error's own line(s), then the log's last lines
    errs = [ln.strip() for ln in tail if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", ln.strip())]
    if isinstance(ev.get("message"), str):
        lines = [ln.strip() for ln in ev["message"].splitlines()
                 if ln.strip() and not ln.strip().startswith("For further information visit")]
        def bare(ln: str) -> str:  # pydantic_core._pydantic_core.ValidationError: x -> ValidationError: x
            return re.sub(r"^[\w.]*\.(?=\w+:)", "", ln)

        if errs and bare(errs[-1]) not in map(bare, lines):  # "Engine core ... failed. See root cause above"
            lines = lines[:START_ERROR_LINES - 1] + [f"its log's last error: {errs[-1]}"]
    else:  # exited or timed out without an error event: the wait's own line, the log's last exception
        lines = [first] + (errs[-1:] or [ln.strip() for ln in tail if ln.strip()][-3:])
    lines = [ln if len(ln) <= 300 else ln[:297] + "..." for ln in lines] or ["(no message)"]
    more = len(lines) - START_ERROR_LINES
    shown = lines[:START_ERROR_LINES] + ([f"({more} more line(s) in the log)"] if more > 0 else [])
    where = f"the engine's full log: {kept}" if kept is not None else "the engine's log could not be kept"
    return EngineError("the engine failed while starting (loading the model): " + "\n  ".join(shown),
                       hint=f"{where}; if the error is about the model, check the model folder {model_dir}: "
                            "config.json, the weights and the tokenizer files must be the model's own, as its "
                            "publisher ships them",
                       details={**ev, "log": str(kept) if kept is not None else None})


def _rehearse_sleep(engine: Engine, level: int, recorded: oracle.Oracle, clock: Callable[[], float],
                    canary: oracle.Oracle | None = None) -> float:
    """sleep -> wake (reload) -> oracle must match (and the recorded ``canary``, asked with its
    prompt: every restore's HTTP canary compares with it after a wake too) -> sleep again.
    Returns the seconds the wake took (``clock``: monotonic seconds). Raises
    OracleMismatchError, EngineError."""
    engine.send("sleep", level=level)
    engine.wait_event("slept", SLEEP_TIMEOUT_S)
    t0 = clock()
    engine.send("wake")
    engine.wait_event("woken", WAKE_TIMEOUT_S)
    woke_s = clock() - t0
    checks = [("oracle", recorded, {})] + ([("canary", canary, {"prompt": canary.prompt})] if canary is not None else [])
    for what, expected, kw in checks:
        engine.send("oracle", **kw)
        again = oracle.Oracle.model_validate(engine.wait_event("oracle", SLEEP_TIMEOUT_S)["oracle"])
        diffs = oracle.compare(expected, again)
        if diffs:
            raise OracleMismatchError(f"sleep/wake rehearsal changed the {what}: " + "; ".join(diffs))
    engine.send("sleep", level=level)
    engine.wait_event("slept", SLEEP_TIMEOUT_S)
    return woke_s


def wake_timeout_s(m: manifest.Manifest) -> float:
    """Seconds a restore waits for its engine's wake: as long as create's rehearsal was allowed
    (:data:`WAKE_TIMEOUT_S`), and at least twice what the rehearsal's wake took (a reload on a
    busier host). Pure."""
    return max(WAKE_TIMEOUT_S, 2 * (m.engine.rehearsal_wake_s or 0.0))


def build_manifest(*, req: CreateRequest, target: Path, model_dir: Path, revision: str | None, files: tuple, info: dict,
                   recorded: oracle.Oracle, sleep_level: int, env: dict[str, str], criu_ver: str,
                   canary: oracle.Oracle | None = None,
                   host: dict[str, str], inv: Inventory, inherit: dict[str, str], dump_opts: criu.DumpOptions,
                   externals: tuple, images: tuple, extra: tuple, timings: dict[str, float],
                   carried: manifest.Carried | None = None,
                   created_at: str, key: manifest.SnapshotKey | None = None,
                   code: manifest.CodeIdentity | None = None,
                   engine_user: manifest.EngineUser | None = None,
                   rehearsal_wake_s: float | None = None, cuda_pids: tuple[int, ...] = (),
                   env_scrubbed: bool | None = None,
                   weights: manifest.WeightsFile | None = None) -> manifest.Manifest:
    """The manifest of a finished dump (unsealed). ``canary``: the HTTP canary's record (None:
    the engine sent none, restores use the oracle's prompt). ``env_scrubbed``: the engine's
    environment ``env`` is what the scrubber gives without ``--keep-env`` (push requires it). Pure."""
    return manifest.Manifest(
        schema_version=manifest.SCHEMA_VERSION,
        tool_version=__version__,
        created_at=created_at,
        host=host,
        engine=manifest.EngineInfo(
            kind=info["kind"], sleep_level=sleep_level, engine_args=tuple(redact_args(req.engine_args)),
            env_hashes={}, full_state_captured=(sleep_level == 0), network="isolated", user=engine_user,
            rehearsal_wake_s=rehearsal_wake_s, env_scrubbed=env_scrubbed),
        model=manifest.ModelIdentity(
            requested=req.model, path=str(model_dir), served_name=info["served_model_name"],
            files=files, total_bytes=sum(f.size for f in files), revision=revision),
        oracle=recorded,
        canary=canary,
        criu=manifest.CriuInfo(
            version=criu_ver, flags=dump_opts.flags, inherit=inherit, pid_namespace=True,
            root_pid=dump_opts.pid, tree_pids=inv.pids, tree_commands=inv.commands,
            dump_argv=tuple(criu.dump_argv(dump_opts, str(target / layout.IMAGES))),
            listeners=tuple(inv.listeners), tree_files=tuple(inv.files), external_mounts=tuple(externals),
            freeze_timeout_s=dump_opts.timeout_s, cuda_pids=tuple(cuda_pids)),
        images=images,
        extra_files=extra,
        sizes={"raw": sum(i.raw_bytes for i in images), "stored": sum(i.stored_bytes for i in images),
               "model": sum(f.size for f in files),
               **({"carried": sum(b.raw_bytes for b in carried.blobs),
                   "carried_stored": sum(b.stored_bytes for b in carried.blobs)} if carried is not None else {})},
        timings=dict(timings),
        key=key,
        code=code,
        carried=carried,
        weights=weights,
    )


def _create_locked(t: Tools, req: CreateRequest, rep: Reporter, target: Path, model_dir: Path,
                   revision: str | None, criu_ver: str, user: privilege.User, mode: str) -> Created:
    """:func:`create` under the snapshot's lock; ``mode``: :func:`weights_mode` on the predicted device."""
    report_reclaimed(rep, t.store.reclaim(target.parent))
    tmp = t.files.prepare_target(target)
    engine: Engine | None = None
    remaps: list[Path] = []
    before: dict[str, set[str]] = {}
    try:
        with rep.phase("model_digest", "hashing model files"):
            files = t.model.digest_model(model_dir)
        env = scrubbed_env(t.host.environ(), req.keep_env, user)
        env_scrubbed = env == scrubbed_env(t.host.environ(), (), user)  # --keep-env added nothing the scrubber drops
        who = engine_user_record(user)
        spec = EngineSpec(
            model=str(model_dir), engine_args=tuple(req.engine_args), oracle_prompt=req.oracle_prompt,
            sleep_level=req.sleep_level,
            user=RunAs(name=who.name, uid=who.uid, gid=who.gid, groups=who.groups, home=who.home),
            weights_file=mode == "file", weights_root=str(target.parent) if mode == "file" else None,
            # serve a Hugging Face id by its id, as `vllm serve` does
            served_model_name=req.model if revision is not None and arg_value(
                req.engine_args, "--served-model-name") is None else None)
        loading_since_ns = int(t.clock.now() * 1e9)  # the engine may read the model files from here on
        with rep.phase("engine_start", "starting engine (load, compile, warm-up)"):
            engine, init, weights = _start_engine(t.engine, req, spec, env, tmp, model_dir,
                                                  target.parent if mode == "file" else None, who.uid)
        info = init["info"]
        # the device vLLM chose decides (engine_device() is a prediction): auto on a GPU is in-image
        if mode == "file" and weights_mode(req.weights, info["kind"]) == "file" and weights is None:
            raise EngineError("the engine did not hand its weights over for a weights file (its vLLM model loader "
                              "was not the one patched: another vLLM version?)",
                              hint="create with --weights in-image (the weights then stay in the images)")
        if weights is not None and info["kind"] == "cuda":  # kept open as the level-2 wake's source, not mapped
            weights = weights.model_copy(update={"use": "wake"})
        recorded = oracle.Oracle.model_validate(init["oracle"])
        # the HTTP canary's record (engine/protocol.py CANARY_PROMPT): not part of the key below,
        # it changes nothing the engine does; an engine that sent none leaves the oracle's prompt
        canary = oracle.Oracle.model_validate(init["canary"]) if init.get("canary") is not None else None
        check_cpu_kv_cache(req.engine_args, t.host.environ(), info["kind"])  # the device vLLM actually chose
        host = t.host.host_identity(info["kind"])
        key = snapkey.build(requested_model=req.model, engine_args=req.engine_args, keep_env=req.keep_env,
                            model_identity=req.model if revision is not None else str(model_dir),
                            normalized=info["normalized_args"], model_files=files, oracle_prompt=req.oracle_prompt,
                            sleep_level=req.sleep_level, env=env, host=host,
                            weights="file" if weights is not None else "in-image")
        sleep_level = req.sleep_level if info["kind"] == "cuda" else 0
        woke_s = None
        if sleep_level:
            with rep.phase("sleep", f"sleep level {sleep_level} (rehearsal: wake, reload, oracle)"):
                woke_s = round(_rehearse_sleep(engine, sleep_level, recorded, t.clock.monotonic, canary), 3)
        engine.send("prepare-dump")
        ready = engine.wait_event("dump-ready", DUMP_READY_TIMEOUT_S)
        with rep.phase("inventory", "checking the tree for what CRIU cannot restore"):
            inv = t.checkpoint.inspect_tree(engine.root_pid)
            inherit = t.checkpoint.channel_keys(engine.root_pid)
            before = t.checkpoint.watch_remaps(inv.deleted_files)
            externals = t.checkpoint.external_mounts(engine.root_pid)
            use = t.checkpoint.gpu_used(inv) if info["kind"] == "cuda" else None  # refuses NVML-only holders
            gpu_id = use.host_fields() if use is not None else {}  # the GPU, its minor and model: restore places by them
            check_offline(inv)
            wrong = privilege.tree_problems(t.checkpoint.tree_creds(engine.root_pid), who.uid, who.gid, who.groups, inv.pids)
            if wrong:
                raise UnsnapshottableError(f"the engine tree does not run as {who.name} without privileges:\n  "
                                           + "\n  ".join(wrong[:10]),
                                           hint="the engine root drops them itself (vllm_snapshot/host/privilege.py); "
                                                "its log says why it did not")
            if gpu_id:  # the GPU state goes through host RAM into the images
                t.checkpoint.check_dump_room(inv, gpu_id["gpu_uuid_used"], tmp)
        # the digest must describe the bytes the engine loaded (read during the start and, on
        # GPU, at the rehearsal's wake): what changed since the hash is re-hashed now
        with rep.phase("model_recheck", "checking the model files did not change while the engine loaded them"):
            t.model.recheck_model(model_dir, files, loading_since_ns, during="between the hash and the dump, while the "
                            "engine loaded them", hint="nothing was published; keep the model directory unchanged "
                            "while create runs (stop what writes to it: a download, a sync) and run create again")
        # what the tree maps or holds open outside the model, the Python environment and the
        # system (compile caches under the engine user's HOME) travels with the snapshot:
        # copied now, while the tree still maps exactly these bytes (checkpoint/carry.py)
        with rep.phase("carry", "copying the files outside the model, the Python environment and the system"):
            carried_files, carried_dirs = t.checkpoint.carry_files(
                inv.files, model_dir, files, ready.get("sys_path") or [], tmp,
                also=(weights.path,) if weights is not None else ())
            moved = carry.changed_since(inv.files, carried_files)
            if moved:
                raise UnsnapshottableError("files the engine maps changed while create copied them into the "
                                           "snapshot (another engine rewrote its cache?):\n  " + "\n  ".join(moved[:10]),
                                           hint="nothing was published; run create again")
        # the tree's network namespace holds only its own processes: no network lock to take
        # (criu.NETWORK_LOCK_ISOLATED says why)
        dump_opts = criu.DumpOptions(pid=engine.root_pid, external=mountpolicy.dump_args(externals),
                                     network_lock=criu.NETWORK_LOCK_ISOLATED,
                                     timeout_s=criu.freeze_timeout(info["kind"], len(inv.pids), len(inv.cuda_pids),
                                                                   t.host.environ()))
        with rep.phase("dump", "CRIU dump"):
            t.checkpoint.dump(info["kind"], dump_opts, tmp)
            alive = t.checkpoint.wait_gone(inv.pids, TREE_GONE_TIMEOUT_S)
            if alive:
                raise EngineError(f"processes of the tree survived the dump: PIDs {alive}")
            engine.close()
            engine = None
        remaps = t.checkpoint.collect_remaps(before, tmp / layout.FILES)
        with rep.phase("pack", f"checksums + compression ({req.compression})"):
            images = t.files.pack(tmp / layout.IMAGES, str(req.compression))
            extra = t.files.pack(tmp / layout.FILES, "none")
            blobs = t.files.pack(tmp / layout.CARRIED, str(req.compression))
        with rep.phase("code_identity", "pinning the files of the Python distributions the engine imported from"):
            code = t.files.pin_code(ready["modules"], ready["sys_path"], tmp)
        t.checkpoint.cleanup_remaps(remaps)  # the copies live in the snapshot now
        remaps = []
        m = build_manifest(
            req=req, target=target, model_dir=model_dir, revision=revision, files=files, info=info, recorded=recorded,
            canary=canary,
            sleep_level=sleep_level, env=env, criu_ver=criu_ver, host={**host, **gpu_id},
            inv=inv, inherit=inherit, dump_opts=dump_opts, externals=externals, images=images, extra=extra,
            carried=carry.carried(carried_files, carried_dirs, blobs),
            timings=rep.timings, key=key, code=code, engine_user=who, rehearsal_wake_s=woke_s,
            cuda_pids=use.cuda_pids if use is not None else (), env_scrubbed=env_scrubbed, weights=weights,
            created_at=_dt.datetime.fromtimestamp(t.clock.now(), _dt.timezone.utc).isoformat(timespec="seconds"))
        with rep.phase("publish", "publishing"):
            m = manifest.seal(m.model_copy(update={"timings": dict(rep.timings)}))
            t.files.publish(m, tmp, target)
        return Created(str(target), m)
    except BaseException as e:
        steps = []
        if engine is not None:
            eng = engine
            steps += [("stop the engine", eng.kill), ("close the engine channel", eng.close)]
        # the saved ones, or those a failed dump left in the watched directories
        steps += [("remove link-remap files", lambda: t.checkpoint.cleanup_remaps(remaps or t.checkpoint.find_remaps(before))),
                  (f"remove the temp dir {tmp}", lambda: t.files.discard(tmp)),
                  # after the engine is gone: a weights file this create wrote that no snapshot
                  # names and no process maps (another create of the same weights may)
                  ("remove an unused weights file", lambda: t.store.remove_unused_weights(target.parent))]
        run_cleanups(e, steps)
        if _is_enospc(e):
            raise EnvironmentProblem(
                f"no space left on the filesystem of {target.parent} while writing the snapshot; "
                "the partial snapshot was removed",
                hint="free space there or choose another --snapshot-dir/--root "
                     "(a CPU engine's image is about its resident memory; see `inspect` of an earlier snapshot)") from e
        raise
