"""Test doubles declared against the product's Protocols (``tests/test_protocols.py`` checks
their methods and signatures against the Protocol and the real class).

One fake per role of :class:`vllm_snapshot.effects.tools.Tools` (``FakeHostTools``, ...), all
over one :class:`FakeWorld`, which records every side-effect call in ``calls`` (method names,
in order, across the roles) and can be told to fail at any method
(``fail={"dump": CriuError(...)}``); ``world.tools`` is the bundle an operation is given. The
engine is a :class:`FakeEngine` answering the engine protocol from a script.
"""

from __future__ import annotations

import socket
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

from vllm_snapshot.store import manifest as mf
from vllm_snapshot.checkpoint.criu import DumpOptions, RestoreOptions
from vllm_snapshot.host.cgroups import Placement
from vllm_snapshot.checkpoint.gpu import GpuSlot, GpuUse
from vllm_snapshot.checkpoint.inventory import Inventory
from vllm_snapshot.checkpoint.carry import Plan as CarryPlan
from vllm_snapshot.store.manifest import (CarriedDir, CarriedFile, CodeIdentity, EngineUser, ExternalMount, ImageFile, Manifest,
                                         ModelFile, WeightsFile)
from vllm_snapshot.store.model_digest import ModelCheck
from vllm_snapshot.host.privilege import Creds, User
from vllm_snapshot.errors import SnapshotError
from vllm_snapshot.report.results import ExitedRow, PartialPull
from vllm_snapshot.store.registry import Entry, StopReport
from vllm_snapshot.host.resources import Offer
from vllm_snapshot.effects.protocols import (
    CheckpointTools,
    Clock,
    EngineTools,
    HostTools,
    ModelTools,
    RuntimeTools,
    SnapshotFiles,
    StoreTools,
)
from vllm_snapshot.effects.handles import Engine, EngineChannel, StagedImages, UnpackingImages, WeightsChannel
from vllm_snapshot.effects.tools import Tools
from vllm_snapshot.fleet import reference
from vllm_snapshot.effects.protocols import FleetTools
from vllm_snapshot.fleet.transport import Target
from vllm_snapshot.engine.protocol import decode, encode_event
from vllm_snapshot.engine.spec import EngineSpec

from helpers import ENGINE_USER, make_canary, make_manifest, make_oracle

HOST = {"vllm": "0.32.0", "torch": "2.13.0+cpu", "kernel": "6.18.0", "machine_id": "abc"}


class FakeEngine(Engine):
    """Answers commands with the events the real engine sends; ``oracle`` answers with
    ``oracles`` in turn (the last repeats), or with ``canary`` when asked with a prompt (create's
    rehearsal of the canary record); ``initialized`` carries ``canary`` (None: an engine that
    records none)."""

    def __init__(self, calls: list[str], kind: str = "cpu", oracles: list | None = None, pid: int = 4242,
                 engine_args: list[str] | None = None, canary=make_canary()) -> None:
        self.root_pid = pid
        self.canary = canary
        self._asked: str | None = None  # the prompt of the last oracle command (None: the oracle's)
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
        if cmd == "oracle":
            self._asked = kw.get("prompt")

    def wait_event(self, name: str, timeout: float) -> dict:
        self.timeouts[name] = timeout
        fields: dict = {}
        if name == "initialized":
            fields = {"oracle": self._next_oracle(),
                      **({"canary": self.canary.model_dump()} if self.canary is not None else {}),
                      "info": {"kind": self.kind, "vllm": "x", "torch": "y", "served_model_name": "tiny",
                               "normalized_args": {"args": " ".join(self.engine_args)}}}
        elif name == "oracle":
            fields = {"oracle": self.canary.model_dump() if self._asked is not None and self.canary is not None
                      else self._next_oracle()}
        elif name == "dump-ready":
            fields = {"modules": ["vllm", "torch"], "sys_path": ["/site-packages"]}
        elif name == "binding":
            fields = {"address": "http://127.0.0.1:8123"}
        return decode(encode_event(name, **fields))  # the protocol's field table, as the real engine's

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


