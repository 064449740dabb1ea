"""The fp8 plugins outside ``trainer.fit``: validate / test / predict under Lightning's default inference mode, and
Lightning Fabric. CPU only: torchao's fp8 matmuls are emulated (``emulate=True``); the blocks stay eager
(``compile_blocks=False``), which is where a converted layer meets inference mode.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_gh.demo import Llama, LlamaLM, MarkovDataModule, preset
from lightning_gh.precision import precision

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*compile_blocks=False:UserWarning")  # eager on purpose here


def eager_ao(**options):
    return precision("fp8-ao-tensorwise", emulate=True, min_dim=0, compile_blocks=False, **options)


class EvalLM(LlamaLM):
    def test_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("test/loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


# ---- validate / test / predict under inference_mode=True: See Note [torchao float8 outside inference mode]


@pytest.mark.parametrize("skip_head", [True, False])
def test_validate_test_and_predict_run_converted_layers_eagerly_under_the_default_inference_mode(
        cpu_trainer_kwargs, skip_head):
    torch.manual_seed(0)
    model = EvalLM.from_preset("tiny")
    dm = MarkovDataModule.for_model(model)
    trainer = L.Trainer(plugins=[eager_ao(skip_head=skip_head)], limit_val_batches=2, limit_test_batches=2,
                        limit_predict_batches=2, **cpu_trainer_kwargs)
    assert trainer.predict_loop.inference_mode  # Lightning's default, kept
    val = trainer.validate(model, dm, verbose=False)  # failed here: NotImplementedError aten.to.dtype
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) > 0
    test = trainer.test(model, dataloaders=dm.val_dataloader(), verbose=False)
    assert test[0]["test/loss"] == pytest.approx(val[0]["val/loss"])  # the same batches
    logits = trainer.predict(model, dataloaders=dm.val_dataloader())
    assert len(logits) == 2 and all(torch.isfinite(x).all() for x in logits)
    assert not any(x.requires_grad for x in logits)  # no graph recorded: no_grad instead of inference mode

    # the same forward by hand under no_grad gives the same logits
    batch = next(iter(dm.val_dataloader()))
    plugin = trainer.precision_plugin
    with torch.no_grad(), plugin.forward_context():
        expected = model(batch[0])
    torch.testing.assert_close(logits[0], expected)


def test_fit_with_validation_runs_under_the_default_inference_mode(cpu_trainer_kwargs):
    model = LlamaLM.from_preset("tiny")
    trainer = L.Trainer(plugins=[eager_ao()], max_steps=2, limit_val_batches=1, val_check_interval=1,
                        **cpu_trainer_kwargs)
    trainer.fit(model, MarkovDataModule.for_model(model))
    assert torch.isfinite(trainer.callback_metrics["val/loss"])


# ---- Lightning Fabric: See Note [One plugin object for the Trainer and Fabric]


def _batches(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
        yield tokens, torch.roll(tokens, -1, dims=1)


CFG = preset("tiny")


def _train(step, n=3):
    return [step(tokens, targets) for tokens, targets in _batches(CFG, n)]


def _loss(model, tokens, targets):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def test_fabric_trains_with_an_fp8_plugin_by_name_as_the_plugin_does_by_hand():
    torch.manual_seed(0)
    model, reference = Llama(CFG), Llama(CFG)
    reference.load_state_dict(model.state_dict())

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[eager_ao()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)  # converts the layers, as the Trainer's setup does
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2 * 7 - 3

    def fabric_step(tokens, targets):
        loss = _loss(model, tokens, targets)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    by_hand = eager_ao()
    by_hand.convert_layers(reference, "cpu")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    def hand_step(tokens, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what the plugin's forward_context is on this device
            loss = _loss(reference, tokens, targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.item()

    assert _train(fabric_step) == _train(hand_step)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_fabric_with_fp8_auto_trains_or_falls_back():
    # On a CPU fp8-auto falls back to bf16-mixed; the plugin it returns works under Fabric all the same.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin = precision("fp8-auto")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Llama(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    tokens, targets = next(_batches(CFG, 1))
    loss = _loss(model, tokens, targets)
    fabric.backward(loss)
    opt.step()
    assert torch.isfinite(loss)


def test_transformer_engine_plugin_is_refused_under_fabric_at_setup(monkeypatch):
    from lightning_gh.precision import te as te_module

    monkeypatch.setattr(te_module, "te_missing_reason", lambda: None)  # no TE here: the refusal comes first
    monkeypatch.setattr(te_module, "make_recipe", lambda recipe, **options: SimpleNamespace())
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[te_module.TEFloat8Precision("current")])
    with pytest.raises(RuntimeError, match=r"'fp8-te-current' needs Lightning's Trainer .*cannot run under "
                                           r"Lightning Fabric.*fp8-ao-tensorwise"):
        fabric.setup(Llama(CFG))


# ---- the same on a GPU: real fp8 matmuls, the plugin's default options (blocks compiled in place)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with fp8 matmuls (compute capability 8.9 or newer)")
def test_validate_test_and_predict_with_default_fp8_on_the_gpu(tmp_path):
    torch.manual_seed(0)
    model = EvalLM.from_preset("small", {"dim": 1024, "ffn_dim": 2816, "n_heads": 16, "n_kv_heads": 8})
    dm = MarkovDataModule.for_model(model)
    trainer = L.Trainer(accelerator="gpu", devices=1, plugins=[precision("fp8-ao-tensorwise")], max_steps=3,
                        limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    assert trainer.predict_loop.inference_mode
    trainer.fit(model, dm)
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) > 0
    val = trainer.validate(model, dm, verbose=False)
    test = trainer.test(model, dataloaders=dm.val_dataloader(), verbose=False)
    assert torch.isfinite(torch.tensor(val[0]["val/loss"]))
    assert test[0]["test/loss"] == pytest.approx(val[0]["val/loss"], rel=1e-3)  # the same batches
    logits = trainer.predict(model, dataloaders=dm.val_dataloader())
    assert len(logits) == 2 and all(torch.isfinite(x.float()).all() for x in logits)
    assert not any(x.requires_grad for x in logits)
