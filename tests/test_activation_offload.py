"""The activation-offload engine and callback.

On the CPU the engine runs in ``backend="host-copy"`` mode: every offloaded storage really goes through a
separate host buffer and comes back as a new tensor, so hooks, skips, dedupe, pool, plan and prefetch
order are exercised, and gradients must be bitwise those of the plain run. GPU tests at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_gh import hardware
from lightning_gh._host import HostMemoryError
from lightning_gh.activation_offload import (
    ActivationOffload,
    ActivationOffloader,
    ActivationOffloadOptions,
    HostBufferPool,
    find_blocks,
    offload_activations,
)
from lightning_gh.demo import Llama, LlamaLM, MarkovDataModule, preset

CPU = dict(backend="host-copy", min_tensor_bytes=1024)


def _llama(n_layers=3, seed=0, **kw):
    cfg = preset("tiny", n_layers=n_layers, **kw)
    torch.manual_seed(seed)
    return Llama(cfg), cfg


def _batch(cfg, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return tok[:, :-1].to(device), tok[:, 1:].to(device)


def _step(model, batch, ctx=None, autocast=None):
    model.zero_grad(set_to_none=True)
    tokens, targets = batch
    ac = torch.autocast(tokens.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx if ctx is not None else contextlib.nullcontext(), ac:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("policy", ["all", 1, "auto"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_gradients_bitwise_equal_with_and_without_the_engine(policy, autocast):
    model, cfg = _llama()
    batch = _batch(cfg)
    loss0, grads0 = _step(model, batch, autocast=autocast)
    # "auto" measures 1 warm-up + 1 step, then decides; a huge link makes it offload all it may.
    off = offload_activations(model, policy, profile_steps=1, bandwidth_gbps=1e6, **CPU)
    for _ in range(3):
        loss, grads = _step(model, batch, off, autocast)
        assert torch.equal(loss, loss0) and _equal(grads, grads0)
    assert off.stats.last_offloaded_bytes > 0  # the last step really went through host buffers
    assert off.stats.reloaded_bytes == off.stats.offloaded_bytes
    assert off.stats.on_demand_reloads == 0  # every reload was a prefetch
    assert off.pool.in_use_bytes == 0  # every buffer came back to the pool


def test_gradient_accumulation_two_forwards_before_one_backward():
    model, cfg = _llama()
    b1, b2 = _batch(cfg, 1), _batch(cfg, 2)

    def run(ctx_factory):
        model.zero_grad(set_to_none=True)
        losses = []
        for tokens, targets in (b1, b2):
            with ctx_factory():
                losses.append(F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
        (losses[0] + losses[1]).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = run(contextlib.nullcontext)
    off = offload_activations(model, "all", **CPU)
    assert _equal(run(lambda: off), plain)
    assert off.stats.forwards == 2 and off.stats.on_demand_reloads == 0


# ------------------------------------------------------------------------------------ dedupe, skips


class _ViewBlock(nn.Module):
    """Saves one storage through two views and one tensor twice."""

    def __init__(self, d=64):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        y = self.lin(x)  # saves x
        a, b = y[..., :32], y[..., 32:]  # two views of y
        z = a.sin() * b.cos()  # sin saves a, cos saves b (one storage); mul saves sin(a) and cos(b)
        return torch.cat([z * z, z], -1) + x  # mul saves z twice


class _Stack(nn.Module):
    def __init__(self, block, n=3):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_views_and_repeated_saves_of_one_storage_are_moved_once():
    torch.manual_seed(0)
    net = _Stack(_ViewBlock)
    x = torch.randn(16, 64, 64, requires_grad=True)
    net(x).square().mean().backward()
    plain = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad(set_to_none=True)
    x.grad = None
    off = offload_activations(net, "all", backend="host-copy", min_tensor_bytes=1)
    with off:
        out = net(x)
    out.square().mean().backward()
    assert _equal([p.grad for p in net.parameters()] + [x.grad], plain)
    # Per offloaded block (0 and 1): 5 storages (x, y, sin(a), cos(b), z) for 7 saves.
    assert off.stats.offloaded_tensors == 2 * 5
    assert off.stats.reloaded_tensors == 2 * 5
    # b shares a's storage, z saved twice; the kept block 2 goes untracked (Note [A kept block's saved tensors go
    # untracked]): its saves are not looked up by storage
    assert off.stats.deduplicated_saves == 2 * 2
    per_block = 16 * 64 * 64 * 4 + 16 * 64 * 64 * 4 + 3 * 16 * 64 * 32 * 4
    assert off.stats.last_offloaded_by_block == [per_block, per_block, 0]


class _WrappedOut(nn.Module):
    """A _ViewBlock whose output comes as a tensor, in a tuple, or in a dict (as some decoder layers return it)."""

    def __init__(self, kind):
        super().__init__()
        self.inner, self.kind = _ViewBlock(), kind

    def forward(self, x):
        y = self.inner(x)
        return y if self.kind == "tensor" else (y, None) if self.kind == "tuple" else {"cache": None, "hidden": y}


class _UnwrapStack(nn.Module):
    def __init__(self, kind, n=4):
        super().__init__()
        self.layers = nn.ModuleList(_WrappedOut(kind) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            out = layer(x)
            x = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out["hidden"]
        return x


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_the_backward_point_hook_finds_the_output_in_a_tuple_or_a_dict(kind):
    torch.manual_seed(0)
    net = _UnwrapStack(kind)
    x = torch.randn(16, 64, 64, requires_grad=True)
    off = offload_activations(net, 1, backend="host-copy", min_tensor_bytes=1)
    order = []
    reload = off._reload
    off._reload = lambda e: order.append("reload") or reload(e)
    # block 1's backward ends when its input's gradient is ready (a module backward hook takes no dict outputs)
    hook = net.layers[1].register_forward_pre_hook(
        lambda m, args: args[0].register_hook(lambda g: order.append("block 1's backward ends")) and None)
    with off:
        out = net(x)
    out.square().mean().backward()
    hook.remove()
    assert order == ["reload"] * 5 + ["block 1's backward ends"]


def test_kept_blocks_go_untracked_and_their_backward_point_comes_from_the_output():
    """Note [A kept block's saved tensors go untracked]: a kept block of a forward that measures nothing hands autograd
    plain tensors (no handles), still counts its bytes once per storage, and its backward point, where the plan
    issues the offloaded block's reload, is reached as its backward starts (not late, at block 0's first unpack)."""
    torch.manual_seed(0)
    net = _Stack(_ViewBlock, n=4)
    x = torch.randn(16, 64, 64, requires_grad=True)
    net(x).square().mean().backward()
    plain = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    runs = {}
    for tracked in (False, True):  # record_timeline keeps every block tracked
        net.zero_grad(set_to_none=True)
        x.grad = None
        off = offload_activations(net, 1, backend="host-copy", min_tensor_bytes=1, record_timeline=tracked)
        packed, order = [], []
        pack, reload = off._pack, off._reload
        off._pack = lambda t, pack=pack, packed=packed: packed.append(pack(t)) or packed[-1]
        off._reload = lambda e, reload=reload, order=order: order.append(f"reload {e.block}") or reload(e)
        hook = net.layers[1].register_full_backward_hook(
            lambda *a, order=order: order.append("block 1's backward ends"))
        with off:
            out = net(x)
        out.square().mean().backward()
        hook.remove()
        assert _equal([p.grad for p in net.parameters()] + [x.grad], plain)
        runs[tracked] = (off, packed, order)
    off, packed, order = runs[False]
    plan = off.plan
    assert plan.offloaded_blocks == (0,) and plan.prefetch_at[0] == 1
    # Blocks 1-3 saved their tensors as (tensor, version, block) (8 saves each: x and the weight, a, b, sin(a),
    # cos(b), z twice); block 0 handles.
    assert sum(type(h) is tuple for h in packed) == 3 * 8 and len(packed) == 4 * 8
    # block 0's five storages are reloaded as block 1's backward starts, tracked or not
    assert order == runs[True][2] == ["reload 0"] * 5 + ["block 1's backward ends"]
    assert off.stats.last_resident_bytes == runs[True][0].stats.last_resident_bytes > 0


class _InplaceBlock(nn.Module):
    """Saves ``h`` for ``sin`` and then, when ``bad``, changes it in place: plain autograd refuses the backward."""

    def __init__(self, bad=False, d=64):
        super().__init__()
        self.lin, self.bad = nn.Linear(d, d), bad

    def forward(self, x):
        h = self.lin(x)
        y = h.sin()
        if self.bad:
            h.mul_(2)
        return y + x


@pytest.mark.parametrize("tracked", [False, True])
def test_an_inplace_change_of_a_kept_saved_tensor_raises_as_without_the_engine(tracked):
    """Note [A kept saved tensor keeps its version check]: with the hooks installed autograd no longer checks versions;
    the engine does, for kept blocks untracked or tracked (record_timeline keeps every block tracked)."""
    torch.manual_seed(0)
    net = _Stack(lambda: _InplaceBlock(), n=3)
    net.layers[2].bad = True
    x = torch.randn(8, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        net(x).sum().backward()
    off = offload_activations(net, 1, backend="host-copy", min_tensor_bytes=1, record_timeline=tracked)
    with off:
        out = net(x)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation .*block 2"):
        out.sum().backward()
    net.layers[2].bad = False  # and without the change the backward runs
    with off:
        out = net(x)
    out.sum().backward()


class _DroppedBranchBlock(nn.Module):
    """Saves a storage on a branch whose graph is dropped inside the block; a later save may reuse its address."""

    def __init__(self, d=64):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        a = self.lin(x)
        t = (a * 3).sin()
        del t
        return (a * 5).cos() + x


def test_untracked_blocks_count_each_live_storage_once_even_at_a_reused_address():
    torch.manual_seed(0)
    net = _Stack(_DroppedBranchBlock, n=3)
    x = torch.randn(64, 64, requires_grad=True)
    resident = {}
    for tracked in (False, True):
        off = offload_activations(net, 1, backend="host-copy", min_tensor_bytes=1, record_timeline=tracked)
        with off:
            out = net(x)
        out.sum().backward()
        resident[tracked] = off.stats.last_resident_bytes
    assert resident[False] == resident[True] > 0


def test_repeated_autocast_casts_share_one_copy():
    model, cfg = _llama(n_layers=2)
    batch = _batch(cfg)
    _, grads0 = _step(model, batch, autocast=torch.bfloat16)
    off = offload_activations(model, 0, **CPU)  # nothing offloaded: the dedupe alone
    _, grads = _step(model, batch, off, torch.bfloat16)
    assert _equal(grads, grads0)
    # q/k/v each cast the normed input to bf16, and so do w1/w3: 3 identical copies per block dropped.
    assert off.stats.deduplicated_casts == 3 * 2
    off2 = offload_activations(model, 0, dedupe_casts=False, **CPU)
    _step(model, batch, off2, torch.bfloat16)
    assert off2.stats.deduplicated_casts == 0
    assert off2.stats.last_resident_bytes > off.stats.last_resident_bytes


def test_weight_casts_are_recomputed_not_kept():
    model, cfg = _llama(n_layers=2)
    batch = _batch(cfg)
    _, grads0 = _step(model, batch, autocast=torch.bfloat16)
    on = offload_activations(model, 0, **CPU)
    off = offload_activations(model, 0, recompute_param_casts=False, **CPU)
    _, g_on = _step(model, batch, on, torch.bfloat16)
    _, g_off = _step(model, batch, off, torch.bfloat16)
    assert _equal(g_on, grads0) and _equal(g_off, grads0)
    assert on.stats.recomputed_param_casts == 2 * 7 + 1  # q, k, v, o, w1, w3, w2 per block, and the head
    assert off.stats.recomputed_param_casts == 0
    weights_bf16 = sum(p.numel() * 2 for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    assert off.stats.last_resident_bytes - on.stats.last_resident_bytes == weights_bf16 - model.head.weight.numel() * 2


def test_parameter_changed_between_forward_and_backward_is_a_clear_error():
    model, cfg = _llama(n_layers=2)
    tokens, targets = _batch(cfg)
    off = offload_activations(model, 0, **CPU)
    with off, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
    with torch.no_grad():
        model.layers[0].mlp.w1.weight.mul_(2)
    with pytest.raises(RuntimeError, match="parameter was modified in place between the forward and the backward"):
        loss.backward()


class _SkipBlock(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        h = (x @ self.w) * self.scale  # mm saves x and w (a parameter); mul saves the buffer
        gate = h.mean(-1, keepdim=True).sigmoid()  # small: one value per row
        return h * gate + x  # mul saves h and the gate


def test_skips_parameters_buffers_small_tensors_last_block_and_outside_blocks():
    torch.manual_seed(0)
    net = _Stack(_SkipBlock, n=4)
    head = nn.Linear(128, 128)
    x = torch.randn(8, 64, 128, requires_grad=True)
    off = offload_activations(net, "all", backend="host-copy", min_tensor_bytes=64 * 1024)
    with off:
        loss = head(net(x)).square().mean()  # the head runs outside the blocks
    loss.backward()
    s = off.stats
    # w and the buffer in every offloading block; the kept last block goes untracked (Note [A kept block's saved
    # tensors go untracked]), so nothing of it is counted as skipped
    assert s.skipped["parameter"] == 3 * 2
    assert s.skipped["small"] >= 3  # the gate (8*64 floats) in every offloading block
    assert s.last_offloaded_by_block[:3] == [2 * 8 * 64 * 128 * 4] * 3  # x and h
    assert s.last_offloaded_by_block[3] == 0  # the last block stays
    assert s.offloaded_bytes == sum(s.last_offloaded_by_block)  # nothing outside the blocks moved


def test_nothing_happens_without_grad():
    model, cfg = _llama()
    off = offload_activations(model, "all", **CPU)
    with torch.no_grad(), off:
        model(_batch(cfg)[0])
    assert off.stats.saved_tensors == 0 and off.stats.forwards == 0


def test_without_cuda_auto_backend_warns_once_and_equals_the_plain_run():
    model, cfg = _llama()
    batch = _batch(cfg)
    _, grads0 = _step(model, batch)
    off = offload_activations(model, "all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _, grads = _step(model, batch, off)
            assert _equal(grads, grads0)
    msgs = [str(w.message) for w in caught if "ActivationOffload" in str(w.message)]
    assert len(msgs) == 1 and "not a CUDA GPU" in msgs[0]
    assert off.stats.saved_tensors == 0 and not off.enabled


def test_cuda_backend_without_cuda_is_a_clear_error():
    model, _ = _llama()
    with pytest.raises(RuntimeError, match="backend='cuda' needs the model on a CUDA device"):
        offload_activations(model, "all", backend="cuda").begin_forward()


# --------------------------------------------------------------------------- pool, guard, ordering


def test_pool_allocates_only_in_the_first_step():
    model, cfg = _llama()
    batch = _batch(cfg)
    off = offload_activations(model, "all", **CPU)
    _step(model, batch, off)
    first = off.pool.allocations
    assert first > 0
    for _ in range(3):
        _step(model, batch, off)
    assert off.pool.allocations == first and off.pool.reuses >= 3 * first
    assert off.pool.in_use_bytes == 0


def test_host_memory_guard_raises_a_clear_error_and_leaves_no_hooks(monkeypatch):
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 4 * 2**20)
    model, cfg = _llama()
    batch = _batch(cfg)
    off = offload_activations(model, "all", host_memory_fraction=0.5, backend="host-copy", min_tensor_bytes=1024)
    with pytest.raises(HostMemoryError, match=r"host_memory_fraction=0.5 .*available"):
        _step(model, batch, off)
    saved = off.stats.saved_tensors
    _, grads = _step(model, batch)  # a plain step afterwards: no hook left behind
    assert off.stats.saved_tensors == saved
    assert off.pool.reserved_bytes <= 0.5 * (4 * 2**20 + off.pool.reserved_bytes)


def _guarded_pool(monkeypatch, total=200 * 2**20, fraction=0.5):
    """A pool on a host with ``total`` bytes, of which the pool's own buffers are no longer available."""
    pool = HostBufferPool(pin=False, host_memory_fraction=fraction)
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: total - pool.reserved_bytes)
    return pool


