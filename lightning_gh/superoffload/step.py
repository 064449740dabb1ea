"""The per-step records the training thread and the CPU worker share: :class:`StepCtx` (one optimizer step),
:class:`Decision` (its clip/skip outcome, once the global gradient norm is known) and :class:`GradNorms` (the
per-parameter gradient norms the decision is made from).

A step opens when its first armed gradient arrives and closes in ``step()``, which posts the global norm and the
clip coefficient (a two-element tensor, copied to the host on CUDA behind an event). The worker turns that into a
:class:`Decision` when it needs it (:meth:`StepCtx.poll`), without the training thread ever waiting for the worker.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_gh.superoffload.layout import Bucket, Slot

__all__ = ["Decision", "GradNorms", "StepCtx"]


@dataclass(frozen=True)
class Decision:
    """What ``step()`` decided for one step, once the global gradient norm is known.

    Attributes:
        skip: the step is skipped (a non-finite norm with ``skip_nonfinite``): no state changes.
        coef: the clip multiplier (fp32, 0-dim, CPU), or ``None`` when no clipping applies.
        hp: each param group's hyper-parameters as ``step()`` read them.
        redo: speculative results are invalid (clipped, skipped or hyper-parameters changed since backward began).
    """

    skip: bool
    coef: torch.Tensor | None
    hp: list[dict[str, float]]
    redo: bool


class StepCtx:
    """What the worker knows about one optimizer step.

    Args:
        step_id: the optimizer's running step number.
        hp: each param group's hyper-parameters when the step's backward began (speculative updates use them).
        needs_validation: the step may be clipped or skipped, so its decision waits for the global norm.
    """

    def __init__(self, step_id: int, hp: list[dict[str, float]], needs_validation: bool) -> None:
        self.id = step_id
        self.hp = hp
        self.needs_validation = needs_validation
        self.decision: Decision | None = None if needs_validation else Decision(False, None, hp, False)
        self.posted = threading.Event()
        self.spec: list[Bucket] = []  # buckets updated speculatively, in the order the worker updated them
        self.arrival: list[int] = []  # slot indices in the order their gradients arrived
        # written by post() before `posted` is set
        self.result_host: torch.Tensor | None = None  # [total_norm, clip_coef]
        self.result_event: Any = None
        self.hp_now: list[dict[str, float]] = hp
        self.max_norm: float | None = None
        self.skip_nonfinite = True

    def post(self, hp_now: list[dict[str, float]], max_norm: float | None, skip_nonfinite: bool,
             result: torch.Tensor | None, cuda: bool, device: torch.device | None = None) -> None:
        """Hand the step's outcome to the worker: ``result`` is ``[total_norm, clip_coef]`` on the device (copied to
        page-locked host memory behind an event on CUDA), or ``None`` without validation."""
        self.hp_now, self.max_norm, self.skip_nonfinite = hp_now, max_norm, skip_nonfinite
        if result is not None and cuda:
            self.result_host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            self.result_host.copy_(result, non_blocking=True)
            self.result_event = torch.cuda.Event()
            self.result_event.record(torch.cuda.current_stream(device))
        elif result is not None:
            self.result_host = result
        self.posted.set()

    def drop(self) -> None:
        """Abandon an unfinished step (the optimizer closes): every update of it is skipped."""
        self.decision = Decision(True, None, self.hp, True)
        self.posted.set()

    def poll(self, block: bool) -> Decision | None:
        """The step's decision, or ``None`` while it is not known yet and ``block`` is false."""
        if self.decision is not None:
            return self.decision
        if not self.posted.is_set():
            if not block:
                return None
            self.posted.wait()
        if self.decision is not None:  # dropped while waiting
            return self.decision
        if self.result_event is not None:
            if not block and not self.result_event.query():
                return None
            self.result_event.synchronize()
        total, coef = (float(v) for v in self.result_host.tolist())
        skip = self.skip_nonfinite and not math.isfinite(total)
        coef_t = None
        if not skip and self.max_norm is not None and coef != 1.0:
            coef_t = torch.tensor(coef, dtype=torch.float32)
        redo = skip or coef_t is not None or self.hp_now != self.hp
        self.decision = Decision(skip, coef_t, self.hp_now, redo)
        return self.decision


class GradNorms:
    """One fp32 vector with every parameter's gradient L2 norm of the open step, on the optimizer's device.

    Args:
        device: where the norms (and the global norm computed from them) live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.vector: torch.Tensor | None = None
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def open(self, count: int, zero: bool) -> None:
        """Make room for ``count`` norms; ``zero``: clear them (several ranks write only the norms they own)."""
        if self.vector is None or self.vector.numel() != count:
            self.vector = torch.zeros(count, dtype=torch.float32, device=self.device)
        elif zero:
            self.vector.zero_()

    def index(self, slots: list[Slot]) -> torch.Tensor:
        """The slots' indices on the norms' device, cached: building one from a list in a gradient hook would copy
        from pageable memory, which waits for the copy stream (and so for a gradient reduce) on CUDA."""
        key = tuple(s.index for s in slots)
        t = self._index.get(key)
        if t is None:
            t = self._index[key] = torch.tensor(key, device=self.device)
        return t

    def write(self, slots: list[Slot], views: list[torch.Tensor]) -> None:
        """Store the L2 norms of ``views`` (fp32) as the norms of ``slots``."""
        self.vector.index_copy_(0, self.index(slots), torch.stack(torch._foreach_norm(views, 2.0)))

    def take(self, slots: list[Slot], step_id: int) -> None:
        """Write the norms of ``slots``' gradients (still on ``param.grad``), once per slot and step."""
        slots = [s for s in slots if s.normed_step != step_id]
        if not slots:
            return
        by_kind: dict[bool, list[Slot]] = {}
        for s in slots:
            by_kind.setdefault(s.param.grad.dtype == torch.float32, []).append(s)
            s.normed_step = step_id
        for fp32, group in by_kind.items():
            grads = [s.param.grad for s in group]
            if fp32:  # the kernel clip_grad_norm_ uses, so each norm is bitwise equal to its own
                norms = torch._foreach_norm(grads, 2.0)
            else:  # fp32 accumulation of bf16/fp16 gradients (clip_grad_norm_ would return a bf16 norm)
                norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            self.vector.index_copy_(0, self.index(group), torch.stack(norms))

    def total(self, arrival: list[int]) -> torch.Tensor:
        """The global L2 norm over the parameters in ``arrival``, combined in parameter order as
        ``clip_grad_norm_`` combines them."""
        idx = sorted(arrival)
        norms = self.vector if len(idx) == self.vector.numel() else \
            self.vector[torch.tensor(idx, device=self.device)]
        return torch.linalg.vector_norm(norms, 2.0)
