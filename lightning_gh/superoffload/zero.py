"""SuperOffload across ranks, ZeRO-1/2 style: each rank owns a share of the offloaded parameters' fp32
master weights and AdamW moments in host memory, receives their gradients summed over the ranks as backward
produces them, updates them on its own CPU, and sends the updated weights to every rank.

Partition
    Whole parameters, not element ranges: the offloaded parameters, in bucket order (the module's parameter order
    reversed, the order gradients arrive in), are cut into buckets, and the buckets are dealt to the ranks in the
    order the next forward needs them, each to the rank holding the fewest parameters so far (:func:`deal`). The
    forward's consecutive buckets then belong to different ranks, so every rank's CPU updates its part of the
    model's first layers at once instead of one rank's CPU working through the first half of the model while the
    others wait for the forward to reach theirs. Owning whole tensors keeps every per-parameter computation (its
    gradient norm, its fused AdamW update) identical to the single-process one, which is what makes the result
    bitwise equal to ``clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)``; flat element slices would split a
    tensor's norm across ranks and change its summation order. The cost is balance: a rank's share can exceed
    ``1/N`` by up to one bucket.

Per step (``N`` ranks, each its own process)
    1. Backward: each gradient is copied (fp32) into its bucket's staging buffer; a full bucket is reduced (sum)
       onto its owner (``torch.distributed.reduce``: NCCL on GPUs, on the gradient copy stream; gloo on CPUs).
       The owner divides by ``N`` (the average of the ranks' mean gradients), takes each parameter's norm, copies
       the bucket to its host gradient buffer and hands it to its CPU worker, while backward goes on.
    2. ``step()``: the per-parameter norms (each written by its owner only, zeros elsewhere) are summed over the
       ranks (``x + 0 = x`` exactly, so every rank gets the same vector) and combined in parameter order as
       ``clip_grad_norm_`` combines them. Every rank reaches the same clip/skip decision; speculation and exact
       rollback work per rank as on one device. Parameters kept on the GPU are either replicated (``gpu_fraction``
       > 0, or the auto tail where the whole state fits on every GPU): their gradients are all-reduced and every
       rank updates them; or sharded (the auto tail otherwise, :meth:`RankShard.shard_to_devices`): their
       gradients are reduced onto the owner, which updates them on its GPU and broadcasts their weights.
    3. The next forward (a forward pre-hook per module, as on one device): the owner waits for its bucket's update
       and every rank receives the bucket's weights by ``broadcast`` from the owner, just before the layer needs
       them.

Every collective is issued in the same order on every rank (bucket order during backward; at ``step()`` the GPU
tail's reduces in parameter order, the norms, the sharded tail's broadcasts; then the buckets the forward needs;
the auto tail's decision, once, at the end of a step), so the ranks must produce gradients for the same
parameters each step, as under DDP without ``find_unused_parameters``.

:class:`RankShard` does this for :class:`~lightning_gh.superoffload.HeterogeneousAdamW`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_gh import hardware
from lightning_gh.superoffload import numa
from lightning_gh.superoffload.layout import Bucket, HostLayout, Slot, chunk_by_size
from lightning_gh.superoffload.step import GradNorms, StepCtx
from lightning_gh.superoffload.tail_mover import TAIL_UPDATE_CHUNK

__all__ = ["RankGroup", "RankShard", "current_group", "deal", "default_cpu_threads", "rank_cpu_threads"]


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


def deal(numels: list[int], ranks: int) -> list[int]:
    """The owner of each bucket: the buckets (``numels``, their sizes in bucket order, the order gradients arrive in)
    are dealt in the order the next forward needs them, the last bucket first, each to the rank holding the fewest
    parameters so far (the lowest such rank on a tie).

    Args:
        numels: bucket sizes, in bucket order.
        ranks: number of ranks (>= 1).

    Example::

        >>> deal([4, 4, 4, 4], 2)
        [1, 0, 1, 0]
        >>> deal([10, 1, 1], 2)
        [0, 1, 0]
    """
    if not (isinstance(ranks, int) and ranks >= 1):
        raise ValueError(f"ranks={ranks!r} must be an int >= 1.")
    held = [0] * ranks
    owners = [0] * len(numels)
    for i in reversed(range(len(numels))):
        r = min(range(ranks), key=lambda q: (held[q], q))
        owners[i] = r
        held[r] += numels[i]
    return owners


def rank_cpu_threads(cuda: bool, local_ranks: int) -> int:
    """CPU threads for one rank's CPU AdamW: its share of the CPUs this process may use, less two with CUDA for
    the training loop and the data loader's main thread (at least one).

    Example::

        >>> rank_cpu_threads(cuda=False, local_ranks=1) >= 1
        True
    """
    bound = numa.bound_cpus()  # already this rank's own share: See Note [A rank's CPUs near its GPU]
    share = len(bound) if bound is not None else hardware.cpus_available() // max(1, local_ranks)
    return max(1, share - 2 if cuda else share)


def default_cpu_threads(cuda: bool, local_ranks: int | None) -> int:
    """CPU threads for the CPU AdamW when the options leave them open: a rank's share over several ranks
    (:func:`rank_cpu_threads`), else this process's CPUs less two with CUDA (the training loop and the data
    loader's main thread), torch's own thread count on the CPU."""
    if local_ranks is not None:
        return rank_cpu_threads(cuda, local_ranks)
    return max(1, hardware.cpus_available() - 2) if cuda else torch.get_num_threads()


class _Slice:
    """A bucket's part of the one host block: looks like a :class:`~lightning_gh._host.HostBuffer` to the rest of
    the optimizer; the block itself is released once, by the shard."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def release(self) -> None:
        pass


