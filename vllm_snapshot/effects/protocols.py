"""The seam's contracts: one Protocol per role (:class:`Tools` in :mod:`.tools` bundles one
implementation of each); the handles the roles return (the engine, its channels, the staged
images a restore waits on) are :mod:`.handles`'.

Each role has one local implementation in a module of its own (:mod:`.host`, :mod:`.model`,
:mod:`.files`, :mod:`.checkpoint`, :mod:`.engine`, :mod:`.store`, :mod:`.runtime`, :mod:`.fleet`) and one
recording fake in ``tests/fakes.py``; ``tests/test_protocols.py`` checks that both define
exactly the role's methods, with the same signatures (vLLM's own fake drifted from its real
class without such a test). Policies live in the leaves the implementations call, not here.
"""

from __future__ import annotations

import socket
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Protocol

from ..checkpoint.criu import DumpOptions, RestoreOptions
from ..checkpoint.gpu import GpuSlot, GpuUse
from ..checkpoint.inventory import Inventory
from ..engine.spec import EngineSpec
from ..host.cgroups import Placement
from ..host.privilege import Creds, User
from ..host.resources import Offer
from ..checkpoint.carry import Plan as CarryPlan
from ..store.manifest import (CarriedDir, CarriedFile, CodeIdentity, EngineUser, ExternalMount, ImageFile, Manifest,
                              ModelFile)
from ..store.model_digest import ModelCheck
from ..errors import SnapshotError
from ..report.results import ExitedRow, PartialPull
from ..store.registry import Entry, StopReport
from ..fleet import reference
from ..fleet.transport import Target
from .handles import Engine, EngineChannel, StagedImages, WeightsChannel


class HostTools(Protocol):
    """This host and this process: root, CRIU version, identity, users and what they may read, mounts, devices, memory, ports."""

    def require_root(self) -> None:
        """Raises EnvironmentProblem when not root."""

    def criu_version(self) -> str:
        """Version of the CRIU that will run (probed once). Raises EnvironmentProblem (< 4.2)."""

    def host_identity(self, kind: str) -> dict[str, str]:
        """This host's identity fields (identity.collect + GPU + CUDA helper for ``cuda``)."""

    def gpu_uuids(self) -> list[str]:
        """UUIDs of this host's GPUs ([] without)."""

    def gpu_slots(self) -> list[GpuSlot]:
        """This host's GPUs with model and device minor, by minor ([] without;
        :func:`vllm_snapshot.checkpoint.gpu.slots`). Raises EnvironmentProblem (nvidia-smi)."""

    def engine_device(self) -> str:
        """``"cpu"`` or ``"cuda"``: what the installed vLLM build will run the engine on (a CPU
        build of vLLM runs on CPU even on a GPU host)."""

    def environ(self) -> dict[str, str]: ...

    def path_exists(self, path: Path) -> bool: ...

    def path_kind(self, path: Path) -> str:
        """What ``path`` is, in words, not following a symlink: ``"a directory"``, ``"a file"``,
        ``"a symlink"``, ``"a special file"``, or ``"nothing"`` (absent)."""

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

    def unreadable_by(self, u: EngineUser, paths: list[Path]) -> list[str]:
        """Which of ``paths`` (files) the recorded engine user cannot read (human lines)."""

    def check_mounts(self, model_dir: Path, env: dict[str, str], also: tuple[str, ...] = ()) -> None:
        """Before the engine starts: refuse (UsageError naming mount point, type, remedy) when
        a mount the engine needs (the model, its Python, caches, and the paths ``also``: the
        snapshot root whose weights file it maps) cannot be checkpointed (engine/mounts.py policy)."""

    def check_external_mounts(self, mounts: tuple[ExternalMount, ...]) -> list[str]:
        """Problems with this host's mounts at the recorded mount points (empty = same)."""

    def check_cuda_ready(self) -> None:
        """Before a CUDA engine starts: CRIU's CUDA plugin (of the binary's build, not
        redirected by a config file) and the ``cuda-checkpoint`` CRIU would run, which must
        reach the driver's checkpoint API (NVIDIA r570+). Raises EnvironmentProblem."""

    def memory_offer(self, detached: bool = False) -> Offer:
        """Memory this host and the memory cgroup the engine will run in offer a restore now
        (:mod:`vllm_snapshot.host.resources`): ours, or for ``detached`` the engines' parent cgroup
        ``/vllm-snapshot`` (:mod:`vllm_snapshot.host.cgroups`), whose limit caps every detached engine."""

    def port_free(self, host: str, port: int) -> None:
        """Raises BusyError/UsageError when ``host:port`` cannot be bound."""

    def listeners_taken(self, listeners: tuple[tuple[str, int], ...]) -> list[str]: ...

    def ports_held_by(self, pid: int) -> set[int]:
        """TCP ports the tree rooted at ``pid`` listens on."""

    def take_listener(self, pid: int, host: str, port: int) -> socket.socket:
        """A duplicate of the listening socket bound to ``host:port`` (in our network namespace)
        that process ``pid`` holds: the same socket, so its backlog is shared
        (:func:`vllm_snapshot.host.ports.take_listener`). Raises LookupError (``pid`` holds
        none), OSError (it cannot be taken)."""

    def holds_socket(self, pid: int, sock: socket.socket) -> bool:
        """Whether process ``pid`` still has a descriptor of ``sock``; False when it is gone."""

    def accepting(self, pid: int, sock: socket.socket) -> bool:
        """Whether process ``pid``'s event loop waits for connections on ``sock`` (an epoll
        instance of it watches the socket: :func:`vllm_snapshot.host.ports.accepting`)."""


