"""Trainer(strategy="superoffload") on the CPU: the same run as the plain Trainer with torch.optim.AdamW(fused=True).

Tolerance: none (bitwise losses and parameters), for the reasons given in test_superoffload.py: the strategy runs
the module's own AdamW hyper-parameters through the same fused kernel and Lightning's clip coefficient.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gh.demo import Llama, MarkovDataModule, preset
from lightning_gh.offload.strategy import SuperOffloadStrategy
from lightning_gh.offload.superoffload import HeterogeneousAdamW

ROOT = Path(__file__).resolve().parents[1]


class TinyLM(L.LightningModule):
    """The tiny reference Llama with AdamW(fused=True) on the CPU too, two param groups and a warm-up."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = preset("tiny")
        self.model = Llama(self.config)
        self.optimizer = optimizer
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.model(tokens).flatten(0, 1).float(), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.95), fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class OrderedData(MarkovDataModule):
    """Batches in a fixed order, so a run resumed at an epoch boundary sees the batches the full run saw."""

    def train_dataloader(self):
        return self._loader(self._dataset(self.num_train_samples, 0, self.sample_cost_ms), shuffle=False)


def fit(strategy, tmp_path, max_steps=10, ckpt_path=None, **kwargs):
    model = TinyLM()
    # 10 batches of 8: one epoch is 5 optimizer steps with accumulate_grad_batches=2
    dm = OrderedData.for_model(model, num_train_samples=80)
    kwargs.setdefault("gradient_clip_val", 0.5)
    kwargs.setdefault("accumulate_grad_batches", 2)
    kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, **kwargs)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer


def test_registered_by_name():
    assert "superoffload" in StrategyRegistry
    assert StrategyRegistry["superoffload"]["strategy"] is SuperOffloadStrategy


def test_import_lightning_gh_registers_the_strategy():
    import lightning_gh

    if not hasattr(lightning_gh, "SuperOffloadStrategy"):
        pytest.skip("lightning_gh/__init__.py does not export SuperOffloadStrategy yet")
    code = ("import lightning_gh; from lightning.pytorch.strategies import StrategyRegistry; "
            "assert 'superoffload' in StrategyRegistry; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("clip", [{"gradient_clip_val": 0.5}, {"gradient_clip_val": 0.02,
                                                               "gradient_clip_algorithm": "value"}])
def test_trainer_matches_plain_adamw_bitwise(tmp_path, clip):
    plain, _ = fit("auto", tmp_path, **clip)
    ours, trainer = fit("superoffload", tmp_path, **clip)
    opt = trainer.optimizers[0]
    assert isinstance(opt, HeterogeneousAdamW)
    assert opt.pipeline_trigger == "closure"
    if "gradient_clip_algorithm" in clip:
        assert opt.max_grad_value == 0.02 and opt.max_grad_norm is None
    else:
        assert opt.max_grad_norm == 0.5 and opt.stats["clipped_steps"] > 0
    assert opt.stats["steps"] == 10
    assert ours.losses == plain.losses
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    # the LR schedule reached the optimizer that actually ran
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)


def test_checkpoint_resume_gives_identical_losses(tmp_path):
    full, _ = fit("superoffload", tmp_path, max_steps=10)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    first, _ = fit("superoffload", tmp_path, max_steps=10, callbacks=[ckpt_cb], enable_checkpointing=True)
    assert first.losses == full.losses
    ckpt = tmp_path / "ckpt" / "step=5.ckpt"
    state = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]
    assert all(v["exp_avg"].device.type == "cpu" and float(v["step"]) == 5 for v in state.values())
    resumed, trainer = fit("superoffload", tmp_path, max_steps=10, ckpt_path=str(ckpt))
    # 5 optimizer steps x 2 micro-batches after the checkpoint, the same as the uninterrupted run
    assert resumed.losses == full.losses[10:]
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_bf16_true_keeps_fp32_master_on_host(tmp_path):
    model, trainer = fit(SuperOffloadStrategy(gpu_fraction=0.0), tmp_path, max_steps=4, precision="bf16-true")
    opt = trainer.optimizers[0]
    state = opt.state_dict()["state"]
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.bfloat16 for p in params)
    for i, p in enumerate(params):
        assert state[i]["master"].dtype == torch.float32
        assert torch.equal(p, state[i]["master"].to(torch.bfloat16))
    assert model.losses[-1] < model.losses[0]


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="devices=1"):
        L.Trainer(accelerator="cpu", devices=2, strategy="superoffload")
    with pytest.raises(ValueError, match="gpu_fraction=2"):
        SuperOffloadStrategy(gpu_fraction=2)
    model = TinyLM(optimizer="sgd")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(TypeError, match="returned SGD"):
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=16))


def test_demo_part_is_off_without_cuda_and_carries_the_strategy_with_it():
    import dataclasses

    from lightning_gh import hardware
    from lightning_gh.demo.run import DemoConfig
    from lightning_gh.offload.superoffload_part import superoffload_part

    cfg = DemoConfig(preset="tiny", out=Path("unused"))
    hw = dataclasses.replace(hardware.detect(), cuda_available=False)
    off = superoffload_part(cfg, hw, Path("unused"))
    assert not off.enabled and "no CUDA GPU" in off.reason
    on = superoffload_part(cfg, dataclasses.replace(hw, cuda_available=True), Path("unused"))
    assert on.enabled and isinstance(on.trainer_kwargs["strategy"], SuperOffloadStrategy)
