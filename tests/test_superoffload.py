"""HeterogeneousAdamW on the CPU: the same math as clip_grad_norm_ + torch.optim.AdamW(fused=True), bitwise.

Tolerance: none. Every comparison below is `torch.equal`: the CPU worker runs torch's own fused CPU AdamW kernel
on the fp32 master weights with the clip coefficient clip_grad_norm_ computes, so parameters and both moments
match the reference bit for bit after every step (the reference clips over the parameters in param-group order,
as Lightning does, and skips a step whose gradient norm is not finite, as a GradScaler would).
"""

from __future__ import annotations

import shutil
import time
import warnings

import pytest
import torch
from torch import nn

from lightning_gh import hardware
from lightning_gh.superoffload import HeterogeneousAdamW, tail_mover
from lightning_gh.superoffload import memory as superoffload_memory
from lightning_gh.superoffload.layout import HostLayout
from lightning_gh.superoffload.tail_mover import tail_bytes

STEPS = 24
CLIP = 0.5
NONFINITE_STEP = 7


def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.LayerNorm(48), nn.Linear(48, 48), nn.GELU(),
                         nn.Linear(48, 4)).to(dtype)


def groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]


def batches(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    # every 4th step gets large inputs, so the clip triggers on some steps and not on others
    scale = 8.0 if step % 4 == 0 else 0.05
    return [torch.randn(8, 16, generator=g) * scale for _ in range(2)]


def inject_nonfinite(model: nn.Module):
    first = next(model.parameters())
    return first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def train_reference(steps: int = STEPS, clip: float | None = CLIP):
    """clip_grad_norm_ over param-group order + AdamW(fused=True), skipping non-finite steps."""
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    clipped = 0
    for step in range(steps):
        h = inject_nonfinite(model) if step == NONFINITE_STEP else None
        for x in batches(step):  # two micro-batches, gradients accumulate
            loss_fn(model, x).backward()
        if h is not None:
            h.remove()
        params = [p for g in opt.param_groups for p in g["params"]]
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(params, clip)
            clipped += bool(total > clip)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if torch.isfinite(total):
            opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, clipped


def backward_micro_batches(model, opt, step):
    """The two micro-batches of one step (the first accumulated), with the non-finite gradient on its step."""
    h = inject_nonfinite(model) if step == NONFINITE_STEP else None
    first, last = batches(step)
    with opt.accumulating():
        loss_fn(model, first).backward()
    loss_fn(model, last).backward()
    if h is not None:
        h.remove()


def offload_step(model, opt, sched, step):
    """One optimizer step of the offloaded run: the micro-batches, the update, the schedule."""
    backward_micro_batches(model, opt, step)
    opt.step()
    opt.zero_grad()
    sched.step()
    opt.synchronize()


def train_ours(steps: int = STEPS, clip: float | None = CLIP, model: nn.Module | None = None,
               opt: HeterogeneousAdamW | None = None, start: int = 0, force_speculation: bool = False, **kwargs):
    """Our optimizer on the same schedule. `force_speculation`: let the worker finish every bucket before
    step() posts the decision (whenever it speculates), so the rollback path runs deterministically."""
    model = model or make_model()
    kwargs.setdefault("bucket_size", 600)  # several buckets even for this small model
    opt = opt or HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=clip, module=model,
                                    **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s), last_epoch=start - 1) \
        if start == 0 else None
    for step in range(start, steps):
        if sched is None:
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] / (1 + 0.3 * step)
        backward_micro_batches(model, opt, step)
        if force_speculation and opt.updater.will_speculate:
            while not opt.updater.settled:  # the speculative updates ran; the others wait for the decision
                time.sleep(0.002)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if force_speculation:
            opt.synchronize()  # so whether the next step speculates is settled
    opt.synchronize()
    return model, opt


def assert_same(model_a: nn.Module, opt_a, model_b: nn.Module, opt_b) -> None:
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), (pa - pb).abs().max()
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][key].cpu().float(), sb[k][key].cpu().float()), (k, key)
        assert float(sa[k]["step"]) == float(sb[k]["step"])


HAVE_CC = shutil.which("gcc") is not None or shutil.which("cc") is not None


@pytest.mark.parametrize("speculative,rollback", [(True, "auto"), (True, "copy"), (False, "auto")])
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.4])
def test_matches_torch_adamw_bitwise(speculative, rollback, gpu_fraction):
    ref_model, ref_opt, clipped = train_reference()
    model, opt = train_ours(speculative=speculative, gpu_fraction=gpu_fraction, force_speculation=True,
                            rollback=rollback)
    # two-copy rollback runs only when speculative updates must be undoable, and needs a C compiler
    two_copies = speculative and rollback == "auto" and HAVE_CC
    assert (opt.layout.kernel is not None) == (rollback == "auto" and HAVE_CC)  # it then makes every CPU update
    assert opt.layout.two_copies == two_copies
    assert all((b.alt_master is not None) == two_copies for b in opt.layout.buckets)
    assert 0 < clipped < STEPS - 1  # the clip triggered on some steps only
    assert opt.stats["skipped_steps"] == 1  # the injected inf
    assert_same(ref_model, ref_opt, model, opt)
    # buckets updated once their step's decision was known went weights first (see worker's Note), with the kernel
    assert (opt.stats["writeback_ms"] > 0) == (opt.layout.kernel is not None)
    # the skipped step did not count: AdamW's bias correction uses the number of real updates
    assert float(next(iter(opt.state_dict()["state"].values()))["step"]) == STEPS - 1
    if speculative:
        # clipped and skipped steps rolled back; after each, one step waited for its decision
        assert opt.stats["speculative_buckets"] > opt.stats["rollbacks"] > 0
    else:
        assert opt.stats["speculative_buckets"] == 0
    if gpu_fraction:
        assert opt.device_numel > 0 and opt.host_numel > 0
    opt.close()