def test_pool_with_growing_sizes_stays_under_the_guard_while_little_is_in_use(monkeypatch):
    mib = 2**20
    pool = _guarded_pool(monkeypatch)  # the guard allows 100 MiB
    for step in range(30):  # one buffer per step, 4, 6, 8, ... 62 MiB: never more than 62 MiB in use
        buf = pool.acquire((4 + 2 * step) * mib)
        assert buf.tensor.numel() >= (4 + 2 * step) * mib
        pool.release(buf)
        assert pool.in_use_bytes == 0 and pool.reserved_bytes <= 100 * mib
    assert pool.dropped > 0  # old free buffers made room
    # A smaller request is served by a free buffer that is large enough, not by a new one.
    allocations = pool.allocations
    held = pool.acquire(5 * mib)
    assert pool.allocations == allocations and pool.larger_reuses == 1 and held.size == 62 * mib
    # What is in use still counts: holding more than the guard allows is a clear error.
    with pytest.raises(HostMemoryError, match=r"0.06 GiB in use.*host_memory_fraction=0.5"):
        pool.acquire(60 * mib)


def test_pool_best_fit_picks_the_smallest_large_enough_buffer():
    mib = 2**20
    pool = HostBufferPool(pin=False)
    big, mid, small = pool.acquire(16 * mib), pool.acquire(8 * mib), pool.acquire(2 * mib)
    for b in (big, mid, small):
        pool.release(b)
    assert pool.acquire(5 * mib) is mid and pool.acquire(7 * mib) is big
    assert pool.allocations == 3 and pool.larger_reuses == 2


