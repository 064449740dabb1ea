"""Activation memory on the medium HF config: ActivationOffload against HF and selective checkpointing, per family.

The model users bring: a ``transformers`` decoder (``LlamaForCausalLM``, ``Qwen2ForCausalLM`` with its q/k/v bias,
``MistralForCausalLM``), random init, SDPA attention, hidden 2048, 8 layers, FFN 5632, 16 heads with 4 KV heads (the
offload suite's budget table's shape, :data:`suites.offload.HF_CFG`), vocab 32000, 4 x 2048 tokens, in a plain
``LightningModule`` whose ``training_step`` computes its own loss from the logits (no ``labels=``), with
``torch.optim.AdamW(fused=True)`` and ``Trainer(precision="bf16-mixed")``. Each family runs in a fresh process of its
own (``--in-process``: all in this one), its variants one after the other in that process, each on a fresh model (same
seed, same batches), with a full garbage collection and ``torch.cuda.empty_cache()`` between them (a row records what
stayed allocated after its cleanup, ``leftover_mib``, and the run warns where that looks like a leak):

================  ==================================================================================================
variant           what runs
================  ==================================================================================================
plain             nothing: the ratio base (always runs first)
hf_ckpt           ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
hf_ckpt_reentrant the same with ``{"use_reentrant": True}`` (torch's reentrant checkpoint)
sac               torch's selective activation checkpointing per decoder layer: each layer's forward under
                  ``torch.utils.checkpoint.checkpoint(use_reentrant=False, context_fn=...)`` with
                  ``create_selective_checkpoint_contexts`` and a policy that saves matmul and SDPA outputs and
                  recomputes the rest (:func:`sac_policy`)
auto              ``ActivationOffload()`` with default options
lean              ``ActivationOffload(policy=0, lean_loss=True)``: the lean loss alone (nothing offloaded or
                  recomputed)
lean_norm_act     ``ActivationOffload(policy=0, recompute="norm-act", lean_loss=True)``: the lean loss, and every
                  block recomputes its norms and gated activations (nothing offloaded)
lean_norm_mlp     as lean_norm_act with each layer's ``mlp`` marked ``lgh_recompute = True``: every block recomputes
                  its norms and its whole MLP (gate and up projections included)
budget_0.7 ...    ``ActivationOffload(budget=0.7)``, ``0.5``, ``0.3``
budget_0.7_last   ``ActivationOffload(budget=0.7, budget_offload="last")``: the plan offloads only what recomputing
                  cannot fit
budget_at_ckpt    ``ActivationOffload(budget=<bytes>)`` at hf_ckpt's measured activation memory (skipped, with a
                  note, when hf_ckpt did not run)
budget_at_ckpt_mlp
                  as budget_at_ckpt with the MLPs marked as in lean_norm_mlp: the budget's norm-act mode recomputes
                  norms and MLPs (this row and lean_norm_mlp are diagnostics: no goal is judged on them)
================  ==================================================================================================

Each step is timed between ``torch.cuda.synchronize()`` calls (the median of ``--iters`` timed steps). The timed steps
start after ``--warmup`` steps, and for the ActivationOffload variants only once the engine has settled its plan (its
measuring and checking steps done; at most ``--max-warmup`` untimed steps, else the row says ``settled: false``).
Memory: ``torch.cuda.max_memory_allocated`` per step; the activation memory is that peak minus weights, gradients
and optimizer state (measured as the offload suite does, :class:`suites.offload._ModelStatePeak`). Losses: the last
step's, and the largest ``|loss - plain loss|`` over the steps both ran. An out-of-memory error is a row with the
error. After the table, one line per family says whether the goals are met by the measured rows (:func:`goals`).

Usage (on the GPU machine)::

    python benchmarks/activation_job.py                                   # all families, all variants, JSON to $OUT
    python benchmarks/activation_job.py --family qwen2 --variants plain auto --iters 30
    python benchmarks/activation_job.py --device cpu --smoke              # every code path on a tiny model, CPU
    python benchmarks/activation_job.py --family llama --profile plain budget_0.7   # + two profiled steps each
    python benchmarks/activation_job.py --family llama --precision fp8-ao-tensorwise  # every variant under fp8

Output in ``--out`` (default ``$OUT``, else ``bench_out/``): ``activation_job.jsonl``, one JSON object a line, written as
each row ends (``"kind"``: ``"run"`` for the run and for each family's process, with the machine and the measured link,
``"row"`` per variant, ``"goals"`` per family), and ``activation_job.md``, the table printed at the end. Without a CUDA
GPU (and without ``--device cpu --smoke``) it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):  # the repository root (lightning_gh) and benchmarks/ (common, suites)
    if _p not in sys.path:
        sys.path.insert(0, _p)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lightning_gh  # noqa: E402
from common import machine_info, reset_memory  # noqa: E402
from lightning_gh.activation_offload import ActivationOffload  # noqa: E402
from lightning_gh.precision.names import LIGHTNING_NAMES, canonical  # noqa: E402
from suites.offload import (  # noqa: E402
    HF_BATCH,
    HF_BATCH_CPU,
    HF_CFG,
    HF_CFG_CPU,
    HF_SEQ,
    HF_SEQ_CPU,
    _engine_extras,
    _ModelStatePeak,
)

GIB = 2**30
MIB = 2**20
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}
VARIANTS = ("plain", "hf_ckpt", "hf_ckpt_reentrant", "sac", "auto", "lean", "lean_norm_act", "lean_norm_mlp",
            "budget_0.7", "budget_0.7_last", "budget_0.5", "budget_0.3", "budget_at_ckpt", "budget_at_ckpt_mlp")
#: Variants whose decoder layers' MLP modules are marked ``lgh_recompute = True``: ``"norm-act"`` (and the budget's
#: norm-act mode) then recomputes each whole MLP (its gate and up projections too), not only the norms.
MLP_MARKED = ("lean_norm_mlp", "budget_at_ckpt_mlp")  # diagnostic rows: a mark on the model, so no goal is judged on them
ANCHORS = ("hf_ckpt", "hf_ckpt_reentrant", "sac")
#: Variants whose budget is hf_ckpt's measured activation memory (run after hf_ckpt, skipped without it).
AT_CKPT = ("budget_at_ckpt", "budget_at_ckpt_mlp")
#: The ActivationOffload variants: the rows the goals are judged on (the others are the anchors).
OURS = ("auto", "lean", "lean_norm_act", "budget_0.7", "budget_0.7_last", "budget_0.5", "budget_0.3", "budget_at_ckpt")
#: The smoke run's model: the offload suite's CPU shape with two decoder layers.
SMOKE_CFG = {**HF_CFG_CPU, "num_hidden_layers": 2}
#: Memory left allocated after a variant's cleanup above which the run warns of a leak.
LEAK_BYTES = 64 * MIB
#: Budget states after which the plan stays (lightning_gh.activation_offload.controller.BudgetState values).
SETTLED_BUDGET_STATES = ("done", "failed", "compiled")
# The goals: step time ratios against plain, and the activation memory saved.
GOAL_AT_CKPT_RATIO = 1.10  # at checkpointing's memory
CKPT_MEMORY_TOLERANCE = 1.05  # "at checkpointing's memory": activation memory within +5% of hf_ckpt's
GOAL_LESS_ACT, GOAL_LESS_ACT_RATIO = 0.30, 1.05  # >= 30% less activation memory at <= 1.05x
GOAL_AUTO_RATIO = 1.03  # ActivationOffload() with default options


# ------------------------------------------------------------------------------------------------- the model


def build_model(family: str, config: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A random-init ``transformers`` causal LM of ``family`` with ``config``'s shape, SDPA attention, on ``device``."""
    import transformers

    cfg_name, model_name = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**config, attn_implementation="sdpa", use_cache=False)
    with torch.device(device):
        return getattr(transformers, model_name)(cfg)


