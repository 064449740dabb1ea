"""Reading Kineto traces: the chrome-trace JSON that ``torch.profiler`` (and anything built on Kineto) writes.

This module only parses; it makes no judgement about the numbers (that is :mod:`lightning_gh.profiling.summary`),
the way Holistic Trace Analysis keeps its parser apart from its analyses. It reads any Kineto trace, gzip or
not, ours or someone else's: a ``{"traceEvents": [...]}`` object or a bare list of events, with the category
names of recent Kineto (``kernel``, ``gpu_memcpy``, ``cuda_runtime`` ...) or of older releases (``Kernel``,
``Memcpy``, ``Runtime`` ...).

Times stay in microseconds, as in the file.

Example::

    >>> from lightning_gh.profiling.trace import parse_trace
    >>> t = parse_trace({"traceEvents": [
    ...     {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
    ...     {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2, "dur": 5, "pid": 0, "tid": 7,
    ...      "args": {"stream": 7, "correlation": 1}}]})
    >>> [s.number for s in t.steps], [k.name for k in t.kernels]
    ([3], ['gemm'])
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["Event", "Step", "KinetoTrace", "load_trace", "parse_trace", "trace_files", "STEP_RE"]

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")

# Kineto category -> our kind. Old releases capitalised some categories; ROCm traces use the same names.
_KINDS = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "runtime": "runtime",
    "user_annotation": "annotation",
    "gpu_user_annotation": "gpu_annotation",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "python_function": "python",
}


@dataclass(frozen=True)
class Event:
    """One complete (``"ph": "X"``) event. ``ts`` and ``dur`` are in microseconds."""

    name: str
    kind: str
    ts: float
    dur: float
    pid: Any = None
    tid: Any = None
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def correlation(self) -> int | None:
        c = self.args.get("correlation")
        return int(c) if isinstance(c, (int, float)) else None


@dataclass(frozen=True)
class Step:
    """A ``ProfilerStep#<number>`` span on the host (``number`` is ``None`` for a whole-trace span); ``pid`` and
    ``tid`` name the thread that marked it (the training loop's)."""

    number: int | None
    ts: float
    dur: float
    pid: Any = None
    tid: Any = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class KinetoTrace:
    """The parsed events of one trace, grouped by what they are.

    Attributes:
        path: the file it came from (``None`` when parsed from memory).
        metadata: the top-level keys other than ``traceEvents`` (``distributedInfo``, ``deviceProperties``, ...).
        steps: host ``ProfilerStep#n`` spans, sorted by start; empty when the trace has none.
        kernels / memcpys / memsets: GPU activity, sorted by start.
        runtime: CUDA runtime and driver calls (launches, copies, syncs) by correlation id.
        annotations: host ``record_function`` ranges (``ProfilerStep#n`` excluded).
        cpu_ops: host operators (``aten::mm`` ...).
        bounds: (first start, last end) over every complete event, in microseconds.
        thread_names: ``(pid, tid) -> name`` from the trace's ``thread_name`` metadata events (Kineto names host
            threads ``"thread <tid> (python)"``, not by their Python name).
    """

    path: Path | None
    metadata: dict[str, Any]
    steps: list[Step]
    kernels: list[Event]
    memcpys: list[Event]
    memsets: list[Event]
    runtime: dict[int, Event]
    annotations: list[Event]
    cpu_ops: list[Event]
    bounds: tuple[float, float] | None
    thread_names: dict[tuple[Any, Any], str] = field(default_factory=dict)

    @property
    def gpu_events(self) -> list[Event]:
        """Kernels, copies and memsets together, sorted by start."""
        return sorted(self.kernels + self.memcpys + self.memsets, key=lambda e: e.ts)

    @property
    def rank(self) -> int | None:
        info = self.metadata.get("distributedInfo")
        if isinstance(info, Mapping) and isinstance(info.get("rank"), int):
            return info["rank"]
        return None

    @property
    def has_gpu(self) -> bool:
        return bool(self.kernels or self.memcpys or self.memsets)


def load_trace(path: str | os.PathLike) -> KinetoTrace:
    """Read a Kineto trace file (``.json`` or ``.json.gz``).

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a folder (see :func:`trace_files` for the traces inside one).
        ValueError: the file is empty, not JSON, not a chrome trace, holds no events, or holds an event with a
            negative duration (see :func:`parse_trace`).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a folder, not a trace file; give the traces in it "
                                "(*.pt.trace.json.gz, *.json)")
    if not path.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    if path.stat().st_size == 0:
        raise ValueError(f"{str(path)!r} is empty (0 bytes): no events")
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, OSError) as e:
        raise ValueError(f"{str(path)!r} is not a Kineto trace: not a readable JSON chrome trace ({e})") from e
    return parse_trace(obj, path=path)


def trace_files(folder: str | os.PathLike) -> list[Path]:
    """The Kineto traces under ``folder`` (recursively), sorted: ``*.json`` and ``*.json.gz`` but summaries."""
    root = Path(folder)
    found = [p for pattern in ("*.json", "*.json.gz") for p in root.rglob(pattern)
             if p.is_file() and ".summary." not in p.name]
    return sorted(set(found))


def parse_trace(obj: Mapping[str, Any] | list[Any], path: Path | None = None) -> KinetoTrace:
    """Group the events of a loaded chrome-trace object (see :func:`load_trace`).

    Raises:
        ValueError: ``obj`` is not a chrome trace ("not a Kineto trace"), holds no complete (``"ph": "X"``) events
            ("no events"), or holds a complete event with a negative duration.
    """
    where = f"{str(path)!r}" if path else "the trace"
    if isinstance(obj, list):
        raw, metadata = obj, {}
    elif isinstance(obj, Mapping) and isinstance(obj.get("traceEvents"), list):
        raw = obj["traceEvents"]
        metadata = {k: v for k, v in obj.items() if k != "traceEvents"}
    else:
        raise ValueError(f"{where} is not a Kineto trace: not a chrome trace, expected a list of events or an object "
                         "with 'traceEvents'")
    if raw and not any(isinstance(r, Mapping) and "ph" in r for r in raw):
        raise ValueError(f"{where} is not a Kineto trace: none of its {len(raw)} entries is a trace event (an object "
                         "with 'ph', 'ts')")
    events = list(_complete_events(raw))
    if not events:
        raise ValueError(f"{where} has no events: no complete ('ph': 'X') event among its {len(raw)} entries")
    negative = [e for e in events if e.dur < 0]
    if negative:
        e = negative[0]
        raise ValueError(f"{where} is not a valid Kineto trace: {len(negative)} event(s) with a negative duration, "
                         f"e.g. {e.name!r} at ts={e.ts:g} us with dur={e.dur:g} us")
    steps: list[Step] = []
    kernels: list[Event] = []
    memcpys: list[Event] = []
    memsets: list[Event] = []
    runtime: dict[int, Event] = {}
    annotations: list[Event] = []
    cpu_ops: list[Event] = []
    lo, hi = float("inf"), float("-inf")
    for e in events:
        lo, hi = min(lo, e.ts), max(hi, e.end)
        if e.kind == "kernel":
            kernels.append(e)
        elif e.kind == "memcpy":
            memcpys.append(e)
        elif e.kind == "memset":
            memsets.append(e)
        elif e.kind == "runtime":
            c = e.correlation
            if c is not None:
                runtime[c] = e
        elif e.kind == "annotation":
            m = STEP_RE.match(e.name)
            if m:
                steps.append(Step(int(m.group(1)), e.ts, e.dur, e.pid, e.tid))
            else:
                annotations.append(e)
        elif e.kind == "cpu_op":
            cpu_ops.append(e)
    for group in (kernels, memcpys, memsets, annotations, cpu_ops):
        group.sort(key=lambda e: e.ts)
    steps.sort(key=lambda s: s.ts)
    return KinetoTrace(path, metadata, steps, kernels, memcpys, memsets, runtime, annotations, cpu_ops,
                       (lo, hi) if lo <= hi else None, _thread_names(raw))


def _thread_names(raw: Iterable[Any]) -> dict[tuple[Any, Any], str]:
    out = {}
    for r in raw:
        if isinstance(r, Mapping) and r.get("ph") == "M" and r.get("name") == "thread_name":
            args = r.get("args")
            if isinstance(args, Mapping) and isinstance(args.get("name"), str):
                out[(r.get("pid"), r.get("tid"))] = args["name"]
    return out


def _complete_events(raw: Iterable[Any]) -> Iterable[Event]:
    for r in raw:
        if not isinstance(r, Mapping) or r.get("ph") != "X":
            continue
        try:
            ts, dur = float(r["ts"]), float(r.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        cat = str(r.get("cat", "")).lower()
        kind = _KINDS.get(cat, "other")
        args = r.get("args") if isinstance(r.get("args"), Mapping) else {}
        yield Event(str(r.get("name", "")), kind, ts, dur, r.get("pid"), r.get("tid"), args)
