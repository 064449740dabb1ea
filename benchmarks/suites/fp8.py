"""Suite `fp8`: every fp8 precision name against bf16-mixed and Lightning's own TransformerEnginePrecision.

Three modes, each measured side by side in one process:

  (default)      full Lightning training steps (forward + backward + fused AdamW, fp32 master weights unless a
                 variant says otherwise) for each variant; ratios against bf16-mixed eager (the table's
                 speedup_vs_first), against bf16-mixed compiled and against Lightning's "transformer-engine".
  --check-loss   the same variants trained --loss-steps steps from the same seed on the same batches; the loss
                 curves are compared with bf16-mixed eager (10-step moving average, tolerance 1%).
  --hf           the model a user brings: a plain LightningModule around transformers' LlamaForCausalLM (random
                 init, the issue-18 configuration by default), Trainer(precision=...) or plugins=[precision(name)],
                 fused AdamW; variants --hf-variants (see HF_VARIANTS: bf16 anchors, Lightning's
                 "transformer-engine", the TE and torchao defaults, the TE layer choice and compile_blocks=False
                 rows, fp8-auto with its choice and trial figures); ratios against bf16-mixed eager and Lightning's
                 TE, losses step by step against bf16; --hf-loss-variants run --hf-loss-steps (200) steps and are
                 checked on the last-50 mean (the issue-18 loss goal). JSON is also written after every variant.
  --hf-profile N with --hf: N more steps per variant under torch.profiler after the timed ones: the top-25 kernels
                 by GPU time, time by kernel kind (GEMM, attention, Inductor's fused kernels, optimizer, ...), and
                 torch._dynamo's graph / graph-break / recompile counters (issue 18: where a whole-model-compiled
                 step spends its time against one with compiled blocks; --hf-variants bf16-compiled bf16-blocks
                 bf16-compiled-sdpa ao-tensorwise-compiled ao-tensorwise-compiled-nosdpa ao-tensorwise ...)
  --gemm         the GEMM cross-over behind the layer filter's min_dim rule: one Linear, forward + backward, bf16
                 against torchao float8 (compiled) and Transformer Engine fp8, for square and Llama shapes.

Variants (pick with --variants; bf16, bf16-compiled and, when a TE variant runs, lightning-te always run):
  bf16                 Trainer(precision="bf16-mixed"), eager                          (the ratio base)
  bf16-compiled        the same with the decoder and the loss under torch.compile (every "compiled" variant
                       compiles both)
  lightning-te         Trainer(precision="transformer-engine"): Lightning's plugin, bf16 weights, every Linear,
                       DelayedScaling, eager (anchor: 72.4 ms vs 114.2 ms bf16-mixed on large, 1.58x)
  te-delayed, te-current, te-block          lgh.precision("fp8-te-*"), default filter, fp32 master weights, eager
  te-delayed-compiled, te-current-compiled  the same on a compiled model (TE layers run eagerly between graphs)
  te-current-traced    compiled, and torch.compile traces the TE layers (compile_te_layers=True)
  te-delayed-matched   fp8-te-delayed configured like Lightning's: bf16 weights, head and first layer in fp8, eager
  te-current-matched-compiled   the same with current scaling on a compiled model
  ao-tensorwise, ao-rowwise, ao-rowwise-gw-hp   lgh.precision("fp8-ao-*") on a compiled model
  ao-tensorwise-all    ao-tensorwise with the head and first layer in fp8 too (what the 1.31x anchor converted)
  ao-tensorwise-eager  ao-tensorwise on an uncompiled model (the plugin compiles its blocks by default)
  auto                 lgh.precision("fp8-auto") on a compiled model (it should pick fp8-ao-tensorwise)
  auto-eager           lgh.precision("fp8-auto") on an uncompiled model (it should pick fp8-te-delayed)
  te-delayed-noblocks, te-delayed-nomasters, te-delayed-plainmasters   fp8-te-delayed with one default turned off
                       (compile_blocks, master_weights, fused_master_update): what each default costs here

    python benchmarks/run.py --suite fp8 --preset large --variants te-delayed te-current ...
    python benchmarks/run.py --suite fp8 --preset large --check-loss --loss-steps 120
    python benchmarks/run.py --suite fp8 --gemm
    python benchmarks/run.py --suite fp8 --hf --warmup 8 --iters 30
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from common import BenchContext, Result, StepTimer, lightning_steps, peak_memory, reset_memory, sync, time_fn

from lightning_gh.precision import LayerFilter, list_precisions, precision
from lightning_gh.demo import LlamaLM, preset

DEFAULT_PRESETS = ["large", "medium"]
LOSS_TOLERANCE = 0.01  # relative, on the 10-step moving average of the training loss

# Anchors from ../shared/gpu/README.md (H200, 2026-11), printed next to this run's figures.
ANCHORS = {
    "large": {"lightning_bf16_ms": 114.2, "lightning_te_ms": 72.4, "ao_tensorwise_fwd_bwd_x": 1.31,
              "ao_rowwise_fwd_bwd_x": 1.08},
}


@dataclass
class Variant:
    label: str
    compile: bool = False
    precision: str | None = None  # a Trainer(precision=...) string, or None when `plugin` is used
    plugin: tuple[str, dict[str, Any]] | None = None
    weights_note: str = "fp32 master"
    tags: set[str] = field(default_factory=set)


MATCHED = dict(weights_dtype=torch.bfloat16, skip_head=False, skip_first=False)
VARIANTS: dict[str, Variant] = {
    "bf16": Variant("bf16-mixed eager", precision="bf16-mixed"),
    "bf16-compiled": Variant("bf16-mixed compiled", compile=True, precision="bf16-mixed"),
    "lightning-te": Variant("Lightning transformer-engine", precision="transformer-engine", weights_note="bf16",
                            tags={"te"}),
    "te-delayed": Variant("fp8-te-delayed", plugin=("fp8-te-delayed", {}), tags={"te"}),
    "te-current": Variant("fp8-te-current", plugin=("fp8-te-current", {}), tags={"te"}),
    "te-block": Variant("fp8-te-block", plugin=("fp8-te-block", {}), tags={"te"}),
    "te-delayed-compiled": Variant("fp8-te-delayed compiled", True, plugin=("fp8-te-delayed", {}), tags={"te"}),
    "te-current-compiled": Variant("fp8-te-current compiled", True, plugin=("fp8-te-current", {}), tags={"te"}),
    "te-current-traced": Variant("fp8-te-current compiled+traced", True,
                                 plugin=("fp8-te-current", {"compile_te_layers": True}), tags={"te"}),
    "te-delayed-matched": Variant("fp8-te-delayed bf16w all-layers", plugin=("fp8-te-delayed", MATCHED),
                                  weights_note="bf16", tags={"te"}),
    "te-current-matched-compiled": Variant("fp8-te-current bf16w all-layers compiled", True,
                                           plugin=("fp8-te-current", MATCHED), weights_note="bf16", tags={"te"}),
    "ao-tensorwise": Variant("fp8-ao-tensorwise compiled", True, plugin=("fp8-ao-tensorwise", {}), tags={"ao"}),
    "ao-rowwise": Variant("fp8-ao-rowwise compiled", True, plugin=("fp8-ao-rowwise", {}), tags={"ao"}),
    "ao-rowwise-gw-hp": Variant("fp8-ao-rowwise-gw-hp compiled", True, plugin=("fp8-ao-rowwise-gw-hp", {}),
                                tags={"ao"}),
    "ao-tensorwise-all": Variant("fp8-ao-tensorwise all-layers compiled", True,
                                 plugin=("fp8-ao-tensorwise", {"skip_head": False, "skip_first": False}), tags={"ao"}),
    "ao-tensorwise-eager": Variant("fp8-ao-tensorwise eager", plugin=("fp8-ao-tensorwise", {}), tags={"ao"}),
    "auto": Variant("fp8-auto compiled", True, plugin=("fp8-auto", {})),
    "auto-eager": Variant("fp8-auto eager", plugin=("fp8-auto", {})),
    # which of the TE defaults costs what on a preset (compiled blocks, fp32 masters, their fused update)
    "te-delayed-noblocks": Variant("fp8-te-delayed compile_blocks=False", plugin=("fp8-te-delayed",
                                                                                  {"compile_blocks": False}),
                                   tags={"te"}),
    "te-delayed-nomasters": Variant("fp8-te-delayed master_weights=False", plugin=("fp8-te-delayed",
                                                                                   {"master_weights": False}),
                                    tags={"te"}),
    "te-delayed-plainmasters": Variant("fp8-te-delayed fused_master_update=False",
                                       plugin=("fp8-te-delayed", {"fused_master_update": False}), tags={"te"}),
}
BASES = ("bf16", "bf16-compiled")

# --hf: the issue-18 model (hidden 4096, 4 layers, FFN 14336, 32/8 heads, vocab 32000, 2x4096 tokens)
HF_SHAPE = (4096, 4, 14336, 32, 8, 32000, 2, 4096)
_EAGER = {"compile_blocks": False}
_ALL_LAYERS = {"skip_head": False, "skip_first": False}
_LIKE_LIGHTNING = {"master_weights": False, "weights_dtype": torch.bfloat16, **_ALL_LAYERS}
HF_VARIANTS = {
    # key: (label, precision string or plugin name, plugin options, how the model is compiled)
    "bf16": ("bf16-mixed eager", "bf16-mixed", None, "none"),
    "lightning-te": ("Lightning transformer-engine", "transformer-engine", None, "none"),
    "te-delayed": ("fp8-te-delayed (default: fp32 masters, compile_blocks='auto')", "fp8-te-delayed", {}, "none"),
    "te-current": ("fp8-te-current (default: fp32 masters, blocks compiled)", "fp8-te-current", {}, "none"),
    "te-delayed-head": ("fp8-te-delayed, head in fp8 (skip_head=False)", "fp8-te-delayed",
                        {"skip_head": False}, "none"),
    "te-delayed-all": ("fp8-te-delayed, head + first projection in fp8", "fp8-te-delayed", _ALL_LAYERS, "none"),
    "te-delayed-eager": ("fp8-te-delayed compile_blocks=False", "fp8-te-delayed", _EAGER, "none"),
    "te-delayed-fused": ("fp8-te-delayed, fused master update (one pass: bf16 grad -> fp32 master, moments, bf16 "
                         "weight)", "fp8-te-delayed", {"fused_master_update": True}, "none"),
    "te-delayed-plain-masters": ("fp8-te-delayed, plain master update (fp32 grad copy, AdamW, copy back)",
                                 "fp8-te-delayed", {"fused_master_update": False}, "none"),
    "te-delayed-eager-head": ("fp8-te-delayed compile_blocks=False, head in fp8", "fp8-te-delayed",
                              {**_EAGER, "skip_head": False}, "none"),
    "te-delayed-eager-first": ("fp8-te-delayed compile_blocks=False, first projection in fp8", "fp8-te-delayed",
                               {**_EAGER, "skip_first": False}, "none"),
    "te-delayed-eager-all": ("fp8-te-delayed compile_blocks=False, head + first in fp8", "fp8-te-delayed",
                             {**_EAGER, **_ALL_LAYERS}, "none"),
    "te-delayed-eager-like-lightning": ("fp8-te-delayed compile_blocks=False, no masters, bf16 weights, all layers",
                                        "fp8-te-delayed", {**_EAGER, **_LIKE_LIGHTNING}, "none"),
    "ao-tensorwise": ("fp8-ao-tensorwise (default: blocks compiled)", "fp8-ao-tensorwise", {}, "none"),
    "ao-tensorwise-nocompile": ("fp8-ao-tensorwise compile_blocks=False", "fp8-ao-tensorwise",
                                {"compile_blocks": False}, "none"),
    "bf16-blocks": ("bf16-mixed, blocks compiled", "bf16-mixed", None, "blocks"),
    "auto": ("fp8-auto", "fp8-auto", {}, "none"),
    "auto-fused": ("fp8-auto, its TE plugins with fused_master_update=True", "fp8-auto", {}, "none"),
    "ao-rowwise": ("fp8-ao-rowwise (default: blocks compiled)", "fp8-ao-rowwise", {}, "none"),
    "bf16-compiled": ("bf16-mixed, model compiled", "bf16-mixed", None, "model"),
    "ao-tensorwise-compiled": ("fp8-ao-tensorwise, model compiled", "fp8-ao-tensorwise", {}, "model"),
    # issue 18, the compiled-model goal: transformers materialises the causal mask under torch.compile (no flash)
    "bf16-compiled-sdpa": ("bf16-mixed, model compiled, keep_causal_sdpa (SDPA's causal flash path)", "bf16-mixed",
                           None, "model-sdpa"),
    "ao-tensorwise-compiled-nosdpa": ("fp8-ao-tensorwise, model compiled, causal_sdpa=False (the mask transformers "
                                      "builds under compile)", "fp8-ao-tensorwise", {"causal_sdpa": False}, "model"),
    "ao-tensorwise-compiled-head": ("fp8-ao-tensorwise, model compiled, head in fp8 (skip_head=False)",
                                    "fp8-ao-tensorwise", {"skip_head": False}, "model"),
    "ao-tensorwise-compiled-all": ("fp8-ao-tensorwise, model compiled, head + first projection in fp8",
                                   "fp8-ao-tensorwise", _ALL_LAYERS, "model"),
    "ao-tensorwise-compiled-fastaccum": ("fp8-ao-tensorwise, model compiled, fast accumulation in the backward GEMMs "
                                         "too", "fp8-ao-tensorwise", {"config": "fast-accum"}, "model"),
    "ao-tensorwise-sdpa": ("fp8-ao-tensorwise (default: blocks compiled), keep_causal_sdpa", "fp8-ao-tensorwise", {},
                           "none-sdpa"),
}
HF_DEFAULT = ("bf16", "ao-tensorwise", "ao-tensorwise-nocompile", "bf16-blocks", "auto", "bf16-compiled",
              "ao-tensorwise-compiled")
DEFAULT_VARIANTS = [k for k in VARIANTS if k not in ("te-current-traced", "ao-tensorwise-eager")]


def add_arguments(ap) -> None:
    ap.add_argument("--variants", nargs="+", default=None, choices=sorted(VARIANTS),
                    help="variants to run (bf16, bf16-compiled and, with TE variants, lightning-te always run)")
    ap.add_argument("--check-loss", action="store_true", help="compare loss curves with bf16-mixed instead of timing")
    ap.add_argument("--loss-steps", type=int, default=120, help="steps per variant in --check-loss mode")
    ap.add_argument("--loss-tail", type=int, default=10,
                    help="--check-loss: also compare the mean of the last N losses (the flatter end of the run)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (both modes)")
    ap.add_argument("--gemm", action="store_true", help="GEMM cross-over micro-benchmark instead")
    ap.add_argument("--hf", action="store_true", help="HF transformers Llama in a plain LightningModule instead")
    ap.add_argument("--master-update", action="store_true",
                    help="the optimizer step alone on the --hf model's parameters: AdamW on bf16 weights, fp32 masters "
                         "the plain way, fp32 masters with the fused update")
    ap.add_argument("--hf-variants", nargs="+", default=list(HF_DEFAULT), choices=sorted(HF_VARIANTS))
    ap.add_argument("--hf-loss-variants", nargs="*", default=[], choices=sorted(HF_VARIANTS),
                    help="--hf: these variants (and bf16) run --hf-loss-steps steps; their last-50 mean loss is "
                         "compared with bf16-mixed's")
    ap.add_argument("--hf-loss-steps", type=int, default=200, help="--hf: steps of the --hf-loss-variants runs")
    ap.add_argument("--hf-data", default="zipf", choices=["zipf", "uniform"],
                    help="--hf: token ids drawn from a Zipf(1.1) distribution (the loss falls) or uniformly")
    ap.add_argument("--hf-profile", type=int, default=0, metavar="STEPS",
                    help="--hf: after the timed steps, run STEPS more under torch.profiler (not timed) and record the "
                         "top-25 kernels by GPU time, time by kernel kind, and torch._dynamo's graph, graph-break and "
                         "recompile counters for each variant")
    ap.add_argument("--hf-shape", type=int, nargs=8, default=list(HF_SHAPE), metavar="N",
                    help="hidden layers ffn heads kv_heads vocab batch seq (default: the issue-18 model)")
    ap.add_argument("--gemm-tokens", type=int, nargs="+", default=[8192], help="tokens (M) per GEMM")
    ap.add_argument("--gemm-dims", type=int, nargs="+", default=[512, 768, 1024, 1536, 2048, 3072, 4096, 8192],
                    help="square in=out sizes")
    ap.add_argument("--gemm-shapes", nargs="*", default=["4096x14336", "14336x4096", "2048x5632", "5632x2048",
                                                         "512x1408", "1408x512"],
                    help="extra in x out shapes (default: the Llama presets' MLP shapes)")


def _selected(args) -> list[str]:
    chosen = list(args.variants) if args.variants else list(DEFAULT_VARIANTS)
    keys = list(BASES)
    if any("te" in VARIANTS[k].tags for k in chosen):
        keys.append("lightning-te")
    return keys + [k for k in chosen if k not in keys]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"


def _reset_backends() -> None:
    """Drop compiled graphs and Transformer Engine's global fp8 buffers between variants."""
    torch._dynamo.reset()
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            manager = __import__(mod, fromlist=["FP8GlobalStateManager"]).FP8GlobalStateManager
            manager.reset()
            break
        except Exception:
            continue
    gc.collect()


