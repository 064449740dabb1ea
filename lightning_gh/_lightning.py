"""Every Lightning internal that lightning_gh touches, in one place (written against lightning 2.6).

The parts talk to Lightning through public hooks wherever they can. The few private names they cannot avoid
are read or written here and nowhere else, each behind a function that fails with
:class:`LightningInternalsChanged` (naming the attribute and the installed Lightning version) instead of
silently falling back to different behaviour. ``tests/test_lightning_internals.py`` holds one canary per
function: when a Lightning upgrade moves one of these names, that test names it.

Sections: the module and its trainer, the fit loop, logging, the optimization closure (CUDAGraphCapture),
strategies and precision plugins (SuperOffload).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.loops.optimization.closure import AbstractClosure
from torch import nn

__all__ = [
    "LightningInternalsChanged",
    "batches_that_stepped",
    "current_hook",
    "in_hook",
    "is_compiled",
    "is_last_training_batch",
    "let_one_process_strategies_be_local",
    "log_to_loggers",
    "route_clip_gradients",
    "set_closure_result",
    "should_update_logs",
    "trainer_of",
    "unwrap_optimizer",
]


class LightningInternalsChanged(RuntimeError):
    """A private Lightning name lightning_gh relies on is not where lightning 2.6 kept it."""


def _require(obj: Any, attr: str, where: str) -> Any:
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise LightningInternalsChanged(
            f"lightning_gh reads {where}.{attr}, which lightning {lightning.__version__} does not have "
            f"(it was written against lightning 2.6). Please report this with your Lightning version.") from None


# ------------------------------------------------------------------------------------------------------------------
# the module and its trainer


def trainer_of(module: nn.Module) -> pl.Trainer | None:
    """The Trainer a LightningModule is attached to, or ``None`` (a plain ``nn.Module``, or not attached yet).

    ``LightningModule.trainer`` raises when no trainer is attached; the parts ask from places (precision plugins'
    ``convert_module``, plain-PyTorch engines) where that is a normal case, so they read ``_trainer``.
    """
    if not isinstance(module, pl.LightningModule):
        return None
    return _require(module, "_trainer", "LightningModule")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is, or contains, a ``torch.compile``'d module.

    Lightning unwraps a compiled LightningModule before training (``Trainer.fit`` takes the ``OptimizedModule``'s
    ``_orig_mod``) and remembers that it was compiled in ``_compiler_ctx``; submodules compiled in place keep
    their ``OptimizedModule`` wrapper.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, pl.LightningModule) and _require(module, "_compiler_ctx", "LightningModule"):
        return True
    return any(isinstance(m, OptimizedModule) for m in module.modules())


# ------------------------------------------------------------------------------------------------------------------
# the fit loop


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning logs metrics at (``fit_loop.epoch_loop._batches_that_stepped``).

    It differs from ``global_step`` with several optimizers; loggers see this number, so metrics logged by the
    parts line up with the user's own.
    """
    return int(_require(trainer.fit_loop.epoch_loop, "_batches_that_stepped", "trainer.fit_loop.epoch_loop"))


def is_last_training_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch that just ended was the epoch's last (``batch_progress``)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch or progress.current.ready >= trainer.num_training_batches)


# ------------------------------------------------------------------------------------------------------------------
# logging


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes logs at this step (``log_every_n_steps``), as its logger connector decides."""
    connector = _require(trainer, "_logger_connector", "Trainer")
    return bool(_require(connector, "should_update_logs", "Trainer._logger_connector"))


# ------------------------------------------------------------------------------------------------------------------
# the optimization closure (CUDAGraphCapture)
#
# ``Closure._result``: after ``optimizer_step`` returns, the automatic-optimization loop calls
# ``closure.consume_result()`` (lightning/pytorch/loops/optimization/automatic.py). On a replayed step the closure
# never runs (running it would run the eager training step and its hooks), so the replayed loss is handed over by
# setting the cached result the closure would have set.
#
# ``LightningModule._current_fx_name``: the hook a ``self.log`` call comes from decides its result key and its
# on_step/on_epoch defaults. Logs recorded while the step is captured are re-issued after each replay under the hook
# that made them.


def set_closure_result(closure: Any, step_output: Any, normalize: int) -> None:
    """Make ``closure.consume_result()`` return what running the closure on ``step_output`` would have returned.

    Args:
        closure: the ``optimizer_closure`` Lightning passed to ``optimizer_step``.
        step_output: what ``training_step`` returned (a loss tensor or a dict with ``"loss"``).
        normalize: ``trainer.accumulate_grad_batches`` (Lightning divides the loss by it).
    """
    if not isinstance(closure, AbstractClosure):
        raise TypeError(f"optimizer_closure is a {type(closure).__name__}, not Lightning's closure; "
                        "CUDAGraphCapture needs Lightning's automatic optimization loop")
    _require(closure, "_result", "Closure")
    closure._result = ClosureResult.from_training_step_output(step_output, normalize)


def current_hook(pl_module: pl.LightningModule) -> str | None:
    """The name of the hook Lightning is running on ``pl_module`` now (what ``self.log`` keys on)."""
    return _require(pl_module, "_current_fx_name", "LightningModule")


@contextmanager
def in_hook(pl_module: pl.LightningModule, name: str | None) -> Iterator[None]:
    """Run the body as if Lightning were inside hook ``name`` (so ``self.log`` keys and defaults match)."""
    prev = current_hook(pl_module)
    pl_module._current_fx_name = name
    try:
        yield
    finally:
        pl_module._current_fx_name = prev


# ------------------------------------------------------------------------------------------------------------------
# strategies and precision plugins (SuperOffload)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The user's optimizer inside Lightning's ``LightningOptimizer`` wrapper (``_optimizer``), else ``optimizer``."""
    if isinstance(optimizer, LightningOptimizer):
        return _require(optimizer, "_optimizer", "LightningOptimizer")
    return optimizer


