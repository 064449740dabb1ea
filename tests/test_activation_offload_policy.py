"""The offload policy on synthetic timings: what "auto" chooses, and the timeline model behind it."""

import pytest

from lightning_gh.activation_offload.policy import (
    BlockProfile,
    OffloadPlan,
    StepProfile,
    plan_all,
    plan_auto,
    plan_first_k,
    plan_none,
    simulate,
)

MIB = 2**20
GIB = 2**30


def _profile(n=8, fwd=2.0, bwd=4.0, nbytes=400 * MIB, resident=10 * MIB, tail_f=1.0, tail_b=2.0, other=50 * MIB):
    return StepProfile(tuple(BlockProfile(fwd, bwd, nbytes, resident) for _ in range(n)), tail_f, tail_b, other)


def _sim(prof, plan, d2h, h2d=None, margin=0.0):
    return simulate(prof, plan.budgets, plan.release_at, plan.prefetch_at, d2h, h2d or d2h, margin)


def test_fast_link_offloads_every_eligible_block_without_stall():
    prof = _profile()
    plan = plan_auto(prof, d2h_gbps=10_000, h2d_gbps=10_000, margin=0.25)
    assert plan.offloaded_blocks == tuple(range(7))  # all but the last (skip_last_blocks=1)
    assert all(b is None for b in plan.budgets[:7]) and plan.budgets[7] == 0
    assert plan.prediction.stall_ms == 0.0
    assert plan.prediction.offloaded_bytes == 7 * 400 * MIB
    assert plan.prediction.saving_bytes > 0


def test_slow_link_offloads_nothing_and_says_why():
    prof = _profile()
    plan = plan_auto(prof, d2h_gbps=0.001, h2d_gbps=0.001)
    assert plan.offloaded_blocks == ()
    assert "nothing is offloaded" in plan.describe()


def test_link_limited_choice_is_a_prefix_with_a_partial_last_block_and_hides_fully():
    prof = _profile()
    plan = plan_auto(prof, d2h_gbps=55.0, h2d_gbps=55.0, margin=0.25)
    blocks = plan.offloaded_blocks
    assert 0 < len(blocks) < 7
    assert blocks == tuple(range(len(blocks)))  # a prefix: early blocks have the most time to hide
    assert all(b is None for b in plan.budgets[: len(blocks) - 1])
    assert plan.budgets[len(blocks) - 1] is None or 0 < plan.budgets[len(blocks) - 1] < 400 * MIB
    # With the margin it plans for, the chosen bytes hide; moving one more block does not.
    assert _sim(prof, plan, 55.0, margin=0.25).stall_ms == 0.0
    more = plan_first_k(8, len(blocks) + 1, max_inflight_blocks=None)
    assert _sim(prof, more, 55.0, margin=0.25).stall_ms > 0.0
    assert "limited by the link" in plan.describe()


def test_more_margin_means_fewer_bytes_and_faster_link_means_more():
    prof = _profile()
    moved = lambda **kw: plan_auto(prof, **kw).prediction.offloaded_bytes  # noqa: E731
    assert moved(d2h_gbps=55, h2d_gbps=55, margin=1.0) < moved(d2h_gbps=55, h2d_gbps=55, margin=0.0)
    assert moved(d2h_gbps=55, h2d_gbps=55, margin=0.25) < moved(d2h_gbps=200, h2d_gbps=200, margin=0.25)


def test_slower_reload_link_limits_the_choice():
    prof = _profile(fwd=4.0, bwd=1.0)  # long forward, short backward: the reloads are the bottleneck
    fast_back = plan_auto(prof, d2h_gbps=55, h2d_gbps=1000).prediction.offloaded_bytes
    slow_back = plan_auto(prof, d2h_gbps=55, h2d_gbps=20).prediction.offloaded_bytes
    assert slow_back < fast_back


