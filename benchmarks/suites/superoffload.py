"""Suite `superoffload`: host-offloaded AdamW inside Lightning, against GPU-only fused AdamW and torchao's
`CPUOffloadOptimizer`, in one process.

Part 1, kernels (no model): torch's CPU AdamW, fused against foreach, on the worker's thread count; host memcpy
(what a speculation backup costs); pinned host<->GPU copy bandwidth.

Part 2, step time on a model that fits both ways: `preset("medium", n_layers=16)` (953M parameters, d=2048,
4x2048 tokens, fp32 weights + bf16 autocast = `precision="bf16-mixed"`), each variant a full step of an ordinary
`Trainer`, timed per step with CUDA events (median) after `--warmup` steps (the auto GPU tail settles in the
first ~12 steps), plus the wall-clock time per step and the GPU utilisation sampled through NVML:

  gpu fused adamw                  the plain run (ratio base)
  superoffload                     Trainer(strategy="superoffload"): auto tail, speculative, non-finite skip
  superoffload clip=1.0            the same with gradient_clip_val=1.0 (clipping on every step or most)
  superoffload no-validation       skip_nonfinite=False, no clipping: no speculation backup needed
  superoffload tail=0              gpu_fraction=0.0 (every parameter on the CPU), no validation
  torchao offload                  torchao CPUOffloadOptimizer(AdamW, fused=True) from configure_optimizers
  torchao offload_gradients        the same with offload_gradients=True

Part 3, the largest model that trains under a GPU memory cap (`torch.cuda.set_per_process_memory_fraction`):
`preset("medium", seq_len=1024, batch_size=1)` with `n_layers` varied; GPU-only fused AdamW under
`bf16-mixed` (16 B/param) against `strategy=SuperOffloadStrategy(gpu_fraction=0.0)` under `bf16-true`
(bf16 weights on the GPU, fp32 master + moments on the host). A size "trains" when 3 steps finish.

Part 4 (`--so-parts hf`), the bound under memory pressure with default options: a plain LightningModule
wrapping `transformers.LlamaForCausalLM` (hidden 2048, FFN 5632, 16 heads / 4 KV heads, vocab 32000, 1x2048
tokens), the GPU capped with `torch.cuda.set_per_process_memory_fraction` (`--so-hf-cap-gib`, default 24):

  gpu fused adamw (bf16-mixed)            GPU-only, at the first of `--so-hf-layers` (16: the largest that fits)
  superoffload default (bf16-true)        Trainer(strategy="superoffload"), default options, each size
  superoffload gpu_fraction=0.0 (bf16-true)  the same with every parameter's state on the host
  superoffload k=v,... (bf16-true)        `--so-hf-variants 'so:k=v,...'`: SuperOffloadStrategy(k=v, ...)

Per run it prints the measured forward+backward time (the same module, the same batch, no optimizer: each
gradient is dropped as it lands, as the offload does), the CPU AdamW time of the offloaded parameters at the CPU
rate measured in this process (fused CPU AdamW, the worker's thread count), the host-link time of the bytes moved
(4 B/param each way: fp32 gradients down, fp32 weights up, at the measured pinned bandwidth), the bound = the max
of the three, the step time and step/bound (goal <= 1.15), the auto tail's one-line decision and the allocator's
retry count.

`--so-parts micro speed cap` picks the parts (default the first three; about 7 minutes on the H200 machine).

Isolation: on CUDA every variant of parts 2 and 3 runs in a fresh Python process (`--so-in-process` turns that
off), so peak-memory figures and the memory cap start from an empty GPU and the host RAM of one variant (28 B per
offloaded parameter) is returned before the next starts. A first run that kept all variants in one process saw
~20 GiB still allocated after them, which broke the cap experiment and inflated later peaks.

Anchors and goals: docs/superoffload.md (fused GPU AdamW and torchao's CPUOffloadOptimizer on the 953M model, full
step, and the step-time, speed-up and model-size goals against them); figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import glob
import json
import math
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import lightning as L
import torch

from common import (
    BenchContext,
    Result,
    Timing,
    child_context,
    emit_child_result,
    lightning_steps,
    median_s,
    peak_memory,
    reset_memory,
    run_isolated,
)
from lightning_gh import hardware
from lightning_gh.demo import LlamaLM, preset
from lightning_gh.profiling import SelectiveProfiler
from lightning_gh.profiling.profiler import window_metrics
from lightning_gh.superoffload import HeterogeneousAdamW, SuperOffloadOptions, SuperOffloadStrategy

DEFAULT_PRESETS = ["medium"]
ANCHOR_GPU_MS = 107.0
ANCHOR_TORCHAO_MS = 270.0
ANCHOR_TORCHAO_OG_MS = 254.0
GOAL_VS_GPU = 1.3
GOAL_VS_TORCHAO = 1.5
GOAL_SIZE = 3.0


def add_arguments(parser: Any) -> None:
    parser.add_argument("--so-layers", type=int, default=16, help="n_layers of the step-time model (default 16: 953M)")
    parser.add_argument("--so-variants", nargs="+", default=None,
                        help="subset of step-time variants to run (names as in the table, quoted)")
    parser.add_argument("--so-cap-gib", type=float, default=12.0, help="GPU memory cap of part 3 (GiB); 0 skips it")
    parser.add_argument("--so-cap-seq", type=int, default=1024, help="sequence length of part 3 (batch 1)")
    parser.add_argument("--so-parts", nargs="+", default=["micro", "speed", "cap"],
                        choices=["micro", "speed", "cap", "hf"], help="which parts to run (default: micro speed cap)")
    parser.add_argument("--so-hf-layers", type=int, nargs="+", default=[16, 32, 64],
                        help="part hf: LlamaForCausalLM depths (the first is also the GPU-only size)")
    parser.add_argument("--so-hf-cap-gib", type=float, default=24.0, help="part hf: GPU memory cap (GiB); 0: none")
    parser.add_argument("--so-hf-seq", type=int, default=2048, help="part hf: tokens per step (batch 1)")
    parser.add_argument("--so-hf-hidden", type=int, default=2048,
                        help="part hf: hidden size (FFN = 2.75x, 16 heads / 4 KV heads); small only for a CPU smoke run")
    parser.add_argument("--so-hf-variants", nargs="+", default=["gpu", "default", "tail0"], type=_hf_variant,
                        help="part hf: which variants to run: gpu, default, tail0, deepspeed "
                             "(strategy='deepspeed_stage_2_offload' with DeepSpeedCPUAdam, the anchor users know; "
                             "needs the deepspeed package), or 'so:k=v,...' for SuperOffloadStrategy(k=v, ...) "
                             "(e.g. 'so:gpu_fraction=1.0', 'so:cpu_threads=8,speculative=False')")
    parser.add_argument("--so-hf-profile", action="store_true",
                        help="part hf: also profile two timed steps of each variant with SelectiveProfiler and "
                             "record the GPU's busy/idle share of the step from its trace summary")
    parser.add_argument("--so-in-process", action="store_true",
                        help="run every variant in this process instead of one fresh process each")
    parser.add_argument("--so-budget-s", type=float, default=0.0,
                        help="stop starting new variants/sizes after this many seconds (0: no limit)")


_T0 = time.perf_counter()


def _over_budget(ctx: BenchContext) -> bool:
    budget = float(getattr(ctx.args, "so_budget_s", 0.0) or 0.0)
    return budget > 0 and time.perf_counter() - _T0 > budget


class _Sampler(L.Callback):
    """Wall-clock time per step over the timed steps, and NVML GPU utilisation sampled on a thread of its own."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._steps0 = 0
        self.wall_ms: float | None = None
        self.util_pct: float | None = None

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.samples.append(float(torch.cuda.utilization()))
            except Exception:
                return

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup and self._thread is None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._t0, self._steps0 = time.perf_counter(), trainer.global_step
            if torch.cuda.is_available():
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._t0:
            for opt in trainer.optimizers:
                if isinstance(opt, HeterogeneousAdamW):
                    opt.synchronize()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            steps = trainer.global_step - self._steps0
            self.wall_ms = (time.perf_counter() - self._t0) * 1e3 / max(steps, 1)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self.samples:
            self.util_pct = sum(self.samples) / len(self.samples)


