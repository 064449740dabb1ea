"""The ``"auto"`` policy's state: the measured steps, the plan made from them, and its forecast once recompute is seen.

:class:`AutoPlanner` takes the profiles of the first training steps (the engine times them block by block, see
:class:`~lightning_gh.activation_offload.policy.StepProfile`), and after ``profile_steps`` of them (the warm-up step
left out) plans with :func:`~lightning_gh.activation_offload.policy.plan_auto`, adding the ``recompute`` mode where
one is set. The first forward that recomputes tells what the recomputing blocks really keep; the forecast is
redone once from that.

The plan promises to cost nothing (the copies hide under compute). The first :data:`WARM_STEPS` + ``profile_steps``
steps with it are timed and held against the forecast (the measured steps' own time plus the stall the timeline model
predicts); the steady steps (the warm ones left out: they pay once for what the plan sets up) slower by more than
:data:`TOLERANCE` shrink the plan by its last offloaded block, or undo it (:func:`judge_trial`, :func:`check_verdict`),
and say so in one log line. A plan kept is held once more against steps run without the engine (See Note [The
reference of the check is the step without the engine]). A plan that offloads nothing leaves the step as it is
without the engine (See Note [A plan that moves nothing installs nothing] in :mod:`.engine`). This needs the
backward's end marked (:meth:`~lightning_gh.activation_offload.engine.ActivationOffloader.end_backward`; the Lightning
callback does) and the link measured (``bandwidth_gbps=None``: a given bandwidth is a forecast for that link, not a
promise about this one).

Example::

    >>> from lightning_gh.activation_offload import ActivationOffloadOptions, BlockProfile, StepProfile
    >>> planner = AutoPlanner(ActivationOffloadOptions(profile_steps=1), lambda: (50.0, 50.0))
    >>> step = StepProfile(tuple(BlockProfile(2.0, 4.0, 100 * 2**20) for _ in range(4)))
    >>> planner.observe([step]).offloaded_blocks
    (0, 1, 2)
"""

from __future__ import annotations

import enum
import logging
import statistics
from dataclasses import replace
from typing import Callable, Mapping, NamedTuple, Sequence

from lightning_gh.activation_offload.options import ActivationOffloadOptions
from lightning_gh.activation_offload.policy import (
    OffloadPlan,
    StepProfile,
    median_profile,
    plan_auto,
    plan_none,
    plan_with_recompute,
)

__all__ = ["TOLERANCE", "WARM_STEPS", "AutoPlanner", "Judgement", "Verdict", "check_verdict", "judge_trial"]

log = logging.getLogger(__name__)

#: A step with the ``"auto"`` plan may take this much longer than its forecast before the plan shrinks.
TOLERANCE = 0.03

#: The first steps with a new plan that its check leaves out: they pay once for what the plan sets up (the pinned host
#: buffers the pool allocates on first use, the device allocator's first blocks for the reloads), later steps do not.
WARM_STEPS = 1


class Verdict(enum.Enum):
    """What the timed steps with an ``"auto"`` plan mean for it."""

    KEEP = "keep"  # within the forecast
    SHRINK = "shrink"  # over it by up to twice the tolerance, with more than one block offloaded: drop the last one
    UNDO = "undo"  # over it by more, or with one block left: offload nothing


def check_verdict(forecast_ms: float, measured_ms: float, offloaded_blocks: int,
                  tolerance: float = TOLERANCE) -> Verdict:
    """The decision after timing steps with an ``"auto"`` plan (pure, so its table is tested as written).

    Example::

        >>> check_verdict(100.0, 102.0, 3), check_verdict(100.0, 105.0, 3), check_verdict(100.0, 105.0, 1)
        (<Verdict.KEEP: 'keep'>, <Verdict.SHRINK: 'shrink'>, <Verdict.UNDO: 'undo'>)
        >>> check_verdict(100.0, 120.0, 3)
        <Verdict.UNDO: 'undo'>
    """
    if offloaded_blocks == 0 or measured_ms <= forecast_ms * (1.0 + tolerance):
        return Verdict.KEEP
    if offloaded_blocks > 1 and measured_ms <= forecast_ms * (1.0 + 2.0 * tolerance):
        return Verdict.SHRINK
    return Verdict.UNDO


class Judgement(NamedTuple):
    """A plan's check: the verdict and the figures it came from (what the one log line states)."""

    verdict: Verdict
    plain_ms: float  # the reference: the lower median of the steps without offload
    forecast_ms: float  # plain_ms plus the stall the plan predicts
    measured_ms: float  # the lower median of the steady steps with the plan


