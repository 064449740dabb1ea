"""The predicted peak of a Lightning training step, before it runs: the step traced on fake tensors
(:func:`~lightning_gh.memory.predict.trace_step`), what the optimizers will hold
(:func:`~lightning_gh.memory.optim.forecast`), and :func:`~lightning_gh.memory.predict.peak_from_parts`.

:func:`why_not` (pure, tested as a table) says when no prediction is made (a model with any part compiled is never
traced: :func:`compiled_part`); :func:`predict` makes one from the first batch, or says in one line why it could
not. Under SuperOffload the gradients of host-resident parameters leave the GPU as they arrive, and the peak holds
the GPU tail its policy will settle on, not the one it has at the first batch (:mod:`.tail`).

Example::

    >>> why_not(automatic_optimization=False)
    'manual optimization: training_step steps the optimizer itself, so it is not traced'
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_gh.memory.optim import forecast
from lightning_gh.memory.predict import Peak, StepTrace, block_bytes, peak_from_parts, trace_step
from lightning_gh.memory.tail import TailForecast, TailReading, read_tail, settle_tail, tail_target

__all__ = ["Prediction", "compiled_part", "predict", "stateful_part", "why_not"]


def why_not(*, automatic_optimization: bool = True, compiled: bool | str = False, sharded: bool = False,
            activation_offload: bool = False, stateful: str | None = None) -> str | None:
    """Why the step's memory is not predicted from a trace, or ``None`` when it is.

    Args:
        compiled: the model runs compiled: ``True``, or what runs compiled in words (:func:`compiled_part`).
        stateful: a submodule whose state a traced step would change (:func:`stateful_part`), in words.
    """
    if not automatic_optimization:
        return "manual optimization: training_step steps the optimizer itself, so it is not traced"
    if compiled:
        what = "a torch.compile'd model" if compiled is True else str(compiled)
        return (f"{what}: the compiler decides what the step saves for backward, and a trace on fake tensors "
                "would compile it again")
    if sharded:
        return "sharded parameters (DTensor): the trace runs on whole ones"
    if activation_offload:
        return "ActivationOffload decides at run time which activations leave the GPU (a budget= gives the peak)"
    if stateful:
        return (f"{stateful} keeps state across steps that a traced step would update with fake tensors, so the "
                "step is not traced")
    return None


def stateful_part(pl_module: torch.nn.Module) -> str | None:
    """The first submodule of ``pl_module`` that accumulates state when the step runs (a torchmetrics ``Metric``:
    its ``update`` adds to tensors that are not parameters or buffers), in words, or ``None``."""
    for name, m in pl_module.named_modules():
        if any(c.__module__.startswith("torchmetrics") and c.__name__ == "Metric" for c in type(m).__mro__):
            return f"submodule {name!r} ({type(m).__name__}, a torchmetrics Metric)"
    return None


def compiled_part(pl_module: torch.nn.Module) -> str | None:
    """What of ``pl_module`` runs compiled, in words, or ``None``: the module itself (``torch.compile`` before
    ``fit``), or its first submodule wrapped by ``torch.compile`` or compiled in place (``module.compile()``, as
    the fp8 plugins compile the blocks), by :func:`~lightning_gh.superoffload.layout.is_compiled_region`.

    Example::

        >>> block = torch.nn.Linear(2, 2)
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), block)
        >>> compiled_part(model) is None
        True
        >>> block.compile()
        >>> compiled_part(model)
        "submodule '1' (Linear, compiled in place)"
    """
    from lightning_gh._lightning import is_compiled
    from lightning_gh.superoffload.layout import is_compiled_region

    for name, m in pl_module.named_modules():
        if is_compiled_region(m):
            how = "compiled in place" if getattr(m, "_compiled_call_impl", None) is not None else "torch.compile"
            kind = type(getattr(m, "_orig_mod", m)).__name__
            return f"the model ({how})" if not name else f"submodule {name!r} ({kind}, {how})"
    return "a torch.compile'd model" if is_compiled(pl_module) else None


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
    context (autocast for ``bf16-mixed``) and the strategy's loss context where it has one (the SuperOffload
    strategies' lean loss: ``strategy.loss.context()``); the random number generators are left as they were."""
    device = pl_module.device
    devices = [device] if device.type == "cuda" else []
    loss = getattr(getattr(trainer, "strategy", None), "loss", None)
    loss_context = loss.context if callable(getattr(loss, "context", None)) else contextlib.nullcontext

    def step(b: Any) -> Any:
        with loss_context(), trainer.precision_plugin.train_step_context():
            return pl_module.training_step(b, 0)

    with torch.random.fork_rng(devices=devices), _quiet(pl_module):
        return trace_step(step, batch, device_type=device.type, module=pl_module)


