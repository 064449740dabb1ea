"""Offloading to host memory: saved activations (``ActivationOffload``, ``offload_activations``)."""

from lightning_gh.offload.activation_policy import (
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
from lightning_gh.offload.activations import (
    ActivationOffloader,
    HostBufferPool,
    HostMemoryError,
    OffloadStats,
    TimelinePoint,
    find_blocks,
    offload_activations,
)
from lightning_gh.offload.callback import ActivationOffload

__all__ = [
    "ActivationOffload",
    "ActivationOffloader",
    "BlockProfile",
    "HostBufferPool",
    "HostMemoryError",
    "OffloadPlan",
    "OffloadStats",
    "Prediction",
    "StepProfile",
    "TimelinePoint",
    "find_blocks",
    "offload_activations",
    "plan_all",
    "plan_auto",
    "plan_first_k",
    "plan_with_recompute",
    "simulate",
]
