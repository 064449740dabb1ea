"""The one host-memory plan the offloading parts share (see Note [One host-memory plan] in lightning_gh/_host.py)."""

import pytest

from lightning_gh import _host
from lightning_gh._host import HostMemoryError, HostPlan

GIB = 2**30


class FakeHost:
    """MemAvailable that drops as the parts allocate what they claimed."""

    def __init__(self, avail_gib: float) -> None:
        self.avail = int(avail_gib * GIB)

    def __call__(self) -> int:
        return self.avail


def plan_with(avail_gib: float) -> HostPlan:
    return HostPlan(available=FakeHost(avail_gib))


def hold(plan: HostPlan, part: str, gib: float, **kw) -> None:
    """``part`` claims ``gib`` and allocates it (the host's available memory drops by as much)."""
    plan.claim(part, int(gib * GIB), what=part, **kw)
    plan._available.avail -= int(gib * GIB)


@pytest.mark.parametrize(
    ("avail", "others", "part", "room"),
    [
        # available GiB, [(part, held GiB, declared GiB)], the asking part, its room in GiB (headroom 0.9)
        (100, [], "SuperOffload", 90),
        (100, [("ActivationOffload", 0, 10)], "SuperOffload", 80),
        # SuperOffload holds 80 GiB, so 20 are left available: the budget is 0.9 x (20 + 80), not half of 20
        (20, [("SuperOffload", 80, 0)], "ActivationOffload", 10),
        (20, [("SuperOffload", 80, 0), ("KVCache", 0, 4)], "ActivationOffload", 6),
        # a part's own holding counts in its room (room is its total)
        (20, [("SuperOffload", 80, 0)], "SuperOffload", 90),
        (10, [("SuperOffload", 100, 0)], "ActivationOffload", 0),
    ],
)
def test_room_is_the_budget_less_the_other_parts_shares(avail, others, part, room):
    plan = plan_with(avail + sum(held for _, held, _ in others))
    for name, held, declared in others:
        if held:
            hold(plan, name, held, headroom=1.0)
        if declared:
            plan.declare(name, int(declared * GIB))
    assert plan.room(part) == pytest.approx(room * GIB, abs=1)


def test_a_claim_replaces_the_parts_total_and_uses_up_its_declaration():
    plan = plan_with(100)
    plan.declare("ActivationOffload", 10 * GIB)
    plan.claim("ActivationOffload", 4 * GIB, what="pool")
    (share,) = plan.shares()
    assert (share.held_bytes, share.declared_bytes) == (4 * GIB, 6 * GIB)
    plan.claim("ActivationOffload", 12 * GIB, what="pool")
    (share,) = plan.shares()
    assert (share.held_bytes, share.declared_bytes) == (12 * GIB, 0)
    plan.release("ActivationOffload")
    assert plan.shares() == []


def test_the_error_names_every_parts_share_and_the_way_out():
    plan = plan_with(120)
    hold(plan, "SuperOffload", 90, headroom=1.0)
    plan.declare("KVCache", 2 * GIB)
    with pytest.raises(HostMemoryError) as err:
        plan.claim("ActivationOffload", 20 * GIB, what="ActivationOffload's pool", tips=["a smaller budget"],
                   opt_out="host_memory_check=False")
    msg = str(err.value)
    for text in ("ActivationOffload's pool needs 20.00 GiB", "SuperOffload holds 90.00 GiB",
                 "KVCache will take 2.00 GiB", "at most 90% of the 120.00 GiB available", "budget: 108.00 GiB", "To fit: a smaller budget",
                 "host_memory_check=False"):
        assert text in msg
    assert isinstance(err.value, MemoryError)


def test_unknown_host_memory_passes_every_claim():
    plan = HostPlan(available=lambda: None)
    assert plan.room("SuperOffload") is None
    assert plan.claim("SuperOffload", 10**15, what="x") is None


