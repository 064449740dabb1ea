"""The names ``precision()`` accepts: the fp8 recipes of this package and Lightning's own strings.

A plain table with no imports of the plugins, so that the registry, the availability checks and the CLI plugin
all read the same names without importing one another.

Example::

    >>> from lightning_gh.precision.names import canonical
    >>> canonical("BF16")
    'bf16-mixed'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FP8_NAMES", "LIGHTNING_NAMES", "LIGHTNING_ALIASES", "Fp8Name", "canonical", "precision_names"]


@dataclass(frozen=True)
class Fp8Name:
    """One fp8 name: which backend (``"te"`` or ``"ao"``) and recipe it selects, and a one-line summary."""

    backend: str
    recipe: str
    summary: str


FP8_NAMES: dict[str, Fp8Name] = {
    "fp8-te-delayed": Fp8Name("te", "delayed", "Transformer Engine, per-tensor scales from an amax history"),
    "fp8-te-current": Fp8Name("te", "current", "Transformer Engine, per-tensor scales from the current tensor"),
    "fp8-te-block": Fp8Name("te", "block", "Transformer Engine, 1x128 / 128x128 block scales"),
    "fp8-te-mxfp8": Fp8Name("te", "mxfp8", "Transformer Engine, MXFP8 32-element block scales (Blackwell)"),
    "fp4-te-nvfp4": Fp8Name("te", "nvfp4", "Transformer Engine, NVFP4 (Blackwell)"),
    "fp8-ao-tensorwise": Fp8Name("ao", "tensorwise", "torchao float8, per-tensor dynamic scales"),
    "fp8-ao-rowwise": Fp8Name("ao", "rowwise", "torchao float8, per-row dynamic scales"),
    "fp8-ao-rowwise-gw-hp": Fp8Name("ao", "rowwise_with_gw_hp",
                                    "torchao float8, per-row scales, weight gradient in bf16"),
}
# Lightning's own precision strings (and their aliases), passed through to Lightning's plugin classes.
LIGHTNING_NAMES = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true",
                   "transformer-engine", "transformer-engine-float16")
LIGHTNING_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def precision_names() -> list[str]:
    """Every name ``precision()`` accepts (aliases excluded)."""
    return [*FP8_NAMES, "fp8-auto", *LIGHTNING_NAMES]


def canonical(name: Any) -> str:
    """``name`` lower-cased with aliases resolved.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a known name (the message lists the valid ones).
    """
    if not isinstance(name, str):
        raise TypeError(f"precision name={name!r} must be a string, got {type(name).__name__}; valid names: "
                        f"{', '.join(precision_names())}.")
    key = name.strip().lower()
    key = LIGHTNING_ALIASES.get(key, key)
    if key not in FP8_NAMES and key not in LIGHTNING_NAMES and key != "fp8-auto":
        raise ValueError(f"precision name={name!r} is not known; valid names: {', '.join(precision_names())} "
                         f"(aliases: {', '.join(LIGHTNING_ALIASES)}).")
    return key