@pytest.mark.skipif(not HAVE_CC, reason="weights first needs the CPU AdamW kernel (a C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_first_equals_one_pass_bitwise(dtype):
    """weights_first (the default) against weights_first=False, every step clipped or skipped: the same weights,
    masters and moments; only the first wrote its state in a second pass (bf16 weights staged as bf16)."""
    runs = [train_ours(steps=8, clip=1e-3, model=make_model(dtype), speculative=False, weights_first=wf)
            for wf in (True, False)]
    (a_model, a_opt), (b_model, b_opt) = runs
    assert a_opt.stats["writeback_ms"] > 0 and b_opt.stats["writeback_ms"] == 0
    assert a_opt.stats["clipped_steps"] == 7
    assert_same(a_model, a_opt, b_model, b_opt)
    for k, st in a_opt.state_dict()["state"].items():
        if "master" in st:
            assert torch.equal(st["master"], b_opt.state_dict()["state"][k]["master"])
    for _, opt in runs:
        opt.close()


def _after_a_step_with_the_second_pass_held(monkeypatch):
    """An optimizer clipped on every step, one step taken, whose second passes (see worker's Note) wait for the
    returned gate (failing after 20 s)."""
    import threading

    from lightning_gh.superoffload.worker import CpuUpdater

    gate, real = threading.Event(), CpuUpdater._update

    def held(self, b, hp, coef):
        if not gate.wait(20):
            raise RuntimeError("the second pass was held for 20 s")
        return real(self, b, hp, coef)

    monkeypatch.setattr(CpuUpdater, "_update", held)
    model = make_model()
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, max_grad_norm=1e-3, module=model, speculative=False,
                             bucket_size=600)
    backward_micro_batches(model, opt, 0)
    opt.step()
    opt.zero_grad()
    return gate, model, opt


@pytest.mark.skipif(not HAVE_CC, reason="weights first needs the CPU AdamW kernel (a C compiler)")
def test_the_next_forward_runs_before_the_state_is_written(monkeypatch):
    """The next forward needs a bucket's weights only: it runs while every second pass is held, and the backward
    after it waits for them (a forward that waited would fail the held pass after its timeout)."""
    gate, model, opt = _after_a_step_with_the_second_pass_held(monkeypatch)
    first, last = batches(1)
    loss = loss_fn(model, last)  # the forward: every bucket's weights are in, no state is written yet
    pending = [b.index for b in opt.layout.buckets if not b.done.is_set()]
    gate.set()
    loss.backward()
    opt.step()
    opt.synchronize()
    assert pending == [b.index for b in opt.layout.buckets] and len(pending) > 1
    assert opt.stats["writeback_ms"] > 0
    opt.close()


@pytest.mark.skipif(not HAVE_CC, reason="weights first needs the CPU AdamW kernel (a C compiler)")
def test_the_next_backward_waits_for_the_state_and_an_unvalidated_step_takes_one_pass(monkeypatch):
    """A bucket's next gradient copy waits for its second pass (held here: the backward does not finish and the
    bucket's host gradients stay those the pass reads); a step with neither clipping nor the non-finite check
    updates during backward in one pass."""
    import threading

    gate, model, opt = _after_a_step_with_the_second_pass_held(monkeypatch)
    grads = [b.grad_buf.tensor.clone() for b in opt.layout.buckets]
    loss = loss_fn(model, batches(1)[1])
    done = threading.Event()
    backward = threading.Thread(target=lambda: (loss.backward(), done.set()), daemon=True)
    backward.start()
    assert not done.wait(0.5)  # blocked at the first bucket's gradient: its state is not written yet
    assert all(torch.equal(g, b.grad_buf.tensor) for g, b in zip(grads, opt.layout.buckets))
    gate.set()
    assert done.wait(20)
    opt.step()
    opt.close()
    monkeypatch.undo()  # the second pass no longer held
    _, plain = train_ours(steps=3, clip=None, skip_nonfinite=False)
    assert plain.stats["writeback_ms"] == 0
    plain.close()


def test_speculative_equals_non_speculative_and_no_clip_path():
    a_model, a_opt = train_ours(speculative=True, force_speculation=True)
    b_model, b_opt = train_ours(speculative=False)
    assert_same(a_model, a_opt, b_model, b_opt)
    # without clipping, speculation is committed except on the non-finite step
    ref_model, ref_opt, _ = train_reference(clip=None)
    c_model, c_opt = train_ours(clip=None)
    assert_same(ref_model, ref_opt, c_model, c_opt)
    assert c_opt.stats["clipped_steps"] == 0 and c_opt.stats["skipped_steps"] == 1
    for o in (a_opt, b_opt, c_opt):
        o.close()


def test_learning_rate_changed_after_backward_is_applied_exactly():
    torch.manual_seed(0)
    results = []
    for kind in ("ref", "ours"):
        model = make_model()
        opt = (torch.optim.AdamW(groups(model), lr=1e-2, fused=True) if kind == "ref" else
               HeterogeneousAdamW(groups(model), lr=1e-2, module=model, bucket_size=600))
        for step in range(5):
            loss_fn(model, batches(step)[0]).backward()
            if kind == "ours" and step == 0:
                # let the worker finish its speculative updates before the LR changes (deterministic test);
                # after that redo the optimizer stops speculating, so later steps wait for step() anyway
                opt.updater.join()
            for g in opt.param_groups:  # after backward: the speculative CPU update used the old value
                g["lr"] = 1e-2 * (step + 2)
            opt.step()
            opt.zero_grad()
        if kind == "ours":
            opt.synchronize()
            # step 0 speculated with the old LR and was redone; after a redo the next steps wait for step()
            assert opt.stats["rollbacks"] > 0 and opt.stats["speculative_buckets"] == opt.stats["rollbacks"]
            opt.close()
        results.append(model)
    for pa, pb in zip(results[0].parameters(), results[1].parameters()):
        assert torch.equal(pa, pb)