class ModelTools(Protocol):
    """The model directory: resolve, hash, stat, re-check, and vLLM's reading of the engine args."""

    def resolve_model(self, model: str, revision: str | None) -> tuple[Path, str | None]:
        """(local directory, resolved HF revision or None) of ``model``. Raises UsageError."""

    def check_model_config(self, model_dir: Path, engine_args: list[str]) -> None:
        """Refuse a ``config.json`` vLLM cannot use before the engine starts
        (:func:`vllm_snapshot.store.model_digest.check_config`). Raises UsageError."""

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
        """``vllm serve`` args normalized by vLLM's parser (:func:`vllm_snapshot.engine.args.normalize_args`;
        imports vLLM). Raises UsageError for args vLLM rejects."""

    def verify_model(self, model_dir: Path, files: tuple[ModelFile, ...], mode: str) -> ModelCheck:
        """Raises ModelChangedError."""


class SnapshotFiles(Protocol):
    """A snapshot directory's members: the temp dir of a create and its publication, the trusted open, checksums, the code table, images packed and staged."""

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

    def check_weights(self, m: Manifest, full: bool = False) -> None:
        """Raise ModelChangedError when the weights file ``m`` maps is missing or changed
        (:func:`vllm_snapshot.store.weights.refuse`; ``full``: re-hash it even when its stat is
        unchanged). Nothing for a snapshot without one."""

    def check_weights_dir(self, root: Path) -> None:
        """Raise EnvironmentProblem when ``root/.weights`` exists but is not a real root-owned
        0700 directory (:func:`vllm_snapshot.store.weights.dir_problem`): create checks it before
        the engine starts. Nothing when it is one, or missing (create makes it)."""

    def check_tree_files(self, m: Manifest) -> list[str]:
        """Problems with the files the tree had open or mapped (empty = unchanged), those the
        snapshot carries left out (:meth:`plan_carried` decides about them)."""

    def plan_carried(self, snapshot: Path, m: Manifest) -> CarryPlan:
        """Verify every stored copy of the snapshot's carried files (CorruptSnapshotError naming
        the file), then what a restore would do with each here
        (:func:`vllm_snapshot.checkpoint.carry.plan`; empty for a snapshot without carried files).
        Writes nothing."""

    def pin_code(self, modules: list[str], sys_path: list[str], work_dir: Path) -> CodeIdentity:
        """Pin the files of the distributions owning ``modules`` on ``sys_path``
        (:func:`vllm_snapshot.host.codeid.record`) into ``work_dir/code.json``; its summary."""

    def check_code(self, snapshot: Path, m: Manifest) -> list[str]:
        """Problems with the pinned Python files (:func:`vllm_snapshot.host.codeid.check`; empty =
        unchanged or none pinned). Raises CorruptSnapshotError when the table does not match
        its digest in the manifest."""

    def caps_missing(self, snapshot: Path, m: Manifest) -> list[int]:
        """Capabilities the dumped engine root held that this process cannot give back
        (:func:`vllm_snapshot.host.privilege.caps_beyond` over the root's CRIU core image; [] when
        the image cannot be read: CRIU then decides)."""

    def pack(self, directory: Path, compression: str) -> tuple[ImageFile, ...]: ...

    def stage_checking(self, snapshot: Path, m: Manifest) -> tuple[Path, StagedImages]:
        """(staging dir of the raw images, their checksum verification: :class:`StagedImages`): for an
        uncompressed snapshot the images are hard-linked at once and verified in the background
        while CRIU restores; a compressed snapshot's small images are unpacked and verified
        before returning and its memory pages images in the background
        (:class:`UnpackingImages`: ``ready()`` must return before CRIU reads a pages image).
        Saved files (``files/``) are
        verified before returning. Raises CorruptSnapshotError."""

    def unstage(self, stage: Path) -> None: ...

    def unstage_all(self, near: Path) -> None:
        """Remove every staging dir this process made (/dev/shm, the staging dir, ``near``)."""


