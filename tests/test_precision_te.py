"""fp8 through Transformer Engine. Skipped where TE is not installed; the training tests need an fp8 GPU.

On the GPU machine, after installing TE (see ../shared/gpu/README.md):
    python3 -m pytest -q tests/test_precision_te.py
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_gh.precision import FP8UnavailableError, TEFloat8Precision, export_bf16_state_dict, precision
from lightning_gh import hardware
from lightning_gh.demo import Llama, LlamaLM, MarkovDataModule

te = pytest.importorskip("transformer_engine.pytorch")

FP8_GPU = hardware.detect().fp8_unsupported_reason() is None
needs_fp8 = pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with fp8 tensor cores")
gpu_kwargs = dict(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(model, steps, tmp_path, ckpt_path=None, **kwargs):
    rec = LossRecorder()
    callbacks = [rec, *kwargs.pop("callbacks", [])]
    kw = {**gpu_kwargs, **kwargs}
    trainer = L.Trainer(max_steps=steps, callbacks=callbacks, default_root_dir=tmp_path, **kw)
    trainer.fit(model, MarkovDataModule.for_model(model), ckpt_path=ckpt_path)
    return trainer, rec.losses


def test_compile_with_delayed_scaling_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="DelayedScaling cannot be traced by torch.compile.*fp8-te-current"):
        precision("fp8-te-delayed", compile_te_layers=True)
    with pytest.raises(ValueError, match=r"TEFloat8Precision\(recipe='fp9'\)"):
        TEFloat8Precision("fp9")
    with pytest.raises(ValueError, match="weights_dtype"):
        precision("fp8-te-current", weights_dtype=torch.float16)


@pytest.mark.gpu
def test_conversion_keeps_weights_and_saves_plain_checkpoints():
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny").cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = precision("fp8-te-current", min_dim=0)
    plan = plugin.convert_layers(model, device="cuda")
    converted = [n for n, m in model.named_modules() if isinstance(m, te.Linear)]
    assert converted == plan.converted and len(converted) == 13
    after = model.state_dict()
    assert list(after) == list(before)  # no TE _extra_state, same names: a plain checkpoint
    assert all(torch.equal(after[k], before[k]) for k in before)
    plain = LlamaLM.from_preset("tiny").cuda()
    plain.load_state_dict(after, strict=True)  # and the converted model loads a plain one
    model.load_state_dict(plain.state_dict(), strict=True)


@pytest.mark.gpu
def test_tied_head_is_not_untied():
    model = LlamaLM.from_preset("tiny", overrides={"tie_embeddings": True}).cuda()
    plan = precision("fp8-te-current", min_dim=0, skip_head=False).convert_layers(model, device="cuda")
    assert plan.decisions["model.head"].reason == "weight shared with another module (tied)"
    assert model.model.head.weight is model.model.embed.weight


@needs_fp8
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8-te-delayed", "fp8-te-current", "fp8-te-block"])
def test_trains_close_to_bf16(name, tmp_path):
    curves = {}
    for which in ("bf16-mixed", name):
        L.seed_everything(0)
        model = LlamaLM.from_preset("small", lr=3e-3)
        kwargs = dict(precision="bf16-mixed") if which == "bf16-mixed" else dict(
            plugins=[precision(which, min_dim=0)])
        trainer, curves[which] = fit(model, 30, tmp_path, **kwargs)
    ref, fp8 = curves["bf16-mixed"], curves[name]
    assert ref[-1] < ref[0] - 1.0
    rel = [abs(a - b) / a for a, b in zip(ref[-10:], fp8[-10:])]
    assert max(rel) < 0.02, rel


@needs_fp8
@pytest.mark.gpu
def test_checkpoint_resume_and_bf16_export(tmp_path):
    L.seed_everything(0)
    model = LlamaLM.from_preset("small", lr=3e-3)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", save_last=True)
    plugin = precision("fp8-te-delayed", min_dim=0)
    fit(model, 5, tmp_path, plugins=[plugin], callbacks=[ckpt], enable_checkpointing=True)
    saved = torch.load(tmp_path / "a" / "last.ckpt", weights_only=False)
    assert not any(k.endswith("_extra_state") for k in saved["state_dict"])
    assert "te_extra_state" in saved["TEFloat8Precision"]  # DelayedScaling's amax histories

    resumed = LlamaLM.from_preset("small", lr=3e-3)
    plugin2 = precision("fp8-te-delayed", min_dim=0)
    trainer, losses = fit(resumed, 8, tmp_path, ckpt_path=str(tmp_path / "a" / "last.ckpt"), plugins=[plugin2],
                          callbacks=[ModelCheckpoint(dirpath=tmp_path / "b")], enable_checkpointing=True)
    assert trainer.global_step == 8 and len(losses) == 3
    exported = export_bf16_state_dict(resumed.model)
    plain = Llama(resumed.config).to(device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(exported, strict=True)


@needs_fp8
@pytest.mark.gpu
def test_compiled_model_with_delayed_scaling_runs_te_layers_eagerly(tmp_path):
    L.seed_everything(0)
    model = LlamaLM.from_preset("small", lr=3e-3, compile=True)
    trainer, losses = fit(model, 4, tmp_path, plugins=[precision("fp8-te-delayed", min_dim=0)])
    assert len(losses) == 4 and all(l == l for l in losses)  # noqa: E741 - finite, not NaN


@needs_fp8
@pytest.mark.gpu
def test_blackwell_recipes_are_refused_on_hopper_with_the_reason(tmp_path):
    if hardware.detect().compute_capability >= (10, 0):
        pytest.skip("a Blackwell GPU runs MXFP8")
    model = LlamaLM.from_preset("small")
    with pytest.raises(FP8UnavailableError, match="Blackwell"):
        fit(model, 1, tmp_path, plugins=[precision("fp8-te-mxfp8", min_dim=0)])


@needs_fp8
@pytest.mark.gpu
def test_ragged_batch_fails_with_a_clear_error():
    model = LlamaLM.from_preset("small").cuda()
    plugin = precision("fp8-te-current", min_dim=0)
    plugin.convert_layers(model, device="cuda")
    with plugin.forward_context(), pytest.raises(ValueError, match="multiple of 16"):
        model(torch.randint(100, (1, 10), device="cuda"))
