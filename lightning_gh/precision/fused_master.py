"""One pass per weight for the fp32-master AdamW update: bf16 gradient in, fp32 master and moments updated, bf16
weight out.

The plain master-weight step (``master``) moves every parameter's bytes three times: the bf16 gradient is cast into a
new fp32 tensor (read 2 B, write 4 B), the optimizer updates the fp32 master and its moments (read 16 B, write 12 B),
and the master is cast back into the module (read 4 B, write 2 B). When the user's optimizer is ``torch.optim.Adam``
or ``AdamW``, :class:`FusedMasterAdam` does the same arithmetic in one pass that reads the bf16 gradient, the master
and both moments and writes the master, the moments and the bf16 weight (about 28 B instead of 40 B per parameter,
and no fp32 gradient buffers at all).

The update is the user's optimizer's own: its ``param_groups`` (``lr`` as an LR scheduler leaves it, ``betas``,
``eps``, ``weight_decay``, ``maximize``, Adam's L2 or AdamW's decoupled decay) are read at every step, and its state
lives where the optimizer keeps it (``optimizer.state[master]``: ``step``, ``exp_avg``, ``exp_avg_sq``), so
``optimizer.state_dict()`` has the standard layout and loads into ``torch.optim.AdamW``. What it does not cover
(another optimizer, ``amsgrad``, ``differentiable``, tensor hyper-parameters) is named by
:func:`fused_adam_unsupported` and left to the plain path.

Two implementations of the same arithmetic:

* ``compile=True`` (the default on CUDA): a ``torch.compile``d function over the group's tensors. Inductor fuses each
  weight's update into one kernel; the learning rate is a 0-d tensor on the device and the bias corrections are
  computed on the device from the ``step`` tensors, so neither a new ``lr`` nor a new step recompiles, and nothing
  waits for the GPU. The step tensors are therefore kept on the parameter's device (as torch's fused and capturable
  AdamW keep them; ``torch.optim.AdamW`` loads them either way).
* ``compile=False`` (the default on the CPU, and the fallback when compiling fails): a loop doing, per weight, the
  same operations as torch's single-tensor AdamW with the gradient cast one tensor at a time, so it equals the plain
  path bitwise against ``torch.optim.AdamW(foreach=False)``. The compiled kernel may contract multiply-adds (FMA) and
  reorders a few scalar operations, so it agrees with that to a few fp32 ulps per step, not bitwise.

Example::

    masters = MasterWeights(optimizer)            # fp32 copies swapped into the optimizer's param_groups
    fused = FusedMasterAdam(masters)
    loss.backward(); fused.step()                 # bf16 grads -> masters, moments, bf16 weights; grads freed
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Protocol

import torch
from torch import Tensor

__all__ = ["FusedMasterAdam", "MasterPairs", "fused_adam_unsupported"]


class MasterPairs(Protocol):
    """What :class:`FusedMasterAdam` reads of :class:`~lightning_gh.precision.master.MasterWeights`."""

    optimizer: torch.optim.Optimizer
    """The user's optimizer, whose ``param_groups`` hold the fp32 masters."""
    pairs: list[tuple[Tensor, Tensor]]
    """``(module weight, fp32 master)`` for every low-precision weight, in ``param_groups`` order."""

_HYPER = ("lr", "betas", "eps", "weight_decay")


def fused_adam_unsupported(optimizer: Any) -> str | None:
    """Why :class:`FusedMasterAdam` cannot stand in for ``optimizer``'s step, or ``None`` when it can.

    Args:
        optimizer: the user's torch optimizer (not Lightning's wrapper).

    Example::

        fused_adam_unsupported(torch.optim.SGD(params, lr=0.1))  # 'SGD is not torch.optim.Adam or AdamW'
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not torch.optim.Adam or AdamW"
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "differentiable"):
            if group.get(flag):
                return f"param group {i} has {flag}=True"
        for key in _HYPER:
            value = group.get(key)
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, Tensor) for v in values):
                return f"param group {i} has a tensor {key!r}"
    return None


def _decay_and_moments(g: Tensor, m: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, lr: float | Tensor, beta1: float,
                       beta2: float, weight_decay: float, decoupled: bool, maximize: bool) -> None:
    """Weight decay and the moment updates of one weight, as torch's single-tensor Adam does them."""
    grad = g.float()  # under torch.compile fused into the kernel: no fp32 gradient is written
    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled:
            m.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(m, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def _adam_pass(weights: list[Tensor], grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], steps: list[Tensor], lr: Tensor, beta1: float, beta2: float, eps: float,
               weight_decay: float, decoupled: bool, maximize: bool) -> None:
    """The traced update (under ``torch.compile``): every scalar that changes between steps is a device tensor."""
    for w, g, m, exp_avg, exp_avg_sq, step in zip(weights, grads, masters, exp_avgs, exp_avg_sqs, steps):
        step.add_(1)
        _decay_and_moments(g, m, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, decoupled, maximize)
        step_size = lr / (1 - beta1 ** step)
        denom = exp_avg_sq.sqrt() / (1 - beta2 ** step).sqrt() + eps
        m.sub_(step_size * (exp_avg / denom))
        w.copy_(m)


