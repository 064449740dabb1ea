"""Deprecated: the activation-offload engine moved to :mod:`lightning_gh.activation_offload.engine`.

The old names keep working for one release and warn ``DeprecationWarning``; import them from the
new module.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = [
    "ActivationOffloader", "HostBufferPool", "HostMemoryError", "OffloadStats", "TimelinePoint", "find_blocks",
    "offload_activations"
]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.activation_offload.engine",
    "lightning_gh.activation_offload.pool",
    "lightning_gh.activation_offload.stats",
    "lightning_gh.activation_offload.blocks",
    "lightning_gh.activation_offload.options",
    "lightning_gh.activation_offload.transport",
    "lightning_gh.activation_offload.hooks",
    "lightning_gh._host",
), public="lightning_gh.activation_offload")
