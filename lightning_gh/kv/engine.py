"""The KV-offload engine: per-layer storage, the decode-step choreography, and its statistics.

Framework-free (no transformers): :class:`~lightning_gh.kv.cache.OffloadedKVCache` adapts it to transformers'
``Cache`` interface, and the demo ``Llama.generate`` calls it directly.

Storage, allocated once at the first ``update`` (when the batch, heads, dtype and device are known):

* a resident layer: GPU keys and values ``(B, H, max_length, D)``; ``update`` writes the new tokens in place.
* an offloaded layer: the same buffers in the pinned :class:`~lightning_gh.kv.pool.HostKVPool`, plus, while
  it computes, a slot of the :class:`~lightning_gh.kv.pool.StagingRing`.

``update(i, k, v)`` returns ``buffer[:, :, :n]`` views (``n`` = tokens so far): the shapes a growing cache
returns, so attention runs the same kernels on the same numbers and greedy tokens are bitwise those of
transformers' ``DynamicCache``. What happens in ``update(i)`` of an offloaded layer, in stream order::

    compute : ... attention i-1 | M_i | wait READY_i | write new k,v into slot | W_i | attention i ...
    copy    :   wait FREE(s) | fetch prefix of layer j into slot s | READY_j | wait W_i | append new k,v of i

1. ``M_i`` is recorded first: every slot whose layer's attention was queued before it is released with
   ``FREE = M_i`` (:meth:`StagingRing.release_consumed`); a fetch into such a slot waits on it, so a slot is
   never overwritten while attention still reads it.
2. Layer ``i``'s slot was usually filled ahead of time (step 5); if not, its valid prefix is fetched now.
   The compute stream waits on that fetch only.
3. The new tokens are written into the slot by the compute stream, and appended to the host pool by the copy
   stream after ``W_i``: append-only, ``new tokens x layer`` bytes per step; the prefix already on the host is
   never copied back.
4. Returned: the slot's ``[:, :, :n]`` views.
5. Prefetch: for the next offloaded layers in use order (the rest of this step, then the next step's), each
   free slot receives the next layer's valid prefix. With two slots, layer ``i + 1`` (the next offloaded one)
   is copied while layer ``i`` computes; with ``placement="spread"`` resident layers in between give it more time.

One copy stream serves both directions: a layer's append is then always queued before its next fetch, and a
slot's append before its refill, with no further events.

Example::

    >>> import torch
    >>> from lightning_gh.kv.options import KVOffloadOptions
    >>> eng = KVOffloadEngine(3, KVOffloadOptions(resident_layers=1, max_length=16, backend="host-copy"))
    >>> k = torch.randn(2, 1, 5, 4)
    >>> for i in range(3):
    ...     keys, values = eng.update(i, k, k)
    >>> eng.plan.offloaded, eng.seq_length(), keys.shape
    ((0, 1), 5, torch.Size([2, 1, 5, 4]))
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_gh import hardware
from lightning_gh._util import warn_once
from lightning_gh.kv.options import KVOffloadOptions
from lightning_gh.kv.plan import KVPlan, make_plan
from lightning_gh.kv.pool import HostKVPool, Slot, StagingRing
from lightning_gh.kv.transport import KVCudaTransport, KVHostCopyTransport, KVTransport

__all__ = ["KVOffloadEngine", "KVStats"]


@dataclass
class KVStats:
    """What the engine moved since it was created (or since :meth:`KVOffloadEngine.reset_stats`)."""

    h2d_bytes: int = 0           # prefixes fetched into staging slots
    d2h_bytes: int = 0           # new tokens appended to the host pool
    fetches: int = 0             # fetches queued
    prefetches: int = 0          # ... of them queued ahead of the layer's update
    late_fetches: int = 0        # ... queued in the layer's own update (the compute stream waits on the link)
    ring_hits: int = 0           # layer found still in a released slot: nothing fetched
    updates: int = 0
    grown: int = 0               # times the buffers were reallocated for a longer max_length

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _free_gpu_bytes(device: torch.device) -> int | None:
    room = hardware.gpu_memory_room(device)
    if room is None:
        return None
    # Memory torch has reserved but not handed out is free to the cache as well.
    return int(room[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class KVOffloadEngine:
    """Holds the keys and values of ``num_layers`` attention layers; see the module docstring.

    Args:
        num_layers: layers that call :meth:`update`, indexed ``0..num_layers-1`` in the order they run.
        options: the split and sizes (:class:`~lightning_gh.kv.options.KVOffloadOptions`).
        name: how messages name the owner.
    """

    def __init__(self, num_layers: int, options: KVOffloadOptions | None = None,
                 name: str = "OffloadedKVCache") -> None:
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers={num_layers!r} must be an int > 0.")
        self.num_layers = num_layers
        self.options = options or KVOffloadOptions()
        self.name = name
        self.lengths = [0] * num_layers
        self.plan: KVPlan | None = None
        self.transport: KVTransport | None = None
        self.ring: StagingRing | None = None
        self.pool: HostKVPool | None = None
        self.stats = KVStats()
        self._resident: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._host_index: dict[int, int] = {}
        self._order: tuple[int, ...] = ()
        self._pos: dict[int, int] = {}
        self.batch_size = 0
        self.max_length = 0
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self._kv_shape: tuple[int, int, int] | None = None  # heads, key dim, value dim

    # ----------------------------------------------------------------------------------------- state

    @property
    def allocated(self) -> bool:
        return self.plan is not None

    def seq_length(self, layer: int = 0) -> int:
        return self.lengths[layer] if 0 <= layer < self.num_layers else 0

    def is_resident(self, layer: int) -> bool:
        return layer in self._resident

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-length storage of ``layer``: GPU buffers if resident, host-pool views if offloaded."""
        if layer in self._resident:
            return self._resident[layer]
        assert self.pool is not None
        return self.pool.layer(self._host_index[layer])

    def addresses(self) -> dict[str, list[int]]:
        """Data pointers of every buffer (resident, ring, pool): constant for the cache's life unless it grows."""
        out = {"resident": [t.data_ptr() for kv in self._resident.values() for t in kv]}
        out["ring"] = [t.data_ptr() for s in (self.ring.slots if self.ring else []) for t in (s.keys, s.values)]
        out["pool"] = [self.pool.flat.data_ptr()] if self.pool is not None else []
        return out

    # ------------------------------------------------------------------------------------ allocation

    def _backend(self, device: torch.device) -> str:
        b = self.options.backend
        if b == "cuda" and device.type != "cuda":
            raise ValueError(f"backend='cuda' but the keys are on {device}; allowed there: 'auto', 'host-copy', "
                             "'plain'.")
        if b == "auto":
            if device.type == "cuda":
                return "cuda"
            warn_once(f"kv:plain-{device.type}", f"{self.name}: the keys are on {device}, not a CUDA GPU, so nothing "
                      "is offloaded: it runs as a plain preallocated cache (same tokens, no host pool).")
            return "plain"
        return b

    def _default_length(self, needed: int) -> int:
        return int(math.ceil((needed + 256) / 256) * 256)

    def _allocate(self, k: torch.Tensor, v: torch.Tensor, needed: int) -> None:
        b, h, _, dk = k.shape
        dv = v.shape[-1]
        self.batch_size, self.dtype, self.device = b, k.dtype, k.device
        self._kv_shape = (h, dk, dv)
        if self.options.max_length is not None:
            if needed > self.options.max_length:
                raise ValueError(f"max_length={self.options.max_length} is below the prompt: the first forward brings "
                                 f"{needed} tokens. Allowed: max_length >= prompt length + new tokens.")
            max_len = self.options.max_length
        else:
            max_len = self._default_length(needed)
        backend = self._backend(k.device)
        if dk != dv:
            raise ValueError(f"{self.name} needs keys and values of one head size; got {dk} and {dv}.")
        self.plan = self._plan(max_len, backend)
        self._build(max_len)

    def _plan(self, max_len: int, backend: str) -> KVPlan:
        h, d, _ = self._kv_shape  # type: ignore[misc]
        layer_bytes = 2 * self.batch_size * h * max_len * d * torch.empty((), dtype=self.dtype).element_size()
        return make_plan(num_layers=self.num_layers, layer_bytes=layer_bytes, batch_size=self.batch_size,
                         max_length=max_len, resident_layers=self.options.resident_layers,
                         gpu_budget_bytes=self.options.gpu_budget_bytes, num_slots=self.options.num_slots,
                         placement=self.options.placement, backend=backend,
                         free_bytes=_free_gpu_bytes(self.device) if self.device is not None else None,
                         gpu_memory_fraction=self.options.gpu_memory_fraction,
                         device_type=self.device.type if self.device is not None else "cuda")

    def _build(self, max_len: int) -> None:
        plan = self.plan
        assert plan is not None and self._kv_shape is not None and self.device is not None
        h, d, _ = self._kv_shape
        shape = (self.batch_size, h, max_len, d)
        self.max_length = max_len
        self._resident = {i: (torch.empty(shape, dtype=self.dtype, device=self.device),
                              torch.empty(shape, dtype=self.dtype, device=self.device)) for i in plan.resident}
        self._order = plan.offloaded
        self._pos = {layer: p for p, layer in enumerate(self._order)}
        self._host_index = dict(self._pos)
        if plan.offloaded:
            self.transport = KVCudaTransport(self.device) if plan.backend == "cuda" else KVHostCopyTransport()
            self.pool = HostKVPool(len(plan.offloaded), shape, self.dtype, pin=plan.backend == "cuda",
                                   host_memory_fraction=self.options.host_memory_fraction)
            self.ring = StagingRing(plan.slots, shape, self.dtype, self.device)
        else:
            self.transport, self.pool, self.ring = None, None, None

    def _grow(self, needed: int) -> None:
        """Reallocate for a longer ``max_length`` and decide the split again for the larger layers.

        A chunked prefill (transformers' ``prefill_chunk_size``) shows the cache one chunk at a time, so a cache
        sized at first use grows several times during the prompt. Keeping the first split would hold many more
        GPU bytes than the budget once the layers are longer; so the kept tokens are parked on the host, the old
        buffers are dropped (their memory goes back to the allocator, where the new plan may count it as free),
        and the plan is made again, as at first use.
        """
        if self.options.max_length is not None:
            raise ValueError(f"max_length={self.options.max_length} is full: a forward needs {needed} tokens per "
                             "sequence. Allowed: max_length >= prompt length + new tokens.")
        old_len = self.max_length
        new_len = max(self._default_length(needed), 2 * old_len)
        warn_once("kv:grow", f"{self.name}: {needed} tokens do not fit the {old_len} allocated; reallocating for "
                  f"{new_len} (buffers move: pass max_length=prompt+new tokens to allocate once).")
        self.synchronize()
        plan = self.plan
        assert plan is not None
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(self.num_layers):
            n = self.lengths[i]
            if n:
                k, v = self.buffers(i)
                kept[i] = (k[:, :, :n].to("cpu", copy=True), v[:, :, :n].to("cpu", copy=True))
        if self.pool is not None:
            self.pool.release()
        self._resident, self.pool, self.ring, self.transport = {}, None, None, None
        self.plan = self._plan(new_len, plan.backend)
        self._build(new_len)
        for i, (k, v) in kept.items():
            nk, nv = self.buffers(i)
            nk[:, :, : k.shape[2]].copy_(k)
            nv[:, :, : v.shape[2]].copy_(v)
        self.stats.grown += 1

    # ---------------------------------------------------------------------------------------- update

    def update(self, layer: int, key_states: torch.Tensor,
               value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``(B, H, q, D)`` to ``layer`` and return all of its keys and
        values so far, ``(B, H, n, D)`` views of fixed buffers."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer={layer} is outside the {self.num_layers} layers this cache was built for.")
        q = key_states.shape[-2]
        start = self.lengths[layer]
        stop = start + q
        if not self.allocated:
            self._allocate(key_states, value_states, stop)
        elif key_states.shape[0] != self.batch_size or key_states.shape[1] != self._kv_shape[0]:  # type: ignore[index]
            heads = self._kv_shape[0]  # type: ignore[index]
            raise ValueError(f"{self.name} was sized for batch {self.batch_size} x {heads} key/value heads at its "
                             f"first use; layer {layer} brings {tuple(key_states.shape)}. Use a new cache (or reset() "
                             "and the same batch) for another batch size.")
        if stop > self.max_length:
            self._grow(stop)
        self.stats.updates += 1
        if self.ring is not None and self.ring.any_consumed():
            self.ring.release_consumed(self.transport.compute_marker())  # type: ignore[union-attr]
        if layer in self._resident:
            k_buf, v_buf = self._resident[layer]
            k_buf[:, :, start:stop].copy_(key_states)
            v_buf[:, :, start:stop].copy_(value_states)
            self.lengths[layer] = stop
            self._prefetch_after(layer)
            return k_buf[:, :, :stop], v_buf[:, :, :stop]
        slot = self._acquire(layer, start)
        slot.keys[:, :, start:stop].copy_(key_states)
        slot.values[:, :, start:stop].copy_(value_states)
        slot.length, slot.consumed = stop, True
        self._append(layer, slot, start, stop)
        self.lengths[layer] = stop
        self._prefetch_after(layer)
        return slot.keys[:, :, :stop], slot.values[:, :, :stop]

    def _fill(self, slot: Slot, layer: int, length: int) -> None:
        t = self.transport
        assert t is not None and self.pool is not None
        t.copy_waits(slot.free_after)
        hk, hv = self.pool.layer(self._host_index[layer])
        t.fetch_prefix(slot.keys, hk, length, layer, slot.index)
        t.fetch_prefix(slot.values, hv, length, layer, slot.index)
        slot.owner, slot.length = layer, length
        slot.ready = t.copy_marker()
        self.stats.fetches += 1
        self.stats.h2d_bytes += 2 * length * self._token_bytes()

    def _token_bytes(self) -> int:
        h, d, _ = self._kv_shape  # type: ignore[misc]
        return self.batch_size * h * d * torch.empty((), dtype=self.dtype).element_size()

    def _next_use(self, after: int) -> dict[int, int]:
        """Offloaded layer -> how many offloaded updates from now it is next used (after layer ``after``)."""
        n = len(self._order)
        first = next((p for p, layer in enumerate(self._order) if layer > after), n)
        return {self._order[(first + k) % n]: k for k in range(n)}

    def _acquire(self, layer: int, length: int) -> Slot:
        ring, t = self.ring, self.transport
        assert ring is not None and t is not None
        slot = ring.reserved_for(layer)
        if slot is None:
            slot = ring.cached(layer, length)
            if slot is not None:
                slot.reserved, slot.consumed = True, False
                self.stats.ring_hits += 1
        if slot is None:
            slot = ring.take(layer, self._next_use(layer))
            if slot is None:  # cannot happen: slots of earlier layers were just released
                raise RuntimeError(f"{self.name}: no free staging slot for layer {layer}.")
            self._fill(slot, layer, length)
            self.stats.late_fetches += 1
        elif slot.length < length:  # a prefetch issued before the cache was changed (crop, reset)
            self._fill(slot, layer, length)
            self.stats.late_fetches += 1
        slot.length = length
        t.compute_waits(slot.ready)
        return slot

    def _append(self, layer: int, slot: Slot, start: int, stop: int) -> None:
        t = self.transport
        assert t is not None and self.pool is not None
        t.copy_waits(t.compute_marker())
        hk, hv = self.pool.layer(self._host_index[layer])
        t.append(hk, slot.keys, start, stop, layer, slot.index)
        t.append(hv, slot.values, start, stop, layer, slot.index)
        self.stats.d2h_bytes += 2 * (stop - start) * self._token_bytes()

    def _prefetch_after(self, layer: int) -> None:
        ring = self.ring
        if ring is None:
            return
        next_use = self._next_use(layer)
        for j in sorted(next_use, key=next_use.__getitem__):
            if ring.reserved_for(j) is not None:
                continue
            hit = ring.cached(j, self.lengths[j])
            if hit is not None:
                hit.reserved, hit.consumed = True, False
                self.stats.ring_hits += 1
                continue
            slot = ring.take(j, next_use)
            if slot is None:
                return
            self._fill(slot, j, self.lengths[j])
            self.stats.prefetches += 1

    # ------------------------------------------------------------------------------------ management

    def synchronize(self) -> None:
        """Wait for every queued copy (before the host pool is read or the cache changed from the CPU)."""
        if self.transport is not None:
            self.transport.synchronize()

    def reset(self) -> None:
        """Empty the cache, keeping every buffer (same addresses) for the next generation."""
        self.synchronize()
        self.lengths = [0] * self.num_layers
        if self.ring is not None:
            self.ring.invalidate()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``tokens_to_remove`` tokens (a negative number counts from the end, as transformers does;
        a positive one is the length to keep, as in older transformers)."""
        for i in range(self.num_layers):
            n = self.lengths[i]
            keep = n - abs(tokens_to_remove) if tokens_to_remove <= 0 else min(n, tokens_to_remove)
            self.lengths[i] = max(0, keep)
        if self.ring is not None:
            for s in self.ring.slots:
                if s.owner is not None and not s.reserved:
                    s.length = min(s.length, self.lengths[s.owner])

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch (beam search): resident buffers on the GPU, the host pool on the CPU."""
        self.synchronize()
        for k, v in self._resident.values():
            idx = beam_idx.to(k.device)
            k.copy_(k.index_select(0, idx))
            v.copy_(v.index_select(0, idx))
        if self.pool is not None:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            idx = beam_idx.cpu()
            for j in range(self.pool.num_layers):
                for t in self.pool.layer(j):
                    t.copy_(t.index_select(0, idx))
        if self.ring is not None:
            self.ring.invalidate()

    def reset_stats(self) -> None:
        self.stats = KVStats()

    def close(self) -> None:
        """Wait for copies and unlock the host pool; the engine is empty afterwards and reallocates on next use."""
        self.synchronize()
        if self.pool is not None:
            self.pool.release()
        self.pool = self.ring = self.transport = None
        self._resident = {}
        self.plan = None
        self.lengths = [0] * self.num_layers

    def describe(self) -> str:
        return self.plan.describe() if self.plan else f"{self.name}: not allocated yet (sized at first use)"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan": self.plan.to_dict() if self.plan else None, "stats": self.stats.to_dict()}
        return out
