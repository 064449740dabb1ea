"""The automatic GPU tail (``gpu_fraction="auto"``): the pure policy as a table of (measurements -> action), and
the mover that applies it, through its public interface (``optimizer.tail``), on the CPU.

See Note [Tail growth trial] in ``lightning_gh/superoffload/tail.py``. On the CPU the "GPU" tail lives on the CPU:
the same code paths, the same state moves; the training math after the moves is checked bitwise against the
reference of ``test_superoffload.py``. No timings are asserted: the periods are made up.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from test_superoffload import CLIP, assert_same, groups, make_model, offload_step, train_reference

from lightning_gh.superoffload import HeterogeneousAdamW, memory, tail_mover
from lightning_gh.superoffload import tail as tail_mod
from lightning_gh.superoffload.tail import (
    StepTimes,
    TailAction,
    TailActionKind,
    TailStage,
    TailWindow,
    Trial,
    decide,
)

K = TailActionKind


def W(**kw) -> TailWindow:
    """A window of three 100 ms steps without stall, 4 steps after the layout, 1000 host parameters (30 ms)."""
    base = dict(steps=4, periods=(100.0,) * 3, stalls=(0.0,) * 3, cpu_ms=30.0, host_numel=1000)
    if "period" in kw:
        base["periods"] = (kw.pop("period"),) * 3
    if "stall" in kw:
        base["stalls"] = (kw.pop("stall"),) * 3
    base.update(kw)
    return TailWindow(**base)


def T(period=100.0, on_stall=True, retries=0) -> Trial:
    return Trial(period=period, retries=retries, slots=(3, 4), numel=500, on_stall=on_stall)


# (window, expected action): the whole policy, one row per rule
TABLE = [
    ("too early", W(steps=3, stall=50.0), TailAction(K.KEEP)),
    ("too few steps measured", W(periods=(100.0, 100.0), stalls=(50.0, 50.0)), TailAction(K.KEEP)),
    ("no stall: no tail", W(), TailAction(K.FINAL, why="the CPU update hides under forward+backward")),
    ("a stall grows the tail by 85% of it", W(stall=8.0), TailAction(K.GROW, need_ms=0.85 * 8.0, on_stall=True)),
    ("a stall under 3% of the period is none", W(stall=2.0),
     TailAction(K.FINAL, why="the CPU update hides under forward+backward")),
    ("everything fits: one all-in trial", W(all_fits=True), TailAction(K.GROW, need_ms=math.inf)),
    ("the all-in trial only once", W(all_fits=True, all_in_tried=True),
     TailAction(K.FINAL, why="the CPU update hides under forward+backward")),
    ("a stall trial 1% slower is noise: kept, grows on",
     W(period=101.0, stall=8.0, trial=T(100.0), device_numel=500),
     TailAction(K.GROW, need_ms=0.85 * 8.0, on_stall=True, judged_trial=True)),
    ("a stall trial 3.5% slower is undone", W(period=104.5, stall=8.0, trial=T(101.0), device_numel=500),
     TailAction(K.UNDO, judged_trial=True, why="growing it by 500 parameters was undone: the step took 104 ms "
                                               "instead of 101 ms; the tail stops there")),
    ("one slow step in the window does not undo", W(periods=(80.0, 130.0, 80.0), trial=T(), device_numel=500,
                                                    host_numel=0),
     TailAction(K.FINAL, judged_trial=True,
                why="all of the state fits on the GPU and the step was faster with it there")),
    ("two slow steps do", W(periods=(130.0, 80.0, 130.0), trial=T(), device_numel=500),
     TailAction(K.UNDO, judged_trial=True, why="growing it by 500 parameters was undone: the step took 130 ms "
                                               "instead of 100 ms; the tail stops there")),
    ("allocator retries undo a faster trial", W(period=60.0, stall=10.0, retries=3, trial=T(), device_numel=500),
     TailAction(K.UNDO, judged_trial=True, why="growing it by 500 parameters was undone: the allocator had to "
                                               "free its cache 3 time(s); the tail stops there")),
    ("a probe must buy 2%", W(period=99.0, trial=T(on_stall=False), device_numel=500),
     TailAction(K.UNDO, judged_trial=True, why="growing it by 500 parameters was undone: the step took 99 ms "
                                               "instead of 100 ms; the tail stops there")),
    ("a kept trial with no stall left probes a quarter of the CPU work", W(period=70.0, trial=T(), device_numel=500),
     TailAction(K.GROW, need_ms=0.25 * 30.0, judged_trial=True)),
    ("no probe without a tail", W(gained=True), TailAction(K.FINAL, why="the CPU update hides under "
                                                                        "forward+backward")),
    ("blocked: no growth", W(stall=50.0, blocked=True, device_numel=500),
     TailAction(K.FINAL, why="the forward no longer waits for the CPU")),
    ("settled after the last check", W(steps=37, stall=50.0), TailAction(K.FINAL, why="settled")),
    ("long slack gives half of it back", W(slacks=(20.0, 30.0), device_numel=500),
     TailAction(K.SHRINK, numel=int(0.5 * 20.0 * 1000 / 30.0))),
    ("slack without CPU time measured: wait", W(slacks=(20.0, 30.0), device_numel=500, cpu_ms=0.0),
     TailAction(K.KEEP)),
    ("short slack: final", W(slacks=(5.0, 30.0), device_numel=500),
     TailAction(K.FINAL, why="the forward no longer waits for the CPU")),
    ("final: a retry with a tail sends it home", W(stage=TailStage.FINAL, device_numel=500, retries=2,
                                                   retries_seen=1),
     TailAction(K.SEND_HOME, why="the caching allocator had to free its cache 1 time(s) with 500 parameters in "
                                 "the GPU tail")),
    ("final: no new retry", W(stage=TailStage.FINAL, device_numel=500, retries=1, retries_seen=1),
     TailAction(K.KEEP)),
    ("final: no tail, nothing to send", W(stage=TailStage.FINAL, retries=5), TailAction(K.KEEP)),
    ("sent home: once", W(stage=TailStage.SENT_HOME, device_numel=500, retries=9), TailAction(K.KEEP)),
]


@pytest.mark.parametrize("window,expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_policy_table(window, expected):
    assert decide(window) == expected


# ---------------------------------------------------------------------------------------------------------------
# The mover, through the optimizer's public `tail`


def _auto_opt(model: torch.nn.Module, **kw) -> HeterogeneousAdamW:
    return HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model,
                              bucket_size=600, gpu_fraction="auto", **kw)


def _times(period: float | list[float], stall: float) -> StepTimes:
    periods = period if isinstance(period, list) else [period] * tail_mod.WINDOW
    return StepTimes(periods=list(periods), stalls=[stall] * len(periods), slacks=[None, None])


def _after(opt: HeterogeneousAdamW, period, stall: float, k: int) -> tuple[TailAction, StepTimes]:
    """The mover's turn after a step measured with this period (or these periods) and stall, ``k`` pipelined steps
    after the layout; each host bucket took 10 ms of CPU time."""
    for b in opt.layout.buckets:
        b.cpu_ms = b.cpu_ms or 10.0
    times = _times(period, stall)
    return opt.tail.step(times, k, opt.synchronize), times


@pytest.fixture
def info_log(caplog):
    caplog.set_level(logging.INFO)
    return caplog


def _decision_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "SuperOffload auto GPU tail" in r.getMessage()]


def test_a_final_decision_is_one_log_line_and_later_windows_change_nothing(info_log):
    opt = _auto_opt(make_model())
    action, _ = _after(opt, 100.0, 0.0, k=4)
    assert action.kind is K.FINAL and opt.tail.final and opt.device_numel == 0
    lines = _decision_lines(info_log)
    assert len(lines) == 1 and "0 of" in lines[0] and "hides under forward+backward" in lines[0]
    assert opt.stats["tail_decision"] == lines[0]
    _after(opt, 100.0, 50.0, k=5)
    assert opt.device_numel == 0 and len(_decision_lines(info_log)) == 1
    opt.close()


def test_the_tail_waits_while_another_part_sizes_its_gpu_memory(info_log):
    """An ActivationOffload budget still measuring or relaxing: the tail neither grows nor decides; once it is done,
    the same window grows the tail (Note [One part sizes GPU memory at a time])."""
    from lightning_gh import _gpu_plan

    class Budget:
        pass

    opt = _auto_opt(make_model())
    owner = Budget()
    _gpu_plan.set_sizing(owner, "ActivationOffload", True)
    try:
        for k in range(4, 40):  # held past the policy's last check
            action, times = _after(opt, 100.0, 8.0, k=k)
            assert action.kind is K.KEEP and opt.device_numel == 0 and not opt.tail.final
            assert not times.periods  # the held steps' timings are forgotten
    finally:
        _gpu_plan.set_sizing(owner, "ActivationOffload", False)
    action, _ = _after(opt, 100.0, 8.0, k=41)  # the policy counts its steps from the end of the hold
    assert action.kind is K.KEEP and not opt.tail.final
    action, _ = _after(opt, 100.0, 8.0, k=39 + tail_mod.FIRST_CHECK)
    assert action.kind is K.GROW and opt.device_numel > 0
    opt.close()


def test_a_grown_trial_then_its_undo_move_exactly_the_trial(info_log):
    opt = _auto_opt(make_model())
    total = opt.host_numel
    action, times = _after(opt, 100.0, 8.0, k=4)  # a stall worth less than one bucket's CPU time (10 ms each)
    first = opt.device_numel
    assert action.kind is K.GROW and 0 < first < total and opt.tail.trial.on_stall and not opt.tail.final
    assert times.last_step_t is None and not times.periods  # the step after a move is not measured
    _after(opt, 101.0, 8.0, k=8)  # 1% slower: noise; kept, and the stall asks for more
    assert opt.device_numel > first and not opt.tail.final and not _decision_lines(info_log)
    action, _ = _after(opt, 104.5, 8.0, k=12)  # 3.5% slower than the 101 ms before this growth: undone
    assert action.kind is K.UNDO and opt.device_numel == first and opt.host_numel == total - first
    assert opt.tail.final and opt.stats["tail_moves_back"] == 1
    lines = _decision_lines(info_log)
    assert len(lines) == 1 and "was undone: the step took 104 ms instead of 101 ms" in lines[0]
    opt.close()


def test_allocator_retries_undo_a_trial_and_later_send_the_tail_home(monkeypatch, info_log):
    retries = [0]
    monkeypatch.setattr(tail_mod, "allocator_retries", lambda device: retries[0])
    opt = _auto_opt(make_model())
    _after(opt, 100.0, 10.0, k=4)
    _after(opt, 70.0, 0.0, k=6)  # kept; probes further
    kept = opt.device_numel - opt.tail.trial.numel
    retries[0] = 3  # the probe took memory the activations needed
    action, _ = _after(opt, 60.0, 0.0, k=9)
    assert action.kind is K.UNDO and opt.device_numel == kept > 0 and opt.tail.final
    assert "the allocator had to free its cache 3 time(s)" in _decision_lines(info_log)[0]
    retries[0] = 4  # a later, longer batch: the allocator has to free its cache again
    with pytest.warns(UserWarning, match="tail went back to the host"):
        _after(opt, 60.0, 0.0, k=10)
    assert opt.device_numel == 0 and opt.tail.blocked and opt.tail.stage is TailStage.SENT_HOME
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        retries[0] = 5
        _after(opt, 60.0, 0.0, k=11)  # once
    opt.close()


def test_a_final_tail_lets_the_host_room_it_freed_hold_more_rollback_copies(monkeypatch, info_log):
    from lightning_gh import hardware

    n = sum(p.numel() for p in make_model().parameters())
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: int((16 * n + 12 * 1400) / 0.9) + 8)
    retries = [0]
    monkeypatch.setattr(tail_mod, "allocator_retries", lambda device: retries[0])
    opt = _auto_opt(make_model())
    lay = opt.layout
    planned = lay.plan.backup_params
    spec = lambda k: opt.tail.step(_times(60.0, 0.0), k, opt.synchronize,  # noqa: E731
                                   lambda host: memory.speculation_budget(lay.plan, host))
    _after(opt, 100.0, 10.0, k=4)
    _after(opt, 70.0, 0.0, k=6)  # kept; probes further
    retries[0] = 3
    spec(9)  # the probe is undone; the decision is final with a tail
    assert opt.tail.final and opt.device_numel > 0
    lines = [r.getMessage() for r in info_log.records if "may be updated speculatively" in r.getMessage()]
    assert len(lines) == 1 and f"{opt.stats['speculative_params']:,} of the {opt.host_numel:,}" in lines[0]
    assert opt.stats["speculative_params"] > planned
    retries[0] = 4  # the tail goes home: the copies give the room back first
    with pytest.warns(UserWarning, match="tail went back to the host"):
        spec(10)
    assert opt.device_numel == 0 and opt.stats["speculative_params"] <= planned
    opt.close()


def test_growth_limited_by_memory_is_final_and_says_so(monkeypatch, info_log):
    monkeypatch.setattr(memory, "device_memory_room", lambda dev: (tail_mover.TAIL_HEADROOM_MIN_BYTES, 2**30))
    opt = _auto_opt(make_model())
    _after(opt, 100.0, 40.0, k=4)
    assert opt.device_numel == 0 and opt.tail.final
    assert "limited by GPU memory" in _decision_lines(info_log)[0]
    opt.close()


@pytest.mark.parametrize("period,kept", [(80.0, True), (99.0, False)])
def test_the_all_in_trial_is_kept_only_when_faster(monkeypatch, info_log, period, kept):
    monkeypatch.setattr(memory, "device_memory_room", lambda dev: (64 * 2**30, 80 * 2**30))
    opt = _auto_opt(make_model())
    total = opt.host_numel
    action, _ = _after(opt, 100.0, 0.0, k=4)  # no stall, but everything fits: one trial moves it all
    assert action == TailAction(K.GROW, need_ms=math.inf) and opt.host_numel == 0 and opt.device_numel == total
    _after(opt, period, 0.0, k=6)
    line = _decision_lines(info_log)[0]
    assert opt.tail.final
    if kept:
        assert opt.host_numel == 0 and f"{total:,} of {total:,}" in line and "step was faster" in line
    else:
        assert opt.device_numel == 0 and opt.host_numel == total and "the step took 99 ms instead of 100" in line
    opt.close()


def test_max_gpu_fraction_forbids_the_all_in_trial(monkeypatch):
    monkeypatch.setattr(memory, "device_memory_room", lambda dev: (64 * 2**30, 80 * 2**30))
    opt = _auto_opt(make_model(), max_gpu_fraction=0.5)
    _after(opt, 100.0, 0.0, k=4)
    assert opt.device_numel == 0 and opt.tail.final  # no all-in trial; no stall, so no tail
    opt.close()


@pytest.mark.parametrize("all_in", [False, True], ids=["grow-undo", "all-in-kept"])
def test_trial_moves_keep_the_math_bitwise(monkeypatch, all_in):
    """Mid-run moves - a growth then its undo, or everything moved to the "GPU" tail (here: the CPU) and kept -
    leave parameters and moments equal to clip_grad_norm_ + AdamW(fused)."""
    if all_in:
        monkeypatch.setattr(memory, "device_memory_room", lambda dev: (64 * 2**30, 80 * 2**30))
    ref_model, ref_opt, _ = train_reference(steps=12)
    model = make_model()
    opt = _auto_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    stall = 0.0 if all_in else 40.0
    for step in range(12):
        if step == 3:
            _after(opt, 100.0, stall, k=4)
            assert opt.device_numel > 0 and (opt.host_numel == 0 or not all_in)
        if step == 5:
            _after(opt, 70.0 if all_in else 110.0, stall, k=6)  # all-in: faster, kept; else undone
            assert opt.host_numel == 0 if all_in else opt.device_numel == 0
        offload_step(model, opt, sched, step)
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


# ---------------------------------------------------------------------------------------------------- sharded tail
def _candidates(owners: list[int], numel: int = 10, own: int = 140, remote: int = 20) -> list:
    from lightning_gh.superoffload.tail import ShardCandidate

    return [ShardCandidate(i, o, numel, own, remote) for i, o in enumerate(owners)]


@pytest.mark.parametrize("owners, ranks, room, max_share, chosen", [
    # each rank's first-needed buckets (the highest indices) first, the rank with the smallest share taking next
    ([0, 0, 1, 1], 2, 10_000, None, [0, 1, 2, 3]),
    ([0, 0, 1, 1], 2, 300, None, [0, 1, 3]),  # rank 1's second bucket would put it at 320
    ([0, 0, 1, 1], 2, 180, None, [1, 3]),  # one bucket each: 140 own + 20 of the other's
    ([0, 0, 1, 1], 2, 139, None, []),  # no rank's own bucket fits
    ([0, 0, 1, 1], 2, 10_000, 0.5, [1, 3]),  # half of each rank's own parameters at most
    ([0, 0, 1, 1], 2, 10_000, 0.0, []),
    ([0, 0, 0, 1], 2, 10_000, 0.7, [1, 2]),  # rank 0 may move 2 of its 3 buckets; rank 1's one is all its share
    ([0, 1, 2], 3, 180, None, [0, 1, 2]),  # three ranks: each bucket costs the other two 20 each
    ([0, 1, 2], 3, 179, None, [0, 1]),
    ([], 2, 10_000, None, []),
])
def test_sharded_tail_table(owners, ranks, room, max_share, chosen):
    from lightning_gh.superoffload.tail import sharded_tail

    assert sharded_tail(_candidates(owners), ranks, room, max_share) == chosen


def test_sharded_tail_never_exceeds_any_ranks_room():
    from lightning_gh.superoffload.tail import ShardCandidate, sharded_tail

    cands = [ShardCandidate(i, i % 3, 5 + i, 14 * (5 + i), 2 * (5 + i)) for i in range(12)]
    for room in range(0, 2000, 37):
        picked = sharded_tail(cands, 3, room, None)
        for r in range(3):
            used = sum(c.own_bytes if c.owner == r else c.remote_bytes for c in cands if c.index in picked)
            assert used <= room
