"""Where every byte of a training run lives: the memory plan, and the attribution of live GPU memory to owners.

Two pure pieces the :class:`~lightning_gh.memory.MemoryReport` callback puts together:

* :func:`attribute` sorts live CUDA tensors by owner (weights, gradients, optimizer state, the rest: activations
  and temporaries) from their storages' addresses, so a storage shared by views counts once;
* :class:`MemoryPlan` is the table printed at setup and after the first measured steps: GPU bytes per owner, the
  allocator's reserve, free and total memory, the host-memory plan's shares (:data:`lightning_gh._host.PLAN`),
  and the decisions the parts took (tail share, budget, host shares), with the predicted and measured peaks.

Example::

    >>> from lightning_gh.memory.plan import MemoryPlan
    >>> plan = MemoryPlan(gpu={"weights": 2 * 2**30, "optimizer state": 2**30}, gpu_free=10 * 2**30,
    ...                   gpu_total=16 * 2**30)
    >>> print(plan.table().splitlines()[2])
    | GPU | weights | 2.00 GiB |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_gh._util import fmt_bytes

__all__ = ["OWNERS", "MemoryPlan", "attribute", "storage_key"]

#: The owners live GPU memory is attributed to, in the order the tables show them.
OWNERS = ("weights", "gradients", "optimizer state", "activations and temporaries")


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of a CUDA tensor's storage, or ``None`` for a tensor off the GPU or without storage."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage (e.g. some fp8 tensors)
        return None
    return (st.data_ptr(), st.nbytes())


def _tensors_of_state(state: Any) -> Iterable[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, Mapping):
        for v in state.values():
            yield from _tensors_of_state(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors_of_state(v)


def attribute(module: torch.nn.Module | None, optimizers: Iterable[Any] = (), allocated: int | None = None,
              ) -> dict[str, int]:
    """GPU bytes per owner (:data:`OWNERS`) of the tensors reachable from ``module`` and ``optimizers``.

    ``allocated`` (default: ``torch.cuda.memory_allocated()``) minus what the owners hold is reported as
    activations and temporaries. Each storage counts once, for the first owner that reaches it.
    """
    seen: set[int] = set()
    out = dict.fromkeys(OWNERS, 0)

    def add(owner: str, t: torch.Tensor | None) -> None:
        key = storage_key(t) if t is not None else None
        if key is not None and key[0] not in seen:
            seen.add(key[0])
            out[owner] += key[1]

    params = list(module.parameters()) if module is not None else []
    for p in params:
        add("weights", p)
    for p in params:
        add("gradients", p.grad)
    for opt in optimizers:
        state = getattr(opt, "state", {})
        for value in (state.values() if isinstance(state, Mapping) else ()):
            for t in _tensors_of_state(value):
                add("optimizer state", t)
    if allocated is None:
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    owned = out["weights"] + out["gradients"] + out["optimizer state"]
    out["activations and temporaries"] = max(0, allocated - owned)
    return out


@dataclass
class MemoryPlan:
    """The memory plan of one run: GPU bytes per owner, the allocator, the host plan's shares, the parts'
    decisions, and the predicted and measured peaks.

    Attributes:
        gpu: GPU bytes per owner (:data:`OWNERS`, plus any our parts add, e.g. ``"activation budget"``).
        gpu_free: free bytes on the device (under the process's memory-fraction cap), or ``None`` off CUDA.
        gpu_total: the device's bytes, or ``None`` off CUDA.
        reserved: bytes the caching allocator holds (allocated or cached), or ``None`` off CUDA.
        host: host bytes per part from the host-memory plan (held plus announced).
        host_available: host bytes available now, or ``None`` where unknown.
        decisions: what the parts decided and why (``{"SuperOffload": "tail 23% ...", ...}``).
        predicted_peak: the peak GPU bytes the parts predict for a step, or ``None``.
        measured_peak: the peak GPU bytes of the measured steps, or ``None`` before they ran.
    """

    gpu: dict[str, int] = field(default_factory=dict)
    gpu_free: int | None = None
    gpu_total: int | None = None
    reserved: int | None = None
    host: dict[str, int] = field(default_factory=dict)
    host_available: int | None = None
    decisions: dict[str, str] = field(default_factory=dict)
    predicted_peak: int | None = None
    measured_peak: int | None = None

    def headroom(self) -> int | None:
        """GPU bytes left between the predicted (else measured) peak and the device's total, or ``None``."""
        peak = self.predicted_peak if self.predicted_peak is not None else self.measured_peak
        return None if peak is None or self.gpu_total is None else self.gpu_total - peak

    def peak_error(self) -> float | None:
        """(predicted - measured) / measured, or ``None`` until both exist."""
        if self.predicted_peak is None or not self.measured_peak:
            return None
        return (self.predicted_peak - self.measured_peak) / self.measured_peak

    def table(self) -> str:
        """The plan as a markdown table (one row per owner and part), then the decisions."""
        rows = ["| where | what | bytes |", "| --- | --- | ---: |"]
        rows += [f"| GPU | {k} | {fmt_bytes(v)} |" for k, v in self.gpu.items()]
        for label, value in (("allocator reserve", self.reserved), ("free", self.gpu_free),
                             ("total", self.gpu_total), ("predicted peak", self.predicted_peak),
                             ("measured peak", self.measured_peak), ("headroom", self.headroom())):
            if value is not None:
                rows.append(f"| GPU | {label} | {fmt_bytes(value)} |")
        rows += [f"| host | {k} | {fmt_bytes(v)} |" for k, v in self.host.items()]
        if self.host_available is not None:
            rows.append(f"| host | available | {fmt_bytes(self.host_available)} |")
        err = self.peak_error()
        lines = rows + [f"- {k}: {v}" for k, v in self.decisions.items()]
        if err is not None:
            lines.append(f"- predicted peak vs measured: {err:+.1%}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (bytes as ints)."""
        d = dataclasses.asdict(self)
        d["headroom"] = self.headroom()
        d["peak_error"] = self.peak_error()
        return d
