"""fp8 training through NVIDIA Transformer Engine, as a Lightning precision plugin.

The plugin swaps the ``nn.Linear`` layers chosen by the shared ``LayerFilter`` for ``te.Linear`` (copying the
weights, keeping their dtype: fp32 master weights by default, like ``bf16-mixed``), and runs each training,
validation and prediction step under bf16 autocast plus Transformer Engine's fp8 autocast with the chosen
recipe. It uses the TE 2.x API ``te.autocast(recipe=...)`` and falls back to ``te.fp8_autocast(fp8_recipe=...)``
on older TE.

Recipes (``transformer_engine.common.recipe``):
  ``delayed``  ``DelayedScaling``: per-tensor scales from an amax history (fastest GEMMs; not traceable by
               torch.compile, so TE layers always run eagerly between compiled regions).
  ``current``  ``Float8CurrentScaling``: per-tensor scales from the tensor being cast (no history to go stale).
  ``block``    ``Float8BlockScaling``: 1x128 activation / 128x128 weight blocks (Hopper, CUDA >= 12.9).
  ``mxfp8`` / ``nvfp4``  Blackwell only; on Hopper they are refused at setup with the reason.

Checkpoints stay plain: converted layers save ``weight`` / ``bias`` under the original names, without TE's
``_extra_state``, so a checkpoint loads into the unconverted model and Lightning can restore it before the
plugin converts (which is the order Lightning uses). DelayedScaling's amax histories travel in the plugin's own
``state_dict`` instead, and are restored on resume.

Example::

    trainer = L.Trainer(plugins=[lgh.precision("fp8-te-current")])
    trainer.fit(LlamaLM.from_preset("large"), dm)
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Generator, Literal, Mapping

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from lightning_gh.precision.layer_filter import LayerDecision, LayerFilter, LayerPlan, clean_name
from lightning_gh.precision.registry import (
    FP8UnavailableError,
    is_compiled,
    require_fp8_device,
    te_missing_reason,
    token_check_hook,
    trainer_device,
    warn_untested_callbacks,
)

__all__ = ["TEFloat8Precision", "TE_RECIPES", "make_recipe", "te_autocast"]

log = logging.getLogger(__name__)

TE_RECIPES = ("delayed", "current", "block", "mxfp8", "nvfp4")
_RECIPE_CLASSES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
                   "mxfp8": "MXFP8BlockScaling", "nvfp4": "NVFP4BlockScaling"}


def make_recipe(recipe: str, **options: Any):
    """The Transformer Engine recipe object for a recipe name, with ``options`` passed to its dataclass.

    ``delayed`` and ``current`` default to the HYBRID format (E4M3 forward, E5M2 gradients).
    """
    from transformer_engine.common import recipe as te_recipe

    cls = getattr(te_recipe, _RECIPE_CLASSES[recipe], None)
    if cls is None:
        import transformer_engine

        version = getattr(transformer_engine, "__version__", "?")
        raise FP8UnavailableError(f"Transformer Engine {version} has no {_RECIPE_CLASSES[recipe]} recipe; upgrade it: "
                                  "pip install -U 'transformer-engine[pytorch]'")
    if recipe in ("delayed", "current"):
        options.setdefault("fp8_format", te_recipe.Format.HYBRID)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"recipe_options={options!r} are not valid for {cls.__name__}: {e}") from None


@functools.lru_cache(maxsize=None)
def _autocast_api() -> tuple[Any, bool, bool]:
    """(function, is the TE 2.x ``autocast``, takes a reduction group keyword): looked up once, not per step."""
    import transformer_engine.pytorch as te

    fn = getattr(te, "autocast", None)
    if fn is not None and "recipe" in inspect.signature(fn).parameters:
        return fn, True, "amax_reduction_group" in inspect.signature(fn).parameters
    return te.fp8_autocast, False, True


def te_autocast(recipe: Any, group: Any = None) -> AbstractContextManager:
    """TE's fp8 autocast: ``te.autocast(recipe=...)`` on TE 2.x, else the older ``te.fp8_autocast(fp8_recipe=...)``."""
    fn, new_api, takes_group = _autocast_api()
    if new_api:
        kwargs = {"amax_reduction_group": group} if takes_group and group is not None else {}
        return fn(enabled=True, recipe=recipe, **kwargs)
    kwargs = {"fp8_group": group} if group is not None else {}
    return fn(enabled=True, fp8_recipe=recipe, **kwargs)


_CLASSES: dict[tuple[str, bool], type] = {}


