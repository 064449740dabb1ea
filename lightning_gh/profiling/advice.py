"""Rules that turn a trace's numbers into a verdict and advice, and the one definition of a data stall.

One definition and one threshold serve :class:`~lightning_gh.profiling.DataStallDetector` and the trace summary,
so the two never disagree on the same run (docs/profiling.md, "Data wait"):

* the **data-wait share** is the time the training loop spends in Lightning's fetch of the next batch
  (``next(train_dataloader)``: producing or receiving the batch, collating, pinning), divided by the time of the
  steps it feeds (:func:`data_wait_share`);
* the loop is **input-bound** when that share is at least :data:`DATA_WAIT_BOUND` (:func:`is_input_bound`).

The verdict is :func:`decide`, a pure function of a few shares of the window (:class:`BoundFacts`, gathered from
a summary by :func:`bound_facts`). The GPU *stalls* when it computes nothing: it idles (waiting for data, for the
CPU optimizer update, for launches, or for something else), or only host-link copies or only NCCL kernels run.
When the stalls add up to at least :data:`IDLE_BOUND` of the window, the largest one names the verdict:
``input-bound`` (only when the data wait is input-bound by the definition above), ``cpu-update-bound``,
``launch-bound``, ``link-bound``, ``communication-bound`` or ``latency-bound``. Otherwise the kernels decide:
``compute-bound`` when GEMM and attention kernels are at least :data:`TENSOR_CORE_BOUND` of kernel time, else
``memory-bound``. A trace without GPU activity is ``cpu-only`` (or ``input-bound`` when the data wait is).
:func:`verdict` adds the evidence and the advice, naming the knob: a stall of at least :data:`SECONDARY_BOUND`
that is not the verdict gets its advice too, SuperOffload's exposed time (CPU-update wait plus its copies alone) of
at least :data:`OFFLOAD_SECONDARY_BOUND` gets its knobs, and fp8 casts of at least :data:`FP8_CAST_BOUND` of kernel
time add "compile the blocks".

Example::

    >>> from lightning_gh.profiling.advice import BoundFacts, data_wait_share, decide, is_input_bound
    >>> is_input_bound(data_wait_share(wait=8.1, total=100.0)), is_input_bound(data_wait_share(10.1, 100.0))
    (False, True)
    >>> decide(BoundFacts(has_gpu=True, idle_cpu_update=0.3, idle_launch=0.05, tensor_core=0.9))
    'cpu-update-bound'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

__all__ = ["BOUNDS", "DATA_WAIT_BOUND", "FP8_CAST_BOUND", "IDLE_BOUND", "OFFLOAD_SECONDARY_BOUND", "SECONDARY_BOUND",
           "TENSOR_CORE_BOUND",
           "BoundFacts", "bound_facts", "data_wait_share", "decide", "is_input_bound", "short_name", "stall_advice",
           "verdict"]

#: The GPU computes nothing (idle, or only copies / NCCL kernels run) at least this share of the window: the
#: verdict is about why.
IDLE_BOUND = 0.25
#: A stall that is not the verdict but takes at least this share of the window gets its advice too.
SECONDARY_BOUND = 0.10
#: SuperOffload's exposed time (the GPU waiting for its CPU update, plus its copies running alone) at least this share
#: of the window, under another verdict: its knobs are advised too.
OFFLOAD_SECONDARY_BOUND = 0.05
#: fp8 casts, amax and scale kernels at least this share of kernel time: advise compiling the fp8 blocks.
FP8_CAST_BOUND = 0.10
#: Every verdict :func:`decide` can give.
BOUNDS = ("compute-bound", "memory-bound", "input-bound", "cpu-update-bound", "launch-bound", "link-bound",
          "communication-bound", "latency-bound", "cpu-only")
#: GEMM + attention kernels at least this share of kernel time: compute-bound.
TENSOR_CORE_BOUND = 0.5
#: The input-bound threshold: a data-wait share at or above it is a data stall, for the detector and the summary.
DATA_WAIT_BOUND = 0.10

_TENSOR_CORE_KINDS = ("gemm", "attention")


def data_wait_share(wait: float, total: float) -> float:
    """The share of ``total`` (time of the steps, any unit) spent waiting for data (``wait``, same unit)."""
    return wait / total if total > 0 else 0.0


def is_input_bound(share: float, threshold: float = DATA_WAIT_BOUND) -> bool:
    """Whether a data-wait share means the loop is input-bound (``share >= threshold``)."""
    return share >= threshold


def short_name(name: str, n: int = 70) -> str:
    """A kernel or operator name cut to ``n`` characters, safe inside a Markdown table."""
    name = name.replace("|", "/")
    return name if len(name) <= n else name[: n - 1] + "…"


def stall_advice(info: Mapping[str, Any] | None, wait_s: float, step_s: float) -> list[str]:
    """Concrete changes for a loop that waits ``wait_s`` per batch for data and then computes ``step_s``.

    The worker estimate: with ``num_workers=0`` the main process makes a batch in about ``wait_s``; with ``W``
    workers a loader-limited loop gets a batch every ``wait_s + step_s``, so each worker needs about
    ``W * (wait_s + step_s)`` per batch. Keeping up needs ``batch time / step_s`` workers; 25% is added as margin.
    """
    if not info:
        return ["raise the DataLoader's num_workers and set pin_memory=True / persistent_workers=True"]
    step_s = max(step_s, 1e-6)
    w = info.get("num_workers") or 0
    batch_time = wait_s if w == 0 else w * (wait_s + step_s)
    need = max(w + 1, math.ceil(1.25 * batch_time / step_s))
    cpus, local = info.get("cpus_per_process") or 1, info.get("processes_per_node") or 1
    avail = info.get("cpus_available") or cpus
    out = [f"raise num_workers from {w} to {need} (the loader needs ~{1e3 * batch_time:.1f} ms per batch per "
           f"worker against a {1e3 * step_s:.1f} ms step)"]
    if need > cpus:
        out[0] += (f"; that is more workers than the {cpus} CPUs this process has ({avail} in its affinity mask / "
                   f"{local} process{'es' * (local != 1)} per node): extra workers help only while loading waits "
                   "on I/O. If it is CPU work (decoding, tokenising, augmenting), make samples cheaper "
                   "(pre-tokenise offline, cache) or give each process more CPUs")
    if info.get("cuda") and not info.get("pin_memory"):
        out.append("set pin_memory=True: page-locked batches copy to the GPU asynchronously and faster")
    if w > 0 and not info.get("persistent_workers"):
        out.append("set persistent_workers=True so workers are not re-spawned at every epoch")
    if w > 0:
        pf = info.get("prefetch_factor") or 2
        out.append(f"raise prefetch_factor from {pf} to {2 * pf} to absorb uneven per-sample costs")
    return out


@dataclass(frozen=True)
class BoundFacts:
    """The numbers a verdict is decided on; shares of the window unless stated.

    Attributes:
        has_gpu: the trace holds GPU activity.
        data_wait: the loop's data-wait share (:func:`data_wait_share`).
        idle_data_wait: the GPU idled while the loop waited for data.
        idle_cpu_update: the GPU idled while the CPU optimizer update ran and no launching thread worked.
        idle_launch: the GPU idled while the host was still launching the work that ended the idle gap.
        idle_other: the rest of the idle time (synchronisations, waits on events or other streams).
        link_alone: host-link copies (HtoD / DtoH) ran with no kernel running.
        comm_alone: NCCL kernels ran with no other kernel running.
        tensor_core: GEMM and attention kernels' share of kernel time.
    """

    has_gpu: bool
    data_wait: float = 0.0
    idle_data_wait: float = 0.0
    idle_cpu_update: float = 0.0
    idle_launch: float = 0.0
    idle_other: float = 0.0
    link_alone: float = 0.0
    comm_alone: float = 0.0
    tensor_core: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "has_gpu":
                if not isinstance(v, bool):
                    raise TypeError(f"BoundFacts(has_gpu={v!r}): expected a bool.")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 + 1e-6:
                raise ValueError(f"BoundFacts({f.name}={v!r}): expected a share in [0, 1].")

    def stalls(self) -> dict[str, float]:
        """The window's stalls by the verdict each would give (data waits count as input only when the loop is
        input-bound; otherwise they join the latency stall)."""
        input_bound = is_input_bound(self.data_wait)
        return {"input-bound": self.idle_data_wait if input_bound else 0.0,
                "cpu-update-bound": self.idle_cpu_update,
                "launch-bound": self.idle_launch,
                "link-bound": self.link_alone,
                "communication-bound": self.comm_alone,
                "latency-bound": self.idle_other + (0.0 if input_bound else self.idle_data_wait)}


def decide(f: BoundFacts) -> str:
    """The verdict (one of :data:`BOUNDS`) for a window's numbers; the rules are in the module docstring."""
    if not f.has_gpu:
        return "input-bound" if is_input_bound(f.data_wait) else "cpu-only"
    stalls = f.stalls()
    if sum(stalls.values()) >= IDLE_BOUND:
        return max(stalls, key=lambda k: stalls[k])  # the first listed wins a tie
    return "compute-bound" if f.tensor_core >= TENSOR_CORE_BOUND else "memory-bound"


