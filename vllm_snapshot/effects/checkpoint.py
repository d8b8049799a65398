"""The CRIU side of the seam: :class:`CriuRunners` (the CRIU binary found and version-checked
once, its runner per engine kind, the ``cuda-checkpoint`` CRIU's plugin runs) and
:class:`LocalCheckpointTools`, :class:`~vllm_snapshot.effects.protocols.CheckpointTools` over this
host."""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

from ..checkpoint.criu import DumpOptions, RestoreOptions
from ..checkpoint.gpu import GpuUse
from ..checkpoint.inventory import Inventory
from ..host.privilege import Creds
from ..store.manifest import CarriedDir, CarriedFile, ExternalMount, Manifest, ModelFile
from .protocols import CheckpointTools


class CriuRunners:
    """The CRIU binary (found and checked >= 4.2 once), a runner per engine kind, and the
    ``cuda-checkpoint`` CRIU's CUDA plugin would run."""

    def __init__(self) -> None:
        self._found: tuple[str, str] | None = None

    def binary(self) -> tuple[str, str]:
        """(path, version) of the CRIU that will run. Raises EnvironmentProblem (< 4.2)."""
        from ..checkpoint import criu
        from ..errors import EnvironmentProblem

        if self._found is None:
            b = criu.find_criu()
            v = criu.criu_version(b)
            if not criu.version_ok(v):
                raise EnvironmentProblem(f"CRIU {v} at {b} is too old; vllm-snapshot needs >= 4.2",
                                         hint="CRIU < 4.2 fails on kernels >= 6.16; run scripts/setup.sh")
            self._found = (b, v)
        return self._found

    def runner(self, kind: str):
        """A :class:`vllm_snapshot.checkpoint.criu.Criu` for an engine of ``kind``."""
        from ..checkpoint import criu

        binary = self.binary()[0]
        return criu.Criu(binary, criu.cuda_env(binary) if kind == "cuda" else {})

    @staticmethod
    def helper(env: dict[str, str]) -> Callable:
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

    def cuda_preflight(self, env: dict[str, str], remap: bool = False) -> None:
        """The test CRIU's plugin makes at init, with the PATH CRIU will get
        (:func:`vllm_snapshot.checkpoint.gpu.check_helper_usable`); ``remap``: also that it takes
        a device map (:func:`vllm_snapshot.checkpoint.gpu.check_remap_usable`). Raises
        EnvironmentProblem."""
        from ..checkpoint import gpu

        rc, out = self.helper(env)(["-h"])
        gpu.check_helper_usable(rc, out)
        if remap:
            gpu.check_remap_usable(rc, out, os.environ.get("VLLM_SNAPSHOT_CUDA_CHECKPOINT"))