class OwnLossLM(L.LightningModule):
    """What users write: the HF model, the loss from the logits (no ``labels=``), their own fused AdamW."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-4) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: list[torch.Tensor] = []  # detached, read after the run (no sync per step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


# ------------------------------------------------------------------------- selective activation checkpointing


@functools.lru_cache(maxsize=1)
def _sac_saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Save the outputs of matmuls and SDPA, recompute everything else (norms, rotary, SiLU, products, casts)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _sac_saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def apply_sac(layers: Sequence[torch.nn.Module], policy: Any = sac_policy) -> int:
    """Run each layer's forward under non-reentrant ``checkpoint`` with ``policy`` (:func:`sac_policy`); the number
    of layers wrapped."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for layer in layers:
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        layer.forward = forward
    return len(layers)


# -------------------------------------------------------------------------------------------- one variant


def settled(enabled: bool, budget_state: str | None, plan_age: int | None, profile_steps: int,
            checking: bool = False) -> bool:
    """Whether an ActivationOffload engine's plan stays from here on, so the steps after this one can be timed.

    ``enabled``: the engine moves anything (``False`` off CUDA: nothing to wait for). ``budget_state``: the budget
    controller's state value, ``None`` without a budget. ``plan_age``: steps ended since the plan last changed
    (``None``: no plan yet). A budget plan stays once the controller is done and a step ran with it; an ``"auto"``
    plan once it outlived its check (``profile_steps`` timed steps with it) and no verdict is still to come
    (``checking``: :attr:`~lightning_gh.activation_offload.auto.AutoPlanner.checking`).
    """
    if not enabled:
        return True
    if checking:
        return False
    if plan_age is None:
        return False
    if budget_state is not None:
        return budget_state in SETTLED_BUDGET_STATES and plan_age >= 1
    return plan_age > profile_steps


