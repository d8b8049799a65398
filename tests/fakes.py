"""Test doubles declared against the product's Protocols (``tests/test_protocols.py`` checks
their methods and signatures against the Protocol and the real class).

:class:`FakeTools` records every side-effect call in ``calls`` (method names, in order) and
can be told to fail at any method (``fail={"dump": CriuError(...)}``); its engine is a
:class:`FakeEngine` answering the engine protocol from a script.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

from vllm_snapshot.store import manifest as mf
from vllm_snapshot.checkpoint.criu import DumpOptions, RestoreOptions
from vllm_snapshot.host.cgroups import Placement
from vllm_snapshot.checkpoint.gpu import GpuUse
from vllm_snapshot.checkpoint.inventory import Inventory
from vllm_snapshot.store.manifest import CodeIdentity, EngineUser, ExternalMount, ImageFile, Manifest, ModelFile
from vllm_snapshot.store.model_digest import ModelCheck
from vllm_snapshot.host.privilege import Creds, User
from vllm_snapshot.store.registry import Entry, StopReport
from vllm_snapshot.host.resources import Offer
from vllm_snapshot.effects.tools import Engine, EngineChannel, SnapshotTools

from helpers import ENGINE_USER, make_manifest, make_oracle

HOST = {"vllm": "0.32.0", "torch": "2.13.0+cpu", "kernel": "6.18.0", "machine_id": "abc"}


class FakeEngine(Engine):
    """Answers commands with the events the real engine sends; ``oracle`` answers with
    ``oracles`` in turn (the last repeats)."""

    def __init__(self, calls: list[str], kind: str = "cpu", oracles: list | None = None, pid: int = 4242,
                 engine_args: list[str] | None = None) -> None:
        self.root_pid = pid
        self.engine_args = list(engine_args or [])
        self.calls = calls
        self.kind = kind
        self.oracles = list(oracles or [make_oracle()])
        self.sent: list[str] = []
        self.timeouts: dict[str, float] = {}  # event -> the last timeout waited for it (seconds)
        self.killed = False
        self.closed = False
        self._alive = True

    def _next_oracle(self) -> dict:
        o = self.oracles.pop(0) if len(self.oracles) > 1 else self.oracles[0]
        return o.model_dump()

    def send(self, cmd: str, **kw) -> None:
        self.sent.append(cmd)
        self.calls.append(f"engine.{cmd}")

    def wait_event(self, name: str, timeout: float) -> dict:
        self.timeouts[name] = timeout
        if name == "initialized":
            return {"event": name, "oracle": self._next_oracle(),
                    "info": {"kind": self.kind, "vllm": "x", "torch": "y", "served_model_name": "tiny",
                             "normalized_args": {"args": " ".join(self.engine_args)}}}
        if name == "oracle":
            return {"event": name, "oracle": self._next_oracle()}
        if name == "dump-ready":
            return {"event": name, "modules": ["vllm", "torch"], "sys_path": ["/site-packages"]}
        return {"event": name}

    def alive(self) -> bool:
        return self._alive

    def kill(self, grace: float = 0.0) -> None:
        self.calls.append("engine.kill")
        self.killed = True
        self._alive = False

    def close(self) -> None:
        self.calls.append("engine.close")
        self.closed = True

    def reap(self, block: bool = True) -> int | None:
        return 0

    def log_tail(self, n: int = 20) -> str:
        return ""

    def drain_log(self, timeout_s: float = 5.0) -> None:
        return None


class FakeChannel(EngineChannel):
    def __init__(self) -> None:
        self.closed = False

    def inherit_fds(self, keys: dict[str, str]) -> tuple[tuple[str, int], ...]:
        return tuple((k, 10 + i) for i, k in enumerate(sorted(keys.values())))

    def close(self) -> None:
        self.closed = True


class FakeTools(SnapshotTools):
    """A recording :class:`SnapshotTools`. ``manifest`` is what ``open_snapshot`` returns;
    ``host`` the identity; ``fail`` maps a method name to the exception it raises."""

    def __init__(self, *, manifest: Manifest | None = None, host: dict | None = None, kind: str = "cpu",
                 oracles: list | None = None, fail: dict[str, BaseException] | None = None,
                 health_after: int = 0, canary_diffs: list[str] | None = None) -> None:
        self.calls: list[str] = []
        self.manifest = manifest or make_manifest(host=dict(HOST))
        self.host = dict(host or HOST)
        self.kind = kind
        self.oracles = oracles
        self.fail = dict(fail or {})
        self.health_after = health_after
        self.canary_diffs = list(canary_diffs or [])
        self.engine: FakeEngine | None = None
        self.channel: FakeChannel | None = None
        self.restore_opts: RestoreOptions | None = None
        self.dump_opts: DumpOptions | None = None
        self.published: list[Path] = []
        self.net_problems: tuple[str, ...] = ()  # what inspect_tree says of the tree's network namespace
        self.discarded: list[Path] = []
        self.registered: list[Entry] = []
        self.entries: list[Entry] = []
        self._t = 0.0
        self.externals: list[ExternalMount] = []
        self.mount_problems: list[str] = []
        self.code_problems: list[str] = []  # what check_code finds
        self.missing_caps: list[int] = []  # what caps_missing finds
        self.restored_tree: list[str] | None = None
        self.uuids: list[str] = ["GPU-fake-0"]
        self.model_files: tuple[ModelFile, ...] | None = None
        self.refusals: dict[str, dict] = {}
        #: str(snapshot) -> its pull record (``pulled_from``): a snapshot pulled from a registry
        self.pulled: dict[str, dict] = {}
        #: path -> manifest: a store of several snapshots (list_snapshots/open_snapshot/publish)
        self.snapshots: dict[Path, Manifest] | None = None
        #: path -> the error its restore raises (from ``stage``)
        self.refuse: dict[Path, BaseException] = {}
        self.refuse_all: BaseException | None = None
        self.corrupt_images: BaseException | None = None  # raised by the background checksum verdict
        self.unpacking = False  # stage_checking returns an Unpacking (a compressed snapshot: ready() before memory)
        self.corrupt_frame: BaseException | None = None  # raised by that ready()
        self.offer = Offer(64 << 30, "MemAvailable 64.00 GiB")
        self.device = "cpu"
        #: what engine_user returns (name replaced by the one asked for)
        self.user = User(ENGINE_USER.name, ENGINE_USER.uid, ENGINE_USER.gid, ENGINE_USER.groups, ENGINE_USER.home)
        #: engine_access's answer: {"model"|"code"|"home": [problems]}
        self.access: dict[str, list[str]] = {}
        #: user_problems's answer
        self.user_identity: list[str] = []
        #: paths unreadable_by says the engine user cannot read
        self.user_unreadable: list[str] = []
        #: tree_creds's answer; None: every tree process runs as self.user with no capability
        self.creds: dict[int, Creds] | None = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    # ---- host
    def require_root(self) -> None:
        self._call("require_root")

    def criu_version(self) -> str:
        self._call("criu_version")
        return "4.2.1"

    def host_identity(self, kind: str) -> dict[str, str]:
        self._call("host_identity")
        return dict(self.host)

    def check_mounts(self, model_dir: Path, env: dict[str, str]) -> None:
        self._call("check_mounts")

    def external_mounts(self, root_pid: int) -> tuple[ExternalMount, ...]:
        self._call("external_mounts")
        return tuple(self.externals)

    def check_external_mounts(self, mounts: tuple[ExternalMount, ...]) -> list[str]:
        self._call("check_external_mounts")
        return list(self.mount_problems)

    def code_paths(self) -> dict[str, Path]:
        return {"Python environment": Path("/venv")}

    def engine_user(self, name: str) -> User:
        self._call("engine_user")
        return User(name, self.user.uid, self.user.gid, self.user.groups, self.user.home)

    def engine_access(self, user: User, model_dir: Path) -> dict[str, list[str]]:
        self._call("engine_access")
        return {"model": [], "code": [], "home": [], **self.access}

    def caps_missing(self, snapshot: Path, m: Manifest) -> list[int]:
        self._call("caps_missing")
        return list(self.missing_caps)

    def user_problems(self, u: EngineUser) -> list[str]:
        self._call("user_problems")
        return list(self.user_identity)

    def tree_creds(self, root_pid: int) -> dict[int, Creds]:
        self._call("tree_creds")
        if self.creds is not None:
            return dict(self.creds)
        u = self.user
        ok = Creds(uids=(u.uid,) * 4, gids=(u.gid,) * 4, groups=u.groups, cap_inh=0, cap_prm=0, cap_eff=0,
                   cap_bnd=0, cap_amb=0, no_new_privs=1)
        return {root_pid: ok, root_pid + 1: ok}

    def unreadable_by(self, u: EngineUser, paths: list[Path]) -> list[str]:
        self._call("unreadable_by")
        return [f"cannot read {p}: Permission denied" for p in paths if str(p) in self.user_unreadable]

    def engine_device(self) -> str:
        return self.device

    def check_cuda_ready(self) -> None:
        self._call("check_cuda_ready")

    def gpu_used(self, inv: Inventory) -> GpuUse:
        self._call("gpu_used")
        return GpuUse("GPU-fake-0", (2,))  # the tree's second process (namespace PID 2) has CUDA

    def gpu_uuids(self) -> list[str]:
        return list(self.uuids)

    def environ(self) -> dict[str, str]:
        return {"PATH": "/usr/bin", "HF_TOKEN": "hf_secret"}

    def path_exists(self, path: Path) -> bool:
        if self.snapshots is not None:
            return path in self.snapshots or any(path in p.parents for p in self.snapshots)
        return False

    def canonical(self, path: Path) -> Path:
        return Path(path).absolute()

    # ---- model
    def resolve_model(self, model: str, revision: str | None) -> tuple[Path, str | None]:
        self._call("resolve_model")
        return Path(model), None

    def digest_model(self, model_dir: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
        self._call("digest_model")
        return self.model_files if self.model_files is not None else self.manifest.model.files

    def model_stats(self, model_dir: Path, files: tuple[ModelFile, ...]) -> tuple[ModelFile, ...]:
        self._call("model_stats")
        return files

    def recheck_model(self, model_dir: Path, pinned: tuple[ModelFile, ...], since_ns: int, during: str,
                      hint: str) -> tuple[str, ...]:
        self.rechecked = (pinned, since_ns)
        self._call("recheck_model")
        return ()

    def normalize_engine_args(self, engine_args: list[str]) -> dict[str, str]:
        self._call("normalize_engine_args")
        if "--bogus" in engine_args:
            from vllm_snapshot.errors import UsageError

            raise UsageError("invalid engine arguments: unrecognized arguments: --bogus")
        return {"args": " ".join(engine_args)}

    def verify_model(self, model_dir: Path, files: tuple[ModelFile, ...], mode: str) -> ModelCheck:
        self._call(f"verify_model:{mode}")
        return ModelCheck(rehashed=(), added=())

    # ---- snapshot directories
    def prepare_target(self, target: Path) -> Path:
        self._call("prepare_target")
        return target.parent / f".{target.name}.tmp-x"

    def discard(self, tmp: Path) -> None:
        self._call("discard")
        self.discarded.append(tmp)

    def publish(self, m: Manifest, tmp: Path, target: Path) -> None:
        self._call("publish")
        self.published.append(target)
        if self.snapshots is not None:
            self.snapshots[target] = m

    def open_snapshot(self, snapshot: Path) -> Manifest:
        self._call("open_snapshot")
        if self.snapshots is not None:
            if snapshot not in self.snapshots:
                from vllm_snapshot.errors import UsageError

                raise UsageError(f"snapshot {snapshot} does not exist")
            return self.snapshots[snapshot]
        return self.manifest

    def pulled_from(self, snapshot: Path) -> dict | None:
        return self.pulled.get(str(snapshot))

    def verify_images(self, snapshot: Path, m: Manifest) -> None:
        self._call("verify_images")

    def check_tree_files(self, m: Manifest) -> list[str]:
        self._call("check_tree_files")
        return []

    def pin_code(self, modules: list[str], sys_path: list[str], work_dir: Path) -> CodeIdentity:
        self._call("pin_code")
        self.pinned_modules = list(modules)
        return CodeIdentity(table_digest="0" * 64, files=len(modules), distributions={"vllm": "0.32.0"})

    def check_code(self, snapshot: Path, m: Manifest) -> list[str]:
        self._call("check_code")
        return list(self.code_problems)

    # ---- engine (create)
    def launch_engine(self, spec: dict, env: dict[str, str], log_path: Path,
                      echo: Callable[[bytes], None] | None) -> Engine:
        self._call("launch_engine")
        self.launch_env = env
        self.launch_spec = spec
        self.engine = FakeEngine(self.calls, self.kind, self.oracles, engine_args=spec.get("engine_args"))
        return self.engine

    def inspect_tree(self, root_pid: int) -> Inventory:
        self._call("inspect_tree")
        return Inventory(root_pid=root_pid, pids=(root_pid, root_pid + 1), commands=("python", "VLLM::EngineCore"),
                         listeners=(), files=(), net_problems=self.net_problems)

    def channel_keys(self, root_pid: int) -> dict[str, str]:
        self._call("channel_keys")
        return {"control": "pipe:[1]", "log": "pipe:[2]", "events": "pipe:[3]"}

    def watch_remaps(self, deleted: tuple[str, ...]) -> dict[str, set[str]]:
        return {}

    def collect_remaps(self, before: dict[str, set[str]], files_dir: Path) -> list[Path]:
        self._call("collect_remaps")
        return []

    def find_remaps(self, before: dict[str, set[str]]) -> list[Path]:
        self._call("find_remaps")
        return []

    def cleanup_remaps(self, found: list[Path]) -> None:
        self._call("cleanup_remaps")

    def check_dump_room(self, inv: Inventory, gpu_uuid: str, work_dir: Path) -> None:
        self._call("check_dump_room")

    def dump(self, kind: str, opts: DumpOptions, work_dir: Path) -> None:
        self.dump_opts = opts
        self._call("dump")

    def wait_gone(self, pids: tuple[int, ...], timeout_s: float) -> list[int]:
        self._call("wait_gone")
        return []

    def pack(self, directory: Path, compression: str) -> tuple[ImageFile, ...]:
        self._call(f"pack:{directory.name}")
        return self.manifest.images if directory.name == "images" else ()

    # ---- engine (restore)
    def port_free(self, host: str, port: int) -> None:
        self._call("port_free")

    def memory_offer(self, detached: bool = False) -> Offer:
        self._call("memory_offer")
        self.offer_detached = detached
        return self.offer

    def serve_engine(self, engine: Engine, host: str, port: int, die_with_parent: bool,
                     frontend: tuple[str, ...] = (), drain_s: float | None = None) -> None:
        self._call("serve_engine")
        self.served_frontend = tuple(frontend)
        self.served_drain = drain_s
        engine.send("serve", host=host, port=port, die_with_parent=die_with_parent, handoff="fake-handoff",
                    frontend=list(frontend), drain_s=drain_s)

    def engine_owning(self, pid: int, entries: list[Entry]) -> Entry | None:
        return next((e for e in entries if pid in (e.pid + 1, e.supervisor_pid)), None)  # root's child: root + 1

    def engine_cgroup(self, name: str) -> Placement:
        self._call("engine_cgroup")
        return Placement(name)  # no leaves: enter/leave/remove touch nothing

    def cgroup_of(self, pid: int) -> str:
        return "/fake"

    def check_log_file(self, path: Path) -> None:
        self._call("check_log_file")

    def default_log_file(self, snapshot: Path, port: int) -> Path:
        return Path(f"/var/log/vllm-snapshot/{snapshot.name}-{port}.log")

    def stage(self, snapshot: Path, m: Manifest) -> Path:
        self._call("stage")
        if snapshot in self.refuse:
            raise self.refuse[snapshot]
        if self.refuse_all is not None:
            raise self.refuse_all
        return Path("/stage")

    def stage_checking(self, snapshot: Path, m: Manifest):
        stage = self.stage(snapshot, m)
        tools = self

        class _Checking:
            def wait(self) -> None:
                tools._call("checksums")
                if tools.corrupt_images is not None:
                    raise tools.corrupt_images

            def cancel(self) -> None:
                tools._call("checksums.cancel")

        class _Unpacking(_Checking):  # a compressed snapshot: the pages images still unpacking
            waited_s = 0.0

            def ready(self) -> None:
                tools._call("unpack_ready")
                if tools.corrupt_frame is not None:
                    raise tools.corrupt_frame

        return stage, (_Unpacking() if self.unpacking else _Checking())

    def unstage(self, stage: Path) -> None:
        self._call("unstage")

    def unstage_all(self, near: Path) -> None:
        self._call("unstage_all")

    def put_back_remaps(self, snapshot: Path, m: Manifest) -> list[Path]:
        self._call("put_back_remaps")
        return []

    def new_channel(self, log_file: Path | None) -> EngineChannel:
        self._call("new_channel")
        self.channel = FakeChannel()
        return self.channel

    def criu_lock(self) -> AbstractContextManager:
        self._call("criu_lock")
        return nullcontext()

    def listeners_taken(self, listeners: tuple[tuple[str, int], ...]) -> list[str]:
        self._call("listeners_taken")
        return []

    def ports_held_by(self, pid: int) -> set[int]:
        return set()

    def gpu_lock(self, uuid: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from contextlib import contextmanager

        @contextmanager
        def held():
            self._call(f"gpu_lock:{uuid}")
            try:
                yield
            finally:
                self.calls.append("gpu_unlock")
        return held()

    def check_gpu_capacity(self, m: Manifest) -> None:
        self._call("check_gpu_capacity")

    def restore_tree(self, kind: str, opts: RestoreOptions, stage: Path,
                     before_memory: Callable[[], None] | None = None, cuda_pids: tuple[int, ...] = ()) -> int:
        self.restore_opts = opts
        self.restore_cuda_pids = cuda_pids
        self._call("restore_tree")
        if before_memory is not None:
            before_memory()
        return 5151

    def adopt(self, pid: int, channel: EngineChannel, echo: Callable[[bytes], None] | None) -> Engine:
        self._call("adopt")
        self.engine = FakeEngine(self.calls, self.manifest.engine.kind, self.oracles, pid)
        return self.engine

    def tree_commands(self, pid: int) -> tuple[str, ...]:
        self._call("tree_commands")
        return tuple(self.restored_tree if self.restored_tree is not None else self.manifest.criu.tree_commands)

    def http_health(self, url: str) -> bool:
        self._call("http_health")
        self.health_after -= 1
        return self.health_after < 0

    def http_canary(self, url: str, m: Manifest, api_key: str | None = None) -> list[str]:
        self.canary_key = api_key
        self.canary_url = url
        self._call("http_canary")
        return list(self.canary_diffs)

    # ---- store and runtime
    def snapshot_lock(self, snapshot: Path, shared: bool, must_exist: bool = True) -> AbstractContextManager:
        self._call("snapshot_lock")
        return nullcontext()

    def disk_room(self, target: Path, model_dir: Path) -> tuple[tuple[str, int] | None, int]:
        self._call("disk_room")
        return getattr(self, "room", (None, 1 << 50))

    def port_lock(self, port: int, on_wait: Callable[[str], None]) -> AbstractContextManager:
        self._call("port_lock")
        return nullcontext()

    def list_snapshots(self, root: Path) -> list[Path]:
        self._call("list_snapshots")
        if self.snapshots is not None:
            return sorted(p for p in self.snapshots if p.parent == root)
        return [root / "a", root / "b"]

    def delete_snapshot(self, snapshot: Path) -> None:
        self._call("delete_snapshot")

    def clean_stale_temps(self, root: Path) -> list[Path]:
        return []

    def reclaim(self, near: Path, dry_run: bool = False) -> list[str]:
        self._call("reclaim")
        return []

    def key_lock(self, key: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        self._call("key_lock")
        return nullcontext()

    def record_refusal(self, snapshot: Path, code: str, reason: str) -> None:
        self._call("record_refusal")
        self.refusals[str(snapshot)] = {"code": code, "reason": reason, "at": 0.0}

    def refusal(self, snapshot: Path) -> dict | None:
        return self.refusals.get(str(snapshot))

    def last_restore(self, snapshot: Path) -> float | None:
        return None

    def record_restore(self, snapshot: Path, overrides: list[str]) -> None:
        self._call("record_restore")

    def engines(self) -> list[Entry]:
        return list(self.entries)

    def orphan_pids(self) -> list[int]:
        return list(getattr(self, "orphans", []))

    def empty_engine_cgroups(self) -> list[str]:
        return list(getattr(self, "empty_cgroups", []))

    def register(self, entry: Entry) -> None:
        self._call("register")
        self.registered.append(entry)

    def unregister(self, pid: int) -> None:
        self._call("unregister")

    def stop_engine(self, entry: Entry, drain_s: float | None = None) -> StopReport:
        self._call("stop_engine")
        self.stop_drains = [*getattr(self, "stop_drains", []), drain_s]
        return getattr(self, "stop_report", StopReport(0.5))

    # ---- time
    def clock(self) -> float:
        self._t += 1.0
        return self._t

    def now(self) -> float:
        return 1_700_000_000.0

    def sleep(self, seconds: float) -> None:
        return None


def manifest_with(**over) -> Manifest:
    """A sealed manifest with the fake host identity and ``over`` applied (``engine.network``
    ``host``: a snapshot made before engines had their own network namespace)."""
    return make_manifest(host=dict(HOST), **over)


def isolated_manifest(**over) -> Manifest:
    """A sealed manifest of today's kind: the engine in its own network namespace
    (``engine.network`` ``isolated``), with recorded loopback listeners."""
    base = manifest_with()
    return manifest_with(engine=base.engine.model_copy(update={"network": "isolated"}),
                         criu=base.criu.model_copy(update={"listeners": (("127.0.0.1", 40000),)}), **over)


__all__ = ["FakeTools", "FakeEngine", "FakeChannel", "HOST", "isolated_manifest", "manifest_with", "mf"]
