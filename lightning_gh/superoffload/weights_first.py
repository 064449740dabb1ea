"""The ZeRO-3 path's CPU update of a host unit: in place (:func:`update_in_place`), or in two passes, the new
weights first, for the next forward (:func:`write_weights` into a :class:`StageRing`), and the master weights and
moments after it (:func:`two_pass` says which).

Note [Weights first, state after]
    A step that may be clipped or skipped is updated once its gradient norm is known, after backward; the next
    forward then waits for the CPU update of each host unit in turn (see Note [ZeRO-3 step and the forward's wait] in
    :mod:`.fsdp_optimizer`). That update is bound by the host's memory bandwidth, and of what it moves the forward
    needs only the new weights. So, with ``weights_first=True`` and the package's CPU AdamW kernel loaded:

    1. In forward order, as soon as the decision is known, each host unit's new weights are computed by the
       kernel's weights-only form (:meth:`~.cpu_adamw.AdamWKernel.weights`: the same arithmetic, reading the fp32
       master rows, both moments and the gradient rows, writing only the weights) straight into one of two
       page-locked staging buffers (:class:`StageRing`), in the parameters' dtype (bf16 rounded to nearest even, as
       torch casts; fp32 where the unit's gradient buffer is fp32), and copied from there into the parameters' local
       shards. The unit is then *ready*: its forward pre-hook stops waiting. Per bf16 parameter this pass moves
       16 B through the host's memory instead of the 32 B of the in-place update and the cast behind it.
    2. Then, in the reverse order (the order the next backward takes the units), each unit's in-place update of
       its master rows and moments, the one the single pass makes, which writes the same weights bitwise. The
       unit is then *done*.

    The forward waits for *ready* only (on CUDA set once the copy's pieces are queued: see Note [Paced weight copies]
    in :mod:`.paced_copy`). Everything that reads or overwrites a unit's host state or gradient rows waits for
    *ready* and *done*, and for the copy's event: the next backward's copy of the unit's gradients into its host
    buffer, the next ``step()``, ``state_dict()``, a move of the unit to or from the device, ``close()``. The rows in a full tensor's tail
    (see Note [A shard's rows, updated as the full tensor's] in :mod:`.fsdp_units`) take torch's update in both
    passes. A staging buffer is written again only after its last copy to the device has finished (its event).
    Without the kernel (no compiler, or a kernel that differs from torch's on this machine) every unit takes the
    single pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from lightning_gh._host import HostBuffer
from lightning_gh.superoffload import cpu_adamw
from lightning_gh.superoffload.fsdp_units import positioned_update

if TYPE_CHECKING:
    from lightning_gh.superoffload.cpu_adamw import AdamWKernel
    from lightning_gh.superoffload.fsdp_units import HostUnit

__all__ = ["STAGE_SLOTS", "WRITEBACK_RANGE", "FirstPass", "StageRing", "stage_bytes", "two_pass", "update_in_place",
           "write_weights"]

#: The profiler range around the second pass of a unit (named so that it counts as CPU update work).
WRITEBACK_RANGE = "superoffload/cpu_update_writeback"

#: Staging buffers: one unit's weights are copied to the device while the next unit's are written.
STAGE_SLOTS = 2


def two_pass(option: bool, kernel: AdamWKernel | None) -> bool:
    """Whether host units are updated weights first (see Note [Weights first, state after]).

    Args:
        option: ``SuperOffloadOptions.weights_first``.
        kernel: the loaded CPU AdamW kernel, or ``None`` where it cannot be used (its weights-only form is checked
            with the rest of it, see :func:`~.cpu_adamw.load`).

    Example::

        >>> two_pass(True, None), two_pass(False, object()), two_pass(True, object())
        (False, False, True)
    """
    return bool(option) and kernel is not None


def stage_bytes(unit_bytes: list[int], slots: int = STAGE_SLOTS) -> int:
    """Host bytes of the staging buffers: ``slots`` buffers of the largest unit's weights (``unit_bytes``: each host
    unit's elements times its gradient buffer's element size).

    >>> stage_bytes([10, 40, 30]), stage_bytes([])
    (80, 0)
    """
    return slots * max(unit_bytes, default=0)


class StageRing:
    """:data:`STAGE_SLOTS` page-locked buffers the first pass writes weights into, each reused once its last copy to
    the device has finished.

    Args:
        nbytes: bytes per buffer (the largest unit's weights).
        pin: page-lock them (with CUDA, so the copies are asynchronous).
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.pin = pin
        self.buffers = [HostBuffer(nbytes, pin=pin, zero=False, dtype=torch.uint8) for _ in range(STAGE_SLOTS)]
        self.events: list[Any] = [None] * STAGE_SLOTS
        self.turn = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """The next buffer as ``numel`` elements of ``dtype``, once its last copy has read it; returns its slot.
        Every buffer is made anew, larger, once every copy from the ring has finished, when they are too small
        (a bucket made larger since, e.g. a parameter that came back from the GPU tail)."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.buffers[0].numel:
            for slot, event in enumerate(self.events):
                if event is not None:
                    event.synchronize()
                    self.events[slot] = None
            pin = self.pin
            self.release()
            self.buffers = [HostBuffer(nbytes, pin=pin, zero=False, dtype=torch.uint8) for _ in range(STAGE_SLOTS)]
        slot = self.turn
        self.turn = (self.turn + 1) % STAGE_SLOTS
        if self.events[slot] is not None:
            self.events[slot].synchronize()
            self.events[slot] = None
        return slot, self.buffers[slot].tensor[:nbytes].view(dtype)

    def copied(self, slot: int, event: Any) -> None:
        """``event`` completes once the device has read the buffer of ``slot`` (``None``: already read)."""
        self.events[slot] = event

    def release(self) -> None:
        for b in self.buffers:
            b.release()


class FirstPass:
    """The first pass of a unit: its weights written into the next staging buffer (made at first use) and handed
    to ``push``, which copies them into the parameters and returns what to wait on before the buffer is written
    again: anything with ``synchronize()`` (a CUDA event, a paced copy's job), or ``None`` (done).

    Args:
        kernel: the CPU AdamW kernel.
        nbytes: bytes per staging buffer (the largest host unit's weights; the ring grows if one is larger).
        threads: the kernel's threads.
    """

    def __init__(self, kernel: AdamWKernel, nbytes: int, threads: int) -> None:
        self.kernel = kernel
        self.nbytes = nbytes
        self.threads = threads
        self.ring: StageRing | None = None

    def run(self, u: HostUnit, hp: list[dict[str, float]], coef: torch.Tensor | None,
            push: Callable[[HostUnit, torch.Tensor], Any]) -> None:
        if self.ring is None:
            self.ring = StageRing(self.nbytes, pin=torch.cuda.is_available())
        slot, out = self.ring.take(u.numel, u.grad_dtype)
        write_weights(self.kernel, u, hp, coef, out, self.threads)
        self.ring.copied(slot, push(u, out))

    def release(self) -> None:
        if self.ring is not None:
            self.ring.release()


def _kernel_spans(u: HostUnit, hp: list[dict[str, float]],
                  coef: torch.Tensor | None) -> Iterator[tuple[int, int, tuple[torch.Tensor, bool]]]:
    """The unit's spans one kernel call updates (consecutive active shards of one group and step count) with the
    kernel's constants for them: the same for both passes, so they compute the same weights."""
    c = None if coef is None else float(coef)
    for run in cpu_adamw.kernel_runs(u.active):
        lo, hi = run[0].offset, run[-1].offset + run[-1].numel
        if hi > lo:
            h = hp[run[0].group]
            yield lo, hi, cpu_adamw.step_constants(float(run[0].step) + 1.0, h["lr"], h["beta1"], h["beta2"],
                                                   h["weight_decay"], h["eps"], c)


def write_weights(kernel: AdamWKernel, u: HostUnit, hp: list[dict[str, float]], coef: torch.Tensor | None,
                  out: torch.Tensor, threads: int) -> None:
    """The first pass for unit ``u``: the new weights of its active rows written to ``out`` (the unit's rows, in
    ``out``'s dtype), bitwise those its in-place update will write, cast as torch casts; nothing of ``u`` changes.

    Args:
        kernel: the CPU AdamW kernel.
        u: a host unit whose gradient rows are in its host buffer.
        hp: each param group's hyper-parameters.
        coef: the clip coefficient (0-dim fp32 on the CPU) or ``None``.
        out: ``u.numel`` elements, fp32 or bf16.
        threads: the kernel's threads.
    """
    grad = u.grad.tensor
    span = (u.region(0), u.region(1), u.region(2))
    for lo, hi, consts in _kernel_spans(u, hp, coef):
        kernel.weights(tuple(t[lo:hi] for t in span), grad[lo:hi], out[lo:hi], consts, threads)
    for s in u.active:  # the rows in a full tensor's tail: torch's update, as in the in-place pass
        lo, hi = s.tail_rows()
        if hi > lo:
            a, b = s.offset + lo, s.offset + hi
            new = positioned_update(tuple(t[a:b] for t in span), grad[a:b], s, lo, hi, hp[s.group], coef)
            out[a:b].copy_(new[0])


def update_in_place(kernel: AdamWKernel | None, u: HostUnit, hp: list[dict[str, float]], coef: torch.Tensor | None,
                    threads: int) -> None:
    """Update unit ``u``'s active rows (master, moments) in place, bitwise as ``torch._fused_adamw_`` updates the
    full parameters, and advance their step counts. See Note [A shard's rows, updated as the full tensor's].

    Args:
        kernel: the CPU AdamW kernel, or ``None`` (torch's fused AdamW on each shard's rows).
        u, hp, coef, threads: as for :func:`write_weights`.
    """
    grad = u.grad.tensor
    span = (u.region(0), u.region(1), u.region(2))
    # the rows in the full tensors' tails, from the inputs (an in-place kernel call overwrites them)
    tails = [(s, lo, hi, positioned_update(tuple(t[s.offset + lo:s.offset + hi] for t in span),
                                           grad[s.offset + lo:s.offset + hi], s, lo, hi, hp[s.group], coef))
             for s in u.active for lo, hi in [s.tail_rows()] if hi > lo]
    if kernel is not None:
        for lo, hi, consts in _kernel_spans(u, hp, coef):
            rows = tuple(t[lo:hi] for t in span)
            kernel.step(rows, grad[lo:hi], rows, consts, threads)
    else:  # torch's fused AdamW on each shard's body, padded to whole units so that no row takes its tail path
        for s in u.active:
            lo, hi = 0, s.tail_rows()[0]  # the rows before the full tensor's tail
            if hi > lo:
                rows = tuple(t[s.offset + lo:s.offset + hi] for t in span)
                out = positioned_update(rows, grad[s.offset + lo:s.offset + hi], s, lo, hi, hp[s.group], coef,
                                        body=True)
                for d, o in zip(rows, out):
                    d.copy_(o)
    for s, lo, hi, out in tails:
        for t, o in zip(span, out):
            t[s.offset + lo:s.offset + hi].copy_(o)
    for s in u.active:
        s.step.add_(1)
