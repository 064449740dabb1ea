"""SuperOffload across ranks (ZeRO-1/2 with the state in host memory) on the CPU: 2 processes, gloo.

The reference is one process running ``clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)`` on the same global
batch, with its gradient formed the way the ranks form it: each rank's mean gradient over its own half of the batch
(``g_r``), summed over the ranks in rank order and divided by the number of ranks, ``(g_0 + g_1) / 2``. That is the
same fp32 arithmetic the ranks do (a sum of two is the same either way round, and the owner divides by 2), so the
comparison is bitwise: no tolerance. A reference that took the mean over the whole batch in one backward would
differ in the last bits (a different summation order), not because the optimizer is wrong.

Each run covers gradient-norm clipping (some steps clipped, some not), one injected inf on one rank (the whole step
skipped on every rank), two param groups (with and without weight decay) and an LR schedule. The reference clips
over the parameters in the optimizer's order (its param groups), the order in which HeterogeneousAdamW combines the
per-parameter norms, as ``clip_grad_norm_(optimizer's params)`` does.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload import memory as superoffload_memory
from lightning_gh.superoffload.tail_mover import TAIL_UPDATE_CHUNK
from lightning_gh.superoffload.zero import deal

STEPS = 20
INF_STEP = 7  # rank 1's loss is scaled by inf at this step: every rank must skip it
MAX_NORM = 0.7  # about half of the steps are clipped
WORLD = 2
FRACTIONS = (0.0, 0.4, "auto", "auto-sharded", "auto-part", "auto-none")
#: GPU room each "auto" run reports (bytes beyond the margin): everything fits replicated; the whole state fits only
#: sharded (12 B per fp32 parameter of its owner's, 4 B of the other's: 8.7 + 1.2 KB on rank 1); only rank 0's share
#: fits (3.5 KB there, 1.2 KB of its gradients on rank 1, whose own share would take 8.7 KB)
#: fits (3.5 KB there, 1.2 KB of its gradients on rank 1, whose own share would take 8.7 KB); none: less than the margin
ROOM = {"auto": 1 << 40, "auto-sharded": 10_000, "auto-part": 5_000, "auto-none": -5_000}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4))


def groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * (0.9 ** max(0, s - 5)))


def local_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 12, generator=g)
    y = torch.randn(6, 4, generator=g)
    loss = (model(x) - y).square().mean()
    if step == INF_STEP and rank == 1:
        loss = loss * float("inf")
    return loss


def local_grads(model: nn.Module, step: int, rank: int, losses: list | None = None) -> list[torch.Tensor]:
    params = list(model.parameters())
    loss = local_loss(model, step, rank)
    if losses is not None:
        losses.append(loss.item())
    return list(torch.autograd.grad(loss, params))


def reference(steps: int, snapshot_at: int | None = None,
              losses: list | None = None) -> tuple[nn.Module, torch.optim.AdamW, dict | None]:
    """The single-process run; ``losses`` gets ``[rank 0's, rank 1's]`` loss of every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: a matmul split over other thread counts rounds differently
    try:
        return _reference(steps, snapshot_at, losses)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int, snapshot_at: int | None, losses: list | None) -> tuple[nn.Module, torch.optim.AdamW, dict | None]:
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), fused=True)
    sched = schedule(opt)
    snap = None
    for step in range(steps):
        step_losses: list[float] = []
        gs = [local_grads(model, step, r, step_losses) for r in range(WORLD)]
        if losses is not None:
            losses.append(step_losses)
        for p, g0, g1 in zip(model.parameters(), *gs):
            p.grad = (g0 + g1) / WORLD
        # in the optimizer's parameter order (its param groups), the order its norms are combined in
        total = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], MAX_NORM)
        if torch.isfinite(total):
            opt.step()
        opt.zero_grad()
        sched.step()
        if snapshot_at is not None and step + 1 == snapshot_at:
            snap = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "opt": _clone(opt.state_dict()), "sched": sched.state_dict()}
    return model, opt, snap


def _clone(sd: dict) -> dict:
    return {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
            "param_groups": [dict(g) for g in sd["param_groups"]]}