def test_pool_drops_the_oldest_free_buffer_first(monkeypatch):
    mib = 2**20
    pool = _guarded_pool(monkeypatch, total=100 * mib)  # the guard allows 50 MiB
    a, b = pool.acquire(16 * mib), pool.acquire(16 * mib)
    pool.release(a)
    pool.release(b)  # a came back first
    c = pool.acquire(32 * mib)  # 64 MiB would be over: drop one free buffer, the oldest
    assert pool.dropped == 1 and pool._free[16 * mib] == [b] and pool.reserved_bytes == 48 * mib
    pool.release(c)


def test_pool_clear_drops_buffers_given_back_later(monkeypatch):
    mib = 2**20
    pool = HostBufferPool(pin=False)
    a, b = pool.acquire(4 * mib), pool.acquire(8 * mib)
    pool.release(a)
    pool.clear()
    assert pool.reserved_bytes == 8 * mib  # only b, still in use
    pool.release(b)
    assert pool.reserved_bytes == 0 and pool.in_use_bytes == 0
    c = pool.acquire(8 * mib)  # the pool stays usable, with new buffers
    assert c is not b and pool.allocations == 3 and pool.reserved_bytes == 8 * mib


def test_variable_sequence_lengths_reuse_the_pool_and_keep_gradients():
    model, cfg = _llama()
    off = offload_activations(model, "all", **CPU)
    allocations = []
    for seq in (cfg.seq_len, cfg.seq_len // 2, cfg.seq_len // 4, cfg.seq_len):
        tokens, targets = _batch(cfg)
        batch = tokens[:, :seq], targets[:, :seq]
        _, grads0 = _step(model, batch)
        _, grads = _step(model, batch, off)
        assert _equal(grads, grads0)
        allocations.append(off.pool.allocations)
    assert off.stats.last_offloaded_bytes > 0 and off.pool.in_use_bytes == 0
    assert off.pool.larger_reuses > 0 and allocations == allocations[:1] * 4  # shorter batches: no new buffer


def test_copies_are_waited_for_and_reloads_prefetched_in_plan_order():
    """See Note [Release point of an offloaded storage]: each block's copies are released at its plan's point."""
    model, cfg = _llama(n_layers=4)
    off = offload_activations(model, "all", record_timeline=True, **CPU)
    _step(model, _batch(cfg), off)
    ev = [(p.event, p.block) for p in off.timeline]
    idx = lambda e: ev.index(e)  # noqa: E731
    for i in range(3):  # blocks 0-2 offloaded; block i's copies are waited for when block i+2 starts
        last_offload = max(k for k, e in enumerate(ev) if e == ("offload", i))
        release = idx(("release", i + 2))
        assert last_offload < release < (idx(("block-start", i + 2)) if i + 2 < 4 else idx(("forward-end", 4)))
    for i in range(3):  # block i is reloaded when block i+1's backward starts, before block i's
        reloads = [k for k, e in enumerate(ev) if e == ("reload", i)]
        assert reloads and idx(("backward-point", i + 1)) < min(reloads) and max(reloads) < idx(("backward-point", i))
    # The engine's accounting: less on the device at the end of the forward than was saved in it.
    at_end = off.timeline[idx(("forward-end", 4))].saved_bytes
    assert at_end < off.stats.last_offloaded_bytes + off.stats.last_resident_bytes


def test_inplace_change_of_a_saved_tensor_is_an_error_as_without_the_engine():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            y = self.lin(x)
            z = y.sin()  # saves y
            y.mul_(2)  # ... then changes it
            return z + y

    def run(ctx):
        torch.manual_seed(0)
        net = _Stack(Bad)
        with ctx(net):
            out = net(torch.randn(4, 64, 64)).sum()
        out.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(lambda net: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(lambda net: offload_activations(net, "all", backend="host-copy", min_tensor_bytes=1))


# -------------------------------------------------------------------------------- composition


def test_activation_checkpointing_offloads_only_what_checkpointing_saves():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, cfg = _llama()
    for i, blk in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(blk)
    batch = _batch(cfg)
    _, grads0 = _step(model, batch)
    off = offload_activations(model, "all", **CPU)
    _, grads = _step(model, batch, off)
    assert _equal(grads, grads0)
    # Each checkpointed block keeps only its input (the rotary tables are buffers): one storage moved.
    assert off.stats.offloaded_tensors == 2
    x_bytes = cfg.batch_size * cfg.seq_len * cfg.dim * 4
    assert off.stats.last_offloaded_by_block == [x_bytes, x_bytes, 0]


def test_whole_model_compile_is_a_clear_error():
    model, cfg = _llama()
    compiled = torch.compile(model)
    off = offload_activations(compiled, "all", **CPU)
    with pytest.raises(RuntimeError, match="torch.compile'd module.*Compile each block instead"):
        off.begin_forward()
    assert off._hooks_ctx is None


def _offload_all_matches_the_compiled_model(model, cfg):
    """Offload every block of ``model`` (its blocks compiled) for two steps: gradients bitwise those of the same
    model without the engine, every offloaded byte reloaded ahead of use. Returns the batch and those gradients."""
    batch = _batch(cfg)
    _, grads0 = _step(model, batch)
    off = offload_activations(model, "all", **CPU)
    for _ in range(2):
        _, grads = _step(model, batch, off)
        assert _equal(grads, grads0)
    assert off.stats.offloaded_tensors > 0 and off.stats.last_offloaded_by_block[0] > 0
    assert off.stats.reloaded_bytes == off.stats.offloaded_bytes and off.stats.on_demand_reloads == 0
    return batch, grads0


def test_per_block_compile_with_aot_eager_is_bitwise_equal():
    model, cfg = _llama()
    for i, blk in enumerate(model.layers):
        model.layers[i] = torch.compile(blk, backend="aot_eager")
    _offload_all_matches_the_compiled_model(model, cfg)


def test_blocks_compiled_in_place_run_their_boundaries_around_the_compiled_call():
    """``block.compile()`` (the fp8 plugins' regional compilation) traces the block's own hooks into the compiled
    function; the engine runs its boundaries around the compiled call instead, and puts the call back after the
    forward. Gradients bitwise those of the same compiled model without the engine."""
    model, cfg = _llama()
    for blk in model.layers:
        blk.compile(backend="aot_eager")
    calls = [blk._compiled_call_impl for blk in model.layers]
    batch, grads0 = _offload_all_matches_the_compiled_model(model, cfg)
    assert [blk._compiled_call_impl for blk in model.layers] == calls  # the compiled calls are back
    assert not any(blk._forward_pre_hooks or blk._forward_hooks for blk in model.layers)
    # full recompute around the compiled call (Hugging Face's checkpointing calls a block the same way), under a
    # wait of another part's (SuperOffload's) installed first: both chained, the boundaries outside the checkpoint
    from lightning_gh._compiled import compiled_call_wrappers
    from lightning_gh.superoffload.layout import WaitBeforeCompiledCall

    waits = []
    held = [WaitBeforeCompiledCall(blk, lambda i=i: waits.append(i)) for i, blk in enumerate(model.layers)]
    off = offload_activations(model, 1, recompute="full", **CPU)
    starts = []
    pre = off._make_pre
    off._make_pre = lambda i: (lambda m, a: (starts.append(i), pre(i)(m, a)))
    _, grads = _step(model, batch, off)
    assert _equal(grads, grads0) and off.stats.last_recompute_blocks == [1, 2]
    assert starts == [0, 1, 2]  # once per block: the backward's recompute runs inside the boundaries
    assert waits == [0, 1, 2, 2, 1]  # the wait is inside the checkpoint: the recomputed blocks wait again
    assert [compiled_call_wrappers(blk) for blk in model.layers] == [[h] for h in held]
    # a second engine cannot recompute a block the first recomputes (as on eager blocks)
    off2 = offload_activations(model, 0, recompute="full", **CPU)
    off.begin_forward()
    with pytest.raises(ValueError, match="already recomputes under another ActivationOffload engine"):
        off2.begin_forward()
    off.end_forward()
    for h in held:
        h.remove()
    assert [blk._compiled_call_impl for blk in model.layers] == calls
    with pytest.raises(ValueError, match="recompute='selective'.*'full' also for a block compiled in place"):
        offload_activations(model, 1, recompute="selective", **CPU).begin_forward()
    # a module compiled in place that runs the blocks is still refused
    model.compile(backend="aot_eager")
    off = offload_activations(model, "all", **CPU)
    with pytest.raises(RuntimeError, match="torch.compile'd module '<the model itself"):
        off.begin_forward()


def test_find_blocks():
    model, _ = _llama()
    name, blocks = find_blocks(model)
    assert name == "layers" and blocks == list(model.layers)
    assert find_blocks(model, "layers")[1] == list(model.layers)
    with pytest.raises(ValueError, match="blocks='head'.*ModuleList"):
        find_blocks(model, "head")
    with pytest.raises(ValueError, match="blocks='nope' names no submodule"):
        find_blocks(model, "nope")
    with pytest.raises(ValueError, match="no transformer blocks found"):
        find_blocks(nn.Linear(3, 3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(policy="some"), "policy='some'"),
        (dict(policy=-1), "policy=-1"),
        (dict(min_tensor_bytes=-1), "min_tensor_bytes=-1"),
        (dict(prefetch_blocks=0), "prefetch_blocks=0"),
        (dict(max_inflight_blocks=0), "max_inflight_blocks=0"),
        (dict(margin=-0.1), "margin=-0.1"),
        (dict(profile_steps=0), "profile_steps=0"),
        (dict(host_memory_fraction=1.5), "host_memory_fraction=1.5"),
        (dict(backend="tpu"), "backend='tpu'"),
        (dict(bandwidth_gbps=(1.0, 2.0, 3.0)), "bandwidth_gbps"),
    ],
)
def test_argument_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationOffload(**kwargs)
    policy = kwargs.pop("policy", "auto")
    with pytest.raises(ValueError, match=match):
        offload_activations(nn.Linear(2, 2), policy, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy=True), r"policy=True\): expected 'auto', 'all', or an int K >= 0 .*, got bool"),
    (dict(policy=0.5), r"policy=0.5\): expected 'auto', 'all', or an int K >= 0 .*, got float"),
    (dict(min_tensor_bytes=2.5), r"min_tensor_bytes=2.5\): expected an int, got float"),
    (dict(margin="0.5"), r"margin='0.5'\): expected a float, got str"),
    (dict(backend=3), r"backend=3\): expected a string, got int"),
    (dict(bandwidth_gbps=("fast", 2.0)), r"bandwidth_gbps=\('fast', 2.0\)\): expected a float, a \(float, float\)"),
])
def test_wrong_types_are_type_errors_naming_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ActivationOffload(**kwargs)
    policy = kwargs.pop("policy", "auto")
    with pytest.raises(TypeError, match=match):
        offload_activations(nn.Linear(2, 2), policy, **kwargs)



