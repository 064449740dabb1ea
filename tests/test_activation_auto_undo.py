"""``policy="auto"`` keeps its promise: the check of a plan leaves out the first step with it (what the plan sets up is
paid once), judges the steady steps, and a plan undone (or one that offloads nothing) leaves the step exactly as it is
without the engine: nothing installed, the same losses and gradients to the bit, the pool's pinned buffers given back.
The verdict is a table; the loop runs with a clock that stands still but for the engine's measuring marks and the
penalties a test puts in chosen steps (the engine's hooks, an offloading step)."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from test_activation_offload import CPU, _batch, _equal, _llama, _step  # noqa: E402  (the tiny demo Llama and its step)

from lightning_gh.activation_offload import offload_activations
from lightning_gh.activation_offload.auto import TOLERANCE, WARM_STEPS, Verdict, judge_trial

P = [100.0, 101.0]  # the steps without offload (lower median 100)


@pytest.mark.parametrize("plain, trial, stall, blocks, verdict", [
    (P, [600.0, 100.0, 101.0], 0.0, 3, Verdict.KEEP),  # a first step six times over (pinned buffers): left out
    (P, [100.0, 100.0, 103.0], 0.0, 3, Verdict.KEEP),  # within the tolerance
    (P, [100.0, 110.0, 111.0], 0.0, 3, Verdict.UNDO),  # over in every steady step: undone
    (P, [600.0, 110.0, 111.0], 0.0, 3, Verdict.UNDO),  # a costly first step does not hide a steady excess
    (P, [100.0, 104.0, 105.0], 0.0, 3, Verdict.SHRINK),  # a little over: the last block goes
    (P, [100.0, 104.0, 105.0], 0.0, 1, Verdict.UNDO),  # one block: nothing to shrink
    (P, [100.0, 101.0, 160.0], 0.0, 3, Verdict.KEEP),  # one steady step slowed by something else does not decide
    (P, [100.0, 104.0, 104.0], 5.0, 3, Verdict.KEEP),  # the predicted stall is part of the forecast
    ([100.0, 140.0], [100.0, 110.0, 111.0], 0.0, 3, Verdict.UNDO),  # one slow reference step does not excuse it
    (P, [100.0, 500.0, 500.0], 0.0, 0, Verdict.KEEP),  # nothing offloaded: nothing to undo
])
def test_judge_trial_table(plain, trial, stall, blocks, verdict):
    assert WARM_STEPS == 1
    assert judge_trial(plain, trial, stall, blocks).verdict is verdict


def test_judge_trial_states_its_figures_and_refuses_too_few_steps():
    j = judge_trial([100.0, 120.0], [900.0, 104.0, 130.0], 2.0, 3)
    assert (j.plain_ms, j.forecast_ms, j.measured_ms) == (100.0, 102.0, 104.0)
    assert judge_trial(P, [600.0], 0.0, 3, warm_steps=0).verdict is Verdict.UNDO  # no warm step: it counts
    with pytest.raises(ValueError, match=r"trial_ms=\[600.0\] with warm_steps=1"):
        judge_trial(P, [600.0], 0.0, 3)
    with pytest.raises(ValueError, match="warm_steps=-1 must be >= 0"):
        judge_trial(P, [1.0, 2.0], 0.0, 3, warm_steps=-1)


class StillClock:
    """A clock that stands still but for the penalties a test puts in a step, and one millisecond per mark while the
    engine measures, before its plan (so that its blocks take time and the plan has compute to hide copies under)."""

    def __init__(self, off):
        self.off, self.now = off, 0.0

    def mark(self):
        if self.off.plan is None:
            self.now += 1.0
        return self.now

    def ms(self, a, b):
        return b - a


class _Probe:
    """Per forward (a pre-hook on the model): the plan in force, whether the engine's hooks are installed."""

    def __init__(self, off, model):
        self.off, self.rows = off, []
        model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        off = self.off
        saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        block_hooks = sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in off.blocks)
        self.rows.append((off._fwd, saved_hooks is not None, block_hooks))


