"""Where the time went: a step-by-step reading of one Kineto trace, written as JSON, Markdown and a PNG.

Works on any Kineto trace (see :mod:`lightning_gh.profiling.trace`), not only the ones
:class:`~lightning_gh.profiling.SelectiveProfiler` writes. The span analysed is the host's ``ProfilerStep#<n>``
ranges; a trace without them is analysed as one span from its first to its last event.

Definitions (all times are wall-clock time within the step spans, so the shares add up to 1):

* **busy**: the union of kernel, memcpy and memset intervals over all streams; **idle** is the rest.
* the **window** is the sum of the step spans; GPU work still running after the host's last step ends (the host
  runs ahead of the GPU) extends the last step's span to the end of that work (``gpu_tail_ms``), so every recorded
  kernel is counted. Step *times* stay the host spans.
* busy is split without double counting, by priority: **compute** (any non-communication kernel running) >
  **communication** (an NCCL kernel running, nothing else) > **copies** (only a memcpy/memset running).
* an idle gap is **host-bound** up to the moment the host finished launching the GPU work that ended the gap (the
  GPU had nothing queued: it waited for launches); the rest of the gap is **other** (synchronisation, waits on
  events or other streams, launch latency). Idle time that falls inside an ``lgh/data_wait`` range is reported too.
* the **top kernels** and **kernel kinds** are shares of summed kernel time (like ``nsys stats``'
  ``cuda_gpu_kern_sum``), over every kernel in the trace.
* **phases** come from ``lgh/<phase>`` ``record_function`` ranges (``data_wait``, ``forward``, ``backward``,
  ``optimizer``) that SelectiveProfiler adds inside its windows; GPU time is attributed to the phase during which
  its launch was issued.
* the **verdict** is ``input-bound`` / ``launch-bound`` / ``latency-bound`` when the GPU idles at least
  :data:`IDLE_BOUND` of the window (by what dominates the idle time), else ``communication-bound`` when exposed
  NCCL time is at least :data:`IDLE_BOUND`, else ``compute-bound`` when GEMM and attention kernels are at least
  :data:`TENSOR_CORE_BOUND` of kernel time, else ``memory-bound``. A trace without GPU activity is ``cpu-only``
  (or ``input-bound`` when data wait is material).

Example::

    >>> from lightning_gh.profiling import summarize_trace
    >>> s = summarize_trace("profiles/steps10-14/rank0_steps10-14.pt.trace.json.gz")  # doctest: +SKIP
    >>> s["verdict"]["bound"], s["top_kernels"][0]["name"]  # doctest: +SKIP
    ('compute-bound', 'nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN')
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from lightning_gh.profiling.trace import Event, KinetoTrace, Step, load_trace

__all__ = [
    "summarize",
    "summarize_trace",
    "render_markdown",
    "write_summary",
    "kernel_kind",
    "summary_paths",
    "IDLE_BOUND",
    "TENSOR_CORE_BOUND",
    "DATA_WAIT_BOUND",
    "PHASES",
    "stall_advice",
]

IDLE_BOUND = 0.25
TENSOR_CORE_BOUND = 0.5
DATA_WAIT_BOUND = 0.10
PHASE_PREFIX = "lgh/"
PHASES = ("data_wait", "forward", "backward", "optimizer")

Interval = tuple[float, float]

# Order matters: attention kernels are often CUTLASS kernels, and cuBLAS names contain "gemm".
_KIND_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|alltoall|cross_device_reduce", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|_mha|mha_", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cublas|cutlass|matmul|wgmma|triton_tem_fused_(?:b?mm|addmm)|\bb?mm_|_mm_",
                        re.I)),
    ("optimizer", re.compile(r"adam|sgd|multi_tensor_apply|optimizer", re.I)),
    ("reduction", re.compile(r"reduce|triton_red|triton_per|softmax|norm|cross_entropy|nll_loss|sum_kernel|mean",
                             re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|triton_poi|pointwise|copy|fill|cat_|index|embedding|scatter"
                               r"|gather", re.I)),
]
TENSOR_CORE_KINDS = ("gemm", "attention")


def kernel_kind(name: str) -> str:
    """Coarse kind of a GPU kernel from its name: communication, attention, gemm, optimizer, reduction,
    elementwise or other."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


