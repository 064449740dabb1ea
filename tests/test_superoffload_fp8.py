"""fp8 precision plugins with strategy="superoffload": bf16 weights on the GPU, fp32 masters in host memory.

torchao's emulation (``emulate=True``) runs the fp8 path on the CPU; the strategy's weights are then bf16 and the
optimizer is SuperOffload's. Tolerance: the losses follow the plain fp8 run (fp32 weights under bf16-mixed, plain
AdamW) within bf16 rounding of the weights, 2% relative over the first steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback

from lightning_gh import compat
from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.precision import precision
from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload.strategy import fit_fp8_weights

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def run(strategy: str | None):
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny")
    plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True, compile_blocks=False)
    losses = Losses()
    kw = {"strategy": strategy} if strategy else {}
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, plugins=[plugin], callbacks=[losses],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, **kw)
    with pytest.warns(UserWarning):  # eager fp8 is slow; SuperOffload off the GPU steps aside
        trainer.fit(model, MarkovDataModule.for_model(model))
    return trainer, model, losses.values


def test_the_table_lets_fp8_and_superoffload_combine():
    assert compat.verdict("fp8", "SuperOffload").combine


def test_torchao_fp8_trains_with_superoffload_and_bf16_weights():
    trainer, model, ours = run("superoffload")
    assert isinstance(trainer.optimizers[0], HeterogeneousAdamW)
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _, _, plain = run(None)
    assert len(ours) == len(plain) == 4
    assert ours[0] == pytest.approx(plain[0], rel=2e-2)
    assert all(abs(a - b) / abs(b) < 2e-2 for a, b in zip(ours, plain))


@pytest.mark.parametrize(
    ("plugin", "refused"),
    [
        (SimpleNamespace(lgh_part="fp8", backend="te", master_weights=True, name="fp8-te-delayed"), True),
        (SimpleNamespace(lgh_part="fp8", backend="te", master_weights=False, name="fp8-te-delayed"), False),
        (SimpleNamespace(lgh_part="fp8", backend="ao", name="fp8-ao-tensorwise"), False),
        (SimpleNamespace(), False),  # not an fp8 plugin: nothing changes
    ],
)
def test_te_with_its_own_masters_is_refused_with_the_way_out(plugin, refused):
    model = torch.nn.Linear(4, 4)
    if refused:
        with pytest.raises(MisconfigurationException, match="master_weights=False"):
            fit_fp8_weights(plugin, model)
        return
    fit_fp8_weights(plugin, model)
    expected = torch.bfloat16 if getattr(plugin, "lgh_part", None) == "fp8" else torch.float32
    assert model.weight.dtype == expected


class HookPlaces(Callback):
    """Where the optimizer's forward pre-hooks sit while training (the optimizer removes them at teardown)."""

    def __init__(self) -> None:
        self.places: dict[str, tuple[int, bool]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_gh.superoffload.layout import WaitBeforeCompiledCall, is_compiled_region

        opt = trainer.strategy._lightning_optimizers[0]._optimizer if trainer.strategy._lightning_optimizers else None
        wrapped = {id(h.module) for h in getattr(opt, "_module_hooks", [])
                   if isinstance(h, WaitBeforeCompiledCall) and h.installed}
        self.places = {name: (len(m._forward_pre_hooks) + (id(m) in wrapped), is_compiled_region(m))
                       for name, m in pl_module.named_modules() if m._forward_pre_hooks or is_compiled_region(m)}


def test_compiled_fp8_blocks_wait_outside_their_graphs():
    """The plugin compiles each fp8 block in place before the strategy builds the optimizer: each block gets one
    wait in front of its compiled call, outside its graph, and its submodules none, so nothing of ours breaks a block's graph (see
    Note [Forward hooks stay out of compiled regions] in lightning_gh.superoffload.layout)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny")
    plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True, compile_blocks={"backend": "eager"})
    hooks = HookPlaces()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, plugins=[plugin], strategy="superoffload",
                        callbacks=[hooks], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0)
    with pytest.warns(UserWarning):  # SuperOffload off the GPU steps aside
        trainer.fit(model, MarkovDataModule.for_model(model))
    assert isinstance(trainer.optimizers[0], HeterogeneousAdamW)
    blocks = [name for name, (_, compiled) in hooks.places.items() if compiled]
    assert blocks and all(hooks.places[b] == (1, True) for b in blocks)
    inside = [name for name in hooks.places if any(name.startswith(b + ".") for b in blocks)]
    assert inside == []
    breaks = " ".join(counters["graph_break"])
    assert "perf_counter" not in breaks and "Condition" not in breaks and "_before_forward" not in breaks, breaks
    assert counters["stats"]["unique_graphs"] >= 1
