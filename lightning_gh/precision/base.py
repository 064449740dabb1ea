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
from typing import Any, ClassVar

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_gh import _lightning, compat
from lightning_gh._options import resolve
from lightning_gh.precision.checks import require_fp8_device, token_check_hook, trainer_device
from lightning_gh.precision.fabric import FabricCompatible
from lightning_gh.precision.layer_filter import FIELDS as FILTER_FIELDS
from lightning_gh.precision.layer_filter import LayerFilter, LayerPlan
from lightning_gh.precision.options import Float8Options, TEOptions

__all__ = ["Float8PrecisionBase", "te_native_modules"]

log = logging.getLogger(__name__)


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


class Float8PrecisionBase(FabricCompatible, Precision):
    """What every fp8 plugin shares: options, layer filter, ``repr`` and the conversion sequence.

    The same object works under the Trainer and under Lightning Fabric (``Fabric(plugins=[...])``): see
    Note [One plugin object for the Trainer and Fabric] in ``precision.fabric``.

    Args:
        recipe: the backend's recipe name (one of the subclass's ``recipes``; default: the first of them).
        options: a ready ``Float8Options`` instead of ``recipe`` and the keyword arguments.
        **kwargs: the fields of ``Float8Options`` as keyword arguments: ``name``, ``layer_filter`` (a ``LayerFilter``
            or a dict of its fields), its single fields ``include``, ``exclude``, ``skip_head``, ``skip_first``,
            ``min_dim`` (override ``layer_filter``'s), and the backend's own options (``TEOptions``'s fields for the
            Transformer Engine plugin). See ``Float8Options`` for each option and its default.

    Raises:
        ValueError: a recipe the backend does not have, or a bad option value.
        TypeError: an unknown option, or ``options`` together with a keyword that changes it.

    Example::

        plugin = lgh.precision("fp8-ao-tensorwise", exclude=["*.wo"])
        plugin.fp8_options.layer_filter.exclude   # ('*.wo',)
    """

    lgh_part: ClassVar[str] = "fp8"
    precision = "bf16-mixed"  # what runs outside the fp8 layers
    backend: ClassVar[str] = ""  # "te" or "ao", as in the registry's names
    backend_label: ClassVar[str] = ""  # shown in errors: "Transformer Engine", "torchao"
    recipes: ClassVar[tuple[str, ...]] = ()
    backend_fields: ClassVar[tuple[str, ...]] = ()  # keyword arguments that build Float8Options.te (TE plugin only)

    def __init__(self, recipe: str | None = None, *, options: Float8Options | None = None, **kwargs: Any) -> None:
        options = self.resolve_options(recipe, options, **kwargs)
        if self.recipes and options.recipe not in self.recipes:
            raise ValueError(f"{type(self).__name__}(recipe={options.recipe!r}): expected one of {list(self.recipes)}.")
        self.fp8_options = options
        self.name = options.name or self.default_name(options.recipe)
        self.plan: LayerPlan | None = None
        self.native_te: list[str] = []  # Transformer Engine modules the model was built from (left as they are)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The keyword arguments that build this plugin's ``Float8Options`` (besides ``recipe`` and ``options``)."""
        return ("name", "layer_filter", *FILTER_FIELDS, *cls.backend_fields)

    @classmethod
    def resolve_options(cls, recipe: str | None, options: Float8Options | None, **kwargs: Any) -> Float8Options:
        """``options``, or the ``Float8Options`` the keyword arguments build; both at once is a ``TypeError``
        (``lightning_gh._options.resolve``: a keyword that leaves an option at its default does not count)."""
        where = cls.__name__
        unknown = sorted(set(kwargs) - set(cls.option_names()))
        if unknown:
            raise TypeError(f"{where} got unknown option(s) {unknown}; the options are {list(cls.option_names())} "
                            "(or options=Float8Options(...)).")
        given: dict[str, Any] = {}
        if recipe is not None and (options is None or recipe != options.recipe):
            given["recipe"] = recipe
        elif options is None:
            given["recipe"] = cls.recipes[0] if cls.recipes else recipe
        if kwargs.get("name") is not None:
            given["name"] = kwargs["name"]
        filter_fields = {k: kwargs[k] for k in FILTER_FIELDS if kwargs.get(k) is not None}
        if filter_fields or kwargs.get("layer_filter") is not None:
            given["layer_filter"] = LayerFilter.from_options(kwargs.get("layer_filter"), **filter_fields)
        backend = {k: kwargs[k] for k in cls.backend_fields if k in kwargs}
        if backend and TEOptions(**backend) != TEOptions():
            given["te"] = TEOptions(**backend)
        options = resolve(Float8Options, options, where, **given)
        if options.te is not None and not cls.backend_fields:
            raise TypeError(f"{where}(options=...) has te={options.te!r}: those are the Transformer Engine plugin's "
                            "options (TEFloat8Precision); leave te=None here.")
        return options

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
