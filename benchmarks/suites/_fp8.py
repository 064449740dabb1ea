"""What the three fp8 suites share: the Variant type, the loss recorder, and the clean-up between variants.

``fp8_steps`` (the demo model: timed steps, or loss curves), ``fp8_hf`` (a transformers Llama in a plain
LightningModule, and the optimizer step alone) and ``fp8_gemm`` (one Linear layer) each describe their rows as
:class:`Variant` records; a variant that fails (a missing backend, an out-of-memory error) is a result, not a crash.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.callbacks import Callback

LOSS_TOLERANCE = 0.01
"""Relative: the gap allowed between an fp8 loss curve and bf16-mixed's (moving average, or the mean of the tail)."""

COMPILE_MODES = ("none", "model", "blocks", "model-sdpa", "none-sdpa")


@dataclass(frozen=True)
class Variant:
    """One row of an fp8 suite: how the model is trained, side by side with the others in one process."""

    label: str
    """The row's name in the table."""
    precision: str | None = None
    """A ``Trainer(precision=...)`` string (``"bf16-mixed"``, Lightning's ``"transformer-engine"``); ``None`` when
    ``plugin`` is set."""
    plugin: tuple[str, dict[str, Any]] | None = None
    """``(name, options)`` for ``lightning_gh.precision(name, **options)``."""
    compile: str = "none"
    """``"none"``; ``"model"``: torch.compile of the model (for the demo model: its decoder and loss);
    ``"blocks"``: each decoder layer compiled in place; ``"model-sdpa"`` / ``"none-sdpa"``: as ``"model"`` /
    ``"none"`` with transformers' causal SDPA path kept (``keep_causal_sdpa``)."""
    weights: str = "fp32 master"
    """What the trained weights are, for the table."""
    options: dict[str, Any] = field(default_factory=dict)
    """Suite-specific switches (e.g. ``{"te_default": ("fused_master_update", True)}``)."""

    def __post_init__(self) -> None:
        if (self.precision is None) == (self.plugin is None):
            raise ValueError(f"Variant {self.label!r}: give exactly one of precision= and plugin=")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"Variant {self.label!r}: compile={self.compile!r}; allowed: {COMPILE_MODES}")

    @property
    def backend(self) -> str | None:
        """``"te"`` (Transformer Engine), ``"ao"`` (torchao) or ``None`` (bf16, or ``fp8-auto``'s own choice)."""
        name = self.plugin[0] if self.plugin else self.precision
        if name == "transformer-engine" or name.startswith("fp8-te"):
            return "te"
        return "ao" if name.startswith("fp8-ao") else None

    @property
    def compiled(self) -> bool:
        return self.compile.startswith("model")


class LossRecorder(Callback):
    """Every training step's loss, and a checksum of the first batch (the runs saw the same data)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_batch: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_batch is None:
            self.first_batch = int(batch[0].sum())
        self.losses.append(float(outputs["loss"]))


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"


def reset_backends() -> None:
    """Drop compiled graphs and Transformer Engine's global fp8 buffers between variants."""
    import torch

    torch._dynamo.reset()
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            manager = __import__(mod, fromlist=["FP8GlobalStateManager"]).FP8GlobalStateManager
            manager.reset()
            break
        except Exception:
            continue
    gc.collect()


def fp8_layers(trainer) -> str:
    """``converted/total`` Linear layers of the run's plugin (``"all"`` for Lightning's TE plugin)."""
    plugin = trainer.precision_plugin
    plan = getattr(plugin, "plan", None)
    if plan is not None:
        return f"{len(plan.converted)}/{len(plan.decisions)}"
    if type(plugin).__name__ == "TransformerEnginePrecision":
        return "all"
    return "0"


def plugin_name(trainer) -> str:
    return getattr(trainer.precision_plugin, "name", type(trainer.precision_plugin).__name__)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else "-"
