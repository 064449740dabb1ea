"""Making an optimizer safe to capture in a CUDA graph, and keeping the captured optimizer live.

A graph bakes in every Python scalar it saw at capture and every tensor address it touched. So the
optimizer must (1) keep its state, including Adam's step counter, in device tensors that it updates
in place (``capturable=True``), (2) read its learning rate from a device tensor, so an LR scheduler that
writes ``param_group["lr"]`` after capture still changes what the graph does, and (3) keep those very
tensors for the rest of the run. :func:`make_capturable` does (1) and (2) and can undo them;
:class:`OptimizerGuard` does (3): before each replay it repairs a learning rate that someone assigned
as a float, copies a state that ``load_state_dict`` swapped in back into the captured tensors (restore
in place), and says when a hyperparameter the graph baked in (betas, weight decay, eps) has changed.

Example::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    undo = make_capturable(opt)        # capturable=True, lr is a 0-dim device tensor
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ...                                # warm up, capture, replay; sched.step() fills the lr tensor
    undo.restore()                     # back to float lr and the original flags
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["SUPPORTED_OPTIMIZERS", "CapturableOptimizer", "GuardResult", "OptimizerGuard", "assign_scalar",
           "live_tensors", "make_capturable", "move_lr_into_tensors", "reassigned_lr_groups",
           "unsupported_optimizer_reason"]

# Adam and AdamW take capturable=True and a tensor lr in their fused, foreach and single-tensor paths.
SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)

# Group keys the graph does not bake in: the parameters themselves, the lr (a tensor, handled apart) and
# the scheduler's bookkeeping copy of the first lr.
_UNBAKED_KEYS = frozenset({"params", "lr", "initial_lr", "param_names"})


def unsupported_optimizer_reason(optimizer: Any) -> str | None:
    """Why ``optimizer`` cannot be captured, or ``None`` when it can.

    Args:
        optimizer: the optimizer Lightning built from ``configure_optimizers`` (a LightningOptimizer is unwrapped).
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(optimizer, SUPPORTED_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in SUPPORTED_OPTIMIZERS)
        return (f"optimizer {type(optimizer).__name__} is not supported: a captured step needs an optimizer whose "
                f"state and learning rate live in device tensors updated in place ({names} with capturable=True); "
                f"{type(optimizer).__name__} would bake the learning rate or a host-side step counter into the graph")
    if any(g.get("differentiable", False) for g in optimizer.param_groups):
        return f"optimizer {type(optimizer).__name__} has differentiable=True, which cannot be captured"
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"optimizer parameters are on {sorted(map(str, devices))}; a captured step needs them on one CUDA device"
    return None


