"""Activation memory by budget: parsing, the planner, the engine's measure/plan/correct loop, HF models.

On the CPU the engine runs in ``backend="host-copy"`` mode and counts the saved bytes it tracks as the activation
memory; recomputing (norms, rotary, SiLU, full blocks) replays the same deterministic CPU kernels, so losses must be
bitwise those of the plain run in fp32 with a plan that mixes recompute and offload.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from lightning_gh.activation_offload import ActivationOffload, ActivationOffloadOptions, offload_activations
from lightning_gh.activation_offload.budget import (
    BudgetProfile,
    ModeCost,
    compiler_budget,
    parse_budget,
    plan_budget,
    plan_floor,
)
from lightning_gh.activation_offload.controller import Kind, Measure
from lightning_gh.activation_offload.policy import BlockProfile, StepProfile

GIB = 2**30
MIB = 2**20

# ------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("value, nbytes", [("6GiB", 6 * GIB), ("512MiB", 512 * MIB), ("6GB", 6 * 10**9),
                                           ("1.5 gib", int(1.5 * GIB)), (123456, 123456)])
def test_parse_sizes(value, nbytes):
    assert parse_budget(value).bytes == nbytes and parse_budget(value).fraction is None


def test_parse_fraction():
    assert parse_budget(0.5).fraction == 0.5 and parse_budget(1.0).fraction == 1.0


@pytest.mark.parametrize("value", ["6 parsecs", "GiB", "-1GiB", "0MiB", 0, -5, True, 1.5, 0.0, float("nan"), [1]])
def test_parse_errors_name_value_and_forms(value):
    with pytest.raises(ValueError, match="budget=") as e:
        parse_budget(value)
    assert "(0, 1]" in str(e.value)


def test_options_budget_validation():
    assert ActivationOffloadOptions(budget="6GiB").budget == "6GiB"
    with pytest.raises(ValueError, match="budget=2.0"):
        ActivationOffloadOptions(budget=2.0)
    with pytest.raises(ValueError, match="cannot be combined with policy='all'"):
        ActivationOffloadOptions(budget=0.5, policy="all")
    with pytest.raises(ValueError, match="recompute='full'"):
        ActivationOffload(budget=0.5, recompute="full")
    assert ActivationOffloadOptions(budget="6GiB", budget_offload=False).budget_offload is False
    with pytest.raises(ValueError, match="budget_offload=False decides whether a budget's plan may offload; there is "
                                         "no budget"):
        ActivationOffloadOptions(budget_offload=False)
    with pytest.raises(ValueError, match="budget_offload='no' is not valid; use None .* True, 'last' or False"):
        ActivationOffload(budget="6GiB", budget_offload="no")
    with pytest.raises(TypeError, match="budget_offload"):
        ActivationOffloadOptions(budget="6GiB", budget_offload=1.0)


# ------------------------------------------------------------------------------------------ planner


def _profile(n=8, link_heavy=True, overhead=0):
    step = StepProfile(tuple(BlockProfile(3.0, 6.0, GIB, GIB // 10) for _ in range(n)), 2.0, 4.0, 3 * GIB // 2)
    costs = tuple({"norm-act": ModeCost(int(0.8 * GIB), int(0.7 * GIB), 0.3),
                   "selective": ModeCost(int(0.55 * GIB), 60 * MIB, 0.6),
                   "full": ModeCost(60 * MIB, 60 * MIB, 3.0)} for _ in range(n))
    return BudgetProfile(step, costs, overhead)


def _plain(bp):
    return plan_budget(bp, 2**62, 50.0, 50.0)[1]


@pytest.mark.parametrize("frac", [0.3, 0.5, 0.7, 0.9])
def test_plan_fits_and_is_not_slower_than_full_checkpointing(frac):
    bp = _profile()
    plain = _plain(bp)
    budget = int(frac * plain.activation_bytes)
    floor = plan_floor(bp, 50.0, 50.0)
    if budget < floor.activation_bytes:
        pytest.skip("below this synthetic model's floor")
    plan, fc = plan_budget(bp, budget, 50.0, 50.0)
    assert fc.activation_bytes <= budget
    assert fc.activation_bytes >= 0.8 * budget  # gives back what it does not need
    full = plan_budget(BudgetProfile(bp.step, tuple({"full": c["full"]} for c in bp.costs)), budget, 50.0, 50.0)[1]
    assert fc.step_ms <= full.step_ms + 1e-9
    assert plan.policy == "budget" and plan.n_blocks == 8


def _deep_profile(n=20):
    """A deep model's blocks at a 7B job's proportions: keeping a block costs more than a step's worth of link time,
    selective recompute keeps half of it (all offloadable) for a third of full recompute's extra time."""
    plain = BlockProfile(16.0, 32.0, int(3.07 * GIB), int(0.4 * GIB))
    costs = {None: ModeCost(int(3.47 * GIB), int(3.07 * GIB), 0.0),
             "norm-act": ModeCost(int(2.97 * GIB), int(2.57 * GIB), 1.3),
             "selective": ModeCost(int(1.56 * GIB), int(1.56 * GIB), 4.3),
             "full": ModeCost(128 * MIB, 128 * MIB, 12.9)}
    return BudgetProfile(StepProfile((plain,) * n, 20.0, 40.0, 2 * GIB), (costs,) * n)