def test_checkpoint_resume_and_torch_adamw_round_trip():
    full_model, full_opt = train_ours(steps=14)
    # resume: 6 steps, save, rebuild everything, load, continue to 14
    model, opt = train_ours(steps=6)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    opt.close()
    model2 = make_model()
    model2.load_state_dict(model_state)
    opt2 = HeterogeneousAdamW(groups(model2), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model2,
                              bucket_size=600)
    opt2.load_state_dict(opt_state)
    model2, opt2 = train_ours(steps=14, model=model2, opt=opt2, start=6)
    assert_same(full_model, full_opt, model2, opt2)

    # into torch.optim.AdamW and back: the state is AdamW's format
    torch_opt = torch.optim.AdamW(groups(model2), lr=1e-2, betas=(0.9, 0.95), fused=True)
    torch_opt.load_state_dict(opt2.state_dict())
    back = HeterogeneousAdamW(groups(model2), lr=1e-2, betas=(0.9, 0.95), module=model2)
    back.load_state_dict(torch_opt.state_dict())
    assert_same(model2, opt2, model2, back)
    assert back.param_groups[1]["lr"] == opt2.param_groups[1]["lr"]
    for o in (full_opt, opt2, back):
        o.close()


def test_lazy_layout_without_module_and_unused_parameter():
    """Without `module` the first step records the gradient order and lays out the buckets; a parameter that
    gets no gradient is skipped like torch does (no state, no step count)."""
    model = make_model()
    unused = nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [unused]
    ref_model = make_model()
    ref_unused = nn.Parameter(torch.ones(3))
    ref = torch.optim.AdamW(list(ref_model.parameters()) + [ref_unused], lr=1e-2, fused=True)
    opt = HeterogeneousAdamW(params, lr=1e-2, skip_nonfinite=False, bucket_size=500)
    assert opt.host_numel == 0  # nothing allocated before the first step
    for step in range(4):
        for m, o in ((ref_model, ref), (model, opt)):
            loss_fn(m, batches(step)[0]).backward()
            o.step()
            o.zero_grad()
        if step == 0:
            assert opt.host_numel > 0
    opt.synchronize()
    for pa, pb in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(pa, pb)
    assert torch.equal(unused, torch.ones(3))
    state = opt.state_dict()["state"]
    assert float(state[len(params) - 1]["step"]) == 0.0
    opt.close()


def test_bf16_parameters_keep_fp32_master():
    """bf16 weights: the fp32 master on the host follows AdamW in fp32, the bf16 weights are its rounding."""
    model = make_model(torch.bfloat16)
    master_ref = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.AdamW(master_ref, lr=1e-2, fused=True)
    opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, module=model, skip_nonfinite=False, bucket_size=700,
                             gpu_fraction=0.3)
    for step in range(6):
        loss_fn(model, batches(step)[0]).backward()
        for m, p in zip(master_ref, model.parameters()):
            m.grad = p.grad.float()
        ref.step()
        ref.zero_grad()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    state = opt.state_dict()["state"]
    for i, (m, p) in enumerate(zip(master_ref, model.parameters())):
        assert torch.equal(state[i]["master"], m.detach())
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    opt.close()


@pytest.mark.skipif(not HAVE_CC, reason="our CPU kernel needs a C compiler")
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.4])
def test_bf16_gradients_on_the_host_equal_the_fp32_path(gpu_fraction):
    """bf16 parameters with our kernel: gradients land on the host in bf16 and every update (speculative into the
    other copy, decided in place, redone after a clip or skip) equals torch's fused AdamW on their fp32 copies,
    i.e. the ``rollback="copy"`` run, bitwise."""
    ref_model, ref_opt = train_ours(model=make_model(torch.bfloat16), rollback="copy", gpu_fraction=gpu_fraction,
                                    force_speculation=True)
    model, opt = train_ours(model=make_model(torch.bfloat16), rollback="auto", gpu_fraction=gpu_fraction,
                            force_speculation=True)
    assert opt.layout.kernel is not None and opt.layout.two_copies
    assert opt.layout.buckets and all(b.grad_buf.tensor.dtype == torch.bfloat16 for b in opt.layout.buckets)
    assert all(b.grad_buf.tensor.dtype == torch.float32 for b in ref_opt.layout.buckets)
    assert opt.stats["rollbacks"] > 0 and opt.stats["skipped_steps"] == 1 and opt.stats["clipped_steps"] > 0
    assert_same(ref_model, ref_opt, model, opt)
    sa, sb = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert all(torch.equal(sa[k]["master"], sb[k]["master"]) for k in sa)
    # decided (in-place) updates ran too: not every bucket of every step was speculative
    assert opt.stats["speculative_buckets"] < (STEPS - 1) * len(opt.layout.buckets)
    ref_opt.close()
    opt.close()


def test_fp32_parameters_keep_fp32_host_gradients():
    model, opt = train_ours(steps=2)
    assert all(b.grad_buf.tensor.dtype == torch.float32 for b in opt.layout.buckets)
    opt.close()


def test_value_clipping_matches_clip_grad_value():
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, max_grad_value=0.01, module=model, bucket_size=600)
    for step in range(5):
        for m in (ref_model, model):
            loss_fn(m, batches(step)[0]).backward()
        torch.nn.utils.clip_grad_value_(ref_model.parameters(), 0.01)
        ref.step()
        ref.zero_grad()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    for pa, pb in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(pa, pb)
    opt.close()