@dataclass
class CapturableOptimizer:
    """What :func:`make_capturable` changed, so that it can be undone (:meth:`restore`) and so that a checkpoint
    can be written as the plain run would have written it (:meth:`plain_state_dict`).

    Attributes:
        optimizer: the optimizer, changed in place.
        lr_tensors: one 0-dim float32 device tensor per param group, the group's ``"lr"``.
        original_capturable: each group's ``capturable`` flag before the change.
    """

    optimizer: torch.optim.Optimizer
    lr_tensors: list[Tensor]
    original_capturable: list[bool]

    def restore(self) -> None:
        """Back to Python-float learning rates and the original ``capturable`` flags (one host sync)."""
        for group, _lr_t, cap in zip(self.optimizer.param_groups, self.lr_tensors, self.original_capturable):
            lr = group["lr"]
            group["lr"] = float(lr) if isinstance(lr, Tensor) else lr
            group["capturable"] = cap
            if not cap and not group.get("fused"):
                # Plain Adam keeps the step counter on the host; a device counter would cost a sync per parameter.
                for p in group["params"]:
                    st = self.optimizer.state.get(p, {})
                    if isinstance(st.get("step"), Tensor) and st["step"].device.type != "cpu":
                        st["step"] = st["step"].to("cpu", torch.float32)

    def plain_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Rewrite an ``optimizer.state_dict()`` (in place, and return it) as the unconverted optimizer would have
        written it: float learning rates, the original ``capturable`` flags, host step counters where plain Adam
        keeps them. Checkpoints then load into runs with or without CUDAGraphCapture."""
        # The group dicts are fresh copies made by state_dict(), so editing them leaves the optimizer alone.
        for group, cap in zip(state.get("param_groups", []), self.original_capturable):
            if isinstance(group.get("lr"), Tensor):
                group["lr"] = float(group["lr"])
            group["capturable"] = cap
            if not cap and not group.get("fused"):
                per_param = state.get("state", {})
                for pid in group.get("params", []):
                    st = per_param.get(pid)
                    if st is not None and isinstance(st.get("step"), Tensor):
                        # state_dict() shares the live per-parameter dicts: replace the dict, never edit it.
                        per_param[pid] = {**st, "step": st["step"].to("cpu", torch.float32, copy=True)}
        return state


def make_capturable(optimizer: torch.optim.Optimizer) -> CapturableOptimizer:
    """Switch an Adam/AdamW to ``capturable=True`` with a device-tensor learning rate, in place.

    Call it once the optimizer exists and any checkpoint has been loaded into it, before its first captured step.
    State that already exists (a resumed run) has its step counters moved to the device.

    Args:
        optimizer: a :data:`SUPPORTED_OPTIMIZERS` instance whose parameters are on one CUDA device.

    Returns:
        The record of the change (:class:`CapturableOptimizer`).

    Raises:
        ValueError: the optimizer is not supported (the message says why).
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    reason = unsupported_optimizer_reason(optimizer)
    if reason is not None:
        raise ValueError(f"make_capturable(optimizer): {reason}.")
    lr_tensors, original = [], []
    for group in optimizer.param_groups:
        device = group["params"][0].device
        original.append(bool(group.get("capturable", False)))
        group["capturable"] = True
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr_t = lr.detach().to(device=device, dtype=torch.float32).reshape(())
        else:
            lr_t = torch.tensor(float(lr), dtype=torch.float32, device=device)
        group["lr"] = lr_t
        lr_tensors.append(lr_t)
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st and isinstance(st.get("step"), Tensor):
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
            elif st and "step" in st:
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device)
    return CapturableOptimizer(optimizer, lr_tensors, original)


@dataclass(frozen=True)
class GuardResult:
    """What :meth:`OptimizerGuard.check` found.

    Attributes:
        action: ``"replay"`` (all good, possibly after repairs), ``"recapture"`` (a baked-in hyperparameter
            changed) or ``"eager"`` (the state can no longer be restored into the captured tensors).
        reason: why, for ``"recapture"`` and ``"eager"``.
        repaired: what was put back in place (e.g. a float lr filled into the lr tensor).
    """

    action: str
    reason: str = ""
    repaired: tuple[str, ...] = ()


