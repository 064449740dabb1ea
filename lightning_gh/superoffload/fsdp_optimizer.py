"""ZeRO-3 with the optimizer state in host memory: :class:`ShardedHostAdamW`, AdamW over the local shards of
parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), with each shard's fp32 master weights and
moments in (page-locked) host memory and the update on a CPU thread.

FSDP2 keeps each parameter as a ``DTensor`` sharded on dim 0 over the ranks, all-gathers a module's parameters
just before its forward and reduce-scatters their gradients (averaged over the ranks) after its backward. This
optimizer takes over from there: it owns, per rank, the fp32 master copy and the two AdamW moments of that rank's
rows of every parameter, updates them with the package's CPU AdamW kernel (:mod:`.cpu_adamw`, bitwise equal to
``torch._fused_adamw_``; torch's own fused CPU AdamW where the kernel is not available), and writes the new rows
back, cast to the parameter's dtype, into the ``DTensor``'s local tensor, which FSDP2's next all-gather reads.

Note [ZeRO-3 step and the forward's wait]
    One optimizer step, on every rank (``N`` ranks, ``K`` parameters in the optimizer's order):

    1. During backward, per FSDP module (a *unit*), as soon as FSDP2 has reduce-scattered the unit's gradients:
       FSDP2 runs the post-accumulate-grad hooks of each sharded parameter right after putting its reduce-scattered
       gradient in ``param.grad`` (in its post-reduce stream on CUDA), and the hook of the unit's last parameter
       takes the unit (:class:`~.fsdp_grads.UnitGradients`). It waits until the unit's last update has read the
       unit's host gradient buffer (done since the unit's forward), copies the local gradient rows there (on a
       side stream that waits for the post-reduce stream, with an event per unit, on CUDA; a plain copy on the
       CPU) and, when the step may be clipped or skipped, assembles each parameter's full gradient on one rank,
       its *owner* (parameter ``i`` belongs to rank ``i % N``): one batch of point-to-point transfers per unit
       and dtype puts the other ranks' rows in place in the owner's buffer (on CUDA on a stream of the compute
       stream's priority, not FSDP2's high-priority post-reduce stream); the owner takes its L2 norm with the
       kernel ``clip_grad_norm_`` uses (``torch._foreach_norm``). Taking the
       norm of the full gradient, not a sum of per-shard partial sums, is what keeps every norm bitwise equal to
       ``clip_grad_norm_``'s on the unsharded gradient. Backward runs the units in the same order on every rank,
       so the collectives issued from the hooks match across ranks. Then the unit's ``param.grad`` are released:
       no rank holds its sharded gradients until the end of backward.
       Gradient accumulation: backward passes inside :meth:`ShardedHostAdamW.accumulating` (Lightning's
       ``accumulate_grad_batches`` under the strategy) take nothing, so their gradients stay in ``param.grad``,
       where FSDP2 adds the next micro-batch's before running the hooks; the backward that completes the step
       takes the sums. A second backward that reaches a unit already taken since the last ``step()`` is an
       error (its first gradients have left the device). ``step()`` takes, in reverse forward order, the units
       no hook took (the hooks did not run, a parameter had no gradient, or streaming is off), as the hooks do
       but keeping ``param.grad``.
    2. The per-parameter norms (each written by its owner, zero elsewhere: the sum is exact) are summed over the
       ranks, and every rank combines the same vector in parameter order with ``torch.linalg.vector_norm``, as
       ``clip_grad_norm_`` does, and derives the clip coefficient with its expression; so the global norm, the
       clip coefficient and the skip decision (a non-finite norm skips the step) are the same on every rank.
       ``step()`` posts them to the CPU thread (a :class:`~lightning_gh.superoffload.step.StepCtx`, copied to the
       host behind an event on CUDA) and returns without waiting for the CPU.
    3. The CPU thread updates the units in forward order (the order their forward pre-hooks ran in the last
       forward; the root module first) once the decision is known, then copies each unit's new master rows back
       into the parameters' local shards (on CUDA a thread of its own copies them, one piece queued at a time, and
       marks the unit ready after their event: Note [Paced weight copies] in :mod:`.paced_copy`; with the kernel,
       in two passes: see Note [Weights first, state after] in :mod:`.weights_first`). Rows of bf16 parameters
       are cast on the host, into the unit's (pinned) gradient buffer, which the update has just read: the next
       write into that buffer is the next backward's copy, which step 1 queues behind this copy's event.
    4. The next forward: a forward pre-hook on every FSDP module, registered with ``prepend=True`` after
       ``fully_shard`` registered FSDP2's own pre-forward hook (which all-gathers the module's parameters), so it
       runs first, waits on the host for that unit to be ready, then makes FSDP2's all-gather streams and the
       compute stream wait for its copy back (the copy's event). The all-gather streams must wait themselves:
       FSDP2 all-gathers a non-root unit on its own streams, which wait for the compute stream only at the root's
       pre-forward. Where those streams cannot be read (:func:`~.fsdp_units.gather_streams`: before the root's
       first forward, or another torch's layout), the host waits for the copy instead. The CPU update of later
       units therefore overlaps the forward of earlier ones, and no all-gather can read a shard before its update
       is in place. FSDP2's explicit forward prefetching (``FSDPModule.set_modules_to_forward_prefetch``)
       all-gathers a later module from an earlier module's pre-forward, before the later module's own hook runs;
       it is refused (see :func:`~.fsdp_units.check_no_forward_prefetch`).

    GPU share (``gpu_fraction=f``, a float): the fp32 master and moments of the first units in forward order,
    about ``f`` of the elements (:func:`~.fsdp_units.device_share`, over every rank's elements, so every rank
    chooses the same units), live on the parameters' device. The choice is made once, just before the first unit of
    the first step is taken (by the first forward's order; module order for the units it did not run), and kept;
    the optimizer is built with the choice module order gives, and a unit that the forward order places otherwise
    moves then, before any update. In step 1 such a unit's norms are taken as above, but its gradients stay in
    ``param.grad`` (no host copy); ``step()`` updates it on the device right after step 2 (``torch._fused_adamw_``
    with the same clip coefficient, the skip decision as its ``found_inf``: no host synchronization) and writes its
    weights, cast, into the local shards on the compute stream, ahead of the next forward's all-gathers. Its
    forward pre-hook does not wait for the CPU; the CPU thread only advances its step counts once the decision is
    known. With ``gpu_fraction="auto"`` the share starts empty and is sized once, at the end of step
    ``AUTO_SHARE_STEP``, from the smallest room any rank has beside a full step's peak (an all-reduce, so every
    rank chooses the same units), after the CPU thread has finished every unit; the chosen units move then.

    Whatever reads the parameters or the state outside a forward (``state_dict()``, a checkpoint, the next
    ``step()``) waits for every unit first (:meth:`ShardedHostAdamW.synchronize`).

The state dict is ``torch.optim.AdamW``'s (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, the moments as
``DTensor`` s sharded like their parameter, backed by the host buffers themselves, or by the device tensors of the
GPU share), plus ``master`` (the fp32 master rows, sharded the same way) for the parameters that are not fp32: for
fp32 parameters the master copy equals the parameter bit for bit and is re-derived from it. That is the format
``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` and Lightning's
``ModelParallelStrategy`` save and load, at any number of ranks (DCP reshards).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_gh._util import fmt_bytes
from lightning_gh.superoffload import cpu_adamw
from lightning_gh.superoffload import weights_first as wf
from lightning_gh.superoffload.fsdp_grads import UnitGradients
from lightning_gh.superoffload.fsdp_units import (
    AUTO_SHARE_STEP,
    HostUnit,
    LocalShard,
    auto_device_fraction,
    check_host_on_every_rank,
    check_no_forward_prefetch,
    device_share,
    fsdp_units,
    gather_streams,
    host_dtensor,
    local_rows,
    share_decision,
    unsupported_options,
    update_on_device,
)
from lightning_gh.superoffload.memory import local_world_size
from lightning_gh.superoffload.options import SuperOffloadOptions, resolve_options, validate_knobs
from lightning_gh.superoffload.paced_copy import PacedCopies
from lightning_gh.superoffload.state import check_group
from lightning_gh.superoffload.step import StepCtx
from lightning_gh.superoffload.tail_mover import device_room
from lightning_gh.superoffload.worker import CPU_UPDATE_RANGE, UPDATE_WAIT_RANGE
from lightning_gh.superoffload.zero import rank_cpu_threads

__all__ = ["ShardedHostAdamW"]


class ShardedHostAdamW(torch.optim.Optimizer):
    """AdamW over FSDP2-sharded parameters with each rank's fp32 master rows and moments in host memory, updated
    on a CPU thread, with exact gradient-norm clipping across ranks. See Note [ZeRO-3 step and the forward's wait].

    Identical, on every rank, to ``torch.nn.utils.clip_grad_norm_`` followed by ``torch.optim.AdamW(fused=True)`` on
    the unsharded fp32 parameters and gradients (bitwise; the tests check it on 2 ranks); a step whose gradient
    norm is not finite is skipped on every rank (``skip_nonfinite``).

    Args:
        params: the parameters (``DTensor`` s sharded on dim 0 by ``fully_shard``) or param groups, as for AdamW.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (defaults as ``torch.optim.AdamW``'s).
        module: the model the parameters belong to (its ``fully_shard``-ed modules get the forward pre-hooks).
        max_grad_norm: clip the global gradient L2 norm to this value (as ``clip_grad_norm_``), or ``None``.
        options: :class:`SuperOffloadOptions`; ``skip_nonfinite``, ``cpu_threads``, ``host_memory_check`` and
            ``gpu_fraction`` (a float: the GPU share of the Note; ``"auto"``: sized from measured memory) and
            ``max_gpu_fraction`` apply (see
            :func:`~.fsdp_units.unsupported_options` for the rest).
        **option_kwargs: the same options as keywords instead (see :class:`SuperOffloadOptions`).

    Example::

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        opt = ShardedHostAdamW(model.parameters(), lr=3e-4, module=model, max_grad_norm=1.0)
        loss = model(batch).mean(); loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, module: nn.Module, max_grad_norm: float | None = None,
                 options: SuperOffloadOptions | None = None, **option_kwargs: Any) -> None:
        self.options = resolve_options(options, "ShardedHostAdamW", **option_kwargs)
        bad = unsupported_options(self.options)
        if bad:
            raise ValueError(f"ShardedHostAdamW (ZeRO-3) cannot take {', '.join(bad)}: each unit is updated once "
                             "its step's decision is known, by its rank's CPU. Leave them at their defaults.")
        validate_knobs(max_grad_norm=max_grad_norm)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": False,
                    "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                    "fused": None}
        super().__init__(params, defaults)
        for gi, g in enumerate(self.param_groups):
            check_group(g, gi)
        self.module = module
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.stats: dict[str, Any] = {"steps": 0, "skipped_steps": 0, "clipped_steps": 0, "wait_ms": 0.0,
                                      "cpu_ms": 0.0, "writeback_ms": 0.0, "streamed_units": 0,
                                      "last_grad_norm": None}
        self._build(module)
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._forward_order: list[int] = []
        self._recording: dict[int, None] = {}  # units whose forward pre-hook ran since the last step, in order
        self._step_id = 0
        self._closed = False
        self.publish_state()

    # ------------------------------------------------------------------ layout
    def _build(self, module: nn.Module) -> None:
        from torch.distributed.tensor import DTensor, Shard

        units = fsdp_units(module)  # first: a model with no fully_shard at all gets the error that says so
        params = [p for g in self.param_groups for p in g["params"]]
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        index_of = {id(p): i for i, p in enumerate(params)}
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"ShardedHostAdamW: parameter {i} (shape {tuple(p.shape)}) is not sharded by fully_shard. In "
                    "configure_model(), call fully_shard on the root module last, so that every parameter "
                    "belongs to a fully_shard-ed module.")
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"ShardedHostAdamW: parameter {i} has placements {tuple(p.placements)} on a "
                    f"{p.device_mesh.ndim}-d mesh; only FSDP2's default (Shard(0),) on a 1-d data-parallel mesh is "
                    "supported (no tensor parallelism, no HSDP, no shard_placement_fn).")
        mesh = params[0].device_mesh if params else None
        self._pg = mesh.get_group() if mesh is not None else None
        self.world = mesh.size() if mesh is not None else 1
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.device = local_rows(params[0]).device if params else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        # every rank's local element count of every parameter: FSDP2 cuts dim 0 like torch.chunk (uneven shards)
        mine = torch.tensor([local_rows(p).numel() for p in params], dtype=torch.int64, device=self.device)
        if self.world > 1:
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(gathered, mine, group=self._pg)
        else:
            gathered = [mine]
        numels = torch.stack(gathered).cpu().tolist()
        pending: list[tuple[nn.Module, list[LocalShard]]] = []
        seen: set[int] = set()
        for unit_module, unit_params in units:
            check_no_forward_prefetch(unit_module)
            owned = sorted(index_of[id(p)] for p in unit_params if id(p) in index_of)
            shards, off = [], 0
            for i in owned:
                s = LocalShard(i, params[i], group_of[id(params[i])], numels[self.rank][i], off,
                           [numels[r][i] for r in range(self.world)], rank=self.rank)
                shards.append(s)
                off += s.numel
                seen.add(i)
            if shards:
                pending.append((unit_module, shards))
        missing = [i for i in range(len(params)) if i not in seen]
        if missing:
            raise ValueError(f"ShardedHostAdamW: parameters {missing} of the optimizer are not in the module passed as "
                             "module= (pass the model whose configure_model() sharded them).")
        gf = self.options.gpu_fraction
        self._share = 0.0 if gf == "auto" else float(gf)  # None once the units are placed (at the first take)
        sizes = [sum(sum(s.numels) for s in shards) for _, shards in pending]
        provisional = set(device_share(list(range(len(pending))), sizes, self._share))
        local = [sum(s.numel for s in shards) for _, shards in pending]
        unit_bytes = [n * (2 if {s.param.dtype for s in shards} == {torch.bfloat16} else 4)
                      for n, (_, shards) in zip(local, pending)]  # each unit's gradient rows (and staged weights)
        self._kernel = cpu_adamw.load()
        two = wf.two_pass(self.options.weights_first, self._kernel)
        self.stats["weights_first"] = two
        host_bytes = sum(12 * local[ui] + unit_bytes[ui] for ui in range(len(pending)) if ui not in provisional) \
            + (wf.stage_bytes(unit_bytes) if two else 0)
        check_host_on_every_rank(host_bytes, options=self.options, world=self.world, device=self.device,
                                 group=self._pg, owner=self)
        self._units: list[HostUnit] = []
        for ui, (unit_module, shards) in enumerate(pending):
            unit = HostUnit(ui, unit_module, shards, pin=torch.cuda.is_available(),
                            device=self.device if ui in provisional else None)
            for s in shards:
                unit.view(s, 0).copy_(local_rows(s.param).reshape(-1))
            self._hook(unit)
            self._units.append(unit)
        threads = self.options.cpu_threads
        self.cpu_threads = threads if threads is not None else rank_cpu_threads(
            self.cuda, min(local_world_size(), self.world))
        self._first = wf.FirstPass(self._kernel, max(unit_bytes, default=0), self.cpu_threads) if two else None
        self._pacer = PacedCopies.reporting_to(self, torch.cuda.Stream(self.device)) if self.cuda else None
        self._grads = UnitGradients(self._units, params, pg=self._pg, world=self.world, rank=self.rank,
                                    device=self.device, stream=torch.cuda.Stream(self.device) if self.cuda else None,
                                    wait=partial(self._wait, state=True), validating=self._validating, stats=self.stats,
                                    prepare=self._place)
        self._grads.register()
        self._masters_stale = True  # re-derived from the weights at the first step (a model loaded since)

    def _place(self, order: list[int] | None = None) -> None:
        """Choose the GPU share once, by ``order`` or the forward order recorded so far (module order for the units
        it did not run), and move the units it places otherwise. See Note [ZeRO-3 step and the forward's wait]."""
        if self._share is None:
            return
        share, self._share = self._share, None
        if not share:
            return
        seen = [i for i in self._recording] if order is None else order
        order = seen + [u.index for u in self._units if u.index not in seen]
        chosen = set(device_share(order, [sum(sum(s.numels) for s in u.shards) for u in self._units], share))
        moved = False
        for u in self._units:
            if u.on_device != (u.index in chosen):
                self._wait(u, state=True)
                u.place(self.device if u.index in chosen else None, pin=torch.cuda.is_available())
                moved = True
        if moved and self.state:
            self.publish_state()

    def _size_device_share(self) -> None:
        """``gpu_fraction="auto"``: size the GPU share once, from the smallest room beside a full step's peak on any
        rank (:func:`~.tail_mover.device_room`, :func:`~.fsdp_units.auto_device_fraction`: the same share on every
        rank), move the first units in forward order there, and say so in one log line (rank 0). A rank whose move
        runs out of memory makes every rank keep its state on the host."""
        self.synchronize()  # the CPU thread is done with every unit before any moves
        measured = device_room(self.device)
        sizes = torch.tensor([-1 if measured is None else measured[0], -sum(u.numel for u in self._units)],
                             dtype=torch.int64, device=self.device)
        if self.world > 1:  # the smallest room and the largest rank
            dist.all_reduce(sizes, op=dist.ReduceOp.MIN, group=self._pg)
        room, local = (int(v) for v in sizes.tolist())
        grad_bytes = max(u.grad_dtype.itemsize for u in self._units)
        self._share = auto_device_fraction(None if room < 0 else room, -local, grad_bytes,
                                           self.options.max_gpu_fraction)
        failed = torch.zeros(1, device=self.device)
        try:
            self._place(self._forward_order)
        except torch.cuda.OutOfMemoryError:
            failed += 1
        if self.world > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._pg)
        if failed.item():
            for u in self._units:
                if u.on_device:
                    u.place(None, pin=torch.cuda.is_available())
            self.publish_state()
        self.stats["gpu_share_decision"] = text = share_decision(
            self._units, fmt_bytes(max(room, 0)) if measured else None, measured[1] if measured else None,
            bool(failed.item()))
        rank_zero_info(text)

    @property
    def device_units(self) -> list[int]:
        """The units (indices in :func:`~.fsdp_units.fsdp_units` order) whose state lives on the device."""
        return [u.index for u in self._units if u.on_device]

    @property
    def updates_on_host(self) -> bool:
        """Whether some units are updated on the host CPU (ActivationOffload's budget plans around it)."""
        return not all(u.on_device for u in self._units)

    def _hook(self, unit: HostUnit) -> None:
        ref = weakref.ref(self)

        def pre_forward(module: nn.Module, args: Any) -> None:
            opt = ref()
            if opt is not None and not opt._closed:
                opt.wait_for(unit.index)

        # prepend=True, registered after fully_shard's own: runs before FSDP2's all-gather (see the Note)
        unit.hook = unit.module.register_forward_pre_hook(pre_forward, prepend=True)

    # ------------------------------------------------------------------ state in AdamW's format
    def publish_state(self) -> None:
        """Expose the host state in ``self.state`` as ``torch.optim.AdamW`` keeps it (``step`` and the moments,
        ``DTensor`` s over the host buffers; ``master`` for non-fp32 parameters). The strategy calls this after
        Lightning's setup, which would otherwise move every tensor of ``self.state`` to the GPU."""
        for u in self._units:
            for s in u.shards:
                entry = {"step": s.step, "exp_avg": host_dtensor(u.view(s, 1), s.param),
                         "exp_avg_sq": host_dtensor(u.view(s, 2), s.param)}
                if s.param.dtype != torch.float32:
                    entry["master"] = host_dtensor(u.view(s, 0), s.param)
                self.state[s.param] = entry

    def hide_state(self) -> None:
        """Empty ``self.state`` until :meth:`publish_state` (the host buffers stay)."""
        self.state.clear()

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        if not self.state:
            self.publish_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW``-format state: entries keyed by parameter index or name, the moments (and
        ``master``) as DTensors sharded like the parameter, or as full tensors (this rank's rows are taken).
        Parameters without a ``master`` entry re-derive it from their weights at the next step (load the model
        first, as Lightning and ``torch.distributed.checkpoint`` do)."""
        self.synchronize()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the state has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}.")
        key_of: dict[int, Any] = {}
        for g, sg in zip(self.param_groups, saved_groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("load_state_dict: a param group's size differs from the state's.")
            for p, k in zip(g["params"], sg["params"]):
                key_of[id(p)] = k
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        unit_of = {s.index: u for u in self._units for s in u.shards}
        for s in sorted((s for u in self._units for s in u.shards), key=lambda s: s.index):
            entry = state_dict["state"].get(key_of[id(s.param)])
            if entry is None:
                continue
            u = unit_of[s.index]
            s.step.copy_(torch.as_tensor(entry["step"], dtype=torch.float32).reshape(()).cpu())
            for k, name in ((1, "exp_avg"), (2, "exp_avg_sq"), (0, "master")):
                if name in entry:
                    self._copy_rows(u.view(s, k), entry[name], s)
            s.master_loaded = "master" in entry
        self._masters_stale = True
        self.publish_state()

    def _copy_rows(self, dst: torch.Tensor, value: torch.Tensor, s: LocalShard) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            src = value.to_local().reshape(-1)
        else:  # a full (unsharded) tensor: this rank's rows
            lo = sum(s.numels[:self.rank])
            src = value.reshape(-1)[lo:lo + s.numel]
        if src.numel() != dst.numel():
            raise ValueError(f"load_state_dict: parameter {s.index} has {dst.numel()} local elements here, the "
                             f"state {src.numel()}.")
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)

    # ------------------------------------------------------------------ the step
    def set_max_grad_norm(self, value: float | None) -> None:
        """Clip the global gradient norm to ``value`` from the next ``step()`` on (``None``: no clipping)."""
        validate_knobs(max_grad_norm=value)
        self.max_grad_norm = None if value is None else float(value)

    def _validating(self) -> bool:
        return self.max_grad_norm is not None or self.options.skip_nonfinite

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients for a later one (gradient accumulation): their
        gradients stay in ``param.grad``, where FSDP2 adds the next ones, and the backward that completes the step,
        outside the block, moves the sums to host memory. ``SuperOffloadFSDPStrategy`` enters it for Lightning's
        ``accumulate_grad_batches``. See Note [ZeRO-3 step and the forward's wait]."""
        before, self._grads.accumulating = self._grads.accumulating, True
        try:
            yield
        finally:
            self._grads.accumulating = before

    def set_gradient_streaming(self, enabled: bool) -> None:
        """``True`` (the default): each unit's gradients move to host memory, and leave the device, as soon as FSDP2
        has reduce-scattered them. ``False``: they stay in ``param.grad`` until ``step()`` (which copies them then)
        and ``zero_grad()``; for code that reads the gradients between backward and ``step()``."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_gradient_streaming(enabled={enabled!r}): enabled must be a bool.")
        self._grads.streaming = enabled

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.reset()  # gradients taken by a backward that no step() consumed are dropped too
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        self._place()
        if self._masters_stale:
            self._rederive_masters()
        hp = [{"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
               "weight_decay": float(g["weight_decay"]), "eps": float(g["eps"])} for g in self.param_groups]
        validate = self.max_grad_norm is not None or self.options.skip_nonfinite
        self._step_id += 1
        ctx = StepCtx(self._step_id, hp, needs_validation=validate)
        order = self._order()
        present = self._grads.finish(order, validate)  # the units backward did not take
        for u in order:
            u.ready.clear()
            u.done.clear()
        coef = found_inf = None
        if validate:
            coef, found_inf = self._post(ctx, present, hp)
        for u in order:
            if u.on_device:
                update_on_device(u, hp, coef, found_inf)
        self._forward_order = [u.index for u in order]
        self._start()
        self._queue.put((ctx, [u.index for u in order]))
        self.stats["steps"] += 1
        if self.options.gpu_fraction == "auto" and self._step_id >= AUTO_SHARE_STEP and \
                "gpu_share_decision" not in self.stats:  # sized once, from measured memory
            self._size_device_share()
        return loss

    def _order(self) -> list[HostUnit]:
        """The units in the last forward's order (units it did not run after, in module order)."""
        seen = list(self._recording)
        self._recording = {}
        if seen:
            self._forward_order = seen
        rest = [u.index for u in self._units if u.index not in self._forward_order]
        return [self._units[i] for i in self._forward_order + rest]

    def _rederive_masters(self) -> None:
        for u in self._units:
            for s in u.shards:
                if not s.master_loaded:
                    u.view(s, 0).copy_(local_rows(s.param).reshape(-1))
        self._masters_stale = False

    def _post(self, ctx: StepCtx, present: list[int], hp: list[dict[str, float]]) -> tuple[Any, Any]:
        """Sum the owners' norms over the ranks, combine them as ``clip_grad_norm_`` does and post the outcome;
        returns the clip coefficient (``None`` without clipping) and the skip flag (``None`` without
        ``skip_nonfinite``), on the device, for the GPU share's update."""
        vec = self._grads.norms.vector
        if self.world > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self._pg)
        total = self._grads.norms.total(present) if present else torch.zeros((), device=self.device)
        clip = None
        if self.max_grad_norm is not None:
            # the same expression as torch.nn.utils.clip_grad_norm_, so the coefficient is bitwise equal
            coef = clip = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        else:
            coef = torch.ones((), device=self.device)
        found_inf = (~torch.isfinite(total)).to(torch.float32) if self.options.skip_nonfinite else None
        ctx.post(hp, self.max_grad_norm, self.options.skip_nonfinite, torch.stack([total, coef]).float(),
                 self.cuda, self.device)
        return clip, found_inf

    # ------------------------------------------------------------------ waiting
    def wait_for(self, unit_index: int) -> None:
        """The forward pre-hook of unit ``unit_index``: note the forward order, and block until the unit's update of
        the last step is in its parameters."""
        self._recording.setdefault(unit_index)
        u = self._units[unit_index]
        if not u.on_device:  # the GPU share's update was queued on the device in step()
            self._wait(u, streams=gather_streams(u.module) if self.cuda else [])

    def _wait(self, u: HostUnit, state: bool = False, streams: list[Any] | None = None) -> None:
        """Block until unit ``u``'s weights are in its parameters (with ``streams``, FSDP2's all-gather streams:
        until they are queued, those streams and the compute stream waiting for the copy); with ``state``, until
        its host state is final too (see Note [Weights first, state after])."""
        for flag in (u.ready, u.done) if state else (u.ready,):  # ready: the weights' copy is queued, its event set
            if not flag.is_set():
                t0 = time.perf_counter()
                with torch.profiler.record_function(UPDATE_WAIT_RANGE):
                    while not flag.wait(0.05):
                        self._raise()
                        if self._thread is None or not self._thread.is_alive() or (self._pacer and self._pacer.stalled()):
                            raise RuntimeError("ShardedHostAdamW: the CPU worker stopped with an update pending.")
                self.stats["wait_ms"] += (time.perf_counter() - t0) * 1e3
        self._raise()
        if self.cuda and u.h2d_event is not None:
            for stream in streams or ():  # FSDP2's all-gather streams do not wait for the compute stream here
                stream.wait_event(u.h2d_event)
            if not streams:
                u.h2d_event.synchronize()
            torch.cuda.current_stream(self.device).wait_event(u.h2d_event)

    def synchronize(self) -> None:
        """Wait until every unit's update of the last step is in its parameters and its host state."""
        for u in self._units:
            self._wait(u, state=True)

    def _raise(self) -> None:
        if self._error is not None:
            err = self._error
            raise RuntimeError(f"ShardedHostAdamW CPU worker failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Finish the pending updates, stop the CPU thread, remove the hooks and unpin the host buffers."""
        if self._closed:
            return
        try:
            self.synchronize()
        finally:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join(timeout=30)
            stopped = self._pacer.close() if self._pacer is not None else True
            self._grads.remove_hooks()
            for u in self._units:
                u.hook.remove()
            alive = self._thread is not None and self._thread.is_alive() or not stopped
            if self.cuda:  # copies to and from the pinned buffers may still be in flight
                torch.cuda.synchronize(self.device)
            if not alive:  # a worker still running (its join timed out) may still touch the buffers: keep them
                for u in self._units:
                    u.release()
                if self._first is not None:
                    self._first.release()
            self._thread = None

    # ------------------------------------------------------------------ the CPU thread
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=_worker_loop, args=(weakref.ref(self), self._queue),
                                            name="superoffload-zero3-cpu-adamw", daemon=True)
            self._thread.start()

    def _run_step(self, ctx: StepCtx, order: list[int]) -> None:
        dec = None
        later: list[HostUnit] = []  # units whose state is written back after every unit's weights
        for ui in order:
            u = self._units[ui]
            pushed = False  # the copies' thread marks the unit ready
            try:
                if dec is None:
                    dec = ctx.poll(block=True)
                    self.stats["last_grad_norm"] = ctx.norm
                    if dec.skip:
                        self.stats["skipped_steps"] += 1
                    elif dec.coef is not None:
                        self.stats["clipped_steps"] += 1
                t0 = time.perf_counter()
                if u.on_device:  # updated in step(), on the device: only its step counts are the host's
                    if not dec.skip:
                        for s in u.active:
                            s.step.add_(1)
                    continue
                if self.cuda and u.d2h_event is not None:
                    u.d2h_event.synchronize()
                if not dec.skip and u.active:
                    with torch.profiler.record_function(CPU_UPDATE_RANGE):
                        if self._first is not None:  # see Note [Weights first, state after]
                            self._first.run(u, dec.hp, dec.coef, self._push)
                            later.append(u)
                        else:
                            self._update(u, dec.hp, dec.coef)
                            self._push(u)
                        pushed = self._pacer is not None
                self.stats["cpu_ms"] += (time.perf_counter() - t0) * 1e3
            except BaseException as e:  # re-raised on the training thread at its next wait
                self._error = e
            finally:
                if not pushed:
                    u.ready.set()
                if not later or later[-1] is not u:
                    u.done.set()
        for u in reversed(later):
            try:
                t0 = time.perf_counter()
                with torch.profiler.record_function(wf.WRITEBACK_RANGE):
                    wf.update_in_place(self._kernel, u, dec.hp, dec.coef, self.cpu_threads)
                self.stats["writeback_ms"] += (time.perf_counter() - t0) * 1e3
            except BaseException as e:
                self._error = e
            finally:
                u.done.set()

    def _update(self, u: HostUnit, hp: list[dict[str, float]], coef: torch.Tensor | None) -> None:
        if self.cuda and u.h2d_event is not None:
            u.h2d_event.synchronize()  # the last copy back has read the master rows
        wf.update_in_place(self._kernel, u, hp, coef, self.cpu_threads)

    def _push(self, u: HostUnit, rows: torch.Tensor | None = None) -> Any:
        """Copy the unit's new weights (``rows``, else its master rows cast to the parameters' dtype on the host:
        :meth:`_staged`) into the parameters' local shards, so that 2 bytes a bf16 parameter cross the link; the
        rounding is the same as a cast on the device. On CUDA the copies' thread copies them (see Note [Paced
        weight copies]) and marks the unit ready; returns its job (``None`` off CUDA)."""
        rows = self._staged(u) if rows is None else rows
        if not self.cuda:
            for s in u.active:
                loc = local_rows(s.param)
                loc.copy_(rows[s.offset:s.offset + s.numel].view(loc.shape))
            return None
        def copied(event: Any, u: HostUnit = u) -> None:
            if event is not None:
                u.h2d_event = event
            u.ready.set()

        return self._pacer.submit([(local_rows(s.param), rows[s.offset:s.offset + s.numel]) for s in u.active], copied)

    @staticmethod
    def _staged(u: HostUnit) -> torch.Tensor:
        """The unit's rows to copy: the fp32 master rows where the gradient buffer is fp32 (fp32 or mixed dtypes),
        else the master rows cast into the gradient buffer, which the update has read (see Note [ZeRO-3 step and
        the forward's wait])."""
        master = u.region(0)
        if u.grad_dtype == torch.float32:
            return master
        stage = u.grad.tensor
        for s in u.active:
            stage[s.offset:s.offset + s.numel].copy_(master[s.offset:s.offset + s.numel])
        return stage


def _worker_loop(wself: Any, q: queue.Queue) -> None:
    """The CPU thread: one task per step, its units in forward order."""
    opt = wself()
    if opt is None:
        return
    torch.set_num_threads(opt.cpu_threads)
    if opt.cuda:
        torch.cuda.set_device(opt.device)
    del opt
    while True:
        task = q.get()
        if task is None:
            return
        opt = wself()
        if opt is None:
            return
        with torch.no_grad():
            opt._run_step(*task)
        del opt
