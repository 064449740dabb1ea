"""The SuperOffload strategies' loss: a Hugging Face causal LM's loss through the lean loss, by default on CUDA.

A model that does not fit a GPU spends what the step leaves free on SuperOffload's GPU tail (the share of the
optimizer state updated on the GPU): every byte the step's peak gives back is state the CPU does not update. The
peak of a causal LM's step is often the loss: ``F.cross_entropy(logits.float(), ...)`` saves an fp32 log-softmax of
the whole ``tokens x vocab`` logits for the backward, and the backward holds two more fp32 tensors of that size.
:class:`~lightning_gh.activation_offload.lean_loss.LeanLoss` computes the same loss keeping only the
low-precision logits (also for a loss the ``LightningModule`` computes itself from the logits, see Note [A loss of
the user's own over the logits]). The strategies enter it around each ``training_step`` (the forward and the loss;
the backward needs nothing installed), where :func:`lean_loss_decision` says so.

Example::

    >>> lean_loss_decision("auto", cuda=True, causal_lm=True, loss_owner=False)[0]
    True
    >>> lean_loss_decision("auto", cuda=True, causal_lm=True, loss_owner=True)[0]
    False
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from lightning_gh import compat
from lightning_gh._options import check_type

__all__ = ["StepLoss", "activation_offload_owns_loss", "check_lean_loss", "lean_loss_decision"]


def check_lean_loss(owner: str, value: Any) -> None:
    """``TypeError`` for a ``lean_loss`` of the wrong type, ``ValueError`` for a string other than ``"auto"``."""
    check_type(owner, "lean_loss", value, bool | str)
    if isinstance(value, str) and value != "auto":
        raise ValueError(f"{owner}(lean_loss={value!r}): expected True, False or 'auto'.")


def lean_loss_decision(setting: bool | str, *, cuda: bool, causal_lm: bool,
                       loss_owner: bool) -> tuple[bool, str]:
    """Whether the strategy computes the causal LM's loss through the lean loss, and why (one line).

    Args:
        setting: the strategy's ``lean_loss``: ``True``, ``False`` or ``"auto"`` (on CUDA only).
        cuda: the run's device is a GPU.
        causal_lm: the ``LightningModule`` holds a transformers ``*ForCausalLM``
            (:func:`~lightning_gh.activation_offload.lean_loss.find_causal_lm`).
        loss_owner: an ``ActivationOffload`` callback that decides the loss itself is attached (one with a
            budget, whose plan turns the lean loss on where it needs the memory, or with ``lean_loss`` set):
            see :func:`activation_offload_owns_loss`.

    Raises:
        ValueError: ``lean_loss=True`` and there is no causal LM to apply it to.
    """
    if setting is False:
        return False, "off: lean_loss=False"
    if loss_owner:
        return False, "left to ActivationOffload: its budget or its lean_loss decides the loss"
    if not causal_lm:
        if setting is True:
            raise ValueError("lean_loss=True: the LightningModule holds no transformers *ForCausalLM model whose "
                             "loss it could replace; pass lean_loss='auto' or False.")
        return False, "off: no transformers *ForCausalLM in the LightningModule"
    if setting == "auto" and not cuda:
        return False, "off: not on CUDA (no GPU memory to give back; lean_loss=True forces it)"
    return True, ("on: the causal LM's loss, or the module's own cross-entropy over its logits, keeps only the "
                  "low-precision logits for the backward (lean_loss=False for the loss as written)")


def activation_offload_owns_loss(trainer: Any) -> bool:
    """Whether ``trainer`` has an ``ActivationOffload`` that decides the loss: one with a ``budget`` (its plan weighs
    the lean loss) or an explicit ``lean_loss``; one without either never touches the loss. A stand-in of another
    class, whose options are unknown, is taken to decide it."""
    cb = compat.parts_in(trainer).get("ActivationOffload")
    if cb is None:
        return False
    opts = getattr(cb, "options", None)
    return opts is None or getattr(opts, "budget", None) is not None or getattr(opts, "lean_loss", None) is not None


class StepLoss:
    """The strategy's side of the lean loss: decided once at setup, entered around each ``training_step``.

    Args:
        owner: the strategy's class name, for messages.
        setting: its ``lean_loss`` argument (checked here).
    """

    def __init__(self, owner: str, setting: bool | str) -> None:
        check_lean_loss(owner, setting)
        self.owner = owner
        self.setting = setting
        self.on = False
        self.why = "not set up"
        self._lean: Any = None

    def setup(self, trainer: Any, module: torch.nn.Module, device: torch.device) -> None:
        """Decide for this run (see :func:`lean_loss_decision`) and build the lean loss where it is on."""
        from lightning_gh.activation_offload.lean_loss import LeanLoss, find_causal_lm

        lm = find_causal_lm(module)
        self.on, self.why = lean_loss_decision(self.setting, cuda=device.type == "cuda", causal_lm=lm is not None,
                                               loss_owner=activation_offload_owns_loss(trainer))
        self._lean = LeanLoss(lm) if self.on else None
        if device.type == "cuda" and lm is not None:  # one line where it matters: a causal LM on a GPU
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(f"{self.owner} loss: {self.why}")

    def context(self) -> ContextManager[Any]:
        """What a ``training_step`` runs inside: the lean loss where it is on, else nothing."""
        return self._lean if self._lean is not None else contextlib.nullcontext()

    def teardown(self) -> None:
        self._lean = None