# ------------------------------------------------------------------------------------- options


def test_options_are_frozen_and_validated_at_construction():
    opts = ActivationOffloadOptions(policy=2, margin=0.5, bandwidth_gbps=[10, 20])
    assert opts.bandwidth_gbps == (10, 20)  # a list becomes a tuple: the options stay immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.margin = 1.0
    assert dataclasses.replace(opts, margin=1.0).margin == 1.0
    with pytest.raises(ValueError, match=r"margin=-1 must be a number >= 0"):
        dataclasses.replace(opts, margin=-1)
    with pytest.raises(ValueError, match=r"policy='some' is not valid; use 'auto', 'all', or an int"):
        ActivationOffloadOptions(policy="some")
    with pytest.raises(ValueError, match=r"recompute='everything' is not valid; use None"):
        ActivationOffloadOptions(recompute="everything")
    with pytest.raises(TypeError, match=r"dedupe_casts='yes'\): expected True or False, got str"):
        ActivationOffloadOptions(dedupe_casts="yes")
    model, _ = _llama()
    assert ActivationOffloadOptions(blocks=list(model.layers)).blocks == tuple(model.layers)


def test_blocks_of_the_wrong_type_fail_at_construction():
    with pytest.raises(TypeError, match=r"blocks=5 must be None .* a submodule name .* or a list of modules; got a int"):
        ActivationOffload(blocks=5)
    with pytest.raises(ValueError, match=r"blocks=Linear must be a submodule name or a list of modules, not a single"):
        ActivationOffload(blocks=nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"non-empty sequence of nn.Module"):
        ActivationOffload(blocks=[])


