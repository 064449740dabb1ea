"""Deprecated: the ActivationOffload callback moved to :mod:`lightning_gh.activation_offload.callback`.

The old names keep working for one release and warn ``DeprecationWarning``; import them from the
new module.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = [
    "ActivationOffload", "check_strategy"
]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.activation_offload.callback",
), public="lightning_gh.activation_offload")
