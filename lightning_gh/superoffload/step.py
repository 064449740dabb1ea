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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_gh._util import warn_once

if TYPE_CHECKING:
    from lightning_gh.superoffload.layout import Bucket, Slot

__all__ = ["SPECULATION_WINDOW", "Decision", "GradNorms", "StepCtx", "should_speculate"]

#: The decided steps :func:`should_speculate` looks back on.
SPECULATION_WINDOW = 4


def should_speculate(redone: Sequence[bool], window: int = SPECULATION_WINDOW) -> bool:
    """Whether the next step's buckets may be updated before its decision is known (see Note [Speculative update
    and exact rollback] in :mod:`.worker`), from the last decided steps.

    A speculative update pays when the step is neither clipped nor skipped: the CPU works while backward still runs.
    Otherwise it is thrown away and redone once the decision is known, and its rollback copy (``rollback="copy"``),
    its copy back and its share of the host's memory bandwidth were spent for nothing. So a step speculates while
    fewer than half of the last ``window`` steps had to redo it: a run clipped on (almost) every step stops after its
    first step and its CPU then waits for each step's decision (the update runs once, in forward order, with no
    rollback copy); a rarely clipped run goes on speculating through a clipped step; a run whose gradient norm
    falls under the threshold resumes within a window.

    Args:
        redone: for each decided step, oldest first, :attr:`Decision.redo` (clipped, skipped, or hyper-parameters
            changed after backward began), whether or not that step speculated.
        window: how many of the last steps count.

    Example::

        >>> should_speculate([]), should_speculate([True]), should_speculate([False, False, False, True])
        (True, False, True)
    """
    recent = list(redone)[-window:]
    return not recent or 2 * sum(recent) < len(recent)


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
        self.later: list[Bucket] = []  # buckets whose weights went first, their state to write at the step's end
        self.speculate: bool | None = None  # whether its buckets may speculate (the worker decides at its first)
        self.posted_t = 0.0  # when step() posted its outcome (perf_counter)
        self.arrival: list[int] = []  # slot indices in the order their gradients arrived
        # written by post() before `posted` is set
        self.result_host: torch.Tensor | None = None  # [total_norm, clip_coef]
        self.result_event: Any = None
        self.hp_now: list[dict[str, float]] = hp
        self.max_norm: float | None = None
        self.skip_nonfinite = True
        self.norm: float | None = None  # the global gradient norm, once the decision is read

    def decide(self, norms: GradNorms, hp_now: list[dict[str, float]], max_norm: float | None,
               skip_nonfinite: bool, cuda: bool, device: torch.device) -> tuple[torch.Tensor | None,
                                                                              torch.Tensor | None]:
        """Compute the global norm from ``norms`` (on the device), the clip coefficient and the non-finite flag, and
        post them (:meth:`post`); returns ``(coef, found_inf)`` for the GPU tail's update."""
        coef = found_inf = packed = None
        if self.needs_validation:
            total = norms.total(self.arrival)
            if max_norm is not None:
                # the same expression as torch.nn.utils.clip_grad_norm_, so the coefficient is bitwise equal
                coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            if skip_nonfinite:
                found_inf = (~torch.isfinite(total)).to(torch.float32)
            packed = torch.stack([total, coef if coef is not None else torch.ones_like(total)])
        elif hp_now != self.hp:
            warn_once("superoffload:hp-changed",
                      "HeterogeneousAdamW: hyper-parameters changed between backward and step(); without "
                      "validation (max_grad_norm=None, skip_nonfinite=False) the CPU update uses the values read "
                      "when backward started. Set the learning rate before backward.", stacklevel=4)
        self.post(hp_now, max_norm, skip_nonfinite, packed, cuda, device)
        return coef, found_inf

    def post(self, hp_now: list[dict[str, float]], max_norm: float | None, skip_nonfinite: bool,
             result: torch.Tensor | None, cuda: bool, device: torch.device | None = None) -> None:
        """Hand the step's outcome to the worker: ``result`` is ``[total_norm, clip_coef]`` on the device (copied to
        page-locked host memory behind an event on CUDA), or ``None`` without validation."""
        self.hp_now, self.max_norm, self.skip_nonfinite = hp_now, max_norm, skip_nonfinite
        self.posted_t = time.perf_counter()
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
        self.posted_t = time.perf_counter()
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
        self.norm = total
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
        self._index: dict[tuple[Any, ...], torch.Tensor] = {}

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
        if len(idx) == self.vector.numel():
            return torch.linalg.vector_norm(self.vector, 2.0)
        key = ("total", *idx)  # cached as index(): a fresh index tensor would wait for the device to catch up
        if key not in self._index:
            self._index[key] = torch.tensor(idx, device=self.device)
        return torch.linalg.vector_norm(self.vector[self._index[key]], 2.0)
