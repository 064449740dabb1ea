"""Suite `fp8_hf`: the model a user brings, trained in fp8 against bf16-mixed and Lightning's
"transformer-engine", side by side in one process.

A plain LightningModule around transformers' ``LlamaForCausalLM`` (random init; by default hidden 4096, 4 layers,
FFN 14336, 32/8 heads, vocabulary 32000, 2 x 4096 tokens: --shape), fused AdamW, ``Trainer(precision=...)`` or
``plugins=[precision(name)]``. Ratios against bf16-mixed eager and Lightning's TE; losses step by step against
bf16's. JSON is also written after every variant.

  (default)        --variants (see VARIANTS: bf16 anchors, Lightning's "transformer-engine", the TE and torchao
                   defaults, the TE layer choice and compile_blocks=False rows, fp8-auto with its choice and trial
                   figures); --loss-variants run --loss-steps (200) steps and are checked on the last-50 mean.
  --profile N      N more steps per variant under torch.profiler after the timed ones: the top-25 kernels by GPU
                   time, time by kernel kind (GEMM, attention, Inductor's fused kernels, optimizer, ...), and
                   torch._dynamo's graph / graph-break / recompile counters (where a whole-model-compiled step
                   spends its time against one with compiled blocks).
  --master-update  the optimizer step alone on the model's parameters: AdamW on bf16 weights, fp32 masters the
                   plain way, fp32 masters with the fused update.

    python benchmarks/run.py --suite fp8_hf --warmup 8 --iters 30
    python benchmarks/run.py --suite fp8_hf --variants bf16 lightning-te te-delayed auto --loss-variants te-delayed
    python benchmarks/run.py --suite fp8_hf --profile 3 --variants bf16-compiled ao-tensorwise-compiled
    python benchmarks/run.py --suite fp8_hf --master-update --warmup 5 --iters 20
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import time
import traceback
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from common import BenchContext, Result, StepTimer, peak_memory, reset_memory, sync, time_fn
from lightning_gh.precision import list_precisions, precision
from suites._fp8 import (
    LOSS_TOLERANCE,
    LossRecorder,
    Variant,
    error_text,
    fp8_layers,
    plugin_name,
    ratio,
    reset_backends,
)

DEFAULT_PRESETS = ["small"]  # unused: the model's shape comes from --shape
# hidden, layers, ffn, heads, kv_heads, vocab, batch, seq: a d=4096 Llama block stack, two 4096-token sequences
SHAPE = (4096, 4, 14336, 32, 8, 32000, 2, 4096)
LOSS_TAIL = 50  # the loss goal: the mean of the last 50 steps within LOSS_TOLERANCE of bf16-mixed's
# goals printed under the table (ratios > 1 are faster)
GOAL_OVER_LIGHTNING_TE = 1.05
GOAL_TE_OVER_BF16 = 1.53
GOAL_AO_EAGER_OVER_BF16 = 1.40
GOAL_AO_OVER_COMPILED = 1.30

_EAGER = {"compile_blocks": False}
_ALL_LAYERS = {"skip_head": False, "skip_first": False}
_LIKE_LIGHTNING = {"master_weights": False, "weights_dtype": torch.bfloat16, **_ALL_LAYERS}


def _fp8(label: str, name: str, compile: str = "none", **opts: Any) -> Variant:
    return Variant(label, plugin=(name, opts), compile=compile)


VARIANTS: dict[str, Variant] = {
    "bf16": Variant("bf16-mixed eager", precision="bf16-mixed"),
    "lightning-te": Variant("Lightning transformer-engine", precision="transformer-engine", weights="bf16"),
    "te-delayed": _fp8("fp8-te-delayed (default: fp32 masters, compile_blocks='auto')", "fp8-te-delayed"),
    "te-current": _fp8("fp8-te-current (default: fp32 masters, blocks compiled)", "fp8-te-current"),
    "te-delayed-head": _fp8("fp8-te-delayed, head in fp8 (skip_head=False)", "fp8-te-delayed", skip_head=False),
    "te-delayed-all": _fp8("fp8-te-delayed, head + first projection in fp8", "fp8-te-delayed", **_ALL_LAYERS),
    "te-delayed-eager": _fp8("fp8-te-delayed compile_blocks=False", "fp8-te-delayed", **_EAGER),
    "te-delayed-fused": _fp8("fp8-te-delayed, fused master update (one pass: bf16 grad -> fp32 master, moments, "
                             "bf16 weight)", "fp8-te-delayed", fused_master_update=True),
    "te-delayed-plain-masters": _fp8("fp8-te-delayed, plain master update (fp32 grad copy, AdamW, copy back)",
                                     "fp8-te-delayed", fused_master_update=False),
    "te-delayed-eager-head": _fp8("fp8-te-delayed compile_blocks=False, head in fp8", "fp8-te-delayed",
                                  **_EAGER, skip_head=False),
    "te-delayed-eager-first": _fp8("fp8-te-delayed compile_blocks=False, first projection in fp8", "fp8-te-delayed",
                                   **_EAGER, skip_first=False),
    "te-delayed-eager-all": _fp8("fp8-te-delayed compile_blocks=False, head + first in fp8", "fp8-te-delayed",
                                 **_EAGER, **_ALL_LAYERS),
    "te-delayed-eager-like-lightning": _fp8("fp8-te-delayed compile_blocks=False, no masters, bf16 weights, all "
                                            "layers", "fp8-te-delayed", **_EAGER, **_LIKE_LIGHTNING),
    "ao-tensorwise": _fp8("fp8-ao-tensorwise (default: blocks compiled)", "fp8-ao-tensorwise"),
    "ao-tensorwise-nocompile": _fp8("fp8-ao-tensorwise compile_blocks=False", "fp8-ao-tensorwise", **_EAGER),
    "bf16-blocks": Variant("bf16-mixed, blocks compiled", precision="bf16-mixed", compile="blocks"),
    "auto": _fp8("fp8-auto", "fp8-auto"),
    # fp8-auto takes layer-filter options only: its TE plugins' default is set around the run
    "auto-fused": Variant("fp8-auto, its TE plugins with fused_master_update=True", plugin=("fp8-auto", {}),
                          options={"te_default": ("fused_master_update", True)}),
    "ao-rowwise": _fp8("fp8-ao-rowwise (default: blocks compiled)", "fp8-ao-rowwise"),
    "bf16-compiled": Variant("bf16-mixed, model compiled", precision="bf16-mixed", compile="model"),
    "ao-tensorwise-compiled": _fp8("fp8-ao-tensorwise, model compiled", "fp8-ao-tensorwise", "model"),
    # transformers materialises the causal mask under torch.compile (no flash attention) unless the SDPA path is kept
    "bf16-compiled-sdpa": Variant("bf16-mixed, model compiled, keep_causal_sdpa (SDPA's causal flash path)",
                                  precision="bf16-mixed", compile="model-sdpa"),
    "ao-tensorwise-compiled-nosdpa": _fp8("fp8-ao-tensorwise, model compiled, causal_sdpa=False (the mask "
                                          "transformers builds under compile)", "fp8-ao-tensorwise", "model",
                                          causal_sdpa=False),
    "ao-tensorwise-compiled-head": _fp8("fp8-ao-tensorwise, model compiled, head in fp8 (skip_head=False)",
                                        "fp8-ao-tensorwise", "model", skip_head=False),
    "ao-tensorwise-compiled-all": _fp8("fp8-ao-tensorwise, model compiled, head + first projection in fp8",
                                       "fp8-ao-tensorwise", "model", **_ALL_LAYERS),
    "ao-tensorwise-compiled-fastaccum": _fp8("fp8-ao-tensorwise, model compiled, fast accumulation in the backward "
                                             "GEMMs too", "fp8-ao-tensorwise", "model", config="fast-accum"),
    "ao-tensorwise-sdpa": _fp8("fp8-ao-tensorwise (default: blocks compiled), keep_causal_sdpa",
                               "fp8-ao-tensorwise", "none-sdpa"),
}
DEFAULT_VARIANTS = ("bf16", "ao-tensorwise", "ao-tensorwise-nocompile", "bf16-blocks", "auto", "bf16-compiled",
                    "ao-tensorwise-compiled")


def add_arguments(ap) -> None:
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS))
    ap.add_argument("--loss-variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="these variants (and bf16) run --loss-steps steps; their last-50 mean loss is compared with "
                         "bf16-mixed's")
    ap.add_argument("--loss-steps", type=int, default=200, help="steps of the --loss-variants runs")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--data", default="zipf", choices=["zipf", "uniform"],
                    help="token ids drawn from a Zipf(1.1) distribution (the loss falls) or uniformly")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after the timed steps, run STEPS more under torch.profiler (not timed) and record the "
                         "top-25 kernels by GPU time, time by kernel kind, and torch._dynamo's graph, graph-break and "
                         "recompile counters for each variant")
    ap.add_argument("--shape", type=int, nargs=8, default=list(SHAPE), metavar="N",
                    help="hidden layers ffn heads kv_heads vocab batch seq")
    ap.add_argument("--master-update", action="store_true",
                    help="the optimizer step alone on the model's parameters: AdamW on bf16 weights, fp32 masters "
                         "the plain way, fp32 masters with the fused update")


def _param_shapes(shape: list[int]) -> list[tuple[int, ...]]:
    """The parameter shapes of the model (untied embedding and head, RMSNorm weights)."""
    hidden, layers, ffn, heads, kv, vocab, _, _ = shape
    kv_dim = hidden * kv // heads
    block = [(hidden, hidden), (kv_dim, hidden), (kv_dim, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
             (hidden, ffn), (hidden,), (hidden,)]
    return [(vocab, hidden), *block * layers, (hidden,), (vocab, hidden)]


def _master_step(kind: str, shapes: list[tuple[int, ...]], ctx: BenchContext) -> Callable[[], None]:
    """One optimizer step over bf16 parameters of ``shapes`` with fixed gradients, updated the ``kind`` way."""
    from lightning_gh.precision.fused_master import FusedMasterAdam
    from lightning_gh.precision.master import MasterWeights

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=ctx.device, generator=gen).to(torch.bfloat16)) for s in shapes]
    grads = [torch.randn(s, device=ctx.device, generator=gen).to(torch.bfloat16) * 1e-3 for s in shapes]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=ctx.cuda)
    masters = None if kind == "bf16-adamw" else MasterWeights(opt)
    fused = FusedMasterAdam(masters) if kind == "fused" else None

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        if fused is not None:
            fused.step()
            opt.step()
            return
        if masters is not None:
            masters.grads_to_master()
        opt.step()
        opt.zero_grad()
        if masters is not None:
            masters.master_to_model()

    return step


def _run_master_update(ctx: BenchContext) -> list[Result]:
    """The optimizer step alone on the model's parameters: how the fp32 masters are updated, side by side.

    ``bf16-adamw``: ``AdamW(fused=True)`` on the bf16 weights (Lightning's ``"transformer-engine"``, no masters);
    ``plain``: fp32 masters, gradient copy + ``AdamW(fused=True)`` + copy back; ``fused``: ``FusedMasterAdam``.
    """
    shapes = _param_shapes(list(ctx.args.shape))
    n = sum(math.prod(s) for s in shapes)
    rows = []
    for kind in ("bf16-adamw", "plain", "fused"):
        reset_memory(ctx.device)
        r = Result(ctx.suite, "hf-llama-params", f"master update: {kind}", None)
        r.extra.update({"params": n})
        try:
            step = _master_step(kind, shapes, ctx)
            t0 = time.perf_counter()
            step()  # the first step (the compile for "fused")
            sync(ctx.device)
            r.extra["first_step_s"] = round(time.perf_counter() - t0, 2)
            r.timing = time_fn(step, ctx.device, ctx.warmup, ctx.iters)
            r.peak_mem_bytes = peak_memory(ctx.device)
            step = None
        except Exception as e:
            r.error = error_text(e)
            traceback.print_exc()
        rows.append(r)
        print(f"[fp8_hf master-update] {kind}: " + (f"{r.median_ms:.2f} ms (p10-p90 {r.timing.p10_ms:.2f}-"
                                                   f"{r.timing.p90_ms:.2f}), first step {r.extra['first_step_s']} s, "
                                                   f"peak {(r.peak_mem_bytes or 0) / 2**30:.1f} GiB, {n / 1e9:.2f} G "
                                                   "params" if r.timing else f"error {r.error}"), flush=True)
    return rows


class HFCausalLM(L.LightningModule):
    """What a new user writes: transformers' ``LlamaForCausalLM`` in a plain LightningModule, fused AdamW.

    ``compile``: ``"none"``, ``"blocks"`` (each decoder layer ``.compile()``d in place in ``configure_model``: the fair
    bf16 anchor for regional compilation) or ``"model"`` (``torch.compile`` of the whole HF model); ``"model-sdpa"``
    and ``"none-sdpa"``: the same with ``keep_causal_sdpa`` applied (what the fp8-ao plugins do on a compiled model).
    """

    def __init__(self, config: Any, compile: str = "none", lr: float = 3e-4) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config)
        self.compile_how = compile
        self.lr = lr

    def configure_model(self) -> None:
        if self.compile_how.endswith("-sdpa"):
            from lightning_gh.precision.hf_sdpa import keep_causal_sdpa

            keep_causal_sdpa(self.model)
        if self.compile_how == "blocks":
            for layer in self.model.model.layers:
                layer.compile()
        elif self.compile_how in ("model", "model-sdpa"):
            if not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
                self.model = torch.compile(self.model)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.device.type == "cuda")


def _hf_config(shape: list[int]) -> Any:
    from transformers import LlamaConfig

    hidden, layers, ffn, heads, kv, vocab, _, seq = shape
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                       max_position_embeddings=seq, attn_implementation="sdpa")


def _loss_keys(args) -> set[str]:
    """The variants run --loss-steps long (bf16 always among them: the reference curve)."""
    keys = set(args.loss_variants or ())
    return keys | {"bf16"} if keys else set()


def _data(shape: list[int], steps: int, kind: str = "zipf") -> torch.utils.data.DataLoader:
    """``steps`` batches of token ids, the same for every variant.

    ``uniform``: uniform random ids (the loss stays near ln(vocab): a speed run only). ``zipf``: ids drawn from a
    Zipf(1.1) distribution over the vocabulary, so the loss falls from ln(vocab) towards the distribution's entropy
    as the model learns the frequencies: a loss curve to compare recipes on.
    """
    *_, vocab, batch, seq = shape
    g = torch.Generator().manual_seed(0)
    if kind == "uniform":
        tokens = torch.randint(vocab, (steps * batch, seq), generator=g)
    else:
        probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
        tokens = torch.multinomial(probs / probs.sum(), steps * batch * seq, replacement=True, generator=g)
        tokens = tokens.view(steps * batch, seq)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=batch, shuffle=False)


def _run_variant(ctx: BenchContext, key: str, shape: list[int]) -> Result:
    variant = VARIANTS[key]
    label = variant.label
    hidden, layers, ffn, heads, kv, vocab, batch, seq = shape
    tokens = batch * seq
    flops = 6 * tokens * (layers * (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * ffn)
                          + hidden * vocab) + 12 * layers * batch * seq * seq * hidden  # causal attn ~ half
    r = Result(ctx.suite, "hf-llama", label, None, tokens, float(flops))
    r.extra.update({"key": key, "compiled": variant.compile})
    reset_memory(ctx.device)
    model = trainer = None
    stack = contextlib.ExitStack()
    try:
        L.seed_everything(0, verbose=False)
        with torch.device(ctx.device):
            model = HFCausalLM(_hf_config(shape), compile=variant.compile, lr=ctx.args.lr)
        kwargs: dict[str, Any] = {}
        if variant.precision == "bf16-mixed":
            kwargs["precision"] = "bf16-mixed" if ctx.cuda else "32-true"
        elif variant.precision is not None:
            kwargs["precision"] = variant.precision
        else:
            name, opts = variant.plugin
            o = dict(opts)
            if o.get("config") == "fast-accum":
                o["config"] = _ao_fast_accum_config()
            if not ctx.cuda and name.startswith("fp8-ao"):
                o["emulate"] = True  # the CPU smoke run: emulated fp8, functional only
            kwargs["plugins"] = [precision(name, **o)]
        if "te_default" in variant.options:
            stack.enter_context(_te_default(*variant.options["te_default"]))
        rec = LossRecorder()
        steps = ctx.warmup + ctx.iters
        if key in _loss_keys(ctx.args):
            steps = max(steps, ctx.args.loss_steps)  # a longer run: its loss curve is checked against bf16's
        r.extra["steps"] = steps
        profile_steps = max(0, ctx.args.profile)
        timer = _TimedSteps(ctx.warmup, steps)  # the profiled steps after `steps` are not timed
        callbacks: list[Callback] = [timer, rec]
        prof = None
        if profile_steps:
            prof = _KernelProfile(steps, profile_steps)
            callbacks.append(prof)
            torch._dynamo.utils.counters.clear()
        trainer = L.Trainer(accelerator="gpu" if ctx.cuda else "cpu", devices=1, max_steps=steps + profile_steps,
                            limit_val_batches=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)
        t0 = time.perf_counter()
        trainer.fit(model, _data(shape, steps + profile_steps, ctx.args.data))
        if prof is not None:
            r.extra["profile"] = prof.report()
            r.extra["dynamo"] = _dynamo_counters()
            print(_profile_text(label, r.extra["profile"], r.extra["dynamo"]), flush=True)
        r.extra["fit_s"] = round(time.perf_counter() - t0, 1)
        r.timing = timer.timing()
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra["losses"] = rec.losses[:steps]
        r.extra["fp8_layers"] = fp8_layers(trainer)
        r.extra["plugin"] = plugin_name(trainer)
        r.extra["regional"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        auto = next((p for p in kwargs.get("plugins", []) if hasattr(p, "choice")), None)
        if auto is not None and auto.choice is not None:  # fp8-auto: what it chose and the figures it used
            r.extra["auto_choice"] = auto.choice.name
            r.extra["auto_reason"] = auto.choice.reason
            r.extra["auto_trial_ms"] = dict(auto.timings)
    except Exception as e:  # a missing backend, an OOM or a compile failure is a result, not a crash
        r.error = error_text(e)
        traceback.print_exc()
    finally:
        stack.close()
        del model, trainer
        reset_backends()
        reset_memory(ctx.device)
    print(f"[fp8_hf] {label}: " + (f"{r.median_ms:.2f} ms, peak {(r.peak_mem_bytes or 0) / 2**30:.1f} GiB, "
                                   f"plugin {r.extra.get('plugin')}, fp8 layers {r.extra.get('fp8_layers')}"
                                   if r.median_ms else f"error {r.error}"), flush=True)
    return r


def _ao_fast_accum_config() -> Any:
    """torchao's tensorwise recipe with fast (non-split) accumulation in the two backward GEMMs as well."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    fast = Float8GemmConfig(use_fast_accum=True)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), gemm_config_grad_input=fast,
                               gemm_config_grad_weight=fast)


