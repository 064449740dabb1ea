"""Trainer(strategy="superoffload") on the CPU: the same run as the plain Trainer with torch.optim.AdamW(fused=True).

Tolerance: none (bitwise losses and parameters), for the reasons given in test_superoffload.py: the strategy runs
the module's own AdamW hyper-parameters through the same fused kernel and Lightning's clip coefficient.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gh.demo import Llama, MarkovDataModule, preset
from lightning_gh.superoffload import HeterogeneousAdamW, SuperOffloadStrategy

ROOT = Path(__file__).resolve().parents[1]


class TinyLM(L.LightningModule):
    """The tiny reference Llama with AdamW(fused=True) on the CPU too, two param groups and a warm-up."""

    def __init__(self, optimizer: str = "adamw", scheduler: str = "lambda") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = preset("tiny")
        self.model = Llama(self.config)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        # the LR the optimizer that actually runs will read for this step
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))
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
        lr_sched = torch.optim.lr_scheduler
        if self.scheduler == "sequential":  # linear warm-up for 3 steps, then half the LR
            for g in opt.param_groups:
                g["lr"] = 1e-3
            sched = lr_sched.SequentialLR(opt, [lr_sched.LinearLR(opt, start_factor=0.1, total_iters=3),
                                                lr_sched.ConstantLR(opt, factor=0.5, total_iters=100)], milestones=[3])
        elif self.scheduler == "chained":
            sched = lr_sched.ChainedScheduler([lr_sched.LinearLR(opt, start_factor=0.1, total_iters=3),
                                               lr_sched.ExponentialLR(opt, gamma=0.8)], optimizer=opt)
        else:
            sched = lr_sched.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class OrderedData(MarkovDataModule):
    """Batches in a fixed order, so a run resumed at an epoch boundary sees the batches the full run saw."""

    def train_dataloader(self):
        return self._loader(self._dataset(self.num_train_samples, 0, self.sample_cost_ms), shuffle=False)


def fit(strategy, tmp_path, max_steps=10, ckpt_path=None, scheduler="lambda", **kwargs):
    model = TinyLM(scheduler=scheduler)
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
    # the entry may be the class or a lazy factory (lightning_gh/_strategies.py): either builds our strategy
    assert isinstance(StrategyRegistry.get("superoffload"), SuperOffloadStrategy)


def test_import_lightning_gh_registers_the_strategy(fresh_import_report):
    import lightning_gh

    if not hasattr(lightning_gh, "SuperOffloadStrategy"):
        pytest.skip("lightning_gh/__init__.py does not export SuperOffloadStrategy yet")
    # import lightning_gh in a fresh interpreter, then look in Lightning's registry (tests/conftest.py)
    assert fresh_import_report["superoffload_registered"] is True


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
    # several devices are data-parallel now (tests/test_superoffload_zero.py): DDP's launcher, no refusal
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="superoffload")
    assert trainer.strategy.num_processes == 2 and trainer.strategy.launcher is not None
    with pytest.raises(ValueError, match="gpu_fraction=2"):
        SuperOffloadStrategy(gpu_fraction=2)
    # the same validator as HeterogeneousAdamW, so the same messages
    for kwargs, error, match in [({"max_gpu_fraction": 1.5}, ValueError, "max_gpu_fraction=1.5 must be a float in"),
                                 ({"cpu_threads": 0}, ValueError, "cpu_threads=0"),
                                 ({"bucket_size": True}, TypeError, r"bucket_size=True\): expected an int, got bool")]:
        with pytest.raises(error, match=match):
            SuperOffloadStrategy(**kwargs)
        with pytest.raises(error, match=match):
            HeterogeneousAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    model = TinyLM(optimizer="sgd")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(TypeError, match="returned SGD"):
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=16))


@pytest.mark.parametrize("scheduler", ["sequential", "chained"])
def test_nested_lr_schedulers_drive_the_offloaded_optimizer(tmp_path, scheduler):
    """SequentialLR / ChainedScheduler keep their own schedulers bound to the AdamW that configure_optimizers built;
    the strategy's optimizer must still read the LR they write (shared param groups, nested rebinding)."""
    plain, _ = fit("auto", tmp_path, max_steps=7, scheduler=scheduler, accumulate_grad_batches=1)
    ours, trainer = fit("superoffload", tmp_path, max_steps=7, scheduler=scheduler, accumulate_grad_batches=1)
    opt = trainer.optimizers[0]
    assert isinstance(opt, HeterogeneousAdamW)
    assert len(set(plain.lrs)) >= 4  # the schedule really moves the LR
    if scheduler == "sequential":
        assert plain.lrs[:4] == pytest.approx([1e-4, 4e-4, 7e-4, 5e-4])
    assert ours.lrs == plain.lrs
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert all(inner.optimizer is opt for inner in sched._schedulers)
    assert ours.losses == plain.losses
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_grad_scaler_precision_warns_that_overlap_is_lost(tmp_path):
    """precision="16-mixed" (a GradScaler) runs backward outside optimizer.step(closure): the strategy says so
    once, and the run still equals the plain one."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))

    # no clipping: Lightning refuses to clip a fused AdamW under a GradScaler (the plain run)
    plain, _ = fit("auto", tmp_path, max_steps=3, plugins=[plugin()], gradient_clip_val=None)
    with pytest.warns(UserWarning, match="16-mixed.*cannot overlap the backward") as record:
        ours, trainer = fit(SuperOffloadStrategy(gpu_fraction=0.0), tmp_path, max_steps=3, plugins=[plugin()],
                            gradient_clip_val=None)
    assert sum("cannot overlap" in str(w.message) for w in record) == 1
    assert isinstance(trainer.optimizers[0], HeterogeneousAdamW)
    assert ours.losses == plain.losses
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_strategy_takes_options_or_keywords_not_both(tmp_path):
    from lightning_gh.superoffload import SuperOffloadOptions

    opts = SuperOffloadOptions(gpu_fraction=0.0, speculative=False, cpu_threads=2, bucket_size=4096)
    by_kwargs = SuperOffloadStrategy(gpu_fraction=0.0, speculative=False, cpu_threads=2, bucket_size=4096)
    by_options = SuperOffloadStrategy(options=opts)
    assert by_kwargs.options == by_options.options == opts
    assert by_options.optimizer_kwargs == opts.as_kwargs()
    with pytest.raises(TypeError, match=r"SuperOffloadStrategy got both options= and speculative=False"):
        SuperOffloadStrategy(options=SuperOffloadOptions(gpu_fraction=0.0), speculative=False)
    with pytest.raises(ValueError, match=r"speculative='no' must be True, False or 'auto'"):
        SuperOffloadStrategy(speculative="no")
    # the optimizer the strategy builds carries the very same options
    model, trainer = fit(SuperOffloadStrategy(options=opts), tmp_path, max_steps=2)
    opt = trainer.optimizers[0]
    assert isinstance(opt, HeterogeneousAdamW) and opt.options == opts and opt.cpu_threads == 2


def test_strategy_consults_the_table_of_parts(tmp_path):
    from lightning_gh import compat

    class ManagedState(L.Callback):  # stands in for a part the table says SuperOffload does not combine with
        lgh_part = "ManagedOptimizerState"

    assert SuperOffloadStrategy.lgh_part == "SuperOffload"
    model = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=1, logger=False,
                        callbacks=[ManagedState()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(compat.IncompatiblePartsError, match="SuperOffload and ManagedOptimizerState"):
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=16))


def test_torch_scheduler_internals_the_strategy_relies_on():
    """Canary: rebinding schedulers reads torch's nested ``_schedulers`` and mirrors the ``step`` wrapper marker."""
    lr_sched = torch.optim.lr_scheduler
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    seq = lr_sched.SequentialLR(opt, [lr_sched.ConstantLR(opt), lr_sched.ConstantLR(opt)], milestones=[1])
    chained = lr_sched.ChainedScheduler([lr_sched.ConstantLR(opt)], optimizer=opt)
    assert len(seq._schedulers) == 2 and len(chained._schedulers) == 1
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)