def _worker(rank: int, tmp: str, gpu_fraction: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{gpu_fraction}", rank=rank, world_size=WORLD)
    try:
        out = {}
        model = make_model()
        frac = "auto" if str(gpu_fraction).startswith("auto") else gpu_fraction
        opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=MAX_NORM,
                                 gpu_fraction=frac, bucket_size=300, module=model)
        sched = schedule(opt)
        for step in range(STEPS):
            local_loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if step + 1 == STEPS // 2:
                opt.synchronize()  # every rank's weights committed and received, as before any checkpoint
                out["mid"] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                              "opt": _clone(opt.state_dict()), "sched": sched.state_dict()}
        out["state"] = opt.state_dict()
        opt.synchronize()
        out["params"] = [p.detach().clone() for p in model.parameters()]
        out["stats"] = dict(opt.stats)
        out["host_numel"] = opt.host_numel
        out["owners"] = sorted({b.owner for b in opt.layout.buckets})
        out["tail_owned"] = sum(s.numel for s in opt.layout.slots if s.residency == "device" and s.step is not None)
        opt.close()

        # Resume on 2 ranks from the state saved at step 10 (unsharded), and run the last 10 steps again.
        model = make_model()
        model.load_state_dict(out["mid"]["model"])
        opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=MAX_NORM,
                                 gpu_fraction=frac, bucket_size=300, module=model)
        sched = schedule(opt)  # first, as Lightning does: building a scheduler sets the LR the state then restores
        opt.load_state_dict(out["mid"]["opt"])
        sched.load_state_dict(out["mid"]["sched"])
        for step in range(STEPS // 2, STEPS):
            local_loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        opt.synchronize()
        out["resumed_params"] = [p.detach().clone() for p in model.parameters()]
        opt.close()
        torch.save(out, f"{tmp}/rank{rank}-{gpu_fraction}.pt")
    finally:
        dist.destroy_process_group()


def _assert_state_equal(ours: dict, ref: dict) -> None:
    assert set(ours["state"]) == set(ref["state"])
    for k, st in ref["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours["state"][k][key].reshape(st[key].shape), st[key]), (k, key)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero"))
    results = {}
    for frac in FRACTIONS:
        # fork: a spawned child would import this module, pytest and Lightning again (tens of seconds on 2 cores)
        room = superoffload_memory.device_memory_room
        if frac in ROOM:  # a "GPU" with this room beyond a 1 GiB margin: the auto tail's several-rank decision
            superoffload_memory.device_memory_room = lambda device, _r=ROOM[frac]: ((1 << 30) + _r, 1 << 30)
        try:
            mp.start_processes(_worker, args=(tmp, frac), nprocs=WORLD, start_method="fork", join=True)
        finally:
            superoffload_memory.device_memory_room = room
        results[frac] = [torch.load(f"{tmp}/rank{r}-{frac}.pt") for r in range(WORLD)]
    return results


@pytest.mark.parametrize("gpu_fraction", FRACTIONS)
def test_two_ranks_equal_one_process_adamw_bitwise(sharded_runs, gpu_fraction):
    ref_model, ref_opt, _ = reference(STEPS)
    ref_state = ref_opt.state_dict()
    for rank, out in enumerate(sharded_runs[gpu_fraction]):
        for p, q in zip(out["params"], ref_model.parameters()):
            assert torch.equal(p, q.detach()), f"rank {rank}: parameters differ"
        _assert_state_equal(out["state"], ref_state)  # every rank gets the whole (unsharded) state
        st = out["stats"]
        assert st["skipped_steps"] == 1 and 0 < st["clipped_steps"] < STEPS - 1, st
    owners = sharded_runs[gpu_fraction][0]["owners"]
    host = [out["host_numel"] for out in sharded_runs[gpu_fraction]]
    tail_owned = [out["tail_owned"] for out in sharded_runs[gpu_fraction]]
    decisions = [out["stats"].get("tail_decision", "") for out in sharded_runs[gpu_fraction]]
    if gpu_fraction == "auto":  # the whole state moved to every rank's "GPU" after the first steps, same numbers
        assert owners == [] and host == [0, 0] and tail_owned == [1012, 1012]
        assert all("kept there on every rank" in d for d in decisions), decisions
        return
    if gpu_fraction == "auto-sharded":  # each rank's share of the state on its own "GPU", none replicated
        assert owners == [] and host == [0, 0] and tail_owned == [288, 724]
        assert all("sharded" in d for d in decisions), decisions
        return
    if gpu_fraction == "auto-none":  # a GPU with less than the margin free: everything stays on the hosts
        assert owners == [0, 1] and tail_owned == [0, 0]
        assert all("does not fit" in d and "keeps its share on the host" in d for d in decisions), decisions
        assert not any("no GPU memory reading" in d for d in decisions), decisions
        return
    if gpu_fraction == "auto-part":  # only rank 0's share fits: rank 1 keeps its share on the host
        assert owners == [1] and host == [0, 724] and tail_owned == [288, 0]
        assert all("sharded" in d for d in decisions), decisions
        return
    assert owners == [0, 1]  # both ranks own buckets
    assert all(h > 0 for h in host) and sum(host) <= sum(p.numel() for p in ref_model.parameters())


