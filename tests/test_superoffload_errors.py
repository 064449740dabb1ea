"""SuperOffload's guards: host RAM per rank, and clear errors for optimizers and strategies it cannot serve, each
naming what was given and what to use instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gh import hardware
from lightning_gh._host import HostMemoryError
from lightning_gh.superoffload import HeterogeneousAdamW, memory
from lightning_gh.superoffload.strategy import _unsupported_optimizer_message


def test_host_memory_guard_checks_each_ranks_share(monkeypatch):
    params = 10_000_000
    need = params * memory.host_bytes_per_param(speculative_backup=True)
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: int(need / 0.9 * 1.5))
    memory.check_host_memory(params, True, local_ranks=1)  # fits on its own
    with pytest.raises(HostMemoryError, match=r"this rank's share: 1/2 of the host.*run fewer ranks per host"):
        memory.check_host_memory(params, True, local_ranks=2)  # two ranks on the host do not
    with pytest.raises(ValueError, match=r"local_ranks=0 must be an int >= 1 or None"):
        memory.check_host_memory(params, True, local_ranks=0)


def test_local_world_size_reads_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory.local_world_size() == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert memory.local_world_size() == 1  # no process group in this test


def test_optimizer_guard_uses_the_local_world_size(monkeypatch):
    model = nn.Linear(512, 512)
    need = sum(p.numel() for p in model.parameters()) * memory.host_bytes_per_param(speculative_backup=True)
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: int(need / 0.9 * 3))
    HeterogeneousAdamW(model.parameters(), module=model).close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(HostMemoryError, match="1/8"):
        HeterogeneousAdamW(model.parameters(), module=model)


@pytest.mark.parametrize("attrs, kind", [
    ({"device_mesh": None, "placements": ()}, "a DTensor"),
    ({"_fsdp_flattened": True}, "an FSDP FlatParameter"),
    ({"ds_id": 3}, "a DeepSpeed ZeRO-3 partitioned parameter"),
])
def test_sharded_parameters_are_refused_with_what_to_use(attrs, kind):
    p = nn.Parameter(torch.zeros(4, 2))
    for k, v in attrs.items():
        setattr(p, k, v)
    with pytest.raises(TypeError, match=rf"got {kind}.*of shape \(4, 2\).*strategy='superoffload_fsdp'.*"
                                        r"strategy='superoffload'.*deepspeed_stage_3_offload"):
        HeterogeneousAdamW([p])


def test_process_group_of_several_ranks_shards_instead_of_refusing(monkeypatch):
    """Under a process group of 2+ ranks the optimizer shards its state (tests/test_superoffload_zero.py runs it);
    it no longer refuses. Here only the choice is checked, with a faked group of 2 on rank 1."""
    from lightning_gh.superoffload import zero

    monkeypatch.setattr(zero, "current_group", lambda: zero.RankGroup(rank=1, size=2, backend="gloo", local_size=2))
    monkeypatch.setattr("lightning_gh.superoffload.optimizer.current_group", zero.current_group)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = HeterogeneousAdamW(model.parameters(), module=model, bucket_size=64 * 64)
    owned = [b for b in opt.layout.buckets if b.owner == 1]
    assert owned and len(owned) < len(opt.layout.buckets)  # rank 1 holds state for its share only
    assert opt.host_numel == sum(b.numel for b in owned)
    assert opt.options.gpu_fraction == "auto" and opt.stats["tail_decision"] is None  # decided with the other ranks later
    opt.updater.close()  # nothing to synchronize with the (fake) other rank: no close()


def test_unsupported_optimizers_name_the_alternative():
    p = [nn.Parameter(torch.zeros(2))]
    msg = _unsupported_optimizer_message(torch.optim.Adam(p, weight_decay=0.1))
    assert "returned Adam" in msg and "decoupled" in msg and "torch.optim.AdamW" in msg
    msg = _unsupported_optimizer_message(torch.optim.SGD(p, lr=0.1))
    assert "returned SGD" in msg and "strategy='auto'" in msg


# ---------------------------------------------------------------------------------------------------------------
# The host plan: which configuration fits (a pure function of the sizes), as a table

GIB = 2**30
B7 = 7_240_000_000  # the 7B job's parameters


@pytest.mark.parametrize("kwargs,expect", [
    # the 7B job on a 125 GiB host, bf16 gradients (14 B/param): the state fits, backups for what is left
    (dict(params=B7, available_bytes=125 * GIB, grad_bytes=2),
     dict(host_params=B7, backup_params=int(0.9 * 125 * GIB - 14 * B7) // 12, device_params=0, why="room for")),
    # speculative=True keeps its meaning: a backup for every bucket, which does not fit there
    (dict(params=B7, available_bytes=125 * GIB, grad_bytes=2, speculative=True),
     dict(host_params=B7, backup_params=B7, fits=False, why="speculative=True")),
    (dict(params=1000, available_bytes=40_000), dict(host_params=1000, backup_params=1000, why="every bucket")),
    (dict(params=1000, available_bytes=22_223), dict(host_params=1000, backup_params=333, why="333 of 1,000")),
    (dict(params=1000, available_bytes=17_780), dict(host_params=1000, backup_params=0, why="no host RAM left")),
    (dict(params=1000, available_bytes=18_000, speculative=False), dict(backup_params=0, why="speculative=False")),
    (dict(params=1000, available_bytes=18_000, validation=False), dict(backup_params=0, why="need no backup")),
    (dict(params=1000, available_bytes=None), dict(host_params=1000, backup_params=1000, why="unknown")),
    # two ranks on the host, the state sharded over both: each holds half, with half of the host
    (dict(params=1000, available_bytes=40_000, shards=2, local_ranks=2),
     dict(host_params=500, backup_params=500, why="every bucket")),
    # a fixed GPU share: only the rest needs host state
    (dict(params=1000, available_bytes=18_000, gpu_share=0.5),
     dict(host_params=500, device_params=500, backup_params=500)),
    # the host cannot hold the state: the auto tail keeps the rest on the GPU from the start, where it fits
    (dict(params=1000, available_bytes=10_000, gpu_room_bytes=14 * 500),
     dict(host_params=562, device_params=438, backup_params=0, why="cannot hold every parameter's state")),
    (dict(params=1000, available_bytes=10_000, gpu_room_bytes=14 * 100),
     dict(fits=False, largest=562 + 100, why="cannot hold the state")),
    (dict(params=1000, available_bytes=10_000), dict(fits=False, largest=562)),
    (dict(params=1000, available_bytes=7_000, gpu_share=0.5), dict(fits=False, largest=786)),
], ids=["7B-125GiB", "7B-speculative-True", "all-backups", "some-backups", "no-backup", "speculative-False",
        "no-validation", "host-unknown", "two-ranks", "fixed-gpu-share", "host-overflow-to-gpu", "gpu-too-small",
        "nothing-fits", "nothing-fits-fixed-share"])
def test_host_plan_table(kwargs, expect):
    plan = memory.plan_host_memory(**kwargs)
    room = None if plan.available_bytes is None else 0.9 * plan.available_bytes / kwargs.get("local_ranks", 1)
    assert (room is None or plan.needed_bytes <= room) == expect.pop("fits", True), plan
    if "why" in expect:
        assert expect.pop("why") in plan.reason, plan.reason
    if "largest" in expect:
        assert plan.largest_params == expect.pop("largest"), plan
    for key, value in expect.items():
        assert getattr(plan, key) == value, (key, plan)
