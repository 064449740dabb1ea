"""lightning-gh: drop-in PyTorch Lightning callbacks and plugins for fast, observable LLM training on
NVIDIA Hopper (H100, H200) and Grace Hopper (GH200).

Every name below loads on first use (PEP 562), so ``import lightning_gh`` is cheap and a command that only
reads a trace never imports torch. Optional packages (nvtx, torchao, Transformer Engine, transformers) are
imported only by the parts that use them. ``Trainer(strategy="superoffload")`` works after ``import lightning_gh``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gh import _strategies

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from lightning_gh import compat, hardware, unified
    from lightning_gh._host import HostMemoryError
    from lightning_gh.activation_offload import (
        ActivationOffload,
        ActivationOffloadOptions,
        LeanLoss,
        lean_causal_lm_loss,
        offload_activations,
    )
    from lightning_gh.graphs import CUDAGraphCapture, GraphCaptureError, GraphCaptureOptions, GraphReport, GraphState
    from lightning_gh.hardware import HardwareInfo
    from lightning_gh.kv import GenerationCallback, KVOffloadOptions, OffloadedKVCache
    from lightning_gh.memory import MemoryReport, MemoryReportOptions
    from lightning_gh.precision import (
        Float8Options,
        Float8Precision,
        FP8UnavailableError,
        LayerFilter,
        TEOptions,
        export_bf16_state_dict,
        keep_causal_sdpa,
        list_precisions,
        precision,
    )
    from lightning_gh.profiling.nvtx import NVTXRangeCallback
    from lightning_gh.profiling.options import NVTXOptions, ProfilerOptions, StallOptions
    from lightning_gh.profiling.profiler import SelectiveProfiler
    from lightning_gh.profiling.stall import DataStallDetector
    from lightning_gh.profiling.summary import summarize_trace
    from lightning_gh.profiling.throughput import ThroughputMonitor, ThroughputOptions
    from lightning_gh.superoffload import (
        HeterogeneousAdamW,
        ShardedHostAdamW,
        SuperOffloadFSDPStrategy,
        SuperOffloadOptions,
        SuperOffloadStrategy,
    )
    from lightning_gh.unified import (
        ManagedMemoryError,
        ManagedMemoryOptions,
        ManagedMemoryUnavailable,
        ManagedOptimizerState,
        managed_memory,
    )

# public name -> the module that defines it (a module itself where the name is the module)
_WHERE: dict[str, str] = {
    "ActivationOffload": "lightning_gh.activation_offload",
    "LeanLoss": "lightning_gh.activation_offload",
    "keep_causal_sdpa": "lightning_gh.precision",
    "lean_causal_lm_loss": "lightning_gh.activation_offload",
    "ActivationOffloadOptions": "lightning_gh.activation_offload",
    "offload_activations": "lightning_gh.activation_offload",
    "CUDAGraphCapture": "lightning_gh.graphs",
    "GraphCaptureError": "lightning_gh.graphs",
    "GraphReport": "lightning_gh.graphs",
    "GraphCaptureOptions": "lightning_gh.graphs",
    "GraphState": "lightning_gh.graphs",
    "NVTXOptions": "lightning_gh.profiling.options",
    "ProfilerOptions": "lightning_gh.profiling.options",
    "StallOptions": "lightning_gh.profiling.options",
    "ThroughputMonitor": "lightning_gh.profiling.throughput",
    "ThroughputOptions": "lightning_gh.profiling.throughput",
    "DataStallDetector": "lightning_gh.profiling.stall",
    "NVTXRangeCallback": "lightning_gh.profiling.nvtx",
    "SelectiveProfiler": "lightning_gh.profiling.profiler",
    "summarize_trace": "lightning_gh.profiling.summary",
    "FP8UnavailableError": "lightning_gh.precision",
    "Float8Options": "lightning_gh.precision",
    "Float8Precision": "lightning_gh.precision",
    "LayerFilter": "lightning_gh.precision",
    "TEOptions": "lightning_gh.precision",
    "export_bf16_state_dict": "lightning_gh.precision",
    "list_precisions": "lightning_gh.precision",
    "precision": "lightning_gh.precision",
    "HardwareInfo": "lightning_gh.hardware",
    "HeterogeneousAdamW": "lightning_gh.superoffload",
    "SuperOffloadOptions": "lightning_gh.superoffload",
    "SuperOffloadStrategy": "lightning_gh.superoffload",
    "SuperOffloadFSDPStrategy": "lightning_gh.superoffload",
    "ShardedHostAdamW": "lightning_gh.superoffload",
    "HostMemoryError": "lightning_gh._host",
    "MemoryReport": "lightning_gh.memory",
    "MemoryReportOptions": "lightning_gh.memory",
    "GenerationCallback": "lightning_gh.kv",
    "KVOffloadOptions": "lightning_gh.kv",
    "OffloadedKVCache": "lightning_gh.kv",
    "ManagedMemoryError": "lightning_gh.unified",
    "ManagedMemoryOptions": "lightning_gh.unified",
    "ManagedMemoryUnavailable": "lightning_gh.unified",
    "ManagedOptimizerState": "lightning_gh.unified",
    "managed_memory": "lightning_gh.unified",
}
_MODULES = ("compat", "hardware", "unified")

__all__ = sorted([*_WHERE, *_MODULES, "__version__"])

_strategies.install()


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(f"lightning_gh.{name}")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'lightning_gh' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
