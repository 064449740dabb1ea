"""SuperOffload's share of the predicted peak: the gradients it keeps on the GPU, and the GPU tail its policy settles
on.

With ``gpu_fraction="auto"`` everything but the host plan's minimum tail starts on the host, and over the first
steps the tail grows (see Note [Tail growth trial] in :mod:`lightning_gh.superoffload.tail`) until the step's peak
reaches the GPU's limit less the policy's margin, or the whole state is on the GPU. A prediction read at the first
batch sees the tail as it is then; :func:`settle_tail` (pure, tested as a table) forecasts the one it settles on.
:func:`tail_target` is that limit less the margin, from the constants the mover's budget uses
(:meth:`~lightning_gh.superoffload.tail_mover.TailMover.budget`). :func:`read_tail` reads the sizes from a
:class:`~lightning_gh.superoffload.HeterogeneousAdamW`.

Example::

    >>> from lightning_gh.memory.tail import settle_tail
    >>> settle_tail("auto", peak=30, on_gpu=0, state=100, target=60).peak  # the tail fills up to the target
    60
    >>> settle_tail("auto", peak=30, on_gpu=0, state=20, target=60).case
    "the whole state (20 B) fits below the auto tail's target (60 B): all of it on the GPU"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_gh._util import fmt_bytes
from lightning_gh.memory.predict import block_bytes

__all__ = ["TailForecast", "TailReading", "read_tail", "settle_tail", "tail_target"]


@dataclass(frozen=True)
class TailForecast:
    """The step's peak with the GPU tail SuperOffload settles on (bytes).

    Attributes:
        peak: the predicted peak.
        added: GPU bytes the tail takes beyond what it holds at the first step.
        case: which case applied, in words (for the plan).
    """

    peak: int
    added: int
    case: str


def tail_target(free: int, reserved: int, limit: int) -> int:
    """The peak the auto tail grows a step to: what the caching allocator holds now plus what the device has free,
    less the margin the mover leaves (the larger of ``TAIL_HEADROOM_MIN_BYTES`` and ``TAIL_HEADROOM_SHARE`` of the
    limit, see :meth:`~lightning_gh.superoffload.tail_mover.TailMover.budget`).

    Args:
        free: free bytes on the device under the process's cap
            (:func:`~lightning_gh.superoffload.memory.device_memory_room`).
        reserved: bytes the caching allocator holds now.
        limit: the device's bytes, or the process's cap where lower.

    Example::

        >>> from lightning_gh.superoffload.tail_mover import TAIL_HEADROOM_SHARE
        >>> tail_target(free=60 * 2**30, reserved=20 * 2**30, limit=80 * 2**30) == int((1 - TAIL_HEADROOM_SHARE) * 80 * 2**30)
        True
    """
    from lightning_gh.superoffload.tail_mover import TAIL_HEADROOM_MIN_BYTES, TAIL_HEADROOM_SHARE

    return reserved + free - max(TAIL_HEADROOM_MIN_BYTES, int(TAIL_HEADROOM_SHARE * limit))


def settle_tail(gpu_fraction: float | str, *, peak: int, on_gpu: int, state: int, target: int | None,
                max_gpu_fraction: float | None = None, whole_only: bool = False) -> TailForecast:
    """The step's peak with the GPU tail SuperOffload settles on.

    Args:
        gpu_fraction: the option (``"auto"`` or a share of the parameters).
        peak: the step's predicted peak with the tail it holds at the first step.
        on_gpu: GPU bytes of that tail (counted in ``peak``): a fixed tail, or the host plan's minimum one.
        state: GPU bytes of the whole state in the tail: fp32 moments, an fp32 master of non-fp32 weights and the
            gradients it keeps until ``zero_grad`` (see :func:`~lightning_gh.superoffload.tail_mover.tail_bytes`).
        target: the peak the auto tail grows a step to (:func:`tail_target`), or ``None`` where the device's
            memory is not known (off CUDA the auto tail does not grow).
        max_gpu_fraction: see :class:`~lightning_gh.superoffload.SuperOffloadOptions`.
        whole_only: the tail is all or nothing (several ranks decide together whether the whole state fits).
    """
    if gpu_fraction != "auto":
        want = int(float(gpu_fraction) * state)
        added = max(0, want - on_gpu)
        return TailForecast(peak + added, added, f"gpu_fraction={gpu_fraction}: {fmt_bytes(want)} of the state on "
                                                 "the GPU")
    if on_gpu >= state:
        return TailForecast(peak, 0, f"the whole state ({fmt_bytes(state)}) is on the GPU from the start")
    held = f"the host plan's minimum tail ({fmt_bytes(on_gpu)})" if on_gpu else "no tail"
    if target is None:
        return TailForecast(peak, 0, f"gpu_fraction='auto' without a GPU memory reading: {held}, it does not grow")
    cap = state - on_gpu if max_gpu_fraction is None else max(0, min(state, int(max_gpu_fraction * state)) - on_gpu)
    room = target - peak
    if cap <= 0 or room <= 0:
        why = f"max_gpu_fraction={max_gpu_fraction}" if cap <= 0 else \
            f"the step already reaches the auto tail's target ({fmt_bytes(target)})"
        return TailForecast(peak, 0, f"{held} stays as it is: {why}")
    if cap <= room:
        what = f"the whole state ({fmt_bytes(state)})" if cap == state - on_gpu else \
            f"the state allowed by max_gpu_fraction={max_gpu_fraction} ({fmt_bytes(cap + on_gpu)})"
        return TailForecast(peak + cap, cap, f"{what} fits below the auto tail's target ({fmt_bytes(target)}): "
                                             "all of it on the GPU")
    if whole_only:
        return TailForecast(peak, 0, f"the whole state ({fmt_bytes(state)}) does not fit below the auto tail's target "
                                     f"({fmt_bytes(target)}) on every GPU: each rank keeps its share on the host")
    return TailForecast(target, room, f"the auto tail grows until the step's peak reaches its target "
                                      f"({fmt_bytes(target)}): {fmt_bytes(on_gpu + room)} of the state's "
                                      f"{fmt_bytes(state)} on the GPU")


@dataclass(frozen=True)
class TailReading:
    """What a :class:`~lightning_gh.superoffload.HeterogeneousAdamW` holds on the GPU at the first step, and would
    hold with the whole state there (bytes).

    Attributes:
        on_gpu: the tail now: its state (already allocated) and the gradients it will keep.
        tail_grads: the gradients of the tail's parameters, kept on the GPU until ``zero_grad``.
        host_grads: the gradients of the other parameters, which leave the GPU as they arrive.
        state: the whole state in the tail (every trainable parameter).
        in_flight: gradients on their way to the host at once: the largest host bucket's, with their cast copies
            (every gradient while the layout is not built yet: the first backward only records their order).
        step_temp: the tail update's fp32 copies of bf16 gradients (one chunk).
    """

    on_gpu: int
    tail_grads: int
    host_grads: int
    state: int
    in_flight: int
    step_temp: int


def read_tail(opt: Any) -> TailReading:
    """The sizes of ``opt``'s GPU tail and gradients (a :class:`~lightning_gh.superoffload.HeterogeneousAdamW`)."""
    from lightning_gh.superoffload.tail_mover import TAIL_UPDATE_CHUNK, tail_bytes

    lay = opt.layout
    slots = [s for s in lay.slots if s.param.requires_grad]
    device = [s for s in slots if s.residency == "device" and lay.built]
    grad = lambda s: block_bytes(s.numel * s.param.element_size())  # noqa: E731
    tail_grads = sum(grad(s) for s in device)
    if lay.built:
        in_flight = max((sum(grad(s) + (block_bytes(s.numel * s.grad.element_size())
                                        if s.grad is not None and s.grad.dtype != s.param.dtype else 0)
                             for s in b.slots) for b in lay.buckets), default=0)
    else:
        in_flight = sum(grad(s) for s in slots)
    cast = [s.numel for s in device if s.param.dtype != torch.float32]
    step_temp = 4 * min(sum(cast), TAIL_UPDATE_CHUNK + max(cast)) if cast else 0
    # a sharded tail (several ranks): the state of the owner's own share; of the others' only their gradients
    own = [s for s in device if s.step is not None]
    on_gpu = tail_bytes(own) + sum(grad(s) for s in device if s.step is None)
    return TailReading(on_gpu=on_gpu, tail_grads=tail_grads,
                       host_grads=sum(grad(s) for s in slots) - tail_grads, state=tail_bytes(slots),
                       in_flight=in_flight, step_temp=step_temp)
