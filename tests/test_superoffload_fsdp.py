"""SuperOffload ZeRO-3 through FSDP2 (ShardedHostAdamW, SuperOffloadFSDPStrategy) on the CPU: 2 processes, gloo.

The reference is one process running ``clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)`` on the unsharded model,
with its gradient formed the way the ranks form it: each rank's gradient of its own half of the global batch
(``g_r``) averaged over the ranks, ``(g_0 + g_1) / 2``. FSDP2's reduce-scatter on gloo divides each rank's gradient
by 2 before the sum, ``g_0 / 2 + g_1 / 2``, which is the same number (halving is exact), so the comparison is
bitwise. Each run covers norm clipping (some steps clipped), one injected inf on rank 1 (the step skipped on every
rank), two param groups (with and without weight decay, their parameters interleaved across the FSDP units) and an
LR schedule. A one-process run that takes both halves, loss ``(l_0 + l_1) / 2``, forms the same gradient.

Every multi-process run forks its processes (no re-import of pytest and Lightning) and kills them after
``TIMEOUT_S``, so nothing can hang.
"""

from __future__ import annotations

import os
import socket
import traceback

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_superoffload_zero import groups, schedule  # the ZeRO-1/2 tests' param groups and LR schedule
from torch import nn

from lightning_gh.superoffload import cpu_adamw
from lightning_gh.superoffload.fsdp import SuperOffloadFSDPStrategy, check_optimizers
from lightning_gh.superoffload.fsdp_optimizer import ShardedHostAdamW
from lightning_gh.superoffload.fsdp_units import (
    LocalShard,
    device_share,
    fsdp_units,
    positioned_update,
    tail_range,
    unsupported_options,
)
from lightning_gh.superoffload.options import SuperOffloadOptions

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

STEPS = 20
MID = STEPS // 2
INF_STEP = 7  # rank 1's loss is scaled by inf at this step: every rank must skip it
MAX_NORM = 0.7
WORLD = 2
TIMEOUT_S = 240


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(12, 24), nn.Tanh()), nn.Sequential(nn.Linear(24, 23), nn.Tanh()),
                         nn.Linear(23, 3))


def shard(model: nn.Module, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 12, generator=g)
    y = torch.randn(6, 3, generator=g)
    loss = (model(x) - y).square().mean()
    if step == INF_STEP and rank == 1:
        loss = loss * float("inf")
    return loss


def both_halves(model: nn.Module, step: int) -> tuple[torch.Tensor, list[float]]:
    """One process, both ranks' halves: ``(l_0 + l_1) / 2`` (its gradient is ``(g_0 + g_1) / 2`` bit for bit)."""
    halves = [local_loss(model, step, r) for r in range(WORLD)]
    return (halves[0] + halves[1]) / WORLD, [h.item() for h in halves]


def reference(steps: int = STEPS) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: a matmul split over other thread counts rounds differently
    try:
        model = make_model()
        opt = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), fused=True)
        sched = schedule(opt)
        losses = []
        params = list(model.parameters())
        for step in range(steps):
            gs = []
            step_losses = []
            for r in range(WORLD):
                loss = local_loss(model, step, r)
                step_losses.append(loss.item())
                gs.append(torch.autograd.grad(loss, params))
            losses.append(step_losses)
            for p, g0, g1 in zip(params, *gs):
                p.grad = (g0 + g1) / WORLD
            total = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], MAX_NORM)
            if torch.isfinite(total):
                opt.step()
            opt.zero_grad()
            sched.step()
        state = opt.state_dict()["state"]
        return {"params": [p.detach().clone() for p in params], "losses": losses,
                "state": {i: {k: v.clone() for k, v in st.items()} for i, st in state.items()}}
    finally:
        torch.set_num_threads(threads)


