"""fp8-auto: the setup-time rule, and the hand-over to the chosen plugin inside a real Trainer (on the CPU)."""

from __future__ import annotations

import importlib
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.precision import AutoFloat8Precision, Fp8Choice, choose_fp8
from lightning_gh.precision.checks import ao_missing_reason

TE_GONE, AO_GONE = "Transformer Engine is not installed", "torchao is not installed"


@pytest.mark.parametrize("compiled, strategy, te, ao, expected", [
    (True, "SingleDeviceStrategy", None, None, "fp8-ao-tensorwise"),
    (True, "DDPStrategy", TE_GONE, None, "fp8-ao-tensorwise"),
    (True, "SingleDeviceStrategy", None, AO_GONE, "fp8-te-current"),
    (True, "ModelParallelStrategy", None, None, "fp8-ao-tensorwise"),
    (True, "ModelParallelStrategy", None, AO_GONE, None),
    (False, "SingleDeviceStrategy", None, None, "fp8-te-delayed"),
    (False, "DDPStrategy", None, AO_GONE, "fp8-te-delayed"),
    (False, "SingleDeviceStrategy", TE_GONE, None, "fp8-ao-tensorwise"),  # its blocks compiled in place
    (False, "DDPStrategy", TE_GONE, None, "fp8-ao-tensorwise"),
    (False, "ModelParallelStrategy", None, None, None),
    (False, "SingleDeviceStrategy", TE_GONE, AO_GONE, None),
])
def test_choice_table(compiled, strategy, te, ao, expected):
    choice = choose_fp8(compiled, strategy, te, ao)
    assert choice.name == expected
    assert choice.reason
    if expected is None and not compiled and ao is None:
        assert "compile the blocks" in choice.reason  # says how to get fp8
    if te and ao:
        assert TE_GONE in choice.reason and AO_GONE in choice.reason


def test_only_layer_filter_options_are_taken():
    AutoFloat8Precision(exclude=["*.wo"], min_dim=0)
    with pytest.raises(TypeError, match=r"does not take option\(s\) \['weights_dtype'\].*'min_dim'"):
        AutoFloat8Precision(weights_dtype=torch.bfloat16)


def _fit(plugins, cpu_trainer_kwargs, steps=3, **kw):
    L.seed_everything(0)
    model = LlamaLM.from_preset("tiny")
    trainer = L.Trainer(max_steps=steps, plugins=plugins, **{**cpu_trainer_kwargs, **kw})
    trainer.fit(model, MarkovDataModule.for_model(model))
    return trainer, model, trainer.callback_metrics["train/loss"].item()


