"""SuperOffload across ranks, ZeRO-1/2 style: each rank owns a contiguous share of the offloaded parameters' fp32
master weights and AdamW moments in host memory, receives their gradients summed over the ranks as backward
produces them, updates them on its own CPU, and sends the updated weights to every rank.

Partition
    Whole parameters, not element ranges: the offloaded parameters, in bucket order (the module's parameter order
    reversed, the order gradients arrive in), are cut into ``N`` contiguous runs of about equal size
    (:func:`partition`). Owning whole tensors keeps every per-parameter computation (its gradient norm, its fused
    AdamW update) identical to the single-process one, which is what makes the result bitwise equal to
    ``clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)``; flat element slices would split a tensor's norm
    across ranks and change its summation order. The cost is balance: a rank's share can exceed ``1/N`` by up to
    one parameter (the largest, usually the embedding).

Per step (``N`` ranks, each its own process)
    1. Backward: each gradient is copied (fp32) into its bucket's staging buffer; a full bucket is reduced (sum)
       onto its owner (``torch.distributed.reduce``: NCCL on GPUs, on the gradient copy stream; gloo on CPUs).
       The owner divides by ``N`` (the average of the ranks' mean gradients), takes each parameter's norm, copies
       the bucket to its host gradient buffer and hands it to its CPU worker, while backward goes on.
    2. ``step()``: the per-parameter norms (each written by its owner only, zeros elsewhere) are summed over the
       ranks (``x + 0 = x`` exactly, so every rank gets the same vector) and combined in parameter order as
       ``clip_grad_norm_`` combines them. Every rank reaches the same clip/skip decision; speculation and exact
       rollback work per rank as on one device. Parameters kept on the GPU (``gpu_fraction`` > 0) are replicated:
       their gradients are all-reduced and every rank updates them.
    3. The next forward (a forward pre-hook per module, as on one device): the owner waits for its bucket's update
       and every rank receives the bucket's weights by ``broadcast`` from the owner, just before the layer needs
       them.

Every collective is issued in the same order on every rank (bucket order during backward, then the norms, then
the buckets the forward needs), so the ranks must produce gradients for the same parameters each step, as under
DDP without ``find_unused_parameters``.

:class:`ShardMixin` is that part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_gh import hardware
from lightning_gh.superoffload.layout import Bucket, Slot

__all__ = ["RankGroup", "ShardMixin", "current_group", "partition", "rank_cpu_threads"]


@dataclass(frozen=True)
class RankGroup:
    """The ranks an optimizer shards its state over.

    Attributes:
        rank: this process's rank in the default process group.
        size: ranks in the group (>= 2; one rank is the single-device optimizer).
        backend: ``"nccl"`` or ``"gloo"`` (what the collectives need their tensors on).
        local_size: ranks on this host sharing its memory and CPUs.
    """

    rank: int
    size: int
    backend: str
    local_size: int

    @property
    def tensors_on_gpu(self) -> bool:
        return "nccl" in self.backend


def current_group() -> RankGroup | None:
    """The default process group as a :class:`RankGroup`, or ``None`` outside a distributed run of 2+ ranks.

    Example::

        >>> current_group() is None  # no process group initialised here
        True
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    from lightning_gh.superoffload.memory import local_world_size

    return RankGroup(rank=dist.get_rank(), size=dist.get_world_size(), backend=str(dist.get_backend()),
                     local_size=min(local_world_size(), dist.get_world_size()))


def partition(numels: list[int], ranks: int) -> list[int]:
    """The owner of each parameter: ``ranks`` contiguous runs of about ``sum(numels) / ranks`` elements each.

    A parameter belongs to the rank whose share holds its midpoint, so owners never decrease along the list and a
    large parameter lands where most of it falls.

    Args:
        numels: parameter sizes, in bucket order.
        ranks: number of ranks (>= 1).

    Example::

        >>> partition([4, 4, 4, 4], 2)
        [0, 0, 1, 1]
        >>> partition([10, 1, 1], 2)
        [0, 1, 1]
    """
    if not (isinstance(ranks, int) and ranks >= 1):
        raise ValueError(f"ranks={ranks!r} must be an int >= 1.")
    total = sum(numels)
    owners: list[int] = []
    acc = 0
    for n in numels:
        mid = acc + n / 2
        owners.append(min(ranks - 1, int(ranks * mid / total)) if total else 0)
        acc += n
    return owners


