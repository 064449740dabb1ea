"""Suite `fp8_steps`: every fp8 precision name on the demo model, against bf16-mixed and Lightning's own
TransformerEnginePrecision, in full Lightning training steps (forward + backward + fused AdamW; fp32 master
weights unless a variant says otherwise), side by side in one process.

  (default)      timed steps; ratios against bf16-mixed eager (the table's speedup_vs_first), against bf16-mixed
                 compiled and against Lightning's "transformer-engine".
  --check-loss   the same variants trained --loss-steps steps from the same seed on the same batches; the loss
                 curves are compared with bf16-mixed eager (10-step moving average and the last --loss-tail steps'
                 mean, tolerance 1%).

Variants (pick with --variants; bf16, bf16-compiled and, when a TE variant runs, lightning-te always run):
  bf16                 Trainer(precision="bf16-mixed"), eager                          (the ratio base)
  bf16-compiled        the same with the decoder and the loss under torch.compile (every "compiled" variant
                       compiles both)
  lightning-te         Trainer(precision="transformer-engine"): Lightning's plugin, bf16 weights, every Linear,
                       DelayedScaling, eager (the anchor)
  te-delayed, te-current, te-block          lgh.precision("fp8-te-*"), default filter, fp32 master weights, eager
  te-delayed-compiled, te-current-compiled  the same on a compiled model (TE layers run eagerly between graphs)
  te-current-traced    compiled, and torch.compile traces the TE layers (compile_te_layers=True)
  te-delayed-matched   fp8-te-delayed configured like Lightning's: bf16 weights, head and first layer in fp8, eager
  te-current-matched-compiled   the same with current scaling on a compiled model
  ao-tensorwise, ao-rowwise, ao-rowwise-gw-hp   lgh.precision("fp8-ao-*") on a compiled model
  ao-tensorwise-all    ao-tensorwise with the head and first layer in fp8 too (what torchao's own figures convert)
  ao-tensorwise-eager  ao-tensorwise on an uncompiled model (the plugin compiles its blocks by default)
  auto                 lgh.precision("fp8-auto") on a compiled model (it should pick fp8-ao-tensorwise)
  auto-eager           lgh.precision("fp8-auto") on an uncompiled model (it should pick fp8-te-delayed)
  te-delayed-noblocks, te-delayed-nomasters, te-delayed-plainmasters   fp8-te-delayed with one default turned off
                       (compile_blocks, master_weights, fused_master_update): what each default costs here

    python benchmarks/run.py --suite fp8_steps --preset large --variants te-delayed te-current ...
    python benchmarks/run.py --suite fp8_steps --preset large --check-loss --loss-steps 120
"""

from __future__ import annotations

import dataclasses
import statistics
import traceback
from typing import Any

import lightning as L
import torch

from common import BenchContext, Result, lightning_steps, peak_memory, reset_memory
from lightning_gh.demo import LlamaLM, preset
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

DEFAULT_PRESETS = ["large", "medium"]
GOAL_AO_OVER_COMPILED = 1.30  # torchao on a compiled model against compiled bf16-mixed

_MATCHED = dict(weights_dtype=torch.bfloat16, skip_head=False, skip_first=False)


def _plugin(label: str, name: str, compile: str = "none", weights: str = "fp32 master", **opts: Any) -> Variant:
    return Variant(label, plugin=(name, opts), compile=compile, weights=weights)


VARIANTS: dict[str, Variant] = {
    "bf16": Variant("bf16-mixed eager", precision="bf16-mixed"),
    "bf16-compiled": Variant("bf16-mixed compiled", precision="bf16-mixed", compile="model"),
    "lightning-te": Variant("Lightning transformer-engine", precision="transformer-engine", weights="bf16"),
    "te-delayed": _plugin("fp8-te-delayed", "fp8-te-delayed"),
    "te-current": _plugin("fp8-te-current", "fp8-te-current"),
    "te-block": _plugin("fp8-te-block", "fp8-te-block"),
    "te-delayed-compiled": _plugin("fp8-te-delayed compiled", "fp8-te-delayed", "model"),
    "te-current-compiled": _plugin("fp8-te-current compiled", "fp8-te-current", "model"),
    "te-current-traced": _plugin("fp8-te-current compiled+traced", "fp8-te-current", "model",
                                 compile_te_layers=True),
    "te-delayed-matched": _plugin("fp8-te-delayed bf16w all-layers", "fp8-te-delayed", weights="bf16", **_MATCHED),
    "te-current-matched-compiled": _plugin("fp8-te-current bf16w all-layers compiled", "fp8-te-current", "model",
                                           weights="bf16", **_MATCHED),
    "ao-tensorwise": _plugin("fp8-ao-tensorwise compiled", "fp8-ao-tensorwise", "model"),
    "ao-rowwise": _plugin("fp8-ao-rowwise compiled", "fp8-ao-rowwise", "model"),
    "ao-rowwise-gw-hp": _plugin("fp8-ao-rowwise-gw-hp compiled", "fp8-ao-rowwise-gw-hp", "model"),
    "ao-tensorwise-all": _plugin("fp8-ao-tensorwise all-layers compiled", "fp8-ao-tensorwise", "model",
                                 skip_head=False, skip_first=False),
    "ao-tensorwise-eager": _plugin("fp8-ao-tensorwise eager", "fp8-ao-tensorwise"),
    "auto": _plugin("fp8-auto compiled", "fp8-auto", "model"),
    "auto-eager": _plugin("fp8-auto eager", "fp8-auto"),
    # which of the TE defaults costs what on a preset (compiled blocks, fp32 masters, their fused update)
    "te-delayed-noblocks": _plugin("fp8-te-delayed compile_blocks=False", "fp8-te-delayed", compile_blocks=False),
    "te-delayed-nomasters": _plugin("fp8-te-delayed master_weights=False", "fp8-te-delayed", master_weights=False),
    "te-delayed-plainmasters": _plugin("fp8-te-delayed fused_master_update=False", "fp8-te-delayed",
                                       fused_master_update=False),
}
BASES = ("bf16", "bf16-compiled")
DEFAULT_VARIANTS = [k for k in VARIANTS if k not in ("te-current-traced", "ao-tensorwise-eager")]


