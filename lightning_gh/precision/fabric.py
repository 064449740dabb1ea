"""The fp8 plugins under Lightning Fabric as well as under the Trainer: one plugin object, two call conventions.

Note [One plugin object for the Trainer and Fabric]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``Fabric(plugins=[lgh.precision("fp8-ao-tensorwise")])`` accepts our plugins, since a Trainer ``Precision`` is a
Fabric ``Precision`` too, but the two call them differently. The Trainer passes its ``LightningModule`` (attached to
the Trainer) to ``pre_backward`` / ``backward`` / ``post_backward``, which run the Trainer's hooks, and calls
``optimizer_step(optimizer, model=..., closure=...)``. Fabric passes its module (or ``None``) and calls
``optimizer_step(optimizer, **kwargs)``; there are no Trainer hooks to run. :class:`FabricCompatible` tells the two
apart by the module: attached to a Trainer means the Trainer's convention, anything else Fabric's (a plain backward
and ``optimizer.step()``). ``convert_module``, ``forward_context``, ``convert_input`` and ``convert_output`` are the
same in both. A plugin that needs the Trainer's optimizer step (the Transformer Engine plugin's fp32 master weights)
refuses at ``convert_module`` when no Trainer is attached (``require_trainer``).

Example::

    fabric = L.Fabric(accelerator="cuda", devices=1, plugins=[lgh.precision("fp8-ao-tensorwise")])
    model, optimizer = fabric.setup(model, optimizer)   # converts the layers, as the Trainer's setup does
    fabric.backward(loss); optimizer.step()
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn

from lightning_gh._lightning import trainer_of

__all__ = ["FabricCompatible", "FabricCompatibleMixedPrecision", "require_trainer"]


def _under_trainer(module: Any) -> bool:
    return isinstance(module, nn.Module) and trainer_of(module) is not None


class FabricCompatible:
    """Precision-plugin glue that runs the Trainer's call convention under a Trainer and Fabric's otherwise (put it
    before the Trainer's ``Precision`` base class). See Note [One plugin object for the Trainer and Fabric]."""

    def pre_backward(self, tensor: Tensor, module: Any) -> Any:
        if _under_trainer(module):
            return super().pre_backward(tensor, module)  # type: ignore[misc]
        return tensor

    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if _under_trainer(model):
            return super().backward(tensor, model, *args, **kwargs)  # type: ignore[misc]
        tensor.backward(*args, **kwargs)
        return None

    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        if _under_trainer(module):
            return super().post_backward(tensor, module)  # type: ignore[misc]
        return tensor

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None,
                       **kwargs: Any) -> Any:
        if model is None and closure is None:  # Fabric: optimizer_step(optimizer, **kwargs)
            return optimizer.step(**kwargs)
        return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]


class FabricCompatibleMixedPrecision(FabricCompatible, MixedPrecision):
    """Lightning's ``MixedPrecision`` that also runs under Fabric: what ``fp8-auto`` falls back to (``bf16-mixed``)
    where no fp8 can run, so that the same ``lgh.precision("fp8-auto")`` works with the Trainer and with Fabric."""


def require_trainer(module: nn.Module, name: str, why: str) -> None:
    """Raise ``RuntimeError`` when ``module`` is not attached to a Trainer (Fabric, or a loop of the user's own).

    Args:
        module: the module the plugin converts.
        name: the plugin's precision name, for the message.
        why: what the plugin needs the Trainer for.
    """
    if trainer_of(module) is None:
        raise RuntimeError(f"precision {name!r} needs Lightning's Trainer ({why}); it cannot run under Lightning Fabric "
                           "or a training loop of your own. Use an fp8-ao-* recipe there (e.g. "
                           "lgh.precision('fp8-ao-tensorwise')), which works with Fabric.")
