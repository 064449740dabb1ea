"""A budget plan that offloads, timed against the plan that only recomputes, before one is kept.

The budget planner (:mod:`lightning_gh.activation_offload.budget`) prices recompute by measurement and offload by a
timeline model of the link. The model charges a copy only where the link cannot hide it; what the plan's waits cost
the compute stream (a release point, a reload) and what its copies cost the host around them are not in it. Where a
step is already bound by the host's launches, a plan that offloads part of a few blocks can lose more time than
recomputing the same bytes would, while the forecast says both are free; where the step is bound by the GPU, the
offload plan is the faster one by a wide margin. Neither forecast settles it, so both plans run.

When the plan in force offloads something and the planner's plan that offloads nothing also fits the budget (as
``budget_offload="last"`` would plan it), the controller runs the two in turn, :data:`TRIAL_STEPS` steps each,
interleaved, and keeps the faster by the median of the steps each ran (:func:`choose`), saying so in one line. The
first step of each is not counted: it grows the pinned pool or compiles a recompute path once. A plan whose median
counted step measured above the budget loses to one within it; between two within it, the plan in force stays
unless the other's median step is shorter by more than :data:`TRIAL_MARGIN`.

Example::

    >>> choose([80.0, 81.0, 80.5], True, [78.0, 77.5, 78.2], True)
    'alternative'
    >>> choose([80.0, 81.0, 80.5], True, [80.2, 79.9, 80.4], True)  # within the margin: the plan in force stays
    'incumbent'
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence

from lightning_gh._util import fmt_bytes
from lightning_gh.activation_offload.budget import BudgetForecast, BudgetProfile, evaluate, plan_budget
from lightning_gh.activation_offload.policy import OffloadPlan

__all__ = ["TRIAL_MARGIN", "TRIAL_STEPS", "Candidate", "PlanTrial", "choose", "recompute_only"]

#: Steps each of the two plans runs in the trial; the first of each is not counted.
TRIAL_STEPS = 4
#: The plan that only recomputes replaces the plan in force only if its median step is shorter by more than this.
TRIAL_MARGIN = 0.01


def choose(incumbent_ms: Sequence[float], incumbent_fits: bool, alternative_ms: Sequence[float],
           alternative_fits: bool, margin: float = TRIAL_MARGIN) -> str:
    """``"incumbent"`` or ``"alternative"``: which of two timed plans to keep.

    Args:
        incumbent_ms / alternative_ms: the counted steps' forward+backward times of each plan (ms).
        incumbent_fits / alternative_fits: whether each plan's measured activation memory was within the budget.
        margin: the alternative must be faster by more than this (a share of the incumbent's median).

    A plan measured above the budget loses to one within it; with no time measured for either, the incumbent stays.
    """
    if not alternative_fits:
        return "incumbent"
    if not incumbent_fits:
        return "alternative"
    if not incumbent_ms or not alternative_ms:
        return "incumbent"
    a, b = statistics.median(incumbent_ms), statistics.median(alternative_ms)
    return "alternative" if b < a * (1.0 - margin) else "incumbent"


def recompute_only(bp: BudgetProfile, plan: OffloadPlan, forecast: BudgetForecast, achieved_bytes: int | None,
                   budget_bytes: int, link: tuple[float, float, float], room_bytes: int | None, lean_loss: bool,
                   ) -> tuple[OffloadPlan, BudgetForecast] | None:
    """The trial's other plan: the planner's plan that offloads nothing (``None`` where there is none to try).

    There is one where the plan in force (``plan``, planned as ``forecast``) offloads, and recomputing alone fits.
    The planner's model erred on the plan in force by what that plan measured above its forecast
    (``achieved_bytes``), and would err alike on the other plan: so the other is planned for the budget less that
    error, and must also fit what the device could still hold (``room_bytes``; ``None``: not known).

    Args:
        bp: the measurements both plans come from.
        link: ``(d2h GB/s, h2d GB/s, margin)``, as the plan in force was planned with.
        lean_loss: the plan in force's loss, kept by the other plan.
    """
    if not plan.offloaded_blocks:
        return None
    d2h, h2d, margin = link
    in_force = evaluate(bp, list(forecast.choices), d2h, h2d, margin)[1].activation_bytes
    error = max(0, (achieved_bytes or 0) - in_force)
    try:
        alt, fc = plan_budget(bp, budget_bytes - error, d2h, h2d, margin, bp.step.n_blocks)
    except ValueError:  # recomputing alone cannot reach the budget
        return None
    predicted = fc.activation_bytes + error
    if alt.offloaded_blocks or predicted > budget_bytes or (room_bytes is not None and predicted > room_bytes):
        return None
    fc = replace(fc, activation_bytes=predicted)  # forecast as the plan in force's is: its measured error included
    note = (f"budget {fmt_bytes(budget_bytes)}: the plan that only recomputes, timed against the plan in force: "
            f"{fc.describe_choices()}; predicted {fmt_bytes(predicted)} at {fc.step_ms:.1f} ms fwd+bwd")
    return replace(alt, notes=(note,), lean_loss=lean_loss), fc


@dataclass
class Candidate:
    """One plan of a trial and what its steps measured.

    Args:
        label: how the one-line verdict names it.
        plan: the plan, as the engine runs it.
        forecast: the planner's forecast of it.
        times: forward+backward ms of its counted steps.
        achieved: activation bytes of its counted steps.
        runs: steps it has run (the first is not counted).
    """

    label: str
    plan: OffloadPlan
    forecast: BudgetForecast
    times: list[float] = field(default_factory=list)
    achieved: list[int] = field(default_factory=list)
    runs: int = 0


class PlanTrial:
    """Two plans run in turn, ``steps`` steps each; :meth:`verdict` once both have run them.

    Args:
        incumbent: the plan in force (it runs first).
        alternative: the plan that offloads nothing.
        budget_bytes: what each plan's measured activation memory must stay within.
        steps: steps per plan (:data:`TRIAL_STEPS`).
    """

    def __init__(self, incumbent: Candidate, alternative: Candidate, budget_bytes: int,
                 steps: int = TRIAL_STEPS) -> None:
        if steps < 2:
            raise ValueError(f"steps={steps!r} must be an int >= 2 (the first step of each plan is not counted).")
        self.incumbent, self.alternative = incumbent, alternative
        self.budget_bytes = budget_bytes
        self.steps = steps
        self.issued = 0

    @property
    def candidates(self) -> tuple[Candidate, Candidate]:
        return self.incumbent, self.alternative

    def next(self) -> Candidate:
        """The candidate the next forward runs (interleaved, so that both see the same drift of the host)."""
        c = self.candidates[self.issued % 2]
        self.issued += 1
        return c

    def owner(self, plan: OffloadPlan) -> Candidate | None:
        return next((c for c in self.candidates if c.plan is plan), None)

    def record(self, plan: OffloadPlan, ms: float | None, achieved: int) -> None:
        """One step of ``plan`` observed."""
        c = self.owner(plan)
        if c is None:
            return
        c.runs += 1
        if c.runs == 1:
            return
        if ms is not None:
            c.times.append(ms)
        c.achieved.append(achieved)

    @property
    def done(self) -> bool:
        return all(c.runs >= self.steps for c in self.candidates)

    def fits(self, c: Candidate) -> bool:
        """Whether ``c``'s counted steps measured within the budget (their median: one step's blip does not count)."""
        return bool(c.achieved) and statistics.median(c.achieved) <= self.budget_bytes

    def verdict(self) -> tuple[Candidate, str]:
        """The candidate kept, and the line that says why."""
        inc, alt = self.candidates
        pick = choose(inc.times, self.fits(inc), alt.times, self.fits(alt))
        kept = alt if pick == "alternative" else inc

        def said(c: Candidate) -> str:
            ms = f"{statistics.median(c.times):.1f} ms" if c.times else "not timed"
            mem = fmt_bytes(statistics.median(c.achieved)) if c.achieved else "not measured"
            return f"{c.label} ({c.forecast.describe_choices()}): {ms}, {mem}"

        line = (f"ActivationOffload budget: timed two plans, {len(inc.times)} + {len(alt.times)} steps: "
                f"{said(inc)}; {said(alt)}; kept {kept.label} (budget {fmt_bytes(self.budget_bytes)})")
        return kept, line

    def log_entry(self, kept: Candidate) -> dict[str, float]:
        """The trial for the callback's log: each plan's median step, and which was kept."""
        out = {f"activation_budget/trial_{c.label.replace(' ', '_')}_ms": statistics.median(c.times)
               for c in self.candidates if c.times}
        out["activation_budget/trial_kept_recompute_only"] = float(kept is self.alternative)
        return out
