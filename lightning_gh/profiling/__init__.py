"""Profiling: step windows, SelectiveProfiler, the trace summary and the data-loader stall detector.

Example::

    import lightning as L
    from lightning_gh.profiling import DataStallDetector, SelectiveProfiler, summarize_trace

    trainer = L.Trainer(callbacks=[SelectiveProfiler(steps="20-24", ranks="0"), DataStallDetector()])
    trainer.fit(model, datamodule)
    summarize_trace("some_other_run.pt.trace.json.gz")   # any Kineto trace -> .summary.{json,md,png}
"""

from lightning_gh.profiling.profiler import SelectiveProfiler
from lightning_gh.profiling.stall import DataStallDetector, DataStallWarning
from lightning_gh.profiling.summary import summarize_trace
from lightning_gh.profiling.windows import RankSelection, StepSchedule, StepWindow

__all__ = [
    "SelectiveProfiler",
    "DataStallDetector",
    "DataStallWarning",
    "summarize_trace",
    "StepSchedule",
    "StepWindow",
    "RankSelection",
]
