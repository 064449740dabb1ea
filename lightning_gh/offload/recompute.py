"""Deprecated: recomputation for activation offload moved to :mod:`lightning_gh.activation_offload.recompute`.

The old names keep working for one release and warn ``DeprecationWarning``; import them from the
new module.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = [
    "BlockRecompute", "RECOMPUTE_ATTR", "RECOMPUTE_MODES", "check_recomputable", "compute_heavy_ops",
    "is_norm_act_module", "selective_policy"
]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.activation_offload.recompute",
), public="lightning_gh.activation_offload")
