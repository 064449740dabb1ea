"""The same objects as :mod:`lightning_gh._hf` (the one module of Hugging Face helpers), under this module's name.

Kept only while code outside ``lightning_gh.precision`` still imports it from here; new code imports
``lightning_gh._hf``. The names are re-exported, not copied, so the set of accepted decoders and the call state are
the ones ``lightning_gh._hf`` uses.
"""

from lightning_gh._hf import _ACCEPTED, _STATE, FAMILIES, _skip, hf_sdpa_decoders, keep_causal_sdpa  # noqa: F401

__all__ = ["FAMILIES", "keep_causal_sdpa", "hf_sdpa_decoders"]
