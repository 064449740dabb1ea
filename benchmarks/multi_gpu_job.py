"""The one-GPU job on N GPUs of one host, each variant a Lightning multi-process job, the anchors in the same run.

A plain ``LightningModule`` builds ``transformers.LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (random init, SDPA
attention, HF gradient checkpointing) in ``configure_model``: on the meta device, then ``fully_shard`` per decoder
layer and on the root where the variant shards, then materialized shard by shard (each parameter drawn in full on
the GPU from its own seed, one at a time, and only this rank's rows kept), so a 14B or 32B model never needs its full
size in host or GPU memory on one rank. Every variant that builds this way starts from the same weights; the loss
is the cross entropy of the logits in fp32, on ``--batch`` x ``--seq`` tokens per rank.

=========================  ========================================================================================
variant                    what runs
=========================  ========================================================================================
fsdp_noclip                Lightning ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` per layer; bf16 all-gather
                           and reduce-scatter as Lightning's ``FSDPStrategy`` does under ``bf16-mixed``),
                           ``precision="bf16-mixed"``, fp32 parameters sharded, ``AdamW(fused=True)``, no clipping:
                           the anchor
fsdp_clip                  the same with ``gradient_clip_val=1.0`` (Lightning's ``bf16-mixed`` plugin refuses a
                           fused optimizer with clipping: this row takes ``foreach=True``, the same math, and says so)
superoffload               ``strategy="superoffload"`` (ZeRO-1/2, AdamW state in host memory), ``bf16-true``,
                           defaults, clipping; the model whole on every rank (built on the meta device, materialized)
superoffload_lean          the same with ``max_gpu_fraction=--lean-gpu-fraction``: the share of each rank's state its
                           GPU may hold (the sharded GPU tail)
superoffload_fsdp          ``strategy="superoffload_fsdp"`` (ZeRO-3 through FSDP2), ``bf16-true``, defaults, clipping
superoffload_fsdp_lean     the same with ``max_gpu_fraction=--lean-gpu-fraction``: less GPU memory, more CPU work
superoffload_fsdp_onepass  ``superoffload_fsdp`` with ``weights_first=False`` (each unit's update in one pass);
                           ``superoffload_fsdp_lean_onepass``: ``superoffload_fsdp_lean`` with it
fsdp_noclip_budget         ``fsdp_noclip`` with ``ActivationOffload(budget=--act-budget)`` in place of HF checkpointing
superoffload_fsdp_lean_budget ``superoffload_fsdp_lean`` with ``ActivationOffload(budget=--act-budget)`` in place
                           of HF checkpointing (both take ``--budget-warmup`` untimed steps: the budget's measuring
                           steps)
superoffload_fsdp_lean_plainloss  ``superoffload_fsdp_lean`` with ``lean_loss=False``: the module's loss as written, the
                           A/B of the lean loss the SuperOffload strategies take by default on CUDA
fsdp_cpu_offload           as fsdp_clip with ``fully_shard(..., offload_policy=CPUOffloadPolicy())``
deepspeed_zero3_offload    Lightning ``strategy="deepspeed_stage_3_offload"``, ``bf16-mixed``, ``DeepSpeedCPUAdam``,
                           clipping (the model is built inside DeepSpeed's ``zero.Init``: torch's default init, so
                           its losses are not comparable)
=========================  ========================================================================================

Each row: the median step (CUDA-synchronized, rank 0), tokens/s over all ranks, MFU (6 x parameters x tokens against
the GPU's dense bf16 peak, :func:`lightning_gh.profiling.throughput.peak_tflops`), the peak GPU memory of every rank,
host RSS per rank and host memory used, rank 0's losses (compared with the anchor's) and, for SuperOffload, the
optimizer's ``stats`` over the timed steps. An error (an OOM included) is a row. The parent prints one table with
ratios against ``--anchor`` and a forecast for a 70B model on four GH200 from the measured rates.

Usage (on a machine with 2 or 4 GPUs)::

    python benchmarks/multi_gpu_job.py --shape mistral7b --variants fsdp_noclip superoffload_fsdp --out $OUT
    python benchmarks/multi_gpu_job.py --shape qwen14b --gpu-cap-gib 48 --variants superoffload superoffload_fsdp
    python benchmarks/multi_gpu_job.py --smoke --variants superoffload_fsdp          # CPU, gloo, 2 processes
    python benchmarks/multi_gpu_job.py --variants fsdp_noclip superoffload_fsdp --trace --out $OUT

``--trace`` profiles one timed step per variant on rank 0 (:func:`trace_step` says which; it stays among the timed
steps, the median absorbs its profiler overhead) and writes ``trace-<variant>.json``, the step's GPU time by stream,
kernel, copy and idle gap (:func:`trace_summary.trace_summary`), with the raw trace as ``trace-<variant>.json.gz``
where it is small enough; with two or more variants traced, ``trace-compare.md`` sets them side by side against the
anchor. ``--trace-ranks 0 1`` profiles the same step on rank 1 too (``trace-<variant>-rank1.json``, set beside rank
0's in ``trace-compare.md``): two ranks' idle times side by side show which rank the collectives wait for.
Exporting and reading a large model's trace takes its time: allow for it in ``--timeout``.

The variant's child is ``multi_gpu_job.py --child <json> --child-out <file>``; Lightning's "popen" launcher re-runs
it for the other ranks. Every rank writes ``<file>.rank<r>.json``; rank 0 also writes the row to ``<file>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_gpu_job import (  # noqa: E402
    GRACE_MEMORY_BPS,
    NVLINK_C2C_BPS,
    ROOT,
    UPDATE_BYTES_PER_PARAM,
    WALL_MIN_S,
    Outcome,
    Shape,
    _host_used_bytes,
    hf_decoder,
    param_count,
    wall_left,
)
from one_gpu_job import (
    SHAPES as ONE_GPU_SHAPES,
)
from trace_summary import StepTracer, compare_markdown  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """How one variant trains."""

    strategy: str  # "fsdp" (ModelParallelStrategy), or a Lightning strategy name
    precision: str
    clip: bool
    offload: bool = False  # FSDP2's CPUOffloadPolicy
    budget: bool = False  # ActivationOffload(budget=--act-budget) in place of HF checkpointing
    cpu: bool = False  # runs in --smoke (CPU, gloo)


VARIANTS = {
    "fsdp_noclip": Variant("fsdp", "bf16-mixed", clip=False, cpu=True),
    "fsdp_clip": Variant("fsdp", "bf16-mixed", clip=True),
    "superoffload": Variant("superoffload", "bf16-true", clip=True, cpu=True),
    "superoffload_lean": Variant("superoffload", "bf16-true", clip=True, cpu=True),
    "superoffload_fsdp": Variant("superoffload_fsdp", "bf16-true", clip=True, cpu=True),
    "superoffload_fsdp_lean": Variant("superoffload_fsdp", "bf16-true", clip=True, cpu=True),
    "superoffload_fsdp_lean_plainloss": Variant("superoffload_fsdp", "bf16-true", clip=True, cpu=True),
    "superoffload_fsdp_onepass": Variant("superoffload_fsdp", "bf16-true", clip=True, cpu=True),
    "superoffload_fsdp_lean_onepass": Variant("superoffload_fsdp", "bf16-true", clip=True, cpu=True),
    "fsdp_noclip_budget": Variant("fsdp", "bf16-mixed", clip=False, cpu=True, budget=True),
    "superoffload_fsdp_lean_budget": Variant("superoffload_fsdp", "bf16-true", clip=True, cpu=True, budget=True),
    "fsdp_cpu_offload": Variant("fsdp", "bf16-mixed", clip=True, offload=True),
    "deepspeed_zero3_offload": Variant("deepspeed_stage_3_offload", "bf16-mixed", clip=True),
}
#: Model shapes: (architecture, hidden, FFN, layers, heads, KV heads, vocab): the one-GPU job's published shapes
#: and larger ones. ``smoke`` is the CPU check's; ``llama70b`` is the forecast's.
SHAPES = {
    **ONE_GPU_SHAPES,
    "qwen14b": ("qwen2", 5120, 13824, 48, 40, 8, 152064),
    "qwen32b": ("qwen2", 5120, 27648, 64, 40, 8, 152064),
    "smoke": ("llama", 64, 128, 2, 4, 2, 256),
    "llama70b": ("llama", 8192, 28672, 80, 64, 8, 128256),
}
#: Steps of data every run draws (its first ``warmup + steps`` are used), whatever its length; see ``_child``. A run
#: longer than this draws more, and its batches differ from the shorter runs' from the first.
DATA_STEPS = 64
INIT_STD = 0.02  # HF's initializer_range for the weight matrices; norms start at one, biases at zero
#: Bytes per parameter on the GPU of a GPU-only FSDP2 run with fp32 parameters: the sharded parameter, gradient and
#: two AdamW moments (what must fit before activations).
FSDP_STATE_BYTES = 16


@dataclass
class MJob(Shape):
    """One variant's job: the model shape, the ranks and the run length."""

    variant: str
    shape: str = "mistral7b"
    devices: int = 2
    accelerator: str = "gpu"
    steps: int = 8  # timed
    warmup: int = 4  # untimed, before the timed steps
    gpu_cap_gib: float | None = None
    max_gpu_fraction: float | None = None  # SuperOffload's option, for the *_lean variants
    weights_first: bool = True  # SuperOffload's option, False for the *_onepass variants
    cpu_threads: int | None = None  # SuperOffload's option (--cpu-threads), for every superoffload variant
    trace: bool = False  # profile one timed step (trace_step) on the ranks of trace_ranks
    trace_ranks: tuple[int, ...] = (0,)  # --trace-ranks (rank r > 0 writes trace-<variant>-rank<r>.json)
    act_budget: str | None = None  # ActivationOffload's budget, for the *_budget variants


