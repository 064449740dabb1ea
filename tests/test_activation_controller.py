"""The budget controller through its two calls: ``next_forward()`` (what the next step runs and measures) and
``observe()`` (what a measured step did). Synthetic observations, no model: each decision is a table row."""

from __future__ import annotations

import pytest

from lightning_gh.activation_offload import ActivationOffloadOptions
from lightning_gh.activation_offload.controller import (
    MAX_CORRECTIONS,
    BudgetController,
    BudgetState,
    Correction,
    Kind,
    Measure,
    Observation,
    correction,
    measuring_schedule,
)
from lightning_gh.activation_offload.policy import BlockProfile, OffloadPlan, StepProfile
from lightning_gh.activation_offload.trial import PlanTrial, choose, recompute_only

MIB = 2**20
N = 4


class NoMemory:
    """A probe that reads nothing (a CPU): the controller counts tracked bytes, or takes ``act_peak`` as given."""

    def start(self):
        return None

    def peak(self, base):
        return None

    def free_bytes(self):
        return None

    def activation_room(self):
        return None


def _controller(budget, modes=("full",), lean=False, **opts):
    plans: list[OffloadPlan] = []
    options = ActivationOffloadOptions(budget=budget, profile_steps=1, bandwidth_gbps=50.0, **opts)
    ctl = BudgetController(options, N, lambda: (50.0, 50.0), plans.append, NoMemory())
    ctl.start(modes, weigh_lean_loss=lean)
    return ctl, plans


def _step(fwd=1.0, bwd=2.0, offloadable=100 * MIB, resident=0, other=10 * MIB):
    return StepProfile(tuple(BlockProfile(fwd, bwd, offloadable, resident) for _ in range(N)), 0.5, 1.0, other)


def _obs(measure, plan, *, act_peak=None, kept=100 * MIB, other=10 * MIB, step=None, used=0, ms=None):
    """What the engine would report: ``kept`` bytes stay in each block (offloadable unless ``full`` recompute)."""
    full = measure.kind is Kind.MODE and measure.mode == "full"
    offl = 0 if full else kept
    return Observation(measure, plan, step if step is not None else _step(bwd=3.0 if full else 2.0, offloadable=offl,
                                                                          resident=kept - offl),
                       (used,) * N, (offl,) * N, (kept - used,) * N, {}, other, act_peak, ms)


def _run_schedule(ctl, plain_peak=420 * MIB):
    """Observe every measuring step the controller asks for; return the measures in order."""
    seen = []
    while ctl.state is BudgetState.MEASURE:
        plan, m = ctl.next_forward()
        seen.append(m)
        kept = 2 * MIB if m.kind is Kind.MODE and m.mode == "full" else 100 * MIB
        peak = None if m.kind is Kind.WARMUP else (plain_peak if m.kind is not Kind.MODE else 20 * MIB)
        ctl.observe(_obs(m, plan, act_peak=peak, kept=kept))
        ctl.after_observations()
    return seen


@pytest.mark.parametrize("modes, steps, lean, labels", [
    ((), 1, False, ["warm-up", "raw", "plain"]),
    (("full",), 2, False, ["warm-up", "raw", "plain", "plain", "full"]),
    (("norm-act", "selective", "full"), 1, True,
     ["warm-up", "raw", "plain", "lean-loss", "norm-act", "selective", "full"]),
])
def test_measuring_schedule_is_data(modes, steps, lean, labels):
    schedule = measuring_schedule(modes, steps, lean)
    assert [m.label for m in schedule] == labels
    assert schedule[0].lean_loss == lean  # the warm-up runs the lean loss when it is weighed
    assert [m.raw for m in schedule] == [label == "raw" for label in labels]


def test_next_forward_walks_the_schedule_then_measures_plain_steps_until_observed():
    ctl, _ = _controller(0.5, modes=("full",))
    plans = [ctl.next_forward() for _ in range(5)]
    assert [m.label for _, m in plans] == ["warm-up", "raw", "plain", "full", "plain"]
    assert [p.policy for p, _ in plans[:2]] == ["budget-warmup", "budget-raw"]
    assert plans[3][0].modes == ("full",) * N and not plans[2][0].modes
    assert all(not p.offloaded_blocks for p, _ in plans)  # measuring steps move nothing