# ---------------------------------------------------------------------------------------------- intervals
def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(merged: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of a merged interval list inside [lo, hi]."""
    starts = [a for a, _ in merged]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    out = []
    for a, b in merged[i:]:
        if a >= hi:
            break
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
    return out


def _length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _gaps(lo: float, hi: float, merged: list[Interval]) -> list[Interval]:
    out, cur = [], lo
    for a, b in merged:
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if hi > cur:
        out.append((cur, hi))
    return out


def _ms(us: float) -> float:
    return round(us / 1e3, 6)


def _share(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole > 0 else 0.0


# ---------------------------------------------------------------------------------------------- analysis
def _spans(trace: KinetoTrace) -> tuple[list[Step], str]:
    if trace.steps:
        ran = trace.metadata.get("lgh_steps")  # SelectiveProfiler's record of the steps that ran a batch
        if isinstance(ran, list) and len(ran) == 2 and all(isinstance(x, int) for x in ran):
            kept = [s for s in trace.steps if s.number is not None and ran[0] <= s.number <= ran[1]]
            if kept:
                return kept, "ProfilerStep"
        return trace.steps, "ProfilerStep"
    if trace.bounds is None:
        return [], "empty"
    lo, hi = trace.bounds
    return [Step(None, lo, hi - lo)], "whole trace"


def _phase_ranges(trace: KinetoTrace) -> dict[str, list[Interval]]:
    ranges: dict[str, list[Interval]] = defaultdict(list)
    for e in trace.annotations:
        if e.name.startswith(PHASE_PREFIX):
            ranges[e.name[len(PHASE_PREFIX):]].append((e.ts, e.end))
    ordered = [p for p in PHASES if p in ranges] + sorted(p for p in ranges if p not in PHASES)
    return {p: _union(ranges[p]) for p in ordered}


def _phase_of(launch_ts: float, labelled: list[tuple[float, float, str]], starts: list[float]) -> str | None:
    i = bisect.bisect_right(starts, launch_ts) - 1
    # Ranges may nest (another tool's lgh/ ranges); look back a few for the innermost that still covers ts.
    for j in range(i, max(i - 8, -1), -1):
        a, b, name = labelled[j]
        if a <= launch_ts <= b:
            return name
    return None


def summarize(trace: KinetoTrace, top: int = 10, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Analyse a parsed trace; returns a JSON-ready dict (the schema ``summary.json`` holds).

    Args:
        trace: from :func:`~lightning_gh.profiling.trace.load_trace`.
        top: how many kernels and host operators to list.
        context: optional facts about the run the trace cannot know (``"loader"``: the DataLoader settings from
            :func:`lightning_gh.profiling.stall.loader_info`), used for concrete advice.
    """
    if top <= 0:
        raise ValueError(f"top={top!r} must be a positive number of rows.")
    host_spans, span_source = _spans(trace)
    gpu = trace.gpu_events
    spans = list(host_spans)
    tail_us = 0.0
    if spans and gpu and span_source == "ProfilerStep":
        # The host runs ahead of the GPU: work launched in the last step can finish after its host span ends.
        gpu_end = max(e.end for e in gpu)
        if gpu_end > spans[-1].end:
            tail_us = gpu_end - spans[-1].end
            spans[-1] = Step(spans[-1].number, spans[-1].ts, gpu_end - spans[-1].ts)
    window_us = sum(s.dur for s in spans)
    comm = [k for k in trace.kernels if kernel_kind(k.name) == "communication"]
    compute = [k for k in trace.kernels if kernel_kind(k.name) != "communication"]
    comp_u = _union((e.ts, e.end) for e in compute)
    cc_u = _union((e.ts, e.end) for e in compute + comm)
    all_u = _union((e.ts, e.end) for e in gpu)
    comm_u = _union((e.ts, e.end) for e in comm)
    phases = _phase_ranges(trace)
    wait_u = phases.get("data_wait", [])
    gpu_starts = [e.ts for e in gpu]

    steps_out = []
    totals: dict[str, float] = defaultdict(float)
    for s, host in zip(spans, host_spans):
        a, b = s.ts, s.end
        compute_t = _length(_clip(comp_u, a, b))
        cc_t = _length(_clip(cc_u, a, b))
        busy_clip = _clip(all_u, a, b)
        busy_t = _length(busy_clip)
        idle = _gaps(a, b, busy_clip)
        host_t = 0.0
        for g0, g1 in idle:
            k = bisect.bisect_left(gpu_starts, g1 - 1e-9)
            if k < len(gpu):
                launch = trace.runtime.get(gpu[k].correlation) if gpu[k].correlation is not None else None
                if launch is not None:
                    host_t += min(max(launch.end, g0), g1) - g0
        wait_idle_t = _length(_intersect(idle, _clip(wait_u, a, b)))
        row = {
            "step": s.number,
            "start_ms": _ms(s.ts - spans[0].ts),
            "time_ms": _ms(host.dur),
            "span_ms": _ms(s.dur),
            "busy_ms": _ms(busy_t),
            "compute_ms": _ms(compute_t),
            "comm_ms": _ms(cc_t - compute_t),
            "copy_ms": _ms(busy_t - cc_t),
            "idle_ms": _ms(s.dur - busy_t),
            "host_bound_idle_ms": _ms(host_t),
            "data_wait_idle_ms": _ms(wait_idle_t),
            "phases_ms": {p: _ms(_length(_clip(r, a, b))) for p, r in phases.items()},
        }
        steps_out.append(row)
        for key, val in (("busy", busy_t), ("compute", compute_t), ("comm", cc_t - compute_t),
                         ("copy", busy_t - cc_t), ("idle", s.dur - busy_t), ("host", host_t),
                         ("wait_idle", wait_idle_t)):
            totals[key] += val

    step_times = [s.dur / 1e3 for s in host_spans]
    out: dict[str, Any] = {
        "trace": str(trace.path) if trace.path else None,
        "rank": trace.rank,
        "lgh": _lgh_metadata(trace),
        "span_source": span_source,
        "window_ms": _ms(window_us),
        "gpu_tail_ms": _ms(tail_us),
        "step_time_ms": None if not step_times else {
            "mean": round(statistics.fmean(step_times), 6),
            "median": round(statistics.median(step_times), 6),
            "min": round(min(step_times), 6),
            "max": round(max(step_times), 6),
        },
        "steps": steps_out,
        "gpu": None,
        "top_kernels": [],
        "kernel_kinds": {},
        "copies": {},
        "communication": None,
        "phases": None,
        "top_cpu_ops": _top_cpu_ops(trace, host_spans, window_us, top),
    }
    if trace.has_gpu:
        kernel_us = sum(k.dur for k in trace.kernels)
        durs = sorted(k.dur for k in trace.kernels)
        out["gpu"] = {
            "busy_share": _share(totals["busy"], window_us),
            "idle_share": _share(totals["idle"], window_us),
            "compute_share": _share(totals["compute"], window_us),
            "comm_share": _share(totals["comm"], window_us),
            "copy_share": _share(totals["copy"], window_us),
            "idle": {
                "host_bound_share": _share(totals["host"], window_us),
                "other_share": _share(totals["idle"] - totals["host"], window_us),
                "during_data_wait_share": _share(totals["wait_idle"], window_us),
            },
            "kernel_count": len(trace.kernels),
            "kernel_time_ms": _ms(kernel_us),
            "median_kernel_us": round(statistics.median(durs), 3) if durs else None,
        }
        out["top_kernels"] = _top_kernels(trace.kernels, kernel_us, top)
        kinds: dict[str, float] = defaultdict(float)
        for k in trace.kernels:
            kinds[kernel_kind(k.name)] += k.dur
        out["kernel_kinds"] = {k: _share(v, kernel_us) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
        out["copies"] = _copies(trace, window_us)
        if comm:
            comm_t = _length(comm_u)
            out["communication"] = {
                "kernels": len(comm),
                "time_ms": _ms(sum(k.dur for k in comm)),
                "share": _share(sum(k.dur for k in comm), window_us),
                "exposed_share": _share(totals["comm"], window_us),
                "overlapped_fraction": _share(_length(_intersect(comm_u, comp_u)), comm_t),
            }
    if phases:
        out["phases"] = _phase_table(trace, phases, spans, window_us, gpu)
    out["verdict"] = _verdict(out, context or {})
    return out


def _lgh_metadata(trace: KinetoTrace) -> Any:
    raw = trace.metadata.get("lgh")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _top_kernels(kernels: Sequence[Event], kernel_us: float, top: int) -> list[dict[str, Any]]:
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k.name].append(k.dur)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"name": n, "kind": kernel_kind(n), "count": len(d), "total_ms": _ms(sum(d)),
             "share": _share(sum(d), kernel_us), "mean_us": round(sum(d) / len(d), 3)} for n, d in rows]