@dataclass
class Row(Outcome):
    """One variant's row: :class:`one_gpu_job.Outcome` with every rank's figures."""

    shape: str = ""
    world: int = 1
    peak_gpu_gib_ranks: list[float] = field(default_factory=list)
    host_rss_gib_ranks: list[float] = field(default_factory=list)


def make_job(variant: str, shape: str, layers: int | None = None, **kw: Any) -> MJob:
    """The job of ``variant`` on the named shape (``layers`` overrides its depth)."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {sorted(SHAPES)}")
    arch, hidden, ffn, depth, heads, kv, vocab = SHAPES[shape]
    return MJob(variant, shape=shape, arch=arch, layers=layers or depth, hidden=hidden, ffn=ffn, heads=heads,
                kv_heads=kv, vocab=vocab, **kw)


def trace_step(j: MJob) -> int:
    """The index (warmup steps included) of the step ``--trace`` profiles: the second timed step, else the only one.

    >>> trace_step(MJob("x", warmup=4, steps=8)), trace_step(MJob("x", warmup=1, steps=1))
    (5, 1)
    """
    return min(j.warmup + 1, j.warmup + j.steps - 1)


def params_of(j: MJob) -> int:
    """Parameters of the decoder: Llama-shaped, plus Qwen2's q/k/v biases (:func:`one_gpu_job.param_count`)."""
    return param_count(j)  # type: ignore[arg-type]  # MJob has the fields param_count reads