@dataclass
class OptimizerGuard:
    """Remembers the tensors and hyperparameters a graph captured, and keeps the optimizer pointing at them.

    Build it right after capture. :meth:`check` costs a few identity and dict comparisons when nothing changed.

    Args:
        optimizer: the captured optimizer.
        lr_tensors: the per-group lr tensors the graph reads (from :func:`make_capturable`).
    """

    optimizer: torch.optim.Optimizer
    lr_tensors: list[Tensor]
    _state: Any = field(init=False)
    _groups: list[dict[str, Any]] = field(init=False)
    _tensors: dict[Tensor, dict[str, Any]] = field(init=False)
    _baked: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        opt = self.optimizer
        self._state = opt.state
        self._groups = opt.param_groups
        self._tensors = {p: dict(st) for p, st in opt.state.items()}
        self._baked = [{k: v for k, v in g.items() if k not in _UNBAKED_KEYS} for g in opt.param_groups]

    def check(self) -> GuardResult:
        """Repair what can be repaired in place; say whether the graph may be replayed."""
        opt = self.optimizer
        repaired: list[str] = []
        if opt.state is not self._state or opt.param_groups is not self._groups:
            failure = self._restore_in_place(repaired)
            if failure:
                return GuardResult("eager", failure, tuple(repaired))
        # A scheduler or user code may have assigned a new value: move it into the tensor the graph reads.
        repaired += [f"lr of param group {i}" for i in move_lr_into_tensors(self._groups, self.lr_tensors)]
        for i, (group, baked) in enumerate(zip(self._groups, self._baked)):
            for k, v in baked.items():
                if k not in group or not _same(group[k], v):
                    return GuardResult("recapture", f"param group {i}'s {k!r} changed from {v!r} to "
                                                    f"{group.get(k)!r} after capture", tuple(repaired))
        return GuardResult("replay", "", tuple(repaired))

    def _restore_in_place(self, repaired: list[str]) -> str:
        """``load_state_dict`` replaced the state and the groups: copy the new values into the captured tensors
        and put the captured objects back. Returns a reason when that is impossible."""
        opt = self.optimizer
        new_state, new_groups = opt.state, opt.param_groups
        if len(new_groups) != len(self._groups):
            return f"the optimizer now has {len(new_groups)} param groups; {len(self._groups)} were captured"
        for p, captured in self._tensors.items():
            fresh = new_state.get(p)
            if fresh is None or set(fresh) != set(captured):
                return ("the optimizer state was replaced by one with different entries "
                        f"({sorted(fresh or {})} instead of {sorted(captured)})")
            for k, t in captured.items():
                v = fresh[k]
                if isinstance(t, Tensor):
                    if isinstance(v, Tensor):
                        if v.shape != t.shape:
                            return f"state {k!r} changed shape from {tuple(t.shape)} to {tuple(v.shape)}"
                        if v is not t:
                            t.copy_(v)
                    else:
                        t.fill_(float(v))
                elif not _same(t, v):
                    return f"state {k!r} is a Python value that changed from {t!r} to {v!r}"
        for old, new in zip(self._groups, new_groups):
            for k, v in new.items():
                if k != "params" and k != "lr":
                    old[k] = v
            old["lr"] = new["lr"]  # a value, a float or a tensor: the lr repair below moves it into place
        opt.state = self._state
        opt.param_groups = self._groups
        for p, st in self._state.items():
            st.update(self._tensors.get(p, {}))
        repaired.append("optimizer state (restored in place into the captured tensors)")
        return ""


def reassigned_lr_groups(groups: Sequence[dict[str, Any]], lr_tensors: Sequence[Tensor]) -> list[int]:
    """Indices of the param groups whose ``"lr"`` is no longer their lr tensor (a value was assigned to it).

    Args:
        groups: the optimizer's param groups.
        lr_tensors: the per-group lr tensors (from :func:`make_capturable`), in the same order.
    """
    return [i for i, (group, lr_t) in enumerate(zip(groups, lr_tensors)) if group["lr"] is not lr_t]


def move_lr_into_tensors(groups: Sequence[dict[str, Any]], lr_tensors: Sequence[Tensor]) -> list[int]:
    """Write every assigned learning rate (a float, or another tensor) into its group's lr tensor in place, and
    put the tensor back into the group. Returns the indices of the groups repaired.

    Args:
        groups: the optimizer's param groups.
        lr_tensors: the per-group lr tensors the step reads, in the same order.
    """
    moved = reassigned_lr_groups(groups, lr_tensors)
    for i in moved:
        assign_scalar(lr_tensors[i], groups[i]["lr"])
        groups[i]["lr"] = lr_tensors[i]
    return moved


def live_tensors(optimizer: torch.optim.Optimizer, lr_tensors: Sequence[Tensor]) -> list[Tensor]:
    """The optimizer's tensors that keep changing in place across replays: the lr tensors (filled by schedulers and
    :meth:`OptimizerGuard.check` before each replay) and every state tensor (updated by the captured step).

    Args:
        optimizer: the captured optimizer.
        lr_tensors: the per-group lr tensors (from :func:`make_capturable`).
    """
    state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, Tensor)]
    return [*lr_tensors, *state]


def assign_scalar(dst: Tensor, value: Any) -> None:
    """Write a float or a one-element tensor into the 0-dim tensor ``dst`` in place (no new tensor)."""
    if isinstance(value, Tensor):
        dst.copy_(value.detach().reshape(()))
    else:
        dst.fill_(float(value))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return a is b
