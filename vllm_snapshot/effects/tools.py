"""Every side effect the operations (:mod:`vllm_snapshot.ops`) need, behind one Protocol.

:class:`SnapshotTools` is the contract; :class:`LocalTools` is the real implementation over
this host (CRIU, the supervisor, ``/proc``, sockets, HTTP, the store, the registry, locks, the
clock); ``tests/fakes.py`` has a recording fake. ``tests/test_protocols.py`` checks that both
have exactly the Protocol's methods and signatures (vLLM's own fake drifted from its real
class without such a test).

The operations only sequence calls to these methods; they never touch the host themselves.
Heavy imports (pycriu, vLLM) happen inside the methods that need them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Protocol

from .. import paths
from ..checkpoint.criu import DumpOptions, RestoreOptions
from ..host.cgroups import Placement
from ..checkpoint.gpu import GpuUse
from ..checkpoint.inventory import Inventory
from ..fleet.tools import LocalFleetTools
from ..store.manifest import CodeIdentity, EngineUser, ExternalMount, ImageFile, Manifest, ModelFile
from ..store.model_digest import ModelCheck
from ..host.privilege import Creds, User
from ..store.registry import Entry, StopReport
from ..host.resources import Offer


class Engine(Protocol):
    """A running engine tree we supervise (:class:`vllm_snapshot.supervise.supervisor.EngineHandle`)."""

    root_pid: int

    def send(self, cmd: str, **kw) -> None:
        """Send one command (:mod:`vllm_snapshot.engine.protocol`). Raises EngineError."""

    def wait_event(self, name: str, timeout: float) -> dict:
        """The next event ``name``. Raises EngineError (error event, exit, timeout)."""

    def alive(self) -> bool: ...

    def kill(self, grace: float = 0.0) -> None:
        """SIGTERM, ``grace`` seconds, SIGKILL; wait until every process is gone."""

    def close(self) -> None:
        """Close our ends of the channel."""

    def reap(self, block: bool = True) -> int | None:
        """The root's exit code when it is our child and has exited."""

    def log_tail(self, n: int = 20) -> str: ...

    def drain_log(self, timeout_s: float = 5.0) -> None: ...


class EngineChannel(Protocol):
    """Fresh pipes for a restored engine (:class:`vllm_snapshot.supervise.supervisor.Channel`)."""

    def inherit_fds(self, keys: dict[str, str]) -> tuple[tuple[str, int], ...]: ...

    def close(self) -> None: ...