def judge_trial(plain_ms: Sequence[float], trial_ms: Sequence[float], stall_ms: float, offloaded_blocks: int,
                warm_steps: int = WARM_STEPS, tolerance: float = TOLERANCE) -> Judgement:
    """The verdict on a plan from the timed steps with it (pure, so its table is tested as written).

    The first ``warm_steps`` of ``trial_ms`` are left out: the first use of the plan's pinned buffers and reload
    memory is paid once, and would otherwise be held against the plan for good. The rest are the steady steps; their
    lower median is what the plan costs (one step slowed by something else, a collection or another process, does not
    decide), held against the lower median of ``plain_ms`` plus ``stall_ms`` by :func:`check_verdict`.

    Example::

        >>> judge_trial([100.0, 101.0], [400.0, 101.0, 102.0], 0.0, 3).verdict  # a costly first step: kept
        <Verdict.KEEP: 'keep'>
        >>> judge_trial([100.0, 101.0], [400.0, 110.0, 111.0], 0.0, 3).verdict  # over in every steady step
        <Verdict.UNDO: 'undo'>
    """
    if warm_steps < 0:
        raise ValueError(f"warm_steps={warm_steps!r} must be >= 0.")
    steady = list(trial_ms[warm_steps:])
    if not plain_ms or not steady:
        raise ValueError(f"judge_trial needs steps without offload and steady steps with the plan; got plain_ms="
                         f"{list(plain_ms)!r}, trial_ms={list(trial_ms)!r} with warm_steps={warm_steps}.")
    plain = statistics.median_low(plain_ms)
    measured = statistics.median_low(steady)
    forecast = plain + stall_ms
    return Judgement(check_verdict(forecast, measured, offloaded_blocks, tolerance), plain, forecast, measured)


