"""Deprecated: the activation-offload planner moved to :mod:`lightning_gh.activation_offload.policy`.

The old names keep working for one release and warn ``DeprecationWarning``; import them from the
new module.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = [
    "BlockProfile", "OffloadPlan", "Prediction", "StepProfile", "plan_all", "plan_auto", "plan_first_k",
    "plan_none", "plan_with_recompute", "simulate"
]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.activation_offload.policy",
), public="lightning_gh.activation_offload")