def _run(penalty, steps, autocast=None, hook_ms=0.0):
    """``steps`` steps of the tiny Llama under ``"auto"`` with a still clock: ``hook_ms`` is added to each forward the
    engine's hooks are installed in, ``penalty(k, plan)`` ms to the k-th forward that offloads. Returns the engine, its
    plans, the probe, the per-step (loss, grads), the model and its config."""
    model, cfg = _llama(n_layers=4)
    off = offload_activations(model, "auto", profile_steps=2, **CPU)
    assert off.enabled
    clock = off._clock = StillClock(off)
    offloading = []

    def slow(module, args):
        fwd = off._fwd
        if fwd is not None:
            clock.now += hook_ms
        if fwd is not None and fwd.plan.offloaded_blocks:
            offloading.append(fwd.plan)
            clock.now += penalty(len(offloading) - 1, fwd.plan)

    model.register_forward_pre_hook(slow)
    probe = _Probe(off, model)
    plans = []
    off.on_plan = plans.append
    results = []
    for i in range(steps):
        results.append(_step(model, _batch(cfg, seed=i), off, autocast))
        off.end_backward()
    return off, plans, probe, results, model, cfg


def test_a_costly_first_step_with_the_plan_is_left_out_and_the_plan_kept(caplog):
    # The first step with the plan pays 5 s (say, pinning the pool); the steady steps pay nothing.
    with caplog.at_level(logging.INFO, logger="lightning_gh.activation_offload.auto"):
        off, plans, probe, *_ = _run(lambda k, plan: 5000.0 if k == 0 else 0.0, steps=9)
    assert len(plans) == 1 and off.plan is plans[0] and off.plan.offloaded_blocks
    assert not off.auto.checking  # judged against the measured steps, then against the steps without the engine: kept
    assert "ActivationOffload auto: the step took" not in caplog.text
    # steps: 0 warm-up, 1-2 measured, 3-5 with the plan (3 left out), 6-7 without the engine (the reference), 8 plan
    assert [fwd is None for fwd, _, _ in probe.rows] == [False] * 6 + [True] * 2 + [False]
    assert probe.rows[6][1:] == probe.rows[7][1:] == (False, 0)


def test_a_plan_within_the_measured_steps_but_over_the_step_without_the_engine_is_undone(caplog):
    # The engine's hooks cost 10 ms a step, offloading nothing more: against the measured steps (hooks on) the plan
    # holds; against the steps without the engine it is 10 ms over, and undone.
    with caplog.at_level(logging.INFO, logger="lightning_gh.activation_offload.auto"):
        off, plans, probe, *_ = _run(lambda k, plan: 0.0, steps=10, hook_ms=10.0)
    assert len(plans) == 2 and plans[0].offloaded_blocks and not off.plan.offloaded_blocks
    lines = [r.getMessage() for r in caplog.records if "ActivationOffload auto: the step took" in r.getMessage()]
    assert len(lines) == 1 and "took 10.0 ms with the plan against" in lines[0]
    assert "(the steps without the engine: 0.0 ms;" in lines[0] and "undone (nothing offloaded)" in lines[0]
    assert all(row == (None, False, 0) for row in probe.rows[6:]) and not off.auto.checking


