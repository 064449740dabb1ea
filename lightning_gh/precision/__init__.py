"""Precision plugins by string: fp8 through Transformer Engine or torchao, one shared layer filter, honest
hardware gating, and Lightning's own precisions passed through.

Modules: ``names`` (the names), ``checks`` (availability, hardware gating, setup-time checks), ``layer_filter``,
``options`` (``Float8Options`` and its ``TEOptions``), ``base`` (``Float8PrecisionBase``), ``te`` / ``ao`` /
``auto`` (the fp8 plugins), ``master`` (fp32 master weights for bf16 modules, used by ``te``), ``fused_master``
(their one-pass Adam/AdamW update), ``regional`` (per-block ``torch.compile``, used by ``ao`` and ``te``), ``trial``
(``fp8-auto``'s setup-time timing of the candidates), ``registry`` (``precision()``: names to plugins), ``plugin``
(``Float8Precision`` for config files), ``fabric`` (the same plugins under Lightning Fabric), ``export``. SDPA's
causal path for HF decoders under whole-model ``torch.compile`` (``keep_causal_sdpa``, used by ``ao``) lives in
:mod:`lightning_gh._hf`.

Nothing here imports Transformer Engine or torchao until a plugin that needs one is built.

Example::

    import lightning as L
    import lightning_gh as lgh

    print(lgh.list_precisions())                        # name -> "available" or why not here
    trainer = L.Trainer(plugins=[lgh.precision("fp8-te-current")])
"""

import sys as _sys
import types as _types
from typing import Any as _Any

from lightning_gh._hf import keep_causal_sdpa
from lightning_gh.precision.ao import TorchAOFloat8Precision
from lightning_gh.precision.auto import AutoFloat8Precision, Fp8Choice, choose_fp8
from lightning_gh.precision.base import Float8PrecisionBase
from lightning_gh.precision.checks import FP8UnavailableError, list_precisions
from lightning_gh.precision.export import export_bf16_state_dict
from lightning_gh.precision.fused_master import FusedMasterAdam, fused_adam_unsupported
from lightning_gh.precision.layer_filter import LayerDecision, LayerFilter, LayerPlan
from lightning_gh.precision.master import MasterWeights, MasterWeightsMixin
from lightning_gh.precision.names import precision_names
from lightning_gh.precision.options import Float8Options, TEOptions
from lightning_gh.precision.plugin import Float8Precision
from lightning_gh.precision.registry import precision
from lightning_gh.precision.te import TEFloat8Precision

__all__ = [
    "AutoFloat8Precision",
    "Float8Options",
    "Float8Precision",
    "Float8PrecisionBase",
    "Fp8Choice",
    "FusedMasterAdam",
    "fused_adam_unsupported",
    "choose_fp8",
    "FP8UnavailableError",
    "LayerDecision",
    "LayerFilter",
    "LayerPlan",
    "MasterWeights",
    "MasterWeightsMixin",
    "TEFloat8Precision",
    "TEOptions",
    "TorchAOFloat8Precision",
    "export_bf16_state_dict",
    "keep_causal_sdpa",
    "list_precisions",
    "precision",
    "precision_names",
]


class _CallablePackage(_types.ModuleType):
    """This package, callable as ``precision(name, **options)``.

    ``lightning_gh`` exports the function ``precision`` lazily, under the same name as this package. Once anything
    imports the package (``from lightning_gh.precision import LayerFilter``), Python's import system binds
    ``lightning_gh.precision`` to the package module, shadowing the lazy function; ``lgh.precision("fp8-auto")``
    then still has to work, so the package forwards calls to the function.
    """

    def __call__(self, name: str, **options: _Any) -> _Any:
        return precision(name, **options)


_sys.modules[__name__].__class__ = _CallablePackage
