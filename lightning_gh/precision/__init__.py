"""Precision plugins by string: fp8 through Transformer Engine or torchao, one shared layer filter, honest
hardware gating, and Lightning's own precisions passed through.

Nothing here imports Transformer Engine or torchao until a plugin that needs one is built.

Example::

    import lightning as L
    import lightning_gh as lgh

    print(lgh.list_precisions())                        # name -> "available" or why not here
    trainer = L.Trainer(plugins=[lgh.precision("fp8-te-current")])
"""

from lightning_gh.precision.ao import TorchAOFloat8Precision
from lightning_gh.precision.auto import AutoFloat8Precision, Fp8Choice, choose_fp8
from lightning_gh.precision.layer_filter import LayerDecision, LayerFilter, LayerPlan
from lightning_gh.precision.registry import (
    FP8UnavailableError,
    export_bf16_state_dict,
    list_precisions,
    precision,
    precision_names,
)
from lightning_gh.precision.te import TEFloat8Precision

__all__ = [
    "AutoFloat8Precision",
    "Fp8Choice",
    "choose_fp8",
    "FP8UnavailableError",
    "LayerDecision",
    "LayerFilter",
    "LayerPlan",
    "TEFloat8Precision",
    "TorchAOFloat8Precision",
    "export_bf16_state_dict",
    "list_precisions",
    "precision",
    "precision_names",
]
