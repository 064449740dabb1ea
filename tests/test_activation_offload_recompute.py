"""Offload + recompute: blocks the plan does not offload recompute what they saved (``recompute=``).

On the CPU the engine runs in ``backend="host-copy"`` mode. Recomputing RMSNorm, rotary, SiLU, products and
casts replays the same deterministic CPU kernels on the same inputs, so losses and gradients must be
bitwise those of the plain run (on the GPU the same holds for these elementwise kernels; matmuls and
attention are not recomputed under ``"selective"``).

What a step keeps for its backward is measured with a dispatch mode that records every op's output
storage and, after the forward, counts those still alive: selective checkpointing keeps its matmul and
attention outputs in its own cache, not as saved tensors, so a ``saved_tensors_hooks`` counter would miss
them and flatter the saving.
"""

from __future__ import annotations

import contextlib
import logging
import pickle

import lightning as L
import pytest
import test_activation_offload as plain_tests  # the engine tests: model, batch and step helpers
import torch
import torch.nn.functional as F
from test_activation_offload import CPU, _batch, _equal, _llama
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gh.activation_offload import ActivationOffload, offload_activations
from lightning_gh.activation_offload.policy import (
    BlockProfile,
    StepProfile,
    plan_auto,
    plan_first_k,
    plan_with_recompute,
)
from lightning_gh.activation_offload.recompute import BlockRecompute, is_norm_act_module
from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.demo import model as demo_model


class SwiGLUGate(demo_model.SwiGLUGate):
    """The demo's gate module, counting its calls: how often ``recompute="norm-act"`` runs it."""

    calls = 0

    def forward(self, gate, up):
        SwiGLUGate.calls += 1
        return super().forward(gate, up)


def _gated_llama(n_layers=3, seed=0):
    """The demo Llama with counting gate modules (same parameters, same numbers)."""
    model, cfg = _llama(n_layers, seed)
    for blk in model.layers:
        blk.mlp.gate = SwiGLUGate()
    return model, cfg


def _step(model, batch, ctx=None, autocast=torch.bfloat16):
    return plain_tests._step(model, batch, ctx, autocast)


