"""Deprecated: ``SuperOffloadStrategy`` moved to :mod:`lightning_gh.superoffload.strategy`.

The old name keeps working for one release and warns ``DeprecationWarning``; import it from the new module.
The new package is imported (and ``strategy="superoffload"`` registered) only when the name is first used;
``import lightning_gh`` registers it in any case.
"""

from lightning_gh.offload._moved import forward_to

# The names it had; each is looked up in its new home on first use.
__all__ = ["SuperOffloadStrategy"]
__getattr__, __dir__ = forward_to(__name__, (
    "lightning_gh.superoffload.strategy",
    "lightning_gh.superoffload",
), public="lightning_gh.superoffload")