class FakeWorld:
    """What the role fakes share: one call log (``calls``: method names, in order, across
    every role, so the order tests see the operations' global step order), the state they
    answer from, and ``tools``: the :class:`Tools` bundle of one fake per role. ``manifest``
    is what ``open_snapshot`` returns; ``host`` the identity; ``fail`` maps a method name to
    the exception it raises."""

    def __init__(self, *, manifest: Manifest | None = None, host: dict | None = None, kind: str = "cpu",
                 oracles: list | None = None, fail: dict[str, BaseException] | None = None,
                 health_after: int = 0, canary_diffs: list[str] | None = None) -> None:
        self.calls: list[str] = []
        self.manifest = manifest or make_manifest(host=dict(HOST))
        self.host = dict(host or HOST)
        self.kind = kind
        self.oracles = oracles
        #: the canary record a launched engine sends (and answers a rehearsal with); None: none
        self.canary = make_canary()
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
        #: this host's GPUs (gpu_slots); None: one "Fake GPU" per ``uuids``, minors 0, 1, ...
        self.slots: list[GpuSlot] | None = None
        #: raised by restore_tree when asked to remap GPUs (the helper cannot remap)
        self.remap_refusal: BaseException | None = None
        self.restore_gpu_map: tuple = ()
        self.capacity_uuid: str | None = None
        self.model_files: tuple[ModelFile, ...] | None = None
        self.refusals: dict[str, dict] = {}
        self.restored_at: dict[str, float] = {}  # snapshot -> when record_restore last ran
        #: str(snapshot) -> its pull record (``pulled_from``): a snapshot pulled from a registry
        self.pulled: dict[str, dict] = {}
        #: path -> manifest: a store of several snapshots (list_snapshots/open_snapshot/publish)
        self.snapshots: dict[Path, Manifest] | None = None
        #: path -> the error its restore raises (from ``stage``)
        self.refuse: dict[Path, BaseException] = {}
        self.refuse_all: BaseException | None = None
        self.corrupt_images: BaseException | None = None  # damaged image bytes: raised by verify_images and the staged verdict
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
        #: carry_files's answer; plan_carried's answer; what put_back_carried says it wrote
        self.carried_files: list[CarriedFile] = []
        self.carried_dirs: list[CarriedDir] = []
        self.carry_plan = CarryPlan()
        self.carry_written: list[str] = []
        #: the signal handler serve_foreground installed (forward_signals), and the PIDs terminated
        self.signal_handler: Callable[[int], None] | None = None
        self.terminated: list[int] = []
        #: what read_log_tail returns (None: the log cannot be read)
        self.log_file_tail: str | None = None
        #: bytes free on the log file's filesystem (None: cannot be told)
        self.log_room: int | None = None
        #: called by sleep() with the clock's time (a test sends a signal or ends the engine there)
        self.on_sleep: Callable[[float], None] | None = None
        #: what the weights channel's worker mapped (None: no worker used it); check_weights's refusal
        self.weights_file: WeightsFile | None = WeightsFile(
            path="/var/lib/vllm-snapshot/.weights/" + "ab" * 32 + ".weights", size=8192, blake3="ab" * 32, mtime_ns=1,
            ctime_ns=1, inode=7, device=8, tensors=3, mapped_bytes=8000)
        self.weights_problems: dict[str, str] = {}
        #: snapshot dirs whose unreadable manifest keeps unused weights files (weights_blocked)
        self.weights_blocked: list[str] = []
        self.tools = Tools(host=FakeHostTools(self), model=FakeModelTools(self), files=FakeSnapshotFiles(self),
                           checkpoint=FakeCheckpointTools(self), engine=FakeEngineTools(self),
                           store=FakeStoreTools(self), runtime=FakeRuntimeTools(self), clock=FakeClock(self),
                           fleet=FakeFleetTools(self))

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]


class FakeWeightsChannel(WeightsChannel):
    """The weights channel of a fake engine: ``w.weights_file`` is what its worker mapped."""

    def __init__(self, w: FakeWorld) -> None:
        self.w = w

    def result(self) -> WeightsFile | None:
        self.w._call("weights_result")
        return self.w.weights_file

    def close(self) -> None:
        self.w._call("weights_close")


class FakeChecking(StagedImages):
    """The checksum verdict of uncompressed staged images (:class:`vllm_snapshot.store.checksums.Checking`)."""

    def __init__(self, w: FakeWorld) -> None:
        self.w = w

    def wait(self) -> None:
        self.w._call("checksums")
        if self.w.corrupt_images is not None:
            raise self.w.corrupt_images

    def cancel(self) -> None:
        self.w._call("checksums.cancel")


