"""Whole-step CUDA graphs for Lightning: :class:`CUDAGraphCapture` captures the training step once and replays it.

Modules: ``capture`` (the callback and its report), ``optim`` (capturable optimizer state, in-place restore),
``buffers`` (static inputs, batch signatures), ``logs`` (replaying ``self.log``), ``detect`` (what cannot be
captured, and where), ``part`` (the demo's Part factory). Lightning internals are touched only in ``_lightning``.
"""

from lightning_gh.graphs.capture import CUDAGraphCapture, GraphCaptureError, GraphReport
from lightning_gh.graphs.optim import make_capturable

__all__ = ["CUDAGraphCapture", "GraphCaptureError", "GraphReport", "make_capturable"]
