"""Shared timing and reporting for the benchmark suites.

Timing follows the GPU method: warm up first, time every step with CUDA events on the stream that runs
it, report the median (and p10/p90) of many steps. On the CPU (for the runner's own tests) it falls
back to ``time.perf_counter``. Variants of one suite run in the same process, side by side, and each
preset's ratios are taken against that preset's first ("plain") variant.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from lightning_gh import hardware
from lightning_gh.demo import LlamaConfig, LlamaLM, MarkovDataModule


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: list[float]

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> Timing:
        if not samples_ms:
            raise ValueError("no timed samples: raise --iters")
        s = sorted(samples_ms)
        pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
        return cls(statistics.median(s), pick(0.1), pick(0.9), list(samples_ms))


def median_s(fn: Callable[[], Any], reps: int = 5) -> float:
    """Median wall-clock seconds of ``fn()`` over ``reps`` calls after one untimed call (host-side work: the
    CPU kernels; GPU work is timed with CUDA events, see :class:`Timing`)."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@dataclass
class Result:
    """One variant of one preset in one suite."""

    suite: str
    preset: str
    variant: str
    timing: Timing | None
    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    peak_mem_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return self.timing.median_ms if self.timing else None

    def row(self) -> dict[str, Any]:
        ms = self.median_ms
        d = {
            "suite": self.suite, "preset": self.preset, "variant": self.variant,
            "median_ms": ms,
            "p10_ms": self.timing.p10_ms if self.timing else None,
            "p90_ms": self.timing.p90_ms if self.timing else None,
            "tokens_per_s": self.tokens_per_step / (ms / 1e3) if ms else None,
            "tflops": self.flops_per_step / (ms / 1e3) / 1e12 if ms and self.flops_per_step else None,
            "peak_mem_gib": self.peak_mem_bytes / 2**30 if self.peak_mem_bytes is not None else None,
            "error": self.error,
        }
        d.update(self.extra)
        return d