def _wait_share(s: Mapping[str, Any]) -> float:
    wait = s.get("data_wait") or {}
    return wait.get("share", ((s.get("phases") or {}).get("data_wait") or {}).get("share", 0.0))


def bound_facts(s: Mapping[str, Any]) -> BoundFacts:
    """The :class:`BoundFacts` of a summary's numbers (from :func:`~lightning_gh.profiling.analysis.analyze`)."""
    wait = min(max(_wait_share(s), 0.0), 1.0)
    g = s.get("gpu")
    if g is None:
        return BoundFacts(has_gpu=False, data_wait=wait)
    idle = g["idle"]
    causes = idle.get("by_cause") or {  # a summary written before idle time was split by cause
        "data_wait": idle["during_data_wait_share"], "cpu_update": 0.0,
        "launch": max(idle["host_bound_share"] - idle["during_data_wait_share"], 0.0),
        "other": max(g["idle_share"] - max(idle["host_bound_share"], idle["during_data_wait_share"]), 0.0)}
    kinds = s.get("kernel_kinds") or {}
    return BoundFacts(has_gpu=True, data_wait=wait, idle_data_wait=causes["data_wait"],
                      idle_cpu_update=causes["cpu_update"], idle_launch=causes["launch"], idle_other=causes["other"],
                      link_alone=(s.get("link") or {}).get("alone_share", 0.0), comm_alone=g["comm_share"],
                      tensor_core=min(sum(kinds.get(k, 0.0) for k in _TENSOR_CORE_KINDS), 1.0))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _offload_evidence(s: Mapping[str, Any]) -> list[str]:
    out = []
    cu = s.get("cpu_update")
    if cu:
        under = cu["under_backward_fraction"]
        out.append(f"CPU optimizer update ({cu['source']}): {cu['per_step_ms']:.3f} ms per step, "
                   f"{cu['share']:.1%} of the window"
                   + (f", {under:.0%} of it under backward" if under is not None else "")
                   + f"; the GPU waited for it {cu['exposed_share']:.1%} of the window "
                   + ("(hidden)" if cu["exposed_share"] < SECONDARY_BOUND / 2 else "(exposed)"))
    link = s.get("link")
    if link:
        parts = []
        for d in ("HtoD", "DtoH"):
            c = link.get(d)
            if c:
                rate = (f", {c['utilization']:.0%} of {c['rate_gbps']:g} GB/s" if c.get("utilization") is not None
                        else "")
                gbps = f"{c['gbps']:.1f} GB/s" if c["gbps"] is not None else "? GB/s"
                parts.append(f"{d} {_gb(c['bytes_per_step'])}/step in {c['busy_ms']:.3f} ms ({gbps}{rate})")
        out.append("host link: " + "; ".join(parts) + f"; copies with no kernel running {link['alone_share']:.1%} "
                   "of the window" + (f" (rate: {link['rate_source']})" if link.get("rate_source") else ""))
    act = s.get("activation_offload")
    if act:
        out.append(f"activation offload: {_gb(act['offload']['bytes'])} to the host, {_gb(act['prefetch']['bytes'])} "
                   f"back; {act['overlap_fraction']:.0%} of their copy time under compute kernels")
    fp8 = s.get("fp8")
    if fp8:
        out.append(f"fp8: casts/amax/scales {fp8['cast_share']:.1%} of kernel time ({fp8['cast_kernels']} kernels), "
                   f"fp8 GEMMs {fp8['gemm_share']:.1%}")
    return out


