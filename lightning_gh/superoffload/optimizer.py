"""SuperOffload: a heterogeneous CPU/GPU AdamW that keeps optimizer state in host memory and hides the
CPU update behind the backward pass.

What lives where
    GPU: the model's weights (bf16 under ``precision="bf16-true"``, fp32 under ``"bf16-mixed"``) and, only
    while they are in flight, the gradients of offloaded parameters. Host: fp32 master weights, both
    AdamW moments and a gradient landing buffer (bf16 for bf16 parameters when our CPU kernel runs, else
    fp32), 14-16 B per offloaded parameter (master and gradient page-locked), plus 12 B when speculation
    keeps its exact-rollback copy (or second copy of the state). The parameters whose
    gradients arrive last (the first layers) may stay on the GPU with the fused GPU AdamW (the "GPU
    tail", ``gpu_fraction``): the next forward needs them first, so updating them on the CPU would make
    the step end waiting for the CPU.

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
    is known. It assumes the step will be neither clipped nor skipped. Before a speculative update it
    copies the bucket's master weights, moments and step counters aside (12 B per parameter). When
    ``step()`` learns the norm: if no clipping/skipping is needed the speculative buckets are committed;
    otherwise each is restored from its copy (bitwise the pre-step state) and redone with the clipped
    gradients, or left restored (skipped step). Buckets the worker reaches after the decision is known
    need no copy, and while the worker has nothing queued it makes the copies the next speculative
    updates will need, off the critical path. After a step whose speculation had to be redone the next
    step waits for its decision (speculation would most likely be wasted again); speculation resumes
    after a step that needed no redo. The result is identical to the non-speculative path
    (``speculative=False``: the worker always waits for the decision), not an algebraic inverse. The
    learning rate and the other hyper-parameters are read when a step's backward starts; if they change
    before ``step()``, the speculative work is redone with the new values.

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
    the step gets faster without allocator retries, within the GPU memory left after a step's peak and
    ``max_gpu_fraction``; the decision is logged once (the policy and its thresholds:
    :mod:`lightning_gh.superoffload.tail`).

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
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Literal

import torch
from torch import nn

from lightning_gh import hardware
from lightning_gh.superoffload.layout import Bucket, LayoutMixin, Slot, chunk_by_size
from lightning_gh.superoffload.memory import check_host_memory
from lightning_gh.superoffload.options import (
    SuperOffloadOptions,
    resolve_options,
    validate_hyperparameters,
    validate_options,
)
from lightning_gh.superoffload.tail import TAIL_UPDATE_CHUNK, TailMixin
from lightning_gh.superoffload.worker import Decision, StepCtx, WorkerMixin
from lightning_gh.superoffload.zero import ShardMixin, current_group, rank_cpu_threads

__all__ = ["HeterogeneousAdamW", "validate_options"]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# What to use instead when the parameters are already sharded by another strategy (ZeRO-3 style).
SHARDED_ALTERNATIVES = (
    "for ZeRO-3 with the optimizer state in host memory use Lightning's FSDPStrategy(cpu_offload=True) (FSDP2's "
    "CPUOffloadPolicy through ModelParallelStrategy works the same way) or strategy='deepspeed_stage_3_offload'; "
    "for a model whose bf16 weights fit one GPU use Trainer(strategy='superoffload', devices=1)")


def _check_not_sharded(p: torch.Tensor) -> None:
    """Refuse parameters an FSDP / DeepSpeed ZeRO-3 wrapper already sharded: the offload pipeline needs each rank's
    whole, local parameters and their gradients as autograd produces them."""
    kind = None
    if type(p).__name__ == "DTensor" or hasattr(p, "device_mesh") and hasattr(p, "placements"):
        kind = "a DTensor (FSDP2 fully_shard / ModelParallelStrategy / FSDPStrategy)"
    elif type(p).__name__ == "FlatParameter" or hasattr(p, "_fsdp_flattened"):
        kind = "an FSDP FlatParameter"
    elif hasattr(p, "ds_id") or hasattr(p, "ds_status"):
        kind = "a DeepSpeed ZeRO-3 partitioned parameter"
    if kind is not None:
        raise TypeError(f"HeterogeneousAdamW got {kind} of shape {tuple(p.shape)}: parameters sharded by "
                        f"another strategy (ZeRO-3) are not supported; {SHARDED_ALTERNATIVES}.")


def _adamw_group_defaults() -> dict[str, Any]:
    """The keys torch.optim.AdamW keeps in a param group, so our state_dict loads into it and back."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return dict(probe.defaults)


