"""The one place where CUDAGraphCapture touches Lightning internals (written against lightning 2.6).

Everything else goes through public hooks: the LightningModule's ``optimizer_step``, ``training_step`` and
``log`` are wrapped on the instance, and the batch comes from ``on_train_batch_start``. Two private names
could not be avoided:

``Closure._result``
    After ``optimizer_step`` returns, the automatic-optimization loop calls ``closure.consume_result()``
    (``lightning/pytorch/loops/optimization/automatic.py``). On a replayed step Lightning's closure never
    runs (running it would run the eager training step and its hooks), so the replayed loss is handed over
    by setting the cached result the closure would have set.

``LightningModule._current_fx_name``
    The hook a ``self.log`` call comes from decides its result key and its on_step/on_epoch defaults.
    Logs recorded while the step is captured are re-issued after each replay under the hook that made them.

``tests/test_graphs.py::test_lightning_internals_canary`` fails when Lightning changes either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.loops.optimization.closure import AbstractClosure

__all__ = ["current_hook", "in_hook", "set_closure_result"]


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
    closure._result = ClosureResult.from_training_step_output(step_output, normalize)


def current_hook(pl_module: pl.LightningModule) -> str | None:
    """The name of the hook Lightning is running on ``pl_module`` now (what ``self.log`` keys on)."""
    return pl_module._current_fx_name


@contextmanager
def in_hook(pl_module: pl.LightningModule, name: str | None) -> Iterator[None]:
    """Run the body as if Lightning were inside hook ``name`` (so ``self.log`` keys and defaults match)."""
    prev = pl_module._current_fx_name
    pl_module._current_fx_name = name
    try:
        yield
    finally:
        pl_module._current_fx_name = prev
