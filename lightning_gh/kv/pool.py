"""Where offloaded KV lives: one pinned host pool, and a ring of GPU staging slots.

:class:`HostKVPool` is a single host allocation for every offloaded layer's keys and values at the maximum
length, page-locked once (``cudaHostRegister`` on an exact-size allocation; torch's pinned allocator would round
a multi-GiB request up to the next power of two). Its free-RAM check happens before anything is allocated.

:class:`StagingRing` holds ``num_slots`` GPU buffers, each big enough for one layer's keys and values. A slot
is *reserved* from the moment a fetch for a layer is queued into it until that layer's attention has been
queued and the next layer's ``update`` has recorded a marker behind it (:meth:`StagingRing.release_consumed`);
only then may a fetch overwrite it, and the copy stream first waits on that marker. A released slot keeps its
contents, so when the ring holds every offloaded layer, the next decode step finds them there and copies
nothing. The ring does bookkeeping only: tensors move in :mod:`lightning_gh.kv.transport`.

Example::

    >>> import torch
    >>> ring = StagingRing(2, (1, 2, 16, 4), torch.float32, torch.device("cpu"))
    >>> s = ring.take(layer=3, next_use={})
    >>> s.owner, s.reserved, ring.reserved_for(3) is s
    (3, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_gh import _host
from lightning_gh._host import HostBuffer, HostMemoryError, check_host_room
from lightning_gh.kv.options import KVOffloadOptions

__all__ = ["HostKVPool", "HostMemoryError", "Slot", "StagingRing"]


class HostKVPool:
    """Keys and values of ``num_layers`` offloaded layers, each ``shape`` = ``(batch, heads, max_length,
    head_dim)``, in one host allocation.

    Args:
        num_layers: offloaded layers.
        shape: one layer's key (and value) shape.
        dtype: element type.
        pin: page-lock the allocation (for asynchronous copies with a CUDA device).
        host_memory_fraction: the most of ``MemAvailable`` the pool may take.
    """

    def __init__(self, num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype, pin: bool,
                 host_memory_fraction: float = KVOffloadOptions.host_memory_fraction) -> None:
        self.num_layers, self.shape, self.dtype = num_layers, tuple(shape), dtype
        per = 1
        for s in shape:
            per *= int(s)
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 2 * num_layers * per
        self.nbytes = numel * itemsize
        check_host_room(self.nbytes, headroom=host_memory_fraction,
                        what=f"OffloadedKVCache's host pool ({num_layers} offloaded layers x keys+values "
                             f"{tuple(shape)} {dtype})",
                        tips=["keep more layers on the GPU (resident_layers)", "lower max_length or the batch",
                              f"raise host_memory_fraction={host_memory_fraction}"],
                        part="KVCache", owner=self)
        # One exact-size allocation, page-locked once (HostBuffer counts fp32 words).
        self._buffer = HostBuffer(-(-self.nbytes // 4), pin=pin, zero=False)
        self.flat = self._buffer.tensor.view(torch.uint8)[: self.nbytes].view(dtype)
        self._views = self.flat.view(num_layers, 2, *shape) if numel else None

    @property
    def pinned(self) -> bool:
        return self._buffer.pinned

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the ``index``-th offloaded layer (views into the pool)."""
        assert self._views is not None
        return self._views[index, 0], self._views[index, 1]

    def release(self) -> None:
        """Unlock the pages (at most once) and give the pool's share of the host-memory plan back; the pool must
        not be used afterwards."""
        self._buffer.release()
        _host.PLAN.release("KVCache")


@dataclass(eq=False)
class Slot:
    """One GPU staging buffer of the ring and what it holds."""

    index: int
    keys: torch.Tensor
    values: torch.Tensor
    owner: int | None = None   # the layer whose prefix it holds
    length: int = 0            # valid tokens of ``owner`` in it
    reserved: bool = False     # fetched for, or being read by, ``owner``: must not be overwritten
    consumed: bool = False     # ``owner``'s attention has been queued on it: free at the next layer's update
    ready: Any = None          # marker after the fetch into it
    free_after: Any = None     # marker after the last attention that read it
    uses: int = field(default=0)


class StagingRing:
    """``num_slots`` GPU buffers of one layer's keys and values, assigned to offloaded layers in turn.

    Args:
        num_slots: buffers in the ring.
        shape: one layer's key (and value) shape ``(batch, heads, max_length, head_dim)``.
        dtype: element type.
        device: where the buffers live (the GPU; the CPU in tests).
    """

    def __init__(self, num_slots: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = tuple(shape)
        self.slots = [Slot(i, torch.empty(shape, dtype=dtype, device=device),
                           torch.empty(shape, dtype=dtype, device=device)) for i in range(num_slots)]

    @property
    def nbytes(self) -> int:
        return sum(s.keys.numel() * s.keys.element_size() * 2 for s in self.slots)

    def reserved_for(self, layer: int) -> Slot | None:
        return next((s for s in self.slots if s.reserved and s.owner == layer), None)

    def cached(self, layer: int, length: int) -> Slot | None:
        """A free slot that still holds at least ``length`` valid tokens of ``layer``."""
        return next((s for s in self.slots if not s.reserved and s.owner == layer and s.length >= length), None)

    def free_slots(self) -> list[Slot]:
        return [s for s in self.slots if not s.reserved]

    def take(self, layer: int, next_use: dict[int, int]) -> Slot | None:
        """Reserve a free slot for ``layer``, evicting the layer needed latest (``next_use``: layer -> distance);
        ``None`` when every slot is reserved. The caller fills it."""
        free = self.free_slots()
        if not free:
            return None
        far = 1 << 30
        victim = max(free, key=lambda s: (far + 1 if s.owner is None else next_use.get(s.owner, far), -s.index))
        victim.owner, victim.length, victim.reserved, victim.consumed = layer, 0, True, False
        victim.uses += 1
        return victim

    def release_consumed(self, marker: Any) -> int:
        """Free every slot whose layer's attention is queued before ``marker``; returns how many."""
        n = 0
        for s in self.slots:
            if s.reserved and s.consumed:
                s.reserved, s.consumed, s.free_after = False, False, marker
                n += 1
        return n

    def any_consumed(self) -> bool:
        return any(s.reserved and s.consumed for s in self.slots)

    def invalidate(self) -> None:
        """Forget every slot's contents (after a reset, crop to zero, reorder or growth)."""
        for s in self.slots:
            s.owner, s.length, s.reserved, s.consumed = None, 0, False, False
