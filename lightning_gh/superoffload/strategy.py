"""``Trainer(strategy="superoffload")``: run the LightningModule's own AdamW as a :class:`HeterogeneousAdamW`.

The strategy is Lightning's ``DDPStrategy`` without the ``DistributedDataParallel`` wrapper (the optimizer's own
gradient hooks reduce each gradient onto the rank that owns its state, see :mod:`.zero`), plus four things:

* ``setup_optimizers`` calls ``configure_optimizers`` as usual, then rebuilds every ``torch.optim.AdamW`` it
  returns as a ``HeterogeneousAdamW`` with the same param groups and hyper-parameters, and re-points the
  LR schedulers at it (they keep working: the optimizer reads the LR at every step);
* ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm" | "value")`` becomes the optimizer's
  ``max_grad_norm`` / ``max_grad_value``. Lightning clips after backward, when the speculative CPU update
  has already started on unclipped gradients, so the precision plugin's own clipping is turned off for
  these optimizers and the optimizer clips (exactly, with rollback) itself;
* under automatic optimization only the backward inside ``optimizer.step(closure)`` (the last micro-batch
  of ``accumulate_grad_batches``) starts the offload pipeline; earlier micro-batches accumulate on the GPU;
* checkpoints wait for in-flight CPU updates, and the optimizer state stays in host memory when a
  checkpoint is restored (Lightning would otherwise move it to the GPU).

Devices: ``devices=1`` runs one process with no process group, as a single-device strategy does.
``devices=N`` runs under DDP's launchers (a subprocess per device, NCCL on GPUs; ``start_method="spawn"`` for the
CPU or notebooks, gloo on CPUs), and each rank keeps ``1/N`` of the offloaded state (ZeRO-1/2 with the state in
host memory). The module is not wrapped: rank 0's weights and buffers are broadcast once at setup instead. On a
host with several NUMA nodes each rank's CPU threads run on its GPU's node (``bind_numa``, see
Note [A rank's CPUs near its GPU] in :mod:`.numa`).

Registered in Lightning's strategy registry as ``"superoffload"`` when this module is imported (``import
lightning_gh`` does that).

Precision: ``"bf16-true"`` keeps bf16 weights on the GPU (2 B/param) and the fp32 master weights on the host:
classic mixed-precision training with an fp32 master copy. ``"bf16-mixed"`` keeps fp32 weights on the GPU
(4 B/param; autocast casts per op) that equal the host master weights bitwise, so the run matches a plain
``bf16-mixed`` run with ``torch.optim.AdamW(fused=True)``. ``"32-true"`` is the same with fp32 compute.

Example::

    import lightning as L
    import lightning_gh  # registers "superoffload"

    trainer = L.Trainer(strategy="superoffload", precision="bf16-true", gradient_clip_val=1.0, max_steps=1000)
    trainer.fit(model, datamodule)            # model.configure_optimizers returns torch.optim.AdamW

    # or with options:
    trainer = L.Trainer(strategy=lightning_gh.SuperOffloadStrategy(gpu_fraction=0.0), precision="bf16-true")
    opts = lightning_gh.superoffload.SuperOffloadOptions(gpu_fraction=0.0, speculative=False)
    trainer = L.Trainer(strategy=lightning_gh.SuperOffloadStrategy(options=opts), precision="bf16-true")
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig

from lightning_gh import _lightning, compat
from lightning_gh.superoffload import numa
from lightning_gh.superoffload.loss import StepLoss
from lightning_gh.superoffload.optimizer import HeterogeneousAdamW
from lightning_gh.superoffload.options import SuperOffloadOptions, resolve_options

__all__ = ["SuperOffloadStrategy"]


class SuperOffloadStrategy(DDPStrategy):
    """Lightning strategy that trains with :class:`HeterogeneousAdamW`, on one device or data-parallel on several
    (each rank then owns a share of the optimizer state; the module is not wrapped in DDP).

    Args:
        options: the optimizer's options as one :class:`SuperOffloadOptions` (shared with
            :class:`HeterogeneousAdamW`).
        **option_kwargs: the same options as keyword arguments instead (``gpu_fraction=0.0``, ...); see
            :class:`SuperOffloadOptions`. Giving both is an error.
        device: the device of a one-device run; normally left to ``Trainer(accelerator=..., devices=...)``.
        start_method: how ``devices=N`` starts its processes, as for ``DDPStrategy``: ``"popen"`` (re-runs the
            script, the usual choice on GPUs) or ``"spawn"`` / ``"fork"`` / ``"forkserver"``.
        process_group_backend: ``None`` (NCCL on GPUs, gloo on CPUs) or a backend name.
        lean_loss: compute a Hugging Face causal LM's loss (``labels=``, or the module's own cross-entropy over the
            logits) through the lean loss, which keeps only the low-precision logits for the backward: the GPU
            memory it gives back goes to the GPU tail. ``"auto"`` (default): on CUDA, where the module holds a
            transformers ``*ForCausalLM`` and no ``ActivationOffload`` decides the loss (one with a ``budget`` or a
            ``lean_loss`` of its own: see :func:`~lightning_gh.superoffload.loss.activation_offload_owns_loss`);
            ``True``: also off CUDA; ``False``: the loss as written (bitwise the plain run's). See
            :mod:`lightning_gh.superoffload.loss`; the decision is ``strategy.loss.why``.
        accelerator, checkpoint_io, precision_plugin, cluster_environment, timeout: as for Lightning's
            ``DDPStrategy``.

    Example::

        trainer = L.Trainer(strategy=SuperOffloadStrategy(gpu_fraction=0.0), precision="bf16-true",
                            gradient_clip_val=1.0)
        trainer = L.Trainer(strategy="superoffload", devices=8, precision="bf16-true")  # ZeRO-2 + offload
    """

    strategy_name = "superoffload"
    lgh_part = "SuperOffload"

    def __init__(
        self,
        *,
        options: SuperOffloadOptions | None = None,
        device: str | torch.device | None = None,
        accelerator: Any = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        cluster_environment: Any = None,
        timeout: Any = None,
        lean_loss: bool | str = "auto",
        **option_kwargs: Any,
    ) -> None:
        self.options = resolve_options(options, "SuperOffloadStrategy", **option_kwargs)
        self.loss = StepLoss("SuperOffloadStrategy", lean_loss)
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=None if device is None else [torch.device(device)],
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **extra)
        _lightning.let_one_process_strategies_be_local()  # one device: not distributed for the tuner (lgh_one_process)
        self._clip_installed = False
        self._scaler_warned = False
        self._ckpt_warned = False

    # ------------------------------------------------------------------ processes
    @property
    def _several(self) -> bool:
        return self.num_nodes * self.num_processes > 1

    @property
    def lgh_one_process(self) -> bool:
        """True on one device: Lightning then treats the run as local, not distributed (the tuner accepts it).
        See :func:`lightning_gh._lightning.let_one_process_strategies_be_local`."""
        return not self._several

    def _configure_launcher(self) -> None:
        # One device: no launcher and no process group, as a single-device strategy (DDP's would start neither
        # children nor anything useful, but it would still set up a process group of one).
        if self._several:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()
        numa.bind_strategy_rank(self)  # before anything of the optimizer: see Note [A rank's CPUs near its GPU]

    def setup_distributed(self) -> None:
        if self._several:
            super().setup_distributed()
        else:
            self.set_world_ranks()

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        fit_fp8_weights(self.precision_plugin, model)
        return model  # never DistributedDataParallel: the optimizer reduces the gradients itself

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: the optimizer's hooks reduce the gradients. What the wrapper would have
        done at construction, making every rank start from rank 0's weights and buffers, is done here."""
        fit_fp8_weights(self.precision_plugin, self.model)
        if self._several and torch.distributed.is_initialized():
            with torch.no_grad():
                for tensor in self.model.state_dict().values():
                    torch.distributed.broadcast(tensor, src=0)

    # ------------------------------------------------------------------ optimizers
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        clip_val = trainer.gradient_clip_val
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
        clip_kwargs: dict[str, Any] = {}
        if clip_val:
            clip_kwargs = {"max_grad_value": float(clip_val)} if algorithm == "value" else {"max_grad_norm": float(clip_val)}
        trigger = "closure" if module.automatic_optimization else "backward"
        converted = []
        for opt in self.optimizers:
            if isinstance(opt, HeterogeneousAdamW):
                opt.set_pipeline_trigger(trigger)
                if opt.module is None:
                    opt.attach(module)
                if "max_grad_norm" in clip_kwargs:
                    opt.set_max_grad_norm(clip_kwargs["max_grad_norm"])
                if "max_grad_value" in clip_kwargs:
                    opt.set_max_grad_value(clip_kwargs["max_grad_value"])
                new = opt
            elif isinstance(opt, torch.optim.AdamW):
                new = HeterogeneousAdamW.from_optimizer(opt, module=module, pipeline_trigger=trigger,
                                                        options=self.options, **clip_kwargs)
                self._rebind_schedulers(opt, new)
            else:
                raise TypeError(_unsupported_optimizer_message(opt))
            converted.append(new)
        self.optimizers = converted

    def _rebind_schedulers(self, old: torch.optim.Optimizer, new: HeterogeneousAdamW) -> None:
        """Point every scheduler bound to ``old`` at ``new``, including the schedulers nested in a
        ``SequentialLR`` or ``ChainedScheduler`` (their ``_schedulers``). The two optimizers share their
        param-group dicts (see ``HeterogeneousAdamW.from_optimizer``), so a scheduler missed here still sets the
        learning rate the new optimizer reads; rebinding keeps ``optimizer.step`` bookkeeping right too."""
        seen: set[int] = set()

        def rebind(sched: Any) -> None:
            if id(sched) in seen:
                return
            seen.add(id(sched))
            if getattr(sched, "optimizer", None) is old:
                sched.optimizer = new
                if hasattr(old.step, "_wrapped_by_lr_sched") and not hasattr(new.step, "_wrapped_by_lr_sched"):
                    _mark_step_for_schedulers(new)
            for inner in getattr(sched, "_schedulers", None) or ():
                rebind(inner)

        configs: list[LRSchedulerConfig] = self.lr_scheduler_configs
        for cfg in configs:
            rebind(cfg.scheduler)

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        """The options as :class:`HeterogeneousAdamW` keyword arguments (kept for code that read them before 0.3)."""
        return self.options.as_kwargs()

    def setup(self, trainer: Any) -> None:
        compat.check(trainer, self.lgh_part)
        if self._several:
            super().setup(trainer)
        else:  # one device: the plain strategy's setup (DDP's would sync the module over a process group)
            _lightning.keep_user_sampler(trainer)  # and the data a single-device run sees
            Strategy.setup(self, trainer)
        self._install_clipping()
        self._check_precision_plugin()
        self.loss.setup(trainer, self.lightning_module, self.root_device)
        if self.root_device.type != "cuda":
            # Every other GPU part says when it steps aside; the math is the same, only nothing moves.
            rank_zero_warn(f"SuperOffloadStrategy on {self.root_device}: there is no GPU memory to relieve, so the "
                           "optimizer state simply stays in host memory and AdamW runs on the CPU as usual (same "
                           "results; use a CUDA device to offload).", category=UserWarning)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss.context():  # the forward and the loss; the backward needs nothing installed
            return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        opt = _lightning.unwrap_optimizer(optimizer)
        trainer = getattr(self.lightning_module, "trainer", None) if self.lightning_module is not None else None
        if isinstance(opt, HeterogeneousAdamW) and trainer is not None and trainer.loggers \
                and _lightning.should_update_logs(trainer):
            _lightning.log_to_loggers(trainer, _stats_metrics(opt))
        return out

    def _check_precision_plugin(self) -> None:
        """Warn once when a loss scaler is in use (``precision="16-mixed"``).

        Lightning's ``MixedPrecision.optimizer_step`` runs the closure (forward and backward) *before* it calls
        ``scaler.step(optimizer)``, so the backward never runs inside ``optimizer.step(closure)``: every gradient is
        collected and updated in ``step()`` after backward, i.e. correct but with no CPU/backward overlap. This is
        a warning, not an error, because the results are still right (the scaler unscales first and skips
        non-finite steps)."""
        plugin = self.precision_plugin
        if self._scaler_warned or not isinstance(plugin, MixedPrecision) or getattr(plugin, "scaler", None) is None:
            return
        if not any(isinstance(o, HeterogeneousAdamW) for o in self.optimizers):
            return
        self._scaler_warned = True
        rank_zero_warn(
            f"SuperOffloadStrategy with precision={plugin.precision!r} (a GradScaler): Lightning runs backward before "
            "optimizer.step(), so the CPU AdamW update cannot overlap the backward pass and each step ends waiting "
            "for the whole CPU update (the math is unchanged). Use precision='bf16-mixed' or 'bf16-true', which "
            "need no loss scaling, to get the overlap.", category=UserWarning)

    def _install_clipping(self) -> None:
        """Route Lightning's post-backward clipping of our optimizers to the optimizer itself."""
        _lightning.route_clip_gradients(self.precision_plugin, _clip_gradients)

    # ------------------------------------------------------------------ checkpoints and teardown
    def _heterogeneous(self) -> list[HeterogeneousAdamW]:
        return [o for o in self.optimizers if isinstance(o, HeterogeneousAdamW)]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        for opt in self._heterogeneous():
            opt.synchronize()  # the weights on the GPU must be the committed ones
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # A plain Trainer never runs our code when it loads this file, so the one moment to say it is now: with
        # low-precision module weights the fp32 master lives only in the optimizer state.
        if not self._ckpt_warned and self._heterogeneous() and any(
                p.dtype in (torch.bfloat16, torch.float16) for p in self.lightning_module.parameters()):
            self._ckpt_warned = True
            rank_zero_warn(
                f"SuperOffloadStrategy: the checkpoint {str(filepath)!r} holds the module's "
                f"{next(self.lightning_module.parameters()).dtype} weights; their fp32 master copies are in its "
                "optimizer state. Resume it with strategy='superoffload' to keep them: a Trainer without it loads the "
                "low-precision weights and drops the masters.", category=UserWarning)
        checkpoint.setdefault("lightning_gh", {})["superoffload"] = {"fp32_master_in_optimizer_state": True}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Lightning's default also moves the state to the GPU, which is what this strategy avoids.
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt.load_state_dict(state)

    def teardown(self) -> None:
        for opt in self._heterogeneous():
            opt.close()
        self.loss.teardown()
        numa.unbind_rank()
        super().teardown()


def _stats_metrics(opt: HeterogeneousAdamW) -> dict[str, float]:
    """What the user's logger gets from the offloaded optimizer at each logging step (``lgh/superoffload/*``)."""
    st = opt.stats
    total = opt.host_numel + opt.device_numel
    return {
        "lgh/superoffload/cpu_stall_ms": float(st.get("last_stall_ms") or 0.0),
        "lgh/superoffload/cpu_update_ms": float(st.get("cpu_ms_per_step") or 0.0),
        # fp32 gradients down and fp32 weights back up for every host-resident parameter
        "lgh/superoffload/host_bytes_per_step": float(8 * opt.host_numel),
        "lgh/superoffload/gpu_tail_frac": float(opt.device_numel / max(total, 1)),
        "lgh/superoffload/skipped_steps": float(st.get("skipped_steps", 0)),
        "lgh/superoffload/rollbacks": float(st.get("rollbacks", 0)),
    }


def fit_fp8_weights(plugin: Any, model: torch.nn.Module) -> None:
    """Under an fp8 precision plugin, keep bf16 weights on the GPU: SuperOffload holds the fp32 masters.

    The fp8 layers cast their weights to fp8 on the fly from whatever the module holds; the torchao plugins run
    under ``bf16-mixed`` with fp32 module weights, which would put 4 B per parameter on the GPU next to the fp32
    master SuperOffload already keeps in host memory. Their fp32 parameters become bf16 here (after the plugin
    converted the layers, before the optimizer is built, so the host masters start from the exact fp32 values).
    A Transformer Engine plugin that keeps fp32 master weights of its own (``master_weights=True``) would
    duplicate SuperOffload's: that is refused with the way out.
    """
    if getattr(plugin, "lgh_part", None) != "fp8":
        return
    if getattr(plugin, "backend", None) == "te" and getattr(plugin, "master_weights", False):
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        raise MisconfigurationException(
            f"{type(plugin).__name__}(master_weights=True) with strategy='superoffload': the plugin's fp32 master "
            "weights on the GPU would duplicate SuperOffload's, which keeps them (and the AdamW moments) in host "
            f"memory. Use lgh.precision({getattr(plugin, 'name', 'fp8-te-delayed')!r}, master_weights=False), or a "
            "torchao recipe (lgh.precision('fp8-ao-tensorwise')).")
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float32:
                p.data = p.data.to(torch.bfloat16)


def _unsupported_optimizer_message(opt: Any) -> str:
    """Why ``opt`` cannot be offloaded, and what to use instead."""
    name = type(opt).__name__
    if isinstance(opt, torch.optim.Adam):
        instead = ("torch.optim.Adam's weight decay is L2 (added to the gradient), not AdamW's decoupled decay: "
                   "return torch.optim.AdamW (with weight_decay=0.0 it is the same update as Adam without decay)")
    elif type(opt).__module__.startswith(("torchao", "deepspeed", "bitsandbytes")):
        instead = (f"{name} already manages its own state placement; use it with strategy='auto' (or DeepSpeed's "
                   f"own strategy), or return torch.optim.AdamW to let SuperOffload place the state")
    else:
        instead = (f"return torch.optim.AdamW (or a HeterogeneousAdamW), or keep {name} with strategy='auto' "
                   f"(its state then stays on the GPU)")
    return (f"SuperOffloadStrategy runs AdamW on the CPU; configure_optimizers returned {name}, which it cannot "
            f"offload: {instead}.")


def clip_handler(ours: type, clip: Any) -> Any:
    """The handler :func:`lightning_gh._lightning.route_clip_gradients` installs for a SuperOffload strategy: an
    optimizer that is not of type ``ours`` clips as before; for one that is, a positive clip value goes to
    ``clip(optimizer, clip_val, algorithm)`` (``"norm"`` or ``"value"``), which hands it to the optimizer, since the
    optimizer clips in its own ``step()``; a clip value of 0 or ``None`` does nothing."""

    def handler(original: Any, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        opt = _lightning.unwrap_optimizer(optimizer)
        if not isinstance(opt, ours):
            if gradient_clip_algorithm is None:
                return original(optimizer, clip_val)
            return original(optimizer, clip_val, gradient_clip_algorithm)
        if clip_val and clip_val > 0:
            clip(opt, clip_val, getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
        return None

    return handler


def _clip(opt: HeterogeneousAdamW, clip_val: float, algo: str) -> None:
    """Lightning's clipping for a :class:`HeterogeneousAdamW`: the norm becomes its ``max_grad_norm``; a value clip
    must be the one set up before backward (see :func:`clip_handler`)."""
    if algo == "value":
        if opt.max_grad_value != float(clip_val):
            raise RuntimeError(
                f"SuperOffloadStrategy: value clipping must be known before backward (the gradients are "
                f"already on the host when Lightning clips); got clip value {clip_val} at step time but "
                f"{opt.max_grad_value} at setup. Set Trainer(gradient_clip_val=..., "
                f"gradient_clip_algorithm='value').")
        return
    # norm clipping is decided in optimizer.step(), after this call, so a per-step value is honoured
    opt.set_max_grad_norm(float(clip_val))


_clip_gradients = clip_handler(HeterogeneousAdamW, _clip)


def _mark_step_for_schedulers(opt: HeterogeneousAdamW) -> None:
    """Mirror what an LR scheduler does to its optimizer's ``step`` (it warns if ``step`` was not wrapped)."""
    ref = weakref.ref(opt)
    func = type(opt).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        o = ref()
        o._opt_called = True  # type: ignore[union-attr]
        return func(o, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper  # type: ignore[method-assign]

