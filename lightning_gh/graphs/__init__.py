"""Whole-step CUDA graphs for Lightning: :class:`CUDAGraphCapture` captures the training step once and replays it.

Modules: ``capture`` (the callback and its report), ``optim`` (capturable optimizer state, in-place restore),
``buffers`` (static inputs, batch signatures), ``logs`` (replaying ``self.log``), ``detect`` (what cannot be
captured, and where), ``hf`` (transformers models train without their KV cache). Lightning internals are touched
only through :mod:`lightning_gh._lightning`; which parts may share the Trainer is decided by :mod:`lightning_gh.compat`.
"""

from lightning_gh.graphs.capture import CUDAGraphCapture, GraphCaptureError, GraphReport
from lightning_gh.graphs.optim import make_capturable

__all__ = ["CUDAGraphCapture", "GraphCaptureError", "GraphReport", "make_capturable"]
