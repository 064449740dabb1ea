"""The budget controller: which step budget mode runs next, and what it learns from each step it measured.

:class:`BudgetController` decides; the engine (:class:`~lightning_gh.activation_offload.engine.ActivationOffloader`)
runs the hooks, pools and copies, and calls :meth:`BudgetController.next_forward` before a forward (the plan it runs
and, for a step to measure, the :class:`Measure` that says what for) and :meth:`BudgetController.observe` after its
backward (an :class:`Observation`: per-block times and saved bytes, the activation peak where memory can be read).

The controller moves through :class:`BudgetState`. ``MEASURE`` walks the measuring schedule (:func:`measuring_schedule`:
a warm-up step, a step with no engine effect at all (the reference of a fraction budget), ``profile_steps`` plain
steps, the lean loss's step where it is weighed, one step per recompute mode with every block in it; a size budget's
:func:`floor_schedule` starts from the floor instead). The planner of :mod:`lightning_gh.activation_offload.budget`
then picks the plan; ``RELAX`` walks a size budget from the floor to it block by block, more blocks a step while
steps add nothing (:func:`~.measure.widen`; planning again from the measurement where it ends well under the
budget: :func:`~.measure.retarget`); ``CORRECT`` measures planned steps and
corrects the overhead estimate (at most two rounds); ``TRIAL`` times a plan that offloads against one that only
recomputes, where both fit, and keeps the faster (:mod:`~.trial`); ``DONE`` keeps the plan. On a compiled model
``COMPILED_MEASURE`` measures one compiled step, ``COMPILED`` has handed the budget to the compiler's own knob (those
steps are in :mod:`~.compiled_budget`, which the controller inherits).

Example::

    >>> from lightning_gh.activation_offload.controller import measuring_schedule
    >>> [m.label for m in measuring_schedule(modes=("full",), profile_steps=1, weigh_lean_loss=False)]
    ['warm-up', 'raw', 'plain', 'full']
"""

from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import replace
from typing import Any, Callable

from lightning_gh._util import fmt_bytes
from lightning_gh.activation_offload import budget as _budget
from lightning_gh.activation_offload.compiled_budget import CompiledBudget
from lightning_gh.activation_offload.measure import (
    MAX_CORRECTIONS,
    MAX_OVERSHOOTS,
    SIZE_FORM,
    WITHIN,
    BudgetState,
    CompilerKnob,
    Correction,
    Kind,
    Measure,
    MemoryProbe,
    Observation,
    Relaxation,
    block0_ms,
    correction,
    device_allows,
    fill_step,
    floor_costs,
    floor_mode,
    floor_refusal,
    floor_schedule,
    lower_bound_refusal,
    measuring_schedule,
    next_width,
    plain_fits_refusal,
    relax_end,
    relax_guard,
    retarget,
    sample_copy_points,
    tracked_activation,
    widen,
)
from lightning_gh.activation_offload.options import ActivationOffloadOptions
from lightning_gh.activation_offload.policy import (
    OffloadPlan,
    StepProfile,
    median_profile,
    plan_all,
    plan_none,
)
from lightning_gh.activation_offload.trial import Candidate, PlanTrial, recompute_only

__all__ = ["MAX_CORRECTIONS", "WITHIN", "BudgetController", "BudgetState", "Correction", "Kind", "Measure",
           "MemoryProbe", "Observation", "correction", "floor_schedule", "measuring_schedule"]

log = logging.getLogger(__name__)