@pytest.mark.parametrize("achieved, round_, expected", [
    (100, 0, Correction.WITHIN),
    (95, 0, Correction.WITHIN),
    (94, 0, Correction.REPLAN),  # further below than needed: plan again, faster
    (101, 0, Correction.REPLAN),
    (101, MAX_CORRECTIONS - 1, Correction.REPLAN),
    (101, MAX_CORRECTIONS, Correction.LAST_ROUND),
    (50, MAX_CORRECTIONS, Correction.LAST_ROUND),
    (99, MAX_CORRECTIONS, Correction.WITHIN),
])
def test_correction_decision(achieved, round_, expected):
    assert correction(achieved, 100, round_) is expected


def test_fraction_budget_plans_after_the_schedule_and_checks_the_planned_step():
    ctl, plans = _controller(0.5)
    seen = _run_schedule(ctl)
    assert [m.label for m in seen] == ["warm-up", "raw", "plain", "full"]
    assert ctl.state is BudgetState.CORRECT and plans and plans[-1] is ctl.plan
    assert ctl.plain_activation_bytes == 420 * MIB and ctl.budget_bytes == 210 * MIB
    assert ctl.forecast.activation_bytes <= ctl.budget_bytes
    plan, m = ctl.next_forward()
    assert plan is ctl.plan and m == Measure(Kind.CHECK, round=0)
    assert ctl.log[-1]["activation_budget/predicted_gib"] == ctl.forecast.activation_bytes / 2**30


@pytest.mark.parametrize("achieved_share, state, rounds", [
    (0.97, BudgetState.TRIAL, 0),  # within: keep, after timing it against recomputing alone (it offloads)
    (1.20, BudgetState.CORRECT, 1),  # over: correct the overhead and check again
    (0.50, BudgetState.CORRECT, 1),  # far under: plan again with the memory to spare
])
def test_observed_planned_step_table(achieved_share, state, rounds):
    ctl, plans = _controller(0.5)
    _run_schedule(ctl)
    plan, m = ctl.next_forward()
    n_plans = len(plans)
    ctl.observe(_obs(m, plan, act_peak=int(achieved_share * ctl.budget_bytes), ms=4.0))
    assert ctl.state is state and ctl.achieved_bytes == int(achieved_share * ctl.budget_bytes)
    assert len(plans) == n_plans + rounds
    assert ctl.log[-1 - rounds]["activation_budget/measured_ms"] == 4.0


def _settled(**opts):
    """A fraction budget whose plan offloads, checked within the budget: the trial starts."""
    ctl, plans = _controller(0.5, **opts)
    _run_schedule(ctl)
    plan, m = ctl.next_forward()
    ctl.observe(_obs(m, plan, act_peak=int(0.97 * ctl.budget_bytes), ms=4.0))
    return ctl, plans


@pytest.mark.parametrize("inc, alt, inc_fits, alt_fits, kept", [
    ([5.0, 5.1, 5.0], [4.0, 4.1, 4.0], True, True, "recompute only"),  # faster: taken
    ([5.0, 5.1, 5.0], [4.98, 5.0, 4.97], True, True, "the plan"),  # within the margin: the plan stays
    ([5.0, 5.1, 5.0], [4.0, 4.1, 4.0], True, False, "the plan"),  # faster but measured over the budget
    ([5.0, 5.1, 5.0], [6.0, 6.1, 6.0], False, True, "recompute only"),  # the plan over the budget
])
def test_trial_times_the_plan_against_recomputing_alone_and_keeps_the_faster(inc, alt, inc_fits, alt_fits, kept):
    ctl, plans = _settled()
    assert ctl.state is BudgetState.TRIAL and ctl.plan.offloaded_blocks
    incumbent, n_plans, times = ctl.plan, len(plans), {True: [9.0] + inc, False: [9.0] + alt}
    steps = []
    while ctl.state is BudgetState.TRIAL:
        plan, m = ctl.next_forward()
        steps.append((plan is incumbent, m.kind))
        mine = plan is incumbent
        fits = inc_fits if mine else alt_fits
        ms = times[mine].pop(0)  # the first step of each is not counted: 9.0 ms never decides
        ctl.observe(_obs(m, plan, act_peak=int((0.9 if fits else 1.2) * ctl.budget_bytes), ms=ms))
    assert [k for _, k in steps] == [Kind.TRIAL] * 8 and [i for i, _ in steps] == [True, False] * 4  # interleaved
    assert ctl.state is BudgetState.DONE and ctl.next_forward()[1] is None
    if kept == "the plan":
        assert ctl.plan is incumbent and len(plans) == n_plans
    else:
        assert not ctl.plan.offloaded_blocks and plans[-1] is ctl.plan and len(plans) == n_plans + 1
        assert "the plan that only recomputes" in ctl.plan.describe() and ctl.plan.lean_loss == incumbent.lean_loss
    assert ctl.log[-1]["activation_budget/trial_kept_recompute_only"] == float(kept == "recompute only")


