"""Suite `offload`: activation offloading inside Lightning, against save_on_cpu and checkpointing.

Per preset (default: medium), side by side in this process, same seed, same data:

Lightning ``Trainer(precision="bf16-mixed")`` full steps (forward, backward, fused AdamW):
  no offload            the plain step (ratio base), run twice: the second gives the loss noise
  save_on_cpu           torch.autograd.graph.save_on_cpu(pin_memory=True) around the training forward
  checkpointing         per-block activation checkpointing (non-reentrant checkpoint_wrapper)
  ours auto / all / K=2 lightning_gh.ActivationOffload(policy=...)
  ckpt + ours auto      checkpointing, and ActivationOffload on what it still saves
  recompute only        ActivationOffload(policy=0, recompute="selective"): no offload, every block recomputes
                        all but its matmul and attention outputs (selective activation checkpointing)
  ours auto + recompute ActivationOffload(policy="auto", recompute="selective"): offload what the link hides,
                        selective recompute in the other blocks
  ours auto + full recompute   the same with recompute="full" in the other blocks
  norm-act only         ActivationOffload(policy=0, recompute="norm-act"): no offload, every block checkpoints
                        only its norm and gated-activation modules (no dispatch mode)
  ours auto + norm-act  ActivationOffload(policy="auto", recompute="norm-act")
  --offload-variants picks some of them ("no offload" always runs first: it is the ratio base).
  peak activation memory = the step's peak allocation minus parameters and optimizer state; loss parity
  = the largest |loss - plain loss| over all steps.
Out of memory, then not: the batch doubled under torch.cuda.set_per_process_memory_fraction set between
  what the plain step and the offloaded step need: plain must fail, ours must train.
Plain PyTorch forward+backward (how the anchors in docs/benchmarks-archive.md were taken): no offload,
  save_on_cpu, checkpointing, ours auto / all / K=2, next to the anchor figures. Memory timelines of
  one such step (no offload, auto, all) are written to $OUT/offload_timelines.json for the notebook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import statistics
import time
import traceback
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F

from common import BenchContext, Result, lightning_steps, random_batch, reset_memory, time_fn
from lightning_gh.activation_offload import ActivationOffload, offload_activations
from lightning_gh.demo import Llama, LlamaLM, preset

DEFAULT_PRESETS = ["medium"]
GIB = 2**30
# docs/benchmarks-archive.md's anchors, medium preset, plain PyTorch fwd+bwd, bf16: (ms, GiB of activations)
ANCHORS = {"no offload": (49.5, 9.31), "save_on_cpu": (291.0, 4.43), "checkpointing": (61.1, 4.74)}
GOAL = "goal (medium): >= 40% less peak activation memory at <= 1.10x step time"


def add_arguments(parser) -> None:
    parser.add_argument("--skip-oom", action="store_true", help="skip the out-of-memory demonstration")
    parser.add_argument("--skip-fwdbwd", action="store_true", help="skip the plain PyTorch fwd+bwd rows")
    parser.add_argument("--k", type=int, default=2, help="K of the fixed-K variant (default 2)")
    parser.add_argument("--offload-hf-budget", action="store_true",
                        help="run only the budget table: an HF LlamaForCausalLM (2048 x 8) with none, HF gradient "
                             "checkpointing, SAC, auto, all, budget=0.3/0.5/0.7/0.9 and a budget at "
                             "checkpointing's measured activation memory")
    parser.add_argument("--offload-hf-compiled", action="store_true",
                        help="with --offload-hf-budget: also torch.compile'd: no budget, the compiler's "
                             "activation_memory_budget 0.5 / 0.3 set by hand, and budget=0.5 / 0.3")
    parser.add_argument("--offload-hf-lean", action="store_true",
                        help="with --offload-hf-budget: instead of its table, the lean loss's: none, HF checkpointing, "
                             "policy=0 with and without lean_loss=True, a budget at checkpointing's memory without "
                             "and with the lean loss weighed, budget=0.3/0.5/0.7, budget=0.3 without the lean loss")
    parser.add_argument("--offload-compiled-offload", action="store_true",
                        help="with --offload-hf-lean: also a probe of torch's own activation offloading in a compiled "
                             "graph (torch._functorch.config.enable_activation_offloading, the matmul outputs of the "
                             "first K decoder layers marked for it) on top of the compiler's activation_memory_budget")
    parser.add_argument("--offload-compiled-sdpa", action="store_true",
                        help="with --offload-hf-budget: instead of its table, a torch.compile'd HF model at the "
                             "compiler's activation_memory_budget 0.5 / 0.3: the knob by hand, the same with SDPA's "
                             "causal path kept (keep_causal_sdpa), and budget mode (default options)")
    parser.add_argument("--offload-medium-budget", action="store_true",
                        help="with --offload-hf-budget: also the demo's medium preset, none and budget=0.5")
    parser.add_argument("--offload-variants", default=None,
                        help="comma-separated variant names to run (case-insensitive), e.g. "
                             "'checkpointing,ours auto,recompute only,ours auto + recompute'; 'no offload' always "
                             "runs first. Default: all")


def _chosen(ctx: BenchContext, names: list[str]) -> set[str]:
    """The variants to run: all, or those --offload-variants names (an unknown name is an error)."""
    arg = getattr(ctx.args, "offload_variants", None)
    if not arg:
        return set(names)
    want = {w.strip().lower() for w in arg.split(",") if w.strip()}
    by_lower = {n.lower(): n for n in names}
    unknown = sorted(want - set(by_lower))
    if unknown:
        raise SystemExit(f"--offload-variants: unknown {unknown}; choose from {names}")
    return {by_lower[w] for w in want} | {"no offload"}


# ------------------------------------------------------------------------------------ Lightning parts


class _SaveOnCpu(L.Callback):
    """torch's save_on_cpu(pin_memory=True) around exactly the training forward."""

    def __init__(self) -> None:
        self._ctx: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
        self._ctx.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