def test_gradient_arriving_twice_without_step_is_an_error():
    model = make_model()
    opt = HeterogeneousAdamW(model.parameters(), module=model)
    loss_fn(model, batches(0)[0]).backward()
    with pytest.raises(RuntimeError, match="accumulating"):
        loss_fn(model, batches(1)[0]).backward()
    opt.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (0.9, 1.0)}, "betas="),
        ({"gpu_fraction": 1.5}, "gpu_fraction=1.5"),
        ({"gpu_fraction": "half"}, "gpu_fraction='half'"),
        ({"max_grad_norm": 0.0}, "max_grad_norm=0.0"),
        ({"cpu_threads": 0}, "cpu_threads=0"),
        ({"bucket_size": 0}, "bucket_size=0"),
        ({"pipeline_trigger": "always"}, "pipeline_trigger='always'"),
        ({"max_gpu_fraction": 1.5}, "max_gpu_fraction=1.5"),
    ],
)
def test_argument_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeterogeneousAdamW(make_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": "0.1"}, r"HeterogeneousAdamW\(lr='0.1'\): expected a float, got str"),
        ({"betas": "0.9"}, r"HeterogeneousAdamW\(betas='0.9'\): expected a \(float, float\) tuple, got str"),
        ({"betas": (0.9, True)}, r"betas=\(0.9, True\)\): expected a \(float, float\) tuple"),
        ({"weight_decay": True}, r"weight_decay=True\): expected a float, got bool"),
        ({"max_grad_norm": "1"}, r"max_grad_norm='1'\): expected a float or None, got str"),
        ({"pipeline_trigger": 1}, r"pipeline_trigger=1\): expected a string, got int"),
        ({"max_gpu_fraction": "auto"}, r"SuperOffloadOptions\(max_gpu_fraction='auto'\): expected a float or None"),
        ({"bucket_size": 2.5}, r"bucket_size=2.5\): expected an int, got float"),
        ({"skip_nonfinite": 0}, r"skip_nonfinite=0\): expected True or False, got int"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        HeterogeneousAdamW(make_model().parameters(), **kwargs)


def test_unsupported_options_and_dtypes():
    with pytest.raises(ValueError, match="amsgrad"):
        HeterogeneousAdamW([{"params": list(make_model().parameters()), "amsgrad": True}])
    with pytest.raises(ValueError, match="float64"):
        HeterogeneousAdamW([nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match="torch.optim.AdamW"):
        HeterogeneousAdamW.from_optimizer(torch.optim.SGD(make_model().parameters(), lr=0.1))


def test_host_memory_guard_names_the_numbers(monkeypatch):
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 10_000)
    with pytest.raises(MemoryError, match=r"offloaded parameters x 28 B .* available: 9.8 KiB"):
        HeterogeneousAdamW(make_model().parameters(), max_grad_norm=1.0, speculative=True)
    # speculative="auto" (the default) drops the speculation backup where it does not fit: 16 B per parameter
    with pytest.raises(MemoryError, match=r"x 16 B \(master/moments/gradient\) ="):
        HeterogeneousAdamW(make_model().parameters(), max_grad_norm=1.0)
    # without validation there is no speculation backup either
    with pytest.raises(MemoryError, match=r"x 16 B"):
        HeterogeneousAdamW(make_model().parameters(), skip_nonfinite=False, speculative=True)
    HeterogeneousAdamW(make_model().parameters(), host_memory_check=False).close()


def test_host_memory_reading():
    avail = superoffload_memory.available_host_bytes()
    assert avail is None or avail > 0
    plan = superoffload_memory.HostMemoryPlan(1_000_000, True, avail)
    assert plan.needed_bytes == 28_000_000 and "GiB" in plan.describe()
    assert superoffload_memory.host_bytes_per_param(False) == 16


def test_stats_report_where_state_lives():
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    opt = HeterogeneousAdamW(model.parameters(), module=model, gpu_fraction=0.5, bucket_size=300)
    assert opt.host_numel + opt.device_numel == n
    # whole parameters from the last-arriving end (the first layers) until at least half is on the "GPU"
    assert 0.5 <= opt.device_numel / n < 1.0
    first = next(model.parameters())
    assert opt.layout.slot_of[id(first)].residency == "device"
    assert opt.layout.slot_of[id(list(model.parameters())[-1])].residency == "host"
    opt.close()


def test_stats_report_the_last_global_gradient_norm():
    model = make_model()
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, max_grad_norm=CLIP, module=model, bucket_size=600)
    loss_fn(model, batches(0)[0]).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]])
    opt.step()
    opt.synchronize()
    assert opt.stats["last_grad_norm"] == float(expected)
    assert opt.stats["clipped_steps"] == int(float(expected) > CLIP)
    opt.close()


