"""SuperOffload: a heterogeneous CPU/GPU AdamW that keeps optimizer state in host memory and hides the
CPU update behind the backward pass.

What lives where
    GPU: the model's weights (bf16 under ``precision="bf16-true"``, fp32 under ``"bf16-mixed"``) and, only
    while they are in flight, the gradients of offloaded parameters. Host: fp32 master weights, both AdamW
    moments and a gradient landing buffer (bf16 for bf16 parameters when our CPU kernel runs, else fp32),
    14-16 B per offloaded parameter, plus 12 B for each bucket updated speculatively (the host plan,
    :func:`~lightning_gh.superoffload.memory.plan_host_memory`, picks those from the RAM it measures). The
    parameters whose gradients arrive last (the first layers) may stay on the GPU with the fused GPU AdamW
    (the "GPU tail", ``gpu_fraction``): the next forward needs them first.

The pipeline (one optimizer step)
    1. Backward: a post-accumulate-grad hook fires as each gradient becomes final. It adds the
       gradient's norm to a GPU-side vector (for clipping and the non-finite check), copies the gradient
       to the host on a copy stream (as it is for bf16 parameters when our CPU kernel runs, which widens it
       exactly; else cast to fp32 on the GPU) and frees it on the GPU. When every parameter of a bucket
       (buckets follow gradient-arrival order) has landed, the bucket goes to a CPU worker thread.
    2. The worker waits for the bucket's copy event, runs a fused CPU AdamW (our kernel, :mod:`.cpu_adamw`,
       or torch's) on the fp32 master weights and moments (multithreaded, vectorised, GIL released) and
       streams the updated weights back on a second stream (fp32 over the link, cast to the parameter dtype
       on the GPU).
    3. ``step()`` computes the global gradient norm on the GPU, updates the GPU tail with the fused GPU
       kernel and posts the clip/skip decision to the worker; it does not wait for the CPU.
    4. The next forward waits per bucket: a forward pre-hook on each module that owns offloaded
       parameters blocks until that bucket's update is committed and makes the current stream wait on
       the bucket's host-to-device event. Without ``module=`` (no hooks) ``step()`` waits for all buckets.

Speculation, validation and exact rollback
    The worker starts updating buckets before backward has finished, i.e. before the global gradient norm
    is known, and undoes such an update exactly when the step must be clipped or skipped. See
    Note [Speculative update and exact rollback] in :mod:`.worker`. The learning rate and the other
    hyper-parameters are read when a step's backward starts; if they change before ``step()``, the speculative
    work is redone with the new values.

Gradient accumulation
    Gradients of micro-batches that do not end in ``step()`` must stay on the GPU. In plain PyTorch wrap
    those backward passes in ``with optimizer.accumulating():``; outside that block every backward is
    treated as the last one of the step. Under Lightning's automatic optimization (the strategy passes
    ``pipeline_trigger="closure"``) only the backward that runs inside ``step(closure)`` starts the
    pipeline, which is exactly the last micro-batch.

Layout
    With ``module=`` the buckets are laid out at construction in the module's parameter order reversed
    (the order gradients usually arrive in), so even the first step is pipelined. Without it the first
    backward only records the arrival order (its gradients stay on the GPU) and the first ``step()``
    lays out the buckets and allocates the host buffers.

Auto GPU tail (``gpu_fraction="auto"``, CUDA only)
    Everything starts on the host; over the first pipelined steps the last-processed host buckets (the earliest
    layers) move to the GPU while the next forward measurably waits for the CPU, each growth a trial kept only if
    the step gets faster. See Note [Tail growth trial] in :mod:`.tail`; the mover is :mod:`.tail_mover`.

Math
    Identical to ``torch.nn.utils.clip_grad_norm_`` followed by ``torch.optim.AdamW(fused=True)`` on the fp32
    master weights, parameter by parameter (same kernel, same clip coefficient), with one addition: a
    step whose gradient norm is not finite is skipped (state and step counters untouched) when
    ``skip_nonfinite`` is on. With fp32 parameters the GPU weights equal the master weights bitwise.

Example::

    >>> import torch
    >>> from lightning_gh.superoffload import HeterogeneousAdamW
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    >>> opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, module=model)
    >>> for _ in range(3):
    ...     model(torch.randn(4, 8)).square().mean().backward()
    ...     opt.step()
    ...     opt.zero_grad()
    >>> opt.synchronize(); opt.close()
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Literal

import torch
from torch import nn

from lightning_gh.superoffload import memory
from lightning_gh.superoffload.assist import DeviceAssist, assist_enabled
from lightning_gh.superoffload.layout import (
    Bucket,
    HostLayout,
    Slot,
    WaitBeforeCompiledCall,
    compiled_regions,
    forward_hook_sites,
)
from lightning_gh.superoffload.memory import HostMemoryPlan
from lightning_gh.superoffload.options import (
    SuperOffloadOptions,
    resolve_options,
    validate_hyperparameters,
    validate_knobs,
)
from lightning_gh.superoffload.state import (
    adamw_arguments,
    adamw_group_defaults,
    check_group,
    check_param,
    load_into,
    pack_state_dict,
)
from lightning_gh.superoffload.step import GradNorms, StepCtx
from lightning_gh.superoffload.tail import StepTimes
from lightning_gh.superoffload.tail_mover import (
    TAIL_HEADROOM_MIN_BYTES,
    TAIL_HEADROOM_SHARE,
    TailMover,
    update_device_tail,
)
from lightning_gh.superoffload.worker import CpuUpdater
from lightning_gh.superoffload.zero import RankShard, current_group, default_cpu_threads

__all__ = ["HeterogeneousAdamW"]

class HeterogeneousAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in pinned host memory and are updated on the CPU
    while the backward pass still runs; the last-arriving parameters can stay on the GPU.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW`` (each group may set ``lr``,
            ``betas``, ``eps``, ``weight_decay``).
        lr: learning rate; read at the start of every step's backward, so LR schedulers work.
        betas: AdamW ``(beta1, beta2)``.
        eps: AdamW epsilon.
        weight_decay: decoupled weight decay.
        max_grad_norm: clip the global gradient L2 norm to this value (as ``clip_grad_norm_``), or ``None``;
            change it later with :meth:`set_max_grad_norm`.
        max_grad_value: clamp every gradient element to ``[-v, v]`` before anything else, or ``None``;
            change it later with :meth:`set_max_grad_value`.
        module: the model; when given, forward pre-hooks make each layer wait only for its own bucket.
        pipeline_trigger: ``"backward"``: every backward outside :meth:`accumulating` ends the step's gradients;
            ``"closure"``: only a backward inside ``step(closure)`` does (Lightning's automatic optimization).
        options: the shared options as one :class:`~lightning_gh.superoffload.SuperOffloadOptions`.
        **option_kwargs: the same options as keyword arguments instead (``gpu_fraction=0.0``, ...); see
            :class:`~lightning_gh.superoffload.SuperOffloadOptions`. Giving both is an error.

    ``stats`` holds counters for diagnosis: steps clipped and skipped, steps allowed to speculate
    (``speculated_steps``; ``last_speculated`` for the last decided step, see
    :func:`~lightning_gh.superoffload.step.should_speculate`), buckets updated speculatively
    (``speculative_buckets``) and redone after a rollback (``rollbacks``), how long the CPU still worked on the last
    step after ``step()`` (``last_cpu_after_step_ms``), the tail's decision, the CPU worker's cumulative
    milliseconds per phase (``cpu_phases_ms``) and the training thread's in the optimizer's hooks
    (``loop_phases_ms``: ``grad_hooks``, and ``forward_hooks`` less their waits for the CPU, which
    ``last_stall_ms`` reports per step).

    This class holds the param groups, the hooks, ``step()`` and the state dict; its collaborators are the host
    layout (:attr:`layout`), the CPU updater (:attr:`updater`), the auto tail's mover (:attr:`tail`, or ``None``)
    and, over several ranks, the rank shard.

    Example: see the module's.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
        module: nn.Module | None = None,
        pipeline_trigger: Literal["backward", "closure"] = "backward",
        options: SuperOffloadOptions | None = None,
        **option_kwargs: Any,
    ) -> None:
        opts = resolve_options(options, "HeterogeneousAdamW", **option_kwargs)
        validate_hyperparameters("", lr, betas, eps, weight_decay)
        validate_knobs(max_grad_norm=max_grad_norm, max_grad_value=max_grad_value, pipeline_trigger=pipeline_trigger)
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or None, got {type(module).__name__}.")
        defaults = adamw_group_defaults()
        defaults.update(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                        weight_decay=float(weight_decay))
        super().__init__(params, defaults)

        self.options = opts
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._max_grad_value = None if max_grad_value is None else float(max_grad_value)
        self._pipeline_trigger = pipeline_trigger
        devices = {p.device for g in self.param_groups for p in g["params"] if isinstance(p, torch.Tensor)}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        group = current_group()  # several ranks (a process group of 2+): each owns a share of the state (.zero)
        layout = self._layout = HostLayout(self.device, rank=0 if group is None else group.rank)
        self._hook_handles: list[Any] = []
        for gi, g in enumerate(self.param_groups):
            check_group(g, gi)
            for p in g["params"]:
                self._add_slot(p, gi)
        if len(devices) > 1:
            raise ValueError(f"HeterogeneousAdamW needs all parameters on one device, found {sorted(map(str, devices))}.")
        cuda = layout.cuda
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if cuda else (None, None)
        self._norms = GradNorms(self.device)
        self._shard = None if group is None else RankShard(group, layout, self._norms, self._streams[0])
        self.stats: dict[str, Any] = {"steps": 0, "clipped_steps": 0, "skipped_steps": 0, "rollbacks": 0,
                                      "speculative_buckets": 0, "prefetched_backups": 0, "speculated_steps": 0,
                                      "last_speculated": None, "last_cpu_after_step_ms": None, "last_stall_ms": 0.0,
                                      "last_slack_ms": None, "cpu_ms_per_step": 0.0, "tail_moves": 0,
                                      "tail_moves_back": 0, "tail_limited": 0, "tail_move_failures": 0,
                                      "tail_decision": None, "cpu_phases_ms": {}, "last_grad_norm": None,
                                      "loop_phases_ms": {"grad_hooks": 0.0, "forward_hooks": 0.0}}
        threads = opts.cpu_threads or default_cpu_threads(cuda, None if group is None else group.local_size)
        self.stats.update(assisted_buckets=0, assisted_numel=0, writeback_ms=0.0)
        on = assist_enabled(opts.device_assist, cuda, group is not None, torch.are_deterministic_algorithms_enabled())
        assist = DeviceAssist(layout, self.stats) if on else None
        layout.pin_moments = assist is not None  # the GPU's copies of the moments are then async
        self._updater = CpuUpdater(layout, self._streams[1], threads, opts.speculative is not False, self.stats,
                                   assist, opts.weights_first)
        auto = opts.gpu_fraction == "auto"
        self._tail = TailMover(layout, opts.max_gpu_fraction, self.stats, self._shard) if auto else None
        self._times = StepTimes()
        self._ctx: StepCtx | None = None  # the open step (first armed hook .. step())
        self._step_id = 0
        self._posted_step = -1  # the last step whose decision step() posted
        self._accumulating = False
        self._in_closure = False
        self._module: nn.Module | None = None
        self._module_hooks: list[Any] = []
        # the hooked module's submodules, and which of them were compiled regions then (see attach)
        self._watch: tuple[list[nn.Module], frozenset[int]] = ([], frozenset())
        self._closed = False
        self._plan_host()  # before anything is allocated
        if module is not None:
            self.attach(module)
            # Lay the buckets out now, in the order the module registers its parameters, reversed (the usual
            # order gradients arrive in), so the first step is pipelined too and never holds every gradient
            # on the GPU at once.
            slot_of = layout.slot_of
            guess = [slot_of[id(p)].index for p in reversed(list(module.parameters()))
                     if id(p) in slot_of and p.requires_grad]
            with torch.no_grad():
                self._build_layout(guess)

    # ------------------------------------------------------------------ setup helpers
    def _add_slot(self, p: torch.Tensor, gi: int) -> None:
        check_param(p, self._layout.slot_of)
        self._layout.add_slot(p, gi)
        if p.requires_grad:
            wself = weakref.ref(self)

            def hook(param: torch.Tensor, _wself=wself) -> None:
                opt = _wself()
                if opt is not None:
                    opt._on_grad(param)

            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        layout = self.__dict__.get("_layout")  # None while torch's __init__ adds the first groups
        if layout is not None and layout.built:
            raise RuntimeError("HeterogeneousAdamW.add_param_group() after the first step() is not supported: "
                               "the host buffers are laid out at the first step.")
        super().add_param_group(param_group)
        if layout is None:
            return
        gi = len(self.param_groups) - 1
        check_group(self.param_groups[gi], gi)
        for p in self.param_groups[gi]["params"]:
            self._add_slot(p, gi)

    def _needs_validation(self) -> bool:
        return self._max_grad_norm is not None or self.options.skip_nonfinite

    def _backup_needed(self) -> bool:
        return self.options.needs_backup(self._needs_validation())

    def _plan_host(self) -> HostMemoryPlan:
        """The host plan (see :meth:`HostLayout.plan_host`), logged in one line (rank 0) and kept in
        ``stats["host_plan"]``; refuses with a HostMemoryError when no configuration fits."""
        gpu_room = 0
        room = memory.device_memory_room(self.device) if self.options.gpu_fraction == "auto" else None
        if room is not None:  # the auto tail may start with what the host cannot hold: half the GPU's room beyond
            # its headroom (the other half is the activations' until a step is measured)
            gpu_room = max(0, room[0] - max(TAIL_HEADROOM_MIN_BYTES, int(TAIL_HEADROOM_SHARE * room[1]))) // 2
        plan = self._layout.plan_host(self.options, self._needs_validation(), self._shard, gpu_room)
        self.stats["host_plan"] = text = f"SuperOffload host plan: {plan.describe()}; {plan.reason}."
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # Lightning's rank-0 logger

        rank_zero_info(text)
        return plan

    def _spec_budget(self, host_params: int | None = None) -> float:
        """Parameters whose buckets may speculate: all when no step needs validation (no copy needed), else the
        copies the host has room for (:func:`~lightning_gh.superoffload.memory.speculation_budget`)."""
        if self.options.speculative is False:
            return 0
        return math.inf if not self._needs_validation() else memory.speculation_budget(self._layout.plan, host_params)

    def _build_layout(self, arrival: list[int]) -> None:
        opts = self.options
        self._layout.build(arrival, bucket_size=opts.bucket_size, spec_budget=self._spec_budget(), auto_tail=opts.gpu_fraction == "auto",
                           step_id=self._step_id, shard=self._shard)

    # ------------------------------------------------------------------ collaborators and per-run knobs
    @property
    def layout(self) -> HostLayout:
        """The host layout: slots, buckets and where each parameter's state lives."""
        return self._layout

    @property
    def updater(self) -> CpuUpdater:
        """The CPU updater (its thread, queue, speculation and rollback)."""
        return self._updater

    @property
    def tail(self) -> TailMover | None:
        """The auto GPU tail's mover with ``gpu_fraction="auto"`` (it acts after each step on CUDA or over several
        ranks), else ``None``."""
        return self._tail

    @property
    def module(self) -> nn.Module | None:
        """The model whose forward pre-hooks wait for the buckets (see :meth:`attach`), or ``None``."""
        return self._module

    @property
    def cpu_threads(self) -> int:
        """Threads of the CPU update (the option, or what this machine gives the rank)."""
        return self._updater.cpu_threads

    @property
    def max_grad_norm(self) -> float | None:
        return self._max_grad_norm

    @property
    def max_grad_value(self) -> float | None:
        return self._max_grad_value

    @property
    def pipeline_trigger(self) -> str:
        return self._pipeline_trigger

    def set_max_grad_norm(self, value: float | None) -> None:
        """Clip the global gradient norm to ``value`` from the next ``step()`` on (``None``: no clipping)."""
        validate_knobs(max_grad_norm=value)
        was = self._needs_validation()
        self._max_grad_norm = None if value is None else float(value)
        if self._needs_validation() != was:  # speculation now needs (or no longer needs) exact-rollback copies
            self._plan_host()
            if self._layout.built:  # flags only: buffers change between steps (see HostLayout.set_spec_budget)
                self._layout.set_spec_budget(self._spec_budget(), resize=False)

    def set_max_grad_value(self, value: float | None) -> None:
        """Clamp gradients to ``[-value, value]`` from the next backward on (``None``: no clamping)."""
        validate_knobs(max_grad_value=value)
        self._max_grad_value = None if value is None else float(value)

    def set_pipeline_trigger(self, trigger: Literal["backward", "closure"]) -> None:
        """Which backward ends a step's gradients: see the ``pipeline_trigger`` argument."""
        validate_knobs(pipeline_trigger=trigger)
        self._pipeline_trigger = trigger

    # ------------------------------------------------------------------ public controls
    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients on the GPU and start nothing."""
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    def attach(self, module: nn.Module) -> None:
        """Install forward pre-hooks on ``module`` so each layer waits only for its own bucket.

        A compiled block (``torch.compile``-d, or compiled in place with ``block.compile()``) gets one wait, run
        outside its graph, for every bucket under it. See Note [Forward hooks stay out of compiled
        regions] in :mod:`.layout`; blocks compiled or uncompiled later get their hooks re-placed at the next
        ``step()``."""
        for h in self._module_hooks:
            h.remove()
        self._module, self._module_hooks = module, []
        modules = list(module.modules())
        self._watch = (modules, compiled_regions(modules))
        wself = weakref.ref(self)
        for m, slots, compiled in forward_hook_sites(module, self._layout.slot_of):

            def pre_hook(mod: nn.Module, args: Any, _slots=slots, _wself=wself) -> None:
                opt = _wself()
                if opt is not None:
                    opt._before_forward(_slots)

            if compiled and getattr(m, "_compiled_call_impl", None) is not None:  # compiled in place
                wait = torch._dynamo.disable(functools.partial(pre_hook, m, ()))  # also under an outer compile
                self._module_hooks.append(WaitBeforeCompiledCall(m, wait))
            else:
                self._module_hooks.append(m.register_forward_pre_hook(torch._dynamo.disable(pre_hook) if compiled
                                                                      else pre_hook))

    def synchronize(self) -> None:
        """Block until every queued CPU update has finished and make the current stream wait for the copies
        back; afterwards the parameters on the GPU hold the committed weights."""
        if self._ctx is not None:
            raise RuntimeError("HeterogeneousAdamW.synchronize() between backward and step(): the step is not "
                               "validated yet; call step() first.")
        self._updater.join()
        self._updater.count_decisions(block=True)
        if self._layout.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[1])
            for b in self._layout.buckets:
                b.stream_synced = b.step_id
        if self._shard is not None and not self._closed:
            self._broadcast_pending()  # a collective: every rank synchronizes at the same points

    def _broadcast_pending(self) -> None:
        """Broadcast every bucket of the last finished step not yet sent (before a checkpoint, or without hooks)."""
        for b in self._layout.buckets:
            if b.step_id == self._posted_step:
                self._wait_ready(b, stall=False)
                self._shard.broadcast(b)

    def close(self) -> None:
        """Stop the worker thread, remove hooks and unpin host buffers. The optimizer is unusable after."""
        if self._closed:
            return
        if self._ctx is not None:  # an unfinished step: drop it so the worker does not wait for its decision
            self._ctx.drop()
            self._ctx = None
        with contextlib.suppress(Exception):
            self.synchronize()
        self._closed = True
        self._updater.close()
        for h in self._hook_handles + self._module_hooks:
            h.remove()
        self._hook_handles, self._module_hooks = [], []
        if self._layout.cuda:
            # A dropped step's gradient copies or a last copy back may still be reading or writing the host
            # buffers: they must finish before the pages are unregistered (and later freed).
            for stream in self._streams:
                with contextlib.suppress(Exception):
                    stream.synchronize()
        self._layout.release()
        if self._shard is not None:
            self._shard.release()

    @property
    def host_numel(self) -> int:
        """Parameters whose state lives in this rank's host memory (after the first step)."""
        return self._layout.host_numel()

    @property
    def updates_on_host(self) -> bool:
        """Whether some parameters are updated on the host CPU, on any rank (ActivationOffload's budget plans around
        it): the layout's host buckets once built, else unless ``gpu_fraction=1.0`` keeps all the state on the GPU."""
        return bool(self._layout.buckets) if self._layout.built else self.options.gpu_fraction != 1.0

    @property
    def device_numel(self) -> int:
        """Parameters updated on the GPU (the tail), after the first step."""
        return self._layout.device_numel()

    # ------------------------------------------------------------------ hooks
    def _armed(self) -> bool:
        if self._accumulating or self._closed:
            return False
        return self._in_closure if self._pipeline_trigger == "closure" else True

    def _hp_snapshot(self) -> list[dict[str, float]]:
        return [{"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
                 "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])} for g in self.param_groups]

    def _open_step(self) -> StepCtx:
        if self._ctx is None:
            self._step_id += 1
            self._ctx = StepCtx(self._step_id, self._hp_snapshot(), self._needs_validation())
            self._norms.open(len(self._layout.slots), zero=self._shard is not None)
        return self._ctx

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed():
            return
        slot = self._layout.slot_of.get(id(p))
        if slot is None or p.grad is None:
            return
        t0 = time.perf_counter()
        ctx = self._open_step()
        self._arrive(slot, ctx)
        self.stats["loop_phases_ms"]["grad_hooks"] += (time.perf_counter() - t0) * 1e3

    @torch.no_grad()
    def _arrive(self, slot: Slot, ctx: StepCtx) -> None:
        if slot.step_id == ctx.id:
            raise RuntimeError(
                "HeterogeneousAdamW: a gradient arrived twice before step(). Backward passes of micro-batches "
                "that do not end in step() must run inside `with optimizer.accumulating():` (or, with "
                "pipeline_trigger='closure', outside step(closure)). If the model now trains with another "
                "optimizer (e.g. after moving this one's state_dict() to torch.optim.AdamW), call close() on this "
                "HeterogeneousAdamW first: its gradient hooks stay on the model until it is closed or collected.")
        grad = slot.param.grad
        sharded = self._shard is not None  # clamp and norm apply to the rank-averaged gradient (see .zero)
        if self._max_grad_value is not None and not sharded:
            grad.clamp_(-self._max_grad_value, self._max_grad_value)
        slot.step_id = ctx.id
        ctx.arrival.append(slot.index)
        # Once the layout is built, norms and host copies are made per bucket when it is complete (and the GPU
        # tail's norms at step()): a few multi-tensor calls for many parameters instead of several launches from
        # this hook per parameter, which cost the training thread much more.
        if ctx.needs_validation and not sharded and not self._layout.built:
            self._norms.take([slot], ctx.id)
        if self._layout.built and slot.residency == "host":
            self._offload(slot, grad, ctx)

    def _offload(self, slot: Slot, grad: torch.Tensor, ctx: StepCtx) -> None:
        b = slot.bucket
        if b.step_id != ctx.id:
            if self._layout.owns(b):
                self._wait_ready(b, stall=False)
                self._times.stall_ms += self._updater.wait(b, state=True)  # its state written, gradient read
                b.ready.clear()
            b.step_id, b.arrived, b.active, b.pushed = ctx.id, 0, [], False
        b.arrived += 1
        b.active.append(slot)
        if self._shard is not None:
            self._shard.stage_grad(b, slot, grad)
        if b.arrived == len(b.slots):
            self._submit(b, ctx)

    def _land(self, slots: list[Slot], ctx: StepCtx) -> None:
        """Take the norms of ``slots``' gradients if the step needs them, copy the gradients into their host
        buffers and, on CUDA, free them on the GPU."""
        if ctx.needs_validation:
            self._norms.take(slots, ctx.id)
        grads = [s.param.grad if s.param.grad.dtype == s.grad.dtype else s.param.grad.to(s.grad.dtype)
                 for s in slots]
        dst = [s.grad.view(s.param.shape) for s in slots]
        if self._layout.cuda:
            copy_stream = self._streams[0]
            copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(copy_stream):
                torch._foreach_copy_(dst, grads, non_blocking=True)
            for s, g in zip(slots, grads):
                g.record_stream(copy_stream)
                s.param.grad = None  # the GPU copy is no longer needed once the host copy lands
        else:
            torch._foreach_copy_(dst, grads)

    def _submit(self, b: Bucket, ctx: StepCtx) -> None:
        if self._shard is None:
            self._land(b.active, ctx)
        else:
            self._shard.reduce_bucket(b, ctx, self._max_grad_value)
            if not self._layout.owns(b):
                return
        if self._layout.cuda:
            b.d2h_event.record(self._streams[0])
        self._updater.submit(b, ctx)

    def _before_forward(self, slots: list[Slot] | None) -> None:
        if not self._layout.built or self._closed:
            return
        t0, stalled = time.perf_counter(), self._times.stall_ms
        buckets = self._layout.buckets if slots is None else \
            {id(s.bucket): s.bucket for s in slots if s.residency == "host"}.values()
        for b in list(buckets):
            self._wait_ready(b, stall=True)
            if self._shard is not None and b.step_id == self._posted_step:
                self._shard.broadcast(b)
        # the hooks' own time: the waits for the CPU are counted in last_stall_ms
        self.stats["loop_phases_ms"]["forward_hooks"] += \
            (time.perf_counter() - t0) * 1e3 - (self._times.stall_ms - stalled)

    def _wait_ready(self, b: Bucket, stall: bool) -> None:
        ctx = self._ctx
        if ctx is not None and b.step_id == ctx.id:
            return  # its gradients are still arriving in this backward (e.g. an activation-checkpoint recompute)
        # The first bucket of the last step that the next forward needs is the critical one: how long it had
        # been ready (slack) or how long the forward waited for it sizes the auto tail.
        first = stall and b.step_id == self._posted_step and self._times.claim_first()
        was_ready = b.ready.is_set()
        waited = self._updater.wait(b)
        if stall:
            self._times.stall_ms += waited
        if first:
            self._times.slack_ms = (time.perf_counter() - b.ready_t) * 1e3 if was_ready else -waited
        self._updater.raise_error()
        if self._layout.cuda and b.pushed and b.stream_synced != b.step_id:
            torch.cuda.current_stream(self.device).wait_event(b.h2d_event)
            b.stream_synced = b.step_id

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finish the step: offload any gradient not yet sent, validate (norm, non-finite), update the GPU
        tail and hand the decision to the CPU worker. Returns the closure's loss. Does not wait for the CPU
        unless no ``module`` is attached."""
        if self._closed:
            raise RuntimeError("HeterogeneousAdamW.step() after close().")
        loss = None
        if closure is not None:
            self._in_closure = True
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._in_closure = False
        self._updater.raise_error()
        lay = self._layout
        ctx = self._ctx
        # Gradients that did not come through an armed hook (first step, closure mode without closure,
        # parameters whose hook did not fire) are collected now, in parameter order.
        late = [s for s in lay.slots if s.param.grad is not None and (ctx is None or s.step_id != ctx.id)]
        if ctx is None and not late:
            return loss
        ctx = self._open_step()
        for s in late:
            self._arrive(s, ctx)
        if not lay.built:
            self._build_layout(ctx.arrival)
            for i in ctx.arrival:
                s = lay.slots[i]
                if s.residency == "host":
                    self._offload(s, s.param.grad, ctx)
        for b in lay.buckets:  # buckets where some parameter got no gradient this step
            if b.step_id == ctx.id and b.arrived < len(b.slots):
                b.arrived = len(b.slots)
                self._submit(b, ctx)
        tail = [lay.slots[i] for i in ctx.arrival if lay.slots[i].residency == "device"]
        if self._shard is not None:
            self._shard.reduce_tail(ctx, self._max_grad_value)
        elif ctx.needs_validation:  # the GPU tail's norms (host buckets took theirs when complete)
            self._norms.take(tail, ctx.id)

        hp_now = self._hp_snapshot()
        if ctx.needs_validation and self._shard is not None:
            self._shard.sum_norms()
        coef, found_inf = ctx.decide(self._norms, hp_now, self._max_grad_norm, self.options.skip_nonfinite,
                                     self._layout.cuda, self.device)
        update_device_tail(tail, hp_now, coef, found_inf)
        if self._shard is not None:
            self._shard.broadcast_tail(tail)  # the sharded tail's weights, from each owner
        self._ctx = None
        self._posted_step = ctx.id
        if any(b.step_id == ctx.id and lay.owns(b) for b in lay.buckets):
            self._updater.finish(ctx)
        elif ctx.needs_validation:  # no CPU work this step (all state on the GPU): count its decision here
            self._updater.count_later(ctx)
        if self._module is None:
            for b in lay.buckets:
                self._wait_ready(b, stall=True)
            if self._shard is not None:
                self._broadcast_pending()
        self._after_step()
        return loss

    def _after_step(self) -> None:
        times = self._times
        self.stats["steps"] += 1
        self.stats["last_stall_ms"] = times.stall_ms
        self.stats["last_slack_ms"] = times.slack_ms
        times.end_step(time.perf_counter())
        self.stats["cpu_ms_per_step"] = sum(b.cpu_ms for b in self._layout.buckets)
        self._updater.count_decisions(block=False)
        if self._module is not None and (compiled_regions(self._watch[0]) != self._watch[1] or any(
                not h.installed for h in self._module_hooks if isinstance(h, WaitBeforeCompiledCall))):
            self.attach(self._module)  # a block was compiled (or uncompiled) since: see Note [Forward hooks ...]
        if self._tail is not None and (self._layout.cuda or self._shard is not None):  # off CUDA: no GPU tail
            self._tail.step(times, self._step_id - self._layout.built_at, self.synchronize, self._spec_budget)

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.AdamW``'s format (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter,
        plus ``master`` for parameters that are not fp32), loadable into ``torch.optim.AdamW`` and back."""
        if self._ctx is not None:
            raise RuntimeError("HeterogeneousAdamW.state_dict() between backward and step(): call step() first.")
        self.synchronize()
        gathered = self._shard.gather_host_state() if self._shard is not None and self._layout.built else {}
        return pack_state_dict(self.param_groups, self._layout, gathered)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.optim.AdamW`` (any device or dtype). Across ranks every
        rank loads the same unsharded state and keeps its own share, so a state saved at any number of ranks loads
        at any other."""
        if self._ctx is not None:
            raise RuntimeError("HeterogeneousAdamW.load_state_dict() between backward and step(): call step() first.")
        self.synchronize()
        load_into(self.param_groups, self._layout, state_dict)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **kwargs: Any) -> HeterogeneousAdamW:
        """Build from a ``torch.optim.AdamW``: its param groups (the same dict objects, shared with ``optimizer``
        so schedulers bound to either see one learning rate), hyper-parameters and any state. Use the new
        optimizer only afterwards."""
        groups, hp = adamw_arguments(optimizer)
        new = cls(groups, **hp, **kwargs)
        if optimizer.state:
            new.load_state_dict(optimizer.state_dict())
        return new
