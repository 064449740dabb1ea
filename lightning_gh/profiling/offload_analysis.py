"""Numbers of an offloaded or fp8 step: the CPU optimizer update, the host link, activation-offload copies, fp8 casts.

:mod:`lightning_gh.profiling.analysis` calls these for every summary; each section is ``None`` when the trace shows
nothing of it. Like the rest of the analysis, nothing here imports torch or Lightning, and nothing here judges:
the verdict is :func:`lightning_gh.profiling.advice.decide`.

**The CPU update** is the time another host thread spends updating optimizer state (SuperOffload's worker, any
CPU AdamW off the training thread). Its spans are, in order of preference:

* ``record_function`` ranges whose name holds ``cpu_update`` (what :data:`CPU_UPDATE_RANGE` names), on any thread
  but the one that marks ``ProfilerStep``;
* otherwise host operators and ranges whose names show a CPU AdamW (``adamw``, ``cpu_adam``,
  ``HeterogeneousAdamW``, ``_fused_adamw_``) on such a thread, and everything on a thread whose name shows one,
  but not those that launch a kernel (a GPU AdamW, e.g. a GPU tail updated from autograd's thread).
  torch's own ``Optimizer.step#...`` ranges, which the training thread opens around a step, never count.

torch.profiler records the host operators of other Python threads only with
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`` (SelectiveProfiler asks for
it where torch has it); without it the update is invisible and the section is ``None``. The update's time is the
union of its spans inside the window; the share *under backward* is the part inside the backward (each
``lgh/backward`` range stretched over the GPU work launched in it: the host launches the backward ahead of the GPU);
the *exposed* part is GPU idle time while it ran and no launching thread ran an operator (the GPU waited for the
update, not for launches), as :func:`lightning_gh.profiling.analysis.analyze` splits idle time. What the training
thread shows either way is its own wait for the update, a range named :data:`UPDATE_WAIT_RANGE` around each blocking
wait (:func:`update_wait_spans`): GPU idle time inside it counts as the update's too.

**The host link** is the ``Memcpy HtoD`` / ``Memcpy DtoH`` activity: count, bytes (Kineto's ``bytes`` argument),
summed time, busy time (union over streams), achieved GB/s over busy time, and that against the link's rate when
known (:func:`link_rate`). *Alone* time is link activity while no kernel runs. Each copy has an **owner**, from
the thread and the moment its launch was issued (:func:`copy_owner`).

**fp8 casts** are kernels that cast to or from float8, take amax or compute scales (not the fp8 GEMMs themselves),
as a share of kernel time.

Example::

    >>> from lightning_gh.profiling.offload_analysis import copy_direction, is_fp8_cast
    >>> copy_direction("Memcpy HtoD (Pinned -> Device)"), is_fp8_cast("triton_red_fused_abs_amax_0", "reduction")
    ('HtoD', True)
    >>> is_fp8_cast("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn", "gemm")
    False
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

from lightning_gh.profiling._intervals import Interval, intersect, length, subtract, union
from lightning_gh.profiling.trace import Event, KinetoTrace

__all__ = ["CPU_UPDATE_RANGE", "UPDATE_WAIT_RANGE", "ACTIVATION_RANGES", "HOST_GAP_US", "NOMINAL_LINK_GBPS",
           "LINK_DIRECTIONS", "OWNERS", "SMALL_COPY_BYTES",
           "copy_direction", "copy_owner", "cpu_update_spans", "fp8_section", "host_busy", "is_fp8_cast",
           "is_fp8_gemm", "link_rate", "main_threads", "update_wait_spans"]

#: The range name a CPU optimizer worker opens around each unit of update work (SuperOffload's bucket updates).
CPU_UPDATE_RANGE = "superoffload/cpu_update"
#: The range name the training thread opens around a blocking wait for a CPU update (SuperOffload's forward waits).
UPDATE_WAIT_RANGE = "superoffload/wait_for_update"
#: Range names activation offload opens around its copies to the host and back.
ACTIVATION_RANGES = ("activation_offload/offload", "activation_offload/prefetch")
LINK_DIRECTIONS = ("HtoD", "DtoH")
#: Who a host-link copy belongs to (see :func:`copy_owner`).
OWNERS = ("activations", "optimizer", "input", "other")
#: Copies smaller than this are not attributed to an owner by their phase alone.
SMALL_COPY_BYTES = 64 * 1024
#: Gaps shorter than this between a launching thread's host operators count as host work (Python between
#: operators), not as time the thread waited for something.
HOST_GAP_US = 100.0

#: Nominal per-direction host-link rates (GB/s) by GPU name, used only when nothing measured is given:
#: PCIe Gen5 x16 for Hopper PCIe/SXM boards, Gen4 x16 for Ampere and Ada, NVLink-C2C for Grace Hopper.
NOMINAL_LINK_GBPS: tuple[tuple[str, float, str], ...] = (
    ("GH200", 450.0, "NVLink-C2C"),
    ("GB200", 450.0, "NVLink-C2C"),
    ("H100", 64.0, "PCIe Gen5 x16"),
    ("H200", 64.0, "PCIe Gen5 x16"),
    ("H800", 64.0, "PCIe Gen5 x16"),
    ("A100", 32.0, "PCIe Gen4 x16"),
    ("A800", 32.0, "PCIe Gen4 x16"),
    ("L40", 32.0, "PCIe Gen4 x16"),
    ("L4", 32.0, "PCIe Gen4 x16"),
)

_DIRECTION_RE = re.compile(r"\b(HtoD|DtoH|DtoD|HtoH|PtoP)\b")
_UPDATE_RANGE_RE = re.compile(r"cpu_update", re.I)
_UPDATE_OP_RE = re.compile(r"cpu_update|cpu_?adam|heterogeneous_?adam|adamw", re.I)
_UPDATE_THREAD_RE = re.compile(r"superoffload|adamw|cpu_?adam", re.I)
_ACTIVATION_RE = re.compile(r"activation_offload|offload_activations|save_on_cpu", re.I)
_OPTIMIZER_RE = re.compile(r"superoffload|cpu_update", re.I)
_FP8_RE = re.compile(r"float8|fp8|f8e4m3|f8e5m2|e4m3|e5m2|amax|quantize|cast_transpose|compute_scale|"
                     r"scale_from_amax|delayed_scaling", re.I)
_FP8_GEMM_RE = re.compile(r"float8|fp8|e4m3|e5m2|_scaled_mm|scaled_gemm", re.I)

ThreadKey = tuple[Any, Any]


def copy_direction(name: str) -> str | None:
    """``HtoD`` / ``DtoH`` / ``DtoD`` / ``HtoH`` / ``PtoP`` from a memcpy's name, else ``None``."""
    m = _DIRECTION_RE.search(name)
    return m.group(1) if m else None