def reference_accumulated(steps: int) -> dict:
    """The reference with two micro-batches a step (batches ``2 s`` and ``2 s + 1``), each loss divided by 2 as
    Lightning's ``accumulate_grad_batches=2`` divides it; each micro-batch's gradient averaged over the ranks as the
    reduce-scatter forms it, then summed as FSDP2 sums it into the sharded gradient."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), fused=True)
        sched = schedule(opt)
        params = list(model.parameters())
        losses = {}
        for step in range(steps):
            acc = None
            for batch in (2 * step, 2 * step + 1):
                gs = []
                for r in range(WORLD):
                    loss = local_loss(model, batch, r)
                    losses.setdefault(batch, []).append(loss.item())
                    gs.append(torch.autograd.grad(loss / 2, params))
                reduced = [(g0 + g1) / WORLD for g0, g1 in zip(*gs)]
                acc = reduced if acc is None else [a + g for a, g in zip(acc, reduced)]
            for p, g in zip(params, acc):
                p.grad = g
            total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            if torch.isfinite(total):
                opt.step()
            opt.zero_grad()
            sched.step()
        return {"params": [p.detach().clone() for p in params], "losses": losses}
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------------
# processes with a timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world: int, port: int, tmp: str, args: tuple) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                          LOCAL_RANK=str(rank), RANK=str(rank))
        fn(rank, world, tmp, *args)
    except BaseException:
        with open(f"{tmp}/error-{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(fn, world: int, tmp: str, *args, timeout: float = TIMEOUT_S) -> None:
    """Run ``fn(rank, world, tmp, *args)`` in ``world`` forked processes; fail on an error or after ``timeout``."""
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, tmp, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    errors = [open(f"{tmp}/error-{r}.txt").read() for r in range(world) if os.path.exists(f"{tmp}/error-{r}.txt")]
    assert not errors, "\n".join(errors)
    assert not alive, f"{fn.__name__}: {len(alive)} process(es) still running after {timeout} s, killed"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _init(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ---------------------------------------------------------------------------------------------------------------
# (1) the optimizer without Lightning, and distributed checkpoints through torch.distributed.checkpoint


class SpyAdamW(ShardedHostAdamW):
    """Records, at each forward pre-hook wait, whether the unit's parameters are still sharded (DTensors): FSDP2's
    own pre-forward hook, which all-gathers them, has not run yet."""

    def wait_for(self, unit_index: int) -> None:
        from torch.distributed.tensor import DTensor

        params = self.test_units[unit_index]
        self.test_sharded_at_wait.append(all(isinstance(p, DTensor) for p in params))
        super().wait_for(unit_index)


def _opt(model: nn.Module, cls=ShardedHostAdamW, gpu_fraction: float | str = "auto",
         weights_first: bool = True) -> ShardedHostAdamW:
    return cls(groups(model), lr=1e-2, betas=(0.9, 0.95), module=model, max_grad_norm=MAX_NORM, cpu_threads=1,
               gpu_fraction=gpu_fraction, weights_first=weights_first)


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _full_state(opt: ShardedHostAdamW) -> dict:
    return {i: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in st.items()}
            for i, st in opt.state_dict()["state"].items()}


def _save(model, opt, sched, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(sched.state_dict(), f"{path}-sched.pt")


def _load(model, opt, sched, path: str) -> None:
    """As Lightning's ModelParallelStrategy loads a distributed checkpoint: the model first, then the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"], options=StateDictOptions(cpu_offload=True))
    sched.load_state_dict(torch.load(f"{path}-sched.pt"))


#: Device bytes beyond the margin that the ``"auto-room"`` runs report free: about half of the test model's state
#: (16 B per local element with fp32 gradients, 480 elements on the larger rank).
HALF_ROOM = 16 * 480 // 2


def _report_room_for_half() -> None:
    """Make the CPU "device" report room beside the margin for about half of a rank's state (forked child only)."""
    from lightning_gh.superoffload import memory as so_memory

    so_memory.device_memory_room = lambda dev: (2**30 + HALF_ROOM, 2 * 2**30)  # the margin is 1 GiB here


