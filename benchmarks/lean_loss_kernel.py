"""The lean loss's cross-entropy timed alone: Hugging Face's fp32 upcast + ``cross_entropy``, the row chunks, and the
fused Triton kernels, forward + backward over ``rows x vocab`` logits in bf16.

For each shape and path: the median time of the forward and backward (CUDA events, the host's launches included),
and the memory above the logits at its highest, in the forward and in the backward (what a training step's peak
would carry on top of its saved activations at the loss).

    python benchmarks/lean_loss_kernel.py --shapes 8192x32000 16384x32000 8192x151936 --out $OUT

Prints one JSON line per path and shape and writes ``lean_loss_kernel.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

PATHS = ("hf", "chunks", "fused")


def run(path: str, rows: int, vocab: int, iters: int) -> dict[str, float | str | int]:
    from lightning_gh.activation_offload import lean_loss

    os.environ["LGH_LEAN_LOSS_KERNEL"] = "triton" if path == "fused" else "torch"
    g = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    chunk_rows = max(1, lean_loss.CHUNK_BYTES // (4 * vocab))

    def forward() -> torch.Tensor:
        if path == "hf":
            return F.cross_entropy(logits.float(), targets)
        return lean_loss._LeanCrossEntropy.apply(logits, targets, -100, None, chunk_rows)

    times, fwd_peak, bwd_peak = [], 0, 0
    for i in range(iters + 2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        loss = forward()
        if i < 2:
            torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base
        (grad,) = torch.autograd.grad(loss, logits)
        e1.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(e0.elapsed_time(e1))
        else:  # the peaks, from untimed runs that synchronise between the passes
            fwd_peak, bwd_peak = max(fwd_peak, fwd), max(bwd_peak, torch.cuda.max_memory_allocated() - base)
        del loss, grad
    return {"path": path, "rows": rows, "vocab": vocab, "ms": round(statistics.median(times), 3),
            "forward_extra_mib": round(fwd_peak / 2**20, 1), "backward_extra_mib": round(bwd_peak / 2**20, 1),
            "logits_mib": round(logits.numel() * 2 / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x32000", "16384x32000"], help="ROWSxVOCAB")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="folder for lean_loss_kernel.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lean_loss_kernel needs a CUDA GPU")
    rows_out = []
    for shape in args.shapes:
        rows, vocab = (int(v) for v in shape.lower().split("x"))
        for path in args.paths:
            r = run(path, rows, vocab, args.iters)
            rows_out.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lean_loss_kernel.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                               "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