def is_fp8_cast(name: str, kind: str) -> bool:
    """Whether a kernel is fp8 overhead (cast, amax, scale), not an fp8 GEMM; ``kind`` from ``kernel_kind``."""
    return kind not in ("gemm", "attention") and bool(_FP8_RE.search(name))


def is_fp8_gemm(name: str, kind: str) -> bool:
    """Whether a GEMM kernel runs in fp8 (by its name)."""
    return kind == "gemm" and bool(_FP8_GEMM_RE.search(name))


# ---------------------------------------------------------------------------------------------- threads
def main_threads(trace: KinetoTrace) -> set[ThreadKey]:
    """The training loop's thread: the one marking ``ProfilerStep``, else the one issuing the most launches."""
    marked = {(s.pid, s.tid) for s in trace.steps if s.tid is not None}
    if marked:
        return marked
    counts: dict[ThreadKey, int] = defaultdict(int)
    for r in trace.runtime.values():
        counts[(r.pid, r.tid)] += 1
    return {max(counts, key=counts.get)} if counts else set()


def _host_events(trace: KinetoTrace) -> Iterable[Event]:
    yield from trace.annotations
    yield from trace.cpu_ops


def cpu_update_spans(trace: KinetoTrace) -> tuple[list[Interval], str | None, list[ThreadKey]]:
    """The CPU update's spans (merged), where they came from (``"ranges"`` / ``"operators"`` / ``None``) and the
    threads that ran them."""
    main = main_threads(trace)
    off_main = [e for e in _host_events(trace) if (e.pid, e.tid) not in main and not e.name.startswith("Optimizer.")]
    picked = [e for e in off_main if e.kind == "annotation" and _UPDATE_RANGE_RE.search(e.name)]
    source = "ranges"
    if not picked:
        named = {k for k, n in trace.thread_names.items() if k not in main and _UPDATE_THREAD_RE.search(n)}
        launches: dict[ThreadKey, list[float]] = defaultdict(list)
        for r in trace.runtime.values():
            if "Launch" in r.name:
                launches[(r.pid, r.tid)].append(r.ts)
        for ts in launches.values():
            ts.sort()

        def launches_kernel(e: Event) -> bool:  # a GPU optimizer (a GPU tail's fused AdamW) is not a CPU update
            ts = launches.get((e.pid, e.tid), [])
            i = bisect.bisect_left(ts, e.ts)
            return i < len(ts) and ts[i] <= e.end

        picked = [e for e in off_main if (_UPDATE_OP_RE.search(e.name) or (e.pid, e.tid) in named)
                  and not launches_kernel(e)]
        source = "operators"
    if not picked:
        return [], None, []
    threads = sorted({(e.pid, e.tid) for e in picked}, key=str)
    return union((e.ts, e.end) for e in picked), source, threads


