"""fp8 training through NVIDIA Transformer Engine, as a Lightning precision plugin.

The plugin swaps the ``nn.Linear`` layers chosen by the shared ``LayerFilter`` for ``te.Linear`` (copying the
weights), casts the module to bf16 as Lightning's ``TransformerEnginePrecision`` does (its speed: bf16 weight reads,
bf16 gradients), and keeps an fp32 master copy of every weight on the optimizer side (``master_weights=True``, the
default; see ``master``): the optimizer updates the fp32 masters, which are cast back into the module after each
step (for Adam / AdamW in one fused pass per weight, ``fused_master_update=True``; see ``fused_master``), and
checkpoints hold them. With ``master_weights=False`` the module keeps the model's own dtype (fp32 weights under
bf16 autocast) unless ``weights_dtype`` says otherwise. The options are ``Float8Options`` and its ``TEOptions``.
It runs each training,
validation and prediction step under bf16 autocast plus Transformer Engine's fp8 autocast with the chosen
recipe. On a model that is not compiled it can compile each transformer block in place (regional compilation):
the elementwise work between the TE GEMMs (norms, rotary embeddings, activations, residual adds) is fused, while
the TE layers run eagerly inside the compiled blocks, a graph break around each. That pays on some models and not
on others, so by default (``compile_blocks="auto"``, see ``block_trial``) the first training steps measure both and
keep the faster. It uses the TE 2.x API
``te.autocast(recipe=...)`` and falls back to ``te.fp8_autocast(fp8_recipe=...)`` on older TE.

Recipes (``transformer_engine.common.recipe``):
  ``delayed``  ``DelayedScaling``: per-tensor scales from an amax history (fastest GEMMs; not traceable by
               torch.compile, so TE layers always run eagerly between compiled regions).
  ``current``  ``Float8CurrentScaling``: per-tensor scales from the tensor being cast (no history to go stale).
  ``block``    ``Float8BlockScaling``: 1x128 activation / 128x128 weight blocks (Hopper, CUDA >= 12.9).
  ``mxfp8`` / ``nvfp4``  Blackwell only; on Hopper they are refused at setup with the reason.

Checkpoints stay plain: converted layers save ``weight`` / ``bias`` under the original names, without TE's
``_extra_state``, so a checkpoint loads into the unconverted model and Lightning can restore it before the
plugin converts (which is the order Lightning uses). DelayedScaling's scales and amax histories travel in the
plugin's own ``state_dict`` instead, as plain tensors (``"te_fp8_meta"``), and are copied back in place on
resume. Plain tensors rather than TE's ``_extra_state``: that is a Python pickle, which recent TE refuses to load
(it could run arbitrary code) unless the user sets ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``; tensors load with
``torch.load(weights_only=True)`` and need no opt-in.

Example::

    trainer = L.Trainer(plugins=[lgh.precision("fp8-te-current")])
    trainer.fit(LlamaLM.from_preset("large"), dm)
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Callable, Generator, Literal, Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from lightning_gh._lightning import is_compiled, trainer_of
from lightning_gh.precision.base import Float8PrecisionBase
from lightning_gh.precision.block_trial import BlockCompileTrial
from lightning_gh.precision.checks import FP8UnavailableError, te_missing_reason
from lightning_gh.precision.fabric import require_trainer
from lightning_gh.precision.layer_filter import LayerDecision, LayerPlan, clean_name
from lightning_gh.precision.master import MasterWeightsMixin
from lightning_gh.precision.options import TE_FIELDS, Float8Options, TEOptions
from lightning_gh.precision.regional import compile_regions, is_region_compiled

__all__ = ["TEFloat8Precision", "TE_RECIPES", "make_recipe", "te_autocast", "fp8_meta_state_dict",
           "load_fp8_meta_state_dict"]

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


def amax_reduction_group(recipe: str) -> Any:
    """The process group whose ranks share DelayedScaling's amax history, or ``None`` (no reduction).

    Under DDP every rank holds the same weights but sees different activations; without a reduction each rank's
    amax history, and so its fp8 scales, drift apart, and replicas quantise the same weights differently. TE
    reduces the histories over this group once per step. Current and block scaling compute scales from the tensor
    at hand (no history), so they need no group; passing one would add a collective per quantised tensor.
    """
    if recipe != "delayed" or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_world_size() < 2:
        return None
    return torch.distributed.group.WORLD


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

        def get_extra_state(self):
            # The plugin keeps the fp8 metadata (as plain tensors, see fp8_meta_state_dict), so the layer offers
            # none: no pickle to write, and _fill_extra_state hands TE's set_extra_state a None, which it skips.
            # Handing back TE's own pickle instead would make recent TE refuse the load once a DelayedScaling
            # layer has state (it will not unpickle without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1).
            return None

        if isolate:
            forward = torch._dynamo.disable(forward)
        name = "EagerTELinear" if isolate else "TELinear"
        cls = type(name, (base,), {"forward": forward, "get_extra_state": get_extra_state, "__module__": __name__,
                                   "__qualname__": name})
        globals()[name] = cls  # importable by name, so a pickled module finds its class
        _CLASSES[key] = cls
    return _CLASSES[key]


def _drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # Plain checkpoints: the TE layer saves exactly what nn.Linear saved.
    state_dict.pop(prefix + "_extra_state", None)


def _fill_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    # Loading a plain (or our own) checkpoint into a converted model: keep the layer's current fp8 state. For our
    # TE layers get_extra_state() is None, which TE's set_extra_state skips in every release.
    key = prefix + "_extra_state"
    if key not in state_dict:
        state_dict[key] = module.get_extra_state()


# ---- DelayedScaling state as plain tensors (no pickle); pure Python over ``module.fp8_meta`` so CPU tests reach it

_META_KEYS = ("scaling_fwd", "scaling_bwd")
_META_FIELDS = ("scale", "scale_inv", "amax_history")  # TE 2.x keeps scale and amax_history; 1.x also scale_inv


def _meta_tensors(module: Any) -> dict[str, Tensor] | None:
    """``{"scaling_fwd.scale": tensor, ...}`` viewing the module's live fp8 meta tensors; None if not initialised."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, Mapping) or any(key not in meta for key in _META_KEYS):
        return None
    found = {f"{key}.{field}": t for key in _META_KEYS for field in _META_FIELDS
             if isinstance(t := getattr(meta[key], field, None), Tensor)}
    return found if any(name.endswith(".amax_history") for name in found) else None