def test_a_steady_excess_is_still_undone_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_gh.activation_offload.auto"):
        off, plans, *_ = _run(lambda k, plan: 1000.0, steps=8)
    assert len(plans) == 2 and plans[0].offloaded_blocks and not off.plan.offloaded_blocks
    lines = [r.getMessage() for r in caplog.records if "ActivationOffload auto: the step took" in r.getMessage()]
    assert len(lines) == 1 and "undone (nothing offloaded)" in lines[0] and f"{TOLERANCE:.0%} over" in lines[0]
    assert "the first 1 step(s) with the plan left out" in lines[0]
    assert lines[0] in off.plan.describe()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_after_the_undo_nothing_is_installed_and_the_step_is_the_plain_step_bitwise(autocast):
    steps = 10
    off, plans, probe, results, model, cfg = _run(lambda k, plan: 1000.0, steps=steps, autocast=autocast)
    assert len(plans) == 2 and not off.plan.offloaded_blocks
    # The step the undo is adopted in, and every one after it: the engine's hooks are not there.
    undone_at = next(i for i, (fwd, _, _) in enumerate(probe.rows) if i > 3 and fwd is None)
    assert undone_at < steps - 2
    for fwd, saved_hooks, block_hooks in probe.rows[undone_at:]:
        assert fwd is None and not saved_hooks and block_hooks == 0
    # ... while the steps before it ran through the engine (its hooks installed).
    assert all(saved and blk for _, saved, blk in probe.rows[:undone_at])
    packed, recast = off.stats.saved_tensors, off.stats.recomputed_param_casts
    assert off.stats.plain_forwards == steps - undone_at
    assert off.stats.last_offloaded_bytes == 0 and off.stats.last_resident_bytes == 0
    # The pool gave its pinned buffers back.
    assert off.pool.reserved_bytes == 0 and off.pool.in_use_bytes == 0
    # A plain run of the same model and batches from the same start: the same losses and gradients, to the bit.
    plain_model, _ = _llama(n_layers=4)
    for i, (loss, grads) in enumerate(results):
        loss0, grads0 = _step(plain_model, _batch(cfg, seed=i), autocast=autocast)
        assert torch.equal(loss, loss0) and _equal(grads, grads0), i
    # One more step after all this: the engine packs nothing, re-casts nothing.
    _step(model, _batch(cfg, seed=99), off, autocast)
    assert (off.stats.saved_tensors, off.stats.recomputed_param_casts) == (packed, recast)


def test_auto_that_plans_nothing_installs_nothing():
    # A link that hides nothing: "auto" plans to offload nothing, and from then on the step is left alone.
    model, cfg = _llama(n_layers=3)
    off = offload_activations(model, "auto", profile_steps=1, bandwidth_gbps=1e-6, **CPU)
    probe = _Probe(off, model)
    for i in range(4):
        _step(model, _batch(cfg, seed=i), off)
    assert off.plan is not None and not off.plan.offloaded_blocks
    assert probe.rows[-1] == (None, False, 0) and off.stats.plain_forwards == 2


def test_an_explicit_policy_zero_keeps_its_hooks():
    # policy=0 asks for the cast dedupe and the weight re-cast alone: the engine stays in the step.
    model, cfg = _llama(n_layers=2)
    off = offload_activations(model, 0, **CPU)
    probe = _Probe(off, model)
    _step(model, _batch(cfg), off, torch.bfloat16)
    assert probe.rows[-1][1] and off.stats.recomputed_param_casts > 0 and off.stats.plain_forwards == 0


def test_a_forward_is_freed_with_its_graph_not_by_the_garbage_collector():
    # The engine's per-forward state holds no reference cycle: once the backward has run and the loss is gone, the
    # forward's state (its entries, its pinned buffers' handles) is freed at once, with the collector off.
    model, cfg = _llama(n_layers=3)
    off = offload_activations(model, "all", **CPU)
    refs = []
    model.register_forward_pre_hook(lambda m, a: refs.append(weakref.ref(off._fwd)))
    gc.collect()
    gc.disable()
    try:
        for i in range(2):
            _step(model, _batch(cfg, seed=i), off, torch.bfloat16)
        assert off.stats.offloaded_bytes > 0
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_a_reference_step_without_a_backward_is_asked_again_and_the_check_ends():
    # As the first test, but a step without the engine ends with no backward (a training_step that returned None):
    # the check still ends, with the plan kept, and no forward is left waiting for a backward.
    model, cfg = _llama(n_layers=4)
    off = offload_activations(model, "auto", profile_steps=2, **CPU)
    assert off.enabled
    off._clock = StillClock(off)
    for i in range(11):
        if i == 7:  # a reference step (steps 7-8 run without the engine here): a forward, then nothing
            model(_batch(cfg, seed=i)[0])
            continue
        _step(model, _batch(cfg, seed=i), off, None)
        off.end_backward()
    assert off.plan is not None and off.plan.offloaded_blocks
    assert not off.auto.checking
    assert not off._measured  # nothing left waiting for a backward