@pytest.mark.parametrize("budget_offload", [False, "last"])
def test_no_trial_where_the_options_decide_offload(budget_offload):
    ctl, _ = _settled(budget_offload=budget_offload)
    assert ctl.state is BudgetState.DONE and ctl.next_forward()[1] is None


def test_no_trial_where_recomputing_alone_cannot_reach_the_budget_or_the_device():
    ctl, _ = _controller(0.5)
    _run_schedule(ctl)
    args = (ctl.profile, ctl.plan, ctl.forecast, None)
    assert ctl.plan.offloaded_blocks and recompute_only(*args, ctl.budget_bytes, (50.0, 50.0, 0.25), None, False)
    assert recompute_only(*args, 1, (50.0, 50.0, 0.25), None, False) is None  # one byte: nothing fits
    assert recompute_only(*args, ctl.budget_bytes, (50.0, 50.0, 0.25), 1, False) is None  # the device is full
    # The plan in force measured some bytes above its forecast: the other plan is planned for the budget less them.
    exact = recompute_only(*args, ctl.budget_bytes, (50.0, 50.0, 0.25), None, False)[1].activation_bytes
    err = ctl.budget_bytes - exact + MIB  # the other plan, as planned for the whole budget, would then not fit
    alt = recompute_only(ctl.profile, ctl.plan, ctl.forecast, ctl.forecast.activation_bytes + err, ctl.budget_bytes,
                         (50.0, 50.0, 0.25), None, False)
    assert alt[1].activation_bytes <= ctl.budget_bytes < exact + err  # a tighter plan (one more block), forecast
    # with the error included, as the plan in force's forecast is
    assert alt[1].describe_choices() == "0-3 full"
    over = ctl.budget_bytes  # the plan in force measured a whole budget above its forecast: so would the other
    assert recompute_only(ctl.profile, ctl.plan, ctl.forecast, ctl.forecast.activation_bytes + over,
                          ctl.budget_bytes, (50.0, 50.0, 0.25), None, False) is None


@pytest.mark.parametrize("inc, inc_fits, alt, alt_fits, expected", [
    ([80.0, 81.0, 80.5], True, [78.0, 77.5, 78.2], True, "alternative"),
    ([80.0, 81.0, 80.5], True, [80.0, 79.9, 80.1], True, "incumbent"),  # within the margin
    ([80.0, 81.0, 80.5], True, [], True, "incumbent"),  # not timed
    ([], True, [70.0], True, "incumbent"),
    ([80.0], False, [90.0], True, "alternative"),  # only one within the budget
    ([80.0], True, [70.0], False, "incumbent"),
    ([80.0], False, [70.0], False, "incumbent"),
])
def test_choose_is_a_table(inc, inc_fits, alt, alt_fits, expected):
    assert choose(inc, inc_fits, alt, alt_fits) == expected


def test_a_plan_trial_needs_two_steps_a_plan():
    with pytest.raises(ValueError, match=r"steps=1 must be an int >= 2"):
        PlanTrial(None, None, 1, steps=1)


