"""What CUDAGraphCapture did: the states of a capture (:class:`GraphState`) and the report of a fit
(:class:`GraphReport`).

Example::

    >>> from lightning_gh.graphs.report import GraphReport, GraphState
    >>> GraphState.CAPTURED == "captured", str(GraphState.EAGER)
    (True, 'eager')
    >>> GraphReport().summary()
    'CUDAGraphCapture: off (not started).'
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_gh._util import fmt_bytes

__all__ = ["GraphReport", "GraphState"]


class GraphState(str, enum.Enum):
    """Where a fit with :class:`~lightning_gh.graphs.CUDAGraphCapture` stands (``GraphReport.state``).

    A ``str`` Enum: each state compares equal to its value (``report.state == "captured"``) and prints as it.
    """

    OFF = "off"
    """Nothing attempted (no CUDA GPU, or before the fit)."""
    WARMING_UP = "warming up"
    """Eager warm-up steps on a side stream."""
    REHEARSED = "rehearsed"
    """The rehearsal found nothing uncapturable: the next step of the same shapes is captured."""
    CAPTURED = "captured"
    """The step is captured and replayed."""
    EAGER = "eager"
    """Gave up (declined at the start or during the fit): every later step runs eagerly."""

    def __str__(self) -> str:
        return self.value


@dataclass
class GraphReport:
    """What CUDAGraphCapture did in the last fit.

    Attributes:
        state: a :class:`GraphState` (a ``str`` Enum: ``"off"``, ``"warming up"``, ``"rehearsed"``, ``"captured"``
            or ``"eager"``, gave up: see ``reason``).
        reason: why the run is (or went) eager, as told to the user.
        warmup_steps: eager steps before the capture.
        replayed_steps: steps run by replaying the graph (the capture step included).
        eager_steps: steps that ran eagerly after the capture (fallbacks, or all steps after giving up).
        fallbacks: eager steps after the capture, counted by reason.
        captures: graphs captured (more than one after a recapture).
        repairs: in-place repairs before a replay, counted by what was repaired.
        pool_bytes: memory held by the graph's private pool (activations, gradients, outputs), in bytes.
        capture_ms: wall time of the capture.
    """

    state: GraphState = GraphState.OFF
    reason: str | None = None
    warmup_steps: int = 0
    replayed_steps: int = 0
    eager_steps: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    captures: int = 0
    repairs: dict[str, int] = field(default_factory=dict)
    pool_bytes: int | None = None
    capture_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values (the state as its string)."""
        return {**asdict(self), "state": str(self.state)}

    def summary(self) -> str:
        """One paragraph for the log."""
        if self.state == GraphState.OFF:
            return f"CUDAGraphCapture: off ({self.reason or 'not started'})."
        parts = [f"CUDAGraphCapture: {self.state}"]
        if self.captures:
            pool = fmt_bytes(self.pool_bytes) if self.pool_bytes is not None else "unknown size"
            parts.append(f"captured {self.captures}x after {self.warmup_steps} eager warm-up steps "
                         f"(graph pool {pool}, capture {self.capture_ms or 0:.0f} ms)")
        else:
            parts.append(f"{self.warmup_steps} warm-up steps")
        parts.append(f"replayed {self.replayed_steps} steps, {self.eager_steps} eager after capture")
        if self.fallbacks:
            parts.append("fallbacks: " + "; ".join(f"{n}x {why}" for why, n in self.fallbacks.items()))
        if self.repairs:
            parts.append("repaired in place: " + "; ".join(f"{n}x {what}" for what, n in self.repairs.items()))
        if self.reason:
            parts.append(f"reason: {self.reason}")
        return "; ".join(parts) + "."
