"""What the engine counts: :class:`OffloadStats` over its life, :class:`TimelinePoint` events of one step.

Example::

    >>> from lightning_gh.activation_offload import OffloadStats
    >>> OffloadStats().offloaded_bytes
    0
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OffloadStats", "TimelinePoint"]


@dataclass
class OffloadStats:
    """Counters over the engine's life (``last_*``: the most recent forward; one left untouched moved and kept
    nothing through the engine, so they read 0)."""

    forwards: int = 0  # forwards the engine ran its hooks in
    plain_forwards: int = 0  # forwards it left untouched: See Note [A plan that moves nothing installs nothing]
    saved_tensors: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    deduplicated_saves: int = 0
    deduplicated_casts: int = 0
    recomputed_param_casts: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0
    on_demand_reloads: int = 0
    used_before_release: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    last_offloaded_bytes: int = 0
    last_resident_bytes: int = 0
    last_offloaded_by_block: list[int] = field(default_factory=list)
    peak_device_saved_bytes: int = 0
    recompute_forwards: int = 0  # forwards in which some blocks recomputed
    last_recompute_blocks: list[int] = field(default_factory=list)
    last_recompute_cached_bytes: int = 0  # what the selective caches of those blocks held (not via the hooks)
    # per recomputing block: what it kept (bytes through the hooks + its selective cache), latest forward
    last_recompute_kept_by_block: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TimelinePoint:
    """One event of the engine's own accounting (``record_timeline=True``).

    ``saved_bytes``: bytes of saved activations the engine accounts on the device (resident, copying or
    reloaded); ``allocated_bytes``: ``torch.cuda.memory_allocated()`` at the same moment (CUDA only).
    """

    t_ms: float
    event: str
    block: int
    saved_bytes: int
    allocated_bytes: int | None
