"""Rules that turn a trace's numbers into a verdict and advice, and the one definition of a data stall.

One definition and one threshold serve :class:`~lightning_gh.profiling.DataStallDetector` and the trace summary,
so the two never disagree on the same run (docs/profiling.md, "Data wait"):

* the **data-wait share** is the time the training loop spends in Lightning's fetch of the next batch
  (``next(train_dataloader)``: producing or receiving the batch, collating, pinning), divided by the time of the
  steps it feeds (:func:`data_wait_share`);
* the loop is **input-bound** when that share is at least :data:`DATA_WAIT_BOUND` (:func:`is_input_bound`).

The verdict is ``input-bound`` / ``launch-bound`` / ``latency-bound`` when the GPU idles at least
:data:`IDLE_BOUND` of the window (by what dominates the idle time), else ``communication-bound`` when exposed NCCL
time is at least :data:`IDLE_BOUND`, else ``compute-bound`` when GEMM and attention kernels are at least
:data:`TENSOR_CORE_BOUND` of kernel time, else ``memory-bound``. A trace without GPU activity is ``cpu-only`` (or
``input-bound`` when the data wait is, by the definition above).

Example::

    >>> from lightning_gh.profiling.advice import data_wait_share, is_input_bound
    >>> is_input_bound(data_wait_share(wait=8.1, total=100.0)), is_input_bound(data_wait_share(10.1, 100.0))
    (False, True)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["DATA_WAIT_BOUND", "IDLE_BOUND", "TENSOR_CORE_BOUND", "data_wait_share", "is_input_bound", "short_name",
           "stall_advice", "verdict"]

#: The GPU idles at least this share of the window: the verdict is about why it idles.
IDLE_BOUND = 0.25
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


def verdict(s: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verdict of a summary's numbers (from :func:`~lightning_gh.profiling.analysis.analyze`).

    Args:
        s: the numbers.
        context: facts about the run the trace cannot know (``"loader"``: the DataLoader settings from
            :func:`lightning_gh.profiling.stall.loader_info`), used for concrete advice.

    Returns:
        ``{"bound": ..., "evidence": [...], "advice": [...]}``.
    """
    context = context or {}
    evidence: list[str] = []
    advice: list[str] = []
    phases = s.get("phases") or {}
    wait = s.get("data_wait") or {}
    wait_share = wait.get("share", phases.get("data_wait", {}).get("share", 0.0))
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
        bound = "input-bound" if is_input_bound(wait_share) else "cpu-only"
        evidence.insert(0, "no GPU activity in the trace (a CPU-only run, or the profiler had no CUDA activity)")
        if s["top_cpu_ops"]:
            t = s["top_cpu_ops"][0]
            evidence.append(f"top host operator by self time: {t['name']} ({t['share']:.1%} of the window)")
        return {"bound": bound, "evidence": evidence, "advice": advice}

    kinds = s["kernel_kinds"]
    tc = sum(kinds.get(k, 0.0) for k in _TENSOR_CORE_KINDS)
    idle, host, other = g["idle_share"], g["idle"]["host_bound_share"], g["idle"]["other_share"]
    during_wait = g["idle"]["during_data_wait_share"]
    evidence.insert(0, f"GPU busy {g['busy_share']:.1%} of the window, idle {idle:.1%} "
                       f"(host-bound {host:.1%}, other {other:.1%})")
    if s["top_kernels"]:
        k = s["top_kernels"][0]
        evidence.append(f"top kernel ({k['kind']}): {short_name(k['name'])} {k['share']:.1%} of kernel time, "
                        f"{k['count']} calls")
    evidence.append(f"GEMM + attention kernels {tc:.1%} of kernel time; median kernel {g['median_kernel_us']} µs "
                    f"over {g['kernel_count']} kernels")
    comm = s.get("communication")
    if idle >= IDLE_BOUND:
        if during_wait >= idle / 2:
            bound = "input-bound"
            evidence.append(f"{during_wait:.1%} of the window the GPU idled while the loop waited for data")
        elif host >= idle / 2:
            bound = "launch-bound"
            advice.append("the GPU waits for kernel launches: capture the step in a CUDA graph "
                          "(lightning_gh CUDAGraphCapture or torch.compile(mode='reduce-overhead')), fuse small "
                          "kernels with torch.compile, or give each step more work (a larger micro-batch)")
        else:
            bound = "latency-bound"
            advice.append("the GPU idles with work queued behind synchronisations or other streams: look for "
                          ".item()/.cpu() calls, blocking copies and cross-stream waits in the idle gaps")
    elif comm and comm["exposed_share"] >= IDLE_BOUND:
        bound = "communication-bound"
        evidence.append(f"NCCL kernels run alone {comm['exposed_share']:.1%} of the window "
                        f"({comm['overlapped_fraction']:.0%} of their time overlaps compute)")
        advice.append("overlap communication with compute (DDP bucket sizes, FSDP prefetch) or reduce it")
    elif tc >= TENSOR_CORE_BOUND:
        bound = "compute-bound"
        advice.append("tensor-core kernels dominate: lower precision (fp8 via lightning_gh precision plugins) "
                      "or fewer FLOPs are the next levers")
    else:
        bound = "memory-bound"
        non_tc = sorted(((v, k) for k, v in kinds.items() if k not in _TENSOR_CORE_KINDS), reverse=True)[:2]
        if non_tc:
            evidence.append("largest non-GEMM kinds: " + ", ".join(f"{k} {v:.1%}" for v, k in non_tc))
        advice.append("bandwidth-bound kernels dominate: fuse elementwise and normalisation kernels "
                      "(torch.compile) or use fused optimizer/loss kernels")
    if g["copy_share"] >= DATA_WAIT_BOUND:
        evidence.append(f"copies/memsets run alone {g['copy_share']:.1%} of the window")
        h2d = s["copies"].get("HtoD")
        if h2d and h2d["gbps"] is not None:
            advice.append(f"host-to-GPU copies reach {h2d['gbps']:.1f} GB/s: pin host memory "
                          "(pin_memory=True) and copy with non_blocking=True so copies overlap compute")
    return {"bound": bound, "evidence": evidence, "advice": advice}

