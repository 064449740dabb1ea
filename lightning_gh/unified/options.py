"""The options of the managed-memory pool and of the optimizer-state placement: one frozen, validated dataclass.

``managed_memory()``, :class:`~lightning_gh.unified.state.OptimizerStatePlacement` and the
:class:`~lightning_gh.unified.callback.ManagedOptimizerState` callback all take these fields as keyword
arguments and build one :class:`ManagedMemoryOptions`, so a bad value gets the same message wherever it is given.

Example::

    >>> from lightning_gh.unified.options import ManagedMemoryOptions
    >>> ManagedMemoryOptions(preferred="cpu").location
    'host'
    >>> ManagedMemoryOptions(preferred="disk")
    Traceback (most recent call last):
    ...
    ValueError: preferred='disk' is not a location for managed memory; allowed: 'cpu' (pages live in host memory, the GPU reads them in place) or 'gpu' (pages live in GPU memory, the driver may move them to the host).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_gh._options import check_types

__all__ = ["DEFAULT_HEADROOM_BYTES", "PREFERRED", "PREFETCH", "ManagedMemoryOptions"]

#: Where the pages of a pool should live.
PREFERRED: tuple[str, ...] = ("cpu", "gpu")
#: When the optimizer-state placement moves the state between host and GPU.
PREFETCH: tuple[str, ...] = ("none", "step")
#: GPU memory the safety guard keeps free beyond the managed bytes (the driver, cuBLAS workspaces, NCCL).
DEFAULT_HEADROOM_BYTES = 512 * 2**20

_PREFERRED_HELP = ("'cpu' (pages live in host memory, the GPU reads them in place) or 'gpu' (pages live in GPU "
                   "memory, the driver may move them to the host)")
_PREFETCH_HELP = ("'none' (the GPU reads the state where it lives) or 'step' (move the state to the GPU just "
                  "before each optimizer step and back to its preferred location after it)")


@dataclass(frozen=True)
class ManagedMemoryOptions:
    """How managed memory is allocated, advised, guarded and (for optimizer state) moved.

    Args:
        preferred: ``"cpu"``: the pages' preferred location is host memory; with ``accessed_by_gpu`` the GPU maps
            them and reads/writes them in place (over NVLink-C2C on Grace Hopper, over PCIe elsewhere), so they take
            no GPU memory. ``"gpu"``: the pages live in GPU memory like ordinary tensors, and the driver may evict
            them to the host under memory pressure (on Grace Hopper, or where oversubscription is allowed).
        accessed_by_gpu: advise ``cudaMemAdviseSetAccessedBy`` for the GPU, so it keeps a mapping to the pages
            wherever they are and reads host-resident pages without a page fault or a migration.
        allow_oversubscription: let the pool hold more managed memory than the GPU has free. Honoured only where
            the GPU reads host memory coherently (Grace Hopper); elsewhere it is an error, because oversubscribed
            managed memory on a PCIe GPU can hang the GPU, not just the process.
        headroom_bytes: GPU memory the safety guard keeps free beyond the pool's managed bytes.
        prefetch: optimizer-state placement only: ``"none"`` (default) or ``"step"``, which prefetches the state to
            the GPU just before each optimizer step (when the GPU has room) and, for ``preferred="cpu"``, back to
            the host on a side stream after it. On a PCIe GPU it is much slower than reading the state in place
            (page migration costs more than the GPU's direct reads of host memory; docs/unified_memory.md has the
            figures): it is meant for GPU-preferred state on Grace Hopper with oversubscription, to bring evicted
            pages back in bulk.

    Example::

        opts = ManagedMemoryOptions(preferred="cpu", headroom_bytes=1 << 30)
        opts.replace(preferred="gpu")
    """

    preferred: str = "cpu"
    accessed_by_gpu: bool = True
    allow_oversubscription: bool = False
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    prefetch: str = "none"

    def __post_init__(self) -> None:
        # bool(0), "yes" and None would all pass an `if`: a flag must be a real bool, a size a real int.
        check_types(self)  # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        if self.preferred not in PREFERRED:
            raise ValueError(f"preferred={self.preferred!r} is not a location for managed memory; allowed: "
                             f"{_PREFERRED_HELP}.")
        if self.prefetch not in PREFETCH:
            raise ValueError(f"prefetch={self.prefetch!r} is not a prefetch policy; allowed: {_PREFETCH_HELP}.")
        if self.headroom_bytes < 0:
            raise ValueError(f"headroom_bytes={self.headroom_bytes!r} must be >= 0 bytes.")

    @property
    def location(self) -> str:
        """``"host"`` or ``"device"``: the preferred location in CUDA's words."""
        return "host" if self.preferred == "cpu" else "device"

    def pool_key(self) -> tuple[str, bool]:
        """What makes two pools different: the advice their pages get when they are allocated."""
        return (self.preferred, self.accessed_by_gpu)

    def replace(self, **changes: Any) -> ManagedMemoryOptions:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