def test_moving_buckets_between_host_and_gpu_tail_keeps_the_math():
    """The auto tail moves buckets between host and GPU residency mid-run (on CUDA, from measured stalls); the
    state must travel intact. Driven by hand here: the run still equals the reference bitwise."""
    ref_model, ref_opt, _ = train_reference(steps=14)
    model = make_model()
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model,
                             bucket_size=600, gpu_fraction=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    n_buckets = len(opt.layout.buckets)
    for step in range(14):
        if step == 4:
            opt.layout.to_device(opt.layout.buckets[-1])
            opt.layout.to_device(opt.layout.buckets[-1])
            assert len(opt.layout.buckets) == n_buckets - 2 and opt.device_numel > 0
        if step == 9:
            device = opt.layout.device_slots()
            opt.layout.to_host(device[: len(device) // 2])
        offload_step(model, opt, sched, step)
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def test_auto_tail_growth_is_bounded_by_free_gpu_memory_and_survives_oom(monkeypatch):
    """The auto tail grows only into free GPU memory minus the headroom, and a move that runs out of memory leaves
    the bucket on the host. The memory query is replaced to simulate a small GPU; the run still equals the
    reference bitwise, so state that stayed, moved or failed to move is intact."""
    ref_model, ref_opt, _ = train_reference(steps=12)
    model = make_model()
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model,
                             bucket_size=600)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    headroom = tail_mover.TAIL_HEADROOM_MIN_BYTES
    n_buckets = len(opt.layout.buckets)
    for step in range(12):
        if step == 3:  # room for exactly the last bucket beyond the 1 GiB headroom
            one = tail_bytes(opt.layout.buckets[-1].slots)
            monkeypatch.setattr(superoffload_memory, "device_memory_room", lambda dev: (headroom + one + 1, 2**30))  # noqa: B023
            assert opt.tail.grow(float("inf")) == 1
            assert len(opt.layout.buckets) == n_buckets - 1 and opt.device_numel > 0
            assert opt.stats["tail_limited"] == 1
            assert "of GPU memory and only" in opt.stats["tail_limit_detail"]
            assert opt.tail.limit.startswith("limited by GPU memory")
        if step == 6:  # plenty of memory, but the allocator fails on the second parameter of the bucket
            monkeypatch.setattr(superoffload_memory, "device_memory_room", lambda dev: (2**40, 2**41))
            real, calls = HostLayout.device_state, []

            def flaky(self, s, host_state):
                calls.append(s.index)  # noqa: B023
                if len(calls) == 2:  # noqa: B023
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
                return real(self, s, host_state)  # noqa: B023

            monkeypatch.setattr(HostLayout, "device_state", flaky)
            before = opt.device_numel
            with warnings.catch_warnings(record=True) as rec:  # the limit is reported by the decision, not warned
                warnings.simplefilter("always")
                assert opt.tail.grow(float("inf")) == 0
            assert not [w for w in rec if "tail" in str(w.message)]
            assert len(calls) == 2 and opt.device_numel == before and len(opt.layout.buckets) == n_buckets - 1
            assert all(opt.layout.slots[i].residency == "host" for i in calls)
            assert opt.stats["tail_move_failures"] == 1 and opt.tail.blocked
            monkeypatch.setattr(HostLayout, "device_state", real)
            assert opt.tail.grow(float("inf")) == 0  # blocked after an OOM
        offload_step(model, opt, sched, step)
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def test_auto_tail_respects_max_gpu_fraction():
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    opt = HeterogeneousAdamW(model.parameters(), module=model, bucket_size=300, max_gpu_fraction=0.3)
    # off CUDA the memory query answers None: only the cap bounds the growth
    assert superoffload_memory.device_memory_room(torch.device("cpu")) is None
    moved = opt.tail.grow(float("inf"))
    assert "max_gpu_fraction=0.3" in opt.tail.limit
    assert moved >= 1 and 0 < opt.device_numel <= 0.3 * n
    # the next bucket would have crossed the cap
    assert opt.device_numel + opt.layout.buckets[-1].numel > 0.3 * n
    opt.close()



def test_options_are_frozen_and_validated():
    import dataclasses

    from lightning_gh.superoffload import SuperOffloadOptions

    opts = SuperOffloadOptions(gpu_fraction=0, max_gpu_fraction=1)
    assert opts.gpu_fraction == 0.0 and isinstance(opts.gpu_fraction, float) and opts.max_gpu_fraction == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.speculative = False  # type: ignore[misc]
    for kwargs, error, match in [
            ({"speculative": "no"}, ValueError, r"speculative='no' must be True, False or 'auto'"),
            ({"speculative": 1}, TypeError, r"speculative=1\): expected True, False or a string, got int"),
            ({"skip_nonfinite": 1}, TypeError, r"skip_nonfinite=1\): expected True or False, got int"),
            ({"host_memory_check": None}, TypeError, r"host_memory_check=None\): expected True or False, got NoneType"),
            ({"gpu_fraction": "half"}, ValueError, r"gpu_fraction='half' must be a float in \[0, 1\] or 'auto'"),
            ({"gpu_fraction": -0.1}, ValueError, r"gpu_fraction=-0.1"),
            ({"max_gpu_fraction": 2.0}, ValueError, r"max_gpu_fraction=2.0 must be a float in \[0, 1\] or None"),
            ({"cpu_threads": 0}, ValueError, r"cpu_threads=0 must be an int >= 1 or None"),
            ({"cpu_threads": 2.0}, TypeError, r"cpu_threads=2.0\): expected an int or None, got float"),
            ({"bucket_size": 0}, ValueError, r"bucket_size=0 must be a positive int")]:
        with pytest.raises(error, match=match):
            SuperOffloadOptions(**kwargs)
        # the optimizer's keyword arguments build the same dataclass, so they fail the same way
        with pytest.raises(error, match=match):
            HeterogeneousAdamW([nn.Parameter(torch.zeros(2))], **kwargs)


def test_optimizer_takes_options_or_keywords_not_both():
    from lightning_gh.superoffload import SuperOffloadOptions

    opts = SuperOffloadOptions(gpu_fraction=0.5, speculative=False, bucket_size=300, host_memory_check=False)
    a = HeterogeneousAdamW(make_model().parameters(), options=opts)
    b = HeterogeneousAdamW(make_model().parameters(), gpu_fraction=0.5, speculative=False, bucket_size=300,
                           host_memory_check=False)
    assert a.options == b.options == opts
    a.close(), b.close()
    with pytest.raises(TypeError, match=r"both options= and bucket_size=7"):
        HeterogeneousAdamW(make_model().parameters(), options=opts, bucket_size=7)
    with pytest.raises(TypeError, match=r"options=\.\.\.\) must be a SuperOffloadOptions, got dict"):
        HeterogeneousAdamW(make_model().parameters(), options={"gpu_fraction": 0.5})


def test_every_param_group_is_validated_like_adamw():
    """torch.optim.AdamW checks its constructor's hyper-parameters; HeterogeneousAdamW checks every group's too, since
    a bad group would otherwise fail deep in the CPU worker's fused kernel (or silently diverge)."""
    model = make_model()
    params = list(model.parameters())
    for key, value, error, match in [
            ("betas", (2.0, 2.0), ValueError, r"param_groups\[1\] betas=\(2.0, 2.0\) must be a pair of floats"),
            ("lr", -1.0, ValueError, r"param_groups\[1\] lr=-1.0 must be a float >= 0"),
            ("eps", "tiny", TypeError, r"param_groups\[1\]\(eps='tiny'\): expected a float, got str"),
            ("weight_decay", -0.1, ValueError, r"param_groups\[1\] weight_decay=-0.1 must be a float >= 0")]:
        with pytest.raises(error, match=match):
            HeterogeneousAdamW([{"params": params[:1]}, {"params": params[1:], key: value}])
    # the constructor's own values are checked with the argument's name alone
    with pytest.raises(ValueError, match=r"^betas=\(2.0, 2.0\) must be"):
        HeterogeneousAdamW(params, betas=(2.0, 2.0))
    # a group added later, and the groups of a loaded state dict, go through the same check
    opt = HeterogeneousAdamW([{"params": params[:1]}])
    with pytest.raises(ValueError, match=r"param_groups\[1\] betas=\(0.9, 1.5\)"):
        opt.add_param_group({"params": params[1:], "betas": (0.9, 1.5)})
    opt.close()
    opt = HeterogeneousAdamW(params)
    bad = opt.state_dict()
    bad["param_groups"][0]["eps"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\] eps=-1.0"):
        opt.load_state_dict(bad)
    opt.close()


def test_host_memory_error_is_the_shared_one(monkeypatch):
    from lightning_gh._host import HostMemoryError

    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 10_000)
    with pytest.raises(HostMemoryError, match="host_memory_check=False"):
        HeterogeneousAdamW(make_model().parameters())