def test_callback_keywords_and_options_build_the_same_engine_options():
    kwargs = dict(policy="all", min_tensor_bytes=1024, margin=0.5, skip_last_blocks=2, recompute="full",
                  backend="host-copy", bandwidth_gbps=(8.0, 9.0), record_timeline=True)
    opts = ActivationOffloadOptions(**kwargs)
    by_kwargs, by_options = ActivationOffload(**kwargs), ActivationOffload(options=opts)
    assert by_kwargs.options == by_options.options == opts
    assert by_kwargs.state_key == by_options.state_key
    model, _ = _llama()
    assert ActivationOffloader(model, options=opts).options == offload_activations(model, **kwargs).options == opts
    engine = ActivationOffloader(model, options=opts)
    o = engine.options
    assert (o.policy, o.margin, o.recompute, o.record_timeline) == ("all", 0.5, "full", True)


def test_options_and_keywords_together_are_a_clear_error():
    opts = ActivationOffloadOptions(policy="all")
    with pytest.raises(TypeError, match=r"ActivationOffload got both options= and margin=0.5: pass the options in one place"):
        ActivationOffload(margin=0.5, options=opts)
    with pytest.raises(TypeError, match=r"ActivationOffloader got both options= and policy=1"):
        ActivationOffloader(nn.Linear(2, 2), 1, options=opts)
    with pytest.raises(TypeError, match=r"ActivationOffload\(options=...\) must be an ActivationOffloadOptions, got dict"):
        ActivationOffload(options={"policy": "all"})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['polcy'\]"):
        offload_activations(nn.Linear(2, 2), polcy="all")