class _TimedSteps(StepTimer):
    """``StepTimer`` over the first ``last`` steps only (the steps after them are profiled, not timed)."""

    def __init__(self, warmup: int, last: int) -> None:
        super().__init__(warmup)
        self.last = last

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx < self.last:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx < self.last:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


# Kernel kinds for the profile's split (lower-case substrings of kernel names; first match wins). Inductor's
# kernels come first: a fused float8 cast is named after the op it feeds ("triton_poi_fused__scaled_mm_...").
_KERNEL_KINDS = (
    ("triton (fused by Inductor)", ("triton",)),
    ("attention", ("flash", "fmha", "attention", "efficient_attention", "cutlassf", "cudnn_sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "scaled_mm", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("embedding / index", ("embedding", "index", "scatter", "gather")),
    ("loss", ("nll", "softmax", "cross_entropy")),
)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in _KERNEL_KINDS if any(k in low for k in keys)), "other")


class _KernelProfile(Callback):
    """``torch.profiler`` over ``steps`` steps from batch ``start``: GPU time by kernel name and by kind, per step.

    On a machine without CUDA it records CPU operators instead (a functional check of the plumbing).
    """

    def __init__(self, start: int, steps: int, top: int = 25) -> None:
        self.start, self.steps, self.top = start, steps, top
        self._prof: Any = None
        self._cuda = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.start:
            from torch.profiler import ProfilerActivity, profile

            self._cuda = pl_module.device.type == "cuda"
            sync(pl_module.device)
            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if self._cuda else [ProfilerActivity.CPU]
            self._prof = profile(activities=acts)
            self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._prof is not None and batch_idx == self.start + self.steps - 1:
            sync(pl_module.device)
            self._prof.__exit__(None, None, None)

    def report(self) -> dict[str, Any]:
        if self._prof is None:
            return {}
        by_name: dict[str, list[float]] = {}
        for e in self._prof.events():
            on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
            # GPU-side user annotations (e.g. "Optimizer.step#AdamW.step") span kernels counted on their own
            if self._cuda != on_gpu or getattr(e, "is_user_annotation", False) or e.name.startswith("Optimizer."):
                continue
            us = e.time_range.elapsed_us() if on_gpu else e.self_cpu_time_total
            entry = by_name.setdefault(e.name, [0.0, 0])
            entry[0] += us
            entry[1] += 1
        total = sum(v[0] for v in by_name.values()) or 1.0
        kinds: dict[str, float] = {}
        for name, (us, _) in by_name.items():
            kinds[_kernel_kind(name)] = kinds.get(_kernel_kind(name), 0.0) + us
        rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: self.top]
        per = lambda us: round(us / self.steps / 1e3, 3)  # noqa: E731  (ms per step)
        return {"steps": self.steps, "device": "cuda" if self._cuda else "cpu",
                "busy_ms_per_step": per(total),
                "kinds_ms_per_step": {k: per(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                "top": [{"name": n[:160], "ms_per_step": per(us), "calls_per_step": c / self.steps,
                         "share": round(us / total, 4), "kind": _kernel_kind(n)} for n, (us, c) in rows]}


def _dynamo_counters() -> dict[str, Any]:
    """torch._dynamo's counters after a fit: graphs captured, graph breaks (by reason), recompiles."""
    from torch._dynamo.utils import counters

    keep = ("stats", "graph_break", "recompiles", "frames", "unimplemented")
    return {k: {str(kk): vv for kk, vv in counters[k].items()} for k in keep if k in counters and counters[k]}


def _profile_text(label: str, prof: dict[str, Any], dyn: dict[str, Any]) -> str:
    if not prof:
        return f"[fp8 hf profile] {label}: no profile"
    lines = [f"\n#### profile: {label} ({prof['steps']} steps, {prof['device']}; ms per step)",
             f"busy {prof['busy_ms_per_step']} ms/step; by kind: " +
             ", ".join(f"{k} {v}" for k, v in prof["kinds_ms_per_step"].items()),
             "| kernel | kind | ms/step | calls/step | share |", "|---|---|---:|---:|---:|"]
    lines += [f"| `{t['name'][:110]}` | {t['kind']} | {t['ms_per_step']} | {t['calls_per_step']:g} | "
              f"{t['share']:.1%} |" for t in prof["top"]]
    lines.append(f"dynamo: {dyn}")
    return "\n".join(lines)


@contextlib.contextmanager
def _te_default(option: str, value: Any):
    """``TEFloat8Precision``'s default for a keyword-only ``option`` set to ``value`` for the ``with`` block."""
    from lightning_gh.precision.te import TEFloat8Precision

    defaults = TEFloat8Precision.__init__.__kwdefaults__
    old = defaults[option]
    defaults[option] = value
    try:
        yield
    finally:
        defaults[option] = old


def _tail_gap(ref: list[float], losses: list[float], n: int) -> float | None:
    """Relative gap between the means of the last ``n`` losses (``None`` when either run is shorter)."""
    if len(ref) < n or len(losses) < n or len(ref) != len(losses):
        return None
    a, b = statistics.fmean(ref[-n:]), statistics.fmean(losses[-n:])
    return abs(a - b) / abs(a)


def _summary_hf(rows: list[Result]) -> str:
    by_key = {r.extra["key"]: r for r in rows}
    base = by_key.get("bf16")
    blocks = by_key.get("bf16-blocks")
    compiled = by_key.get("bf16-compiled")
    lte = by_key.get("lightning-te")
    ms = lambda r: r.median_ms if r is not None else None  # noqa: E731
    lines = ["\n### fp8 summary: HF LlamaForCausalLM, full Lightning steps (median ms; ratio > 1 is faster)",
             "| variant | plugin | fp8 layers | steps | ms | vs bf16 eager | vs Lightning TE | vs bf16 blocks compiled | "
             f"vs bf16 compiled | peak GiB | max rel loss gap | last-{LOSS_TAIL} mean gap |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = base.extra.get("losses") if base is not None and base.timing else None
    for r in rows:
        if not r.median_ms:
            lines.append(f"| {r.variant} | - | - | - | error: {r.error} | | | | | | | |")
            continue
        gap = tail = "-"
        losses = r.extra.get("losses") or []
        if ref and losses and r is not base:
            rel = [abs(a - b) / abs(a) for a, b in zip(ref, losses)]
            gap = f"{max(rel):.2e}"
            t = _tail_gap(ref, losses, LOSS_TAIL)
            if t is not None:
                r.extra["loss_tail_rel_gap"] = t
                tail = f"{t:.2e}"
        peak = f"{r.peak_mem_bytes / 2**30:.1f}" if r.peak_mem_bytes else "-"
        lines.append(f"| {r.variant} | {r.extra.get('plugin')} | {r.extra.get('fp8_layers')} | "
                     f"{r.extra.get('steps', '-')} | {r.median_ms:.2f} | {ratio(ms(base), r.median_ms)} | "
                     f"{ratio(ms(lte), r.median_ms)} | {ratio(ms(blocks), r.median_ms)} | "
                     f"{ratio(ms(compiled), r.median_ms)} | {peak} | {gap} | {tail} |")
    for r in rows:
        if r.extra.get("auto_choice") is not None or r.extra.get("auto_reason"):
            lines.append(f"fp8-auto chose {r.extra.get('auto_choice')}: {r.extra.get('auto_reason')}")

    def goal(text: str, x: float | None, target: float) -> None:
        if x is not None:
            lines.append(f"goal {text}: {x:.3f}x -> {'MET' if x >= target else 'NOT MET'} (>= {target:.2f}x)")

    for key in ("te-delayed", "auto"):
        r = by_key.get(key)
        if r is not None and r.median_ms:
            if ms(lte):
                goal(f"{r.variant} over Lightning transformer-engine", ms(lte) / r.median_ms, GOAL_OVER_LIGHTNING_TE)
            if ms(base):
                goal(f"{r.variant} over bf16-mixed", ms(base) / r.median_ms, GOAL_TE_OVER_BF16)
    ao = by_key.get("ao-tensorwise")
    if ao is not None and ao.median_ms and ms(base):
        goal("fp8-ao-tensorwise on the eager model over bf16-mixed", ms(base) / ao.median_ms, GOAL_AO_EAGER_OVER_BF16)
    aoc = by_key.get("ao-tensorwise-compiled")
    if aoc is not None and aoc.median_ms and ms(compiled):
        goal("fp8-ao-tensorwise on a compiled model over compiled bf16", ms(compiled) / aoc.median_ms,
             GOAL_AO_OVER_COMPILED)
    # The same goal against the faster compiled bf16: the user's compile with SDPA's causal path kept for bf16 too.
    fast = [r.median_ms for r in (compiled, by_key.get("bf16-compiled-sdpa")) if r is not None and r.median_ms]
    for key in ("ao-tensorwise-compiled", "ao-tensorwise-compiled-head", "ao-tensorwise-compiled-all",
                "ao-tensorwise-compiled-fastaccum", "ao-tensorwise-compiled-nosdpa"):
        r = by_key.get(key)
        if r is not None and r.median_ms and len(fast) == 2:
            goal(f"{r.variant} over the faster compiled bf16 ({min(fast):.2f} ms)", min(fast) / r.median_ms,
                 GOAL_AO_OVER_COMPILED)
    if base is not None and base.peak_mem_bytes:
        for r in rows:
            if r is not base and r.peak_mem_bytes and r.extra["key"] in ("te-delayed", "ao-tensorwise", "auto"):
                ok = r.peak_mem_bytes <= base.peak_mem_bytes
                lines.append(f"goal {r.variant} peak memory <= bf16-mixed's: {r.peak_mem_bytes / 2**30:.1f} vs "
                             f"{base.peak_mem_bytes / 2**30:.1f} GiB -> {'MET' if ok else 'NOT MET'}")
    for r in rows:
        t = r.extra.get("loss_tail_rel_gap")
        if t is not None and r.extra.get("steps", 0) >= 200:
            lines.append(f"goal {r.variant} loss over {r.extra['steps']} steps, last-{LOSS_TAIL} mean within 1% "
                         f"of bf16-mixed: {t:.2%} -> {'MET' if t <= LOSS_TOLERANCE else 'NOT MET'}")
    return "\n".join(lines)


def run(ctx: BenchContext) -> list[Result]:
    if ctx.args.master_update:
        return _run_master_update(ctx)
    shape = list(ctx.args.shape)
    print(f"[fp8_hf] shape={shape} variants={ctx.args.variants}\n[fp8_hf] availability: {list_precisions()}",
          flush=True)
    rows: list[Result] = []
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    for key in ctx.args.variants:
        rows.append(_run_variant(ctx, key, shape))
        partial = [{**r.row(), "samples_ms": r.timing.samples_ms if r.timing else None} for r in rows]
        (ctx.out_dir / "fp8_hf_partial.json").write_text(json.dumps(partial, indent=1, default=str))
        print(_summary_hf(rows), flush=True)
    return rows
