"""Precision plugins by string: names, errors, list_precisions, the shared layer filter, and fp8-auto."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_gh import hardware
from lightning_gh.demo import Llama, LlamaLM, MarkovDataModule, preset
from lightning_gh.precision import LayerFilter, export_bf16_state_dict, list_precisions, precision, precision_names
from lightning_gh.precision.checks import ao_missing_reason, te_missing_reason
from lightning_gh.precision.names import FP8_NAMES

REQUIRED = ["fp8-te-delayed", "fp8-te-current", "fp8-te-block", "fp8-ao-tensorwise", "fp8-ao-rowwise",
            "fp8-ao-rowwise-gw-hp", "fp8-auto", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "32-true", "64-true",
            "transformer-engine"]
NO_FP8 = hardware.detect().fp8_unsupported_reason() is not None


def meta_llama(name: str, **overrides) -> Llama:
    with torch.device("meta"):
        return Llama(preset(name, **overrides))


# ---------------------------------------------------------------- registry


def test_every_required_name_is_listed_with_a_status():
    listed = list_precisions()
    assert set(REQUIRED) <= set(listed)
    assert list(listed) == precision_names()
    for name, status in listed.items():
        assert isinstance(status, str) and status, name
    for name in ("32-true", "64-true", "bf16-mixed", "bf16-true", "fp8-auto"):
        assert listed[name] == "available"


@pytest.mark.skipif(not NO_FP8, reason="this machine has an fp8 GPU")
def test_fp8_names_say_why_they_cannot_run_here():
    listed = list_precisions()
    why = hardware.detect().fp8_unsupported_reason()
    for name in FP8_NAMES:
        assert why in listed[name], (name, listed[name])
    if te_missing_reason():
        for name in ("fp8-te-delayed", "fp8-te-current", "fp8-te-block", "transformer-engine"):
            assert "pip install 'lightning-gh[te]'" in listed[name]


def test_recipe_reasons_for_blackwell_only_and_block_scaling():
    from lightning_gh.precision.checks import recipe_unsupported_reason

    hopper = hardware.HardwareInfo(True, 0, "NVIDIA H200", (9, 0), 141 * 2**30, 1, True, True, False, "pcie",
                                   "x86_64", 16, "2.11", "13.0")
    assert "Blackwell" in recipe_unsupported_reason("te", "mxfp8", hopper)
    assert "compute capability >= 10.0" in recipe_unsupported_reason("te", "nvfp4", hopper)
    ada = hardware.HardwareInfo(True, 0, "NVIDIA L4", (8, 9), 24 * 2**30, 1, True, False, False, "pcie",
                                "x86_64", 16, "2.11", "13.0")
    assert "9.0" in recipe_unsupported_reason("te", "block", ada)
    assert "Hopper" in recipe_unsupported_reason("ao", "rowwise", ada)
    assert recipe_unsupported_reason("ao", "tensorwise", ada) is None
    assert recipe_unsupported_reason("te", "current", hopper) is None


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        precision("fp8-te-delayd")
    msg = str(err.value)
    assert "'fp8-te-delayd'" in msg
    for name in ("fp8-te-delayed", "fp8-ao-tensorwise", "fp8-auto", "bf16-mixed", "32-true"):
        assert name in msg
    with pytest.raises(TypeError, match="must be a string"):
        precision(16)


@pytest.mark.parametrize(("name", "cls", "flag"), [
    ("bf16-mixed", MixedPrecision, "bf16-mixed"), ("bf16", MixedPrecision, "bf16-mixed"),
    ("16-mixed", MixedPrecision, "16-mixed"), ("BF16-True", HalfPrecision, "bf16-true"),
    ("16-true", HalfPrecision, "16-true"), ("32-true", Precision, "32-true"), ("32", Precision, "32-true"),
    ("64-true", DoublePrecision, "64-true"),
])
def test_lightning_strings_map_to_lightning_plugins(name, cls, flag):
    plugin = precision(name)
    assert type(plugin) is cls
    assert plugin.precision == flag
    if flag == "16-mixed":
        assert plugin.scaler is not None  # fp16 needs loss scaling, as with Trainer(precision="16-mixed")


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['foo'\]; allowed: \['device', 'scaler'\]"):
        precision("bf16-mixed", foo=1)
    with pytest.raises(ValueError, match="allowed: none"):
        precision("32-true", device="cpu")
    with pytest.raises(ValueError, match="the name selects the recipe"):
        precision("fp8-ao-rowwise", recipe="tensorwise")
    with pytest.raises(ValueError, match=r"\['min_dims'\].*'min_dim'"):
        precision("fp8-ao-tensorwise", min_dims=0)
    with pytest.raises(ValueError, match=r"LayerFilter\(min_dim=-1\)"):
        precision("fp8-ao-tensorwise", min_dim=-1)


def test_passthrough_plugin_trains_like_the_string(cpu_trainer_kwargs):
    losses = {}
    for how in ("flag", "plugin"):
        L.seed_everything(0)
        model = LlamaLM.from_preset("tiny")
        kw = dict(precision="bf16-mixed") if how == "flag" else dict(plugins=[precision("bf16-mixed")])
        trainer = L.Trainer(max_steps=3, **kw, **cpu_trainer_kwargs)
        trainer.fit(model, MarkovDataModule.for_model(model))
        assert trainer.precision == "bf16-mixed"
        losses[how] = trainer.callback_metrics["train/loss"].item()
    assert losses["flag"] == losses["plugin"]


@pytest.mark.skipif(te_missing_reason() is None, reason="Transformer Engine is installed")
@pytest.mark.parametrize("name", ["fp8-te-delayed", "fp8-te-current", "fp8-te-block", "transformer-engine"])
def test_missing_transformer_engine_names_the_extra(name):
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-gh\[te\]'"):
        precision(name)


@pytest.mark.skipif(not NO_FP8, reason="this machine has an fp8 GPU")
def test_fp8_auto_falls_back_to_bf16_with_the_reason():
    with pytest.warns(UserWarning, match="fp8-auto' falls back to bf16-mixed: no CUDA GPU"):
        plugin = precision("fp8-auto", min_dim=0)
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed"
    assert plugin.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_importing_the_package_imports_no_optional_backend(fresh_import_report):
    # import lightning_gh, lightning_gh.precision in a fresh interpreter (tests/conftest.py)
    assert fresh_import_report["optional_backends"] == []


# ---------------------------------------------------------------- layer filter


def test_filter_on_the_large_reference_model():
    model = meta_llama("large")
    plan = LayerFilter().plan(model)
    assert len(plan.decisions) == 4 * 7 + 1
    first = "first linear layer (input projection)"
    # wk and wv read the same normalised input as wq: the first projection is the three of them.
    assert plan.skipped == {"layers.0.attn.wq": first, "layers.0.attn.wk": first, "layers.0.attn.wv": first,
                            "head": "output head"}
    assert plan.converted[0] == "layers.0.attn.wo" and "layers.1.attn.wq" in plan.converted
    d = plan.decisions["layers.2.mlp.w2"]
    assert (d.in_features, d.out_features, d.convert, d.reason) == (14336, 4096, True, "converted")
    assert plan.summary().startswith("25 of 29 nn.Linear layers in fp8")


def test_filter_first_projection_siblings_and_vocab_sized_head():
    class HFStyle(nn.Module):
        """A head that is not last in module order, and q/k/v named like Hugging Face models."""

        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(512, 64)
            self.lm_head = nn.Linear(64, 512)
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
            self.o_proj = nn.Linear(64, 64)  # same in_features but reads the attention output: not a sibling
            self.up = nn.Linear(64, 128)
            self.down = nn.Linear(128, 64)

    plan = LayerFilter(min_dim=0).plan(HFStyle())
    assert plan.decisions["lm_head"].reason == "output head"
    assert plan.decisions["down"].reason == "output head"  # last in module order
    first = "first linear layer (input projection)"
    # lm_head comes first in module order but is the head: the first projection is q/k/v
    assert plan.skipped == {"lm_head": "output head", "q_proj": first, "k_proj": first, "v_proj": first,
                            "down": "output head"}
    assert plan.converted == ["o_proj", "up"]
    plan = LayerFilter(min_dim=0, skip_head=False).plan(HFStyle())
    assert plan.skipped == {"q_proj": first, "k_proj": first, "v_proj": first}

    fused = nn.ModuleDict({"attn": nn.ModuleDict({"c_attn": nn.Linear(64, 192), "c_proj": nn.Linear(64, 64)}),
                           "out": nn.Linear(64, 64)})
    plan = LayerFilter(min_dim=0, skip_head=False).plan(fused)
    assert plan.skipped == {"attn.c_attn": "first linear layer (input projection)"}  # no q/k/v name: alone

    tiny = LayerFilter(min_dim=0).plan(meta_llama("tiny"))  # vocab 64 == dim 64: square layers are not heads
    assert tiny.decisions["layers.1.attn.wo"].convert and tiny.decisions["layers.0.mlp.w2"].convert


def test_filter_skips_gemms_too_small_to_gain():
    plan = LayerFilter().plan(meta_llama("small"))  # dim 512, kv 256, ffn 1408
    assert plan.converted == []
    assert plan.decisions["layers.1.attn.wk"].reason == "too small to gain: min(in, out)=256 < min_dim=1024"
    medium = LayerFilter().plan(meta_llama("medium"))  # dim 2048: every block layer is big enough
    assert len(medium.converted) == 8 * 7 - 3
    everything = LayerFilter(min_dim=0, skip_head=False, skip_first=False).plan(meta_llama("small"))
    assert len(everything.converted) == len(everything.decisions)


def test_filter_include_exclude_patterns():
    model = meta_llama("large")
    plan = LayerFilter(include=["layers.*.mlp.*"], exclude="*.w2").plan(model)
    assert plan.converted == [f"layers.{i}.mlp.{w}" for i in range(4) for w in ("w1", "w3")]
    assert plan.decisions["layers.0.mlp.w2"].reason == "excluded by pattern '*.w2'"
    assert plan.decisions["layers.1.attn.wo"].reason == "not matched by include=['layers.*.mlp.*']"


def test_filter_dimension_rule_and_tied_head():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(64, 64)
            self.mid = nn.Linear(64, 100)
            self.ok = nn.Linear(100 - 4, 64)
            self.out = nn.Linear(64, 64)

    plan = LayerFilter(min_dim=0).plan(Odd())
    assert plan.decisions["mid"].reason == "out_features=100 is not a multiple of 16"
    assert plan.converted == ["ok"]
    tied = meta_llama("small", tie_embeddings=True)
    plan = LayerFilter(min_dim=0, skip_first=False).plan(tied)
    assert plan.decisions["head"].reason == "output head"


def test_filter_names_ignore_torch_compile_wrappers():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    wrapped = nn.ModuleDict({"net": torch.compile(model)})  # compiled lazily: nothing runs here
    plan = LayerFilter(min_dim=0).plan(wrapped)
    assert list(plan.decisions) == ["net.0", "net.1", "net.2"]
    assert plan.converted == ["net.1"]
    assert plan.should_convert("net._orig_mod.1")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(min_dim=-1), ValueError, r"min_dim=-1"), (dict(include=[""]), ValueError, "non-empty string"),
    (dict(min_dim=1.5), TypeError, r"LayerFilter\(min_dim=1.5\): expected an int, got float"),
    (dict(include=[3]), TypeError, "every pattern must be a string, got 3"),
    (dict(include=3), TypeError, "expected a glob string or a sequence of them, got int"),
    (dict(skip_head="yes"), TypeError, r"LayerFilter\(skip_head='yes'\): expected True or False, got str"),
])
def test_filter_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LayerFilter(**kwargs)


def test_filter_from_options():
    f = LayerFilter.from_options({"min_dim": 0}, exclude=["*.wo"])
    assert f == LayerFilter(min_dim=0, exclude=("*.wo",))
    with pytest.raises(TypeError, match=r"\['bogus'\] are not known"):
        LayerFilter.from_options({"bogus": 1})


# ---------------------------------------------------------------- demo part


# ---------------------------------------------------------------- checkpoint hooks (TE layers) and export


def test_checkpoint_hooks_keep_checkpoints_plain():
    """The hooks the TE plugin puts on every converted layer, on a layer with TE-style ``_extra_state``."""
    from lightning_gh.precision.te import _drop_extra_state, _fill_extra_state

    class WithExtraState(nn.Linear):
        restored = None

        def get_extra_state(self):
            return torch.tensor([3.0])

        def set_extra_state(self, state):
            self.restored = state

    net = nn.Sequential(nn.Linear(4, 4), WithExtraState(4, 4))
    assert "1._extra_state" in net.state_dict()
    net[1].register_state_dict_post_hook(_drop_extra_state)
    net[1].register_load_state_dict_pre_hook(_fill_extra_state)
    saved = net.state_dict()
    assert list(saved) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plain.load_state_dict(saved, strict=True)  # the unconverted model takes the checkpoint
    net.load_state_dict(plain.state_dict(), strict=True)  # and the converted one takes a plain checkpoint
    assert torch.equal(net[1].restored, torch.tensor([3.0]))


def test_export_bf16_state_dict_strips_compile_wrappers_and_copies():
    model = LlamaLM.from_preset("tiny", compile=True)
    model.configure_model()
    exported = export_bf16_state_dict(model)
    assert not any("_orig_mod" in k for k in exported)
    assert all(v.dtype == torch.bfloat16 for v in exported.values())
    plain = LlamaLM.from_preset("tiny").to(torch.bfloat16)
    plain.load_state_dict(exported, strict=True)
    exported["model.head.weight"].zero_()
    assert model.model._orig_mod.head.weight.abs().sum() > 0  # a copy, not a view of the training weights


# ---------------------------------------------------------------- structure, options, parts table


def test_fp8_auto_options_are_checked_even_where_fp8_cannot_run():
    with pytest.raises(TypeError, match=r"precision\('fp8-auto'\) does not take option\(s\) \['bogus'\]"):
        precision("fp8-auto", bogus=1)
    with pytest.raises(ValueError, match=r"LayerFilter\(min_dim=-1\)"):
        precision("fp8-auto", min_dim=-1)


def test_float8_options_are_frozen_validated_and_shared():
    from dataclasses import FrozenInstanceError

    from lightning_gh.precision import Float8Options, Float8PrecisionBase, TEOptions, TorchAOFloat8Precision

    opts = Float8Options.build("tensorwise", exclude="*.wo", min_dim=0)
    assert opts.layer_filter == LayerFilter(exclude=("*.wo",), min_dim=0)
    with pytest.raises(FrozenInstanceError):
        opts.recipe = "rowwise"
    with pytest.raises(TypeError, match=r"Float8Options\(layer_filter=3\)"):
        Float8Options("tensorwise", layer_filter=3)
    if ao_missing_reason() is None:
        plugin = TorchAOFloat8Precision(options=opts, emulate=True)
        assert isinstance(plugin, Float8PrecisionBase) and plugin.fp8_options is opts
        assert plugin.recipe == "tensorwise" and plugin.name == "fp8-ao-tensorwise" and plugin.lgh_part == "fp8"
        assert repr(plugin) == "TorchAOFloat8Precision(name='fp8-ao-tensorwise', recipe='tensorwise')"
        with pytest.raises(TypeError, match=r"got both options= and layer_filter=LayerFilter\(.*min_dim=0\)"):
            TorchAOFloat8Precision(options=opts, min_dim=0)
        with pytest.raises(TypeError, match=r"got both options= and recipe='rowwise'"):
            TorchAOFloat8Precision("rowwise", options=opts)
        assert TorchAOFloat8Precision("tensorwise", options=opts, min_dim=1024).fp8_options is opts  # unchanged
        with pytest.raises(TypeError, match=r"unknown option\(s\) \['bogus'\]"):
            TorchAOFloat8Precision(bogus=1)
        with pytest.raises(TypeError, match=r"te=TEOptions.*Transformer Engine plugin's options"):
            TorchAOFloat8Precision(options=Float8Options("tensorwise", te=TEOptions(master_weights=False)))
        with pytest.raises(ValueError, match=r"TorchAOFloat8Precision\(recipe='delayed'\): expected one of"):
            TorchAOFloat8Precision("delayed")


@pytest.mark.skipif(ao_missing_reason() is not None, reason="torchao is not installed")
def test_no_eligible_linear_warns_that_the_model_trains_in_bf16():
    from lightning_gh.precision import TorchAOFloat8Precision

    plugin = TorchAOFloat8Precision(emulate=True)  # default min_dim: the tiny model's layers are all too small
    with pytest.warns(UserWarning, match=r"no nn.Linear layer of the model is eligible for fp8, so it trains in bf16"):
        plugin.convert_layers(LlamaLM.from_preset("tiny"))


@pytest.mark.skipif(ao_missing_reason() is not None, reason="torchao is not installed")
def test_fp8_with_cuda_graph_capture_is_refused_by_the_parts_table():
    from types import SimpleNamespace

    from lightning_gh import CUDAGraphCapture
    from lightning_gh.compat import IncompatiblePartsError
    from lightning_gh.precision import TorchAOFloat8Precision

    model = LlamaLM.from_preset("tiny")
    model._trainer = SimpleNamespace(callbacks=[CUDAGraphCapture()],
                                     strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(IncompatiblePartsError, match=r"CUDAGraphCapture and fp8 cannot be used together"):
        TorchAOFloat8Precision(emulate=True, min_dim=0).convert_module(model)


def test_precision_modules_import_without_a_cycle(fresh_import_report):
    # Each module imports on its own in a fresh interpreter (a forked child, see fresh_import_report in
    # tests/conftest.py), in the orders of PRECISION_IMPORT_ORDERS, where a cycle would fail.
    assert fresh_import_report["codes"] == [0, 0, 0], fresh_import_report["stderr"][-3000:]


def test_lgh_precision_stays_callable_once_the_package_is_imported():
    # Importing the subpackage binds lightning_gh.precision to it, shadowing the lazily exported function.
    import lightning_gh as lgh
    import lightning_gh.precision  # noqa: F401

    plugin = lgh.precision("32-true")
    assert type(plugin).__name__ == "Precision"
    with pytest.raises(ValueError, match="precision name='nope' is not known"):
        lgh.precision("nope")
