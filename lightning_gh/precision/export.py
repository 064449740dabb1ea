"""Plain weights out of a model trained with any fp8 plugin (for inference or export).

Example::

    >>> from lightning_gh.demo import LlamaLM
    >>> from lightning_gh.precision import export_bf16_state_dict
    >>> export_bf16_state_dict(LlamaLM.from_preset("tiny").model)["head.weight"].dtype
    torch.bfloat16
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_gh.precision.layer_filter import clean_name

__all__ = ["export_bf16_state_dict"]


def export_bf16_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                           device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Plain weights of a model trained with any fp8 plugin, for the unconverted model (inference, export).

    Floating-point tensors are cast to ``dtype`` (bf16 by default), torchao's float8 weight wrappers are
    unwrapped, FSDP2 shards are gathered (call it on every rank then), Transformer Engine's ``_extra_state`` is
    dropped and ``torch.compile`` wrapper segments are removed from the keys. The result loads with
    ``strict=True`` into the same model class built without any precision plugin. Tensors are copies (on
    ``device`` when given), never views of the training parameters.

    Example::

        >>> from lightning_gh.demo import LlamaLM
        >>> from lightning_gh.precision import export_bf16_state_dict
        >>> sd = export_bf16_state_dict(LlamaLM.from_preset("tiny").model)
        >>> sd["head.weight"].dtype
        torch.bfloat16
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        if hasattr(value, "full_tensor"):  # DTensor (FSDP2): gather the shards
            value = value.full_tensor()
        inner = getattr(value, "_tensor", None)  # torchao WeightWithDynamicFloat8CastTensor
        if isinstance(inner, torch.Tensor):
            value = inner
        value = value.detach()
        target = dtype if value.is_floating_point() else value.dtype
        out[clean_name(key)] = value.to(device=device or value.device, dtype=target, copy=True)
    return out