@pytest.mark.parametrize(("value", "exc"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_sizes_are_refused(value, exc):
    with pytest.raises(exc, match="nbytes="):
        plan_with(10).claim("SuperOffload", value, what="x")


def test_check_host_room_with_a_part_goes_through_the_process_plan(monkeypatch):
    monkeypatch.setattr(_host.hardware, "available_host_bytes", lambda: 50 * GIB)
    try:
        _host.PLAN.declare("ActivationOffload", 20 * GIB)
        with pytest.raises(HostMemoryError, match="ActivationOffload will take 20.00 GiB"):
            _host.check_host_room(30 * GIB, what="HeterogeneousAdamW", part="SuperOffload")
        _host.check_host_room(20 * GIB, what="HeterogeneousAdamW", part="SuperOffload")
        assert {s.part for s in _host.PLAN.shares()} == {"ActivationOffload", "SuperOffload"}
    finally:
        _host.PLAN.release("ActivationOffload")
        _host.PLAN.release("SuperOffload")


def test_a_share_is_released_when_its_owner_is_collected():
    import gc

    class Pool:
        pass

    plan = plan_with(100)
    pool = Pool()
    plan.claim("KVCache", 5 * GIB, what="pool", owner=pool)
    assert [s.part for s in plan.shares()] == ["KVCache"]
    del pool
    gc.collect()
    assert plan.shares() == []


def test_an_owner_collected_while_the_plan_holds_its_lock_does_not_deadlock():
    """The collector can run an owner's release inside the plan's own locked section (on the same thread): the
    release is queued and applied at the plan's next call, instead of waiting for the lock the thread holds."""
    import gc
    import threading

    plan = HostPlan(available=lambda: 100 * 2**30)

    class Owner:
        pass

    owner = Owner()
    plan.claim("SuperOffload", 2**30, what="state", owner=owner)
    done = threading.Event()

    def collect_inside_the_lock() -> None:
        nonlocal owner
        with plan._locked():
            owner = None
            gc.collect()  # runs the finalizer here, with the plan's lock held by this thread
        done.set()

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert done.is_set(), "the owner's release waited for the lock its own thread held"
    assert plan.shares() == []


def test_superoffload_plans_around_what_another_part_announced(monkeypatch):
    """SuperOffload sizes its speculation copies from its room in the plan, not from all of MemAvailable."""
    from lightning_gh.superoffload import memory

    monkeypatch.setattr(_host.hardware, "available_host_bytes", lambda: 100 * GIB)
    params = 25 * 10**8  # 35 GB of state at 14 B, 30 GB more for every copy
    owner = type("Layout", (), {})()
    alone = memory.check_host_memory(params, local_ranks=1, speculative="auto", grad_bytes=2)
    _host.PLAN.declare("ActivationOffload", 40 * GIB)
    shared = memory.check_host_memory(params, local_ranks=1, speculative="auto", grad_bytes=2, owner=owner)
    assert alone.backup_params == params  # 90 GiB of room: every copy fits
    assert 0 < shared.backup_params < params  # 60 GiB of room less the state: copies for part of it
    assert {s.part for s in _host.PLAN.shares()} == {"ActivationOffload", "SuperOffload"}


def test_a_zero12_rank_reserves_its_process_bytes_beside_the_state(monkeypatch):
    """Two ZeRO-1/2 ranks on a 250 GiB host: a 14.8B model's state (16 B per parameter, half per rank) fits the
    ranks' shares alone, not beside each rank's process bytes: a clear error naming the ZeRO-3 strategy, before
    anything is allocated; the 7.2B model still fits."""
    from lightning_gh.superoffload import memory

    monkeypatch.setattr(_host.hardware, "available_host_bytes", lambda: 250 * GIB)
    big, small = 14_770_000_000, 7_240_000_000
    assert memory.check_host_memory(big, speculative=False, local_ranks=2, shards=2).host_params == big // 2
    with pytest.raises(HostMemoryError, match='superoffload_fsdp') as e:
        memory.check_host_memory(big, speculative=False, local_ranks=2, shards=2,
                                 process_bytes=memory.rank_process_bytes(big, 2))
    assert "the rank's process takes beside them" in str(e.value)
    plan = memory.check_host_memory(small, speculative="auto", local_ranks=2, shards=2,
                                    process_bytes=memory.rank_process_bytes(small, 2))
    assert plan.host_params == small // 2
