"""The predicted peak of a Lightning training step, before it runs: the step traced on fake tensors
(:func:`~lightning_gh.memory.predict.trace_step`), what the optimizers will hold
(:func:`~lightning_gh.memory.optim.forecast`), and :func:`~lightning_gh.memory.predict.peak_from_parts`.

:func:`why_not` (pure, tested as a table) says when no prediction is made; :func:`predict` makes one from the first
batch, or says in one line why it could not.

Example::

    >>> why_not(automatic_optimization=False)
    'manual optimization: training_step steps the optimizer itself, so it is not traced'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_gh.memory.optim import forecast
from lightning_gh.memory.predict import Peak, StepTrace, block_bytes, peak_from_parts, trace_step

__all__ = ["Prediction", "predict", "why_not"]


def why_not(*, automatic_optimization: bool = True, compiled: bool = False, sharded: bool = False,
            activation_offload: bool = False) -> str | None:
    """Why the step's memory is not predicted from a trace, or ``None`` when it is."""
    if not automatic_optimization:
        return "manual optimization: training_step steps the optimizer itself, so it is not traced"
    if compiled:
        return "a torch.compile'd model: the compiler decides what the step saves for backward"
    if sharded:
        return "sharded parameters (DTensor): the trace runs on whole ones"
    if activation_offload:
        return "ActivationOffload decides at run time which activations leave the GPU (a budget= gives the peak)"
    return None


@dataclass(frozen=True)
class Prediction:
    """The predicted peak of a step and its parts (bytes).

    Attributes:
        peak: the peak and its phase (:class:`~lightning_gh.memory.predict.Peak`).
        parts: what the peak is made of: ``"before the step"`` (weights, buffers, the batch), ``"gradients"``,
            ``"optimizer state"``, ``"optimizer step temporaries"``, ``"activations"`` (held into backward),
            ``"forward transient"`` (the forward's largest temporaries above those), ``"backward above
            activations"``.
        trace: the step's trace.
        notes: what the prediction assumed (an optimizer whose state it does not know, offloaded gradients).
    """

    peak: Peak
    parts: dict[str, int]
    trace: StepTrace
    notes: tuple[str, ...] = field(default=())


def _batch_bytes(batch: Any, device: torch.device) -> int:
    return sum(block_bytes(t.untyped_storage().nbytes()) for t in pytree.tree_leaves(batch)
               if isinstance(t, torch.Tensor) and t.device == device)


@contextlib.contextmanager
def _quiet(pl_module: Any) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing while the step is traced (a fake loss is no metric)."""
    noop = lambda *args, **kwargs: None  # noqa: E731
    pl_module.__dict__["log"] = noop
    pl_module.__dict__["log_dict"] = noop
    try:
        yield
    finally:
        pl_module.__dict__.pop("log", None)
        pl_module.__dict__.pop("log_dict", None)


def trace_training_step(trainer: Any, pl_module: Any, batch: Any) -> StepTrace:
    """``pl_module.training_step(batch, 0)`` and its backward traced on fake tensors, under the precision plugin's
    context (autocast for ``bf16-mixed``); the random number generators are left as they were."""
    device = pl_module.device
    devices = [device] if device.type == "cuda" else []

    def step(b: Any) -> Any:
        with trainer.precision_plugin.train_step_context():
            return pl_module.training_step(b, 0)

    with torch.random.fork_rng(devices=devices), _quiet(pl_module):
        return trace_step(step, batch, device_type=device.type, module=pl_module)


def predict(trainer: Any, pl_module: Any, batch: Any, owners: dict[str, int], allocated: int) -> Prediction | str:
    """The predicted peak of a step of ``trainer`` on ``batch``, or why there is none (one line).

    Args:
        owners: GPU bytes per owner now (:func:`~lightning_gh.memory.plan.attribute`).
        allocated: bytes allocated on the device now (weights, buffers, the batch, the parts' buffers).
    """
    from lightning_gh._lightning import is_compiled

    params = list(pl_module.parameters())
    sharded = any(type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor" for p in params)
    offload = any(getattr(cb, "lgh_part", None) == "ActivationOffload" for cb in trainer.callbacks)
    reason = why_not(automatic_optimization=pl_module.automatic_optimization, compiled=is_compiled(pl_module),
                     sharded=sharded, activation_offload=offload)
    if reason is not None:
        return reason
    try:
        trace = trace_training_step(trainer, pl_module, batch)
    except Exception as e:  # custom ops without a fake kernel, shapes that depend on data, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"the step does not run on fake tensors: {type(e).__name__}: {first}"
    device = pl_module.device
    fc = forecast(trainer.optimizers, device.type)
    notes = [f"{name}: its state is counted as allocated now" for name in fc.unknown]
    superoffload = getattr(trainer.strategy, "lgh_part", None) == "SuperOffload"
    grads = max(0, fc.grads - owners.get("gradients", 0))
    if superoffload:
        notes.append("SuperOffload: gradients leave the GPU as they arrive; its GPU tail as allocated now")
        grads = 0
    state = max(0, fc.state - owners.get("optimizer state", 0))
    kept = getattr(trainer, "accumulate_grad_batches", 1) > 1
    backward_peak = trace.backward_peak - (trace.grads if superoffload else 0)
    peak = peak_from_parts(base=allocated, grads=grads, state=state, step_temp=fc.step_temp,
                           forward_peak=trace.forward_peak, backward_peak=backward_peak, grads_made=trace.grads,
                           grads_kept=kept)
    parts = {"before the step": allocated, "gradients": grads, "optimizer state": state,
             "optimizer step temporaries": fc.step_temp, "activations": trace.retained,
             "forward transient": trace.forward_peak - trace.retained,
             "backward above activations": max(0, backward_peak - trace.retained)}
    return Prediction(peak, parts, trace, tuple(notes))


def allocated_now(pl_module: Any, owners: dict[str, int], batch: Any) -> int:
    """Bytes allocated on the module's device now: the allocator's count on CUDA, else the owners' plus the
    batch's."""
    device = pl_module.device
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return owners.get("weights", 0) + owners.get("gradients", 0) + owners.get("optimizer state", 0) + \
        _batch_bytes(batch, device)
