"""The fused fp32-master Adam/AdamW update (``precision.fused_master``) against the plain master path: bitwise for the
eager loop, within torch's own fused-vs-loop AdamW spread for the compiled pass; checkpoints in torch's layout, exact
resume, and the plain path where it must stay (SGD, clipping, hooks that read gradients)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_gh.precision.fused_master import FusedMasterAdam, fused_adam_unsupported
from lightning_gh.precision.master import MasterWeights, MasterWeightsMixin


class BF16FusedMaster(MasterWeightsMixin, Precision):
    """A bf16 module with fp32 masters; ``fused`` picks the update (what the TE plugin does, minus fp8)."""

    master_weights = True

    def __init__(self, fused: bool = True) -> None:
        self.fused_master_update = fused

    def convert_module(self, module):
        return module.to(torch.bfloat16)

    def convert_input(self, data):
        return [t.to(torch.bfloat16) for t in data]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def param_groups(net: nn.Module) -> list[dict]:
    """Two groups with their own lr, betas and weight decay (the second on the output layer)."""
    ps = list(net.parameters())
    return [{"params": ps[:2], "weight_decay": 0.1},
            {"params": ps[2:], "lr": 2e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def loop(steps: int, update: str, opt_cls=torch.optim.AdamW, **opt_kwargs):
    """``steps`` steps by hand with an LR schedule; ``update``: "plain" (today's path), "eager" or "compiled"."""
    net = make_net().to(torch.bfloat16)
    opt = opt_cls(param_groups(net), lr=1e-3, **opt_kwargs)
    masters = MasterWeights(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    fused = None if update == "plain" else FusedMasterAdam(masters, compile=update == "compiled")
    for x, y in data(steps):
        nn.functional.mse_loss(net(x.to(torch.bfloat16)).float(), y).backward()
        if fused is None:
            masters.grads_to_master()
            opt.step()
            opt.zero_grad()
            masters.master_to_model()
        else:
            fused.step()
            opt.step()  # steps nothing here (no master has a .grad), as inside Lightning
        sched.step()
    return masters, opt


def assert_same(a: MasterWeights, b: MasterWeights, opt_a, opt_b) -> None:
    for (p, m), (q, n) in zip(a.pairs, b.pairs):
        assert torch.equal(m, n) and torch.equal(p, q)
    for sa, sb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("maximize", [False, True])
def test_eager_fused_update_equals_the_plain_master_path_bitwise(opt_cls, maximize):
    plain, opt_p = loop(6, "plain", opt_cls, maximize=maximize)
    fused, opt_f = loop(6, "eager", opt_cls, maximize=maximize)
    assert_same(plain, fused, opt_p, opt_f)
    assert all(p.grad is None for p, _ in fused.pairs)  # the bf16 gradients are freed by the update


def test_compiled_fused_update_agrees_within_torch_fused_adamw_spread():
    """The compiled pass vs the plain path, one step at a time from the same state.

    Tolerance: torch's own ``AdamW(fused=True)`` differs from its for-loop by a few fp32 ulps per step (bias
    corrections in fp32 instead of float64, multiply-add contraction); the compiled pass is held to 4x that spread.
    Over many steps no bound holds: once a master sits on a bf16 rounding boundary the bf16 weights differ by one ulp
    and the two trajectories part, as they do between any two AdamW implementations.
    """
    plain, _ = loop(1, "plain")
    compiled, _ = loop(1, "compiled")
    torch_fused, _ = loop(1, "plain", fused=True)
    spread = max((m - n).abs().max().item() for (_, m), (_, n) in zip(plain.pairs, torch_fused.pairs))
    for (p, m), (q, n) in zip(plain.pairs, compiled.pairs):
        assert (m - n).abs().max().item() <= 4 * max(spread, 1e-8)
        assert torch.equal(p, q)


def test_compiled_update_does_not_recompile_when_the_lr_changes():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    net = make_net().to(torch.bfloat16)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    fused = FusedMasterAdam(MasterWeights(opt), compile={"backend": "eager"})  # tracing only: no C++ build
    for i, (x, y) in enumerate(data(4)):
        opt.param_groups[0]["lr"] = 1e-3 / (i + 1)
        nn.functional.mse_loss(net(x.to(torch.bfloat16)).float(), y).backward()
        fused.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]


def test_unsupported_optimizers_are_named():
    ps = list(make_net().parameters())
    assert fused_adam_unsupported(torch.optim.SGD(ps, lr=0.1)) == "SGD is not torch.optim.Adam or AdamW"
    assert fused_adam_unsupported(torch.optim.AdamW(ps, amsgrad=True)) == "param group 0 has amsgrad=True"
    assert fused_adam_unsupported(torch.optim.AdamW(ps, lr=torch.tensor(1e-3))) == "param group 0 has a tensor 'lr'"
    assert fused_adam_unsupported(torch.optim.AdamW(ps, fused=True)) is None
    with pytest.raises(ValueError, match=r"FusedMasterAdam\(optimizer=SGD\): SGD is not torch.optim.Adam or AdamW"):
        FusedMasterAdam(MasterWeights(torch.optim.SGD(ps, lr=0.1)))
    with pytest.raises(ValueError, match=r"compile='yes'.*True, False, None or a dict"):
        FusedMasterAdam(MasterWeights(torch.optim.AdamW(make_net().parameters())), compile="yes")


# ---- inside Lightning


class Net(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = make_net()
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        opt = torch.optim.AdamW(param_groups(self.net), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GradNorms(Callback):
    """Reads the gradients in on_before_optimizer_step, as a gradient logger does."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(float(torch.stack([g.norm() for g in grads]).norm()))


def fit(tmp_path, steps: int, fused: bool, ckpt_path=None, callbacks=(), **trainer_kwargs):
    model = Net(trainer_kwargs.pop("optimizer", "adamw"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint)
                                                                             for c in callbacks),
                        default_root_dir=tmp_path, callbacks=list(callbacks), plugins=[BF16FusedMaster(fused)],
                        **trainer_kwargs)
    batches = [data(1)[0]] * 8  # one batch repeated: a resumed epoch sees the same data at any position
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    (masters,) = trainer.precision_plugin._masters
    return masters, trainer


def test_lightning_fused_steps_equal_the_plain_path_and_checkpoints_load_into_adamw(tmp_path):
    plain, t_plain = fit(tmp_path / "p", 5, fused=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    fused, t_fused = fit(tmp_path / "f", 5, fused=True, callbacks=[ckpt])
    assert t_fused.precision_plugin._fused  # the fused update was in use
    assert_same(plain, fused, t_plain.optimizers[0], t_fused.optimizers[0])
    assert t_fused.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * 0.25)  # the schedule stepped

    # The checkpoint's optimizer state is torch's AdamW layout: a plain AdamW over fp32 params loads it.
    state = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=True)
    fresh = make_net()
    opt = torch.optim.AdamW(param_groups(fresh), lr=1e-3)
    opt.load_state_dict(state["optimizer_states"][0])
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(opt.state_dict()["state"][0]["step"]) == 5


def test_resume_with_the_fused_update_is_exact(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    fit(tmp_path / "a", 3, fused=True, callbacks=[ckpt])
    resumed, t_resumed = fit(tmp_path / "b", 6, fused=True, ckpt_path=str(tmp_path / "ck" / "last.ckpt"),
                             callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck2")])
    straight, t_straight = fit(tmp_path / "c", 6, fused=True)
    assert_same(straight, resumed, t_straight.optimizers[0], t_resumed.optimizers[0])


def test_sgd_falls_back_to_the_plain_path(tmp_path):
    plain, t_plain = fit(tmp_path / "p", 4, fused=False, optimizer="sgd")
    fused, t_fused = fit(tmp_path / "f", 4, fused=True, optimizer="sgd")
    assert not t_fused.precision_plugin._fused
    for (p, m), (q, n) in zip(plain.pairs, fused.pairs):
        assert torch.equal(m, n) and torch.equal(p, q)


@pytest.mark.parametrize("how", ["clip", "hook"])
def test_clipping_and_gradient_hooks_get_fp32_gradients_and_the_plain_path(tmp_path, how, monkeypatch):
    kwargs = {"gradient_clip_val": 0.05} if how == "clip" else {}
    cb_plain, cb_fused = GradNorms(), GradNorms()
    plain, t_plain = fit(tmp_path / "p", 4, fused=False, callbacks=[cb_plain], **copy.deepcopy(kwargs))
    fused_steps = []
    step = FusedMasterAdam.step
    monkeypatch.setattr(FusedMasterAdam, "step", lambda self: fused_steps.append(1) or step(self))
    fused, t_fused = fit(tmp_path / "f", 4, fused=True, callbacks=[cb_fused], **kwargs)
    assert t_fused.precision_plugin._fused and not fused_steps  # set up, but stepped aside on every step
    assert len(cb_fused.norms) == 4 and cb_fused.norms == cb_plain.norms  # the hook saw the fp32 gradients
    assert_same(plain, fused, t_plain.optimizers[0], t_fused.optimizers[0])


def test_a_callback_marked_as_not_reading_gradients_keeps_the_fused_path(tmp_path, monkeypatch):
    class Marker(Callback):
        lgh_reads_gradients = False

        def __init__(self) -> None:
            self.calls = 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.calls += 1

    marker, fused_steps = Marker(), []
    plain, t_plain = fit(tmp_path / "p", 3, fused=False)
    step = FusedMasterAdam.step
    monkeypatch.setattr(FusedMasterAdam, "step", lambda self: fused_steps.append(1) or step(self))
    fused, t_fused = fit(tmp_path / "f", 3, fused=True, callbacks=[marker])
    assert marker.calls == 3 and len(fused_steps) == 3  # the hook ran, and the fused update did every step
    assert_same(plain, fused, t_plain.optimizers[0], t_fused.optimizers[0])


# ---- fp8-auto's setup trial leaves nothing behind (its GPU measurement itself is not run on the CPU)


def test_trial_cuts_its_entries_out_of_te_global_amax_buffers(monkeypatch):
    """The trial's TE layers' amax histories must not stay in TE's process-wide DelayedScaling buffers."""
    import sys
    import types

    from lightning_gh.precision import trial

    state = types.SimpleNamespace(global_amax_buffer={"forward_k": ["model"]}, global_amax_history_buffer={},
                                  global_scale_buffer={"forward_k": ["model"]})
    fake = types.ModuleType("transformer_engine.pytorch.quantization")
    fake.FP8GlobalStateManager = types.SimpleNamespace(quantization_state=state)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", fake)
    with trial._te_global_buffers_restored():
        state.global_amax_buffer["forward_k"].append("trial")
        state.global_amax_buffer["backward_k"] = ["trial"]
        state.global_scale_buffer["forward_k"].append("trial")
        state.global_amax_history_buffer["forward_k"] = ["trial"]
    assert state.global_amax_buffer == {"forward_k": ["model"]}
    assert state.global_scale_buffer == {"forward_k": ["model"]}
    assert state.global_amax_history_buffer == {}


def test_trial_compiles_through_its_own_function_not_module_call_impl():
    """``model.compile()`` would leave cache entries on ``nn.Module._call_impl``, which regional compilation reuses."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from lightning_gh.precision import trial

    torch._dynamo.reset()
    lin = nn.Sequential(nn.Linear(8, 4))
    compiled = torch.compile(trial._call, dynamic=False, backend="eager")
    for k in (3, 5):
        compiled(lin, torch.randn(k, 8))
    assert len(_debug_get_cache_entry_list(trial._call.__code__)) == 2  # one static graph per shape
    assert not _debug_get_cache_entry_list(nn.Module._call_impl.__code__)


# ---- the Transformer Engine plugin's option (driven by hand on the CPU, without TE)


def test_te_plugin_fused_master_update_option(monkeypatch):
    from types import SimpleNamespace

    from lightning_gh.precision import te as te_module

    monkeypatch.setattr(te_module, "te_missing_reason", lambda: None)
    monkeypatch.setattr(te_module, "make_recipe", lambda recipe, **options: SimpleNamespace())
    assert te_module.TEFloat8Precision("current").fused_master_update is True  # the default
    with pytest.raises(TypeError, match=r"fused_master_update='on'.*True or False"):
        te_module.TEFloat8Precision("current", fused_master_update="on")

    def drive(fused: bool):
        plugin = te_module.TEFloat8Precision("current", fused_master_update=fused)
        plugin._after_closure = lambda model, optimizer: None  # the Trainer's hooks
        net = make_net().to(torch.bfloat16)
        opt = torch.optim.AdamW(param_groups(net), lr=1e-3)
        plugin.connect(net, [opt], [])
        for x, y in data(4):
            def closure(x=x, y=y):
                loss = nn.functional.mse_loss(net(x.to(torch.bfloat16)).float(), y)
                loss.backward()
                return loss
            plugin.optimizer_step(opt, net, closure)
            opt.zero_grad()
        return plugin, opt

    fused, opt_f = drive(True)
    plain, opt_p = drive(False)
    assert fused._fused and not plain._fused
    assert_same(plain._masters[0], fused._masters[0], opt_p, opt_f)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_fused_update_on_cuda_agrees_with_torch_fused_adamw():
    """On the GPU: three steps of the compiled pass against the plain path with ``AdamW(fused=True)``, same grads."""
    torch.manual_seed(0)
    weights = [torch.randn(256, 512, device="cuda").to(torch.bfloat16) for _ in range(3)]
    grads = [torch.randn_like(w) for w in weights]
    out = {}
    for fused_update in (False, True):
        params = [nn.Parameter(w.clone()) for w in weights]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
        masters = MasterWeights(opt)
        fused = FusedMasterAdam(masters) if fused_update else None
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if fused is not None:
                fused.step()
            else:
                masters.grads_to_master()
                opt.step()
                opt.zero_grad()
                masters.master_to_model()
        out[fused_update] = [m.clone() for _, m in masters.pairs]
        if fused is not None:
            assert fused._compiled not in (None, False)  # it ran compiled, not the eager fallback
            assert all(s["step"].device.type == "cuda" for s in opt.state.values())
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # updates are 1e-3; ulps of |w| ~ 1 are 1.2e-7


def test_profiling_callbacks_keep_the_fused_path(tmp_path):
    """NVTX ranges and profiler phases only mark time before the step: with them on, the fused update still runs."""
    import lightning as L

    from lightning_gh import NVTXRangeCallback, SelectiveProfiler
    from lightning_gh.precision.master import _reads_grads_before_step

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

    model = Tiny()
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                        callbacks=[NVTXRangeCallback(), SelectiveProfiler(steps="5-6", output_dir=str(tmp_path))])
    trainer.strategy.connect(model)
    model.trainer = trainer
    assert not _reads_grads_before_step(model)

    class Reads(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    trainer.callbacks.append(Reads())
    assert _reads_grads_before_step(model)  # an unmarked hook still turns it off
