"""Replaying ``self.log``: calls made inside a captured step are recorded, then re-issued after every replay.

Lightning's ``self.log`` does host-side bookkeeping (result collections, batch sizes, reductions) that a
graph cannot hold, and it must not run *during* capture: nothing executes then, so it would accumulate
tensors that hold no values yet. Instead the calls are recorded with the tensors they were given. Those
tensors come out of the graph: each replay writes the step's values into them, and re-issuing the same
calls after the replay hands Lightning this step's values (Lightning clones what it is given, so nothing
logged is overwritten by the next replay).

A value that is *not* a tensor on the step's device cannot be replayed: a Python number (``loss.item()``,
``scheduler.get_last_lr()[0]``) or a host tensor would be frozen at its capture-time value, and a
``torchmetrics.Metric`` updates host-side state every step. :meth:`LogRecorder.findings` names them.

Example::

    rec = LogRecorder(signature_of=pl_module.log)
    rec.record("training_step", ("train/loss", static_loss), {"prog_bar": True})
    ...replay...
    rec.reissue(pl_module, original_log)
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gh._lightning import in_hook

__all__ = ["LogCall", "LogRecorder", "detached", "logged_value_problem"]


@dataclass(frozen=True)
class LogCall:
    """One recorded ``self.log(...)`` call.

    Attributes:
        hook: the Lightning hook it was made from (``"training_step"``, ``"on_before_optimizer_step"``...).
        args: positional arguments, as given.
        kwargs: keyword arguments, as given.
    """

    hook: str | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def logged_value_problem(name: str, value: Any, device: torch.device) -> str | None:
    """Why a logged ``value`` would be wrong after a replay (``None`` when it replays correctly).

    Args:
        name: the logged key (for the message).
        value: what was passed to ``self.log`` (a tensor, number, Metric, or a dict of them).
        device: the device the step runs on.
    """
    if isinstance(value, Mapping):
        for k, v in value.items():
            p = logged_value_problem(f"{name}.{k}", v, device)
            if p:
                return p
        return None
    if isinstance(value, Tensor):
        if value.device != device and not (value.device.type == device.type and device.index is None):
            return (f"self.log({name!r}) gets a tensor on {value.device}; a replayed graph would keep logging its "
                    f"capture-time value (log a tensor computed on {device} in the step)")
        return None
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        return (f"self.log({name!r}) gets the Python number {value!r}; a replayed graph would keep logging its "
                "capture-time value (log the tensor instead of `.item()`/`float(...)`, or log it outside the step, "
                "e.g. in on_train_batch_end)")
    return (f"self.log({name!r}) gets a {type(value).__name__}, which updates host-side state every step "
            "and cannot be replayed (log it from on_train_batch_end or on_train_epoch_end)")


def detached(value: Any) -> Any:
    """``value`` with every tensor detached (on the same storage), inside mappings too; anything else as is.

    Used for logged values and for the step output: both outlive the step, and one that kept its autograd graph
    would keep a capture's AccumulateGrad nodes (bound to the capture stream) alive into later eager steps.

    Args:
        value: a tensor, a mapping of values, or anything else.
    """
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return type(value)((k, detached(v)) for k, v in value.items())
    return value


@dataclass
class LogRecorder:
    """Collects ``self.log`` calls while a step is captured (or rehearsed) and re-issues them afterwards.

    Args:
        signature_of: the original ``LightningModule.log`` (bound), used to find the value among the arguments.
        snapshot: storage addresses of tensors that the step itself changes in place later on (parameters, buffers,
            optimizer state). A logged tensor on one of them is copied where it is logged (inside a capture the
            copy is part of the graph), because Lightning takes the value at the call, and re-issuing the tensor
            after the step would hand it the updated one.

    Attributes:
        calls: what :meth:`reissue` passes to ``log`` (with the copies).
        given: the calls as they were made (what :meth:`findings` and :meth:`logged_tensors` look at).
    """

    signature_of: Callable[..., Any]
    snapshot: frozenset[int] = field(default=frozenset(), kw_only=True)
    calls: list[LogCall] = field(default_factory=list, init=False)
    given: list[LogCall] = field(default_factory=list, init=False)

    def record(self, hook: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Detached: Lightning detaches logged values anyway (see `detached` for why it matters here).
        given = LogCall(hook, tuple(detached(a) for a in args), {k: detached(v) for k, v in kwargs.items()})
        self.given.append(given)
        if self.snapshot:
            given = LogCall(hook, tuple(self._copy(a) for a in given.args),
                            {k: self._copy(v) for k, v in given.kwargs.items()})
        self.calls.append(given)

    def _copy(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.clone() if value.untyped_storage().data_ptr() in self.snapshot else value
        if isinstance(value, Mapping):
            return type(value)((k, self._copy(v)) for k, v in value.items())
        return value

    def _bound(self, call: LogCall) -> inspect.BoundArguments:
        return inspect.signature(self.signature_of).bind(*call.args, **call.kwargs)

    def findings(self, device: torch.device) -> list[str]:
        """A message for every recorded call whose value would not replay correctly."""
        out = []
        for call in self.given:
            try:
                a = self._bound(call).arguments
            except TypeError as e:  # Lightning itself would reject the call; let it say so when re-issued
                out.append(f"self.log{call.args!r} cannot be bound to LightningModule.log: {e}")
                continue
            p = logged_value_problem(str(a.get("name")), a.get("value"), device)
            if p:
                out.append(f"{p} [in {call.hook}]")
        return out

    def logged_tensors(self) -> list[tuple[str, Tensor]]:
        """``(name, tensor)`` for every tensor value among the recorded calls, as given."""
        out: list[tuple[str, Tensor]] = []
        for call in self.given:
            try:
                a = self._bound(call).arguments
            except TypeError:
                continue
            stack = [(str(a.get("name")), a.get("value"))]
            while stack:
                name, v = stack.pop()
                if isinstance(v, Tensor):
                    out.append((name, v))
                elif isinstance(v, Mapping):
                    stack.extend((f"{name}.{k}", x) for k, x in v.items())
        return out

    def reissue(self, pl_module: pl.LightningModule, log: Callable[..., Any]) -> None:
        """Call ``log`` again with every recorded call, each under the hook it came from."""
        for call in self.calls:
            with in_hook(pl_module, call.hook):
                log(*call.args, **call.kwargs)
