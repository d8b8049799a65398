"""The embedded tiny model: a random-weight Llama generated deterministically, offline.

Shape (chosen so vLLM's CPU attention accepts it, see design notes): hidden 128, 2 layers,
2 attention heads of head_dim 64, 1 KV head, a ~300-token byte-level BPE vocabulary trained with
``tokenizers`` on a fixed text, weights from ``torch.manual_seed(0)``. On disk ~0.5 MB
(safetensors, float32). Greedy decoding on it is deterministic, which is all the oracle needs.

Run ``python -m vllm_snapshot.tiny_model --out DIR``; an existing complete model (matching
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
    from .paths import cache_dir

    cache = cache_dir()
    return cache / "models" / SERVED_NAME


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a tiny model written by this generator version."""
    try:
        return (path / STAMP).read_text().strip() == GENERATOR_VERSION
    except OSError:
        return False


def generate(out: Path) -> Path:
    """Write the tiny model to ``out`` atomically (temp sibling, then rename) and return it.

    Raises OSError when ``out``'s parent cannot be written. Imports torch/transformers/tokenizers.
    """
    if is_complete(out):
        return out
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
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
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
        (tmp / STAMP).write_text(GENERATOR_VERSION + "\n")
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default_model_dir())
    args = ap.parse_args(argv)
    path = generate(args.out)
    print(json.dumps({"model": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
