"""The embedded tiny model: a random-weight Llama generated deterministically, offline.

Shape (chosen so vLLM's CPU attention accepts it: head size 64): hidden 128, 2 layers,
2 attention heads of head_dim 64, 1 KV head, a ~300-token byte-level BPE vocabulary trained with
``tokenizers`` on a fixed text, weights from ``torch.manual_seed(0)``. On disk ~0.5 MB
(safetensors, float32). Greedy decoding on it is deterministic, which is all the oracle needs.

Run ``python -m vllm_snapshot.dev.tiny_model --out DIR``; an existing complete model (matching
``GENERATOR_VERSION``) is kept as is. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GENERATOR_VERSION = "1"
STAMP = ".vllm-snapshot-tiny-model"
SERVED_NAME = "tiny-llama"
#: Engine args for the tiny model on CPU (the demo's, the benchmarks' default): float32, a 64 MiB
#: KV cache (without an explicit size vLLM's CPU backend reserves --gpu-memory-utilization of
#: host RAM, and every byte of it lands in the snapshot), served as :data:`SERVED_NAME`.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
               "--served-model-name", SERVED_NAME]

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "Snapshots let an inference engine start in seconds instead of minutes. "
    "A process tree is checkpointed with CRIU and restored later, safely. "
    "Once upon a time there was a small model that answered every prompt with one token. "
    "Hello world, hello engine, hello restore. 0123456789 "
) * 8


def default_model_dir() -> Path:
    """Where setup puts the tiny model: ``$VLLM_SNAPSHOT_CACHE/models/tiny-llama``.

    The cache defaults to ``/var/cache/vllm-snapshot`` (as in scripts/setup.sh).
    """
    from ..paths import model_store

    return model_store() / SERVED_NAME


def generate(out: Path, hidden: int = 128, layers: int = 2, heads: int = 2, intermediate: int | None = None) -> Path:
    """Write a random-weight Llama (default: the tiny model) to ``out`` atomically (temp
    sibling, then rename) and return it. ``hidden`` = heads x 64 (vLLM's CPU attention head
    size); ``intermediate`` defaults to 2 x hidden (256 for the tiny model), one KV head.
    Weights are float32: about 4 x layers x (2 x hidden^2 + 3 x hidden x intermediate) bytes;
    benchmarks use ``hidden=2048, layers=16, heads=32, intermediate=7168`` (3.1 GiB, the big model of docs/benchmarks.md).
    Raises OSError when ``out``'s parent cannot be written. Imports torch/transformers/tokenizers."""
    intermediate = intermediate or 2 * hidden
    stamp = GENERATOR_VERSION if (hidden, layers, heads, intermediate) == (128, 2, 2, 256) else \
        f"{GENERATOR_VERSION} hidden={hidden} layers={layers} heads={heads} intermediate={intermediate}"
    try:
        if (out / STAMP).read_text().strip() == stamp:
            return out
    except OSError:
        pass
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            min_frequency=1,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([_CORPUS], trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        fast.model_max_length = 512
        fast.save_pretrained(tmp)

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=512,
            bos_token_id=tok.token_to_id("<s>"),
            eos_token_id=tok.token_to_id("</s>"),
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / STAMP).write_text(stamp + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def publish_dir(tmp: Path, out: Path) -> None:
    """Make the finished model directory ``tmp`` readable by every user (the engine runs as its
    own user) and put it at ``out`` by renames: an existing ``out`` is moved aside first and
    removed after, so ``out`` is never half-written or missing for longer than between two
    renames. ``tmp`` and ``out`` share a parent. Raises OSError."""
    for p in tmp.iterdir():
        os.chmod(p, 0o644)
    os.chmod(tmp, 0o755)
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.rename(out, old / "model")  # out is free for the rename below; the old one goes after
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default_model_dir())
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (= heads x 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2 x hidden)")
    args = ap.parse_args(argv)
    path = generate(args.out, hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                    intermediate=args.intermediate)
    print(json.dumps({"model": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