def test_on_a_cpu_trainer_it_hands_over_to_bf16_mixed(cpu_trainer_kwargs):
    auto = AutoFloat8Precision(min_dim=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, loss = _fit([auto], cpu_trainer_kwargs)
    fallbacks = [w for w in caught if "falls back to bf16-mixed" in str(w.message)]
    assert len(fallbacks) == 1 and "'cpu'" in str(fallbacks[0].message)
    assert auto.choice == Fp8Choice(None, auto.choice.reason) and isinstance(auto.chosen, MixedPrecision)
    assert trainer.precision_plugin is auto.chosen and trainer.precision == "bf16-mixed"
    _, _, plain = _fit([], cpu_trainer_kwargs, precision="bf16-mixed")
    assert loss == plain  # the chosen plugin really ran the steps: same autocast as Trainer(precision="bf16-mixed")


@pytest.mark.skipif(ao_missing_reason() is not None, reason="torchao is not installed")
def test_hands_over_to_the_chosen_fp8_plugin(cpu_trainer_kwargs, monkeypatch):
    """With the rule forced to torchao (emulated fp8 matmuls, as on a CPU), the Trainer trains with that plugin."""
    from torchao.float8.float8_linear import Float8Linear

    from lightning_gh.precision import TorchAOFloat8Precision

    monkeypatch.setattr(AutoFloat8Precision, "_device_reason", staticmethod(lambda device: None))
    # (the package re-exports the function `precision`, which shadows the subpackage for dotted lookups)
    monkeypatch.setattr(importlib.import_module("lightning_gh.precision.auto"), "choose_fp8",
                        lambda *a: Fp8Choice("fp8-ao-tensorwise", "forced by the test"))
    built = {}

    def build(self, choice, device, precision):
        built["plugin"] = plugin = TorchAOFloat8Precision(emulate=True, compile_blocks={"backend": "aot_eager"},
                                                          **self.options)
        plugin.name = f"fp8-auto ({choice.name})"
        return plugin

    monkeypatch.setattr(AutoFloat8Precision, "_build", build)
    auto = AutoFloat8Precision(min_dim=0)
    trainer, model, loss = _fit([auto], cpu_trainer_kwargs, enable_checkpointing=True)
    assert trainer.precision_plugin is built["plugin"] and trainer.precision_plugin.name == "fp8-auto (fp8-ao-tensorwise)"
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2 * 7 - 3
    assert torch.isfinite(torch.tensor(loss))
    # Resume: a fresh auto plugin chooses again at setup and the chosen plugin takes the checkpoint.
    ckpt = next(cpu_trainer_kwargs["default_root_dir"].rglob("*.ckpt"))
    auto2 = AutoFloat8Precision(min_dim=0)
    model2 = LlamaLM.from_preset("tiny")
    trainer2 = L.Trainer(max_steps=5, plugins=[auto2], **cpu_trainer_kwargs)
    trainer2.fit(model2, MarkovDataModule.for_model(model2), ckpt_path=ckpt)
    assert trainer2.global_step == 5 and trainer2.precision_plugin is built["plugin"]


# ---- the setup trial: the decision from injected timings; the measurement itself needs a GPU


def test_candidates_follow_the_rule_order():
    from lightning_gh.precision.auto import auto_candidates

    assert auto_candidates(False, "SingleDeviceStrategy", None, None) == [
        "fp8-te-delayed", "fp8-te-current", "fp8-ao-tensorwise"]
    # a compiled model: torchao whenever it is usable (no trial between it and TE, whose graph breaks it cannot see)
    assert auto_candidates(True, "SingleDeviceStrategy", None, None) == ["fp8-ao-tensorwise"]
    assert auto_candidates(True, "SingleDeviceStrategy", None, "torchao is not installed") == ["fp8-te-current"]
    assert auto_candidates(True, "FSDPStrategy", None, None) == ["fp8-ao-tensorwise"]
    assert auto_candidates(False, "ModelParallelStrategy", None, None) == []
    assert auto_candidates(False, "SingleDeviceStrategy", TE_GONE, None) == ["fp8-ao-tensorwise"]


def test_measured_timings_override_the_table_and_are_logged_in_the_reason():
    timings = {"bf16": 30.0, "fp8-te-delayed": 20.0, "fp8-te-current": 21.0, "fp8-ao-tensorwise": 18.0}
    choice = choose_fp8(False, "SingleDeviceStrategy", None, None, timings)
    assert choice.name == "fp8-ao-tensorwise"
    assert "fp8-ao-tensorwise 18.00 ms, fp8-te-delayed 20.00 ms" in choice.reason and "bf16 30.00 ms" in choice.reason
    # within 2%: the rule's order decides (TE delayed first for an eager model)
    near = {"fp8-te-delayed": 18.2, "fp8-ao-tensorwise": 18.0}
    assert choose_fp8(False, "SingleDeviceStrategy", None, None, near).name == "fp8-te-delayed"
    # on a compiled model a faster-looking TE layer does not win: the trial cannot see its graph breaks
    compiled_timings = {"bf16": 42.0, "fp8-te-current": 74.0, "fp8-ao-tensorwise": 77.0}
    assert choose_fp8(True, "SingleDeviceStrategy", None, None, compiled_timings).name == "fp8-ao-tensorwise"
    # timings of recipes that cannot run here, or none usable, fall back to the table
    assert choose_fp8(True, "SingleDeviceStrategy", None, None, {"fp8-te-delayed": 1.0}).name == "fp8-ao-tensorwise"
    assert choose_fp8(False, "SingleDeviceStrategy", None, None, {"fp8-te-current": float("nan")}).name == \
        "fp8-te-delayed"


def test_the_trial_runs_only_with_two_candidates_and_a_failure_falls_back(monkeypatch):
    calls = []

    def trial(module, candidates, device):
        calls.append(list(candidates))
        return {c: float(i + 1) for i, c in enumerate(reversed(candidates))}

    auto = AutoFloat8Precision(trial=trial)
    model = torch.nn.Linear(2, 2)
    assert auto._measure(model, ["fp8-ao-tensorwise"], torch.device("cpu")) == {}
    timings = auto._measure(model, ["fp8-te-delayed", "fp8-ao-tensorwise"], torch.device("cpu"))
    assert calls == [["fp8-te-delayed", "fp8-ao-tensorwise"]] and timings["fp8-ao-tensorwise"] == 1.0
    assert AutoFloat8Precision(trial=False)._measure(model, ["a", "b"], torch.device("cpu")) == {}

    def broken(*a):
        raise RuntimeError("no GPU")

    with pytest.warns(UserWarning, match=r"setup trial failed \(RuntimeError: no GPU\); choosing by the table"):
        assert AutoFloat8Precision(trial=broken)._measure(model, ["a", "b"], torch.device("cpu")) == {}
    with pytest.raises(ValueError, match=r"trial_tokens=8.*int >= 16"):
        AutoFloat8Precision(trial_tokens=8)
    with pytest.raises(TypeError, match=r"trial='fast'"):
        AutoFloat8Precision(trial="fast")
    with pytest.raises(TypeError, match=r"trial_tokens=8.5\): expected an int >= 16, got float"):
        AutoFloat8Precision(trial_tokens=8.5)


def test_gemm_shapes_are_the_converted_layers():
    from lightning_gh.demo import Llama, preset
    from lightning_gh.precision import LayerFilter
    from lightning_gh.precision.trial import gemm_shapes

    with torch.device("meta"):
        model = Llama(preset("large"))
    shapes = gemm_shapes(model, LayerFilter())
    assert sum(shapes.values()) == len(LayerFilter().plan(model).converted)