class StepProbe(_ModelStatePeak):
    """Times each step between CUDA syncs, reads its memory (the offload suite's probe), and ends the fit after
    ``iters`` timed steps once ``warmup`` steps ran and the ActivationOffload plan (if any) settled (:func:`settled`),
    or after ``max_warmup`` untimed steps."""

    def __init__(self, warmup: int, iters: int, max_warmup: int, offload: ActivationOffload | None,
                 trace_to: Path | None = None) -> None:
        super().__init__()
        self.warmup, self.iters, self.max_warmup, self.offload = warmup, iters, max(warmup, max_warmup), offload
        self.trace_to = trace_to  # after the timed steps, profile two more steps into this file (--profile)
        self._prof: Any = None
        self.trace_steps = 0
        self.step_ms: list[float] = []
        self.timed_from: int | None = None  # the first timed step's index
        self.was_settled = True
        self._t0 = 0.0
        self._plan: Any = None
        self._plan_age: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        if self._timing_done() and self.trace_to is not None and self._prof is None:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pl_module.device.type == "cuda" else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._t0 = time.perf_counter()

    def _timing_done(self) -> bool:
        return self.timed_from is not None and len(self.step_ms) - self.timed_from >= self.iters

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        if self._prof is not None:  # a profiled step after the timed ones: not timed
            self.trace_steps += 1
            if self.trace_steps >= 2:
                self._prof.__exit__(None, None, None)
                self.trace_to.parent.mkdir(parents=True, exist_ok=True)
                self._prof.export_chrome_trace(str(self.trace_to))
                trainer.should_stop = True
            return
        self.step_ms.append((time.perf_counter() - self._t0) * 1e3)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        done = len(self.step_ms)
        if self.timed_from is None:
            ok = self._settled()
            if (done >= self.warmup and ok) or done >= self.max_warmup:
                self.timed_from, self.was_settled = done, ok
        elif self._timing_done() and self.trace_to is None:
            trainer.should_stop = True

    def _settled(self) -> bool:
        cb = self.offload
        if cb is None:
            return True
        if cb.plan is not None and cb.plan is self._plan:
            self._plan_age = (self._plan_age or 0) + 1
        elif cb.plan is not None:
            self._plan, self._plan_age = cb.plan, 0
        engine = cb.engine
        budget = engine.budget if engine is not None else None
        state = getattr(getattr(budget, "state", None), "value", None) if budget is not None else None
        checking = bool(getattr(getattr(engine, "auto", None), "checking", False))
        return settled(engine is not None and engine.enabled, state, self._plan_age, cb.options.profile_steps,
                       checking)

    def timed(self) -> list[float]:
        return self.step_ms[self.timed_from:] if self.timed_from is not None else []


def _trace_verdict(trace: Path) -> str:
    """Summarise a profiled variant's trace (``summary.md`` beside it, the trace gzipped) and return its verdict."""
    import gzip
    import shutil

    from lightning_gh.profiling import summarize_trace

    summary = summarize_trace(trace, top=12, plot=False)
    with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    v = summary.get("verdict") or {}
    return f"{v.get('bound')}: " + "; ".join(v.get("evidence", [])[:3])