def _module_run(rank: int, world: int, tmp: str, fraction: float | str = "auto", weights_first: bool = True) -> None:
    from torch.distributed.tensor import DTensor

    _init(rank, world)
    tag = "" if fraction == "auto" else f"-share{fraction}"
    if fraction in ("auto-room", "auto-oom"):  # gpu_fraction="auto" where the device reports room for half the state
        _report_room_for_half()
        if fraction == "auto-oom" and rank == 1:  # ... but rank 1's move runs out of device memory
            from lightning_gh.superoffload import fsdp_units as units_module

            def no_room(self, numel, device):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

            units_module._DeviceBuffer.__init__ = no_room
        fraction = "auto"
    model = shard(make_model())
    control: list[bool] = []  # a plain pre-hook runs after FSDP2's: the parameters are unsharded there
    model[1].register_forward_pre_hook(lambda m, a: control.append(isinstance(m[0].weight, DTensor)))
    SpyAdamW.test_units = [params for _, params in fsdp_units(model)]
    SpyAdamW.test_sharded_at_wait = []
    opt = _opt(model, SpyAdamW, fraction, weights_first)
    sched = schedule(opt)
    losses = []
    released = []  # after backward, before step(): no parameter holds a gradient (all moved to the host)
    for step in range(STEPS):
        loss = local_loss(model, step, rank)
        losses.append(loss.item())
        loss.backward()
        released.append(all(p.grad is None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 == MID:
            _save(model, opt, sched, f"{tmp}/dcp{tag}")
    opt.synchronize()  # the last step's update is in the weights (the next forward would wait for it)
    out = {"params": _full(model), "state": _full_state(opt), "stats": dict(opt.stats), "losses": losses,
           "sharded_at_wait": list(SpyAdamW.test_sharded_at_wait), "control": control,
           "host_numel": sum(u.state.tensor.numel() // 3 for u in opt._units if not u.on_device),
           "device_units": opt.device_units, "released": released, "updates_on_host": opt.updates_on_host}
    opt.close()

    # resume on the same 2 ranks from the step-MID checkpoint
    model = shard(make_model())
    opt = _opt(model, gpu_fraction=fraction)
    sched = schedule(opt)
    _load(model, opt, sched, f"{tmp}/dcp{tag}")
    resumed = []
    for step in range(MID, STEPS):
        loss = local_loss(model, step, rank)
        resumed.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.synchronize()
    out["resumed_params"] = _full(model)
    out["resumed_losses"] = resumed
    opt.close()
    out["resumed_device_units"] = opt.device_units
    torch.save(out, f"{tmp}/module{tag}-rank{rank}.pt")
    dist.destroy_process_group()


def _module_resume_on_one(rank: int, world: int, tmp: str) -> None:
    _init(rank, world)
    model = shard(make_model())
    opt = _opt(model)
    sched = schedule(opt)
    _load(model, opt, sched, f"{tmp}/dcp")
    losses = []
    for step in range(MID, STEPS):
        loss, halves = both_halves(model, step)
        losses.append(halves)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.synchronize()
    torch.save({"params": _full(model), "state": _full_state(opt), "losses": losses}, f"{tmp}/one.pt")
    opt.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3"))
    run_ranks(_module_run, WORLD, tmp)
    run_ranks(_module_resume_on_one, 1, tmp)
    return {"ranks": [torch.load(f"{tmp}/module-rank{r}.pt") for r in range(WORLD)], "one": torch.load(f"{tmp}/one.pt"),
            "ref": reference()}


def _assert_state(ours: dict, ref: dict) -> None:
    assert set(ours) == set(ref)
    for i, st in ref.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[i][key].reshape(st[key].shape), st[key]), (i, key)
        assert "master" not in ours[i]  # fp32 parameters: the master is the parameter


def _assert_equals_reference(out: dict, ref: dict, rank: int) -> None:
    """Rank ``rank``'s run of the module equals the one-process reference: parameters and AdamW state bitwise, its
    half of each step's loss, every step taken, the injected inf skipped, some steps clipped and not all."""
    for p, q in zip(out["params"], ref["params"]):
        assert torch.equal(p, q), f"rank {rank}: parameters differ"
    _assert_state(out["state"], ref["state"])
    assert out["losses"] == [ref["losses"][s][rank] for s in range(STEPS)]
    st = out["stats"]
    assert st["steps"] == STEPS and st["skipped_steps"] == 1 and 0 < st["clipped_steps"] < STEPS - 1, st
    if st["weights_first"]:  # the host units' state was written in a second pass (see weights_first)
        assert st["writeback_ms"] > 0, st
    assert st["last_grad_norm"] is not None and st["last_grad_norm"] > 0


def test_two_ranks_equal_one_process_adamw_bitwise(module_runs):
    ref = module_runs["ref"]
    kernel = cpu_adamw.load() is not None
    assert [out["stats"]["weights_first"] for out in module_runs["ranks"]] == [kernel] * WORLD  # the default
    for rank, out in enumerate(module_runs["ranks"]):
        _assert_equals_reference(out, ref, rank)
    total = sum(p.numel() for p in ref["params"])
    assert sum(out["host_numel"] for out in module_runs["ranks"]) == total  # each rank holds its rows only
    assert all(out["updates_on_host"] for out in module_runs["ranks"])


@pytest.fixture(scope="module")
def share_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3-share"))
    run_ranks(_module_run, WORLD, tmp, 0.5, False)  # and in one pass (weights_first=False)
    return [torch.load(f"{tmp}/module-share0.5-rank{r}.pt") for r in range(WORLD)]


def test_gpu_share_equals_one_process_adamw_bitwise_and_resumes(share_runs, module_runs):
    """gpu_fraction=0.5: the first units in forward order (the root, then model[0]: 384 of 959 elements) keep their
    state on the parameters' device (here the CPU) and are updated there by torch's fused AdamW in step(); results
    bitwise equal to the reference, the host buffers hold only model[1]'s rows, and a checkpoint resumes."""
    ref = module_runs["ref"]
    for rank, out in enumerate(share_runs):
        assert out["device_units"] == [0, 1] and out["resumed_device_units"] == [0, 1]
        assert out["updates_on_host"]  # model[1]'s units stay on the host
        assert out["stats"]["weights_first"] is False and out["stats"]["writeback_ms"] == 0
        _assert_equals_reference(out, ref, rank)
        assert out["released"] == [False] * STEPS  # the device units' gradients stay in param.grad for step()
        assert out["resumed_losses"] == out["losses"][MID:]
        assert all(torch.equal(p, q) for p, q in zip(out["resumed_params"], out["params"]))
    assert sum(out["host_numel"] for out in share_runs) == 24 * 23 + 23  # model[1] only, split over the ranks


@pytest.fixture(scope="module")
def auto_share_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3-auto-share"))
    run_ranks(_module_run, WORLD, tmp, "auto-room")
    return [torch.load(f"{tmp}/module-shareauto-room-rank{r}.pt") for r in range(WORLD)]


def test_auto_gpu_share_is_sized_from_the_room_once_and_stays_bitwise(auto_share_runs, module_runs):
    """gpu_fraction="auto" with device room for about half of the state: after its second step each rank moves the
    same first units in forward order (the root and model[0]) to the device, says so, and the run stays bitwise
    equal to the reference (the checkpoint resumes, sizing the share again)."""
    from lightning_gh.superoffload.fsdp_units import AUTO_SHARE_STEP

    ref = module_runs["ref"]
    for rank, out in enumerate(auto_share_runs):
        assert out["device_units"] == [0, 1] and out["resumed_device_units"] == [0, 1]
        assert "2 of 3 FSDP units (40.0% of the elements)" in out["stats"]["gpu_share_decision"]
        _assert_equals_reference(out, ref, rank)
        # streamed to the host until the share was sized; then the device units keep their gradients for step()
        assert out["released"] == [True] * AUTO_SHARE_STEP + [False] * (STEPS - AUTO_SHARE_STEP)
        assert out["resumed_losses"] == out["losses"][MID:]
        assert all(torch.equal(p, q) for p, q in zip(out["resumed_params"], out["params"]))


def test_a_rank_whose_move_runs_out_of_memory_keeps_every_rank_on_the_host(tmp_path, module_runs):
    """If one rank cannot allocate the GPU share, every rank keeps its state on the host (no rank is left alone in a
    collective), the decision line says why, and the run stays bitwise equal to the reference."""
    run_ranks(_module_run, WORLD, str(tmp_path), "auto-oom")
    for rank in range(WORLD):
        out = torch.load(f"{tmp_path}/module-shareauto-oom-rank{rank}.pt")
        assert out["device_units"] == [] and "ran out of memory on some rank" in out["stats"]["gpu_share_decision"]
        _assert_equals_reference(out, module_runs["ref"], rank)


@pytest.mark.parametrize(("order", "numels", "fraction", "expected"), [
    ([0, 1, 2], [72, 312, 575], 0.5, [0, 1]),  # the test model: the root and model[0]
    ([0, 1, 2], [72, 312, 575], 1.0, [0, 1, 2]),
    ([0, 1, 2], [72, 312, 575], 0.0, []),
    ([0, 1, 2], [72, 312, 575], 0.04, [0]),  # half of the root's elements fit
    ([0, 1, 2], [72, 312, 575], 0.03, []),
    ([2, 0, 1], [72, 312, 575], 0.5, [2]),  # forward order, not module order: a prefix, never a later unit
    ([1, 0], [10, 10], 0.74, [1]),
    ([1, 0], [10, 10], 0.75, [1, 0]),
    ([], [], 0.5, []),
])
def test_device_share_table(order, numels, fraction, expected):
    assert device_share(order, numels, fraction) == expected


def _forward_before_writeback(rank: int, world: int, tmp: str) -> None:
    """Hold every second pass until the next forward has run: it must need the first pass only."""
    import threading

    from lightning_gh.superoffload import weights_first

    _init(rank, world)
    gate, real = threading.Event(), weights_first.update_in_place

    def held(*args, **kwargs):
        if not gate.wait(20):
            raise RuntimeError("the second pass was held for 20 s: the forward waited for it")
        return real(*args, **kwargs)

    weights_first.update_in_place = held  # a forked process: the parent's module is untouched
    model = shard(make_model())
    opt = _opt(model)
    local_loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    loss = local_loss(model, 1, rank)  # the next forward, while every unit's state waits behind the gate
    pending = [u.index for u in opt._units if not u.done.is_set()]
    finished = threading.Event()
    backward = threading.Thread(target=lambda: (loss.backward(), finished.set()), daemon=True)
    backward.start()
    blocked = not finished.wait(0.5)  # its first unit's gradient copy waits for that unit's second pass
    gate.set()
    assert finished.wait(20)
    opt.step()
    opt.synchronize()
    torch.save({"pending": pending, "units": len(opt._units), "writeback_ms": opt.stats["writeback_ms"],
                "blocked": blocked}, f"{tmp}/writeback.pt")
    opt.close()
    dist.destroy_process_group()


def test_the_forward_waits_for_the_weights_not_the_state(tmp_path):
    """weights_first: the next forward runs while every host unit's master rows and moments are still being
    written (held here), and the backward after it waits for them (it does not finish while they are held)."""
    if cpu_adamw.load() is None:
        pytest.skip("needs the CPU AdamW kernel (a C compiler)")
    run_ranks(_forward_before_writeback, 1, str(tmp_path), timeout=120)
    out = torch.load(tmp_path / "writeback.pt")
    assert out["pending"] == list(range(out["units"])) and out["writeback_ms"] > 0
    assert out["blocked"]  # the backward after it waited for the held second pass


def test_gradients_leave_the_device_during_backward(module_runs):
    """Note [ZeRO-3 step and the forward's wait]: every unit's gradients were taken at its post-reduce point during
    backward (3 units a step) and released from param.grad before step(), with the results still bitwise (above)."""
    for out in module_runs["ranks"]:
        assert out["released"] == [True] * STEPS
        assert out["stats"]["streamed_units"] == 3 * STEPS


def test_forward_waits_before_fsdp_all_gather(module_runs):
    """Note [ZeRO-3 step and the forward's wait]: the optimizer's pre-hook runs before FSDP2's pre-forward hook."""
    for out in module_runs["ranks"]:
        assert len(out["sharded_at_wait"]) == 3 * STEPS and all(out["sharded_at_wait"])
        assert out["control"] and not any(out["control"])  # the check can tell: after FSDP2's hook, unsharded


def test_dcp_checkpoint_resumes_on_two_and_on_one(module_runs):
    ranks, one = module_runs["ranks"], module_runs["one"]
    for out in ranks:
        assert out["resumed_losses"] == out["losses"][MID:]
        assert all(torch.equal(p, q) for p, q in zip(out["resumed_params"], out["params"]))
    assert one["losses"] == [[ranks[0]["losses"][s], ranks[1]["losses"][s]] for s in range(MID, STEPS)]
    assert all(torch.equal(p, q) for p, q in zip(one["params"], ranks[0]["params"]))
    _assert_state(one["state"], module_runs["ref"]["state"])


# ---------------------------------------------------------------------------------------------------------------
# (2), (3) through Lightning: Trainer(strategy=SuperOffloadFSDPStrategy(), accelerator="cpu", devices=2)


class ShardedLM(L.LightningModule):
    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.model = make_model()
        self.out, self.tag = out, tag
        self.losses: dict[int, list[float]] = {}

    def configure_model(self):
        shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        if self.trainer.world_size == 1:
            loss, self.losses[step] = both_halves(self.model, step)
            return loss
        loss = local_loss(self.model, step, self.global_rank)
        self.losses[step] = [loss.item()]
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(groups(self.model), lr=1e-2, betas=(0.9, 0.95), fused=True)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)

    def on_fit_end(self):
        opt = self.trainer.optimizers[0]
        opt.synchronize()
        torch.save({"losses": self.losses, "params": _full(self.model), "stats": dict(opt.stats),
                    "type": type(opt).__name__}, f"{self.out}/{self.tag}-rank{self.global_rank}.pt")


def _fit(rank: int, world: int, tmp: str, tag: str, ckpt: str | None) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [] if ckpt else [ModelCheckpoint(dirpath=f"{tmp}/ckpt", every_n_train_steps=MID, save_top_k=-1,
                                                 filename="{step}")]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=SuperOffloadFSDPStrategy(cpu_threads=1),
                        max_steps=STEPS, logger=False, gradient_clip_val=MAX_NORM, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        enable_checkpointing=not ckpt, callbacks=callbacks, default_root_dir=tmp)
    trainer.fit(ShardedLM(tmp, tag), ckpt_path=ckpt)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3-trainer"))
    run_ranks(_fit, WORLD, tmp, "full", None)
    mid = f"{tmp}/ckpt/step={MID}.ckpt"
    assert os.path.isdir(mid)  # a distributed checkpoint: a folder of shards
    run_ranks(_fit, WORLD, tmp, "resume2", mid)
    run_ranks(_fit, 1, tmp, "resume1", mid)
    return {tag: [torch.load(f"{tmp}/{tag}-rank{r}.pt") for r in range(2 if tag != "resume1" else 1)]
            for tag in ("full", "resume2", "resume1")}


