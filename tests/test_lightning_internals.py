"""Canaries for every Lightning internal lightning_gh touches (lightning_gh/_lightning.py).

Each test fails, naming what changed, when a Lightning upgrade moves a private name the package relies on.
"""

from __future__ import annotations

import inspect

import lightning as L
import pytest
import torch

from lightning_gh import _lightning
from lightning_gh._lightning import (
    LightningInternalsChanged,
    batches_that_stepped,
    current_hook,
    in_hook,
    is_compiled,
    is_last_training_batch,
    set_closure_result,
    should_update_logs,
    trainer_of,
    unwrap_optimizer,
)
from lightning_gh.demo import LlamaLM, MarkovDataModule


def _fit_with(callback: L.Callback, steps: int = 3) -> L.Trainer:
    model = LlamaLM.from_preset("tiny")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
                        limit_val_batches=0, callbacks=[callback])
    trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=8, batch_size=2))
    return trainer


def test_every_internal_fails_with_a_clear_message():
    with pytest.raises(LightningInternalsChanged, match=r"lightning_gh reads Thing\.missing, which lightning .* does not"):
        _lightning._require(object(), "missing", "Thing")


def test_closure_and_hook_internals_cuda_graph_capture_relies_on():
    """Fails when Lightning changes what CUDAGraphCapture relies on (the closure result, the current hook)."""
    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.loops.optimization.automatic import Closure, _AutomaticOptimization
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.trainer import call

    """Fails when Lightning changes what lightning_gh/_lightning.py relies on."""

    # 1. the loop consumes the closure's cached result after the optimizer_step hook returns
    run_src = inspect.getsource(_AutomaticOptimization.run)
    assert "self._optimizer_step(" in run_src and "closure.consume_result()" in run_src
    assert '"optimizer_step"' in inspect.getsource(_AutomaticOptimization._optimizer_step)
    closure = Closure(step_fn=lambda: None)
    assert closure._result is None
    set_closure_result(closure, torch.tensor(3.0), 2)
    result = closure.consume_result()
    assert result.loss.item() == 1.5 and closure._result is None
    with pytest.raises(TypeError, match="not Lightning's closure"):
        set_closure_result(lambda: None, torch.tensor(1.0), 1)
    # 2. the whole step (closure, clipping, optimizer.step) runs inside the optimizer_step hook
    assert "_wrap_closure" in inspect.getsource(Precision.optimizer_step)
    assert "_clip_gradients" in inspect.getsource(Precision._after_closure)
    # 3. hooks are looked up on the instance, so instance wrappers are honoured
    assert "getattr(pl_module, hook_name)" in inspect.getsource(call._call_lightning_module_hook)
    assert "self.lightning_module.training_step(" in inspect.getsource(Strategy.training_step)
    # 4. self.log keys on _current_fx_name, which the hook callers set
    module = LlamaLM.from_preset("tiny")
    assert "_current_fx_name" in vars(module)
    assert "self._current_fx_name" in inspect.getsource(LightningModule.log)
    assert "pl_module._current_fx_name = hook_name" in inspect.getsource(call._call_lightning_module_hook)
    with in_hook(module, "training_step"):
        assert current_hook(module) == "training_step"
    assert current_hook(module) is None




def test_trainer_of_and_is_compiled():
    module = LlamaLM.from_preset("tiny")
    assert trainer_of(module) is None and trainer_of(torch.nn.Linear(2, 2)) is None
    assert not is_compiled(module)
    module._compiler_ctx = {"compiler": "dynamo"}  # what Lightning keeps after unwrapping a compiled module
    assert is_compiled(module)
    inner = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))
    assert is_compiled(inner)


def test_fit_loop_and_logging_internals():
    seen: dict[str, list] = {"stepped": [], "last": [], "logs": [], "trainer": []}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["stepped"].append(batches_that_stepped(trainer))
            seen["last"].append(is_last_training_batch(trainer))
            seen["trainer"].append(trainer_of(pl_module) is trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["logs"].append(should_update_logs(trainer))

    _fit_with(Probe(), steps=4)
    assert seen["stepped"] == [0, 1, 2, 3]  # incremented after on_train_batch_end
    assert all(seen["trainer"])
    assert seen["last"] == [False, False, False, True]  # 8 samples / batch 2 = 4 batches in the epoch
    assert seen["logs"] == [False, True, False, True]  # log_every_n_steps=2


def test_optimizer_wrapper():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert unwrap_optimizer(LightningOptimizer(opt)) is opt and unwrap_optimizer(opt) is opt


def test_clip_gradients_route_superoffload_relies_on():
    """Lightning clips through the precision plugin's clip_gradients(optimizer, clip_val, gradient_clip_algorithm)."""
    import inspect

    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.plugins.precision import Precision

    from lightning_gh._lightning import route_clip_gradients

    assert list(inspect.signature(Precision.clip_gradients).parameters)[:4] == [
        "self", "optimizer", "clip_val", "gradient_clip_algorithm"]
    assert "precision_plugin.clip_gradients(" in inspect.getsource(LightningModule.clip_gradients)
    plugin, calls = Precision(), []
    assert route_clip_gradients(plugin, lambda orig, *args: calls.append(args))
    assert not route_clip_gradients(plugin, lambda orig, *args: None)  # once per plugin
    plugin.clip_gradients("opt", 1.0, "norm")
    assert calls == [("opt", 1.0, "norm")]


def test_log_to_loggers_uses_the_logging_step_on_rank_zero():
    from lightning.pytorch.loggers import Logger

    from lightning_gh._lightning import log_to_loggers

    seen: list[tuple[dict, int | None]] = []

    class Recorder(Logger):
        name, version = "rec", 0

        @property
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            seen.append((dict(metrics), step))

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            log_to_loggers(trainer, {"lgh/probe": float(batch_idx)})

    model = LlamaLM.from_preset("tiny")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=Recorder(), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[Probe()])
    trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=8, batch_size=2))
    probes = [(m["lgh/probe"], step) for m, step in seen if "lgh/probe" in m]
    assert probes == [(0.0, 0), (1.0, 1)]  # batches_that_stepped, the step Lightning's own self.log uses here


def test_keep_user_sampler_superoffload_relies_on():
    import lightning as L

    from lightning_gh._lightning import keep_user_sampler

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert trainer._accelerator_connector.use_distributed_sampler is True
    keep_user_sampler(trainer)
    assert trainer._accelerator_connector.use_distributed_sampler is False


def test_is_distributed_asks_a_one_process_strategy():
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    _lightning.let_one_process_strategies_be_local()
    _lightning.let_one_process_strategies_be_local()  # idempotent: wrapped once
    fget = _AcceleratorConnector.__dict__["is_distributed"].fget
    assert getattr(fget, "_lgh_wrapped", False)

    class Local:
        lgh_one_process = True

    class Other:
        pass

    connector = object.__new__(_AcceleratorConnector)
    connector.strategy = Local()
    assert connector.is_distributed is False
    connector.strategy = Other()
    assert connector.is_distributed is False  # Lightning's own answer for a strategy it does not know
