"""The options of the fp8 plugins, in frozen, validated dataclasses: ``Float8Options`` and its ``TEOptions``.

``Float8Options`` holds what the Transformer Engine, torchao and ``fp8-auto`` plugins have in common: the recipe,
the name shown in logs and the layer filter; its ``te`` field holds the options only the Transformer Engine plugin
takes (``TEOptions``). Each field is documented once, here, with its default. The plugins take either a ready
``Float8Options`` as ``options=`` or the same options as keyword arguments (``include=``, ``min_dim=``,
``master_weights=``, ...), never both (``lightning_gh._options.resolve``, a ``TypeError``).

Example::

    >>> from lightning_gh.precision import Float8Options, TEOptions
    >>> Float8Options.build("tensorwise", min_dim=0).layer_filter.min_dim
    0
    >>> opts = Float8Options("current", te=TEOptions(master_weights=False, compile_blocks=False))
    >>> opts.te.module_dtype() is None   # no masters: the module keeps the model's own dtype
    True
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from lightning_gh._options import check_types
from lightning_gh.precision.layer_filter import LayerFilter

__all__ = ["Float8Options", "TEOptions"]


_COMPILE_BLOCKS = "'auto', True, False or a dict of torch.compile arguments"


@dataclass(frozen=True)
class TEOptions:
    """The options only the Transformer Engine plugin (``TEFloat8Precision``) takes.

    Attributes:
        master_weights: keep an fp32 master copy of every bf16 weight on the optimizer side: the module computes
            with bf16 weights (Lightning's ``"transformer-engine"`` speed) while updates are applied in fp32 and
            checkpointed (see ``precision.master``). ``False``: no masters; the module keeps the dtype
            ``weights_dtype`` says.
        fused_master_update: with master weights and a ``torch.optim.Adam`` / ``AdamW`` optimizer, update each fp32
            master, its moments and the module's bf16 weight in one pass that reads the bf16 gradient (see
            ``precision.fused_master``), instead of copying the gradient to fp32, stepping the optimizer and copying
            the weight back. Steps where gradient clipping or an ``on_before_optimizer_step`` hook may read the
            gradients, and other optimizers, keep the plain path. ``False`` is the plain path on every step.
        weights_dtype: the module's weight dtype. ``None``: ``torch.bfloat16`` with master weights, else the model's
            own dtype (fp32 weights under bf16 autocast, as ``bf16-mixed``). ``torch.bfloat16`` without master
            weights trains bf16 weights directly, like Lightning's plugin (small updates are rounded away).
            ``torch.float32`` keeps fp32 weights.
        compile_te_layers: let ``torch.compile`` trace into the TE layers (needs a TE release that supports it, and
            a recipe other than ``delayed``). ``False``: TE layers run eagerly between compiled regions.
        compile_blocks: on a model that is not compiled, ``torch.compile`` each transformer block holding converted
            layers in place (regional compilation, see ``precision.regional``), so the norms, rotary embeddings,
            activations and residual adds between the TE GEMMs are fused; the TE layers themselves still run
            eagerly inside (a graph break around each, unless ``compile_te_layers=True``). ``"auto"``: whether
            that pays depends on the model, so the first training steps measure both and keep the faster (see
            ``precision.block_trial``; under DDP rank 0's measurement decides for all). ``True`` compiles them at
            setup, ``False`` leaves everything eager (Lightning's ``"transformer-engine"`` way), a dict of
            ``torch.compile`` arguments compiles with those. A model compiled by the user, or one built from
            Transformer Engine modules, is left alone.
        recipe_options: extra fields for the TE recipe dataclass, e.g. ``{"amax_history_len": 16}``; ``None``: TE's
            defaults (``delayed`` and ``current`` use the HYBRID format: E4M3 forward, E5M2 gradients).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a ``weights_dtype`` or ``compile_blocks`` value that is not one of those allowed.
    """

    master_weights: bool = True
    fused_master_update: bool = True
    weights_dtype: torch.dtype | None = None
    compile_te_layers: bool = False
    compile_blocks: bool | str | Mapping[str, Any] = "auto"
    recipe_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        check_types(self, allowed={"weights_dtype": "None, torch.float32 or torch.bfloat16",
                                   "compile_blocks": _COMPILE_BLOCKS, "recipe_options": "a dict or None"})
        if self.weights_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"TEOptions(weights_dtype={self.weights_dtype!r}): expected None (keep the model's), "
                             "torch.float32 or torch.bfloat16.")
        if isinstance(self.compile_blocks, str) and self.compile_blocks != "auto":
            raise ValueError(f"TEOptions(compile_blocks={self.compile_blocks!r}): expected {_COMPILE_BLOCKS}.")

    def module_dtype(self) -> torch.dtype | None:
        """The dtype the plugin casts the module to (``None``: the model's own): ``weights_dtype`` as resolved."""
        if self.weights_dtype is None and self.master_weights:
            return torch.bfloat16  # the module computes in bf16; the fp32 masters live in the optimizer
        return self.weights_dtype


TE_FIELDS = tuple(f.name for f in fields(TEOptions))


@dataclass(frozen=True)
class Float8Options:
    """What the fp8 plugins share, and the Transformer Engine plugin's own options.

    Attributes:
        recipe: the backend's recipe (``"delayed"``, ``"tensorwise"``, ...; ``"auto"`` for ``fp8-auto``).
        name: the precision name shown in logs (``"fp8-te-current"``); ``None`` lets the plugin derive it.
        layer_filter: which ``nn.Linear`` layers run in fp8 (see ``LayerFilter`` for its fields and defaults).
        te: the Transformer Engine plugin's own options; ``None``: ``TEOptions()``. Only ``TEFloat8Precision``
            takes them.

    Raises:
        TypeError: a field of the wrong type (``recipe`` that is not a string, ``te`` that is not a ``TEOptions``).
        ValueError: a bad value, or ``te.compile_te_layers=True`` with the ``delayed`` recipe.
    """

    recipe: str
    name: str | None = None
    layer_filter: LayerFilter = LayerFilter()
    te: TEOptions | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layer_filter, LayerFilter):
            raise TypeError(f"Float8Options(layer_filter={self.layer_filter!r}): expected a LayerFilter, got "
                            f"{type(self.layer_filter).__name__}; build one from a dict or keyword arguments with "
                            "Float8Options.build(...).")
        check_types(self)  # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        if not self.recipe:
            raise ValueError(f"Float8Options(recipe={self.recipe!r}): expected a recipe name (a non-empty string).")
        if self.te is not None and self.te.compile_te_layers and self.recipe == "delayed":
            raise ValueError("Float8Options(recipe='delayed', compile_te_layers=True): DelayedScaling cannot be "
                             "traced by torch.compile. Use recipe 'current' (fp8-te-current) to compile the TE layers, "
                             "or leave compile_te_layers=False (TE layers then run eagerly between compiled regions).")

    @classmethod
    def build(cls, recipe: str, *, name: str | None = None,
              layer_filter: LayerFilter | Mapping[str, Any] | None = None, te: TEOptions | None = None,
              **filter_fields: Any) -> Float8Options:
        """The options from the plugins' keyword arguments.

        Args:
            recipe: the backend's recipe name.
            name: the precision name shown in logs.
            layer_filter: a ``LayerFilter`` or a dict of its fields.
            te: the Transformer Engine plugin's own options.
            **filter_fields: ``include``, ``exclude``, ``skip_head``, ``skip_first``, ``min_dim``: override single
                fields of ``layer_filter`` (``None`` keeps it).

        Raises:
            TypeError: an unknown filter field, or one of the wrong type.
            ValueError: a filter field with a bad value.
        """
        return cls(recipe=recipe, name=name, layer_filter=LayerFilter.from_options(layer_filter, **filter_fields),
                   te=te)
