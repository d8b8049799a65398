#!/usr/bin/env python3
"""Part E of scripts/gpu_check.sh: the weights file's GPU half, with the product's own functions
(vllm_snapshot/engine/weights.py) on real device tensors -- what a GPU engine made with
``--weights file`` does at create and at every level-2 wake, without vLLM (the lent GPU machine
has none):

1. create: :func:`wake_plan` over a model's parameters on the device, and :func:`_write_all`
   writes them into a file through bounded host copies (``CHUNK``);
2. the level-2 sleep leaves every parameter's storage at its address with undefined contents
   (here: NaN written over them, as the fake driver cannot give back undefined memory);
3. the wake: :func:`fill_in_place` copies the file's bytes back into the very storages.

Then the model's output must equal the one before, every ``data_ptr`` must be unchanged (CUDA
graphs and kernels captured those addresses), and the write and fill rates are printed. Prints
``RESULT STATUS NAME: DETAIL`` lines (scripts/gpu_check.sh's results_of); exit 0 when it ran
(whatever the results), 2 on bad arguments. ``--device cpu`` runs the same steps on CPU tensors
(the test suite's check of this script; a GPU's result needs ``cuda``).

    python scripts/gpu_check_weights.py --out DIR [--mib 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def result(status: str, name: str, detail: str = "") -> None:
    """Print one RESULT line (``name`` holds no ": ")."""
    print(f"RESULT {status} {name}" + (f": {detail}" if detail else ""), flush=True)


def model_of(mib: int, device: str):
    """A stack of square float32 linear layers of about ``mib`` MiB on ``device``, with a tied
    projection (one storage, two names), small norms and a buffer (not in the wake's file)."""
    import torch

    width = 1024
    layers = max(1, (mib << 20) // (width * width * 4))
    g = torch.Generator().manual_seed(0)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
            self.head = torch.nn.Linear(width, width, bias=False)
            self.head.weight = self.layers[0].weight
            self.register_buffer("scale", torch.full((width,), 0.5))
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)

        def forward(self, x):
            for lin, norm in zip(self.layers, self.norms):
                x = norm(torch.relu(lin(x))) * self.scale
            return self.head(x)

    return Stack().to(device)


def run(out: Path, mib: int, device: str) -> None:
    """Steps 1-3 of the module doc on ``device``; RESULT lines. Raises nothing it can report."""
    import torch

    from vllm_snapshot.engine import weights as ew

    if device == "cuda" and not torch.cuda.is_available():
        result("INFO", "E weights file on the GPU", "not run: torch sees no CUDA device")
        return
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = model_of(mib, device)
    x = torch.randn(8, 1024, device=device)
    with torch.no_grad():
        want = model(x)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    entries, stays, storages = ew.wake_plan(model, device)
    size = entries[-1]["offset"] + entries[-1]["nbytes"]
    path = out / "gpu_check_weights.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        sync()
        t0 = time.monotonic()
        ew._write_all(fd, entries, storages)
        wrote = time.monotonic() - t0
        del storages
        total = sum(e["nbytes"] for e in entries)
        result("PASS", "E weights file written from the device",
               f"{len(entries)} storages, {total >> 20} MiB in {wrote:.2f} s ({total / max(wrote, 1e-9) / 1e9:.2f} GB/s), "
               f"{len(stays)} stay")
        with torch.no_grad():  # what a level-2 sleep leaves: the storages, not their bytes
            for p in model.parameters():
                p.fill_(float("nan"))
            if not torch.isnan(model(x)).all():
                result("FAIL", "E parameters emptied as a level-2 sleep leaves them", "the output is not NaN")
                return
        sync()
        t0 = time.monotonic()
        n = ew.fill_in_place(model, entries, fd)
        sync()
        filled = time.monotonic() - t0
        with torch.no_grad():
            got = model(x)
        same = bool(torch.equal(got, want))
        kept = {k: p.data_ptr() for k, p in model.named_parameters()} == ptrs
        detail = (f"{n >> 20} MiB in {filled:.2f} s ({n / max(filled, 1e-9) / 1e9:.2f} GB/s) on {device}; "
                  f"same output: {same}; same data_ptrs: {kept}")
        result("PASS" if same and kept and n == total else "FAIL", "E wake filled from the weights file", detail)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args()
    try:
        run(a.out, a.mib, a.device)
    except Exception as e:  # noqa: BLE001 - a result line, not a traceback, is what the verdict reads
        import traceback

        traceback.print_exc()
        result("FAIL", "E weights file on the GPU", f"{type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