def _link_advice(s: Mapping[str, Any]) -> list[str]:
    link = s.get("link") or {}
    owners = link.get("owners") or {}
    out = []
    if owners:
        owner, o = max(owners.items(), key=lambda kv: kv[1]["alone_share"])
        x = f"{o['alone_share']:.1%} of the window"
        act = s.get("activation_offload") or {}
        out.append({
            "activations": f"activation-offload copies run with no kernel {x} (only "
                           f"{act.get('overlap_fraction', 0.0):.0%} of their time under compute): offload fewer "
                           "activations, a higher ActivationOffload(budget=...) keeps more on the GPU (or "
                           "policy='auto', which offloads only what the link hides)",
            "optimizer": f"SuperOffload's gradients and weights cross the link with no kernel running {x}: keep "
                         "more parameters on the GPU so fewer cross it, a higher SuperOffloadStrategy("
                         "gpu_fraction=...) (or max_gpu_fraction=... with gpu_fraction='auto')",
            "input": f"batches copied to the GPU with nothing else running {x}: DataLoader(pin_memory=True) and "
                     "non_blocking copies let them overlap the previous step",
            "other": f"host-GPU copies run with no kernel {x}: copy from pinned memory with non_blocking=True on a "
                     "side stream so they overlap compute",
        }[owner])
    pageable = sum((link.get(d) or {}).get("pageable_bytes", 0) for d in ("HtoD", "DtoH"))
    if pageable >= 1e6:  # not a loss.item() per step
        out.append(f"{_gb(pageable)} crossed the link from pageable memory (staged by the driver, synchronous): "
                   "pin it (pin_memory=True)")
    return out or ["copies over the host link stall the GPU: move fewer bytes or overlap them with compute"]