def test_command_line_builds_the_callback_from_keywords_or_options():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(ActivationOffload, "cb")
    by_kwargs = parser.instantiate_classes(parser.parse_args(["--cb.policy=3", "--cb.recompute=full"])).cb
    by_options = parser.instantiate_classes(parser.parse_args(["--cb.options.policy=3",
                                                               "--cb.options.recompute=full"])).cb
    assert by_kwargs.options == by_options.options == ActivationOffloadOptions(policy=3, recompute="full")

# ------------------------------------------------------------------------------------- Lightning


def _fit(callbacks, steps=3, accumulate=1, val=0, devices=1, **kw):
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny", overrides=dict(n_layers=3), lr=3e-3)
    dm = MarkovDataModule.for_model(model)
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=steps, accumulate_grad_batches=accumulate,
                        limit_val_batches=val, val_check_interval=2 if val else None,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, **{"logger": False, **kw})
    trainer.fit(model, dm)
    return model, trainer


def test_callback_parity_with_accumulation_and_validation():
    plain, _ = _fit([], accumulate=2, val=2)
    cb = ActivationOffload(policy=1, **CPU)
    model, _ = _fit([cb], accumulate=2, val=2)
    assert _equal(list(model.parameters()), list(plain.parameters()))
    assert cb.engine.stats.forwards == 6  # 3 optimizer steps x 2 micro-batches; validation untouched
    assert cb.engine.stats.offloaded_tensors > 0 and cb.engine.stats.on_demand_reloads == 0