@pytest.mark.parametrize("gpu_fraction", FRACTIONS)
def test_resume_on_two_ranks_equals_the_uninterrupted_run(sharded_runs, gpu_fraction):
    for out in sharded_runs[gpu_fraction]:
        for p, q in zip(out["resumed_params"], out["params"]):
            assert torch.equal(p, q)


def _bf16_worker(rank: int, tmp: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-bf16-{mode}", rank=rank, world_size=WORLD)
    try:
        model = make_model().to(torch.bfloat16)
        opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=MAX_NORM,
                                 gpu_fraction="auto" if mode == "sharded" else 0.0, bucket_size=300, module=model)
        for step in range(12):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(6, 12, generator=g), torch.randn(6, 4, generator=g)
            (model(x.bfloat16()).float() - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "decision": opt.stats.get("tail_decision", ""),
                    "tail_owned": sum(s.numel for s in opt.layout.slots if s.residency == "device" and s.step is not None)},
                   f"{tmp}/bf16-{mode}-{rank}.pt")
        opt.close()
    finally:
        dist.destroy_process_group()


def test_sharded_tail_of_bf16_weights_equals_the_host_path_bitwise(tmp_path):
    """bf16 weights: the sharded GPU tail's owner updates from the rank-averaged fp32 gradient, as a host bucket does,
    so moving buckets to it changes no bit (a bf16 copy of that average would round it)."""
    out = {}
    for mode in ("host", "sharded"):
        room = superoffload_memory.device_memory_room
        # room for rank 0's share (16 B per bf16 parameter, 288 of them), not rank 1's, beside one chunk of casts
        cast = 4 * (TAIL_UPDATE_CHUNK + 576)
        superoffload_memory.device_memory_room = lambda device, _c=cast: ((1 << 30) + _c + 8_000, 1 << 30)
        try:
            mp.start_processes(_bf16_worker, args=(str(tmp_path), mode), nprocs=WORLD, start_method="fork", join=True)
        finally:
            superoffload_memory.device_memory_room = room
        out[mode] = [torch.load(f"{tmp_path}/bf16-{mode}-{r}.pt") for r in range(WORLD)]
    assert all("sharded" in o["decision"] for o in out["sharded"]) and sum(o["tail_owned"] for o in out["sharded"]) > 0
    for h, sh in zip(out["host"], out["sharded"]):
        for a, b in zip(h["params"], sh["params"]):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.parametrize("saved_by", [0.0, "auto-sharded"])