def test_trainer_on_two_ranks_equals_one_process_adamw_bitwise(trainer_runs, module_runs):
    ref = module_runs["ref"]
    for rank, out in enumerate(trainer_runs["full"]):
        assert out["type"] == "ShardedHostAdamW"
        assert [out["losses"][s][0] for s in range(STEPS)] == [ref["losses"][s][rank] for s in range(STEPS)]
        for p, q in zip(out["params"], ref["params"]):
            assert torch.equal(p, q), f"rank {rank}: parameters differ"
        st = out["stats"]
        assert st["skipped_steps"] == 1 and 0 < st["clipped_steps"] < STEPS - 1, st


def test_trainer_checkpoint_of_two_ranks_resumes_on_two_and_on_one(trainer_runs):
    full = trainer_runs["full"]
    for rank, out in enumerate(trainer_runs["resume2"]):
        assert sorted(out["losses"]) == list(range(MID, STEPS))
        assert all(out["losses"][s] == full[rank]["losses"][s] for s in out["losses"])
        assert all(torch.equal(p, q) for p, q in zip(out["params"], full[rank]["params"]))
    one = trainer_runs["resume1"][0]
    assert sorted(one["losses"]) == list(range(MID, STEPS))
    for s, pair in one["losses"].items():
        assert pair == [full[0]["losses"][s][0], full[1]["losses"][s][0]]
    assert all(torch.equal(p, q) for p, q in zip(one["params"], full[0]["params"]))


