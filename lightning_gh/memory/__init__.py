"""Where the memory of a run goes: the memory plan before the first step, and a report when a step runs out of
memory (:class:`MemoryReport`); the pure pieces in :mod:`.plan` and :mod:`.oom`."""

from lightning_gh.memory.callback import MemoryReport, MemoryReportOptions
from lightning_gh.memory.oom import Knob, Shortfall, parse_cuda_oom, step_shortfall, suggest
from lightning_gh.memory.plan import MemoryPlan, attribute

__all__ = ["Knob", "MemoryPlan", "MemoryReport", "MemoryReportOptions", "Shortfall", "attribute", "parse_cuda_oom",
           "step_shortfall", "suggest"]
