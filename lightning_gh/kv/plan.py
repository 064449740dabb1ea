"""Which layers stay on the GPU: the budget, the resident count, and where the resident layers sit.

Every offloaded layer's valid prefix crosses the host link once per decode step, so a step takes at least
``offloaded KV bytes / link bandwidth`` (:meth:`KVPlan.link_bytes_per_step`, printed by the benchmark as the
PCIe bound). ``"auto"`` therefore keeps as many layers resident as the GPU budget allows after the staging ring,
and all of them when they fit (then nothing crosses the link and no ring is allocated).

``placement="spread"`` spaces the resident layers evenly among the offloaded ones: while a resident layer
computes, the copy of the next offloaded layer is already under way, so the link stays busy through the whole
step instead of only while the offloaded layers compute.

Example::

    >>> place(8, 4, "spread")
    (1, 3, 5, 7)
    >>> plan = make_plan(num_layers=8, layer_bytes=100, batch_size=2, max_length=64,
    ...                  resident_layers="auto", gpu_budget_bytes=500, num_slots=2, placement="spread", backend="cuda")
    >>> plan.resident, plan.slots, plan.gpu_kv_bytes
    ((2, 5, 7), 2, 500)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_gh._util import fmt_bytes
from lightning_gh.kv.options import KVOffloadOptions

__all__ = ["KVPlan", "make_plan", "place"]


def place(num_layers: int, resident: int, placement: str) -> tuple[int, ...]:
    """Indices of ``resident`` resident layers out of ``num_layers``."""
    if resident >= num_layers:
        return tuple(range(num_layers))
    if resident <= 0:
        return ()
    if placement == "first":
        return tuple(range(resident))
    # Evenly spaced offloaded layers, the rest resident; offloaded layer k sits at floor(k * n / off).
    off = num_layers - resident
    offloaded = {int(k * num_layers / off) for k in range(off)}
    return tuple(i for i in range(num_layers) if i not in offloaded)


@dataclass(frozen=True)
class KVPlan:
    """The split of one cache between GPU and host.

    Args:
        num_layers: layers of the cache.
        resident: indices of layers kept on the GPU.
        offloaded: indices of layers kept in the host pool.
        slots: GPU staging slots (0 when nothing is offloaded).
        layer_bytes: one layer's keys plus values at ``max_length``.
        batch_size: sequences.
        max_length: tokens per sequence the buffers hold.
        backend: ``"cuda"``, ``"host-copy"`` or ``"plain"``.
        reason: how the resident count was chosen.
        device_type: where the keys are computed (``"cuda"``; ``"cpu"`` in tests and off the GPU), for messages.
    """

    num_layers: int
    resident: tuple[int, ...]
    offloaded: tuple[int, ...]
    slots: int
    layer_bytes: int
    batch_size: int
    max_length: int
    backend: str
    reason: str
    device_type: str = "cuda"

    @property
    def gpu_kv_bytes(self) -> int:
        """KV bytes on the GPU: resident layers plus the staging ring."""
        return (len(self.resident) + self.slots) * self.layer_bytes

    @property
    def host_kv_bytes(self) -> int:
        return len(self.offloaded) * self.layer_bytes

    @property
    def gpu_fraction(self) -> float:
        """GPU KV bytes over those of a cache that keeps every layer on the GPU."""
        return self.gpu_kv_bytes / max(1, self.num_layers * self.layer_bytes)

    def link_bytes_per_step(self, length: int, new_tokens: int = 1) -> int:
        """Bytes one decode step moves at context ``length``: every offloaded layer's prefix comes in, its new
        tokens go out (a ring that holds all offloaded layers keeps them and moves only the new tokens)."""
        per_token = self.layer_bytes // max(1, self.max_length)
        fetch = 0 if self.slots >= len(self.offloaded) else length
        return len(self.offloaded) * per_token * (fetch + new_tokens)

    def describe(self) -> str:
        dev = "GPU" if self.device_type == "cuda" else self.device_type.upper()
        if not self.offloaded:
            return (f"all {self.num_layers} layers on the {dev} ({fmt_bytes(self.gpu_kv_bytes)}, backend "
                    f"{self.backend}; {self.reason})")
        host = "pinned host memory" if self.backend == "cuda" else "host memory"
        return (f"{len(self.resident)}/{self.num_layers} layers resident {list(self.resident)}, "
                f"{len(self.offloaded)} offloaded to {fmt_bytes(self.host_kv_bytes)} of {host}, "
                f"{self.slots} staging slots; {dev} KV {fmt_bytes(self.gpu_kv_bytes)} = {self.gpu_fraction:.0%} of "
                f"a {dev}-only cache (batch {self.batch_size}, max_length {self.max_length}, backend {self.backend}; "
                f"{self.reason})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gpu_kv_bytes=self.gpu_kv_bytes, host_kv_bytes=self.host_kv_bytes, gpu_fraction=self.gpu_fraction)
        return d


def make_plan(*, num_layers: int, layer_bytes: int, batch_size: int, max_length: int, resident_layers: int | str,
              gpu_budget_bytes: int | None, num_slots: int, placement: str, backend: str,
              free_bytes: int | None = None,
              gpu_memory_fraction: float = KVOffloadOptions.gpu_memory_fraction,
              budget_is_explicit: bool | None = None, device_type: str = "cuda") -> KVPlan:
    """Decide the split.

    Args:
        num_layers: layers of the cache.
        layer_bytes: one layer's keys plus values at ``max_length``.
        batch_size: sequences (for messages).
        max_length: tokens per sequence (for messages).
        resident_layers: ``"auto"`` or a count.
        gpu_budget_bytes: the user's budget, or ``None`` to take ``gpu_memory_fraction`` of ``free_bytes``.
        num_slots: staging slots when something is offloaded.
        placement: ``"spread"`` or ``"first"``.
        backend: ``"plain"`` keeps everything resident.
        free_bytes: free GPU memory at first use (``None``: unknown, keep everything resident).
        gpu_memory_fraction: share of ``free_bytes`` ``"auto"`` may budget.
        budget_is_explicit: whether the user gave ``gpu_budget_bytes`` (default: whether it is not ``None``).
        device_type: where the keys are computed, for messages.
    """
    explicit = gpu_budget_bytes is not None if budget_is_explicit is None else budget_is_explicit
    what = f"one layer's keys+values for batch {batch_size} x max_length {max_length} is {layer_bytes:,} bytes"
    if explicit and gpu_budget_bytes is not None and gpu_budget_bytes < layer_bytes:
        raise ValueError(f"gpu_budget_bytes={gpu_budget_bytes:,} is below one layer: {what}. Allowed: at least "
                         f"{min(num_layers, num_slots) * layer_bytes:,} bytes (the staging ring of "
                         f"num_slots={num_slots} layers), or lower the batch or max_length.")
    if isinstance(resident_layers, int) and resident_layers > num_layers:
        raise ValueError(f"resident_layers={resident_layers} exceeds the model's {num_layers} cached layers; allowed: "
                         f"'auto' or 0..{num_layers}.")
    if backend == "plain":
        why = ("plain cache: nothing is offloaded" if device_type == "cuda" else
               f"the keys are on {device_type}, not a CUDA GPU: a plain cache, nothing is offloaded")
        return KVPlan(num_layers, tuple(range(num_layers)), (), 0, layer_bytes, batch_size, max_length, backend,
                      why, device_type)
    if isinstance(resident_layers, int):
        count, reason = resident_layers, f"resident_layers={resident_layers}"
    else:
        budget = gpu_budget_bytes
        if budget is None:
            if free_bytes is None:
                count, reason, budget = num_layers, "free GPU memory unknown", None
            else:
                budget = int(gpu_memory_fraction * free_bytes)
        if budget is not None:
            if budget >= num_layers * layer_bytes:
                count = num_layers
                reason = f"auto: all layers fit the budget of {fmt_bytes(budget)}"
            else:
                ring = min(num_slots, num_layers)
                if budget < ring * layer_bytes:
                    source = (f"gpu_budget_bytes={budget:,}" if explicit else
                              f"gpu_memory_fraction={gpu_memory_fraction} of the {free_bytes or 0:,} free GPU bytes "
                              f"= {budget:,} bytes")
                    raise ValueError(f"{source} cannot hold the staging ring of num_slots={num_slots} layers: "
                                     f"{what}. Allowed: at least {ring * layer_bytes:,} bytes; or lower the batch or "
                                     "max_length.")
                count = min(num_layers, budget // layer_bytes - ring)
                reason = f"auto: budget {fmt_bytes(budget)} = {count} resident + {ring} slots"
    resident = place(num_layers, count, placement)
    offloaded = tuple(i for i in range(num_layers) if i not in resident)
    slots = min(num_slots, len(offloaded)) if offloaded else 0
    plan = KVPlan(num_layers, resident, offloaded, slots, layer_bytes, batch_size, max_length, backend, reason,
                  device_type)
    over = gpu_budget_bytes is not None and plan.gpu_kv_bytes > gpu_budget_bytes
    if explicit and isinstance(resident_layers, int) and over:
        most = max(0, gpu_budget_bytes // layer_bytes - min(num_slots, num_layers))  # type: ignore[operator]
        raise ValueError(f"resident_layers={resident_layers} with {slots} staging slots needs {plan.gpu_kv_bytes:,} "
                         f"GPU bytes, above gpu_budget_bytes={gpu_budget_bytes:,} ({what}). Allowed: resident_layers "
                         f"<= {most}, or resident_layers='auto'.")
    return plan