ACCUM_STEPS = 5  # optimizer steps of two micro-batches; batch INF_STEP is the second of step 3 (skipped)


class AccumulatingLM(ShardedLM):
    """Each micro-batch's data from its batch index; records whether param.grad was released after each backward."""

    def training_step(self, batch, batch_idx):
        loss = local_loss(self.model, int(batch), self.global_rank)
        self.losses[int(batch)] = [loss.item()]
        return loss

    def on_after_backward(self):
        self.released = [*getattr(self, "released", []), all(p.grad is None for p in self.model.parameters())]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(2 * ACCUM_STEPS)), batch_size=None)

    def on_fit_end(self):
        super().on_fit_end()
        torch.save(self.released, f"{self.out}/released-rank{self.global_rank}.pt")


def _fit_accumulated(rank: int, world: int, tmp: str) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=SuperOffloadFSDPStrategy(cpu_threads=1),
                        max_steps=ACCUM_STEPS, accumulate_grad_batches=2, logger=False, gradient_clip_val=MAX_NORM,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        enable_checkpointing=False, default_root_dir=tmp)
    trainer.fit(AccumulatingLM(tmp, "accumulated"))


def test_trainer_accumulate_grad_batches_equals_reference_bitwise(tmp_path):
    """accumulate_grad_batches=2: the first micro-batch's gradients stay in param.grad (FSDP2 sums the second's
    into them), the second's backward moves the sums to the host; parameters bitwise equal to the reference."""
    run_ranks(_fit_accumulated, WORLD, str(tmp_path))
    ref = reference_accumulated(ACCUM_STEPS)
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"accumulated-rank{rank}.pt")
        assert {b: v[0] for b, v in out["losses"].items()} == {b: v[rank] for b, v in ref["losses"].items()}
        for p, q in zip(out["params"], ref["params"]):
            assert torch.equal(p, q), f"rank {rank}: parameters differ"
        st = out["stats"]
        assert st["steps"] == ACCUM_STEPS and st["skipped_steps"] == 1 and st["clipped_steps"] > 0, st
        assert st["streamed_units"] == 3 * ACCUM_STEPS, st
        assert torch.load(tmp_path / f"released-rank{rank}.pt") == [False, True] * ACCUM_STEPS


