"""Deprecated: activation offload moved to :mod:`lightning_gh.activation_offload` and SuperOffload to
:mod:`lightning_gh.superoffload`. The old names keep working for one release and warn ``DeprecationWarning``.

Example::

    from lightning_gh.activation_offload import ActivationOffload   # was: from lightning_gh.offload import ...
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = [
    "ActivationOffload", "ActivationOffloader", "BlockProfile", "HostBufferPool", "HostMemoryError",
    "OffloadPlan", "OffloadStats", "Prediction", "StepProfile", "TimelinePoint", "find_blocks",
    "offload_activations", "plan_all", "plan_auto", "plan_first_k", "plan_with_recompute", "simulate"
]
__getattr__, __dir__ = forward_to(__name__, ("lightning_gh.activation_offload",))