def _build(cfg, variant: Variant, lr: float, device: torch.device) -> tuple[LlamaLM, dict[str, Any]]:
    # Parameters are created on the GPU (fast init, CUDA RNG), so every variant starts from the same weights and
    # the CPU RNG that shuffles the data is untouched by model construction.
    with torch.device(device):
        model = LlamaLM(cfg, lr=lr, warmup_steps=10, compile=variant.compile, compile_loss=variant.compile)
    if variant.plugin is None:
        return model, {"precision": variant.precision}
    name, opts = variant.plugin
    return model, {"precision": None, "plugins": [precision(name, **opts)]}


def _fp8_layers(trainer) -> str:
    plugin = trainer.precision_plugin
    plan = getattr(plugin, "plan", None)
    if plan is not None:
        return f"{len(plan.converted)}/{len(plan.decisions)}"
    if type(plugin).__name__ == "TransformerEnginePrecision":
        return "all"
    return "0"


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_batch: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_batch is None:
            self.first_batch = int(batch[0].sum())
        self.losses.append(float(outputs["loss"]))


def _run_variant(ctx: BenchContext, name: str, cfg, key: str, mode: str) -> Result:
    variant = VARIANTS[key]
    r = Result(ctx.suite, name, variant.label, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
    r.extra.update({"key": key, "compiled": variant.compile, "weights": variant.weights_note})
    reset_memory(ctx.device)
    model = trainer = None
    try:
        L.seed_everything(0, verbose=False)
        model, kwargs = _build(cfg, variant, ctx.args.lr, ctx.device)
        if mode == "loss":
            rec = _Losses()
            run_ctx = dataclasses.replace(ctx, warmup=0, iters=ctx.args.loss_steps)
            r.timing, trainer = lightning_steps(model, run_ctx, callbacks=[rec], **kwargs)
            r.extra["losses"] = rec.losses
            r.extra["first_batch_checksum"] = rec.first_batch
        else:
            r.timing, trainer = lightning_steps(model, ctx, **kwargs)
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra["fp8_layers"] = _fp8_layers(trainer)
        r.extra["plugin"] = getattr(trainer.precision_plugin, "name", type(trainer.precision_plugin).__name__)
        r.extra["compiled_loss"] = bool(getattr(model, "_compile_loss", False))
    except Exception as e:  # a missing backend, an OOM or a compile failure is a result, not a crash
        r.error = _error(e)
        traceback.print_exc()
    finally:
        del model, trainer
        _reset_backends()
        reset_memory(ctx.device)
    print(f"[fp8] {name} / {variant.label}: " + (f"{r.median_ms:.2f} ms" if r.median_ms else f"error {r.error}"),
          flush=True)
    return r


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else "-"


def _summary_steps(name: str, rows: list[Result]) -> str:
    by_key = {r.extra["key"]: r for r in rows}
    eager, compiled = by_key.get("bf16"), by_key.get("bf16-compiled")
    lte = by_key.get("lightning-te")
    ms = lambda r: r.median_ms if r is not None else None  # noqa: E731
    lines = [f"\n### fp8 summary: preset {name}, full Lightning steps (median ms; ratio > 1 is faster)",
             "| variant | weights | fp8 layers | ms | vs bf16 eager | vs bf16 compiled | vs Lightning TE | peak GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.median_ms:
            lines.append(f"| {r.variant} | {r.extra.get('weights')} | - | error: {r.error} | | | | |")
            continue
        peak = f"{r.peak_mem_bytes / 2**30:.1f}" if r.peak_mem_bytes else "-"
        lines.append(f"| {r.variant} | {r.extra.get('weights')} | {r.extra.get('fp8_layers', '-')} | "
                     f"{r.median_ms:.2f} | {_ratio(ms(eager), r.median_ms)} | {_ratio(ms(compiled), r.median_ms)} | "
                     f"{_ratio(ms(lte), r.median_ms)} | {peak} |")
    anchors = ANCHORS.get(name)
    if anchors:
        lines.append(f"anchors (H200, ../shared/gpu/README.md): Lightning bf16-mixed {anchors['lightning_bf16_ms']} ms "
                     f"(here {ms(eager) or '-'}), Lightning transformer-engine {anchors['lightning_te_ms']} ms "
                     f"(here {ms(lte) or '-'}), torchao tensorwise compiled {anchors['ao_tensorwise_fwd_bwd_x']}x and "
                     f"rowwise {anchors['ao_rowwise_fwd_bwd_x']}x over compiled bf16 (forward+backward only; full "
                     "steps add the same AdamW time to both sides, which lowers the ratio).")
    ao = [r for r in rows if r.extra["key"].startswith("ao-") and r.median_ms and r.extra["compiled"]]
    te = [r for r in rows if r.extra["key"].startswith("te-") and r.median_ms]
    if ao and ms(compiled):
        best = min(ao, key=lambda r: r.median_ms)
        x = ms(compiled) / best.median_ms
        lines.append(f"goal torchao >= 1.30x over compiled bf16: best {best.variant} {x:.3f}x -> "
                     f"{'MET' if x >= 1.30 else 'NOT MET'}")
    if te and ms(lte):
        best = min(te, key=lambda r: r.median_ms)
        lines.append(f"goal TE faster than Lightning's TransformerEnginePrecision: best {best.variant} "
                     f"{best.median_ms:.2f} ms vs {ms(lte):.2f} ms ({ms(lte) / best.median_ms:.3f}x) -> "
                     f"{'MET' if best.median_ms < ms(lte) else 'NOT MET'}")
    return "\n".join(lines)


def _moving(xs: list[float], w: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


def _summary_losses(name: str, rows: list[Result], tail_n: int = 10) -> str:
    """Loss curves against bf16-mixed eager: the worst 10-step moving-average gap, and the gap of the last
    ``tail_n`` steps' mean. A second bf16 curve (compiled) in the same table is the bf16-vs-bf16 yardstick: in a
    steep phase tiny numeric differences move trajectories apart by more than fp8 does."""
    ref = next((r for r in rows if r.extra["key"] == "bf16" and r.extra.get("losses")), None)
    lines = [f"\n### fp8 loss check: preset {name}, {len(ref.extra['losses']) if ref else 0} steps, same seed and "
             f"batches; tolerance {LOSS_TOLERANCE:.0%} on the 10-step moving average and on the last-{tail_n} mean",
             f"| variant | same data | first loss | last-{tail_n} mean | max rel diff (moving avg) | last-{tail_n} rel "
             f"diff | within 1% (all steps) | within 1% (last {tail_n}) |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    if ref is None:
        return "\n".join(lines + ["(no bf16-mixed reference curve: nothing to compare)"])
    base = _moving(ref.extra["losses"])
    ref_tail = statistics.fmean(ref.extra["losses"][-tail_n:])
    for r in rows:
        losses = r.extra.get("losses")
        if not losses:
            lines.append(f"| {r.variant} | - | - | - | - | - | error: {r.error} | |")
            continue
        cur = _moving(losses)
        n = min(len(cur), len(base))
        rel = [abs(cur[i] - base[i]) / base[i] for i in range(9, n)] or [float("nan")]
        tail = abs(statistics.fmean(losses[-tail_n:]) - ref_tail) / ref_tail
        same = r.extra.get("first_batch_checksum") == ref.extra.get("first_batch_checksum")
        ok, ok_tail = max(rel) <= LOSS_TOLERANCE, tail <= LOSS_TOLERANCE
        r.extra.update({"loss_max_rel_diff": max(rel), "loss_tail_rel_diff": tail, "loss_tail_n": tail_n,
                        "loss_within_tolerance": ok, "loss_tail_within_tolerance": ok_tail})
        lines.append(f"| {r.variant} | {'yes' if same else 'NO'} | {losses[0]:.4f} | "
                     f"{statistics.fmean(losses[-tail_n:]):.4f} | {max(rel):.4%} | {tail:.4%} | "
                     f"{'yes' if ok else 'NO'} | {'yes' if ok_tail else 'NO'} |")
    for r in rows:  # the raw curves stay in the JSON; keep the printed table short
        r.extra["losses"] = [round(x, 5) for x in r.extra.get("losses", [])]
    return "\n".join(lines)


# ---------------------------------------------------------------- GEMM cross-over


def _gemm_step(kind: str, m: int, k: int, n: int, device: torch.device):
    """One Linear(k -> n) forward + backward on m tokens, fp32 master weight under bf16 autocast."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=device)
    fp8_ctx = None
    if kind.startswith("ao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        holder = torch.nn.Sequential(lin)
        convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(kind.split("-", 1)[1]))
        lin = holder[0]
    elif kind.startswith("te"):
        import transformer_engine.pytorch as te

        from lightning_gh.precision.te import make_recipe, te_autocast

        lin = te.Linear(k, n, bias=False, params_dtype=torch.float32, device=device)
        recipe = make_recipe(kind.split("-", 1)[1])
        fp8_ctx = lambda: te_autocast(recipe)  # noqa: E731
    fn = torch.compile(lin) if kind in ("bf16-compiled",) or kind.startswith("ao") else lin

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if fp8_ctx is not None:
                with fp8_ctx():
                    y = fn(x)
            else:
                y = fn(x)
        y.backward(grad)
        x.grad = None
        lin.weight.grad = None

    return step


def _run_gemm(ctx: BenchContext) -> list[Result]:
    from lightning_gh.precision.checks import ao_missing_reason, te_missing_reason

    kinds = ["bf16", "bf16-compiled"]
    if ao_missing_reason() is None:
        kinds += ["ao-tensorwise", "ao-rowwise"]
    if te_missing_reason() is None:
        kinds += ["te-delayed", "te-current", "te-block"]
    shapes = [(d, d) for d in ctx.args.gemm_dims]
    shapes += [tuple(int(v) for v in spec.lower().split("x")) for spec in ctx.args.gemm_shapes]
    results: list[Result] = []
    table: dict[tuple[int, int, int], dict[str, float | None]] = {}
    for m in ctx.args.gemm_tokens:
        for k, n in shapes:
            row = table.setdefault((m, k, n), {})
            for kind in kinds:
                reset_memory(ctx.device)
                # One "preset" per shape, so the runner's speedup_vs_first is each kind against eager bf16.
                r = Result(ctx.suite, f"gemm {m}x{k}x{n}", kind, None, m, 6.0 * m * k * n)
                r.extra.update({"kind": kind, "m": m, "k": k, "n": n})
                try:
                    step = _gemm_step(kind, m, k, n, ctx.device)
                    r.timing = time_fn(step, ctx.device, max(ctx.warmup, 3), ctx.iters)
                except Exception as e:
                    r.error = _error(e)
                row[kind] = r.median_ms
                results.append(r)
                step = None
                torch._dynamo.reset()
    fp8_kinds = [k for k in kinds if k[:2] in ("ao", "te")]

    def speedup(row: dict[str, float | None], kind: str) -> float | None:
        base = row.get("bf16-compiled") if kind.startswith("ao") else row.get("bf16")
        return base / row[kind] if base and row.get(kind) else None

    lines = ["\n### GEMM cross-over: one Linear forward+backward (3 GEMMs), fp32 master weight, bf16 autocast",
             "speed-up of each fp8 kind over bf16 (torchao against compiled bf16, TE against eager bf16)",
             "| M | in | out | bf16 ms | bf16 compiled ms | " + " | ".join(fp8_kinds) + " |",
             "|---:|---:|---:|---:|---:|" + "---:|" * len(fp8_kinds)]
    fmt = lambda v: f"{v:.3f}" if v else "-"  # noqa: E731
    for (m, k, n), row in table.items():
        cells = [f"{x:.2f}x" if (x := speedup(row, kind)) else "-" for kind in fp8_kinds]
        lines.append(f"| {m} | {k} | {n} | {fmt(row.get('bf16'))} | {fmt(row.get('bf16-compiled'))} | "
                     + " | ".join(cells) + " |")
    for m in ctx.args.gemm_tokens:
        squares = sorted(d for d in ctx.args.gemm_dims)
        for kind in fp8_kinds:
            # The cross-over: the smallest square size from which every larger size tried is faster in fp8.
            wins = [(d, (speedup(table[(m, d, d)], kind) or 0) > 1.0) for d in squares]
            start = None
            for i, (d, _) in enumerate(wins):
                if all(w for _, w in wins[i:]):
                    start = d
                    break
            lines.append(f"cross-over M={m} {kind}: fp8 faster from in=out={start} on" if start else
                         f"cross-over M={m} {kind}: fp8 not consistently faster on the square sizes tried")
    lines.append(f"layer filter default: min_dim={LayerFilter().min_dim} (convert when min(in, out) >= min_dim)")
    print("\n".join(lines), flush=True)
    return results


# ---------------------------------------------------------------- entry point


def _hf_param_shapes(shape: list[int]) -> list[tuple[int, ...]]:
    """The parameter shapes of the --hf Llama (untied embedding and head, RMSNorm weights)."""
    hidden, layers, ffn, heads, kv, vocab, _, _ = shape
    kv_dim = hidden * kv // heads
    block = [(hidden, hidden), (kv_dim, hidden), (kv_dim, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
             (hidden, ffn), (hidden,), (hidden,)]
    return [(vocab, hidden), *block * layers, (hidden,), (vocab, hidden)]


def _run_master_update(ctx: BenchContext) -> list[Result]:
    """The optimizer step alone on the --hf model's parameters: how the fp32 masters are updated, side by side.

    ``bf16-adamw``: ``AdamW(fused=True)`` on the bf16 weights (Lightning's ``"transformer-engine"``, no masters);
    ``plain``: fp32 masters, gradient copy + ``AdamW(fused=True)`` + copy back; ``fused``: ``FusedMasterAdam``.
    """
    from lightning_gh.precision.fused_master import FusedMasterAdam
    from lightning_gh.precision.master import MasterWeights

    shapes = _hf_param_shapes(list(ctx.args.hf_shape))
    n = sum(math.prod(s) for s in shapes)
    rows = []
    for kind in ("bf16-adamw", "plain", "fused"):
        reset_memory(ctx.device)
        r = Result(ctx.suite, "hf-llama-params", f"master update: {kind}", None)
        r.extra.update({"params": n})
        try:
            gen = torch.Generator(device=ctx.device).manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, device=ctx.device, generator=gen).to(torch.bfloat16))
                      for s in shapes]
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

            t0 = time.perf_counter()
            step()  # the first step (the compile for "fused")
            sync(ctx.device)
            r.extra["first_step_s"] = round(time.perf_counter() - t0, 2)
            r.timing = time_fn(step, ctx.device, ctx.warmup, ctx.iters)
            r.peak_mem_bytes = peak_memory(ctx.device)
            del params, grads, opt, masters, fused
        except Exception as e:
            r.error = _error(e)
            traceback.print_exc()
        rows.append(r)
        print(f"[fp8 master-update] {kind}: " + (f"{r.median_ms:.2f} ms (p10-p90 {r.timing.p10_ms:.2f}-"
                                                   f"{r.timing.p90_ms:.2f}), first step {r.extra['first_step_s']} s, "
                                                   f"peak {(r.peak_mem_bytes or 0) / 2**30:.1f} GiB, {n / 1e9:.2f} G "
                                                   "params" if r.timing else f"error {r.error}"), flush=True)
    return rows


def run(ctx: BenchContext) -> list[Result]:
    if ctx.args.gemm:
        return _run_gemm(ctx)
    if getattr(ctx.args, "master_update", False):
        return _run_master_update(ctx)
    if getattr(ctx.args, "hf", False):
        return run_hf(ctx)
    mode = "loss" if ctx.args.check_loss else "steps"
    keys = _selected(ctx.args)
    print(f"[fp8] mode={mode} variants={keys}\n[fp8] availability: {list_precisions()}", flush=True)
    results: list[Result] = []
    summaries = []
    for name in ctx.presets:
        cfg = preset(name)
        rows = [_run_variant(ctx, name, cfg, key, mode) for key in keys]
        results += rows
        summaries.append(_summary_losses(name, rows, ctx.args.loss_tail) if mode == "loss"
                         else _summary_steps(name, rows))
    print("\n".join(summaries), flush=True)
    return results


# ---------------------------------------------------------------- --hf: a model the user brings


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
        elif self.compile_how in ("model", "model-sdpa") and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
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


def _hf_loss_keys(args) -> set[str]:
    """The --hf variants run --hf-loss-steps long (bf16 always among them: the reference curve)."""
    keys = set(getattr(args, "hf_loss_variants", None) or ())
    return keys | {"bf16"} if keys else set()


def _hf_data(shape: list[int], steps: int, kind: str = "zipf") -> torch.utils.data.DataLoader:
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


def _hf_variant(ctx: BenchContext, key: str, shape: list[int]) -> Result:
    from common import StepTimer

    label, name, opts, how = HF_VARIANTS[key]
    hidden, layers, ffn, heads, kv, vocab, batch, seq = shape
    tokens = batch * seq
    flops = 6 * tokens * (layers * (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * ffn)
                          + hidden * vocab) + 12 * layers * batch * seq * seq * hidden  # causal attn ~ half
    r = Result(ctx.suite, "hf-llama", label, None, tokens, float(flops))
    r.extra.update({"key": key, "compiled": how})
    reset_memory(ctx.device)
    model = trainer = None
    stack = contextlib.ExitStack()
    try:
        L.seed_everything(0, verbose=False)
        with torch.device(ctx.device):
            model = HFCausalLM(_hf_config(shape), compile=how, lr=ctx.args.lr)
        kwargs: dict[str, Any] = {}
        if name == "bf16-mixed":
            kwargs["precision"] = "bf16-mixed" if ctx.cuda else "32-true"
        elif name == "transformer-engine":
            kwargs["precision"] = name
        else:
            o = dict(opts or {})
            if o.get("config") == "fast-accum":
                o["config"] = _ao_fast_accum_config()
            if not ctx.cuda and name.startswith("fp8-ao"):
                o["emulate"] = True  # the CPU smoke run: emulated fp8, functional only
            kwargs["plugins"] = [precision(name, **o)]
        if key == "auto-fused":  # fp8-auto takes layer-filter options only: its TE plugins' default is set here
            stack.enter_context(_te_default("fused_master_update", True))
        rec = _Losses()
        steps = ctx.warmup + ctx.iters
        if key in _hf_loss_keys(ctx.args):
            steps = max(steps, ctx.args.hf_loss_steps)  # a longer run: its loss curve is checked against bf16's
        r.extra["steps"] = steps
        profile_steps = max(0, getattr(ctx.args, "hf_profile", 0))
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
        trainer.fit(model, _hf_data(shape, steps + profile_steps, ctx.args.hf_data))
        if prof is not None:
            r.extra["profile"] = prof.report()
            r.extra["dynamo"] = _dynamo_counters()
            print(_profile_text(label, r.extra["profile"], r.extra["dynamo"]), flush=True)
        r.extra["fit_s"] = round(time.perf_counter() - t0, 1)
        r.timing = timer.timing()
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra["losses"] = rec.losses[:steps]
        r.extra["fp8_layers"] = _fp8_layers(trainer)
        r.extra["plugin"] = getattr(trainer.precision_plugin, "name", type(trainer.precision_plugin).__name__)
        r.extra["regional"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        auto = next((p for p in kwargs.get("plugins", []) if hasattr(p, "choice")), None)
        if auto is not None and auto.choice is not None:  # fp8-auto: what it chose and the figures it used
            r.extra["auto_choice"] = auto.choice.name
            r.extra["auto_reason"] = auto.choice.reason
            r.extra["auto_trial_ms"] = dict(auto.timings)
    except Exception as e:  # a missing backend, an OOM or a compile failure is a result, not a crash
        r.error = _error(e)
        traceback.print_exc()
    finally:
        stack.close()
        del model, trainer
        _reset_backends()
        reset_memory(ctx.device)
    print(f"[fp8 hf] {label}: " + (f"{r.median_ms:.2f} ms, peak {(r.peak_mem_bytes or 0) / 2**30:.1f} GiB, "
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


HF_LOSS_TAIL = 50  # the loss goal: mean of the last 50 steps within 1% of bf16-mixed's


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
             f"vs bf16 compiled | peak GiB | max rel loss gap | last-{HF_LOSS_TAIL} mean gap |",
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
            t = _tail_gap(ref, losses, HF_LOSS_TAIL)
            if t is not None:
                r.extra["loss_tail_rel_gap"] = t
                tail = f"{t:.2e}"
        peak = f"{r.peak_mem_bytes / 2**30:.1f}" if r.peak_mem_bytes else "-"
        lines.append(f"| {r.variant} | {r.extra.get('plugin')} | {r.extra.get('fp8_layers')} | "
                     f"{r.extra.get('steps', '-')} | {r.median_ms:.2f} | {_ratio(ms(base), r.median_ms)} | "
                     f"{_ratio(ms(lte), r.median_ms)} | {_ratio(ms(blocks), r.median_ms)} | "
                     f"{_ratio(ms(compiled), r.median_ms)} | {peak} | {gap} | {tail} |")
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
                goal(f"{r.variant} >= 1.05x over Lightning transformer-engine", ms(lte) / r.median_ms, 1.05)
            if ms(base):
                goal(f"{r.variant} >= 1.53x over bf16-mixed", ms(base) / r.median_ms, 1.53)
    ao = by_key.get("ao-tensorwise")
    if ao is not None and ao.median_ms and ms(base):
        goal("fp8-ao-tensorwise on the eager model >= 1.40x over bf16-mixed", ms(base) / ao.median_ms, 1.40)
    aoc = by_key.get("ao-tensorwise-compiled")
    if aoc is not None and aoc.median_ms and ms(compiled):
        goal("fp8-ao-tensorwise on a compiled model >= 1.30x over compiled bf16", ms(compiled) / aoc.median_ms, 1.30)
    # The same goal against the faster compiled bf16: the user's compile with SDPA's causal path kept for bf16 too.
    fast = [r.median_ms for r in (compiled, by_key.get("bf16-compiled-sdpa")) if r is not None and r.median_ms]
    for key in ("ao-tensorwise-compiled", "ao-tensorwise-compiled-head", "ao-tensorwise-compiled-all",
                "ao-tensorwise-compiled-fastaccum", "ao-tensorwise-compiled-nosdpa"):
        r = by_key.get(key)
        if r is not None and r.median_ms and len(fast) == 2:
            goal(f"{r.variant} >= 1.30x over the faster compiled bf16 ({min(fast):.2f} ms)",
                 min(fast) / r.median_ms, 1.30)
    if base is not None and base.peak_mem_bytes:
        for r in rows:
            if r is not base and r.peak_mem_bytes and r.extra["key"] in ("te-delayed", "ao-tensorwise", "auto"):
                ok = r.peak_mem_bytes <= base.peak_mem_bytes
                lines.append(f"goal {r.variant} peak memory <= bf16-mixed's: {r.peak_mem_bytes / 2**30:.1f} vs "
                             f"{base.peak_mem_bytes / 2**30:.1f} GiB -> {'MET' if ok else 'NOT MET'}")
    for r in rows:
        t = r.extra.get("loss_tail_rel_gap")
        if t is not None and r.extra.get("steps", 0) >= 200:
            lines.append(f"goal {r.variant} loss over {r.extra['steps']} steps, last-{HF_LOSS_TAIL} mean within 1% "
                         f"of bf16-mixed: {t:.2%} -> {'MET' if t <= LOSS_TOLERANCE else 'NOT MET'}")
    return "\n".join(lines)


def run_hf(ctx: BenchContext) -> list[Result]:
    import json

    shape = list(ctx.args.hf_shape)
    print(f"[fp8 hf] shape={shape} variants={ctx.args.hf_variants}\n[fp8] availability: {list_precisions()}",
          flush=True)
    rows: list[Result] = []
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    for key in ctx.args.hf_variants:
        rows.append(_hf_variant(ctx, key, shape))
        partial = [{**r.row(), "samples_ms": r.timing.samples_ms if r.timing else None} for r in rows]
        (ctx.out_dir / "fp8_hf_partial.json").write_text(json.dumps(partial, indent=1, default=str))
        print(_summary_hf(rows), flush=True)
    return rows