@pytest.mark.parametrize("above_floor_gib", [1.5, 3.0, 5.0])
def test_a_budget_near_the_floor_is_climbed_to_from_the_floor(above_floor_gib):
    """Near the floor, descending from keeping everything takes many one-block moves that leave the peak where it
    was (and may end on the floor's mix); the planner climbs from the floor instead, and from the floor's modes
    with nothing offloaded, where the link is free for the blocks that then offload more."""
    bp = _deep_profile()
    floor = plan_floor(bp, 55.0, 55.0, 0.25)
    budget = int(floor.activation_bytes + above_floor_gib * GIB)
    plan, fc = plan_budget(bp, budget, 55.0, 55.0, 0.25)
    assert fc.activation_bytes <= budget
    assert fc.step_ms <= floor.step_ms - 8.0, (fc, floor)  # at least one block selective instead of full
    assert any(m == "selective" for m, _ in fc.choices), fc.describe_choices()
    wider = plan_budget(bp, budget + GIB, 55.0, 55.0, 0.25)[1]
    assert wider.step_ms <= fc.step_ms + 1e-9  # more memory never plans slower


@pytest.mark.parametrize("share", [0.1, 0.25, 0.4])
def test_a_budget_below_the_midpoint_plans_faster_than_the_floor(share):
    """On this profile the descent from keeping everything ends on the floor's mix for budgets below the midpoint
    between the floor and the plain step; the climb from the floor finds a faster mix that fits."""
    bp = _profile()
    floor, plain = plan_floor(bp, 50.0, 50.0), _plain(bp)
    budget = int(floor.activation_bytes + share * (plain.activation_bytes - floor.activation_bytes))
    fc = plan_budget(bp, budget, 50.0, 50.0)[1]
    assert fc.activation_bytes <= budget and fc.step_ms < floor.step_ms - 1.0, (fc.step_ms, floor.step_ms)


def test_plan_prefers_offload_on_a_fast_link():
    bp = _profile()
    budget = int(0.6 * _plain(bp).activation_bytes)
    slow = plan_budget(bp, budget, 50.0, 50.0)[1]
    fast = plan_budget(bp, budget, 450.0, 450.0)[1]
    assert fast.step_ms <= slow.step_ms
    assert sum(f for _, f in fast.choices) >= sum(f for _, f in slow.choices)


