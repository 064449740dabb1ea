"""Whole-step CUDA graphs for Lightning: :class:`CUDAGraphCapture` captures the training step once and replays it.

Modules: ``capture`` (the callback), ``options`` (its options), ``report`` (its states and report), ``optim`` (capturable optimizer state, in-place restore),
``buffers`` (static inputs, batch signatures), ``logs`` (replaying ``self.log``), ``detect`` (what cannot be
captured, and where), ``hf`` (transformers models train without their KV cache). Lightning internals are touched
only through :mod:`lightning_gh._lightning`; which parts may share the Trainer is decided by :mod:`lightning_gh.compat`.
"""

from lightning_gh.graphs.capture import CUDAGraphCapture, GraphCaptureError
from lightning_gh.graphs.optim import make_capturable
from lightning_gh.graphs.options import GraphCaptureOptions
from lightning_gh.graphs.report import GraphReport, GraphState

__all__ = ["CUDAGraphCapture", "GraphCaptureError", "GraphCaptureOptions", "GraphReport", "GraphState",
           "make_capturable"]