def fused_adamw(precision: str, clip: bool) -> bool:
    """Whether the GPU-resident AdamW may be fused: Lightning's mixed-precision plugin refuses gradient clipping with
    an optimizer that unscales its own gradients (a fused one), so clipping under ``*-mixed`` takes ``foreach``.

    >>> fused_adamw("bf16-mixed", clip=False), fused_adamw("bf16-mixed", clip=True), fused_adamw("bf16-true", True)
    (True, False, True)
    """
    return not (clip and precision.endswith("-mixed"))


def fsdp_fit_reason(variant: str, params: int, world: int, gpu_bytes: int | None) -> str | None:
    """Why a GPU-only FSDP variant cannot fit (its sharded fp32 parameters, gradients and moments alone exceed one
    GPU), or ``None``: such a row is reported without spending a run on it.

    >>> fsdp_fit_reason("fsdp_noclip", 32_000_000_000, 4, 80 * 2**30)[:40]
    'does not fit: 16 B/param x 32.0B params '
    >>> fsdp_fit_reason("fsdp_noclip", 7_000_000_000, 2, 80 * 2**30) is None
    True
    """
    spec = VARIANTS[variant]
    if spec.strategy != "fsdp" or spec.offload or not gpu_bytes:
        return None
    need = FSDP_STATE_BYTES * params / world
    if need < gpu_bytes:
        return None
    return (f"does not fit: {FSDP_STATE_BYTES} B/param x {params / 1e9:.1f}B params / {world} ranks = "
            f"{need / 2**30:.0f} GiB per GPU of sharded fp32 parameters, gradients and moments, above the GPU's "
            f"{gpu_bytes / 2**30:.0f} GiB before any activation (not run)")


# ------------------------------------------------------------------------------------------------ the child