def fp8_meta_state_dict(module: Any) -> dict[str, Any] | None:
    """A TE module's DelayedScaling state (scales, amax histories) as CPU tensor copies, or ``None`` if it has none.

    Reads ``module.fp8_meta["scaling_fwd" | "scaling_bwd"]`` and their ``scale`` / ``amax_history`` (and TE 1.x's
    ``scale_inv``); adds ``num_gemms`` (an int) so that the layout can be rebuilt before the first forward. The result
    holds only tensors and ints: it loads with ``torch.load(weights_only=True)``, unlike TE's pickled
    ``_extra_state``.

    Args:
        module: a Transformer Engine module (anything with an ``fp8_meta`` dict of that shape).

    Example::

        state = fp8_meta_state_dict(te_linear)  # {"scaling_fwd.amax_history": tensor(...), ..., "num_gemms": 1}
    """
    tensors = _meta_tensors(module)
    if tensors is None:
        return None
    state: dict[str, Any] = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
    num_gemms = module.fp8_meta.get("num_gemms")
    if isinstance(num_gemms, int):
        state["num_gemms"] = num_gemms
    return state


def load_fp8_meta_state_dict(module: Any, state: Mapping[str, Any],
                             init: Callable[[Any, Mapping[str, Any]], None] | None = None) -> str | None:
    """Copy a ``fp8_meta_state_dict`` back into ``module``'s fp8 meta tensors, in place; all or nothing.

    In place (``copy_``), because TE's quantizers and its global amax buffer hold views of these very tensors.
    When the module has no fp8 meta tensors yet (no forward has run), ``init(module, state)`` is called first to
    create them. Every name and shape is checked before anything is copied.

    Args:
        module: a Transformer Engine module (anything with an ``fp8_meta`` dict of that shape).
        state: what ``fp8_meta_state_dict`` returned.
        init: creates the module's fp8 meta tensors when they do not exist yet.

    Returns:
        ``None`` when restored, else why not (the module is then unchanged, up to ``init``).

    Example::

        why = load_fp8_meta_state_dict(te_linear, state)
        if why: warnings.warn(f"amax history starts fresh: {why}")
    """
    if not isinstance(state, Mapping):
        return f"expected a dict of tensors, got {type(state).__name__}"
    saved = {name: value for name, value in state.items() if name != "num_gemms"}
    if not saved or not all(isinstance(v, Tensor) for v in saved.values()):
        return "the checkpoint entry holds no fp8 meta tensors"
    live = _meta_tensors(module)
    if live is None and init is not None:
        try:
            init(module, state)
        except Exception as e:  # a TE release whose internals differ: start fresh rather than fail the resume
            return f"could not create the fp8 meta tensors before the first step ({type(e).__name__}: {e})"
        live = _meta_tensors(module)
    if live is None:
        return "the layer has no fp8 meta tensors (no fp8 forward has run)"
    if set(saved) != set(live):
        return f"the checkpoint has {sorted(saved)}, this layer has {sorted(live)}"
    for name, value in saved.items():
        if value.shape != live[name].shape:
            return (f"{name} has shape {tuple(value.shape)} in the checkpoint but {tuple(live[name].shape)} here "
                    "(a different amax_history_len or layer layout)")
    with torch.no_grad():
        for name, value in saved.items():
            live[name].copy_(value)
    return None


