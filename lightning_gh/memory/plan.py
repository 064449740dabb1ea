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

__all__ = ["OWNERS", "MemoryPlan", "attribute", "plot_plan", "storage_key"]

#: The owners live GPU memory is attributed to, in the order the tables show them.
OWNERS = ("weights", "gradients", "optimizer state", "activations and temporaries")


def storage_key(t: torch.Tensor, device_type: str = "cuda") -> tuple[int, int] | None:
    """``(address, bytes)`` of the storage of a tensor on ``device_type``, or ``None`` for a tensor elsewhere or
    without one storage."""
    if not isinstance(t, torch.Tensor) or t.device.type != device_type:
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
              device_type: str = "cuda") -> dict[str, int]:
    """Bytes per owner (:data:`OWNERS`) of the tensors on ``device_type`` reachable from ``module`` and
    ``optimizers``.

    ``allocated`` (default: ``torch.cuda.memory_allocated()``) minus what the owners hold is reported as
    activations and temporaries. Each storage counts once, for the first owner that reaches it.
    """
    seen: set[int] = set()
    out = dict.fromkeys(OWNERS, 0)

    def add(owner: str, t: torch.Tensor | None) -> None:
        key = storage_key(t, device_type) if t is not None else None
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
    owned = out["weights"] + out["gradients"] + out["optimizer state"]
    if allocated is None:
        allocated = torch.cuda.memory_allocated() if device_type == "cuda" and torch.cuda.is_available() else owned
    out["activations and temporaries"] = max(0, allocated - owned)
    return out


@dataclass
class MemoryPlan:
    """The memory plan of one run: GPU bytes per owner, the allocator, the host plan's shares, the parts'
    decisions, and the predicted and measured peaks.

    Attributes:
        gpu: bytes per owner on the run's device (the GPU; the CPU in a CPU run, see ``device``) (:data:`OWNERS`, plus any our parts add, e.g. ``"activation budget"``).
        gpu_free: free bytes on the device (under the process's memory-fraction cap), or ``None`` off CUDA.
        gpu_total: the device's bytes, or ``None`` off CUDA.
        reserved: bytes the caching allocator holds (allocated or cached), or ``None`` off CUDA.
        host: host bytes per part from the host-memory plan (held plus announced).
        host_available: host bytes available now, or ``None`` where unknown.
        decisions: what the parts decided and why (``{"SuperOffload": "tail 23% ...", ...}``).
        predicted_peak: the peak allocated GPU bytes predicted for a step (``torch.cuda.max_memory_allocated``),
            or ``None``.
        predicted: what the predicted peak is made of (see :class:`lightning_gh.memory.forecast.Prediction`).
        prediction_note: how the peak was predicted, or the one-line reason it was not.
        measured_peak: the peak allocated GPU bytes of the measured steps, or ``None`` before they ran.
        measured_reserved: the peak bytes the caching allocator reserved in them (allocated plus its cache).
        device: the label of the device rows (``"GPU"``, or ``"CPU"`` in a CPU run).
    """

    gpu: dict[str, int] = field(default_factory=dict)
    gpu_free: int | None = None
    gpu_total: int | None = None
    reserved: int | None = None
    host: dict[str, int] = field(default_factory=dict)
    host_available: int | None = None
    decisions: dict[str, str] = field(default_factory=dict)
    predicted_peak: int | None = None
    predicted: dict[str, int] = field(default_factory=dict)
    prediction_note: str | None = None
    measured_peak: int | None = None
    measured_reserved: int | None = None
    device: str = "GPU"

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
        rows += [f"| {self.device} | {k} | {fmt_bytes(v)} |" for k, v in self.gpu.items()]
        rows += [f"| {self.device} | predicted: {k} | {fmt_bytes(v)} |" for k, v in self.predicted.items()]
        for label, value in (("allocator reserve", self.reserved), ("free", self.gpu_free),
                             ("total", self.gpu_total), ("predicted peak", self.predicted_peak),
                             ("measured peak", self.measured_peak), ("measured peak reserved", self.measured_reserved),
                             ("headroom", self.headroom())):
            if value is not None:
                rows.append(f"| {self.device} | {label} | {fmt_bytes(value)} |")
        rows += [f"| host | {k} | {fmt_bytes(v)} |" for k, v in self.host.items()]
        if self.host_available is not None:
            rows.append(f"| host | available | {fmt_bytes(self.host_available)} |")
        err = self.peak_error()
        lines = rows + [f"- {k}: {v}" for k, v in self.decisions.items()]
        if self.prediction_note:
            lines.append(f"- predicted peak: {self.prediction_note}")
        if err is not None:
            lines.append(f"- predicted peak vs measured: {err:+.1%}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (bytes as ints)."""
        d = dataclasses.asdict(self)
        d["headroom"] = self.headroom()
        d["peak_error"] = self.peak_error()
        return d


def plot_plan(plan: MemoryPlan, ax: Any = None) -> Any:
    """The plan as two stacked bars, GPU and host, one segment per owner or part (GiB); returns the axes.

    Lines mark the GPU's total and, where known, its measured and predicted peaks; matplotlib is imported here only."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    gib = 2**30
    for x, parts in ((0, plan.gpu), (1, plan.host)):  # device bar, host bar
        bottom = 0.0
        for name, nbytes in parts.items():
            if nbytes <= 0:
                continue
            ax.bar(x, nbytes / gib, bottom=bottom, label=f"{plan.device if x == 0 else 'host'}: {name}")
            bottom += nbytes / gib
    for value, style, label in ((plan.gpu_total, "-", "GPU total"), (plan.measured_peak, "--", "GPU peak"),
                                (plan.predicted_peak, ":", "GPU predicted peak")):
        if value is not None:
            ax.hlines(value / gib, -0.4, 0.4, colors="k", linestyles=style, label=label)
    if plan.host_available is not None:
        top = sum(plan.host.values()) / gib
        ax.hlines(top + plan.host_available / gib, 0.6, 1.4, colors="grey", linestyles=":",
                  label="host: held + available")
    ax.set_xticks([0, 1], [plan.device, "host"])
    ax.set_ylabel("GiB")
    ax.set_title("memory plan")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