_DIRECTION_RE = re.compile(r"\b(HtoD|DtoH|DtoD|HtoH|PtoP)\b")


def _copies(trace: KinetoTrace, window_us: float) -> dict[str, Any]:
    groups: dict[str, list[Event]] = defaultdict(list)
    for e in trace.memcpys:
        m = _DIRECTION_RE.search(e.name)
        groups[m.group(1) if m else "other"].append(e)
    for e in trace.memsets:
        groups["memset"].append(e)
    out = {}
    for name in ("HtoD", "DtoH", "DtoD", "PtoP", "HtoH", "other", "memset"):
        events = groups.get(name)
        if not events:
            continue
        t = sum(e.dur for e in events)
        nbytes = sum(int(e.args.get("bytes", 0) or 0) for e in events)
        out[name] = {"count": len(events), "bytes": nbytes, "time_ms": _ms(t),
                     "gbps": round(nbytes / (t * 1e3), 3) if t > 0 and nbytes else None,
                     "share": _share(t, window_us)}
    return out


def _phase_table(trace: KinetoTrace, phases: dict[str, list[Interval]], spans: list[Step], window_us: float,
                 gpu: list[Event]) -> dict[str, Any]:
    labelled = sorted((a, b, p) for p, r in phases.items() for a, b in r)
    starts = [a for a, _, _ in labelled]
    gpu_by_phase: dict[str, float] = defaultdict(float)
    for e in gpu:
        launch = trace.runtime.get(e.correlation) if e.correlation is not None else None
        phase = _phase_of(launch.ts, labelled, starts) if launch is not None else None
        gpu_by_phase[phase or "other"] += e.dur
    table: dict[str, Any] = {}
    covered = 0.0
    for p, r in phases.items():
        t = sum(_length(_clip(r, s.ts, s.end)) for s in spans)
        covered += t
        table[p] = {"ms": _ms(t), "share": _share(t, window_us),
                    "gpu_ms": _ms(gpu_by_phase.get(p, 0.0)) if gpu else None}
    other = max(window_us - covered, 0.0)
    table["other"] = {"ms": _ms(other), "share": _share(other, window_us),
                      "gpu_ms": _ms(gpu_by_phase.get("other", 0.0)) if gpu else None}
    return table