def test_worker_runs_final_updates_in_forward_order():
    """Once a step's decision is known, queued bucket updates and redos run earliest layer first (what the next
    forward needs first); before it, and across steps or a "finish" task, the queue keeps its order."""
    from types import SimpleNamespace

    from lightning_gh.superoffload.worker import next_task

    def bucket(index):  # numbered in gradient-arrival order
        return SimpleNamespace(index=index)

    known = SimpleNamespace(poll=lambda block: "decision")
    unknown = SimpleNamespace(poll=lambda block: None)
    late, mid, early = bucket(0), bucket(1), bucket(2)  # arrival order: last layer first
    pending = [("bucket", late, known), ("bucket", mid, known), ("bucket", early, known), ("finish", None, known)]
    assert next_task(pending) == 2
    assert next_task([("bucket", late, unknown), ("bucket", early, unknown)]) == 0  # speculative: FIFO
    assert next_task([("bucket", late, known), ("finish", None, known), ("bucket", early, known)]) == 0
    assert next_task([("bucket", late, known), ("bucket", early, unknown)]) == 0
    assert next_task([("finish", None, known), ("bucket", early, known)]) == 0
    assert next_task([None]) == 0
    # the redos of a rolled-back speculation join the step's decided updates, in forward order
    pending = [("redo", late, known), ("redo", mid, known), ("bucket", early, known), ("finish", None, known)]
    assert next_task(pending) == 2
    assert next_task([("redo", late, known), ("redo", mid, known)]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_norms_are_taken_per_bucket_not_per_parameter(monkeypatch, dtype):
    """After the first step the gradient hook only records arrivals: each complete host bucket takes its norms in
    one multi-tensor call (and the GPU tail its own at step()), and the training thread's hook time is counted."""
    model = make_model(dtype)
    params = list(model.parameters())
    opt = HeterogeneousAdamW(params, lr=1e-2, max_grad_norm=CLIP, module=model, bucket_size=100, gpu_fraction=0.2)
    x = batches(0)[0]
    loss_fn(model, x).backward()
    opt.step()  # the first step lays out the buckets
    opt.zero_grad()
    opt.synchronize()
    calls: list[int] = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    before = dict(opt.stats["loop_phases_ms"])
    loss_fn(model, x).backward()
    host_buckets = len(opt.layout.buckets)
    assert host_buckets >= 2 and len(calls) == host_buckets  # one call per complete bucket, during backward
    opt.step()
    assert len(calls) == host_buckets + 1  # the GPU tail's norms, in step()
    assert sum(calls) == len(params) and max(calls) > 1
    opt.zero_grad()
    opt.synchronize()
    for phase in ("grad_hooks", "forward_hooks"):
        assert opt.stats["loop_phases_ms"][phase] > before[phase]
    opt.close()


def test_tail_update_casts_bf16_gradients_a_chunk_at_a_time(monkeypatch):
    """The GPU tail's update of bf16 weights reads fp32 copies of their gradients; they are made a chunk at a time
    (so the tail costs 14 B per bf16 parameter, not 18), and the chunked update equals the one-call update
    bitwise. On the CPU the tail runs in ``step()`` with the same math."""
    import threading

    def run(chunk: int, dtype: torch.dtype = torch.bfloat16):
        monkeypatch.setattr(tail_mover, "TAIL_UPDATE_CHUNK", chunk)
        main, calls = threading.get_ident(), []
        real = torch._fused_adamw_

        def spy(*args, **kwargs):
            if threading.get_ident() == main:  # the tail's update (the worker thread runs the host buckets')
                calls.append(len(args[0]))
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "_fused_adamw_", spy)
        model, opt = train_ours(model=make_model(dtype), gpu_fraction=0.6, steps=6)
        monkeypatch.setattr(torch, "_fused_adamw_", real)
        return model, opt, calls

    whole_model, whole_opt, whole_calls = run(1 << 40)
    chunk_model, chunk_opt, chunk_calls = run(1)
    n_tail = sum(1 for s in chunk_opt.layout.slots if s.residency == "device")
    assert n_tail >= 2
    # one call per group and step in one piece; one per tail parameter in chunks of one element
    assert max(whole_calls) > 1 and set(chunk_calls) == {1}
    assert len(chunk_calls) == sum(whole_calls)
    assert_same(whole_model, whole_opt, chunk_model, chunk_opt)
    # the per-parameter GPU cost the auto tail budgets: moments 8 B + fp32 master 4 B + the bf16 gradient 2 B
    slot = next(s for s in chunk_opt.layout.slots if s.residency == "device")
    assert tail_bytes([slot]) == 14 * slot.numel
    whole_opt.close()
    chunk_opt.close()
    # fp32 weights: nothing is cast, so the tail's update stays one call per group and step whatever the chunk
    _, fp32_opt, fp32_calls = run(1, torch.float32)
    assert fp32_calls == whole_calls
    fp32_opt.close()