class LocalCheckpointTools(CheckpointTools):
    """:class:`CheckpointTools` over this host (``criu``: the CRIU binary and helpers shared
    with :class:`vllm_snapshot.effects.host.LocalHostTools`)."""

    def __init__(self, criu: CriuRunners) -> None:
        self.criu = criu

    def inspect_tree(self, root_pid: int) -> Inventory:
        from ..checkpoint import inventory

        return inventory.inspect_tree(root_pid)

    def channel_keys(self, root_pid: int) -> dict[str, str]:
        from ..supervise.supervisor import channel_keys

        return channel_keys(root_pid)

    def external_mounts(self, root_pid: int) -> tuple[ExternalMount, ...]:
        from ..checkpoint import mountpolicy
        from ..errors import UnsnapshottableError

        try:
            return tuple(mountpolicy.describe_externals(root_pid))
        except ValueError as e:
            raise UnsnapshottableError(str(e), hint="mount that file system at a path without ']'") from e

    def gpu_used(self, inv: Inventory) -> GpuUse:
        from ..checkpoint import gpu
        from ..host.procs import ns_pid

        cuda, skipped = gpu.cuda_processes(inv.cuda_pids, self.criu.helper(self.criu.runner("cuda").env))
        gpu.refuse_skipped(skipped, dict(zip(inv.pids, inv.commands)))
        by_minor = gpu.uuids_by_minor()
        uuid = gpu.used_gpu(cuda, inv.nvidia_files, by_minor, gpu.compute_apps() if cuda else ())
        # its device minor and model: a restore on another host places the GPU state by them
        minor = next((n for n, u in by_minor.items() if u == uuid), None)
        name = next((g.name for g in gpu.query() or () if g.uuid == uuid), "")
        return GpuUse(uuid, tuple(sorted(n for p in cuda if (n := ns_pid(p)) is not None)), minor, name)

    def check_dump_room(self, inv: Inventory, gpu_uuid: str, work_dir: Path) -> None:
        from ..checkpoint import gpu
        from ..host.resources import mem_available

        used, how = gpu.tree_gpu_bytes(inv.pids, gpu_uuid)
        try:
            ram = mem_available()
        except ValueError:  # a kernel without MemAvailable: no room known
            ram = 0
        st = os.statvfs(work_dir)
        gpu.check_host_room(used, how, ram, st.f_bavail * st.f_frsize, str(work_dir))

    def dump(self, kind: str, opts: DumpOptions, work_dir: Path) -> None:
        from ..checkpoint import criu
        from ..store import layout, locks

        runner = self.criu.runner(kind)
        try:
            runner.real_ids = criu.dump_real_ids(Path(f"/proc/{opts.pid}/status").read_text(),
                                                 Path("/proc/self/status").read_text())
        except (OSError, ValueError):
            pass  # the tree is gone: CRIU says so
        if kind == "cuda":  # again right before CRIU: the engine ran for minutes since create began
            self.criu.cuda_preflight(runner.env)
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

    def put_back_remaps(self, snapshot: Path, m: Manifest) -> list[Path]:
        from ..store import layout
        from ..checkpoint import remaps

        return remaps.put_back(layout.SnapshotDir(snapshot).files, [f.name for f in m.extra_files])

    def carry_files(self, files: tuple, model_dir: Path, model_files: tuple[ModelFile, ...], sys_path: list[str],
                    work_dir: Path, also: tuple[str, ...] = ()) -> tuple[tuple[CarriedFile, ...], tuple[CarriedDir, ...]]:
        from ..checkpoint import carry
        from ..store import layout

        model = [str(model_dir), os.path.realpath(model_dir), *also]
        model += [os.path.realpath(model_dir / f.path) for f in model_files]
        env = carry.python_prefixes([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix], sys_path)
        return carry.collect(carry.select(files, model, env), work_dir / layout.CARRIED)

    def put_back_carried(self, snapshot: Path, m: Manifest) -> list[str]:
        from ..checkpoint import carry
        from ..store import layout

        if m.carried is None or not m.carried.files:
            return []
        plan = carry.plan(m.carried)
        err = carry.refusal(plan)
        if err is not None:
            raise err
        return carry.put_back(m.carried, layout.SnapshotDir(snapshot).carried, plan.place)

    def criu_lock(self) -> AbstractContextManager:
        from ..store import locks

        return locks.criu_lock()

    def gpu_lock(self, uuid: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from ..store import locks

        return locks.gpu_lock(uuid, on_wait)

    def check_gpu_capacity(self, m: Manifest, uuid: str) -> None:
        from ..checkpoint import gpu

        if m.engine.kind != "cuda":
            return
        total, free, _used = gpu.memory(uuid)
        need = gpu.required_restore_bytes(m.engine.engine_args, total, m.key.normalized_args if m.key else None)
        gpu.check_free_memory(need, free, gpu=uuid)

    def restore_tree(self, kind: str, opts: RestoreOptions, stage: Path,
                     before_memory: Callable[[], None] | None = None, cuda_pids: tuple[int, ...] = (),
                     gpu_map: tuple[tuple[str, str], ...] = ()) -> int:
        from ..checkpoint import criu, cuda_checkpoint
        from ..checkpoint import gpu
        from ..store import layout
        from ..host.procs import kill_restored_children, ns_pid, tree

        runner = self.criu.runner(kind)
        if kind == "cuda" and gpu_map:  # CRIU 4.2.1's plugin passes no map: our helper reads it from CRIU's env
            runner.env = {**runner.env, cuda_checkpoint.DEVICE_MAP_ENV: cuda_checkpoint.format_device_map(gpu_map)}
        if kind == "cuda":  # as at dump: a helper that cannot reach the driver (or remap) fails here, not after CRIU
            self.criu.cuda_preflight(runner.env, remap=bool(gpu_map))
        from ..paths import ENGINE_TMPDIR

        # the engine's private TMPDIR tmpfs is mounted there: CRIU needs the mount point, which
        # create made on the host's disk -- gone in a container restored from a fresh image
        # (its /var/tmp is the image's), or after a tmp cleaner removed the empty directory
        os.makedirs(ENGINE_TMPDIR, mode=0o700, exist_ok=True)
        pid = runner.restore(opts, stage, stage, before_memory)
        if kind == "cuda":
            try:
                criu.check_cuda_run(stage / layout.RESTORE_LOG, "restore")
                pids, helper = [p.pid for p in tree(pid)], self.criu.helper(runner.env)
                if cuda_pids:  # only the recorded CUDA processes: one driver attach each
                    wanted = set(cuda_pids)
                    states = gpu.restored_states([p for p in pids if ns_pid(p) in wanted], helper, recorded=True)
                    gpu.check_restored(states, expected=len(wanted))
                else:
                    gpu.check_restored(gpu.restored_states(pids, helper))
            except BaseException:
                kill_restored_children()
                raise
        return pid

    def tree_commands(self, pid: int) -> tuple[str, ...]:
        from ..host.procs import command, tree

        return tuple(command(p) for p in tree(pid))

    def tree_creds(self, root_pid: int) -> dict[int, Creds]:
        from ..host import privilege
        from ..host.procs import tree

        return privilege.tree_creds(p.pid for p in tree(root_pid))


def _chown_root(top: Path) -> None:
    """``chown -R 0:0 top`` without following links (files a CRIU run as the engine user wrote)."""
    for d, dirs, files in os.walk(top):
        for n in [*dirs, *files]:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if st.st_uid != 0 or st.st_gid != 0:
                os.lchown(p, 0, 0)