def update_wait_spans(trace: KinetoTrace) -> list[Interval]:
    """The spans (merged) in which a thread waited for a CPU update: :data:`UPDATE_WAIT_RANGE` ranges."""
    return union((e.ts, e.end) for e in trace.annotations if e.name == UPDATE_WAIT_RANGE)


def host_busy(trace: KinetoTrace, exclude: Iterable[ThreadKey]) -> list[Interval]:
    """When a thread that launches GPU work (the training loop, autograd's) is inside a host operator, or between
    two less than :data:`HOST_GAP_US` apart."""
    skip = set(exclude)
    launching = ({(r.pid, r.tid) for r in trace.runtime.values()} | main_threads(trace)) - skip
    by_thread: dict[ThreadKey, list[Interval]] = defaultdict(list)
    for e in trace.cpu_ops:
        if (e.pid, e.tid) in launching:
            by_thread[(e.pid, e.tid)].append((e.ts, e.end))
    out: list[Interval] = []
    for ops in by_thread.values():
        closed: list[Interval] = []
        for a, b in union(ops):  # Python between two operators is still the thread working: close short gaps
            if closed and a - closed[-1][1] <= HOST_GAP_US:
                closed[-1] = (closed[-1][0], b)
            else:
                closed.append((a, b))
        out += closed
    return union(out)


# ---------------------------------------------------------------------------------------------- copies
def _tagged_ranges(trace: KinetoTrace) -> dict[ThreadKey, tuple[list[float], list[tuple[float, float, str]]]]:
    """Per thread, the ranges that name a copy's owner: (starts, [(start, end, owner)])."""
    by_thread: dict[ThreadKey, list[tuple[float, float, str]]] = defaultdict(list)
    for e in _host_events(trace):
        if e.name.startswith("Optimizer."):  # torch's range around any optimizer's step names its class
            continue
        owner = ("activations" if _ACTIVATION_RE.search(e.name) else
                 "optimizer" if _OPTIMIZER_RE.search(e.name) else None)
        if owner:
            by_thread[(e.pid, e.tid)].append((e.ts, e.end, owner))
    out = {}
    for k, rows in by_thread.items():
        rows.sort()
        out[k] = ([a for a, _, _ in rows], rows)
    return out


def copy_owner(direction: str, phase: str | None, update_thread: bool = False, tagged: str | None = None,
               nbytes: int | None = None, pageable: bool = False) -> str:
    """Who a host-link copy belongs to: ``activations``, ``optimizer``, ``input`` or ``other``.

    Args:
        direction: ``HtoD`` or ``DtoH``.
        phase: the ``lgh/`` phase its launch was issued in, if any (``None`` also when the trace lost the launch).
        update_thread: the launch came from a CPU-update thread (SuperOffload streams weights back from there).
        tagged: the owner named by a range around the launch (:data:`ACTIVATION_RANGES`, :data:`CPU_UPDATE_RANGE`
            and other ``superoffload/`` ranges), which wins.
        nbytes: its size; pageable: whether the host side is pageable memory.

    Without such a range, the phase decides: activations go to the host during ``forward`` and come back during
    ``backward``; gradients go to the host during ``backward``/``optimizer`` and weights come back during
    ``optimizer``; the batch comes to the GPU during ``data_wait``. Copies to or from pageable memory or smaller
    than :data:`SMALL_COPY_BYTES` (``.item()``, ``.cpu()`` of a loss, a scalar) are ``other`` unless a range
    names them: offloads use pinned buffers of whole tensors.

    >>> copy_owner("DtoH", "forward", nbytes=2**24), copy_owner("HtoD", "backward", update_thread=True)
    ('activations', 'optimizer')
    >>> copy_owner("DtoH", "forward", nbytes=4, pageable=True)  # a loss.item()
    'other'
    """
    if tagged:
        return tagged
    if update_thread:
        return "optimizer"
    if phase is None or pageable or (nbytes is not None and nbytes < SMALL_COPY_BYTES):
        return "other"
    if direction == "DtoH":
        return {"forward": "activations", "backward": "optimizer", "optimizer": "optimizer"}.get(phase, "other")
    return {"backward": "activations", "optimizer": "optimizer", "data_wait": "input"}.get(phase, "other")