@pytest.mark.parametrize("share, offloads", [(0.9, False), (0.5, False), (0.2, False), (-0.5, True)])
def test_offload_last_offloads_only_below_what_recompute_alone_reaches(share, offloads):
    """offload_last: the plan without offload wherever one fits (the link-heavy profile's fastest plans offload);
    below recompute's own floor, offload as well, and the plan still fits."""
    bp = _deep_profile()
    kept = plan_floor(bp, 55.0, 55.0, 0.25, skip_last_blocks=bp.step.n_blocks)  # full recompute, nothing offloaded
    floor = plan_floor(bp, 55.0, 55.0, 0.25)
    top = _plain(bp).activation_bytes
    budget = int(kept.activation_bytes + share * ((top if share > 0 else kept.activation_bytes)
                                                   - (kept.activation_bytes if share > 0 else floor.activation_bytes)))
    free = plan_budget(bp, budget, 55.0, 55.0, 0.25)
    plan, fc = plan_budget(bp, budget, 55.0, 55.0, 0.25, offload_last=True)
    assert fc.activation_bytes <= budget
    assert bool(plan.offloaded_blocks) is offloads, fc.describe_choices()
    assert fc.step_ms >= free[1].step_ms - 1e-9  # never faster than offloading freely
    moved = lambda f: sum(frac * bp.costs[i][m].offloadable_bytes for i, (m, frac) in enumerate(f.choices))  # noqa
    if offloads:  # below recompute's floor: the least offload that fits, far less than the free plan moves
        assert moved(fc) < 0.75 * moved(free[1]), (fc.describe_choices(), free[1].describe_choices())
    # one byte below recompute's own floor: one block's input, half of it
    _, near = plan_budget(bp, kept.activation_bytes - 1, 55.0, 55.0, 0.25, offload_last=True)
    assert near.activation_bytes < kept.activation_bytes and 0 < moved(near) <= 128 * MIB, near.describe_choices()


def test_impossible_budget_names_the_floor():
    bp = _profile()
    floor = plan_floor(bp, 50.0, 50.0)
    with pytest.raises(ValueError, match=rf"floor of full recompute plus offload, {floor.activation_bytes / GIB:.2f} GiB "):
        plan_budget(bp, floor.activation_bytes - MIB, 50.0, 50.0)


def test_budget_above_need_keeps_everything():
    bp = _profile()
    plan, fc = plan_budget(bp, 100 * GIB, 50.0, 50.0)
    assert not plan.offloaded_blocks and not plan.recompute and fc.ratio == 1.0


def test_overhead_shifts_the_plan():
    bp = _profile()
    budget = int(0.6 * _plain(bp).activation_bytes)
    a = plan_budget(bp, budget, 50.0, 50.0)[1]
    b = plan_budget(bp.with_overhead(GIB), budget, 50.0, 50.0)[1]
    assert b.activation_bytes <= budget and b.step_ms >= a.step_ms


def test_compiler_budget_decision():
    assert compiler_budget(1.0) == 1.0
    assert compiler_budget(0.5) == 0.5
    assert compiler_budget(0.5, overhead_fraction=0.2) == pytest.approx(0.375)
    assert compiler_budget(0.1, overhead_fraction=0.2) == 0.0  # below what the knob reaches: its minimum
    with pytest.raises(ValueError, match="fraction=0"):
        compiler_budget(0)


# ------------------------------------------------------------------------------------- HF decoders

transformers = pytest.importorskip("transformers")


def _hf(kind="llama", seed=0, layers=3):
    cfgs = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
    cfg_cls, model_cls = cfgs[kind]
    torch.manual_seed(seed)
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return model_cls(cfg)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_find_blocks_takes_hf_decoder_layers(kind):
    from lightning_gh.activation_offload import find_blocks

    model = _hf(kind)
    name, blocks = find_blocks(model)
    assert name == "model.layers" and len(blocks) == 3


class HFModule(L.LightningModule):
    def __init__(self, kind="llama", seed=0, layers=3, model=None):
        super().__init__()
        self.model = model if model is not None else _hf(kind, seed, layers)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(torch.randint(0, 128, (n, 24), generator=g), batch_size=2)


def _fit(module, callbacks, steps=9):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, deterministic=True)
    trainer.fit(module, _data())
    return torch.stack(module.losses)


