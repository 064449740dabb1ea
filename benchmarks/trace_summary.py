"""Where one training step's GPU time goes: a compact reading of a ``torch.profiler`` trace of that step.

:func:`trace_summary` is pure: it takes Chrome-trace event dicts (``{"ph": "X", "cat": ..., "name": ..., "ts": us,
"dur": us, "pid": ..., "tid": ..., "args": {...}}``, what ``export_chrome_trace`` writes) and a step window, and
returns the step's GPU busy time (the union of every kernel, memcpy and memset, clipped to the window), each stream's
busy time, the compute stream (the most non-NCCL kernel time) and its idle time, the largest idle gaps of that stream
with the host ranges running when each began, kernel time by name, NCCL kernel time, memcpy time and bytes by
direction, and host time per ``record_function`` range. :func:`compare_markdown` sets the summaries of two or more
variants side by side.

:class:`StepTracer` profiles one step on the rank that makes it (``benchmarks/multi_gpu_job.py --trace``): the
profiler starts right after the step's ``torch.cuda.synchronize`` and stops right after the next step's, and a
``record_function`` range (:data:`MARKER`) spans exactly the step, so the window is read from the trace itself.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

#: The range :class:`StepTracer` opens around the profiled step: the analysis window.
MARKER = "multi_gpu_job.traced_step"
#: Event categories that run on the GPU (compared lowercase).
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Host event categories whose ranges are named at the start of a GPU idle gap.
HOST_CATS = frozenset({"user_annotation", "cpu_op", "python_function", "cuda_runtime", "cuda_driver"})
MIN_GAP_MS = 0.2  # compute-stream idle gaps reported one by one from this length on
IDLE_BINS = 10  # the compute stream's idle time is also given per tenth of the step
_MODULE_SUFFIX = re.compile(r"\s*\([^()]*\)$")  # "FSDP::pre_forward (model.layers.3)" -> "FSDP::pre_forward"
TOP_GAPS = 12
TOP_KERNELS = 25
TOP_RANGES = 20
TOP_STREAMS = 8
GAP_HOST_NAMES = 5
NAME_CHARS = 90
#: The raw trace is kept (gzipped) below this size.
MAX_RAW_BYTES = 25 * 2**20
_MEMCPY_KIND = re.compile(r"\b(HtoD|DtoH|DtoD|HtoH|PtoP)\b")


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _cat(e: dict[str, Any]) -> str:
    return str(e.get("cat") or "").lower()


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted, disjoint union of ``(start, end)`` intervals (empty ones dropped).

    >>> union([(5, 7), (0, 2), (1, 3), (7, 8), (4, 4)])
    [(0, 3), (5, 8)]
    """
    out: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def memcpy_kind(name: str) -> str:
    """The direction of a memcpy event from its name (``"Memcpy HtoD (Pinned -> Device)"`` is ``HtoD``), or
    ``other``.

    >>> memcpy_kind("Memcpy DtoH (Device -> Pinned)"), memcpy_kind("Memcpy PtoP (Device -> Device)"), memcpy_kind("x")
    ('DtoH', 'PtoP', 'other')
    """
    m = _MEMCPY_KIND.search(name)
    return m.group(1) if m else "other"