class AutoPlanner:
    """Plans ``policy="auto"`` from measured steps (see the module docstring).

    Args:
        options: the engine's options (``profile_steps``, ``margin``, ``skip_last_blocks``, ``recompute``).
        link: returns the link bandwidth ``(d2h, h2d)`` in GB/s.

    Attributes:
        profile: the median of the measured steps, once planned (recompute's kept bytes added once measured).
    """

    def __init__(self, options: ActivationOffloadOptions, link: Callable[[], tuple[float, float]]) -> None:
        self.options = options
        self.link = link
        self.profile: StepProfile | None = None
        self._measured: list[StepProfile] = []
        self._recompute_seen = False
        self._plain_ms: list[float] = []  # the measured steps' own times (no offload): the reference of the check
        self._checked: tuple[OffloadPlan, list[float]] | None = None  # the plan being timed, its step times
        # A plan kept against the measured steps, its step times, and the steps without the engine timed for it so
        # far (None: none asked for yet). See Note [The reference of the check is the step without the engine].
        self._confirm: tuple[OffloadPlan, list[float]] | None = None
        self._reference: list[float] | None = None
        self._references_asked = 0

    def observe(self, steps: Sequence[StepProfile], step_ms: Sequence[float] = ()) -> OffloadPlan | None:
        """Take in measured steps (not the warm-up) and, where the backward's end was marked, their whole times; the
        plan once ``profile_steps`` are in, else ``None``."""
        if self.profile is not None:
            return None
        self._measured.extend(steps)
        self._plain_ms.extend(step_ms)
        if len(self._measured) < self.options.profile_steps:
            return None
        o = self.options
        self.profile = median_profile(self._measured)
        d2h, h2d = self.link()
        plan = plan_with_recompute(plan_auto(self.profile, d2h, h2d, o.margin, o.skip_last_blocks), o.recompute,
                                   self.profile, d2h, h2d, o.margin)
        self._start_check(plan)
        return plan

    def _start_check(self, plan: OffloadPlan) -> None:
        # A bandwidth given in the options is a forecast for that link, not a promise about this one: no check.
        measured_link = self.options.bandwidth_gbps is None
        self._checked = (plan, []) if measured_link and self._plain_ms and plan.offloaded_blocks else None

    @property
    def checking(self) -> bool:
        """Whether a plan is being timed against its forecast (its verdict may still change it)."""
        return self._checked is not None or self._confirm is not None

    # Note [The reference of the check is the step without the engine]
    # The measured steps run with the engine's hooks (they time each block), which cost something of their own: a
    # Python call per saved tensor, autocast's weight casts made again in the backward. Held against them alone, a
    # plan could be within TOLERANCE of a step already slower than the one without the engine. So a plan kept
    # against the measured steps is held once more against ``profile_steps`` steps run with nothing installed (the engine only
    # marks their start and the backward's end, ``reference_step``/``reference_timed``), and from then on every check
    # uses those. Only without ``recompute`` and a forced lean loss (with them the plan does more than offload, and the
    # step without the engine is not what it promises to match), and only where the backward's end is marked.
    def _wants_reference(self) -> bool:
        o = self.options
        return self._reference is None and o.recompute is None and o.lean_loss is not True

    def reference_step(self) -> bool:
        """Whether the next forward is to run with nothing installed and be timed as the reference (asked once)."""
        if self._confirm is None or self._references_asked >= self.options.profile_steps:
            return False
        self._references_asked += 1
        return True

    def reference_timed(self, step_ms: float) -> OffloadPlan | None:
        """Take in one step without the engine; a smaller plan (or none) when the kept plan breaks its promise
        against these steps."""
        if self._confirm is None:
            return None
        ref = self._reference = (self._reference or []) + [step_ms]
        if len(ref) < self.options.profile_steps:
            return None
        (plan, times), self._confirm = self._confirm, None
        self._plain_ms = list(ref)
        return self._verdict(plan, times, "the steps without the engine")

    def timing(self, plan: OffloadPlan | None) -> bool:
        """Whether a step with ``plan`` is to be timed (the plan is being checked)."""
        return self._checked is not None and plan is self._checked[0]

    def timed(self, plan: OffloadPlan, step_ms: float) -> OffloadPlan | None:
        """Take in one timed step with ``plan``; a smaller plan (or none) when the plan broke its promise."""
        if not self.timing(plan):
            return None
        times = self._checked[1]
        times.append(step_ms)
        if len(times) < WARM_STEPS + self.options.profile_steps:
            return None
        self._checked = None
        if self._wants_reference():
            self._confirm = (plan, times)
        return self._verdict(plan, times, "the measured steps without offload")

    def _verdict(self, plan: OffloadPlan, times: list[float], reference: str) -> OffloadPlan | None:
        stall = plan.prediction.stall_ms if plan.prediction is not None else 0.0
        verdict, plain, forecast, measured = judge_trial(self._plain_ms, times, stall, len(plan.offloaded_blocks))
        if verdict is Verdict.KEEP:
            return None
        self._confirm = None
        n, o = plan.n_blocks, self.options
        if verdict is Verdict.SHRINK:
            last = plan.offloaded_blocks[-1]
            new = replace(plan, budgets=tuple(0 if i == last else b for i, b in enumerate(plan.budgets)),
                          prediction=None, recompute=(), modes=())
            what = f"shrunk to blocks {new.offloaded_blocks}"
        else:
            new = replace(plan_none(n, "auto"), notes=plan.notes)
            what = "undone (nothing offloaded)"
        line = (f"ActivationOffload auto: the step took {measured:.1f} ms with the plan against {forecast:.1f} ms "
                f"forecast ({reference}: {plain:.1f} ms; the first {WARM_STEPS} step(s) with "
                f"the plan left out), more than {TOLERANCE:.0%} over; the plan is {what}")
        log.info(line)
        new = plan_with_recompute(replace(new, notes=new.notes + (line,)), o.recompute)
        self._start_check(new)
        return new

    def recompute_measured(self, plan: OffloadPlan, kept: Mapping[int, int]) -> OffloadPlan | None:
        """``plan`` with its forecast redone from what its recomputing blocks kept in their first forward (``kept``:
        block -> bytes that reached the engine plus the selective cache); ``None`` when there is nothing to redo.

        Measured, not predicted from the graph. Needs the profile the plan was made from; a fixed or restored plan
        states no forecast.
        """
        if self._recompute_seen or self.profile is None or plan.prediction is None or not plan.recompute:
            return None
        if set(kept) != set(plan.recompute):
            return None
        blocks = tuple(replace(b, recompute_kept_bytes=kept[i]) if i in kept else b
                       for i, b in enumerate(self.profile.blocks))
        self.profile = replace(self.profile, blocks=blocks)
        self._recompute_seen = True
        d2h, h2d = self.link()
        new = plan_with_recompute(plan, self.options.recompute, self.profile, d2h, h2d, self.options.margin)
        if self.timing(plan):  # the same offload: its check goes on
            self._checked = (new, self._checked[1])
        return new
