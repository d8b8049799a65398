"""Operations: create, restore, verify. Sequencing only; side effects live in the modules
they call (criu, supervisor, archive, store). Errors are SnapshotError subclasses."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from . import __version__, archive, criu, gpu, identity, inventory, locks, manifest, model_digest, oracle, registry, store
from .errors import (BusyError, CriuError, EngineError, EnvironmentProblem, IncompatibleHostError,
                     OracleMismatchError, UsageError)
from .progress import Reporter
from .supervisor import (ENGINE_MODULE, EngineHandle, is_secret_name, launch, pipe_key, restored_handle,
                         scrubbed_env)

ENGINE_START_TIMEOUT_S = 900.0
RESTORE_ORACLE_TIMEOUT_S = 300.0
BIND_TIMEOUT_S = 120.0
REMAP_DIR_CANDIDATES = ("/dev/shm",)


def require_root() -> None:
    """CRIU needs root here. Raises EnvironmentProblem."""
    if os.geteuid() != 0:
        raise EnvironmentProblem("vllm-snapshot create/restore must run as root (CRIU needs CAP_SYS_ADMIN and more)",
                                 hint="run it with sudo")


def criu_binary() -> tuple[str, str]:
    """(path, version) of a usable CRIU >= 4.2. Raises EnvironmentProblem."""
    b = criu.find_criu()
    v = criu.criu_version(b)
    if not criu.version_ok(v):
        raise EnvironmentProblem(f"CRIU {v} at {b} is too old; vllm-snapshot needs >= 4.2",
                                 hint="CRIU < 4.2 fails on kernels >= 6.16; run scripts/setup.sh")
    return b, v


def host_identity(criu_version: str, kind: str) -> dict[str, str]:
    """This host's identity (identity.collect, GPU fields on GPU hosts) plus, for CUDA
    engines, which cuda-checkpoint helper CRIU's plugin will run (ours by digest, or NVIDIA's
    binary named by ``VLLM_SNAPSHOT_CUDA_CHECKPOINT``)."""
    ident = identity.collect(criu_version, gpu.gpu_identity())
    if kind == "cuda":
        from . import cuda_checkpoint

        ident["cuda_checkpoint_helper"] = (os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")
                                           or f"vllm-snapshot:{cuda_checkpoint.digest()[:16]}")
    return ident


def redact_args(args: list[str]) -> list[str]:
    """Engine args with values of secret-looking flags (``--api-key X``, ``--hf-token=X``)
    replaced by ``<redacted>``."""
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next and not a.startswith("-"):
            out.append("<redacted>")
            hide_next = False
            continue
        hide_next = False
        if a.startswith("--") and is_secret_name(a[2:].split("=", 1)[0]):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=<redacted>")
            else:
                out.append(a)
                hide_next = True
            continue
        out.append(a)
    return out


def _tree_of(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def check_cpu_kv_cache(engine_args: list[str], env: dict[str, str], gpu_present: bool | None = None) -> None:
    """On a host without an NVIDIA GPU, refuse an engine whose KV cache is not sized
    explicitly: vLLM's CPU backend then reserves ``--gpu-memory-utilization`` (default 0.9) of
    host RAM for it, and a CPU snapshot captures all of it (22 GiB for a 1.4 MiB model seen
    here). Raises UsageError with the remedy."""
    if gpu_present is None:
        gpu_present = os.path.isdir("/proc/driver/nvidia/gpus")
    if gpu_present:
        return
    sized = any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in engine_args)
    if sized or env.get("VLLM_CPU_KVCACHE_SPACE"):
        return
    raise UsageError(
        "on CPU the whole engine memory is captured, KV cache included, and vLLM reserves 90% of "
        "host RAM for it unless told otherwise; size it explicitly",
        hint="add an engine arg like --kv-cache-memory-bytes 1G (or set VLLM_CPU_KVCACHE_SPACE=GiB)")


def _is_enospc(e: BaseException) -> bool:
    """True for ENOSPC from our own writes or from CRIU (its log says so)."""
    import errno

    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return isinstance(e, CriuError) and "No space left on device" in str(e)


def _deleted_open_files(procs: list[psutil.Process]) -> set[str]:
    """Paths of deleted-but-open files in the tree (CRIU link-remaps them into the same dir)."""
    out = set()
    for p in procs:
        fd_dir = f"/proc/{p.pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for n in names:
            try:
                t = os.readlink(f"{fd_dir}/{n}")
            except OSError:
                continue
            if t.endswith(" (deleted)") and t.startswith("/"):
                out.add(t[: -len(" (deleted)")])
    return out


@dataclass
class CreateRequest:
    """Inputs of :func:`create`. ``engine_args`` are ``vllm serve`` args; sizes in bytes."""

    model: str
    target: Path
    engine_args: list[str] = field(default_factory=list)
    oracle_prompt: str = oracle.DEFAULT_PROMPT
    sleep_level: int = 2
    compression: archive.Compression = field(default_factory=lambda: archive.Compression.parse(archive.DEFAULT_COMPRESSION))
    keep_env: tuple[str, ...] = ()
    engine_log: Callable[[bytes], None] | None = None


def create(req: CreateRequest, rep: Reporter) -> manifest.Manifest:
    """Launch the engine, record the oracle, dump it with CRIU, publish the snapshot.

    Returns the published manifest. Raises UsageError (bad args, target exists),
    EnvironmentProblem, EngineError, CriuError, UnsnapshottableError. On any failure no
    snapshot is published and no engine process is left.
    """
    require_root()
    criu_bin, criu_ver = criu_binary()
    if req.sleep_level not in (0, 1, 2):
        raise UsageError("--sleep-level must be 0, 1 or 2")
    target = req.target.absolute()
    model_dir = model_digest.resolve_model(req.model)
    from .engine.mounts import hidden_prefixes

    with open("/proc/self/mountinfo") as f:
        hidden = [Path(h) for h in hidden_prefixes(f.read())]
    for what, path in (("model", model_dir), ("Python environment", Path(sys.prefix).resolve()),
                       ("vllm_snapshot package", Path(__file__).resolve().parent)):
        for h in hidden:
            if path == h or h in path.parents:
                raise UsageError(f"the {what} at {path} is under {h}, which the engine does not see (its "
                                 "mount namespace has a private /dev/shm and detaches the host's tmpfs mounts)",
                                 hint=f"move the {what} to a directory on a disk filesystem")
    if os.path.lexists(target):
        raise UsageError(f"{target} already exists; refusing to overwrite a snapshot",
                         hint="choose another --snapshot-dir/--name, or delete the old one first")
    check_cpu_kv_cache(req.engine_args, dict(os.environ))
    with locks.snapshot_lock(target, must_exist=False):
        return _create_locked(req, rep, target, model_dir, criu_bin, criu_ver)


def _create_locked(req: CreateRequest, rep: Reporter, target: Path, model_dir: Path,
                   criu_bin: str, criu_ver: str) -> manifest.Manifest:
    tmp = store.prepare_target(target)
    (tmp / "owner.pid").write_text(str(os.getpid()))
    handle: EngineHandle | None = None
    log_fd = os.open(tmp / "engine-create.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        with rep.phase("model_digest", "hashing model files"):
            files = model_digest.digest_dir(model_dir)
        env = scrubbed_env(dict(os.environ), req.keep_env)
        spec = {"model": str(model_dir), "engine_args": list(req.engine_args),
                "oracle_prompt": req.oracle_prompt, "sleep_level": req.sleep_level}
        sinks = [lambda b: os.write(log_fd, b)]
        if req.engine_log:
            sinks.append(req.engine_log)
        with rep.phase("engine_start", "starting engine (load, compile, warm-up)"):
            handle = launch(spec, env, sinks, module=os.environ.get("VLLM_SNAPSHOT_ENGINE_MODULE", ENGINE_MODULE))
            try:
                init = handle.wait_event("initialized", ENGINE_START_TIMEOUT_S)
            except EngineError as e:
                if isinstance(e.details, dict) and e.details.get("kind") == "usage":
                    raise UsageError(e.message, hint="the engine args are those of `vllm serve`") from e
                raise
        info = init["info"]
        recorded = oracle.Oracle.model_validate(init["oracle"])
        kind = info["kind"]
        sleep_level = req.sleep_level if kind == "cuda" else 0
        if sleep_level:
            with rep.phase("sleep", f"sleep level {sleep_level} (rehearsal: wake, reload, oracle)"):
                handle.send("sleep", level=sleep_level)
                handle.wait_event("slept", 300)
                handle.send("wake")
                handle.wait_event("woken", 600)
                handle.send("oracle")
                again = oracle.Oracle.model_validate(handle.wait_event("oracle", 300)["oracle"])
                diffs = oracle.compare(recorded, again)
                if diffs:
                    raise OracleMismatchError("sleep/wake rehearsal changed the oracle: " + "; ".join(diffs))
                handle.send("sleep", level=sleep_level)
                handle.wait_event("slept", 300)
        with rep.phase("inventory", "inspecting the process tree"):
            procs = _tree_of(handle.root_pid)
            inherit = {"control": pipe_key(handle.root_pid, 0), "log": pipe_key(handle.root_pid, 1),
                       "events": pipe_key(handle.root_pid, 3)}
            deleted = _deleted_open_files(procs)
            remap_dirs = {str(Path(d).parent) for d in deleted}
        handle.send("prepare-dump")
        handle.wait_event("dump-ready", 120)
        with rep.phase("inventory_check", "checking the tree for what CRIU cannot restore"):
            tree_inv = inventory.inspect_tree(handle.root_pid)
        dump_opts = criu.DumpOptions(pid=handle.root_pid)
        before = {d: set(os.listdir(d)) for d in remap_dirs if os.path.isdir(d)}
        criu_env = criu.cuda_env(criu_bin) if kind == "cuda" else {}
        with rep.phase("dump", "CRIU dump"), locks.criu_lock():
            criu.Criu(criu_bin, criu_env).dump(dump_opts, tmp / store.IMAGES, tmp)
            # the dump killed the tree; make sure every process is gone
            gone, alive = psutil.wait_procs(procs, timeout=30)
            if alive:
                raise EngineError(f"processes survived the dump: {[p.pid for p in alive]}")
            handle.close()
            handle = None
        # link-remap files CRIU left for deleted-but-open files; restore consumes them
        remaps = []
        for d, names in before.items():
            for n in sorted(set(os.listdir(d)) - names):
                if n.startswith("link_remap."):
                    src = Path(d) / n
                    dst_name = (d.strip("/").replace("/", "%") + "%" + n)
                    shutil.copy2(src, tmp / store.FILES / dst_name)
                    os.chmod(tmp / store.FILES / dst_name, 0o600)
                    remaps.append(src)
        with rep.phase("pack", f"checksums + compression ({req.compression})"):
            images = archive.pack(tmp / store.IMAGES, req.compression)
            extra = archive.pack(tmp / store.FILES, archive.Compression("none", 0))
        for src in remaps:  # the copies live in the snapshot now
            src.unlink(missing_ok=True)
        raw = sum(i.raw_bytes for i in images)
        stored = sum(i.stored_bytes for i in images)
        host = host_identity(criu_ver, kind)
        m = manifest.Manifest(
            schema_version=manifest.SCHEMA_VERSION,
            tool_version=__version__,
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            host=host,
            engine=manifest.EngineInfo(
                kind=kind, sleep_level=sleep_level, engine_args=tuple(redact_args(req.engine_args)),
                env_hashes=identity.env_hashes(env), full_state_captured=(sleep_level == 0)),
            model=manifest.ModelIdentity(
                requested=req.model, path=str(model_dir), served_name=info["served_model_name"],
                files=files, total_bytes=sum(f.size for f in files)),
            oracle=recorded,
            criu=manifest.CriuInfo(
                version=criu_ver, flags=criu.SHARED_FLAGS, inherit=inherit, pid_namespace=True,
                root_pid=dump_opts.pid, tree_pids=tree_inv.pids, tree_commands=tree_inv.commands,
                dump_argv=tuple(criu.dump_argv(dump_opts, str(target / store.IMAGES))),
                listeners=tuple(tree_inv.listeners),
                tree_files=tuple(manifest.TreeFile(**f.to_json()) for f in tree_inv.files)),
            images=images,
            extra_files=extra,
            sizes={"raw": raw, "stored": stored, "model": sum(f.size for f in files)},
            timings=dict(rep.timings),
        )
        with rep.phase("publish", "publishing"):
            m = manifest.seal(m.model_copy(update={"timings": dict(rep.timings)}))
            for dirpath, _dirs, names in os.walk(tmp):  # CRIU writes stats-dump 0644
                for n in names:
                    os.chmod(os.path.join(dirpath, n), 0o600)
            manifest.write_atomic(m, tmp)
            store.publish(tmp, target)
        return m
    except BaseException as e:
        if handle is not None:
            handle.kill()
            handle.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_enospc(e):
            raise EnvironmentProblem(
                f"no space left on the filesystem of {target.parent} while writing the snapshot; "
                "the partial snapshot was removed",
                hint="free space there or choose another --snapshot-dir/--root "
                     "(a CPU engine's image is about its resident memory; see `inspect` of an earlier snapshot)") from e
        raise
    finally:
        os.close(log_fd)


# ----------------------------------------------------------------------------- restore

@dataclass
class RestoreRequest:
    """Inputs of :func:`restore`."""

    snapshot: Path
    host: str = "127.0.0.1"
    port: int = 8000
    verify_model: str = "quick"
    allow: frozenset[str] = frozenset()
    detach: bool = False
    log_file: Path | None = None
    engine_log: Callable[[bytes], None] | None = None
    canary: bool = True


@dataclass
class Restored:
    """A restored, validated, serving engine. ``handle`` stays valid in foreground mode."""

    handle: EngineHandle
    pid: int
    url: str
    manifest: manifest.Manifest
    timings: dict[str, float]
    warnings: list[str]


def port_free(host: str, port: int) -> None:
    """Refuse when ``host:port`` cannot be bound now. Raises BusyError naming the owner."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} is not a numeric IPv4/IPv6 address ({e.strerror})",
                         hint="use e.g. 127.0.0.1, 0.0.0.0 or ::1") from e
    fam = infos[0][0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        if e.errno == 99:  # EADDRNOTAVAIL: not an address of this host
            raise UsageError(f"--host {host} is not an address of this host: {e.strerror}") from e
        owner = ""
        try:
            for c in psutil.net_connections("inet"):
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                    owner = f" (held by PID {c.pid}: {' '.join(psutil.Process(c.pid).cmdline())[:120]})"
                    break
        except (psutil.Error, OSError):
            pass
        raise BusyError(f"port {host}:{port} is not free{owner}: {e.strerror}",
                        hint="choose another --port or stop what listens there") from e
    finally:
        s.close()


def validate(snapshot: Path, verify_model: str = "quick", allow: frozenset[str] = frozenset(),
             check_images: bool = False) -> tuple[manifest.Manifest, list[str]]:
    """Every check a restore makes before CRIU, in order: layout/permissions, manifest
    schema + digest, host identity field by field, image layout (and checksums with
    ``check_images``), model files. Returns (manifest, warnings). Raises CorruptSnapshotError,
    IncompatibleHostError, ModelChangedError, EnvironmentProblem."""
    snapshot = snapshot.absolute()
    store.check_dir_safety(snapshot)
    store.check_file_modes(snapshot)
    m = manifest.read(snapshot)
    archive.check_layout(snapshot / store.IMAGES, m.images)
    archive.check_layout(snapshot / store.FILES, m.extra_files)
    criu_bin, criu_ver = criu_binary()
    here = host_identity(criu_ver, m.engine.kind)
    try:
        diffs = identity.compare(m.host, here, allow)
    except ValueError as e:
        raise UsageError(str(e)) from e
    warnings = [f"identity override: {d}" for d in diffs if d.overridden]
    hard = [d for d in diffs if not d.overridden]
    if hard:
        raise IncompatibleHostError(
            "this host differs from the one the snapshot was created on:\n  " + "\n  ".join(map(str, hard)),
            hint="restore on a matching host, or re-create the snapshot here",
            details=[d.__dict__ for d in hard])
    if check_images:
        archive.verify(snapshot / store.IMAGES, m.images)
        archive.verify(snapshot / store.FILES, m.extra_files)
    problems = inventory.check_files([f.model_dump() for f in m.criu.tree_files])
    if problems:
        raise IncompatibleHostError(
            "files the engine had open or mapped changed since the snapshot was created:\n  " + "\n  ".join(problems),
            hint="restore with the same venv/libraries, or re-create the snapshot")
    mc = model_digest.verify(Path(m.model.path), m.model.files, "full" if verify_model == "full" else "quick")
    if mc.added:
        warnings.append("model dir has files the snapshot did not record: " + ", ".join(mc.added))
    return m, warnings


def _http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_canary(base: str, m: manifest.Manifest) -> list[str]:
    """Send the oracle prompt over HTTP (/v1/completions, greedy, 1 token, logprobs 5) and
    compare text + logprob with the manifest's oracle. Returns differences."""
    status, body = _http_json(f"{base}/v1/completions", {
        "model": m.model.served_name, "prompt": m.oracle.prompt, "max_tokens": 1,
        "temperature": 0.0, "logprobs": 5})
    if status != 200 or not isinstance(body, dict):
        return [f"canary request failed: HTTP {status}: {str(body)[:200]}"]
    choice = body["choices"][0]
    diffs = []
    if choice.get("text") != m.oracle.text:
        diffs.append(f"canary text: expected {m.oracle.text!r}, got {choice.get('text')!r}")
    lps = (choice.get("logprobs") or {}).get("token_logprobs") or [None]
    if lps[0] is None or abs(float(lps[0]) - m.oracle.logprob) > oracle.LOGPROB_ABS_TOL:
        diffs.append(f"canary logprob: expected {m.oracle.logprob!r}, got {lps[0]!r}")
    return diffs


def _put_back_files(snapshot: Path, m: manifest.Manifest) -> list[Path]:
    placed = []
    for f in m.extra_files:
        d, _, n = f.name.rpartition("%")
        dst = Path("/" + d.replace("%", "/")) / n
        if not dst.exists():
            shutil.copy2(snapshot / store.FILES / f.name, dst)
            placed.append(dst)
    return placed


def restore(req: RestoreRequest, rep: Reporter) -> Restored:
    """Validate, stage, CRIU-restore, replay the oracle inside the engine, and only then bind
    ``host:port`` and serve; then a canary request over HTTP. Fails closed: on any error the
    restored tree is killed, the port is released, staging is removed, the snapshot is
    untouched. Raises the SnapshotError subclasses of :func:`validate`, BusyError, CriuError,
    EngineError, OracleMismatchError."""
    require_root()
    snapshot = req.snapshot.absolute()
    with locks.snapshot_lock(snapshot, shared=True):
        r = _restore_locked(req, rep, snapshot)
    try:
        registry.register(registry.Entry(
            snapshot=str(snapshot), pid=r.pid, supervisor_pid=0 if req.detach else os.getpid(),
            host=req.host, port=req.port, started_at=time.time(),
            mode="detached" if req.detach else "foreground"))
        store.record_restore(snapshot, [w for w in r.warnings if w.startswith("identity override")])
    except OSError as e:  # bookkeeping only: never fail a served restore for it
        rep.info(f"could not record the engine in the registry: {e}")
    return r


def _restore_locked(req: RestoreRequest, rep: Reporter, snapshot: Path) -> Restored:
    with rep.phase("validate", "validating snapshot, host and model"):
        m, warnings = validate(snapshot, req.verify_model, req.allow)
        port_free(req.host, req.port)
        if req.detach and req.log_file is not None:
            lf = req.log_file
            if lf.is_dir() or not lf.parent.is_dir():
                raise UsageError(f"--log-file {lf}: " + ("is a directory" if lf.is_dir() else f"{lf.parent} does not exist"))
    criu_bin, _ = criu_binary()
    for w in warnings:
        rep.info(w)
    raw = sum(i.raw_bytes for i in m.images)
    stage = None
    handle: EngineHandle | None = None
    fds: list[int] = []
    placed: list[Path] = []
    try:
        with rep.phase("stage", "verifying checksums and staging images"):
            stage = archive.unpack(snapshot / store.IMAGES, m.images,
                                   archive.staging_parent(raw, snapshot.parent, m.images))
            archive.verify(snapshot / store.FILES, m.extra_files)
            placed = _put_back_files(snapshot, m)
        ctl_r, ctl_w = os.pipe()
        ev_r, ev_w = os.pipe()
        fds += [ctl_r, ctl_w, ev_r, ev_w]
        if req.detach:
            log_path = req.log_file or Path(f"/var/log/vllm-snapshot/{snapshot.name}-{req.port}.log")
            if req.log_file is None:
                log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            log_w = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            log_r = os.open("/dev/null", os.O_RDONLY)
        else:
            log_r, log_w = os.pipe()
        fds += [log_r, log_w]
        for fd in (ctl_r, ev_w, log_w):
            os.set_inheritable(fd, True)
        inherit = ((m.criu.inherit["control"], ctl_r), (m.criu.inherit["log"], log_w),
                   (m.criu.inherit["events"], ev_w))
        with locks.criu_lock():
            # Checked under the host-wide CRIU lock, so a concurrent restore of the same
            # snapshot that just bound them is seen: refuse before CRIU would fail on them.
            taken = inventory.check_listeners_free(m.criu.listeners)
            if taken:
                raise BusyError(
                    "loopback ports the engine tree listened on at snapshot time are taken "
                    "(another engine restored from this snapshot?):\n  " + "\n  ".join(taken),
                    hint="stop the engine holding them (vllm-snapshot status / stop), or re-create the snapshot")
            with rep.phase("criu_restore", "CRIU restore"):
                criu_env = criu.cuda_env(criu_bin) if m.engine.kind == "cuda" else {}
                pid = criu.Criu(criu_bin, criu_env).restore(criu.RestoreOptions(inherit_fds=inherit), stage, stage)
        for fd in (ctl_r, ev_w, log_w):
            os.close(fd)
            fds.remove(fd)
        sinks = [req.engine_log] if req.engine_log else []
        handle = restored_handle(pid, ctl_w, ev_r, log_r, sinks)
        fds = []
        if stage is not None:
            archive.remove_staging(stage)
            stage = None
        if m.engine.sleep_level:
            with rep.phase("wake", "waking engine (reload weights, reset prefix cache)"):
                handle.send("wake")
                handle.wait_event("woken", RESTORE_ORACLE_TIMEOUT_S)
        with rep.phase("oracle", "replaying the oracle inside the engine"):
            handle.send("oracle")
            got = oracle.Oracle.model_validate(handle.wait_event("oracle", RESTORE_ORACLE_TIMEOUT_S)["oracle"])
            diffs = oracle.compare(m.oracle, got)
            if diffs:
                raise OracleMismatchError("the restored engine's oracle differs; refusing to serve:\n  " + "\n  ".join(diffs),
                                          details={"expected": m.oracle.model_dump(), "actual": got.model_dump()})
        base = f"http://{'[' + req.host + ']' if ':' in req.host else req.host}:{req.port}"
        with rep.phase("bind", f"binding {req.host}:{req.port}"):
            handle.send("serve", host=req.host, port=req.port, die_with_parent=not req.detach)
            handle.wait_event("binding", BIND_TIMEOUT_S)
        with rep.phase("http_ready", "waiting for the HTTP server (/health)"):
            deadline = time.monotonic() + BIND_TIMEOUT_S
            while True:
                try:
                    status, _ = _http_json(f"{base}/health", timeout=2)
                    if status == 200:
                        break
                except (urllib.error.URLError, OSError):
                    pass
                if not handle.alive():
                    raise EngineError(f"engine exited while starting the server\n{handle.log.tail_text()}")
                if time.monotonic() > deadline:
                    raise EngineError(f"server did not become healthy within {BIND_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        if req.canary:
            with rep.phase("canary", "canary request over HTTP"):
                diffs = http_canary(base, m)
                if diffs:
                    raise OracleMismatchError("the HTTP canary differs from the oracle; stopped the engine:\n  " + "\n  ".join(diffs))
        return Restored(handle, pid, base, m, dict(rep.timings), warnings)
    except BaseException:
        if handle is not None:
            handle.kill()
            handle.close()
        raise
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if stage is not None:
            archive.remove_staging(stage)
        for p in placed:  # CRIU normally consumes them; never leave ours behind
            p.unlink(missing_ok=True)


def serve_foreground(r: Restored, on_signal_msg: Callable[[str], None] | None = None, stop_grace_s: float = 30.0) -> int:
    """Block until the restored engine exits; SIGINT/SIGTERM are forwarded to it as SIGTERM
    (clean shutdown), then SIGKILL after ``stop_grace_s``. Returns the engine's exit code."""
    h = r.handle
    stopping = {"at": None}

    def _fwd(signum, frame):
        if on_signal_msg:
            on_signal_msg(f"received signal {signum}; stopping the engine")
        stopping["at"] = stopping["at"] or time.monotonic()
        try:
            os.kill(h.root_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, _fwd) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            code = h.reap(block=False)
            if code is not None:
                break
            if stopping["at"] and time.monotonic() - stopping["at"] > stop_grace_s:
                h.kill()
                code = 128 + signal.SIGKILL
                break
            time.sleep(0.2)
        # stragglers of the namespace die with its init; wait for the log to drain
        h.log.join(timeout=5)
        return code
    finally:
        for s, hnd in old.items():
            signal.signal(s, hnd)
        h.close()
        registry.unregister(r.pid)


# ----------------------------------------------------------------------------- store and runtime

def describe(snapshot: Path) -> dict:
    """One ``list`` row: name, model, created, kind, sleep level, raw/stored bytes, whether
    this host can restore it (``compatible`` + ``why``), last restore (unix s or None)."""
    row: dict = {"name": snapshot.name, "path": str(snapshot), "last_restore": store.last_restore(snapshot)}
    try:
        m = manifest.read(snapshot)
    except Exception as e:  # noqa: BLE001 - a broken snapshot is still listed, as incompatible
        return {**row, "model": None, "created": None, "kind": None, "sleep_level": None,
                "raw_bytes": None, "stored_bytes": None, "compatible": False, "why": str(e).splitlines()[0]}
    row.update(model=m.model.requested, created=m.created_at, kind=m.engine.kind, sleep_level=m.engine.sleep_level,
               raw_bytes=m.sizes["raw"], stored_bytes=m.sizes["stored"])
    try:
        validate(snapshot)
        row.update(compatible=True, why="")
    except Exception as e:  # noqa: BLE001
        row.update(compatible=False, why=(getattr(e, "message", None) or str(e)).splitlines()[0]
                   + (" " + " ".join(str(e).splitlines()[1:2]).strip() if len(str(e).splitlines()) > 1 else ""))
    return row


def _engines_of(snapshot: Path) -> list[registry.Entry]:
    return [e for e in registry.entries() if Path(e.snapshot) == snapshot.absolute()]


def delete(snapshot: Path, force: bool = False) -> list[int]:
    """Delete ``snapshot`` under its exclusive lock. Refuses (BusyError) while an engine
    restored from it runs, unless ``force`` (then they are stopped first). Returns the PIDs
    stopped. Raises CorruptSnapshotError for a directory that is not a snapshot."""
    from .errors import CorruptSnapshotError

    snapshot = snapshot.absolute()
    if not (snapshot / manifest.MANIFEST_NAME).is_file():
        if not snapshot.exists():
            raise UsageError(f"{snapshot} does not exist")
        raise CorruptSnapshotError(f"{snapshot} has no manifest.json; refusing to delete a directory that is not a snapshot")
    running = _engines_of(snapshot)
    if running and not force:
        raise BusyError(f"engines restored from {snapshot} are running: PIDs {[e.pid for e in running]}",
                        hint="stop them (vllm-snapshot stop), or pass --force")
    for e in running:
        registry.stop(e)
    with locks.snapshot_lock(snapshot):
        store.delete(snapshot)
    return [e.pid for e in running]


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"`` -> seconds. Raises UsageError."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise UsageError(f"--older-than {text!r}: expected a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def prune(root: Path, keep: int | None, older_than_s: float | None, dry_run: bool) -> dict:
    """Select snapshots under ``root`` beyond the ``keep`` newest per model and/or older than
    ``older_than_s``; delete them unless ``dry_run``; skip those with running engines. Also
    removes leftover temp dirs of crashed creates. Returns ``{"deleted", "kept_running",
    "temp_removed"}`` (lists of paths)."""
    if keep is None and older_than_s is None:
        raise UsageError("give --keep N and/or --older-than DURATION")
    rows = []
    for p in store.list_snapshots(root):
        try:
            m = manifest.read(p)
            created = _dt.datetime.fromisoformat(m.created_at).timestamp()
            rows.append((m.model.path, created, p))
        except Exception:  # noqa: BLE001 - unreadable snapshots are left to `delete`
            continue
    victims: set[Path] = set()
    if keep is not None:
        by_model: dict[str, list] = {}
        for model, created, p in rows:
            by_model.setdefault(model, []).append((created, p))
        for items in by_model.values():
            for _, p in sorted(items, reverse=True)[keep:]:
                victims.add(p)
    if older_than_s is not None:
        now = time.time()
        victims |= {p for _, created, p in rows if now - created > older_than_s}
    deleted, kept = [], []
    for p in sorted(victims):
        if _engines_of(p):
            kept.append(str(p))
            continue
        if not dry_run:
            with locks.snapshot_lock(p):
                store.delete(p)
        deleted.append(str(p))
    temps = [] if dry_run else [str(t) for t in store.clean_stale_temps(root)]
    return {"deleted": deleted, "kept_running": kept, "temp_removed": temps}


def stop_engines(snapshot: Path | None, port: int | None) -> list[dict]:
    """Stop registered engines of ``snapshot`` or on ``port``; wait until their processes
    are gone. Returns ``[{"pid", "snapshot", "port", "seconds"}]``. Raises UsageError when
    none matches."""
    match = [e for e in registry.entries()
             if (snapshot is not None and Path(e.snapshot) == snapshot.absolute()) or (port is not None and e.port == port)]
    if not match:
        raise UsageError("no restored engine matches " + (f"snapshot {snapshot}" if snapshot else f"port {port}"))
    return [{"pid": e.pid, "snapshot": e.snapshot, "port": e.port, "seconds": round(registry.stop(e), 3)} for e in match]


def switch(snapshot: Path, host: str, port: int, log_file: Path | None, rep: Reporter) -> dict:
    """Stop the engine on ``port`` (if any), restore ``snapshot`` there detached. Returns
    ``{"snapshot", "pid", "url", "stop_s", "restore_s", "switch_s", "stopped"}`` (seconds)."""
    t0 = time.monotonic()
    stopped = [e.pid for e in registry.entries() if e.port == port]
    if stopped:
        with rep.phase("stop_previous", f"stopping the engine on port {port}"):
            stop_engines(None, port)
    t1 = time.monotonic()
    r = restore(RestoreRequest(snapshot=snapshot, host=host, port=port, detach=True, log_file=log_file), rep)
    r.handle.close()
    t2 = time.monotonic()
    return {"snapshot": str(snapshot), "pid": r.pid, "url": r.url, "stop_s": round(t1 - t0, 3),
            "restore_s": round(t2 - t1, 3), "switch_s": round(t2 - t0, 3), "stopped": stopped}
