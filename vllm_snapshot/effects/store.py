"""The snapshot store: :class:`LocalStoreTools`, :class:`~vllm_snapshot.effects.protocols.StoreTools`
over :mod:`vllm_snapshot.store` (store, locks, reclaim)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

from ..errors import SnapshotError
from .protocols import StoreTools


class LocalStoreTools(StoreTools):
    """:class:`StoreTools` over the snapshot store of this host (:mod:`vllm_snapshot.store`)."""

    def canonical(self, path: Path) -> Path:
        from ..store import store

        return store.canonical(path)

    def snapshot_lock(self, snapshot: Path, shared: bool, must_exist: bool = True) -> AbstractContextManager:
        from ..store import locks

        return locks.snapshot_lock(snapshot, shared=shared, must_exist=must_exist)

    def key_lock(self, key: str, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from ..store import locks

        return locks.key_lock(key, on_wait)

    def port_lock(self, port: int, on_wait: Callable[[str], None]) -> AbstractContextManager:
        from ..store import locks

        return locks.port_lock(port, on_wait)

    def list_snapshots(self, root: Path) -> list[Path]:
        from ..store import store

        return store.list_snapshots(root)

    def without_manifest(self, root: Path) -> list[Path]:
        from ..store import store

        return store.without_manifest(root)

    def root_problem(self, root: Path) -> SnapshotError | None:
        from ..errors import EnvironmentProblem
        from ..store import layout

        if not root.is_dir():
            return None
        try:
            layout.check_parents(root / "x")  # root itself is a parent of what it holds
        except EnvironmentProblem as e:
            return e
        except OSError:
            return None
        return None

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

    def delete_refusal(self, snapshot: Path) -> SnapshotError | None:
        from ..store import store

        return store.delete_refusal(snapshot)

    def weights_blocked(self, root: Path) -> list[str]:
        from ..store import weights

        return weights.blocked(root)

    def remove_unused_weights(self, root: Path, dry_run: bool = False) -> list[Path]:
        from ..checkpoint.carry import holders
        from ..store import weights

        gone = []
        for p in weights.unreferenced(root):
            if holders(str(p)):  # a create in flight (or an engine of a deleted snapshot) maps it
                continue
            if dry_run:
                gone.append(p)
                continue
            weights.remove(p)  # and its node-local pin
            gone.append(p)
        try:  # an empty .weights (a failed first create) goes too: a root then holds only snapshots
            if not dry_run:
                weights.remove_orphan_pins(root)
                weights.directory(root).rmdir()
        except OSError:
            pass
        return gone

    def clean_stale_temps(self, root: Path) -> list[Path]:
        from ..store import locks, store

        from ..store import weights

        locks.clean_stale()  # lock files of snapshot paths that are gone
        temps = weights.stale_temps(root)  # weights files a killed create was writing
        for p in temps:
            p.unlink(missing_ok=True)
        return store.clean_stale_temps(root) + temps

    def reclaim(self, near: Path, dry_run: bool = False) -> list[str]:
        from ..store import reclaim

        return reclaim.reclaim(near, dry_run)

    def record_refusal(self, snapshot: Path, code: str, reason: str, by: str = "serve") -> None:
        from ..store import store

        store.record_refusal(snapshot, code, reason, by)

    def refusal(self, snapshot: Path) -> dict | None:
        from ..store import store

        return store.refusal(snapshot)

    def clear_refusal(self, snapshot: Path, codes: frozenset[str]) -> dict | None:
        from ..store import store

        return store.clear_refusal(snapshot, codes)

    def last_restore(self, snapshot: Path) -> float | None:
        from ..store import store

        return store.last_restore(snapshot)

    def record_restore(self, snapshot: Path, overrides: list[str]) -> None:
        from ..store import store

        store.record_restore(snapshot, overrides)