def test_tail_budget_holds_back_one_cast_chunk(monkeypatch):
    """Before the first move, the auto tail's memory budget holds back one chunk of fp32 gradient copies for bf16
    weights (none for fp32 weights, whose gradients the update reads as they are); once a tail exists, the measured
    peak of a step holds it and nothing more is held back."""
    room = (10 * 2**30, 2**40)
    monkeypatch.setattr(superoffload_memory, "device_memory_room", lambda dev: room)
    budgets = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(dtype)
        opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, module=model, skip_nonfinite=False, bucket_size=600)
        loss_fn(model, batches(0)[0]).backward()
        opt.step()
        opt.synchronize()
        budgets[dtype] = opt.tail.budget()[0]
        largest = max(s.numel for s in opt.layout.slots)
        expect = 0 if dtype == torch.float32 else 4 * (tail_mover.TAIL_UPDATE_CHUNK + largest)
        assert opt.tail.cast_chunk_bytes() == expect
        opt.close()
    assert budgets[torch.float32] - budgets[torch.bfloat16] == 4 * (tail_mover.TAIL_UPDATE_CHUNK + largest)
    model = make_model(torch.bfloat16)
    opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, module=model, skip_nonfinite=False, bucket_size=600,
                             gpu_fraction=0.5)
    loss_fn(model, batches(0)[0]).backward()
    opt.step()
    opt.synchronize()
    mover = tail_mover.TailMover(opt.layout, None, opt.stats)  # a fixed tail has none of its own
    assert opt.device_numel > 0 and mover.budget()[0] == budgets[torch.float32]
    opt.close()


def _host_with_room(monkeypatch, backup_params: int, stage_bucket: int = 0) -> None:
    """A host whose available memory holds the test model's state (16 B/param, fp32 gradients) and exact-rollback
    copies of ``backup_params`` parameters, within the 90% the optimizer may take; with ``stage_bucket``, also the
    weights-first staging ring for buckets of that size (two fp32 buffers of the largest bucket)."""
    params = list(make_model().parameters())
    n = sum(p.numel() for p in params)
    ring = 2 * 4 * max(stage_bucket, max(p.numel() for p in params)) if stage_bucket else 0
    need = 16 * n + 12 * backup_params + ring
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: int(need / 0.9) + 8)


@pytest.mark.parametrize("rollback", ["auto", "copy"])
def test_a_host_too_small_for_backups_trains_without_speculation_bitwise(monkeypatch, rollback):
    _host_with_room(monkeypatch, backup_params=0)
    ref_model, ref_opt, _ = train_reference()
    model, opt = train_ours(force_speculation=True, rollback=rollback)  # speculative="auto", the default
    plan = opt.layout.plan
    assert plan.backup_params == 0 and "no host RAM left for a backup" in plan.reason
    # no room for the weights-first staging ring either: every update takes one pass (none needs it here)
    assert opt.layout.staging == (opt.layout.kernel is None) and opt.stats["writeback_ms"] == 0
    assert "no host RAM left" in opt.stats["host_plan"]
    assert not any(b.speculative for b in opt.layout.buckets) and not opt.layout.two_copies
    assert all(b.alt_master is None and b.backup.tensor is None for b in opt.layout.buckets)
    assert opt.stats["speculative_buckets"] == 0 and opt.stats["rollbacks"] == 0
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


@pytest.mark.parametrize("rollback", ["auto", "copy"])
def test_room_for_a_few_backups_speculates_on_exactly_those_buckets(monkeypatch, rollback):
    m = make_model()
    probe = HeterogeneousAdamW(groups(m), module=m, bucket_size=100, host_memory_check=False)
    sizes = [b.numel for b in probe.layout.buckets]  # in gradient-arrival order
    probe.close()
    assert len(sizes) >= 4
    _host_with_room(monkeypatch, backup_params=sizes[0] + sizes[1],
                    stage_bucket=100 if rollback == "auto" and HAVE_CC else 0)
    ref_model, ref_opt, _ = train_reference()
    model, opt = train_ours(force_speculation=True, rollback=rollback, bucket_size=100)
    assert opt.layout.staging and (opt.stats["writeback_ms"] > 0) == (opt.layout.kernel is not None)
    assert [b.speculative for b in opt.layout.buckets] == [True, True] + [False] * (len(sizes) - 2)
    assert f"room for backups of {sizes[0] + sizes[1]:,} of {sum(sizes):,} parameters" in opt.layout.plan.reason
    two = opt.layout.two_copies
    assert [b.alt_master is not None for b in opt.layout.buckets] == [two, two] + [False] * (len(sizes) - 2)
    spec = opt.layout.buckets[:2]
    if two:
        assert all(b.backup.tensor is None for b in opt.layout.buckets)
    else:  # copy rollback: only the speculating buckets ever copy their state aside
        assert all(b.backup.tensor is not None for b in spec)
        assert all(b.backup.tensor is None for b in opt.layout.buckets[2:])
    assert 0 < opt.stats["rollbacks"] < opt.stats["speculative_buckets"] <= 2 * STEPS
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def _host_bytes(layout: HostLayout) -> int:
    """Host bytes the layout's buckets hold: state and fp32 gradient buffer (16 B/param), plus 12 B/param for a
    second copy or a rollback copy."""
    return sum(b.numel * (16 + 12 * (b.alt_master is not None) + 12 * (b.backup.tensor is not None))
               for b in layout.buckets)


