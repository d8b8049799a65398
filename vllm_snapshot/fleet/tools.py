"""The fleet's role in the tools seam: :class:`FleetTools` (the side effects push/pull need
beyond the other roles') and :class:`LocalFleetTools`, its real implementation: the ``fleet``
role of :class:`vllm_snapshot.effects.tools.Tools`."""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from ..errors import CorruptSnapshotError
from . import reference
from .transport import Target

from ..store.layout import PULLED  # noqa: F401 - the record a pull leaves (manifest.json stays as pushed)


class FleetTools(Protocol):
    """Side effects of ``push``/``pull``/``inspect IMAGE``."""

    def open_target(self, ref: reference.Ref, plain_http: bool, create: bool) -> Target:
        """The registry repository or image layout of ``ref`` (:func:`.transport.open_target`).
        Raises UsageError (``--plain-http`` to a host that is not loopback; not a layout)."""

    def snapshot_config(self, snapshot: Path) -> bytes:
        """The bytes of ``snapshot/manifest.json`` (the artifact's config, pushed byte for byte)."""

    def check_pulled(self, staging: Path, m) -> None:
        """The snapshot's own checks over a downloaded staging dir: member layout (stat),
        every image and saved file's BLAKE3, the code table's digest. Raises
        CorruptSnapshotError naming the file."""

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


def read_pulled(snapshot: Path) -> dict | None:
    """``snapshot/pulled.json`` as a dict, None when absent. Raises CorruptSnapshotError."""
    try:
        raw = (Path(snapshot) / PULLED).read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptSnapshotError(f"{snapshot}/{PULLED} is not JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("image"), str):
        raise CorruptSnapshotError(f"{snapshot}/{PULLED} is not a pull record")
    return doc


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFleetTools(FleetTools):
    """The real :class:`FleetTools`."""

    def open_target(self, ref: reference.Ref, plain_http: bool, create: bool) -> Target:
        from .transport import open_target

        return open_target(ref, plain_http, create)

    def snapshot_config(self, snapshot: Path) -> bytes:
        from ..store import layout

        return (Path(snapshot) / layout.MANIFEST).read_bytes()

    def check_pulled(self, staging: Path, m) -> None:
        import blake3

        from ..store import archive, layout

        sd = layout.SnapshotDir(staging)
        archive.check_layout(sd.images, m.images)
        archive.check_layout(sd.files, m.extra_files)
        archive.verify(sd.images, m.images)
        archive.verify(sd.files, m.extra_files)
        if m.carried is not None:  # the files restore puts back on this node (checkpoint/carry.py)
            archive.check_layout(sd.carried, m.carried.blobs)
            archive.verify(sd.carried, m.carried.blobs)
        if m.code is not None:
            try:
                table = (staging / layout.CODE_TABLE).read_bytes()
            except FileNotFoundError:
                raise CorruptSnapshotError(f"the artifact lacks {layout.CODE_TABLE}, which its manifest pins") from None
            if blake3.blake3(table).hexdigest() != m.code.table_digest:
                raise CorruptSnapshotError(f"the artifact's {layout.CODE_TABLE} does not match its digest in the manifest")

    def pull_staging(self, dest: Path, digest: str) -> AbstractContextManager:
        import contextlib
        import shutil

        from ..store import store
        from . import partial

        @contextlib.contextmanager
        def cm():
            temps = [str(p) for p in store.clean_stale_temps(Path(dest).parent)]  # killed pulls of old versions
            with partial.staging(dest, digest, store.prepare_target,
                                 lambda p: shutil.rmtree(p, ignore_errors=True)) as st:
                st.removed[:0] = temps
                yield st

        return cm()

    def weights_problem(self, path: Path) -> str | None:
        from . import weights

        return weights.destination_problem(path)

    def weights_present(self, path: Path, blake3: str, size: int) -> bool:
        from . import weights

        return weights.present(path, blake3, size)

    def weights_staging(self, final: Path, blake3: str, where: str) -> AbstractContextManager:
        from . import weights

        return weights.staging(final, blake3, where)

    def publish_pulled(self, staging: Path, target: Path, config: bytes, provenance: dict) -> None:
        from ..store import layout, store
        from . import partial

        partial.finish(staging)
        _write_private(staging / PULLED, json.dumps(provenance, indent=2, sort_keys=True).encode() + b"\n")
        _write_private(staging / layout.MANIFEST, config)
        store.publish(staging, target)