def _owner_of(e: Event, trace: KinetoTrace, tagged: Mapping[ThreadKey, tuple[list[float], list]],
              phase_of: Callable[[float], str | None], update_threads: set[ThreadKey]) -> str:
    launch = trace.runtime.get(e.correlation) if e.correlation is not None else None
    tag = None
    if launch is not None and (launch.pid, launch.tid) in tagged:
        starts, rows = tagged[(launch.pid, launch.tid)]
        i = bisect.bisect_right(starts, launch.ts) - 1
        for j in range(i, max(i - 8, -1), -1):
            a, b, owner = rows[j]
            if a <= launch.ts <= b:
                tag = owner
                break
    return copy_owner(copy_direction(e.name) or "", phase_of(launch.ts) if launch else None,
                      launch is not None and (launch.pid, launch.tid) in update_threads, tag,
                      int(e.args.get("bytes", 0) or 0), "Pageable" in e.name)


def link_copies(trace: KinetoTrace, phase_of: Callable[[float], str | None],
                update_threads: Iterable[ThreadKey]) -> list[tuple[Event, str, str]]:
    """The window's host-link copies as ``(event, direction, owner)``."""
    tagged = _tagged_ranges(trace)
    upd = set(update_threads)
    out = []
    for e in trace.memcpys:
        d = copy_direction(e.name)
        if d in LINK_DIRECTIONS:
            out.append((e, d, _owner_of(e, trace, tagged, phase_of, upd)))
    return out


def link_rate(trace: KinetoTrace, context: Mapping[str, Any] | None) -> tuple[dict[str, float] | None, str | None]:
    """The link's per-direction rate in GB/s and where it came from, or ``(None, None)``.

    In order: ``context["link"]`` (``{"h2d_gbps": ..., "d2h_gbps": ...}``, e.g. from
    :func:`lightning_gh.hardware.link_bandwidth`), the trace's ``lgh_link`` metadata (same keys), then the nominal
    rate of the GPU named in the trace's ``deviceProperties`` (:data:`NOMINAL_LINK_GBPS`)."""
    for src, where in (((context or {}).get("link"), "measured (context)"),
                       (trace.metadata.get("lgh_link"), "measured (trace metadata)")):
        if isinstance(src, Mapping):
            h2d, d2h = src.get("h2d_gbps"), src.get("d2h_gbps")
            if isinstance(h2d, (int, float)) and isinstance(d2h, (int, float)) and h2d > 0 and d2h > 0:
                return {"HtoD": float(h2d), "DtoH": float(d2h)}, where
    props = trace.metadata.get("deviceProperties")
    names = [str(p.get("name", "")) for p in props if isinstance(p, Mapping)] if isinstance(props, list) else []
    for name in names:
        for key, gbps, link in NOMINAL_LINK_GBPS:
            if key in name:
                return {"HtoD": gbps, "DtoH": gbps}, f"nominal {link} ({name})"
    return None, None


def _ms(us: float) -> float:
    return round(us / 1e3, 6)