def _streaming_switches(rank: int, world: int, tmp: str) -> None:
    _init(rank, world)
    model = shard(make_model())
    opt = _opt(model)
    out = {}
    local_loss(model, 0, 0).backward()
    out["plain"] = [p.grad is None for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    with opt.accumulating():
        local_loss(model, 1, 0).backward()
    out["accumulating"] = [p.grad is not None for p in model.parameters()]
    local_loss(model, 2, 0).backward()
    out["completing"] = [p.grad is None for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    opt.set_gradient_streaming(False)
    local_loss(model, 3, 0).backward()
    out["off"] = [p.grad is not None for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    opt.set_gradient_streaming(True)
    local_loss(model, 4, 0).backward()
    # clipping turned on between backward and step(): the norms come from the host rows
    late = shard(make_model())
    opt_late = ShardedHostAdamW(groups(late), lr=1e-2, betas=(0.9, 0.95), module=late, max_grad_norm=None,
                                skip_nonfinite=False, cpu_threads=1)
    local_loss(late, 0, 0).backward()
    opt_late.set_max_grad_norm(MAX_NORM)
    opt_late.step()
    opt_late.synchronize()
    clipped = shard(make_model())
    opt_clipped = _opt(clipped)
    local_loss(clipped, 0, 0).backward()
    opt_clipped.step()
    opt_clipped.synchronize()
    out["late"] = [torch.equal(p.to_local(), q.to_local()) for p, q in zip(late.parameters(), clipped.parameters())]
    out["late_clipped"] = opt_late.stats["clipped_steps"]
    opt_late.close()
    opt_clipped.close()
    try:  # last: an error raised inside FSDP2's backward leaves its state unusable
        local_loss(model, 5, 0).backward()  # a second backward before step(), not announced
        out["second"] = "no error"
    except RuntimeError as e:
        out["second"] = str(e)
    out["stats"] = dict(opt.stats)
    opt.close()
    torch.save(out, f"{tmp}/switches.pt")
    dist.destroy_process_group()


def test_gradient_streaming_switches(tmp_path):
    run_ranks(_streaming_switches, 1, str(tmp_path))
    out = torch.load(tmp_path / "switches.pt")
    assert all(out["plain"]) and all(out["accumulating"]) and all(out["completing"]) and all(out["off"])
    assert all(out["late"]) and out["late_clipped"] == 1
    assert "a second backward reached FSDP unit" in out["second"] and "optimizer.accumulating()" in out["second"]
    assert out["stats"]["steps"] == 3 and out["stats"]["streamed_units"] == 3 * 3  # not the accumulating or off ones


# ---------------------------------------------------------------------------------------------------------------
# errors before the first step, and the pure decisions


def test_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry.get("superoffload_fsdp"), SuperOffloadFSDPStrategy)  # a class or a factory


def test_optimizer_checks():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(TypeError, match=r"returned SGD\. Return torch\.optim\.AdamW"):
        check_optimizers([torch.optim.SGD([p], lr=0.1)])
    with pytest.raises(TypeError, match=r"returned Adam\."):
        check_optimizers([torch.optim.Adam([p])])
    with pytest.raises(ValueError, match=r"returned 2 optimizers; it supports exactly one"):
        check_optimizers([torch.optim.AdamW([p]), torch.optim.AdamW([p])])
    with pytest.raises(ValueError, match=r"amsgrad=True"):
        check_optimizers([torch.optim.AdamW([p], amsgrad=True)])


@pytest.mark.parametrize(("kwargs", "bad"), [
    ({}, []),
    ({"gpu_fraction": 0.0, "speculative": False}, []),
    ({"gpu_fraction": 0.3}, []),
    ({"speculative": True}, ["speculative=True"]),
    ({"device_assist": True}, ["device_assist=True"]),
    ({"device_assist": "auto"}, []),
])
def test_unsupported_options_table(kwargs, bad):
    assert unsupported_options(SuperOffloadOptions(**kwargs)) == bad


def test_strategy_argument_errors():
    with pytest.raises(ValueError, match=r"data_parallel_size=0 must be 'auto' or an int >= 1"):
        SuperOffloadFSDPStrategy(data_parallel_size=0)
    with pytest.raises(TypeError):
        SuperOffloadFSDPStrategy(options=SuperOffloadOptions(), cpu_threads=2)  # options= or keywords, not both


def _layer_only(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])  # the root is not fully_shard-ed: its own Linear stays a plain parameter
    return model


def _errors(rank: int, world: int, tmp: str) -> None:
    _init(rank, world)
    msgs = []
    for model in (make_model(), _layer_only(make_model())):
        with pytest.raises(ValueError) as e:
            _opt(model)
        msgs.append(str(e.value))
    with open(f"{tmp}/errors.txt", "w") as f:
        f.write("\n".join(msgs))
    # bf16 weights: the fp32 master rows are in the state dict ("master") and come back on load
    model = shard(make_model().to(torch.bfloat16))
    opt = _opt(model)
    model(torch.randn(6, 12, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)).float().square().mean() \
        .backward()
    opt.step()
    sd = opt.state_dict()
    masters = {k: st["master"].to_local().clone() for k, st in sd["state"].items()}
    opt.close()
    other = shard(make_model().to(torch.bfloat16))
    opt2 = _opt(other)
    opt2.load_state_dict(sd)
    loaded = {k: st["master"].to_local() for k, st in opt2.state_dict()["state"].items()}
    torch.save({"masters": masters, "loaded": loaded, "weights_first": opt.stats["weights_first"],
                "weights": [p.to_local().clone() for g in groups(model) for p in g["params"]]},  # the state's order
               f"{tmp}/bf16.pt")
    opt2.close()
    dist.destroy_process_group()


def test_unsharded_model_errors_and_bf16_masters(tmp_path):
    run_ranks(_errors, 1, str(tmp_path))
    out = torch.load(tmp_path / "bf16.pt")
    assert set(out["masters"]) == set(range(6))
    for k, master in out["masters"].items():
        assert master.dtype == torch.float32 and torch.equal(out["loaded"][k], master)
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in out["masters"].values())  # finer than bf16
    assert out["weights_first"] == (cpu_adamw.load() is not None)  # bf16 weights from the kernel's first pass
    for k, master in out["masters"].items():  # the weights are the masters cast (on the host, before the copy)
        assert torch.equal(out["weights"][k], master.to(torch.bfloat16).view(out["weights"][k].shape)), k
    msgs = (tmp_path / "errors.txt").read_text().splitlines()
    assert len(msgs) == 2
    assert "no module of Sequential is fully_shard-ed" in msgs[0] and "configure_model()" in msgs[0]
    assert "is not sharded by fully_shard" in msgs[1] and "root module last" in msgs[1]