def test_auto_waits_as_early_as_the_copy_allows_and_reloads_as_late_as_it_allows():
    prof = _profile(fwd=10.0, bwd=20.0, nbytes=100 * MIB)  # each copy hides under one block
    plan = plan_auto(prof, d2h_gbps=55, h2d_gbps=55, margin=0.0)
    assert plan.offloaded_blocks == tuple(range(7))
    # Block i's copy starts when it ends and is done before block i+2 starts: that is where compute waits.
    assert plan.release_at[:7] == tuple(i + 2 for i in range(7))
    assert plan.prefetch_at[:7] == tuple(i + 1 for i in range(7))  # reloaded during the next block's backward


def test_fixed_policies():
    p = plan_all(6)
    assert p.offloaded_blocks == (0, 1, 2, 3, 4)
    assert p.release_at == (2, 3, 4, 5, 6, 7) and p.prefetch_at == (1, 2, 3, 4, 5, 6)
    p = plan_first_k(6, 2, max_inflight_blocks=None, prefetch_blocks=2)
    assert p.offloaded_blocks == (0, 1)
    assert p.release_at[:2] == (7, 7) and p.prefetch_at[:2] == (2, 3)
    p = plan_first_k(4, 10, skip_last_blocks=2)
    assert p.offloaded_blocks == (0, 1) and "stay resident" in p.describe()
    assert plan_none(3).offloaded_blocks == ()


def test_all_on_a_slow_link_trades_stall_for_memory():
    prof = _profile()
    pred = _sim(prof, plan_all(8), 55.0)
    assert pred.stall_ms > 0
    assert pred.peak_bytes < pred.baseline_peak_bytes
    # Offloading everything but the last block at most two blocks in flight: the saving is large.
    assert pred.saving_bytes > 4 * 100 * MIB


def test_simulate_memory_model_baseline_and_prefetch_cost():
    prof = _profile(n=2, nbytes=100 * MIB, resident=0, other=0)
    none = plan_none(2)
    pred = _sim(prof, none, 55.0)
    assert pred.baseline_peak_bytes == pred.peak_bytes == 200 * MIB and pred.stall_ms == 0
    one = plan_first_k(2, 1)
    pred = _sim(prof, one, 1e9)  # instant link: block 0 is off the device at its release point
    # During block 1's backward block 0 is back (prefetched) while block 1's activations are still held.
    assert pred.peak_bytes == 200 * MIB
    assert pred.offloaded_bytes == 100 * MIB


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(forward_ms=-1.0, backward_ms=1.0, offloadable_bytes=1), "forward_ms"),
        (dict(forward_ms=1.0, backward_ms=1.0, offloadable_bytes=-5), "offloadable_bytes"),
    ],
)
def test_profile_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockProfile(**kwargs)


def test_plan_validation_and_argument_errors():
    with pytest.raises(ValueError, match="release_at"):
        OffloadPlan("x", (None, 0), (0, 3), (1, 2))
    with pytest.raises(ValueError, match="margin"):
        plan_auto(_profile(), 55, 55, margin=-1)
    with pytest.raises(ValueError, match="d2h_gbps"):
        plan_auto(_profile(), 0, 55)
    with pytest.raises(ValueError, match="max_inflight_blocks"):
        plan_first_k(4, 1, max_inflight_blocks=0)
    with pytest.raises(ValueError, match="StepProfile.blocks"):
        StepProfile(())


def test_describe_names_blocks_points_and_forecast():
    plan = plan_auto(_profile(), d2h_gbps=55, h2d_gbps=55)
    text = plan.describe()
    assert "policy auto" in text and "predicted:" in text and "GiB" in text and "wait@" in text and "reload@" in text


def test_a_faster_link_never_hides_less():
    # Regression: reloads are scheduled as late as possible from the block needed last, so a faster link
    # cannot make an earlier-needed reload crowd out a later one.
    blk = BlockProfile(forward_ms=2.3, backward_ms=4.6, offloadable_bytes=700 * MIB, resident_bytes=100 * MIB)
    prof = StepProfile((blk,) * 8, tail_forward_ms=3.2, tail_backward_ms=4.2, other_bytes=2 * GIB)
    moved = [plan_auto(prof, g, g).prediction.offloaded_bytes for g in (25, 55, 110, 220, 450)]
    assert moved == sorted(moved) and moved[0] < moved[-1]
    for g in (25, 55, 110, 220, 450):
        assert plan_auto(prof, g, g).prediction.stall_ms == 0.0
