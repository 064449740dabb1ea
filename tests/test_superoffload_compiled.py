"""HeterogeneousAdamW's forward hooks on models whose blocks are compiled (see Note [Forward hooks stay out of
compiled regions] in lightning_gh.superoffload.layout).

A block compiled in place (``block.compile()``) or wrapped by ``torch.compile`` gets one forward pre-hook that
waits for every bucket under it, run outside its graph; its submodules get none. Dynamo's ``eager`` and
``aot_eager`` backends run the same kernels as eager PyTorch, so the compiled runs must equal the eager one
bitwise (tolerance: none), and our hooks must not break a graph.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload.layout import (
    WaitBeforeCompiledCall,
    compiled_regions,
    forward_hook_sites,
    is_compiled_region,
)

STEPS = 6
CLIP = 0.5


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_net(how: str | None, backend: str = "eager") -> Net:
    torch.manual_seed(0)
    net = Net()
    if how == "in_place":
        for b in net.blocks:
            b.compile(backend=backend)
    elif how == "wrapper":
        net.blocks = nn.ModuleList(torch.compile(b, backend=backend) for b in net.blocks)
    return net


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=g) * (6.0 if step % 2 == 0 else 0.05)  # clipped on every other step


def train(net: Net, steps: int = STEPS) -> HeterogeneousAdamW:
    opt = HeterogeneousAdamW(net.parameters(), lr=1e-2, max_grad_norm=CLIP, module=net, bucket_size=300)
    for step in range(steps):
        net(batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return opt


def hook_counts(net: nn.Module, opt: HeterogeneousAdamW) -> dict[str, int]:
    """The optimizer's waits per module: forward pre-hooks, plus a wait in front of an in-place compiled call."""
    wrapped = {id(h.module) for h in opt._module_hooks if isinstance(h, WaitBeforeCompiledCall) and h.installed}
    counts = {name: len(m._forward_pre_hooks) + (id(m) in wrapped) for name, m in net.named_modules()}
    return {name: n for name, n in counts.items() if n}


def test_hook_sites_table():
    """One site per compiled block (every parameter under it), one per eager module owning parameters."""
    net = make_net("in_place")
    opt = HeterogeneousAdamW(net.parameters(), lr=1e-2, bucket_size=300)
    sites = forward_hook_sites(net, opt.layout.slot_of)
    by_module = {id(m): (len(slots), compiled) for m, slots, compiled in sites}
    assert by_module[id(net.embed)] == (2, False) and by_module[id(net.head)] == (2, False)
    for b in net.blocks:
        assert is_compiled_region(b) and by_module[id(b)] == (6, True)
        assert not any(id(m) in by_module for m in b.modules() if m is not b)
    assert len(sites) == 2 + len(net.blocks)
    assert compiled_regions(net.modules()) == frozenset(id(b) for b in net.blocks)
    assert compiled_regions(make_net(None).modules()) == frozenset()
    opt.close()


@pytest.mark.parametrize("how", ["in_place", "wrapper"])
def test_a_compiled_block_gets_one_hook_and_its_submodules_none(how):
    net = make_net(how)
    originals = [getattr(b, "_compiled_call_impl", None) for b in net.blocks]
    opt = HeterogeneousAdamW(net.parameters(), lr=1e-2, module=net, bucket_size=300)
    counts = hook_counts(net, opt)
    blocks = [f"blocks.{i}" for i in range(len(net.blocks))]
    assert counts == {"embed": 1, "head": 1, **{b: 1 for b in blocks}}
    if how == "in_place":  # nothing of ours inside the compiled call: the wait runs in front of it
        assert all(not b._forward_pre_hooks for b in net.blocks)
    opt.close()
    assert hook_counts(net, opt) == {}
    if how == "in_place":  # close() gave the blocks their own compiled calls back
        assert all(b._compiled_call_impl is before for b, before in zip(net.blocks, originals))


def test_a_block_compiled_again_gets_its_wait_back_at_the_next_step():
    net = make_net("in_place")
    opt = HeterogeneousAdamW(net.parameters(), lr=1e-2, module=net, bucket_size=300)
    net.blocks[1].compile(backend="eager")  # replaces the wrapped compiled call
    assert "blocks.1" not in hook_counts(net, opt)
    net(batch(0)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert hook_counts(net, opt)["blocks.1"] == 1
    opt.close()


@pytest.mark.parametrize(("how", "backend"), [("in_place", "eager"), ("in_place", "aot_eager"), ("wrapper", "eager")])
def test_compiled_blocks_train_bitwise_as_eager_without_graph_breaks(how, backend):
    eager_net = make_net(None)
    eager_opt = train(eager_net)
    torch._dynamo.reset()
    counters.clear()
    net = make_net(how, backend)
    opt = train(net)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks did run compiled
    assert opt.stats["clipped_steps"] == eager_opt.stats["clipped_steps"] > 0
    for a, b in zip(eager_net.parameters(), net.parameters()):
        assert torch.equal(a, b)
    sa, sb = eager_opt.state_dict()["state"], opt.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    eager_opt.close()
    opt.close()


def test_hooks_follow_blocks_compiled_after_attach():
    """A block compiled (or uncompiled) after the optimizer attached gets its hooks re-placed at the next step()."""
    net = make_net(None)
    opt = HeterogeneousAdamW(net.parameters(), lr=1e-2, module=net, bucket_size=300)
    assert hook_counts(net, opt)["blocks.0.up"] == 1
    net.blocks[0].compile(backend="eager")
    net(batch(0)).sum().backward()
    opt.step()
    opt.zero_grad()
    counts = hook_counts(net, opt)
    assert counts["blocks.0"] == 1 and "blocks.0.up" not in counts and counts["blocks.1.up"] == 1
    net.blocks[0]._compiled_call_impl = None  # as lightning_gh.precision.block_trial.uncompile does
    net(batch(1)).sum().backward()
    opt.step()
    assert hook_counts(net, opt)["blocks.0.up"] == 1 and "blocks.0" not in hook_counts(net, opt)
    opt.close()
