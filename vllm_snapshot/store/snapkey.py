"""The snapshot **key**: one digest of everything that determines a snapshot's engine state, so
``serve MODEL [engine args]`` can find the snapshot made for exactly this model, these args and
this host, or know that none exists.

The key is BLAKE3 over four parts (each itself a BLAKE3 hex digest, kept in the manifest so a
mismatch can say *which* part differs):

* ``model``  -- the model's content: every file's relative path, size and full-content BLAKE3
  (the same digests the manifest records for restore's model check);
* ``engine`` -- the engine args **normalized by vLLM's own parser** (every option whose parsed
  value differs from the parser's default, so ``--dtype=float32`` and ``--dtype float32``, or
  ``64M`` and ``67108864``, give one key), the requested model string (it is the served name
  unless ``--served-model-name``), the oracle prompt and the requested sleep level;
* ``env``    -- the variables of the engine's scrubbed environment that vLLM, torch, the
  math libraries and the dynamic loader read (``VLLM_*``, ``OMP_*``, ``CUDA_*``, ``NVIDIA_*``,
  ``LD_LIBRARY_PATH``, …), values hashed;
* ``host``   -- the host-*class* identity fields restore compares (:func:`vllm_snapshot.host.identity.collect`,
  plus the GPU fields on CUDA hosts; not the machine id: nodes of one class share keys, which
  ``serve --registry`` uses as tags).

Importing vLLM's parser costs ~16 s on a 2-core host (measured: ``python -c 'from
vllm.entrypoints.launchers.cli_args import make_arg_parser'``), longer than a restore. So the
engine (which parses its args anyway) reports the normalized args at create, the manifest keeps
them with a digest of the raw args (``raw_args``), and ``serve`` reuses a manifest's normalized
args when its raw args, model string and vLLM version are the same (:func:`raw_args_digest`, looked up by ``ops.serve``); only
args never seen before are parsed in the CLI process.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

import blake3

#: Environment prefixes whose values change what the engine computes or allocates.
ENV_PREFIXES = ("VLLM_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_", "NCCL_", "CUDA_", "OPENBLAS_", "GLOO_",
                "NVIDIA_")
#: Single variables of the key: which driver (and other libraries) the engine loads.
ENV_EXACT = frozenset({"LD_LIBRARY_PATH"})
#: vllm-snapshot's own settings (``VLLM_SNAPSHOT``, ``VLLM_SNAPSHOT_ROOT``, ``_CACHE``, …): where
#: things live, never what the engine computes -- not part of the key.
ENV_IGNORED_PREFIX = "VLLM_SNAPSHOT"
#: Parsed ``vllm serve`` destinations that never change the engine's state.
ARGS_IGNORED = frozenset({"model", "model_tag", "dispatch_function", "subparser", "config"})


def _h(obj) -> str:
    return blake3.blake3(json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                    default=repr).encode()).hexdigest()


def normalize_namespace(got: Mapping[str, object], defaults: Mapping[str, object]) -> dict[str, str]:
    """The options of a parsed ``vllm serve`` namespace whose value differs from the parser's
    default: ``{dest: JSON text of the value}``, sorted. Secret-looking destinations
    (``hf_token``) keep only a digest of their value. Pure."""
    from ..host.envpolicy import is_secret_name

    out = {}
    for k in sorted(got):
        if k in ARGS_IGNORED or got[k] == defaults.get(k, object()):
            continue
        text = json.dumps(got[k], sort_keys=True, default=repr)
        out[k] = "blake3:" + blake3.blake3(text.encode()).hexdigest() if is_secret_name(k) else text
    return out


def normalize_args(engine_args: list[str]) -> dict[str, str]:
    """Normalize ``vllm serve`` engine args with vLLM's own parser (imports vLLM: ~16 s on a
    small host). ``os.environ`` is as it was before: importing vLLM sets variables there
    (TORCHINDUCTOR_CACHE_DIR=/tmp/..., LD_LIBRARY_PATH, PYTORCH_NVML_BASED_CUDA_CHECK, ...) that
    would reach the engine's environment and the key's env part of a create in this process.
    Raises SystemExit (argparse) on args vLLM rejects."""
    import os

    saved = dict(os.environ)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-snapshot serve MODEL"))
        from . import argnames

        argnames.remember(argnames.parser_options(parser))  # the next typo is answered without vLLM
        got = vars(parser.parse_args(["--model", "MODEL", *engine_args]))
        base = vars(parser.parse_args(["--model", "MODEL"]))
        return normalize_namespace(got, base)
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def raw_args_digest(requested_model: str, engine_args: Iterable[str], vllm_version: str) -> str:
    """Digest of the args exactly as given (the memo's key: same text, same vLLM -> same
    normalized args). Pure."""
    return _h({"model": requested_model, "args": list(engine_args), "vllm": vllm_version})


def memoizable(engine_args: Iterable[str]) -> bool:
    """False when the args name a file whose content the parse depends on (``--config``): those
    are normalized afresh every time. Pure."""
    from ..engine.args import has_flag

    return not has_flag(engine_args, "--config")


def model_part(files) -> str:
    """Digest of a model's content from its ModelFile records (path, size, BLAKE3), without
    the files that cannot change the engine (:func:`vllm_snapshot.store.model_digest.ignored`:
    manifests made before that policy recorded them). Pure."""
    from .model_digest import ignored

    return _h(sorted((f.path, f.size, f.blake3) for f in files if not ignored(f.path)))


def engine_part(requested_model: str, normalized: Mapping[str, str], oracle_prompt: str, sleep_level: int,
                weights: str = "in-image") -> str:
    """Digest of what is asked of the engine. ``weights``: ``in-image`` (the weights in the
    CRIU images: the digest is the one of snapshots made before weights files existed) or
    ``file`` (a CPU engine mapping a weights file, :mod:`vllm_snapshot.store.weights`: its
    linear layers compute without vLLM's prepacked copies). Pure."""
    d = {"model": requested_model, "args": dict(normalized), "oracle_prompt": oracle_prompt,
         "sleep_level": int(sleep_level)}
    if weights != "in-image":
        d["weights"] = weights
    return _h(d)


def _env_values(env: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    keep = set(keep)
    return {k: blake3.blake3(v.encode()).hexdigest() for k, v in sorted(env.items())
            if k in keep or k in ENV_EXACT or (k.startswith(ENV_PREFIXES) and not k.startswith(ENV_IGNORED_PREFIX))}


def env_part(env: Mapping[str, str], keep: Iterable[str] = ()) -> str:
    """Digest of the engine environment's state-changing variables (see :data:`ENV_PREFIXES`,
    :data:`ENV_EXACT`) and of every variable passed on purpose (``--keep-env``). Pure."""
    return _h(_env_values(env, keep))


def env_record(env: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    """The variables of :func:`env_part`, ``{name: BLAKE3 hex of the value}`` -- ``"secret"``
    for a secret-looking name (a token kept with ``--keep-env``: not even its digest is
    written) -- for the manifest, so a mismatch names them (:func:`env_differences`). Pure."""
    from ..host.envpolicy import is_secret_name

    return {k: ("secret" if is_secret_name(k) else v) for k, v in _env_values(env, keep).items()}


def env_differences(was: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``["VLLM_X changed", "LD_LIBRARY_PATH added", ...]``: the variables that differ between
    two :func:`env_record` dicts (a secret's change cannot be seen: its name is kept, not its
    digest). Pure."""
    out = []
    for k in sorted(set(was) | set(now)):
        if k not in was:
            out.append(f"{k} set now")
        elif k not in now:
            out.append(f"{k} no longer set")
        elif was[k] != now[k]:
            out.append(f"{k} changed")
    return out


def host_part(host: Mapping[str, str]) -> str:
    """Digest of the host-*class* identity fields (the GPU the tree used,
    :data:`vllm_snapshot.host.identity.GPU_USED_FIELDS`, is a fact of the dump, not of the host,
    and is left out, as are the other fields restore does not compare,
    :data:`vllm_snapshot.host.identity.NOT_COMPARED`, and the ones that pin one machine,
    :data:`~vllm_snapshot.host.identity.MACHINE_FIELDS`: every node of a class computes the
    same key, which ``serve --registry`` uses as the tag). Pure."""
    from ..host.identity import MACHINE_FIELDS, NOT_COMPARED

    return _h({k: v for k, v in host.items()
               if k != "gpu_uuid_used" and k not in NOT_COMPARED and k not in MACHINE_FIELDS})


PARTS = ("model", "engine", "env", "host")


def parts_of(m) -> dict[str, str]:
    """The key parts of the manifest ``m`` (which has a key) as this version computes them:
    ``model`` and ``host`` again from the manifest's own records (the model files' policy and
    the host fields compared may have changed since it was made: a snapshot must not need a
    rebuild for that), ``engine`` and ``env`` as recorded. Pure."""
    return {**m.key.parts, "model": model_part(m.model.files), "host": host_part(m.host)}


def key_of(m) -> str:
    """The key of the manifest ``m`` (which has a key) as this version computes it
    (:func:`parts_of`). Pure."""
    return combine(parts_of(m))


def combine(parts: Mapping[str, str]) -> str:
    """The key: BLAKE3 over the four part digests (:data:`PARTS`). Pure."""
    return _h([parts[p] for p in PARTS])


def differing_parts(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """Names of the parts that differ between two part dicts, in :data:`PARTS` order. Pure."""
    return [p for p in PARTS if a.get(p) != b.get(p)]


PART_WORDS = {"model": "the model files", "engine": "the engine args, oracle prompt or sleep level",
              "env": "the engine environment (VLLM_*, OMP_*, CUDA_*, NVIDIA_*, LD_LIBRARY_PATH, …)",
              "host": "this host (driver, kernel, vLLM, torch, CRIU, CPU, …)"}


def build(*, requested_model: str, model_identity: str, engine_args: Iterable[str], normalized: Mapping[str, str],
          model_files, oracle_prompt: str, sleep_level: int, env: Mapping[str, str], host: Mapping[str, str],
          keep_env: Iterable[str] = (), weights: str = "in-image"):
    """The :class:`vllm_snapshot.store.manifest.SnapshotKey` of these inputs. ``model_identity`` is
    what the engine is given as ``--model`` (and serves under without ``--served-model-name``):
    the resolved directory of a local model -- so ``dir/``, ``./dir`` and a symlink to it are
    one key -- or a Hugging Face id as typed; ``requested_model`` (as typed) only keys the
    normalization memo. Pure."""
    from .manifest import SnapshotKey

    parts = {"model": model_part(model_files),
             "engine": engine_part(model_identity, normalized, oracle_prompt, sleep_level, weights),
             "env": env_part(env, keep_env), "host": host_part(host)}
    return SnapshotKey(value=combine(parts), parts=parts,
                       raw_args=raw_args_digest(requested_model, engine_args, host.get("vllm", "")),
                       normalized_args=dict(normalized), env=env_record(env, keep_env))
