"""Model identity: full-content BLAKE3 digest of every file in a model directory, stat pinning.

At create every regular file under the model directory is hashed in full (BLAKE3, multi-
threaded over an mmap) and its size, mtime_ns, ctime_ns, inode and device are kept. At restore
(``quick`` mode) a file whose stat is unchanged is trusted; any stat change triggers a full
re-hash and only a content difference refuses (so ``touch`` alone never refuses). ``full`` mode
re-hashes everything. Around the engine's reading of the files (create's cold start, a
level-2 wake at restore) :func:`stat_pins` and :func:`recheck` make sure the digest still
describes what it read. A metadata-only fingerprint (safetensors headers, first KiB of each
tensor) misses changes past the fingerprinted bytes; hashing every byte cannot.

**One policy for added files, for every command** (restore, verify, ``serve``'s key, switch):
what cannot change the engine is not part of a model's identity (:func:`ignored`: dot-files
and dot-directories such as ``.cache/huggingface`` or ``.git``, ``__pycache__``, docs such as
README, LICENSE, ``*.md``, images); it is neither hashed nor compared, nor part of the key. Any
other file added to the model directory after create refuses (:func:`verify` raises naming it
and its kind): vLLM's loader globs ``*.safetensors``/``*.bin``/``*.pt`` in the model
directory (it filters only when an index file exists; vLLM 0.32 ``default_loader.py``), and
the level-2 wake reloads the weights that way, so an added shard can be loaded by a restored
engine though the snapshot's oracle never saw it; an added config or tokenizer file changes
what a cold start would build. Unknown kinds refuse too (fail closed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import blake3

from ..engine.args import arg_value, has_flag
from ..errors import ModelChangedError, UsageError
from .manifest import ModelFile

SKIP_DIRS = {".git", "__pycache__"}
#: File name stems (before the first dot, any case) of documents: they cannot change the engine.
DOC_STEMS = frozenset({"readme", "license", "licence", "notice", "copying", "changelog", "citation", "authors",
                       "contributing", "use_policy", "model_card"})
#: Suffixes of documents and pictures (a model card's figures): they cannot change the engine.
DOC_SUFFIXES = frozenset({".md", ".rst", ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"})
#: The kinds :func:`kind` names, by suffix or name (vLLM 0.32's loader patterns, HF names).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz",
                    ".index.json")
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template",
                       "spiece", "sentencepiece")
_TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".jinja")


def ignored(rel: str) -> bool:
    """True when the model file at ``rel`` (a path relative to the model directory, ``/``
    separated) cannot change the engine, so it is not part of the model's identity: under a
    dot-directory or ``__pycache__``, a dot-file, or a document (:data:`DOC_STEMS`,
    :data:`DOC_SUFFIXES`). vLLM and transformers read weights, config and tokenizer files by
    name or by glob from the model directory, and ``glob`` skips dot-files. Pure."""
    parts = PurePosixPath(rel).parts
    if not parts or any(p.startswith(".") or p in SKIP_DIRS for p in parts):
        return True
    name = parts[-1].lower()
    return name.split(".", 1)[0] in DOC_STEMS or PurePosixPath(name).suffix in DOC_SUFFIXES


def kind(rel: str) -> str:
    """What the model file at ``rel`` is, in words: ``weights`` (and weight index),
    ``tokenizer``, ``config``, ``code`` (a model's own Python, run with
    ``--trust-remote-code``), or ``file`` (unknown: refused like the others). Pure."""
    name = PurePosixPath(rel).name.lower()
    if name.endswith(_WEIGHT_SUFFIXES):
        return "weights"
    if name.startswith(_TOKENIZER_PREFIXES) or name.endswith(_TOKENIZER_SUFFIXES):
        return "tokenizer"
    if name.endswith((".json", ".yaml", ".yml")):
        return "config"
    if name.endswith(".py"):
        return "code"
    return "file"


def hash_file(path: Path) -> str:
    """BLAKE3 hex digest of a file's full content (multi-threaded). Raises OSError."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size == 0:
        return h.hexdigest()
    h.update_mmap(path)
    return h.hexdigest()


