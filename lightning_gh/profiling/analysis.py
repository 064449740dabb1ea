"""Numbers from a parsed Kineto trace: step spans, GPU busy/idle split, kernels, copies, communication, phases.

Parsing is :mod:`lightning_gh.profiling.trace`; judging the numbers is :mod:`lightning_gh.profiling.advice`; writing
them is :mod:`lightning_gh.profiling.render`. Nothing here imports torch or Lightning, so a trace can be analysed
on a laptop (``python -m lightning_gh.profiling summarize``).

The span analysed is the host's ``ProfilerStep#<n>`` ranges; a trace without them is analysed as one span from its
first to its last event. Definitions (all times are wall-clock time within the step spans, so the shares add up
to 1):

* **busy**: the union of kernel, memcpy and memset intervals over all streams; **idle** is the rest. The
  denominator is the window below (wall-clock time of the profiled steps), not the GPU's lifetime in the trace as
  in Holistic Trace Analysis' idle time; docs/profiling.md compares the two.
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
* idle time is also split **by cause**, each instant once, in this order: the loop waited for data (inside
  ``lgh/data_wait``), the CPU optimizer update ran on another thread while no launching thread ran a host
  operator (the GPU waited for the update), the host was launching (as above), other.
* the **CPU update**, the **host link** (HtoD / DtoH copies, their owners and the time they ran with no kernel),
  **activation offload** copies and **fp8** casts are defined in :mod:`lightning_gh.profiling.offload_analysis`.
* the **data wait** (``data_wait``) is the share of the window the loop spent fetching its next batch, as
  :func:`lightning_gh.profiling.advice.data_wait_share` defines it: from SelectiveProfiler's record of
  Lightning's fetch (trace metadata ``lgh_fetch_ms``) when present, else from the ``lgh/data_wait`` ranges.

Example::

    >>> from lightning_gh.profiling.analysis import analyze
    >>> from lightning_gh.profiling.trace import load_trace
    >>> numbers = analyze(load_trace("rank0_steps10-14.pt.trace.json.gz"))  # doctest: +SKIP
    >>> numbers["gpu"]["idle_share"]  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import statistics
from collections import defaultdict
from typing import Any, Mapping, Sequence

from lightning_gh.profiling import offload_analysis as off
from lightning_gh.profiling._intervals import Interval, intersect, length, subtract, union
from lightning_gh.profiling._intervals import clip as _clip
from lightning_gh.profiling._intervals import gaps as _gaps
from lightning_gh.profiling.advice import data_wait_share
from lightning_gh.profiling.trace import Event, KinetoTrace, Step

__all__ = ["analyze", "kernel_kind", "PHASES", "PHASE_PREFIX", "TENSOR_CORE_KINDS"]

PHASE_PREFIX = "lgh/"
PHASES = ("data_wait", "forward", "backward", "optimizer")

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


@functools.lru_cache(maxsize=8192)  # a trace repeats few names many times; the patterns are the summary's hot path
def kernel_kind(name: str) -> str:
    """Coarse kind of a GPU kernel from its name: communication, attention, gemm, optimizer, reduction,
    elementwise or other."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


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
    return {p: union(ranges[p]) for p in ordered}


def _phase_of(launch_ts: float, labelled: list[tuple[float, float, str]], starts: list[float]) -> str | None:
    i = bisect.bisect_right(starts, launch_ts) - 1
    # Ranges may nest (another tool's lgh/ ranges); look back a few for the innermost that still covers ts.
    for j in range(i, max(i - 8, -1), -1):
        a, b, name = labelled[j]
        if a <= launch_ts <= b:
            return name
    return None


