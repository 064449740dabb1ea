"""Suite `nvtx`: what NVTXRangeCallback costs a Lightning step, against the same fit without it.

Variants per preset (bf16-mixed on CUDA, eager, Markov tokens through a DataLoader):
  plain                  no NVTXRangeCallback (the ratio base)
  nvtx                   NVTXRangeCallback(): the phase ranges, ~6 per step
  nvtx+modules+gc        module_ranges=True, gc_ranges=True: + a forward range per block/embed/norm/head
                         and a backward range where cheap (24 ranges per step on `small`)
  nvtx outside window    NVTXRangeCallback(steps="1000000"): the cost on steps that are not annotated
  emit_nvtx (anchor)     torch.autograd.profiler.emit_nvtx() around the fit: a range per operator
                         (CUDA only; what users turn on today)

The callback does work only when a tool listens. Unless --nvtx-inject none, the suite attaches one
before the first NVTX call of the process: $NVTX_INJECTION64_PATH if already set (nsys sets it),
else --nvtx-inject PATH, else tests/nvtx_inject/inject.c compiled with the system C compiler (a
tool that formats and logs every event, i.e. pays about what a recording tool pays). Each variant
uses its own NVTX domain, so the log gives the ranges per step of each.

Timing: the period between consecutive on_train_batch_start calls (wall clock, no synchronisation),
so everything between two steps counts: data fetch, every hook, the callback's own work. On the
launch-bound `small` preset this is the host's time per step, the worst case for a Python
callback. Variants run in --rounds rounds, the order rotated each round, all in this process;
each variant's median is taken over all its steps after warm-up, and the spread of the per-round
medians is reported as `round_spread_pct` (noise to compare the overhead against).

    python benchmarks/run.py --suite nvtx --preset small --iters 200 --warmup 20 --rounds 5
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from common import BenchContext, Result, Timing, reset_memory
from lightning_gh.demo import LlamaLM, MarkovDataModule, preset

DEFAULT_PRESETS = ["small"]
ROOT = Path(__file__).resolve().parents[2]
INJECT_SRC = ROOT / "tests" / "nvtx_inject" / "inject.c"


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="nvtx: interleaved rounds of every variant")
    parser.add_argument("--nvtx-inject", default="auto",
                        help="nvtx: 'auto' (NVTX_INJECTION64_PATH, else compile tests/nvtx_inject/inject.c), "
                             "a path to an NVTX injection library, or 'none' (no tool: the callback is inert)")


class PeriodTimer(L.Callback):
    """Wall-clock period between consecutive training batches (first in the callback list)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def periods_ms(self, warmup: int) -> list[float]:
        s = self.stamps
        return [(b - a) * 1e3 for a, b in zip(s, s[1:])][warmup:]


def _attach_tool(choice: str) -> tuple[str, Path | None]:
    """Make sure an NVTX tool is injected before NVTX initialises; returns (description, log path)."""
    if choice == "none":
        return "none (callback inert)", None
    if os.environ.get("NVTX_INJECTION64_PATH"):
        return f"already attached: {os.environ['NVTX_INJECTION64_PATH']}", None
    lib = Path(choice) if choice != "auto" else None
    if lib is None:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            return "none (no C compiler to build the injection library)", None
        lib = Path(tempfile.mkdtemp(prefix="lgh_nvtx_log_")) / "libnvtx_inject.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(INJECT_SRC), "-lpthread"], check=True)
    log = (lib.parent if choice == "auto" else Path(tempfile.mkdtemp(prefix="lgh_nvtx_log_"))) / "nvtx.%p.log"
    # NVTX reads these at its first call in the process; nothing has called it yet.
    os.environ["NVTX_INJECTION64_PATH"] = str(lib)
    os.environ["LGH_NVTX_LOG"] = str(log)
    return f"tests/nvtx_inject ({lib})", log


def _ranges_per_domain(log: Path | None) -> dict[str, int]:
    """push + start events per NVTX domain ("" is the global domain, where emit_nvtx and torch go)."""
    counts: dict[str, int] = {}
    if log is None:
        return counts
    for path in log.parent.glob("nvtx.*.log"):
        with path.open() as f:
            for line in f:
                kind, _, rest = line.partition("\t")
                if kind in ("push", "start"):
                    domain = rest.split("\t", 3)[2]
                    counts[domain] = counts.get(domain, 0) + 1
    return counts


def _push_pop_us(domain: str) -> float | None:
    from lightning_gh.profiling._nvtx_backend import push_pop_cost_us, select_backend

    b = select_backend(domain)
    return push_pop_cost_us(b) if b.tool_attached else None