class _TorchAOLM(LlamaLM):
    """LlamaLM whose optimizer is torchao's CPUOffloadOptimizer (same groups and hyper-parameters)."""

    def __init__(self, *args: Any, offload_gradients: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offload_gradients = offload_gradients

    def configure_optimizers(self) -> Any:
        from torchao.optim import CPUOffloadOptimizer

        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        hp = self.hparams
        opt = CPUOffloadOptimizer(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            torch.optim.AdamW, offload_gradients=self._offload_gradients, lr=hp.lr, betas=tuple(hp.betas), fused=True)
        # torchao skips Optimizer.__init__; Lightning reads these two attributes.
        if not hasattr(opt, "state"):
            opt.state = {}
        if not hasattr(opt, "defaults"):
            opt.defaults = {"lr": hp.lr}
        return opt


def _so_stats(trainer: Any) -> dict[str, Any]:
    for opt in getattr(trainer, "optimizers", []):
        if isinstance(opt, HeterogeneousAdamW):
            st = dict(opt.stats)
            return {"host_params_M": round(opt.host_numel / 1e6, 1), "gpu_params_M": round(opt.device_numel / 1e6, 1),
                    "cpu_ms": round(st.get("cpu_ms_per_step", 0.0), 1), "stall_ms": round(st.get("last_stall_ms", 0.0), 1),
                    "slack_ms": None if st.get("last_slack_ms") is None else round(st["last_slack_ms"], 1),
                    "rollbacks": st.get("rollbacks"), "clipped": st.get("clipped_steps"),
                    "spec_buckets": st.get("speculative_buckets"), "prefetched": st.get("prefetched_backups"),
                    "tail_moves": st.get("tail_moves"), "moves_back": st.get("tail_moves_back")}
    return {}


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _lightning_variant(ctx: BenchContext, cfg: Any, name: str, make_model: Callable[[], LlamaLM],
                       **trainer_kwargs: Any) -> Result:
    reset_memory(ctx.device)
    start = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    r = Result(ctx.suite, f"{ctx.presets[0]}-{cfg.n_layers}L", name, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
    model = trainer = None
    try:
        torch.manual_seed(0)
        model = make_model()
        sampler = _Sampler(ctx.warmup)
        r.timing, trainer = lightning_steps(model, ctx, callbacks=[sampler], **trainer_kwargs)
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra.update(wall_ms=round(sampler.wall_ms, 2) if sampler.wall_ms else None,
                       gpu_util_pct=round(sampler.util_pct, 1) if sampler.util_pct is not None else None)
        r.extra.update(_so_stats(trainer))
        loss = trainer.callback_metrics.get("train/loss")
        r.extra["loss_last"] = round(float(loss), 4) if loss is not None else None
    except Exception as e:  # an OOM or a missing package is a result, not a crash of the suite
        r.error = _err(e)
        traceback.print_exc()
    finally:
        # drop the references before measuring what is left behind
        model = trainer = None  # noqa: F841
        gc.collect()
        reset_memory(ctx.device)
    if ctx.cuda:
        r.extra["mem_at_start_gib"] = round(start / 2**30, 2)
        r.extra["left_allocated_gib"] = round(torch.cuda.memory_allocated(ctx.device) / 2**30, 2)
    print(f"[superoffload] {name}: {r.median_ms} ms  {r.extra}  {r.error or ''}", flush=True)
    return r


def _micro(ctx: BenchContext) -> list[Result]:
    """CPU AdamW kernel throughput (fused vs foreach), host memcpy, pinned link bandwidth."""
    out = []
    threads = max(1, (torch.get_num_threads() if not ctx.cuda else hardware.cpus_available() - 2))
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    n = 1 << 26  # 64M parameters
    try:
        for kind in ("fused", "foreach"):
            p = torch.randn(n)
            p.grad = torch.randn(n)
            opt = torch.optim.AdamW([p], lr=1e-4, fused=kind == "fused", foreach=kind == "foreach")
            opt.step()
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                opt.step()
                samples.append((time.perf_counter() - t0) * 1e3)
            t = Timing.from_samples(samples)
            r = Result(ctx.suite, "kernels", f"cpu adamw {kind} ({threads} threads, 64M params)", t)
            r.extra["gparams_per_s"] = round(n / (t.median_ms / 1e3) / 1e9, 2)
            out.append(r)
            del opt, p
        src, dst = torch.randn(3 * n), torch.empty(3 * n)
        dst.copy_(src)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append((time.perf_counter() - t0) * 1e3)
        t = Timing.from_samples(samples)
        r = Result(ctx.suite, "kernels", "host memcpy of a 12 B/param backup (64M params)", t)
        r.extra["gparams_per_s"] = round(n / (t.median_ms / 1e3) / 1e9, 2)
        r.extra["gb_per_s_rw"] = round(2 * 12 * n / (t.median_ms / 1e3) / 1e9, 1)
        out.append(r)
        del src, dst
        if ctx.cuda:
            bw = hardware.link_bandwidth()
            if bw is not None:
                r = Result(ctx.suite, "kernels", "pinned link bandwidth", Timing.from_samples([0.0]))
                r.extra.update(h2d_gbps=round(bw.h2d_gbps, 1), d2h_gbps=round(bw.d2h_gbps, 1))
                out.append(r)
    finally:
        torch.set_num_threads(prev)
    for r in out:
        print(f"[superoffload] {r.variant}: {r.median_ms:.2f} ms {r.extra}", flush=True)
    return out


def _fits(ctx: BenchContext, cfg: Any, offload: bool) -> tuple[bool, str, float | None, int | None]:
    """Train 3 steps of `cfg` under the current memory cap; (fits, error, median ms, peak bytes)."""
    reset_memory(ctx.device)
    model = trainer = None
    try:
        torch.manual_seed(0)
        if offload:
            with default_dtype(torch.bfloat16), torch.device(ctx.device):  # bf16 weights directly (bf16-true)
                model = LlamaLM(cfg, lr=1e-4, warmup_steps=0)
            kw = dict(strategy=SuperOffloadStrategy(gpu_fraction=0.0, skip_nonfinite=False), precision="bf16-true")
        else:
            with torch.device(ctx.device):
                model = LlamaLM(cfg, lr=1e-4, warmup_steps=0)
            kw = dict(precision="bf16-mixed")
        sub = BenchContext(ctx.suite, ctx.presets, ctx.device, warmup=1, iters=2, out_dir=ctx.out_dir, args=ctx.args)
        timing, trainer = lightning_steps(model, sub, **kw)
        return True, "", timing.median_ms, peak_memory(ctx.device)
    except Exception as e:
        return False, _err(e), None, None
    finally:
        model = trainer = None  # noqa: F841
        gc.collect()
        reset_memory(ctx.device)


def _cap(ctx: BenchContext) -> list[Result]:
    cap_gib = float(ctx.args.so_cap_gib)
    seq = int(ctx.args.so_cap_seq)
    isolate = not getattr(ctx.args, "so_in_process", False)
    out: list[Result] = []

    def attempt(name: str, n_layers: int, offload: bool) -> Result:
        cfg = preset("medium", seq_len=seq, batch_size=1, n_layers=n_layers)
        kw = dict(n_layers=n_layers, offload=offload, cap_gib=cap_gib, seq_len=seq, name=name)
        r = _isolated(ctx, "cap", **kw) if isolate else None
        if r is None and isolate:
            r = Result(ctx.suite, f"cap {cap_gib:g} GiB", name, None, error="isolated run crashed")
            r.extra.update(n_layers=n_layers, params_M=round(cfg.num_params() / 1e6))
        elif r is None:  # in-process (memory left by earlier variants counts against the cap)
            dev_index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(dev_index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), dev_index)
            try:
                ok, err, ms, peak = _fits(ctx, cfg, offload)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, dev_index)
            r = Result(ctx.suite, f"cap {cap_gib:g} GiB", name, Timing.from_samples([ms]) if ms else None,
                       cfg.tokens_per_batch, cfg.train_flops_per_batch(), peak, error=None if ok else err)
            r.extra.update(n_layers=n_layers, params_M=round(cfg.num_params() / 1e6))
        out.append(r)
        fits = r.error is None
        print(f"[superoffload] cap {cap_gib:g} GiB {name} {n_layers}L ({r.extra.get('params_M')}M): "
              f"{'fits' if fits else 'does not fit: ' + str(r.error)[:160]}", flush=True)
        return r

    gpu_best = None
    for n_layers in (16, 12, 10, 8, 6, 4, 2, 1):
        if attempt("gpu fused adamw (bf16-mixed)", n_layers, offload=False).error is None:
            gpu_best = preset("medium", seq_len=seq, batch_size=1, n_layers=n_layers)
            break
    if gpu_best is None:
        return out
    per_layer = preset("medium", n_layers=2).num_params() - preset("medium", n_layers=1).num_params()
    fixed = gpu_best.num_params() - gpu_best.n_layers * per_layer
    best = best_rec = None
    for mult in (GOAL_SIZE, 4.0, 5.0):
        if _over_budget(ctx):
            break
        n_layers = max(1, math.ceil((mult * gpu_best.num_params() - fixed) / per_layer))
        r = attempt("superoffload tail=0 (bf16-true)", n_layers, offload=True)
        if r.error is not None:
            break
        best, best_rec = preset("medium", seq_len=seq, batch_size=1, n_layers=n_layers), r
    if best is not None:
        ratio = best.num_params() / gpu_best.num_params()
        best_rec.extra["size_vs_gpu_only"] = round(ratio, 2)
        print(f"[superoffload] cap {cap_gib:g} GiB: largest GPU-only {gpu_best.num_params() / 1e6:.0f}M, "
              f"with offload {best.num_params() / 1e6:.0f}M -> {ratio:.2f}x (goal >= {GOAL_SIZE}x)", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- part 4: hf + bound
HF_GOAL_VS_BOUND = 1.15
HF_MIN_WARMUP = 28  # the auto tail decides within the first ~10-36 pipelined steps: time after it


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch``'s default dtype set to ``dtype`` for the block (modules built inside get weights of that dtype)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


class _HFLlamaLM(L.LightningModule):
    """A plain LightningModule around ``transformers.LlamaForCausalLM``, as a user would write it."""

    def __init__(self, n_layers: int, hidden: int = 2048, seq_len: int = 2048, lr: float = 1e-4) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_attention_heads=16,
                          num_key_value_heads=4, num_hidden_layers=n_layers, vocab_size=32000,
                          max_position_embeddings=seq_len)
        cfg._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(cfg)
        self.lr = lr
        self.last_loss: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if getattr(self, "deepspeed_cpu_adam", False):  # ZeRO-Offload refuses a torch optimizer by default
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), lr=self.lr, weight_decay=0.1, adamw_mode=True)
        fused = next(self.parameters()).is_cuda
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=fused)


