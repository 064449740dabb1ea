"""lightning-gh: drop-in PyTorch Lightning callbacks and plugins for fast, observable LLM training on
NVIDIA Hopper (H100, H200) and Grace Hopper (GH200).

Optional packages (nvtx, torchao, Transformer Engine) are imported only by the parts that use them.
"""

from lightning_gh import hardware
from lightning_gh.graphs import CUDAGraphCapture, GraphCaptureError, GraphReport
from lightning_gh.hardware import HardwareInfo
from lightning_gh.precision import FP8UnavailableError, LayerFilter, export_bf16_state_dict, list_precisions, precision
from lightning_gh.profiling.nvtx import NVTXRangeCallback

__version__ = "0.1.0.dev0"

__all__ = [
    "CUDAGraphCapture",
    "FP8UnavailableError",
    "GraphCaptureError",
    "GraphReport",
    "HardwareInfo",
    "LayerFilter",
    "NVTXRangeCallback",
    "__version__",
    "export_bf16_state_dict",
    "hardware",
    "list_precisions",
    "precision",
]