class HeterogeneousAdamW(LayoutMixin, TailMixin, WorkerMixin, ShardMixin, torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in pinned host memory and are updated on the CPU
    while the backward pass still runs; the last-arriving parameters can stay on the GPU.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW`` (each group may set ``lr``,
            ``betas``, ``eps``, ``weight_decay``).
        lr: learning rate; read at the start of every step's backward, so LR schedulers work.
        betas: AdamW ``(beta1, beta2)``.
        eps: AdamW epsilon.
        weight_decay: decoupled weight decay.
        gpu_fraction: share of the parameters (by count, taken from the last-arriving gradients) whose state
            stays on the GPU and is updated there with fused AdamW. ``"auto"``: all on the host at first, then,
            over the first pipelined steps, move the last-arriving buckets to the GPU while the next forward
            measurably waits for the CPU. ``0.0`` saves the most GPU memory. Without CUDA: the tail runs on the
            CPU in ``step()`` (same math) and ``"auto"`` means ``0.0``. The auto tail grows only into the GPU memory
            left after a step's peak, keeps a growth only when the step measurably gets faster (so it is never
            slower than ``0.0``), and logs its decision in one line (``stats["tail_decision"]``).
        max_gpu_fraction: upper bound on the share of parameters (by count) the auto tail may keep on the GPU,
            or ``None`` (bounded by free GPU memory only). Each move is also bounded by the GPU memory the
            allocator can still obtain minus a headroom of ``max(1 GiB, 5%`` of the device``)``; a move that
            runs out of memory anyway leaves the bucket on the host. Ignored unless ``gpu_fraction="auto"``.
        speculative: start CPU updates before the gradient norm is known and undo them exactly if the step
            must be clipped or skipped. ``False``: each bucket waits for the decision (no 12 B/param backup).
        max_grad_norm: clip the global gradient L2 norm to this value (as ``clip_grad_norm_``), or ``None``.
        max_grad_value: clamp every gradient element to ``[-v, v]`` before anything else, or ``None``.
        skip_nonfinite: skip the whole step (no state change) when the gradient norm is inf/NaN.
        cpu_threads: threads of the CPU update (default: all CPUs but two with CUDA, else torch's setting).
        bucket_size: parameters per host bucket (a bucket is the unit of copy and CPU work).
        module: the model; when given, forward pre-hooks make each layer wait only for its own bucket.
        pipeline_trigger: ``"backward"``: every backward outside :meth:`accumulating` ends the step's gradients;
            ``"closure"``: only a backward inside ``step(closure)`` does (Lightning's automatic optimization).
        host_memory_check: refuse (:class:`~lightning_gh._host.HostMemoryError`, a ``MemoryError``, with the
            numbers) when host RAM cannot hold the state.
        rollback: ``"auto"`` (a speculative update writes a second copy of the bucket's state, so undoing it is
            free; falls back to ``"copy"`` where the CPU kernel cannot be built or checked) or ``"copy"`` (copy
            the state aside before each speculative update). See :class:`SuperOffloadOptions`.
        options: the shared options as one :class:`SuperOffloadOptions` (``gpu_fraction``, ``max_gpu_fraction``,
            ``speculative``, ``skip_nonfinite``, ``cpu_threads``, ``bucket_size``, ``host_memory_check``,
            ``rollback``) instead
            of those keyword arguments; giving both is an error.

    ``stats`` holds counters for diagnosis: steps clipped, skipped and rolled back, the tail's decision, the CPU
    worker's cumulative milliseconds per phase (``cpu_phases_ms``) and the training thread's in the optimizer's
    hooks (``loop_phases_ms``: ``grad_hooks``, and ``forward_hooks`` less their waits for the CPU, which
    ``last_stall_ms`` reports per step).

    The optimizer is made of one part per idea: :mod:`.layout` (slots, buckets, host buffers), :mod:`.tail` (the
    GPU-tail policy), :mod:`.worker` (the CPU update thread); this class holds the hooks, ``step()`` and the
    state dict.

    Example::

        model = Llama(cfg).cuda().bfloat16()
        opt = HeterogeneousAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0, module=model)
        for tokens, targets in loader:
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        gpu_fraction: float | str = "auto",
        speculative: bool = True,
        max_grad_norm: float | None = None,
        cpu_threads: int | None = None,
        *,
        max_grad_value: float | None = None,
        skip_nonfinite: bool = True,
        bucket_size: int = 1 << 24,
        max_gpu_fraction: float | None = None,
        module: nn.Module | None = None,
        pipeline_trigger: Literal["backward", "closure"] = "backward",
        host_memory_check: bool = True,
        rollback: str = "auto",
        options: SuperOffloadOptions | None = None,
    ) -> None:
        opts = resolve_options(options, "HeterogeneousAdamW", gpu_fraction=gpu_fraction, speculative=speculative,
                               cpu_threads=cpu_threads, skip_nonfinite=skip_nonfinite, bucket_size=bucket_size,
                               max_gpu_fraction=max_gpu_fraction, host_memory_check=host_memory_check,
                               rollback=rollback)
        validate_options(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                         max_grad_value=max_grad_value, pipeline_trigger=pipeline_trigger)
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or None, got {type(module).__name__}.")

        defaults = _adamw_group_defaults()
        defaults.update(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                        weight_decay=float(weight_decay))
        super().__init__(params, defaults)

        self.options = opts
        # The options also live as plain attributes: the worker and the tail policy read them on every step, and
        # the strategy re-points max_grad_norm / pipeline_trigger on an optimizer the user built.
        self.gpu_fraction = opts.gpu_fraction
        self.max_gpu_fraction = opts.max_gpu_fraction
        self.speculative = opts.speculative
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.max_grad_value = None if max_grad_value is None else float(max_grad_value)
        self.skip_nonfinite = opts.skip_nonfinite
        self.bucket_size = opts.bucket_size
        self.pipeline_trigger = pipeline_trigger
        self.host_memory_check = opts.host_memory_check
        self.rollback = opts.rollback
        self._kernel: Any = None  # .cpu_adamw.AdamWKernel when the layout found it usable (rollback="auto")
        self._two_copies = False  # host buckets keep two copies of their state (the kernel's rollback)

        self._slots: list[Slot] = []
        self._slot_of: dict[int, Slot] = {}
        self._hook_handles: list[Any] = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi)
            for p in group["params"]:
                self._add_slot(p, gi)
        devices = {s.param.device for s in self._slots}
        if len(devices) > 1:
            raise ValueError(f"HeterogeneousAdamW needs all parameters on one device, found {sorted(map(str, devices))}.")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        # Several ranks (an initialised process group of 2+): each owns a share of the state (see .zero).
        self._rg = current_group()
        cpu_threads = opts.cpu_threads
        if cpu_threads is None and self._rg is not None:  # this rank's share of the host's CPUs
            cpu_threads = rank_cpu_threads(self._cuda, self._rg.local_size)
        elif cpu_threads is None:  # leave two CPUs to the training loop and the data loader's main thread
            cpu_threads = max(1, hardware.cpus_available() - 2) if self._cuda else torch.get_num_threads()
        self.cpu_threads = cpu_threads
        self._block = None

        self._buckets: list[Bucket] = []
        self._layout_built = False
        self._pending_state: dict[int, dict[str, torch.Tensor]] = {}
        self._ctx: StepCtx | None = None  # the open step (first armed hook .. step())
        self._step_id = 0
        self._layout_step = 0
        self._norms: torch.Tensor | None = None
        self._loop_ms: dict[str, float] = {"grad_hooks": 0.0, "forward_hooks": 0.0}
        self._accumulating = False
        self._in_closure = False
        self._worker: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()
        self._worker_error: BaseException | None = None
        self._copy_stream = None
        self._h2d_stream = None
        self._module_hooks: list[Any] = []
        self._module: nn.Module | None = None
        self._closed = False
        self._last_step_t: float | None = None
        self._periods: list[float] = []
        self._stalls: list[float] = []
        self._stall_ms = 0.0
        self._auto_adjustments = 0
        self._hp_warned = False
        self._last_redo = False
        self._uncounted: list[StepCtx] = []  # validated steps the worker will not count (see _count_decisions)
        self._state_lock = threading.Lock()
        self._closed_step = -1
        self._cur_slack: float | None = None
        self._slack: list[float | None] = []
        self._need_seen = False
        self._order: list[int] = []
        self.stats: dict[str, Any] = {"steps": 0, "clipped_steps": 0, "skipped_steps": 0, "rollbacks": 0,
                                      "speculative_buckets": 0, "prefetched_backups": 0, "last_stall_ms": 0.0,
                                      "last_slack_ms": None, "cpu_ms_per_step": 0.0, "tail_moves": 0,
                                      "tail_moves_back": 0, "tail_limited": 0, "tail_move_failures": 0,
                                      "tail_decision": None, "cpu_phases_ms": {},
                                      "loop_phases_ms": self._loop_ms}
        self._tail_warned = False
        self._tail_blocked = False
        # auto tail decision state (see .tail): an open trial growth, whether the decision is final, what limited it
        self._tail_trial: dict[str, Any] | None = None
        self._tail_final = False
        self._tail_gained = False  # the last trial growth was kept
        self._all_in_tried = False  # the one trial of moving everything left on the host to the GPU was made
        self._tail_limit: str | None = None
        self._tail_guard_done = False
        self._tail_retries_seen = 0
        self._plan = None
        if self.host_memory_check:  # early, before the first step allocates anything
            total = sum(s.numel for s in self._slots if s.param.requires_grad)
            share = 1.0 if self.gpu_fraction == "auto" or not self._cuda else 1.0 - float(self.gpu_fraction)
            ranks = 1 if self._rg is None else self._rg.size
            check_host_memory(int(total * share / ranks), self._backup_needed(),
                              local_ranks=None if self._rg is None else self._rg.local_size)
        if module is not None:
            self.attach(module)
            # Lay the buckets out now, in the order the module registers its parameters, reversed (the usual
            # order gradients arrive in), so the first step is pipelined too and never holds every gradient
            # on the GPU at once.
            guess = [self._slot_of[id(p)].index for p in reversed(list(module.parameters()))
                     if id(p) in self._slot_of and p.requires_grad]
            with torch.no_grad():
                self._build_layout(guess)

    # ------------------------------------------------------------------ setup helpers
    @staticmethod
    def _check_group(group: dict[str, Any], gi: int) -> None:
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                raise ValueError(f"param_groups[{gi}] sets {key}=True; HeterogeneousAdamW supports only plain AdamW.")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            group["lr"] = lr = float(lr)
        # Each group may override the constructor's hyper-parameters: check them as torch.optim.AdamW checks its own.
        validate_hyperparameters(f"param_groups[{gi}] ", lr, group["betas"], group["eps"], group["weight_decay"])

    def _add_slot(self, p: torch.Tensor, gi: int) -> None:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"HeterogeneousAdamW params must be tensors, got {type(p).__name__}.")
        if id(p) in self._slot_of:
            raise ValueError("a parameter appears in more than one param group.")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"parameter of dtype {p.dtype} is not supported; allowed: float32, bfloat16, float16.")
        if p.is_sparse:
            raise ValueError("sparse parameters are not supported by HeterogeneousAdamW.")
        _check_not_sharded(p)
        slot = Slot(index=len(self._slots), param=p, group=gi, numel=p.numel())
        self._slots.append(slot)
        self._slot_of[id(p)] = slot
        if p.requires_grad:
            wself = weakref.ref(self)

            def hook(param: torch.Tensor, _wself=wself) -> None:
                opt = _wself()
                if opt is not None:
                    opt._on_grad(param)

            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_built", False):
            raise RuntimeError("HeterogeneousAdamW.add_param_group() after the first step() is not supported: "
                               "the host buffers are laid out at the first step.")
        super().add_param_group(param_group)
        if hasattr(self, "_slots"):  # called after __init__ (torch's __init__ calls it too)
            gi = len(self.param_groups) - 1
            self._check_group(self.param_groups[gi], gi)
            for p in self.param_groups[gi]["params"]:
                self._add_slot(p, gi)

    def _needs_validation(self) -> bool:
        return self.max_grad_norm is not None or self.skip_nonfinite

    def _backup_needed(self) -> bool:
        return self.speculative and self._needs_validation()

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

        A ``torch.compile``-d submodule gets one hook that waits for every bucket (hooks inside a compiled
        region would break its graph)."""
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        self._module = module
        wself = weakref.ref(self)
        skip_prefixes: list[str] = []
        for name, m in module.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skip_prefixes):
                continue
            if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod"):  # torch.compile wrapper
                skip_prefixes.append(name)
                slots = None  # wait for everything
            else:
                slots = [self._slot_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self._slot_of]
                if not slots:
                    continue

            def pre_hook(mod: nn.Module, args: Any, _slots=slots, _wself=wself) -> None:
                opt = _wself()
                if opt is not None:
                    opt._before_forward(_slots)

            self._module_hooks.append(m.register_forward_pre_hook(pre_hook))

    def synchronize(self) -> None:
        """Block until every queued CPU update has finished and make the current stream wait for the copies
        back; afterwards the parameters on the GPU hold the committed weights."""
        if self._ctx is not None:
            raise RuntimeError("HeterogeneousAdamW.synchronize() between backward and step(): the step is not "
                               "validated yet; call step() first.")
        self._raise_worker_error()
        if self._worker is not None:
            self._queue.join()
        self._raise_worker_error()
        self._count_decisions(block=True)
        if self._cuda and self._h2d_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._h2d_stream)
            for b in self._buckets:
                b.stream_synced = b.step_id
        if self._rg is not None and not self._closed:
            self._broadcast_pending()  # a collective: every rank synchronizes at the same points

    def _count_decisions(self, block: bool) -> None:
        """Count the skipped and clipped steps the worker did not see (steps with no host bucket to finish); without
        ``block``, only those whose decision has reached the host already, so no step waits for it."""
        while self._uncounted:
            dec = self._poll_decision(self._uncounted[0], block=block)
            if dec is None:
                return
            self._uncounted.pop(0)
            if dec.skip:
                self.stats["skipped_steps"] += 1
            elif dec.coef is not None:
                self.stats["clipped_steps"] += 1

    def close(self) -> None:
        """Stop the worker thread, remove hooks and unpin host buffers. The optimizer is unusable after."""
        if self._closed:
            return
        ctx = self._ctx
        if ctx is not None:  # an unfinished step: drop it so the worker does not wait for its decision
            ctx.decision = Decision(True, None, ctx.hp, True)
            ctx.posted.set()
            self._ctx = None
        with contextlib.suppress(Exception):
            self.synchronize()
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=30)
            self._worker = None
        for h in self._hook_handles + self._module_hooks:
            h.remove()
        self._hook_handles, self._module_hooks = [], []
        if self._cuda:
            # A dropped step's gradient copies or a last copy back may still be reading or writing the host
            # buffers: they must finish before the pages are unregistered (and later freed).
            for stream in (self._copy_stream, self._h2d_stream):
                if stream is not None:
                    with contextlib.suppress(Exception):
                        stream.synchronize()
        for b in self._buckets:
            b.release_host()
        if self._block is not None:
            self._block.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not getattr(self, "_closed", True) and self._worker is not None:
                self._queue.put(None)

    @property
    def host_numel(self) -> int:
        """Parameters whose state lives in this rank's host memory (after the first step)."""
        return sum(b.numel for b in self._buckets if self._owned(b))

    @property
    def device_numel(self) -> int:
        """Parameters updated on the GPU (the tail), after the first step."""
        return sum(s.numel for s in self._slots if s.residency == "device" and s.step is not None)

    # ------------------------------------------------------------------ hooks
    def _armed(self) -> bool:
        if self._accumulating or self._closed:
            return False
        return self._in_closure if self.pipeline_trigger == "closure" else True

    def _hp_snapshot(self) -> list[dict[str, float]]:
        return [{"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
                 "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])} for g in self.param_groups]

    def _open_step(self) -> StepCtx:
        if self._ctx is None:
            self._step_id += 1
            self._ctx = StepCtx(self._step_id, self._hp_snapshot(), self._needs_validation())
            if self._norms is None or self._norms.numel() != len(self._slots):
                self._norms = torch.zeros(len(self._slots), dtype=torch.float32, device=self.device)
            elif self._rg is not None:  # each rank writes only the norms it owns; the rest must be zero
                self._norms.zero_()
        return self._ctx

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed():
            return
        slot = self._slot_of.get(id(p))
        if slot is None or p.grad is None:
            return
        t0 = time.perf_counter()
        ctx = self._open_step()
        self._arrive(slot, ctx)
        self._loop_ms["grad_hooks"] += (time.perf_counter() - t0) * 1e3

    @torch.no_grad()
    def _arrive(self, slot: Slot, ctx: StepCtx) -> None:
        if slot.step_id == ctx.id:
            raise RuntimeError(
                "HeterogeneousAdamW: a gradient arrived twice before step(). Backward passes of micro-batches "
                "that do not end in step() must run inside `with optimizer.accumulating():` (or, with "
                "pipeline_trigger='closure', outside step(closure)).")
        grad = slot.param.grad
        sharded = self._rg is not None  # clamp and norm apply to the rank-averaged gradient (see .zero)
        if self.max_grad_value is not None and not sharded:
            grad.clamp_(-self.max_grad_value, self.max_grad_value)
        slot.step_id = ctx.id
        ctx.arrival.append(slot.index)
        # Once the layout is built, norms and host copies are made per bucket when it is complete (and the GPU
        # tail's norms at step()): a few multi-tensor calls for many parameters instead of several launches from
        # this hook per parameter, which took ~2.5x as long on the training thread (issue 13, session j).
        if ctx.needs_validation and not sharded and not self._layout_built:
            self._take_norms([slot], ctx)
        if self._layout_built and slot.residency == "host":
            self._offload(slot, grad, ctx)

    def _take_norms(self, slots: list[Slot], ctx: StepCtx) -> None:
        """Write the gradient norms of ``slots`` (gradients still on ``param.grad``) into ``self._norms``."""
        slots = [s for s in slots if s.normed_step != ctx.id]
        if not slots:
            return
        assert self._norms is not None
        by_kind: dict[bool, list[Slot]] = {}
        for s in slots:
            by_kind.setdefault(s.param.grad.dtype == torch.float32, []).append(s)
            s.normed_step = ctx.id
        for fp32, group in by_kind.items():
            grads = [s.param.grad for s in group]
            if fp32:  # the kernel clip_grad_norm_ uses, so each norm is bitwise equal to its own
                norms = torch._foreach_norm(grads, 2.0)
            else:  # fp32 accumulation of bf16/fp16 gradients (clip_grad_norm_ would return a bf16 norm)
                norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            self._norms.index_copy_(0, self._index_tensor(group), torch.stack(norms))

    def _offload(self, slot: Slot, grad: torch.Tensor, ctx: StepCtx) -> None:
        b = slot.bucket
        assert b is not None
        if b.step_id != ctx.id:
            if self._owned(b):
                self._wait_ready(b, stall=False)
                b.ready.clear()
            b.step_id, b.arrived, b.active, b.pushed = ctx.id, 0, [], False
        b.arrived += 1
        b.active.append(slot)
        if self._rg is not None:
            self._stage_grad(b, slot, grad)
        if b.arrived == len(b.slots):
            self._submit(b, ctx)

    def _land(self, slots: list[Slot], ctx: StepCtx) -> None:
        """Take the norms of ``slots``' gradients if the step needs them, copy the gradients into their host
        buffers and, on CUDA, free them on the GPU."""
        if ctx.needs_validation:
            self._take_norms(slots, ctx)
        grads = [s.param.grad if s.param.grad.dtype == s.grad.dtype else s.param.grad.to(s.grad.dtype)
                 for s in slots]
        dst = [s.grad.view(s.param.shape) for s in slots]
        if self._cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                torch._foreach_copy_(dst, grads, non_blocking=True)
            for s, g in zip(slots, grads):
                g.record_stream(self._copy_stream)
                s.param.grad = None  # the GPU copy is no longer needed once the host copy lands
        else:
            torch._foreach_copy_(dst, grads)

    def _submit(self, b: Bucket, ctx: StepCtx) -> None:
        if self._rg is None:
            self._land(b.active, ctx)
        else:
            self._reduce_bucket(b, ctx)
            if not self._owned(b):
                return
        if self._cuda:
            b.d2h_event.record(self._copy_stream)
        self._ensure_worker()
        self._queue.put(("bucket", b, ctx))

    def _before_forward(self, slots: list[Slot] | None) -> None:
        if not self._layout_built or self._closed:
            return
        t0, stalled = time.perf_counter(), self._stall_ms
        buckets = self._buckets if slots is None else {id(s.bucket): s.bucket for s in slots if s.residency == "host"}.values()
        for b in list(buckets):
            self._wait_ready(b, stall=True)
            if self._rg is not None and b.step_id == self._closed_step:
                self._broadcast_bucket(b)
        # the hooks' own time: the waits for the CPU are counted in last_stall_ms
        self._loop_ms["forward_hooks"] += (time.perf_counter() - t0) * 1e3 - (self._stall_ms - stalled)

    def _wait_ready(self, b: Bucket, stall: bool) -> None:
        ctx = self._ctx
        if ctx is not None and b.step_id == ctx.id:
            return  # its gradients are still arriving in this backward (e.g. an activation-checkpoint recompute)
        # The first bucket of the last step that the next forward needs is the critical one: how long it had
        # been ready (slack) or how long the forward waited for it sizes the auto tail.
        first = stall and not self._need_seen and b.step_id == self._closed_step
        if first:
            self._need_seen = True
        if not b.ready.is_set():
            t0 = time.perf_counter()
            while not b.ready.wait(0.05):
                self._raise_worker_error()
                if self._worker is None or not self._worker.is_alive():
                    raise RuntimeError("HeterogeneousAdamW: the CPU worker stopped with a bucket still pending.")
            waited = (time.perf_counter() - t0) * 1e3
            if stall:
                self._stall_ms += waited
            if first:
                self._cur_slack = -waited
        elif first:
            self._cur_slack = (time.perf_counter() - b.ready_t) * 1e3
        self._raise_worker_error()
        if self._cuda and b.pushed and b.stream_synced != b.step_id:
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
        self._raise_worker_error()
        ctx = self._ctx
        # Gradients that did not come through an armed hook (first step, closure mode without closure,
        # parameters whose hook did not fire) are collected now, in parameter order.
        late = [s for s in self._slots if s.param.grad is not None and (ctx is None or s.step_id != ctx.id)]
        if ctx is None and not late:
            return loss
        ctx = self._open_step()
        for s in late:
            self._arrive(s, ctx)
        if not self._layout_built:
            self._build_layout(ctx.arrival)
            for i in ctx.arrival:
                s = self._slots[i]
                if s.residency == "host":
                    self._offload(s, s.param.grad, ctx)
        for b in self._buckets:  # buckets where some parameter got no gradient this step
            if b.step_id == ctx.id and b.arrived < len(b.slots):
                b.arrived = len(b.slots)
                self._submit(b, ctx)
        if self._rg is not None:
            self._reduce_tail(ctx)
        elif ctx.needs_validation:  # the GPU tail's norms (host buckets took theirs when complete)
            self._take_norms([self._slots[i] for i in ctx.arrival if self._slots[i].residency == "device"], ctx)

        hp_now = self._hp_snapshot()
        coef_dev, found_inf = self._post_decision(ctx, hp_now)
        self._step_tail(ctx, hp_now, coef_dev, found_inf)
        self._ctx = None
        self._closed_step = ctx.id
        if any(b.step_id == ctx.id and self._owned(b) for b in self._buckets):
            self._ensure_worker()
            self._queue.put(("finish", None, ctx))
        elif ctx.needs_validation:  # no CPU work this step (all state on the GPU): count its decision here
            self._uncounted.append(ctx)
        if self._module is None:
            for b in self._buckets:
                self._wait_ready(b, stall=True)
            if self._rg is not None:
                self._broadcast_pending()
        self._after_step()
        return loss

    def _post_decision(self, ctx: StepCtx, hp_now: list[dict[str, float]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ctx.hp_now = hp_now
        ctx.max_norm = self.max_grad_norm
        ctx.skip_nonfinite = self.skip_nonfinite
        coef_dev = found_inf = None
        if ctx.needs_validation:
            if self._rg is not None:
                self._sum_norms()
            idx = sorted(ctx.arrival)
            norms = self._norms if len(idx) == len(self._slots) else self._norms[torch.tensor(idx, device=self.device)]
            total = torch.linalg.vector_norm(norms, 2.0)
            if self.max_grad_norm is not None:
                # the same expression as torch.nn.utils.clip_grad_norm_, so the coefficient is bitwise equal
                coef_dev = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            if self.skip_nonfinite:
                found_inf = (~torch.isfinite(total)).to(torch.float32)
            packed = torch.stack([total, coef_dev if coef_dev is not None else torch.ones_like(total)])
            if self._cuda:
                ctx.result_host = torch.empty(2, dtype=torch.float32, pin_memory=True)
                ctx.result_host.copy_(packed, non_blocking=True)
                ctx.result_event = torch.cuda.Event()
                ctx.result_event.record(torch.cuda.current_stream(self.device))
            else:
                ctx.result_host = packed
        elif hp_now != ctx.hp and not self._hp_warned:
            self._hp_warned = True
            warnings.warn("HeterogeneousAdamW: hyper-parameters changed between backward and step(); without "
                          "validation (max_grad_norm=None, skip_nonfinite=False) the CPU update uses the values read "
                          "when backward started. Set the learning rate before backward.", stacklevel=3)
        ctx.posted.set()
        return coef_dev, found_inf

    def _step_tail(self, ctx: StepCtx, hp: list[dict[str, float]], coef: torch.Tensor | None,
                   found_inf: torch.Tensor | None) -> None:
        by_group: dict[int, list[Slot]] = {}
        for i in ctx.arrival:
            s = self._slots[i]
            if s.residency == "device" and s.param.grad is not None:
                by_group.setdefault(s.group, []).append(s)
        for gi, group_slots in sorted(by_group.items()):
            h = hp[gi]
            # The fp32 copies of bf16 gradients the fused update reads are made a chunk at a time: they then cost
            # one chunk of GPU memory, not 4 B per tail parameter (the auto tail budgets for one chunk). fp32
            # weights' gradients are read as they are: one call, no chunks.
            cast = any(s.dev_master is not None for s in group_slots)
            for slots in chunk_by_size(group_slots, TAIL_UPDATE_CHUNK) if cast else [group_slots]:
                grads = [s.param.grad if s.dev_master is None else s.param.grad.to(torch.float32) for s in slots]
                if coef is not None:
                    torch._foreach_mul_(grads, coef)
                targets = [s.param if s.dev_master is None else s.dev_master for s in slots]
                steps = [s.step for s in slots]
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(targets, grads, [s.exp_avg for s in slots], [s.exp_avg_sq for s in slots], [],
                                    steps, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                                    weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False, maximize=False,
                                    found_inf=found_inf)
                if found_inf is not None:
                    torch._foreach_sub_(steps, [found_inf] * len(steps))
                mastered = [s for s in slots if s.dev_master is not None]
                if mastered:  # one multi-tensor cast back into the module's (bf16) weights
                    torch._foreach_copy_([s.param for s in mastered], [s.dev_master for s in mastered])
                del grads  # free this chunk's fp32 copies before the next chunk makes its own

    def _after_step(self) -> None:
        self.stats["steps"] += 1
        self.stats["last_stall_ms"] = self._stall_ms
        now = time.perf_counter()
        if self._last_step_t is not None:
            self._periods.append((now - self._last_step_t) * 1e3)
            self._stalls.append(self._stall_ms)
            self._slack.append(self._cur_slack)
        self.stats["last_slack_ms"] = self._cur_slack
        self._last_step_t = now
        self._stall_ms = 0.0
        self._cur_slack = None
        self._need_seen = False
        self.stats["cpu_ms_per_step"] = sum(b.cpu_ms for b in self._buckets)
        self._count_decisions(block=False)
        if self.gpu_fraction == "auto" and (self._cuda or self._rg is not None):
            self._auto_tail()


    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.AdamW``'s format (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter,
        plus ``master`` for parameters that are not fp32), loadable into ``torch.optim.AdamW`` and back."""
        if self._ctx is not None:
            raise RuntimeError("HeterogeneousAdamW.state_dict() between backward and step(): call step() first.")
        self.synchronize()
        packed_groups = []
        index = 0
        id_of: dict[int, int] = {}
        for g in self.param_groups:
            pg = {k: v for k, v in g.items() if k != "params"}
            ids = []
            for p in g["params"]:
                id_of[id(p)] = index
                ids.append(index)
                index += 1
            pg["params"] = ids
            packed_groups.append(pg)
        state: dict[int, dict[str, torch.Tensor]] = {}
        gathered = self._gather_host_state() if self._rg is not None and self._layout_built else {}
        for s in self._slots:
            i = id_of[id(s.param)]
            if s.index in gathered:
                st = {k: v.view(s.param.shape) if k != "step" else v for k, v in gathered[s.index].items()}
                if s.param.dtype == torch.float32:
                    del st["master"]
                state[i] = st
            elif self._layout_built and s.step is not None:
                shape = s.param.shape
                st = {"step": s.step.detach().to("cpu", copy=True), "exp_avg": s.exp_avg.view(shape),
                      "exp_avg_sq": s.exp_avg_sq.view(shape)}
                if s.param.dtype != torch.float32:
                    st["master"] = (s.master if s.residency == "host" else s.dev_master).view(shape)
                state[i] = st
            elif s.index in self._pending_state:
                state[i] = dict(self._pending_state[s.index])
        return {"state": state, "param_groups": packed_groups}

    def _gather_host_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every host-resident parameter's state, from whichever rank owns it (a collective; CPU tensors)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for b in self._buckets:
            out.update(self._bucket_slot_states(b))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.optim.AdamW`` (any device or dtype). Across ranks every
        rank loads the same unsharded state and keeps its own share, so a state saved at any number of ranks loads
        at any other."""
        if self._ctx is not None:
            raise RuntimeError("HeterogeneousAdamW.load_state_dict() between backward and step(): call step() first.")
        self.synchronize()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                             f"{len(self.param_groups)}.")
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"param_groups[{i}] has {len(g['params'])} parameters, the loaded one has "
                                 f"{len(sg['params'])}.")
        id_map: dict[Any, Slot] = {}
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            for p, k in zip(g["params"], sg["params"]):
                id_map[k] = self._slot_of[id(p)]
            for key, val in sg.items():
                if key not in ("params", "param_names"):
                    g[key] = val
            self._check_group(g, gi)
        for k, st in state_dict["state"].items():
            slot = id_map.get(k)
            if slot is None:
                continue
            clean = {key: torch.as_tensor(v).detach().to("cpu", torch.float32).clone()
                     for key, v in st.items() if key in ("step", "exp_avg", "exp_avg_sq", "master")}
            if "exp_avg" not in clean or "exp_avg_sq" not in clean or "step" not in clean:
                raise ValueError(f"state for parameter {k} lacks step/exp_avg/exp_avg_sq: not an AdamW state.")
            if clean["exp_avg"].numel() != slot.numel:
                raise ValueError(f"state for parameter {k} has {clean['exp_avg'].numel()} elements, the parameter "
                                 f"has {slot.numel}.")
            if self._layout_built and slot.step is not None:
                with self._state_lock:
                    self._write_state(slot, clean)
            else:
                self._pending_state[slot.index] = clean

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **kwargs: Any) -> HeterogeneousAdamW:
        """Build from a ``torch.optim.AdamW``: its param groups (the same dict objects, shared with ``optimizer``
        so schedulers bound to either see one learning rate), hyper-parameters and any state. Use the new
        optimizer only afterwards."""
        if not isinstance(optimizer, torch.optim.AdamW):
            if isinstance(optimizer, torch.optim.Adam) and getattr(optimizer, "defaults", {}).get("decoupled_weight_decay"):
                pass
            else:
                raise TypeError(f"HeterogeneousAdamW.from_optimizer needs a torch.optim.AdamW, got "
                                f"{type(optimizer).__name__} (Adam's weight decay is L2, not decoupled).")
        for g in optimizer.param_groups:
            for key in ("amsgrad", "maximize"):
                if g.get(key):
                    raise ValueError(f"the AdamW sets {key}=True, which HeterogeneousAdamW does not support.")
        # The new optimizer takes over the very same param-group dicts (torch's add_param_group keeps the dict it
        # is given), so an LR scheduler still bound to the old optimizer, e.g. inside a SequentialLR, writes the
        # learning rate this optimizer reads.
        groups = list(optimizer.param_groups)
        d = optimizer.defaults
        new = cls(groups, lr=float(d["lr"]), betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"], **kwargs)
        if optimizer.state:
            new.load_state_dict(optimizer.state_dict())
        return new

