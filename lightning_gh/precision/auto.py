"""``fp8-auto``: the fp8 recipe that measured fastest for *this* run, chosen at setup.

Which fp8 backend is fastest depends on things the Trainer only knows once the model is set up: whether the model
is compiled, and which strategy shards it. Measured on an H200 on the ``large`` preset (full Lightning steps, fused
AdamW, fp32 master weights, the default layer filter; ``docs/benchmarks.md``):

=====================  =================================================================  ================
model                  fastest                                                            why not the other
=====================  =================================================================  ================
compiled               ``fp8-ao-tensorwise`` (85.5 ms; 1.27x over compiled bf16)          TE layers break
                                                                                          the graph
not compiled           ``fp8-te-delayed`` (95.5 ms; 1.29x over eager bf16)                eager torchao fp8
                                                                                          is 0.56x (slower)
=====================  =================================================================  ================

So ``fp8-auto`` decides in ``convert_module`` (see :func:`choose_fp8`), builds that plugin with the same layer-filter
options, installs it as the strategy's precision plugin (everything after setup -- autocast, backward, optimizer
step, checkpoint state -- is the chosen plugin's) and logs the choice with its reason. When nothing fits (no fp8 GPU
under the Trainer, no usable backend, an uncompiled model with only torchao installed) it trains in ``bf16-mixed``
and warns once, saying why.

Example::

    trainer = L.Trainer(plugins=[lgh.precision("fp8-auto")])
    trainer.fit(model)                       # log: "fp8-auto chose fp8-te-delayed: the model is not compiled ..."
    trainer.precision_plugin.name            # 'fp8-auto (fp8-te-delayed)'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_gh import hardware
from lightning_gh.precision.layer_filter import FIELDS as FILTER_FIELDS

__all__ = ["AutoFloat8Precision", "Fp8Choice", "choose_fp8", "AUTO_OPTIONS"]

# The options fp8-auto forwards: the layer filter's, which both backends share. Backend-specific options belong to a
# named recipe (``precision("fp8-te-current", weights_dtype=...)``), where the backend is known.
AUTO_OPTIONS = ("layer_filter", *FILTER_FIELDS)
# Strategies that shard parameters: Transformer Engine layers are not sharded by our TE plugin.
_SHARDING = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


@dataclass(frozen=True)
class Fp8Choice:
    """What ``fp8-auto`` picked: ``name`` is an fp8 precision name, or ``None`` for the bf16-mixed fallback."""

    name: str | None
    reason: str


def choose_fp8(compiled: bool, strategy: str, te: str | None, ao: str | None) -> Fp8Choice:
    """The rule ``fp8-auto`` applies at setup (pure, so the table in the module docs is tested as written).

    Args:
        compiled: the model (or a submodule) is under ``torch.compile``.
        strategy: the Trainer's strategy class name.
        te: why Transformer Engine is unusable here, or ``None`` when it is usable.
        ao: the same for torchao.
    """
    sharded = strategy in _SHARDING
    if compiled:
        if ao is None:
            return Fp8Choice("fp8-ao-tensorwise", "the model is compiled: torchao tensorwise fp8 is traced into the "
                                                  "compiled graph (1.27x over compiled bf16 on an H200), while "
                                                  "Transformer Engine layers break it")
        if te is None and not sharded:
            return Fp8Choice("fp8-te-current", "the model is compiled and torchao is not usable "
                                               f"({ao}); current scaling is the TE recipe that compiles")
    else:
        if te is None and not sharded:
            return Fp8Choice("fp8-te-delayed", "the model is not compiled: Transformer Engine's fused fp8 kernels are "
                                               "fast eagerly (1.29x over eager bf16 on an H200), eager torchao fp8 "
                                               "is slower than bf16")
        if ao is None:
            why_not_te = f"Transformer Engine does not support {strategy}" if sharded else f"{te}"
            return Fp8Choice(None, f"the model is not compiled and eager torchao fp8 is slower than bf16 "
                                   f"({why_not_te}); compile the model (torch.compile in configure_model) to train "
                                   "in fp8")
    if sharded and te is None:
        return Fp8Choice(None, f"Transformer Engine does not support {strategy} and torchao is not usable ({ao})")
    return Fp8Choice(None, "no fp8 backend is usable (" + "; ".join(
        f"{n}: {r}" for n, r in (("Transformer Engine", te), ("torchao", ao)) if r) + ")")


class AutoFloat8Precision(Precision):
    """The plugin behind ``precision("fp8-auto")``: picks an fp8 recipe at setup and hands over to it.

    Args:
        **options: layer-filter options (``include``, ``exclude``, ``skip_head``, ``skip_first``, ``min_dim``,
            ``layer_filter``), passed to the chosen plugin.

    After ``Trainer.fit`` has set up, ``trainer.precision_plugin`` is the chosen plugin (its ``name`` reads
    ``"fp8-auto (fp8-...)"``) and ``choice`` on this object says what was picked and why.

    Example::

        trainer = L.Trainer(plugins=[lgh.precision("fp8-auto", exclude=["*.wo"])])
    """

    precision = "bf16-mixed"  # what runs outside the fp8 layers, whichever backend is chosen

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(AUTO_OPTIONS))
        if unknown:
            raise ValueError(f"precision('fp8-auto') does not take option(s) {unknown}; allowed: {list(AUTO_OPTIONS)} "
                             "(backend options need a named recipe, e.g. precision('fp8-te-current', ...)).")
        self.options = dict(options)
        self.name = "fp8-auto"
        self.choice: Fp8Choice | None = None
        self.chosen: Precision | None = None

    def __repr__(self) -> str:
        return f"AutoFloat8Precision(options={self.options}, choice={self.choice})"

    def convert_module(self, module: nn.Module) -> nn.Module:
        from lightning_gh.precision.registry import (
            ao_missing_reason, is_compiled, precision, te_missing_reason, trainer_device)

        device = trainer_device(module)
        trainer = getattr(module, "_trainer", None)
        strategy = type(getattr(trainer, "strategy", None)).__name__
        hw_reason = self._device_reason(device)
        if hw_reason:
            self.choice = Fp8Choice(None, hw_reason)
        else:
            self.choice = choose_fp8(is_compiled(module), strategy, te_missing_reason(), ao_missing_reason())
        self.chosen = self._build(self.choice, device, precision)
        if self.choice.name is None:
            warnings.warn(f"precision 'fp8-auto' falls back to bf16-mixed: {self.choice.reason}.", UserWarning,
                          stacklevel=2)
        else:
            rank_zero_info(f"fp8-auto chose {self.choice.name}: {self.choice.reason}.")
        if trainer is not None:
            # From here on the strategy talks to the chosen plugin (autocast, backward, optimizer step, state).
            trainer.strategy.precision_plugin = self.chosen
        return self.chosen.convert_module(module)

    def _build(self, choice: Fp8Choice, device: Any, precision: Callable[..., Precision]) -> Precision:
        if choice.name is None:
            return precision("bf16-mixed", device=device.type)
        plugin = precision(choice.name, **self.options)
        plugin.name = f"fp8-auto ({choice.name})"
        return plugin

    @staticmethod
    def _device_reason(device: Any) -> str | None:
        if device.type != "cuda":
            return f"the Trainer trains on '{device}', not on an fp8-capable CUDA GPU"
        return hardware.detect(device.index).fp8_unsupported_reason()

    # Before setup nothing of the step has run yet; after it the strategy holds the chosen plugin. These keep a
    # direct caller (e.g. a test driving the plugin by hand after convert_module) on the chosen one as well.
    def forward_context(self):  # type: ignore[override]
        return self.chosen.forward_context() if self.chosen is not None else super().forward_context()

    def state_dict(self) -> dict[str, Any]:
        return self.chosen.state_dict() if self.chosen is not None else {}