class _StepMemory(L.Callback):
    """Per step: peak allocation above parameters + optimizer state (gradients excluded), and the loss."""

    def __init__(self) -> None:
        self.act_peaks: list[int] = []
        self.static: list[int] = []
        self.losses: list[torch.Tensor] = []
        self._base = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        grads = sum(p.grad.numel() * p.grad.element_size() for p in pl_module.parameters() if p.grad is not None)
        self._base = torch.cuda.memory_allocated() - grads
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.act_peaks.append(torch.cuda.max_memory_allocated() - self._base)
        self.static.append(self._base)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().float())


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, blk in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(blk)


def _lightning_variant(ctx: BenchContext, cfg, name: str, callbacks: Callable[[], list], ckpt: bool = False,
                       steps: tuple[int, int] | None = None) -> tuple[Result, _StepMemory, list]:
    r = Result(ctx.suite, ctx.args._preset_label, name, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
    probe = _StepMemory()
    cbs: list = []
    reset_memory(ctx.device)
    try:
        L.seed_everything(0, verbose=False)
        model = LlamaLM(cfg, lr=1e-4, warmup_steps=0)
        if ckpt:
            _checkpoint_blocks(model.model)
        cbs = callbacks()
        sub = ctx if steps is None else BenchContext(ctx.suite, ctx.presets, ctx.device, steps[0], steps[1],
                                                     ctx.out_dir, ctx.args)
        r.timing, _ = lightning_steps(model, sub, callbacks=[probe, *cbs])
        w = sub.warmup
        r.peak_mem_bytes = max(probe.act_peaks[w:]) + max(probe.static[w:])
        r.extra["act_peak_gib"] = round(statistics.median(probe.act_peaks[w:]) / GIB, 3)
        r.extra["static_gib"] = round(statistics.median(probe.static[w:]) / GIB, 3)
        for cb in cbs:
            if isinstance(cb, ActivationOffload) and cb.engine is not None:
                s = cb.engine.stats
                r.extra["offloaded_gib_per_step"] = round(s.last_offloaded_bytes / GIB, 3)
                r.extra["dedup_casts"] = s.deduplicated_casts
                r.extra["recomputed_param_casts"] = s.recomputed_param_casts
                r.extra["on_demand_reloads"] = s.on_demand_reloads
                r.extra["pinned_allocations"] = cb.engine.pool.allocations if cb.engine.pool else None
                r.extra["plan"] = cb.plan.describe() if cb.plan else None
                r.extra["recomputed_blocks"] = s.last_recompute_blocks
                r.extra["recompute_cache_gib"] = round(s.last_recompute_cached_bytes / GIB, 3)
    except Exception as e:  # an OOM is a result, not a crash of the suite
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not isinstance(e, torch.OutOfMemoryError):
            traceback.print_exc()
    model = None
    gc.collect()
    reset_memory(ctx.device)
    _print_row(r)
    return r, probe, cbs


def _print_row(r: Result) -> None:
    ms = f"{r.median_ms:8.1f} ms" if r.median_ms else "       -   "
    act = r.extra.get("act_peak_gib")
    print(f"[offload] {r.preset:>18} | {r.variant:<26} | {ms} | act {act if act is not None else '-':>7} GiB"
          + (f" | {r.error}" if r.error else ""), flush=True)


# ----------------------------------------------------------------------------------- plain PyTorch


def _fwdbwd_variant(ctx: BenchContext, cfg, name: str, label: str, make_ctx: Callable[[torch.nn.Module], Any],
                    ckpt: bool = False, timeline: dict | None = None) -> Result:
    """Time ``make_ctx(model)`` (None, a context, or a factory of one per step) around fwd+bwd steps.

    With ``timeline``, one more step is recorded by an engine (the variant's own, or an observing one
    that offloads nothing) and its (host ms, event, block, allocated bytes) go into ``timeline[name]``.
    """
    r = Result(ctx.suite, label, name, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
    reset_memory(ctx.device)
    model = holder = None
    try:
        torch.manual_seed(0)
        model = Llama(cfg).to(ctx.device)
        if ckpt:
            _checkpoint_blocks(model)
        tokens, targets = random_batch(cfg, ctx.device)
        holder = make_ctx(model)
        peaks: list[int] = []

        def step(c: Any = None):
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if c is None:
                c = holder() if callable(holder) and not hasattr(holder, "begin_forward") else holder
            with c if c is not None else contextlib.nullcontext(), torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            del logits
            loss.backward()
            model.zero_grad(set_to_none=True)
            peaks.append(torch.cuda.max_memory_allocated() - base)

        r.timing = time_fn(step, ctx.device, ctx.warmup, ctx.iters)
        r.extra["act_peak_gib"] = round(statistics.median(peaks[ctx.warmup:]) / GIB, 3)
        r.peak_mem_bytes = torch.cuda.max_memory_allocated()
        if hasattr(holder, "plan") and holder.plan is not None:
            r.extra["plan"] = holder.plan.describe()
            r.extra["offloaded_gib_per_step"] = round(holder.stats.last_offloaded_bytes / GIB, 3)
        if timeline is not None:
            observer = holder if hasattr(holder, "timeline") else \
                offload_activations(model, 0, dedupe_casts=False, recompute_param_casts=False)
            observer.record_timeline = True
            torch.cuda.synchronize()
            step(observer)
            torch.cuda.synchronize()
            timeline[name] = [(round(p.t_ms, 3), p.event, p.block, p.allocated_bytes) for p in observer.timeline]
            observer.record_timeline = False
    except Exception as e:
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not isinstance(e, torch.OutOfMemoryError):
            traceback.print_exc()
    model = holder = None
    gc.collect()
    reset_memory(ctx.device)
    _print_row(r)
    return r


# ------------------------------------------------------------------------------------------- suite


def _print_norm_act_regions(cfg) -> None:
    """Which submodules of one block recompute="norm-act" checkpoints (built on the meta device: no memory)."""
    from lightning_gh.activation_offload.recompute import is_norm_act_module
    from lightning_gh.demo.model import Block

    try:
        with torch.device("meta"):
            blk = Block(cfg)
        names = [n for n, m in blk.named_modules() if m is not blk and is_norm_act_module(m)]
    except Exception as e:  # the demo's Block changed shape: say so, the run goes on
        names = [f"? ({type(e).__name__}: {e})"]
    print(f"[offload] recompute='norm-act' checkpoints in each block: {', '.join(names) or 'nothing'}")


def run(ctx: BenchContext) -> list[Result]:
    if getattr(ctx.args, "offload_hf_budget", False) and not ctx.cuda:
        return run_hf_budget(ctx)  # a functional run of the same code on a tiny model (no memory figures)
    if not ctx.cuda:
        raise SystemExit("suite offload measures GPU memory and copies over the host link: run it on a CUDA GPU")
    from lightning_gh import hardware

    link = hardware.link_bandwidth()
    print(f"[offload] link: {link.d2h_gbps:.1f} GB/s device->host, {link.h2d_gbps:.1f} GB/s host->device (pinned)")
    if getattr(ctx.args, "offload_hf_budget", False):
        return run_hf_budget(ctx)
    k = ctx.args.k
    results: list[Result] = []
    timelines: dict[str, Any] = {}
    for name in ctx.presets:
        cfg = preset(name)
        ctx.args._preset_label = name
        ours = lambda policy, **kw: (lambda: [ActivationOffload(policy=policy, **kw)])  # noqa: E731
        variants = [
            ("no offload", lambda: [], False),
            ("no offload (repeat)", lambda: [], False),  # the run-to-run noise of the loss
            ("save_on_cpu", lambda: [_SaveOnCpu()], False),
            ("checkpointing", lambda: [], True),
            ("ours auto", ours("auto"), False),
            ("ours all", ours("all"), False),
            (f"ours K={k}", ours(k), False),
            ("ckpt + ours auto", ours("auto"), True),
            ("recompute only", ours(0, recompute="selective"), False),
            ("ours auto + recompute", ours("auto", recompute="selective"), False),
            ("ours auto + full recompute", ours("auto", recompute="full"), False),
            ("norm-act only", ours(0, recompute="norm-act"), False),
            ("ours auto + norm-act", ours("auto", recompute="norm-act"), False),
        ]
        chosen = _chosen(ctx, [v[0] for v in variants])
        if any("norm-act" in v for v in chosen):
            _print_norm_act_regions(cfg)
        rows: dict[str, tuple[Result, _StepMemory]] = {}
        for variant, cbs, ckpt in variants:
            if variant not in chosen:
                continue
            r, probe, _ = _lightning_variant(ctx, cfg, variant, cbs, ckpt)
            rows[variant] = (r, probe)
            results.append(r)
        _parity(rows)
        _summary(name, "Lightning full step", [r for r, _ in rows.values()])
        _goal(name, "Lightning full step", [r for r, _ in rows.values()])

        if not ctx.args.skip_oom and "ours all" in rows:
            results += _oom_demo(ctx, cfg, rows)

        if not ctx.args.skip_fwdbwd:
            label = f"{name} fwd+bwd"
            ctx.args._preset_label = label
            fb = []
            tl: dict[str, Any] = {}
            fwdbwd = [
                ("no offload", lambda m: None, False, True),
                ("save_on_cpu", lambda m: (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)), False, False),
                ("checkpointing", lambda m: None, True, False),
                ("ours auto", lambda m: offload_activations(m, "auto"), False, True),
                ("ours all", lambda m: offload_activations(m, "all"), False, True),
                (f"ours K={k}", lambda m: offload_activations(m, k), False, False),
                ("recompute only", lambda m: offload_activations(m, 0, recompute="selective"), False, False),
                ("ours auto + recompute", lambda m: offload_activations(m, "auto", recompute="selective"), False,
                 True),
                ("ours auto + full recompute", lambda m: offload_activations(m, "auto", recompute="full"), False,
                 False),
                ("norm-act only", lambda m: offload_activations(m, 0, recompute="norm-act"), False, False),
                ("ours auto + norm-act", lambda m: offload_activations(m, "auto", recompute="norm-act"), False,
                 False),
            ]
            for variant, make, ckpt, with_timeline in fwdbwd:
                if variant in chosen:
                    fb.append(_fwdbwd_variant(ctx, cfg, variant, label, make, ckpt=ckpt,
                                              timeline=tl if with_timeline else None))
            results += fb
            _goal(label, "plain PyTorch fwd+bwd", fb)
            timelines[name] = tl
            _summary(label, "plain PyTorch fwd+bwd (the anchors' method)", fb, anchors=name == "medium")
    if timelines and ctx.out_dir:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        (ctx.out_dir / "offload_timelines.json").write_text(json.dumps(timelines))
    print(f"[offload] {GOAL}")
    return results


def _goal(label: str, what: str, rows: list[Result], max_ratio: float = 1.10, min_saved: float = 0.40) -> None:
    """Print, per variant, whether it meets the goal (both axes against 'no offload' of this run)."""
    plain = next((r for r in rows if r.variant == "no offload" and r.timing and not r.error), None)
    if plain is None:
        print(f"[offload] {label}: goal not evaluated (no plain row)", flush=True)
        return
    base_ms, base_act = plain.median_ms, plain.extra["act_peak_gib"]
    met, near = [], []
    for r in rows:
        if r is plain or r.error or not r.timing or r.extra.get("act_peak_gib") is None:
            continue
        ratio, saved = r.median_ms / base_ms, 1 - r.extra["act_peak_gib"] / base_act
        cell = f"{r.variant} ({saved:.0%} less at {ratio:.2f}x)"
        (met if ratio <= max_ratio and saved >= min_saved else near).append(cell)
        r.extra["goal_met"] = ratio <= max_ratio and saved >= min_saved
    print(f"[offload] {label} ({what}): {GOAL}")
    print(f"[offload]   met by: {', '.join(met) if met else 'none'}")
    print(f"[offload]   not met: {', '.join(near) if near else '-'}", flush=True)


def _parity(rows: dict[str, tuple[Result, _StepMemory]]) -> None:
    base = rows["no offload"][1].losses
    if not base:
        return
    ref = torch.stack(base).cpu()
    for r, probe in rows.values():
        if probe.losses and len(probe.losses) == len(base):
            diff = (torch.stack(probe.losses).cpu() - ref).abs().max().item()
            r.extra["loss_max_abs_diff"] = diff


def _summary(label: str, what: str, rows: list[Result], anchors: bool = False) -> None:
    plain = next((r for r in rows if r.variant == "no offload" and r.timing), None)
    print(f"\n[offload] {label}: {what}; ratios against 'no offload' in this run")
    print("| variant | step ms | x plain | act peak GiB | act saved | loss diff | offloaded GiB/step |"
          + (" anchor ms / GiB |" if anchors else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if anchors else ""))
    for r in rows:
        if r.error:
            print(f"| {r.variant} | {r.error} |")
            continue
        act = r.extra.get("act_peak_gib")
        ratio = r.median_ms / plain.median_ms if plain and plain.median_ms else float("nan")
        base = plain.extra["act_peak_gib"] if plain else 0
        saved = 1 - act / base if base and act is not None else float("nan")
        diff = r.extra.get("loss_max_abs_diff")
        line = (f"| {r.variant} | {r.median_ms:.1f} | {ratio:.2f}x | {act:.2f} | {saved:.0%} | "
                f"{'-' if diff is None else f'{diff:.2e}'} | {r.extra.get('offloaded_gib_per_step', '-')} |")
        if anchors:
            a = ANCHORS.get(r.variant)
            line += f" {a[0]} / {a[1]} |" if a else " - |"
        print(line)
    for r in rows:
        if r.extra.get("plan"):
            print(f"[offload] {label} / {r.variant} plan: " + r.extra["plan"].replace("\n", "\n    "))
    print(flush=True)


def _oom_demo(ctx: BenchContext, cfg, rows: dict[str, tuple[Result, _StepMemory]]) -> list[Result]:
    """Double the batch under a memory cap between what plain and ours-all need: plain fails, ours trains."""
    plain, ours = rows["no offload"][0], rows["ours all"][0]
    if plain.error or ours.error:
        return []
    big = dataclasses.replace(cfg, batch_size=2 * cfg.batch_size)
    static = plain.extra["static_gib"] * GIB
    need_plain = static + 2 * plain.extra["act_peak_gib"] * GIB
    need_ours = static + 2 * ours.extra["act_peak_gib"] * GIB
    cap = (need_plain + need_ours) / 2
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    frac = cap / total
    print(f"[offload] OOM demo: batch {big.batch_size}, cap {cap / GIB:.1f} GiB ({frac:.3f} of the GPU); "
          f"expected need: plain ~{need_plain / GIB:.1f} GiB, ours all ~{need_ours / GIB:.1f} GiB", flush=True)
    out = []
    ctx.args._preset_label = f"{ctx.presets[0]} batch x2, {cap / GIB:.0f} GiB cap"
    index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(frac, index)
    try:
        for variant, cbs in (("no offload", lambda: []), ("ours all", lambda: [ActivationOffload(policy="all")])):
            r, _, _ = _lightning_variant(ctx, big, variant, cbs, steps=(2, 4))
            r.extra["memory_cap_gib"] = round(cap / GIB, 2)
            r.extra["trained"] = r.error is None
            out.append(r)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        reset_memory(ctx.device)
    print(f"[offload] OOM demo result: no offload -> {'trained' if out[0].extra['trained'] else 'out of memory'}; "
          f"ours all -> {'trained' if out[1].extra['trained'] else 'FAILED: ' + str(out[1].error)}", flush=True)
    ctx.args._preset_label = ctx.presets[0]
    return out


# ------------------------------------------------------------------------------- budget on an HF Llama

HF_CFG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
HF_BATCH, HF_SEQ = 4, 2048
# Off the GPU (`--device cpu`: a functional run of the same code paths) a tiny configuration, host-copy engine.
HF_CFG_CPU = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
HF_BATCH_CPU, HF_SEQ_CPU = 2, 32
BUDGET_FRACTIONS = (0.3, 0.5, 0.7, 0.9)
COMPILER_KNOBS = (0.5, 0.3)
FORECAST_GBPS = 450.0  # a GH200-class host link
# Seconds into the run after which the later groups are skipped (the GPU call's limit is 420 s).
COMPILED_BEFORE_S, ROW_BEFORE_S = 150.0, 330.0
LEAN_ROW_BEFORE_S = 330.0  # --offload-hf-lean: a budget row takes about 30 s
COMPILED_OFFLOAD_BEFORE_S = 330.0  # a compiled row takes about 30 s


def _hf_shape(ctx: BenchContext) -> tuple[dict, int, int]:
    return (HF_CFG, HF_BATCH, HF_SEQ) if ctx.cuda else (HF_CFG_CPU, HF_BATCH_CPU, HF_SEQ_CPU)


class _HFLlama(L.LightningModule):
    """The user's model: transformers' LlamaForCausalLM in a plain LightningModule, fused AdamW."""

    def __init__(self, cfg: dict, device: torch.device) -> None:
        super().__init__()
        import transformers

        c = transformers.LlamaConfig(**cfg)
        c._attn_implementation = "sdpa"
        with torch.device(device):
            self.model = transformers.LlamaForCausalLM(c)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.device.type == "cuda")


