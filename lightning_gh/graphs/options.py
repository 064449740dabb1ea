"""CUDAGraphCapture's options: one frozen, validated dataclass.

Each field is documented once, here, with its default; :class:`~lightning_gh.graphs.CUDAGraphCapture` takes either
``options=`` or the same names as keyword arguments (see :func:`lightning_gh._options.resolve`). A bad value fails at
construction, naming the argument, the value and what is allowed: ``TypeError`` for a wrong type, ``ValueError``
for a value out of range.

Example::

    >>> from lightning_gh.graphs.options import GraphCaptureOptions
    >>> GraphCaptureOptions(warmup_steps=4).max_recaptures
    2
    >>> GraphCaptureOptions(warmup_steps=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: CUDAGraphCapture(warmup_steps=1): expected an int >= 2 (eager steps before the capture; ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GraphCaptureOptions"]


def _check(name: str, value: Any, ok: bool, expected: str, is_type: bool) -> None:
    if not ok:
        raise (TypeError if is_type else ValueError)(f"CUDAGraphCapture({name}={value!r}): expected {expected}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GraphCaptureOptions:
    """The options of :class:`~lightning_gh.graphs.CUDAGraphCapture`."""

    warmup_steps: int = 3
    """Eager steps before the capture, at least 2: the first ones initialise the optimizer state and CUDA libraries
    on a side stream, the last is the rehearsal that detects uncapturable work."""

    detect_syncs: bool = True
    """Run the rehearsal with CUDA's sync debug mode to name the line of a host sync. Without it a sync is still
    caught, less precisely, when the capture itself fails."""

    max_recaptures: int = 2
    """How many times a baked-in optimizer hyperparameter (betas, weight decay, eps) may change after capture, each
    time re-capturing, before the run goes eager for good."""

    strict: bool = False
    """Raise :class:`~lightning_gh.graphs.GraphCaptureError` instead of continuing eagerly when the step cannot be
    captured (never raised for a machine without CUDA)."""

    verbose: bool = True
    """Log :meth:`~lightning_gh.graphs.GraphReport.summary` at the end of the fit."""

    def __post_init__(self) -> None:
        expected = "an int >= 2 (eager steps before the capture; the last one rehearses the capture)"
        _check("warmup_steps", self.warmup_steps, _is_int(self.warmup_steps), expected, is_type=True)
        _check("warmup_steps", self.warmup_steps, self.warmup_steps >= 2, expected, is_type=False)
        expected = "an int >= 0 (re-captures after a baked-in hyperparameter changed)"
        _check("max_recaptures", self.max_recaptures, _is_int(self.max_recaptures), expected, is_type=True)
        _check("max_recaptures", self.max_recaptures, self.max_recaptures >= 0, expected, is_type=False)
        for name in ("detect_syncs", "strict", "verbose"):
            value = getattr(self, name)
            _check(name, value, isinstance(value, bool), "True or False", is_type=True)
