"""fp32 master weights on the optimizer side of a module that computes with bf16 weights (backend-neutral).

The Megatron / DeepSpeed mixed-precision recipe: the module keeps bf16 (or fp16) weights, so its GEMMs read half
the bytes and fp8 casts start from bf16, while the optimizer updates an fp32 copy of every such weight. Updates
smaller than bf16's resolution (``|lr * update| < |w| * 2**-8``) then accumulate in fp32 instead of being rounded
away, which is what training a bf16-weight model directly (Lightning's ``precision="transformer-engine"``) loses.

One step, as :class:`MasterWeightsMixin` runs it inside Lightning's ``optimizer_step``:

1. the closure runs forward and backward: gradients land on the module's bf16 weights;
2. they are copied into the fp32 masters (``master.grad = weight.grad.float()``) and the bf16 gradients freed,
   *before* ``on_before_optimizer_step`` and gradient clipping, which therefore see the fp32 gradients (the
   optimizer's ``param_groups`` hold the masters, so ``main_params`` yields them);
3. the optimizer steps the masters in fp32;
4. the masters are cast back into the module's weights.

With ``fused_master_update = True`` and a ``torch.optim.Adam`` / ``AdamW`` optimizer, steps 2-4 become one pass per
weight (:mod:`lightning_gh.precision.fused_master`): it reads the bf16 gradient, updates the fp32 master and the
moments in the optimizer's own state, and writes the bf16 weight, so no fp32 gradient is ever made. Only when nothing
reads gradients between backward and the step: with gradient clipping, an ``on_before_optimizer_step`` hook (of the
module, or of a callback not marked ``lgh_reads_gradients = False``) or manual optimization, that step takes the
plain path above.

The optimizer's own state (AdamW moments) is keyed by position, so checkpoints keep their layout; the plugin's
``state_dict`` adds the fp32 masters (``"fp32_master"``, plain tensors), so a resume is exact rather than restarting
from the rounded bf16 weights of the model's ``state_dict``.

Example::

    class MyPrecision(MasterWeightsMixin, Precision):
        master_weights = True

        def convert_module(self, module):
            return module.to(torch.bfloat16)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_gh._lightning import trainer_of, unwrap_optimizer

__all__ = ["MasterWeights", "MasterWeightsMixin"]

_LOW = (torch.bfloat16, torch.float16)


class MasterWeights:
    """fp32 masters for the low-precision parameters of one optimizer, swapped into its ``param_groups``.

    Args:
        optimizer: the optimizer built over the module's parameters, before its first step.

    Raises:
        ValueError: the optimizer has stepped already (its state is keyed on the bf16 parameters).

    Example::

        masters = MasterWeights(optimizer)
        loss.backward(); masters.grads_to_master(); optimizer.step(); masters.master_to_model()
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if len(optimizer.state):
            raise ValueError(f"MasterWeights(optimizer={type(optimizer).__name__}): the optimizer has state already; "
                             "fp32 masters must be attached before its first step.")
        self.optimizer = optimizer
        self.pairs: list[tuple[Tensor, Tensor]] = []  # (module weight, fp32 master), in param_groups order
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if p.dtype in _LOW:
                    master = p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
                    self.pairs.append((p, master))
                    params.append(master)
                else:
                    params.append(p)
            group["params"] = params

    def __len__(self) -> int:
        return len(self.pairs)

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Copy the module's gradients into the masters as fp32 and free the low-precision ones."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Cast the masters back into the module's weights (after each optimizer step and on restore)."""
        if self.pairs:
            # One multi-tensor call rather than a kernel launch per weight (hundreds in a deep model).
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def state_dict(self) -> list[Tensor]:
        """The fp32 masters, in order (CPU copies: plain tensors, ``torch.load(weights_only=True)`` reads them)."""
        return [m.detach().to("cpu", copy=True) for _, m in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, masters: list[Tensor]) -> None:
        """Restore the masters from :meth:`state_dict` and cast them into the module.

        Raises:
            ValueError: a different number or shape of masters (another model or layer plan).
        """
        if len(masters) != len(self.pairs):
            raise ValueError(f"the checkpoint holds {len(masters)} fp32 master weights, this model has "
                             f"{len(self.pairs)} low-precision weights.")
        for i, ((_, m), saved) in enumerate(zip(self.pairs, masters)):
            if saved.shape != m.shape:
                raise ValueError(f"fp32 master {i} has shape {tuple(saved.shape)} in the checkpoint but "
                                 f"{tuple(m.shape)} here.")
            m.copy_(saved)
        self.master_to_model()


class MasterWeightsMixin:
    """Precision-plugin glue for :class:`MasterWeights` (put it before the ``Precision`` base class).

    The plugin sets ``master_weights`` (``True`` to keep fp32 masters of its low-precision weights) and
    ``fused_master_update`` (``True``: the one-pass Adam/AdamW update where it applies, see the module docs).
    Lightning calls ``connect`` once the optimizers exist; ``_wrap_closure`` / ``optimizer_step`` / ``state_dict`` /
    ``load_state_dict`` do the rest (see the module docs).
    """

    master_weights: bool = False
    fused_master_update: bool = False
    _masters: list[MasterWeights] | None = None
    _pending_masters: list[list[Tensor]] | None = None
    _fused: dict[int, Any] | None = None  # id(MasterWeights) -> FusedMasterAdam
    _fused_done: set[int] | None = None  # the MasterWeights whose step the fused update has already done

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]):
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)  # type: ignore[misc]
        if self.master_weights:
            self._masters = [MasterWeights(_unwrap(opt)) for opt in optimizers]
            self._fused, self._fused_done = {}, set()
            if self.fused_master_update:
                self._fuse(self._masters)
            if self._pending_masters is not None:
                self._restore_masters()
        return model, optimizers, lr_schedulers

    def _fuse(self, all_masters: list[MasterWeights]) -> None:
        from lightning_gh.precision.fused_master import FusedMasterAdam, fused_adam_unsupported

        for masters in all_masters:
            reason = fused_adam_unsupported(masters.optimizer)
            if reason is None:
                self._fused[id(masters)] = FusedMasterAdam(masters)  # type: ignore[index]
            else:
                rank_zero_info(f"{type(self).__name__}(fused_master_update=True): {reason}; its fp32 masters are "
                               "updated the plain way (fp32 gradient copy, the optimizer's step, copy back).")

    def _fused_for(self, masters: MasterWeights, model: Any) -> Any:
        """The fused update for this step, or ``None`` when something reads the fp32 gradients before the step."""
        fused = (self._fused or {}).get(id(masters))
        if fused is None or _reads_grads_before_step(model):
            return None
        return fused

    def _masters_of(self, optimizer: Any) -> MasterWeights | None:
        inner = _unwrap(optimizer)
        return next((m for m in self._masters or () if m.optimizer is inner), None)

    def _wrap_closure(self, model: Any, optimizer: Any, closure: Callable[[], Any]) -> Any:
        masters = self._masters_of(optimizer)
        if masters is None:
            return super()._wrap_closure(model, optimizer, closure)  # type: ignore[misc]
        result = closure()
        fused = self._fused_for(masters, model)
        if fused is None:
            masters.grads_to_master()  # before the hooks and clipping: they see the fp32 gradients
            self._after_closure(model, optimizer)  # type: ignore[attr-defined]
            return result
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]
        # Nothing above read gradients (no clipping, no on_before_optimizer_step). The masters get no .grad, so the
        # optimizer's own step, which runs right after this closure, skips them and steps only its other params.
        for _, m in masters.pairs:
            m.grad = None
        fused.step()
        self._fused_done.add(id(masters))  # type: ignore[union-attr]
        return result

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]
        masters = self._masters_of(optimizer)
        if masters is not None:
            if id(masters) in (self._fused_done or ()):
                self._fused_done.discard(id(masters))  # type: ignore[union-attr]  # the weights are written already
            else:
                masters.master_to_model()
        return out

    def state_dict(self) -> dict[str, Any]:
        state = dict(super().state_dict())  # type: ignore[misc]
        if self._masters:
            state["fp32_master"] = [m.state_dict() for m in self._masters]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        saved = state_dict.get("fp32_master")
        if saved is None:
            if self._masters:
                warnings.warn(f"{type(self).__name__}: the checkpoint holds no fp32 master weights; they restart "
                              "from the model's bf16 weights.", UserWarning, stacklevel=2)
            return
        self._pending_masters = list(saved)
        if self._masters is not None:  # Lightning restores the plugin after connect
            self._restore_masters()

    def _restore_masters(self) -> None:
        saved, self._pending_masters = self._pending_masters, None
        if not self.master_weights:
            warnings.warn(f"{type(self).__name__}(master_weights=False): the checkpoint's fp32 master weights are "
                          "not used.", UserWarning, stacklevel=3)
            return
        if len(saved) != len(self._masters):
            raise ValueError(f"the checkpoint holds fp32 masters for {len(saved)} optimizers, this run has "
                             f"{len(self._masters)}.")
        for masters, tensors in zip(self._masters, saved):
            masters.load_state_dict(tensors)


def _unwrap(optimizer: Any) -> Any:
    return unwrap_optimizer(optimizer)  # a LightningOptimizer's torch optimizer


def _reads_grads_before_step(model: Any) -> bool:
    """Whether anything between backward and the optimizer step may read or change the gradients.

    Lightning calls ``on_before_optimizer_step`` (callbacks and the module) and gradient clipping
    (``gradient_clip_val`` or an overridden ``configure_gradient_clipping``) there; they see the fp32 master
    gradients, so the fused update, which never makes them, steps aside. Manual optimization clips inside
    ``training_step``, out of the plugin's sight: the plain path there too. A plain ``nn.Module`` (no Trainer) has
    none of these.
    """
    if not isinstance(model, pl.LightningModule):
        return False
    if not model.automatic_optimization:
        return True
    if is_overridden("on_before_optimizer_step", model) or is_overridden("configure_gradient_clipping", model):
        return True
    trainer = trainer_of(model)
    if trainer is None:
        return False
    if trainer.gradient_clip_val:
        return True
    # A callback whose hook only marks time (NVTX ranges, profiler phases) says so with ``lgh_reads_gradients = False``.
    return any(is_overridden("on_before_optimizer_step", cb, Callback) and getattr(cb, "lgh_reads_gradients", True)
               for cb in trainer.callbacks)
