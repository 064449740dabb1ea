"""What an optimizer will hold on the device once it has stepped, read before it has: its state, and the
temporaries of its step.

``torch.optim`` optimizers create their state at the first ``step()``, so at setup the plan sees none of it.
:func:`state_buffers` and :func:`step_temporaries` are pure functions of the optimizer's class name, its options
and the bytes of its parameters (tested as tables); :func:`forecast` reads those from an optimizer.

Example::

    >>> state_buffers("AdamW", {"amsgrad": False})
    2
    >>> step_temporaries("foreach", group_bytes=[400, 100], largest=300)
    400
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gh.memory.predict import block_bytes

__all__ = ["OptimizerForecast", "forecast", "implementation", "state_buffers", "step_temporaries"]

#: Parameter-sized state buffers per parameter, by ``torch.optim`` class (before the options that add one).
_BUFFERS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2, "Adagrad": 1,
            "ASGD": 1, "RMSprop": 1, "SGD": 0}


def state_buffers(name: str, group: Mapping[str, Any]) -> int | None:
    """Parameter-sized buffers a ``torch.optim`` optimizer named ``name`` keeps per parameter with the options of
    ``group``, or ``None`` for an optimizer this table does not know."""
    if name not in _BUFFERS:
        return None
    n = _BUFFERS[name]
    if name in ("Adam", "AdamW") and group.get("amsgrad"):
        n += 1  # max_exp_avg_sq
    if name == "SGD" and group.get("momentum", 0):
        n += 1  # momentum_buffer
    if name == "RMSprop":
        n += bool(group.get("momentum", 0)) + bool(group.get("centered"))
    return n


def step_temporaries(impl: str, group_bytes: Sequence[int], largest: int) -> int:
    """Bytes of temporaries alive at once during an Adam-like step.

    Args:
        impl: ``"fused"`` (none), ``"foreach"`` (a parameter-sized list per device and dtype group, e.g. Adam's
            ``sqrt(exp_avg_sq)``: the largest group), or ``"single"`` (per parameter: the largest one, twice).
        group_bytes: bytes of the parameters of each device and dtype group.
        largest: bytes of the largest parameter.
    """
    if impl == "fused":
        return 0
    if impl == "foreach":
        return max(group_bytes, default=0)
    if impl == "single":
        return 2 * largest
    raise ValueError(f"step_temporaries(impl={impl!r}): expected 'fused', 'foreach' or 'single'.")


def implementation(group: Mapping[str, Any], all_cuda: bool) -> str:
    """``"fused"``, ``"foreach"`` or ``"single"``: what ``torch.optim`` picks for a group (``fused`` and ``foreach``
    as given, else foreach where every parameter is on a CUDA device and the step is not differentiable)."""
    if group.get("fused"):
        return "fused"
    if group.get("foreach") or (group.get("foreach") is None and all_cuda and not group.get("differentiable")):
        return "foreach"
    return "single"


@dataclass(frozen=True)
class OptimizerForecast:
    """What the optimizers will hold on the device once stepped (bytes), and what was not known.

    Attributes:
        grads: gradients of the trainable parameters on the device (each in its parameter's dtype).
        state: optimizer state on the device.
        step_temp: temporaries of the step.
        unknown: names of optimizers whose state this does not predict (their current state counts instead).
    """

    grads: int
    state: int
    step_temp: int
    unknown: tuple[str, ...] = ()


def _nbytes(p: torch.Tensor) -> int:
    return block_bytes(p.numel() * p.element_size())


def forecast(optimizers: Iterable[Any], device_type: str) -> OptimizerForecast:
    """Gradients, state and step temporaries of ``optimizers`` on ``device_type`` once they have stepped."""
    grads = state = temp = 0
    unknown: list[str] = []
    seen: set[int] = set()
    for opt in optimizers:
        name = type(opt).__name__
        is_torch = type(opt).__module__.startswith("torch.optim")
        for group in getattr(opt, "param_groups", ()):
            params = [p for p in group["params"] if p.requires_grad and p.device.type == device_type]
            new = [p for p in params if id(p) not in seen]
            seen.update(id(p) for p in new)
            grads += sum(_nbytes(p) for p in new)
            n = state_buffers(name, group) if is_torch else None
            if n is None:
                if name not in unknown:
                    unknown.append(name)
                continue
            state += n * sum(_nbytes(p) for p in params)
            if n and (group.get("fused") or group.get("capturable") or device_type == "cpu"):
                state += len(params) * block_bytes(4)  # the step counters: on the host unless fused or capturable
            by_dtype: dict[torch.dtype, int] = {}
            for p in params:
                by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + _nbytes(p)
            impl = implementation(group, all_cuda=device_type == "cuda")
            if n:
                temp = max(temp, step_temporaries(impl, list(by_dtype.values()),
                                                  max((_nbytes(p) for p in params), default=0)))
    return OptimizerForecast(grads, state, temp, tuple(unknown))
