"""The automatic GPU tail's decisions (``gpu_fraction="auto"``), driven by hand with simulated measurements.

On CUDA ``HeterogeneousAdamW`` calls ``_auto_tail`` after every step with the measured step period, the time the
next forward waited for the CPU (stall) and the allocator's retry count. Here the measurements are written into the
optimizer and the policy is called directly, on the CPU (its "GPU" tail then lives on the CPU: the same code
paths, the same state moves). The training math after the moves is checked bitwise against the reference in
``test_superoffload.py``. No timings are asserted: the periods are made up.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload import tail as tail_mod

from test_superoffload import CLIP, assert_same, groups, make_model, offload_step, train_reference


def _auto_opt(model: torch.nn.Module) -> HeterogeneousAdamW:
    return HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model,
                              bucket_size=600, gpu_fraction="auto")


def _measure(opt: HeterogeneousAdamW, period: float | list[float], stall: float, k: int) -> None:
    """Pretend a window of steps was measured with this period (or these periods) and stall, ``k`` pipelined steps
    after the layout."""
    opt._step_id = opt._layout_step + k
    periods = period if isinstance(period, list) else [period] * tail_mod._WINDOW
    opt._periods[:] = periods
    opt._stalls[:] = [stall] * len(periods)
    opt._slack[:] = [None, None]
    for b in opt._buckets:
        b.cpu_ms = b.cpu_ms or 10.0


@pytest.fixture
def info_log(caplog):
    caplog.set_level(logging.INFO)
    return caplog


def _decision_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "SuperOffload auto GPU tail" in r.getMessage()]


def test_no_stall_means_no_tail_and_one_log_line(info_log):
    opt = _auto_opt(make_model())
    _measure(opt, period=100.0, stall=0.0, k=4)
    opt._auto_tail()
    assert opt.device_numel == 0 and opt._tail_final
    lines = _decision_lines(info_log)
    assert len(lines) == 1 and "0 of" in lines[0] and "hides under forward+backward" in lines[0]
    assert opt.stats["tail_decision"] == lines[0]
    _measure(opt, period=100.0, stall=50.0, k=5)  # final: later measurements change nothing
    opt._auto_tail()
    assert opt.device_numel == 0 and len(_decision_lines(info_log)) == 1
    opt.close()


def test_a_stall_growth_is_kept_unless_measurably_slower(info_log):
    """A growth the forward's wait asked for stays unless the step got more than 3% slower: on the H200 machine a
    2%-gain rule undid growths that paid on noise."""
    opt = _auto_opt(make_model())
    total = opt.host_numel
    _measure(opt, period=100.0, stall=8.0, k=4)  # a stall worth less than one bucket's CPU time (10 ms each)
    opt._auto_tail()
    first = opt.device_numel
    assert 0 < first < total and opt._tail_trial["on_stall"] and not opt._tail_final
    assert opt._last_step_t is None  # the step after a move is not measured
    _measure(opt, period=101.0, stall=8.0, k=8)  # 1% slower: noise; kept, and the stall asks for more
    opt._auto_tail()
    assert opt.device_numel > first and not opt._tail_final and not _decision_lines(info_log)
    _measure(opt, period=104.5, stall=8.0, k=12)  # 3.5% slower than the 101 ms before this growth: undone
    opt._auto_tail()
    assert opt.device_numel == first and opt._tail_final and opt.host_numel == total - first
    lines = _decision_lines(info_log)
    assert len(lines) == 1 and "was undone: the step took 104 ms instead of 101 ms" in lines[0]
    opt.close()


@pytest.mark.parametrize("window,kept", [([80.0, 130.0, 80.0], True), ([130.0, 80.0, 130.0], False)])
def test_one_slow_step_does_not_undo_a_growth_that_paid(info_log, window, kept):
    """The policy reads the median of a window: one slow step (a spike the H200 machine shows every few steps) in
    the window after a growth does not undo it (the mean of the last two would say 105 ms); two slow steps do."""
    opt = _auto_opt(make_model())
    total = opt.host_numel
    _measure(opt, period=100.0, stall=40.0, k=4)
    opt._auto_tail()
    assert opt.device_numel > 0 and opt._tail_trial is not None
    _measure(opt, period=window, stall=0.0, k=8)
    opt._auto_tail()
    line = _decision_lines(info_log)[0]
    if kept:
        assert opt.device_numel == total and "the step was faster with it there" in line
    else:
        assert opt.device_numel == 0 and "was undone: the step took 130 ms instead of 100 ms" in line
    opt.close()


def test_a_trial_growth_that_makes_the_allocator_retry_is_undone(monkeypatch, info_log):
    opt = _auto_opt(make_model())
    retries = [0]
    monkeypatch.setattr(tail_mod, "allocator_retries", lambda device: retries[0])
    _measure(opt, period=100.0, stall=40.0, k=4)
    opt._auto_tail()
    assert opt.device_numel > 0
    retries[0] = 3  # the tail took memory the activations needed: the allocator freed its cache 3 times
    _measure(opt, period=60.0, stall=10.0, k=6)  # faster, but thrashing: undone all the same
    opt._auto_tail()
    assert opt.device_numel == 0 and opt._tail_final
    assert "the allocator had to free its cache 3 time(s)" in _decision_lines(info_log)[0]
    opt.close()


def test_a_faster_trial_is_kept_then_probed_and_the_decision_says_why(info_log):
    opt = _auto_opt(make_model())
    _measure(opt, period=100.0, stall=10.0, k=4)
    opt._auto_tail()
    kept = opt.device_numel
    _measure(opt, period=70.0, stall=0.0, k=6)  # faster and no more host-side wait: keep it, probe further
    opt._auto_tail()
    assert opt.device_numel > kept and not opt._tail_final and opt._tail_trial is not None
    _measure(opt, period=69.9, stall=0.0, k=9)  # the probe did not pay: undone, and the decision is final
    opt._auto_tail()
    assert opt.device_numel == kept > 0 and opt._tail_final
    line = _decision_lines(info_log)[0]
    assert f"{kept:,} of" in line and "was undone: the step took 70 ms instead of 70 ms" in line
    opt.close()


def test_growth_limited_by_memory_is_final_and_says_so(monkeypatch, info_log):
    from lightning_gh.superoffload import memory

    opt = _auto_opt(make_model())
    monkeypatch.setattr(memory, "device_memory_room", lambda dev: (tail_mod._TAIL_HEADROOM_MIN_BYTES, 2**30))
    _measure(opt, period=100.0, stall=40.0, k=4)
    opt._auto_tail()
    assert opt.device_numel == 0 and opt._tail_final
    assert "limited by GPU memory" in _decision_lines(info_log)[0]
    opt.close()


def test_allocator_retries_after_the_decision_send_the_tail_home(monkeypatch, info_log):
    opt = _auto_opt(make_model())
    retries = [0]
    monkeypatch.setattr(tail_mod, "allocator_retries", lambda device: retries[0])
    _measure(opt, period=100.0, stall=10.0, k=4)
    opt._auto_tail()
    _measure(opt, period=70.0, stall=0.0, k=6)  # kept; probes further
    opt._auto_tail()
    _measure(opt, period=70.0, stall=0.0, k=9)  # the probe is undone: final, with the first growth
    opt._auto_tail()
    assert opt._tail_final and opt.device_numel > 0
    retries[0] = 1  # a later, longer batch: the allocator now has to free its cache
    with pytest.warns(UserWarning, match="tail went back to the host"):
        opt._auto_tail()
    assert opt.device_numel == 0 and opt._tail_blocked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        retries[0] = 2
        opt._auto_tail()  # once
    opt.close()


def _roomy_gpu(monkeypatch) -> None:
    from lightning_gh.superoffload import memory

    monkeypatch.setattr(memory, "device_memory_room", lambda dev: (64 * 2**30, 80 * 2**30))


def test_when_everything_fits_one_trial_moves_it_all_and_keeps_it_if_faster(monkeypatch, info_log):
    _roomy_gpu(monkeypatch)
    opt = _auto_opt(make_model())
    total = opt.host_numel
    _measure(opt, period=100.0, stall=0.0, k=4)  # no stall: the old policy would stop here with no tail
    opt._auto_tail()
    assert opt.host_numel == 0 and opt.device_numel == total and opt._tail_trial is not None
    _measure(opt, period=80.0, stall=0.0, k=6)
    opt._auto_tail()
    assert opt._tail_final and opt.host_numel == 0
    line = _decision_lines(info_log)[0]
    assert f"{total:,} of {total:,}" in line and "fits on the GPU and the step was faster" in line
    opt.close()


def test_moving_everything_that_is_not_faster_is_undone_once(monkeypatch, info_log):
    _roomy_gpu(monkeypatch)
    opt = _auto_opt(make_model())
    total = opt.host_numel
    _measure(opt, period=100.0, stall=0.0, k=4)
    opt._auto_tail()
    assert opt.device_numel == total
    _measure(opt, period=99.0, stall=0.0, k=6)  # 1% faster: below the 2% a growth must buy
    opt._auto_tail()
    assert opt._tail_final and opt.device_numel == 0 and opt.host_numel == total
    assert "was undone: the step took 99 ms instead of 100 ms" in _decision_lines(info_log)[0]
    opt.close()


def test_moving_everything_respects_max_gpu_fraction(monkeypatch, info_log):
    _roomy_gpu(monkeypatch)
    model = make_model()
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, max_grad_norm=CLIP, module=model, bucket_size=600,
                             gpu_fraction="auto", max_gpu_fraction=0.5)
    _measure(opt, period=100.0, stall=0.0, k=4)
    opt._auto_tail()
    assert opt.device_numel == 0 and opt._tail_final  # no all-in trial; no stall, so no tail
    opt.close()


@pytest.mark.parametrize("all_in", [False, True], ids=["grow-undo", "all-in-kept"])
def test_trial_moves_keep_the_math_bitwise(monkeypatch, all_in):
    """Mid-run moves - a growth then its undo, or everything moved to the "GPU" tail (here: the CPU) and kept -
    leave parameters and moments equal to clip_grad_norm_ + AdamW(fused)."""
    if all_in:
        _roomy_gpu(monkeypatch)
    ref_model, ref_opt, _ = train_reference(steps=12)
    model = make_model()
    opt = _auto_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    stall = 0.0 if all_in else 40.0
    for step in range(12):
        if step == 3:
            _measure(opt, period=100.0, stall=stall, k=4)
            opt._auto_tail()
            assert opt.device_numel > 0 and (opt.host_numel == 0 or not all_in)
        if step == 5:
            _measure(opt, period=70.0 if all_in else 110.0, stall=stall, k=6)  # all-in: faster, kept; else undone
            opt._auto_tail()
            assert opt.host_numel == 0 if all_in else opt.device_numel == 0
        offload_step(model, opt, sched, step)
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()