@dataclass
class BenchContext:
    suite: str
    presets: list[str]
    device: torch.device
    warmup: int
    iters: int
    out_dir: Path
    args: Any = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def time_fn(step: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> Timing:
    """Median time of ``step()`` over ``iters`` calls after ``warmup`` calls; CUDA events on GPU."""
    for _ in range(warmup):
        step()
    sync(device)
    samples = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.from_samples(samples)


def random_batch(cfg: LlamaConfig, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class StepTimer(L.Callback):
    """Times whole Lightning training steps (batch start to batch end) with CUDA events.

    The first ``warmup`` steps are dropped. Data loading between steps is outside the timed span, so
    what is measured is the step Lightning runs: forward, backward, optimizer, hooks.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0
        self._samples_cpu: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((ev, None))
        else:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[-1] = (self._events[-1][0], ev)
        else:
            self._samples_cpu.append((time.perf_counter() - self._t0) * 1e3)

    def timing(self) -> Timing:
        if self._events:
            torch.cuda.synchronize()
            samples = [s.elapsed_time(e) for s, e in self._events if e is not None]
        else:
            samples = self._samples_cpu
        return Timing.from_samples(samples[self.warmup :])


def lightning_steps(
    model: LlamaLM,
    ctx: BenchContext,
    callbacks: list[Any] | None = None,
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs: Any,
) -> tuple[Timing, L.Trainer]:
    """Fit ``model`` for warmup+iters steps in a plain Lightning Trainer and time each step."""
    timer = StepTimer(ctx.warmup)
    dm = datamodule or MarkovDataModule.for_model(model, pin_memory=ctx.cuda, num_train_samples=10**6)
    trainer_kwargs.setdefault("precision", "bf16-mixed" if ctx.cuda else "32-true")
    trainer = L.Trainer(
        accelerator="gpu" if ctx.cuda else "cpu", devices=1, max_steps=ctx.warmup + ctx.iters,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer, *(callbacks or [])], **trainer_kwargs,
    )
    trainer.fit(model, dm)
    return timer.timing(), trainer


def machine_info() -> dict[str, Any]:
    hw = hardware.detect()
    return {"machine": hw.describe(), "hostname": platform.node(), "torch": torch.__version__,
            "lightning": L.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def add_ratios(results: list[Result]) -> None:
    """ratio = first variant's time / this variant's time (> 1 is faster), per (suite, preset).

    The first variant is the plain run each suite lists first; when it failed (say, out of memory) the preset gets
    no ratios at all rather than ratios against whichever variant happened to come next.
    """
    base: dict[tuple[str, str], float | None] = {}
    for r in results:
        key = (r.suite, r.preset)
        if key not in base:
            base[key] = r.median_ms
        b = base[key]
        r.extra["speedup_vs_first"] = round(b / r.median_ms, 3) if b and r.median_ms else None


def format_table(results: list[Result]) -> str:
    cols = ["preset", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_first", "tokens_per_s", "tflops", "peak_mem_gib"]
    rows = [r.row() for r in results]
    fmt = lambda v: "-" if v is None else (f"{v:,.3g}" if isinstance(v, float) and abs(v) >= 1e5 else (f"{v:.3f}" if isinstance(v, float) else str(v)))  # noqa: E731
    table = [cols] + [[fmt(row.get(c)) for c in cols] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    errors = [f"  {r.preset}/{r.variant}: {r.error}" for r in results if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def write_report(ctx: BenchContext, results: list[Result], command: str) -> Path:
    add_ratios(results)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.out_dir / f"bench_{ctx.suite}.json"
    payload = {"suite": ctx.suite, "command": command, **machine_info(),
               "warmup": ctx.warmup, "iters": ctx.iters,
               "results": [{**r.row(), "samples_ms": r.timing.samples_ms if r.timing else None} for r in results]}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def out_dir(default: str | None) -> Path:
    return Path(default or os.environ.get("OUT") or "bench_out")


# ---------------------------------------------------------------- variants in a fresh process

_CHILD_MARK = "@@lgh-bench-result@@"


def run_isolated(ctx: BenchContext, suite_module: str, payload: dict[str, Any],
                 echo: str) -> tuple[Result | None, Any]:
    """Run ``<suite_module>._child(args)`` in a fresh Python process and return its Result (or ``None``) and the
    finished process.

    Used where a variant must not share a process with the others (the CUDA allocator's state, a per-process memory
    cap, a managed-memory pool). ``args`` is the context (see :func:`child_context`) plus ``payload``; the child
    reports with :func:`emit_child_result`. Lines of the child's output that start with ``echo`` are printed here.
    """
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    args = {"suite": ctx.suite, "presets": ctx.presets, "device": str(ctx.device), "warmup": ctx.warmup,
            "iters": ctx.iters, "out_dir": str(ctx.out_dir), "argv": vars(ctx.args) if ctx.args is not None else {},
            **payload}
    code = ("import json, sys; sys.path[:0] = [%r, %r]; import importlib; "
            "importlib.import_module(%r)._child(json.loads(sys.argv[1]))" % (str(here), str(here.parent), suite_module))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(_CHILD_MARK):
            d = json.loads(line[len(_CHILD_MARK):])
            timing = Timing(**d["timing"]) if d["timing"] else None
            return Result(d["suite"], d["preset"], d["variant"], timing, d["tokens_per_step"], d["flops_per_step"],
                          d["peak_mem_bytes"], d["extra"], d["error"]), proc
        if line.startswith(echo):
            print(line, flush=True)
    return None, proc


def child_context(args: dict[str, Any]) -> BenchContext:
    """The parent's context, rebuilt in a :func:`run_isolated` child (TF32 on CUDA, as ``run.py`` sets it)."""
    import argparse

    ctx = BenchContext(args["suite"], args["presets"], torch.device(args["device"]), args["warmup"], args["iters"],
                       Path(args["out_dir"]), argparse.Namespace(**args["argv"]))
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return ctx


def emit_child_result(r: Result) -> None:
    """Hand ``r`` to the parent of a :func:`run_isolated` child."""
    from dataclasses import asdict

    print(_CHILD_MARK + json.dumps(asdict(r), default=str), flush=True)