class _ModelStatePeak(L.Callback):
    """Per step: the peak allocation minus the model state (weights, gradients at full size, optimizer state)."""

    def __init__(self) -> None:
        self.act: list[int] = []
        self.peak: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        params = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        opt = trainer.optimizers[0]
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        self.peak.append(peak)
        self.act.append(peak - 2 * params - state)


@contextlib.contextmanager
def _compiler_knob(value: float | None):
    """``torch._functorch.config.activation_memory_budget`` set by hand, as a user would (restored after)."""
    if value is None:
        yield
        return
    import torch._functorch.config as fconfig

    before = fconfig.activation_memory_budget
    fconfig.activation_memory_budget = value
    torch._dynamo.reset()  # the knob is read when a graph is partitioned: no graph compiled before may serve
    try:
        yield
    finally:
        fconfig.activation_memory_budget = before
        torch._dynamo.reset()


def _hf_variant(ctx: BenchContext, name: str, callbacks: Callable[[], list], hf_ckpt: bool = False,
                compiled: bool = False, knob: float | None = None, warmup: int = 11,
                iters: int | None = None) -> Result:
    cfg, batch, seq = _hf_shape(ctx)
    iters = ctx.iters if iters is None else iters
    r = Result(ctx.suite, "hf-llama-2048x8" if ctx.cuda else "hf-llama-tiny-cpu", name, None, batch * seq, 0.0)
    probe = _ModelStatePeak()
    cbs: list = []
    module = None
    reset_memory(ctx.device)
    t0 = time.time()
    try:
        with _compiler_knob(knob):
            L.seed_everything(0, verbose=False)
            module = _HFLlama(cfg, ctx.device)
            if hf_ckpt:
                module.model.gradient_checkpointing_enable()
            if compiled:
                module.model = torch.compile(module.model)
            cbs = callbacks()
            g = torch.Generator().manual_seed(0)
            data = torch.randint(0, cfg["vocab_size"], ((warmup + iters) * batch, seq), generator=g)
            dl = torch.utils.data.DataLoader(data, batch_size=batch, pin_memory=ctx.cuda)
            from common import StepTimer

            timer = StepTimer(warmup)
            trainer = L.Trainer(accelerator="gpu" if ctx.cuda else "cpu", devices=1, max_steps=warmup + iters,
                                precision="bf16-mixed", limit_val_batches=0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, probe, *cbs])
            trainer.fit(module, dl)
        r.timing = timer.timing()
        r.extra["act_bytes"] = max(probe.act[warmup:])
        r.extra["act_gib"] = round(r.extra["act_bytes"] / GIB, 3)
        r.peak_mem_bytes = max(probe.peak[warmup:])
        r.extra["peak_gib"] = round(r.peak_mem_bytes / GIB, 3)
        r.extra["losses"] = [float(x) for x in module.losses]
        if knob is not None:
            r.extra["compiler_knob"] = knob
        for cb in cbs:
            _engine_extras(r, cb)
    except Exception as e:  # an OOM or a failure is a row, not the end of the suite
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
        traceback.print_exc()
    module = None
    cbs = []
    gc.collect()
    reset_memory(ctx.device)
    r.extra["wall_s"] = round(time.time() - t0, 1)
    print(f"[budget] {name:<28} | {r.median_ms or 0:8.1f} ms | act {r.extra.get('act_gib', '-')} GiB | peak "
          f"{r.extra.get('peak_gib', '-')} GiB | {r.extra['wall_s']} s" + (f" | {r.error}" if r.error else ""),
          flush=True)
    return r