def route_clip_gradients(plugin: Any, handler: Any) -> bool:
    """Send Lightning's post-backward clipping through ``plugin`` to ``handler`` first (this plugin instance only).

    Lightning clips by calling the precision plugin's ``clip_gradients(optimizer, clip_val, gradient_clip_algorithm)``
    from ``LightningModule.clip_gradients``. SuperOffload's optimizer must clip itself (its CPU update has started
    before Lightning clips), so the instance's method is replaced by one that calls
    ``handler(original, optimizer, clip_val, gradient_clip_algorithm)``.

    Returns:
        ``False`` when the plugin was routed already (the handler is installed once per plugin), else ``True``.
    """
    if getattr(plugin, "_lgh_clip_routed", False):
        return False
    original = _require(plugin, "clip_gradients", type(plugin).__name__)

    @functools.wraps(original)
    def clip_gradients(optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> Any:
        return handler(original, optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients
    plugin._lgh_clip_routed = True
    return True


def keep_user_sampler(trainer: pl.Trainer) -> None:
    """Leave the user's samplers alone for this run (``trainer._accelerator_connector.use_distributed_sampler``).

    Lightning injects a ``DistributedSampler`` (which shuffles the training set its own way) whenever the strategy
    is a ``DDPStrategy``, even with one process. SuperOffload's strategy is one so that ``devices=N`` reuses DDP's
    launchers; with one device it must see the data exactly as a single-device strategy does.
    """
    connector = _require(trainer, "_accelerator_connector", "Trainer")
    _require(connector, "use_distributed_sampler", "_AcceleratorConnector")
    connector.use_distributed_sampler = False


def let_one_process_strategies_be_local() -> None:
    """Make ``_AcceleratorConnector.is_distributed`` ask the strategy when it runs one process (idempotent).

    Lightning answers ``is_distributed`` with an isinstance check on ``DDPStrategy`` (and four others) before it
    asks the strategy, so a strategy that subclasses ``DDPStrategy`` only for its launchers counts as distributed
    even on one device, and ``Tuner.scale_batch_size`` / ``BatchSizeFinder`` refuse it. After this call a strategy
    whose ``lgh_one_process`` attribute is true is answered ``False``; every other strategy gets Lightning's answer.
    """
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    current = _AcceleratorConnector.__dict__.get("is_distributed")
    original = current.fget if isinstance(current, property) else None
    if getattr(original, "_lgh_wrapped", False):
        return
    if original is None:
        raise LightningInternalsChanged(
            f"lightning_gh expects _AcceleratorConnector.is_distributed to be a property in lightning "
            f"{lightning.__version__} (it was written against lightning 2.6). Please report this.")

    def is_distributed(self: Any) -> bool:
        if getattr(self.strategy, "lgh_one_process", False):
            return False
        return original(self)

    is_distributed._lgh_wrapped = True  # type: ignore[attr-defined]
    _AcceleratorConnector.is_distributed = property(is_distributed, doc=current.__doc__)


# ------------------------------------------------------------------------------------------------------------------
# metrics of the parts, through the Trainer's loggers (profiling, CUDAGraphCapture)


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger of ``trainer`` at Lightning's logging step, from rank 0 only.

    The step is :func:`batches_that_stepped` (what Lightning's own ``self.log`` uses), so the parts' metrics line up
    with the user's in TensorBoard or ``metrics.csv``. Callbacks cannot ``self.log`` from every hook, and these
    metrics do not belong to the LightningModule's result collection; hence the loggers directly.
    """
    if not metrics or not trainer.loggers or trainer.global_rank != 0:
        return
    step = batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)