class RankShard:
    """This rank's share of the host state, and the collectives: gradient reduce onto the owner, norm sum,
    GPU-tail gradient reduce (replicated or sharded), weight broadcast, and the gather of the unsharded state dict.

    Args:
        group: the ranks.
        layout: the optimizer's host layout (the same buckets on every rank).
        norms: the optimizer's per-parameter gradient norms.
        copy_stream: the CUDA stream of the gradient copies and reduces, or ``None`` off CUDA.
    """

    def __init__(self, group: RankGroup, layout: HostLayout, norms: GradNorms, copy_stream: Any) -> None:
        self.group = group
        self.layout = layout
        self.norms = norms
        self.copy_stream = copy_stream
        self._block: Any = None  # one page-locked block: master weights, gradients (and second master copies)
        self._moments: torch.Tensor | None = None
        self._owned_numel = 0
        self._offset = 0
        self._alt_offset = 0

    @property
    def _cuda(self) -> bool:
        return self.layout.cuda

    @property
    def _device(self) -> torch.device:
        return self.layout.device

    # ------------------------------------------------------------------ layout
    def cut(self, host_slots: list[Slot], bucket_size: int) -> list[tuple[list[Slot], int]]:
        """Cut the host slots into buckets, at least two per rank where the parameters allow (smaller than
        ``bucket_size`` if need be), and give each its owner (:func:`deal`): ``[(slots, owner), ...]``."""
        least = sum(s.numel for s in host_slots) // (2 * self.group.size)
        chunks = chunk_by_size(host_slots, max(1, min(bucket_size, least)))
        return list(zip(chunks, deal([sum(s.numel for s in c) for c in chunks], self.group.size)))

    def alloc_block(self, owned_numel: int, alt_numel: int = 0) -> None:
        """One page-locked block for this rank's master weights and gradient buffers (and the second copy of the
        master weights of the ``alt_numel`` parameters that speculate with two-copy rollback), one for its moments
        (and their second copy)."""
        from lightning_gh._host import HostBuffer

        self._block = HostBuffer(2 * owned_numel + alt_numel, pin=self._cuda, zero=False)
        self._moments = torch.zeros(2 * (owned_numel + alt_numel), dtype=torch.float32)
        self._owned_numel = owned_numel
        self._offset = self._alt_offset = 0

    def slice_block(self, numel: int, alt: bool) -> tuple[_Slice, _Slice, torch.Tensor, _Slice | None,
                                                          torch.Tensor | None]:
        """A bucket's (master, gradient, moments, second master or None, second moments or None)."""
        total, o = self._owned_numel, self._offset
        self._offset += numel
        t, mb = self._block.tensor, self._moments
        out = (_Slice(t[o:o + numel]), _Slice(t[total + o:total + o + numel]), mb[2 * o:2 * o + 2 * numel])
        if not alt:
            return (*out, None, None)
        a = self._alt_offset
        self._alt_offset += numel
        return (*out, _Slice(t[2 * total + a:2 * total + a + numel]),
                mb[2 * total + 2 * a:2 * total + 2 * a + 2 * numel])

    def release(self) -> None:
        """Unpin the rank's host block (its buckets' buffers are slices of it)."""
        if self._block is not None:
            self._block.release()
            self._block = self._moments = None

    # ------------------------------------------------------------------ backward: gradients to their owner
    def stage_grad(self, b: Bucket, slot: Slot, grad: torch.Tensor) -> None:
        """Copy one gradient (fp32) into its bucket's staging buffer; free it on the GPU."""
        if b.staging is None:
            if self._cuda:
                with torch.cuda.stream(self.copy_stream):
                    b.staging = torch.zeros(b.numel, dtype=torch.float32, device=self._device)
            else:  # the owner reduces straight into its host gradient buffer
                b.staging = b.grad_buf.tensor.zero_() if self.layout.owns(b) else torch.zeros(b.numel)
        view = b.staging[slot.offset:slot.offset + slot.numel].view(slot.param.shape)
        if self._cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self.copy_stream):
                view.copy_(grad)
            grad.record_stream(self.copy_stream)
            slot.param.grad = None
        else:
            view.copy_(grad)

    def reduce_bucket(self, b: Bucket, ctx: StepCtx, max_grad_value: float | None) -> None:
        """Sum the bucket's gradients onto its owner; there, average, clamp, take the norms and land them on the
        host."""
        flat = b.staging
        b.staging = None
        if self._cuda:
            with torch.cuda.stream(self.copy_stream):
                dist.reduce(flat, dst=b.owner, op=dist.ReduceOp.SUM)
                if self.layout.owns(b):
                    self._reduced(b, flat, ctx, max_grad_value)
                    b.grad_buf.tensor.copy_(flat, non_blocking=True)
        else:
            dist.reduce(flat, dst=b.owner, op=dist.ReduceOp.SUM)
            if self.layout.owns(b):
                self._reduced(b, flat, ctx, max_grad_value)

    def _reduced(self, b: Bucket, flat: torch.Tensor, ctx: StepCtx, max_grad_value: float | None) -> None:
        flat.div_(self.group.size)
        if max_grad_value is not None:
            flat.clamp_(-max_grad_value, max_grad_value)
        if ctx.needs_validation and b.active:
            self.norms.write(b.active, [flat[s.offset:s.offset + s.numel].view(s.param.shape) for s in b.active])

    # ------------------------------------------------------------------ step: tail and norms
    def reduce_tail(self, ctx: StepCtx, max_grad_value: float | None) -> None:
        """Average the GPU tail's gradients over the ranks and take their norms: a replicated parameter's on every
        rank (all-reduce; rank 0 writes its norm; the average goes back into ``param.grad``), a sharded one's onto
        its owner (reduce; the owner keeps the fp32 average in ``avg_grad`` for its update and writes its norm;
        every rank frees ``param.grad``). In parameter order, the same on every rank whatever order backward
        produced the gradients in, a chunk of parameters at a time, so the fp32 copies cost one chunk of GPU
        memory."""
        by_owner: dict[int, list[Slot]] = {}
        for i in sorted(ctx.arrival):
            s = self.layout.slots[i]
            if s.residency == "device" and s.param.grad is not None:
                by_owner.setdefault(-1 if s.owner is None else s.owner, []).append(s)
        for owner in sorted(by_owner):
            for chunk in chunk_by_size(by_owner[owner], TAIL_UPDATE_CHUNK):
                self._reduce_tail_chunk(chunk, None if owner < 0 else owner, ctx, max_grad_value)

    def _reduce_tail_chunk(self, slots: list[Slot], owner: int | None, ctx: StepCtx,
                           max_grad_value: float | None) -> None:
        grads = [s.param.grad for s in slots]
        flat = torch.empty(sum(s.numel for s in slots), dtype=torch.float32, device=grads[0].device)
        views = [v.view(g.shape) for v, g in zip(flat.split([s.numel for s in slots]), grads)]
        for v, g in zip(views, grads):
            v.copy_(g)
        if owner is None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        else:
            dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM)
            for s in slots:  # the owner updates from the fp32 average, as a host bucket does
                s.param.grad = None
            if owner != self.group.rank:  # another rank updates these parameters and sends their weights
                return
        flat.div_(self.group.size)
        if max_grad_value is not None:
            flat.clamp_(-max_grad_value, max_grad_value)
        for s, g, v in zip(slots, grads, views):
            if owner is None:
                g.copy_(v)
            else:
                s.avg_grad = v
        # one rank contributes each norm, the sum over ranks adds zeros
        if ctx.needs_validation and (owner is not None or self.group.rank == 0):
            self.norms.write(slots, views)

    def broadcast_tail(self, slots: list[Slot]) -> None:
        """Send the new weights of the sharded GPU tail's ``slots`` (the same list on every rank) from each owner to
        every rank, after the owners' update in ``step()``: per owner and dtype, a chunk of parameters at a time."""
        by_key: dict[tuple[int, str], list[Slot]] = {}
        for s in sorted(slots, key=lambda s: s.index):  # parameter order: the same on every rank
            if s.owner is not None:
                by_key.setdefault((s.owner, str(s.param.dtype)), []).append(s)
        for (owner, _), group in sorted(by_key.items()):
            for chunk in chunk_by_size(group, TAIL_UPDATE_CHUNK):
                self._send_weights([s.param for s in chunk], owner)

    def sum_norms(self) -> None:
        """Every rank gets every parameter's norm (written by its owner, zero elsewhere: the sum is exact)."""
        if self._cuda:
            torch.cuda.current_stream(self._device).wait_stream(self.copy_stream)
        dist.all_reduce(self.norms.vector, op=dist.ReduceOp.SUM)

    # ------------------------------------------------------------------ forward: weights from their owner
    def broadcast(self, b: Bucket) -> None:
        """Send the bucket's committed weights from its owner to every rank (once per step)."""
        if b.step_id < 0 or b.bcast_step == b.step_id:
            return
        b.bcast_step = b.step_id
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for s in b.active:
            by_dtype.setdefault(s.param.dtype, []).append(s.param)
        for params in by_dtype.values():
            self._send_weights(params, b.owner)

    def _send_weights(self, params: list[torch.Tensor], owner: int) -> None:
        """Broadcast ``params`` (one dtype, the same list on every rank) from rank ``owner`` into every rank's
        copies, as one flat tensor."""
        with torch.no_grad():
            params = [p.detach() for p in params]
            mine = owner == self.group.rank
            flat = torch.cat([p.reshape(-1) for p in params]) if mine else \
                torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            dist.broadcast(flat, src=owner)
            if not mine:
                parts = flat.split([p.numel() for p in params])
                torch._foreach_copy_(params, [f.view(p.shape) for f, p in zip(parts, params)])

    # ------------------------------------------------------------------ state: unsharded
    def bucket_state(self, b: Bucket) -> torch.Tensor:
        """The bucket's ``[master | exp_avg | exp_avg_sq | steps]`` on every rank (a CPU tensor), sent by its owner."""
        n, k = b.numel, len(b.slots)
        dev = self._device if self.group.tensors_on_gpu else torch.device("cpu")
        packed = torch.empty(3 * n + k, dtype=torch.float32, device=dev)
        if self.layout.owns(b):
            packed[:n].copy_(b.master_buf.tensor)
            packed[n:3 * n].copy_(b.moments)
            packed[3 * n:].copy_(torch.stack([s.step.reshape(()) for s in b.slots]))
        dist.broadcast(packed, src=b.owner)
        return packed.cpu()

    def bucket_slot_states(self, b: Bucket) -> dict[int, dict[str, torch.Tensor]]:
        """Each of the bucket's parameters' ``step``, ``master``, ``exp_avg``, ``exp_avg_sq`` (CPU tensors) on every
        rank, by slot index: :meth:`bucket_state` unpacked (a collective)."""
        packed = self.bucket_state(b)
        n = b.numel
        out = {}
        for j, s in enumerate(b.slots):
            o = s.offset
            out[s.index] = {"step": packed[3 * n + j].clone(), "master": packed[o:o + s.numel],
                            "exp_avg": packed[n + o:n + o + s.numel],
                            "exp_avg_sq": packed[2 * n + o:2 * n + o + s.numel]}
        return out

    def gather_host_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's state that lives on one rank only (host buckets, the sharded GPU tail), from whichever
        rank owns it (a collective; CPU tensors)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for b in self.layout.buckets:
            out.update(self.bucket_slot_states(b))
        for s in self.layout.slots:
            if s.residency == "device" and s.owner is not None:
                out[s.index] = self._tail_slot_state(s)
        return out

    def _tail_slot_state(self, s: Slot) -> dict[str, torch.Tensor]:
        """A sharded GPU-tail parameter's ``step``, ``master``, ``exp_avg``, ``exp_avg_sq`` (CPU tensors), sent by its
        owner a chunk of ``TAIL_UPDATE_CHUNK`` elements at a time, so a large parameter (the embedding) costs the
        ranks' GPUs one chunk, not 12 B per element."""
        mine = s.step is not None
        sources = (s.param.detach() if s.dev_master is None else s.dev_master, s.exp_avg, s.exp_avg_sq) if mine \
            else (None, None, None)
        out = {k: self._broadcast_rows(src, s.numel, s.owner)
               for k, src in zip(("master", "exp_avg", "exp_avg_sq"), sources)}
        out["step"] = self._broadcast_rows(s.step, 1, s.owner)[0].clone()
        return out

    def _broadcast_rows(self, src: torch.Tensor | None, n: int, owner: int) -> torch.Tensor:
        """``src`` (``n`` elements on rank ``owner``, ``None`` elsewhere) on every rank as an fp32 CPU tensor, a
        chunk at a time (a collective)."""
        dev = self._device if self.group.tensors_on_gpu else torch.device("cpu")
        out = torch.empty(n, dtype=torch.float32)
        flat = None if src is None else src.reshape(-1)
        for lo in range(0, n, TAIL_UPDATE_CHUNK):
            hi = min(n, lo + TAIL_UPDATE_CHUNK)
            buf = torch.empty(hi - lo, dtype=torch.float32, device=dev)
            if flat is not None:
                buf.copy_(flat[lo:hi])
            dist.broadcast(buf, src=owner)
            out[lo:hi].copy_(buf)
        return out

    def all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a collective)."""
        t = torch.tensor([1.0 if flag else 0.0],
                         device=self._device if self.group.tensors_on_gpu else torch.device("cpu"))
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return float(t) >= 1.0

    def least(self, value: int) -> int:
        """The least of ``value`` over the ranks (a collective)."""
        t = torch.tensor([value], dtype=torch.int64,
                         device=self._device if self.group.tensors_on_gpu else torch.device("cpu"))
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    def shard_to_devices(self, chosen: set[int]) -> bool:
        """Move the host buckets whose index is in ``chosen`` (the same on every rank) to the sharded GPU tail: each
        owner puts its buckets' state on its GPU and updates them there in ``step()``; the other ranks keep no state
        for them and receive their weights after each update (:meth:`broadcast_tail`). A collective (the caller
        holds the layout's lock and has synchronized). Returns ``False``, with nothing moved on any rank, when some
        rank's GPU ran out of memory on the way."""
        lay = self.layout
        moving = [b for b in lay.buckets if b.index in chosen]
        staged = lay.stage_device_state([s for b in moving if lay.owns(b) for s in b.slots])
        if not self.all_agree(staged is not None):
            return False  # what was allocated is dropped; the host state was only read
        for s, st in staged:
            lay.install_device_state(s, st)
        for b in moving:
            for s in b.slots:
                s.residency, s.bucket, s.owner = "device", None, b.owner
            lay.buckets.remove(b)
            b.release_host()  # an owner's buffers are slices of its host block, released with it
        if not any(lay.owns(b) for b in lay.buckets):
            self.release()  # the rank's page-locked host block held only the buckets that moved
        return True

    def replicate_to_devices(self) -> None:
        """Send every bucket's state from its owner to every rank's GPU tail and drop the host buckets (a
        collective; the caller holds the layout's lock and has synchronized)."""
        for b in list(self.layout.buckets):
            states = self.bucket_slot_states(b)
            for s in b.slots:
                self.layout.install_device_state(s, self.layout.device_state(s, states[s.index]))
            self.layout.buckets.remove(b)
            b.release_host()
        self.release()  # the rank's page-locked host block held only those buckets