def _engine_extras(r: Result, cb: Any) -> None:
    """What an ActivationOffload callback's engine planned, predicted and measured, into the row."""
    if not isinstance(cb, ActivationOffload) or cb.engine is None:
        return
    e, b = cb.engine, cb.engine.budget
    r.extra["plan"] = cb.plan.describe() if cb.plan else None
    if b is not None and b.budget_bytes is not None:
        r.extra["budget_gib"] = round(b.budget_bytes / GIB, 3)
        r.extra["budget_bytes"] = b.budget_bytes
        r.extra["plain_gib"] = round((b.plain_activation_bytes or 0) / GIB, 3)
        r.extra["engine_plain_gib"] = round((b.engine_plain_bytes or 0) / GIB, 3)
        r.extra["budget_log"] = b.log
    if b is not None and b.forecast is not None:
        r.extra["predicted_gib"] = round(b.forecast.activation_bytes / GIB, 3)
        r.extra["predicted_ratio"] = round(b.forecast.ratio, 3)
        r.extra["achieved_engine_gib"] = round((b.achieved_bytes or 0) / GIB, 3)
        r.extra["rounds"] = b.round
        r.extra["lean_loss"] = bool(e.plan is not None and e.plan.lean_loss)
        if b.lean_loss_measured is not None:
            r.extra["lean_loss_measured"] = b.lean_loss_measured
        r.extra["choices"] = b.forecast.describe_choices()
        _forecast_450(r, e)
    if e.record_timeline and e.timeline:
        r.extra["timeline"] = _timeline(e)


