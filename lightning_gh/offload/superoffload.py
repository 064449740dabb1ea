"""Deprecated: the SuperOffload optimizer moved to :mod:`lightning_gh.superoffload` (``optimizer``, ``options``,
``tail``, ``worker``, ``layout``).

The old names keep working for one release and warn ``DeprecationWarning``; import them from the new package.
The new package is imported only when a name is first used.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = ["HeterogeneousAdamW", "validate_options"]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.superoffload",
    "lightning_gh.superoffload.optimizer",
    "lightning_gh.superoffload.options",
    "lightning_gh.superoffload.tail",
    "lightning_gh.superoffload.worker",
    "lightning_gh.superoffload.layout",
), public="lightning_gh.superoffload")