def _walk(root: Path, keep_ignored: bool = False) -> list[Path]:
    """Regular files under ``root``, sorted, without dot-directories and ``__pycache__``, and
    without the other :func:`ignored` files unless ``keep_ignored``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.is_file() and (keep_ignored or not ignored(str(p.relative_to(root)))):
                out.append(p)
    return out


def resolve_model(model: str, revision: str | None = None) -> tuple[Path, str | None]:
    """``(local directory, revision)`` for ``model``: an existing directory (revision None), or
    a Hugging Face id already in the local hub cache at ``revision`` (a branch, tag or commit;
    default the cache's ``main``), looked up offline, never downloaded; the revision returned
    is the commit the cache resolved it to (the ``snapshots/<commit>`` directory name).

    Raises UsageError when neither exists (naming the revision when one was asked for).
    """
    p = Path(model).expanduser()
    if p.is_dir():
        return p.resolve(), None
    if p.exists():
        raise UsageError(f"model {model!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means "not available offline"
        at = f" at revision {revision!r}" if revision else ""
        raise UsageError(
            f"model {model!r}{at} is neither a local directory nor in the local Hugging Face cache",
            hint="pass a local model directory, or a revision the cache holds; vllm-snapshot never downloads models",
        ) from e
    return d.resolve(), d.name


#: engine args with which vLLM does not read the model directory's ``config.json`` as the
#: Hugging Face config (a Mistral-format model's ``params.json``, a config elsewhere)


def check_config(model_dir: Path, engine_args: list[str]) -> None:
    """Refuse, in milliseconds, a model directory whose ``config.json`` vLLM cannot use, instead
    of after a cold start of tens of seconds: present but not UTF-8 JSON, not a JSON object, or
    naming neither ``model_type`` nor ``architectures`` (``{}``). Checks nothing when there is
    no ``config.json`` (a GGUF file, a Mistral-format model) or when ``engine_args`` point vLLM
    at another config (``--config-format`` other than ``auto``/``hf``, ``--hf-config-path``).
    Raises UsageError (exit 2) naming the file, what is wrong and what to do."""
    if has_flag(engine_args, "--hf-config-path"):
        return
    if has_flag(engine_args, "--config-format") and arg_value(engine_args, "--config-format") not in ("auto", "hf"):
        return
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        _check_other_format(model_dir)
        return
    hint = ("check the model folder: config.json must be the model's Hugging Face config (as the model's "
            "publisher ships it, naming its model_type and architectures), beside its weights and tokenizer files")
    try:
        raw = json.loads(cfg.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"the model's {cfg} is not JSON: {e}", hint=hint) from e
    except OSError as e:
        raise UsageError(f"the model's {cfg} cannot be read: {e}", hint=hint) from e
    if not isinstance(raw, dict):
        raise UsageError(f"the model's {cfg} is a JSON {type(raw).__name__}, not an object", hint=hint)
    if not raw.get("model_type") and not raw.get("architectures"):
        raise UsageError(f"the model's {cfg} names neither model_type nor architectures: vLLM cannot tell "
                         "which model it is", hint=hint)


def _check_other_format(model_dir: Path) -> None:
    """A model directory without ``config.json``: refuse it in milliseconds (UsageError) when
    it is empty or holds neither a GGUF file nor Mistral's ``params.json`` -- vLLM would fail
    on it after a cold start of tens of seconds."""
    try:
        names = [n for n in os.listdir(model_dir) if not n.startswith(".")]
    except NotADirectoryError:
        return  # a single file (a .gguf): vLLM's to judge
    except OSError as e:
        raise UsageError(f"the model directory {model_dir} cannot be read: {e}") from e
    hint = ("give the directory of a Hugging Face model (config.json beside its weights and tokenizer files), "
            "e.g. what `huggingface-cli download` put in place")
    if not names:
        raise UsageError(f"the model directory {model_dir} is empty", hint=hint)
    if "params.json" in names or any(n.endswith(".gguf") for n in names):
        return  # Mistral's format, a GGUF model: vLLM reads those without config.json
    raise UsageError(f"the model directory {model_dir} has no config.json (it holds "
                     + ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "") + ")", hint=hint)


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def stat_unchanged(st: os.stat_result, pinned) -> bool:
    """True when ``st`` has the size, mtime, ctime, inode and device ``pinned`` recorded (a
    :class:`ModelFile` or a :class:`~vllm_snapshot.store.manifest.WeightsFile`): its content is
    then trusted without a re-hash. Pure."""
    return _stat_key(st) == pinned_key(pinned)


def pinned_key(pinned) -> tuple[int, int, int, int, int]:
    """The stat a record pinned (size, mtime_ns, ctime_ns, inode, device): what
    :func:`stat_unchanged` compares with ``os.stat``. Pure."""
    return (pinned.size, pinned.mtime_ns, pinned.ctime_ns, pinned.inode, pinned.device)


def digest_dir(root: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
    """Hash every regular file under ``root`` that is not :func:`ignored` (sorted, following
    symlinks as the hub cache uses them). Returns ModelFile entries with paths relative to ``root``. A file whose path
    and full stat (size, mtime_ns, ctime_ns, inode, device) equal one of ``known`` (records
    of earlier digests, e.g. from manifests) takes that record's digest instead of being read
    again -- the rule restore's quick check uses. Raises OSError."""
    by_path = {(f.path, pinned_key(f)): f.blake3 for f in known}
    files = []
    for p in _walk(root):
        st = p.stat()
        rel = str(p.relative_to(root))
        files.append(
            ModelFile(
                path=rel,
                size=st.st_size,
                blake3=by_path.get((rel, _stat_key(st))) or hash_file(p),
                mtime_ns=st.st_mtime_ns,
                ctime_ns=st.st_ctime_ns,
                inode=st.st_ino,
                device=st.st_dev,
            )
        )
    return tuple(files)


@dataclass(frozen=True)
class ModelCheck:
    """Outcome of :func:`verify`: files re-hashed; ``added``: files added since create that
    the policy ignores (:func:`ignored`; outside dot-directories, which are not walked)."""

    rehashed: tuple[str, ...]
    added: tuple[str, ...]


def verify(root: Path, recorded: tuple[ModelFile, ...], mode: Literal["quick", "full"] = "quick") -> ModelCheck:
    """Check ``root`` against ``recorded`` (records of :func:`ignored` files, which snapshots
    made before this policy hold, are not checked).

    Raises ModelChangedError naming every file whose content differs, that is missing, or that
    was added and is not :func:`ignored` (with its :func:`kind`); details: ``{"changed":
    [...], "missing": [...], "added": [...]}``.
    """
    if not root.is_dir():
        raise ModelChangedError(f"the model directory {root} does not exist (moved or deleted after create)",
                                hint="put the model back at that path, or re-create the snapshot",
                                details={"changed": [], "missing": [f.path for f in recorded], "added": []})
    d = compare_pinned(root, tuple(f for f in recorded if not ignored(f.path)), full=mode == "full")
    changed, missing, rehashed = list(d.changed), list(d.missing), list(d.rehashed)
    known = {f.path for f in recorded}
    new = [str(p.relative_to(root)) for p in _walk(root, keep_ignored=True) if str(p.relative_to(root)) not in known]
    added = [n for n in new if not ignored(n)]
    if changed or missing or added:
        parts = _drift_parts(changed, (), missing)
        if added:
            parts.append("added since the snapshot was made: " + ", ".join(f"{n} ({kind(n)})" for n in added))
        hint = "re-create the snapshot from the current model files"
        if added and not (changed or missing):
            hint = (f"move {'it' if len(added) == 1 else 'them'} out of {root} (a cold start or the level-2 wake "
                    "would load added weights, config or tokenizer files), or re-create the snapshot from the model "
                    "as it is now (`vllm-snapshot serve --rebuild ...` or `create`)")
        raise ModelChangedError(
            f"model files under {root} differ from the snapshot's: " + "; ".join(parts),
            hint=hint,
            details={"changed": changed, "missing": missing, "added": added},
        )
    return ModelCheck(tuple(rehashed), tuple(n for n in new if ignored(n)))


# ---------------------------------------------------------------- the window while the engine reads
#
# A digest describes the bytes the engine loaded only if no file changed between the hash and
# the end of the engine's reading: ``create`` hashes before the cold start (~1 min) and dumps
# after it; a level-2 wake at restore reloads the weights from disk after restore checked them.
# :func:`stat_pins` records the stat a check saw, :func:`recheck` compares after the reading:
# a file whose stat changed is re-hashed. A content difference refuses. An equal content
# refuses too when the file's last change (ctime) may have fallen while the engine was reading
# (``since_ns`` onwards): a file changed and put back then holds the hashed bytes again, but the
# engine may have read the other ones -- exactly the change-and-roll-back the digest must not
# miss. An equal content whose last change came before the engine began reading is accepted
# (a ``touch``, or a re-download of the same bytes, before the engine started). ctime cannot
# be set by a user (unlike mtime) and Linux file systems update it on every write, truncate,
# chmod and rename of the inode.

#: A ctime this close to ``since_ns`` counts as made while the engine read: some file systems
#: keep coarse timestamps (ext3: seconds; the kernel's clock for them lags by a tick).
CTIME_SLACK_NS = 1_000_000_000


def stat_pins(root: Path, files: tuple[ModelFile, ...]) -> tuple[ModelFile, ...]:
    """``files`` (each keeping the digest it must have) with the stat each has under ``root``
    now -- take it *before* the check of their content, so that :func:`recheck` later sees
    any change made after it. A file that cannot be stat'ed keeps its recorded stat (the check
    that follows reports it missing). Raises nothing."""
    out = []
    for f in files:
        try:
            st = (root / f.path).stat()
        except OSError:
            out.append(f)
            continue
        out.append(f.model_copy(update={"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                                        "inode": st.st_ino, "device": st.st_dev}))
    return tuple(out)


@dataclass(frozen=True)
class Drift:
    """What :func:`compare_pinned` found, as paths relative to the model dir: ``changed``
    (content differs from the pinned digest), ``rewritten`` (content equal again, but last
    changed while the engine read), ``missing``, and ``rehashed`` (every file whose stat
    differed, so it was read again)."""

    changed: tuple[str, ...] = ()
    rewritten: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    rehashed: tuple[str, ...] = ()

    @property
    def refuses(self) -> bool:
        return bool(self.changed or self.rewritten or self.missing)


def compare_pinned(root: Path, pinned: tuple[ModelFile, ...], since_ns: int | None = None, *,
                   full: bool = False) -> Drift:
    """Compare the files under ``root`` with ``pinned`` (digest + the stat seen when they were
    checked): the one stat-then-rehash loop of :func:`verify` and :func:`recheck`.
    ``since_ns``: the wall-clock time (ns since the epoch, as ``st_ctime_ns``) from which the
    engine may have read them (None: no timing rule, ``rewritten`` stays empty). A file with
    the pinned stat (:func:`pinned_key`) is not read unless ``full``; any other is re-hashed
    (see the section's comment for the rule). Raises OSError for a file that exists but cannot
    be read."""
    changed, rewritten, missing, rehashed = [], [], [], []
    for f in pinned:
        p = root / f.path
        try:
            st = p.stat()
        except FileNotFoundError:
            missing.append(f.path)
            continue
        if not full and stat_unchanged(st, f):
            continue
        rehashed.append(f.path)
        if st.st_size != f.size or hash_file(p) != f.blake3:
            changed.append(f.path)
        elif since_ns is not None and st.st_ctime_ns >= since_ns - CTIME_SLACK_NS:
            rewritten.append(f.path)
    return Drift(tuple(changed), tuple(rewritten), tuple(missing), tuple(rehashed))


def _drift_parts(changed, rewritten, missing) -> list[str]:
    """The drift in words, one part per kind (for the errors of :func:`verify` and :func:`recheck`)."""
    parts = []
    if changed:
        parts.append("content changed: " + ", ".join(changed))
    if rewritten:
        parts.append("changed and put back (the same content again, but its last change came after the engine "
                     "began reading, so what it read is unknown): " + ", ".join(rewritten))
    if missing:
        parts.append("missing: " + ", ".join(missing))
    return parts


def recheck(root: Path, pinned: tuple[ModelFile, ...], since_ns: int, *, during: str, hint: str) -> tuple[str, ...]:
    """:func:`compare_pinned`, refusing any drift. ``during`` says when the files were read
    (e.g. "while the engine loaded them"), ``hint`` what to do; both go into the error.
    Returns the paths re-hashed (stat changed, content and timing fine).

    Raises ModelChangedError (details: ``{"changed", "rewritten", "missing"}``, lists of
    paths) naming every file, or OSError for a file that cannot be read."""
    d = compare_pinned(root, pinned, since_ns)
    if not d.refuses:
        return d.rehashed
    parts = _drift_parts(d.changed, d.rewritten, d.missing)
    raise ModelChangedError(
        f"model files under {root} changed {during}; the digest would not describe the weights the engine "
        "loaded: " + "; ".join(parts),
        hint=hint, details={"changed": list(d.changed), "rewritten": list(d.rewritten), "missing": list(d.missing)})
