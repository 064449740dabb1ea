"""``Trainer(strategy="superoffload_fsdp")``: ZeRO-3 through Lightning's FSDP2 ``ModelParallelStrategy``, with the
optimizer state in host memory (:class:`~lightning_gh.superoffload.fsdp_optimizer.ShardedHostAdamW`).

The user's LightningModule shards itself as Lightning documents for ``ModelParallelStrategy``: in
``configure_model`` it calls ``fully_shard`` on each decoder layer, then on the root, over
``self.device_mesh["data_parallel"]``; ``configure_optimizers`` returns a plain ``torch.optim.AdamW`` (with or
without an LR scheduler), and ``Trainer(gradient_clip_val=...)`` clips. FSDP2 shards the (bf16) weights and
reduce-scatters the gradients; this strategy replaces the AdamW by a ``ShardedHostAdamW`` with the same param
groups and hyper-parameters, which keeps each rank's fp32 master rows and moments in pinned host memory and updates
them on a CPU thread while the next forward runs (see Note [ZeRO-3 step and the forward's wait] in
:mod:`.fsdp_optimizer`). Lightning's norm clipping becomes the optimizer's exact clipping across ranks.

Checkpoints are Lightning's ``ModelParallelStrategy`` checkpoints: a distributed checkpoint folder by default
(``save_distributed_checkpoint=True``), whose optimizer state is ``torch.optim.AdamW``'s (``step``, ``exp_avg``,
``exp_avg_sq``, and ``master`` for non-fp32 parameters) sharded like the parameters, so it resumes on any number
of ranks.

Registered in Lightning's strategy registry as ``"superoffload_fsdp"`` when this module is imported.

Example::

    import lightning as L
    from torch.distributed.fsdp import fully_shard

    class LM(L.LightningModule):
        def configure_model(self):
            for layer in self.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    trainer = L.Trainer(strategy="superoffload_fsdp", devices=2, precision="bf16-true", gradient_clip_val=1.0)
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Generator

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_gh import _lightning, compat
from lightning_gh._options import check_type
from lightning_gh.superoffload import numa
from lightning_gh.superoffload.fsdp_optimizer import ShardedHostAdamW
from lightning_gh.superoffload.loss import StepLoss
from lightning_gh.superoffload.options import SuperOffloadOptions, resolve_options
from lightning_gh.superoffload.strategy import SuperOffloadStrategy, clip_handler

__all__ = ["SuperOffloadFSDPStrategy", "check_optimizers"]


def check_optimizers(optimizers: list[Any]) -> torch.optim.AdamW:
    """The one ``torch.optim.AdamW`` ``configure_optimizers`` returned, or a clear error.

    >>> import torch
    >>> opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    >>> check_optimizers([opt]) is opt
    True
    >>> check_optimizers([torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)])
    Traceback (most recent call last):
    ...
    TypeError: SuperOffloadFSDPStrategy runs AdamW on the CPU; configure_optimizers returned SGD. Return torch.optim.AdamW (its lr, betas, eps, weight_decay and param groups are kept).
    """
    if len(optimizers) != 1:
        raise ValueError(f"SuperOffloadFSDPStrategy: configure_optimizers returned {len(optimizers)} optimizers; "
                         "it supports exactly one torch.optim.AdamW (one optimizer, several param groups are fine).")
    opt = optimizers[0]
    if isinstance(opt, ShardedHostAdamW):
        return opt
    if type(opt) is not torch.optim.AdamW:
        raise TypeError(f"SuperOffloadFSDPStrategy runs AdamW on the CPU; configure_optimizers returned "
                        f"{type(opt).__name__}. Return torch.optim.AdamW (its lr, betas, eps, weight_decay and "
                        "param groups are kept).")
    for gi, g in enumerate(opt.param_groups):
        for key in ("amsgrad", "maximize"):
            if g.get(key):
                raise ValueError(f"SuperOffloadFSDPStrategy: the AdamW's param_groups[{gi}] sets {key}=True, which "
                                 "it does not support.")
    return opt


class SuperOffloadFSDPStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) with the AdamW state in host memory, updated on the CPU.

    Args:
        data_parallel_size: ranks the parameters are sharded over; ``"auto"``: all of them.
        save_distributed_checkpoint: as for ``ModelParallelStrategy``: a folder of shards (the default; use it on
            GPUs) or one full file assembled on rank 0.
        options: :class:`~lightning_gh.superoffload.SuperOffloadOptions` (``skip_nonfinite``, ``cpu_threads``,
            ``host_memory_check`` and ``gpu_fraction`` apply: a float keeps the state of the first FSDP units in
            forward order on the GPU, ``"auto"`` keeps it all in host memory (no sizing from measured GPU memory
            on this path yet); see :func:`~.fsdp_units.unsupported_options`).
        **option_kwargs: the same options as keywords instead.
        lean_loss: as for :class:`~lightning_gh.superoffload.strategy.SuperOffloadStrategy`: a causal LM's loss
            through the lean loss (``"auto"``: on CUDA, unless an ``ActivationOffload`` decides the loss); the decision is
            ``strategy.loss.why``.
        process_group_backend, timeout: as for ``ModelParallelStrategy``.

    Tensor parallelism is not supported (``tensor_parallel_size`` is 1).

    Example::

        trainer = L.Trainer(strategy=SuperOffloadFSDPStrategy(cpu_threads=24), devices=2, precision="bf16-true",
                            gradient_clip_val=1.0)
    """

    strategy_name = "superoffload_fsdp"
    lgh_part = "SuperOffload"

    def __init__(self, *, data_parallel_size: int | str = "auto", save_distributed_checkpoint: bool = True,
                 options: SuperOffloadOptions | None = None, process_group_backend: str | None = None,
                 timeout: Any = default_pg_timeout, lean_loss: bool | str = "auto", **option_kwargs: Any) -> None:
        self.options = resolve_options(options, "SuperOffloadFSDPStrategy", **option_kwargs)
        self.loss = StepLoss("SuperOffloadFSDPStrategy", lean_loss)
        check_type("SuperOffloadFSDPStrategy", "data_parallel_size", data_parallel_size, int | str)
        check_type("SuperOffloadFSDPStrategy", "save_distributed_checkpoint", save_distributed_checkpoint, bool)
        if not (data_parallel_size == "auto" or (isinstance(data_parallel_size, int) and data_parallel_size >= 1)):
            raise ValueError(f"data_parallel_size={data_parallel_size!r} must be 'auto' or an int >= 1.")
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # every rank shards (ModelParallelStrategy's "auto" is per node)
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        numa.bind_strategy_rank(self)  # before anything of the optimizer: see Note [A rank's CPUs near its GPU]

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        opt = check_optimizers(self.optimizers)
        clip = trainer.gradient_clip_val
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
        if clip and algorithm != "norm":
            raise ValueError(f"SuperOffloadFSDPStrategy: gradient_clip_algorithm={algorithm!r} is not supported; "
                             "use 'norm' (the default), which it clips exactly across ranks.")
        if not isinstance(opt, ShardedHostAdamW):
            d = opt.defaults
            new = ShardedHostAdamW(opt.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                                   weight_decay=d["weight_decay"], module=self.model,
                                   max_grad_norm=float(clip) if clip else None, options=self.options)
            SuperOffloadStrategy._rebind_schedulers(self, opt, new)  # the same rebinding as the ZeRO-1/2 strategy
            opt = new
        # Lightning's setup moves every tensor of optimizer.state to the GPU next: the state is exposed after it
        opt.hide_state()
        self.optimizers = [opt]

    def setup(self, trainer: Any) -> None:
        compat.check(trainer, self.lgh_part)
        super().setup(trainer)
        _lightning.route_clip_gradients(self.precision_plugin, _clip_gradients)
        for opt in self._ours():
            opt.publish_state()
        self.loss.setup(trainer, self.lightning_module, self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss.context():  # the forward and the loss; the backward needs nothing installed
            return super().training_step(*args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this around the micro-batches that accumulate gradients (``accumulate_grad_batches``):
        their gradients stay on the device for FSDP2 to sum, and the micro-batch that steps moves the sums to host
        memory (see :meth:`ShardedHostAdamW.accumulating`)."""
        with ExitStack() as stack:
            for opt in self._ours():
                stack.enter_context(opt.accumulating())
            with super().block_backward_sync():
                yield

    def _ours(self) -> list[ShardedHostAdamW]:
        return [o for o in self.optimizers if isinstance(o, ShardedHostAdamW)]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        for opt in self._ours():
            opt.synchronize()  # the weights must be the updated ones
        return super().lightning_module_state_dict()

    def teardown(self) -> None:
        for opt in self._ours():
            opt.close()
        self.loss.teardown()
        numa.unbind_rank()
        super().teardown()


def _clip(opt: ShardedHostAdamW, clip_val: float, algo: str) -> None:
    """Lightning's clipping for a :class:`ShardedHostAdamW`: the clip value becomes its ``max_grad_norm``, applied
    exactly across ranks in its ``step()`` (see :func:`~lightning_gh.superoffload.strategy.clip_handler`)."""
    if algo != "norm":
        raise ValueError(f"SuperOffloadFSDPStrategy: gradient_clip_algorithm={algo!r} is not supported; use 'norm'.")
    opt.set_max_grad_norm(float(clip_val))  # decided in step(), after this call: a per-step value is honoured


_clip_gradients = clip_handler(ShardedHostAdamW, _clip)

