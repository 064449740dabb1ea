"""What to change after an out-of-memory error: the request and the free memory read from the error, the owners of
the live memory, and the knob that would have made the step fit.

:func:`parse_cuda_oom` reads PyTorch's message; :func:`suggest` is a pure function from what was measured to the
knobs, tested as a table; :func:`report` writes both as text.

Example::

    >>> from lightning_gh.memory.oom import Shortfall, suggest
    >>> gib = 2**30
    >>> owners = {"weights": 14 * gib, "gradients": 0, "optimizer state": 0, "activations and temporaries": 60 * gib}
    >>> suggest(owners, Shortfall(requested=4 * gib, free=1 * gib), tokens_per_step=16384)[0].knob
    'ActivationOffload(budget="56GiB")'
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_gh._util import fmt_bytes

__all__ = ["Knob", "Shortfall", "parse_cuda_oom", "report", "step_shortfall", "suggest"]

_GIB = 2**30
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

#: Extra room a suggested knob leaves beyond the shortfall, for the allocator's rounding and fragmentation.
MARGIN = 0.10
#: Share of the device a knob sized from a predicted step leaves free (the allocator's cache and fragmentation).
CAPACITY_MARGIN = 0.05


@dataclass(frozen=True)
class Shortfall:
    """What the failed allocation asked for and what was free then (bytes)."""

    requested: int
    free: int
    allocated: int | None = None
    """What PyTorch had allocated at the failure (from its message; ``None`` where it does not say)."""
    cached: int | None = None
    """What PyTorch's allocator held reserved but unallocated at the failure (from its message)."""

    @property
    def missing(self) -> int:
        """Bytes that were missing for the allocation."""
        return max(0, self.requested - self.free)


@dataclass(frozen=True)
class Knob:
    """One change that would have made the step fit.

    Attributes:
        knob: the setting, as the user writes it.
        why: what it frees and why that is enough.
    """

    knob: str
    why: str


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def parse_cuda_oom(message: str) -> Shortfall | None:
    """The request and the free memory of PyTorch's CUDA out-of-memory message (and, where it says them, what was
    allocated and what the allocator held unallocated at the failure), or ``None`` without a request.

    Example::

        >>> s = parse_cuda_oom("Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.00 GiB "
        ...                    "is free. Of the allocated memory 63.96 GiB is allocated by PyTorch, and 512.00 MiB is "
        ...                    "reserved by PyTorch but unallocated.")
        >>> s.missing == 2**30, round(s.allocated / 2**30, 2), s.cached == 2**29
        (True, 63.96, True)
    """
    unit = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"
    req = re.search(r"Tried to allocate " + unit, message)
    free = re.search(r"of which " + unit + " is free", message)
    alloc = re.search(r"Of the allocated memory " + unit + " is allocated by PyTorch", message)
    cached = re.search(unit + " is reserved by PyTorch but unallocated", message)
    if req is None:
        return None
    return Shortfall(_bytes(*req.groups()), _bytes(*free.groups()) if free else 0,
                     _bytes(*alloc.groups()) if alloc else None, _bytes(*cached.groups()) if cached else None)


def step_shortfall(predicted: Mapping[str, int], peak: int | None, capacity: int | None
                   ) -> tuple[dict[str, int], Shortfall] | None:
    """The owners of a whole step's predicted peak and what that peak misses of the device, or ``None`` when there
    is no prediction or it fits.

    An out-of-memory error in the first forward sees only what was live then: the gradients and the optimizer
    state the step allocates later are not among the owners, so a knob sized from the failed allocation alone
    leaves the step short again further on. With the plan's prediction (:class:`lightning_gh.memory.plan.MemoryPlan`)
    the knob is sized for the whole step, leaving :data:`CAPACITY_MARGIN` of the device free.

    Args:
        predicted: the predicted peak's parts (``"before the step"``, ``"gradients"``, ``"optimizer state"``, ...;
            see :class:`lightning_gh.memory.forecast.Prediction`).
        peak: the predicted peak (bytes).
        capacity: what the process can allocate: free bytes plus what its allocator held at the plan.

    >>> gib = 2**30
    >>> owners, short = step_shortfall({"before the step": 15 * gib, "gradients": 0, "optimizer state": 0},
    ...                                peak=90 * gib, capacity=78 * gib)
    >>> owners["activations and temporaries"] // gib, round(short.missing / gib, 1)
    (75, 15.9)
    """
    if not predicted or peak is None or capacity is None:
        return None
    grown = predicted.get("GPU tail grown after the first steps", 0)  # it grows only into room that is there
    peak -= grown
    usable = int((1 - CAPACITY_MARGIN) * capacity)
    if peak <= usable:
        return None
    before = predicted.get("before the step", 0)
    grads, state = predicted.get("gradients", 0), predicted.get("optimizer state", 0)
    temp = predicted.get("optimizer step temporaries")
    owners = {"weights, buffers and the batch": before, "gradients": grads, "optimizer state": state}
    if temp is not None and before + grads + state + temp >= peak:
        # The peak is the optimizer step's: fewer activations would not lower it.
        owners["optimizer step temporaries"] = temp
        owners["activations and temporaries"] = 0
    else:
        owners["activations and temporaries"] = max(0, peak - before - grads - state)
    return owners, Shortfall(requested=peak, free=usable)


def _gib_ceil(nbytes: float) -> int:
    return max(1, math.ceil(nbytes / _GIB))