class _LiveOutputs(TorchDispatchMode):
    """Records each op's output storages; ``alive()``: those still referenced (what the forward keeps)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.outputs.append((func, StorageWeakRef(st), st.data_ptr(), st.nbytes()))
        return out

    def alive(self):
        live = {}
        for func, ref, ptr, nbytes in self.outputs:
            if not ref.expired():
                live.setdefault(ptr, (func, nbytes))
        return live


def _kept_after_forward(model, batch, ctx):
    tokens, targets = batch
    with _LiveOutputs() as rec, ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
    live = rec.alive()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(n for _, n in live.values()), sum(1 for f, _ in live.values() if f is torch.ops.aten.mm.default)


# --------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("policy", [0, 1, "auto"])
@pytest.mark.parametrize("mode", ["selective", "full", "norm-act"])
def test_gradients_and_losses_bitwise_equal_with_recompute(policy, mode):
    model, cfg = _gated_llama() if mode == "norm-act" else _llama()
    batch = _batch(cfg)
    loss0, grads0 = _step(model, batch)
    off = offload_activations(model, policy, recompute=mode, profile_steps=1, bandwidth_gbps=1e6, **CPU)
    for _ in range(3):  # "auto": warm-up, one profiled step, then the plan with recompute
        loss, grads = _step(model, batch, off)
        assert torch.equal(loss, loss0) and _equal(grads, grads0)
    offloaded = set(off.plan.offloaded_blocks)
    assert off.stats.last_recompute_blocks == [i for i in range(3) if i not in offloaded]
    assert off.plan.recompute == tuple(off.stats.last_recompute_blocks) and off.plan.recompute_mode == mode
    assert off.stats.reloaded_bytes == off.stats.offloaded_bytes and off.stats.on_demand_reloads == 0
    assert all("forward" not in m.__dict__ for m in model.modules())  # unwrapped once the forward ended


def test_selective_keeps_the_matmul_outputs_and_fewer_bytes_than_no_recompute():
    model, cfg = _llama()
    batch = _batch(cfg)
    plain, mm_plain = _kept_after_forward(model, batch, offload_activations(model, 0, **CPU))
    sel_engine = offload_activations(model, 0, recompute="selective", **CPU)
    sel, mm_sel = _kept_after_forward(model, batch, sel_engine)
    full, mm_full = _kept_after_forward(model, batch, offload_activations(model, 0, recompute="full", **CPU))
    assert full < sel < plain
    assert mm_sel == 7 * 3  # q, k, v, o, w1, w3, w2 in each of the 3 blocks
    assert mm_full == 0 and mm_plain < mm_sel  # plain keeps only the mm outputs later ops saved (v, w1, w3)
    # The selective caches (the matmul and attention outputs, with logsumexp) went through the engine's hooks: it
    # counts them among each block's kept bytes, and nothing is left in the caches behind its back.
    t, kv = cfg.batch_size * cfg.seq_len, cfg.n_kv_heads * cfg.head_dim
    mm_bytes = t * (2 * cfg.dim + 2 * kv + 2 * cfg.ffn_dim + cfg.dim) * 2
    attn_bytes = t * cfg.dim * 2 + cfg.batch_size * cfg.n_heads * cfg.seq_len * 4
    assert sel_engine.stats.last_recompute_cached_bytes == 0
    kept = sel_engine.stats.last_recompute_kept_by_block
    assert sorted(kept) == [0, 1, 2] and all(k >= mm_bytes + attn_bytes for k in kept.values())
    # Without the hooks, the same cache is counted where it stays: in torch's cache.
    rc = BlockRecompute(model.layers, "selective")
    rc.apply(range(3))
    tokens, targets = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
    rc.remove()
    loss.backward()
    model.zero_grad(set_to_none=True)
    assert rc.cached_bytes == [mm_bytes + attn_bytes] * 3


@pytest.mark.parametrize("offload", [(None, None, 0), (None, 4096, 0)])
def test_selective_blocks_offload_their_cache_and_stay_bitwise(offload):
    """A budget plan may recompute a block selectively and offload what it still saves: the matmul and attention
    outputs in its cache go to the host and come back for the recompute; gradients and losses stay bitwise."""
    from lightning_gh.activation_offload.policy import OffloadPlan

    model, cfg = _llama()
    batch = _batch(cfg)
    loss0, grads0 = _step(model, batch)
    off = offload_activations(model, 0, recompute="selective", **CPU)
    off._resolve()
    off._adopt(OffloadPlan("budget", offload, (2, 3, 3), (1, 2, 3), modes=("selective",) * 3))
    for _ in range(2):
        loss, grads = _step(model, batch, off)
        assert torch.equal(loss, loss0) and _equal(grads, grads0)
    t, kv = cfg.batch_size * cfg.seq_len, cfg.n_kv_heads * cfg.head_dim
    cache = t * (2 * cfg.dim + 2 * kv + 2 * cfg.ffn_dim + cfg.dim) * 2 + t * cfg.dim * 2
    moved = off.stats.offloaded_bytes // 2  # two steps
    assert (2 * cache <= moved) if offload[1] is None else (cache <= moved < 2 * cache)
    assert off.stats.reloaded_bytes == off.stats.offloaded_bytes
    assert off.stats.last_recompute_cached_bytes == 0 and off.stats.on_demand_reloads == 0


@pytest.mark.parametrize("mode", ["selective", "norm-act"])
def test_auto_measures_without_recompute_then_forecasts_from_the_first_recomputing_forward(caplog, mode):
    model, cfg = _gated_llama()
    batch = _batch(cfg)
    # A slow link: nothing hides, so every block recomputes.
    plans = []
    off = offload_activations(model, "auto", recompute=mode, profile_steps=1, bandwidth_gbps=1e-3,
                              on_plan=plans.append, **CPU)
    for _ in range(2):  # warm-up and profiled step, without recompute
        _step(model, batch, off)
    assert off.stats.recompute_forwards == 0 and plans == []
    # Step 3 adopts the plan (its recompute saving not forecast yet), recomputes, and forecasts from that.
    with caplog.at_level(logging.INFO, logger="lightning_gh.activation_offload.engine"):
        off.on_plan = lambda plan: (plans.append(plan), logging.getLogger("lightning_gh.activation_offload.engine")
                                    .info(plan.describe()))
        _step(model, batch, off)
        _step(model, batch, off)  # later forwards do not forecast again
    assert len(plans) == 2 and off.plan is plans[1] and off.stats.recompute_forwards == 2
    assert plans[0].recompute == plans[1].recompute == (0, 1, 2)
    assert plans[0].prediction.recompute_freed_bytes == 0 and "not forecast yet" in plans[0].describe()
    saved = [b.saved_bytes for b in off.profile.blocks]
    # The forecast uses exactly what the recomputing forward kept: through the hooks plus the selective caches.
    kept = off.stats.last_recompute_kept_by_block
    assert [b.recompute_kept_bytes for b in off.profile.blocks] == [kept[i] for i in range(3)]
    assert sum(kept.values()) == off.stats.last_resident_bytes + off.stats.last_recompute_cached_bytes
    p = off.plan.prediction
    assert p.recompute_freed_bytes == sum(s - kept[i] for i, s in enumerate(saved)) > 0
    assert p.peak_bytes < p.baseline_peak_bytes
    assert all(kept[i] < (0.7 if mode == "selective" else 0.95) * saved[i] for i in range(3))
    assert f"{mode} recompute in blocks 0-2" in caplog.text and "recompute keeps" in caplog.text
    assert "without recompute (mean, both measured)" in caplog.text


def test_norm_act_recomputes_only_norms_and_gates_and_keeps_less_than_plain():
    model, cfg = _gated_llama()
    batch = _batch(cfg)
    regions = [type(m).__name__ for m in model.layers[0].modules() if is_norm_act_module(m)]
    assert regions == ["RMSNorm", "RMSNorm", "SwiGLUGate"]
    assert not any(is_norm_act_module(m) for m in (torch.nn.SiLU(), torch.nn.GLU(), torch.nn.Linear(2, 2)))
    plain, mm_plain = _kept_after_forward(model, batch, offload_activations(model, 0, **CPU))
    eng = offload_activations(model, 0, recompute="norm-act", **CPU)
    SwiGLUGate.calls = 0
    kept, mm_kept = _kept_after_forward(model, batch, eng)
    assert SwiGLUGate.calls == 2 * 3  # each gate ran in the forward and once more in the backward
    assert mm_kept == mm_plain  # no matmul output is kept or dropped
    # Per block at least the SiLU output (bf16, tokens x ffn) is gone; the norms' fp32 outputs on the CPU too.
    t = cfg.batch_size * cfg.seq_len
    assert plain - kept >= 3 * t * (cfg.ffn_dim * 2 + 2 * cfg.dim * 4)
    assert eng.stats.last_recompute_cached_bytes == 0 and eng.stats.last_recompute_blocks == [0, 1, 2]
    # Marked modules: lgh_recompute=True forces a region, False forbids one.
    model.layers[0].attn_norm.lgh_recompute = False
    model.layers[0].attn.lgh_recompute = True
    rc = BlockRecompute(list(model.layers), "norm-act")
    assert [type(m).__name__ for m in rc.regions[0]] == ["Attention", "RMSNorm", "SwiGLUGate"]


# ------------------------------------------------------------------------------------- the planner


def test_plan_with_recompute_takes_the_blocks_not_offloaded_and_forecasts_the_peak():
    mib = 2**20
    prof = StepProfile(tuple(BlockProfile(2.0, 4.0, 100 * mib, 0, 40 * mib) for _ in range(8)),
                       other_bytes=50 * mib)
    plan = plan_auto(prof, d2h_gbps=20.0, h2d_gbps=20.0)
    assert 0 < len(plan.offloaded_blocks) < 8
    hybrid = plan_with_recompute(plan, "selective", prof, 20.0, 20.0, 0.25)
    assert hybrid.budgets == plan.budgets and hybrid.release_at == plan.release_at
    assert set(hybrid.recompute) == set(range(8)) - set(plan.offloaded_blocks)
    n_rc = len(hybrid.recompute)
    assert hybrid.prediction.recompute_freed_bytes == n_rc * 60 * mib
    assert hybrid.prediction.peak_bytes < plan.prediction.peak_bytes
    assert hybrid.prediction.baseline_peak_bytes == plan.prediction.baseline_peak_bytes
    assert hybrid.prediction.stall_ms == plan.prediction.stall_ms
    assert "selective recompute in blocks" in hybrid.describe()
    stripped = plan_with_recompute(hybrid, None)
    assert stripped.recompute == () and stripped.prediction is None  # its forecast counted recompute
    fixed = plan_with_recompute(plan_first_k(8, 2), "full")
    assert fixed.recompute == tuple(range(2, 8)) and "not forecast" in fixed.describe()
    with pytest.raises(ValueError, match="recompute holds block 0"):
        type(plan)(plan.policy, plan.budgets, plan.release_at, plan.prefetch_at, recompute=(0,),
                   recompute_mode="selective")
    with pytest.raises(ValueError, match="mode='cheap'"):
        plan_with_recompute(plan, "cheap")


# ------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("bad, error, match", [
    ("cheap", ValueError, r"recompute='cheap' is not valid; use None .*'selective'.*'full'"),
    ("SELECTIVE", ValueError, r"recompute='SELECTIVE' is not valid; use None .*'selective'.*'full'"),
    (True, TypeError, r"recompute=True\): expected a string or None, got bool"),
    (1, TypeError, r"recompute=1\): expected a string or None, got int"),
])
def test_bad_recompute_value_names_argument_value_and_choices(bad, error, match):
    with pytest.raises(error, match=match):
        ActivationOffload(policy="auto", recompute=bad)
    with pytest.raises(error, match=match):
        offload_activations(torch.nn.Linear(2, 2), "auto", recompute=bad)


def test_already_checkpointed_or_compiled_blocks_are_refused_not_wrapped_twice():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, cfg = _llama()
    model.layers[1] = checkpoint_wrapper(model.layers[1])
    off = offload_activations(model, 0, recompute="selective", blocks="layers", **CPU)
    with pytest.raises(ValueError, match=r"recompute='selective': block 1 \(CheckpointWrapper\) is wrapped in"):
        off.begin_forward()
    model, cfg = _llama()
    model.layers[0] = torch.compile(model.layers[0], backend="aot_eager")
    with pytest.raises(ValueError, match="block 0 .* torch.compile'd"):
        offload_activations(model, 0, recompute="full", blocks="layers", **CPU).begin_forward()
    with pytest.raises(ValueError, match="block 0 .* torch.compile'd"):
        offload_activations(model, 0, recompute="norm-act", blocks="layers", **CPU).begin_forward()
    # Two engines on one model: the second sees the first's wrapper during the first's forward.
    model, cfg = _llama()
    first = offload_activations(model, 0, recompute="selective", **CPU)
    second = BlockRecompute(list(model.layers), "full")
    with first:
        with pytest.raises(ValueError, match="already recomputes under another ActivationOffload engine"):
            second.apply([0])
    assert all("forward" not in b.__dict__ for b in model.layers)
    first = offload_activations(model, 0, recompute="norm-act", **CPU)
    with first:
        assert "forward" in model.layers[0].attn_norm.__dict__ and "forward" not in model.layers[0].__dict__
        with pytest.raises(ValueError, match=r"recompute='selective': block 0 .*already recomputes under another"):
            BlockRecompute(list(model.layers), "selective").apply([0])
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_no_grad_forward_is_untouched():
    model, cfg = _llama()
    off = offload_activations(model, 0, recompute="selective", **CPU)
    with torch.no_grad(), off:
        assert all("forward" not in b.__dict__ for b in model.layers)
        model(_batch(cfg)[0])
    assert off.stats.recompute_forwards == 0 and off.stats.saved_tensors == 0


@pytest.mark.parametrize("mode", ["selective", "norm-act"])
def test_gradient_accumulation_two_forwards_before_one_backward(mode):
    model, cfg = _gated_llama()
    b1, b2 = _batch(cfg, 1), _batch(cfg, 2)

    def run(ctx):
        model.zero_grad(set_to_none=True)
        losses = []
        for tokens, targets in (b1, b2):
            with ctx, torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten()))
        (losses[0] + losses[1]).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = run(contextlib.nullcontext())
    off = offload_activations(model, 1, recompute=mode, **CPU)
    assert _equal(run(off), plain)
    assert off.stats.recompute_forwards == 2 and off.stats.on_demand_reloads == 0


# ------------------------------------------------------------------------------------- Lightning


def _fit(callbacks, steps=3, accumulate=1, val=0, **kw):
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny", overrides=dict(n_layers=3), lr=3e-3)
    dm = MarkovDataModule.for_model(model)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate,
                        limit_val_batches=val, val_check_interval=2 if val else None, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, **kw)
    trainer.fit(model, dm)
    return model, trainer


def test_callback_parity_over_steps_with_accumulation_validation_and_bf16():
    kw = dict(accumulate=2, val=2, precision="bf16-mixed", steps=4)
    plain, _ = _fit([], **kw)
    cb = ActivationOffload(policy="auto", recompute="selective", profile_steps=1, bandwidth_gbps=1e6, **CPU)
    model, _ = _fit([cb], **kw)
    assert _equal(list(model.parameters()), list(plain.parameters()))
    assert cb.plan.recompute == (2,) and cb.plan.offloaded_blocks == (0, 1)
    assert cb.engine.stats.forwards == 8 and cb.engine.stats.recompute_forwards == 6  # 2 profiling micro-batches
    assert all("forward" not in b.__dict__ for b in model.model.layers)


def test_callback_keeps_the_hybrid_plan_across_resume():
    cb = ActivationOffload(policy="auto", recompute="selective", profile_steps=1, bandwidth_gbps=1e6, **CPU)
    _fit([cb], steps=3)
    cb2 = ActivationOffload(policy="auto", recompute="selective", profile_steps=1, **CPU)
    cb2.load_state_dict(cb.state_dict())
    _fit([cb2], steps=1)
    assert cb2.plan.recompute == cb.plan.recompute == (2,) and cb2.engine.stats.recompute_forwards == 1
    cb3 = ActivationOffload(policy="auto", profile_steps=1, **CPU)  # resumed without recompute: none applied
    cb3.load_state_dict(cb.state_dict())
    _fit([cb3], steps=1)
    assert cb3.plan.recompute == () and cb3.engine.stats.recompute_forwards == 0


class _RequireRecompute(L.Callback):
    """Fails the run (on every rank) when the engine recomputed nothing there."""

    def on_train_end(self, trainer, pl_module):
        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationOffload)]
        if cb.engine is None or cb.engine.stats.recompute_forwards == 0:
            raise AssertionError(f"rank {trainer.global_rank}: no forward recomputed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="ddp_fork ranks cannot use CUDA after the parent touched it")
def test_callback_under_ddp_matches_plain_ddp():
    # ddp_fork, as in test_activation_offload.py (a CPU test, skipped on CUDA machines there too); the pickle round trip stands for what ddp_spawn does.
    callbacks = [ActivationOffload(policy=1, recompute="selective", **CPU), _RequireRecompute()]
    callbacks = pickle.loads(pickle.dumps(callbacks))
    kw = dict(devices=2, strategy="ddp_fork", steps=2)
    plain, _ = _fit([], **kw)
    model, _ = _fit(callbacks, **kw)
    assert _equal(list(model.parameters()), list(plain.parameters()))


class _MutatingBlock(torch.nn.Module):
    """Modifies a matmul output in place after computing it: selective checkpointing must refuse its cache."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        y = x @ self.w
        y.mul_(2)
        return torch.sin(y)