_HF_FIXED = ("gpu", "default", "tail0", "deepspeed")


def _hf_variant(text: str) -> str:
    """argparse type of ``--so-hf-variants``: a fixed name, or ``so:k=v,...`` with known option names."""
    if text in _HF_FIXED:
        return text
    try:
        _so_kwargs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _so_kwargs(text: str) -> dict[str, Any]:
    """``'so:gpu_fraction=0.5,speculative=False'`` -> ``{"gpu_fraction": 0.5, "speculative": False}``, checked
    against :class:`SuperOffloadOptions` so a typo fails before any GPU time is spent."""
    if not text.startswith("so:"):
        raise ValueError(f"variant {text!r}: expected one of {_HF_FIXED} or 'so:k=v,...'")
    kw: dict[str, Any] = {}
    for item in filter(None, text[3:].split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: {item!r} is not k=v")
        try:
            kw[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):  # a bare word: a string option value ('auto', 'copy')
            kw[key.strip()] = raw.strip()
    SuperOffloadOptions(**kw)  # raises on an unknown name or a bad value
    return kw


def _token_loader(seq_len: int, cuda: bool, n: int = 64) -> Any:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (n, seq_len), generator=g)
    return torch.utils.data.DataLoader(ids, batch_size=1, pin_memory=cuda)