def test_a_trial_ignores_steps_of_neither_plan_late_steps_and_checks_and_a_restore_ends_it():
    ctl, _ = _settled()
    incumbent, m = ctl.next_forward()
    other_plan = _controller(0.5)[0].next_forward()[0]
    ctl.observe(_obs(Measure(Kind.TRIAL, round=1), other_plan, act_peak=1, ms=1.0))  # neither candidate's
    ctl.observe(_obs(Measure(Kind.CHECK, round=0), incumbent, act_peak=1, ms=1.0))  # a check finishing late
    assert ctl.state is BudgetState.TRIAL and all(c.runs == 0 for c in ctl._trial.candidates)
    ctl.observe(_obs(m, incumbent, act_peak=1, ms=1.0))
    assert ctl._trial.incumbent.runs == 1
    ctl.adopt(incumbent)  # a checkpoint's plan restored mid-trial: kept, nothing more measured
    assert ctl.state is BudgetState.DONE and ctl._trial is None and ctl.next_forward()[1] is None
    ctl.observe(_obs(m, incumbent, act_peak=1, ms=1.0))  # a trial step finishing after the end
    assert ctl.state is BudgetState.DONE and ctl.plan is incumbent


def test_the_kept_recompute_only_plan_carries_its_corrected_forecast():
    ctl, plans = _settled()
    alt = ctl._trial.alternative
    assert alt.forecast.activation_bytes <= ctl.budget_bytes and not alt.plan.offloaded_blocks
    while ctl.state is BudgetState.TRIAL:
        plan, m = ctl.next_forward()
        ctl.observe(_obs(m, plan, act_peak=int(0.9 * ctl.budget_bytes), ms=5.0 if plan is alt.plan else 9.0))
    assert ctl.plan is alt.plan and ctl.forecast is alt.forecast and ctl.achieved_bytes == int(0.9 * ctl.budget_bytes)


def test_correction_rounds_end():
    ctl, _ = _controller(0.5)
    _run_schedule(ctl)
    checks = []
    while ctl.state is BudgetState.CORRECT and len(checks) < 10:
        plan, m = ctl.next_forward()
        checks.append(m)
        ctl.observe(_obs(m, plan, act_peak=ctl.budget_bytes + MIB))  # always just over
    assert ctl.state is BudgetState.DONE
    assert [m.round for m in checks] == list(range(MAX_CORRECTIONS + 1))
    assert ctl.next_forward()[1] is None  # the plan stays, nothing more is measured


def test_a_stale_check_of_an_older_plan_is_ignored():
    ctl, _ = _controller(0.5)
    _run_schedule(ctl)
    old_plan, m = ctl.next_forward()
    over = int(1.1 * ctl.budget_bytes)
    ctl.observe(_obs(m, old_plan, act_peak=over))  # round 0 -> a new plan
    assert ctl.plan is not old_plan
    ctl.observe(_obs(m, old_plan, act_peak=ctl.budget_bytes))  # the old plan's second step finishing late
    assert ctl.state is BudgetState.CORRECT and ctl.achieved_bytes == over


def test_budget_above_the_plain_step_is_nothing_to_do():
    ctl, plans = _controller(1.0)
    _run_schedule(ctl)
    assert ctl.state is BudgetState.DONE and not ctl.plan.offloaded_blocks and not ctl.plan.recompute
    assert "nothing to do" in ctl.plan.describe() and plans == [ctl.plan]


def test_fraction_below_the_floor_is_refused_after_the_measuring_steps():
    ctl, _ = _controller(0.05)
    with pytest.raises(ValueError, match=r"budget=0.05 \(5% of the plain step's activation memory; the plain step "
                                         r"measured 420.0 MiB\).*floor of full recompute plus offload.*Checked after "
                                         r"the 4 measuring steps, before any planned step"):
        _run_schedule(ctl)
    assert ctl.state is BudgetState.FAILED and ctl.forecast is None


def test_what_the_step_saves_outside_the_blocks_bounds_the_floor():
    ctl, _ = _controller(0.02)
    plan, m = ctl.next_forward()
    ctl.observe(_obs(m, plan, other=10 * MIB))  # warm-up: a fraction needs the raw step's peak first
    assert ctl.state is BudgetState.MEASURE and ctl.outside_bytes == 10 * MIB
    plan, m = ctl.next_forward()
    with pytest.raises(ValueError, match=r"8.4 MiB \(2% of .* the plain step measured 420.0 MiB\).*at least 10.0 MiB"):
        ctl.observe(_obs(m, plan, act_peak=420 * MIB))
    assert ctl.state is BudgetState.FAILED


def test_restored_plan_is_kept_without_measuring():
    ctl, _ = _controller(0.5)
    plan = OffloadPlan("budget", (None, 0), (2, 3), (1, 2), modes=(None, "full"))
    ctl.adopt(plan)
    assert ctl.state is BudgetState.DONE and ctl.next_forward() == (plan, None)


