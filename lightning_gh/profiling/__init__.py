"""Profiling: step windows, SelectiveProfiler, NVTXRangeCallback, the trace summary and the data-loader stall detector.

Modules, one idea each: ``options`` (the parts' options dataclasses), ``windows`` (step and rank grammar),
``phases`` (the step-phase tracker), ``_actions`` (watching Lightning's profiler actions), ``profiler`` and
``_profiler_backends`` (SelectiveProfiler), ``nvtx`` and ``_nvtx_backend`` (NVTXRangeCallback), ``stall`` (DataStallDetector), ``trace`` (parsing Kineto traces), ``analysis`` (numbers),
``advice`` (verdict, advice and the one definition of a data stall), ``render`` and ``plot`` (files),
``summary`` (``summarize_trace``, the entry point), ``throughput`` (ThroughputMonitor: tokens/s, TFLOP/s, MFU).

Names load on first use (PEP 562): importing this package alone does not import the profiler, the summary or NVTX.

Example::

    import lightning as L
    from lightning_gh.profiling import DataStallDetector, SelectiveProfiler, summarize_trace

    trainer = L.Trainer(callbacks=[SelectiveProfiler(steps="20-24", ranks="0"), DataStallDetector()])
    trainer.fit(model, datamodule)
    summarize_trace("some_other_run.pt.trace.json.gz")   # any Kineto trace -> .summary.{json,md,png}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gh.profiling.nvtx import NVTXRangeCallback
    from lightning_gh.profiling.options import NVTXOptions, ProfilerOptions, StallOptions
    from lightning_gh.profiling.profiler import SelectiveProfiler
    from lightning_gh.profiling.stall import DataStallDetector, DataStallWarning
    from lightning_gh.profiling.summary import summarize_trace
    from lightning_gh.profiling.throughput import ThroughputMonitor, ThroughputOptions
    from lightning_gh.profiling.windows import RankSelection, StepSchedule, StepWindow

__all__ = ["NVTXRangeCallback", "SelectiveProfiler", "DataStallDetector", "DataStallWarning", "summarize_trace",
           "StepSchedule", "StepWindow", "RankSelection", "ProfilerOptions", "NVTXOptions", "StallOptions",
           "ThroughputMonitor", "ThroughputOptions"]

_WHERE = {
    "NVTXRangeCallback": "lightning_gh.profiling.nvtx",
    "SelectiveProfiler": "lightning_gh.profiling.profiler",
    "DataStallDetector": "lightning_gh.profiling.stall",
    "DataStallWarning": "lightning_gh.profiling.stall",
    "summarize_trace": "lightning_gh.profiling.summary",
    "StepSchedule": "lightning_gh.profiling.windows",
    "StepWindow": "lightning_gh.profiling.windows",
    "RankSelection": "lightning_gh.profiling.windows",
    "ProfilerOptions": "lightning_gh.profiling.options",
    "NVTXOptions": "lightning_gh.profiling.options",
    "StallOptions": "lightning_gh.profiling.options",
    "ThroughputMonitor": "lightning_gh.profiling.throughput",
    "ThroughputOptions": "lightning_gh.profiling.throughput",
}
assert sorted(_WHERE) == sorted(__all__)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_gh.profiling' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