def _fit(name: str, ctx: BenchContext, callbacks: list[Any], wrap: Callable[[], Any]) -> list[float]:
    torch.manual_seed(0)
    model = LlamaLM.from_preset(name, lr=1e-4, warmup_steps=0)
    dm = MarkovDataModule.for_model(model, pin_memory=ctx.cuda, num_train_samples=10**6)
    timer = PeriodTimer()
    trainer = L.Trainer(
        accelerator="gpu" if ctx.cuda else "cpu", devices=1, max_steps=ctx.warmup + ctx.iters,
        precision="bf16-mixed" if ctx.cuda else "32-true", limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer, *callbacks],
    )
    with wrap():
        trainer.fit(model, dm)
    return timer.periods_ms(ctx.warmup)


def run(ctx: BenchContext) -> list[Result]:
    from lightning_gh.profiling.nvtx import NVTXRangeCallback

    args = ctx.args
    rounds = max(1, getattr(args, "rounds", 5) if args is not None else 5)
    tool, log = _attach_tool(getattr(args, "nvtx_inject", "auto") if args is not None else "auto")
    print(f"[nvtx] tool: {tool}", flush=True)
    results: list[Result] = []
    for name in ctx.presets:
        cfg = preset(name)
        variants: list[tuple[str, Callable[[], list[Any]], Callable[[], Any]]] = [
            ("plain", lambda: [], contextlib.nullcontext),
            ("nvtx", lambda name=name: [NVTXRangeCallback(domain=f"{name}.nvtx")], contextlib.nullcontext),
            ("nvtx+modules+gc", lambda name=name: [NVTXRangeCallback(domain=f"{name}.modules", module_ranges=True,
                                                                     gc_ranges=True)], contextlib.nullcontext),
            ("nvtx outside window", lambda name=name: [NVTXRangeCallback(domain=f"{name}.outside", steps="1000000")],
             contextlib.nullcontext),
        ]
        if ctx.cuda:
            variants.append(("emit_nvtx (anchor)", lambda: [], torch.autograd.profiler.emit_nvtx))
        samples: dict[str, list[float]] = {v[0]: [] for v in variants}
        round_medians: dict[str, list[float]] = {v[0]: [] for v in variants}
        errors: dict[str, str] = {}
        before = _ranges_per_domain(log)
        for r in range(rounds):
            k = r % len(variants)
            for variant, make_callbacks, wrap in variants[k:] + variants[:k]:
                if variant in errors:
                    continue
                reset_memory(ctx.device)
                try:
                    periods = _fit(name, ctx, make_callbacks(), wrap)
                    samples[variant] += periods
                    round_medians[variant].append(statistics.median(periods))
                except Exception as e:  # a failing variant is a result, not a crash of the suite
                    errors[variant] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    traceback.print_exc()
            print(f"[nvtx] {name} round {r + 1}/{rounds}: "
                  + ", ".join(f"{v} {m[-1]:.3f} ms" for v, m in round_medians.items() if m), flush=True)
        counts = _ranges_per_domain(log)
        steps = rounds * (ctx.warmup + ctx.iters)
        push_pop = _push_pop_us(f"{name}.cost")
        domains = {"nvtx": f"{name}.nvtx", "nvtx+modules+gc": f"{name}.modules",
                   "nvtx outside window": f"{name}.outside", "emit_nvtx (anchor)": ""}
        base = statistics.median(samples["plain"]) if samples["plain"] else None
        for variant, *_ in variants:
            r = Result(ctx.suite, name, variant, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
            r.error = errors.get(variant)
            if samples[variant]:
                r.timing = Timing.from_samples(samples[variant])
                med = round_medians[variant]
                r.extra["round_spread_pct"] = round(100 * (max(med) - min(med)) / statistics.median(med), 2)
                if base:
                    r.extra["overhead_pct"] = round(100 * (r.timing.median_ms / base - 1), 2)
            d = domains.get(variant)
            if d is not None and log is not None:
                r.extra["ranges_per_step"] = round((counts.get(d, 0) - before.get(d, 0)) / steps, 1)
            if variant.startswith("nvtx"):
                r.extra["push_pop_us"] = round(push_pop, 3) if push_pop is not None else None
            r.extra["tool"] = tool
            results.append(r)
        reset_memory(ctx.device)
    if log is not None:
        shutil.rmtree(log.parent, ignore_errors=True)
    return results