def test_hf_budget_plan_mixes_recompute_and_offload_losses_bitwise():
    plain = _fit(HFModule(), [])
    # A fast link (as on a GH200): offload is cheap, but the last block is never offloaded, so a low budget needs
    # recompute there too.
    cb = ActivationOffload(budget=0.3, backend="host-copy", min_tensor_bytes=1, profile_steps=1, bandwidth_gbps=1000.0)
    ours = _fit(HFModule(), [cb])
    e, b = cb.engine, cb.engine.budget
    assert b.forecast is not None and b.achieved_bytes is not None
    modes = {e.plan.mode_of(i) for i in range(3)}
    assert e.plan.offloaded_blocks and (modes - {None}), e.plan.describe()  # offload and recompute both used
    assert b.achieved_bytes <= b.budget_bytes * 1.05  # the goal: within 5%
    assert torch.equal(plain, ours), (plain - ours).abs().max()


def test_hf_budget_beside_superoffload_recomputes_only_losses_bitwise(caplog):
    """SuperOffload updates on the host CPU: where recomputing reaches the budget, the plan offloads nothing (the
    host's memory is the update's), trains bitwise as SuperOffload alone, and says so in one line; with
    budget_offload=True it offloads where that is fastest."""
    from lightning_gh import SuperOffloadStrategy

    def fit(callbacks):
        module = HFModule()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=9, precision="32-true", logger=False,
                            strategy=SuperOffloadStrategy(gpu_fraction=0.0), enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                            deterministic=True)
        trainer.fit(module, _data())
        assert trainer.optimizers[0].updates_on_host
        return torch.stack(module.losses)

    plain = fit([])
    cb = ActivationOffload(budget=0.5, backend="host-copy", min_tensor_bytes=1, profile_steps=1,
                           bandwidth_gbps=1000.0)
    with caplog.at_level(logging.INFO):
        ours = fit([cb])
    e, b = cb.engine, cb.engine.budget
    assert cb.options.budget_offload is None and e.options.budget_offload == "last"
    assert b.forecast is not None and b.achieved_bytes <= b.budget_bytes * 1.05
    assert not e.plan.offloaded_blocks and e.plan.recompute, e.plan.describe()
    assert sum("the plan offloads only what recomputing cannot fit (budget_offload='last'), since "
               "HeterogeneousAdamW updates parameters on the host CPU" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(plain, ours), (plain - ours).abs().max()
    # offload allowed: on this fast link a lower budget's plan offloads (as without SuperOffload, above)
    cb = ActivationOffload(budget=0.3, backend="host-copy", min_tensor_bytes=1, profile_steps=1,
                           bandwidth_gbps=1000.0, budget_offload=True)
    assert torch.equal(plain, fit([cb]))
    assert cb.engine.options.budget_offload is True and cb.engine.plan.offloaded_blocks, cb.engine.plan.describe()


def test_hf_budget_on_blocks_compiled_in_place_offloads_around_their_compiled_calls():
    """The fp8 plugins compile each decoder layer in place: the budget plans with the engine (offload, full
    recompute around the compiled call, the lean loss) instead of handing the compiler its knob; the modes that
    reach inside a block (selective, norm-act) are left out."""
    def compiled():
        module = HFModule()
        for layer in module.model.model.layers:
            layer.compile(backend="aot_eager")
        return module

    plain = _fit(compiled(), [])
    cb = ActivationOffload(budget=0.4, backend="host-copy", min_tensor_bytes=1, profile_steps=1, bandwidth_gbps=1000.0)
    ours = _fit(compiled(), [cb])
    e, b = cb.engine, cb.engine.budget
    assert e.plan.policy == "budget" and e.plan.recompute, e.plan.describe()
    assert {e.plan.mode_of(i) for i in e.plan.recompute} == {"full"} and set(e._rcs) == {"full"}
    assert b.achieved_bytes is not None and b.achieved_bytes <= b.budget_bytes * 1.05
    assert e.stats.offloaded_tensors > 0
    torch.testing.assert_close(plain, ours, rtol=1e-6, atol=0)


def test_hf_budget_plain_offload_activations_loop():
    module = HFModule()
    model = module.model
    off = offload_activations(model, budget=0.6, backend="host-copy", min_tensor_bytes=1, profile_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in list(_data(18)):  # warm-up, raw, plain, lean loss, three recompute modes, plan, correction
        with off:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        off.end_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    b = off.budget
    assert off.plan.policy == "budget" and b.forecast.activation_bytes <= b.budget_bytes
    assert b.budget_bytes == int(0.6 * b.plain_activation_bytes) and b.achieved_bytes is not None


def test_hf_budget_above_need_is_a_noop(caplog):
    cb = ActivationOffload(budget="64GiB", backend="host-copy", min_tensor_bytes=1, profile_steps=1)
    with caplog.at_level(logging.INFO):
        _fit(HFModule(), [cb], steps=14)  # a size budget: floor, samples, then one block relaxed per step
    assert not cb.plan.offloaded_blocks and not cb.plan.recompute
    assert "nothing to do" in cb.plan.describe()


def test_hf_impossible_size_budget_is_refused_after_the_warmup_step():
    """What the step saves outside the blocks stays under every plan: a size budget below it is certain to fail, and
    is refused at the first step after the warm-up, before any measuring step, naming that bound."""
    module = HFModule()
    cb = ActivationOffload(budget="1KiB", backend="host-copy", min_tensor_bytes=1, profile_steps=1)
    with pytest.raises(ValueError, match=r"budget='1KiB': 1.0 KiB of activation memory is below the floor of full "
                                         r"recompute plus offload, which is at least [0-9.]+ [KMG]iB") as e:
        _fit(module, [cb], steps=8)
    assert "Checked after 1 step(s)" in str(e.value)
    assert len(module.losses) == 1  # only the warm-up step ran
    assert cb.engine.budget.outside_bytes > 1024


def test_hf_impossible_fraction_names_the_exact_floor_before_any_planned_step():
    module = HFModule()
    cb = ActivationOffload(budget=0.01, backend="host-copy", min_tensor_bytes=1, profile_steps=1)
    with pytest.raises(ValueError, match=r"budget=0.01 \(1% of the plain step's activation memory; the plain step "
                                         r"measured [0-9.]+ [KMG]iB\).*below the floor of full recompute plus "
                                         r"offload, [0-9.]+ [KMG]iB") as e:
        _fit(module, [cb], steps=12)
    b = cb.engine.budget
    n_measuring = len(b.schedule)  # warm-up, raw, plain, lean loss, one per recompute mode
    assert f"Checked after the {n_measuring} measuring steps" in str(e.value)
    assert len(module.losses) == n_measuring and b.forecast is None


def test_fraction_is_of_the_plain_step_without_engine_effects():
    """Under bf16 autocast the engine's own measuring step keeps less than a plain run (it shares autocast's repeated
    casts and re-casts the weights in the backward); a fraction is a fraction of the plain run's memory."""
    module = HFModule()
    cb = ActivationOffload(budget=0.6, backend="host-copy", min_tensor_bytes=1, profile_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=9, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb])
    trainer.fit(module, _data())
    b = cb.engine.budget
    assert b.plain_activation_bytes > b.engine_plain_bytes > 0
    assert b.budget_bytes == int(0.6 * b.plain_activation_bytes)
    assert b.forecast.activation_bytes <= b.budget_bytes
    # The raw step's saved bytes are those of a plain autograd run: the same blocks under hooks that only count.
    (raw,) = b.observations(Measure(Kind.RAW))
    assert sum(raw.used) == 0 and sum(raw.resident) > 0


def test_hf_gradient_checkpointing_detected_and_taken_over():
    module = HFModule()
    module.model.gradient_checkpointing_enable()
    assert module.model.is_gradient_checkpointing
    cb = ActivationOffload(budget=0.5, backend="host-copy", min_tensor_bytes=1, profile_steps=1)
    with pytest.warns(UserWarning, match="Hugging Face gradient checkpointing was on"):
        _fit(module, [cb], steps=8)
    assert not module.model.is_gradient_checkpointing


def test_hf_gradient_checkpointing_with_recompute_is_an_error():
    model = _hf()
    model.gradient_checkpointing_enable()
    off = offload_activations(model, 0, recompute="full", backend="host-copy")
    with pytest.raises(ValueError, match="work twice"):
        _ = off.enabled


def test_compiled_model_sets_the_compilers_budget():
    import torch._functorch.config as fconfig

    model = _hf()
    before = fconfig.activation_memory_budget
    compiled = torch.compile(model)
    holder = torch.nn.Module()
    holder.inner = compiled
    off = offload_activations(holder, budget=0.5, backend="host-copy")
    assert off.enabled
    assert fconfig.activation_memory_budget == 0.5 and "activation_memory_budget" in off.plan.describe()
    off.close()
    assert fconfig.activation_memory_budget == before
    with pytest.raises(ValueError, match="pass a fraction"):
        _ = offload_activations(holder, budget="1GiB", backend="host-copy").enabled


@pytest.mark.parametrize("causal_sdpa", [True, False])
def test_compiled_budget_keeps_sdpas_causal_path_unless_told_not_to(causal_sdpa):
    """Budget mode on a compiled HF model keeps SDPA's causal path in its decoder (what transformers' explicit mask
    under torch.compile costs: docs/activation_offload.md); the compiled loss and gradients equal the eager run's."""
    import copy

    from lightning_gh import _hf as hf_helpers

    model = _hf(layers=2)  # two blocks to plan over; each layer more is more C++ for Inductor to compile
    if model.config._attn_implementation != "sdpa":
        pytest.skip("this transformers build picked another attention implementation")
    ref = copy.deepcopy(model)
    holder = torch.nn.Module()
    holder.inner = torch.compile(model)
    off = offload_activations(holder, budget=0.5, backend="host-copy", causal_sdpa=causal_sdpa)
    assert off.enabled
    assert (id(model.model.config) in hf_helpers._ACCEPTED) == causal_sdpa
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with off:
        loss = holder.inner(input_ids=x, labels=x).loss
    loss.backward()
    ref_loss = ref(input_ids=x, labels=x).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    off.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -2.0])
