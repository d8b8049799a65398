"""The fleet role's local class: :class:`LocalFleetTools`, the real
:class:`~vllm_snapshot.effects.protocols.FleetTools` (registries and ``oci:`` layouts, a pull's
partial dir, the shared weights files, publishing a pulled snapshot)."""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path

from ..errors import CorruptSnapshotError
from ..fleet import reference
from ..fleet.tools import PULLED
from ..fleet.transport import Target
from ..report.results import PartialPull
from .protocols import FleetTools


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` (0600, must not exist), flushed to disk. Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFleetTools(FleetTools):
    """The real :class:`FleetTools`."""

    def open_target(self, ref: reference.Ref, plain_http: bool, create: bool) -> Target:
        from ..fleet.transport import open_target

        return open_target(ref, plain_http, create)

    def snapshot_config(self, snapshot: Path) -> bytes:
        from ..store import layout

        return (Path(snapshot) / layout.MANIFEST).read_bytes()

    def check_pulled(self, staging: Path, m, assembled=None) -> None:
        import blake3

        from ..store import archive, checksums, layout

        sd = layout.SnapshotDir(staging)
        archive.check_layout(sd.images, m.images)
        archive.check_layout(sd.files, m.extra_files)
        if m.carried is not None:  # the files restore puts back on this node (checkpoint/carry.py)
            archive.check_layout(sd.carried, m.carried.blobs)
        done = assembled.finish() if assembled is not None else set()

        def rest(d: Path, images):
            return tuple(i for i in images if d / archive.stored_name(i) not in done)

        checksums.verify(sd.images, rest(sd.images, m.images))
        checksums.verify(sd.files, rest(sd.files, m.extra_files))
        if m.carried is not None:
            checksums.verify(sd.carried, rest(sd.carried, m.carried.blobs))
        if m.code is not None:
            try:
                table = (staging / layout.CODE_TABLE).read_bytes()
            except FileNotFoundError:
                raise CorruptSnapshotError(f"the artifact lacks {layout.CODE_TABLE}, which its manifest pins") from None
            if blake3.blake3(table).hexdigest() != m.code.table_digest:
                raise CorruptSnapshotError(f"the artifact's {layout.CODE_TABLE} does not match its digest in the manifest")

    def partial_pulls(self, root: Path) -> list[PartialPull]:
        import dataclasses

        from ..fleet import partial

        return [PartialPull(**dataclasses.asdict(x)) for x in partial.kept(root)]

    def pull_staging(self, dest: Path, digest: str) -> AbstractContextManager:
        import contextlib
        import shutil

        from ..store import store
        from ..fleet import partial

        @contextlib.contextmanager
        def cm():
            temps = [str(p) for p in store.clean_stale_temps(Path(dest).parent)]  # killed pulls of old versions
            with partial.staging(dest, digest, store.prepare_target,
                                 lambda p: shutil.rmtree(p, ignore_errors=True)) as st:
                st.removed[:0] = temps
                yield st

        return cm()

    def weights_problem(self, path: Path) -> str | None:
        from ..fleet import weights

        return weights.destination_problem(path)

    def weights_present(self, path: Path, blake3: str, size: int) -> bool:
        from ..fleet import weights

        return weights.present(path, blake3, size)

    def weights_staging(self, final: Path, blake3: str, where: str) -> AbstractContextManager:
        from ..fleet import weights

        return weights.staging(final, blake3, where)

    def publish_pulled(self, staging: Path, target: Path, config: bytes, provenance: dict) -> None:
        from ..store import layout, store
        from ..fleet import partial

        partial.finish(staging)
        _write_private(staging / PULLED, json.dumps(provenance, indent=2, sort_keys=True).encode() + b"\n")
        _write_private(staging / layout.MANIFEST, config)
        store.publish(staging, target)