class SnapshotTools(Protocol):
    """The side effects of create, restore and the management commands."""

    # ---- host
    def require_root(self) -> None:
        """Raises EnvironmentProblem when not root."""

    def criu_version(self) -> str:
        """Version of the CRIU that will run (probed once). Raises EnvironmentProblem (< 4.2)."""

    def host_identity(self, kind: str) -> dict[str, str]:
        """This host's identity fields (identity.collect + GPU + CUDA helper for ``cuda``)."""

    def check_mounts(self, model_dir: Path, env: dict[str, str]) -> None:
        """Before the engine starts: refuse (UsageError naming mount point, type, remedy) when
        a mount the engine needs cannot be checkpointed (engine/mounts.py policy)."""

    def external_mounts(self, root_pid: int) -> tuple[ExternalMount, ...]:
        """The engine namespace's mounts CRIU gets as external ones (identity recorded).
        Raises UnsnapshottableError for one CRIU cannot name."""

    def check_external_mounts(self, mounts: tuple[ExternalMount, ...]) -> list[str]:
        """Problems with this host's mounts at the recorded mount points (empty = same)."""

    def code_paths(self) -> dict[str, Path]:
        """What the engine must see besides the model: ``{what: path}``."""

    def engine_user(self, name: str) -> User:
        """The unprivileged user the engine tree will run as. Raises EnvironmentProblem (no
        such user) or UsageError (root)."""

    def engine_access(self, user: User, model_dir: Path) -> dict[str, list[str]]:
        """What ``user`` cannot do that the engine needs: ``{"model": [...], "code": [...],
        "home": [...]}`` (empty lists = fine): every model file readable, the Python
        environment and packages readable and not writable, HOME writable. Raises
        EnvironmentProblem when the check cannot run."""

    def user_problems(self, u: EngineUser) -> list[str]:
        """Why the recorded engine user is not the same user on this host (empty = same)."""

    def caps_missing(self, snapshot: Path, m: Manifest) -> list[int]:
        """Capabilities the dumped engine root held that this process cannot give back
        (:func:`vllm_snapshot.host.privilege.caps_beyond` over the root's CRIU core image; [] when
        the image cannot be read: CRIU then decides)."""

    def tree_creds(self, root_pid: int) -> dict[int, Creds]:
        """pid -> credentials (/proc/PID/status) of ``root_pid`` and its descendants."""

    def unreadable_by(self, u: EngineUser, paths: list[Path]) -> list[str]:
        """Which of ``paths`` (files) the recorded engine user cannot read (human lines)."""

    def engine_device(self) -> str:
        """``"cpu"`` or ``"cuda"``: what the installed vLLM build will run the engine on (a CPU
        build of vLLM runs on CPU even on a GPU host)."""

    def check_cuda_ready(self) -> None:
        """Before a CUDA engine starts: CRIU's CUDA plugin (of the binary's build, not
        redirected by a config file) and the ``cuda-checkpoint`` CRIU would run, which must
        reach the driver's checkpoint API (NVIDIA r570+). Raises EnvironmentProblem."""

    def gpu_used(self, inv: Inventory) -> GpuUse:
        """The one GPU a CUDA engine tree uses and its processes with a CUDA context
        (:class:`vllm_snapshot.checkpoint.gpu.GpuUse`): every ``/dev/nvidia*`` holder is asked as CRIU's
        plugin asks (:func:`vllm_snapshot.checkpoint.gpu.cuda_processes`), the GPU comes from the driver's
        compute apps (:func:`vllm_snapshot.checkpoint.gpu.used_gpu`). Raises UnsnapshottableError (a holder
        without a CUDA context, named; no CUDA process; several GPUs), EnvironmentProblem."""

    def gpu_uuids(self) -> list[str]:
        """UUIDs of this host's GPUs ([] without)."""

    def environ(self) -> dict[str, str]: ...

    def path_exists(self, path: Path) -> bool: ...

    def canonical(self, path: Path) -> Path:
        """The one identity of a snapshot path (:func:`vllm_snapshot.store.store.canonical`)."""

    # ---- model
    def resolve_model(self, model: str, revision: str | None) -> tuple[Path, str | None]:
        """(local directory, resolved HF revision or None) of ``model``. Raises UsageError."""

    def digest_model(self, model_dir: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
        """Every model file's digest; files whose stat equals a ``known`` record reuse its digest."""

    def model_stats(self, model_dir: Path, files: tuple[ModelFile, ...]) -> tuple[ModelFile, ...]:
        """``files`` with the stat each has now (:func:`vllm_snapshot.store.model_digest.stat_pins`)."""

    def recheck_model(self, model_dir: Path, pinned: tuple[ModelFile, ...], since_ns: int, during: str,
                      hint: str) -> tuple[str, ...]:
        """Refuse a model file changed since ``pinned`` was taken, while the engine may have
        read it (from ``since_ns``; :func:`vllm_snapshot.store.model_digest.recheck`). Returns the
        paths re-hashed. Raises ModelChangedError."""

    def normalize_engine_args(self, engine_args: list[str]) -> dict[str, str]:
        """``vllm serve`` args normalized by vLLM's parser (:func:`vllm_snapshot.store.snapkey.normalize_args`;
        imports vLLM). Raises UsageError for args vLLM rejects."""

    def verify_model(self, model_dir: Path, files: tuple[ModelFile, ...], mode: str) -> ModelCheck:
        """Raises ModelChangedError."""

    # ---- snapshot directories
    def prepare_target(self, target: Path) -> Path:
        """A private temp dir beside ``target`` (``images/``, ``files/``). Raises UsageError."""

    def discard(self, tmp: Path) -> None:
        """Remove a temp dir of a failed create. Raises OSError."""

    def publish(self, m: Manifest, tmp: Path, target: Path) -> None:
        """chmod 0600, write the manifest last, rename ``tmp`` to ``target``."""

    def open_snapshot(self, snapshot: Path) -> Manifest:
        """Trust checks, manifest (schema, digest), member layout (stat). Raises
        UsageError, CorruptSnapshotError."""

    def pulled_from(self, snapshot: Path) -> dict | None:
        """The ``pulled.json`` record of a snapshot made by ``pull`` (image, digest, the
        machine that pulled it), None for one made here: a pulled snapshot's host identity is
        compared at the host-class level (:data:`vllm_snapshot.host.identity.MACHINE_FIELDS`
        not). Raises CorruptSnapshotError for a record that is not one."""

    def verify_images(self, snapshot: Path, m: Manifest) -> None:
        """Every image and saved file checksum. Raises CorruptSnapshotError."""

    def check_tree_files(self, m: Manifest) -> list[str]:
        """Problems with the files the tree had open or mapped (empty = unchanged)."""

    def pin_code(self, modules: list[str], sys_path: list[str], work_dir: Path) -> CodeIdentity:
        """Pin the files of the distributions owning ``modules`` on ``sys_path``
        (:func:`vllm_snapshot.host.codeid.record`) into ``work_dir/code.json``; its summary."""

    def check_code(self, snapshot: Path, m: Manifest) -> list[str]:
        """Problems with the pinned Python files (:func:`vllm_snapshot.host.codeid.check`; empty =
        unchanged or none pinned). Raises CorruptSnapshotError when the table does not match
        its digest in the manifest."""

    # ---- engine (create)
    def launch_engine(self, spec: dict, env: dict[str, str], log_path: Path,
                      echo: Callable[[bytes], None] | None) -> Engine:
        """Start the engine root in its own PID + mount namespace. Raises EngineError."""

    def inspect_tree(self, root_pid: int) -> Inventory:
        """Raises UnsnapshottableError, EngineError."""

    def channel_keys(self, root_pid: int) -> dict[str, str]:
        """role -> ``pipe:[inode]`` of the engine's channel fds."""

    def watch_remaps(self, deleted: tuple[str, ...]) -> dict[str, set[str]]: ...

    def collect_remaps(self, before: dict[str, set[str]], files_dir: Path) -> list[Path]:
        """Copy link-remap files CRIU left into ``files_dir``; return the originals."""

    def find_remaps(self, before: dict[str, set[str]]) -> list[Path]:
        """Link-remap files CRIU left in the watched directories (a failed dump's, to remove)."""

    def cleanup_remaps(self, found: list[Path]) -> None: ...

    def check_dump_room(self, inv: Inventory, gpu_uuid: str, work_dir: Path) -> None:
        """CUDA: refuse (UnsnapshottableError naming the numbers) when the GPU memory the tree
        holds would not fit into host RAM and the disk of ``work_dir`` (the checkpoint copies it
        there)."""

    def dump(self, kind: str, opts: DumpOptions, work_dir: Path) -> None:
        """CRIU dump into ``work_dir/images`` under the host-wide CRIU lock. For ``cuda``: the
        helper is probed first, and the CRIU log must show the CUDA plugin checkpointing.
        Raises CriuError, EnvironmentProblem."""

    def wait_gone(self, pids: tuple[int, ...], timeout_s: float) -> list[int]:
        """PIDs still alive after ``timeout_s`` seconds."""

    def pack(self, directory: Path, compression: str) -> tuple[ImageFile, ...]: ...

    # ---- engine (restore)
    def port_free(self, host: str, port: int) -> None:
        """Raises BusyError/UsageError when ``host:port`` cannot be bound."""

    def serve_engine(self, engine: Engine, host: str, port: int, die_with_parent: bool,
                     frontend: tuple[str, ...] = (), drain_s: float | None = None) -> None:
        """Bind ``host:port`` in our (the host's) network namespace, send ``serve`` and hand the
        listening socket to the engine, whose tree has a network namespace of its own
        (:mod:`vllm_snapshot.supervise.handoff`); ``frontend``: option tokens the engine applies first
        (:mod:`vllm_snapshot.supervise.frontend`); ``drain_s``: seconds the engine lets requests in flight
        finish when signalled to stop. Raises BusyError/UsageError (port), EngineError."""

    def check_log_file(self, path: Path) -> None:
        """Raises UsageError when ``path`` cannot be an engine log file."""

    def memory_offer(self, detached: bool = False) -> Offer:
        """Memory this host and the memory cgroup the engine will run in offer a restore now
        (:mod:`vllm_snapshot.host.resources`): ours, or for ``detached`` the engines' parent cgroup
        ``/vllm-snapshot`` (:mod:`vllm_snapshot.host.cgroups`), whose limit caps every detached engine."""

    def default_log_file(self, snapshot: Path, port: int) -> Path: ...

    def stage(self, snapshot: Path, m: Manifest) -> Path:
        """Verified raw images in a staging dir. Raises CorruptSnapshotError."""

    def stage_checking(self, snapshot: Path, m: Manifest):
        """Raw images in a staging dir, and their checksum verification (an object with
        ``wait()``, raising CorruptSnapshotError on a mismatch, and ``cancel()``): for an
        uncompressed snapshot the images are hard-linked at once and verified in the background
        while CRIU restores; a compressed snapshot's small images are unpacked and verified
        before returning and its memory pages images in the background
        (:class:`vllm_snapshot.store.archive.Unpacking`: the object also has ``ready()``, which the
        caller must call before CRIU reads a pages image). Saved files (``files/``) are
        verified before returning. Raises CorruptSnapshotError."""

    def unstage(self, stage: Path) -> None: ...

    def unstage_all(self, near: Path) -> None:
        """Remove every staging dir this process made (/dev/shm, the staging dir, ``near``)."""

    def put_back_remaps(self, snapshot: Path, m: Manifest) -> list[Path]: ...

    def new_channel(self, log_file: Path | None) -> EngineChannel: ...

    def criu_lock(self) -> AbstractContextManager:
        """Host-wide lock around one CRIU run."""

    def listeners_taken(self, listeners: tuple[tuple[str, int], ...]) -> list[str]: ...

    def ports_held_by(self, pid: int) -> set[int]:
        """TCP ports the tree rooted at ``pid`` listens on."""

    def gpu_lock(self, uuid: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        """Exclusive lock of the GPU ``uuid`` (:func:`vllm_snapshot.store.locks.gpu_lock`), held by a
        CUDA restore from its capacity check until its engine has woken; ``on_wait`` hears who
        holds it before waiting. Raises BusyError after the wait."""

    def check_gpu_capacity(self, m: Manifest) -> None:
        """CUDA snapshot: raise BusyError unless the GPU it used has the memory the engine
        will need free (:func:`vllm_snapshot.checkpoint.gpu.required_restore_bytes`). Call right before
        CRIU (after ``switch`` stopped the old engine)."""

    def restore_tree(self, kind: str, opts: RestoreOptions, stage: Path,
                     before_memory: Callable[[], None] | None = None, cuda_pids: tuple[int, ...] = ()) -> int:
        """CRIU restore as our child; returns the root's host PID. ``before_memory``: called
        once the tree's namespaces exist, before CRIU reads any pages image (a tree with
        namespaces only; its exception aborts CRIU and is raised). For ``cuda``: before CRIU,
        the ``cuda-checkpoint`` CRIU will run must reach the driver (EnvironmentProblem, as
        :meth:`check_cuda_ready`); after it, every CUDA process of the restored tree must be
        ``running`` (else the tree is killed): those recorded at the dump (``cuda_pids``, PIDs
        in the tree's namespace; each probe costs a driver attach), or every process when none
        were recorded. Raises CriuError, EnvironmentProblem."""

    def adopt(self, pid: int, channel: EngineChannel, echo: Callable[[bytes], None] | None) -> Engine: ...

    def tree_commands(self, pid: int) -> tuple[str, ...]:
        """Command lines of ``pid``'s tree, root first (empty when it is gone)."""

    def http_health(self, url: str) -> bool: ...

    def http_canary(self, url: str, m: Manifest, api_key: str | None = None) -> list[str]:
        """Differences between an HTTP completion of the oracle prompt and the oracle
        (``api_key``: sent as ``Authorization: Bearer``)."""

    # ---- store and runtime
    def snapshot_lock(self, snapshot: Path, shared: bool, must_exist: bool = True) -> AbstractContextManager: ...

    def list_snapshots(self, root: Path) -> list[Path]: ...

    def disk_room(self, target: Path, model_dir: Path) -> tuple[tuple[str, int] | None, int]:
        """(``(path, raw image bytes)`` of the newest readable snapshot of ``model_dir`` beside
        ``target`` or None, bytes free on the filesystem that will hold ``target``)."""

    def delete_snapshot(self, snapshot: Path) -> None: ...

    def clean_stale_temps(self, root: Path) -> list[Path]:
        """Remove leftovers of crashed creates under ``root`` (and stale lock files)."""

    def reclaim(self, near: Path, dry_run: bool = False) -> list[str]:
        """Remove what killed commands left: staging dirs of dead restores (/dev/shm, the
        staging dir, ``near``), orphaned engine trees, stale registry entries and lock files.
        Never a live one's. ``dry_run``: only list them."""

    def key_lock(self, key: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        """Exclusive lock of one snapshot key; ``on_wait`` hears who holds it before waiting."""

    def port_lock(self, port: int, on_wait: Callable[[str], None]) -> AbstractContextManager:
        """Exclusive lock of one TCP port (``switch``, :func:`vllm_snapshot.store.locks.port_lock`);
        ``on_wait`` hears who holds it before waiting."""

    def record_refusal(self, snapshot: Path, code: str, reason: str) -> None:
        """Remember that ``serve`` refused ``snapshot`` here (shown by ``list``)."""

    def refusal(self, snapshot: Path) -> dict | None:
        """The refusal recorded for ``snapshot`` since its last restore, or None."""

    def last_restore(self, snapshot: Path) -> float | None: ...

    def record_restore(self, snapshot: Path, overrides: list[str]) -> None: ...

    def engines(self) -> list[Entry]: ...

    def orphan_pids(self) -> list[int]:
        """Root PIDs of engine trees nobody owns (what a SIGKILLed restore leaves: see
        :func:`vllm_snapshot.store.registry.orphans`); ``reclaim`` (every prune) kills them."""

    def empty_engine_cgroups(self) -> list[str]:
        """Paths of engine cgroups no process is in any more (an engine that exited or was
        killed; :func:`vllm_snapshot.host.cgroups.empty_leaves`); ``reclaim`` removes them."""

    def register(self, entry: Entry) -> None: ...

    def unregister(self, pid: int) -> None: ...

    def stop_engine(self, entry: Entry, drain_s: float | None = None) -> StopReport:
        """Stop one registered engine, draining it for up to ``drain_s`` seconds (default
        :func:`vllm_snapshot.store.registry.drain_timeout`), and remove its cgroup, now empty
        (:func:`vllm_snapshot.store.registry.stop`)."""

    def engine_owning(self, pid: int, entries: list[Entry]) -> Entry | None:
        """The entry whose engine tree holds ``pid`` (a descendant of its root) or whose
        supervisor ``pid`` is, else None."""

    def engine_cgroup(self, name: str) -> Placement:
        """A cgroup of its own for a detached engine (:func:`vllm_snapshot.host.cgroups.create`)."""

    def cgroup_of(self, pid: int) -> str:
        """The cgroup ``pid`` runs in, in words (:func:`vllm_snapshot.host.cgroups.where`)."""

    # ---- time
    def clock(self) -> float:
        """Monotonic seconds."""

    def now(self) -> float:
        """Unix time, seconds."""

    def sleep(self, seconds: float) -> None: ...


def _chown_root(top: Path) -> None:
    """``chown -R 0:0 top`` without following links (files a CRIU run as the engine user wrote)."""
    for d, dirs, files in os.walk(top):
        for n in [*dirs, *files]:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if st.st_uid != 0 or st.st_gid != 0:
                os.lchown(p, 0, 0)


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return "unreadable"
    return h.hexdigest()


def canary_request(m: Manifest) -> dict:
    """The HTTP canary's body: the oracle's own request -- greedy, exactly one token
    (``min_tokens`` masks EOS as the in-engine oracle does), seeded, token ids returned -- with
    neutral sampling values sent explicitly, so defaults from the model's
    ``generation_config.json`` (which vLLM's server applies to requests, not to the engine's own
    oracle) cannot change it. Pure."""
    return {"model": m.model.served_name, "prompt": m.oracle.prompt, "max_tokens": 1, "min_tokens": 1,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0, "logprobs": 5,
            "return_token_ids": True}


def _http_json(url: str, body: dict | None = None, timeout: float = 30.0,
               api_key: str | None = None) -> tuple[int, dict | str]:
    """POST ``body`` (or GET) ``url``; (status, parsed JSON or text). ``https://`` URLs are not
    certificate-checked: they are the listener this process bound itself a moment ago (the
    certificate's names need not include the loopback address we connect to). Raises
    URLError/OSError."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    ctx = None
    if url.startswith("https://"):
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            raw = r.read().decode()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _remove_empty_cgroups() -> list[str]:
    """:func:`vllm_snapshot.host.cgroups.remove_empty` under the host-wide CRIU lock, which every
    restore holds from creating its engine's cgroup until CRIU has put the tree in it: an empty
    leaf seen under that lock is an exited engine's, never one about to be entered (seen without
    it: two clones restored at once, one's reclaim removed the other's new leaf). When a CRIU
    run holds the lock, nothing is removed now; a later command does it."""
    from ..host import cgroups
    from ..store import locks
    from ..errors import BusyError

    try:
        with locks.criu_lock(wait_s=0):
            return cgroups.remove_empty()
    except BusyError:
        return []


class LocalTools(SnapshotTools, LocalFleetTools):
    """:class:`SnapshotTools` over this host. ``engine_argv`` replaces the engine root's command
    (tests run a protocol-speaking fake engine through it)."""

    def __init__(self, engine_argv: tuple[str, ...] | None = None) -> None:
        from ..supervise.supervisor import ENGINE_ARGV

        self.engine_argv = tuple(engine_argv or ENGINE_ARGV)
        self._criu: tuple[str, str] | None = None
        self._identity: dict[str, dict[str, str]] = {}

    # ---- host
    def require_root(self) -> None:
        from ..errors import EnvironmentProblem

        if os.geteuid() != 0:
            raise EnvironmentProblem("vllm-snapshot create/restore must run as root (CRIU needs CAP_SYS_ADMIN and more)",
                                     hint="run it with sudo")

    def _criu_binary(self) -> tuple[str, str]:
        from ..checkpoint import criu
        from ..errors import EnvironmentProblem

        if self._criu is None:
            b = criu.find_criu()
            v = criu.criu_version(b)
            if not criu.version_ok(v):
                raise EnvironmentProblem(f"CRIU {v} at {b} is too old; vllm-snapshot needs >= 4.2",
                                         hint="CRIU < 4.2 fails on kernels >= 6.16; run scripts/setup.sh")
            self._criu = (b, v)
        return self._criu

    def criu_version(self) -> str:
        return self._criu_binary()[1]

    def host_identity(self, kind: str) -> dict[str, str]:
        if kind not in self._identity:
            from ..checkpoint import gpu
            from ..host import identity

            ident = identity.collect(self.criu_version(), gpu.gpu_identity())
            if kind == "cuda":
                from ..checkpoint import criu, cuda_checkpoint

                # what CRIU will load and run for the GPU state: the plugin pinned by content;
                # our helper by its protocol version (a comment edit must not orphan snapshots)
                ident["cuda_plugin"] = "sha256:" + _sha256(criu.find_cuda_plugin(self._criu_binary()[0]))[:16]
                own = os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT")  # NVIDIA's binary instead of ours
                ident["cuda_checkpoint_helper"] = (f"{own} sha256:{_sha256(Path(own))[:16]}" if own
                                                   else f"vllm-snapshot protocol {cuda_checkpoint.PROTOCOL}")
            self._identity[kind] = ident
        return dict(self._identity[kind])

    def check_mounts(self, model_dir: Path, env: dict[str, str]) -> None:
        from ..checkpoint import mountpolicy

        mountpolicy.check_create(str(model_dir), env)

    def external_mounts(self, root_pid: int) -> tuple[ExternalMount, ...]:
        from ..checkpoint import mountpolicy
        from ..errors import UnsnapshottableError

        try:
            return tuple(mountpolicy.describe_externals(root_pid))
        except ValueError as e:
            raise UnsnapshottableError(str(e), hint="mount that file system at a path without ']'") from e

    def check_external_mounts(self, mounts: tuple[ExternalMount, ...]) -> list[str]:
        from ..checkpoint import mountpolicy

        return mountpolicy.check_restore(mounts) if mounts else []

    def code_paths(self) -> dict[str, Path]:
        return {"Python environment": Path(sys.prefix).resolve(),
                "vllm_snapshot package": Path(__file__).resolve().parents[1]}

    def engine_user(self, name: str) -> User:
        from ..host import privilege
        from ..errors import EnvironmentProblem, UsageError

        try:
            u = privilege.lookup(name)
        except KeyError:
            hint = privilege.USERADD_HINT if name == privilege.DEFAULT_USER else f"create the user {name} or pick another --user"
            raise EnvironmentProblem(f"the engine user {name!r} does not exist on this host", hint=hint) from None
        if u.uid == 0:
            raise UsageError(f"--user {name}: the engine tree would run as root with every capability",
                             hint=f"use an unprivileged user (default: {privilege.DEFAULT_USER})")
        return u

    def engine_access(self, user: User, model_dir: Path) -> dict[str, list[str]]:
        from ..host import privilege
        from ..errors import EnvironmentProblem

        py = privilege.python_paths()
        try:
            model = privilege.access_problems(user, read=[model_dir])
            code = privilege.access_problems(user, reach=list(py.values()),
                                             nowrite=[py[k] for k in py if k.endswith(("environment", "package"))])
            home = privilege.access_problems(user, write=[Path(user.home)])
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise EnvironmentProblem(f"cannot check what the engine user {user.name} can read: {e}") from e
        return {"model": model, "code": code, "home": home}

    def caps_missing(self, snapshot: Path, m: Manifest) -> list[int]:
        from ..host import privilege

        root = 1 if m.criu.pid_namespace else m.criu.root_pid  # the images name namespace PIDs
        img = next((i for i in m.images if i.name.split(".")[0] == f"core-{root}"), None)
        if img is None:
            return []
        try:
            import io

            import pycriu

            from ..store.archive import open_raw

            with open_raw(snapshot / "images", img) as r:
                raw = b"".join(iter(lambda: r.read(1 << 20), b""))
            creds = pycriu.images.load(io.BytesIO(raw))["entries"][0]["thread_core"]["creds"]
            return privilege.caps_beyond(creds, Path("/proc/self/status").read_text())
        except Exception:  # noqa: BLE001 - an unreadable image is CRIU's to report
            return []

    def user_problems(self, u: EngineUser) -> list[str]:
        from ..host import privilege

        return privilege.identity_problems(u.name, u.uid, u.gid, u.groups)

    def tree_creds(self, root_pid: int) -> dict[int, Creds]:
        from ..host import privilege
        from ..host.procs import tree

        return privilege.tree_creds(p.pid for p in tree(root_pid))

    def unreadable_by(self, u: EngineUser, paths: list[Path]) -> list[str]:
        from ..host import privilege
        from ..errors import EnvironmentProblem

        try:
            return privilege.access_problems(privilege.User(u.name, u.uid, u.gid, u.groups, u.home), read=paths)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise EnvironmentProblem(f"cannot check what the engine user {u.name} can read: {e}") from e

    def engine_device(self) -> str:
        from ..checkpoint import gpu

        return gpu.engine_device()

    def gpu_used(self, inv: Inventory) -> GpuUse:
        from ..checkpoint import gpu
        from ..host.procs import ns_pid

        cuda, skipped = gpu.cuda_processes(inv.cuda_pids, self._helper(self._runner("cuda").env))
        gpu.refuse_skipped(skipped, dict(zip(inv.pids, inv.commands)))
        uuid = gpu.used_gpu(cuda, inv.nvidia_files, gpu.uuids_by_minor(), gpu.compute_apps() if cuda else ())
        return GpuUse(uuid, tuple(sorted(n for p in cuda if (n := ns_pid(p)) is not None)))

    def gpu_uuids(self) -> list[str]:
        from ..checkpoint import gpu

        return sorted(gpu.uuids_by_minor().values())

    def environ(self) -> dict[str, str]:
        return dict(os.environ)

    def path_exists(self, path: Path) -> bool:
        return os.path.lexists(path)

    def canonical(self, path: Path) -> Path:
        from ..store import store

        return store.canonical(path)

    # ---- model
    def resolve_model(self, model: str, revision: str | None) -> tuple[Path, str | None]:
        from ..store import model_digest

        return model_digest.resolve_model(model, revision)

    def digest_model(self, model_dir: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
        from ..store import model_digest

        return model_digest.digest_dir(model_dir, known)

    def model_stats(self, model_dir: Path, files: tuple[ModelFile, ...]) -> tuple[ModelFile, ...]:
        from ..store import model_digest

        return model_digest.stat_pins(model_dir, files)

    def recheck_model(self, model_dir: Path, pinned: tuple[ModelFile, ...], since_ns: int, during: str,
                      hint: str) -> tuple[str, ...]:
        from ..store import model_digest

        return model_digest.recheck(model_dir, pinned, since_ns, during=during, hint=hint)

    def normalize_engine_args(self, engine_args: list[str]) -> dict[str, str]:
        import contextlib
        import io

        from ..store import snapkey
        from ..errors import UsageError

        captured = io.StringIO()
        # importing vLLM sets variables in os.environ (TORCHINDUCTOR_CACHE_DIR=/tmp/...,
        # LD_LIBRARY_PATH, PYTORCH_NVML_BASED_CUDA_CHECK, ...): they would reach the engine's
        # environment and the key's env part of a create in this process. Put it back.
        saved = dict(os.environ)
        try:
            with contextlib.redirect_stderr(captured):
                return snapkey.normalize_args(list(engine_args))
        except SystemExit as e:
            from ..engine.main import argparse_reason

            raise UsageError(f"invalid engine arguments: {argparse_reason(captured.getvalue())}",
                             hint="the engine args are those of `vllm serve`") from e
        finally:
            if dict(os.environ) != saved:
                os.environ.clear()
                os.environ.update(saved)

    def verify_model(self, model_dir: Path, files: tuple[ModelFile, ...], mode: str) -> ModelCheck:
        from ..store import model_digest

        return model_digest.verify(model_dir, files, "full" if mode == "full" else "quick")

    # ---- snapshot directories
    def prepare_target(self, target: Path) -> Path:
        from ..store import store

        return store.prepare_target(target)

    def discard(self, tmp: Path) -> None:
        import shutil

        if tmp.exists():
            shutil.rmtree(tmp)

    def publish(self, m: Manifest, tmp: Path, target: Path) -> None:
        from ..store import manifest, store

        for dirpath, _dirs, names in os.walk(tmp):  # CRIU writes stats-dump 0644
            for n in names:
                os.chmod(os.path.join(dirpath, n), 0o600)
        manifest.write_atomic(m, tmp)
        store.publish(tmp, target)

    def pulled_from(self, snapshot: Path) -> dict | None:
        from ..fleet.tools import read_pulled

        return read_pulled(snapshot)

    def open_snapshot(self, snapshot: Path) -> Manifest:
        from ..store import archive, layout, manifest

        sd = layout.open_trusted(snapshot)
        m = manifest.read(sd.path)
        archive.check_layout(sd.images, m.images)
        archive.check_layout(sd.files, m.extra_files)
        return m

    def verify_images(self, snapshot: Path, m: Manifest) -> None:
        from ..store import archive, layout

        sd = layout.SnapshotDir(snapshot)
        archive.verify(sd.images, m.images)
        archive.verify(sd.files, m.extra_files)

    def check_tree_files(self, m: Manifest) -> list[str]:
        from ..checkpoint import inventory

        return inventory.check_files(m.criu.tree_files)

    def pin_code(self, modules: list[str], sys_path: list[str], work_dir: Path) -> CodeIdentity:
        from ..host import codeid
        from ..store import layout

        pinned = codeid.record(modules, sys_path)
        fd = os.open(work_dir / layout.CODE_TABLE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pinned.table)
        return CodeIdentity(table_digest=pinned.digest, files=pinned.files, distributions=pinned.distributions)

    def check_code(self, snapshot: Path, m: Manifest) -> list[str]:
        import blake3

        from ..host import codeid
        from ..store import layout
        from ..errors import CorruptSnapshotError

        if m.code is None:
            return []
        path = snapshot / layout.CODE_TABLE
        try:
            table = path.read_bytes()
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{path} is missing (the manifest pins {m.code.files} Python files by it)",
                                       hint="restore the snapshot's directory from a backup, or re-create it") from None
        if blake3.blake3(table).hexdigest() != m.code.table_digest:
            raise CorruptSnapshotError(f"{path} does not match its digest in the manifest",
                                       hint="restore the snapshot's directory from a backup, or re-create it")
        try:
            return codeid.check(table)
        except ValueError as e:
            raise CorruptSnapshotError(f"{path}: {e}") from e

    # ---- engine (create)
    def launch_engine(self, spec: dict, env: dict[str, str], log_path: Path,
                      echo: Callable[[bytes], None] | None) -> Engine:
        from ..supervise.supervisor import launch

        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        log = os.fdopen(fd, "ab", buffering=0)  # a write after close raises, never hits a reused fd
        try:
            h = launch(spec, env, [log.write] + ([echo] if echo else []), self.engine_argv)
        except BaseException:
            log.close()
            raise
        h.on_close.append(log.close)
        return h

    def inspect_tree(self, root_pid: int) -> Inventory:
        from ..checkpoint import inventory

        return inventory.inspect_tree(root_pid)

    def channel_keys(self, root_pid: int) -> dict[str, str]:
        from ..supervise.supervisor import channel_keys

        return channel_keys(root_pid)

    def watch_remaps(self, deleted: tuple[str, ...]) -> dict[str, set[str]]:
        from ..checkpoint import remaps

        return remaps.watch_dirs(deleted)

    def collect_remaps(self, before: dict[str, set[str]], files_dir: Path) -> list[Path]:
        from ..checkpoint import remaps

        found = remaps.collect(before)
        remaps.save(found, files_dir)
        return found

    def find_remaps(self, before: dict[str, set[str]]) -> list[Path]:
        from ..checkpoint import remaps

        return remaps.collect(before)

    def cleanup_remaps(self, found: list[Path]) -> None:
        from ..checkpoint import remaps

        remaps.cleanup(found)

    def _runner(self, kind: str):
        from ..checkpoint import criu

        binary = self._criu_binary()[0]
        return criu.Criu(binary, criu.cuda_env(binary) if kind == "cuda" else {})

    @staticmethod
    def _helper(env: dict[str, str]) -> Callable:
        """Runs ``cuda-checkpoint ARGS`` found on ``env``'s PATH, as CRIU's plugin does:
        (exit status, stdout + stderr)."""
        import shutil
        import subprocess

        full = {**os.environ, **env}
        exe = shutil.which("cuda-checkpoint", path=full["PATH"]) or "cuda-checkpoint"

        def run(args) -> tuple[int, str]:
            try:
                p = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=full, cwd="/", timeout=120, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError) as e:
                return 127, f"cannot run {exe}: {e}"
            return p.returncode, p.stdout
        return run

    def _cuda_preflight(self, env: dict[str, str]) -> None:
        """The test CRIU's plugin makes at init (``cuda-checkpoint -h`` must offer --action),
        with the PATH CRIU will get; ours probes the driver (cuInit, API >= r570)."""
        from ..errors import EnvironmentProblem

        rc, out = self._helper(env)(["-h"])
        if rc != 0 or "--action" not in out:
            raise EnvironmentProblem(f"the cuda-checkpoint CRIU would run cannot checkpoint here (exit {rc}): "
                                     + " ".join(out.split())[:400],
                                     hint="run `vllm-snapshot doctor`; the checkpoint API needs NVIDIA driver r570+")

    def check_cuda_ready(self) -> None:
        self._cuda_preflight(self._runner("cuda").env)

    def check_dump_room(self, inv: Inventory, gpu_uuid: str, work_dir: Path) -> None:
        from ..checkpoint import gpu

        used, how = gpu.tree_gpu_bytes(inv.pids, gpu_uuid)
        meminfo = Path("/proc/meminfo").read_text()
        st = os.statvfs(work_dir)
        gpu.check_host_room(used, how, gpu.mem_available(meminfo), st.f_bavail * st.f_frsize, str(work_dir))

    def dump(self, kind: str, opts: DumpOptions, work_dir: Path) -> None:
        from ..checkpoint import criu
        from ..store import layout, locks

        runner = self._runner(kind)
        try:
            runner.real_ids = criu.dump_real_ids(Path(f"/proc/{opts.pid}/status").read_text(),
                                                 Path("/proc/self/status").read_text())
        except (OSError, ValueError):
            pass  # the tree is gone: CRIU says so
        if kind == "cuda":  # again right before CRIU: the engine ran for minutes since create began
            self._cuda_preflight(runner.env)
        try:
            with locks.criu_lock():
                runner.dump(opts, work_dir / layout.IMAGES, work_dir)
        finally:
            if runner.real_ids is not None:  # what CRIU wrote as the engine user: root's again
                _chown_root(work_dir)
        if kind == "cuda":
            criu.check_cuda_run(work_dir / layout.DUMP_LOG, "dump")

    def wait_gone(self, pids: tuple[int, ...], timeout_s: float) -> list[int]:
        import psutil

        from ..host.procs import wait_gone

        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        return wait_gone(procs, timeout_s)

    def pack(self, directory: Path, compression: str) -> tuple[ImageFile, ...]:
        from ..store import archive

        return archive.pack(directory, archive.Compression.parse(compression))

    # ---- engine (restore)
    def port_free(self, host: str, port: int) -> None:
        from ..host import ports

        ports.port_free(host, port)

    def memory_offer(self, detached: bool = False) -> Offer:
        from ..host import cgroups, resources

        return resources.offer(f"/{cgroups.PARENT}/_" if detached else None)

    def serve_engine(self, engine: Engine, host: str, port: int, die_with_parent: bool,
                     frontend: tuple[str, ...] = (), drain_s: float | None = None) -> None:
        from ..supervise import handoff

        handoff.serve_engine(engine, host, port, die_with_parent, frontend, drain_s)

    def check_log_file(self, path: Path) -> None:
        from ..errors import UsageError

        if path.is_dir() or not path.parent.is_dir():
            raise UsageError(f"--log-file {path}: " + ("is a directory" if path.is_dir() else f"{path.parent} does not exist"))
        real = os.path.realpath(path)
        if real.startswith(("/proc/", "/sys/", "/dev/")):
            raise UsageError(f"--log-file {path} is on a pseudo filesystem ({real}); name a regular file")
        try:  # the engine appends to it: it must be a writable regular file (not a fifo, a device)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
            try:
                import stat as _stat

                if not _stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UsageError(f"--log-file {path} is not a regular file")
            finally:
                os.close(fd)
        except OSError as e:
            raise UsageError(f"--log-file {path} cannot be written: {e.strerror}") from e

    def default_log_file(self, snapshot: Path, port: int) -> Path:
        return paths.ensure_private_dir(paths.log_dir()) / f"{snapshot.name}-{port}.log"

    def stage(self, snapshot: Path, m: Manifest) -> Path:
        from ..store import archive, layout

        sd = layout.SnapshotDir(snapshot)
        raw = sum(i.raw_bytes for i in m.images)
        stage = archive.unpack(sd.images, m.images, archive.staging_parent(raw, snapshot.parent, m.images))
        try:
            archive.verify(sd.files, m.extra_files)
        except BaseException:
            archive.remove_staging(stage)
            raise
        return stage

    def stage_checking(self, snapshot: Path, m: Manifest):
        from ..store import archive, layout

        sd = layout.SnapshotDir(snapshot)
        raw = sum(i.raw_bytes for i in m.images)
        parent = archive.staging_parent(raw, snapshot.parent, m.images)
        archive.verify(sd.files, m.extra_files)
        if any(i.compression != "none" for i in m.images):
            return archive.start_unpack(sd.images, m.images, parent)
        stage = archive.link_stage(sd.images, m.images, parent)
        try:
            return stage, archive.Checking(sd.images, m.images)
        except BaseException:
            archive.remove_staging(stage)
            raise

    def unstage(self, stage: Path) -> None:
        from ..store import archive

        archive.remove_staging(stage)

    def unstage_all(self, near: Path) -> None:
        from ..store import archive

        for d in archive.own_staging([Path("/dev/shm"), paths.staging_dir(), near]):
            archive.remove_staging(d)

    def put_back_remaps(self, snapshot: Path, m: Manifest) -> list[Path]:
        from ..store import layout
        from ..checkpoint import remaps

        return remaps.put_back(layout.SnapshotDir(snapshot).files, [f.name for f in m.extra_files])

    def new_channel(self, log_file: Path | None) -> EngineChannel:
        from ..supervise.supervisor import Channel

        return Channel.open(log_file)

    def criu_lock(self) -> AbstractContextManager:
        from ..store import locks

        return locks.criu_lock()

    def listeners_taken(self, listeners: tuple[tuple[str, int], ...]) -> list[str]:
        from ..host import ports

        return ports.listeners_taken(listeners)

    def ports_held_by(self, pid: int) -> set[int]:
        import psutil

        from ..host.procs import tree

        pids = {p.pid for p in tree(pid)}
        try:
            conns = psutil.net_connections("tcp")
        except (psutil.Error, OSError):
            return set()
        return {c.laddr.port for c in conns if c.pid in pids and c.status == psutil.CONN_LISTEN and c.laddr}

    def gpu_lock(self, uuid: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from ..store import locks

        return locks.gpu_lock(uuid, on_wait)

    def check_gpu_capacity(self, m: Manifest) -> None:
        from ..checkpoint import gpu

        if m.engine.kind != "cuda":
            return
        uuid = m.host.get("gpu_uuid_used", "")
        total, free, _used = gpu.memory(uuid)
        need = gpu.required_restore_bytes(m.engine.engine_args, total, m.key.normalized_args if m.key else None)
        gpu.check_free_memory(need, free, gpu=uuid)

    def restore_tree(self, kind: str, opts: RestoreOptions, stage: Path,
                     before_memory: Callable[[], None] | None = None, cuda_pids: tuple[int, ...] = ()) -> int:
        from ..checkpoint import criu
        from ..checkpoint import gpu
        from ..store import layout
        from ..host.procs import ns_pid, tree

        runner = self._runner(kind)
        if kind == "cuda":  # as at dump: a helper that cannot reach the driver fails here, not after CRIU
            self._cuda_preflight(runner.env)
        pid = runner.restore(opts, stage, stage, before_memory)
        if kind == "cuda":
            try:
                criu.check_cuda_run(stage / layout.RESTORE_LOG, "restore")
                pids, helper = [p.pid for p in tree(pid)], self._helper(runner.env)
                if cuda_pids:  # only the recorded CUDA processes: one driver attach each
                    wanted = set(cuda_pids)
                    states = gpu.restored_states([p for p in pids if ns_pid(p) in wanted], helper, recorded=True)
                    gpu.check_restored(states, expected=len(wanted))
                else:
                    gpu.check_restored(gpu.restored_states(pids, helper))
            except BaseException:
                criu.kill_restored_children()
                raise
        return pid

    def adopt(self, pid: int, channel: EngineChannel, echo: Callable[[bytes], None] | None) -> Engine:
        from ..supervise.supervisor import restored_handle

        return restored_handle(pid, channel, [echo] if echo else [])

    def tree_commands(self, pid: int) -> tuple[str, ...]:
        from ..host.procs import command, tree

        return tuple(command(p) for p in tree(pid))

    def http_health(self, url: str) -> bool:
        try:
            status, _ = _http_json(f"{url}/health", timeout=2)
            return status == 200
        except (urllib.error.URLError, OSError):
            return False

    def http_canary(self, url: str, m: Manifest, api_key: str | None = None) -> list[str]:
        from ..store import oracle

        try:
            status, body = _http_json(f"{url}/v1/completions", canary_request(m), api_key=api_key)
        except (urllib.error.URLError, OSError) as e:
            return [f"canary request failed: {e}"]
        if status != 200 or not isinstance(body, dict):
            return [f"canary request failed: HTTP {status}: {str(body)[:200]}"]
        try:
            choice = body["choices"][0]
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or [None]
            ids = choice.get("token_ids") or [None]
            return oracle.compare_http(m.oracle, choice.get("text"), lps[0], ids[0])
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            return [f"canary response is malformed ({type(e).__name__}: {e}): {str(body)[:200]}"]

    # ---- store and runtime
    def snapshot_lock(self, snapshot: Path, shared: bool, must_exist: bool = True) -> AbstractContextManager:
        from ..store import locks

        return locks.snapshot_lock(snapshot, shared=shared, must_exist=must_exist)

    def list_snapshots(self, root: Path) -> list[Path]:
        from ..store import store

        return store.list_snapshots(root)

    def disk_room(self, target: Path, model_dir: Path) -> tuple[tuple[str, int] | None, int]:
        from ..store import manifest, store
        from ..errors import SnapshotError

        parent = target.parent
        newest = None
        if parent.is_dir():
            for p in store.list_snapshots(parent):
                try:
                    m = manifest.read(p)
                except (SnapshotError, OSError):
                    continue
                if m.model.path == str(model_dir) and (newest is None or m.created_at > newest[0]):
                    newest = (m.created_at, str(p), int(m.sizes.get("raw", 0)))
        probe = parent
        while not probe.exists() and probe != probe.parent:  # the root may not exist yet
            probe = probe.parent
        st = os.statvfs(probe)
        return (newest[1:] if newest else None), st.f_bavail * st.f_frsize

    def delete_snapshot(self, snapshot: Path) -> None:
        from ..store import locks, store

        store.delete(snapshot)
        locks.remove_lock_file(snapshot)  # the caller holds it exclusively

    def clean_stale_temps(self, root: Path) -> list[Path]:
        from ..store import locks, store

        locks.clean_stale()  # lock files of snapshot paths that are gone
        return store.clean_stale_temps(root)

    def reclaim(self, near: Path, dry_run: bool = False) -> list[str]:
        import psutil

        from ..store import archive, locks, registry, store

        gone = []
        for d in archive.stale_staging([Path("/dev/shm"), paths.staging_dir(), near]):
            if not dry_run:
                archive.remove_staging(d)
            gone.append(str(d))
        if dry_run:
            gone += [str(p) for p in store.stale_temps(near)]
        registry.entries()  # drops entries of dead engines
        for p in registry.orphans():  # a SIGKILLed restore's tree: kill its namespace init
            try:
                if not dry_run:
                    p.kill()
                gone.append(f"orphaned engine tree PID {p.pid}")
            except psutil.Error:
                pass
        if not dry_run:
            gone += [str(p) for p in locks.clean_stale()]
            gone += [f"empty cgroup {p}" for p in _remove_empty_cgroups()]
        return gone

    def key_lock(self, key: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from ..store import locks

        return locks.key_lock(key, on_wait)

    def port_lock(self, port: int, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from ..store import locks

        return locks.port_lock(port, on_wait)

    def record_refusal(self, snapshot: Path, code: str, reason: str) -> None:
        from ..store import store

        store.record_refusal(snapshot, code, reason)

    def refusal(self, snapshot: Path) -> dict | None:
        from ..store import store

        return store.refusal(snapshot)

    def last_restore(self, snapshot: Path) -> float | None:
        from ..store import store

        return store.last_restore(snapshot)

    def record_restore(self, snapshot: Path, overrides: list[str]) -> None:
        from ..store import store

        store.record_restore(snapshot, overrides)

    def engines(self) -> list[Entry]:
        from ..store import registry

        return registry.entries()

    def orphan_pids(self) -> list[int]:
        from ..store import registry

        return [p.pid for p in registry.orphans()]

    def empty_engine_cgroups(self) -> list[str]:
        from ..host import cgroups

        return [str(p) for p in cgroups.empty_leaves()]

    def register(self, entry: Entry) -> None:
        from ..store import registry

        registry.register(entry)

    def unregister(self, pid: int) -> None:
        from ..store import registry

        registry.unregister(pid)

    def stop_engine(self, entry: Entry, drain_s: float | None = None) -> StopReport:
        from ..store import registry

        report = registry.stop(entry, drain_s)
        _remove_empty_cgroups()
        return report

    def engine_owning(self, pid: int, entries: list[Entry]) -> Entry | None:
        import psutil

        try:
            chain = {p.pid for p in psutil.Process(pid).parents()}
        except psutil.Error:
            return None
        return next((e for e in entries if e.pid in chain or (e.supervisor_pid and e.supervisor_pid == pid)), None)

    def engine_cgroup(self, name: str) -> Placement:
        from ..host import cgroups

        return cgroups.create(name)

    def cgroup_of(self, pid: int) -> str:
        from ..host import cgroups

        return cgroups.where(pid)

    # ---- time
    def clock(self) -> float:
        return time.monotonic()

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