def test_cpu_run_says_it_steps_aside_and_bf16_checkpoint_names_its_masters(tmp_path):
    """On the CPU the strategy says once that nothing is offloaded; a checkpoint of bf16 weights says where their
    fp32 masters are (a plain Trainer never runs our code when it loads the file, so the save is the moment)."""
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    with pytest.warns(UserWarning) as record:
        fit(SuperOffloadStrategy(gpu_fraction=0.0), tmp_path, max_steps=4, precision="bf16-true",
            callbacks=[ckpt_cb], enable_checkpointing=True)
    texts = [str(w.message) for w in record]
    assert sum("there is no GPU memory to relieve" in t for t in texts) == 1
    saved = [t for t in texts if "fp32 master copies are in its optimizer state" in t]
    assert len(saved) == 1 and "strategy='superoffload'" in saved[0]
    meta = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=False)["lightning_gh"]
    assert meta == {"superoffload": {"fp32_master_in_optimizer_state": True}}


def test_stats_reach_the_users_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    model = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=4, log_every_n_steps=1,
                        logger=CSVLogger(tmp_path, name="", version="logs"), enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(model, OrderedData.for_model(model, num_train_samples=32))
    import csv

    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    logged = {k for r in rows for k, v in r.items() if v}
    assert {"lgh/superoffload/cpu_update_ms", "lgh/superoffload/host_bytes_per_step",
            "lgh/superoffload/gpu_tail_frac"} <= logged, logged


def test_tuner_scales_the_batch_size_on_one_device_but_several_stay_distributed(tmp_path):
    """On one device the strategy is local (``Tuner.scale_batch_size`` runs); with several it is distributed."""
    from lightning.pytorch.tuner import Tuner

    model = TinyLM()
    dm = OrderedData.for_model(model, num_train_samples=64, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    assert trainer._accelerator_connector.is_distributed is False
    found = Tuner(trainer).scale_batch_size(model, datamodule=dm, mode="power", steps_per_trial=1, max_trials=2,
                                            init_val=2)
    assert found > 2 and dm.batch_size == found  # it doubled the batch and kept the result
    several = L.Trainer(accelerator="cpu", devices=2, strategy="superoffload", logger=False)
    assert several._accelerator_connector.is_distributed is True
    plain_ddp = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False)
    assert plain_ddp._accelerator_connector.is_distributed is True  # Lightning's answer for its own strategies


def test_updates_on_host_is_known_before_the_first_step():
    """ActivationOffload reads it at fit start, before the layout is built (no module: built at the first step)."""
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    opt = HeterogeneousAdamW(p, gpu_fraction=0.0)
    assert not opt.layout.built and opt.updates_on_host
    assert not HeterogeneousAdamW([torch.nn.Parameter(torch.randn(4, 4))], gpu_fraction=1.0).updates_on_host
    p[0].grad = torch.randn(4, 4)
    opt.step()
    opt.synchronize()
    assert opt.layout.built and opt.updates_on_host
    opt.close()
