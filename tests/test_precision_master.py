"""fp32 master weights for bf16 modules (``precision.master``): bitwise against a reference loop, checkpoint resume,
and the Transformer Engine plugin's use of them (driven on the CPU without TE; not GPU-verified in this file)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_gh.precision.master import MasterWeights, MasterWeightsMixin

LR = 1e-3


class BF16Master(MasterWeightsMixin, Precision):
    """The smallest plugin using the mixin: a bf16 module with fp32 masters (what the TE plugin does, minus fp8)."""

    def __init__(self, master_weights: bool = True) -> None:
        self.master_weights = master_weights

    def convert_module(self, module):
        return module.to(torch.bfloat16)

    def convert_input(self, data):
        return data.to(torch.bfloat16) if isinstance(data, torch.Tensor) else [t.to(torch.bfloat16) for t in data]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def batches(n: int, same: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches; ``same``: one batch repeated (a resumed epoch then sees the same data whatever its position)."""
    g = torch.Generator().manual_seed(1)
    if same:
        return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))] * n
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def reference(steps: int, same: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fp32-master recipe written out: bf16 module, fp32 copies in AdamW, grads copied in, weights copied back."""
    net = make_net().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in net.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR)
    for x, y in batches(steps, same):
        loss = nn.functional.mse_loss(net(x.to(torch.bfloat16)).float(), y.to(torch.bfloat16).float())
        loss.backward()
        for p, m in zip(net.parameters(), masters):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters):
                p.copy_(m)
    return masters, [p.detach() for p in net.parameters()]


def fit(steps: int, tmp_path, plugin=None, ckpt_path=None, callbacks=(), same=False) -> tuple[Net, L.Trainer]:
    model = Net()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(callbacks), default_root_dir=tmp_path,
                        callbacks=list(callbacks), plugins=[plugin or BF16Master()])
    trainer.fit(model, torch.utils.data.DataLoader(batches(8, same), batch_size=None), ckpt_path=ckpt_path)
    return model, trainer


def test_lightning_steps_equal_the_reference_fp32_master_loop_bitwise(tmp_path):
    model, trainer = fit(5, tmp_path)
    ref_masters, ref_weights = reference(5)
    (masters,) = trainer.precision_plugin._masters
    assert len(masters) == 4 and all(m.dtype == torch.float32 for _, m in masters.pairs)
    for (p, m), rm, rp in zip(masters.pairs, ref_masters, ref_weights):
        assert torch.equal(m, rm) and torch.equal(p, rp) and p.dtype == torch.bfloat16
    # the optimizer steps the masters, so clipping and on_before_optimizer_step see fp32 gradients
    assert all(p.dtype == torch.float32 for g in trainer.optimizers[0].param_groups for p in g["params"])


def test_masters_keep_updates_that_bf16_weights_round_away(tmp_path):
    global LR
    LR, old = 1e-6, LR  # |update| far below bf16's resolution at |w| ~ 0.1
    try:
        with_masters, t1 = fit(5, tmp_path / "a")
        plain, _ = fit(5, tmp_path / "b", plugin=BF16Master(master_weights=False))
    finally:
        LR = old
    start = make_net().to(torch.bfloat16)
    moved = (plain.net[0].weight != start[0].weight).float().mean()
    assert moved < 0.1, moved  # bf16 training rounded away (nearly) every update
    (masters,) = t1.precision_plugin._masters
    assert (masters.pairs[0][1] != start[0].weight.float()).float().mean() > 0.9  # the fp32 masters moved


def test_checkpoint_holds_the_masters_and_resume_is_exact(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    fit(3, tmp_path, callbacks=[ckpt], same=True)
    state = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=True)
    saved = state["BF16Master"]["fp32_master"][0]
    assert len(saved) == 4 and all(t.dtype == torch.float32 for t in saved)
    resumed, trainer = fit(5, tmp_path, ckpt_path=str(tmp_path / "ck" / "last.ckpt"),
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck2")], same=True)
    ref_masters, ref_weights = reference(5, same=True)
    (masters,) = trainer.precision_plugin._masters
    for (p, m), rm, rp in zip(masters.pairs, ref_masters, ref_weights):
        assert torch.equal(m, rm) and torch.equal(p, rp)


def test_attach_after_a_step_and_mismatched_checkpoints_are_refused():
    net = make_net().to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 16, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"MasterWeights\(optimizer=SGD\): the optimizer has state already"):
        MasterWeights(opt)
    masters = MasterWeights(torch.optim.SGD(make_net().to(torch.bfloat16).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="checkpoint holds 1 fp32 master weights, this model has 4"):
        masters.load_state_dict([torch.zeros(1)])


@pytest.fixture
def te_plugin(monkeypatch):
    """TEFloat8Precision built where TE is absent (its master-weight path needs no TE)."""
    import importlib

    te_module = importlib.import_module("lightning_gh.precision.te")
    monkeypatch.setattr(te_module, "te_missing_reason", lambda: None)
    monkeypatch.setattr(te_module, "make_recipe", lambda recipe, **options: SimpleNamespace())
    return te_module.TEFloat8Precision


def test_te_plugin_keeps_fp32_masters_by_default(te_plugin):
    plugin = te_plugin("current")
    assert plugin.master_weights and plugin.weights_dtype == torch.bfloat16
    old = te_plugin("current", master_weights=False)
    assert not old.master_weights and old.weights_dtype is None
    with pytest.raises(TypeError, match=r"master_weights='yes'.*True or False"):
        te_plugin("current", master_weights="yes")

    # Drive the plugin's optimizer_step as Lightning does, against the reference loop.
    net = make_net().to(torch.bfloat16)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    plugin._after_closure = lambda model, optimizer: None  # the Trainer's hooks
    plugin.connect(net, [opt], [])
    for x, y in batches(3):
        def closure(x=x, y=y):
            loss = nn.functional.mse_loss(net(x.to(torch.bfloat16)).float(), y.to(torch.bfloat16).float())
            loss.backward()
            return loss
        plugin.optimizer_step(opt, net, closure)
        opt.zero_grad()
    ref_masters, ref_weights = reference(3)
    (masters,) = plugin._masters
    for (p, m), rm, rp in zip(masters.pairs, ref_masters, ref_weights):
        assert torch.equal(m, rm) and torch.equal(p, rp)
    state = plugin.state_dict()
    assert len(state["fp32_master"][0]) == 4
    fresh = te_plugin("current")
    fresh.load_state_dict(copy.deepcopy(state))  # before connect: kept, restored once the optimizer exists
    net2 = make_net().to(torch.bfloat16)
    fresh.connect(net2, [torch.optim.AdamW(net2.parameters(), lr=LR)], [])
    assert all(torch.equal(a, b) for a, b in zip(net2.parameters(), ref_weights))