def _timeline(e: Any, points: int = 200) -> dict:
    """The engine's events of its last step: host ms, device bytes allocated (CUDA) and the tracked saved bytes,
    downsampled to the largest value per 1/``points`` of the step."""
    tl = e.timeline
    t_end = max(p.t_ms for p in tl) or 1.0
    fwd_end = next((p.t_ms for p in tl if p.event == "forward-end"), None)
    bins: dict[int, tuple[float, float, float]] = {}
    for p in tl:
        k = min(int(p.t_ms / t_end * points), points - 1)
        alloc = (p.allocated_bytes or 0) / GIB
        cur = (round(p.t_ms, 2), round(alloc, 3), round(p.saved_bytes / GIB, 4))
        if k not in bins or cur[1] + cur[2] > bins[k][1] + bins[k][2]:
            bins[k] = cur
    return {"forward_end_ms": fwd_end, "points": [list(v) for _, v in sorted(bins.items())]}


def _forecast_450(r: Result, e: Any) -> None:
    """The planner's forecast on a GH200-class link (``FORECAST_GBPS``) for the same measured blocks (a forecast,
    not a measurement)."""
    from lightning_gh.activation_offload.budget import plan_budget

    try:
        _, fc = plan_budget(e.budget.profile, e.budget.budget_bytes, FORECAST_GBPS, FORECAST_GBPS, e.options.margin,
                            e.options.skip_last_blocks)
        r.extra["forecast_450_ratio"] = round(fc.ratio, 3)
        r.extra["forecast_450_gib"] = round(fc.activation_bytes / GIB, 3)
        r.extra["forecast_450_choices"] = fc.describe_choices()
    except ValueError as err:
        r.extra["forecast_450_ratio"] = f"infeasible: {err}"