def trace_summary(events: list[dict[str, Any]], step_start_us: float, step_end_us: float, *,
                  host_tid: Any = None) -> dict[str, Any]:
    """The step between ``step_start_us`` and ``step_end_us`` (the trace's clock): every time in ms, every
    interval clipped to the window. ``host_tid`` is the training thread: a gap's ``host`` names come from it (from
    every thread when ``None``), the other threads' names go to ``other_threads``.

    GPU events are the complete (``"X"``) events whose category is a kernel, memcpy or memset; an event's stream is
    ``args["stream"]``, else its ``tid``. The compute stream is the one with the most non-NCCL kernel time; its idle
    time is the window less the union of its events, and its gaps of at least :data:`MIN_GAP_MS` are listed (the
    longest :data:`TOP_GAPS`, with their offset from the window's start) with the host ranges running at each gap's
    start, the innermost (shortest) first.
    """
    lo, hi = float(step_start_us), float(step_end_us)
    wall = max(0.0, hi - lo)
    gpu: list[tuple[float, float, dict[str, Any]]] = []
    host: list[tuple[float, float, dict[str, Any]]] = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        a = float(e["ts"])
        b = a + float(e.get("dur") or 0.0)
        a, b = max(a, lo), min(b, hi)
        if b < a or (b == a and float(e.get("dur") or 0.0) > 0):
            continue
        cat = _cat(e)
        if cat in GPU_CATS:
            gpu.append((a, b, e))
        elif cat in HOST_CATS:
            host.append((a, b, e))

    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    kernel_us: dict[str, float] = defaultdict(float)  # per stream, NCCL aside
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    memcpy: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "bytes": 0, "count": 0})
    nccl_us = memset_us = kernel_total = 0.0
    for a, b, e in gpu:
        args = e.get("args") or {}
        stream = str(args.get("stream", e.get("tid")))
        by_stream[stream].append((a, b))
        cat, name = _cat(e), str(e.get("name", ""))
        if cat == "kernel":
            kernel_total += b - a
            k = kernels[name[:NAME_CHARS]]
            k[0] += b - a
            k[1] += 1
            if "nccl" in name.lower():
                nccl_us += b - a
            else:
                kernel_us[stream] += b - a
        elif cat == "gpu_memcpy":
            m = memcpy[memcpy_kind(name)]
            m["ms"] += b - a
            m["count"] += 1
            if isinstance(args.get("bytes"), (int, float)):
                m["bytes"] += int(args["bytes"])
        else:
            memset_us += b - a

    unions = {s: union(iv) for s, iv in by_stream.items()}
    streams = sorted(({"stream": s, "busy_ms": _ms(_length(u)), "kernel_ms": _ms(kernel_us.get(s, 0.0)),
                       "events": len(by_stream[s])} for s, u in unions.items()),
                     key=lambda r: (-r["busy_ms"], r["stream"]))
    compute = max(kernel_us, key=lambda s: (kernel_us[s], s), default=None)
    if compute is None and unions:  # NCCL kernels or copies only: the busiest stream
        compute = max(unions, key=lambda s: (_length(unions[s]), s))
    busy = union([iv for u in unions.values() for iv in u])
    compute_union = unions.get(compute, []) if compute is not None else []

    gaps: list[tuple[float, float]] = []  # none without a GPU stream (a CPU run)
    t = lo
    for a, b in compute_union:
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if compute is not None and hi > t:
        gaps.append((t, hi))
    floor = MIN_GAP_MS * 1e3
    big = [g for g in gaps if g[1] - g[0] >= floor]
    small = [g for g in gaps if g[1] - g[0] < floor]

    def running(at: float) -> tuple[list[str], list[str]]:
        here = sorted((b - a, str(e.get("name", "")), e.get("tid") == host_tid or host_tid is None)
                      for a, b, e in host if a <= at < b)
        mine = list(dict.fromkeys(n for _, n, own in here if own))[:GAP_HOST_NAMES]
        others = list(dict.fromkeys(n for _, n, own in here if not own))[:GAP_HOST_NAMES]
        return mine, others

    # idle per tenth of the window, and by the training thread's innermost named range at each gap's start (every
    # gap, short ones too; ranges of one kind over several modules summed)
    bins = [0.0] * IDLE_BINS
    width = wall / IDLE_BINS if wall > 0 else 0.0
    for a, b in gaps:
        i = int((a - lo) // width) if width else 0
        while a < b and i < IDLE_BINS:
            edge = lo + (i + 1) * width
            bins[i] += min(b, edge) - a
            a, i = edge, i + 1
    marks = sorted(((a, b, _MODULE_SUFFIX.sub("", str(e.get("name", "")))) for a, b, e in host
                    if _cat(e) == "user_annotation" and (host_tid is None or e.get("tid") == host_tid)),
                   key=lambda m: (m[0], -m[1], m[2]))  # of two ranges that start together, the outer one first
    by_range: dict[str, float] = defaultdict(float)
    stack: list[tuple[float, str]] = []
    j = 0
    for a, b in sorted(gaps):
        while j < len(marks) and marks[j][0] <= a:
            while stack and stack[-1][0] <= marks[j][0]:
                stack.pop()
            stack.append((marks[j][1], marks[j][2]))
            j += 1
        while stack and stack[-1][0] <= a:
            stack.pop()
        by_range[stack[-1][1] if stack else ""] += b - a

    top_gaps = []
    for a, b in sorted(big, key=lambda g: (g[0] - g[1], g[0]))[:TOP_GAPS]:
        mine, others = running(a)
        gap = {"start_ms": _ms(a - lo), "ms": _ms(b - a), "host": mine}
        if host_tid is not None:
            gap["other_threads"] = others
        top_gaps.append(gap)

    ranges: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for a, b, e in host:
        if _cat(e) == "user_annotation":
            r = ranges[str(e.get("name", ""))]
            r[0] += b - a
            r[1] += 1
    named = sorted(kernels.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return {
        "wall_ms": _ms(wall),
        "gpu_busy_ms": _ms(_length(busy)),
        "streams": streams[:TOP_STREAMS],
        "compute_stream": compute,
        "compute_busy_ms": _ms(_length(compute_union)),
        "compute_idle_ms": _ms(wall - _length(compute_union)),
        "gaps": top_gaps,
        "gaps_count": len(big),
        "gaps_ms": _ms(_length(big)),
        "small_gaps_count": len(small),
        "small_gaps_ms": _ms(_length(small)),
        "idle_by_tenth_ms": [_ms(v) for v in bins],
        "idle_by_range_ms": {n: _ms(v) for n, v in sorted(by_range.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_RANGES]},
        "kernel_ms_total": _ms(kernel_total),
        "kernel_count": sum(int(v[1]) for v in kernels.values()),
        "kernels": [{"name": n, "ms": _ms(v[0]), "count": int(v[1])} for n, v in named[:TOP_KERNELS]],
        "kernel_ms_by_name": {n: _ms(v[0]) for n, v in named},
        "nccl_ms": _ms(nccl_us),
        "memcpy": {k: {"ms": _ms(v["ms"]), "bytes": int(v["bytes"]), "count": int(v["count"])}
                   for k, v in sorted(memcpy.items())},
        "memcpy_ms": _ms(sum(v["ms"] for v in memcpy.values())),
        "memset_ms": _ms(memset_us),
        "ranges": [{"name": n, "ms": _ms(v[0]), "count": int(v[1])}
                   for n, v in sorted(ranges.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_RANGES]],
    }


def load_events(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (gzipped or not; a ``{"traceEvents": [...]}`` object or a bare list)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return list(data.get("traceEvents", [])) if isinstance(data, dict) else list(data)


def step_window(events: list[dict[str, Any]], marker: str = MARKER) -> tuple[float, float, Any] | None:
    """``(start_us, end_us, tid)`` of the ``marker`` range (the longest, if several), or ``None``."""
    found = [e for e in events if e.get("ph") == "X" and e.get("name") == marker and "ts" in e]
    if not found:
        return None
    e = max(found, key=lambda e: float(e.get("dur") or 0.0))
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur") or 0.0), e.get("tid")


def summary_lines(variant: str, s: dict[str, Any]) -> list[str]:
    """A few lines of a summary, for the log."""
    mc = ", ".join(f"{k} {v['ms']:.1f} ms / {v['bytes'] / 2**20:.0f} MiB" for k, v in s["memcpy"].items()) or "none"
    lines = [f"trace {variant} (step {s.get('step')}): wall {s['wall_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms, "
             f"compute stream {s['compute_stream']} busy {s['compute_busy_ms']:.1f} ms, idle "
             f"{s['compute_idle_ms']:.1f} ms ({s['gaps_count']} gaps from {MIN_GAP_MS} ms on: {s['gaps_ms']:.1f} ms; "
             f"{s['small_gaps_count']} shorter: {s['small_gaps_ms']:.1f} ms)",
             f"  kernels {s['kernel_ms_total']:.1f} ms ({s['kernel_count']}), NCCL {s['nccl_ms']:.1f} ms, memcpy {mc}, "
             f"memset {s['memset_ms']:.1f} ms",
             "  top kernels: " + "; ".join(f"{k['name'][:50]} {k['ms']:.1f}" for k in s["kernels"][:5]),
             "  largest gaps (at +ms: ms [host]): " + "; ".join(
                 f"+{g['start_ms']:.1f}: {g['ms']:.2f} [{' < '.join(g['host'][:3])}]" for g in s["gaps"][:5]),
             "  ranges (host ms): " + "; ".join(f"{r['name']} {r['ms']:.1f}" for r in s["ranges"][:6])]
    if s.get("idle_by_tenth_ms"):
        lines.append("  idle per tenth of the step (ms): " + " ".join(f"{v:.1f}" for v in s["idle_by_tenth_ms"]))
        lines.append("  idle by the training thread's range (ms): " + "; ".join(
            f"{n or '(none)'} {v:.1f}" for n, v in list(s.get("idle_by_range_ms", {}).items())[:6]))
    if s.get("raw_trace"):
        lines.append(f"  raw trace: {s['raw_trace']}")
    return lines


def compare_markdown(summaries: list[tuple[str, dict[str, Any]]], top: int = 15) -> str:
    """The variants' summaries side by side (the first is the anchor): one row of totals each, then per other
    variant the kernels whose time per step differs most from the anchor's, and each variant's largest gaps."""
    head = ("| variant | step | wall ms | GPU busy ms | compute busy ms | compute idle ms | gaps ms (count) | "
            "shorter gaps ms | kernel ms | NCCL ms | memcpy ms (HtoD/DtoH/DtoD) |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    lines = ["Profiled step per variant (rank 0, one step, ms per step).", "", head]
    for v, s in summaries:
        mc = "/".join(f"{s['memcpy'].get(k, {}).get('ms', 0.0):.1f}" for k in ("HtoD", "DtoH", "DtoD"))
        lines.append(f"| {v} | {s.get('step', '')} | {s['wall_ms']:.1f} | {s['gpu_busy_ms']:.1f} | "
                     f"{s['compute_busy_ms']:.1f} | {s['compute_idle_ms']:.1f} | {s['gaps_ms']:.1f} ({s['gaps_count']}) | "
                     f"{s['small_gaps_ms']:.1f} | {s['kernel_ms_total']:.1f} | {s['nccl_ms']:.1f} | "
                     f"{s['memcpy_ms']:.1f} ({mc}) |")
    if not summaries:
        return "\n".join(lines)
    anchor, base = summaries[0]
    a_k = base.get("kernel_ms_by_name", {})
    for v, s in summaries[1:]:
        o_k = s.get("kernel_ms_by_name", {})
        diff = sorted(((o_k.get(n, 0.0) - a_k.get(n, 0.0), n) for n in set(a_k) | set(o_k)),
                      key=lambda d: (-abs(d[0]), d[1]))[:top]
        lines += ["", f"Kernel time per step, {v} minus {anchor} (largest differences first):", "",
                  f"| kernel | {anchor} ms | {v} ms | difference ms |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{n}` | {a_k.get(n, 0.0):.2f} | {o_k.get(n, 0.0):.2f} | {d:+.2f} |" for d, n in diff]
    for v, s in summaries:
        lines += ["", f"{v}: largest compute-stream gaps (offset ms, length ms, host ranges then, innermost first):"]
        lines += [f"- +{g['start_ms']:.1f}: {g['ms']:.2f} [{' < '.join(g['host'])}]" for g in s["gaps"][:5]]
    if any(s.get("idle_by_tenth_ms") for _, s in summaries):
        lines += ["", "Compute-stream idle ms per tenth of the step, and by the training thread's innermost named range "
                  "at each gap (every gap):", "", "| variant | " + " | ".join(f"{i + 1}/10" for i in range(IDLE_BINS))
                  + " | by range |", "| --- | " + " | ".join("---:" for _ in range(IDLE_BINS)) + " | --- |"]
        for v, s in summaries:
            tenths = s.get("idle_by_tenth_ms") or [0.0] * IDLE_BINS
            named = "; ".join(f"{n or '(none)'} {ms:.1f}" for n, ms in list(s.get("idle_by_range_ms", {}).items())[:5])
            lines.append(f"| {v} | " + " | ".join(f"{t:.1f}" for t in tenths) + f" | {named} |")
    return "\n".join(lines)


def _all_threads() -> dict[str, Any]:
    """``torch.profiler.profile`` keywords that record every host thread (SuperOffload's CPU update runs on its
    own), or none where this torch cannot."""
    import torch

    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        return {}


class StepTracer:
    """Profiles step ``step`` (the index of the run's steps, warmup included) on this process.

    The caller, in its per-step hook right after the synchronize: :meth:`close` (ends the profiled step's range),
    :meth:`open` at the profiled step (starts the profiler and the range), then takes its time stamp, then
    :meth:`stop` (stops the profiler once the range is closed). The profiler's start and stop thus fall outside the
    profiled step's interval; :meth:`analyze` exports and reads the trace once training is over.
    """

    def __init__(self, step: int, cuda: bool) -> None:
        self.step = step
        self.cuda = cuda
        self.prof: Any = None
        self._range: Any = None
        self.stopped = False

    def open(self) -> None:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False, **_all_threads())
        self.prof.start()
        self._range = torch.profiler.record_function(MARKER)
        self._range.__enter__()

    def close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def stop(self) -> None:
        if self.prof is not None and self._range is None and not self.stopped:
            self.prof.stop()
            self.stopped = True

    def analyze(self, out_dir: Path, variant: str) -> dict[str, Any]:
        """Export the trace, write ``trace-<variant>.json`` (the summary) and ``trace-<variant>.json.gz`` (the raw
        trace, kept below :data:`MAX_RAW_BYTES`) into ``out_dir``, print the summary; returns it."""
        self.close()
        self.stop()
        if not self.stopped:
            raise RuntimeError(f"step {self.step} was never profiled (the run ended before it)")
        raw = out_dir / f"trace-{variant}.raw.json"
        gz = out_dir / f"trace-{variant}.json.gz"
        self.prof.export_chrome_trace(str(raw))
        try:
            events = load_events(raw)
            window = step_window(events)
            note = None
            if window is None:  # no range in the trace: the span of its events
                spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur") or 0.0)) for e in events
                         if e.get("ph") == "X" and "ts" in e and (_cat(e) in GPU_CATS or _cat(e) in HOST_CATS)]
                window = (min(a for a, _ in spans), max(b for _, b in spans), None) if spans else (0.0, 0.0, None)
                note = f"no {MARKER} range in the trace: the window is the span of its events"
            summary = trace_summary([e for e in events if e.get("name") != MARKER], window[0], window[1],
                                    host_tid=window[2])
            del events
            with open(raw, "rb") as fin, gzip.open(gz, "wb", compresslevel=6) as fout:
                while chunk := fin.read(1 << 24):
                    fout.write(chunk)
        finally:
            raw.unlink(missing_ok=True)
        size = gz.stat().st_size
        if size < MAX_RAW_BYTES:
            summary["raw_trace"] = f"{gz.name} ({size / 2**20:.1f} MiB gzipped)"
        else:
            gz.unlink()
            summary["raw_trace"] = (f"not kept: {size / 2**20:.0f} MiB gzipped, above the "
                                    f"{MAX_RAW_BYTES / 2**20:.0f} MiB limit")
        summary = {"variant": variant, "step": self.step, **({"note": note} if note else {}), **summary}
        (out_dir / f"trace-{variant}.json").write_text(json.dumps(summary, indent=1))
        print("\n".join(summary_lines(variant, summary)), flush=True)
        return summary