def test_state_saved_on_two_ranks_resumes_on_one(sharded_runs, saved_by):
    """The step-10 state of the 2-rank run (all on the hosts, or the sharded GPU tail) loads into a single-process
    HeterogeneousAdamW, which then runs the last 10 steps on the same averaged gradients and lands bitwise on the
    reference."""
    mid = sharded_runs[saved_by][0]["mid"]
    ref_model, ref_opt, snap = reference(STEPS, snapshot_at=STEPS // 2)
    _assert_state_equal(mid["opt"], snap["opt"])
    model = make_model()
    model.load_state_dict(mid["model"])
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=MAX_NORM, gpu_fraction=0.0,
                             bucket_size=300)
    sched = schedule(opt)
    opt.load_state_dict(mid["opt"])
    sched.load_state_dict(mid["sched"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for step in range(STEPS // 2, STEPS):
        gs = [local_grads(model, step, r) for r in range(WORLD)]
        for p, g0, g1 in zip(model.parameters(), *gs):
            p.grad = (g0 + g1) / WORLD
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.set_num_threads(threads)
    opt.synchronize()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    _assert_state_equal(opt.state_dict(), ref_opt.state_dict())
    opt.close()


@pytest.mark.parametrize("numels, ranks, owners", [
    ([4, 4, 4, 4], 2, [1, 0, 1, 0]),  # the forward's order (last bucket first) alternates between the ranks
    ([10, 1, 1], 2, [0, 1, 0]),  # the fewest parameters so far takes the next
    ([1, 1, 1, 1, 1, 1], 3, [2, 1, 0, 2, 1, 0]),
    ([100, 5, 5, 5, 80, 5], 2, [0, 0, 0, 0, 1, 0]),  # 120 and 80: within one bucket
    ([7], 3, [0]),
    ([], 2, []),
])
def test_deal_alternates_in_forward_order_and_balances(numels, ranks, owners):
    assert deal(numels, ranks) == owners


def test_deal_refuses_no_ranks():
    with pytest.raises(ValueError, match=r"ranks=0 must be an int >= 1"):
        deal([1], 0)


# ---------------------------------------------------------------------------------------------------------------
# Through Lightning: Trainer(strategy="superoffload", accelerator="cpu", devices=2), DDP's launcher (fork here)


class ShardedLM(L.LightningModule):
    """The same model, data and optimizer as above. Each rank draws its own half of the global batch from the step
    and its rank; with one rank, both halves (loss ``(l_0 + l_1) / 2``: backward scales each half's gradient by
    0.5, exactly, and adds the two, which is the ranks' ``(g_0 + g_1) / 2`` bit for bit)."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.model = make_model()
        self.out, self.tag = out, tag
        self.losses: dict[int, list[float]] = {}

    def setup(self, stage):
        # Rank 1 starts from other weights: the strategy must replace them with rank 0's (what DDP's wrapper did).
        if self.trainer.world_size > 1 and self.global_rank == 1:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)

    def training_step(self, batch, batch_idx):
        torch.set_num_threads(1)  # as in the reference
        step = self.trainer.global_step
        if self.trainer.world_size == 1:
            halves = [local_loss(self.model, step, r) for r in range(WORLD)]
            self.losses[step] = [h.item() for h in halves]
            return (halves[0] + halves[1]) / WORLD
        loss = local_loss(self.model, step, self.global_rank)
        self.losses[step] = [loss.item()]
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(groups(self.model), lr=1e-2, betas=(0.9, 0.95), fused=True)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)

    def on_fit_end(self):  # after the strategy's teardown: every rank holds the final weights
        torch.save({"losses": self.losses, "params": [p.detach().clone() for p in self.model.parameters()],
                    "stats": dict(self.trainer.optimizers[0].stats)},
                   f"{self.out}/{self.tag}-rank{self.global_rank}.pt")


def _fit(tmp: str, tag: str, devices: int, ckpt_path: str | None = None, checkpoints: bool = False) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gh.superoffload import SuperOffloadStrategy

    callbacks = [ModelCheckpoint(dirpath=f"{tmp}/ckpt", every_n_train_steps=STEPS // 2, save_top_k=-1,
                                 filename="{step}")] if checkpoints else []
    strategy = SuperOffloadStrategy(start_method="fork", bucket_size=300) if devices > 1 else \
        SuperOffloadStrategy(bucket_size=300)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        gradient_clip_val=MAX_NORM, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, enable_checkpointing=checkpoints, callbacks=callbacks,
                        default_root_dir=tmp)
    trainer.fit(ShardedLM(tmp, tag), ckpt_path=ckpt_path)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero-trainer"))
    threads = torch.get_num_threads()
    try:
        _fit(tmp, "full", devices=2, checkpoints=True)
        mid = f"{tmp}/ckpt/step={STEPS // 2}.ckpt"
        _fit(tmp, "resume2", devices=2, ckpt_path=mid)
        _fit(tmp, "resume1", devices=1, ckpt_path=mid)
    finally:
        torch.set_num_threads(threads)
    return {tag: [torch.load(f"{tmp}/{tag}-rank{r}.pt") for r in range(2 if tag != "resume1" else 1)]
            for tag in ("full", "resume2", "resume1")}


def test_trainer_on_two_ranks_equals_one_process_adamw_bitwise(trainer_runs):
    ref_losses: list = []
    ref_model, _, _ = reference(STEPS, losses=ref_losses)
    for rank, out in enumerate(trainer_runs["full"]):
        assert [out["losses"][s][0] for s in range(STEPS)] == [ref_losses[s][rank] for s in range(STEPS)]
        for p, q in zip(out["params"], ref_model.parameters()):
            assert torch.equal(p, q.detach()), f"rank {rank}: parameters differ"
        st = out["stats"]
        assert st["skipped_steps"] == 1 and 0 < st["clipped_steps"] < STEPS - 1, st


def test_trainer_checkpoint_of_two_ranks_resumes_on_two_and_on_one(trainer_runs):
    full = trainer_runs["full"]
    for rank, out in enumerate(trainer_runs["resume2"]):
        assert sorted(out["losses"]) == list(range(STEPS // 2, STEPS))
        assert all(out["losses"][s] == full[rank]["losses"][s] for s in out["losses"])
        assert all(torch.equal(p, q) for p, q in zip(out["params"], full[rank]["params"]))
    one = trainer_runs["resume1"][0]
    assert sorted(one["losses"]) == list(range(STEPS // 2, STEPS))
    for s, pair in one["losses"].items():
        assert pair == [full[0]["losses"][s][0], full[1]["losses"][s][0]]
    assert all(torch.equal(p, q) for p, q in zip(one["params"], full[0]["params"]))


ACC_STEPS = 6  # optimizer steps of the accumulation run, 2 micro-batches each (micro-batch INF_STEP: step 3 skipped)


class AccumulatingLM(ShardedLM):
    """Two micro-batches per optimizer step on each rank: Lightning divides each loss by 2 and the gradients add up on
    each rank's GPU/CPU (only the last backward, inside ``step(closure)``, starts the offload and the reduce)."""

    def training_step(self, batch, batch_idx):
        torch.set_num_threads(1)
        loss = local_loss(self.model, batch_idx, self.global_rank)
        self.losses[batch_idx] = [loss.item()]
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(2 * ACC_STEPS)), batch_size=None)


def test_trainer_gradient_accumulation_on_two_ranks_bitwise(tmp_path):
    from lightning_gh.superoffload import SuperOffloadStrategy

    threads = torch.get_num_threads()
    try:
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=ACC_STEPS, accumulate_grad_batches=2,
                            strategy=SuperOffloadStrategy(start_method="fork", bucket_size=300), logger=False,
                            gradient_clip_val=MAX_NORM, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, enable_checkpointing=False, default_root_dir=tmp_path)
        trainer.fit(AccumulatingLM(str(tmp_path), "acc"))
        torch.set_num_threads(1)
        model = make_model()
        opt = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), fused=True)
        sched = schedule(opt)
        params = list(model.parameters())
        for k in range(ACC_STEPS):
            per_rank = []
            for r in range(WORLD):  # each rank: p.grad = g(a) / 2, then += g(b) / 2, as Lightning accumulates
                a, b = (torch.autograd.grad(local_loss(model, 2 * k + m, r) / 2, params) for m in range(2))
                per_rank.append([x + y for x, y in zip(a, b)])
            for p, h0, h1 in zip(params, *per_rank):
                p.grad = (h0 + h1) / WORLD
            if torch.isfinite(torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                                            MAX_NORM)):
                opt.step()
            opt.zero_grad()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"acc-rank{rank}.pt")
        assert out["stats"]["skipped_steps"] == 1 and out["stats"]["steps"] == ACC_STEPS, out["stats"]
        for p, q in zip(out["params"], params):
            assert torch.equal(p, q.detach()), f"rank {rank}: parameters differ"
