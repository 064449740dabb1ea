"""fp8 training through torchao: ``convert_to_float8_training`` with a named recipe, as a Lightning precision plugin.

torchao swaps the chosen ``nn.Linear`` layers for ``Float8Linear`` (a subclass: same parameters, same
``state_dict`` keys) whose matmuls cast both operands to float8 with dynamic scales and run
``torch._scaled_mm``. Everything else runs under bf16 autocast, like ``bf16-mixed``. The casts are separate
kernels in eager mode, so torchao fp8 only pays off under ``torch.compile``, which fuses them into the
neighbouring ops (eager it is slower than bf16; measured figures in ``docs/precision.md``). So on a model that is
not compiled the plugin compiles each converted transformer block in place at setup (regional compilation, see
``regional``); ``compile_blocks=False`` turns that off, with a warning saying what it costs.

Recipes (``Float8LinearConfig.from_recipe_name``):
  ``tensorwise``          one scale per tensor; fastest; supports FSDP2 float8 all-gather.
  ``rowwise``             one scale per row; more accurate with outliers, slower.
  ``rowwise_with_gw_hp``  row-wise, and the weight-gradient GEMM stays in bf16.

Example::

    trainer = L.Trainer(plugins=[lgh.precision("fp8-ao-tensorwise")])
    trainer.fit(model, dm)   # an eager model: its decoder blocks are compiled in place after conversion

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
import weakref
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generator, Literal, Mapping

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_gh._hf import keep_causal_sdpa
from lightning_gh._lightning import is_compiled, trainer_of
from lightning_gh.precision.base import Float8PrecisionBase
from lightning_gh.precision.checks import ao_missing_reason
from lightning_gh.precision.layer_filter import LayerPlan
from lightning_gh.precision.options import Float8Options
from lightning_gh.precision.regional import EAGER_COST_NOTE, compile_regions

__all__ = ["TorchAOFloat8Precision", "AO_RECIPES"]

log = logging.getLogger(__name__)

AO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _uses_fsdp2(module: nn.Module) -> bool:
    trainer = trainer_of(module)
    strategy = type(getattr(trainer, "strategy", None)).__name__
    return strategy == "ModelParallelStrategy" or _has_dtensor_params(module)


def _has_dtensor_params(module: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


class TorchAOFloat8Precision(Float8PrecisionBase, MixedPrecision):
    """Train the large ``nn.Linear`` layers in float8 with torchao, the rest in bf16 autocast.

    Args:
        recipe: ``"tensorwise"`` (the default), ``"rowwise"`` or ``"rowwise_with_gw_hp"``.
        fsdp_float8_all_gather: all-gather FSDP2-sharded weights in float8 and precompute their scales after
            each optimizer step. ``None`` (default): on when the recipe is tensorwise and the Trainer's strategy is
            ``ModelParallelStrategy`` (FSDP2). Only the tensorwise recipe supports it.
        compile_blocks: on a model that is not compiled, ``torch.compile`` each transformer block holding fp8
            layers in place after conversion (once, at setup), so the float8 casts fuse and fp8 beats bf16.
            ``True`` (default), ``False`` (eager fp8, slower than bf16-mixed: warns once), or a dict of
            ``torch.compile`` arguments (e.g. ``{"mode": "max-autotune-no-cudagraphs"}``). Ignored when the model
            is compiled already.
        convert_only_if_compiled: with ``compile_blocks=False``, leave an uncompiled model in bf16-mixed (with a
            warning) instead of training it in slow eager fp8.
        causal_sdpa: on a model you compiled, let the Hugging Face decoders in it (Llama, Mistral, Qwen2/3 with
            SDPA attention) keep SDPA's causal flash path, as they do eagerly, instead of the explicit causal mask
            transformers builds under ``torch.compile`` (``lightning_gh._hf.keep_causal_sdpa``; applies to calls without
            ``attention_mask``, ``position_ids`` or cache, where the two are the same attention). ``True`` (default)
            or ``False``.
        emulate: emulate the fp8 matmuls in higher precision (torchao's ``emulate``) and skip the hardware check.
            For functional tests on a CPU; never faster.
        config: a full ``torchao.float8.Float8LinearConfig`` instead of ``recipe`` (advanced).
        options: a ready ``Float8Options`` instead of ``recipe`` and the keyword arguments of ``**kwargs``.
        **kwargs: what every fp8 plugin takes (``name``, ``layer_filter``, ``include``, ``exclude``, ``skip_head``,
            ``skip_first``, ``min_dim``: see ``Float8Options``).

    Raises:
        ModuleNotFoundError: torchao is not installed (``pip install 'lightning-gh[ao]'``).
        TypeError: an unknown option, or ``options`` together with keywords that change it.
        FP8UnavailableError: at setup, when the Trainer's device has no fp8 tensor cores.

    Example::

        plugin = TorchAOFloat8Precision("rowwise", exclude=["*.w2"])
        trainer = L.Trainer(plugins=[plugin])
    """

    precision: Literal["bf16-mixed"] = "bf16-mixed"
    backend = "ao"
    backend_label = "torchao"
    recipes = AO_RECIPES

    def __init__(
        self,
        recipe: str | None = None,
        *,
        fsdp_float8_all_gather: bool | None = None,
        compile_blocks: bool | Mapping[str, Any] = True,
        convert_only_if_compiled: bool = False,
        causal_sdpa: bool = True,
        emulate: bool = False,
        config: Any = None,
        options: Float8Options | None = None,
        **kwargs: Any,
    ) -> None:
        Float8PrecisionBase.__init__(self, recipe, options=options, **kwargs)
        if fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(f"TorchAOFloat8Precision(fsdp_float8_all_gather=True) needs recipe='tensorwise', "
                             f"got recipe={self.recipe!r}.")
        for arg, value in (("convert_only_if_compiled", convert_only_if_compiled), ("causal_sdpa", causal_sdpa),
                           ("emulate", emulate)):
            if not isinstance(value, bool):
                raise ValueError(f"TorchAOFloat8Precision({arg}={value!r}): expected True or False.")
        if not isinstance(compile_blocks, (bool, Mapping)):
            raise ValueError(f"TorchAOFloat8Precision(compile_blocks={compile_blocks!r}): expected True, False or a "
                             "dict of torch.compile arguments.")
        missing = ao_missing_reason()
        if missing:
            raise ModuleNotFoundError(f"precision {self.name!r} needs torchao. {missing}")
        MixedPrecision.__init__(self, "bf16-mixed", device="cuda")
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.compile_blocks = compile_blocks
        self.convert_only_if_compiled = convert_only_if_compiled
        self.causal_sdpa = causal_sdpa
        self._causal_sdpa_note = ""
        self._regional = False  # set at setup: the blocks get compiled after conversion
        self.emulate = emulate
        self.config = config
        self._fsdp_precompute = False
        self._fsdp_module: weakref.ref | None = None  # the module whose weights are precomputed (Fabric passes none)

    @classmethod
    def default_name(cls, recipe: str) -> str:
        return f"fp8-ao-{recipe.replace('rowwise_with_gw_hp', 'rowwise-gw-hp')}"

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

    # ---- conversion (the sequence is Float8PrecisionBase's)

    def _check_device(self, device: torch.device) -> None:
        if not self.emulate:
            super()._check_device(device)
        self.device = device.type  # the autocast device (cpu only with emulate=True)

    def _before_conversion(self, module: nn.Module, device: torch.device) -> bool:
        self._regional = False
        self._causal_sdpa_note = ""
        if is_compiled(module):
            if self.causal_sdpa:
                names = keep_causal_sdpa(module)
                if names:
                    self._causal_sdpa_note = (f"; SDPA keeps its causal flash path under torch.compile in "
                                              f"{', '.join(repr(n) for n in names)}")
            return True
        if self.compile_blocks is not False:
            if _has_dtensor_params(module):
                # Compiling blocks FSDP2 has already wrapped is not something we can verify here: say so, run eager.
                rank_zero_warn(f"{self.name}: the model is sharded (FSDP2) and not compiled, so its blocks are not "
                               f"compiled for you; {EAGER_COST_NOTE}. Call block.compile() before fully_shard in "
                               "configure_model.")
                return True
            self._regional = True
            return True
        if self.convert_only_if_compiled:
            rank_zero_warn(f"{self.name}: the model is not compiled and compile_blocks=False; {EAGER_COST_NOTE}, so it "
                           "trains in bf16-mixed instead. Leave compile_blocks=True (the default) or compile the "
                           "model to train in fp8.")
            return False
        rank_zero_warn(f"{self.name}: compile_blocks=False and the model is not compiled, so fp8 runs eagerly: "
                       f"{EAGER_COST_NOTE}. Expect each step to be slower than bf16-mixed. Leave compile_blocks=True "
                       "(the default) or compile the model (e.g. in configure_model).")
        return True

    def _converted_types(self) -> tuple[type, ...]:
        from torchao.float8.float8_linear import Float8Linear

        return (Float8Linear,)

    def _swap_layers(self, module: nn.Module, plan: LayerPlan, device: torch.device) -> dict[str, nn.Module]:
        """Swap the planned layers for ``Float8Linear`` in place with ``convert_to_float8_training``."""
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

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
        self._fsdp_precompute = self._fsdp_precompute or bool(fsdp)
        if fsdp:
            self._fsdp_module = weakref.ref(module)
        return {raw: sub for raw, sub in module.named_modules() if isinstance(sub, Float8Linear)}

    def _token_checks(self) -> bool:
        return not self.emulate  # emulated matmuls have no 16-multiple constraint

    def _after_conversion(self, module: nn.Module, plan: LayerPlan) -> str:
        if self.emulate:
            rank_zero_info(f"{self.name}: emulate=True, fp8 matmuls are emulated (a functional check, not a speed-up).")
        if not self._regional:
            return self._causal_sdpa_note
        from torchao.float8.float8_linear import Float8Linear

        kwargs = self.compile_blocks if isinstance(self.compile_blocks, Mapping) else None
        done = compile_regions(module, lambda m: isinstance(m, Float8Linear), kwargs)
        return f"; {done}" if done else ""

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, model, closure, **kwargs)
        module = model if model is not None else (self._fsdp_module() if self._fsdp_module is not None else None)
        if self._fsdp_precompute and module is not None:  # under Fabric the model is not passed: the one converted
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # One all-reduce for every weight's amax, so the next forward's float8 all-gather has its scales.
            precompute_float8_dynamic_scale_for_fsdp(module)
        return out

    # ---- evaluation: see Note [torchao float8 outside inference mode]

    @contextmanager
    def _eval_context(self) -> Generator[None, None, None]:
        # Note [torchao float8 outside inference mode]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # Lightning runs validation, test and predict under torch.inference_mode() by default. torchao's float8
        # tensors (a tensor subclass) cannot run there: an eager Float8Linear forward dies with
        # "NotImplementedError: attempting to run aten.to.dtype" (tensor subclasses under inference mode,
        # pytorch/pytorch#164872). So the evaluation steps leave inference mode for the model's forward and run it
        # under torch.no_grad() instead (no graph is recorded either way); the loop around them keeps Lightning's
        # mode. Tensors made under inference mode (the batch) are read as usual; only in-place writes to them would
        # be refused, which a forward does not do to its input.
        with torch.inference_mode(False), torch.no_grad(), self.forward_context():
            yield

    def val_step_context(self) -> AbstractContextManager:
        return self._eval_context()

    def test_step_context(self) -> AbstractContextManager:
        return self._eval_context()

    def predict_step_context(self) -> AbstractContextManager:
        return self._eval_context()