def make_loader(vocab: int, batch: int, seq: int, steps: int, seed: int, pin: bool) -> torch.utils.data.DataLoader:
    """``steps`` batches of (inputs, next-token targets), the same for every variant of a run."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (steps * batch, seq + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, pin_memory=pin)


def offload_callback(variant: str, ckpt_act_bytes: int | None) -> ActivationOffload | None:
    """The variant's ActivationOffload (``None`` for the anchors)."""
    if variant == "auto":
        return ActivationOffload()
    if variant == "lean":
        return ActivationOffload(policy=0, lean_loss=True)
    if variant in ("lean_norm_act", "lean_norm_mlp"):
        return ActivationOffload(policy=0, recompute="norm-act", lean_loss=True)
    if variant in AT_CKPT:
        return ActivationOffload(budget=int(ckpt_act_bytes))
    if variant == "budget_0.7_last":
        return ActivationOffload(budget=0.7, budget_offload="last")
    if variant.startswith("budget_"):
        return ActivationOffload(budget=float(variant.split("_", 1)[1]))
    return None


def run_variant(family: str, variant: str, args: argparse.Namespace, device: torch.device, config: dict[str, Any],
                batch: int, seq: int, ckpt_act_bytes: int | None = None) -> dict[str, Any]:
    """One variant on a fresh model; a dict row (``error`` set on failure, out of memory included)."""
    cuda = device.type == "cuda"
    row: dict[str, Any] = {"kind": "row", "family": family, "variant": variant, "device": str(device),
                           "tokens_per_step": batch * seq, "error": None}
    if variant in AT_CKPT:
        row["budget_bytes"] = ckpt_act_bytes
    reset_memory(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    t0 = time.perf_counter()
    model = module = trainer = offload = probe = loader = None
    try:
        L.seed_everything(args.seed, verbose=False)
        model = build_model(family, config, device)
        row["params"] = sum(p.numel() for p in model.parameters())
        row["qkv_bias"] = model.model.layers[0].self_attn.q_proj.bias is not None
        row["sliding_window"] = getattr(model.config, "sliding_window", None)
        if variant in ("hf_ckpt", "hf_ckpt_reentrant"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": variant == "hf_ckpt_reentrant"})
        elif variant == "sac":
            row["sac_layers"] = apply_sac(model.model.layers)
        elif variant in MLP_MARKED:
            for layer in model.model.layers:
                layer.mlp.lgh_recompute = True
        offload = offload_callback(variant, ckpt_act_bytes)
        module = OwnLossLM(model)
        model = None
        profile = getattr(args, "profile", None) or ()
        trace = Path(args.out_dir) / f"trace-{family}-{variant}.json" if variant in profile else None
        probe = StepProbe(args.warmup, args.iters, args.max_warmup, offload, trace)
        steps = probe.max_warmup + args.iters + (2 if trace is not None else 0)
        loader = make_loader(config["vocab_size"], batch, seq, steps, args.seed, pin=cuda)
        prec = canonical(getattr(args, "precision", "bf16-mixed"))
        # Lightning's own strings go to Trainer(precision=...); the package's other names are plugins
        plugin = {"precision": prec} if prec in LIGHTNING_NAMES else {"plugins": [lightning_gh.precision(prec)]}
        row["precision"] = prec
        trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=steps, **plugin,
                            limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[probe, *([offload] if offload else [])])
        trainer.fit(module, loader)
        timed = probe.timed()
        if not timed:
            raise RuntimeError(f"no timed step: {len(probe.step_ms)} steps ran, {probe.max_warmup} untimed")
        w = probe.timed_from
        ms = statistics.median(timed)
        row.update(step_ms=ms, step_ms_p10=_quantile(timed, 0.1), step_ms_p90=_quantile(timed, 0.9),
                   tokens_per_s=batch * seq / (ms / 1e3), untimed_steps=w, timed_steps=len(timed),
                   settled=probe.was_settled, samples_ms=[round(x, 3) for x in timed])
        if cuda:
            row.update(peak_gib=max(probe.peak[w:]) / GIB, max_allocated_gib=max(probe.peak) / GIB,
                       act_bytes=max(probe.act[w:]), static_gib=(probe.peak[-1] - probe.act[-1]) / GIB)
            row["act_gib"] = row["act_bytes"] / GIB
        row["losses"] = [float(x) for x in module.losses[:len(probe.step_ms)]]  # not the profiled steps
        row["loss_last"] = row["losses"][-1]
        if offload is not None:
            _engine_extras(_Extras(row), offload)
        if trace is not None and trace.exists():
            row["trace_verdict"] = _trace_verdict(trace)
    except Exception as e:  # an out-of-memory error (or any failure) is a row, not the end of the run
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        if not isinstance(e, torch.OutOfMemoryError):
            traceback.print_exc()
    if probe is not None and probe._prof is not None and probe.trace_steps < 2:
        probe._prof.__exit__(None, None, None)  # a failure inside the profiled steps: stop the profiler
    model = module = trainer = offload = probe = loader = None  # nothing of the variant outlives it
    reset_memory(device)
    if cuda:
        left = torch.cuda.memory_allocated(device) - before
        row["leftover_mib"] = round(left / MIB, 1)
        if left > LEAK_BYTES:
            print(f"[activation_job] warning: {family}/{variant} left {left / MIB:.0f} MiB allocated after its "
                  "cleanup; later rows of this family may be off (a leak: run one family or variant per process)",
                  flush=True)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


class _Extras:
    """Lets :func:`suites.offload._engine_extras` write into a plain dict row (it writes ``r.extra[...]``)."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.extra = row


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ------------------------------------------------------------------------------------------ ratios and goals


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Each row against its family's plain row: step time ratio, activation memory saved, loss difference."""
    plain = next((r for r in rows if r["variant"] == "plain" and not r.get("error")), None)
    for r in rows:
        r["x_plain"] = r["step_ms"] / plain["step_ms"] if plain and r.get("step_ms") else None
        pa, ra = (plain or {}).get("act_bytes"), r.get("act_bytes")
        r["act_less"] = 1 - ra / pa if pa and ra is not None else None
        a, b = r.get("losses") or [], (plain or {}).get("losses") or []
        n = min(len(a), len(b))
        r["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a[:n], b[:n])) if n else None


def goals(rows: list[dict[str, Any]]) -> dict[str, tuple[bool | None, str]]:
    """The three goals from one family's measured rows (after :func:`add_comparisons`): name -> (met, why).

    ``met`` is ``None`` where a goal cannot be judged (its reference row is missing or failed). Only the
    ActivationOffload rows (:data:`OURS`) can meet a goal; hf_ckpt and sac are the anchors.
    """
    ok = [r for r in rows if not r.get("error") and r.get("x_plain") is not None]
    ours = [r for r in ok if r["variant"] in OURS]
    out: dict[str, tuple[bool | None, str]] = {}
    ckpt = next((r for r in ok if r["variant"] == "hf_ckpt" and r.get("act_bytes") is not None), None)
    if ckpt is None:
        out["at_ckpt_memory"] = (None, "no hf_ckpt row with its activation memory")
    else:
        limit = ckpt["act_bytes"] * CKPT_MEMORY_TOLERANCE
        fits = [r for r in ours if r.get("act_bytes") is not None and r["act_bytes"] <= limit]
        best = min(fits, key=lambda r: r["x_plain"], default=None)
        if best is None:
            out["at_ckpt_memory"] = (False, f"no ActivationOffload row within {limit / GIB:.2f} GiB of activations "
                                            f"(hf_ckpt's {ckpt['act_bytes'] / GIB:.2f} GiB +5%)")
        else:
            out["at_ckpt_memory"] = (best["x_plain"] <= GOAL_AT_CKPT_RATIO,
                                     f"{best['variant']} {best['x_plain']:.2f}x at {best['act_bytes'] / GIB:.2f} GiB "
                                     f"(hf_ckpt {ckpt['x_plain']:.2f}x at {ckpt['act_bytes'] / GIB:.2f} GiB)")
    judged = [r for r in ours if r.get("act_less") is not None]
    if not judged:
        out["less_act"] = (None, "no plain row, or no ActivationOffload row, with its activation memory")
    else:
        fast = [r for r in judged if r["x_plain"] <= GOAL_LESS_ACT_RATIO]
        best = max(fast, key=lambda r: r["act_less"], default=None)
        if best is None:
            best = min(judged, key=lambda r: r["x_plain"])
            out["less_act"] = (False, f"no row at <= {GOAL_LESS_ACT_RATIO:.2f}x; fastest {best['variant']} "
                                      f"{best['x_plain']:.2f}x, {best['act_less']:.0%} less")
        else:
            out["less_act"] = (best["act_less"] >= GOAL_LESS_ACT,
                               f"{best['variant']} {best['act_less']:.0%} less at {best['x_plain']:.2f}x")
    auto = next((r for r in ours if r["variant"] == "auto"), None)
    out["auto"] = ((None, "no auto row") if auto is None else
                   (auto["x_plain"] <= GOAL_AUTO_RATIO, f"auto {auto['x_plain']:.2f}x"))
    return out


GOAL_TEXT = {"at_ckpt_memory": f"at checkpointing's memory <= {GOAL_AT_CKPT_RATIO:.2f}x",
             "less_act": f">= {GOAL_LESS_ACT:.0%} less activation memory at <= {GOAL_LESS_ACT_RATIO:.2f}x",
             "auto": f"ActivationOffload() <= {GOAL_AUTO_RATIO:.2f}x"}


def goal_line(family: str, rows: list[dict[str, Any]]) -> str:
    """One line: each goal met / not met / not judged, with the row that decides it, and the anchors."""
    parts = []
    for key, (met, why) in goals(rows).items():
        verdict = "not judged" if met is None else ("met" if met else "not met")
        parts.append(f"{GOAL_TEXT[key]}: {verdict} ({why})")
    anchors = [f"{r['variant']} {r['x_plain']:.2f}x" for r in rows
               if r["variant"] in ANCHORS and r.get("x_plain") is not None]
    return f"[goals] {family}: " + "; ".join(parts) + (f"; anchors: {', '.join(anchors)}" if anchors else "")


# -------------------------------------------------------------------------------------------------- report


def trial_line(row: dict[str, Any]) -> str:
    """The budget's trial of two plans in a row's budget log, as an indented line (``""`` where none ran)."""
    t = next((e for e in row.get("budget_log") or () if "activation_budget/trial_kept_recompute_only" in e), None)
    if t is None:
        return ""
    ms = lambda k: t.get(f"activation_budget/trial_{k}_ms")  # noqa: E731
    kept = "recompute only" if t["activation_budget/trial_kept_recompute_only"] else "the plan"
    return (f"\n    trial: the plan {ms('the_plan') or float('nan'):.1f} ms, recompute only "
            f"{ms('recompute_only') or float('nan'):.1f} ms fwd+bwd (medians); kept {kept}")


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of every row (ratios against the family's plain row)."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = ["| family | variant | step ms | x plain | tokens/s | peak GiB | act GiB | act less | last loss | "
             "max abs loss diff | untimed steps | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        note = r.get("error") or ""
        if not note and r.get("settled") is False:
            note = "plan not settled before the timed steps"
        if not note and r.get("choices"):
            note = str(r["choices"])[:80]
        lines.append(f"| {r['family']} | {r['variant']} | {f(r.get('step_ms'), '.1f')} | {f(r.get('x_plain'), '.3f')} | "
                     f"{f(r.get('tokens_per_s'), ',.0f')} | {f(r.get('peak_gib'), '.2f')} | "
                     f"{f(r.get('act_gib'), '.2f')} | {f(r.get('act_less'), '.0%')} | {f(r.get('loss_last'), '.4f')} | "
                     f"{f(r.get('loss_max_abs_diff'), '.2e')} | {f(r.get('untimed_steps'), 'd')} | {note} |")
    return "\n".join(lines)


class JsonLines:
    """Appends one JSON object per line to ``path`` as rows finish: a run cut off still leaves what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, obj: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(obj, default=str) + "\n")


def _row_line(r: dict[str, Any]) -> str:
    ms = f"{r['step_ms']:8.1f} ms" if r.get("step_ms") else "       -   "
    act = f"{r['act_gib']:.2f}" if r.get("act_gib") is not None else "-"
    return (f"[activation_job] {r['family']:<8} {r['variant']:<15} | {ms} | act {act:>6} GiB | {r['wall_s']:.1f} s"
            + (f" | {r['error']}" if r.get("error") else ""))


# ---------------------------------------------------------------------------------------------------- main


def family_rows(family: str, args: argparse.Namespace, device: torch.device, out: JsonLines) -> list[dict[str, Any]]:
    """Every chosen variant of ``family``, plain first, hf_ckpt before budget_at_ckpt; rows written as they end."""
    config, batch, seq = ((SMOKE_CFG, HF_BATCH_CPU, HF_SEQ_CPU) if args.smoke else
                          ({**HF_CFG, "num_key_value_heads": args.kv_heads}, HF_BATCH, HF_SEQ))
    chosen = ["plain"] + [v for v in VARIANTS if v in args.variants and v != "plain"]
    rows: list[dict[str, Any]] = []
    for variant in chosen:
        ckpt_bytes = None
        if variant in AT_CKPT:
            ckpt = next((r for r in rows if r["variant"] == "hf_ckpt"), None)
            if ckpt is None or ckpt.get("error"):
                why = "hf_ckpt is not in --variants" if ckpt is None else "hf_ckpt failed"
                row = {"kind": "row", "family": family, "variant": variant, "device": str(device),
                       "error": f"skipped: needs hf_ckpt's measured activation memory ({why})", "wall_s": 0.0}
                rows.append(row)
                add_comparisons(rows)
                out.write(row)
                print(_row_line(row), flush=True)
                continue
            # Off CUDA there is no memory figure; the engine steps aside there anyway, so any size proves the path.
            ckpt_bytes = ckpt.get("act_bytes") or MIB
        row = run_variant(family, variant, args, device, config, batch, seq, ckpt_bytes)
        rows.append(row)
        add_comparisons(rows)
        out.write(row)
        print(_row_line(row), flush=True)
    return rows


def family_process(family: str, args: argparse.Namespace, out_dir: Path) -> tuple[dict[str, Any] | None,
                                                                                  list[dict[str, Any]]]:
    """``family``'s run line and rows from a fresh Python process running this script for it alone (its output goes
    through)."""
    import subprocess

    name = f"activation_job.{family}.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--family", family, "--variants", *args.variants,
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--max-warmup", str(args.max_warmup),
           "--kv-heads", str(args.kv_heads), "--seed", str(args.seed), "--device", args.device,
           "--precision", getattr(args, "precision", "bf16-mixed"),
           "--out", str(out_dir), "--child", name, *(["--smoke"] if args.smoke else []),
           *(["--profile", *args.profile] if getattr(args, "profile", None) else [])]
    why = None
    try:
        rc = subprocess.run(cmd, timeout=args.timeout).returncode
        why = f"the process of {family} exited with code {rc}" if rc else None
    except subprocess.TimeoutExpired:
        why = f"the process of {family} ran past --timeout={args.timeout:g} s"
    path = out_dir / name
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    path.unlink(missing_ok=True)  # folded into activation_job.jsonl
    rows = [x for x in lines if x.get("kind") == "row"]
    if why is not None:
        done = {r["variant"] for r in rows}
        chosen = ["plain"] + [v for v in VARIANTS if v in args.variants and v != "plain"]
        rows += [{"kind": "row", "family": family, "variant": v, "device": args.device, "error": why, "wall_s": 0.0}
                 for v in chosen if v not in done]
    add_comparisons(rows)
    head = next((dict(x, family=family) for x in lines if x.get("kind") == "run"), None)
    return head, rows


@contextlib.contextmanager
def variant_process(one_thread: bool = False) -> Iterator[None]:
    """The process state the variants run in, restored after.

    What is alive on entry (the imported modules) is frozen out of the garbage collector, so the full collection
    between variants scans only what the variants made and stays short. ``one_thread``: torch on one CPU thread (a
    tiny model gains nothing from threads, and they contend on a busy machine). Lightning's notes at each fit (the
    accelerator, the loader's workers, tips) are silenced: the rows say what ran.
    """
    import logging

    gc.collect()
    gc.freeze()
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        gc.unfreeze()
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="plain always runs first (the ratio base); budget_at_ckpt needs hf_ckpt")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per variant (at least)")
    ap.add_argument("--iters", type=int, default=15, help="timed steps per variant")
    ap.add_argument("--max-warmup", type=int, default=40,
                    help="untimed steps after which an ActivationOffload variant is timed even if its plan has not "
                         "settled (budget mode measures and corrects in its first steps)")
    ap.add_argument("--kv-heads", type=int, default=HF_CFG["num_key_value_heads"],
                    help=f"KV heads of the {HF_CFG['num_attention_heads']} attention heads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="bf16-mixed",
                    help="Lightning's precision string, or one of the package's fp8 plugins by name "
                         "(lightning_gh.precision(name), e.g. fp8-ao-tensorwise): every variant runs under it")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a tiny model ({SMOKE_CFG['num_hidden_layers']} layers, hidden {SMOKE_CFG['hidden_size']}, "
                         f"seq {HF_SEQ_CPU}) for 1 + 1 steps: proves the code paths, measures nothing")
    ap.add_argument("--in-process", action="store_true",
                    help="run every family in this process (default: a fresh process per family when there are several)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per family's process")
    ap.add_argument("--out", default=None, help="folder for activation_job.jsonl and .md (default: $OUT or bench_out)")
    ap.add_argument("--profile", nargs="*", default=[], choices=list(VARIANTS),
                    help="variants to profile for two steps after their timed ones (trace-<family>-<variant>.json.gz "
                    "and its .summary.{json,md} in --out; the timed steps are not profiled)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a family's process: its JSON lines file
    args = ap.parse_args(argv)
    if args.iters <= 0 or args.warmup < 0:
        ap.error(f"--iters={args.iters} must be > 0 and --warmup={args.warmup} >= 0")
    try:
        canonical(args.precision)
    except ValueError as e:
        ap.error(f"--precision={args.precision!r}: {e}")
    if (args.device == "cpu" and not args.smoke) or (args.device == "cuda" and not torch.cuda.is_available()):
        print("activation_job: measures GPU memory and step time on a CUDA GPU, and none is in use here "
              f"(--device {args.device}{'' if torch.cuda.is_available() else ', no CUDA GPU visible'}). Run it on the "
              "GPU machine, or with --device cpu --smoke for a functional run of every code path.")
        return 0
    if args.smoke:
        args.warmup, args.iters, args.max_warmup = 1, 1, 1
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as benchmarks/run.py sets it
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(args.out or os.environ.get("OUT") or "bench_out")
    args.out_dir = out_dir
    out = JsonLines(out_dir / (args.child or "activation_job.jsonl"))
    command = "python benchmarks/activation_job.py " + " ".join(sys.argv[1:] if argv is None else argv)
    head: dict[str, Any] = {"kind": "run", "command": command, **machine_info(), "args": vars(args)}
    isolate = len(args.family) > 1 and not (args.in_process or args.child)
    if device.type == "cuda" and not isolate:  # each family's process measures it (this one leaves CUDA alone)
        from lightning_gh import hardware

        link = hardware.link_bandwidth()
        if link is not None:
            head["link_gbps"] = {"d2h": round(link.d2h_gbps, 1), "h2d": round(link.h2d_gbps, 1)}
            print(f"[activation_job] link: {link.d2h_gbps:.1f} GB/s device->host, {link.h2d_gbps:.1f} GB/s "
                  "host->device (pinned)", flush=True)
    out.write(head)
    by_family: dict[str, list[dict[str, Any]]] = {}
    if isolate:
        for family in args.family:
            family_head, by_family[family] = family_process(family, args, out_dir)
            for r in ([family_head] if family_head else []) + by_family[family]:
                out.write(r)
    else:
        import transformers

        for family in args.family:  # import the model code now (transformers imports it lazily, on first use) ...
            getattr(transformers, FAMILIES[family][1])
        with variant_process(one_thread=args.smoke):  # ... so that it is frozen with the rest (see variant_process)
            for family in args.family:
                by_family[family] = family_rows(family, args, device, out)
    summary = [goal_line(family, fam) for family, fam in by_family.items()]
    for family, fam in by_family.items():
        out.write({"kind": "goals", "family": family, **{k: {"met": m, "why": w} for k, (m, w) in goals(fam).items()},
                   "rows": [{k: r.get(k) for k in ("variant", "x_plain", "act_less", "loss_max_abs_diff")}
                            for r in fam]})
    if args.child:  # the parent reports
        return 0
    rows = [r for fam in by_family.values() for r in fam]
    plans = [f"[activation_job] {r['family']}/{r['variant']} plan: " + str(r["plan"]).replace("\n", "\n    ")
             + trial_line(r) for r in rows if r.get("plan")]
    text = "\n".join([table(rows), "", *plans, *([""] if plans else []), *summary])
    print("\n" + text, flush=True)
    (out_dir / "activation_job.md").write_text(f"`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