def analyze(trace: KinetoTrace, top: int = 10, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The numbers of a parsed trace, as a JSON-ready dict (``summary.json`` without its ``verdict``).

    Args:
        trace: from :func:`~lightning_gh.profiling.trace.load_trace`.
        top: how many kernels and host operators to list.
        context: facts about the run the trace cannot know; here ``"link"`` (the host link's measured
            ``h2d_gbps`` / ``d2h_gbps``, see :func:`~lightning_gh.profiling.offload_analysis.link_rate`).
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
            last = spans[-1]
            spans[-1] = Step(last.number, last.ts, gpu_end - last.ts, last.pid, last.tid)
    window_us = sum(s.dur for s in spans)
    comm = [k for k in trace.kernels if kernel_kind(k.name) == "communication"]
    compute = [k for k in trace.kernels if kernel_kind(k.name) != "communication"]
    comp_u = union((e.ts, e.end) for e in compute)
    cc_u = union((e.ts, e.end) for e in compute + comm)
    all_u = union((e.ts, e.end) for e in gpu)
    comm_u = union((e.ts, e.end) for e in comm)
    phases = _phase_ranges(trace)
    wait_u = phases.get("data_wait", [])
    gpu_starts = [e.ts for e in gpu]
    labelled = sorted((a, b, p) for p, r in phases.items() for a, b in r)
    starts = [a for a, _, _ in labelled]

    def phase_of(ts: float) -> str | None:
        return _phase_of(ts, labelled, starts)

    def in_window(u: list[Interval]) -> list[Interval]:
        return [iv for s in spans for iv in _clip(u, s.ts, s.end)]

    # The CPU update, and when it leaves the GPU waiting: see offload_analysis.
    update_u, update_source, update_threads = off.cpu_update_spans(trace)
    update_free = subtract(update_u, off.host_busy(trace, update_threads)) if update_u else []
    update_free = union(update_free + off.update_wait_spans(trace))  # the training thread blocked on the update
    copies = off.link_copies(trace, phase_of, update_threads) if trace.memcpys else []
    link_u = union((e.ts, e.end) for e, _, _ in copies)

    steps_out = []
    totals: dict[str, float] = defaultdict(float)
    for s, host in zip(spans, host_spans):
        a, b = s.ts, s.end
        compute_t = length(_clip(comp_u, a, b))
        cc_t = length(_clip(cc_u, a, b))
        busy_clip = _clip(all_u, a, b)
        busy_t = length(busy_clip)
        idle = _gaps(a, b, busy_clip)
        host_iv = []
        for g0, g1 in idle:
            k = bisect.bisect_left(gpu_starts, g1 - 1e-9)
            if k < len(gpu):
                launch = trace.runtime.get(gpu[k].correlation) if gpu[k].correlation is not None else None
                if launch is not None:
                    host_iv.append((g0, min(max(launch.end, g0), g1)))
        host_iv = union(host_iv)
        host_t = length(host_iv)
        # Idle time by cause, each instant counted once: data wait > CPU update > waiting for launches > other.
        idle_wait = intersect(idle, _clip(wait_u, a, b))
        rest = subtract(idle, idle_wait)
        idle_update = intersect(rest, _clip(update_free, a, b))
        rest = subtract(rest, idle_update)
        launch_t = length(intersect(rest, host_iv))
        wait_idle_t, update_idle_t = length(idle_wait), length(idle_update)
        step_copies = [(e, d) for e, d, _ in copies if a <= e.ts < b]
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
            "cpu_update_ms": _ms(length(_clip(update_u, a, b))),
            "cpu_update_idle_ms": _ms(update_idle_t),
            "link_alone_ms": _ms(length(subtract(_clip(link_u, a, b), _clip(cc_u, a, b)))),
            "htod_bytes": sum(int(e.args.get("bytes", 0) or 0) for e, d in step_copies if d == "HtoD"),
            "dtoh_bytes": sum(int(e.args.get("bytes", 0) or 0) for e, d in step_copies if d == "DtoH"),
            "phases_ms": {p: _ms(length(_clip(r, a, b))) for p, r in phases.items()},
        }
        steps_out.append(row)
        idle_t = s.dur - busy_t
        for key, val in (("busy", busy_t), ("compute", compute_t), ("comm", cc_t - compute_t),
                         ("copy", busy_t - cc_t), ("idle", idle_t), ("host", host_t),
                         ("wait_idle", wait_idle_t), ("update_idle", update_idle_t), ("launch_idle", launch_t),
                         ("other_idle", max(idle_t - wait_idle_t - update_idle_t - launch_t, 0.0))):
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
        "cpu_update": off.cpu_update_section(
            in_window(update_u), update_source, update_threads, trace, _backward_spans(trace, phases, gpu), comp_u,
            totals["update_idle"], window_us, len(host_spans)),
        "link": None,
        "activation_offload": None,
        "fp8": None,
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
                "by_cause": {"data_wait": _share(totals["wait_idle"], window_us),
                             "cpu_update": _share(totals["update_idle"], window_us),
                             "launch": _share(totals["launch_idle"], window_us),
                             "other": _share(totals["other_idle"], window_us)},
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
            comm_t = length(comm_u)
            out["communication"] = {
                "kernels": len(comm),
                "time_ms": _ms(sum(k.dur for k in comm)),
                "share": _share(sum(k.dur for k in comm), window_us),
                "exposed_share": _share(totals["comm"], window_us),
                "overlapped_fraction": _share(length(intersect(comm_u, comp_u)), comm_t),
            }
        rate, rate_source = off.link_rate(trace, context)
        out["link"] = off.link_section(copies, in_window, cc_u, window_us, len(host_spans), rate, rate_source)
        out["activation_offload"] = off.activation_section(copies, in_window, comp_u, window_us)
        out["fp8"] = off.fp8_section(trace.kernels, kernel_kind, kernel_us)
    if phases:
        out["phases"] = _phase_table(trace, phases, spans, window_us, gpu)
    out["data_wait"] = _data_wait(trace, out, host_spans, window_us)
    return out


