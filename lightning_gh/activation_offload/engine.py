"""Move saved activations to host memory during the forward and bring them back ahead of the backward.

The engine wraps every tensor autograd saves inside a transformer block (``saved_tensors_hooks``) and
knows which block is running from forward pre/post hooks on the blocks. For blocks the plan offloads:

* **Forward.** The tensor's whole storage is copied device->host on a dedicated stream into a pinned buffer
  from a reusable pool; at the plan's release point its device memory goes back to the allocator, ordered after
  the copy on the device (See Note [Release point of an offloaded storage] in :mod:`.hooks`).
* **Backward.** The first time a block's saved tensor is used, the reloads the plan triggers there (by
  default the previous block's) are issued host->device on a second side stream, in reverse save order
  (the order backward needs them), into memory allocated on the compute stream after that stream's
  pending work (so nothing still reading it can race the copy). Each use makes the compute stream wait on
  that tensor's copy event: backward never reads an incomplete copy.
* **Skipped** (left on the device): parameters, buffers and casts or views of them (autocast's bf16
  weight copies), tensors below ``min_tensor_bytes``, tensors not on the model's device, tensor
  subclasses, blocks the plan keeps (by default the last one, whose activations backward uses first) and
  everything outside the blocks. Views and repeated saves of one storage within a block share one copy.

With ``recompute="norm-act"``, ``"selective"`` or ``"full"``, the blocks the plan does not offload
recompute what they saved in the backward instead of keeping it (:mod:`lightning_gh.activation_offload.recompute`):
offload what the link can hide, recompute the cheap rest. Under ``"selective"``/``"full"`` those blocks run
inside a checkpoint whose own hooks shadow the engine's, so the engine sees (and keeps) only their inputs;
under ``"norm-act"`` only their norm and gate modules do. What the recomputing blocks keep is measured in
the first forward that recomputes, and the plan's forecast is redone from that measurement.

Without CUDA, ``backend="auto"`` warns once and leaves the run untouched. ``backend="host-copy"`` runs the
same hooks, plan and pool on any device, copying synchronously through a separate host buffer: it is the
test mode that lets a CPU check that gradients are bitwise unchanged.

The parts live in their own modules: options (:mod:`.options`), the pinned pool (:mod:`.pool`), copies and
clocks (:mod:`.transport`), the saved-tensor hooks (:mod:`.hooks`), block discovery (:mod:`.blocks`), the
planner (:mod:`.policy`) and recomputation (:mod:`.recompute`); this module ties them together.

Example::

    model = Llama(cfg).cuda()
    offload = offload_activations(model, policy="all")   # reuse it every step: its pinned pool persists
    for tokens, targets in loader:
        with offload, torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from lightning_gh import _gpu_plan, hardware
from lightning_gh._compiled import AroundCompiledCall, is_compiled_in_place
from lightning_gh._hf import checkpointing_owner
from lightning_gh._util import fmt_bytes, local_tensor
from lightning_gh.activation_offload.auto import AutoPlanner
from lightning_gh.activation_offload.blocks import compiled_owner, find_blocks
from lightning_gh.activation_offload.controller import BudgetController, BudgetState, Kind, MemoryProbe, Observation
from lightning_gh.activation_offload.hooks import Forward, SavedTensorHooks
from lightning_gh.activation_offload.lean_loss import LeanLoss, find_causal_lm, lean_loss_overhead_ms
from lightning_gh.activation_offload.options import ActivationOffloadOptions
from lightning_gh.activation_offload.policy import (
    BlockProfile,
    OffloadPlan,
    StepProfile,
    plan_all,
    plan_first_k,
    plan_none,
    plan_with_recompute,
)
from lightning_gh.activation_offload.pool import HostBufferPool
from lightning_gh.activation_offload.recompute import BlockRecompute
from lightning_gh.activation_offload.stats import OffloadStats, TimelinePoint
from lightning_gh.activation_offload.transport import (
    CudaClock,
    CudaTransport,
    HostClock,
    HostCopyTransport,
    host_copy_gbps,
)

__all__ = ["ActivationOffloader", "offload_activations"]

log = logging.getLogger(__name__)


class ActivationOffloader(SavedTensorHooks):
    """The offload engine; use it as a context manager around each forward (the backward may follow outside).

    Args:
        model: the module that runs the transformer blocks.
        policy: ``"auto"``, ``"all"`` or an int ``K``; see :class:`ActivationOffloadOptions` (``None``: the
            options' policy).
        options: every option as one :class:`ActivationOffloadOptions`; or pass them as keyword arguments
            (``blocks``, ``min_tensor_bytes``, ``margin``, ``recompute``, ... as documented there), not both.
        on_plan: called with each plan the engine adopts (default: log it at INFO).

    Attributes:
        options: the options in force (frozen).
        plan: the plan in force (``None`` while ``"auto"`` measures).
        budget: the :class:`~lightning_gh.activation_offload.controller.BudgetController` of budget mode (its
            forecast, measured peaks and log), once the engine has found the blocks; ``None`` without a budget.
        auto: the :class:`~lightning_gh.activation_offload.auto.AutoPlanner` of ``policy="auto"``.
        stats: :class:`OffloadStats` over the engine's life; ``timeline``: the latest step's events
            (``record_timeline``).

    Example::

        offload = ActivationOffloader(model, "all", min_tensor_bytes=2**20)
        with offload:
            loss = model(x).square().mean()
        loss.backward()
    """

    def __init__(
        self,
        model: nn.Module,
        policy: str | int | None = None,
        *,
        options: ActivationOffloadOptions | None = None,
        on_plan: Callable[[OffloadPlan], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if policy is not None:
            kwargs["policy"] = policy
        opts = ActivationOffloadOptions.build(options, "ActivationOffloader", **kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
        self.model = model
        self.options = opts
        self.on_plan = on_plan or (lambda plan: log.info("ActivationOffload %s", plan.describe()))
        self.stats = OffloadStats()
        self.plan: OffloadPlan | None = None
        self.timeline: list[TimelinePoint] = []
        self.blocks_name: str | None = None
        self.blocks: list[nn.Module] = []
        self.budget: BudgetController | None = None
        self.auto: AutoPlanner | None = None
        self._enabled: bool | None = None  # None: the blocks and the device are not resolved yet
        self._transport: CudaTransport | HostCopyTransport | None = None
        self._clock: CudaClock | HostClock | None = None
        self._pool: HostBufferPool | None = None
        self._rcs: dict[str, BlockRecompute] = {}
        self._lean: LeanLoss | None = None  # the model's HF causal-LM loss, swappable for the lean one
        self._fwd: Forward | None = None
        self._hooks_ctx: Any = None
        self._module_hooks: list[Any] = []
        self._param_ptrs: set[int] = set()
        self._lock = threading.RLock()
        self._forwards = 0
        self._measured: list[Forward] = []  # forwards whose marks wait for their backward's end
        self._saved_bytes = 0
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------------------- public surface

    @property
    def enabled(self) -> bool:
        """Whether the engine moves anything on this machine (``False``: the warned no-op without CUDA)."""
        self._resolve()
        return bool(self._enabled)

    @property
    def pool(self) -> HostBufferPool | None:
        return self._pool

    @property
    def transport(self) -> str | None:
        return self._transport.name if self._transport else None

    @property
    def profile(self) -> StepProfile | None:
        """The measured step ``"auto"`` planned from (``None`` before, and for the other policies)."""
        return self.auto.profile if self.auto is not None else None

    @property
    def record_timeline(self) -> bool:
        """Keep the latest step's memory events in ``timeline``; settable between steps."""
        return self.options.record_timeline

    @record_timeline.setter
    def record_timeline(self, on: bool) -> None:
        self.options = replace(self.options, record_timeline=bool(on))

    @property
    def _device(self) -> torch.device | None:
        return self._transport.device if self._transport is not None else None

    def set_plan(self, plan: OffloadPlan) -> None:
        """Adopt ``plan`` from the next forward on (e.g. restored from a checkpoint)."""
        self._resolve()
        if plan.n_blocks != len(self.blocks):
            raise ValueError(f"plan has {plan.n_blocks} blocks, the model {len(self.blocks)}.")
        rc = self.options.recompute
        if plan.modes or plan.policy == "budget":
            if self.budget is not None:
                self.budget.adopt(plan)
        elif plan.recompute_mode != rc or \
                (rc and set(plan.recompute) != set(range(plan.n_blocks)) - set(plan.offloaded_blocks)):
            plan = plan_with_recompute(plan, rc)
        self._adopt(plan)

    def __enter__(self) -> ActivationOffloader:
        self.begin_forward()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        fwd = self._fwd
        self.end_forward()
        if isinstance(exc, torch.cuda.OutOfMemoryError) and self.budget is not None and fwd is not None \
                and fwd.measure is not None:
            err = self.budget.explain_out_of_memory(fwd.measure)
            if err is not None:
                raise err from exc
        return False

    def begin_forward(self) -> None:
        """Start offloading the forward that follows (same thread until :meth:`end_forward`)."""
        if self._fwd is not None or self._hooks_ctx is not None:
            raise RuntimeError("ActivationOffloader.begin_forward() called again before end_forward(): "
                               "the engine's context does not nest.")
        self._resolve()
        if not self._enabled or not torch.is_grad_enabled():
            return  # no grad (validation, inference): nothing is saved, nothing to do
        owner = compiled_owner(self.model, self.blocks)
        if owner is not None and self.budget is not None:
            self.budget.compiled_forward(owner)
            return
        if owner is not None:
            raise RuntimeError(
                f"ActivationOffload cannot see block boundaries inside the torch.compile'd module '{owner}': "
                "its forward hooks would be traced, not run. Compile each block instead "
                f"(`for b in <{self.blocks_name}>: b.compile()`, or `<{self.blocks_name}>[i] = torch.compile(b)`), "
                "or turn compilation off for this model.")
        if self._transport is not None and self._transport.name == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("ActivationOffload cannot run inside a CUDA graph capture (e.g. CUDAGraphCapture): "
                               "its copies are ordered by host-side hooks that a replay would skip. "
                               "Use one or the other.")
        self._harvest()
        measure = None
        if self.budget is not None:
            plan, measure = self.budget.next_forward()
            profiling = measure is not None and measure.kind not in (Kind.CHECK, Kind.RELAX, Kind.TRIAL)
        else:
            profiling = self.auto is not None and self.plan is None
            plan = plan_none(len(self.blocks), "profiling") if profiling else self.plan
            if not profiling and self.auto is not None and self.auto.reference_step():
                self._reference_forward()  # See Note [The reference of the check is the step without the engine]
                return
            if not profiling and self._idle(plan):
                self._plain_forward()  # See Note [A plan that moves nothing installs nothing]
                return
        assert plan is not None
        fwd = Forward(self._forwards, plan, profiling, measure)
        if measure is not None:
            fwd.mem_base = self.budget.probe.start()
        if measure is not None or (self.auto is not None and (profiling or self.auto.timing(plan))):
            fwd.marks["t0"] = self._clock.mark()
        self._forwards += 1
        self.stats.forwards += 1
        # See Note [FSDP2's gathered weights are parameters]
        self._param_ptrs = {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        self._param_ptrs |= {local_tensor(b).untyped_storage().data_ptr() for b in self.model.buffers()}
        if self.options.record_timeline:
            self.timeline = []
            self._t0 = time.perf_counter()
        self._install(fwd)

    # Note [FSDP2's gathered weights are parameters]
    # The engine must not copy a weight to the host as if it were an activation: a weight is no activation (it
    # exists for the backward anyway), and a sharded strategy may free a gathered weight's memory right after the
    # block's forward, while a side-stream copy would still read it. A saved tensor is a weight when its storage is
    # one a parameter or buffer had as the forward began (``_param_ptrs``, a DTensor's local shard for a sharded
    # model), when it is a view of an ``nn.Parameter`` (a frozen weight's view has no autograd history), or when it
    # is, or leads through views and casts to, an ``nn.Parameter`` leaf. FSDP2 (``fully_shard``) gathers each
    # block's weights just before its forward into new storages, but as ``nn.Parameter`` objects that it swaps into
    # the modules, so the last two tests find them; the memory probe reads a sharded model's gradients at their
    # local size and the gradients a backward leaves on the device as the model state. FSDP1 hands its modules
    # plain views of a flat buffer instead, which no test can tell from activations: the callback refuses
    # ``FSDPStrategy``. Read in ``hooks.SavedTensorHooks._skip_reason``, ``hooks._is_param`` and
    # ``measure.MemoryProbe``.

    # Note [A plan that moves nothing installs nothing]
    # ``policy="auto"`` promises a step no slower than without the engine. An ``"auto"`` plan that offloads no block,
    # recomputes none and swaps no loss (the plan undone by its check, or one that found nothing to hide) would still
    # cost something through the engine: a Python pack and unpack call for every saved tensor, autocast's weight casts
    # made again in the backward (``recompute_param_casts``, which also changes what the step keeps), block hooks.
    # Such a forward runs with nothing installed: no saved-tensor hooks, no block hooks, no recompute wrappers, no
    # loss swap; the step is the step without the engine, to the bit and in memory (``stats.plain_forwards`` counts
    # these forwards). Adopting such a plan also gives the pool's free pinned buffers back (``HostBufferPool.clear``).
    # An explicit ``policy=0`` keeps the hooks (the cast dedupe and the weight re-cast alone, which save memory at a
    # cost), and budget mode keeps its own rules (its measuring steps need the hooks).
    def _idle(self, plan: OffloadPlan) -> bool:
        return self.auto is not None and not plan.offloaded_blocks and not plan.recompute and not plan.lean_loss \
            and self.options.lean_loss is not True

    def _plain_forward(self) -> None:
        st = self.stats
        st.plain_forwards += 1
        st.last_offloaded_bytes = st.last_resident_bytes = 0
        st.last_offloaded_by_block = [0] * len(self.blocks)

    def _reference_forward(self) -> None:
        """A forward with nothing installed, timed from here to the backward's end (``"auto"``'s reference)."""
        fwd = Forward(self._forwards, plan_none(len(self.blocks), "reference"), False)
        fwd.reference = True
        fwd.bwd_point = fwd.n  # no hook moves it: the next end_backward() marks this forward's end
        fwd.marks["t0"] = self._clock.mark()
        self._measured.append(fwd)
        self._plain_forward()

    def _install(self, fwd: Forward) -> None:
        self._fwd = fwd
        if fwd.measure is None and not fwd.profiling and not self.options.record_timeline:
            # See Note [A kept block's saved tensors go untracked]
            rc = set(fwd.plan.recompute)
            fwd.untracked = {i: {} for i, b in enumerate(fwd.plan.budgets) if b == 0 and i not in rc}
        for i, blk in enumerate(self.blocks):
            if not is_compiled_in_place(blk):  # see below for the others
                self._module_hooks.append(blk.register_forward_pre_hook(self._make_pre(i)))
                self._module_hooks.append(blk.register_forward_hook(self._make_post(i), always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        plan = fwd.plan
        try:
            for mode, idx in plan.recompute_groups().items():
                rc = self._rc_for(mode)
                rc.reset_counts()
                rc.apply(idx)
            for i, blk in enumerate(self.blocks):
                # a block compiled in place would trace its own hooks into the compiled function: its boundaries
                # run around the compiled call, outside a recompute's checkpoint of that call (applied above), as
                # a hook runs outside a recomputed forward (removed first in end_forward)
                if is_compiled_in_place(blk):
                    self._module_hooks.append(AroundCompiledCall(blk, self._make_pre(i), self._make_post(i)))
        except BaseException:
            self.end_forward()
            raise
        if self._lean is not None and (plan.lean_loss or (self.options.lean_loss is True and not fwd.raw)):
            self._lean.__enter__()

    def end_forward(self) -> None:
        """Stop packing; wait (on the device) for every copy still in flight and release its memory."""
        ctx, fwd = self._hooks_ctx, self._fwd
        self._hooks_ctx, self._fwd = None, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if self._lean is not None:
            self._lean.__exit__()  # the loss's backward needs nothing installed
        for h in reversed(self._module_hooks):  # last installed first: a compiled call's wrappers chain
            h.remove()
        self._module_hooks = []
        applied: dict[int, int] = {}  # recomputing block -> bytes its selective cache held
        for rc in self._rcs.values():
            for i in rc.applied:
                applied[i] = rc.cached_bytes[i] or 0
            rc.remove()  # the backward recomputes through closures of its own, not through these
        if fwd is None:
            return
        fwd.rc_cached = dict(applied)
        if applied:
            self.stats.recompute_forwards += 1
            self.stats.last_recompute_blocks = sorted(applied)
            self.stats.last_recompute_cached_bytes = sum(applied.values())
            self.stats.last_recompute_kept_by_block = {
                i: fwd.resident[i] + fwd.used[i] + c for i, c in sorted(applied.items())}
        with self._lock:
            for point in sorted(fwd.pending):
                self._release_point(fwd, point)  # See Note [Release point of an offloaded storage]
            fwd.current = None
            # Only the forward looks entries up by storage or cast; the cast keys hold autograd nodes, which hold
            # this forward's handles: dropped here, nothing keeps the forward once its graph is gone.
            fwd.by_key.clear()
            fwd.casts.clear()
            fwd.untracked = None
            if fwd.profiling or "t0" in fwd.marks:
                fwd.marks["fwd_end"] = self._clock.mark()
                self._measured.append(fwd)
            self.stats.last_offloaded_bytes = sum(fwd.used)
            self.stats.last_offloaded_by_block = list(fwd.used)
            self.stats.last_resident_bytes = sum(fwd.resident)
            self._event("forward-end", fwd.n)
        if applied and self.auto is not None and fwd.plan is self.plan:
            plan = self.auto.recompute_measured(fwd.plan, self.stats.last_recompute_kept_by_block)
            if plan is not None:
                self._adopt(plan)
        if self.auto is None and self.budget is None and self.stats.forwards == 1:
            log.info("ActivationOffload: first offloaded forward moved %s (%d blocks), %s of saved activations "
                     "stayed in blocks%s", fmt_bytes(sum(fwd.used)), len(fwd.plan.offloaded_blocks),
                     fmt_bytes(sum(fwd.resident)),
                     f"; {len(applied)} blocks recomputed ({self.options.recompute}), keeping "
                     f"{fmt_bytes(sum(self.stats.last_recompute_kept_by_block.values()))}" if applied else "")

    def end_backward(self) -> None:
        """Optional: mark the backward's end (lets ``"auto"`` measure block 0's backward exactly)."""
        if self.budget is not None:
            self.budget.probe.backward_ended()  # before the readings: they count what the backward left
        for fwd in self._measured:
            if "bwd_end" not in fwd.marks and fwd.bwd_point <= fwd.n:
                fwd.marks["bwd_end"] = self._clock.mark()
                if fwd.measure is not None and fwd.act_peak is None:
                    fwd.act_peak = self.budget.probe.peak(fwd.mem_base)

    def close(self) -> None:
        """Remove hooks, drop the free host buffers, and restore the compiler's budget if budget mode set it."""
        self.end_forward()
        if self.budget is not None:
            _gpu_plan.set_sizing(self.budget, "ActivationOffload", False)
            self.budget.close()
        if self._pool is not None:
            self._pool.clear()

    def _adopt(self, plan: OffloadPlan) -> None:
        self.plan = plan
        if self.budget is None and self._pool is not None and self._idle(plan):
            self._pool.clear()  # See Note [A plan that moves nothing installs nothing]
        self.on_plan(plan)

    # ---------------------------------------------------------------------------------- set-up

    def _resolve(self) -> None:
        if self._enabled is not None:
            return
        opts = self.options
        self.blocks_name, self.blocks = find_blocks(self.model, opts.blocks)
        param = next(self.model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        self._enabled = True
        if opts.backend == "host-copy":
            self._transport = HostCopyTransport(device)
            self._clock = HostClock() if device.type != "cuda" else CudaClock()
            self._pool = HostBufferPool(pin=False, host_memory_fraction=opts.host_memory_fraction)
        elif device.type == "cuda" and torch.cuda.is_available():
            self._transport = CudaTransport(device)
            self._clock = CudaClock()
            self._pool = HostBufferPool(pin=True, host_memory_fraction=opts.host_memory_fraction)
        elif opts.backend == "cuda":
            self._enabled = None
            raise RuntimeError(f"ActivationOffload backend='cuda' needs the model on a CUDA device; its parameters "
                               f"are on {device}.")
        else:
            warnings.warn(f"ActivationOffload: the model is on {device}, not a CUDA GPU; activations stay where "
                          "they are (the run equals a run without it).", stacklevel=3)
            self._enabled = False
            return
        self._check_hf_checkpointing()
        self._find_lean_loss()
        if opts.recompute is not None:
            rc = BlockRecompute(self.blocks, opts.recompute, cache_hooks=self._cache_hooks)
            rc.check()  # already checkpointed, compiled or TE blocks: a clear error now, not mid-step
            self._rcs[opts.recompute] = rc
        n = len(self.blocks)
        if opts.budget is not None:
            self._setup_budget()
        elif opts.policy == "auto":
            self.auto = AutoPlanner(opts, self._link_gbps)
            if opts.bandwidth_gbps is None:
                # Measured now (once per process): the measurement gives the allocators' cached memory back, which the
                # step after it pays to grow again; here that is the warm-up step, not a step the plan is judged on.
                self._link_gbps()
        elif self.plan is None:
            if opts.policy == "all":
                plan = plan_all(n, opts.skip_last_blocks, opts.max_inflight_blocks, opts.prefetch_blocks)
            else:
                plan = plan_first_k(n, int(opts.policy), opts.skip_last_blocks, opts.max_inflight_blocks,
                                    opts.prefetch_blocks)
            self._adopt(plan_with_recompute(plan, opts.recompute))

    def _link_gbps(self) -> tuple[float, float]:
        bw = self.options.bandwidth_gbps
        if isinstance(bw, (int, float)):
            return float(bw), float(bw)
        if bw is not None:
            return float(bw[0]), float(bw[1])
        if self._transport is not None and self._transport.name == "cuda":
            link = hardware.link_bandwidth()
            if link is not None:
                return link.d2h_gbps, link.h2d_gbps
        g = host_copy_gbps()
        return g, g

    @property
    def _cache_hooks(self) -> tuple[Any, Any]:
        """The hooks a selective block's cache goes through (:func:`~lightning_gh.activation_offload.recompute.
        route_cache`): the plan keeps or offloads it like the block's other saved tensors."""
        return self._pack, self._unpack

    def _rc_for(self, mode: str) -> BlockRecompute:
        rc = self._rcs.get(mode)
        if rc is None:
            rc = self._rcs[mode] = BlockRecompute(self.blocks, mode, cache_hooks=self._cache_hooks)
        return rc

    def _find_lean_loss(self) -> None:
        if self.options.lean_loss is False:
            return
        lm = find_causal_lm(self.model)
        if lm is not None:
            self._lean = LeanLoss(lm)
        elif self.options.lean_loss is True:
            raise ValueError(f"lean_loss=True: {type(self.model).__name__} holds no Hugging Face causal LM whose loss "
                             "it can replace (a transformers *ForCausalLM module with loss type 'ForCausalLM' and no "
                             "loss_function of its own). Use lean_loss=None or False.")

    def _lean_overhead_ms(self) -> float | None:
        shape = self._lean.last_logits if self._lean is not None else None
        return lean_loss_overhead_ms(*shape) if shape is not None else None

    def _check_hf_checkpointing(self) -> None:
        """Hugging Face's own gradient checkpointing (``gradient_checkpointing_enable()``) already recomputes every
        decoder layer: the budget planner takes it over, an explicit ``recompute=`` would do the work twice."""
        on = [i for i, b in enumerate(self.blocks) if getattr(b, "gradient_checkpointing", False) is True]
        if not on:
            return
        owner = checkpointing_owner(self.model)
        where = (owner[0] or type(self.model).__name__) if owner else self.blocks_name
        budget, recompute = self.options.budget, self.options.recompute
        if budget is not None:
            if owner is not None:
                owner[1].gradient_checkpointing_disable()
            for b in self.blocks:
                if getattr(b, "gradient_checkpointing", False) is True:
                    b.gradient_checkpointing = False
            warnings.warn(
                f"ActivationOffload(budget={budget!r}): Hugging Face gradient checkpointing was on in "
                f"'{where}' ({len(on)} decoder layers); the budget planner decides per layer what to recompute and "
                "what to offload, so it turned HF's checkpointing off (each layer would otherwise be recomputed by "
                "both, or the plan ignored). Drop gradient_checkpointing_enable() to silence this, or drop budget= "
                "to keep HF's checkpointing.", stacklevel=4)
        elif recompute is not None:
            raise ValueError(
                f"recompute={recompute!r}: Hugging Face gradient checkpointing is on in '{where}' ({len(on)} "
                "decoder layers), so every layer already recomputes its forward; recomputing again would do the "
                "work twice. Use recompute=None (offload what checkpointing still saves), budget=... (the planner "
                "takes over), or call gradient_checkpointing_disable().")
        else:
            log.info("ActivationOffload: Hugging Face gradient checkpointing is on in '%s': its %d decoder layers "
                     "save only their inputs, which is all ActivationOffload can offload.", where, len(on))

    # ---------------------------------------------------------------------------------- measuring

    def _setup_budget(self) -> None:
        # budget_offload=False: no block is eligible to offload, in the plan or at the floor
        opts = self.options if self.options.budget_offload is not False else \
            replace(self.options, skip_last_blocks=len(self.blocks))
        self.budget = ctl = BudgetController(opts, len(self.blocks), self._link_gbps, self._adopt,
                                             MemoryProbe(self.model, self._device), self._lean_overhead_ms)
        owner = compiled_owner(self.model, self.blocks)
        if owner is not None:
            if self.options.causal_sdpa:
                from lightning_gh._hf import keep_causal_sdpa  # only compiled HF decoders need it

                names = keep_causal_sdpa(self.model)
                if names:
                    log.info("ActivationOffload budget: SDPA's causal path kept in %s under torch.compile "
                             "(causal_sdpa=True)", ", ".join(names))
            ctl.start_compiled(owner, on_cuda=self._device is not None and self._device.type == "cuda")
            return
        modes: list[str] = []
        for mode in ("norm-act", "selective", "full"):
            rc = BlockRecompute(self.blocks, mode, cache_hooks=self._cache_hooks)
            try:
                rc.check()
            except ValueError as e:  # compiled or TE blocks: the planner weighs offload (and the other modes) only
                log.info("ActivationOffload budget: recompute mode %r left out: %s", mode, e)
                continue
            if mode == "norm-act" and not any(rc.regions):
                continue  # no norm or gate modules in the blocks: nothing for this mode to recompute
            self._rcs[mode] = rc
            modes.append(mode)
        # The lean loss is measured once (plain blocks): its memory and time are the head's, the blocks' own
        # measurements serve both heads.
        ctl.start(tuple(modes), weigh_lean_loss=self._lean is not None and self.options.lean_loss is None)
        _gpu_plan.set_sizing(ctl, "ActivationOffload", True)

    def _harvest(self) -> None:
        """Hand the measured forwards whose backward has ended to the controller or the ``"auto"`` planner."""
        ctl = self.budget
        if ctl is not None:
            sizing = (BudgetState.MEASURE, BudgetState.RELAX, BudgetState.CORRECT, BudgetState.TRIAL)
            if ctl.state in sizing:
                for fwd in list(self._measured):
                    if fwd.measure is None or not ("bwd_end" in fwd.marks or fwd.bwd_point <= 0):
                        continue
                    self._measured.remove(fwd)
                    if fwd.act_peak is None:  # no end_backward(): the peak up to now (the optimizer step included)
                        fwd.act_peak = ctl.probe.peak(fwd.mem_base)
                    ctl.observe(self._observation(fwd))
                ctl.after_observations()
            # Note [One part sizes GPU memory at a time]
            _gpu_plan.set_sizing(ctl, "ActivationOffload", ctl.state in sizing)
            return
        if self.auto is None or not self._measured:
            return
        steps, times, plan = [], [], None
        for fwd in [f for f in self._measured if f.bwd_point <= 0 or "bwd_end" in f.marks]:
            self._measured.remove(fwd)
            ms = self._clock.ms(fwd.marks["t0"], fwd.marks["bwd_end"]) if "bwd_end" in fwd.marks else None
            if fwd.reference:
                plan = (self.auto.reference_timed(ms) if ms is not None else None) or plan
                continue
            if not fwd.profiling:
                if ms is not None:
                    plan = self.auto.timed(fwd.plan, ms) or plan
                continue
            if fwd.index == 0:
                continue  # warm-up: allocator growth, kernel selection, lazy initialisation
            prof = self._measure(fwd)
            if prof is not None:
                steps.append(prof)
                times += [ms] if ms is not None else []
        if steps and self.plan is None:
            plan = self.auto.observe(steps, times)
        if plan is not None:
            self._adopt(plan)

    def _observation(self, fwd: Forward) -> Observation:
        m = fwd.marks
        ms = self._clock.ms(m["t0"], m["bwd_end"]) if "t0" in m and "bwd_end" in m else None
        return Observation(fwd.measure, fwd.plan, self._measure(fwd) if fwd.profiling else None, tuple(fwd.used),
                           tuple(fwd.offloadable), tuple(fwd.resident), dict(fwd.rc_cached), fwd.other,
                           fwd.act_peak, ms)

    def _measure(self, fwd: Forward) -> StepProfile | None:
        m, n, ms = fwd.marks, fwd.n, self._clock.ms
        need = [("fs", i) for i in range(n)] + [("fe", i) for i in range(n)] + ["fwd_end"] + \
               [("b", i) for i in range(n)]
        if any(k not in m for k in need):
            return None
        blocks = []
        for i in range(n):
            f = ms(m[("fs", i)], m[("fe", i)])
            if i > 0:
                b = ms(m[("b", i)], m[("b", i - 1)])
            else:
                b = ms(m[("b", 0)], m["bwd_end"]) if "bwd_end" in m else 2.0 * f
            # fwd.resident also counts offloadable bytes that stayed (all of them while profiling); the profile's
            # resident bytes are the others, so that offloadable + resident is what the block saved.
            resident = max(fwd.resident[i] - (fwd.offloadable[i] - fwd.used[i]), 0)
            blocks.append(BlockProfile(max(f, 0.0), max(b, 0.0), fwd.offloadable[i], resident))
        bstart = m.get(("b", n), m["fwd_end"])
        return StepProfile(tuple(blocks), max(ms(m[("fe", n - 1)], m["fwd_end"]), 0.0),
                           max(ms(bstart, m[("b", n - 1)]), 0.0), fwd.other)


def offload_activations(model: nn.Module, policy: str | int | None = None, **kwargs: Any) -> ActivationOffloader:
    """An :class:`ActivationOffloader` for plain PyTorch: ``with`` it around each forward.

    Create it once and reuse it every step (its pinned buffer pool and the ``"auto"`` measurements live
    in it); the backward may run outside the ``with``. Arguments as :class:`ActivationOffloader`
    (``policy`` defaults to ``"auto"``; ``options=`` or the option keywords of :class:`ActivationOffloadOptions`).

    Example::

        offload = offload_activations(model, policy=2)
        with offload:
            loss = model(x).square().mean()
        loss.backward()
    """
    return ActivationOffloader(model, policy, **kwargs)
