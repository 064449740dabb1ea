"""The GPU's share of the host buckets' update (Note [Device-assisted update] in lightning_gh.superoffload.assist),
run on the CPU with ``device_assist=True``: the split between the two workers changes no number, bitwise against
clip_grad_norm_ + AdamW(fused=True), and the shared buckets are each updated exactly once, in forward order from
each end.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from test_superoffload import CLIP, STEPS, assert_same, groups, make_model, train_ours, train_reference

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload.assist import SharedBuckets, assist_enabled, chunk_spans
from lightning_gh.superoffload.worker import take_shared


@pytest.mark.parametrize("speculative,rollback", [(False, "auto"), (True, "auto"), (True, "copy")])
def test_assisted_updates_match_torch_adamw_bitwise(speculative, rollback):
    ref_model, ref_opt, clipped = train_reference()
    # Buckets are shared only in a run whose step decision is known when the CPU worker reaches it, which the
    # threads' timing decides (on a loaded machine every run can be speculated before its decision): trained again,
    # each run checked bitwise, until the GPU's worker took part.
    for _ in range(5):
        model, opt = train_ours(speculative=speculative, rollback=rollback, device_assist=True, gpu_fraction=0.0,
                                force_speculation=True)
        if opt.stats["assisted_buckets"] > 0:
            break
        assert_same(ref_model, ref_opt, model, opt)  # bitwise all the same
        opt.close()
    assert 0 < clipped < STEPS - 1
    assert opt.stats["assisted_buckets"] > 0  # the GPU's worker took part
    assert 0 < opt.stats["assisted_numel"]
    assert opt.stats["skipped_steps"] == 1
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def test_assist_is_off_by_default_off_cuda_and_on_with_true():
    model = make_model()
    off = HeterogeneousAdamW(groups(model), lr=1e-2, module=model, bucket_size=600)
    assert off.updater.assist is None and not off.layout.pin_moments
    off.close()
    on = HeterogeneousAdamW(groups(model), lr=1e-2, module=model, bucket_size=600, device_assist=True)
    assert on.updater.assist is not None
    on.close()


def test_device_assist_option_is_validated():
    model = make_model()
    with pytest.raises(ValueError, match=r"device_assist='always' must be True, False or 'auto'"):
        HeterogeneousAdamW(groups(model), module=model, device_assist="always")
    with pytest.raises(TypeError, match="device_assist"):
        HeterogeneousAdamW(groups(model), module=model, device_assist=1)


@pytest.mark.parametrize("option,cuda,sharded,deterministic,expected", [
    ("auto", True, False, False, True),
    ("auto", False, False, False, False),
    ("auto", True, False, True, False),  # torch.use_deterministic_algorithms(True): the CPU alone
    (True, True, False, True, True),
    (True, False, False, False, True),
    (True, True, True, False, False),  # each rank's CPU updates its own share
    (False, True, False, False, False),
])
def test_assist_enabled_table(option, cuda, sharded, deterministic, expected):
    assert assist_enabled(option, cuda, sharded, deterministic) is expected


@pytest.mark.parametrize("lo,hi,chunk,expected", [
    (0, 8, 4, [(0, 4), (4, 8)]),
    (2, 9, 4, [(2, 6), (6, 9)]),
    (5, 5, 4, []),
    (0, 3, 8, [(0, 3)]),
])
def test_chunk_spans_table(lo, hi, chunk, expected):
    assert chunk_spans(lo, hi, chunk) == expected


def test_shared_buckets_give_each_bucket_once_from_both_ends_under_contention():
    buckets = [SimpleNamespace(index=i) for i in range(200)]
    shared = SharedBuckets(list(reversed(buckets)))
    front, back = [], []

    def take(side, out):
        while (b := getattr(shared, side)()) is not None:
            out.append(b.index)

    threads = [threading.Thread(target=take, args=("take_front", front)),
               threading.Thread(target=take, args=("take_back", back))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(front + back) == list(range(200))
    assert front == sorted(front, reverse=True)  # the front: the highest index (the forward's first) first
    assert back == sorted(back)


def _task(kind, index, ctx):
    return (kind, SimpleNamespace(index=index), ctx)


def _ctx(dec):
    return SimpleNamespace(poll=lambda block=False: dec)


@pytest.mark.parametrize("case,expected_taken", [
    ("decided", 3),           # a run of the step's buckets, decision known: all shared
    ("undecided", 0),         # the decision is not known yet: speculative or waiting, the CPU's alone
    ("skipped", 0),           # a skipped step has nothing to update
    ("single", 0),            # one bucket: not worth a split
    ("redo_first", 0),        # redos of rolled-back buckets run on the CPU first
    ("no_assist", 0),
])
def test_take_shared_table(case, expected_taken):
    dec = SimpleNamespace(skip=case == "skipped")
    ctx = _ctx(None if case == "undecided" else dec)
    pending = [_task("bucket", i, ctx) for i in range(1 if case == "single" else 3)] + [("finish", None, ctx)]
    if case == "redo_first":
        pending.insert(0, _task("redo", 9, ctx))
    updater = SimpleNamespace(assist=None if case == "no_assist" else object())
    before = len(pending)
    taken = take_shared(updater, pending)
    assert len(taken) == expected_taken
    assert len(pending) == before - expected_taken
    assert pending[-1][0] == "finish"


def test_assisted_run_with_no_clipping_matches_bitwise():
    ref_model, ref_opt, _ = train_reference(clip=None)
    model, opt = train_ours(clip=None, speculative=False, device_assist=True, gpu_fraction=0.0)
    assert opt.stats["assisted_buckets"] > 0
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def test_the_gpu_workers_thread_stops_when_the_optimizer_is_closed_or_collected():
    import gc

    model, opt = train_ours(steps=4, clip=CLIP, speculative=False, device_assist=True, gpu_fraction=0.0)
    assist = opt.updater.assist
    assert assist._thread is not None and assist._thread.is_alive()
    opt.close()
    assist._thread.join(timeout=10)
    assert not assist._thread.is_alive()

    model, opt = train_ours(steps=4, clip=CLIP, speculative=False, device_assist=True, gpu_fraction=0.0)
    thread = opt.updater.assist._thread
    del opt
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_an_assisted_update_makes_an_earlier_rollback_copy_stale():
    from lightning_gh.superoffload.step import Decision

    model, opt = train_ours(steps=3, clip=CLIP, speculative=True, rollback="copy", device_assist=True,
                            gpu_fraction=0.0)
    b = next(b for b in opt.layout.buckets if b.active)
    opt.updater._backup(b, "test")  # what the worker does while idle, for the next speculative step
    assert b.backup.fresh
    dec = Decision(skip=False, coef=None, hp=opt._hp_snapshot(), redo=False)
    opt.updater.assist._update(b, dec, None, None, None)  # updates the state in place
    assert not b.backup.fresh  # a later rollback must copy again, not restore the state of a step before
    opt.close()
