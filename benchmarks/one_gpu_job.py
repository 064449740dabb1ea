"""The job the project exists for: a 7-8B Hugging Face decoder fully fine-tuned on ONE GPU, with default options.

A plain ``LightningModule`` wraps ``transformers.LlamaForCausalLM`` (random init, SDPA attention), computes its own
loss from the logits, and returns ``torch.optim.AdamW(fused=True)``; the Trainer clips gradients
(``gradient_clip_val=1.0``). Each variant runs in a process of its own (a 7B job leaves host and GPU memory
behind), one after the other, and the parent prints one table with every variant beside the anchors:

==================  ==========================================================================================
variant             what runs
==================  ==========================================================================================
gpu_bf16_ckpt       GPU-only ``precision="bf16-true"`` (bf16 weights and bf16 AdamW state: no fp32 master, lossy)
                    + HF gradient checkpointing: the option users take when fp32 state does not fit
superoffload        ``strategy="superoffload"``, ``precision="bf16-true"`` (fp32 master and moments in host
                    memory), default options, HF gradient checkpointing
superoffload_fp8    the same with ``plugins=[lgh.precision("fp8-ao-tensorwise")]`` instead of ``bf16-true``
superoffload_assist as superoffload with ``device_assist=True`` (the GPU shares the host buckets' update once the
                    step's decision is known): the A/B of that option
superoffload_fp8_assist  as superoffload_fp8 with ``device_assist=True``
superoffload_onepass as superoffload with ``weights_first=False`` (a bucket's update in one pass): the A/B of that
                    option
superoffload_plainloss  as superoffload with ``lean_loss=False``: the module's own loss as written (an fp32
                    log-softmax of the logits kept for the backward): the A/B of the lean loss the strategy takes
                    by default on CUDA
superoffload_rareclip    as superoffload with ``gradient_clip_val=--rare-clip``, a threshold above this job's
                    gradient norm: a fine-tune whose norm stays under the threshold, so the CPU update may run
                    during backward (validated every step; ``clipped_steps`` and ``last_grad_norm`` in the notes)
superoffload_fp8_rareclip  as superoffload_fp8 with ``gradient_clip_val=--rare-clip``
deepspeed_offload   Lightning ``strategy="deepspeed_stage_2_offload"`` + ``DeepSpeedCPUAdam``, ``bf16-mixed``,
                    HF gradient checkpointing (DeepSpeed ZeRO-Offload, the anchor users know)
torchao_offload     torchao's ``CPUOffloadOptimizer`` (fused AdamW on the CPU), ``bf16-mixed``, HF checkpointing
                    (Lightning refuses it: it is not a ``torch.optim.Optimizer``; the row says so)
gpu_bf16_budget     as gpu_bf16_ckpt with ``ActivationOffload(budget=--budget)`` instead of HF checkpointing
gpu_bf16_budget_margin  as gpu_bf16_budget with ``margin=--act-margin`` (the link model's allowance for slower
                    transfers; the option's default beside it in the same run)
superoffload_budget as superoffload with ``ActivationOffload(budget=--budget)`` instead of HF checkpointing
gpu_fp32master      GPU-only ``bf16-mixed`` (fp32 weights and state on the GPU), ``AdamW(foreach=True)``: the
                    reference of ``--check-loss`` on a model that fits
==================  ==========================================================================================

Model FLOPs are 6 x parameters x tokens per step (no attention term, no recompute), against the GPU's dense bf16
peak from the datasheet table ThroughputMonitor uses (:func:`lightning_gh.profiling.throughput.peak_tflops`; no MFU
on a GPU not in it).

Usage (on the GPU machine)::

    python benchmarks/one_gpu_job.py --variants gpu_bf16_ckpt superoffload --layers 32 --steps 12 --out $OUT
    python benchmarks/one_gpu_job.py --variants superoffload --shape llama3.1-8b
    python benchmarks/one_gpu_job.py --variants gpu_bf16_ckpt superoffload superoffload_plainloss --shape qwen2.5-7b
    python benchmarks/one_gpu_job.py --check-loss --layers 4 --steps 50              # losses vs an fp32-master run
    python benchmarks/one_gpu_job.py --variants gpu_bf16_budget gpu_bf16_ckpt --budget 9.4GiB --losses
    python benchmarks/one_gpu_job.py --variants superoffload --no-checkpointing --oom-knob   # OOM, then its knob

A GH200 forecast is printed beside the measured figures, marked as a forecast (its assumptions are printed with
it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = ("gpu_bf16_ckpt", "superoffload", "superoffload_fp8", "deepspeed_offload", "torchao_offload",
            "gpu_fp32master", "gpu_bf16_budget", "superoffload_budget", "superoffload_assist",
            "superoffload_fp8_assist", "superoffload_rareclip", "superoffload_fp8_rareclip", "superoffload_onepass",
            "superoffload_plainloss", "gpu_bf16_budget_margin")
#: Published decoder shapes for ``--shape``: architecture, hidden, FFN, layers, heads, KV heads, vocabulary.
SHAPES = {
    "mistral7b": ("llama", 4096, 14336, 32, 32, 8, 32000),
    "llama3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128256),
    "qwen2.5-7b": ("qwen2", 3584, 18944, 28, 28, 4, 152064),
}
#: Variants that replace HF gradient checkpointing by ``ActivationOffload(budget=...)``.
BUDGET_VARIANTS = ("gpu_bf16_budget", "superoffload_budget", "gpu_bf16_budget_margin")

@dataclass(kw_only=True)
class Shape:
    """The decoder's shape and the tokens of a step, the learning rate and the seed: what the one-GPU and the N-GPU
    jobs share (keyword-only, so a job's own fields may come first)."""

    arch: str = "llama"  # "llama" (LlamaForCausalLM) or "qwen2" (Qwen2ForCausalLM: q/k/v projections with biases)
    layers: int = 32
    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 32000
    batch: int = 4
    seq: int = 4096
    lr: float = 1e-5
    seed: int = 0
    checkpointing: bool = True


@dataclass
class Job(Shape):
    """One variant's job: the model shape and the run length."""

    variant: str
    steps: int = 12
    warmup: int = 4
    clip: float = 1.0
    record_losses: bool = False
    budget: str = "8GiB"
    act_margin: float = 0.1  # ActivationOffload(margin=...) of gpu_bf16_budget_margin
    profile_step: int | None = None  # optimizer step the SuperOffload variants profile (SelectiveProfiler)
    out: str = ""  # the run's output folder (the profile goes there)
    knob: str | None = None  # the out-of-memory report's knob this run applies (--oom-knob), as the report wrote it
    knob_budget: str | None = None  # ActivationOffload(budget=...) added by that knob (HF checkpointing gives way)


@dataclass
class Outcome:
    """What one variant measured (or why it did not run)."""

    variant: str
    params: int = 0
    step_ms: float | None = None
    step_ms_p10: float | None = None
    step_ms_p90: float | None = None
    tokens_per_s: float | None = None
    model_tflops: float | None = None
    mfu: float | None = None
    peak_gpu_gib: float | None = None
    host_rss_gib: float | None = None
    host_used_gib: float | None = None
    device: str = ""
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


def param_count(j: Job) -> int:
    """Parameters of a Llama-shaped decoder (untied embeddings and head), plus Qwen2's q/k/v biases."""
    head_dim = j.hidden // j.heads
    attn = j.hidden * j.hidden * 2 + 2 * j.hidden * j.kv_heads * head_dim
    if j.arch == "qwen2":
        attn += j.hidden + 2 * j.kv_heads * head_dim
    mlp = 3 * j.hidden * j.ffn
    norms = 2 * j.hidden
    return j.layers * (attn + mlp + norms) + 2 * j.vocab * j.hidden + j.hidden


# ------------------------------------------------------------------------------------------------ the child


def hf_decoder(j: Shape) -> tuple[Any, Any]:
    """The transformers class of ``j``'s decoder (``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` for ``arch="qwen2"``)
    and its config: SDPA, no KV cache, untied embeddings and head, positions up to the step's sequence."""
    import transformers

    qwen = j.arch == "qwen2"
    conf = transformers.Qwen2Config if qwen else transformers.LlamaConfig
    cfg = conf(hidden_size=j.hidden, intermediate_size=j.ffn, num_hidden_layers=j.layers, num_attention_heads=j.heads,
               num_key_value_heads=j.kv_heads, vocab_size=j.vocab, max_position_embeddings=j.seq,
               tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return (transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM), cfg


def _host_used_bytes() -> int | None:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = lambda k: int(info[k].split()[0]) * 1024  # noqa: E731
        return kib("MemTotal") - kib("MemAvailable")
    except (OSError, KeyError, ValueError):
        return None


def _child(job: Job, out_file: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback

    import lightning_gh as lgh
    from lightning_gh.profiling.throughput import peak_tflops

    torch.manual_seed(job.seed)
    res = Outcome(job.variant, params=param_count(job), device=torch.cuda.get_device_name(0))
    host_used = [0]

    class LM(L.LightningModule):
        """What users write: the model in configure_model, the loss from the logits, their own AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            cls, cfg = hf_decoder(job)
            self.model = cls(cfg)
            if job.checkpointing and job.variant not in BUDGET_VARIANTS:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = batch[0]
            logits = self.model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            if job.record_losses:
                res.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            if job.variant == "deepspeed_offload":
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                return DeepSpeedCPUAdam(self.parameters(), lr=job.lr)
            if job.variant == "torchao_offload":
                from torchao.optim import CPUOffloadOptimizer
                return CPUOffloadOptimizer(self.parameters(), torch.optim.AdamW, lr=job.lr, fused=True)
            # Lightning refuses gradient clipping with a fused AdamW under bf16-mixed: the fp32-master GPU
            # reference takes the foreach kernel (the same math).
            fused = job.variant != "gpu_fp32master"
            return torch.optim.AdamW(self.parameters(), lr=job.lr, fused=fused, foreach=not fused)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if len(self.starts) == job.warmup:
                torch.cuda.synchronize()
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            torch.cuda.synchronize()
            self.starts.append(time.perf_counter())
            host_used[0] = _host_used_bytes() or 0

    g = torch.Generator().manual_seed(job.seed)
    data = torch.randint(0, job.vocab, (job.steps * job.batch, job.seq), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=job.batch)

    kw: dict[str, Any] = {}
    if job.variant in ("gpu_bf16_ckpt", "gpu_bf16_budget", "gpu_bf16_budget_margin"):
        kw = {"precision": "bf16-true"}
    elif job.variant == "gpu_fp32master":
        kw = {"precision": "bf16-mixed"}
    elif job.variant in ("superoffload", "superoffload_budget", "superoffload_rareclip"):
        kw = {"precision": "bf16-true", "strategy": "superoffload"}
    elif job.variant in ("superoffload_fp8", "superoffload_fp8_rareclip"):
        kw = {"plugins": [lgh.precision("fp8-ao-tensorwise")], "strategy": "superoffload"}
    elif job.variant == "superoffload_plainloss":
        kw = {"precision": "bf16-true", "strategy": lgh.SuperOffloadStrategy(lean_loss=False)}
    elif job.variant == "superoffload_onepass":
        kw = {"precision": "bf16-true", "strategy": lgh.SuperOffloadStrategy(weights_first=False)}
    elif job.variant == "superoffload_assist":
        kw = {"precision": "bf16-true", "strategy": lgh.SuperOffloadStrategy(device_assist=True)}
    elif job.variant == "superoffload_fp8_assist":
        kw = {"plugins": [lgh.precision("fp8-ao-tensorwise")],
              "strategy": lgh.SuperOffloadStrategy(device_assist=True)}
    elif job.variant == "deepspeed_offload":
        kw = {"precision": "bf16-mixed", "strategy": "deepspeed_stage_2_offload"}
    elif job.variant == "torchao_offload":
        kw = {"precision": "bf16-mixed"}
    else:
        raise SystemExit(f"unknown variant {job.variant!r}; expected one of {VARIANTS}")
    clock = Clock()
    margin = {"margin": job.act_margin} if job.variant == "gpu_bf16_budget_margin" else {}
    extra: list[Any] = [lgh.ActivationOffload(budget=job.budget, **margin)] if job.variant in BUDGET_VARIANTS else []
    if job.knob_budget is not None:
        extra.append(lgh.ActivationOffload(budget=job.knob_budget))
    if job.profile_step is not None and job.variant.startswith("superoffload"):
        from lightning_gh.profiling import SelectiveProfiler

        extra.append(SelectiveProfiler(steps=str(job.profile_step),
                                       output_dir=Path(job.out) / f"profile-{job.variant}"))
    memory = lgh.MemoryReport(folder=f"/tmp/lgh-memory-{job.variant}", measure_steps=job.warmup)  # plan in notes
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=job.steps, gradient_clip_val=job.clip,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock, memory, *extra], **kw)
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer.fit(LM(), loader)
    except BaseException as e:  # report the failure of this variant, as a user would see it
        res.error = f"{type(e).__name__}: {str(e)[:600]}"
    if len(clock.starts) > job.warmup + 1:
        timed = clock.starts[job.warmup:]
        deltas = sorted((b - a) * 1e3 for a, b in zip(timed, timed[1:]))
        res.step_ms = statistics.median(deltas)
        res.step_ms_p10 = deltas[int(0.1 * (len(deltas) - 1))]
        res.step_ms_p90 = deltas[int(0.9 * (len(deltas) - 1))]
        tokens = job.batch * job.seq
        res.tokens_per_s = tokens / (res.step_ms / 1e3)
        res.model_tflops = 6 * res.params * tokens / (res.step_ms / 1e3) / 1e12
        peak = peak_tflops(res.device, "bf16")
        res.mfu = res.model_tflops / peak if peak else None
    res.peak_gpu_gib = torch.cuda.max_memory_allocated() / 2**30
    mem = torch.cuda.memory_stats()  # an allocator that frees its cache and retries near the memory's end stalls
    res.notes["allocator"] = {k: mem.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}
    res.notes["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    res.host_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    res.host_used_gib = host_used[0] / 2**30 if host_used[0] else None
    opt = trainer.optimizers[0] if trainer.optimizers else None
    stats = getattr(opt, "stats", None)
    if isinstance(stats, dict):
        res.notes["optimizer_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    loss = getattr(trainer.strategy, "loss", None)
    if loss is not None:  # SuperOffload's lean-loss decision
        res.notes["lean_loss"] = loss.why
    if memory.plan is not None:
        res.notes["memory_plan"] = memory.plan.as_dict()
    if memory.oom_knobs:  # the out-of-memory report: its knobs, and the report itself beside the results
        res.notes["oom_knobs"] = [k.knob for k in memory.oom_knobs]
    for f in memory.oom_files:
        if f.suffix == ".md" and job.out:
            again = "-with-knob" if job.knob else ""
            (Path(job.out) / f"oom_report-{job.variant}{again}.md").write_text(f.read_text())
    if job.knob:
        res.notes["applied_knob"] = job.knob
    for cb in extra:  # an activation budget's way from the floor: predicted against measured, step by step
        ctl = getattr(getattr(cb, "engine", None), "budget", None)
        if ctl is not None and getattr(ctl, "log", None):
            res.notes["activation_budget_log"] = [dict(e) for e in ctl.log]
    for cb in extra:  # the profiled window's verdict
        for entry in getattr(cb, "written", []):
            summary = entry["files"].get("summary_json")
            if summary:
                res.notes["profile_verdict"] = json.loads(Path(summary).read_text()).get("verdict")
    out_file.write_text(json.dumps(asdict(res), default=str))


# ------------------------------------------------------------------------------------------------ the parent


def read_row(out_file: Path) -> Outcome:
    """The row a child wrote, removed once read (it is folded into ``one_gpu_job.json``)."""
    res = Outcome(**json.loads(out_file.read_text()))
    out_file.unlink()
    return res


def run_variant(job: Job, out: Path, timeout_s: float) -> Outcome:
    """Run one variant in a process of its own. A child killed at ``timeout_s`` after it wrote its row (a 7B
    SuperOffload process may take tens of seconds to give its pinned host memory back) keeps that row, with a note
    saying so; one killed before is an error row."""
    out_file = out / f"child-{job.variant}-{job.layers}l-{job.vocab}v.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(asdict(job)), "--child-out",
           str(out_file)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               LGH_DUMP_STACKS_AFTER_S=str(max(1.0, timeout_s - 15.0)))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:  # keep what it printed (and the stacks it dumped) for the post-mortem
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        written = out_file.exists()  # the row was written: only the exit (freeing pinned host memory) ran late
        with open(out / "logs.txt", "a") as log:
            log.write(f"===== {job.variant} ({job.layers} layers, vocab {job.vocab}): timed out after "
                      f"{timeout_s:.0f} s{' after writing its row' if written else ''}\n"
                      + "\n".join(text.splitlines()[-120:]) + "\n")
        if not written:
            return Outcome(job.variant, params=param_count(job), error=f"timed out after {timeout_s:.0f} s")
        res = read_row(out_file)
        res.notes["exit"] = f"killed after {timeout_s:.0f} s, after writing its row (the process's exit ran late)"
        res.notes["wall_s"] = round(time.perf_counter() - t0, 1)
        return res
    with open(out / "logs.txt", "a") as log:  # one file for every variant: the device returns few files
        log.write(f"===== {job.variant} ({job.layers} layers, vocab {job.vocab}): exit code {proc.returncode}\n")
        log.write("\n".join((proc.stdout + proc.stderr).splitlines()[-80:]) + "\n")
    if out_file.exists():
        res = read_row(out_file)
    else:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        res = Outcome(job.variant, params=param_count(job),
                      error=f"exit code {proc.returncode} (killed by the OOM killer?): " + " | ".join(tail))
    res.notes["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


# The GH200 forecast's inputs: NVIDIA's published NVLink-C2C rate per direction, a sustained share of Grace's
# LPDDR5X bandwidth, and the host bytes one CPU AdamW update moves per parameter (fp32 master, two moments read and
# written, the bf16 gradient read).
NVLINK_C2C_BPS = 450e9
GRACE_MEMORY_BPS = 400e9
UPDATE_BYTES_PER_PARAM = 26


def gh200_forecast(step_gpu_ms: float, params: int) -> dict[str, float]:
    """A forecast, not a measurement: the step on one GH200 if the GPU part stays as measured here and the host
    side runs at Grace's rates. Assumptions: the CPU AdamW is bound by host memory traffic
    (``UPDATE_BYTES_PER_PARAM`` per parameter per update) at ``GRACE_MEMORY_BPS``; bf16 gradients down and bf16
    weights up over NVLink-C2C at ``NVLINK_C2C_BPS`` each way; the update overlaps backward as it does here."""
    cpu_ms = params * UPDATE_BYTES_PER_PARAM / GRACE_MEMORY_BPS * 1e3
    link_ms = params * 2 / NVLINK_C2C_BPS * 1e3
    return {"gpu_ms": step_gpu_ms, "cpu_update_ms": cpu_ms, "link_ms_each_way": link_ms,
            "step_ms": max(step_gpu_ms, cpu_ms, link_ms)}


def apply_knob(job: Job, knob: str) -> Job | None:
    """``job`` changed as the out-of-memory report's ``knob`` says, or ``None`` for a knob this script cannot apply
    (one without a number, or a strategy the variant does not take).

    >>> apply_knob(Job("superoffload"), 'ActivationOffload(budget="59GiB")').knob_budget
    '59GiB'
    >>> j = apply_knob(Job("superoffload", batch=4, seq=4096), "at most 11,878 tokens per step (now 16,384)")
    >>> (j.batch, j.seq)
    (2, 4096)
    >>> apply_knob(Job("superoffload"), "SuperOffloadStrategy(max_gpu_fraction=...)") is None
    True
    """
    import re

    budget = re.fullmatch(r'ActivationOffload\(budget="([\d.]+[KMGT]iB)"\)', knob)
    if budget and job.variant in BUDGET_VARIANTS:  # the variant's own budget, lowered
        return replace(job, knob=knob, budget=budget.group(1))
    if budget:
        return replace(job, knob=knob, knob_budget=budget.group(1))
    tokens = re.match(r"at most ([\d,]+) tokens per step", knob)
    if tokens:
        most = int(tokens.group(1).replace(",", ""))
        if most >= job.seq:
            return replace(job, knob=knob, batch=most // job.seq)
        return replace(job, knob=knob, batch=1, seq=most // 128 * 128) if most >= 128 else None
    return None


#: A variant with fewer seconds than this left of ``--wall-budget`` is not started (a row says so).
WALL_MIN_S = 30.0


def wall_left(wall_budget: float | None, t_start: float, timeout: float) -> float:
    """Seconds left of ``wall_budget`` (seconds for the whole run, counted from ``t_start``), or ``timeout`` without
    one. A variant runs for at most ``min(timeout, wall_left(...))`` and is not started below :data:`WALL_MIN_S`.

    >>> wall_left(None, 0.0, 200.0)
    200.0
    """
    return timeout if wall_budget is None else wall_budget - (time.perf_counter() - t_start)


def loss_gaps(rows: list[Outcome], anchor: str) -> dict[str, tuple[int, float]]:
    """Per row with recorded losses (the anchor aside): the steps it shares with the anchor's and the largest
    relative difference of its loss from the anchor's over them. Every variant starts from the same weights and
    data, so the gap is what its arithmetic changes (bf16 noise, recompute order).

    >>> a, b = Outcome("a", losses=[2.0, 1.0]), Outcome("b", losses=[2.2, 1.0, 0.5])
    >>> loss_gaps([a, b], "a")
    {'b': (2, 0.1...)}
    """
    ref = next((r.losses for r in rows if r.variant == anchor), [])
    gaps = {}
    for r in rows:
        n = min(len(ref), len(r.losses))
        if r.variant != anchor and n:
            gaps[r.variant] = (n, max(abs(a - b) / abs(a) for a, b in zip(ref[:n], r.losses[:n])))
    return gaps


def table(rows: list[Outcome], anchor: str | None) -> str:
    base = next((r for r in rows if r.variant == anchor and r.step_ms), None)
    head = ("| variant | params (B) | step ms | tokens/s | MFU | vs anchor | peak GPU GiB | host used GiB | "
            "result |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    lines = [head]
    for r in rows:
        ratio = f"{base.step_ms / r.step_ms:.2f}x" if base and r.step_ms else ""
        f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
        lines.append(f"| {r.variant} | {r.params / 1e9:.2f} | {f(r.step_ms, '.0f')} | {f(r.tokens_per_s, ',.0f')} | "
                     f"{f(r.mfu and 100 * r.mfu, '.1f')}% | {ratio} | {f(r.peak_gpu_gib, '.1f')} | "
                     f"{f(r.host_used_gib, '.1f')} | {r.error or 'ok'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["gpu_bf16_ckpt", "superoffload"], choices=VARIANTS)
    ap.add_argument("--shape", default="mistral7b", choices=sorted(SHAPES),
                    help="a published decoder's shape; --layers, --hidden, --ffn and --vocab override its fields")
    ap.add_argument("--layers", type=int, nargs="+", help="decoder layers (one run per value; default: the shape's)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--vocab", type=int, help="32000: Mistral-7B's shape; 128256: Llama-3.1-8B's")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--offload-steps", type=int, default=45,
                    help="steps of the SuperOffload variants (its GPU tail settles over the first pipelined steps)")
    ap.add_argument("--offload-warmup", type=int, default=35, help="untimed steps of the SuperOffload variants")
    ap.add_argument("--no-checkpointing", action="store_true", help="no HF gradient checkpointing")
    ap.add_argument("--losses", action="store_true",
                    help="record every variant's loss per step and print each one's largest relative difference "
                         "from the anchor's (the same initial weights and data)")
    ap.add_argument("--budget", default="8GiB", help="ActivationOffload's budget in the *_budget variants")
    ap.add_argument("--act-margin", type=float, default=0.1, help="ActivationOffload's margin in gpu_bf16_budget_margin")
    ap.add_argument("--profile-step", type=int, help="profile this optimizer step of the superoffload* variants "
                    "(SelectiveProfiler: trace, summary and verdict under --out)")
    ap.add_argument("--rare-clip", type=float, default=100.0,
                    help="gradient_clip_val of the *_rareclip variants (above the job's gradient norm)")
    ap.add_argument("--check-loss", action="store_true",
                    help="record every step's loss of gpu_fp32master and superoffload (use a model that fits)")
    ap.add_argument("--oom-knob", action="store_true",
                    help="a variant that runs out of GPU memory runs again with the first knob of MemoryReport's "
                    "out-of-memory report that this script can apply (the report goes to --out)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per variant")
    ap.add_argument("--wall-budget", type=float,
                    help="seconds for the whole run: each variant gets at most what is left, and one with less than "
                         "30 s left is a row that says so (the run ends in time for what follows it to collect "
                         "the results)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if os.environ.get("LGH_DUMP_STACKS_AFTER_S"):  # every thread's stack, shortly before the parent's timeout
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["LGH_DUMP_STACKS_AFTER_S"]), exit=False)
        _child(Job(**json.loads(args.child)), Path(args.child_out))
        return 0
    if args.profile_step is not None and not 0 <= args.profile_step < args.offload_warmup:
        ap.error(f"--profile-step={args.profile_step} must be one of the untimed steps, 0 to "
                 f"--offload-warmup - 1 = {args.offload_warmup - 1} (a profiled step is slower)")
    for steps, warmup, name in ((args.steps, args.warmup, ""), (args.offload_steps, args.offload_warmup, "offload-")):
        if steps <= warmup + 1:
            ap.error(f"--{name}steps={steps} must exceed --{name}warmup={warmup} by at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = ["gpu_fp32master", "superoffload"] if args.check_loss else args.variants
    arch, hidden, ffn, depth, heads, kv_heads, vocab = SHAPES[args.shape]
    t_start = time.perf_counter()
    rows: list[Outcome] = []
    for layers in args.layers or [depth]:
        for v in variants:
            ours = (v.startswith("superoffload") or v in BUDGET_VARIANTS) and not args.check_loss
            job = Job(v, arch=arch, layers=layers, hidden=args.hidden or hidden, ffn=args.ffn or ffn,
                      heads=heads, kv_heads=kv_heads, vocab=args.vocab or vocab, batch=args.batch,
                      seq=args.seq, steps=args.offload_steps if ours else args.steps,
                      warmup=args.offload_warmup if ours else args.warmup,
                      checkpointing=not args.no_checkpointing, record_losses=args.check_loss or args.losses,
                      budget=args.budget, act_margin=args.act_margin,
                      clip=args.rare_clip if v.endswith("_rareclip") else 1.0, profile_step=args.profile_step,
                      out=str(out))
            left = wall_left(args.wall_budget, t_start, args.timeout)
            if left < WALL_MIN_S:
                r = Outcome(v, params=param_count(job), error="not run: --wall-budget spent")
            else:
                r = run_variant(job, out, min(args.timeout, left))
            r.notes["layers"] = layers
            r.notes["shape"] = args.shape
            rows.append(r)
            print(f"{v} ({layers} layers): {r.step_ms and round(r.step_ms)} ms, error={r.error}", flush=True)
            ran_out = args.oom_knob and r.error and "OutOfMemoryError" in r.error
            knobs = (r.notes.get("oom_knobs") or []) if ran_out else []
            again = next((j for j in (apply_knob(job, k) for k in knobs) if j is not None), None)
            left = wall_left(args.wall_budget, t_start, args.timeout)
            if again is not None and left >= WALL_MIN_S:
                r2 = run_variant(again, out, min(args.timeout, left))
                r2.variant = f"{v} + {again.knob}"
                r2.notes["layers"] = layers
                rows.append(r2)
                print(f"{r2.variant} ({layers} layers): {r2.step_ms and round(r2.step_ms)} ms, error={r2.error}",
                      flush=True)
            # each row as it finishes: a run stopped at its time limit keeps the variants it completed
            (out / "one_gpu_job.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    anchor = "gpu_fp32master" if args.check_loss else "gpu_bf16_ckpt"
    report = table(rows, anchor)
    if args.check_loss:
        ref = next((r.losses for r in rows if r.variant == "gpu_fp32master"), [])
        ours = next((r.losses for r in rows if r.variant == "superoffload"), [])
        n = min(len(ref), len(ours))
        if n:
            rel = [abs(a - b) / abs(a) for a, b in zip(ref[:n], ours[:n])]
            report += (f"\n\nlosses over {n} steps: max relative difference {max(rel):.2e}, mean {statistics.mean(rel):.2e}"
                       f"; first {ref[0]:.4f} / {ours[0]:.4f}, last {ref[n - 1]:.4f} / {ours[n - 1]:.4f}")
    if args.losses:
        for v, (n, gap) in loss_gaps(rows, anchor).items():
            report += f"\nloss gap of {v} from {anchor}: largest relative difference {gap:.2e} over {n} steps"
    ours = next((r for r in rows if r.variant == "superoffload" and r.step_ms), None)
    gpu_only = next((r for r in rows if r.variant == "gpu_bf16_ckpt" and r.step_ms), None)
    if ours is not None:
        fc = gh200_forecast((gpu_only or ours).step_ms, ours.params)
        report += ("\n\nFORECAST (not measured), one GH200, the superoffload row: GPU part as measured here "
                   f"({'the GPU-only step' if gpu_only else 'our step, an upper bound'}) "
                   f"{fc['gpu_ms']:.0f} ms; CPU update at Grace's memory rate {fc['cpu_update_ms']:.0f} ms; "
                   f"NVLink-C2C {fc['link_ms_each_way']:.0f} ms each way; step ~{fc['step_ms']:.0f} ms "
                   "(assumptions: gh200_forecast's docstring)")
    print(report)
    (out / "one_gpu_job.md").write_text(report + "\n")
    (out / "one_gpu_job.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
