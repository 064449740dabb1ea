"""fp8 on models users bring: HF transformers Llama / Mistral / Qwen2 decoders in a plain LightningModule, the demo
model, models built from Transformer Engine modules; and regional compilation of the converted blocks.

CPU only: fp8 matmuls are emulated (torchao's ``emulate=True``), ``fp8-auto`` falls back to bf16-mixed, and the
blocks are compiled with the ``aot_eager`` backend (Inductor takes minutes on this CPU; the GPU figures use it).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.precision import TorchAOFloat8Precision, precision
from lightning_gh.precision.base import te_native_modules
from lightning_gh.precision.regional import compile_regions, find_fp8_blocks, is_region_compiled

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

AOT = {"backend": "aot_eager"}
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def tiny_config(family: str):
    cfg_cls = getattr(transformers, family.replace("ForCausalLM", "Config"))
    return cfg_cls(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, attn_implementation="sdpa")


class HFLM(L.LightningModule):
    """What a user writes around a transformers model: nothing fp8-specific."""

    def __init__(self, family: str = "LlamaForCausalLM") -> None:
        super().__init__()
        self.model = getattr(transformers, family)(tiny_config(family))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data(steps: int) -> torch.utils.data.DataLoader:
    tokens = torch.randint(256, (steps * 2, 16), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(model: L.LightningModule, plugin, steps: int, cpu_trainer_kwargs) -> list[float]:
    rec = _Losses()
    trainer = L.Trainer(max_steps=steps, callbacks=[rec], plugins=[plugin], **cpu_trainer_kwargs)
    trainer.fit(model, _data(steps) if isinstance(model, HFLM) else MarkovDataModule.for_model(model))
    return rec.losses


def _hf(family: str) -> HFLM:
    L.seed_everything(0)
    return HFLM(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_decoders_convert_the_right_layers_and_track_bf16(family, cpu_trainer_kwargs):
    ref = _fit(_hf(family), precision("bf16-mixed", device="cpu"), 4, cpu_trainer_kwargs)
    model = _hf(family)
    plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True, compile_blocks=AOT)
    fp8 = _fit(model, plugin, 4, cpu_trainer_kwargs)
    plan = plugin.plan
    first = {f"model.model.layers.0.self_attn.{p}_proj" for p in "qkv"}
    assert plan.decisions["model.lm_head"].reason == "output head"
    assert {n for n, d in plan.decisions.items() if d.reason.startswith("first linear")} == first
    assert len(plan.converted) == 2 * 7 - 3  # every other projection of both decoder layers
    layers = model.model.model.layers
    assert isinstance(layers[1].mlp.down_proj, Float8Linear) and not isinstance(model.model.lm_head, Float8Linear)
    assert all(is_region_compiled(layer) for layer in layers)
    rel = [abs(a - b) / a for a, b in zip(ref, fp8)]
    assert len(fp8) == 4 and max(rel) < 0.02, rel


@pytest.mark.parametrize("which", ["hf-llama", "demo"])
def test_regional_compile_matches_eager_fp8(which, cpu_trainer_kwargs):
    """Blocks compiled in place compute what the eager fp8 blocks compute (same emulated fp8 numerics)."""
    curves, models = {}, {}
    for blocks in (False, AOT):
        L.seed_everything(0)
        model = HFLM() if which == "hf-llama" else LlamaLM.from_preset("tiny", lr=3e-3)
        plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True, compile_blocks=blocks)
        if blocks is False:
            with pytest.warns(UserWarning, match="compile_blocks=False .* slower than bf16-mixed"):
                curves[blocks is False] = _fit(model, plugin, 3, cpu_trainer_kwargs)
        else:
            curves[blocks is False] = _fit(model, plugin, 3, cpu_trainer_kwargs)
        models[blocks is False] = model
    decoder = models[False].model.model.layers if which == "hf-llama" else models[False].model.layers
    assert all(is_region_compiled(b) for b in decoder)
    eager = models[True].model.model.layers if which == "hf-llama" else models[True].model.layers
    assert not any(is_region_compiled(b) for b in eager)
    torch.testing.assert_close(torch.tensor(curves[False]), torch.tensor(curves[True]), rtol=1e-4, atol=1e-5)


def test_default_compiles_the_blocks_once_at_setup_and_skips_compiled_models():
    model = LlamaLM.from_preset("tiny")
    plugin = TorchAOFloat8Precision(emulate=True, min_dim=0)
    assert plugin.compile_blocks is True
    plugin.convert_module(model)  # torch.compile is lazy: nothing is traced until the first forward
    assert all(is_region_compiled(b) for b in model.model.layers)
    assert not is_region_compiled(model.model.head)
    impls = [b._compiled_call_impl for b in model.model.layers]
    plugin.convert_module(model)  # a second setup (fit called again) compiles nothing twice
    assert [b._compiled_call_impl for b in model.model.layers] == impls

    compiled = LlamaLM.from_preset("tiny", compile=True)
    compiled.configure_model()  # the user compiled the decoder themselves
    TorchAOFloat8Precision(emulate=True, min_dim=0).convert_module(compiled)
    assert not any(is_region_compiled(b) for b in compiled.model._orig_mod.layers)


def test_compile_blocks_option_is_validated():
    with pytest.raises(ValueError, match=r"compile_blocks='yes'.*expected True, False or a dict"):
        TorchAOFloat8Precision(emulate=True, compile_blocks="yes")


def test_blocks_are_found_like_the_layer_filter_and_fall_back_to_layers():
    model = HFLM().model
    TorchAOFloat8Precision(emulate=True, min_dim=0).convert_layers(model)
    name, blocks = find_fp8_blocks(model, lambda m: isinstance(m, Float8Linear))
    assert name == "model.layers" and len(blocks) == 2
    # no repeated block: each fp8 layer is compiled on its own
    flat = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    TorchAOFloat8Precision(emulate=True, min_dim=0, skip_first=False, skip_head=False).convert_layers(flat)
    note = compile_regions(flat, lambda m: isinstance(m, Float8Linear))
    assert "3 fp8 layers one by one" in note and all(is_region_compiled(m) for m in flat if isinstance(m, nn.Linear))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_auto_falls_back_on_cpu_with_an_hf_model(family, cpu_trainer_kwargs):
    with pytest.warns(UserWarning, match="fp8-auto' falls back to bf16-mixed"):
        plugin = precision("fp8-auto", min_dim=0)
    losses = _fit(_hf(family), plugin, 2, cpu_trainer_kwargs)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


# ---- models built from Transformer Engine modules (a fake stands in where TE is not installed)


class FakeTELinear(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x):
        return x @ self.weight.t()


FakeTELinear.__module__ = "transformer_engine.pytorch.module.linear"


class TEBuilt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([FakeTELinear(32), FakeTELinear(32)])
        self.head = nn.Linear(32, 32)


def test_models_built_from_te_modules_are_left_as_they_are():
    model = TEBuilt()
    assert te_native_modules(model) == ["layers.0", "layers.1"]
    plugin = TorchAOFloat8Precision(emulate=True, min_dim=0)
    with pytest.warns(UserWarning, match=r"2 Transformer Engine module\(s\) .* Use an fp8-te-\* recipe"):
        plugin.convert_layers(model)
    assert all(isinstance(m, FakeTELinear) for m in model.layers) and plugin.native_te == ["layers.0", "layers.1"]