def _top_cpu_ops(trace: KinetoTrace, spans: list[Step], window_us: float, top: int) -> list[dict[str, Any]]:
    """Host operators by self time (own duration minus direct children), inside the spans."""
    if not spans or not trace.cpu_ops:
        return []
    lo, hi = spans[0].ts, max(s.end for s in spans)
    by_thread: dict[Any, list[Event]] = defaultdict(list)
    for e in trace.cpu_ops:
        if lo <= e.ts < hi:
            by_thread[(e.pid, e.tid)].append(e)
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for events in by_thread.values():
        events.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[list[Any]] = []  # [event, children time]
        for e in events:
            while stack and stack[-1][0].end <= e.ts:
                done = stack.pop()
                self_us[done[0].name] += max(done[0].dur - done[1], 0.0)
            if stack:
                stack[-1][1] += e.dur
            stack.append([e, 0.0])
            calls[e.name] += 1
        for done in stack:
            self_us[done[0].name] += max(done[0].dur - done[1], 0.0)
    rows = sorted(self_us.items(), key=lambda kv: -kv[1])[:top]
    return [{"name": n, "calls": calls[n], "self_ms": _ms(t), "share": _share(t, window_us)} for n, t in rows]


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


def _verdict(s: dict[str, Any], context: Mapping[str, Any]) -> dict[str, Any]:
    evidence: list[str] = []
    advice: list[str] = []
    phases = s.get("phases") or {}
    wait_share = phases.get("data_wait", {}).get("share", 0.0)
    step = s.get("step_time_ms") or {}
    g = s.get("gpu")
    # A host that waits for data while the GPU still has queued work is not a data stall: the host ran ahead
    # and something in the fetch (a pinned-buffer wait, a sync) blocked it until the GPU caught up. Data
    # advice needs the GPU itself to have idled during the waits.
    gpu_idled_on_data = g is None or g["idle"]["during_data_wait_share"] >= DATA_WAIT_BOUND / 2
    if wait_share >= DATA_WAIT_BOUND and not gpu_idled_on_data:
        evidence.append(f"the loop waited for data {wait_share:.1%} of the window, but the GPU stayed busy through "
                        f"it (idle {g['idle']['during_data_wait_share']:.1%} of the window during the waits): "
                        "the host was ahead of the GPU, so the loader is not the bottleneck")
    elif wait_share >= DATA_WAIT_BOUND:
        evidence.append(f"the loop waited for data {wait_share:.1%} of the window (lgh/data_wait ranges)")
        loader = context.get("loader")
        n = max(len(s["steps"]), 1)
        wait_ms = phases["data_wait"]["ms"] / n
        busy_ms = max((step.get("mean") or 0.0) - wait_ms, 1e-6)
        advice += stall_advice(loader, wait_ms / 1e3, busy_ms / 1e3) if loader else [
            "raise the DataLoader's num_workers, set pin_memory=True and persistent_workers=True "
            "(lightning_gh.DataStallDetector measures this on every step and gives concrete values)"]
    if g is None:
        bound = "input-bound" if wait_share >= DATA_WAIT_BOUND else "cpu-only"
        evidence.insert(0, "no GPU activity in the trace (a CPU-only run, or the profiler had no CUDA activity)")
        if s["top_cpu_ops"]:
            t = s["top_cpu_ops"][0]
            evidence.append(f"top host operator by self time: {t['name']} ({t['share']:.1%} of the window)")
        return {"bound": bound, "evidence": evidence, "advice": advice}

    kinds = s["kernel_kinds"]
    tc = sum(kinds.get(k, 0.0) for k in TENSOR_CORE_KINDS)
    idle, host, other = g["idle_share"], g["idle"]["host_bound_share"], g["idle"]["other_share"]
    during_wait = g["idle"]["during_data_wait_share"]
    evidence.insert(0, f"GPU busy {g['busy_share']:.1%} of the window, idle {idle:.1%} "
                       f"(host-bound {host:.1%}, other {other:.1%})")
    if s["top_kernels"]:
        k = s["top_kernels"][0]
        evidence.append(f"top kernel ({k['kind']}): {_short(k['name'])} {k['share']:.1%} of kernel time, "
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
        non_tc = sorted(((v, k) for k, v in kinds.items() if k not in TENSOR_CORE_KINDS), reverse=True)[:2]
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


# ---------------------------------------------------------------------------------------------- output
def _short(name: str, n: int = 70) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= n else name[: n - 1] + "…"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_markdown(s: Mapping[str, Any]) -> str:
    """The summary as a Markdown report (what ``summary.md`` holds)."""
    name = Path(s["trace"]).name if s.get("trace") else "trace"
    steps = s["steps"]
    nums = [r["step"] for r in steps if r["step"] is not None]
    what = (f"{len(steps)} step{'s' * (len(steps) != 1)} (ProfilerStep#{nums[0]}..#{nums[-1]})" if nums
            else "no ProfilerStep markers: the whole trace is one span")
    rank = f"rank {s['rank']} · " if s.get("rank") is not None else ""
    v = s["verdict"]
    lines = [f"# Trace summary: {name}", "",
             f"{rank}{what} · window {s['window_ms']:.3f} ms · verdict: **{v['bound']}**", "",
             "## Verdict", "", f"**{v['bound']}**. Evidence:", ""]
    lines += [f"- {e}" for e in v["evidence"]]
    if v["advice"]:
        lines += ["", "What to try:", ""] + [f"- {a}" for a in v["advice"]]
    g = s.get("gpu")
    lines += ["", "## Steps", ""]
    if g is not None:
        lines += ["| step | time ms | GPU busy | compute ms | comm ms | copies ms | idle ms | host-bound idle ms | "
                  "data wait ms |", "|---|---|---|---|---|---|---|---|---|"]
        for r in steps:
            lines.append(f"| {r['step'] if r['step'] is not None else 'all'} | {r['time_ms']:.3f} | "
                         f"{_pct(r['busy_ms'] / r['span_ms'] if r['span_ms'] else 0)} | {r['compute_ms']:.3f} | "
                         f"{r['comm_ms']:.3f} | {r['copy_ms']:.3f} | {r['idle_ms']:.3f} | "
                         f"{r['host_bound_idle_ms']:.3f} | {r['phases_ms'].get('data_wait', 0.0):.3f} |")
    else:
        phase_names = list((s.get("phases") or {}).keys())
        phase_names = [p for p in phase_names if p != "other"]
        lines += ["| step | time ms | " + " | ".join(f"{p} ms" for p in phase_names) + (" |" if phase_names else "|"),
                  "|---|---|" + "---|" * len(phase_names)]
        for r in steps:
            cells = " | ".join(f"{r['phases_ms'].get(p, 0.0):.3f}" for p in phase_names)
            lines.append(f"| {r['step'] if r['step'] is not None else 'all'} | {r['time_ms']:.3f} |"
                         + (f" {cells} |" if phase_names else ""))
    if s.get("gpu_tail_ms"):
        lines += ["", f"The GPU finished the window's work {s['gpu_tail_ms']:.3f} ms after the host ended the last "
                      "step; the GPU columns of the last step include that tail."]
    st = s.get("step_time_ms")
    if st:
        lines += ["", f"Step time: mean {st['mean']:.3f} ms, median {st['median']:.3f} ms, "
                      f"min {st['min']:.3f} ms, max {st['max']:.3f} ms."]
    if g is not None:
        w = s["window_ms"]
        lines += ["", "## GPU time (share of the window)", "", "| | ms | share |", "|---|---|---|"]
        for label, key in (("compute", "compute_share"), ("communication (not under compute)", "comm_share"),
                           ("copies / memsets (alone)", "copy_share"), ("idle", "idle_share")):
            lines.append(f"| {label} | {g[key] * w:.3f} | {_pct(g[key])} |")
        for label, key in (("idle: host-bound (waiting for launches)", "host_bound_share"),
                           ("idle: other (syncs, dependencies, latency)", "other_share"),
                           ("idle while the loop waited for data", "during_data_wait_share")):
            lines.append(f"| {label} | {g['idle'][key] * w:.3f} | {_pct(g['idle'][key])} |")
        lines += ["", f"{g['kernel_count']} kernels, {g['kernel_time_ms']:.3f} ms of kernel time, "
                      f"median kernel {g['median_kernel_us']} µs."]
        lines += ["", "## Top kernels (share of kernel time)", "",
                  "| # | kernel | kind | calls | total ms | share | mean µs |",
                  "|---|---|---|---|---|---|---|"]
        for i, k in enumerate(s["top_kernels"], 1):
            lines.append(f"| {i} | `{_short(k['name'])}` | {k['kind']} | {k['count']} | {k['total_ms']:.3f} | "
                         f"{_pct(k['share'])} | {k['mean_us']:.1f} |")
        lines += ["", "Kernel kinds: " + ", ".join(f"{k} {_pct(v)}" for k, v in s["kernel_kinds"].items()) + "."]
        if s["copies"]:
            lines += ["", "## Copies and memsets", "", "| kind | count | MB | ms | GB/s | share of window |",
                      "|---|---|---|---|---|---|"]
            for k, c in s["copies"].items():
                lines.append(f"| {k} | {c['count']} | {c['bytes'] / 1e6:.3f} | {c['time_ms']:.3f} | "
                             f"{_f(c['gbps'], 1)} | {_pct(c['share'])} |")
        c = s.get("communication")
        lines += ["", "## Communication", ""]
        lines.append("No NCCL kernels in the trace." if not c else
                     f"{c['kernels']} NCCL kernels, {c['time_ms']:.3f} ms ({_pct(c['share'])} of the window); "
                     f"{_pct(c['overlapped_fraction'])} of it overlaps compute, {_pct(c['exposed_share'])} "
                     "of the window is exposed communication.")
    ph = s.get("phases")
    if ph:
        lines += ["", "## Phases (lgh/ ranges on the host)", "",
                  "| phase | host ms | share of window | GPU ms launched |",
                  "|---|---|---|---|"]
        for p, r in ph.items():
            lines.append(f"| {p} | {r['ms']:.3f} | {_pct(r['share'])} | {_f(r['gpu_ms'])} |")
    if s["top_cpu_ops"]:
        lines += ["", "## Top host operators (self time)", "", "| operator | calls | self ms | share of window |",
                  "|---|---|---|---|"]
        for o in s["top_cpu_ops"]:
            lines.append(f"| `{_short(o['name'])}` | {o['calls']} | {o['self_ms']:.3f} | {_pct(o['share'])} |")
    lines += ["", "Definitions: lightning_gh/profiling/summary.py (docs/profiling.md)."]
    return "\n".join(lines) + "\n"


_TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json", ".json.gz", ".json", ".gz")


def summary_paths(trace_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Where the summary of ``trace_path`` goes: ``<stem>.summary.{json,md,png}`` next to it (or in ``out_dir``)."""
    p = Path(trace_path)
    stem = p.name
    for suffix in _TRACE_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    d = Path(out_dir) if out_dir is not None else p.parent
    return {ext: d / f"{stem}.summary.{ext}" for ext in ("json", "md", "png")}


def write_summary(summary: Mapping[str, Any], paths: Mapping[str, Path], plot: bool = True) -> dict[str, Path]:
    """Write ``summary.json``, ``summary.md`` and (``plot=True``) the PNG; returns the paths written."""
    written = {}
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps(summary, indent=2))
    written["json"] = paths["json"]
    paths["md"].write_text(render_markdown(summary))
    written["md"] = paths["md"]
    if plot:
        from lightning_gh.profiling.plot import plot_summary

        written["png"] = plot_summary(summary, paths["png"])
    return written


def summarize_trace(path: str | os.PathLike, out_dir: str | os.PathLike | None = None, *, top: int = 10,
                    plot: bool = True, write: bool = True, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read a Kineto trace, analyse it and (``write=True``) write ``<stem>.summary.{json,md,png}`` next to it.

    Args:
        path: a ``.json`` or ``.json.gz`` Kineto trace (any producer).
        out_dir: where to write the files (default: next to the trace).
        top: kernels and host operators listed.
        plot: also write the PNG.
        write: write files at all (``False`` only returns the dict).
        context: facts about the run for advice (see :func:`summarize`).

    Returns:
        The summary dict; with ``write=True`` its ``"files"`` key maps ``json``/``md``/``png`` to the paths.
    """
    summary = summarize(load_trace(path), top=top, context=context)
    if write:
        files = write_summary(summary, summary_paths(path, out_dir), plot=plot)
        summary["files"] = {k: str(v) for k, v in files.items()}
    return summary
