"""The options of KV-cache offload: one frozen, validated dataclass shared by the cache and the callback.

Example::

    >>> from lightning_gh.kv import KVOffloadOptions
    >>> KVOffloadOptions(resident_layers=4, max_length=4160).num_slots
    2
    >>> KVOffloadOptions(num_slots=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: num_slots=1 must be an int >= 2: ...
    >>> KVOffloadOptions(placement=1)
    Traceback (most recent call last):
    ...
    TypeError: KVOffloadOptions(placement=1): expected a string, got int.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from lightning_gh._options import check_types

__all__ = ["BACKENDS", "PLACEMENTS", "KVOffloadOptions"]

BACKENDS = ("auto", "cuda", "host-copy", "plain")
PLACEMENTS = ("spread", "first")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class KVOffloadOptions:
    """How an :class:`~lightning_gh.kv.OffloadedKVCache` splits the KV cache between the GPU and host memory.

    The one place these options and their defaults are stated: the cache and
    :class:`~lightning_gh.kv.GenerationCallback` take an instance as ``options=`` (the cache also its fields as
    keyword arguments, never both).

    Attributes:
        resident_layers: layers whose keys and values stay on the GPU for the whole generation. ``"auto"`` keeps
            every layer resident when ``gpu_budget_bytes`` (default: ``gpu_memory_fraction`` of the free GPU memory
            at first use) holds them all, else as many as the budget leaves after the staging ring; an int fixes it.
        max_length: tokens per sequence the cache holds (prompt + new tokens). Every buffer is allocated once for
            it, so addresses never change. ``None`` sizes the buffers at first use (prompt + 256, rounded up to 256)
            and doubles them, with one warning, when they fill up, deciding the split again for the longer layers.
            transformers' ``prefill_chunk_size`` shows the cache the prompt chunk by chunk, so it grows during the
            prompt: give ``max_length`` there to allocate once, at the right size.
        gpu_budget_bytes: GPU bytes the cache may hold (resident layers + staging ring) when ``resident_layers`` is
            ``"auto"``; with an int ``resident_layers`` it is checked, not used to decide. Must hold one layer.
        gpu_memory_fraction: the share of free GPU memory ``"auto"`` may budget when ``gpu_budget_bytes`` is None.
            The rest is left to activations: a long prompt's prefill needs far more than its decode steps.
        num_slots: GPU staging slots in the ring for offloaded layers (>= 2): layer ``i + 1`` is copied into one
            while layer ``i``'s attention reads the other.
        placement: which layers stay resident. ``"spread"`` spaces them evenly, so the copy of each offloaded layer
            overlaps the compute of the resident layers before it; ``"first"`` keeps layers ``0..R-1``.
        host_memory_fraction: the most of the host's available memory (``/proc/meminfo``) the pinned pool may take.
        backend: ``"auto"`` (offload when the keys are on a CUDA device; elsewhere warn once and run as a plain
            cache), ``"cuda"`` (require CUDA), ``"host-copy"`` (the offload bookkeeping with synchronous copies on
            any device; for tests) or ``"plain"`` (never offload).
    """

    resident_layers: int | str = "auto"
    max_length: int | None = None
    gpu_budget_bytes: int | None = None
    gpu_memory_fraction: float = 0.5
    num_slots: int = 2
    placement: str = "spread"
    host_memory_fraction: float = 0.8
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_types(self)  # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        r = self.resident_layers
        if not (r == "auto" or (_is_int(r) and r >= 0)):
            raise ValueError(f"resident_layers={r!r} must be 'auto' or an int >= 0 (layers kept on the GPU).")
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length={self.max_length!r} must be None or an int > 0 (prompt + new tokens).")
        if self.gpu_budget_bytes is not None and self.gpu_budget_bytes <= 0:
            raise ValueError(f"gpu_budget_bytes={self.gpu_budget_bytes!r} must be None or an int > 0 (bytes).")
        for name in ("gpu_memory_fraction", "host_memory_fraction"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name}={v!r} must be a number in (0, 1].")
        if self.num_slots < 2:
            raise ValueError(f"num_slots={self.num_slots!r} must be an int >= 2: a layer's staging slot may be "
                             "refilled only after attention has read it, so the next layer needs a slot of its own.")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not known; choose one of {list(PLACEMENTS)}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not known; choose one of {list(BACKENDS)}.")

    def replace(self, **changes: Any) -> KVOffloadOptions:
        """A copy with ``changes`` applied (validated again); unknown names are refused."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise TypeError(f"{bad} are not KVOffloadOptions fields; allowed: {sorted(known)}.")
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