def _host_room_fails_on_rank_1(rank: int, world: int, tmp: str) -> None:
    from lightning_gh import _host
    from lightning_gh._host import HostMemoryError

    _init(rank, world)
    if rank == 1:
        def no_room(*args, **kwargs):
            raise HostMemoryError("no host room on rank 1 (test)")

        _host.check_host_room = no_room  # a forked process: the parent's module is untouched
    try:
        _opt(shard(make_model()))
        outcome = "built"
    except HostMemoryError as e:
        outcome = f"HostMemoryError: {e}"
    with open(f"{tmp}/host-{rank}.txt", "w") as f:
        f.write(outcome)
    dist.destroy_process_group()


def test_host_memory_check_fails_on_every_rank_together(tmp_path):
    """One rank without host room: every rank raises HostMemoryError before any rank pins its buffers (no rank
    goes on to wait for the others in a collective)."""
    run_ranks(_host_room_fails_on_rank_1, WORLD, str(tmp_path), timeout=90)
    rank0, rank1 = ((tmp_path / f"host-{r}.txt").read_text() for r in range(WORLD))
    assert rank1 == "HostMemoryError: no host room on rank 1 (test)"
    assert rank0.startswith("HostMemoryError: ShardedHostAdamW: 1 other rank(s) of this job lack host memory")
    assert "see their error" in rank0


