"""Deprecated: SuperOffload's host-memory sizing moved to :mod:`lightning_gh.superoffload.memory`.

The old names keep working for one release and warn ``DeprecationWarning``; import them from the new module.
The new package is imported only when a name is first used.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = [
    "HostBuffer", "HostMemoryPlan", "available_host_bytes", "check_host_memory", "device_memory_room",
    "host_bytes_per_param",
]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.superoffload.memory",
    "lightning_gh.superoffload",
), public="lightning_gh.superoffload")