class BudgetController(CompiledBudget):
    """Budget mode's decisions, from the measuring schedule to the corrected plan (see the module docstring).

    Args:
        options: the engine's options (``budget`` set).
        n_blocks: transformer blocks in the model.
        link: returns the link bandwidth ``(d2h, h2d)`` in GB/s.
        on_plan: called with each plan the controller adopts.
        probe: reads the activation memory of a step (see :class:`MemoryProbe`).
        lean_overhead_ms: the lean loss's extra time timed alone on the last logits' shape (``None`` off CUDA).

    Attributes:
        budget: the parsed budget.
        state: see :class:`BudgetState`.
        plan: the plan adopted last (``None`` while measuring).
        profile: the measurements the plan was made from (the head the plan uses).
        budget_bytes: the budget in bytes, once known.
        plain_activation_bytes: the plain step's activation memory (no engine effect at all).
        engine_plain_bytes: the engine's own measuring step's (cast dedupe, weight re-cast).
        forecast: what the adopted plan is expected to do.
        achieved_bytes: the activation memory the plan in force measured (a trial's winner: its median).
        lean_loss_measured: the lean loss's measuring step, when weighed.
        log: one entry per plan, correction round, relaxing step or trial (the callback logs them).
    """

    def __init__(self, options: ActivationOffloadOptions, n_blocks: int, link: Callable[[], tuple[float, float]],
                 on_plan: Callable[[OffloadPlan], None], probe: MemoryProbe,
                 lean_overhead_ms: Callable[[], float | None] = lambda: None) -> None:
        self.options = options
        self.budget = _budget.parse_budget(options.budget)
        self.n = n_blocks
        self.link = link
        self.on_plan = on_plan
        self.probe = probe
        self.lean_overhead_ms = lean_overhead_ms
        self.state = BudgetState.MEASURE
        self.schedule: tuple[Measure, ...] = ()
        self._issued = 0
        self._seen: dict[Measure, list[Observation]] = {}
        self._round = 0
        self._relax: Relaxation | None = None
        self._trial: PlanTrial | None = None
        self.knob = CompilerKnob()
        self.plan: OffloadPlan | None = None
        self.profile: _budget.BudgetProfile | None = None
        self.lean = False  # the adopted plan uses the lean loss
        self.budget_bytes: int | None = None
        self.plain_activation_bytes: int | None = None
        self.engine_plain_bytes: int | None = None
        self.forecast: _budget.BudgetForecast | None = None
        self.achieved_bytes: int | None = None
        self.lean_loss_measured: dict[str, float] | None = None
        self.log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------ the two calls

    def start(self, modes: tuple[str, ...], weigh_lean_loss: bool) -> None:
        """Begin measuring: ``modes`` are the recompute modes the blocks allow.

        A size budget never runs the plain step: it measures from the floor (:func:`floor_schedule`) and relaxes
        towards the plan. A fraction needs the plain step's activation memory; where the device's free memory can be
        read, a floor step and one block kept first predict whether the plain step fits (a clear error if not).
        """
        steps = self.options.profile_steps
        if self.budget.bytes is not None:
            self.schedule = floor_schedule(modes, steps, weigh_lean_loss)
        else:
            self.schedule = measuring_schedule(modes, steps, weigh_lean_loss)
            if self.probe.free_bytes() is not None:
                fm = floor_mode(modes)
                self.schedule = (Measure(Kind.WARMUP, floor_mode=fm), Measure(Kind.SAMPLE, floor_mode=fm)) \
                    + self.schedule
        self.state = BudgetState.MEASURE

    def next_forward(self) -> tuple[OffloadPlan, Measure | None]:
        """The plan of the next training forward, and what it is measured for (``None``: not measured)."""
        if self.state is BudgetState.MEASURE:
            m = self.schedule[self._issued] if self._issued < len(self.schedule) else self._past_schedule()
            self._issued += 1
            return self._measuring_plan(m), m
        if self.state is BudgetState.RELAX:
            pending = self._relax_next()
            if pending is not None:
                return pending[1], Measure(Kind.RELAX, round=self._relax.steps)
        if self.state is BudgetState.TRIAL:
            return self._trial.next().plan, Measure(Kind.TRIAL, round=self._trial.issued)
        assert self.plan is not None
        if self.state is BudgetState.CORRECT:
            return self.plan, Measure(Kind.CHECK, round=self._round)
        return self.plan, None

    def wants(self, measure: Measure, plan: OffloadPlan) -> bool:
        """Whether an observation of this step still matters (older steps finishing late are dropped)."""
        if self.state is BudgetState.MEASURE:
            return measure.kind not in (Kind.CHECK, Kind.RELAX, Kind.TRIAL)
        if self.state is BudgetState.RELAX:
            r = self._relax
            return measure.kind is Kind.RELAX and r.pending is not None and plan is r.pending[1]
        if self.state is BudgetState.TRIAL:
            return measure.kind is Kind.TRIAL and self._trial.owner(plan) is not None
        return self.state is BudgetState.CORRECT and measure.kind is Kind.CHECK and plan is self.plan

    def observe(self, obs: Observation) -> None:
        """Take in one measured step; may adopt a plan or raise ``ValueError`` for an impossible budget."""
        if not self.wants(obs.measure, obs.plan):
            return
        kind = obs.measure.kind
        if kind is Kind.WARMUP:
            self._seen.setdefault(obs.measure, []).append(obs)
            self._check_lower_bound()
            if obs.measure.from_floor:
                self._check_floor(obs)
        elif kind is Kind.RAW:
            self._seen[obs.measure] = [obs]
            if obs.act_peak is not None:
                self.plain_activation_bytes = obs.act_peak
            self._check_lower_bound()
        elif kind is Kind.CHECK:
            self._correct(obs)
        elif kind is Kind.RELAX:
            self._relaxed(obs)
        elif kind is Kind.TRIAL:
            self._tried(obs)
        elif obs.profile is not None:
            self._seen.setdefault(obs.measure, []).append(obs)
            if kind is Kind.SAMPLE and self.budget.fraction is not None:
                self._check_plain_fits(obs)

    def after_observations(self) -> None:
        """Plan once every measuring step of the schedule has been observed."""
        if self.state is BudgetState.MEASURE:
            if self.budget.bytes is not None:
                self._plan_from_floor()
            else:
                self._make_plan()

    @property
    def outside_bytes(self) -> int | None:
        """What the latest warm-up step saved outside the blocks, a lower bound of the floor (``None`` before one)."""
        warm = [o for m, v in self._seen.items() if m.kind is Kind.WARMUP for o in v]
        return warm[-1].other if warm else None

    @property
    def round(self) -> int:
        """The correction round of the plan in force (0: the first plan)."""
        return self._round

    def observations(self, measure: Measure) -> list[Observation]:
        """The observations kept of the measuring steps of ``measure``."""
        return list(self._seen.get(measure, []))

    def adopt(self, plan: OffloadPlan) -> None:
        """Keep ``plan`` (restored from a checkpoint): no measuring."""
        self.plan, self._trial = plan, None
        self.state = BudgetState.DONE

    # ------------------------------------------------------------------------------------ measuring

    def _floor_plan(self, fm: str | None, label: str) -> OffloadPlan:
        o = self.options
        plan = plan_all(self.n, o.skip_last_blocks, o.max_inflight_blocks, o.prefetch_blocks)
        return replace(plan, policy=label, notes=(), modes=(fm,) * self.n if fm else ())

    def _measuring_plan(self, m: Measure) -> OffloadPlan:
        label = {Kind.WARMUP: "budget-warmup", Kind.RAW: "budget-raw"}.get(m.kind, "budget-measure")
        if m.from_floor:
            plan = self._floor_plan(m.floor_mode, label)
            if m.kind is Kind.SAMPLE:  # block 0 in the sampled mode, all it saves offloaded
                modes = (m.mode,) + (m.floor_mode,) * (self.n - 1)
                plan = replace(plan, budgets=(None,) + plan.budgets[1:], modes=modes if any(modes) else (),
                               **sample_copy_points(plan, self.n))
            return replace(plan, lean_loss=m.lean_loss)
        plan = plan_none(self.n, label)
        if m.lean_loss:
            plan = replace(plan, lean_loss=True)
        if m.kind is Kind.MODE:
            plan = replace(plan, modes=(m.mode,) * self.n)
        return plan

    def _past_schedule(self) -> Measure:
        """What a step after the schedule measures while it waits for observations: a size budget's floor step (it
        never runs the plain step), else a plain step."""
        if self.budget.bytes is not None:
            return next(m for m in self.schedule if m.kind is Kind.FLOOR)
        return Measure(Kind.PLAIN)

    def _plain_seen(self) -> list[Observation]:
        return self._seen.get(Measure(Kind.PLAIN), [])

    def _ready(self, counted: Kind = Kind.PLAIN) -> bool:
        """Every measuring step of the schedule observed, a step listed twice twice. Two steps past the schedule's
        end, once is enough, and a size budget's samples not at all (its plan leaves a mode without a sample out;
        the steps past the schedule are floor steps, so the floor count is met): a step whose profile could not
        be read is not waited for forever."""
        need = collections.Counter(m for m in self.schedule if m.kind is not Kind.WARMUP)
        late = self._issued >= len(self.schedule) + 2

        def enough(m: Measure, k: int) -> int:
            return k if not late else (0 if m.kind is Kind.SAMPLE and self.budget.bytes is not None else 1)

        return all(len(self._seen.get(m, ())) >= enough(m, k) for m, k in need.items()) \
            and sum(len(v) for m, v in self._seen.items() if m.kind is counted) >= self.options.profile_steps

    @property
    def offload_last(self) -> bool:  # the plans offload only what recomputing cannot fit
        return self.options.budget_offload == "last"

    def _link(self) -> tuple[float, float, float, int]:
        d2h, h2d = self.link()
        return d2h, h2d, self.options.margin, self.options.skip_last_blocks

    def _make_plan(self) -> None:
        if not self._ready():
            return
        plain = self._plain_seen()
        step = median_profile([o.profile for o in plain])
        modes = [m for m in self.schedule if m.kind is Kind.MODE]
        costs: list[dict[str | None, _budget.ModeCost]] = []
        for i in range(self.n):
            base = step.blocks[i].forward_ms + step.blocks[i].backward_ms
            c: dict[str | None, _budget.ModeCost] = {}
            for m in modes:
                o = self._seen[m][0]
                kept = o.resident[i] + o.used[i] + o.rc_cached.get(i, 0)
                extra = max(0.0, o.profile.blocks[i].forward_ms + o.profile.blocks[i].backward_ms - base)
                c[m.mode] = _budget.ModeCost(kept, min(o.offloadable[i], kept), extra)
            costs.append(c)
        bp = _budget.BudgetProfile(step, tuple(costs), 0)
        d2h, h2d, margin, skip = self._link()
        model_plain = _budget.plan_budget(bp, 2**62, d2h, h2d, margin, skip)[1].activation_bytes
        peaks = [o.act_peak for o in plain if o.act_peak is not None]
        act = int(statistics.median(peaks)) if peaks else model_plain
        self.profile = bp = bp.with_overhead(act - model_plain)
        self.engine_plain_bytes = act
        variants = [(bp, False)]
        lean = Measure(Kind.LEAN, lean_loss=True)
        if lean in self.schedule:
            variants.append((self._lean_profile(bp, self._seen[lean][0]), True))
        # The reference of a fraction: the raw step, measured on CUDA, or on a CPU its tracked saved bytes under the
        # same timeline model as the planner's (so both sides of the comparison count alike).
        raw_obs = self._seen[Measure(Kind.RAW)][0]
        raw = self._achieved(raw_obs)
        self.plain_activation_bytes = raw
        self.budget_bytes = budget = self.budget.resolve(raw)
        if budget >= act:
            self.state = BudgetState.DONE
            self.plan = replace(plan_none(self.n, "budget"), notes=(
                f"budget {fmt_bytes(budget)} ({self.budget.describe()}; the plain step measured {fmt_bytes(raw)}) "
                f">= the {fmt_bytes(act)} the engine's own step needs with its free savings (cast dedupe, weight "
                "re-cast): nothing to do",))
            self.log.append({"activation_budget/target_gib": budget / 2**30,
                             "activation_budget/plain_gib": raw / 2**30,
                             "activation_budget/engine_plain_gib": act / 2**30})
            self.on_plan(self.plan)
            return
        best, err = None, None
        for vbp, use_lean in variants:
            try:
                plan, fc = _budget.plan_budget(vbp, budget, d2h, h2d, margin, skip, self.offload_last)
            except ValueError as e:
                err = e  # the last variant's floor is the lowest (the lean loss's, when weighed)
                continue
            key = (self.offload_last and bool(plan.offloaded_blocks), fc.step_ms)  # offload_last: none first
            if best is None or key < (best[0], best[2].step_ms - 1e-6):
                best = (key[0], plan, fc, vbp, use_lean)
        if best is None:
            self.state = BudgetState.FAILED
            raise ValueError(f"ActivationOffload budget={self.options.budget!r} ({self.budget.describe()}; the "
                             f"plain step measured {fmt_bytes(raw)}): {err} Checked after the {self._issued} "
                             "measuring steps, before any planned step.") from None
        _, plan, fc, self.profile, self.lean = best
        self.state, self._round = BudgetState.CORRECT, 0
        self._adopt_plan(plan, fc)

    def _lean_profile(self, bp: _budget.BudgetProfile, obs: Observation) -> _budget.BudgetProfile:
        lbp, self.lean_loss_measured = _budget.lean_profile(bp, obs.profile, obs.other, obs.act_peak,
                                                            self.lean_overhead_ms(), *self._link())
        return lbp

    def _check_lower_bound(self) -> None:
        """Refuse a budget that no plan can reach as soon as that is certain, before the measuring steps end.

        What the step saves outside the blocks (embedding output, final norm, the head's input and logits) stays on
        the device under every plan, all of it at the end of the forward, so it bounds the floor from below. It is
        known after the warm-up step; a fraction also needs the raw step's measured peak (CUDA). The exact floor
        (full recompute plus offload in every block) needs the measuring steps and is checked right after them.
        """
        other = self.outside_bytes
        if other is None or self.state is not BudgetState.MEASURE:
            return
        if self.budget.bytes is not None:
            budget = self.budget.bytes
        elif self.plain_activation_bytes is not None:
            budget = self.budget.resolve(self.plain_activation_bytes)
        else:
            return
        if budget >= other:
            return
        self.state = BudgetState.FAILED
        of = "" if self.budget.bytes is not None else \
            f" ({self.budget.describe()}; the plain step measured {fmt_bytes(self.plain_activation_bytes)})"
        raise lower_bound_refusal(self.options, budget, other, of, self._issued)

    # ------------------------------------------------------------------------------------ from the floor

    def _check_floor(self, warmup: Observation) -> None:
        """A size budget below the floor's measured activation memory is refused after the floor's warm-up step."""
        floor = warmup.act_peak
        if floor is None or self.budget.bytes is None or self.budget.bytes >= floor:
            return
        self.state = BudgetState.FAILED
        raise floor_refusal(self.options, self.budget.bytes, floor, self._issued)

    def _check_plain_fits(self, sample: Observation) -> None:
        """A fraction needs the plain step: refuse it, naming the size form, when one measured block x the blocks
        predicts that the plain step does not fit in the device's free memory."""
        free = self.probe.free_bytes()
        warm = next((o for m, v in self._seen.items() if m.kind is Kind.WARMUP and m.from_floor for o in v), None)
        if free is None or warm is None or warm.act_peak is None:
            return
        err = plain_fits_refusal(self.options.budget, self.budget.fraction, self.n, free, warm.act_peak,
                                 sum(warm.resident), sample.profile.blocks[0].saved_bytes)
        if err is not None:
            self.state = BudgetState.FAILED
            raise err

    def explain_out_of_memory(self, measure: Measure) -> ValueError | None:
        """The error to raise instead of an out-of-memory error in the measuring step ``measure`` (``None``: none)."""
        if self.budget.fraction is None or measure.from_floor or measure.kind not in (Kind.WARMUP, Kind.RAW, Kind.PLAIN,
                                                                                      Kind.LEAN, Kind.MODE):
            return None
        self.state = BudgetState.FAILED
        return ValueError(f"ActivationOffload budget={self.options.budget!r} is a fraction of the plain step's "
                          f"activation memory, and the step that measures it ran out of device memory. {SIZE_FORM}")

    def _plan_from_floor(self) -> None:
        """A size budget's plan from the floor and sample steps; then relax towards it."""
        if not self._ready(Kind.FLOOR):
            return
        floor = [o for m, v in self._seen.items() if m.kind is Kind.FLOOR for o in v]
        samples = {m.mode: min(v, key=block0_ms) for m, v in self._seen.items() if m.kind is Kind.SAMPLE}
        fm = self.schedule[0].floor_mode
        fprof = median_profile([o.profile for o in floor])
        plain = samples[None].profile.blocks[0] if None in samples else fprof.blocks[0]
        base = plain.forward_ms + plain.backward_ms
        step = StepProfile((plain,) * self.n, fprof.tail_forward_ms, fprof.tail_backward_ms, fprof.other_bytes)
        bp = _budget.BudgetProfile(step, floor_costs(self.n, samples, fm, floor[0], fprof, base), 0)
        d2h, h2d, margin, skip = self._link()
        eligible = max(0, self.n - skip)
        fmix = [(fm, 1.0 if i < eligible and bp.costs[i][fm].offloadable_bytes else 0.0) for i in range(self.n)]
        model = _budget.evaluate(bp, fmix, d2h, h2d, margin)[1].activation_bytes
        peaks = [o.act_peak for o in floor if o.act_peak is not None]
        measured = int(statistics.median(peaks)) if peaks else model
        self.profile = bp = bp.with_overhead(measured - model)
        self.budget_bytes = budget = self.budget.bytes
        self.lean = self.schedule[0].lean_loss
        self.plain_activation_bytes = _budget.evaluate(bp, [(None, 0.0)] * self.n, d2h, h2d, margin)[1].activation_bytes
        try:
            _, fc = _budget.plan_budget(bp, budget, d2h, h2d, margin, skip, self.offload_last)
        except ValueError as e:
            self.state = BudgetState.FAILED
            raise ValueError(f"ActivationOffload budget={self.options.budget!r}: {e} Checked after the {self._issued} "
                             "measuring steps, all at the floor, before any step above it.") from None
        added: dict[str | None, int] = {}  # per sampled mode, the most one of its samples added to the floor
        for m, v in self._seen.items():
            for o in v:
                if m.kind is Kind.SAMPLE and o.act_peak is not None:
                    added[m.mode] = max(added.get(m.mode, 0), o.act_peak - measured, 0)
        self._relax = Relaxation(bp, list(fc.choices), fmix, measured, added, floor_mode=fm)
        self.state = BudgetState.RELAX

    def _relax_next(self) -> tuple[list[tuple[str | None, float]], OffloadPlan, _budget.BudgetForecast] | None:
        """The next mix to measure: the current one with one more block at the plan's choice (more while steps add
        nothing: :func:`~.measure.widen`), if it is predicted to fit
        the budget both ways (the planner's model corrected by the current mix's measurement, and the current
        measurement plus what such a block is expected to add, :func:`relax_guard`) and the device could hold the
        samples' bound on top (:func:`device_allows`); one held back by the guard alone is tried anyway while fewer
        than :data:`MAX_OVERSHOOTS` steps measured above the budget (such a block is not tried again)."""
        r = self._relax
        if r.pending is not None:
            return r.pending
        (d2h, h2d, margin, _), room, held_back = self._link(), self.probe.activation_room(), None
        for i in [i for i in range(self.n) if r.current[i] != r.target[i] and i not in r.skipped]:
            mix = [r.target[i] if j == i else c for j, c in enumerate(r.current)]
            plan, fc = _budget.evaluate(r.bp, mix, d2h, h2d, margin)
            if fc.activation_bytes + r.correction > self.budget_bytes or not device_allows(r, r.target[i], room):
                continue
            step = (mix, replace(plan, lean_loss=self.lean), fc)
            if r.measured + relax_guard(r, r.target[i]) <= self.budget_bytes:
                wide = widen(r, mix, self.budget_bytes, room, lambda m: _budget.evaluate(r.bp, m, d2h, h2d, margin))
                step = step if wide is None else (wide[0], replace(wide[1], lean_loss=self.lean), wide[2])
                r.pending, r.past_guard, r.filling = step, False, False
                return r.pending
            held_back = held_back or step
        if held_back is not None and r.overshoots < MAX_OVERSHOOTS:
            r.pending, r.past_guard, r.filling = held_back, True, False
            return r.pending
        fill = fill_step(r, self.budget_bytes, room, lambda mix: _budget.evaluate(r.bp, mix, d2h, h2d, margin))
        if fill is not None:  # the plan is reached (or held back) well under the budget: a finer step
            r.pending, r.past_guard, r.filling = (fill[1], replace(fill[2], lean_loss=self.lean), fill[3]), False, True
            return r.pending
        self._finish_relax(relax_end(r))
        return None

    def _relaxed(self, obs: Observation) -> None:
        r = self._relax
        mix, _, fc = r.pending
        r.pending, r.steps = None, r.steps + 1
        measured = self._achieved(obs)
        self.log.append({"activation_budget/relax_step": float(r.steps),
                         "activation_budget/achieved_gib": measured / 2**30,
                         "activation_budget/predicted_gib": (fc.activation_bytes + r.correction) / 2**30,
                         "activation_budget/target_gib": self.budget_bytes / 2**30})
        changed = [j for j, (a, b) in enumerate(zip(mix, r.current)) if a != b]
        i = changed[0]
        if measured > r.measured and not r.filling and len(changed) == 1:  # what such a step adds (not a finer one)
            r.step_bytes[mix[i]] = max(r.step_bytes.get(mix[i], 0), measured - r.measured)
        if measured > self.budget_bytes and len(changed) > 1:  # undone; its blocks are tried one at a time
            r.wide_overshoot, r.width = True, 1
            log.info("ActivationOffload budget: relaxing step %d (blocks %s) measured %s, above the budget of %s; "
                     "undone", r.steps, changed, fmt_bytes(measured), fmt_bytes(self.budget_bytes))
            return
        if measured > self.budget_bytes:  # undone: the block keeps its choice and is not tried again
            r.skipped.add(i)
            r.width = 1
            log.info("ActivationOffload budget: relaxing step %d (block %d%s) measured %s, above the budget of %s; "
                     "undone", r.steps, i, ", past the guard" if r.past_guard else "", fmt_bytes(measured),
                     fmt_bytes(self.budget_bytes))
            return
        if not r.filling:
            r.width = next_width(r.width, measured - r.measured, r.wide_overshoot)
        elif measured > r.measured:  # a finer step that added memory ends a plateau too
            r.width = 1
        r.current, r.measured, r.correction = mix, measured, measured - fc.activation_bytes
        if r.filling:  # a finer step is part of the plan now; the next forward's _relax_next goes on or ends
            r.target[i], r.fills = mix[i], r.fills + 1
        elif r.current == r.target:
            retarget(r, self.budget_bytes, lambda bp: _budget.plan_budget(bp, self.budget_bytes, *self._link(),
                                                                        self.offload_last)[1].choices)

    def _finish_relax(self, why: str) -> None:
        r = self._relax
        d2h, h2d, margin, _ = self._link()
        plan, fc = _budget.evaluate(r.bp, r.current, d2h, h2d, margin)
        nothing = not plan.offloaded_blocks and not plan.recompute
        note = (f"budget {fmt_bytes(self.budget_bytes)} (a size: planned from the floor, the plain step never run, "
                f"predicted {fmt_bytes(self.plain_activation_bytes)}); relaxed from the floor in {r.steps} measured "
                f"step(s), {why}: {fc.describe_choices()}; measured {fmt_bytes(r.measured)}, predicted "
                f"{fc.step_ms:.1f} ms fwd+bwd ({fc.ratio:.2f}x the plain step's prediction); block 0 measured: "
                f"{r.bp.describe_block(0)}" + ("; nothing to do" if nothing else ""))
        self.plan = replace(plan, notes=(note,), lean_loss=self.lean)
        self.forecast = replace(fc, activation_bytes=fc.activation_bytes + r.correction)
        self.achieved_bytes = r.measured
        self.log.append({"activation_budget/target_gib": self.budget_bytes / 2**30,
                         "activation_budget/predicted_gib": self.forecast.activation_bytes / 2**30,
                         "activation_budget/achieved_gib": r.measured / 2**30,
                         "activation_budget/predicted_ms": fc.step_ms,
                         "activation_budget/lean_loss": float(self.lean)})
        self.on_plan(self.plan)
        self._settled()

    # ------------------------------------------------------------------------------------ planned steps

    def _adopt_plan(self, plan: OffloadPlan, fc: _budget.BudgetForecast) -> None:
        act, budget = self.plain_activation_bytes, self.budget_bytes
        d2h, h2d, margin, _ = self._link()
        rnd = f" (correction {self._round})" if self._round else ""
        note = (f"budget {fmt_bytes(budget)} ({self.budget.describe()}; the plain step measured "
                f"{fmt_bytes(act)}, the engine's measuring step {fmt_bytes(self.engine_plain_bytes)}); plan{rnd}: "
                f"{fc.describe_choices()}; predicted {fmt_bytes(fc.activation_bytes)} at {fc.step_ms:.1f} ms "
                f"fwd+bwd ({fc.ratio:.2f}x the plain {fc.plain_step_ms:.1f} ms: recompute +{fc.recompute_ms:.1f} ms, "
                f"link stall +{fc.stall_ms:.1f} ms at {d2h:.0f}/{h2d:.0f} GB/s, margin {margin:.0%})")
        if self.lean:
            lm = self.lean_loss_measured
            note += (f"; lean loss on (its measured step: {fmt_bytes(lm['activation_gib'] * 2**30)}, head "
                     f"{lm['head_extra_ms']:+.1f} ms)")
        self.plan = replace(plan, notes=(note,), lean_loss=self.lean)
        self.forecast = fc
        self.log.append({"activation_budget/target_gib": budget / 2**30,
                         "activation_budget/plain_gib": act / 2**30,
                         "activation_budget/engine_plain_gib": self.engine_plain_bytes / 2**30,
                         "activation_budget/predicted_gib": fc.activation_bytes / 2**30,
                         "activation_budget/predicted_ms": fc.step_ms,
                         "activation_budget/round": float(self._round),
                         "activation_budget/lean_loss": float(self.lean)})
        self.on_plan(self.plan)

    def _achieved(self, obs: Observation) -> int:
        """A step's activation memory: measured on CUDA, else from the bytes the engine tracked."""
        return obs.act_peak if obs.act_peak is not None else tracked_activation(self.profile, obs, *self._link()[:3])

    def _correct(self, obs: Observation) -> None:
        """Compare the planned step's measured activation memory with the budget; plan again if it is off."""
        achieved = self._achieved(obs)
        budget, fc, ms = self.budget_bytes, self.forecast, obs.step_ms
        entry = {"activation_budget/achieved_gib": achieved / 2**30, "activation_budget/round": float(self._round),
                 "activation_budget/target_gib": budget / 2**30,
                 "activation_budget/predicted_gib": fc.activation_bytes / 2**30}
        if ms is not None:
            entry["activation_budget/measured_ms"] = ms
        self.log.append(entry)
        self.achieved_bytes = achieved
        decision = correction(achieved, budget, self._round)
        msg = (f"ActivationOffload budget round {self._round}: achieved {fmt_bytes(achieved)} against "
               f"{fmt_bytes(budget)} (predicted {fmt_bytes(fc.activation_bytes)})"
               + (f", fwd+bwd {ms:.1f} ms (predicted {fc.step_ms:.1f} ms)" if ms is not None else ""))
        if decision is not Correction.REPLAN:
            log.info("%s: %s", msg, "within the budget" if decision is Correction.WITHIN
                     else "kept (no more correction rounds)")
            self._settled()
            return
        bp = self.profile.with_overhead(self.profile.overhead_bytes + achieved - fc.activation_bytes)
        d2h, h2d, margin, skip = self._link()
        try:
            plan, new_fc = _budget.plan_budget(bp, budget, d2h, h2d, margin, skip, self.offload_last)
        except ValueError as e:
            self.state = BudgetState.DONE
            log.warning("%s; no correction fits: %s", msg, e)
            return
        log.info("%s; correcting the overhead estimate by %s", msg, fmt_bytes(achieved - fc.activation_bytes))
        self.profile = bp
        self._round += 1
        self._adopt_plan(plan, new_fc)

    # ------------------------------------------------------------------------------------ the trial

    def _settled(self) -> None:
        """The plan in force is settled: keep it, or first time it against the plan that offloads nothing, where the
        options leave offload to the planner (``budget_offload`` ``True`` or left to the run) and that plan fits."""
        self.state = BudgetState.DONE
        alt = None if self.options.budget_offload not in (None, True) or self.profile is None else recompute_only(
            self.profile, self.plan, self.forecast, self.achieved_bytes, self.budget_bytes, self._link()[:3],
            self.probe.activation_room(), self.lean)
        if alt is not None:
            self._trial = PlanTrial(Candidate("the plan", self.plan, self.forecast),
                                    Candidate("recompute only", *alt), self.budget_bytes)
            self.state = BudgetState.TRIAL

    def _tried(self, obs: Observation) -> None:
        t = self._trial
        achieved = self._achieved(obs)
        t.record(obs.plan, obs.step_ms, achieved)
        if not t.done:
            return
        kept, line = t.verdict()
        log.info(line)
        self.log.append(t.log_entry(kept))
        self.state, self._trial = BudgetState.DONE, None
        if kept is not t.incumbent:
            self.plan, self.forecast, self.achieved_bytes = kept.plan, kept.forecast, statistics.median(kept.achieved)
            self.on_plan(self.plan)