def _cpu_update_advice(s: Mapping[str, Any]) -> list[str]:
    out = ["the GPU waits for the CPU optimizer update: raise the GPU tail, SuperOffloadStrategy(gpu_fraction=...) "
           "(or max_gpu_fraction=... with gpu_fraction='auto'), so the GPU updates more parameters itself, or give "
           "the update more CPU threads, SuperOffloadStrategy(cpu_threads=...)"]
    cu = s.get("cpu_update") or {}
    under = cu.get("under_backward_fraction")
    if under is not None and under < 0.5:
        out.append(f"only {under:.0%} of the update runs under backward: SuperOffloadStrategy(speculative=True) "
                   "starts each bucket's update as soon as its gradients land, before the gradient norm is known")
    return out


def _offload_lever(s: Mapping[str, Any], bound: str, stalls: Mapping[str, float]) -> list[str]:
    """SuperOffload's exposed time as a lever under another verdict, when it reaches
    :data:`OFFLOAD_SECONDARY_BOUND` of the window and neither of its stalls already got its advice."""
    if bound in ("cpu-update-bound", "link-bound"):
        return []
    cpu = stalls.get("cpu-update-bound", 0.0)
    link = (((s.get("link") or {}).get("owners") or {}).get("optimizer") or {}).get("alone_share", 0.0)
    if cpu + link < OFFLOAD_SECONDARY_BOUND or max(cpu, stalls.get("link-bound", 0.0)) >= SECONDARY_BOUND:
        return []
    return [f"SuperOffload's offload is exposed {cpu + link:.1%} of the window (the GPU waited for the CPU update "
            f"{cpu:.1%}, its copies ran alone {link:.1%}): fewer parameters on the host take less of both, a "
            "larger GPU tail (SuperOffloadStrategy(gpu_fraction=...), or max_gpu_fraction=... with "
            "gpu_fraction='auto'); with the step's compute cut (fp8), this share grows"]