@pytest.mark.parametrize("rollback", ["auto", "copy"])
def test_host_room_the_tail_frees_holds_rollback_copies_for_more_buckets(monkeypatch, rollback):
    """The host plan sizes the rollback copies before the GPU tail takes anything. Once the tail holds buckets, the
    room their host state had lets more buckets keep a copy and speculate (what the tail mover does when its
    decision is final); a tail that moves back takes that room back first. The host never holds more than the
    plan, and the run stays bitwise equal to the reference."""
    m = make_model()
    probe = HeterogeneousAdamW(groups(m), module=m, bucket_size=100, host_memory_check=False)
    sizes = [b.numel for b in probe.layout.buckets]  # in gradient-arrival order
    probe.close()
    freed = (sizes[-1] + sizes[-2]) * 16 // 12  # copies the tail's two buckets make room for
    room = sizes[0] + sizes[1] - freed // 2  # a copy of the first bucket fits; of the second, only with that room
    assert sizes[0] <= room < sizes[0] + sizes[1] <= room + freed
    _host_with_room(monkeypatch, backup_params=room, stage_bucket=100 if rollback == "auto" and HAVE_CC else 0)
    ref_model, ref_opt, _ = train_reference()
    model = make_model()
    opt = HeterogeneousAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), max_grad_norm=CLIP, module=model,
                             bucket_size=100, rollback=rollback)
    lay = opt.layout
    def speculating(budget):  # the buckets, in arrival order, whose copies fit in the budget
        fits, used = [], 0
        for b in lay.buckets:
            fits.append(used + b.numel <= budget)
            used += b.numel if fits[-1] else 0
        return fits

    train_ours(steps=6, model=model, opt=opt, force_speculation=True)
    assert [b.speculative for b in lay.buckets] == speculating(room) and not lay.buckets[1].speculative
    assert _host_bytes(lay) <= lay.plan.needed_bytes
    before = opt.stats["speculative_buckets"]

    lay.to_device(lay.buckets[-1])  # the tail takes the last-arriving buckets
    lay.to_device(lay.buckets[-1])
    budget = superoffload_memory.speculation_budget(lay.plan, lay.host_numel())
    assert budget == min(lay.host_numel(), lay.plan.backup_params + freed) == sizes[0] + sizes[1]
    assert lay.fit_speculation(budget, opt.synchronize)
    assert not lay.fit_speculation(budget, opt.synchronize)  # nothing changes twice
    fits = speculating(budget)
    assert [b.speculative for b in lay.buckets] == fits == [True, True]
    if lay.two_copies:  # the second copies are made at once; rollback copies at a bucket's first speculation
        assert [b.alt_master is not None for b in lay.buckets] == fits
    second = []  # whether the bucket that could not speculate before does now, step by step
    for step in range(6, 14):
        train_ours(steps=step + 1, model=model, opt=opt, start=step, force_speculation=True)
        second.append(lay.buckets[1].speculated)
        assert _host_bytes(lay) <= lay.plan.needed_bytes
    assert sum(second) >= 2 and opt.stats["speculative_buckets"] > before

    lay.to_host(lay.device_slots())  # the tail goes home: the extra copies are dropped before the state lands
    assert [b.speculative for b in lay.buckets] == speculating(room) and not lay.buckets[1].speculative
    assert lay.buckets[1].alt_master is None and lay.buckets[1].backup.tensor is None
    assert _host_bytes(lay) <= lay.plan.needed_bytes
    train_ours(model=model, opt=opt, start=14, force_speculation=True)
    assert _host_bytes(lay) <= lay.plan.needed_bytes  # no copy made ahead for a bucket that stopped speculating
    assert 0 < opt.stats["rollbacks"]
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def test_no_configuration_fits_names_the_sizes_and_the_largest_model(monkeypatch):
    from lightning_gh._host import HostMemoryError

    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 8 * n)  # half of the 16 B/param the state needs
    largest = int(0.9 * 8 * n) // 16
    with pytest.raises(HostMemoryError, match=rf"{n:,} offloaded parameters x 16 B .* a model of at most "
                                              rf"{largest:,} parameters fits this host"):
        HeterogeneousAdamW(groups(model), module=model, max_grad_norm=CLIP)


@pytest.mark.parametrize("speculative", [False, True], ids=["decided", "redo-after-rollback"])
def test_updates_known_to_be_final_run_in_forward_order_and_stay_bitwise(monkeypatch, speculative):
    """When a step's decision is known before a bucket's CPU update runs (every bucket with speculative=False; the
    redo after a rollback otherwise), the worker updates the buckets in the order the next forward needs them:
    the earliest layer first, i.e. the reverse of gradient arrival (bucket 0 arrives first). Bitwise as before."""
    from lightning_gh.superoffload.worker import CpuUpdater

    order: list[tuple[int, bool]] = []  # (bucket index, clipped or redone) per CPU update, in the order they ran
    real_update, real_other = CpuUpdater._update, CpuUpdater._update_other

    def update(self, b, hp, coef):
        order.append((b.index, coef is not None))
        return real_update(self, b, hp, coef)

    def update_other(self, b, hp, coef):
        order.append((b.index, coef is not None))
        return real_other(self, b, hp, coef)

    monkeypatch.setattr(CpuUpdater, "_update", update)
    monkeypatch.setattr(CpuUpdater, "_update_other", update_other)
    ref_model, ref_opt, clipped = train_reference(steps=8)
    model, opt = train_ours(steps=8, speculative=speculative, force_speculation=True, rollback="copy", bucket_size=100)
    n = len(opt.layout.buckets)
    assert n >= 4
    forward = list(range(n - 1, -1, -1))
    steps = [order[i:i + n] for i in range(0, len(order), n)]
    if not speculative:  # every update waited for its decision
        assert len(order) == 7 * n and all([b for b, _ in step] == forward for step in steps)  # one step skipped
    else:  # the clipped steps: n speculative updates in arrival order, then n redos in forward order
        redos = [step for step in steps if all(c for _, c in step)]
        assert redos and all([b for b, _ in step] == forward for step in redos)
        assert any([b for b, _ in step] == list(range(n)) for step in steps)  # speculation: arrival order
    assert_same(ref_model, ref_opt, model, opt)
    opt.close()


def test_moving_the_state_to_torch_adamw_says_to_close_the_old_optimizer_and_works_after_close():
    model = nn.Linear(8, 8)
    opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, module=model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(opt.state_dict())
    model(torch.randn(2, 8)).sum().backward()
    plain.step()
    plain.zero_grad()
    with pytest.raises(RuntimeError, match=r"call close\(\) on this HeterogeneousAdamW first"):
        model(torch.randn(2, 8)).sum().backward()
    plain.zero_grad()
    opt.close()
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        plain.step()
        plain.zero_grad()