def build_model(job: MJob, lm: Any) -> Any:
    """The HF decoder of ``job``: on the meta device, sharded where the variant shards, materialized on this rank's
    device with :func:`fill_weights`. DeepSpeed builds it inside its own ``zero.Init`` instead."""
    import torch

    spec = VARIANTS[job.variant]
    cls, cfg = hf_decoder(job)
    device = lm.trainer.strategy.root_device
    if spec.strategy.startswith("deepspeed"):
        model = cls(cfg)
    else:
        with torch.device("meta"):
            model = cls(cfg)
    if job.checkpointing and not spec.budget:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.strategy.startswith("deepspeed"):
        return model
    if spec.strategy in ("fsdp", "superoffload_fsdp"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {"mesh": lm.device_mesh["data_parallel"]}
        if spec.strategy == "fsdp":  # Lightning's FSDPStrategy under bf16-mixed: bf16 all-gather and reduce
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if spec.offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    model.to_empty(device=device)  # FSDP2 re-homes offloaded shards in pinned host memory
    fill_weights(model, job.seed, device)
    return model


def fill_weights(model: Any, seed: int, device: Any) -> None:
    """Initialize every parameter the same way whatever the sharding: parameter ``i`` drawn in full (fp32, on
    ``device``) from a generator seeded with ``(seed, i)``, this rank's rows kept (FSDP2 cuts dim 0 as
    ``torch.chunk``); the rotary frequencies recomputed (``to_empty`` leaves buffers unset)."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name:
                full = torch.ones(p.shape, device=device)
            elif name.endswith(".bias"):
                full = torch.zeros(p.shape, device=device)
            else:
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
                full = torch.randn(p.shape, generator=g, device=device).mul_(INIT_STD)
            local = p.to_local() if isinstance(p, DTensor) else p
            if isinstance(p, DTensor):
                chunks = full.chunk(p.device_mesh.size(), dim=0)
                rank = p.device_mesh.get_local_rank()
                full = chunks[rank] if rank < len(chunks) else full[:0]
            local.copy_(full.view(local.shape))
            del full
        for m in model.modules():
            if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "config"):
                with torch.device("cpu"):
                    fresh = type(m)(m.config)
                for name in ("inv_freq", "original_inv_freq"):
                    new, old = getattr(fresh, name, None), getattr(m, name, None)
                    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and old.device.type != "meta":
                        old.copy_(new)
                    elif isinstance(new, torch.Tensor):
                        setattr(m, name, new.to(device))


def _rank_figures(trainer: Any, cuda: bool) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"rank": int(trainer.global_rank),
                           "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
                           "host_used_gib": (_host_used_bytes() or 0) / 2**30 or None}
    if cuda:
        dev = trainer.strategy.root_device
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
    return out


def _settled_stats(opt: Any) -> dict[str, Any]:
    """The scalar ``stats`` of a SuperOffload optimizer once its CPU updates in flight are done (``{}`` for
    others)."""
    stats = getattr(opt, "stats", None)
    if not isinstance(stats, dict):
        return {}
    if callable(getattr(opt, "synchronize", None)):
        opt.synchronize()
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}


def _child(job: MJob, out_file: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback

    import lightning_gh  # noqa: F401  (registers "superoffload" and "superoffload_fsdp")
    from lightning_gh.profiling.throughput import peak_tflops

    spec = VARIANTS[job.variant]
    cuda = job.accelerator == "gpu"
    res = Row(job.variant, params=params_of(job), shape=job.shape, world=job.devices,
              device=torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu")
    torch.manual_seed(job.seed)
    fused = fused_adamw(spec.precision, spec.clip)
    if spec.strategy == "fsdp" and not fused:
        res.notes["adamw"] = "foreach: Lightning refuses gradient clipping with a fused AdamW under bf16-mixed"
    if spec.strategy.startswith("deepspeed"):
        res.notes["init"] = "DeepSpeed zero.Init with torch's default init: losses not comparable"

    class LM(L.LightningModule):
        """What users write: the model in configure_model, the loss from the logits, their own AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.losses: list[Any] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build_model(job, self)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = batch[0]
            logits = self.model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            if spec.strategy.startswith("deepspeed"):
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                return DeepSpeedCPUAdam(self.parameters(), lr=job.lr)
            return torch.optim.AdamW(self.parameters(), lr=job.lr, fused=fused, foreach=not fused)

    class Clock(Callback):
        """Step starts (synchronized), the optimizer's stats at the first timed step and at the end, the GPU cap; with
        ``job.trace``, rank 0's profile of one step, begun and ended right after a synchronize."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.stats0: dict[str, Any] = {}
            self.stats1: dict[str, Any] = {}
            self.tracer: StepTracer | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if cuda and job.gpu_cap_gib:
                dev = trainer.strategy.root_device
                total = torch.cuda.get_device_properties(dev).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, job.gpu_cap_gib * 2**30 / total), dev)
            if cuda:
                torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
            if job.trace and trainer.global_rank in job.trace_ranks:
                self.tracer = StepTracer(trace_step(job), cuda)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            if self.tracer is not None:
                self.tracer.close()  # the profiled step ends here
            if len(self.starts) == job.warmup:  # the CPU updates of the timed steps only, from here
                self.stats0 = _settled_stats(trainer.optimizers[0])
            if self.tracer is not None and len(self.starts) == self.tracer.step:
                self.tracer.open()  # its start before the time stamp: in the previous step's time
            self.starts.append(time.perf_counter())
            if self.tracer is not None:
                self.tracer.stop()  # its stop after the time stamp: in the next step's time

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            if self.tracer is not None:
                self.tracer.close()
            self.starts.append(time.perf_counter())
            if self.tracer is not None:
                self.tracer.stop()
            self.stats1 = _settled_stats(trainer.optimizers[0])

    g = torch.Generator().manual_seed(job.seed)
    # Lightning shuffles a training set through its distributed sampler, by a permutation of the set's length: one
    # length for every run up to DATA_STEPS steps, so that rows with more warm-up steps see the same batches.
    total = max(job.warmup + job.steps, DATA_STEPS) * job.batch * job.devices
    data = torch.randint(0, job.vocab, (total, job.seq), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=job.batch)
    clock, lm, trainer = Clock(), LM(), None
    act = lightning_gh.ActivationOffload(budget=job.act_budget) if spec.budget else None
    plain_loss = job.variant.endswith("_plainloss")
    try:
        if spec.strategy == "fsdp":
            from lightning.pytorch.strategies import ModelParallelStrategy
            strategy: Any = ModelParallelStrategy(data_parallel_size=job.devices, tensor_parallel_size=1)
        elif spec.strategy == "superoffload_fsdp" and (job.max_gpu_fraction is not None or not job.weights_first
                                                       or job.cpu_threads is not None or plain_loss):
            strategy = lightning_gh.SuperOffloadFSDPStrategy(max_gpu_fraction=job.max_gpu_fraction,
                                                             weights_first=job.weights_first,
                                                             cpu_threads=job.cpu_threads,
                                                             lean_loss=False if plain_loss else "auto")
        elif spec.strategy == "superoffload" and (job.max_gpu_fraction is not None or job.cpu_threads is not None):
            strategy = lightning_gh.SuperOffloadStrategy(max_gpu_fraction=job.max_gpu_fraction,
                                                         cpu_threads=job.cpu_threads)
        else:
            strategy = spec.strategy
        trainer = L.Trainer(accelerator=job.accelerator, devices=job.devices, strategy=strategy,
                            precision=spec.precision, max_steps=job.warmup + job.steps,
                            gradient_clip_val=1.0 if spec.clip else None, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[clock] + ([act] if act is not None else []))
        trainer.fit(lm, loader)
    except BaseException as e:  # the variant's failure as a user would see it: a row, not a crash
        res.error = f"{type(e).__name__}: {str(e)[:600]}"
    rank = int(trainer.global_rank) if trainer is not None else 0
    mine = _rank_figures(trainer, cuda) if trainer is not None else {"rank": 0}
    mine["error"] = res.error
    timed = clock.starts[job.warmup:]
    delta = {k: v - clock.stats0.get(k, 0) for k, v in clock.stats1.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    opt = trainer.optimizers[0] if trainer is not None and trainer.optimizers else None
    local = getattr(opt, "host_numel", None)  # ZeRO-1/2: the parameters whose state this rank updates on the CPU
    if not isinstance(local, int) and hasattr(opt, "_units"):  # ZeRO-3: the elements of its host units
        local = sum(u.numel for u in opt._units if not u.on_device)
    if not isinstance(local, int):
        local = sum((p.to_local().numel() if hasattr(p, "to_local") else p.numel()) for p in lm.parameters())
    mine["optimizer"] = {"type": type(opt).__name__ if opt is not None else None, "timed_steps": len(timed) - 1,
                         "cpu_threads": getattr(opt, "cpu_threads", None), "local_params": local,
                         "stats": clock.stats1, "timed_delta": delta}
    if clock.tracer is not None and rank != 0:  # another rank's profile of the same step, under its own name
        try:
            clock.tracer.analyze(out_file.parent, f"{job.variant}-rank{rank}")
        except Exception as e:
            print(f"trace {job.variant} rank {rank}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    rank_file = Path(f"{out_file}.rank{rank}.json")
    rank_file.write_text(json.dumps(mine, default=str))
    if rank != 0:
        return
    if len(timed) >= 2:
        deltas = sorted((b - a) * 1e3 for a, b in zip(timed, timed[1:]))
        res.step_ms = statistics.median(deltas)
        res.step_ms_p10 = deltas[int(0.1 * (len(deltas) - 1))]
        res.step_ms_p90 = deltas[int(0.9 * (len(deltas) - 1))]
        tokens = job.batch * job.seq * job.devices
        res.tokens_per_s = tokens / (res.step_ms / 1e3)
        res.model_tflops = 6 * res.params * tokens / (res.step_ms / 1e3) / 1e12
        peak = peak_tflops(res.device, "bf16") if cuda else None
        res.mfu = res.model_tflops / (peak * job.devices) if peak else None
    res.losses = [float(x) for x in lm.losses]
    ctl = getattr(getattr(act, "engine", None), "budget", None)
    if ctl is not None:  # the budget's way from the floor, and what it reached
        res.notes["activation_budget_log"] = [dict(e) for e in ctl.log]
        res.notes["activation_budget"] = {"budget": job.act_budget, "achieved_bytes": ctl.achieved_bytes,
                                          "plan": act.engine.plan.describe() if act.engine.plan else None}
    res.notes["optimizer"] = mine["optimizer"]
    loss = getattr(getattr(trainer, "strategy", None), "loss", None)
    if loss is not None:  # the SuperOffload strategies' lean-loss decision
        res.notes["lean_loss"] = loss.why
    if clock.tracer is not None:
        at = clock.tracer.step
        res.notes["trace"] = {"step": at, "file": f"trace-{job.variant}.json",
                              "step_ms": (clock.starts[at + 1] - clock.starts[at]) * 1e3
                              if len(clock.starts) > at + 1 else None}
        try:
            s = clock.tracer.analyze(out_file.parent, job.variant)
            res.notes["trace"].update({k: s[k] for k in ("wall_ms", "gpu_busy_ms", "compute_idle_ms", "nccl_ms")})
        except Exception as e:  # the row stands without its trace
            res.notes["trace"]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"trace {job.variant}: {res.notes['trace']['error']}", flush=True)
    out_file.write_text(json.dumps(asdict(res), default=str))


# ------------------------------------------------------------------------------------------------ the parent


def _kill_group(proc: subprocess.Popen) -> None:
    """End the variant's process group (rank 0 and the ranks Lightning started from it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_variant(job: MJob, out: Path, timeout_s: float, grace_s: float = 30.0) -> Row:
    """Run one variant as its own process group; fold the ranks' files into one row."""
    out_file = out / f"child-{job.variant}-{job.shape}-{job.layers}l.json"
    for stale in out.glob(out_file.name + "*"):
        stale.unlink()
    if job.trace:
        for stale in [*out.glob(f"trace-{job.variant}.*"), *out.glob(f"trace-{job.variant}-rank*")]:
            stale.unlink()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(asdict(job)), "--child-out",
           str(out_file)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log_path = out / f"{out_file.stem}.log"
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(ROOT))
        done_at = None
        while proc.poll() is None:
            now = time.perf_counter()
            ranks = len(list(out.glob(out_file.name + ".rank*.json")))
            if done_at is None and out_file.exists():
                done_at = now
            if (done_at is not None and (ranks >= job.devices or now - done_at > grace_s)) or now - t0 > timeout_s:
                timed_out = now - t0 > timeout_s and done_at is None
                break
            time.sleep(0.5)
        if proc.poll() is None and done_at is not None:  # rank 0 is done: a little time to exit on its own
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)
    text = log_path.read_text(errors="replace")
    with open(out / "logs.txt", "a") as logs:  # one file for every variant: the device returns few files
        logs.write(f"===== {job.variant} ({job.shape}, {job.layers} layers, {job.devices} ranks): "
                   f"exit code {proc.returncode}\n" + "\n".join(text.splitlines()[-80:]) + "\n")
    log_path.unlink()
    if out_file.exists():
        res = Row(**json.loads(out_file.read_text()))
    else:
        tail = " | ".join(text.strip().splitlines()[-3:])
        why = f"timed out after {timeout_s:.0f} s" if timed_out else \
            f"exit code {proc.returncode} (killed by the OOM killer?)"
        res = Row(job.variant, params=params_of(job), shape=job.shape, world=job.devices, error=f"{why}: {tail}")
    ranks = []
    for f in sorted(out.glob(out_file.name + ".rank*.json")):
        ranks.append(json.loads(f.read_text()))
        f.unlink()
    out_file.unlink(missing_ok=True)
    fold_ranks(res, ranks)
    res.notes["layers"] = job.layers
    res.notes["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def fold_ranks(res: Row, ranks: list[dict[str, Any]]) -> None:
    """Every rank's figures into the row: peaks per rank and their maximum, the first error of any rank."""
    ranks = sorted(ranks, key=lambda r: r.get("rank", 0))
    res.peak_gpu_gib_ranks = [r["peak_gpu_gib"] for r in ranks if r.get("peak_gpu_gib") is not None]
    res.host_rss_gib_ranks = [r["host_rss_gib"] for r in ranks if r.get("host_rss_gib") is not None]
    res.peak_gpu_gib = max(res.peak_gpu_gib_ranks, default=None)
    res.host_rss_gib = max(res.host_rss_gib_ranks, default=None)
    res.host_used_gib = max((r["host_used_gib"] for r in ranks if r.get("host_used_gib")), default=None)
    res.notes["ranks"] = ranks
    if not res.error:
        res.error = next((f"rank {r['rank']}: {r['error']}" for r in ranks if r.get("error")), None)


def per_step(opt: dict[str, Any], total: str, last: str) -> float | None:
    """A per-step figure of one rank's optimizer: its cumulative ``total`` stat over the timed steps divided by
    their number (the ZeRO-3 optimizer), else its ``last`` stat (the ZeRO-1/2 one's figure of its last step)."""
    delta, steps = opt.get("timed_delta") or {}, opt.get("timed_steps") or 0
    if total in delta and steps > 0:
        return delta[total] / steps
    value = (opt.get("stats") or {}).get(last)
    return float(value) if isinstance(value, (int, float)) else None


def cpu_ns_per_param(row: Row) -> float | None:
    """The slowest rank's CPU AdamW time (both passes where the update went weights first) per host parameter and
    per thread over the timed steps (ns), or ``None`` when the row has no CPU update figures."""
    rates = []
    for r in row.notes.get("ranks", []):
        o = r.get("optimizer") or {}
        ms, local, threads = per_step(o, "cpu_ms", "cpu_ms_per_step"), o.get("local_params"), o.get("cpu_threads")
        ms = ms and ms + (per_step(o, "writeback_ms", "writeback_ms") or 0.0)  # both passes of weights first
        if ms and local and threads:
            rates.append(ms * 1e6 / local * threads)
    return max(rates) if rates else None


# The four-GH200 forecast's inputs, beside one_gpu_job's (NVLink-C2C per direction, Grace's memory rate, the bytes
# one CPU AdamW update moves per parameter): Grace's cores per superchip, its LPDDR5X per superchip, and the
# host bytes of the ZeRO-3 path per parameter (fp32 master and two moments, the bf16 gradient rows).
GRACE_CORES = 72
GRACE_HOST_BYTES = 480 * 10**9
HOST_BYTES_PER_PARAM = 14
GH200_HBM_BYTES = 96 * 10**9


def gh200_forecast(ns_per_param_thread: float, mfu: float, *, params: int, ranks: int = 4,
                   tokens_per_rank: int = 4 * 4096, peak_tflops: float = 989.0) -> dict[str, float]:
    """A forecast, not a measurement: the ZeRO-3 step of a ``params`` model on ``ranks`` GH200 superchips (one
    rank each). Assumptions: the GPU part runs at the measured ``mfu`` of the dense bf16 peak; the CPU AdamW of a
    rank's ``params / ranks`` parameters takes the measured time per parameter and thread spread over
    ``GRACE_CORES`` cores, and no less than its host memory traffic (``UPDATE_BYTES_PER_PARAM`` at
    ``GRACE_MEMORY_BPS``); bf16 gradients go down and fp32 master rows come up over NVLink-C2C at
    ``NVLINK_C2C_BPS`` each way; the update overlaps the next forward only (a quarter of a step with full
    recompute), the rest of it shows in the step.

    >>> f = gh200_forecast(1.0, 0.4, params=70_000_000_000)
    >>> round(f["host_gb_per_superchip"]), f["fits_host"], round(f["cpu_update_ms"])
    (245, True, 243)
    """
    local = params / ranks
    gpu_ms = 6 * params * tokens_per_rank / ranks / (peak_tflops * 1e12 * mfu) * 1e3 if mfu else float("nan")
    cpu_core_ms = local * ns_per_param_thread / GRACE_CORES / 1e6
    cpu_mem_ms = local * UPDATE_BYTES_PER_PARAM / GRACE_MEMORY_BPS * 1e3
    cpu_ms = max(cpu_core_ms, cpu_mem_ms)
    down_ms, up_ms = local * 2 / NVLINK_C2C_BPS * 1e3, local * 4 / NVLINK_C2C_BPS * 1e3
    exposed = max(0.0, max(cpu_ms, up_ms) - gpu_ms / 4)
    step = gpu_ms + down_ms + exposed
    host = HOST_BYTES_PER_PARAM * local
    return {"params": params, "ranks": ranks, "gpu_ms": gpu_ms, "cpu_update_ms": cpu_ms,
            "cpu_update_core_bound_ms": cpu_core_ms, "cpu_update_memory_bound_ms": cpu_mem_ms,
            "link_down_ms": down_ms, "link_up_ms": up_ms, "step_ms": step,
            "tokens_per_s": tokens_per_rank * ranks / (step / 1e3), "mfu": mfu * gpu_ms / step if mfu else 0.0,
            "host_gb_per_superchip": host / 1e9, "host_gb_per_node_of_4": 4 * host / 1e9,
            "fits_host": host < 0.9 * GRACE_HOST_BYTES, "gpu_state_gb_per_rank": 4 * local / 1e9}


def forecast_text(rows: list[Row], batch: int, seq: int) -> str:
    """The forecast paragraph, from the ZeRO-3 row (else another ZeRO-3 variant's, else the ZeRO-1/2 row), or why
    there is none."""
    ours = next((r for r in rows if r.variant == "superoffload_fsdp" and r.step_ms), None) or \
        next((r for r in rows if r.variant.startswith("superoffload_fsdp") and r.step_ms), None) or \
        next((r for r in rows if r.variant == "superoffload" and r.step_ms), None)
    rate = cpu_ns_per_param(ours) if ours else None
    if ours is None or rate is None:
        return "FORECAST (4 x GH200, 70B): none (no SuperOffload row with timed CPU update stats in this run)"
    gpu_only = next((r for r in rows if r.variant == "fsdp_noclip" and r.mfu), None)
    mfu = (gpu_only or ours).mfu or 0.0
    a, hidden, ffn, layers, heads, kv, vocab = SHAPES["llama70b"]
    p70 = params_of(MJob("forecast", arch=a, layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv,
                         vocab=vocab))
    f = gh200_forecast(rate, mfu, params=p70, tokens_per_rank=batch * seq)
    return (f"FORECAST (not measured): Llama-70B shape ({p70 / 1e9:.1f}B params), 4 x GH200, ZeRO-3 + SuperOffload,"
            f" {batch} x {seq} tokens per rank.\n"
            f"  host RAM: {f['host_gb_per_superchip']:.0f} GB per superchip ({HOST_BYTES_PER_PARAM} B/param / 4; "
            f"{f['host_gb_per_node_of_4']:.0f} GB for a node of four), "
            f"{'fits' if f['fits_host'] else 'does NOT fit'} {GRACE_HOST_BYTES / 1e9:.0f} GB of LPDDR5X each; "
            f"GPU: {f['gpu_state_gb_per_rank']:.0f} GB of sharded bf16 weights + gradients per rank before "
            f"activations (of {GH200_HBM_BYTES / 1e9:.0f} GB HBM)\n"
            + (f"  GPU part {f['gpu_ms']:.0f} ms (at {100 * mfu:.1f}% MFU, the "
               f"{'fsdp_noclip' if gpu_only else ours.variant} row's)" if mfu else
               "  GPU part: unknown (no MFU measured on this device)") +
            f"; CPU update {f['cpu_update_ms']:.0f} ms ({GRACE_CORES} cores at the measured "
            f"{rate:.2f} ns per parameter-thread: {f['cpu_update_core_bound_ms']:.0f} ms; memory bound "
            f"{f['cpu_update_memory_bound_ms']:.0f} ms); NVLink-C2C {f['link_down_ms']:.0f} ms down, "
            f"{f['link_up_ms']:.0f} ms up\n"
            + (f"  step ~{f['step_ms']:.0f} ms, {f['tokens_per_s']:,.0f} tokens/s, MFU ~{100 * f['mfu']:.1f}%"
               if mfu else "  step: unknown without the GPU part") + " (assumptions: gh200_forecast's docstring)")


def loss_gap(row: Row, base: Row | None, n: int = 4) -> float | None:
    """The largest relative difference of the first ``n`` losses of ``row`` and ``base`` (rank 0's)."""
    if base is None or not row.losses or not base.losses or "init" in row.notes or "init" in base.notes:
        return None
    k = min(n, len(row.losses), len(base.losses))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row.losses[:k], base.losses[:k]))