def _dump(ctx: BenchContext, rows: list[Result]) -> None:
    """Every row so far, after each row: a run cut off by its time limit still leaves what it measured."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    data = [{"variant": r.variant, "preset": r.preset, "median_ms": r.median_ms,
             "samples_ms": r.timing.samples_ms if r.timing else None, "error": r.error, **r.extra} for r in rows]
    (ctx.out_dir / "offload_budget_rows.json").write_text(json.dumps(data, indent=1, default=str))


def run_hf_budget(ctx: BenchContext) -> list[Result]:
    """The activation-budget table: HF Llama (2048 x 8 layers, FFN 5632, 16/4 heads), 4 x 2048 tokens, bf16-mixed, fused AdamW.

    Order: the eager variants (the ratio base first), a budget at checkpointing's measured activation memory, two
    short runs that record the memory over one step (plain, and the plan at 50%), the `medium` demo preset at 50%,
    then the compiled variants (the compiler's knob by hand, and budget mode on the compiled model), each group
    skipped once the run is too far in for its limit.
    """
    t_start = time.time()
    rows: list[Result] = []
    host = {} if ctx.cuda else {"backend": "host-copy", "min_tensor_bytes": 1}
    ours = lambda **kw: (lambda: [ActivationOffload(**host, **kw)])  # noqa: E731

    def add(r: Result) -> Result:
        rows.append(r)
        _dump(ctx, rows)
        return r

    if getattr(ctx.args, "offload_compiled_sdpa", False):
        return _compiled_sdpa(ctx, ours, add, rows)
    if getattr(ctx.args, "offload_hf_lean", False):
        return _hf_lean(ctx, t_start, ours, add, rows)
    add(_hf_variant(ctx, "none", lambda: []))
    ckpt = add(_hf_variant(ctx, "HF gradient_checkpointing", lambda: [], hf_ckpt=True))
    add(_hf_variant(ctx, "SAC (recompute=selective)", ours(policy=0, recompute="selective")))
    add(_hf_variant(ctx, "ours auto", ours(policy="auto")))
    add(_hf_variant(ctx, "ours all", ours(policy="all")))
    for f in BUDGET_FRACTIONS:
        add(_hf_variant(ctx, f"budget {f:.0%}", ours(budget=f)))
    if ckpt.extra.get("act_bytes", 0) > 0:
        add(_hf_variant(ctx, "budget = checkpointing's act", ours(budget=int(ckpt.extra["act_bytes"]))))
    # Memory over one step: the plain run (hooks that only record: no dedupe, no re-cast, nothing moved) and the plan.
    add(_hf_variant(ctx, "timeline: plain", ours(policy=0, dedupe_casts=False, recompute_param_casts=False,
                                                record_timeline=True), iters=1))
    add(_hf_variant(ctx, "timeline: budget 50%", ours(budget=0.5, record_timeline=True), iters=1))
    if getattr(ctx.args, "offload_medium_budget", False) and ctx.cuda:
        rows.extend(_medium_budget(ctx))
        _dump(ctx, rows)
    if getattr(ctx.args, "offload_hf_compiled", False):
        compiled = [("compiled", lambda: [], None)]
        for k in COMPILER_KNOBS:
            # The same knob by hand and from budget mode: the second compile of an identical graph may hit
            # inductor's cache, so the pair costs about one compile.
            compiled += [(f"compiled + knob {k}", lambda: [], k), (f"compiled + budget {k:.0%}", ours(budget=k), None)]
        for i, (name, cbs, knob) in enumerate(compiled):
            limit = COMPILED_BEFORE_S if i == 0 else ROW_BEFORE_S
            if time.time() - t_start > limit:
                print(f"[budget] {name}: skipped, {time.time() - t_start:.0f} s into the run", flush=True)
                continue
            add(_hf_variant(ctx, name, cbs, compiled=True, knob=knob))
    _hf_summary(rows)
    return rows


def _hf_lean(ctx: BenchContext, t_start: float, ours: Callable, add: Callable, rows: list[Result]) -> list[Result]:
    """The lean causal-LM loss on the budget table's model: what it takes off the step's memory and adds to its time,
    timed alone (``policy=0``: the engine's free savings, with and without it), and what the budget planner makes of it at
    checkpointing's memory and at 30/50/70% (each budget without it too where the time allows). 12 untimed steps:
    budget mode measures in 8 (warm-up, raw, two plain, the lean loss, three recompute modes) and corrects in up
    to 3."""
    w = 12
    add(_hf_variant(ctx, "none", lambda: [], warmup=w))
    ckpt = add(_hf_variant(ctx, "HF gradient_checkpointing", lambda: [], hf_ckpt=True, warmup=w))
    add(_hf_variant(ctx, "policy=0", ours(policy=0), warmup=w))
    add(_hf_variant(ctx, "policy=0 + lean_loss", ours(policy=0, lean_loss=True), warmup=w))
    # With the compiled probe the rows without the lean loss (measured in the first run) make room for it.
    probe_compiled = getattr(ctx.args, "offload_compiled_offload", False)
    todo = []
    if ckpt.extra.get("act_bytes", 0) > 0:
        at = int(ckpt.extra["act_bytes"])
        if not probe_compiled:
            todo += [("budget = ckpt act, lean_loss=False", ours(budget=at, lean_loss=False))]
        todo += [("budget = ckpt act", ours(budget=at))]
    todo += [(f"budget {f:.0%}", ours(budget=f)) for f in (0.3, 0.5, 0.7)]
    if not probe_compiled:
        todo += [("budget 30%, lean_loss=False", ours(budget=0.3, lean_loss=False))]
    for name, cbs in todo:
        if time.time() - t_start > LEAN_ROW_BEFORE_S:
            print(f"[budget] {name}: skipped, {time.time() - t_start:.0f} s into the run", flush=True)
            continue
        add(_hf_variant(ctx, name, cbs, warmup=w))
    if probe_compiled:
        _print_offload_flags()
        probe = [("compiled", None, 0)] + [(f"compiled + knob {k}", k, 0) for k in COMPILER_KNOBS]
        probe += [(f"compiled + knob 0.5 + torch offload, layers 0-{k - 1} mm", 0.5, k) for k in (2, 4)]
        for name, knob, k in probe:
            if time.time() - t_start > COMPILED_OFFLOAD_BEFORE_S:
                print(f"[budget] {name}: skipped, {time.time() - t_start:.0f} s into the run", flush=True)
                continue
            with _torch_offload(k):
                add(_hf_variant(ctx, name, lambda: [], compiled=True, knob=knob, warmup=w))
    _hf_summary(rows)
    return rows


class _CausalSdpa(L.Callback):
    """``keep_causal_sdpa`` on the model before its first (compiling) step: SDPA's causal path instead of the
    explicit mask transformers builds under ``torch.compile`` (lightning_gh.precision.hf_sdpa)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_gh.precision import keep_causal_sdpa

        keep_causal_sdpa(pl_module)


def _compiled_sdpa(ctx: BenchContext, ours: Callable, add: Callable, rows: list[Result]) -> list[Result]:
    """At the compiler's knob (0.5, 0.3) on a compiled HF model: the knob set by hand (what a user does), the same
    with SDPA's causal path kept, and budget mode with default options (which sets the knob and keeps the causal
    path). The lean loss on top of the causal path is not a row (docs/activation_offload.md says why)."""
    for knob in COMPILER_KNOBS:
        tag = f"compiled + knob {knob}"
        add(_hf_variant(ctx, tag, lambda: [], compiled=True, knob=knob))
        add(_hf_variant(ctx, f"{tag} + causal sdpa", lambda: [_CausalSdpa()], compiled=True, knob=knob))
        add(_hf_variant(ctx, f"compiled + budget {knob:.0%}", ours(budget=knob), compiled=True))
    _hf_summary(rows)
    return rows


def _print_offload_flags() -> None:
    import torch._functorch.config as fconfig
    from torch.utils.checkpoint import CheckpointPolicy

    names = ("enable_activation_offloading", "activation_offload_separate_stream", "activation_offload_sink_wait",
             "activation_reload_prefetch", "activation_offload_cpu_gpu_bw")
    print("[budget] torch", torch.__version__, {n: getattr(fconfig, n, "absent") for n in names},
          "MUST_CPU_OFFLOAD:", hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"), flush=True)


@contextlib.contextmanager
def _torch_offload(layers: int):
    """torch's own activation offloading in the compiled graph, for the matmul outputs of decoder layers
    ``0..layers-1`` that the partitioner saves (a probe: the flags are marked "testing purpose" in torch; nothing in
    torch 2.13 marks nodes for it, so a joint-graph pass here does, from each node's module path)."""
    if layers <= 0:
        yield
        return
    import re

    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    mm = {torch.ops.aten.mm.default}

    def mark(graph: torch.fx.Graph) -> None:
        for n in graph.nodes:
            if n.op != "call_function" or n.target not in mm:
                continue
            stack = n.meta.get("nn_module_stack") or {}
            paths = " ".join(str(v[0]) for v in stack.values())
            m = re.search(r"layers[\[\.](?:_modules\[')?(\d+)", paths)
            if m and int(m.group(1)) < layers:
                n.meta["should_offload"] = True

    flags = {"enable_activation_offloading": True, "activation_offload_separate_stream": True,
             "activation_offload_sink_wait": True, "activation_reload_prefetch": True,
             "activation_offload_cpu_gpu_bw": 55.0}
    before = {k: getattr(fconfig, k) for k in flags if hasattr(fconfig, k)}
    pre = iconfig.joint_custom_pre_pass
    for k in before:
        setattr(fconfig, k, flags[k])
    iconfig.joint_custom_pre_pass = mark
    torch._dynamo.reset()
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(fconfig, k, v)
        iconfig.joint_custom_pre_pass = pre
        torch._dynamo.reset()


def _medium_budget(ctx: BenchContext) -> list[Result]:
    """The project's `medium` demo preset: none and budget=0.5, full Lightning steps, same process."""
    out = []
    for name, cbs in (("medium none", []), ("medium budget 50%", [ActivationOffload(budget=0.5)])):
        r = Result(ctx.suite, "medium", name, None, 0, 0.0)
        probe = _ModelStatePeak()
        reset_memory(ctx.device)
        t0 = time.time()
        try:
            L.seed_everything(0, verbose=False)
            model = LlamaLM(preset("medium"))
            sub = BenchContext(ctx.suite, ctx.presets, ctx.device, 11, ctx.iters, ctx.out_dir, ctx.args)
            r.timing, _ = lightning_steps(model, sub, callbacks=[probe, *cbs])
            r.extra["act_bytes"] = max(probe.act[11:])
            r.extra["act_gib"] = round(r.extra["act_bytes"] / GIB, 3)
            r.peak_mem_bytes = max(probe.peak[11:])
            r.extra["peak_gib"] = round(r.peak_mem_bytes / GIB, 3)
            for cb in cbs:
                _engine_extras(r, cb)
        except Exception as e:
            r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
            traceback.print_exc()
        model, cbs = None, []
        gc.collect()
        reset_memory(ctx.device)
        r.extra["wall_s"] = round(time.time() - t0, 1)
        print(f"[budget] {name:<28} | {r.median_ms or 0:8.1f} ms | act {r.extra.get('act_gib', '-')} GiB | "
              f"{r.extra['wall_s']} s" + (f" | {r.error}" if r.error else ""), flush=True)
        out.append(r)
    return out


def _hf_summary(rows: list[Result]) -> None:
    base = rows[0]
    print("\n[budget] HF Llama 2048x8, 4x2048 tokens, bf16-mixed, fused AdamW, full Lightning steps; ratios against "
          "'none' in this process (medium rows: against 'medium none'). act = peak - (weights + gradients + AdamW "
          "state). Budget fractions are of the plain step, measured by the engine with no engine effect")
    print("| variant | step ms | x none | peak GiB | act GiB | act % less | budget GiB | achieved/budget | "
          f"predicted x | forecast {FORECAST_GBPS:g} GB/s (x, GiB) | max loss diff | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref = base.extra.get("losses") or []
    for r in rows:
        if r.error:
            print(f"| {r.variant} | {r.error} |")
            continue
        b0 = next((x for x in rows if x.variant == "medium none"), base) if r.preset == "medium" else base
        ratio = r.median_ms / b0.median_ms if b0.median_ms else float("nan")
        b = r.extra.get("budget_gib")
        act0 = b0.extra.get("act_gib") or float("nan")
        less = f"{1 - r.extra['act_gib'] / act0:.0%}" if r is not b0 else "-"
        ach = f"{r.extra['act_gib'] / b:.3f}" if b else "-"
        ls = r.extra.get("losses") or []
        diff = max((abs(a - c) for a, c in zip(ls, ref)), default=float("nan")) if ls and r is not base else 0.0
        fc = (f"{r.extra['forecast_450_ratio']}x, {r.extra.get('forecast_450_gib')} (forecast)"
              if "forecast_450_ratio" in r.extra else "-")
        print(f"| {r.variant} | {r.median_ms:.1f} | {ratio:.2f}x | {r.extra['peak_gib']:.2f} | "
              f"{r.extra['act_gib']:.2f} | {less} | {b if b else '-'} | {ach} | "
              f"{r.extra.get('predicted_ratio', '-')} | "
              f"{fc} | {diff:.3g} | {r.extra.get('choices', '-')}{'; lean loss' if r.extra.get('lean_loss') else ''} |")
    for r in rows:
        if r.extra.get("plan"):
            print(f"[budget] {r.variant} plan: " + str(r.extra["plan"]).replace("\n", "\n    "))
        if r.extra.get("budget_log"):
            print(f"[budget] {r.variant} log: {r.extra['budget_log']}")
    print(flush=True)