class FakeUnpacking(FakeChecking, UnpackingImages):
    """A compressed snapshot's staged images, the pages still unpacking
    (:class:`vllm_snapshot.store.archive.Unpacking`)."""

    def __init__(self, w: FakeWorld) -> None:
        super().__init__(w)
        self.waited_s = 0.0

    def ready(self) -> None:
        self.w._call("unpack_ready")
        if self.w.corrupt_frame is not None:
            raise self.w.corrupt_frame


class _Role:
    """A role fake: it answers from, and records into, the :class:`FakeWorld` ``w``."""

    def __init__(self, w: FakeWorld) -> None:
        self.w = w


class FakeListener:
    """What :meth:`FakeHostTools.take_listener` hands out: the old engine's socket (``pid``)."""

    def __init__(self, pid: int, host: str, port: int) -> None:
        self.pid, self.host, self.port, self.closed = pid, host, port, False

    def close(self) -> None:
        self.closed = True


class FakeHostTools(_Role, HostTools):

    def require_root(self) -> None:
        self.w._call("require_root")

    def criu_version(self) -> str:
        self.w._call("criu_version")
        return "4.2.1"

    def host_identity(self, kind: str) -> dict[str, str]:
        self.w._call("host_identity")
        return dict(self.w.host)

    def gpu_uuids(self) -> list[str]:
        return [s.uuid for s in self.w.slots] if self.w.slots is not None else list(self.w.uuids)

    def gpu_slots(self) -> list[GpuSlot]:
        self.w._call("gpu_slots")  # nvidia-smi on a real host
        if self.w.slots is not None:
            return list(self.w.slots)
        return [GpuSlot(u, "Fake GPU", i) for i, u in enumerate(self.w.uuids)]

    def engine_device(self) -> str:
        return self.w.device

    def environ(self) -> dict[str, str]:
        return {"PATH": "/usr/bin", "HF_TOKEN": "hf_secret"}

    def path_exists(self, path: Path) -> bool:
        if self.w.snapshots is not None:
            return (path in self.w.snapshots or any(path in p.parents for p in self.w.snapshots)
                    or (path.name == "manifest.json" and path.parent in self.w.snapshots))
        return False

    def path_kind(self, path: Path) -> str:
        return "a directory" if self.path_exists(path) else "nothing"

    def code_paths(self) -> dict[str, Path]:
        return {"Python environment": Path("/venv")}

    def engine_user(self, name: str) -> User:
        self.w._call("engine_user")
        return User(name, self.w.user.uid, self.w.user.gid, self.w.user.groups, self.w.user.home)

    def engine_access(self, user: User, model_dir: Path) -> dict[str, list[str]]:
        self.w._call("engine_access")
        return {"model": [], "code": [], "home": [], **self.w.access}

    def user_problems(self, u: EngineUser) -> list[str]:
        self.w._call("user_problems")
        return list(self.w.user_identity)

    def unreadable_by(self, u: EngineUser, paths: list[Path]) -> list[str]:
        self.w._call("unreadable_by")
        return [f"cannot read {p}: Permission denied" for p in paths if str(p) in self.w.user_unreadable]

    def check_mounts(self, model_dir: Path, env: dict[str, str], also: tuple[str, ...] = ()) -> None:
        self.w._call("check_mounts")
        self.w.mounts_also = tuple(also)

    def check_external_mounts(self, mounts: tuple[ExternalMount, ...]) -> list[str]:
        self.w._call("check_external_mounts")
        return list(self.w.mount_problems)

    def check_cuda_ready(self) -> None:
        self.w._call("check_cuda_ready")

    def memory_offer(self, detached: bool = False) -> Offer:
        self.w._call("memory_offer")
        self.w.offer_detached = detached
        return self.w.offer

    def port_free(self, host: str, port: int) -> None:
        self.w._call("port_free")

    def listeners_taken(self, listeners: tuple[tuple[str, int], ...]) -> list[str]:
        self.w._call("listeners_taken")
        return []

    def ports_held_by(self, pid: int) -> set[int]:
        return set()

    def take_listener(self, pid: int, host: str, port: int) -> socket.socket:
        self.w._call("take_listener")
        self.w.listener = FakeListener(pid, host, port)
        return self.w.listener

    def holds_socket(self, pid: int, sock: socket.socket) -> bool:
        self.w._call("holds_socket")
        return "stop_engine" not in self.w.calls  # the old engine closes its copy once told to stop

    def accepting(self, pid: int, sock: socket.socket) -> bool:
        self.w._call("accepting")
        return True