def table(rows: list[Row], anchor: str | None) -> str:
    base = next((r for r in rows if r.variant == anchor and r.step_ms), None)
    head = ("| variant | shape | params (B) | ranks | step ms | tokens/s (all ranks) | MFU | speed vs anchor | "
            "peak GPU GiB (max rank) | GPU mem vs anchor | host used GiB | RSS GiB/rank | loss gap | "
            "CPU ms/step | wait ms/step | clipped/skipped | result |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
            "---: | --- |")
    lines = [head]
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    for r in rows:
        speed = f"{base.step_ms / r.step_ms:.2f}x" if base and r.step_ms else ""
        mem = f"{100 * r.peak_gpu_gib / base.peak_gpu_gib:.0f}%" if base and base.peak_gpu_gib and r.peak_gpu_gib \
            else ""
        opt = r.notes.get("optimizer") or {}
        d = opt.get("timed_delta") or {}
        cpu_ms, wait_ms = f(per_step(opt, "cpu_ms", "cpu_ms_per_step"), ".0f"), f(per_step(opt, "wait_ms",
                                                                                             "last_stall_ms"), ".0f")
        cs = f"{int(d.get('clipped_steps', 0))}/{int(d.get('skipped_steps', 0))}" if "clipped_steps" in d else ""
        rss = "/".join(format(x, ".1f") for x in r.host_rss_gib_ranks)
        gap = loss_gap(r, base)
        lines.append(f"| {r.variant} | {r.shape} | {r.params / 1e9:.2f} | {r.world} | {f(r.step_ms, '.0f')} | "
                     f"{f(r.tokens_per_s, ',.0f')} | {f(r.mfu, '.1%')} | {speed} | "
                     f"{f(r.peak_gpu_gib, '.1f')} | {mem} | {f(r.host_used_gib, '.0f')} | {rss} | {f(gap, '.1e')} | "
                     f"{cpu_ms} | {wait_ms} | {cs} | {r.error or 'ok'} |")
    lines.append("")
    lines.append("loss gap: the largest relative difference of a row's first 4 losses from the anchor's; it also holds "
                 "any difference of clipping and precision between the two rows (a sanity check; exactness is what "
                 "the CPU tests check bitwise).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["fsdp_noclip", "superoffload_fsdp"], choices=list(VARIANTS))
    ap.add_argument("--shape", default="mistral7b", choices=[s for s in SHAPES if s != "llama70b"])
    ap.add_argument("--layers", type=int, help="decoder layers instead of the shape's")
    ap.add_argument("--devices", type=int, help="GPUs (default: all)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps before them")
    ap.add_argument("--offload-warmup", type=int, default=36,
                    help="untimed steps of the superoffload variant (its GPU tail settles over its first pipelined "
                         "steps); the ZeRO-3 variants take --warmup, which should be at least 2: their auto GPU "
                         "share moves at the end of step 2")
    ap.add_argument("--no-checkpointing", action="store_true", help="no HF gradient checkpointing")
    ap.add_argument("--act-budget", default="9.4GiB", help="ActivationOffload's budget in the *_budget variants")
    ap.add_argument("--budget-warmup", type=int, default=30,
                    help="untimed steps of the *_budget variants (the budget's measuring steps come first)")
    ap.add_argument("--gpu-cap-gib", type=float, help="torch.cuda.set_per_process_memory_fraction on every rank")
    ap.add_argument("--lean-gpu-fraction", type=float, default=0.35,
                    help="max_gpu_fraction of the *_lean variants")
    ap.add_argument("--cpu-threads", type=int, help="SuperOffload's cpu_threads for the superoffload variants "
                    "(default: its own choice, the rank's CPUs less two)")
    ap.add_argument("--anchor", help="the row the ratios are taken against (default: fsdp_noclip if run)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per variant")
    ap.add_argument("--wall-budget", type=float, help="seconds for the whole run: later variants get what is left")
    ap.add_argument("--no-fit-check", action="store_true", help="run GPU-only FSDP even where it cannot fit")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check: gloo, 2 processes, a tiny 2-layer model, 1 + 1 steps, the CPU variants only")
    ap.add_argument("--trace", action="store_true",
                    help="profile one timed step per variant on rank 0: trace-<variant>.json (and .json.gz), "
                         "trace-compare.md over the variants traced")
    ap.add_argument("--trace-ranks", type=int, nargs="+", default=[0],
                    help="the ranks that profile the traced step (--trace); another rank's summary is "
                         "trace-<variant>-rank<r>.json, compared beside rank 0's")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder of the JSON lines and logs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(MJob(**json.loads(args.child)), Path(args.child_out))
        return 0
    t_start = time.perf_counter()
    variants = list(dict.fromkeys(args.variants))
    gpu_bytes = None
    if args.smoke:  # no torch in this process: the CPU check is mostly imports
        skipped = [v for v in variants if not VARIANTS[v].cpu]
        if skipped:
            print(f"--smoke runs the CPU variants only; not run: {', '.join(skipped)}")
        variants = [v for v in variants if VARIANTS[v].cpu]
        shape, devices, accel, layers, batch, seq, steps, warmup = "smoke", 2, "cpu", None, 2, 32, 1, 1
    else:
        import torch

        if not torch.cuda.is_available():
            print("multi_gpu_job: no CUDA device here, nothing to measure (--smoke runs the CPU check).")
            return 0
        if args.steps < 2:
            ap.error(f"--steps={args.steps} must be at least 2 (a median of step times)")
        shape, devices, accel = args.shape, args.devices or torch.cuda.device_count(), "gpu"
        layers, batch, seq, steps, warmup = args.layers, args.batch, args.seq, args.steps, args.warmup
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        if args.gpu_cap_gib:
            gpu_bytes = min(gpu_bytes, int(args.gpu_cap_gib * 2**30))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for v in variants:
        job = make_job(v, shape, layers, devices=devices, accelerator=accel, batch=batch, seq=seq, steps=steps,
                       warmup=args.offload_warmup if v in ("superoffload", "superoffload_lean") and not args.smoke
                       else args.budget_warmup if VARIANTS[v].budget and not args.smoke else warmup,
                       checkpointing=not args.no_checkpointing, gpu_cap_gib=args.gpu_cap_gib,
                       max_gpu_fraction=args.lean_gpu_fraction if "_lean" in v else None,
                       weights_first=not v.endswith("_onepass"), cpu_threads=args.cpu_threads, trace=args.trace,
                       trace_ranks=tuple(args.trace_ranks),
                       act_budget=args.act_budget if VARIANTS[v].budget else None)
        left = wall_left(args.wall_budget, t_start, args.timeout)
        why = None if args.no_fit_check else fsdp_fit_reason(v, params_of(job), devices, gpu_bytes)
        if why is None and left < WALL_MIN_S:
            why = "not run: --wall-budget spent"
        if why is not None:
            r = Row(v, params=params_of(job), shape=shape, world=devices, error=why)
        else:
            r = run_variant(job, out, min(args.timeout, left))
        rows.append(r)
        with open(out / "multi_gpu_job.jsonl", "a") as fh:
            fh.write(json.dumps(asdict(r), default=str) + "\n")
        print(f"{v} ({shape}, {job.layers} layers, {devices} ranks): {r.step_ms and round(r.step_ms)} ms, "
              f"error={r.error}", flush=True)
    anchor = args.anchor or ("fsdp_noclip" if "fsdp_noclip" in variants else variants[0] if variants else None)
    report = f"anchor: {anchor}\n\n" + table(rows, anchor) + "\n\n" + forecast_text(rows, batch, seq)
    print(report)
    (out / "multi_gpu_job.md").write_text(report + "\n")
    names = [n for v in variants for n in [v] + [f"{v}-rank{r}" for r in sorted(set(args.trace_ranks)) if r != 0]]
    traced = [(n, json.loads((out / f"trace-{n}.json").read_text())) for n in names
              if args.trace and (out / f"trace-{n}.json").exists()]
    if len(traced) >= 2:
        traced.sort(key=lambda t: t[0] != anchor)  # the anchor first, if traced
        text = compare_markdown(traced)
        print(text)
        (out / "trace-compare.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