def add_arguments(ap) -> None:
    ap.add_argument("--variants", nargs="+", default=None, choices=sorted(VARIANTS),
                    help="variants to run (bf16, bf16-compiled and, with TE variants, lightning-te always run)")
    ap.add_argument("--check-loss", action="store_true", help="compare loss curves with bf16-mixed instead of timing")
    ap.add_argument("--loss-steps", type=int, default=120, help="steps per variant in --check-loss mode")
    ap.add_argument("--loss-tail", type=int, default=10,
                    help="--check-loss: also compare the mean of the last N losses (the flatter end of the run)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (both modes)")


def _selected(args) -> list[str]:
    chosen = list(args.variants) if args.variants else list(DEFAULT_VARIANTS)
    keys = list(BASES)
    if any(VARIANTS[k].backend == "te" for k in chosen):
        keys.append("lightning-te")
    return keys + [k for k in chosen if k not in keys]


def _build(cfg, variant: Variant, lr: float, device: torch.device) -> tuple[LlamaLM, dict[str, Any]]:
    # Parameters are created on the GPU (fast init, CUDA RNG), so every variant starts from the same weights and
    # the CPU RNG that shuffles the data is untouched by model construction.
    with torch.device(device):
        model = LlamaLM(cfg, lr=lr, warmup_steps=10, compile=variant.compiled, compile_loss=variant.compiled)
    if variant.plugin is None:
        return model, {"precision": variant.precision}
    name, opts = variant.plugin
    return model, {"precision": None, "plugins": [precision(name, **opts)]}


def _run_variant(ctx: BenchContext, name: str, cfg, key: str, mode: str) -> Result:
    variant = VARIANTS[key]
    r = Result(ctx.suite, name, variant.label, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
    r.extra.update({"key": key, "compiled": variant.compiled, "weights": variant.weights})
    reset_memory(ctx.device)
    model = trainer = None
    try:
        L.seed_everything(0, verbose=False)
        model, kwargs = _build(cfg, variant, ctx.args.lr, ctx.device)
        if mode == "loss":
            rec = LossRecorder()
            run_ctx = dataclasses.replace(ctx, warmup=0, iters=ctx.args.loss_steps)
            r.timing, trainer = lightning_steps(model, run_ctx, callbacks=[rec], **kwargs)
            r.extra["losses"] = rec.losses
            r.extra["first_batch_checksum"] = rec.first_batch
        else:
            r.timing, trainer = lightning_steps(model, ctx, **kwargs)
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra["fp8_layers"] = fp8_layers(trainer)
        r.extra["plugin"] = plugin_name(trainer)
        r.extra["compiled_loss"] = bool(getattr(model, "_compile_loss", False))
    except Exception as e:  # a missing backend, an OOM or a compile failure is a result, not a crash
        r.error = error_text(e)
        traceback.print_exc()
    finally:
        del model, trainer
        reset_backends()
        reset_memory(ctx.device)
    print(f"[fp8_steps] {name} / {variant.label}: " + (f"{r.median_ms:.2f} ms" if r.median_ms else f"error {r.error}"),
          flush=True)
    return r


def _summary_steps(name: str, rows: list[Result]) -> str:
    by_key = {r.extra["key"]: r for r in rows}
    eager, compiled = by_key.get("bf16"), by_key.get("bf16-compiled")
    lte = by_key.get("lightning-te")

    def ms(r: Result | None) -> float | None:
        return r.median_ms if r is not None else None

    lines = [f"\n### fp8 summary: preset {name}, full Lightning steps (median ms; ratio > 1 is faster)",
             "| variant | weights | fp8 layers | ms | vs bf16 eager | vs bf16 compiled | vs Lightning TE | peak GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.median_ms:
            lines.append(f"| {r.variant} | {r.extra.get('weights')} | - | error: {r.error} | | | | |")
            continue
        peak = f"{r.peak_mem_bytes / 2**30:.1f}" if r.peak_mem_bytes else "-"
        lines.append(f"| {r.variant} | {r.extra.get('weights')} | {r.extra.get('fp8_layers', '-')} | "
                     f"{r.median_ms:.2f} | {ratio(ms(eager), r.median_ms)} | {ratio(ms(compiled), r.median_ms)} | "
                     f"{ratio(ms(lte), r.median_ms)} | {peak} |")
    ao = [r for r in rows if r.extra["key"].startswith("ao-") and r.median_ms and r.extra["compiled"]]
    te = [r for r in rows if r.extra["key"].startswith("te-") and r.median_ms]
    if ao and ms(compiled):
        best = min(ao, key=lambda r: r.median_ms)
        x = ms(compiled) / best.median_ms
        lines.append(f"goal torchao >= {GOAL_AO_OVER_COMPILED:.2f}x over compiled bf16: best {best.variant} "
                     f"{x:.3f}x -> {'MET' if x >= GOAL_AO_OVER_COMPILED else 'NOT MET'}")
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


def run(ctx: BenchContext) -> list[Result]:
    mode = "loss" if ctx.args.check_loss else "steps"
    keys = _selected(ctx.args)
    print(f"[fp8_steps] mode={mode} variants={keys}\n[fp8_steps] availability: {list_precisions()}", flush=True)
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
