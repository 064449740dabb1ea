"""What an ActivationOffload plan costs on the medium HF config, taken apart: hooks, copies, and where copies start.

The medium config of ``benchmarks/activation_job.py`` (a ``transformers`` decoder, random init, SDPA, hidden 2048,
8 layers, FFN 5632, 16 heads with 4 KV heads, vocab 32000, 4 x 2048 tokens) in a plain PyTorch loop (no Lightning):
autocast to bf16, the cross entropy of the fp32 logits, ``AdamW(fused=True)``. Each variant runs ``--steps`` steps in
this one process (the first ``--warmup`` untimed), and the whole list runs ``--reps`` times, interleaved, so a
noisy host shows as spread between the repetitions rather than as a difference between variants:

================  ==================================================================================================
variant           what runs
================  ==================================================================================================
plain             nothing
untracked         the engine with ``policy=0``: every block kept, its saved tensors untracked (the engine's base
                  cost: a Python pack and unpack per saved tensor, autocast's weight casts made again in the backward)
plan              a fixed plan that moves part of blocks 0 and 2 (``--plan-mib``, the ``budget=0.7`` plans' size)
plan_late         the same bytes from blocks 3 and 4
plan_nocopy       ``plan`` with a transport that copies nothing: the tracked blocks' host work alone
dma               ``plain`` with the same bytes copied device-to-host on a side stream as the step starts and
                  host-to-device after the forward, on buffers of their own (nothing waits for them)
dma_d2h           only the device-to-host half of ``dma``
dma_h2d           only the host-to-device half
dma_late          ``dma`` with the device-to-host half issued when block 1 starts
================  ==================================================================================================

Per row: the median step (between ``torch.cuda.synchronize`` calls), its p10 and p90, and the host's time to
enqueue the step (a host time near the step time means the step waits for its launches). ``--find-syncs`` first
runs two plain steps under ``torch.cuda.set_sync_debug_mode("warn")`` and prints where each synchronizing call
comes from: a copy queued on the copy engine before such a call makes the host wait for the whole queue.

Usage (on the GPU machine)::

    python benchmarks/offload_host_cost.py --family llama mistral --reps 3 --out $OUT
    python benchmarks/offload_host_cost.py --variants plain dma dma_d2h dma_h2d dma_late --find-syncs

Writes ``offload_host_cost.jsonl`` (one JSON object a row) under ``--out`` (default ``$OUT``, else ``bench_out/``).
Without a CUDA GPU it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):  # the repository root (lightning_gh) and benchmarks/ (activation_job)
    if _p not in sys.path:
        sys.path.insert(0, _p)

from activation_job import FAMILIES, build_model  # noqa: E402

from suites.offload import HF_BATCH, HF_CFG, HF_SEQ  # noqa: E402

MIB = 2**20
VARIANTS = ("plain", "untracked", "plan", "plan_late", "plan_nocopy", "dma", "dma_d2h", "dma_h2d", "dma_late")


class NoCopy:
    """A transport that moves nothing: a reload hands back uninitialised memory (timing only)."""

    name, synchronous = "nocopy", False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_host(self, src: torch.Tensor, host: torch.Tensor, after: Any) -> None:
        return None

    def release(self, event: Any) -> None:
        pass

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.empty(host.numel(), dtype=torch.uint8, device=self.device), None

    def wait(self, event: Any) -> None:
        pass


def build(family: str) -> torch.nn.Module:
    """The activation job's medium model of ``family`` on the GPU (:func:`activation_job.build_model`)."""
    torch.manual_seed(0)
    return build_model(family, HF_CFG, torch.device("cuda"))


def fixed_plan(first: int, second: int, plan_mib: tuple[int, int]) -> Any:
    """Part of blocks ``first`` and ``second`` moved (``plan_mib`` each), released five and four blocks later,
    reloaded when the backward of the block two and one after them starts (the ``budget=0.7`` plans' points)."""
    from lightning_gh.activation_offload.policy import plan_first_k

    n = 8
    p = plan_first_k(n, 0)
    budgets, release, prefetch = [0] * n, list(p.release_at), list(p.prefetch_at)
    for blk, mib, lag, ahead in ((first, plan_mib[0], 5, 2), (second, plan_mib[1], 4, 1)):
        budgets[blk] = mib * MIB
        release[blk] = min(blk + lag, n + 1)
        prefetch[blk] = min(blk + ahead, n)
    return dataclasses.replace(p, policy="fixed", budgets=tuple(budgets), release_at=tuple(release),
                               prefetch_at=tuple(prefetch))