class CheckpointTools(Protocol):
    """CRIU and the process tree it dumps or restores: the inventory, the GPU it uses, link-remap files, the host-wide CRIU lock and the GPU lock, dump and restore, and what the restored tree is."""

    def inspect_tree(self, root_pid: int) -> Inventory:
        """Raises UnsnapshottableError, EngineError."""

    def channel_keys(self, root_pid: int) -> dict[str, str]:
        """role -> ``pipe:[inode]`` of the engine's channel fds."""

    def external_mounts(self, root_pid: int) -> tuple[ExternalMount, ...]:
        """The engine namespace's mounts CRIU gets as external ones (identity recorded).
        Raises UnsnapshottableError for one CRIU cannot name."""

    def gpu_used(self, inv: Inventory) -> GpuUse:
        """The one GPU a CUDA engine tree uses and its processes with a CUDA context
        (:class:`vllm_snapshot.checkpoint.gpu.GpuUse`): every ``/dev/nvidia*`` holder is asked as CRIU's
        plugin asks (:func:`vllm_snapshot.checkpoint.gpu.cuda_processes`), the GPU comes from the driver's
        compute apps (:func:`vllm_snapshot.checkpoint.gpu.used_gpu`). Raises UnsnapshottableError (a holder
        without a CUDA context, named; no CUDA process; several GPUs), EnvironmentProblem."""

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

    def watch_remaps(self, deleted: tuple[str, ...]) -> dict[str, set[str]]: ...

    def collect_remaps(self, before: dict[str, set[str]], files_dir: Path) -> list[Path]:
        """Copy link-remap files CRIU left into ``files_dir``; return the originals."""

    def find_remaps(self, before: dict[str, set[str]]) -> list[Path]:
        """Link-remap files CRIU left in the watched directories (a failed dump's, to remove)."""

    def cleanup_remaps(self, found: list[Path]) -> None: ...

    def put_back_remaps(self, snapshot: Path, m: Manifest) -> list[Path]: ...

    # carried files (vllm_snapshot/checkpoint/carry.py): create copies, restore puts back
    def carry_files(self, files: tuple, model_dir: Path, model_files: tuple[ModelFile, ...], sys_path: list[str],
                    work_dir: Path, also: tuple[str, ...] = ()) -> tuple[tuple[CarriedFile, ...], tuple[CarriedDir, ...]]:
        """Copy the tree files (``files``: :class:`~vllm_snapshot.store.manifest.TreeFile`) outside
        the model, the Python environment (this interpreter's prefixes and the engine's
        ``sys_path``), the system and the paths ``also`` (the weights file) into ``work_dir/carried``
        (:func:`vllm_snapshot.checkpoint.carry.collect`). Returns (files, the directories above
        them). Raises OSError."""

    def put_back_carried(self, snapshot: Path, m: Manifest) -> list[str]:
        """Right before CRIU (after :meth:`SnapshotFiles.plan_carried` verified the stored
        copies): plan again, raise :func:`vllm_snapshot.checkpoint.carry.refusal`
        (IncompatibleHostError, BusyError), then write the missing or replaceable files, each
        copy hashed again as it is written (CorruptSnapshotError). Returns the paths written."""

    def criu_lock(self) -> AbstractContextManager:
        """Host-wide lock around one CRIU run."""

    def gpu_lock(self, uuid: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        """Exclusive lock of the GPU ``uuid`` (:func:`vllm_snapshot.store.locks.gpu_lock`), held by a
        CUDA restore from its capacity check until its engine has woken; ``on_wait`` hears who
        holds it before waiting. Raises BusyError after the wait."""

    def check_gpu_capacity(self, m: Manifest, uuid: str) -> None:
        """CUDA snapshot: raise BusyError unless the GPU ``uuid`` it is restored onto (the one it
        used, or the one :func:`vllm_snapshot.checkpoint.gpu.place` chose) has the memory the
        engine will need free (:func:`vllm_snapshot.checkpoint.gpu.required_restore_bytes`). Call
        right before CRIU (after ``switch`` stopped the old engine)."""

    def restore_tree(self, kind: str, opts: RestoreOptions, stage: Path,
                     before_memory: Callable[[], None] | None = None, cuda_pids: tuple[int, ...] = (),
                     gpu_map: tuple[tuple[str, str], ...] = ()) -> int:
        """CRIU restore as our child; returns the root's host PID. ``gpu_map``: ``(recorded UUID,
        target UUID)`` pairs when the GPU state goes onto another GPU
        (:attr:`vllm_snapshot.checkpoint.gpu.GpuPlacement.pairs`): handed to our
        ``cuda-checkpoint`` in CRIU's environment, after checking that it can remap
        (EnvironmentProblem before CRIU otherwise). ``before_memory``: called
        once the tree's namespaces exist, before CRIU reads any pages image (a tree with
        namespaces only; its exception aborts CRIU and is raised). For ``cuda``: before CRIU,
        the ``cuda-checkpoint`` CRIU will run must reach the driver (EnvironmentProblem, as
        :meth:`check_cuda_ready`); after it, every CUDA process of the restored tree must be
        ``running`` (else the tree is killed): those recorded at the dump (``cuda_pids``, PIDs
        in the tree's namespace; each probe costs a driver attach), or every process when none
        were recorded. Raises CriuError, EnvironmentProblem."""

    def tree_commands(self, pid: int) -> tuple[str, ...]:
        """Command lines of ``pid``'s tree, root first (empty when it is gone)."""

    def tree_creds(self, root_pid: int) -> dict[int, Creds]:
        """pid -> credentials (/proc/PID/status) of ``root_pid`` and its descendants."""


class EngineTools(Protocol):
    """The engine process and its server: start (create), fresh channel and adoption (restore), the port handed over, HTTP health and canary, its log files."""

    def launch_engine(self, spec: EngineSpec, env: dict[str, str], log_path: Path,
                      echo: Callable[[bytes], None] | None) -> Engine:
        """Start the engine root of ``spec`` in its own PID, mount and network namespace, with
        the environment ``env``, its log appended to ``log_path`` (and each chunk passed to
        ``echo``). Raises EngineError."""

    def new_channel(self, log_file: Path | None) -> EngineChannel: ...

    def adopt(self, pid: int, channel: EngineChannel, echo: Callable[[bytes], None] | None) -> Engine: ...

    def serve_engine(self, engine: Engine, host: str, port: int, die_with_parent: bool,
                     frontend: tuple[str, ...] = (), drain_s: float | None = None,
                     listener: socket.socket | None = None) -> None:
        """Bind ``host:port`` in our (the host's) network namespace, send ``serve`` and hand the
        listening socket to the engine, whose tree has a network namespace of its own
        (:mod:`vllm_snapshot.supervise.handoff`); ``frontend``: option tokens the engine applies first
        (:mod:`vllm_snapshot.supervise.frontend`); ``drain_s``: seconds the engine lets requests in flight
        finish when signalled to stop; ``listener``: a socket already listening on ``host:port``
        to hand over instead of binding (a switch's hand-over; the caller keeps and closes it).
        Raises BusyError/UsageError (port), EngineError."""

    def http_health(self, url: str) -> bool: ...

    def http_canary(self, url: str, m: Manifest, api_key: str | None = None) -> list[str]:
        """Differences between an HTTP completion of the oracle prompt and the oracle
        (``api_key``: sent as ``Authorization: Bearer``)."""

    def check_log_file(self, path: Path) -> None:
        """Raises UsageError when ``path`` cannot be an engine log file."""

    def default_log_file(self, snapshot: Path, port: int) -> Path:
        """Where a detached engine's log goes when ``--log-file`` is not given
        (``$VLLM_SNAPSHOT_LOG_DIR/NAME-PORT.log``, created 0600 here). Raises
        EnvironmentProblem (exit 11) naming the directory when it cannot be written (read-only,
        full, denied)."""

    def log_room(self, path: Path) -> int | None:
        """Bytes free (to unprivileged writers) on the filesystem of the log file ``path`` (of
        its directory when the file is absent); None when it cannot be told."""

    def read_log_tail(self, path: Path, lines: int = 20) -> str | None:
        """The last ``lines`` lines of the engine log file ``path`` (None when it cannot be read)."""

    def weights_channel(self, engine: Engine, root: Path, uid: int) -> WeightsChannel:
        """Serve the weights channel of ``engine``'s tree (its worker, running as ``uid``, hands
        over its weights; the file is published under ``root/.weights``). Raises OSError."""

    def keep_log(self, path: Path, what: str) -> Path | None:
        """Copy the engine log ``path`` into the log directory as ``engine-WHAT-<time>-<pid>.log``
        (0600; :func:`vllm_snapshot.supervise.supervisor.keep_log`) before its directory is
        removed; the copy, or None when it could not be kept."""


class StoreTools(Protocol):
    """The snapshot store: canonical paths, locks (snapshot, key, port), listing, free room, deletion, leftovers, the records of refusals and restores."""

    def canonical(self, path: Path) -> Path:
        """The one identity of a snapshot path (:func:`vllm_snapshot.store.store.canonical`)."""

    def snapshot_lock(self, snapshot: Path, shared: bool, must_exist: bool = True) -> AbstractContextManager: ...

    def key_lock(self, key: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        """Exclusive lock of one snapshot key; ``on_wait`` hears who holds it before waiting."""

    def port_lock(self, port: int, on_wait: Callable[[str], None]) -> AbstractContextManager:
        """Exclusive lock of one TCP port (``switch``, :func:`vllm_snapshot.store.locks.port_lock`);
        ``on_wait`` hears who holds it before waiting."""

    def list_snapshots(self, root: Path) -> list[Path]: ...

    def without_manifest(self, root: Path) -> list[Path]:
        """Directories under ``root`` with ``images/`` but no manifest (a lost manifest:
        :func:`vllm_snapshot.store.store.without_manifest`), which ``list`` cannot list."""

    def root_problem(self, root: Path) -> SnapshotError | None:
        """The EnvironmentProblem for which create and restore would refuse snapshots under
        ``root`` (it or a directory above it writable by group/others, owned by another user, an
        unsafe symlink: :func:`vllm_snapshot.store.layout.check_parents`), its hint saying what to
        do; None when safe or absent."""

    def disk_room(self, target: Path, model_dir: Path) -> tuple[tuple[str, int] | None, int]:
        """(``(path, raw image bytes)`` of the newest readable snapshot of ``model_dir`` beside
        ``target`` or None, bytes free on the filesystem that will hold ``target``)."""

    def delete_snapshot(self, snapshot: Path) -> None: ...

    def delete_refusal(self, snapshot: Path) -> SnapshotError | None:
        """Why ``delete_snapshot`` would refuse ``snapshot`` as not surely a snapshot (a symlink,
        a damaged manifest: :func:`vllm_snapshot.store.store.delete_refusal`), touching nothing;
        None when it would go on."""

    def weights_blocked(self, root: Path) -> list[str]:
        """Snapshot dirs under ``root`` whose unreadable manifest keeps weights files no other
        snapshot names (they might name them); empty when none is kept that way."""

    def remove_unused_weights(self, root: Path, dry_run: bool = False) -> list[Path]:
        """Remove the weights files under ``root/.weights`` that no snapshot's manifest under
        ``root`` names and no process maps (:func:`vllm_snapshot.store.weights.unreferenced`);
        return them (``dry_run``: only return them)."""

    def clean_stale_temps(self, root: Path) -> list[Path]:
        """Remove leftovers of crashed creates under ``root`` (and stale lock files)."""

    def reclaim(self, near: Path, dry_run: bool = False) -> list[str]:
        """Remove what killed commands left: staging dirs of dead restores (/dev/shm, the
        staging dir, ``near``), orphaned engine trees, stale registry entries and lock files.
        Never a live one's. ``dry_run``: only list them."""

    def record_refusal(self, snapshot: Path, code: str, reason: str, by: str = "serve") -> None:
        """Remember that ``by`` (``serve``, or ``restore`` for corrupt images) refused
        ``snapshot`` here (shown by ``list``)."""

    def refusal(self, snapshot: Path) -> dict | None:
        """The refusal recorded for ``snapshot`` since its last restore, or None."""

    def clear_refusal(self, snapshot: Path, codes: frozenset[str]) -> dict | None:
        """Forget the refusal recorded for ``snapshot`` if its code is in ``codes``; return it."""

    def last_restore(self, snapshot: Path) -> float | None: ...

    def record_restore(self, snapshot: Path, overrides: list[str]) -> None: ...


class RuntimeTools(Protocol):
    """Engines running on this host: the registry, their cgroups, stopping them, and the signals this process forwards to its foreground engine."""

    def engines(self) -> list[Entry]: ...

    def orphan_pids(self) -> list[int]:
        """Root PIDs of engine trees nobody owns (what a SIGKILLed restore leaves: see
        :func:`vllm_snapshot.store.registry.orphans`); ``reclaim`` (every prune) kills them."""

    def exited_engines(self) -> list[ExitedRow]:
        """Engines found gone without a ``stop`` -- exited or killed on their own -- since the
        last ``prune`` (:func:`vllm_snapshot.store.registry.exited`), oldest first."""

    def forget_exited_engines(self, dry_run: bool = False) -> list[str]:
        """Forget the records :meth:`exited_engines` lists (``prune``); one line each."""

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

    def merge_of(self, pid: int) -> tuple[bool, int]:
        """(whether the engine tree rooted at ``pid`` is marked KSM-mergeable -- restored with
        ``--merge-pages`` --, how many of its pages KSM has merged now), from /proc
        (:func:`vllm_snapshot.checkpoint.criu.merge.process_merge`); (False, 0) when it is gone."""

    def merge_marked(self, pid: int) -> bool:
        """Whether the engine tree rooted at ``pid`` is marked KSM-mergeable, as :meth:`merge_of`
        says it but from the root's ``/proc/PID/ksm_stat`` alone (the tree inherits the mark;
        :func:`vllm_snapshot.checkpoint.criu.merge.process_marked`); False when it is gone."""

    def forward_signals(self, handler: Callable[[int], None]) -> AbstractContextManager:
        """While the context is open, SIGINT, SIGTERM and SIGHUP (a closed terminal) call
        ``handler(signum)`` instead of their handlers; the old handlers come back on exit."""

    def terminate(self, pid: int) -> None:
        """SIGTERM to ``pid``; nothing when it is gone."""

    def hold_signals(self) -> None:
        """Hold SIGINT/SIGTERM/SIGHUP from now on (:func:`vllm_snapshot.host.interrupts.hold`):
        the moment a restored engine serves validated, its bookkeeping must not be cut."""

    def release_signals(self) -> None:
        """End :meth:`hold_signals`. Raises Interrupted when a signal came meanwhile."""


class Clock(Protocol):
    """Time."""

    def monotonic(self) -> float:
        """Monotonic seconds."""

    def now(self) -> float:
        """Unix time, seconds."""

    def sleep(self, seconds: float) -> None: ...


class FleetTools(Protocol):
    """Side effects of ``push``/``pull``/``inspect IMAGE``."""

    def open_target(self, ref: reference.Ref, plain_http: bool, create: bool) -> Target:
        """The registry repository or image layout of ``ref`` (:func:`.transport.open_target`).
        Raises UsageError (``--plain-http`` to a host that is not loopback; not a layout)."""

    def snapshot_config(self, snapshot: Path) -> bytes:
        """The bytes of ``snapshot/manifest.json`` (the artifact's config, pushed byte for byte)."""

    def check_pulled(self, staging: Path, m, assembled=None) -> None:
        """The snapshot's own checks over a downloaded staging dir: member layout (stat),
        every image and saved file's BLAKE3, the code table's digest. ``assembled``: an
        :class:`~vllm_snapshot.store.checksums.Assembling` that hashed some of those files while
        they were downloaded; its decision (:meth:`~vllm_snapshot.store.checksums.Assembling.finish`,
        after the layout check) stands for them, the others are hashed here. Raises
        CorruptSnapshotError naming the file."""

    def partial_pulls(self, root: Path) -> list[PartialPull]:
        """The partial dirs of pulls under the store ``root`` (:func:`.partial.kept`: kept for
        resuming, or a running pull's). Reads only."""

    def pull_staging(self, dest: Path, digest: str) -> AbstractContextManager:
        """Where a pull of the artifact ``digest`` (``sha256:HEX``) to be published as ``dest``
        writes: a :class:`.partial.Staging` (the store's partial dir of that artifact, locked,
        with what an interrupted pull of it left; or a private dir of this pull's own when
        another pull holds it), after removing stale partial and temp dirs beside ``dest``.
        Leaving by an exception keeps the partial dir for an interruption or a registry
        problem and removes it otherwise (:mod:`.partial`)."""

    def weights_problem(self, path: Path) -> str | None:
        """Why the weights file cannot be placed at ``path`` on this node (None: it can):
        :func:`.weights.destination_problem`. Reads only."""

    def weights_present(self, path: Path, blake3: str, size: int) -> bool:
        """True when a regular file at ``path`` holds ``size`` bytes hashing to ``blake3``."""

    def weights_staging(self, final: Path, blake3: str, where: str) -> AbstractContextManager:
        """The locked :class:`.weights.WeightsStaging` of the weights file ``final``
        (:func:`.weights.staging`). Raises IncompatibleHostError when its directory cannot be
        made."""

    def publish_pulled(self, staging: Path, target: Path, config: bytes, provenance: dict) -> None:
        """Write ``manifest.json`` (``config``, byte for byte) and :data:`PULLED`
        (``provenance``), 0600, drop the resume marks, then rename ``staging`` to ``target``
        (UsageError when ``target`` appeared meanwhile)."""