def _fwd_bwd_ms(module: _HFLlamaLM, batch: torch.Tensor, autocast: bool, warmup: int = 2, iters: int = 5) -> float:
    """Median forward+backward time of ``module`` on ``batch``, no optimizer; each gradient is dropped as it
    lands (as the offload does with its GPU copy), so the memory is that of the offloaded run."""
    params = [p for p in module.parameters() if p.requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None)) for p in params]
    cuda = batch.is_cuda
    samples = []
    try:
        for i in range(warmup + iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = module(batch)
            loss.backward()
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                samples.append(ms)
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.grad = None
    return statistics.median(samples)


def _hf_run(ctx: BenchContext, n_layers: int, variant: str, cap_gib: float, seq_len: int, hidden: int) -> Result:
    """One part-4 variant in this process: cap, build, measure forward+backward, train, report."""
    if ctx.cuda and cap_gib > 0:
        dev_index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev_index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), dev_index)
    name = {"gpu": "gpu fused adamw (bf16-mixed)", "default": "superoffload default (bf16-true)",
            "tail0": "superoffload gpu_fraction=0.0 (bf16-true)",
            "deepspeed": "deepspeed_stage_2_offload (bf16-mixed)"}.get(variant, f"superoffload {variant[3:]} (bf16-true)")
    r = Result(ctx.suite, f"hf-llama {n_layers}L cap {cap_gib:g} GiB", name, None, seq_len)
    module = trainer = None
    try:
        torch.manual_seed(0)
        offload = variant not in ("gpu", "deepspeed")  # DeepSpeed casts an fp32 module itself
        # bf16 weights straight away (bf16-true)
        with default_dtype(torch.bfloat16 if offload else torch.get_default_dtype()), torch.device(ctx.device):
            module = _HFLlamaLM(n_layers, hidden=hidden, seq_len=seq_len)
        r.extra["params_M"] = round(sum(p.numel() for p in module.parameters()) / 1e6)
        batch = torch.randint(0, 32000, (1, seq_len), device=ctx.device)
        r.extra["fwd_bwd_ms"] = round(_fwd_bwd_ms(module, batch, autocast=not offload and ctx.cuda), 2)
        del batch
        gc.collect()
        reset_memory(ctx.device)
        if variant == "gpu":
            kw: dict[str, Any] = dict(precision="bf16-mixed" if ctx.cuda else "32-true")
        elif variant == "default":
            kw = dict(strategy="superoffload", precision="bf16-true")
        elif variant == "deepspeed":
            module.deepspeed_cpu_adam = True
            kw = dict(strategy="deepspeed_stage_2_offload", precision="bf16-mixed")
        elif variant == "tail0":
            kw = dict(strategy=SuperOffloadStrategy(gpu_fraction=0.0), precision="bf16-true")
        else:
            kw = dict(strategy=SuperOffloadStrategy(**_so_kwargs(variant)), precision="bf16-true")
        warmup = ctx.warmup if variant == "gpu" else max(ctx.warmup, HF_MIN_WARMUP)
        sub = BenchContext(ctx.suite, ctx.presets, ctx.device, warmup=warmup, iters=ctx.iters, out_dir=ctx.out_dir,
                           args=ctx.args)
        snap = _PhaseSnapshot(warmup)
        callbacks: list[Any] = [snap]
        prof_dir = None
        if getattr(ctx.args, "so_hf_profile", False):
            prof_dir = os.path.join(ctx.out_dir or ".", f"so-prof-{n_layers}L-{re.sub(r'[^A-Za-z0-9]+', '_', variant)}")
            callbacks.append(SelectiveProfiler(steps=f"{warmup + 2}-{warmup + 3}", output_dir=prof_dir))
        r.timing, trainer = lightning_steps(module, sub, datamodule=_token_loader(seq_len, ctx.cuda),
                                            callbacks=callbacks, **kw)
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra.update(_so_stats(trainer))
        r.extra.update(snap.per_step(trainer))
        if prof_dir is not None:
            r.extra.update(_profile_figures(prof_dir))
        for opt in trainer.optimizers:
            if isinstance(opt, HeterogeneousAdamW):
                r.extra["host_params"] = opt.host_numel
                r.extra["tail_decision"] = opt.stats.get("tail_decision")
        if ctx.cuda:
            st = torch.cuda.memory_stats(ctx.device)
            r.extra["alloc_retries"] = int(st.get("num_alloc_retries", 0))
        if module.last_loss is not None:
            r.extra["loss_last"] = round(float(module.last_loss), 4)
    except Exception as e:
        r.error = _err(e)
        traceback.print_exc()
    finally:
        module = trainer = None
        gc.collect()
        reset_memory(ctx.device)
    return r