def rank_cpu_threads(cuda: bool, local_ranks: int) -> int:
    """CPU threads for one rank's CPU AdamW: its share of the CPUs this process may use, less two with CUDA for
    the training loop and the data loader's main thread (at least one).

    Example::

        >>> rank_cpu_threads(cuda=False, local_ranks=1) >= 1
        True
    """
    share = hardware.cpus_available() // max(1, local_ranks)
    return max(1, share - 2 if cuda else share)


class _Slice:
    """A bucket's part of the one host block: looks like a :class:`~lightning_gh._host.HostBuffer` to the rest of
    the optimizer; the block itself is released once, by the optimizer."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def release(self) -> None:
        pass


class ShardMixin:
    """Partitions the host buckets over the ranks and runs the collectives: gradient reduce onto the owner,
    norm sum, replicated-tail all-reduce, weight broadcast, and the gather of the unsharded state dict.

    A part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW`; ``self._rg`` is ``None`` on one rank, and
    then none of these methods is called.
    """

    _rg: RankGroup | None
    _slots: list[Slot]
    _buckets: list[Bucket]
    _cuda: bool

    # ------------------------------------------------------------------ layout
    def _owned(self, b: Bucket) -> bool:
        return self._rg is None or b.owner == self._rg.rank

    def _shard_buckets(self, host_slots: list[Slot], chunk: Any) -> list[tuple[list[Slot], int]]:
        """Cut the host slots into buckets that never straddle two owners: ``[(slots, owner), ...]``."""
        rg = self._rg
        owners = partition([s.numel for s in host_slots], rg.size)
        out: list[tuple[list[Slot], int]] = []
        for r in range(rg.size):
            run = [s for s, o in zip(host_slots, owners) if o == r]
            out += [(c, r) for c in chunk(run, self.bucket_size)]
        return out

    def _alloc_block(self, owned_numel: int, alt: bool = False) -> None:
        """One page-locked block for this rank's master weights and gradient buffers (and the second copy of the
        master weights with two-copy rollback), one for its moments (twice as long with two-copy rollback)."""
        from lightning_gh._host import HostBuffer

        copies = 2 if alt else 1
        self._block = HostBuffer((1 + copies) * owned_numel, pin=self._cuda, zero=False)
        self._moment_block = torch.zeros(2 * copies * owned_numel, dtype=torch.float32)
        self._block_alt = alt
        self._block_off = 0

    def _slice_block(self, numel: int) -> tuple[_Slice, _Slice, torch.Tensor, _Slice | None, torch.Tensor | None]:
        """A bucket's (master, gradient, moments, second master or None, second moments or None)."""
        copies = 2 if self._block_alt else 1
        total = self._block.numel // (1 + copies)
        o = self._block_off
        self._block_off += numel
        t, mb = self._block.tensor, self._moment_block
        alt = (_Slice(t[2 * total + o:2 * total + o + numel]), mb[2 * total + 2 * o:2 * total + 2 * o + 2 * numel])
        return (_Slice(t[o:o + numel]), _Slice(t[total + o:total + o + numel]), mb[2 * o:2 * o + 2 * numel],
                *(alt if self._block_alt else (None, None)))

    # ------------------------------------------------------------------ backward: gradients to their owner
    def _stage_grad(self, b: Bucket, slot: Slot, grad: torch.Tensor) -> None:
        """Copy one gradient (fp32) into its bucket's staging buffer; free it on the GPU."""
        if b.staging is None:
            if self._cuda:
                with torch.cuda.stream(self._copy_stream):
                    b.staging = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
            else:  # the owner reduces straight into its host gradient buffer
                b.staging = b.grad_buf.tensor.zero_() if self._owned(b) else torch.zeros(b.numel)
        view = b.staging[slot.offset:slot.offset + slot.numel].view(slot.param.shape)
        if self._cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                view.copy_(grad)
            grad.record_stream(self._copy_stream)
            slot.param.grad = None
        else:
            view.copy_(grad)

    def _reduce_bucket(self, b: Bucket, ctx: Any) -> None:
        """Sum the bucket's gradients onto its owner; there, average, clamp, take the norms and land them on the host."""
        flat = b.staging
        b.staging = None
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                dist.reduce(flat, dst=b.owner, op=dist.ReduceOp.SUM)
                if self._owned(b):
                    self._reduced(b, flat, ctx)
                    b.grad_buf.tensor.copy_(flat, non_blocking=True)
        else:
            dist.reduce(flat, dst=b.owner, op=dist.ReduceOp.SUM)
            if self._owned(b):
                self._reduced(b, flat, ctx)

    def _reduced(self, b: Bucket, flat: torch.Tensor, ctx: Any) -> None:
        flat.div_(self._rg.size)
        if self.max_grad_value is not None:
            flat.clamp_(-self.max_grad_value, self.max_grad_value)
        if ctx.needs_validation and b.active:
            views = [flat[s.offset:s.offset + s.numel].view(s.param.shape) for s in b.active]
            self._norms.index_copy_(0, self._index_tensor(b.active), torch.stack(torch._foreach_norm(views, 2.0)))

    def _index_tensor(self, slots: list[Slot]) -> torch.Tensor:
        """The slots' indices on the norms' device, cached: building one from a list in a gradient hook would copy
        from pageable memory, which waits for the copy stream (and so for the reduce) on CUDA."""
        key = tuple(s.index for s in slots)
        cache = self.__dict__.setdefault("_index_cache", {})
        t = cache.get(key)
        if t is None:
            t = cache[key] = torch.tensor(key, device=self._norms.device)
        return t

    # ------------------------------------------------------------------ step: tail and norms
    def _reduce_tail(self, ctx: Any) -> None:
        """All-reduce the replicated GPU tail's gradients (average over the ranks) and take their norms."""
        slots = [self._slots[i] for i in ctx.arrival
                 if self._slots[i].residency == "device" and self._slots[i].param.grad is not None]
        if not slots:
            return
        grads = [s.param.grad for s in slots]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(self._rg.size)
        if self.max_grad_value is not None:
            flat.clamp_(-self.max_grad_value, self.max_grad_value)
        off = 0
        views = []
        for s, g in zip(slots, grads):
            v = flat[off:off + s.numel].view(g.shape)
            g.copy_(v)
            views.append(v)
            off += s.numel
        if ctx.needs_validation and self._rg.rank == 0:  # one rank contributes, the sum over ranks adds zeros
            self._norms.index_copy_(0, self._index_tensor(slots), torch.stack(torch._foreach_norm(views, 2.0)))

    def _sum_norms(self) -> None:
        """Every rank gets every parameter's norm (written by its owner, zero elsewhere: the sum is exact)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        dist.all_reduce(self._norms, op=dist.ReduceOp.SUM)

    # ------------------------------------------------------------------ forward: weights from their owner
    def _broadcast_bucket(self, b: Bucket) -> None:
        """Send the bucket's committed weights from its owner to every rank (once per step)."""
        if b.step_id < 0 or b.bcast_step == b.step_id:
            return
        b.bcast_step = b.step_id
        owner = self._owned(b)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for s in b.active:
            by_dtype.setdefault(s.param.dtype, []).append(s.param)
        with torch.no_grad():
            for dtype, params in by_dtype.items():
                if owner:
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                else:
                    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
                dist.broadcast(flat, src=b.owner)
                if not owner:
                    off = 0
                    for p in params:
                        p.detach().copy_(flat[off:off + p.numel()].view(p.shape))
                        off += p.numel()

    def _broadcast_pending(self) -> None:
        """Broadcast every bucket of the last finished step not yet sent (before a checkpoint, or without hooks)."""
        for b in self._buckets:
            if b.step_id == self._closed_step:
                self._wait_ready(b, stall=False)
                self._broadcast_bucket(b)

    # ------------------------------------------------------------------ state dict: unsharded
    def _bucket_state(self, b: Bucket) -> torch.Tensor:
        """The bucket's ``[master | exp_avg | exp_avg_sq | steps]`` on every rank (a CPU tensor), sent by its owner."""
        n, k = b.numel, len(b.slots)
        dev = self.device if self._rg.tensors_on_gpu else torch.device("cpu")
        packed = torch.empty(3 * n + k, dtype=torch.float32, device=dev)
        if self._owned(b):
            packed[:n].copy_(b.master_buf.tensor)
            packed[n:3 * n].copy_(b.moments)
            packed[3 * n:].copy_(torch.stack([s.step.reshape(()) for s in b.slots]))
        dist.broadcast(packed, src=b.owner)
        return packed.cpu()

    def _bucket_slot_states(self, b: Bucket) -> dict[int, dict[str, torch.Tensor]]:
        """Each of the bucket's parameters' ``step``, ``master``, ``exp_avg``, ``exp_avg_sq`` (CPU tensors) on every
        rank, by slot index: :meth:`_bucket_state` unpacked (a collective)."""
        packed = self._bucket_state(b)
        n = b.numel
        out = {}
        for j, s in enumerate(b.slots):
            o = s.offset
            out[s.index] = {"step": packed[3 * n + j].clone(), "master": packed[o:o + s.numel],
                            "exp_avg": packed[n + o:n + o + s.numel],
                            "exp_avg_sq": packed[2 * n + o:2 * n + o + s.numel]}
        return out
