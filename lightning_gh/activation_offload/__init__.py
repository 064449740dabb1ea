"""Activation offload: saved activations to pinned host memory in the forward, back ahead of use in the backward.

``ActivationOffload`` is the Lightning callback, ``offload_activations`` the same engine for plain PyTorch; both
take one :class:`ActivationOffloadOptions`. Modules, one idea each: ``options`` (every option, validated once),
``pool`` (reusable pinned host buffers under a host-memory guard), ``transport`` (side-stream copies and
clocks), ``hooks`` (the saved-tensor pack/unpack hooks), ``blocks`` (finding the transformer blocks), ``policy``
(the planner), ``budget`` (activation memory by budget: ``budget="6GiB"``), ``recompute`` (recomputing what is not
offloaded), ``lean_loss`` (a Hugging Face causal-LM loss without fp32 copies of the logits), ``stats``, ``engine`` and
``callback``.

Example::

    import lightning as L
    from lightning_gh.activation_offload import ActivationOffload

    trainer = L.Trainer(precision="bf16-mixed", callbacks=[ActivationOffload(policy="auto")])
    trainer = L.Trainer(precision="bf16-mixed", callbacks=[ActivationOffload(budget="6GiB")])  # or budget=0.5
"""

from lightning_gh._host import HostMemoryError
from lightning_gh.activation_offload.blocks import find_blocks
from lightning_gh.activation_offload.budget import (
    Budget,
    BudgetForecast,
    BudgetProfile,
    ModeCost,
    compiler_budget,
    parse_budget,
    plan_budget,
    plan_floor,
)
from lightning_gh.activation_offload.callback import ActivationOffload
from lightning_gh.activation_offload.engine import ActivationOffloader, offload_activations
from lightning_gh.activation_offload.lean_loss import LeanLoss, find_causal_lm, lean_causal_lm_loss
from lightning_gh.activation_offload.options import ActivationOffloadOptions
from lightning_gh.activation_offload.policy import (
    BlockProfile,
    OffloadPlan,
    Prediction,
    StepProfile,
    plan_all,
    plan_auto,
    plan_first_k,
    plan_with_recompute,
    simulate,
)
from lightning_gh.activation_offload.pool import HostBufferPool
from lightning_gh.activation_offload.stats import OffloadStats, TimelinePoint

__all__ = [
    "ActivationOffload",
    "ActivationOffloadOptions",
    "ActivationOffloader",
    "BlockProfile",
    "Budget",
    "BudgetForecast",
    "BudgetProfile",
    "ModeCost",
    "HostBufferPool",
    "HostMemoryError",
    "LeanLoss",
    "OffloadPlan",
    "OffloadStats",
    "Prediction",
    "StepProfile",
    "TimelinePoint",
    "compiler_budget",
    "find_blocks",
    "find_causal_lm",
    "lean_causal_lm_loss",
    "offload_activations",
    "parse_budget",
    "plan_all",
    "plan_auto",
    "plan_budget",
    "plan_floor",
    "plan_first_k",
    "plan_with_recompute",
    "simulate",
]
