"""lightning-gh: drop-in PyTorch Lightning callbacks and plugins for fast, observable LLM training on
NVIDIA Hopper (H100, H200) and Grace Hopper (GH200).

Optional packages (nvtx, torchao, Transformer Engine) are imported only by the parts that use them.
"""

from lightning_gh import hardware
from lightning_gh.graphs import CUDAGraphCapture, GraphCaptureError, GraphReport
from lightning_gh.hardware import HardwareInfo
from lightning_gh.precision import FP8UnavailableError, LayerFilter, export_bf16_state_dict, list_precisions, precision
from lightning_gh.offload import ActivationOffload, HostMemoryError, offload_activations
from lightning_gh.offload.strategy import SuperOffloadStrategy  # registers Trainer(strategy="superoffload")
from lightning_gh.offload.superoffload import HeterogeneousAdamW
from lightning_gh.profiling.nvtx import NVTXRangeCallback
from lightning_gh.profiling.profiler import SelectiveProfiler
from lightning_gh.profiling.stall import DataStallDetector
from lightning_gh.profiling.summary import summarize_trace

__version__ = "0.1.0.dev0"

__all__ = [
    "ActivationOffload",
    "CUDAGraphCapture",
    "DataStallDetector",
    "FP8UnavailableError",
    "GraphCaptureError",
    "GraphReport",
    "HardwareInfo",
    "HeterogeneousAdamW",
    "HostMemoryError",
    "LayerFilter",
    "NVTXRangeCallback",
    "SelectiveProfiler",
    "SuperOffloadStrategy",
    "__version__",
    "export_bf16_state_dict",
    "hardware",
    "list_precisions",
    "offload_activations",
    "precision",
    "summarize_trace",
]