def suggest(owners: Mapping[str, int], shortfall: Shortfall | None, *, tokens_per_step: int | None = None,
            superoffload: bool = False, activation_budget: int | None = None, in_forward: bool = False,
            recomputing: bool = False, host_room: int | None = None) -> list[Knob]:
    """The knobs that free at least the missing bytes (plus :data:`MARGIN`), the most targeted first.

    Args:
        owners: live GPU bytes per owner (:func:`lightning_gh.memory.plan.attribute`).
        shortfall: what the failed allocation missed, or ``None`` when unknown (then a quarter of the largest
            owner is assumed missing).
        tokens_per_step: tokens per optimizer step, to suggest fewer.
        superoffload: whether the optimizer state is offloaded already.
        activation_budget: the ActivationOffload budget in force, if any.
        in_forward: the allocation failed in the forward and ``shortfall`` is that allocation's (not a whole
            step's prediction): the backward will also hold the failed tensor's gradient, so the knobs free its
            size as well.
        recomputing: every block already recomputes in the backward (HF gradient checkpointing): what is left of
            the blocks' activations is their inputs, which only offloading to the host can take.
        host_room: host bytes ActivationOffload may still take (``None``: unknown). With ``recomputing`` and less
            room than the missing bytes, no activation budget is suggested.

    Example::

        >>> gib = 2**30
        >>> live = {"weights": 14 * gib, "activations and temporaries": 39 * gib}
        >>> [k.knob for k in suggest(live, Shortfall(12 * gib, 10 * gib), tokens_per_step=98304, in_forward=True,
        ...                          recomputing=True, host_room=0)]
        ['at most 59,486 tokens per step (now 98,304)']
    """
    acts = owners.get("activations and temporaries", 0)
    state = owners.get("optimizer state", 0)
    need = (shortfall.missing if shortfall and shortfall.missing else 0.25 * max(owners.values(), default=0))
    if in_forward and shortfall is not None:
        need += shortfall.requested
    need *= 1 + MARGIN
    knobs: list[Knob] = []
    budget_helps = not (recomputing and host_room is not None and host_room < need)
    if acts > need and budget_helps:
        budget = (activation_budget if activation_budget is not None else acts) - need
        budget_gib = max(1, math.floor(budget / _GIB))
        knobs.append(Knob(f'ActivationOffload(budget="{budget_gib}GiB")',
                          f"activations and temporaries held {fmt_bytes(acts)}; a budget {fmt_bytes(need)} lower "
                          "keeps the rest on the host or recomputes it"))
    if state > need and not superoffload:
        knobs.append(Knob('strategy="superoffload"',
                          f"the optimizer state held {fmt_bytes(state)} of GPU memory; SuperOffload keeps it in host "
                          "memory and updates it on the CPU"))
    if state > need and superoffload:
        knobs.append(Knob("SuperOffloadStrategy(max_gpu_fraction=...)",
                          f"the GPU tail's optimizer state held {fmt_bytes(state)}; a lower cap keeps more of it on the "
                          "host"))
    if tokens_per_step and acts > 0:
        keep = max(0.0, 1 - need / acts)
        fewer = int(tokens_per_step * keep)
        if fewer > 0:
            knobs.append(Knob(f"at most {fewer:,} tokens per step (now {tokens_per_step:,})",
                              "activations grow with the tokens of a step; fewer per micro-batch with "
                              "accumulate_grad_batches keeps the batch"))
    return knobs


def report(owners: Mapping[str, int], shortfall: Shortfall | None, knobs: Sequence[Knob], *,
           reserved: int | None = None, allocated: int | None = None, error: str = "",
           step: tuple[Mapping[str, int], Shortfall] | None = None) -> str:
    """The out-of-memory report as markdown: the request, the owners, fragmentation, and the knobs.

    ``step`` is :func:`step_shortfall`'s answer when the knobs were sized for the whole predicted step."""
    lines = ["# Out of GPU memory", ""]
    if error:
        lines += [f"Error: `{error.splitlines()[0][:300]}`", ""]
    if shortfall is not None:
        lines.append(f"The failed allocation asked for {fmt_bytes(shortfall.requested)} with "
                     f"{fmt_bytes(shortfall.free)} free: {fmt_bytes(shortfall.missing)} missing.")
    unwound = shortfall is not None and shortfall.allocated is not None and allocated is not None \
        and shortfall.allocated > allocated
    if unwound:
        lines += ["", f"At the failure PyTorch had {fmt_bytes(shortfall.allocated)} allocated; the owners below are "
                  f"read after the error unwound part of the step ({fmt_bytes(allocated)} allocated then)."]
    lines += ["", "| owner | live GPU memory |", "| --- | ---: |"]
    lines += [f"| {k} | {fmt_bytes(v)} |" for k, v in sorted(owners.items(), key=lambda kv: -kv[1])]
    if shortfall is not None and shortfall.cached is not None:
        lines.append("| allocator cache (reserved, not allocated: fragmentation), at the failure | "
                     f"{fmt_bytes(shortfall.cached)} |")
    elif reserved is not None and allocated is not None:
        lines.append(f"| allocator cache (reserved, not allocated: fragmentation) | {fmt_bytes(reserved - allocated)} |")
    if step is not None:
        parts, whole = step
        lines += ["", f"The plan predicted a peak of {fmt_bytes(whole.requested)} for the whole step against "
                  f"{fmt_bytes(whole.free)} the process can use ({CAPACITY_MARGIN:.0%} of the device left free): "
                  f"{fmt_bytes(whole.missing)} missing. The knobs below are sized for the whole step.", "",
                  "| predicted peak's part | bytes |", "| --- | ---: |"]
        lines += [f"| {k} | {fmt_bytes(v)} |" for k, v in parts.items()]
    lines += ["", "## What would have fit", ""]
    lines += [f"- `{k.knob}`: {k.why}" for k in knobs] or ["- no single knob frees enough: see the owners above"]
    return "\n".join(lines) + "\n"