def _backward_spans(trace: KinetoTrace, phases: dict[str, list[Interval]], gpu: list[Event]) -> list[Interval] | None:
    """Each ``lgh/backward`` range, stretched over the GPU work launched inside it (the host only launches the
    backward; the GPU runs it later), or ``None`` without such ranges."""
    ranges = phases.get("backward")
    if not ranges:
        return None
    starts = [a for a, _ in ranges]
    spans = [[a, b] for a, b in ranges]
    for e in gpu:
        launch = trace.runtime.get(e.correlation) if e.correlation is not None else None
        if launch is None:
            continue
        i = bisect.bisect_right(starts, launch.ts) - 1
        if i >= 0 and launch.ts <= ranges[i][1]:
            spans[i][0], spans[i][1] = min(spans[i][0], e.ts), max(spans[i][1], e.end)
    return union((a, b) for a, b in spans)


def _data_wait(trace: KinetoTrace, out: dict[str, Any], host_spans: list[Step], window_us: float) -> dict[str, Any]:
    """The data-wait share, by the one definition the stall detector uses too (see ``advice.data_wait_share``)."""
    fetch = trace.metadata.get("lgh_fetch_ms")  # SelectiveProfiler: ms in Lightning's fetch, per step
    if isinstance(fetch, str):
        try:
            fetch = json.loads(fetch)
        except json.JSONDecodeError:
            fetch = None
    if isinstance(fetch, dict) and fetch:
        numbers = {s.number for s in host_spans}
        wait_ms = sum(float(v) for k, v in fetch.items() if str(k).isdigit() and int(k) in numbers)
        return {"share": round(data_wait_share(wait_ms, window_us / 1e3), 6), "ms": round(wait_ms, 6),
                "source": "fetch"}
    ph = (out.get("phases") or {}).get("data_wait")
    if ph is None:
        return {"share": 0.0, "ms": 0.0, "source": None}
    return {"share": ph["share"], "ms": ph["ms"], "source": "lgh/data_wait ranges"}


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


def _copies(trace: KinetoTrace, window_us: float) -> dict[str, Any]:
    groups: dict[str, list[Event]] = defaultdict(list)
    for e in trace.memcpys:
        groups[off.copy_direction(e.name) or "other"].append(e)
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
        t = sum(length(_clip(r, s.ts, s.end)) for s in spans)
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

