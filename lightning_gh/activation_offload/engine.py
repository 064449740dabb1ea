"""Move saved activations to host memory during the forward and bring them back ahead of the backward.

The engine wraps every tensor autograd saves inside a transformer block (``saved_tensors_hooks``) and
knows which block is running from forward pre/post hooks on the blocks. For blocks the plan offloads:

* **Forward.** The tensor's whole storage is copied device->host on a dedicated stream (which first waits
  for the compute stream, so the data is complete) into a pinned buffer from a reusable pool. At the
  plan's release point the compute stream waits on the copy's event and the engine drops its reference:
  from then on the caching allocator can hand the memory to later compute-stream work, which the wait
  orders after the copy. Waiting on the GPU rather than polling on the host matters: the host runs ahead
  of the GPU, so a host-side "copy finished?" would almost never be true when the allocator is asked.
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
import statistics
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from lightning_gh import hardware
from lightning_gh.activation_offload import budget as _budget
from lightning_gh.activation_offload.blocks import compiled_owner, find_blocks
from lightning_gh.activation_offload.hooks import Forward, SavedTensorHooks
from lightning_gh.activation_offload.lean_loss import LeanLoss, find_causal_lm, lean_loss_overhead_ms
from lightning_gh.activation_offload.options import ActivationOffloadOptions
from lightning_gh.activation_offload.policy import (
    BlockProfile,
    simulate,
    OffloadPlan,
    StepProfile,
    plan_all,
    plan_auto,
    plan_first_k,
    plan_none,
    plan_with_recompute,
)
from lightning_gh.activation_offload.pool import HostBufferPool
from lightning_gh.activation_offload.recompute import BlockRecompute
from lightning_gh.activation_offload.stats import OffloadStats, TimelinePoint
from lightning_gh.activation_offload.transport import CudaClock, CudaTransport, HostClock, HostCopyTransport, \
    host_copy_gbps

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
        self.policy = opts.policy
        self._blocks_arg = opts.blocks
        self.min_tensor_bytes = opts.min_tensor_bytes
        self.skip_last_blocks = opts.skip_last_blocks
        self.prefetch_blocks = opts.prefetch_blocks
        self.max_inflight_blocks = opts.max_inflight_blocks
        self.margin = opts.margin
        self.profile_steps = opts.profile_steps
        self.host_memory_fraction = opts.host_memory_fraction
        self.backend = opts.backend
        self.bandwidth_gbps = opts.bandwidth_gbps
        self.record_timeline = opts.record_timeline
        self.dedupe_casts = opts.dedupe_casts
        self.recompute_param_casts = opts.recompute_param_casts
        self.recompute = opts.recompute
        self.budget = _budget.parse_budget(opts.budget) if opts.budget is not None else None
        if self.budget is not None:
            self.policy = "budget"
        self._rcs: dict[str, BlockRecompute] = {}
        self._lean: LeanLoss | None = None  # the model's HF causal-LM loss, swappable for the lean one
        self._b_lean = False  # the adopted budget plan uses the lean loss
        # budget mode (see :mod:`.budget`): "measure" -> "correct" -> "done"; "compiled" on a compiled model
        self._b_state = "measure"
        self._b_phases: list[str | None] = []
        self._b_issued = 0
        self._b_meas: dict[str | None, list[tuple[StepProfile, Forward]]] = {}
        self._b_round = 0
        self._b_knob_prev: float | None = None
        self.budget_profile: _budget.BudgetProfile | None = None
        self.budget_bytes: int | None = None
        self.plain_activation_bytes: int | None = None  # the plain step's, no engine effect at all (fractions)
        self.engine_plain_bytes: int | None = None  # the engine's own measuring step (cast dedupe, weight re-cast)
        self._b_raw: Forward | None = None
        self._b_other: int | None = None
        self.forecast: _budget.BudgetForecast | None = None
        self.achieved_bytes: int | None = None
        self.lean_loss_measured: dict[str, float] | None = None  # the lean loss's measuring step, when weighed
        self._b_cbase = 0
        self.budget_log: list[dict[str, Any]] = []  # one entry per plan or correction round (the callback logs them)
        self._rc_forecast_done = False
        self.on_plan = on_plan or (lambda plan: log.info("ActivationOffload %s", plan.describe()))

        self.stats = OffloadStats()
        self.plan: OffloadPlan | None = None
        self.profile: StepProfile | None = None
        self.timeline: list[TimelinePoint] = []
        self.blocks_name: str | None = None
        self.blocks: list[nn.Module] = []
        self._resolved = False
        self._enabled = False
        self._transport: CudaTransport | HostCopyTransport | None = None
        self._clock: CudaClock | HostClock | None = None
        self._pool: HostBufferPool | None = None
        self._device: torch.device | None = None
        self._fwd: Forward | None = None
        self._hooks_ctx: Any = None
        self._module_hooks: list[Any] = []
        self._param_ptrs: set[int] = set()
        self._lock = threading.RLock()
        self._forwards = 0
        self._profiles: list[Forward] = []
        self._profiled: list[StepProfile] = []
        self._saved_bytes = 0
        self._t0 = time.perf_counter()
        self._last_fixed_report = -1

    # ------------------------------------------------------------------------------- public surface

    @property
    def enabled(self) -> bool:
        """Whether the engine moves anything on this machine (``False``: the warned no-op without CUDA)."""
        self._resolve()
        return self._enabled

    @property
    def pool(self) -> HostBufferPool | None:
        return self._pool

    @property
    def transport(self) -> str | None:
        return self._transport.name if self._transport else None

    def set_plan(self, plan: OffloadPlan) -> None:
        """Adopt ``plan`` from the next forward on (e.g. restored from a checkpoint)."""
        self._resolve()
        if plan.n_blocks != len(self.blocks):
            raise ValueError(f"plan has {plan.n_blocks} blocks, the model {len(self.blocks)}.")
        if plan.modes or plan.policy == "budget":
            self.plan = plan
            self._b_state = "done"
            self.on_plan(plan)
            return
        if plan.recompute_mode != self.recompute or \
                (self.recompute and set(plan.recompute) != set(range(plan.n_blocks)) - set(plan.offloaded_blocks)):
            plan = plan_with_recompute(plan, self.recompute)
        self.plan = plan
        self.on_plan(plan)

    def __enter__(self) -> ActivationOffloader:
        self.begin_forward()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.end_forward()
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
            self._compiled_budget_step(owner)
            return
        if owner is not None:
            raise RuntimeError(
                f"ActivationOffload cannot see block boundaries inside the torch.compile'd module '{owner}': "
                "its forward hooks would be traced, not run. Compile each block instead "
                f"(`for i, b in enumerate(<{self.blocks_name}>): <{self.blocks_name}>[i] = torch.compile(b)`), "
                "or turn compilation off for this model.")
        if self._transport is not None and self._transport.name == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("ActivationOffload cannot run inside a CUDA graph capture (e.g. CUDAGraphCapture): "
                               "its copies are ordered by host-side hooks that a replay would skip. "
                               "Use one or the other.")
        self._harvest_profiles()
        tag = None
        if self.budget is not None:
            self._harvest_budget()
            plan, profiling, tag = self._budget_forward_plan()
        else:
            profiling = self.policy == "auto" and self.plan is None
            plan = plan_none(len(self.blocks), "profiling") if profiling else self.plan
        assert plan is not None
        fwd = Forward(self._forwards, plan, profiling)
        fwd.tag = tag
        fwd.raw = tag is not None and tag[0] == "raw"
        if tag is not None:
            self._start_measure(fwd)
        self._forwards += 1
        self.stats.forwards += 1
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._param_ptrs |= {b.untyped_storage().data_ptr() for b in self.model.buffers()}
        if self.record_timeline:
            self.timeline = []
            self._t0 = time.perf_counter()
        self._fwd = fwd
        for i, blk in enumerate(self.blocks):
            self._module_hooks.append(blk.register_forward_pre_hook(self._make_pre(i)))
            self._module_hooks.append(blk.register_forward_hook(self._make_post(i), always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        if plan.recompute:
            try:
                for mode, idx in plan.recompute_groups().items():
                    rc = self._rc_for(mode)
                    rc.reset_counts()
                    rc.apply(idx)
            except BaseException:
                self.end_forward()
                raise
        if self._lean is not None and (plan.lean_loss or (self.options.lean_loss is True and tag != ("raw", None))):
            self._lean.__enter__()

    def end_forward(self) -> None:
        """Stop packing; wait (on the device) for every copy still in flight and release its memory."""
        ctx, fwd = self._hooks_ctx, self._fwd
        self._hooks_ctx, self._fwd = None, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if self._lean is not None:
            self._lean.__exit__()  # the loss's backward needs nothing installed
        for h in self._module_hooks:
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
                self._release_point(fwd, point)
            fwd.current = None
            if fwd.profiling or fwd.tag is not None:
                fwd.marks["fwd_end"] = self._clock.mark()
                self._profiles.append(fwd)
            self.stats.last_offloaded_bytes = sum(fwd.used)
            self.stats.last_offloaded_by_block = list(fwd.used)
            self.stats.last_resident_bytes = sum(fwd.resident)
            self._event("forward-end", fwd.n)
        if applied and self.budget is None:
            self._forecast_recompute(fwd.plan)
        if not fwd.profiling and self.policy not in ("auto", "budget") and self._last_fixed_report < 0:
            self._last_fixed_report = fwd.index
            log.info("ActivationOffload: first offloaded forward moved %.2f GiB (%d blocks), %.2f GiB of saved "
                     "activations stayed in blocks%s", sum(fwd.used) / 2**30, len(fwd.plan.offloaded_blocks),
                     sum(fwd.resident) / 2**30,
                     f"; {len(applied)} blocks recomputed ({self.recompute}), their selective caches held "
                     f"{self.stats.last_recompute_cached_bytes / 2**30:.2f} GiB" if applied else "")

    def end_backward(self) -> None:
        """Optional: mark the backward's end (lets ``"auto"`` measure block 0's backward exactly)."""
        for fwd in self._profiles:
            if "bwd_end" not in fwd.marks and fwd.bwd_point <= fwd.n:
                fwd.marks["bwd_end"] = self._clock.mark()
                if fwd.tag is not None and fwd.act_peak is None:
                    self._end_measure(fwd)

    def _forecast_recompute(self, plan: OffloadPlan) -> None:
        """Redo the plan's forecast once, from what the recomputing blocks kept in this (their first) forward.

        Measured, not predicted from the graph: the first forward that recomputes counts, per block, the
        bytes that reached the engine (inputs of the checkpoints, and for ``"norm-act"`` everything the block
        saves outside its norm and gate modules) plus what the selective caches hold. Needs the profile the
        plan was made from (``"auto"``); a fixed or restored plan states no forecast.
        """
        if self._rc_forecast_done or self.profile is None or plan is not self.plan \
                or plan.prediction is None or not plan.recompute:
            return
        kept = self.stats.last_recompute_kept_by_block
        if set(kept) != set(plan.recompute):
            return
        blocks = tuple(replace(b, recompute_kept_bytes=kept[i]) if i in kept else b
                       for i, b in enumerate(self.profile.blocks))
        self.profile = replace(self.profile, blocks=blocks)
        self._rc_forecast_done = True
        d2h, h2d = self._link_gbps()
        self.plan = plan_with_recompute(plan, self.recompute, self.profile, d2h, h2d, self.margin)
        self.on_plan(self.plan)

    def close(self) -> None:
        """Remove hooks, drop the free host buffers, and restore the compiler's budget if budget mode set it."""
        self.end_forward()
        if self._b_knob_prev is not None:
            import torch._functorch.config as fconfig

            if fconfig.activation_memory_budget != self._b_knob_prev:
                fconfig.activation_memory_budget = self._b_knob_prev
                torch._dynamo.reset()  # graphs partitioned under our budget must not serve later compiles
            self._b_knob_prev = None
        if self._pool is not None:
            self._pool.clear()

    # ---------------------------------------------------------------------------------- set-up

    def _resolve(self) -> None:
        if self._resolved:
            return
        self.blocks_name, self.blocks = find_blocks(self.model, self._blocks_arg)
        param = next(self.model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if self.backend == "host-copy":
            self._device = device
            self._transport = HostCopyTransport(device)
            self._clock = HostClock() if device.type != "cuda" else CudaClock()
            self._pool = HostBufferPool(pin=False, host_memory_fraction=self.host_memory_fraction)
            self._enabled = True
        elif device.type == "cuda" and torch.cuda.is_available():
            self._device = device
            self._transport = CudaTransport(device)
            self._clock = CudaClock()
            self._pool = HostBufferPool(pin=True, host_memory_fraction=self.host_memory_fraction)
            self._enabled = True
        elif self.backend == "cuda":
            raise RuntimeError(f"ActivationOffload backend='cuda' needs the model on a CUDA device; its parameters "
                               f"are on {device}.")
        else:
            warnings.warn(f"ActivationOffload: the model is on {device}, not a CUDA GPU; activations stay where "
                          "they are (the run equals a run without it).", stacklevel=3)
            self._enabled = False
        self._resolved = True
        n = len(self.blocks)
        if self._enabled:
            self._check_hf_checkpointing()
            self._find_lean_loss()
        if self._enabled and self.recompute is not None:
            rc = BlockRecompute(self.blocks, self.recompute)
            rc.check()  # already checkpointed, compiled or TE blocks: a clear error now, not mid-step
            self._rcs[self.recompute] = rc
        if self._enabled and self.budget is not None:
            self._setup_budget()
        if self._enabled and self.policy not in ("auto", "budget") and self.plan is None:
            if self.policy == "all":
                plan = plan_all(n, self.skip_last_blocks, self.max_inflight_blocks, self.prefetch_blocks)
            else:
                plan = plan_first_k(n, int(self.policy), self.skip_last_blocks, self.max_inflight_blocks,
                                    self.prefetch_blocks)
            self.plan = plan_with_recompute(plan, self.recompute)
            self.on_plan(self.plan)

    def _link_gbps(self) -> tuple[float, float]:
        bw = self.bandwidth_gbps
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

    def _rc_for(self, mode: str) -> BlockRecompute:
        rc = self._rcs.get(mode)
        if rc is None:
            rc = self._rcs[mode] = BlockRecompute(self.blocks, mode)
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

    def _check_hf_checkpointing(self) -> None:
        """Hugging Face's own gradient checkpointing (``gradient_checkpointing_enable()``) already recomputes every
        decoder layer: the budget planner takes it over, an explicit ``recompute=`` would do the work twice."""
        on = [i for i, b in enumerate(self.blocks) if getattr(b, "gradient_checkpointing", False) is True]
        if not on:
            return
        owner = next(((n, m) for n, m in self.model.named_modules()
                      if hasattr(m, "gradient_checkpointing_disable") and getattr(m, "is_gradient_checkpointing", False)),
                     None)
        where = (owner[0] or type(self.model).__name__) if owner else self.blocks_name
        if self.budget is not None:
            if owner is not None:
                owner[1].gradient_checkpointing_disable()
            for b in self.blocks:
                if getattr(b, "gradient_checkpointing", False) is True:
                    b.gradient_checkpointing = False
            warnings.warn(
                f"ActivationOffload(budget={self.options.budget!r}): Hugging Face gradient checkpointing was on in "
                f"'{where}' ({len(on)} decoder layers); the budget planner decides per layer what to recompute and "
                "what to offload, so it turned HF's checkpointing off (each layer would otherwise be recomputed by "
                "both, or the plan ignored). Drop gradient_checkpointing_enable() to silence this, or drop budget= "
                "to keep HF's checkpointing.", stacklevel=4)
        elif self.recompute is not None:
            raise ValueError(
                f"recompute={self.recompute!r}: Hugging Face gradient checkpointing is on in '{where}' ({len(on)} "
                "decoder layers), so every layer already recomputes its forward; recomputing again would do the "
                "work twice. Use recompute=None (offload what checkpointing still saves), budget=... (the planner "
                "takes over), or call gradient_checkpointing_disable().")
        else:
            log.info("ActivationOffload: Hugging Face gradient checkpointing is on in '%s': its %d decoder layers "
                     "save only their inputs, which is all ActivationOffload can offload.", where, len(on))

    # ---------------------------------------------------------------------------------- budget

    def _setup_budget(self) -> None:
        owner = compiled_owner(self.model, self.blocks)
        if owner is not None:
            self._b_state = "compiled"
            if self.options.causal_sdpa:
                from lightning_gh.precision.hf_sdpa import keep_causal_sdpa  # only compiled HF decoders need it

                names = keep_causal_sdpa(self.model)
                if names:
                    log.info("ActivationOffload budget: SDPA's causal path kept in %s under torch.compile "
                             "(causal_sdpa=True)", ", ".join(names))
            if self.budget.fraction is not None:
                self._set_knob(_budget.compiler_budget(self.budget.fraction), owner,
                               f"a fraction budget of {self.budget.fraction:.0%}")
            elif self._device is None or self._device.type != "cuda":
                raise ValueError(f"budget={self.options.budget!r} on the compiled module '{owner}': a size budget is "
                                 "turned into the compiler's activation_memory_budget from a measured CUDA step; "
                                 "on this device pass a fraction instead (e.g. budget=0.5).")
            else:
                self._b_state = "compiled-measure"
            return
        modes: list[str] = []
        for mode in ("norm-act", "selective", "full"):
            rc = BlockRecompute(self.blocks, mode)
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
        lean = [_LEAN] if self._lean is not None and self.options.lean_loss is None else []
        self._b_phases = [_RAW] + [None] * self.profile_steps + lean + list(modes)

    def _set_knob(self, value: float, owner: str, why: str) -> None:
        import torch._functorch.config as fconfig

        if self._b_knob_prev is None:
            self._b_knob_prev = fconfig.activation_memory_budget
        if fconfig.activation_memory_budget != value:
            fconfig.activation_memory_budget = value
            # The knob is read when a graph is partitioned: a graph compiled before (another instance of the same
            # model class reuses it: the H200 run of 2026-11-23 measured no change without this) must be dropped.
            torch._dynamo.reset()
        msg = (f"ActivationOffload budget: '{owner}' is torch.compile'd, so its blocks' boundaries are traced, not "
               f"run; set torch._functorch.config.activation_memory_budget = {value:.3f} for {why} (the compiler "
               "recomputes what it must; restored when training ends)")
        log.info(msg)
        self.budget_log.append({"activation_budget/compiler_budget": value})
        self.plan = plan_none(len(self.blocks), "budget-compiled")
        self.plan = OffloadPlan("budget-compiled", self.plan.budgets, self.plan.release_at, self.plan.prefetch_at,
                                notes=(msg,))
        self.on_plan(self.plan)

    def _compiled_budget_step(self, owner: str) -> None:
        """Budget mode on a compiled model: no hooks; a size budget measures one compiled step, then sets the
        compiler's fraction and recompiles once."""
        if self._b_state != "compiled-measure":
            return
        self._forwards += 1
        dev = self._device
        if self._forwards == 1:
            return  # the first call compiles: not a step to measure
        if self._forwards == 2:
            self._b_cbase = torch.cuda.memory_allocated(dev) - self._grad_bytes(present=True) + self._grad_bytes()
            torch.cuda.reset_peak_memory_stats(dev)
            return
        act = torch.cuda.max_memory_allocated(dev) - self._b_cbase
        self.plain_activation_bytes = act
        self.budget_bytes = self.budget.resolve(act)
        self._b_state = "compiled"
        frac = min(1.0, self.budget_bytes / max(act, 1))
        if frac >= 1.0:
            log.info("ActivationOffload budget %s >= the compiled step's %.2f GiB: nothing to do",
                     self.budget.describe(), act / 2**30)
            return
        self._set_knob(_budget.compiler_budget(frac), owner,
                       f"{self.budget_bytes / 2**30:.2f} GiB of the compiled step's measured {act / 2**30:.2f} GiB "
                       "(torch._dynamo.reset(): the model recompiles once)")

    def _grad_bytes(self, present: bool = False) -> int:
        if present:
            return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def _budget_forward_plan(self) -> tuple[OffloadPlan, bool, Any]:
        n = len(self.blocks)
        if self._b_state == "measure":
            if self._forwards == 0:
                plan = plan_none(n, "budget-warmup")
                if _LEAN in self._b_phases:
                    # The warm-up runs the lean loss too: what it saves outside the blocks is then the lean head's,
                    # the lower bound of the floor, and the lean loss's measuring step is not its first use.
                    plan = replace(plan, lean_loss=True)
                return plan, True, ("warmup", None)
            mode = self._b_phases[self._b_issued] if self._b_issued < len(self._b_phases) else None
            self._b_issued += 1
            if mode == _RAW:
                return plan_none(n, "budget-raw"), True, ("raw", None)
            plan = plan_none(n, "budget-measure")
            if mode == _LEAN:
                plan = replace(plan, lean_loss=True)
                return plan, True, ("measure", mode)
            if mode is not None:
                plan = replace(plan, modes=(mode,) * n)
            return plan, True, ("measure", mode)
        assert self.plan is not None
        if self._b_state == "correct":
            return self.plan, False, ("correct", self._b_round)
        return self.plan, False, None

    def _start_measure(self, fwd: Forward) -> None:
        if self._device is not None and self._device.type == "cuda":
            # The model state is what is allocated now, gradients counted at their full size whether or not they
            # exist yet (Lightning sets them to None between steps): the activation memory is the peak above it.
            fwd.mem_base = torch.cuda.memory_allocated(self._device) - self._grad_bytes(present=True) \
                + self._grad_bytes()
            torch.cuda.reset_peak_memory_stats(self._device)
        fwd.marks["t0"] = self._clock.mark()

    def _end_measure(self, fwd: Forward) -> None:
        if fwd.mem_base is not None:
            fwd.act_peak = torch.cuda.max_memory_allocated(self._device) - fwd.mem_base

    def _harvest_budget(self) -> None:
        if self._b_state not in ("measure", "correct"):
            return
        for fwd in list(self._profiles):
            if fwd.tag is None or not ("bwd_end" in fwd.marks or fwd.bwd_point <= 0):
                continue
            self._profiles.remove(fwd)
            if fwd.act_peak is None:
                self._end_measure(fwd)  # no end_backward(): the peak up to now (the optimizer step included)
            kind, arg = fwd.tag
            if kind == "warmup":
                self._b_other = fwd.other
                self._check_lower_bound()
            elif kind == "raw":
                self._b_raw = fwd
                if fwd.act_peak is not None:
                    self.plain_activation_bytes = fwd.act_peak
                self._check_lower_bound()
            elif kind == "measure" and self._b_state == "measure":
                prof = self._measure(fwd)
                if prof is not None:
                    self._b_meas.setdefault(arg, []).append((prof, fwd))
            elif kind == "correct" and self._b_state == "correct" and fwd.plan is self.plan:
                self._correct(fwd)
        if self._b_state == "measure":
            self._make_budget_plan()

    def _make_budget_plan(self) -> None:
        plain = self._b_meas.get(None, [])
        modes = [m for m in self._b_phases if m not in (None, _RAW, _LEAN)]
        want_lean = _LEAN in self._b_phases
        if self._b_raw is None or len(plain) < self.profile_steps or any(m not in self._b_meas for m in modes) \
                or (want_lean and _LEAN not in self._b_meas):
            return
        n = len(self.blocks)
        step = _median_profile([p for p, _ in plain])
        costs: list[dict[str | None, _budget.ModeCost]] = []
        for i in range(n):
            base = step.blocks[i].forward_ms + step.blocks[i].backward_ms
            c: dict[str | None, _budget.ModeCost] = {}
            for mode in modes:
                prof, fwd = self._b_meas[mode][0]
                kept = fwd.resident[i] + fwd.used[i] + fwd.rc_cached.get(i, 0)
                extra = max(0.0, prof.blocks[i].forward_ms + prof.blocks[i].backward_ms - base)
                c[mode] = _budget.ModeCost(kept, min(fwd.offloadable[i], kept), extra)
            costs.append(c)
        bp = _budget.BudgetProfile(step, tuple(costs), 0)
        d2h, h2d = self._link_gbps()
        model_plain = _budget.plan_budget(bp, 2**62, d2h, h2d, self.margin, self.skip_last_blocks)[1].activation_bytes
        peaks = [f.act_peak for _, f in plain if f.act_peak is not None]
        act = int(statistics.median(peaks)) if peaks else model_plain
        self.budget_profile = bp = bp.with_overhead(act - model_plain)
        self.engine_plain_bytes = act
        variants = [(bp, False)]
        if want_lean:
            variants.append((self._lean_profile(bp, d2h, h2d), True))
        # The reference of a fraction: the raw step, measured on CUDA, or on a CPU its tracked saved bytes under the
        # same timeline model as the planner's (so both sides of the comparison count alike).
        raw = self._b_raw.act_peak if self._b_raw.act_peak is not None else self._tracked_activation(self._b_raw)
        self.plain_activation_bytes = raw
        self.budget_bytes = budget = self.budget.resolve(raw)
        sz = self._size
        if budget >= act:
            self._b_state = "done"
            plan = plan_none(n, "budget")
            self.plan = OffloadPlan("budget", plan.budgets, plan.release_at, plan.prefetch_at, notes=(
                f"budget {sz(budget)} ({self.budget.describe()}; the plain step measured {sz(raw)}) >= the "
                f"{sz(act)} the engine's own step needs with its free savings (cast dedupe, weight re-cast): "
                "nothing to do",))
            self.budget_log.append({"activation_budget/target_gib": budget / 2**30,
                                    "activation_budget/plain_gib": raw / 2**30,
                                    "activation_budget/engine_plain_gib": act / 2**30})
            self.on_plan(self.plan)
            return
        best, err = None, None
        for vbp, lean in variants:
            try:
                plan, fc = _budget.plan_budget(vbp, budget, d2h, h2d, self.margin, self.skip_last_blocks)
            except ValueError as e:
                err = e  # the last variant's floor is the lowest (the lean loss's, when weighed)
                continue
            if best is None or fc.step_ms < best[1].step_ms - 1e-6:
                best = (plan, fc, vbp, lean)
        if best is None:
            self._b_state = "failed"
            raise ValueError(f"ActivationOffload budget={self.options.budget!r} ({self.budget.describe()}; the "
                             f"plain step measured {sz(raw)}): {err} Checked after the {self._forwards} measuring "
                             "steps, before any planned step.") from None
        plan, fc, self.budget_profile, self._b_lean = best
        self._b_state, self._b_round = "correct", 0
        self._adopt_budget_plan(plan, fc)

    def _lean_profile(self, bp: _budget.BudgetProfile, d2h: float, h2d: float) -> _budget.BudgetProfile:
        """``bp`` with the lean loss's head: what its measuring step saved outside the blocks, its head time, and
        the overhead its measured peak shows above the timeline model."""
        prof, fwd = self._b_meas[_LEAN][0]
        step = bp.step
        # Only the head differs from the plain step; its extra time (the backward's second log-softmax) is charged
        # to the tail, the rest of the single measurement's noise is not.
        step_extra = max(0.0, prof.tail_forward_ms + prof.tail_backward_ms - step.tail_forward_ms
                         - step.tail_backward_ms)
        # On CUDA the head's extra time is timed alone on the logits' shape: one whole step is too noisy for it
        shape = self._lean.last_logits if self._lean is not None else None
        alone = lean_loss_overhead_ms(*shape) if shape is not None else None
        extra = step_extra if alone is None else alone
        lstep = replace(step, tail_backward_ms=step.tail_backward_ms + extra, other_bytes=fwd.other)
        lbp = _budget.BudgetProfile(lstep, bp.costs, 0)
        model = _budget.plan_budget(lbp, 2**62, d2h, h2d, self.margin, self.skip_last_blocks)[1].activation_bytes
        act = fwd.act_peak if fwd.act_peak is not None else model
        self.lean_loss_measured = {"activation_gib": act / 2**30, "head_extra_ms": extra,
                                   "head_extra_in_step_ms": step_extra, "other_gib": fwd.other / 2**30}
        return lbp.with_overhead(act - model)

    def _check_lower_bound(self) -> None:
        """Refuse a budget that no plan can reach as soon as that is certain, before the measuring steps end.

        What the step saves outside the blocks (embedding output, final norm, the head's input and logits) stays on
        the device under every plan, all of it at the end of the forward, so it bounds the floor from below. It is
        known after the warm-up step; a fraction also needs the raw step's measured peak (CUDA). The exact floor
        (full recompute plus offload in every block) needs the measuring steps and is checked right after them.
        """
        other = self._b_other
        if other is None or self._b_state != "measure":
            return
        if self.budget.bytes is not None:
            budget = self.budget.bytes
        elif self.plain_activation_bytes is not None:
            budget = self.budget.resolve(self.plain_activation_bytes)
        else:
            return
        if budget < other:
            self._b_state = "failed"
            sz = self._size
            of = "" if self.budget.bytes is not None else \
                f" ({self.budget.describe()}; the plain step measured {sz(self.plain_activation_bytes)})"
            raise ValueError(
                f"ActivationOffload budget={self.options.budget!r}: {sz(budget)}{of} of activation memory is below "
                f"the floor of full recompute plus offload, which is at least {sz(other)} on this model and batch: "
                "what the step saves outside the transformer blocks (embedding, final norm, head and logits) stays "
                f"on the device under every plan. Raise the budget above {sz(other)} (the exact floor is measured "
                f"in the next steps), or shrink the batch or sequence. Checked after {self._forwards} step(s).")

    @staticmethod
    def _size(nbytes: float) -> str:
        for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(nbytes) >= 0.1 * k:
                return f"{nbytes / k:.2f} {unit}"
        return f"{nbytes:.0f} B"

    def _adopt_budget_plan(self, plan: OffloadPlan, fc: _budget.BudgetForecast) -> None:
        act, budget = self.plain_activation_bytes, self.budget_bytes
        d2h, h2d = self._link_gbps()
        sz = self._size
        rnd = f" (correction {self._b_round})" if self._b_round else ""
        note = (f"budget {sz(budget)} ({self.budget.describe()}; the plain step measured "
                f"{sz(act)}, the engine's measuring step {sz(self.engine_plain_bytes)}); plan{rnd}: "
                f"{fc.describe_choices()}; predicted {sz(fc.activation_bytes)} at {fc.step_ms:.1f} ms "
                f"fwd+bwd ({fc.ratio:.2f}x the plain {fc.plain_step_ms:.1f} ms: recompute +{fc.recompute_ms:.1f} ms, "
                f"link stall +{fc.stall_ms:.1f} ms at {d2h:.0f}/{h2d:.0f} GB/s, margin {self.margin:.0%})")
        if self._b_lean:
            note += "; lean loss on (its measured step: " + \
                f"{sz(self.lean_loss_measured['activation_gib'] * 2**30)}, head +" + \
                f"{self.lean_loss_measured['head_extra_ms']:.1f} ms)"
        self.plan = replace(plan, notes=(note,), lean_loss=self._b_lean)
        self.forecast = fc
        self.budget_log.append({"activation_budget/target_gib": budget / 2**30,
                                "activation_budget/plain_gib": act / 2**30,
                                "activation_budget/engine_plain_gib": self.engine_plain_bytes / 2**30,
                                "activation_budget/predicted_gib": fc.activation_bytes / 2**30,
                                "activation_budget/predicted_ms": fc.step_ms,
                                "activation_budget/round": float(self._b_round),
                                "activation_budget/lean_loss": float(self._b_lean)})
        self.on_plan(self.plan)

    def _tracked_activation(self, fwd: Forward) -> int:
        """Activation memory of ``fwd`` from the bytes the engine tracked (no CUDA memory statistics)."""
        bp = self.budget_profile
        blocks, budgets, transient = [], [], []
        for i, b in enumerate(bp.step.blocks):
            kept = fwd.resident[i] + fwd.rc_cached.get(i, 0)
            blocks.append(BlockProfile(b.forward_ms, b.backward_ms, fwd.used[i], kept))
            budgets.append(None if fwd.used[i] else 0)
            transient.append(max(b.saved_bytes - kept - fwd.used[i], 0) if fwd.plan.mode_of(i) else 0)
        prof = replace(bp.step, blocks=tuple(blocks), other_bytes=fwd.other or bp.step.other_bytes)
        d2h, h2d = self._link_gbps()
        pred = simulate(prof, tuple(budgets), fwd.plan.release_at, fwd.plan.prefetch_at, d2h, h2d, self.margin,
                        tuple(transient))
        return pred.peak_bytes + bp.overhead_bytes

    def _correct(self, fwd: Forward) -> None:
        """Compare the planned step's measured activation memory with the budget; plan again if it is off."""
        achieved = fwd.act_peak if fwd.act_peak is not None else self._tracked_activation(fwd)
        ms = self._clock.ms(fwd.marks["t0"], fwd.marks["bwd_end"]) if "bwd_end" in fwd.marks else None
        budget, fc = self.budget_bytes, self.forecast
        entry = {"activation_budget/achieved_gib": achieved / 2**30, "activation_budget/round": float(self._b_round),
                 "activation_budget/target_gib": budget / 2**30,
                 "activation_budget/predicted_gib": fc.activation_bytes / 2**30}
        if ms is not None:
            entry["activation_budget/measured_ms"] = ms
        self.budget_log.append(entry)
        self.achieved_bytes = achieved
        within = 0.95 * budget <= achieved <= budget
        sz = self._size
        msg = (f"ActivationOffload budget round {self._b_round}: achieved {sz(achieved)} against "
               f"{sz(budget)} (predicted {sz(fc.activation_bytes)})"
               + (f", fwd+bwd {ms:.1f} ms (predicted {fc.step_ms:.1f} ms)" if ms is not None else ""))
        if within or self._b_round >= 2:
            self._b_state = "done"
            log.info("%s: %s", msg, "within the budget" if within else "kept (no more correction rounds)")
            return
        bp = self.budget_profile.with_overhead(self.budget_profile.overhead_bytes + achieved - fc.activation_bytes)
        d2h, h2d = self._link_gbps()
        try:
            plan, new_fc = _budget.plan_budget(bp, budget, d2h, h2d, self.margin, self.skip_last_blocks)
        except ValueError as e:
            self._b_state = "done"
            log.warning("%s; no correction fits: %s", msg, e)
            return
        log.info("%s; correcting the overhead estimate by %+.2f GiB", msg, (achieved - fc.activation_bytes) / 2**30)
        self.budget_profile = bp
        self._b_round += 1
        self._adopt_budget_plan(plan, new_fc)

    # -------------------------------------------------------------------------------- "auto"

    def _harvest_profiles(self) -> None:
        if self.policy != "auto" or self.plan is not None or not self._profiles:
            return
        done = [f for f in self._profiles if f.bwd_point <= 0 or "bwd_end" in f.marks]
        for fwd in done:
            self._profiles.remove(fwd)
            if fwd.index == 0:
                continue  # warm-up: allocator growth, kernel selection, lazy initialisation
            prof = self._measure(fwd)
            if prof is not None:
                self._profiled.append(prof)
        if len(self._profiled) >= self.profile_steps:
            self.profile = _median_profile(self._profiled)
            d2h, h2d = self._link_gbps()
            plan = plan_auto(self.profile, d2h, h2d, self.margin, self.skip_last_blocks)
            self.plan = plan_with_recompute(plan, self.recompute, self.profile, d2h, h2d, self.margin)
            self.on_plan(self.plan)

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


_RAW = "raw"  # budget mode's measuring phase with no engine effect: the reference of a fraction budget
_LEAN = "lean-loss"  # budget mode's measuring phase with the lean causal-LM loss and plain blocks


def _median_profile(profiles: list[StepProfile]) -> StepProfile:
    n = profiles[0].n_blocks
    med = statistics.median
    blocks = tuple(
        BlockProfile(med(p.blocks[i].forward_ms for p in profiles), med(p.blocks[i].backward_ms for p in profiles),
                     int(med(p.blocks[i].offloadable_bytes for p in profiles)),
                     int(med(p.blocks[i].resident_bytes for p in profiles)),
                     None if any(p.blocks[i].recompute_kept_bytes is None for p in profiles)
                     else int(med(p.blocks[i].recompute_kept_bytes for p in profiles)))
        for i in range(n))
    return StepProfile(blocks, med(p.tail_forward_ms for p in profiles), med(p.tail_backward_ms for p in profiles),
                       int(med(p.other_bytes for p in profiles)))


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