def run(model: torch.nn.Module, opt: torch.optim.Optimizer, variant: str, args: argparse.Namespace,
        bufs: dict[str, Any]) -> dict[str, Any]:
    from lightning_gh.activation_offload.engine import offload_activations

    off = None
    if variant in ("untracked", "plan", "plan_late", "plan_nocopy"):
        off = offload_activations(model, policy=0)
        if variant != "untracked":
            off._resolve()
            off.set_plan(fixed_plan(*((3, 4) if variant == "plan_late" else (0, 2)), tuple(args.plan_mib)))
            if variant == "plan_nocopy":
                off._transport = NoCopy(torch.device("cuda"))
    x = bufs["x"]
    ms, host = [], []
    for i in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hook = None
        if variant in ("dma", "dma_d2h"):
            side_copies(bufs, "d2h")
        if variant == "dma_late":
            hook = model.model.layers[1].register_forward_pre_hook(lambda *a: side_copies(bufs, "d2h"))
        if off is not None:
            off.begin_forward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 x[:, 1:].reshape(-1))
        if off is not None:
            off.end_forward()
        if hook is not None:
            hook.remove()
        if variant in ("dma", "dma_h2d", "dma_late"):
            side_copies(bufs, "h2d")
        loss.backward()
        if off is not None:
            off.end_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= args.warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
            host.append((t1 - t0) * 1e3)
    moved = off.stats.offloaded_tensors if off is not None else None
    if off is not None:
        off.close()
    ms_sorted = sorted(ms)
    return {"variant": variant, "step_ms": statistics.median(ms), "host_ms": statistics.median(host),
            "p10_ms": ms_sorted[len(ms) // 10], "p90_ms": ms_sorted[len(ms) * 9 // 10], "offloaded_tensors": moved}


def side_copies(bufs: dict[str, Any], direction: str) -> None:
    """The plan's bytes in seven copies on a side stream that first waits for the compute stream."""
    side, dev, host = bufs["side"], bufs["dev"], bufs["host"]
    side.wait_stream(torch.cuda.current_stream())
    n = dev.numel()
    with torch.cuda.stream(side):
        for k in range(7):
            a, b = k * n // 7, (k + 1) * n // 7
            if direction == "d2h":
                host[a:b].copy_(dev[a:b], non_blocking=True)
            else:
                dev[a:b].copy_(host[a:b], non_blocking=True)


def find_syncs(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """Where the plain step's synchronizing CUDA calls come from (the innermost frames of each)."""
    found: list[str] = []

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        if any(f.name == "set_sync_debug_mode" for f in frames):
            return  # the mode's own notice as it is switched on
        found.append("".join(traceback.format_list(frames[-6:])))

    old = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=x, use_cache=False).logits.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    model.zero_grad(set_to_none=True)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", nargs="+", default=["llama"], choices=sorted(FAMILIES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=25, help="steps per variant and repetition")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps among --steps")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the whole variant list")
    ap.add_argument("--plan-mib", type=int, nargs=2, default=[377, 188], metavar=("FIRST", "SECOND"),
                    help="MiB the fixed plans move from each of their two blocks (and the dma rows copy in all)")
    ap.add_argument("--find-syncs", action="store_true", help="print where the plain step synchronizes first")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.steps <= args.warmup + 1:
        ap.error(f"--steps={args.steps} must exceed --warmup={args.warmup} by at least 2")
    if min(args.plan_mib) < 1:
        ap.error(f"--plan-mib={args.plan_mib} must be two sizes >= 1 MiB")
    if not torch.cuda.is_available():
        print("[offload_host_cost] no CUDA GPU: nothing to measure")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(args.plan_mib) * MIB
    for family in args.family:
        model = build(family)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        bufs = {"x": torch.randint(0, HF_CFG["vocab_size"], (HF_BATCH, HF_SEQ), device="cuda"),
                "side": torch.cuda.Stream(),
                "dev": torch.empty(total, dtype=torch.uint8, device="cuda"),
                "host": torch.empty(total, dtype=torch.uint8, pin_memory=True)}
        if args.find_syncs:
            for where in find_syncs(model, bufs["x"]):
                print(f"[offload_host_cost] {family}: a synchronizing call\n{where}")
        with open(out / "offload_host_cost.jsonl", "a") as f:
            for rep in range(args.reps):
                for variant in args.variants:
                    row = {"family": family, "rep": rep, **run(model, opt, variant, args, bufs)}
                    f.write(json.dumps(row) + "\n")
                    print(f"[offload_host_cost] {family:8s} {variant:12s} {row['step_ms']:7.1f} ms "
                          f"(p10 {row['p10_ms']:.1f}, p90 {row['p90_ms']:.1f}) host {row['host_ms']:5.1f} ms",
                          flush=True)
        del model, opt, bufs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