_ADVICE = {
    "cpu-update-bound": _cpu_update_advice,
    "link-bound": _link_advice,
    "launch-bound": lambda s: [
        "the GPU waits for kernel launches: capture the step in a CUDA graph (lightning_gh.CUDAGraphCapture() or "
        "torch.compile(mode='reduce-overhead')), fuse small kernels with torch.compile, or give each step more "
        "work (a larger micro-batch)"],
    "latency-bound": lambda s: [
        "the GPU idles with work queued behind synchronisations or other streams: look for .item()/.cpu() calls, "
        "blocking copies and cross-stream waits in the idle gaps"],
    "communication-bound": lambda s: [
        "overlap communication with compute (DDP bucket sizes, FSDP prefetch) or reduce it"],
    "compute-bound": lambda s: [
        "tensor-core kernels dominate: lower precision (fp8 via lightning_gh precision plugins) or fewer FLOPs are "
        "the next levers"],
    "memory-bound": lambda s: [
        "bandwidth-bound kernels dominate: fuse elementwise and normalisation kernels (torch.compile) or use fused "
        "optimizer/loss kernels"],
}


def verdict(s: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verdict of a summary's numbers (from :func:`~lightning_gh.profiling.analysis.analyze`).

    Args:
        s: the numbers.
        context: facts about the run the trace cannot know (``"loader"``: the DataLoader settings from
            :func:`lightning_gh.profiling.stall.loader_info`), used for concrete advice.

    Returns:
        ``{"bound": ..., "stalls": {verdict: share of the window}, "evidence": [...], "advice": [...]}``.
    """
    context = context or {}
    facts = bound_facts(s)
    bound = decide(facts)
    evidence: list[str] = []
    advice: list[str] = []
    phases = s.get("phases") or {}
    wait = s.get("data_wait") or {}
    wait_share = _wait_share(s)
    step = s.get("step_time_ms") or {}
    g = s.get("gpu")
    # A host that waits for data while the GPU still has queued work is not a data stall: the host ran ahead
    # and something in the fetch (a pinned-buffer wait, a sync) blocked it until the GPU caught up. Data
    # advice needs the GPU itself to have idled during the waits.
    gpu_idled_on_data = g is None or g["idle"]["during_data_wait_share"] >= DATA_WAIT_BOUND / 2
    if is_input_bound(wait_share) and not gpu_idled_on_data:
        evidence.append(f"the loop waited for data {wait_share:.1%} of the window, but the GPU stayed busy through "
                        f"it (idle {g['idle']['during_data_wait_share']:.1%} of the window during the waits): "
                        "the host was ahead of the GPU, so the loader is not the bottleneck")
    elif is_input_bound(wait_share):
        evidence.append(f"the loop waited for data {wait_share:.1%} of the window "
                        f"({wait.get('source') or 'lgh/data_wait ranges'})")
        loader = context.get("loader")
        n = max(len(s["steps"]), 1)
        wait_ms = wait.get("ms", phases.get("data_wait", {}).get("ms", 0.0)) / n
        busy_ms = max((step.get("mean") or 0.0) - wait_ms, 1e-6)
        advice += stall_advice(loader, wait_ms / 1e3, busy_ms / 1e3) if loader else [
            "raise the DataLoader's num_workers, set pin_memory=True and persistent_workers=True "
            "(lightning_gh.DataStallDetector measures this on every step and gives concrete values)"]
    if g is None:
        evidence.insert(0, "no GPU activity in the trace (a CPU-only run, or the profiler had no CUDA activity)")
        if s["top_cpu_ops"]:
            t = s["top_cpu_ops"][0]
            evidence.append(f"top host operator by self time: {t['name']} ({t['share']:.1%} of the window)")
        evidence += _offload_evidence(s)
        return {"bound": bound, "stalls": {}, "evidence": evidence, "advice": advice}

    kinds = s["kernel_kinds"]
    idle, host, other = g["idle_share"], g["idle"]["host_bound_share"], g["idle"]["other_share"]
    stalls = {k: round(v, 6) for k, v in facts.stalls().items()}
    evidence.insert(0, f"GPU busy {g['busy_share']:.1%} of the window, idle {idle:.1%} "
                       f"(host-bound {host:.1%}, other {other:.1%})")
    if s["top_kernels"]:
        k = s["top_kernels"][0]
        evidence.append(f"top kernel ({k['kind']}): {short_name(k['name'])} {k['share']:.1%} of kernel time, "
                        f"{k['count']} calls")
    evidence.append(f"GEMM + attention kernels {facts.tensor_core:.1%} of kernel time; median kernel "
                    f"{g['median_kernel_us']} µs over {g['kernel_count']} kernels")
    evidence.append("the GPU computed nothing " + f"{sum(stalls.values()):.1%} of the window: "
                    + ", ".join(f"{k.removesuffix('-bound')} {v:.1%}" for k, v in stalls.items() if v >= 0.0005)
                    if any(v >= 0.0005 for v in stalls.values()) else "the GPU computed through the whole window")
    evidence += _offload_evidence(s)
    if bound == "input-bound":
        evidence.append(f"{g['idle']['during_data_wait_share']:.1%} of the window the GPU idled while the loop "
                        "waited for data")
    elif bound == "communication-bound":
        comm = s.get("communication") or {}
        evidence.append(f"NCCL kernels run alone {facts.comm_alone:.1%} of the window "
                        f"({comm.get('overlapped_fraction', 0.0):.0%} of their time overlaps compute)")
    elif bound == "memory-bound":
        non_tc = sorted(((v, k) for k, v in kinds.items() if k not in _TENSOR_CORE_KINDS), reverse=True)[:2]
        if non_tc:
            evidence.append("largest non-GEMM kinds: " + ", ".join(f"{k} {v:.1%}" for v, k in non_tc))
    if bound in _ADVICE:
        advice += _ADVICE[bound](s)
    for other_bound, share in stalls.items():
        if other_bound != bound and other_bound in _ADVICE and share >= SECONDARY_BOUND:
            advice += [f"also ({other_bound.removesuffix('-bound')} stalls {share:.1%} of the window): {a}"
                       for a in _ADVICE[other_bound](s)]
    advice += _offload_lever(s, bound, stalls)
    fp8 = s.get("fp8")
    if fp8 and fp8["cast_share"] >= FP8_CAST_BOUND:
        advice.append(f"fp8 casts, amax and scale kernels take {fp8['cast_share']:.1%} of kernel time: compile the "
                      "blocks so they fuse into their neighbours (the torchao fp8 plugins' compile_blocks=True, "
                      "their default, or torch.compile on the model)")
    if g["copy_share"] >= DATA_WAIT_BOUND:
        evidence.append(f"copies/memsets run alone {g['copy_share']:.1%} of the window")
        h2d = s["copies"].get("HtoD")
        if stalls["link-bound"] < SECONDARY_BOUND and h2d and h2d["gbps"] is not None:  # else the link advice
            advice.append(f"host-to-GPU copies reach {h2d['gbps']:.1f} GB/s: pin host memory "
                          "(pin_memory=True) and copy with non_blocking=True so copies overlap compute")
    return {"bound": bound, "stalls": stalls, "evidence": evidence, "advice": advice}
