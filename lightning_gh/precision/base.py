"""The base class of the fp8 precision plugins: shared constructor, layer filter, ``repr`` and conversion sequence.

``Float8PrecisionBase.convert_module`` runs the same steps for every backend (a template method):

1. check that the part combines with the rest of the Trainer (``compat.check(trainer, "fp8")``);
2. check the Trainer's device runs the recipe (``FP8UnavailableError`` naming the device and its capability);
3. plan the layers with the shared ``LayerFilter``, and warn when no ``nn.Linear`` is eligible (the model would
   otherwise train in bf16 without a word);
4. convert the planned layers (the backend's ``_swap_layers``);
5. install the tokens-multiple-of-16 check on every fp8 layer;
6. log the plan.

Subclasses (``TEFloat8Precision``, ``TorchAOFloat8Precision``, ``AutoFloat8Precision``) keep only what differs.

Example::

    class MyFloat8Precision(Float8PrecisionBase):
        backend, backend_label, recipes = "ao", "torchao", ("tensorwise",)

        def _swap_layers(self, module, plan, device):
            ...  # replace plan.converted layers, return {name: fp8 layer}
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Mapping

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_gh import _lightning, compat
from lightning_gh.precision.checks import require_fp8_device, token_check_hook, trainer_device
from lightning_gh.precision.layer_filter import LayerFilter, LayerPlan
from lightning_gh.precision.options import Float8Options

__all__ = ["Float8PrecisionBase", "te_native_modules"]


def te_native_modules(model: nn.Module) -> list[str]:
    """Names of the Transformer Engine modules a model was built from (outermost only), e.g. ``te.Linear`` or
    ``te.TransformerLayer`` written by the user. The plugins leave them as they are: they are fp8-ready already
    (under TE's autocast) and no ``nn.Linear`` swap applies to them. Recognised by their class's module path, so
    this works without importing Transformer Engine.
    """
    found: list[str] = []
    for name, m in model.named_modules():
        if type(m).__module__.startswith("transformer_engine.") and not any(
                name.startswith(f + ".") for f in found):
            found.append(name)
    return found

log = logging.getLogger(__name__)


class Float8PrecisionBase(Precision):
    """What every fp8 plugin shares: options, layer filter, ``repr`` and the conversion sequence.

    Args:
        recipe: the backend's recipe name (one of the subclass's ``recipes``).
        name: the registry name shown in logs (set by ``lightning_gh.precision``).
        layer_filter: a ``LayerFilter`` (or a dict of its fields); ``include``, ``exclude``, ``skip_head``,
            ``skip_first`` and ``min_dim`` override single fields.
        options: a ready ``Float8Options`` instead of ``recipe``, ``name`` and the filter arguments.

    Raises:
        ValueError: a recipe the backend does not have, a bad filter field, or ``options`` mixed with the
            arguments it replaces.

    Example::

        plugin = lgh.precision("fp8-ao-tensorwise", exclude=["*.wo"])
        plugin.fp8_options.layer_filter.exclude   # ('*.wo',)
    """

    lgh_part: ClassVar[str] = "fp8"
    precision = "bf16-mixed"  # what runs outside the fp8 layers
    backend: ClassVar[str] = ""  # "te" or "ao", as in the registry's names
    backend_label: ClassVar[str] = ""  # shown in errors: "Transformer Engine", "torchao"
    recipes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        recipe: str | None = None,
        *,
        name: str | None = None,
        layer_filter: LayerFilter | Mapping[str, Any] | None = None,
        include: Any = None,
        exclude: Any = None,
        skip_head: bool | None = None,
        skip_first: bool | None = None,
        min_dim: int | None = None,
        options: Float8Options | None = None,
    ) -> None:
        fields = dict(name=name, layer_filter=layer_filter, include=include, exclude=exclude, skip_head=skip_head,
                      skip_first=skip_first, min_dim=min_dim)
        if options is not None:
            if not isinstance(options, Float8Options):
                raise ValueError(f"{type(self).__name__}(options={options!r}): expected a Float8Options.")
            mixed = sorted(k for k, v in fields.items() if v is not None)
            if mixed or (recipe is not None and recipe != options.recipe):
                raise ValueError(f"{type(self).__name__}(options=...) replaces recipe, name and the layer filter "
                                 f"arguments; got {mixed or ['recipe']} as well. Pass one or the other.")
        else:
            options = Float8Options.build(self.recipes[0] if recipe is None else recipe, **fields)
        if self.recipes and options.recipe not in self.recipes:
            raise ValueError(f"{type(self).__name__}(recipe={options.recipe!r}): expected one of {list(self.recipes)}.")
        self.fp8_options = options
        self.name = options.name or self.default_name(options.recipe)
        self.plan: LayerPlan | None = None
        self.native_te: list[str] = []  # Transformer Engine modules the model was built from (left as they are)

    @classmethod
    def default_name(cls, recipe: str) -> str:
        """The registry name of ``recipe`` for this backend (``"fp8-te-current"``)."""
        return f"fp8-{cls.backend}-{recipe}"

    @property
    def recipe(self) -> str:
        return self.fp8_options.recipe

    @property
    def layer_filter(self) -> LayerFilter:
        return self.fp8_options.layer_filter

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, recipe={self.recipe!r})"

    # ---- the conversion sequence

    def convert_module(self, module: nn.Module) -> nn.Module:
        device = self.setup_checks(module)
        if not self._before_conversion(module, device):
            return module
        plan = self.convert_layers(module, device)
        note = self._after_conversion(module, plan)
        rank_zero_info(f"{self.name}: {plan.summary()}{note}")
        return module

    def setup_checks(self, module: nn.Module) -> torch.device:
        """Steps 1-2: the parts table, then the device. Returns the device the Trainer trains on."""
        trainer = _lightning.trainer_of(module)
        if trainer is not None:
            compat.check(trainer, self.lgh_part)
        device = trainer_device(module)
        self._check_device(device)
        return device

    def convert_layers(self, module: nn.Module, device: torch.device | str | None = None) -> LayerPlan:
        """Steps 3-5 without the hardware check (so it runs on a CPU too): plan, warn, convert, token checks.

        Returns the ``LayerPlan`` (also kept as ``self.plan``): every ``nn.Linear`` with the decision and reason.
        """
        device = torch.device(device) if device is not None else trainer_device(module)
        plan = self.layer_filter.plan(module, already_converted=self._converted_types())
        self.native_te = te_native_modules(module)
        if self.native_te:
            self._on_native_te(self.native_te)
        if not plan.converted and not self.native_te:
            rank_zero_warn(f"{self.name}: no nn.Linear layer of the model is eligible for fp8, so it trains in "
                           f"bf16-mixed ({plan.summary()}). Loosen the layer filter (e.g. min_dim=0, include=...) or "
                           "use precision 'bf16-mixed'.")
        layers = self._swap_layers(module, plan, device)
        if self._token_checks():
            for name, layer in layers.items():
                if not getattr(layer, "_lgh_token_check", False):
                    layer.register_forward_pre_hook(token_check_hook(name, self.backend_label))
                    layer._lgh_token_check = True
        self.plan = plan
        log.debug("%s converted layers:\n%s", self.name, plan.table())
        return plan

    # ---- what a backend fills in

    def _check_device(self, device: torch.device) -> None:
        require_fp8_device(self.name, device, self.backend, self.recipe)

    def _before_conversion(self, module: nn.Module, device: torch.device) -> bool:
        """Backend checks before converting; ``False`` leaves the model unconverted."""
        return True

    def _converted_types(self) -> tuple[type, ...]:
        """Layer classes that count as converted already (a second ``convert_layers`` call skips them)."""
        return ()

    def _swap_layers(self, module: nn.Module, plan: LayerPlan, device: torch.device) -> dict[str, nn.Module]:
        """Convert the planned layers in place; return the fp8 layers by name (they get the token check)."""
        raise NotImplementedError

    def _token_checks(self) -> bool:
        return True

    def _on_native_te(self, names: list[str]) -> None:
        """The model was built from Transformer Engine modules (``names``), which this plugin leaves as they are."""
        rank_zero_warn(f"{self.name}: the model has {len(names)} Transformer Engine module(s) (e.g. {names[0]!r}), "
                       f"which {self.backend_label} cannot convert; they are left as they are and run without fp8 "
                       "unless under Transformer Engine's autocast. Use an fp8-te-* recipe (or fp8-auto) for them.")

    def _after_conversion(self, module: nn.Module, plan: LayerPlan) -> str:
        """Backend work after converting; returns a note appended to the logged plan summary."""
        return ""
