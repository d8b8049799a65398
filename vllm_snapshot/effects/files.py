"""Snapshot directories: :class:`LocalSnapshotFiles`, :class:`~vllm_snapshot.effects.protocols.SnapshotFiles`
over :mod:`vllm_snapshot.store` (layout, manifest, archive) and the code table of
:mod:`vllm_snapshot.host.codeid`."""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint.carry import Plan as CarryPlan
from ..store.manifest import CodeIdentity, ImageFile, Manifest
from .protocols import SnapshotFiles
from .handles import StagedImages


class LocalSnapshotFiles(SnapshotFiles):
    """:class:`SnapshotFiles` over snapshot directories on this host (:mod:`vllm_snapshot.store`)."""

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

    def open_snapshot(self, snapshot: Path) -> Manifest:
        from ..store import archive, layout, manifest

        sd = layout.open_trusted(snapshot)
        m = manifest.read(sd.path)
        archive.check_layout(sd.images, m.images)
        archive.check_layout(sd.files, m.extra_files)
        if m.carried is not None:
            archive.check_layout(sd.carried, m.carried.blobs)
        return m

    def pulled_from(self, snapshot: Path) -> dict | None:
        from ..fleet.tools import read_pulled

        return read_pulled(snapshot)

    def verify_images(self, snapshot: Path, m: Manifest) -> None:
        from ..store import checksums, layout

        sd = layout.SnapshotDir(snapshot)
        checksums.verify(sd.images, m.images)
        checksums.verify(sd.files, m.extra_files)
        if m.carried is not None:
            from ..checkpoint import carry

            carry.verify(m.carried, sd.carried)

    def check_weights(self, m: Manifest, full: bool = False) -> None:
        from ..store import weights

        if m.weights is not None:
            weights.refuse(m.weights, full)

    def check_weights_dir(self, root: Path) -> None:
        from ..store import weights

        problem = weights.dir_problem(weights.directory(root))
        if problem is not None:
            raise problem

    def check_tree_files(self, m: Manifest) -> list[str]:
        from ..checkpoint import inventory

        carried = {f.path for f in m.carried.files} if m.carried is not None else set()
        if m.weights is not None:  # checked by check_weights, content included
            carried.add(m.weights.path)
        return inventory.check_files([f for f in m.criu.tree_files if f.path not in carried])

    def plan_carried(self, snapshot: Path, m: Manifest) -> CarryPlan:
        from ..checkpoint import carry
        from ..store import layout

        if m.carried is None:
            return carry.Plan()
        carry.verify(m.carried, layout.SnapshotDir(snapshot).carried)
        return carry.plan(m.carried)

    def pin_code(self, modules: list[str], sys_path: list[str], work_dir: Path) -> CodeIdentity:
        from ..host import codeid
        from ..store import layout

        pinned = codeid.record(modules, sys_path)
        fd = os.open(work_dir / layout.CODE_TABLE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pinned.table)
        return CodeIdentity(table_digest=pinned.digest, files=pinned.files, distributions=pinned.distributions)

    def check_code(self, snapshot: Path, m: Manifest) -> list[str]:
        from ..host import codeid
        from ..store import layout

        if m.code is None:
            return []
        return codeid.check_pinned(snapshot / layout.CODE_TABLE, m.code.table_digest, m.code.files)

    def caps_missing(self, snapshot: Path, m: Manifest) -> list[int]:
        from ..checkpoint import criu
        from ..store import layout

        return criu.caps_missing(snapshot / layout.IMAGES, m, Path("/proc/self/status").read_text())

    def pack(self, directory: Path, compression: str) -> tuple[ImageFile, ...]:
        from ..store import archive

        return archive.pack(directory, archive.Compression.parse(compression))

    def stage_checking(self, snapshot: Path, m: Manifest) -> tuple[Path, StagedImages]:
        from ..store import archive, checksums, layout

        sd = layout.SnapshotDir(snapshot)
        raw = sum(i.raw_bytes for i in m.images)
        parent = archive.staging_parent(raw, snapshot.parent, m.images)
        checksums.verify(sd.files, m.extra_files)
        if any(i.compression != "none" for i in m.images):
            return archive.start_unpack(sd.images, m.images, parent)
        stage = archive.link_stage(sd.images, m.images, parent)
        try:
            return stage, checksums.Checking(sd.images, m.images)
        except BaseException:
            archive.remove_staging(stage)
            raise

    def unstage(self, stage: Path) -> None:
        from ..store import archive

        archive.remove_staging(stage)

    def unstage_all(self, near: Path) -> None:
        from ..store import archive

        for d in archive.own_staging(archive.staging_parents(near)):
            archive.remove_staging(d)