def _adam_loop(weights: list[Tensor], grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], steps: list[Tensor], lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, decoupled: bool, maximize: bool) -> None:
    """The eager update: torch's single-tensor Adam/AdamW operation for operation, one fp32 gradient at a time."""
    for w, g, m, exp_avg, exp_avg_sq, step_t in zip(weights, grads, masters, exp_avgs, exp_avg_sqs, steps):
        step_t += 1
        _decay_and_moments(g, m, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, decoupled, maximize)
        step = step_t.item()
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
        m.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        w.copy_(m)


class FusedMasterAdam:
    """The Adam / AdamW step of an optimizer holding fp32 masters, fused with the gradient and weight casts.

    Args:
        masters: the :class:`~lightning_gh.precision.master.MasterWeights` (any :class:`MasterPairs`) of a
            ``torch.optim.Adam`` / ``AdamW``.
        compile: ``True`` to run the update through ``torch.compile`` (one kernel per weight), ``False`` for the
            eager loop, a dict of ``torch.compile`` arguments, or ``None`` (default): compiled on CUDA, eager on
            the CPU.

    Raises:
        ValueError: the optimizer is one the fused step cannot stand in for (see :func:`fused_adam_unsupported`),
            or ``compile`` is not a bool, a dict or ``None``.

    Example::

        fused = FusedMasterAdam(MasterWeights(torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)))
        loss.backward(); fused.step(); fused.optimizer.step()   # the second call steps only non-master params
    """

    def __init__(self, masters: MasterPairs, compile: bool | Mapping[str, Any] | None = None) -> None:
        reason = fused_adam_unsupported(masters.optimizer)
        if reason is not None:
            raise ValueError(f"FusedMasterAdam(optimizer={type(masters.optimizer).__name__}): {reason}.")
        if compile is not None and not isinstance(compile, (bool, Mapping)):
            raise ValueError(f"FusedMasterAdam(compile={compile!r}): expected True, False, None or a dict of "
                             "torch.compile arguments.")
        self.masters = masters
        self.optimizer = masters.optimizer
        self.compile = compile
        self._weight_of = {id(m): p for p, m in masters.pairs}
        self._compiled: Any = None
        self._lr: dict[int, tuple[float, Tensor]] = {}  # group index -> (value, the 0-d device tensor holding it)

    def _use_compiled(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else self.compile is not False

    def _state(self, master: Tensor, group: Mapping[str, Any], device_step: bool) -> dict[str, Any]:
        """The optimizer's own state for ``master``, created as torch's Adam creates it on first use."""
        state = self.optimizer.state[master]
        if len(state) == 0:
            on_device = device_step or group.get("capturable") or group.get("fused")
            state["step"] = (torch.zeros((), dtype=torch.float32, device=master.device) if on_device else
                             torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        elif device_step and state["step"].device != master.device:
            state["step"] = state["step"].to(device=master.device, dtype=torch.float32)  # e.g. a resumed CPU step
        return state

    def _lr_tensor(self, index: int, lr: float, device: torch.device) -> Tensor:
        held = self._lr.get(index)
        if held is None or held[1].device != device:
            held = (lr, torch.full((), lr, dtype=torch.float32, device=device))
        elif held[0] != lr:
            held[1].fill_(lr)  # a kernel argument, not a host-to-device copy: the host does not wait
            held = (lr, held[1])
        self._lr[index] = held
        return held[1]

    @torch.no_grad()
    def step(self) -> int:
        """Update every master whose module weight has a gradient; free those gradients. Returns how many."""
        done = 0
        for index, group in enumerate(self.optimizer.param_groups):
            pairs = [(self._weight_of[id(m)], m) for m in group["params"] if id(m) in self._weight_of]
            pairs = [(p, m) for p, m in pairs if p.grad is not None]
            if not pairs:
                continue
            compiled = self._use_compiled(pairs[0][1].device)
            states = [self._state(m, group, compiled) for _, m in pairs]
            beta1, beta2 = group["betas"]
            args = ([p for p, _ in pairs], [p.grad for p, _ in pairs], [m for _, m in pairs],
                    [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [s["step"] for s in states])
            kwargs = dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]),
                          decoupled=bool(group.get("decoupled_weight_decay", isinstance(self.optimizer,
                                                                                       torch.optim.AdamW))),
                          maximize=bool(group.get("maximize", False)))
            if compiled and self._run_compiled(args, index, float(group["lr"]), kwargs):
                pass
            else:
                _adam_loop(*args, lr=float(group["lr"]), **kwargs)
            for p, _ in pairs:
                p.grad = None
            done += len(pairs)
        return done

    def _run_compiled(self, args: tuple, index: int, lr: float, kwargs: dict[str, Any]) -> bool:
        """Run the compiled pass; ``False`` (after one warning) when it cannot be compiled here."""
        if self._compiled is False:
            return False
        if self._compiled is None:
            options = dict(self.compile) if isinstance(self.compile, Mapping) else {}
            options.setdefault("fullgraph", True)
            options.setdefault("dynamic", False)
            self._compiled = torch.compile(_adam_pass, **options)
        lr_t = self._lr_tensor(index, lr, args[2][0].device)
        try:
            self._compiled(*args, lr_t, **kwargs)
        except Exception as e:  # no compiler here, or a torch that cannot trace it: the eager loop is the same step
            steps = args[5]
            if any(s.device != m.device for s, m in zip(steps, args[2])):
                raise
            warnings.warn(f"FusedMasterAdam: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); the fused "
                          "master update runs eagerly instead (same arithmetic, one weight at a time).", UserWarning,
                          stacklevel=3)
            self._compiled = False
            return False
        return True