def _te_linear_class(isolate: bool) -> type:
    """``te.Linear``, or a subclass whose forward torch.compile does not trace (a graph break around it).

    Isolation keeps TE's Python-side fp8 state machine (recipe state, amax bookkeeping) out of dynamo, which
    cannot trace DelayedScaling; the GEMMs are cuBLAS calls either way, so little fusion is lost.
    """
    key = ("Linear", isolate)
    if key not in _CLASSES:
        import transformer_engine.pytorch as te

        base = te.Linear

        def forward(self, inp, *args, **kwargs):
            return base.forward(self, inp, *args, **kwargs)

        if isolate:
            forward = torch._dynamo.disable(forward)
        name = "EagerTELinear" if isolate else "TELinear"
        cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # importable by name, so a pickled module finds its class
        _CLASSES[key] = cls
    return _CLASSES[key]


def _drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # Plain checkpoints: the TE layer saves exactly what nn.Linear saved.
    state_dict.pop(prefix + "_extra_state", None)


def _fill_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    # Loading a plain (or our own) checkpoint into a converted model: keep the layer's current fp8 state.
    key = prefix + "_extra_state"
    if key not in state_dict:
        state_dict[key] = module.get_extra_state()


class TEFloat8Precision(Precision):
    """Train the large ``nn.Linear`` layers in fp8 with Transformer Engine, the rest under bf16 autocast.

    Args:
        recipe: ``"delayed"``, ``"current"``, ``"block"`` (Hopper), ``"mxfp8"`` or ``"nvfp4"`` (Blackwell).
        name: the registry name shown in logs (set by ``lightning_gh.precision``).
        layer_filter: a ``LayerFilter`` (or a dict of its fields); ``include``, ``exclude``, ``skip_head``,
            ``skip_first`` and ``min_dim`` override single fields.
        weights_dtype: ``None`` keeps the model's parameter dtype (fp32 master weights, as ``bf16-mixed``);
            ``torch.bfloat16`` casts the whole model to bf16 like Lightning's ``precision="transformer-engine"``
            (half the optimizer traffic, bf16 optimizer state).
        compile_te_layers: let ``torch.compile`` trace into the TE layers (needs a TE release that supports it, and
            a recipe other than ``delayed``). By default TE layers run eagerly between compiled regions.
        recipe_options: extra fields for the TE recipe dataclass, e.g. ``{"amax_history_len": 16}``.

    Raises:
        ModuleNotFoundError: Transformer Engine is not installed (``pip install 'lightning-gh[te]'``).
        FP8UnavailableError: at setup, when the Trainer's device cannot run the recipe.

    Example::

        trainer = L.Trainer(plugins=[TEFloat8Precision("current", weights_dtype=torch.bfloat16)])
    """

    precision: Literal["bf16-mixed"] = "bf16-mixed"

    def __init__(
        self,
        recipe: str = "delayed",
        *,
        name: str | None = None,
        layer_filter: LayerFilter | Mapping[str, Any] | None = None,
        include: Any = None,
        exclude: Any = None,
        skip_head: bool | None = None,
        skip_first: bool | None = None,
        min_dim: int | None = None,
        weights_dtype: torch.dtype | None = None,
        compile_te_layers: bool = False,
        recipe_options: Mapping[str, Any] | None = None,
    ) -> None:
        if recipe not in TE_RECIPES:
            raise ValueError(f"TEFloat8Precision(recipe={recipe!r}): expected one of {list(TE_RECIPES)}.")
        if weights_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"TEFloat8Precision(weights_dtype={weights_dtype!r}): expected None (keep the model's), "
                             "torch.float32 or torch.bfloat16.")
        if not isinstance(compile_te_layers, bool):
            raise ValueError(f"TEFloat8Precision(compile_te_layers={compile_te_layers!r}): expected True or False.")
        if compile_te_layers and recipe == "delayed":
            raise ValueError("TEFloat8Precision(recipe='delayed', compile_te_layers=True): DelayedScaling cannot be "
                             "traced by torch.compile. Use recipe 'current' (fp8-te-current) to compile the TE layers, "
                             "or leave compile_te_layers=False (TE layers then run eagerly between compiled regions).")
        if recipe_options is not None and not isinstance(recipe_options, Mapping):
            raise ValueError(f"TEFloat8Precision(recipe_options={recipe_options!r}): expected a dict.")
        self.name = name or f"fp8-te-{recipe}"
        missing = te_missing_reason()
        if missing:
            raise ModuleNotFoundError(f"precision {self.name!r} needs Transformer Engine. {missing}")
        self.recipe = recipe
        self.te_recipe = make_recipe(recipe, **dict(recipe_options or {}))
        self.layer_filter = LayerFilter.from_options(layer_filter, include=include, exclude=exclude,
                                                     skip_head=skip_head, skip_first=skip_first, min_dim=min_dim)
        self.weights_dtype = weights_dtype
        self.compile_te_layers = compile_te_layers
        self.plan: LayerPlan | None = None
        self._converted: dict[str, nn.Module] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, recipe={self.recipe!r})"

    # ---- conversion

    def convert_layers(self, module: nn.Module, device: torch.device | str | None = None) -> LayerPlan:
        """Swap the filter's ``nn.Linear`` layers for ``te.Linear`` in place, copying weights (no hardware check).

        Layers whose weight is shared with another module (a tied head) stay as they are: a TE copy would untie them.
        """
        device = torch.device(device) if device is not None else trainer_device(module)
        plan = self.layer_filter.plan(module)
        counts: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        module_counts: dict[int, int] = {}
        for _, m in module.named_modules(remove_duplicate=False):
            module_counts[id(m)] = module_counts.get(id(m), 0) + 1

        cls = _te_linear_class(isolate=not self.compile_te_layers)
        for raw, sub in list(module.named_modules()):
            name = clean_name(raw)
            if not isinstance(sub, nn.Linear) or not plan.should_convert(name):
                continue
            if counts.get(id(sub.weight), 0) > 1 or module_counts.get(id(sub), 0) > 1:
                d = plan.decisions[name]
                plan.decisions[name] = LayerDecision(name, d.in_features, d.out_features, False,
                                                     "weight shared with another module (tied)")
                continue
            parent_name, _, child = raw.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            new = self._make_linear(cls, sub, device)
            new.register_forward_pre_hook(token_check_hook(name, "Transformer Engine"))
            new.register_state_dict_post_hook(_drop_extra_state)
            new.register_load_state_dict_pre_hook(_fill_extra_state)
            setattr(parent, child, new)
            self._converted[name] = new
        self.plan = plan
        log.debug("%s converted layers:\n%s", self.name, plan.table())
        return plan

    @staticmethod
    def _make_linear(cls: type, lin: nn.Linear, device: torch.device) -> nn.Module:
        if lin.weight.is_meta:
            raise RuntimeError("TE conversion needs materialised weights; the model is still on the meta device.")
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, params_dtype=lin.weight.dtype,
                  device=device)
        with torch.no_grad():
            new.weight.copy_(lin.weight.detach())
            if lin.bias is not None:
                new.bias.copy_(lin.bias.detach())
        new.weight.requires_grad_(lin.weight.requires_grad)
        new.train(lin.training)
        return new

    def convert_module(self, module: nn.Module) -> nn.Module:
        device = trainer_device(module)
        require_fp8_device(self.name, device, "te", self.recipe)
        strategy = type(getattr(getattr(module, "_trainer", None), "strategy", None)).__name__
        if strategy in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy"):
            raise ValueError(f"precision {self.name!r} does not support {strategy} yet (it does not shard Transformer "
                             "Engine layers). Use fp8-ao-tensorwise, which supports FSDP2 float8 all-gather, or DDP.")
        warn_untested_callbacks(self.name, module)
        plan = self.convert_layers(module, device)
        if self.weights_dtype is not None:
            module.to(dtype=self.weights_dtype)
        rank_zero_info(f"{self.name}: {plan.summary()}")
        if is_compiled(module):
            how = ("traced by torch.compile (compile_te_layers=True)" if self.compile_te_layers else
                   "run eagerly between compiled regions (a graph break around each; "
                   + ("DelayedScaling cannot be traced" if self.recipe == "delayed" else
                      "pass compile_te_layers=True to trace them") + ")")
            rank_zero_info(f"{self.name}: the model is compiled; its {len(self._converted)} TE layers {how}.")
        return module

    # ---- steps

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            stack.enter_context(te_autocast(self.te_recipe))
            yield

    def convert_input(self, data: Any) -> Any:
        if self.weights_dtype in (None, torch.float32):
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.weights_dtype) if t.is_floating_point() else t)

    # ---- checkpoint: DelayedScaling's amax histories (plain weights are in the model's state_dict)

    def state_dict(self) -> dict[str, Any]:
        if self.recipe != "delayed" or not self._converted:
            return {}
        states = {}
        for name, m in self._converted.items():
            state = m.get_extra_state()
            if state is not None:
                states[name] = state
        return {"te_extra_state": states} if states else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for name, state in dict(state_dict.get("te_extra_state", {})).items():
            module = self._converted.get(name)
            if module is not None:
                module.set_extra_state(state)
