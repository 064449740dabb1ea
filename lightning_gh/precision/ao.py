"""fp8 training through torchao: ``convert_to_float8_training`` with a named recipe, as a Lightning precision plugin.

torchao swaps the chosen ``nn.Linear`` layers for ``Float8Linear`` (a subclass: same parameters, same
``state_dict`` keys) whose matmuls cast both operands to float8 with dynamic scales and run
``torch._scaled_mm``. Everything else runs under bf16 autocast, like ``bf16-mixed``. The casts are separate
kernels in eager mode, so torchao fp8 only pays off under ``torch.compile``, which fuses them into the
neighbouring ops (H200, 4-layer d=4096: 1.31x over compiled bf16, 0.56x eager).

Recipes (``Float8LinearConfig.from_recipe_name``):
  ``tensorwise``          one scale per tensor; fastest; supports FSDP2 float8 all-gather.
  ``rowwise``             one scale per row; more accurate with outliers, slower.
  ``rowwise_with_gw_hp``  row-wise, and the weight-gradient GEMM stays in bf16.

Example::

    trainer = L.Trainer(plugins=[lgh.precision("fp8-ao-tensorwise")])
    trainer.fit(LlamaLM.from_preset("large", compile=True), dm)

With FSDP2 (``ModelParallelStrategy``), convert before sharding so that the float8 all-gather can be used::

    def configure_model(self):
        self.trainer.precision_plugin.convert_layers(self)   # before fully_shard
        for block in self.model.layers:
            fully_shard(block)
        fully_shard(self.model)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal, Mapping

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_gh.precision.layer_filter import LayerFilter, LayerPlan
from lightning_gh.precision.registry import (
    ao_missing_reason,
    is_compiled,
    require_fp8_device,
    token_check_hook,
    trainer_device,
    warn_untested_callbacks,
)

__all__ = ["TorchAOFloat8Precision", "AO_RECIPES"]

log = logging.getLogger(__name__)

AO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _uses_fsdp2(module: nn.Module) -> bool:
    trainer = getattr(module, "_trainer", None)
    strategy = type(getattr(trainer, "strategy", None)).__name__
    return strategy == "ModelParallelStrategy" or _has_dtensor_params(module)


def _has_dtensor_params(module: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


class TorchAOFloat8Precision(MixedPrecision):
    """Train the large ``nn.Linear`` layers in float8 with torchao, the rest in bf16 autocast.

    Args:
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        name: the registry name shown in logs (set by ``lightning_gh.precision``).
        layer_filter: a ``LayerFilter`` (or a dict of its fields); ``include``, ``exclude``, ``skip_head``,
            ``skip_first`` and ``min_dim`` override single fields.
        fsdp_float8_all_gather: all-gather FSDP2-sharded weights in float8 and precompute their scales after
            each optimizer step. ``None`` (default): on when the recipe is tensorwise and the Trainer's strategy is
            ``ModelParallelStrategy`` (FSDP2). Only the tensorwise recipe supports it.
        convert_only_if_compiled: leave the model in bf16-mixed (with a warning) when it is not compiled, since
            eager torchao fp8 is slower than bf16. By default the layers are converted and a warning says the
            model should be compiled (``fp8-auto`` only picks torchao for a compiled model).
        emulate: emulate the fp8 matmuls in higher precision (torchao's ``emulate``) and skip the hardware check.
            For functional tests on a CPU; never faster.
        config: a full ``torchao.float8.Float8LinearConfig`` instead of ``recipe`` (advanced).

    Raises:
        ModuleNotFoundError: torchao is not installed (``pip install 'lightning-gh[ao]'``).
        FP8UnavailableError: at setup, when the Trainer's device has no fp8 tensor cores.

    Example::

        plugin = TorchAOFloat8Precision("rowwise", exclude=["*.w2"])
        trainer = L.Trainer(plugins=[plugin])
    """

    precision: Literal["bf16-mixed"] = "bf16-mixed"

    def __init__(
        self,
        recipe: str = "tensorwise",
        *,
        name: str | None = None,
        layer_filter: LayerFilter | Mapping[str, Any] | None = None,
        include: Any = None,
        exclude: Any = None,
        skip_head: bool | None = None,
        skip_first: bool | None = None,
        min_dim: int | None = None,
        fsdp_float8_all_gather: bool | None = None,
        convert_only_if_compiled: bool = False,
        emulate: bool = False,
        config: Any = None,
    ) -> None:
        if recipe not in AO_RECIPES:
            raise ValueError(f"TorchAOFloat8Precision(recipe={recipe!r}): expected one of {list(AO_RECIPES)}.")
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(f"TorchAOFloat8Precision(fsdp_float8_all_gather=True) needs recipe='tensorwise', "
                             f"got recipe={recipe!r}.")
        for arg, value in (("convert_only_if_compiled", convert_only_if_compiled), ("emulate", emulate)):
            if not isinstance(value, bool):
                raise ValueError(f"TorchAOFloat8Precision({arg}={value!r}): expected True or False.")
        missing = ao_missing_reason()
        if missing:
            raise ModuleNotFoundError(f"precision {name or 'fp8-ao-' + recipe!r} needs torchao. {missing}")
        super().__init__("bf16-mixed", device="cuda")
        self.recipe = recipe
        self.name = name or f"fp8-ao-{recipe.replace('rowwise_with_gw_hp', 'rowwise-gw-hp')}"
        self.layer_filter = LayerFilter.from_options(layer_filter, include=include, exclude=exclude,
                                                     skip_head=skip_head, skip_first=skip_first, min_dim=min_dim)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.convert_only_if_compiled = convert_only_if_compiled
        self.emulate = emulate
        self.config = config
        self.plan: LayerPlan | None = None
        self._fsdp_precompute = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, recipe={self.recipe!r})"

    def float8_config(self, fsdp: bool = False):
        """The ``Float8LinearConfig`` this plugin converts with."""
        from torchao.float8 import Float8LinearConfig

        config = self.config if self.config is not None else Float8LinearConfig.from_recipe_name(self.recipe)
        changes: dict[str, Any] = {}
        if self.emulate:
            changes["emulate"] = True
        if fsdp:
            changes["enable_fsdp_float8_all_gather"] = True
        return dataclasses.replace(config, **changes) if changes else config

    def convert_layers(self, module: nn.Module) -> LayerPlan:
        """Swap the filter's layers for ``Float8Linear`` in place (no hardware check: runs on a CPU too).

        Returns the ``LayerPlan`` (also kept as ``self.plan``): every ``nn.Linear`` with the decision and reason.
        """
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        plan = self.layer_filter.plan(module, already_converted=(Float8Linear,))
        pending = [n for n, d in plan.decisions.items() if d.convert and d.reason != "converted earlier"]
        if pending and _has_dtensor_params(module):
            raise RuntimeError(
                f"precision {self.name!r}: the model is already sharded (FSDP2 DTensor parameters) but "
                f"{len(pending)} layers are not converted yet (e.g. {pending[0]!r}). Convert before sharding: call "
                "`self.trainer.precision_plugin.convert_layers(self)` at the start of configure_model, before "
                "fully_shard.")
        fsdp = self.fsdp_float8_all_gather
        if fsdp is None:
            fsdp = self.recipe == "tensorwise" and _uses_fsdp2(module)
        config = self.float8_config(fsdp=bool(fsdp))
        keep = plan.module_filter_fn()
        convert_to_float8_training(module, config=config,
                                   module_filter_fn=lambda m, fqn: not isinstance(m, Float8Linear) and keep(m, fqn))
        if not self.emulate:
            for raw, sub in module.named_modules():
                if isinstance(sub, Float8Linear) and not getattr(sub, "_lgh_token_check", False):
                    sub.register_forward_pre_hook(token_check_hook(raw, "torchao"))
                    sub._lgh_token_check = True
        self._fsdp_precompute = self._fsdp_precompute or bool(fsdp)
        self.plan = plan
        log.debug("%s converted layers:\n%s", self.name, plan.table())
        return plan

    def convert_module(self, module: nn.Module) -> nn.Module:
        device = trainer_device(module)
        if not self.emulate:
            require_fp8_device(self.name, device, "ao", self.recipe)
        self.device = device.type  # the autocast device (cpu only with emulate=True)
        warn_untested_callbacks(self.name, module)
        if not is_compiled(module):
            if self.convert_only_if_compiled:
                rank_zero_warn(f"{self.name}: the model is not compiled, and torchao fp8 is slower than bf16 "
                               "without torch.compile; training in bf16-mixed instead. Compile the model (e.g. "
                               "torch.compile in configure_model) to train in fp8.")
                return module
            rank_zero_warn(f"{self.name}: the model is not compiled; torchao fp8 needs torch.compile to be faster than "
                           "bf16 (eager fp8 measured 0.56x on an H200). Compile it, e.g. in configure_model.")
        plan = self.convert_layers(module)
        rank_zero_info(f"{self.name}: {plan.summary()}")
        if self.emulate:
            rank_zero_info(f"{self.name}: emulate=True, fp8 matmuls are emulated (a functional check, not a speed-up).")
        return module

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, model, closure, **kwargs)
        if self._fsdp_precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # One all-reduce for every weight's amax, so the next forward's float8 all-gather has its scales.
            precompute_float8_dynamic_scale_for_fsdp(model)
        return out