def _share(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole > 0 else 0.0


def link_section(copies: list[tuple[Event, str, str]], clip_window: Callable[[list[Interval]], list[Interval]],
                 kernels_u: list[Interval], window_us: float, n_steps: int,
                 rate: dict[str, float] | None, rate_source: str | None) -> dict[str, Any] | None:
    """The host link per direction and per owner (see the module docstring); ``None`` without link copies."""
    if not copies:
        return None
    out: dict[str, Any] = {"rate_source": rate_source}
    for d in LINK_DIRECTIONS:
        events = [e for e, dd, _ in copies if dd == d]
        if not events:
            out[d] = None
            continue
        busy = length(clip_window(union((e.ts, e.end) for e in events)))
        nbytes = sum(int(e.args.get("bytes", 0) or 0) for e in events)
        gbps = round(nbytes / (busy * 1e3), 3) if busy > 0 and nbytes else None
        r = (rate or {}).get(d)
        out[d] = {"count": len(events), "bytes": nbytes, "bytes_per_step": nbytes // max(n_steps, 1),
                  "time_ms": _ms(sum(e.dur for e in events)), "busy_ms": _ms(busy), "gbps": gbps,
                  "rate_gbps": r, "utilization": round(gbps / r, 4) if gbps and r else None,
                  "pageable_bytes": sum(int(e.args.get("bytes", 0) or 0) for e in events if "Pageable" in e.name)}
    all_u = clip_window(union((e.ts, e.end) for e, _, _ in copies))
    out["alone_share"] = _share(length(subtract(all_u, kernels_u)), window_us)
    owners: dict[str, Any] = {}
    for owner in OWNERS:
        mine = [(e, d) for e, d, o in copies if o == owner]
        if not mine:
            continue
        u = clip_window(union((e.ts, e.end) for e, _ in mine))
        owners[owner] = {d: sum(int(e.args.get("bytes", 0) or 0) for e, dd in mine if dd == d) for d in LINK_DIRECTIONS}
        owners[owner]["busy_ms"] = _ms(length(u))
        owners[owner]["alone_share"] = _share(length(subtract(u, kernels_u)), window_us)
    out["owners"] = owners
    return out


def activation_section(copies: list[tuple[Event, str, str]], clip_window: Callable[[list[Interval]], list[Interval]],
                       compute_u: list[Interval], window_us: float) -> dict[str, Any] | None:
    """Activation-offload copies each way and how much of their time ran under compute kernels."""
    mine = [(e, d) for e, d, o in copies if o == "activations"]
    if not mine:
        return None
    out: dict[str, Any] = {}
    for d, label in (("DtoH", "offload"), ("HtoD", "prefetch")):
        events = [e for e, dd in mine if dd == d]
        out[label] = {"count": len(events), "bytes": sum(int(e.args.get("bytes", 0) or 0) for e in events),
                      "time_ms": _ms(sum(e.dur for e in events))}
    u = clip_window(union((e.ts, e.end) for e, _ in mine))
    t = length(u)
    out["busy_ms"] = _ms(t)
    out["overlap_fraction"] = _share(length(intersect(u, compute_u)), t)
    out["alone_share"] = _share(length(subtract(u, compute_u)), window_us)
    return out


def cpu_update_section(spans_u: list[Interval], source: str | None, threads: list[ThreadKey],
                       trace: KinetoTrace, backward_u: list[Interval] | None, compute_u: list[Interval],
                       exposed_us: float, window_us: float, n_steps: int) -> dict[str, Any] | None:
    """The CPU update's time, where it ran and how much of it the GPU waited for (``spans_u`` inside the window)."""
    t = length(spans_u)
    if source is None or t <= 0:
        return None
    return {
        "source": source,
        "threads": [trace.thread_names.get(k) or f"pid {k[0]} tid {k[1]}" for k in threads],
        "time_ms": _ms(t),
        "per_step_ms": _ms(t / max(n_steps, 1)),
        "share": _share(t, window_us),
        "under_backward_fraction": None if backward_u is None else _share(length(intersect(spans_u, backward_u)), t),
        "under_gpu_compute_fraction": _share(length(intersect(spans_u, compute_u)), t),
        "exposed_ms": _ms(exposed_us),
        "exposed_share": _share(exposed_us, window_us),
    }


def fp8_section(kernels: list[Event], kind_of: Callable[[str], str], kernel_us: float) -> dict[str, Any] | None:
    """fp8 overhead (casts, amax, scales) and fp8 GEMMs as shares of kernel time; ``None`` without either."""
    casts: dict[str, float] = defaultdict(float)
    count, gemm_us = 0, 0.0
    for k in kernels:
        kind = kind_of(k.name)
        if is_fp8_cast(k.name, kind):
            casts[k.name] += k.dur
            count += 1
        elif is_fp8_gemm(k.name, kind):
            gemm_us += k.dur
    if not casts and gemm_us == 0:
        return None
    cast_us = sum(casts.values())
    top = sorted(casts.items(), key=lambda kv: -kv[1])[:3]
    return {"cast_kernels": count, "cast_time_ms": _ms(cast_us), "cast_share": _share(cast_us, kernel_us),
            "gemm_share": _share(gemm_us, kernel_us),
            "top_casts": [{"name": n, "share": _share(v, kernel_us)} for n, v in top]}