def test_callback_auto_logs_its_decision_and_keeps_it_across_resume(caplog, tmp_path):
    cb = ActivationOffload(policy="auto", profile_steps=1, bandwidth_gbps=1e6, **CPU)
    with caplog.at_level(logging.INFO):
        _fit([cb], steps=4)
    assert cb.plan is not None and cb.plan.policy == "auto" and cb.plan.offloaded_blocks == (0, 1)
    assert "policy auto: offload blocks" in caplog.text and "predicted:" in caplog.text
    state = cb.state_dict()
    cb2 = ActivationOffload(policy="auto", profile_steps=1, **CPU)
    cb2.load_state_dict(state)
    _fit([cb2], steps=1)
    assert cb2.plan.budgets == cb.plan.budgets and "restored" in cb2.plan.describe()
    assert cb2.engine.stats.offloaded_tensors > 0  # no profiling steps after the resume


def test_callback_refuses_cuda_graph_capture():
    class CUDAGraphCapture(L.Callback):
        pass

    # compat's message names both parts (and why)
    with pytest.raises(MisconfigurationException, match="CUDAGraphCapture and ActivationOffload cannot be used together"):
        _fit([ActivationOffload(policy="all", **CPU), CUDAGraphCapture()], steps=1)


class _RequireOffload(L.Callback):
    """Fails the run (on every rank) when the ActivationOffload engine moved nothing there."""

    def on_train_end(self, trainer, pl_module):
        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationOffload)]
        moved = cb.engine.stats.offloaded_tensors if cb.engine is not None else 0
        if moved == 0 or cb.engine.stats.reloaded_bytes != cb.engine.stats.offloaded_bytes:
            raise AssertionError(f"rank {trainer.global_rank}/{trainer.world_size}: ActivationOffload moved "
                                 f"{moved} tensors")