@pytest.mark.parametrize("budgets", [(0, 0), (None, None)])
def test_a_cache_entry_modified_in_place_is_still_refused(budgets):
    """Kept or offloaded, a cached matmul output changed in place inside the block raises as torch's own selective
    checkpointing does, instead of recomputing from the changed values."""
    from lightning_gh.activation_offload.policy import OffloadPlan

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_MutatingBlock(), _MutatingBlock()])
    off = offload_activations(model, 0, recompute="selective", blocks="layers", **CPU)
    off._resolve()
    off._adopt(OffloadPlan("budget", budgets, (1, 2), (1, 2), modes=("selective",) * 2))
    x = torch.randn(32, 64, requires_grad=True)  # 8 KiB matmul outputs: above the engine's smallest offload
    with off:
        out = model.layers[1](model.layers[0](x)).sum()
    assert off.stats.offloaded_bytes == (0 if budgets[0] == 0 else 2 * 32 * 64 * 4)  # the inputs only: the modified cache stays with torch
    with pytest.raises(RuntimeError, match="mutated"):
        out.backward()


@pytest.mark.parametrize(("policy", "mode"), [(0, None), ("all", None), (1, "selective"), (0, "full")])
def test_a_forward_dropped_without_backward_frees_what_it_saved(policy, mode):
    """A training_step that returns None (or raises) drops its graph without a backward: the engine's saved bytes
    and pinned buffers come back (a kept tensor saved by the node that made it would otherwise form a cycle)."""
    model, cfg = _llama()
    tokens, targets = _batch(cfg)
    off = offload_activations(model, policy, recompute=mode, **CPU)
    for _ in range(3):
        with off, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        # something is held until the graph goes, where the engine tracks it (policy=0 keeps every block: untracked,
        # Note [A kept block's saved tensors go untracked], held by the graph alone)
        assert off._saved_bytes > 0 or policy in ("all", 0)
        del loss
        assert off._saved_bytes == 0 and (off._pool is None or off._pool.in_use_bytes == 0)
    loss0, grads0 = _step(model, (tokens, targets))
    loss, grads = _step(model, (tokens, targets), off)  # and a step with its backward after it is unchanged
    assert torch.equal(loss, loss0) and _equal(grads, grads0)