def _init_te_fp8_meta(recipe: Any, module: Any, state: Mapping[str, Any]) -> None:
    """Create a TE module's fp8 meta tensors for ``recipe`` before its first forward, as TE's own loader does."""
    num_gemms = state.get("num_gemms")
    if not isinstance(num_gemms, int):
        num_gemms = state["scaling_fwd.amax_history"].shape[-1] // 3  # 3 fp8 tensors per forward GEMM
    module.fp8_meta["num_gemms"] = num_gemms
    module.fp8_meta["recipe"] = recipe
    init = module.init_fp8_meta_tensors
    device = getattr(getattr(module, "weight", None), "device", None)
    with torch.cuda.device(device) if device is not None and device.type == "cuda" else ExitStack():
        if "recipe" in inspect.signature(init).parameters:
            init(recipe)  # TE 2.x
        else:
            init()  # TE 1.x reads fp8_meta["recipe"]


class TEFloat8Precision(MasterWeightsMixin, Float8PrecisionBase):
    """Train the large ``nn.Linear`` layers in fp8 with Transformer Engine, the rest under bf16 autocast.

    Args:
        recipe: ``"delayed"`` (the default), ``"current"``, ``"block"`` (Hopper), ``"mxfp8"`` or ``"nvfp4"``
            (Blackwell).
        options: a ready ``Float8Options`` (with its ``te`` field) instead of ``recipe`` and the keyword arguments.
        **kwargs: the options as keyword arguments: the Transformer Engine ones (``master_weights``,
            ``fused_master_update``, ``weights_dtype``, ``compile_te_layers``, ``compile_blocks``,
            ``recipe_options``: see ``TEOptions``) and what every fp8 plugin takes (``name``, ``layer_filter``,
            ``include``, ``exclude``, ``skip_head``, ``skip_first``, ``min_dim``: see ``Float8Options``).

    Raises:
        ModuleNotFoundError: Transformer Engine is not installed (``pip install 'lightning-gh[te]'``).
        ValueError: a recipe or option value that is not allowed (see ``TEOptions``).
        TypeError: an unknown option, an option of the wrong type, or ``options`` together with keywords.
        FP8UnavailableError: at setup, when the Trainer's device cannot run the recipe.

    Example::

        trainer = L.Trainer(plugins=[TEFloat8Precision("current")])   # bf16 module, fp32 masters in the optimizer
        TEFloat8Precision(options=Float8Options("current", te=TEOptions(compile_blocks=False)))   # the same, eager
    """

    precision: Literal["bf16-mixed"] = "bf16-mixed"
    backend = "te"
    backend_label = "Transformer Engine"
    recipes = TE_RECIPES
    backend_fields = TE_FIELDS

    def __init__(self, recipe: str | None = None, *, options: Float8Options | None = None, **kwargs: Any) -> None:
        super().__init__(recipe, options=options, **kwargs)
        missing = te_missing_reason()
        if missing:
            raise ModuleNotFoundError(f"precision {self.name!r} needs Transformer Engine. {missing}")
        self.te_recipe = make_recipe(self.recipe, **dict(self.te_options.recipe_options or {}))
        self._regional = False  # set at setup: compile the blocks after conversion
        self._block_trial: BlockCompileTrial | None = None  # compile_blocks="auto": decides over the first steps
        self._trial_optimizer: Any = None
        self._converted: dict[str, nn.Module] = {}
        self._pending_fp8_meta: dict[str, Any] | None = None
        self._amax_group: Any = None

    # ---- the options (read-only: see TEOptions)

    @property
    def te_options(self) -> TEOptions:
        """This plugin's Transformer Engine options (``fp8_options.te``, or the defaults)."""
        return self.fp8_options.te or TEOptions()

    @property
    def master_weights(self) -> bool:  # type: ignore[override]
        return self.te_options.master_weights

    @property
    def fused_master_update(self) -> bool:  # type: ignore[override]
        return self.te_options.fused_master_update

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The module's weight dtype after conversion (``None``: the model's own); see ``TEOptions.module_dtype``."""
        return self.te_options.module_dtype()

    @property
    def compile_te_layers(self) -> bool:
        return self.te_options.compile_te_layers

    @property
    def compile_blocks(self) -> bool | str | Mapping[str, Any]:
        return self.te_options.compile_blocks

    @property
    def block_trial(self) -> BlockCompileTrial | None:
        """The ``compile_blocks="auto"`` trial once set up (``None`` before, or with another ``compile_blocks``)."""
        return self._block_trial

    # ---- conversion

    def setup_checks(self, module: nn.Module) -> torch.device:
        # See Note [One plugin object for the Trainer and Fabric]: the masters and the block trial live in the
        # Trainer's optimizer step, which Fabric does not run.
        require_trainer(module, self.name, "its fp32 master weights and compile_blocks='auto' run in the Trainer's "
                        "optimizer step")
        return super().setup_checks(module)

    def _before_conversion(self, module: nn.Module, device: torch.device) -> bool:
        strategy = type(getattr(trainer_of(module), "strategy", None)).__name__
        if strategy in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy"):
            raise ValueError(f"precision {self.name!r} does not support {strategy} yet (it does not shard Transformer "
                             "Engine layers). Use fp8-ao-tensorwise, which supports FSDP2 float8 all-gather, or DDP.")
        self._regional = self.compile_blocks is not False and not is_compiled(module)
        return True

    def _swap_layers(self, module: nn.Module, plan: LayerPlan, device: torch.device) -> dict[str, nn.Module]:
        """Swap the planned ``nn.Linear`` layers for ``te.Linear``, copying weights.

        Layers whose weight is shared with another module (a tied head) stay as they are: a TE copy would untie them.
        """
        counts: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        module_counts: dict[int, int] = {}
        for _, m in module.named_modules(remove_duplicate=False):
            module_counts[id(m)] = module_counts.get(id(m), 0) + 1

        cls = _te_linear_class(isolate=not self.compile_te_layers)
        swapped: dict[str, nn.Module] = {}
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
            new.register_state_dict_post_hook(_drop_extra_state)
            new.register_load_state_dict_pre_hook(_fill_extra_state)
            setattr(parent, child, new)
            self._converted[name] = new
            swapped[name] = new
        return swapped

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

    def _on_native_te(self, names: list[str]) -> None:
        # A model built from TE modules is fp8-ready: the step's te autocast drives them; nothing to swap.
        rank_zero_info(f"{self.name}: {len(names)} Transformer Engine module(s) of the model itself (e.g. "
                       f"{names[0]!r}) are left as they are; they run in fp8 under this plugin's autocast.")

    def _after_conversion(self, module: nn.Module, plan: LayerPlan) -> str:
        if self.weights_dtype is not None:
            module.to(dtype=self.weights_dtype)
        self._restore_fp8_meta()  # a checkpoint entry loaded before conversion
        # DDP launches its processes before setup, so the process group exists here.
        self._amax_group = amax_reduction_group(self.recipe)
        if is_compiled(module):
            how = ("traced by torch.compile (compile_te_layers=True)" if self.compile_te_layers else
                   "run eagerly between compiled regions (a graph break around each; "
                   + ("DelayedScaling cannot be traced" if self.recipe == "delayed" else
                      "pass compile_te_layers=True to trace them") + ")")
            rank_zero_info(f"{self.name}: the model is compiled; its {len(self._converted)} TE layers {how}.")
        note = " (amax histories reduced over the data-parallel group)" if self._amax_group else ""
        return note + self._compile_regions(module)

    def _compile_regions(self, module: nn.Module) -> str:
        """Regional compilation of the blocks holding converted layers; the note for the plan's log line."""
        if not self._regional or not self._converted:
            return ""
        if self.native_te:
            # The user's own TE modules are not isolated from dynamo, and DelayedScaling cannot be traced.
            return "; blocks not compiled: the model has Transformer Engine modules of its own"
        converted = {id(m) for m in self._converted.values()}
        kwargs = self.compile_blocks if isinstance(self.compile_blocks, Mapping) else None
        inside = "" if self.compile_te_layers else ", the TE layers running eagerly inside them"
        if self.compile_blocks == "auto":
            before = {id(m) for m in module.modules() if is_region_compiled(m)}
            strategy = getattr(trainer_of(module), "strategy", None)
            self._block_trial = BlockCompileTrial(
                lambda: compile_regions(module, lambda m: id(m) in converted, kwargs),
                lambda: [m for m in module.modules() if is_region_compiled(m) and id(m) not in before],
                agree=(lambda keep: bool(strategy.broadcast(keep, src=0))) if strategy is not None else None,
                log=rank_zero_info, name=self.name)
            return (f"; blocks eager for the first steps, then compiled in place for a few: kept compiled only if "
                    f"faster (compile_blocks='auto'{inside})")
        done = compile_regions(module, lambda m: id(m) in converted, kwargs)
        if not done:
            return ""
        return f"; {done}{inside}"

    # ---- steps

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, model, closure, **kwargs)
        trial = self._block_trial
        if trial is not None and not trial.done:
            if self._trial_optimizer is None:
                self._trial_optimizer = optimizer  # with several optimizers, one call per training step counts
            if optimizer is self._trial_optimizer:
                trial.step()
        return out

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            stack.enter_context(te_autocast(self.te_recipe, self._amax_group))
            yield

    def convert_input(self, data: Any) -> Any:
        if self.weights_dtype in (None, torch.float32):
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.weights_dtype) if t.is_floating_point() else t)

    # ---- checkpoint: DelayedScaling's scales and amax histories (plain weights are in the model's state_dict)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # the fp32 masters (MasterWeightsMixin)
        if self.recipe != "delayed" or not self._converted:
            return state
        states = {}
        for name, m in self._converted.items():
            meta = fp8_meta_state_dict(m)
            if meta is not None:
                states[name] = meta
        return {**state, "te_fp8_meta": states} if states else state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)  # the fp32 masters (MasterWeightsMixin)
        entry = state_dict.get("te_fp8_meta")
        if not entry:
            return
        if self.recipe != "delayed":
            warnings.warn(f"precision {self.name!r}: the checkpoint holds DelayedScaling amax histories, which recipe "
                          f"{self.recipe!r} does not use; ignored.", UserWarning, stacklevel=2)
            return
        self._pending_fp8_meta = dict(entry)
        if self._converted:  # Lightning restores the plugin after convert_module; else convert_module restores it
            self._restore_fp8_meta()

    def _restore_fp8_meta(self) -> None:
        pending, self._pending_fp8_meta = self._pending_fp8_meta, None
        if not pending:
            return
        init = functools.partial(_init_te_fp8_meta, self.te_recipe)
        problems = {name: load_fp8_meta_state_dict(module, pending[name], init) if name in pending else
                    "not in the checkpoint" for name, module in self._converted.items()}
        problems.update({name: "not converted in this run" for name in pending if name not in self._converted})
        problems = {name: why for name, why in problems.items() if why}
        restored = len(self._converted) - sum(name in self._converted for name in problems)
        if problems:
            shown = "; ".join(f"{name}: {why}" for name, why in list(problems.items())[:3])
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            warnings.warn(f"precision {self.name!r}: could not restore the DelayedScaling scales and amax histories of "
                          f"{len(problems)} layer(s), which start fresh: {shown}{more}.", UserWarning, stacklevel=3)
        log.debug("%s restored the fp8 amax histories of %d layer(s)", self.name, restored)