def test_a_float_budget_that_is_no_size_suggests_a_real_size(value):
    from lightning_gh.activation_offload.budget import parse_budget

    with pytest.raises(ValueError) as err:
        parse_budget(value)
    assert "nanGiB" not in str(err.value) and "infGiB" not in str(err.value) and "'-2GiB'" not in str(err.value)
    assert "'24GiB'" in str(err.value)


class _FixedProbe:
    """A CUDA-like probe whose measured step needs ``act`` bytes."""

    def __init__(self, act):
        self.act = act

    def start(self):
        return 0

    def peak(self, base):
        return self.act


@pytest.mark.parametrize("act_gib, knob", [(4.0, 0.5), (1.0, None)])
def test_a_size_budget_on_a_compiled_model_sets_the_knob_or_says_there_is_nothing_to_do(act_gib, knob):
    """A size on a compiled model: the third compiled call reads the second's activation memory; a budget below it
    becomes the compiler's fraction, one above it a plan that does nothing (either way the measuring ends in a plan
    the callback logs)."""
    from lightning_gh.activation_offload.controller import BudgetController, BudgetState

    plans = []
    ctl = BudgetController(ActivationOffloadOptions(budget="2GiB"), 4, lambda: (50.0, 50.0), plans.append,
                           _FixedProbe(int(act_gib * GIB)))
    ctl.start_compiled("model", on_cuda=True)
    try:
        for _ in range(3):
            ctl.compiled_forward("model")
        assert ctl.state is BudgetState.COMPILED and len(plans) == 1 and plans[0].policy == "budget-compiled"
        if knob is None:
            assert "2.00 GiB >= the compiled step's measured 1.00 GiB: nothing to do" in plans[0].notes[0]
        else:
            import torch._functorch.config as fc

            assert fc.activation_memory_budget == pytest.approx(knob)
    finally:
        ctl.close()