class _PhaseSnapshot(L.Callback):
    """The CPU worker's cumulative time per phase (``stats["cpu_phases_ms"]``) when the timed steps start, so
    the per-step figures exclude the warm-up and the auto tail's trials."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: tuple[int, dict[str, float], dict[str, float]] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            opt = next((o for o in trainer.optimizers if isinstance(o, HeterogeneousAdamW)), None)
            if opt is not None:
                self.start = (opt.stats["steps"], dict(opt.stats["cpu_phases_ms"]), dict(opt.stats["loop_phases_ms"]))

    def per_step(self, trainer: L.Trainer) -> dict[str, Any]:
        opt = next((o for o in trainer.optimizers if isinstance(o, HeterogeneousAdamW)), None)
        if opt is None or self.start is None:
            return {}
        steps = opt.stats["steps"] - self.start[0]
        if steps <= 0:
            return {}
        out: dict[str, Any] = {}
        for key, now, before in (("cpu_phase_ms_per_step", opt.stats["cpu_phases_ms"], self.start[1]),
                                 ("loop_phase_ms_per_step", opt.stats["loop_phases_ms"], self.start[2])):
            out[key] = {k: round((v - before.get(k, 0.0)) / steps, 1) for k, v in sorted(now.items())}
        return out


def _profile_figures(prof_dir: str) -> dict[str, Any]:
    """GPU busy share and step time from the trace summary SelectiveProfiler wrote under ``prof_dir``."""
    found = sorted(glob.glob(os.path.join(prof_dir, "**", "*.summary.json"), recursive=True))
    if not found:
        return {"profile": "no summary written"}
    with open(found[0]) as f:
        summary = json.load(f)
    top = [(k["name"][:60], k["total_ms"], k["count"]) for k in summary.get("top_kernels", [])[:10]]
    return {"profile_metrics": {k: round(v, 3) for k, v in window_metrics(summary).items()},
            "profile_gpu": summary.get("gpu"), "profile_top_kernels": top}


def _cpu_adamw_rate(threads: int, n: int) -> tuple[float, float | None]:
    """Parameters per second on ``threads`` threads (the worker's count) of torch's fused CPU AdamW, and of
    SuperOffload's kernel in the fastest way it runs (out of place or in place, fp32 or bf16 gradients; ``None``
    where it cannot be used here)."""
    from lightning_gh.superoffload import cpu_adamw

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p, grad, m, v = (torch.randn(n) for _ in range(4))
        v.abs_()
        step = torch.tensor(5.0)
        hp = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8}

        def torch_step() -> None:  # torch's kernel itself, without the optimizer's Python around it
            torch._fused_adamw_([p], [grad], [m], [v], [], [step], amsgrad=False, maximize=False, **hp)

        kernel = cpu_adamw.load()
        fns = {"torch": torch_step}
        if kernel is not None:
            src = (p, m, v)
            dst = tuple(torch.empty(n) for _ in range(3))
            g16 = grad.to(torch.bfloat16)
            for name, g, out in (("oop", grad, dst), ("oop bf16", g16, dst), ("in place bf16", g16, src)):
                fns[name] = lambda g=g, out=out: cpu_adamw.update_spans(kernel, src, g, out, [n], 5.0, hp, None,
                                                                        threads)
        # The machine's speed drifts (up to 1.4x between processes): three interleaved rounds, and each the
        # fastest of them, so the bound is as strict as this process allows.
        best = {name: float("inf") for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                best[name] = min(best[name], median_s(fn))
        torch_rate = n / best.pop("torch")
        return torch_rate, (n / min(best.values())) if best else None
    finally:
        torch.set_num_threads(prev)


def _hf(ctx: BenchContext) -> list[Result]:
    a = ctx.args
    layers = list(getattr(a, "so_hf_layers", [16, 32, 64]))
    cap_gib = float(getattr(a, "so_hf_cap_gib", 24.0))
    seq_len = int(getattr(a, "so_hf_seq", 2048))
    hidden = int(getattr(a, "so_hf_hidden", 2048))
    chosen = list(getattr(a, "so_hf_variants", ["gpu", "default", "tail0"]))
    isolate = ctx.cuda and not getattr(a, "so_in_process", False)
    threads = max(1, hardware.cpus_available() - 2) if ctx.cuda else torch.get_num_threads()
    torch_rate, kernel_rate = _cpu_adamw_rate(threads, (1 << 26) if ctx.cuda else (1 << 20))
    # the bound takes the fastest CPU update available here: torch's fused AdamW in place or our kernel
    rate = max(torch_rate, kernel_rate or 0.0)
    bw = hardware.link_bandwidth() if ctx.cuda else None
    link_gbps = None if bw is None else min(bw.h2d_gbps, bw.d2h_gbps)
    print(f"[superoffload] hf: CPU AdamW on {threads} threads: torch fused {torch_rate / 1e9:.2f} G params/s, "
          f"our kernel {'-' if kernel_rate is None else f'{kernel_rate / 1e9:.2f}'} G params/s (the bound "
          f"uses the faster); pinned link {'-' if link_gbps is None else f'{link_gbps:.1f} GB/s'} (slower "
          "direction)", flush=True)
    plan = [(layers[0], "gpu")] if "gpu" in chosen else []
    plan += [(n, v) for n in layers for v in chosen if v not in ("gpu", "deepspeed")]
    plan += [(layers[0], "deepspeed")] if "deepspeed" in chosen else []
    out: list[Result] = []
    for n_layers, variant in plan:
        if _over_budget(ctx):
            break
        kw = dict(n_layers=n_layers, variant=variant, cap_gib=cap_gib, seq_len=seq_len, hidden=hidden)
        r = _isolated(ctx, "hf", **kw) if isolate else _hf_run(ctx, **kw)
        if r is None:
            r = Result(ctx.suite, f"hf-llama {n_layers}L cap {cap_gib:g} GiB", variant, None, error="isolated run crashed")
        _hf_bound(r, rate, link_gbps, torch_rate)
        out.append(r)
        x = r.extra
        print(f"[superoffload] hf {n_layers}L {r.variant}: step {r.median_ms} ms, fwd+bwd {x.get('fwd_bwd_ms')} ms, "
              f"cpu adamw {x.get('cpu_adamw_ms')} ms, link {x.get('link_ms')} ms, bound {x.get('bound_ms')} ms, "
              f"step/bound {x.get('x_bound')} (goal <= {HF_GOAL_VS_BOUND}; at torch's CPU rate "
              f"{x.get('x_bound_torch')}); tail: {x.get('tail_decision')}; "
              f"allocator retries {x.get('alloc_retries')}  {r.error or ''}", flush=True)
    by = {(r.preset, r.variant): r.median_ms for r in out}
    for r in out:
        base = by.get((r.preset, "superoffload gpu_fraction=0.0 (bf16-true)"))
        if r.variant.startswith("superoffload default") and base and r.median_ms:
            r.extra["x_tail0"] = round(r.median_ms / base, 3)
    return out


def _hf_bound(r: Result, rate: float, link_gbps: float | None, torch_rate: float | None = None) -> None:
    """bound = max(forward+backward, CPU AdamW of the host-resident parameters, link time of their bytes), with
    the fastest CPU update measured here (``x_bound``) and with torch's fused CPU AdamW (``x_bound_torch``, the
    rate the issue quotes)."""
    x = r.extra
    host = x.get("host_params", 0)
    link_ms = None
    if link_gbps:
        link_ms = x["link_ms"] = round(host * 4 / (link_gbps * 1e9) * 1e3, 1)  # 4 B/param each way, overlapping
    for key, cpu_rate in (("", rate), ("_torch", torch_rate)):
        if not cpu_rate:
            continue
        cpu_ms = round(host / cpu_rate * 1e3, 1)
        x["cpu_adamw_ms" + key] = cpu_ms
        parts = [p for p in (x.get("fwd_bwd_ms"), cpu_ms, link_ms) if p is not None]
        x["bound_ms" + key] = round(max(parts), 1)
        if r.median_ms:
            x["x_bound" + key] = round(r.median_ms / x["bound_ms" + key], 3)


def _variants(ctx: BenchContext, cfg: Any) -> dict[str, tuple[Callable[[], LlamaLM], dict[str, Any]]]:
    def plain(cls: type = LlamaLM, **kw: Any) -> Callable[[], LlamaLM]:
        def make() -> LlamaLM:
            with torch.device(ctx.device):
                return cls(cfg, lr=1e-4, warmup_steps=0, **kw)
        return make

    so = SuperOffloadStrategy
    return {
        "gpu fused adamw": (plain(), {}),
        "superoffload": (plain(), dict(strategy=so())),
        "superoffload clip=1.0": (plain(), dict(strategy=so(), gradient_clip_val=1.0)),
        "superoffload no-validation": (plain(), dict(strategy=so(skip_nonfinite=False))),
        "superoffload tail=0": (plain(), dict(strategy=so(gpu_fraction=0.0, skip_nonfinite=False))),
        "torchao offload": (plain(_TorchAOLM), {}),
        "torchao offload_gradients": (plain(_TorchAOLM, offload_gradients=True), {}),
    }


def _isolated(ctx: BenchContext, call: str, **kwargs: Any) -> Result | None:
    """Run `call(ctx, **kwargs)` of this module in a fresh Python process; returns its Result."""
    r, proc = run_isolated(ctx, "suites.superoffload", {"call": call, "kwargs": kwargs}, echo="[superoffload]")
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
    return r


def _child(args: dict[str, Any]) -> None:
    """Entry point of an isolated variant: rebuild the context, run one call, print its Result as JSON."""
    ctx = child_context(args)
    kw = args["kwargs"]
    if args["call"] == "hf":
        r = _hf_run(ctx, **kw)
    elif args["call"] == "variant":
        cfg = preset(kw["preset"], n_layers=kw["n_layers"]) if kw["preset"] == "medium" else preset(kw["preset"])
        make, tk = _variants(ctx, cfg)[kw["name"]]
        r = _lightning_variant(ctx, cfg, kw["name"], make, **tk)
    else:
        cfg = preset("medium", seq_len=kw["seq_len"], batch_size=1, n_layers=kw["n_layers"])
        dev_index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev_index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, kw["cap_gib"] * 2**30 / total), dev_index)
        ok, err, ms, peak = _fits(ctx, cfg, offload=kw["offload"])
        r = Result(ctx.suite, f"cap {kw['cap_gib']:g} GiB", kw["name"], Timing.from_samples([ms]) if ms else None,
                   cfg.tokens_per_batch, cfg.train_flops_per_batch(), peak, error=None if ok else err)
        r.extra.update(n_layers=cfg.n_layers, params_M=round(cfg.num_params() / 1e6))
    emit_child_result(r)


def run(ctx: BenchContext) -> list[Result]:
    global _T0
    _T0 = time.perf_counter()
    results: list[Result] = []
    parts = getattr(ctx.args, "so_parts", None) or ["micro", "speed", "cap"]
    if "micro" in parts:
        results += _micro(ctx)
    n_layers = int(getattr(ctx.args, "so_layers", 16) or 16)
    isolate = ctx.cuda and not getattr(ctx.args, "so_in_process", False)
    for name in (ctx.presets if "speed" in parts else []):
        cfg = preset(name, n_layers=n_layers) if name == "medium" else preset(name)
        variants = _variants(ctx, cfg)
        chosen = getattr(ctx.args, "so_variants", None)
        names = [v for v in variants if not chosen or v in chosen or v == "gpu fused adamw"]
        block = []
        for vname in names:
            if _over_budget(ctx):
                block.append(Result(ctx.suite, f"{name}-{cfg.n_layers}L", vname, None, error="skipped: --so-budget-s"))
                continue
            r = None
            if isolate:
                r = _isolated(ctx, "variant", preset=name, n_layers=cfg.n_layers, name=vname)
                if r is None:
                    r = Result(ctx.suite, f"{name}-{cfg.n_layers}L", vname, None, error="isolated run crashed")
            else:
                make, kw = variants[vname]
                r = _lightning_variant(ctx, cfg, vname, make, **kw)
            block.append(r)
        _ratios(block)
        results += block
    if "cap" in parts and ctx.cuda and ctx.args is not None and ctx.args.so_cap_gib > 0:
        results += _cap(ctx)
    if "hf" in parts:
        results += _hf(ctx)
    _print_extras(results)
    return results


_EXTRA_COLS = ("x_bound", "bound_ms", "x_bound_torch", "fwd_bwd_ms", "cpu_adamw_ms", "link_ms", "x_tail0", "alloc_retries", "x_gpu_only", "speedup_vs_torchao", "wall_ms", "gpu_util_pct", "left_allocated_gib", "host_params_M", "gpu_params_M",
               "cpu_ms", "stall_ms", "slack_ms", "rollbacks", "clipped", "spec_buckets", "prefetched", "tail_moves",
               "moves_back", "loss_last", "gparams_per_s", "gb_per_s_rw",
               "h2d_gbps", "d2h_gbps", "n_layers", "params_M", "size_vs_gpu_only")


def _print_extras(results: list[Result]) -> None:
    cols = [c for c in _EXTRA_COLS if any(r.extra.get(c) is not None for r in results)]
    head = ["preset", "variant", "median_ms", "peak_gib", *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [r.preset, r.variant, f"{r.median_ms:.2f}" if r.median_ms else (r.error or "-")[:40],
               f"{r.peak_mem_bytes / 2**30:.2f}" if r.peak_mem_bytes else "-"]
        row += ["-" if r.extra.get(c) is None else str(r.extra[c]) for c in cols]
        lines.append("| " + " | ".join(row) + " |")
    print("\n[superoffload] figures:\n" + "\n".join(lines), flush=True)


def _ratios(block: list[Result]) -> None:
    by = {r.variant: r.median_ms for r in block}
    gpu = by.get("gpu fused adamw")
    tao = by.get("torchao offload")
    for r in block:
        ms = r.median_ms
        if not ms:
            continue
        if gpu:
            r.extra["x_gpu_only"] = round(ms / gpu, 3)
        if tao:
            r.extra["speedup_vs_torchao"] = round(tao / ms, 3)
    lines = [f"anchors: gpu fused adamw {ANCHOR_GPU_MS} ms, torchao {ANCHOR_TORCHAO_MS} ms "
             f"(offload_gradients {ANCHOR_TORCHAO_OG_MS} ms)"]
    if gpu:
        lines.append(f"gpu fused adamw here: {gpu:.1f} ms = {gpu / ANCHOR_GPU_MS:.2f}x the anchor")
    if tao:
        lines.append(f"torchao here: {tao:.1f} ms = {tao / ANCHOR_TORCHAO_MS:.2f}x the anchor")
    for r in block:
        if r.variant.startswith("superoffload") and r.median_ms:
            vs_gpu = r.median_ms / gpu if gpu else float("nan")
            vs_tao = tao / r.median_ms if tao else float("nan")
            lines.append(f"{r.variant}: {r.median_ms:.1f} ms = {vs_gpu:.2f}x GPU-only (goal <= {GOAL_VS_GPU}), "
                         f"{vs_tao:.2f}x faster than torchao (goal >= {GOAL_VS_TORCHAO}); vs anchors "
                         f"{r.median_ms / ANCHOR_GPU_MS:.2f}x / {ANCHOR_TORCHAO_MS / r.median_ms:.2f}x")
    print("[superoffload] " + "\n[superoffload] ".join(lines), flush=True)
