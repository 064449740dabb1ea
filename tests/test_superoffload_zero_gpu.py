"""SuperOffload across 2 GPUs (NCCL): gradients reduced onto their owner on the copy stream, CPU updates per rank,
weights broadcast before the forward needs them. Skipped without 2 CUDA devices.

Reference: one process on GPU 0 forms each rank's mean gradient on its own batch, averages them as the ranks do
(``(g_0 + g_1) / 2``), clips with ``clip_grad_norm_`` on the GPU and runs torch's fused AdamW on CPU fp32 copies
(the kernel the ranks' CPU workers run), or on the GPU for the parameters the ranks keep in their GPU tail. The test prints the largest difference: without a GPU tail it must be 0
(measured so on 2 H200s); with one, below 1e-5 relative (measured 1.3-1.5e-6). That both ranks hold the same
weights is required bitwise.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA devices")]
STEPS, INF_STEP, CLIP = 10, 4, 0.5


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8)).to(device)


def groups(model: nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3}]


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = (torch.randn(32, 64, generator=g) * (6.0 if step % 3 == 0 else 0.05)).to(next(model.parameters()).device)
    loss = model(x).square().mean()
    return loss * float("inf") if step == INF_STEP and rank == 1 else loss


def init_nccl(rank: int, store: str) -> torch.device:
    """Rank ``rank`` of 2 on its own GPU, NCCL without NVLink multicast; the file store at ``store``."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=dev)
    return dev


def split_adamw(model: nn.Module, param_groups: list[dict], on_device: set[int], **kwargs) -> Callable[[], None]:
    """torch's fused AdamW on fp32 copies of ``model``'s parameters, as the ranks update them: those whose index (in
    ``model.parameters()``'s order) is in ``on_device`` on the GPU, the others on the CPU. ``param_groups`` as for
    AdamW, over the model's parameters. Returns ``step()``: it takes the parameters' ``.grad``, steps and writes the
    new values back into them."""
    params = list(model.parameters())
    master = [p.detach().clone().requires_grad_(True) if i in on_device else
              p.detach().cpu().clone().requires_grad_(True) for i, p in enumerate(params)]
    index = {id(p): i for i, p in enumerate(params)}
    ref_groups = []
    for on_gpu in (False, True):
        for g in param_groups:
            ps = [master[index[id(p)]] for p in g["params"] if (index[id(p)] in on_device) == on_gpu]
            if ps:
                ref_groups.append({**g, "params": ps})
    opt = torch.optim.AdamW(ref_groups, fused=True, **kwargs)

    def step() -> None:
        for m, p in zip(master, params):
            m.grad = p.grad.detach().to(m.device)
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)

    return step


def _rank(rank: int, tmp: str, gpu_fraction: float) -> None:
    from lightning_gh.superoffload import HeterogeneousAdamW, tail_mover

    if gpu_fraction == "sharded":  # room for the smaller bucket's owner's share (205 KB + 69 KB), not the other's
        tail_mover.device_room = lambda device: (500_000, "a test's room")
    dev = init_nccl(rank, f"{tmp}/store-{gpu_fraction}")
    try:
        model = make_model(dev)
        opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model,
                                 gpu_fraction="auto" if gpu_fraction == "sharded" else gpu_fraction,
                                 bucket_size=40_000)
        for step in range(STEPS):
            loss_of(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()
        opt.synchronize()
        torch.cuda.synchronize()
        torch.save({"params": [p.detach().cpu() for p in model.parameters()], "stats": dict(opt.stats),
                    "state": state, "owners": sorted({b.owner for b in opt.layout.buckets}),
                    "tail": [s.index for s in opt.layout.slots if s.residency == "device"]},
                   f"{tmp}/rank{rank}-{gpu_fraction}.pt")
        opt.close()
    finally:
        dist.destroy_process_group()


def reference(tail: set[int]) -> nn.Module:
    """The averaged-gradient run; parameters in ``tail`` (the ranks' GPU tail) are updated by fused AdamW on the
    GPU, the others on fp32 CPU copies, as the ranks do."""
    dev = torch.device("cuda", 0)
    ref = make_model(dev)
    update = split_adamw(ref, groups(ref), tail, lr=1e-2, betas=(0.9, 0.95))
    params = list(ref.parameters())
    for step in range(STEPS):
        g0, g1 = (torch.autograd.grad(loss_of(ref, step, r), params) for r in range(2))
        for p, a, b in zip(params, g0, g1):
            p.grad = (a + b) / 2
        total = torch.nn.utils.clip_grad_norm_([p for g in groups(ref) for p in g["params"]], CLIP)
        if torch.isfinite(total):
            update()
        ref.zero_grad(set_to_none=True)
    return ref


@pytest.mark.parametrize("gpu_fraction", [0.0, 0.3, "sharded"])
def test_two_gpus_match_the_averaged_reference(gpu_fraction):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(tmp, gpu_fraction), nprocs=2, start_method="spawn", join=True)
        outs = [torch.load(f"{tmp}/rank{r}-{gpu_fraction}.pt", weights_only=False) for r in range(2)]
    for a, b in zip(outs[0]["params"], outs[1]["params"]):
        assert torch.equal(a, b)  # every rank holds the same weights
    sharded = gpu_fraction == "sharded"
    assert len(outs[0]["owners"]) == (1 if sharded else 2)  # sharded: one rank's share moved to its GPU
    assert outs[0]["stats"]["skipped_steps"] == 1 and outs[0]["stats"]["clipped_steps"] > 0, outs[0]["stats"]
    assert bool(outs[0]["tail"]) == (sharded or gpu_fraction > 0)
    if sharded:
        assert all("sharded" in o["stats"]["tail_decision"] for o in outs), outs[0]["stats"]["tail_decision"]
    ref = reference(set(outs[0]["tail"]))
    worst = max(((a - b.detach().cpu()).abs().max() / b.detach().abs().max().cpu()).item()
                for a, b in zip(outs[0]["params"], ref.parameters()))
    print(f"gpu_fraction={gpu_fraction}: largest relative difference to the reference {worst:.3e} "
          f"({'bitwise' if worst == 0 else 'not bitwise'})")
    # No GPU tail: bitwise on the 2-GPU machine. With a GPU tail: 1.3e-6 there, with the tail's
    # parameters updated by the GPU kernel in the reference too; the remaining rounding difference is not pinned
    # down (the tail's all-reduce, norm and fused-AdamW calls look alike), hence a looser bound for it. A wrong
    # average, clip or skip moves the weights by orders of magnitude more.
    assert worst == 0 if gpu_fraction == 0 else worst < 1e-5  # sharded: the first steps updated on the CPU
    assert len(outs[0]["state"]["state"]) == len(list(ref.parameters()))  # unsharded on every rank
