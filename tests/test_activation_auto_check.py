"""``policy="auto"`` keeps its promise: the first steps with its plan are timed against the forecast, and a plan that
costs more than a few percent shrinks or is undone, in one log line. The decision is a table; the loop runs with a fake
clock (each mark one millisecond, plus a penalty in steps that offload)."""

from __future__ import annotations

import logging

import pytest
from test_activation_offload import _batch, _llama, _step  # noqa: E402  (the tiny demo Llama and its step)

from lightning_gh.activation_offload import offload_activations
from lightning_gh.activation_offload.auto import TOLERANCE, Verdict, check_verdict


@pytest.mark.parametrize("forecast, measured, blocks, verdict", [
    (100.0, 100.0, 3, Verdict.KEEP),
    (100.0, 100.0 * (1 + TOLERANCE), 3, Verdict.KEEP),  # at the tolerance: kept
    (100.0, 90.0, 3, Verdict.KEEP),  # faster than forecast
    (100.0, 104.0, 3, Verdict.SHRINK),
    (100.0, 100.0 * (1 + 2 * TOLERANCE), 2, Verdict.SHRINK),
    (100.0, 104.0, 1, Verdict.UNDO),  # one block left: nothing to shrink
    (100.0, 110.0, 3, Verdict.UNDO),  # far over: undo
    (100.0, 500.0, 0, Verdict.KEEP),  # nothing offloaded: nothing to undo
])
def test_check_verdict_table(forecast, measured, blocks, verdict):
    assert check_verdict(forecast, measured, blocks) is verdict


class FakeClock:
    """Every mark is one millisecond after the previous one; ``now`` can be pushed ahead."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        self.now += 1.0
        return self.now

    def ms(self, a, b):
        return b - a


def _run(penalty_ms, steps=7):
    model, cfg = _llama(n_layers=4)
    off = offload_activations(model, "auto", backend="host-copy", min_tensor_bytes=1024, profile_steps=2)
    assert off.enabled
    clock = off._clock = FakeClock()

    def slow_when_offloading(module, args):
        if off._fwd is not None and off._fwd.plan.offloaded_blocks:
            clock.now += penalty_ms

    model.register_forward_pre_hook(slow_when_offloading)
    plans = []
    off.on_plan = plans.append
    for i in range(steps):
        _step(model, _batch(cfg, seed=i), off)
        off.end_backward()
    return off, plans


def test_auto_plan_within_its_forecast_is_kept(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_gh.activation_offload.auto"):
        off, plans = _run(penalty_ms=0.0)
    assert len(plans) == 1 and off.plan is plans[0] and off.plan.offloaded_blocks
    assert "ActivationOffload auto: the step took" not in caplog.text


def test_auto_plan_slower_than_its_forecast_is_undone_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_gh.activation_offload.auto"):
        off, plans = _run(penalty_ms=1000.0)
    assert len(plans) == 2 and plans[0].offloaded_blocks
    assert off.plan is plans[1] and not off.plan.offloaded_blocks
    lines = [r.getMessage() for r in caplog.records if "ActivationOffload auto: the step took" in r.getMessage()]
    assert len(lines) == 1 and "undone (nothing offloaded)" in lines[0] and f"{TOLERANCE:.0%} over" in lines[0]
    assert lines[0] in off.plan.describe()
