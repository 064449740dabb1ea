"""The gradients of one ZeRO-3 step (:class:`~.fsdp_optimizer.ShardedHostAdamW`): per FSDP unit, the local gradient
rows go to the unit's host buffer and the norms the exact clip needs are taken, as soon as FSDP2 has
reduce-scattered the unit's gradients (during backward; the GPU gradients are then released, except those of the
units whose state lives on the device, which ``step()`` updates there), or in ``step()`` for
the units whose gradients did not arrive that way (:class:`UnitGradients`). See Note [ZeRO-3 step and the forward's
wait] in :mod:`.fsdp_optimizer`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_gh.superoffload.fsdp_units import HostUnit, LocalShard, local_rows, norm_owner
from lightning_gh.superoffload.step import GradNorms

__all__ = ["UnitGradients"]

ACCUMULATION_HINT = (
    "For gradient accumulation, run the backward passes that do not complete a step inside "
    "`with optimizer.accumulating():` (Lightning's accumulate_grad_batches does this under "
    "SuperOffloadFSDPStrategy), or call model.set_requires_gradient_sync(False) for them, or turn streaming off "
    "with optimizer.set_gradient_streaming(False).")


class UnitGradients:
    """Moves each unit's gradient rows to its host buffer and takes their norms, once per step.

    Args:
        units: the optimizer's units (their shards hold the parameters).
        params: the optimizer's parameters, in its order (a norm's slot is the parameter's index).
        pg, world, rank: the data-parallel process group, its size and this rank in it.
        device: the parameters' device (the norms live there).
        stream: the side stream of the device-to-host copies on CUDA, else ``None`` (plain copies).
        wait: ``wait(unit)`` returns once the unit's last update has read its host gradient rows.
        prepare: ``prepare()`` runs before the first unit of a step is taken (the optimizer places the units'
            state there, once).
        validating: ``validating()`` says whether the step being formed needs the norms (clipping or the
            non-finite check).
        stats: the optimizer's stats (``streamed_units`` is counted here).
    """

    def __init__(self, units: list[HostUnit], params: list[torch.Tensor], *, pg: Any, world: int, rank: int,
                 device: torch.device, stream: Any, wait: Callable[[HostUnit], None],
                 validating: Callable[[], bool], stats: dict[str, Any],
                 prepare: Callable[[], None] = lambda: None) -> None:
        self.units = units
        self.params = params
        self.pg, self.world, self.rank, self.device = pg, world, rank, device
        self.stream = stream
        # the norms' stream: FSDP2 runs the hooks in its post-reduce stream, which has a high priority; the
        # exchange and the norms take SMs beside backward's compute at the compute stream's (normal) priority
        self.norm_stream = torch.cuda.Stream(device) if stream is not None else None
        self.wait = wait
        self.prepare = prepare
        self.validating = validating
        self.stats = stats
        self.norms = GradNorms(device)
        self.accumulating = False  # inside optimizer.accumulating(): gradients stay in param.grad
        self.streaming = True
        self.taken: dict[int, bool] = {}  # units taken since the last step -> whether their norms were taken
        self.arrived: dict[int, int] = {}  # gradients arrived per unit in this backward
        self.opened = False  # the norm vector was cleared for this step
        self.handles: list[Any] = []
        self._idx: dict[tuple[int, ...], torch.Tensor] = {}
        self._peers: dict[int, int] = {}

    # ------------------------------------------------------------------ during backward
    def register(self) -> None:
        """A post-accumulate-grad hook on every parameter that takes gradients. FSDP2 runs these hooks on the
        sharded parameter right after it has put the reduce-scattered gradient in ``param.grad`` (in its
        post-reduce stream on CUDA), so the unit's last one marks the moment its reduce-scatter is done."""
        ref = weakref.ref(self)
        for u in self.units:
            hooked = [s for s in u.shards if s.param.requires_grad]
            u.expected = len(hooked)
            for s in hooked:
                def hook(param: torch.Tensor, u: HostUnit = u) -> None:
                    me = ref()
                    if me is not None:
                        me.arrive(u)

                self.handles.append(s.param.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @torch.no_grad()
    def arrive(self, u: HostUnit) -> None:
        """One of ``u``'s gradients is reduce-scattered; at the last one, take the unit and release its GPU
        gradients (unless the backward accumulates for a later step)."""
        if self.accumulating or not self.streaming:
            return
        if u.index in self.taken:
            raise RuntimeError(
                f"ShardedHostAdamW: a second backward reached FSDP unit {u.index} ({type(u.module).__name__}) "
                "before step(); its gradients of the first had already moved to host memory. " + ACCUMULATION_HINT)
        n = self.arrived.get(u.index, 0) + 1
        if n < u.expected:
            self.arrived[u.index] = n
            return
        self.arrived.pop(u.index, None)
        self.take(u, self.validating(), release=True)
        self.stats["streamed_units"] += 1

    # ------------------------------------------------------------------ in step()
    def finish(self, order: list[HostUnit], validate: bool) -> list[int]:
        """Take the units backward did not (in reverse forward order, the same on every rank), add the norms a unit
        taken without them lacks, and return the indices of the parameters with a gradient this step."""
        present: list[int] = []
        for u in reversed(order):
            got = self.taken.get(u.index)
            if got is None:
                self.take(u, validate, release=False)
            elif validate and not got:
                self._norms_from_host(u)
            present += [s.index for s in u.active]
        if self.norm_stream is not None:  # step() reads the norms on the current stream
            torch.cuda.current_stream(self.device).wait_stream(self.norm_stream)
        self.reset()
        return present

    def reset(self) -> None:
        """Forget the units taken since the last step (after ``step()``, or at ``zero_grad()``)."""
        self.taken.clear()
        self.arrived.clear()
        self.opened = False

    # ------------------------------------------------------------------ one unit
    def take(self, u: HostUnit, validate: bool, release: bool) -> None:
        """Copy ``u``'s gradient rows to its host buffer, take their norms (``validate``), and drop the GPU
        gradients (``release``). A device-resident unit's gradients stay in ``param.grad`` for ``step()``; its
        norms are taken all the same."""
        self.prepare()
        self.wait(u)  # its last update has read the host rows about to be overwritten
        u.active = [s for s in u.shards if s.param.grad is not None]
        grads = {s.index: local_rows(s.param.grad) for s in u.active}
        if not u.on_device:
            self._to_host(u, grads)
        if validate:
            self._norms_of(u, grads)
        self.taken[u.index] = validate
        if release and not u.on_device:
            for s in u.active:
                s.param.grad = None  # the copy holds the rows until it has read them (record_stream)

    def _to_host(self, u: HostUnit, grads: dict[int, torch.Tensor]) -> None:
        if self.stream is None:
            for s in u.active:
                u.grad.tensor[s.offset:s.offset + s.numel].copy_(grads[s.index].reshape(-1))
            return
        # after what the current stream has queued: FSDP2's reduce-scatter of this unit (in its hook) or all of
        # backward (in step())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for s in u.active:
                g = grads[s.index]
                u.grad.tensor[s.offset:s.offset + s.numel].copy_(g.reshape(-1), non_blocking=True)
                g.record_stream(self.stream)
            u.d2h_event = torch.cuda.Event()
            u.d2h_event.record(self.stream)

    def _norms_from_host(self, u: HostUnit) -> None:
        """The norms of a unit whose gradients left the device before the step needed them (validation turned
        on between its backward and ``step()``): its host rows, back on the device in their own dtype (exact); a
        device-resident unit's ``param.grad``."""
        if u.on_device:
            grads = {s.index: local_rows(s.param.grad) for s in u.active}
            self._norms_of(u, grads)
            self.taken[u.index] = True
            return
        if self.stream is not None and u.d2h_event is not None:
            u.d2h_event.synchronize()
        grads = {s.index: u.grad.tensor[s.offset:s.offset + s.numel].to(self.device, s.param.dtype)
                 for s in u.active}
        self._norms_of(u, grads)
        self.taken[u.index] = True

    def _norms_of(self, u: HostUnit, grads: dict[int, torch.Tensor]) -> None:
        """Assemble each active parameter's full gradient on its owner (one batch of point-to-point transfers per
        dtype) and write its norm there, on the norms' stream on CUDA. See Note [ZeRO-3 step and the forward's
        wait]."""
        if self.norm_stream is None:
            self._norms_here(u, grads)
            return
        self.norm_stream.wait_stream(torch.cuda.current_stream(self.device))
        for g in grads.values():
            g.record_stream(self.norm_stream)  # the caller may release param.grad before these kernels run
        with torch.cuda.stream(self.norm_stream):
            self._norms_here(u, grads)

    def _norms_here(self, u: HostUnit, grads: dict[int, torch.Tensor]) -> None:
        if not self.opened:
            self.norms.open(len(self.params), zero=True)
            self.opened = True
        by_dtype: dict[torch.dtype, list[LocalShard]] = {}
        for s in u.active:
            by_dtype.setdefault(grads[s.index].dtype, []).append(s)
        for dtype, shards in by_dtype.items():
            if self.world == 1:
                fulls = {s.index: grads[s.index] for s in shards}
            else:
                fulls = self._exchange(shards, grads, dtype)
            if not fulls:
                continue
            idx = tuple(sorted(fulls))
            full = [fulls[i].reshape(self.params[i].shape) for i in idx]
            norms = torch._foreach_norm(full, 2.0) if dtype == torch.float32 else \
                torch._foreach_norm(full, 2.0, dtype=torch.float32)
            if idx not in self._idx:  # cached: a fresh index tensor in a hook would wait for a host copy
                self._idx[idx] = torch.tensor(idx, device=self.device)
            self.norms.vector.index_copy_(0, self._idx[idx], torch.stack(norms))

    def _exchange(self, shards: list[LocalShard], grads: dict[int, torch.Tensor],
                  dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Each active parameter's full gradient on its owner: every other rank sends its rows straight into their
        place in the owner's buffer (one batch of point-to-point transfers per unit and dtype), and the owner copies
        its own rows there, so no rank concatenates a send or a receive buffer."""
        n, me = self.world, self.rank
        ops: list[Any] = []
        fulls: dict[int, torch.Tensor] = {}
        for s in shards:
            owner = norm_owner(s.index, n)
            rows = grads[s.index].reshape(-1)
            if owner != me:
                if rows.numel():
                    ops.append(dist.P2POp(dist.isend, rows, self._peer(owner), group=self.pg))
                continue
            full = torch.empty(sum(s.numels), dtype=dtype, device=self.device)
            off = 0
            for r in range(n):
                part = full[off:off + s.numels[r]]
                if r == me:
                    part.copy_(rows)
                elif s.numels[r]:
                    ops.append(dist.P2POp(dist.irecv, part, self._peer(r), group=self.pg))
                off += s.numels[r]
            fulls[s.index] = full
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return fulls

    def _peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in the process group (what a point-to-point op names)."""
        if group_rank not in self._peers:
            self._peers[group_rank] = group_rank if self.pg is None else dist.get_global_rank(self.pg, group_rank)
        return self._peers[group_rank]