def test_require_offload_check_fails_when_nothing_is_offloaded():
    with pytest.raises(AssertionError, match="rank 0/1: ActivationOffload moved 0 tensors"):
        _fit([ActivationOffload(policy=0, **CPU), _RequireOffload()], steps=1)


# A CPU test: on a CUDA machine Lightning's forked ranks read the CUDA RNG state, which fails once the parent has
# touched CUDA (any earlier GPU test, or a device count).
@pytest.mark.skipif(torch.cuda.is_available(), reason="ddp_fork ranks cannot use CUDA after the parent touched it")
def test_callback_under_ddp_matches_plain_ddp():
    # ddp_fork: two ranks without a fresh interpreter each (a spawned rank imports torch, Lightning and this module
    # again). What ddp_spawn adds, carrying the callbacks to the ranks by pickle, is checked here first.
    callbacks = pickle.loads(pickle.dumps([ActivationOffload(policy="all", **CPU), _RequireOffload()]))
    kw = dict(devices=2, strategy="ddp_fork")
    plain, _ = _fit([], steps=2, **{**kw})
    model, _ = _fit(callbacks, steps=2, **kw)
    assert _equal(list(model.parameters()), list(plain.parameters()))


def test_callback_refuses_fsdp1_at_setup_and_takes_fsdp2():
    import types

    import lightning.pytorch.strategies as strategies

    cb = ActivationOffload(policy="all", **CPU)
    with pytest.raises(MisconfigurationException, match="does not support strategy FSDPStrategy.*ModelParallelStrategy"):
        cb.setup(types.SimpleNamespace(strategy=strategies.FSDPStrategy()), None, "fit")
    with pytest.raises(MisconfigurationException, match="tensor_parallel_size=2.*data parallel only"):
        cb.setup(types.SimpleNamespace(strategy=strategies.ModelParallelStrategy(tensor_parallel_size=2)), None, "fit")
    for ok in (strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
               strategies.DDPStrategy(), strategies.SingleDeviceStrategy("cpu")):
        cb.setup(types.SimpleNamespace(strategy=ok), None, "fit")  # FSDP2, DDP and one device pass


# ------------------------------------------------------------------------------------------ GPU


@contextlib.contextmanager
def _deterministic():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward without atomics
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(old)


@pytest.mark.gpu
def test_gpu_offload_matches_plain_bitwise_and_lowers_peak_memory():
    model, cfg = _llama(n_layers=6, dim=512, n_heads=8, n_kv_heads=8, ffn_dim=1408, seq_len=1024, batch_size=4,
                        vocab_size=1024)
    model.cuda()
    batch = _batch(cfg, device="cuda")
    with _deterministic():
        _, g_a = _step(model, batch, autocast=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _, g_b = _step(model, batch, autocast=torch.bfloat16)
        torch.cuda.synchronize()
        plain_peak = torch.cuda.max_memory_allocated() - base
        assert _equal(g_a, g_b), "the plain run is not deterministic here"
        off = offload_activations(model, "all", backend="cuda")
        _step(model, batch, off, torch.bfloat16)  # the first step fills the pinned pool
        allocations = off.pool.allocations
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _, g_c = _step(model, batch, off, torch.bfloat16)
        torch.cuda.synchronize()
        off_peak = torch.cuda.max_memory_allocated() - base
    assert _equal(g_a, g_c)
    assert off.pool.allocations == allocations  # no pinned allocation after warm-up
    assert off.stats.on_demand_reloads == 0 and off.stats.used_before_release == 0
    assert off.stats.last_offloaded_bytes > 0
    assert off_peak < plain_peak - 0.5 * off.stats.last_offloaded_bytes, (plain_peak, off_peak)


@pytest.mark.gpu
def test_gpu_skips_cpu_tensors_and_auto_decides():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            host = torch.randn(512, 512, requires_grad=True)  # a CPU tensor saved inside a block
            (host * host).sum()
            return self.lin(x).relu()

    net = _Stack(Mixed, n=4).cuda()
    off = offload_activations(net, "auto", profile_steps=1)
    x = torch.randn(64, 256, 256, device="cuda")
    for _ in range(3):
        with off:
            out = net(x).square().mean()
        out.backward()
    assert off.stats.skipped.get("other-device", 0) > 0
    assert off.plan is not None and off.plan.prediction is not None


def test_plan_and_saved_memory_reach_the_users_logger(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    cb = ActivationOffload(policy="all", **CPU)
    _fit([cb], steps=3, logger=CSVLogger(tmp_path, name="", version="logs"), log_every_n_steps=1)
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    moved = [float(r["lgh/activation_offload/offloaded_bytes"]) for r in rows
             if r.get("lgh/activation_offload/offloaded_bytes")]
    assert moved and all(b > 0 for b in moved)
    assert all(float(r["lgh/activation_offload/offloaded_blocks"]) >= 1 for r in rows
               if r.get("lgh/activation_offload/offloaded_blocks"))