@pytest.mark.parametrize(("numels", "rank", "expected"), [
    ([12, 11], 0, (12, 12)),  # 23 elements: the tail is [16, 23), all on rank 1
    ([12, 11], 1, (4, 11)),
    ([20, 10], 0, (16, 20)),  # 30 elements: the tail [16, 30) straddles the ranks
    ([20, 10], 1, (0, 10)),
    ([16, 16], 1, (16, 16)),  # no tail
    ([2, 1], 0, (0, 2)),
    ([0, 3], 0, (0, 0)),  # an empty shard
])
def test_tail_range_table(numels, rank, expected):
    assert tail_range(numels, rank) == expected


@pytest.mark.parametrize("numels", [[12, 11], [20, 10], [2, 1], [40, 37], [9, 9, 9]])
def test_rows_update_as_the_full_tensor(numels):
    """Note [A shard's rows, updated as the full tensor's]: each rank's rows, updated by torch as positioned here
    (the body padded to whole units, the tail placed where the full tensor's starts), equal torch's fused AdamW on
    the full tensor bitwise, however the ranks cut it."""
    gen = torch.Generator().manual_seed(sum(numels))
    n = sum(numels)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) * 1e-3
    hp = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}
    coef = torch.tensor(0.37)
    ref = [t.clone() for t in (p, m, v)]
    rg = g.clone()
    torch._foreach_mul_([rg], coef)
    torch._fused_adamw_([ref[0]], [rg], [ref[1]], [ref[2]], [], [torch.tensor(3.0)], lr=hp["lr"], beta1=hp["beta1"],
                        beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False,
                        maximize=False)
    start = 0
    for rank, k in enumerate(numels):
        s = LocalShard(0, p, 0, k, 0, numels, step=torch.tensor(2.0), rank=rank)
        rows = tuple(t[start:start + k] for t in (p, m, v))
        lo, hi = s.tail_rows()
        out = [torch.empty(k) for _ in range(3)]
        if lo:
            body = positioned_update(tuple(r[:lo] for r in rows), g[start:start + lo], s, 0, lo, hp, coef, body=True)
            for o, b in zip(out, body):
                o[:lo] = b
        if hi > lo:
            tail = positioned_update(tuple(r[lo:hi] for r in rows), g[start + lo:start + hi], s, lo, hi, hp, coef)
            for o, b in zip(out, tail):
                o[lo:hi] = b
        for o, r in zip(out, ref):
            assert torch.equal(o, r[start:start + k]), (numels, rank)
        start += k


class _Stream:
    def wait_event(self, event):  # pragma: no cover - never called here
        pass


class _Ctx:
    def __init__(self, *names):
        for name in names:
            setattr(self, name, _Stream())


class _Unit(nn.Module):
    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def _get_fsdp_state(self):
        return type("State", (), {"_comm_ctx": self.ctx})()


@pytest.mark.parametrize("unit, found, why", [
    (_Unit(_Ctx("all_gather_copy_in_stream", "all_gather_stream")), 2, "both of FSDP2's all-gather streams"),
    (_Unit(_Ctx()), 0, "before the root's first forward the streams do not exist yet: the host waits"),
    (_Unit(_Ctx("all_gather_copy_in_stream")), 0, "another layout: the host waits"),
    (_Unit(None), 0, "no communication context"),
    (nn.Linear(2, 2), 0, "not an FSDP module"),
])
def test_gather_streams_table(unit, found, why):
    from lightning_gh.superoffload.fsdp_units import gather_streams

    assert len(gather_streams(unit)) == found, why


def test_a_host_unit_is_waited_for_on_the_device_where_fsdp2_streams_are_known(monkeypatch):
    """Note [ZeRO-3 step and the forward's wait]: with FSDP2's all-gather streams, they and the compute stream wait
    for the copy's event and the host does not; without them, the host waits for the copy."""
    import threading
    import types

    calls = []

    class Event:
        def synchronize(self):
            calls.append("host")

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            calls.append(self.name)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("compute"))
    ready = threading.Event()
    ready.set()
    unit = types.SimpleNamespace(ready=ready, done=ready, h2d_event=Event())
    opt = types.SimpleNamespace(cuda=True, device=torch.device("cpu"), stats={"wait_ms": 0.0}, _raise=lambda: None,
                                _thread=None)
    ShardedHostAdamW._wait(opt, unit, streams=[Stream("copy-in"), Stream("all-gather")])
    assert calls == ["copy-in", "all-gather", "compute"]
    calls.clear()
    ShardedHostAdamW._wait(opt, unit, streams=[])
    assert calls == ["host", "compute"]