def predict(trainer: Any, pl_module: Any, batch: Any, owners: dict[str, int], allocated: int) -> Prediction | str:
    """The predicted peak of a step of ``trainer`` on ``batch``, or why there is none (one line).

    Args:
        owners: GPU bytes per owner now (:func:`~lightning_gh.memory.plan.attribute`).
        allocated: bytes allocated on the device now (weights, buffers, the batch, the parts' buffers).
    """
    params = list(pl_module.parameters())
    sharded = any(type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor" for p in params)
    offload = any(getattr(cb, "lgh_part", None) == "ActivationOffload" for cb in trainer.callbacks)
    reason = why_not(automatic_optimization=pl_module.automatic_optimization, compiled=compiled_part(pl_module) or False,
                     sharded=sharded, activation_offload=offload, stateful=stateful_part(pl_module))
    if reason is not None:
        return reason
    try:
        trace = trace_training_step(trainer, pl_module, batch)
    except Exception as e:  # custom ops without a fake kernel, shapes that depend on data, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"the step does not run on fake tensors: {type(e).__name__}: {first}"
    device = pl_module.device
    fc = forecast(trainer.optimizers, device.type)
    offloading = _superoffload_optimizers(trainer.optimizers)
    handled = {type(o).__name__ for o in offloading}
    notes = [f"{name}: its state is counted as allocated now" for name in fc.unknown if name not in handled]
    kept = getattr(trainer, "accumulate_grad_batches", 1) > 1
    grads = max(0, fc.grads - owners.get("gradients", 0))
    state = max(0, fc.state - owners.get("optimizer state", 0))
    step_temp, backward_peak = fc.step_temp, trace.backward_peak
    tails = [read_tail(o) for o in offloading]
    if tails and not kept:  # gradients of micro-batches that do not end in step() stay on the GPU
        leave = sum(t.host_grads for t in tails)
        grads = max(0, grads - leave)
        backward_peak = max(trace.retained, backward_peak - leave + max(t.in_flight for t in tails))
    if tails:
        step_temp = max(step_temp, *(t.step_temp for t in tails))
    peak = peak_from_parts(base=allocated, grads=grads, state=state, step_temp=step_temp,
                           forward_peak=trace.forward_peak, backward_peak=backward_peak, grads_made=trace.grads,
                           grads_kept=kept)
    parts = {"before the step": allocated, "gradients": grads, "optimizer state": state,
             "optimizer step temporaries": step_temp, "activations": trace.retained,
             "forward transient": trace.forward_peak - trace.retained,
             "backward above activations": max(0, backward_peak - trace.retained)}
    if tails:
        settled = _settle(offloading[0], tails, peak.allocated, device)
        parts["GPU tail grown after the first steps"] = settled.added
        peak = Peak(settled.peak, peak.phase, {k: v + settled.added for k, v in peak.phases.items()})
        notes.append(f"SuperOffload: {settled.case}; gradients leave the GPU as they arrive"
                     + (" (not between accumulated micro-batches)" if kept else ""))
    return Prediction(peak, parts, trace, tuple(notes))


def _superoffload_optimizers(optimizers: Any) -> list[Any]:
    """The :class:`~lightning_gh.superoffload.HeterogeneousAdamW` among ``optimizers`` (none unless that module
    was imported)."""
    mod = sys.modules.get("lightning_gh.superoffload.optimizer")
    return [] if mod is None else [o for o in optimizers if isinstance(o, mod.HeterogeneousAdamW)]


def _settle(opt: Any, tails: list[TailReading], peak: int, device: torch.device) -> TailForecast:
    """The peak with the GPU tail ``opt``'s options settle on (see :func:`~lightning_gh.memory.tail.settle_tail`)."""
    from lightning_gh.superoffload import memory as so_memory

    target = None
    room = so_memory.device_memory_room(device) if opt.options.gpu_fraction == "auto" else None
    if room is not None:  # the limit as the mover's budget reads it
        free, total = room
        cuda = device.type == "cuda" and torch.cuda.is_available()
        fraction = torch.cuda.get_per_process_memory_fraction(device) \
            if cuda and hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
        target = tail_target(free, torch.cuda.memory_reserved(device) if cuda else 0, min(total, int(fraction * total)))
    return settle_tail(opt.options.gpu_fraction, peak=peak, on_gpu=sum(t.on_gpu for t in tails),
                       state=sum(t.state for t in tails), target=target,
                       max_gpu_fraction=opt.options.max_gpu_fraction,
                       whole_only=getattr(opt.tail, "shard", None) is not None)


def allocated_now(pl_module: Any, owners: dict[str, int], batch: Any) -> int:
    """Bytes allocated on the module's device now: the allocator's count on CUDA, else the owners' plus the
    batch's."""
    device = pl_module.device
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return owners.get("weights", 0) + owners.get("gradients", 0) + owners.get("optimizer state", 0) + \
        _batch_bytes(batch, device)