def test_compiled_model_fraction_goes_to_the_compiler_and_is_restored():
    import torch._functorch.config as fconfig

    before = fconfig.activation_memory_budget
    ctl, plans = _controller(0.5)
    ctl.start_compiled("model", on_cuda=False)
    assert ctl.state is BudgetState.COMPILED and fconfig.activation_memory_budget == 0.5
    assert plans[-1].policy == "budget-compiled"
    ctl.close()
    assert fconfig.activation_memory_budget == before
    size, _ = _controller("1GiB")
    with pytest.raises(ValueError, match="pass a fraction"):
        size.start_compiled("model", on_cuda=False)
    assert size.state is BudgetState.FAILED


def _relax_run(budget, room, increments, kept=100, sample=100):
    """A size budget from the floor (100 MiB measured; a block keeping ``kept`` MiB sampled at ``sample`` MiB above
    it) whose relaxing steps each measure ``increments[k]`` MiB above the last; the probe says the device can hold
    ``room`` (``None``: unknown)."""
    ctl, _ = _controller(budget)
    ctl.probe.activation_room = lambda: room
    measured, relaxed = 100 * MIB, []
    for _ in range(20):
        if ctl.state is BudgetState.DONE:
            break
        plan, m = ctl.next_forward()
        if m is None:
            break
        peak = {Kind.FLOOR: 100 * MIB, Kind.SAMPLE: (100 + sample) * MIB}.get(m.kind)
        if m.kind is Kind.RELAX:
            peak = measured + increments[len(relaxed)] * MIB
            relaxed.append(peak // MIB)
            measured = peak if peak <= ctl.budget_bytes else measured
        ctl.observe(_obs(m, plan, act_peak=peak, kept=kept * MIB))
        ctl.after_observations()
    return ctl, relaxed


@pytest.mark.parametrize("budget, room, increments, relaxed, why", [
    # the first relaxing step is guarded by the sample (+100 MiB); the next ones by what relaxing steps added
    ("210MiB", None, [10, 10, 10, 10], [110, 120, 130, 140], "the plan is reached"),
    # a step that adds more than the steps before it measures above the budget: undone, its block keeps its
    # choice; the next block, held back by the guard (now 95 MiB), is tried anyway and fits
    ("210MiB", None, [10, 10, 95, 10], [110, 120, 215, 130], "relaxing steps measured above the budget"),
    # two steps above the budget end the relaxation
    ("210MiB", None, [10, 95, 95, 10], [110, 205, 300, 215], "relaxing steps measured above the budget"),
    # the device could not hold the sample's bound on top of the measurement: no step above the floor (nor a
    # finer one: the room must hold all that a block offloads, 100 MiB)
    ("210MiB", 150 * MIB, [10, 10, 10, 10], [], "the next block's plan would not fit"),
    ("210MiB", 225 * MIB, [10, 10, 10, 10], [110, 120, 130], "the next block's plan would not fit"),
    # below the floor plus one sampled block: the guard holds every block back, the first is tried anyway, and
    # what it added then guards the rest
    ("190MiB", None, [10, 10, 10, 10], [110, 120, 130, 140], "the plan is reached"),
])
def test_relaxing_is_guarded_by_what_relaxing_steps_added_and_by_the_device(budget, room, increments, relaxed, why):
    ctl, seen = _relax_run(budget, room, increments)
    assert ctl.state is BudgetState.DONE and seen == relaxed, seen
    assert why in ctl.plan.notes[0], ctl.plan.notes[0]
    assert ctl.achieved_bytes <= ctl.budget_bytes


@pytest.mark.parametrize("choice, expected_mib", [
    (("selective", 1.0), 40),   # offloaded in full: what its sample added
    (("selective", 0.5), 40),   # half of 60 MiB kept on the device is less than the sample's 40 MiB
    ((None, 0.0), 100),         # keeping a whole block: its kept bytes
    (("full", 0.0), 8),         # the floor's mode (no sample) with its input kept: that input
    (("full", 1.0), 0),         # the floor itself
    (("norm-act", 1.0), 100),   # a mode without a kept size: the most any sample added
])
def test_sample_guard_counts_a_choice_by_its_sample_and_its_kept_share(choice, expected_mib):
    from lightning_gh.activation_offload.budget import BudgetProfile, ModeCost
    from lightning_gh.activation_offload.measure import Relaxation, sample_guard

    costs = ({None: ModeCost(100 * MIB, 90 * MIB), "selective": ModeCost(60 * MIB, 60 * MIB, 1.0),
              "full": ModeCost(8 * MIB, 8 * MIB, 3.0)},) * N
    r = Relaxation(BudgetProfile(_step(), costs), [], [], 0, mode_bytes={None: 100 * MIB, "selective": 40 * MIB},
                   floor_mode="full")
    assert sample_guard(r, choice) == expected_mib * MIB


@pytest.mark.parametrize("measured_mib, correction_mib, planned, expected, why", [
    # reached 100 MiB of a 200 MiB budget, 30 MiB under its prediction: plan again with 30 MiB more room
    (100, -30, [("selective", 1.0), (None, 0.0)], True, "a new target"),
    (195, -30, [("selective", 1.0), (None, 0.0)], False, "within 5% of the budget: not planned again"),
    (100, -30, [("full", 1.0), ("full", 1.0)], False, "the same mix: nothing left to relax"),
    (100, -30, ValueError("no plan fits"), False, "no plan fits the corrected model: keep what was reached"),
])
def test_retarget_plans_once_more_from_the_measurement(measured_mib, correction_mib, planned, expected, why):
    from lightning_gh.activation_offload.budget import BudgetProfile, ModeCost
    from lightning_gh.activation_offload.measure import MAX_RETARGETS, Relaxation, retarget

    bp = BudgetProfile(_step(), ({None: ModeCost(100 * MIB, 90 * MIB)},) * N, 7 * MIB)
    floor = [("full", 1.0), ("full", 1.0)]
    r = Relaxation(bp, list(floor), list(floor), measured_mib * MIB, correction=correction_mib * MIB)
    seen = []

    def plan(profile):
        seen.append(profile.overhead_bytes)
        if isinstance(planned, Exception):
            raise planned
        return planned

    assert retarget(r, 200 * MIB, plan) is expected, why
    if measured_mib < 190:  # planned once, from the overhead moved by the correction
        assert seen == [(7 + correction_mib) * MIB]
    else:
        assert seen == []
    assert r.retargets == int(expected)  # counts the new targets only
    if expected:
        assert r.target == planned and r.correction == 0 and r.bp.overhead_bytes == (7 + correction_mib) * MIB
        r.current = list(planned)  # reached again, as far under the budget: planned again, up to MAX_RETARGETS
        def alternate(profile):
            seen.append(profile.overhead_bytes)
            return [("full", 0.0), ("full", 0.0)] if len(seen) % 2 == 0 else planned

        while retarget(r, 200 * MIB, alternate):
            r.current = list(r.target)
        assert r.retargets == MAX_RETARGETS and len(seen) == MAX_RETARGETS
    else:
        assert r.target == floor and r.bp is bp


def _fill_relaxation(measured_mib, current, skipped=(), correction_mib=0):
    from lightning_gh.activation_offload.budget import BudgetProfile, ModeCost
    from lightning_gh.activation_offload.measure import Relaxation

    costs = ({None: ModeCost(100 * MIB, 90 * MIB), "selective": ModeCost(60 * MIB, 40 * MIB, 1.0),
              "full": ModeCost(8 * MIB, 8 * MIB, 3.0)},) * N
    r = Relaxation(BudgetProfile(_step(), costs), list(current), list(current), measured_mib * MIB,
                   correction=correction_mib * MIB)
    r.skipped.update(skipped)
    return r


@pytest.mark.parametrize("measured, current, kw, fast, expected, why", [
    # 100 of 130 MiB: the band is 123.5-130, its middle 26.75 MiB away; selective block 1 keeping 3/4 of its
    # 40 MiB offloadable (+30) is nearest among the steps that fit
    (100, [("full", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.0)], {}, None, (1, ("selective", 0.25)),
     "the addition nearest the middle of the band"),
    # a step predicted faster wins over one that lands nearer the middle
    (100, [("full", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.0)], {}, 2, (2, ("full", 0.0)),
     "the fastest predicted first"),
    (125, [("full", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.0)], {}, None, None,
     "within 5% of the budget: no finer step"),
    (100, [("full", 1.0), ("selective", 1.0), ("full", 0.0), ("full", 0.0)], {"skipped": {1}}, None,
     (0, ("full", 0.0)), "a block whose step measured above the budget is not tried again; nothing offloaded, "
     "nothing to keep"),
    (100, [("full", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.0)], {"skipped": {0, 2}}, None, None,
     "two steps above the budget end the finer steps too"),
    # the room must hold all that the block offloads (the engine moves whole tensors): the full blocks' 8 MiB fit
    # in 110, the selective block's 40 do not
    (100, [("full", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.0)], {"room": 110}, None,
     (0, ("full", 0.0)), "the device's room bounds which blocks may keep more"),
    (100, [("full", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.0)], {"correction_mib": 127}, None, None,
     "the corrected model says nothing fits"),
])
def test_fill_step_keeps_a_share_of_one_block_towards_the_budget(measured, current, kw, fast, expected, why):
    from lightning_gh.activation_offload.budget import BudgetForecast
    from lightning_gh.activation_offload.measure import fill_step

    kw = dict(kw)
    room = kw.pop("room", None)
    r = _fill_relaxation(measured, current, **kw)
    r.correction = kw.get("correction_mib", 0) * MIB

    def evaluate(mix):
        changed = next(i for i, (a, b) in enumerate(zip(mix, current)) if a != b)
        return None, BudgetForecast(4 * MIB, 10.0 - (changed == fast), 10.0, 0.0, 0.0)

    got = fill_step(r, 130 * MIB, None if room is None else room * MIB, evaluate)
    assert (got and (got[0], got[1][got[0]])) == expected, why
    if got is not None:
        assert [c for j, c in enumerate(got[1]) if j != got[0]] == [c for j, c in enumerate(current) if j != got[0]]


@pytest.mark.parametrize("increments, relaxed, why, band", [
    # the guards hold the last block back at 106 of 112 MiB, under the 5% band: one finer step (block 0 keeps half
    # of what it offloads) lands in it
    ([1] * 8, [101, 102, 103, 104, 105, 106, 107], "the next block's plan would not fit, then 1 finer step(s)", True),
    # a relaxing step above the budget is undone; finer steps follow until the band is reached
    ([1, 1, 1, 20, 1, 1, 1, 1], [101, 102, 103, 123, 104, 105, 106, 107],
     "relaxing steps measured above the budget, then 4 finer step(s)", True),
    # finer steps that move nothing: until every block keeps all it saves (7 here) ...
    ([1] * 6 + [0] * 12, [101, 102, 103, 104, 105, 106] + [106] * 7, "then 7 finer step(s)", False),
    # ... or MAX_FILLS of them (3 here)
    ([1] * 6 + [0] * 12, [101, 102, 103, 104, 105, 106] + [106] * 3, "then 3 finer step(s)", False),
    # a finer step that measures less than it was predicted to corrects the model: the held-back block relaxes
    # after it (a relaxing step, planned again on reaching the plan), then finer steps go on until no block offloads
    ([1] * 6 + [-3, 1, 1, 1, 1], [101, 102, 103, 104, 105, 106, 103, 104, 105, 106],
     "the plan is reached (planned 2 more time(s) from the measurement), then 4 finer step(s)", False),
    ([1] * 6 + [-5, 1, 1, 1], [101, 102, 103, 104, 105, 106, 101, 102, 103],
     "the plan is reached (planned 3 more time(s) from the measurement), then 1 finer step(s)", False),
])
def test_finer_steps_follow_a_relaxation_that_ends_under_the_band(increments, relaxed, why, band, monkeypatch):
    from lightning_gh.activation_offload import measure

    if "3 finer" in why:
        monkeypatch.setattr(measure, "MAX_FILLS", 3)
    ctl, seen = _relax_run("112MiB", None, increments, kept=10, sample=10)
    assert ctl.state is BudgetState.DONE and seen == relaxed, seen
    assert why in ctl.plan.notes[0], ctl.plan.notes[0]
    assert ctl.achieved_bytes <= ctl.budget_bytes
    assert (ctl.achieved_bytes >= 0.95 * ctl.budget_bytes) is band  # else no block offloads any more, or the cap
