"""What budget mode measures: the records of its measuring steps, their schedules, and how memory is read.

:class:`BudgetState` says where the controller stands, :class:`Measure` what one measured step is for (:class:`Kind`);
:func:`measuring_schedule` (a fraction budget: the plain step is its reference) and :func:`floor_schedule` (a size
budget: every step from the floor) list them in order; :class:`Observation` is what the engine saw in one of them;
:class:`MemoryProbe` reads a step's activation memory on CUDA; :class:`CompilerKnob` holds the compiler's
``activation_memory_budget`` for a compiled model. The decisions are the
:class:`~lightning_gh.activation_offload.controller.BudgetController`'s.

Example::

    >>> [m.label for m in measuring_schedule(modes=("full",), profile_steps=1, weigh_lean_loss=False)]
    ['warm-up', 'raw', 'plain', 'full']
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import nn

from lightning_gh import hardware
from lightning_gh._util import fmt_bytes, local_tensor
from lightning_gh.activation_offload.budget import BudgetForecast, BudgetProfile, ModeCost
from lightning_gh.activation_offload.policy import BlockProfile, OffloadPlan, StepProfile, simulate

__all__ = ["FILL_FRACTIONS", "MAX_CORRECTIONS", "MAX_FILLS", "MAX_OVERSHOOTS", "MAX_WIDTH", "WITHIN", "BudgetState",
           "CompilerKnob", "Correction", "Kind", "Measure", "MemoryProbe", "Observation", "Relaxation", "block0_ms", "correction",
           "device_allows", "fill_step", "floor_costs", "floor_mode", "floor_name", "floor_schedule", "measuring_schedule",
           "next_width", "relax_end", "relax_guard", "sample_copy_points", "sample_guard", "widen"]


#: Correction rounds after the first planned step: the overhead estimate is corrected at most this often.
MAX_CORRECTIONS = 2
#: A planned step's activation memory is "within the budget" from this share of it up to the budget itself.
WITHIN = 0.95


class Correction(enum.Enum):
    """What a measured planned step means for the plan (see :func:`correction`)."""

    WITHIN = "within"  # the step's activation memory is within the budget: keep the plan
    LAST_ROUND = "last-round"  # off the budget, but the correction rounds are spent: keep the plan
    REPLAN = "replan"  # off the budget: correct the overhead estimate by the error and plan again


def correction(achieved_bytes: int, budget_bytes: int, round: int) -> Correction:
    """The decision after a planned step of correction round ``round`` measured ``achieved_bytes``.

    Example::

        >>> correction(96, 100, 0), correction(120, 100, 0), correction(120, 100, MAX_CORRECTIONS)
        (<Correction.WITHIN: 'within'>, <Correction.REPLAN: 'replan'>, <Correction.LAST_ROUND: 'last-round'>)
    """
    if WITHIN * budget_bytes <= achieved_bytes <= budget_bytes:
        return Correction.WITHIN
    return Correction.LAST_ROUND if round >= MAX_CORRECTIONS else Correction.REPLAN


class BudgetState(enum.Enum):
    """Where the controller stands."""

    MEASURE = "measure"  # walking the measuring schedule
    RELAX = "relax"  # a size budget: from the floor towards the plan, a few blocks per measured step
    CORRECT = "correct"  # a plan is adopted; its measured steps correct the overhead estimate
    TRIAL = "trial"  # the plan and the one that only recomputes, timed against each other
    DONE = "done"  # the plan stays
    COMPILED_MEASURE = "compiled-measure"  # a compiled model: measuring one compiled step
    COMPILED = "compiled"  # a compiled model: the budget is the compiler's
    FAILED = "failed"  # the budget was refused


class Kind(enum.Enum):
    """What a measured step is for."""

    WARMUP = "warm-up"  # allocator growth, kernel selection; what the step saves outside the blocks
    RAW = "raw"  # no engine effect at all (no cast dedupe, no weight re-cast, nothing moved): a fraction's reference
    PLAIN = "plain"  # the engine's own step with every block keeping what it saves
    LEAN = "lean-loss"  # plain blocks with the lean causal-LM loss
    MODE = "mode"  # every block under one recompute mode
    CHECK = "check"  # a planned step, measured against the budget
    FLOOR = "floor"  # the floor plan: every block at its least memory (a size budget's measured steps start here)
    SAMPLE = "sample"  # the floor plan, but block 0 in one mode with all it saves offloaded: that mode's costs
    RELAX = "relax"  # a mix between the floor and the plan, measured against the budget
    TRIAL = "trial"  # one of two fitting plans, timed against the other (see lightning_gh.activation_offload.trial)


@dataclass(frozen=True)
class Measure:
    """One measured step: what its forward runs and what it is measured for.

    Attributes:
        kind: see :class:`Kind`.
        mode: the recompute mode of every block (``Kind.MODE``).
        lean_loss: the forward runs the lean causal-LM loss.
        round: the correction round (``Kind.CHECK``), relaxation step (``Kind.RELAX``) or trial step
            (``Kind.TRIAL``).
        floor_mode: for steps from the floor (``Kind.FLOOR``, ``Kind.SAMPLE``, a size budget's warm-up): the
            recompute mode of the blocks at their least memory (``None``: offload alone); ``""``: not such a step.
    """

    kind: Kind
    mode: str | None = None
    lean_loss: bool = False
    round: int = 0
    floor_mode: str | None = ""

    @property
    def from_floor(self) -> bool:
        return self.floor_mode != ""

    @property
    def raw(self) -> bool:
        """The step must keep exactly what a plain run keeps (the hooks only count)."""
        return self.kind is Kind.RAW

    @property
    def label(self) -> str:
        if self.kind is Kind.SAMPLE:
            return f"sample {self.mode or 'keep'}"
        return self.mode if self.kind is Kind.MODE else self.kind.value


def measuring_schedule(modes: tuple[str, ...], profile_steps: int, weigh_lean_loss: bool) -> tuple[Measure, ...]:
    """The measuring steps of budget mode, in order.

    Args:
        modes: the recompute modes the blocks allow (each measured in one step with every block in it).
        profile_steps: plain steps to measure (their median is the plain profile).
        weigh_lean_loss: measure the lean loss in one step; the warm-up runs it too, so that what the warm-up saves
            outside the blocks is the lean head's (the lower bound of the floor) and the measured step is not its
            first use.
    """
    warmup = Measure(Kind.WARMUP, lean_loss=weigh_lean_loss)
    lean = (Measure(Kind.LEAN, lean_loss=True),) if weigh_lean_loss else ()
    return ((warmup, Measure(Kind.RAW)) + (Measure(Kind.PLAIN),) * profile_steps + lean
            + tuple(Measure(Kind.MODE, mode=m) for m in modes))


#: Steps each mode is sampled in from the floor (see :func:`floor_schedule`).
SAMPLES_PER_MODE = 2


def floor_schedule(modes: tuple[str, ...], profile_steps: int, weigh_lean_loss: bool) -> tuple[Measure, ...]:
    """The measuring steps of a size budget: none of them runs more than the floor plus one block.

    A warm-up and ``profile_steps`` steps at the floor (every block in its least-memory mode, what it still saves
    offloaded but in the last ``skip_last_blocks``), then one step per other mode (keeping included) with block 0 in
    that mode and everything it saves offloaded (waited for at the forward's end, brought back at the backward's
    start: :func:`sample_copy_points`); the blocks are alike, so block 0's costs stand for every block's.
    Each mode is sampled twice and the faster sample counts: the first step that offloads a whole block grows the
    pinned pool by that block's bytes, host time the block's forward would otherwise be charged with (and a keep
    sample charged so would make every other mode look free beside it). The lean loss, where weighed, runs in every
    step (the head at its least memory too).

    Example::

        >>> [m.label for m in floor_schedule(("norm-act", "full"), 1, False)]
        ['warm-up', 'floor', 'sample keep', 'sample norm-act', 'sample keep', 'sample norm-act']
    """
    fm = floor_mode(modes)
    lean = weigh_lean_loss
    return ((Measure(Kind.WARMUP, lean_loss=lean, floor_mode=fm),)
            + (Measure(Kind.FLOOR, lean_loss=lean, floor_mode=fm),) * profile_steps
            + tuple(Measure(Kind.SAMPLE, mode=m, lean_loss=lean, floor_mode=fm)
                    for m in (None,) + tuple(modes) if m != fm) * SAMPLES_PER_MODE)


def sample_copy_points(plan: OffloadPlan, n: int) -> dict[str, tuple[int, ...]]:
    """``release_at`` and ``prefetch_at`` of a sample step: block 0's copies waited for at the forward's end and its
    reload issued at the backward's start, the others' as ``plan`` has them. A sample times block 0 in a mode; a
    copy waited for at the usual points (a few blocks later, one block ahead) adds the link's time to the block's
    own wherever the block saves more than the next blocks' compute can hide, and that time is the plan's link
    model's to predict, not the mode's. Held that long, block 0's bytes still add at most one block to the floor.

    Example::

        >>> from lightning_gh.activation_offload.policy import plan_all
        >>> sample_copy_points(plan_all(4), 4)
        {'release_at': (5, 3, 4, 5), 'prefetch_at': (4, 2, 3, 4)}
    """
    return {"release_at": (n + 1,) + plan.release_at[1:], "prefetch_at": (n,) + plan.prefetch_at[1:]}


def floor_mode(modes: tuple[str, ...]) -> str | None:
    """The recompute mode that keeps least of a block: full, else selective, else norm-act, else none."""
    return next((m for m in ("full", "selective", "norm-act") if m in modes), None)


def floor_name(options: Any) -> str:
    """What a budget's floor is made of, for its errors: with ``budget_offload=False`` nothing is offloaded.

    >>> from lightning_gh.activation_offload import ActivationOffloadOptions
    >>> floor_name(ActivationOffloadOptions(budget="1GiB")), floor_name(ActivationOffloadOptions(budget="1GiB",
    ...                                                                  budget_offload=False))
    ('full recompute plus offload', 'full recompute with nothing offloaded (budget_offload=False)')
    """
    return "full recompute with nothing offloaded (budget_offload=False)" if options.budget_offload is False \
        else "full recompute plus offload"


@dataclass(frozen=True)
class Observation:
    """What one measured step did, as the engine saw it.

    Attributes:
        measure: what the step was for.
        plan: the plan it ran.
        profile: per-block times and saved bytes (``None``: the step was not timed block by block).
        used / offloadable / resident: per block, bytes moved, bytes the engine may move, bytes that stayed.
        rc_cached: per recomputing block, the bytes its selective cache held.
        other: bytes saved outside the blocks.
        act_peak: the step's measured activation memory (``None`` where memory cannot be read: a CPU).
        step_ms: forward + backward time, where the backward's end was marked.
    """

    measure: Measure
    plan: OffloadPlan
    profile: StepProfile | None
    used: tuple[int, ...]
    offloadable: tuple[int, ...]
    resident: tuple[int, ...]
    rc_cached: Mapping[int, int] = field(default_factory=dict)
    other: int = 0
    act_peak: int | None = None
    step_ms: float | None = None


class MemoryProbe:
    """Reads a step's activation memory on CUDA: its peak allocation above the model state.

    The model state is what is allocated when the step starts, with the gradients counted at their full size
    whether or not they exist yet (Lightning sets them to ``None`` between steps). Off CUDA every reading is
    ``None`` and the controller counts the saved bytes the engine tracks instead.
    """

    def __init__(self, model: nn.Module, device: torch.device | None) -> None:
        self.model = model
        self.device = device if device is not None and device.type == "cuda" else None
        self.kept_grad_bytes: int | None = None  # the most gradients on the device at a backward's end so far
        self._assumed = 0  # the gradient bytes the last start() counted in the model state

    def _grad_bytes(self, present: bool) -> int:
        if present:
            gs = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            return sum(g.numel() * g.element_size() for g in gs if g.device == self.device)
        if self.kept_grad_bytes is not None:
            return self.kept_grad_bytes
        ps = [local_tensor(p) for p in self.model.parameters()]  # a sharded model's gradients are its shards'
        return sum(p.numel() * p.element_size() for p in ps if p.requires_grad)

    def backward_ended(self) -> None:
        """Note the gradients the device holds now, at a backward's end: the model state's gradients from then on
        are the most held at any backward's end so far.

        Until the first backward ends, every parameter's gradient counts at full size (its local shard's, for a
        sharded model). A strategy that moves gradients off the device during the backward (SuperOffload) or
        frees the gathered ones (FSDP2) keeps fewer; what it holds only within the backward is activation memory.
        The most so far, because under gradient accumulation such a strategy keeps the gradients on the device
        until the last micro-batch: every micro-batch is measured against the same state.
        """
        if self.device is not None:
            self.kept_grad_bytes = max(self.kept_grad_bytes or 0, self._grad_bytes(True))

    def start(self) -> int | None:
        """The model state now (the base of :meth:`peak`); resets the peak statistics."""
        if self.device is None:
            return None
        self._assumed = self._grad_bytes(False)
        base = torch.cuda.memory_allocated(self.device) - self._grad_bytes(True) + self._assumed
        torch.cuda.reset_peak_memory_stats(self.device)
        return base

    def peak(self, base: int | None) -> int | None:
        """The activation memory since :meth:`start` returned ``base``, against the model state as known now (the
        first step's gradients are known once its backward ended: :meth:`backward_ended`)."""
        if base is None or self.device is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - (base - self._assumed + self._grad_bytes(False))

    def free_bytes(self) -> int | None:
        """What the device could still allocate (``None`` off CUDA)."""
        room = hardware.gpu_memory_room(self.device) if self.device is not None else None
        return None if room is None else room[0] + torch.cuda.memory_reserved(self.device) \
            - torch.cuda.memory_allocated(self.device)

    def activation_room(self) -> int | None:
        """The activation memory a step could reach from now, in :meth:`peak`'s terms: what the device could still
        allocate, less the gradients that do not exist yet (:meth:`start` counts them in the model state)."""
        free = self.free_bytes()
        return None if free is None else free - (self._grad_bytes(False) - self._grad_bytes(True))


class CompilerKnob:
    """``torch._functorch.config.activation_memory_budget``, set for a compiled model, restored by :meth:`restore`;
    and the count of the compiled model's calls with the memory base of the measured one."""

    def __init__(self) -> None:
        self.previous: float | None = None
        self.calls = 0
        self.base: int | None = None

    def set(self, value: float) -> None:
        import torch._functorch.config as fconfig

        if self.previous is None:
            self.previous = fconfig.activation_memory_budget
        if fconfig.activation_memory_budget != value:
            fconfig.activation_memory_budget = value
            # The knob is read when a graph is partitioned: a graph compiled before under another value (another
            # instance of the same model class reuses it) must be dropped.
            torch._dynamo.reset()

    def restore(self) -> None:
        import torch._functorch.config as fconfig

        if self.previous is None:
            return
        if fconfig.activation_memory_budget != self.previous:
            fconfig.activation_memory_budget = self.previous
            torch._dynamo.reset()  # graphs partitioned under our budget must not serve later compiles
        self.previous = None


@dataclass
class Relaxation:
    """A size budget's way from the floor to the plan: the mixes measured so far and the one in flight."""

    bp: BudgetProfile
    target: list[tuple[str | None, float]]  # the planner's mix
    current: list[tuple[str | None, float]]  # the last mix measured within the budget (the floor's at first)
    measured: int  # its measured activation memory
    mode_bytes: dict[str | None, int] = field(default_factory=dict)  # per sampled mode, the most a sample added
    correction: int = 0  # measured minus predicted, for the current mix
    pending: tuple[list[tuple[str | None, float]], OffloadPlan, BudgetForecast] | None = None
    steps: int = 0
    # per choice (its mode, the share offloaded), the most one relaxing step to it added to the measurement (> 0)
    step_bytes: dict[tuple[str | None, float], int] = field(default_factory=dict)
    floor_mode: str | None = None  # the floor's mode: it has no sample, the floor is its fully offloaded form
    skipped: set[int] = field(default_factory=set)  # blocks whose relaxing step measured above the budget (undone)
    past_guard: bool = False  # the pending step was let past :func:`relax_guard` (see MAX_OVERSHOOTS)
    retargets: int = 0  # times planned again on reaching a plan (see :func:`retarget`)
    filling: bool = False  # the pending step is a finer one of :func:`fill_step`
    fills: int = 0  # finer steps kept
    width: int = 1  # the most blocks the next relaxing step relaxes at once (:func:`widen`, :func:`next_width`)
    wide_overshoot: bool = False  # a step of several blocks measured above the budget (then widening ended)

    @property
    def overshoots(self) -> int:
        """Relaxing steps that measured above the budget (each undone)."""
        return len(self.skipped) + self.wide_overshoot

    @property
    def block_bytes(self) -> int:
        """The most one sampled block of any mode measured above the floor."""
        return max(self.mode_bytes.values(), default=0)


#: Relaxing steps of a size budget that may measure above the budget before the relaxation ends. Each such step is
#: undone (a block of one keeps its choice; a step of several, see :func:`widen`, counts once and ends widening);
#: while there are any left, a block that :func:`relax_guard` holds back but the planner's corrected model and
#: :func:`device_allows` let through is tried, since most relaxing steps add far less than the most one added.
MAX_OVERSHOOTS = 2


def sample_guard(r: Relaxation, choice: tuple[str | None, float]) -> int:
    """The most relaxing one block to ``choice`` could add to the measured activation memory, from the samples: the
    larger of what a sample of that mode added to the floor (nothing for the floor's own mode, which has no sample)
    and what the choice keeps on the device (the mode's kept bytes less the offloaded share of what may be
    offloaded; for the floor's mode, beyond what the floor keeps). A sample holds its block's bytes through the
    forward and the backward (:func:`sample_copy_points`), so what it added counts them wherever the step's peak
    falls but at the loss, where the kept bytes count them. For a mode without a sample or a kept size: the most
    any sampled block added. A sample measures block 0 alone above the floor, so this counts, once per block, what
    the relaxed blocks share (a prefetched block's bytes beside another's recompute), which is why
    :func:`relax_guard` prefers what relaxing steps measured.

    Example::

        >>> r = Relaxation(None, [], [], 0, mode_bytes={"selective": 4, None: 9})
        >>> sample_guard(r, ("selective", 1.0)), sample_guard(r, ("selective", 0.5)), sample_guard(r, ("norm-act", 1.0))
        (4, 9, 9)
    """
    mode, frac = choice
    cost = r.bp.costs[0].get(mode) if r.bp is not None else None
    added = r.mode_bytes.get(mode, 0 if mode == r.floor_mode and r.mode_bytes else None)
    if cost is None or added is None:
        return r.mode_bytes.get(mode, r.block_bytes) if frac >= 1.0 else r.block_bytes
    keeps = lambda f: cost.kept_bytes - int(f * min(cost.offloadable_bytes, cost.kept_bytes))  # noqa: E731
    return max(added, keeps(frac) - (keeps(1.0) if mode == r.floor_mode else 0))


def relax_guard(r: Relaxation, choice: tuple[str | None, float]) -> int:
    """What relaxing one more block to ``choice`` is expected to add to the measured activation memory: the most one
    relaxing step to the same choice added, once one added anything; before that the samples'
    bound (:func:`sample_guard`). A step that adds more than expected measures above the budget and is undone;
    whether the device could hold it is :func:`device_allows`'s question.

    Example::

        >>> r = Relaxation(None, [], [], 0, mode_bytes={"selective": 4, None: 9}, step_bytes={("selective", 1.0): 1})
        >>> relax_guard(r, ("selective", 1.0)), relax_guard(r, ("selective", 0.5)), relax_guard(r, (None, 0.0))
        (1, 9, 9)
    """
    return r.step_bytes.get(choice, sample_guard(r, choice))


#: The most blocks one relaxing step relaxes at once (:func:`widen`).
MAX_WIDTH = 8


def next_width(width: int, added: int, overshot: bool) -> int:
    """How many blocks the relaxing step after a kept one may relax: twice as many as ``width`` while the kept step
    ``added`` nothing to the measured activation memory (the step's peak is set elsewhere, as when a sharded
    strategy's gathered weights set it), one after a step that added memory, and one for good once a step of
    several blocks measured above the budget (``overshot``).

    Example::

        >>> next_width(1, 0, False), next_width(4, 0, False), next_width(8, 0, False), next_width(4, 10, False)
        (2, 8, 8, 1)
        >>> next_width(4, 0, True)
        1
    """
    return 1 if overshot or added > 0 else min(2 * width, MAX_WIDTH)


def widen(r: Relaxation, mix: list[tuple[str | None, float]], budget: int, room: int | None,
          evaluate: Callable[[list[tuple[str | None, float]]], tuple[Any, BudgetForecast]]
          ) -> tuple[list[tuple[str | None, float]], Any, BudgetForecast] | None:
    """``mix`` (one block relaxed beyond ``r.current``) with up to ``r.width - 1`` more blocks relaxed to their
    planned choices, in block order: each block added only where the planner's model corrected by the current
    measurement (``evaluate`` then ``r.correction``) keeps the mix within ``budget``, where the current measurement
    plus what the first block is expected to add (:func:`relax_guard`) plus every further block's bound (the larger
    of :func:`relax_guard` and :func:`sample_guard`) stays within ``budget`` (so that a wide step is no likelier to
    measure above it than a step of one block), and where ``room`` (the activation memory the device can hold;
    ``None``: unknown, as on a CPU) holds the current measurement plus every relaxed block's samples' bound at once
    (:func:`device_allows` summed). ``None`` when no block could be added. A step of several blocks that measures above the budget anyway
    is undone without holding its blocks back, and the relaxation goes on one block at a time (:func:`next_width`).

    Example::

        >>> r = Relaxation(None, [("k", 0.0)] * 3, [("f", 1.0)] * 3, 0, mode_bytes={"k": 4}, width=2)
        >>> fits = lambda mix: (None, BudgetForecast(sum(4 for m in mix if m[0] == "k"), 0.0, 0.0, 0.0, 0.0))
        >>> widen(r, [("k", 0.0), ("f", 1.0), ("f", 1.0)], 10, None, fits)[0]
        [('k', 0.0), ('k', 0.0), ('f', 1.0)]
        >>> widen(r, [("k", 0.0), ("f", 1.0), ("f", 1.0)], 10, 7, fits) is None  # the device holds one block more
        True
        >>> widen(r, [("k", 0.0), ("f", 1.0), ("f", 1.0)], 7, None, fits) is None  # two blocks' bound over the budget
        True
    """
    changed = [i for i, (a, b) in enumerate(zip(mix, r.current)) if a != b]  # the one block ``mix`` relaxes
    held = sample_guard(r, mix[changed[0]])  # what the device must hold at once
    expected = relax_guard(r, mix[changed[0]])  # what the step may add to the measurement
    out = None
    for j in range(len(mix)):
        if len(changed) >= r.width:
            break
        if j in changed or j in r.skipped or mix[j] == r.target[j]:
            continue
        wider = [r.target[j] if k == j else c for k, c in enumerate(mix)]
        plan, fc = evaluate(wider)
        g, e = sample_guard(r, r.target[j]), max(relax_guard(r, r.target[j]), sample_guard(r, r.target[j]))
        if fc.activation_bytes + r.correction > budget or r.measured + expected + e > budget or \
                (room is not None and r.measured + held + g > room):
            continue
        mix, held, expected, out = wider, held + g, expected + e, (wider, plan, fc)
        changed.append(j)
    return out


def device_allows(r: Relaxation, choice: tuple[str | None, float], room: int | None) -> bool:
    """Whether a relaxing step to ``choice`` cannot run the device out of memory: the current measurement plus the
    samples' bound for one block within ``room``, the activation memory the device can hold (``None``: not
    readable, as on a CPU, where nothing runs out).

    Example::

        >>> r = Relaxation(None, [], [], 10, mode_bytes={"selective": 4})
        >>> device_allows(r, ("selective", 1.0), 14), device_allows(r, ("selective", 1.0), 13), device_allows(r, ("x", 1.0), None)
        (True, False, True)
    """
    return room is None or r.measured + sample_guard(r, choice) <= room


#: A relaxation that reaches its plan further than this share under the budget plans once more (:func:`retarget`).
RETARGET_BELOW = 0.95
#: At most this many times.
MAX_RETARGETS = 3


def retarget(r: Relaxation, budget: int, plan: Callable[[BudgetProfile], Sequence[tuple[str | None, float]]]) -> bool:
    """Once the relaxation has reached its plan more than ``1 - RETARGET_BELOW`` under ``budget``: plan once more,
    with ``plan`` (the planner for ``budget``), from the planner's model corrected by the last measurement (its
    overhead moved by what the current mix measured above its prediction), and relax on towards that plan. Returns
    whether there is a new target (then ``r``'s profile, correction and target are the new ones, and
    ``r.retargets`` counts it); at most :data:`MAX_RETARGETS` new targets."""
    if r.retargets >= MAX_RETARGETS or r.measured >= RETARGET_BELOW * budget:
        return False
    bp = r.bp.with_overhead(r.bp.overhead_bytes + r.correction)
    try:
        target = list(plan(bp))
    except ValueError:  # no plan fits the corrected model: keep what was reached
        return False
    if target == r.current:
        return False
    r.bp, r.correction, r.target, r.retargets = bp, 0, target, r.retargets + 1
    return True


#: The shares of what a block still saves that a finer step (:func:`fill_step`) may leave offloaded.
FILL_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Finer steps a relaxation keeps at most (each is a measured training step; a peak that lies elsewhere may not
#: move with any block's share).
MAX_FILLS = 8


def fill_step(r: Relaxation, budget: int, room: int | None,
              evaluate: Callable[[list[tuple[str | None, float]]], tuple[OffloadPlan, BudgetForecast]],
              ) -> tuple[int, list[tuple[str | None, float]], OffloadPlan, BudgetForecast] | None:
    """Once no block is left to relax and the measurement is more than ``1 - RETARGET_BELOW`` under ``budget``: a
    finer step towards it. One block keeps a larger share of what its mode saves on the device (its offloaded share
    lowered to one of :data:`FILL_FRACTIONS`): such a step adds that share of the block's offloadable bytes, a
    fraction of what relaxing a block's mode adds, and takes traffic off the link. Of the steps that fit the budget
    (the measurement plus what the step keeps, and the planner's model corrected by the current mix's
    measurement) and the device (``room``), the fastest predicted; among those within a tenth of a millisecond
    of it, the one whose addition lands nearest the middle of the band between ``RETARGET_BELOW * budget`` and
    ``budget``. The device must hold all that the block offloads now: the engine moves whole tensors within a
    block's share, so a lower share may keep more than its part (a block that saves one tensor keeps all of it).
    Blocks whose step measured above the budget are not tried again; at most :data:`MAX_FILLS` steps are kept.
    Returns ``(block, mix, plan, forecast)`` or ``None``.

    Example::

        >>> from lightning_gh.activation_offload.budget import ModeCost
        >>> from lightning_gh.activation_offload.policy import BlockProfile
        >>> blocks = (BlockProfile(1.0, 2.0, 0, 0),) * 2
        >>> bp = BudgetProfile(StepProfile(blocks, 0.0, 0.0), ({"full": ModeCost(40, 40, 1.0)},) * 2)
        >>> r = Relaxation(bp, [], [("full", 1.0), ("full", 1.0)], 100)
        >>> ev = lambda mix: (None, BudgetForecast(100, 3.0, 3.0, 0.0, 0.0))
        >>> fill_step(r, 125, None, ev)[:2]  # the band is 118.75-125: keeping half of block 0's 40 bytes lands in it
        (0, [('full', 0.5), ('full', 1.0)])
        >>> fill_step(r, 100, None, ev) is None  # within the band already
        True
    """
    if r.measured >= RETARGET_BELOW * budget or r.overshoots >= MAX_OVERSHOOTS or r.fills >= MAX_FILLS:
        return None
    aim = (1 + RETARGET_BELOW) / 2 * budget - r.measured
    found = []
    for i, (mode, frac) in enumerate(r.current):
        cost = r.bp.costs[i].get(mode)
        if i in r.skipped or frac <= 0 or cost is None:
            continue
        offloadable = min(cost.offloadable_bytes, cost.kept_bytes)
        if room is not None and r.measured + int(frac * offloadable) > room:
            continue  # the engine offloads whole tensors: a lower share may keep all the block offloads now
        for f in (f for f in FILL_FRACTIONS if f < frac):
            add = int((frac - f) * offloadable)
            if add <= 0 or r.measured + add > budget:
                continue
            mix = [(mode, f) if j == i else c for j, c in enumerate(r.current)]
            plan, fc = evaluate(mix)
            if fc.activation_bytes + r.correction <= budget:
                found.append((fc.step_ms, abs(aim - add), i, mix, plan, fc))
    if not found:
        return None
    fastest = min(x[0] for x in found)
    _, _, i, mix, plan, fc = min((x for x in found if x[0] <= fastest + 0.1), key=lambda x: (x[1], x[2]))
    return i, mix, plan, fc


def relax_end(r: Relaxation) -> str:
    """Why relaxing ends when no block is left to try: the plan reached, steps above the budget, or the guards.

    Example::

        >>> r = Relaxation(None, [("full", 0.0), ("selective", 1.0)], [("full", 0.0), ("full", 1.0)], 0)
        >>> relax_end(r)
        "the next block's plan would not fit"
        >>> r.skipped.add(1); relax_end(r)
        'relaxing steps measured above the budget'
    """
    left = [i for i, (c, t) in enumerate(zip(r.current, r.target)) if c != t]
    fills = f", then {r.fills} finer step(s) towards the budget" * (r.fills > 0)
    if not left:
        return "the plan is reached" + f" (planned {r.retargets} more time(s) from the measurement)" * \
            (r.retargets > 0) + fills
    if all(i in r.skipped for i in left) or r.overshoots >= MAX_OVERSHOOTS:
        return "relaxing steps measured above the budget" + fills
    return "the next block's plan would not fit" + fills


def floor_costs(n: int, samples: Mapping[str | None, Observation], floor_mode: str | None, floor: Observation,
                floor_profile: StepProfile, base_ms: float) -> tuple[dict[str | None, ModeCost], ...]:
    """Each block's measured options for a size budget's plan: a sampled mode's cost is block 0's in its sample
    (what it kept on the device, of that what may be offloaded, and its forward and backward time above
    ``base_ms``, the plain block's), the same for every block; the floor's mode's is each block's in the floor
    step ``floor`` (whose median profile is ``floor_profile``)."""
    costs = []
    for i in range(n):
        c: dict[str | None, ModeCost] = {}
        for mode, o, j, prof in [(m, o, 0, o.profile) for m, o in samples.items() if m is not None] + \
                ([(floor_mode, floor, i, floor_profile)] if floor_mode is not None else []):
            kept = o.resident[j] + o.used[j] + o.rc_cached.get(j, 0)
            extra = max(0.0, prof.blocks[j].forward_ms + prof.blocks[j].backward_ms - base_ms)
            c[mode] = ModeCost(kept, min(o.offloadable[j], kept), extra)
        costs.append(c)
    return tuple(costs)


def block0_ms(obs: Observation) -> float:
    """Block 0's forward and backward time in a sample step (see :func:`floor_schedule`: the faster sample counts)."""
    b = obs.profile.blocks[0] if obs.profile is not None else None
    return float("inf") if b is None else b.forward_ms + b.backward_ms


def lower_bound_refusal(options: Any, budget_bytes: int, outside_bytes: int, of: str, issued: int) -> ValueError:
    """The error for a budget below what the step saves outside the blocks (a lower bound of every plan's memory:
    the embedding output, final norm, the head's input and logits stay on the device under every plan); ``of``
    says what a fraction budget is a fraction of (``""`` for a size)."""
    return ValueError(
        f"ActivationOffload budget={options.budget!r}: {fmt_bytes(budget_bytes)}{of} of activation memory is below "
        f"the floor of {floor_name(options)}, which is at least {fmt_bytes(outside_bytes)} on this model and batch: "
        "what the step saves outside the transformer blocks (embedding, final norm, head and logits) stays "
        f"on the device under every plan. Raise the budget above {fmt_bytes(outside_bytes)} (the exact floor is "
        f"measured in the next steps), or shrink the batch or sequence. Checked after {issued} step(s).")


def plain_fits_refusal(budget: Any, fraction: float, n_blocks: int, free_bytes: int, floor_warmup_bytes: int,
                       floor_resident_bytes: int, block_bytes: int) -> ValueError | None:
    """The error for a fraction budget whose plain step would not fit (``None``: it would): the floor's warm-up less
    what its blocks kept, plus one measured block's saved bytes for each block, against the device's free memory.

    Example::

        >>> plain_fits_refusal(0.5, 0.5, 4, free_bytes=100, floor_warmup_bytes=30, floor_resident_bytes=10,
        ...                    block_bytes=20) is None
        True
    """
    predicted = floor_warmup_bytes - floor_resident_bytes + n_blocks * block_bytes
    if predicted <= free_bytes:
        return None
    size = f"{max(fraction * min(predicted, free_bytes), 2**30) / 2**30:.0f}GiB"
    return ValueError(
        f"ActivationOffload budget={budget!r} is a fraction of the plain step's activation memory, and the plain "
        f"step would not fit: one measured block x {n_blocks} blocks predicts {fmt_bytes(predicted)}, the device "
        f"has {fmt_bytes(free_bytes)} free. Give the budget as a size instead (e.g. budget=\"{size}\"): a size "
        "budget plans from the floor and never runs the plain step.")


#: How a fraction budget that cannot measure the plain step is told to give a size.
SIZE_FORM = ("Give the budget as a size instead (e.g. budget=\"24GiB\"): a size budget plans from the floor and never "
             "runs the plain step.")


def floor_refusal(options: Any, budget_bytes: int, floor_bytes: int, issued: int) -> ValueError:
    """The error for a size budget below the floor's measured activation memory (its warm-up step ran the floor)."""
    return ValueError(
        f"ActivationOffload budget={options.budget!r}: {fmt_bytes(budget_bytes)} of activation memory "
        f"is below the floor of {floor_name(options)}, {fmt_bytes(floor_bytes)} measured on this model and batch "
        f"(the warm-up step ran the floor). Raise the budget to at least {fmt_bytes(floor_bytes)}, or shrink the "
        f"batch or sequence. Checked after {issued} step(s), before any step above the floor.")


def tracked_activation(bp: BudgetProfile, obs: Observation, d2h: float, h2d: float, margin: float) -> int:
    """A step's activation memory from the bytes the engine tracked (no CUDA memory statistics): the timeline model
    of ``bp`` with what each block of the step kept and offloaded, plus the profile's overhead."""
    blocks, budgets, transient = [], [], []
    for i, b in enumerate(bp.step.blocks):
        kept = obs.resident[i] + obs.rc_cached.get(i, 0)
        blocks.append(BlockProfile(b.forward_ms, b.backward_ms, obs.used[i], kept))
        budgets.append(None if obs.used[i] else 0)
        transient.append(max(b.saved_bytes - kept - obs.used[i], 0) if obs.plan.mode_of(i) else 0)
    prof = replace(bp.step, blocks=tuple(blocks), other_bytes=obs.other or bp.step.other_bytes)
    pred = simulate(prof, tuple(budgets), obs.plan.release_at, obs.plan.prefetch_at, d2h, h2d, margin,
                    tuple(transient))
    return pred.peak_bytes + bp.overhead_bytes