class FakeModelTools(_Role, ModelTools):

    def resolve_model(self, model: str, revision: str | None) -> tuple[Path, str | None]:
        self.w._call("resolve_model")
        return Path(model), None

    def check_model_config(self, model_dir: Path, engine_args: list[str]) -> None:
        pass  # the real check reads config.json (tests/test_trial_model.py); no call recorded

    def digest_model(self, model_dir: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
        self.w._call("digest_model")
        return self.w.model_files if self.w.model_files is not None else self.w.manifest.model.files

    def model_stats(self, model_dir: Path, files: tuple[ModelFile, ...]) -> tuple[ModelFile, ...]:
        self.w._call("model_stats")
        return files

    def recheck_model(self, model_dir: Path, pinned: tuple[ModelFile, ...], since_ns: int, during: str,
                      hint: str) -> tuple[str, ...]:
        self.w.rechecked = (pinned, since_ns)
        self.w._call("recheck_model")
        return ()

    def normalize_engine_args(self, engine_args: list[str]) -> dict[str, str]:
        self.w._call("normalize_engine_args")
        if "--bogus" in engine_args:
            from vllm_snapshot.errors import UsageError

            raise UsageError("invalid engine arguments: unrecognized arguments: --bogus")
        return {"args": " ".join(engine_args)}

    def verify_model(self, model_dir: Path, files: tuple[ModelFile, ...], mode: str) -> ModelCheck:
        self.w._call(f"verify_model:{mode}")
        return ModelCheck(rehashed=(), added=())


class FakeSnapshotFiles(_Role, SnapshotFiles):
    """Snapshot directories without a file system: by default any path opens as ``w.manifest``;
    in store mode (``w.snapshots`` a dict) only what was published opens, and a published one
    is never overwritten. ``w.corrupt_images`` stands for image bytes damaged at rest.
    tests/test_files_contract.py holds it to the real role's behaviour."""

    def prepare_target(self, target: Path) -> Path:
        self.w._call("prepare_target")
        self._refuse_existing(target, "already exists; refusing to overwrite a snapshot")
        return target.parent / f".{target.name}.tmp-x"

    def _refuse_existing(self, target: Path, why: str) -> None:
        """In store mode (``w.snapshots``), a published snapshot is never overwritten."""
        if self.w.snapshots is not None and target in self.w.snapshots:
            from vllm_snapshot.errors import UsageError

            raise UsageError(f"{target} {why}")

    def discard(self, tmp: Path) -> None:
        self.w._call("discard")
        self.w.discarded.append(tmp)

    def publish(self, m: Manifest, tmp: Path, target: Path) -> None:
        self.w._call("publish")
        self._refuse_existing(target, "appeared while the snapshot was being created")
        self.w.published.append(target)
        if self.w.snapshots is not None:
            self.w.snapshots[target] = m

    def open_snapshot(self, snapshot: Path) -> Manifest:
        self.w._call("open_snapshot")
        if self.w.snapshots is not None:
            if snapshot not in self.w.snapshots:
                from vllm_snapshot.errors import UsageError

                raise UsageError(f"snapshot {snapshot} does not exist")
            return self.w.snapshots[snapshot]
        return self.w.manifest

    def pulled_from(self, snapshot: Path) -> dict | None:
        return self.w.pulled.get(str(snapshot))

    def verify_images(self, snapshot: Path, m: Manifest) -> None:
        self.w._call("verify_images")
        if self.w.corrupt_images is not None:  # the bytes the staged verdict fails fail here too
            raise self.w.corrupt_images

    def check_weights(self, m: Manifest, full: bool = False) -> None:
        self.w._call("check_weights")
        if m.weights is not None and m.weights.path in self.w.weights_problems:
            from vllm_snapshot.errors import ModelChangedError

            raise ModelChangedError(self.w.weights_problems[m.weights.path], details={"weights": m.weights.path})

    def check_weights_dir(self, root: Path) -> None:
        self.w._call("check_weights_dir")

    def check_tree_files(self, m: Manifest) -> list[str]:
        self.w._call("check_tree_files")
        return []

    def plan_carried(self, snapshot: Path, m: Manifest) -> CarryPlan:
        self.w._call("plan_carried")
        return self.w.carry_plan

    def pin_code(self, modules: list[str], sys_path: list[str], work_dir: Path) -> CodeIdentity:
        self.w._call("pin_code")
        self.w.pinned_modules = list(modules)
        return CodeIdentity(table_digest="0" * 64, files=len(modules), distributions={"vllm": "0.32.0"})

    def check_code(self, snapshot: Path, m: Manifest) -> list[str]:
        self.w._call("check_code")
        return list(self.w.code_problems)

    def caps_missing(self, snapshot: Path, m: Manifest) -> list[int]:
        self.w._call("caps_missing")
        return list(self.w.missing_caps)

    def pack(self, directory: Path, compression: str) -> tuple[ImageFile, ...]:
        self.w._call(f"pack:{directory.name}")
        return self.w.manifest.images if directory.name == "images" else ()

    def stage_checking(self, snapshot: Path, m: Manifest) -> tuple[Path, StagedImages]:
        self.w._call("stage_checking")
        if snapshot in self.w.refuse:
            raise self.w.refuse[snapshot]
        if self.w.refuse_all is not None:
            raise self.w.refuse_all
        return Path("/stage"), (FakeUnpacking(self.w) if self.w.unpacking else FakeChecking(self.w))

    def unstage(self, stage: Path) -> None:
        self.w._call("unstage")

    def unstage_all(self, near: Path) -> None:
        self.w._call("unstage_all")


class FakeCheckpointTools(_Role, CheckpointTools):

    def inspect_tree(self, root_pid: int) -> Inventory:
        self.w._call("inspect_tree")
        return Inventory(root_pid=root_pid, pids=(root_pid, root_pid + 1), commands=("python", "VLLM::EngineCore"),
                         listeners=(), files=(), net_problems=self.w.net_problems)

    def channel_keys(self, root_pid: int) -> dict[str, str]:
        self.w._call("channel_keys")
        return {"control": "pipe:[1]", "log": "pipe:[2]", "events": "pipe:[3]"}

    def external_mounts(self, root_pid: int) -> tuple[ExternalMount, ...]:
        self.w._call("external_mounts")
        return tuple(self.w.externals)

    def gpu_used(self, inv: Inventory) -> GpuUse:
        self.w._call("gpu_used")
        return GpuUse("GPU-fake-0", (2,), 0, "Fake GPU")  # the tree's second process (namespace PID 2) has CUDA

    def check_dump_room(self, inv: Inventory, gpu_uuid: str, work_dir: Path) -> None:
        self.w._call("check_dump_room")

    def dump(self, kind: str, opts: DumpOptions, work_dir: Path) -> None:
        self.w.dump_opts = opts
        self.w._call("dump")

    def wait_gone(self, pids: tuple[int, ...], timeout_s: float) -> list[int]:
        self.w._call("wait_gone")
        return []

    def watch_remaps(self, deleted: tuple[str, ...]) -> dict[str, set[str]]:
        return {}

    def collect_remaps(self, before: dict[str, set[str]], files_dir: Path) -> list[Path]:
        self.w._call("collect_remaps")
        return []

    def find_remaps(self, before: dict[str, set[str]]) -> list[Path]:
        self.w._call("find_remaps")
        return []

    def cleanup_remaps(self, found: list[Path]) -> None:
        self.w._call("cleanup_remaps")

    def put_back_remaps(self, snapshot: Path, m: Manifest) -> list[Path]:
        self.w._call("put_back_remaps")
        return []

    def carry_files(self, files: tuple, model_dir: Path, model_files: tuple[ModelFile, ...], sys_path: list[str],
                    work_dir: Path, also: tuple[str, ...] = ()) -> tuple[tuple[CarriedFile, ...], tuple[CarriedDir, ...]]:
        self.w._call("carry_files")
        self.w.carry_also = tuple(also)
        return tuple(self.w.carried_files), tuple(self.w.carried_dirs)

    def put_back_carried(self, snapshot: Path, m: Manifest) -> list[str]:
        self.w._call("put_back_carried")
        return list(self.w.carry_written)

    def criu_lock(self) -> AbstractContextManager:
        self.w._call("criu_lock")
        return nullcontext()

    def gpu_lock(self, uuid: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from contextlib import contextmanager

        @contextmanager
        def held():
            self.w._call(f"gpu_lock:{uuid}")
            try:
                yield
            finally:
                self.w.calls.append("gpu_unlock")
        return held()

    def check_gpu_capacity(self, m: Manifest, uuid: str) -> None:
        self.w.capacity_uuid = uuid
        self.w._call("check_gpu_capacity")

    def restore_tree(self, kind: str, opts: RestoreOptions, stage: Path,
                     before_memory: Callable[[], None] | None = None, cuda_pids: tuple[int, ...] = (),
                     gpu_map: tuple[tuple[str, str], ...] = ()) -> int:
        self.w.restore_opts = opts
        self.w.restore_cuda_pids = cuda_pids
        self.w.restore_gpu_map = gpu_map
        if gpu_map and self.w.remap_refusal is not None:
            raise self.w.remap_refusal
        self.w._call("restore_tree")
        if before_memory is not None:
            before_memory()
        return 5151

    def tree_commands(self, pid: int) -> tuple[str, ...]:
        self.w._call("tree_commands")
        return tuple(self.w.restored_tree if self.w.restored_tree is not None else self.w.manifest.criu.tree_commands)

    def tree_creds(self, root_pid: int) -> dict[int, Creds]:
        self.w._call("tree_creds")
        if self.w.creds is not None:
            return dict(self.w.creds)
        u = self.w.user
        ok = Creds(uids=(u.uid,) * 4, gids=(u.gid,) * 4, groups=u.groups, cap_inh=0, cap_prm=0, cap_eff=0,
                   cap_bnd=0, cap_amb=0, no_new_privs=1)
        return {root_pid: ok, root_pid + 1: ok}


class FakeEngineTools(_Role, EngineTools):

    def launch_engine(self, spec: EngineSpec, env: dict[str, str], log_path: Path,
                      echo: Callable[[bytes], None] | None) -> Engine:
        self.w._call("launch_engine")
        self.w.launch_env = env
        self.w.launch_spec = spec
        self.w.engine = FakeEngine(self.w.calls, self.w.kind, self.w.oracles, engine_args=list(spec.engine_args),
                                   canary=self.w.canary)
        return self.w.engine

    def new_channel(self, log_file: Path | None) -> EngineChannel:
        self.w._call("new_channel")
        self.w.channel = FakeChannel()
        return self.w.channel

    def adopt(self, pid: int, channel: EngineChannel, echo: Callable[[bytes], None] | None) -> Engine:
        self.w._call("adopt")
        self.w.engine = FakeEngine(self.w.calls, self.w.manifest.engine.kind, self.w.oracles, pid)
        return self.w.engine

    def serve_engine(self, engine: Engine, host: str, port: int, die_with_parent: bool,
                     frontend: tuple[str, ...] = (), drain_s: float | None = None,
                     listener: socket.socket | None = None) -> None:
        self.w._call("serve_engine")
        self.w.served_frontend = tuple(frontend)
        self.w.served_drain = drain_s
        self.w.served_listener = listener
        engine.send("serve", host=host, port=port, die_with_parent=die_with_parent, handoff="fake-handoff",
                    frontend=list(frontend), drain_s=drain_s)

    def http_health(self, url: str) -> bool:
        self.w._call("http_health")
        self.w.health_after -= 1
        return self.w.health_after < 0

    def http_canary(self, url: str, m: Manifest, api_key: str | None = None) -> list[str]:
        self.w.canary_key = api_key
        self.w.canary_url = url
        self.w._call("http_canary")
        return list(self.w.canary_diffs)

    def check_log_file(self, path: Path) -> None:
        self.w._call("check_log_file")

    def default_log_file(self, snapshot: Path, port: int) -> Path:
        return Path(f"/var/log/vllm-snapshot/{snapshot.name}-{port}.log")

    def log_room(self, path: Path) -> int | None:
        return self.w.log_room

    def read_log_tail(self, path: Path, lines: int = 20) -> str | None:
        self.w._call("read_log_tail")
        return self.w.log_file_tail

    def weights_channel(self, engine: Engine, root: Path, uid: int) -> WeightsChannel:
        self.w._call("weights_channel")
        self.w.weights_root = root
        return FakeWeightsChannel(self.w)

    def keep_log(self, path: Path, what: str) -> Path | None:
        self.w._call("keep_log")
        return Path(f"/var/log/vllm-snapshot/engine-{what}-20260101-000000-1.log")


class FakeStoreTools(_Role, StoreTools):

    def canonical(self, path: Path) -> Path:
        return Path(path).absolute()

    def snapshot_lock(self, snapshot: Path, shared: bool, must_exist: bool = True) -> AbstractContextManager:
        self.w._call("snapshot_lock")
        return nullcontext()

    def key_lock(self, key: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        self.w._call("key_lock")
        return nullcontext()

    def port_lock(self, port: int, on_wait: Callable[[str], None]) -> AbstractContextManager:
        self.w._call("port_lock")
        return nullcontext()

    def root_problem(self, root: Path) -> SnapshotError | None:
        return getattr(self.w, "root_problem", None)

    def without_manifest(self, root: Path) -> list[Path]:
        return [p for p in getattr(self.w, "manifestless", []) if p.parent == root]

    def list_snapshots(self, root: Path) -> list[Path]:
        self.w._call("list_snapshots")
        if self.w.snapshots is not None:
            return sorted(p for p in self.w.snapshots if p.parent == root)
        return [root / "a", root / "b"]

    def disk_room(self, target: Path, model_dir: Path) -> tuple[tuple[str, int] | None, int]:
        self.w._call("disk_room")
        return getattr(self.w, "room", (None, 1 << 50))

    def delete_snapshot(self, snapshot: Path) -> None:
        self.w._call("delete_snapshot")

    def delete_refusal(self, snapshot: Path) -> SnapshotError | None:
        return None

    def remove_unused_weights(self, root: Path, dry_run: bool = False) -> list[Path]:
        self.w._call("remove_unused_weights")
        return []

    def clean_stale_temps(self, root: Path) -> list[Path]:
        return []

    def reclaim(self, near: Path, dry_run: bool = False) -> list[str]:
        self.w._call("reclaim")
        return []

    def record_refusal(self, snapshot: Path, code: str, reason: str, by: str = "serve") -> None:
        self.w._call("record_refusal")
        self.w.refusals[str(snapshot)] = {"code": code, "reason": reason, "at": 0.0, "by": by}

    def refusal(self, snapshot: Path) -> dict | None:
        return self.w.refusals.get(str(snapshot))

    def weights_blocked(self, root: Path) -> list[str]:
        return list(self.w.weights_blocked)

    def clear_refusal(self, snapshot: Path, codes: frozenset[str]) -> dict | None:
        self.w._call("clear_refusal")
        r = self.w.refusals.get(str(snapshot))
        if r is None or r["code"] not in codes:
            return None
        return self.w.refusals.pop(str(snapshot))

    def last_restore(self, snapshot: Path) -> float | None:
        return self.w.restored_at.get(str(snapshot))

    def record_restore(self, snapshot: Path, overrides: list[str]) -> None:
        """As the real one: the time is kept, and a successful restore clears a refusal."""
        import time

        self.w._call("record_restore")
        self.w.restored_at[str(snapshot)] = time.time()
        self.w.refusals.pop(str(snapshot), None)


class FakeRuntimeTools(_Role, RuntimeTools):

    def engines(self) -> list[Entry]:
        return list(self.w.entries)

    def orphan_pids(self) -> list[int]:
        return list(getattr(self.w, "orphans", []))

    def exited_engines(self) -> list[ExitedRow]:
        return list(getattr(self.w, "exited", []))

    def forget_exited_engines(self, dry_run: bool = False) -> list[str]:
        gone = [f"the record of engine PID {r['pid']}, which exited or was killed without a stop"
                for r in getattr(self.w, "exited", [])]
        if not dry_run:
            self.w.exited = []
        return gone

    def empty_engine_cgroups(self) -> list[str]:
        return list(getattr(self.w, "empty_cgroups", []))

    def register(self, entry: Entry) -> None:
        self.w._call("register")
        self.w.registered.append(entry)

    def unregister(self, pid: int) -> None:
        self.w._call("unregister")

    def stop_engine(self, entry: Entry, drain_s: float | None = None) -> StopReport:
        self.w._call("stop_engine")
        self.w.stop_drains = [*getattr(self.w, "stop_drains", []), drain_s]
        return getattr(self.w, "stop_report", StopReport(0.5))

    def engine_owning(self, pid: int, entries: list[Entry]) -> Entry | None:
        return next((e for e in entries if pid in (e.pid + 1, e.supervisor_pid)), None)  # root's child: root + 1

    def engine_cgroup(self, name: str) -> Placement:
        self.w._call("engine_cgroup")
        return Placement(name)  # no leaves: enter/leave/remove touch nothing

    def cgroup_of(self, pid: int) -> str:
        return "/fake"

    def merge_of(self, pid: int) -> tuple[bool, int]:
        return getattr(self.w, "merged", {}).get(pid, (False, 0))

    def merge_marked(self, pid: int) -> bool:
        return self.merge_of(pid)[0]

    def forward_signals(self, handler: Callable[[int], None]) -> AbstractContextManager:
        from contextlib import contextmanager

        @contextmanager
        def forwarding():
            self.w._call("forward_signals")
            self.w.signal_handler = handler
            try:
                yield
            finally:
                self.w.signal_handler = None
                self.w.calls.append("forward_signals.end")
        return forwarding()

    def terminate(self, pid: int) -> None:
        self.w._call("terminate")
        self.w.terminated.append(pid)

    def hold_signals(self) -> None:
        self.w._call("hold_signals")

    def release_signals(self) -> None:
        self.w._call("release_signals")


class FakeClock(_Role, Clock):
    """Time that moves only when read or slept: every ``monotonic()`` reading adds 1 s (so each
    phase an operation times takes a whole second), ``sleep(s)`` adds ``s`` (and refuses a
    negative ``s``, as :func:`time.sleep` does), ``now()`` is a fixed Unix time.
    tests/test_clock_contract.py holds it to what callers rely on from the real clock."""

    def monotonic(self) -> float:
        self.w._t += 1.0
        return self.w._t

    def now(self) -> float:
        return 1_700_000_000.0

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        self.w._t += seconds
        if self.w.on_sleep is not None:
            self.w.on_sleep(self.w._t)


class FakeFleetTools(_Role, FleetTools):
    """No registry: ``open_target`` refuses (tests of push/pull run the real transports over
    an image layout, tests/test_fleet_ops.py); a staging dir ``check_pulled`` accepts is
    published into ``snapshots``."""

    def open_target(self, ref: reference.Ref, plain_http: bool, create: bool) -> Target:
        self.w._call("open_target")
        from vllm_snapshot.errors import UsageError

        raise UsageError(f"no registry in the fake world: {ref}")

    def snapshot_config(self, snapshot: Path) -> bytes:
        self.w._call("snapshot_config")
        return self.w.manifest.model_dump_json().encode()

    def check_pulled(self, staging: Path, m, assembled=None) -> None:
        self.w._call("check_pulled")

    def partial_pulls(self, root: Path) -> list[PartialPull]:
        return list(getattr(self.w, "partial_pulls", []))

    def pull_staging(self, dest: Path, digest: str) -> AbstractContextManager:
        self.w._call("pull_staging")
        from vllm_snapshot.fleet.partial import Staging

        return nullcontext(Staging(dest.parent / (".pull-" + digest.split(":")[-1]), True, []))

    def weights_problem(self, path: Path) -> str | None:
        self.w._call("weights_problem")
        return None

    def weights_present(self, path: Path, blake3: str, size: int) -> bool:
        self.w._call("weights_present")
        return True

    def weights_staging(self, final: Path, blake3: str, where: str) -> AbstractContextManager:
        self.w._call("weights_staging")
        from vllm_snapshot.fleet.weights import WeightsStaging

        return nullcontext(WeightsStaging(final, final.parent / (".pull-" + blake3), blake3))

    def publish_pulled(self, staging: Path, target: Path, config: bytes, provenance: dict) -> None:
        self.w._call("publish_pulled")
        self.w.pulled[str(target)] = dict(provenance)
        if self.w.snapshots is not None:
            self.w.snapshots[target] = Manifest.model_validate_json(config)


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


__all__ = ["FakeWorld", "FakeEngine", "FakeChannel", "HOST", "isolated_manifest", "manifest_with", "mf"]
