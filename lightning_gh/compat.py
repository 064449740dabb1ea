"""Which lightning_gh parts combine: one table, consulted at setup by every part and by the demo.

One policy for every pair that cannot run together: the first of the two parts to reach its setup raises
:class:`IncompatiblePartsError` naming both parts and why, before any step runs. Nothing steps aside silently
and no pair is decided in two places. Pairs not listed combine (the demo turns them all on together).

A part is recognised by its ``lgh_part`` attribute (callbacks, strategies and precision plugins of
lightning_gh set it) or, for user classes that stand in for ours, by its class name.

Example::

    >>> from lightning_gh import compat
    >>> compat.verdict("CUDAGraphCapture", "ActivationOffload").combine
    False
    >>> compat.verdict("NVTXRangeCallback", "CUDAGraphCapture").combine
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = ["PARTS", "RULES", "IncompatiblePartsError", "Rule", "check", "markdown_table", "parts_in", "verdict"]

#: Every part, by the name the table, the errors and the demo use.
PARTS: tuple[str, ...] = (
    "SelectiveProfiler",
    "DataStallDetector",
    "NVTXRangeCallback",
    "CUDAGraphCapture",
    "fp8",
    "ActivationOffload",
    "SuperOffload",
    "GenerationCallback",
    "ManagedOptimizerState",
    "MemoryReport",
    "ThroughputMonitor",
)


class IncompatiblePartsError(MisconfigurationException):
    """Two lightning_gh parts that cannot run together are in one Trainer."""


@dataclass(frozen=True)
class Rule:
    """How two parts combine.

    Attributes:
        a: one part (a name in :data:`PARTS`).
        b: the other.
        combine: whether they may run in one Trainer.
        why: the reason (shown in errors and in the README's table).
    """

    a: str
    b: str
    combine: bool
    why: str


#: The pairs that need a word; any pair not here combines.
RULES: tuple[Rule, ...] = (
    Rule("CUDAGraphCapture", "ActivationOffload", False,
         "a replayed graph skips the Python hooks that order ActivationOffload's host copies and events"),
    Rule("CUDAGraphCapture", "SuperOffload", False,
         "SuperOffload's gradient hooks, host copies and CPU worker cannot run inside a captured CUDA graph"),
    Rule("CUDAGraphCapture", "fp8", False,
         "capturing the fp8 plugins' step (scaling state, amax history) is not verified yet"),
    Rule("fp8", "SuperOffload", True,
         "the fp8 layers compute from bf16 weights on the GPU; SuperOffload keeps their fp32 masters and the AdamW "
         "state in host memory (Transformer Engine recipes with master_weights=False)"),
    Rule("SuperOffload", "ManagedOptimizerState", False,
         "both move the optimizer state: SuperOffload to pinned host memory updated on the CPU, "
         "ManagedOptimizerState to managed memory updated by the GPU; pick one"),
    Rule("ActivationOffload", "SuperOffload", True,
         "both use the host link: activations in forward/backward, gradients and weights around the update"),
    Rule("CUDAGraphCapture", "ManagedOptimizerState", True,
         "the pool synchronises before the capture; the captured step reads the state in place"),
)


def _key(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


_TABLE: dict[frozenset[str], Rule] = {_key(r.a, r.b): r for r in RULES}


def verdict(a: str, b: str) -> Rule:
    """The rule for parts ``a`` and ``b`` (a combining rule when the table does not list the pair).

    Raises:
        ValueError: a name that is not in :data:`PARTS`.
    """
    for name, arg in ((a, "a"), (b, "b")):
        if name not in PARTS:
            raise ValueError(f"compat.verdict({arg}={name!r}): not a lightning_gh part; one of {list(PARTS)}.")
    return _TABLE.get(_key(a, b), Rule(a, b, True, ""))


def part_name(obj: Any) -> str | None:
    """The part ``obj`` is (a callback, strategy or precision plugin), or ``None``."""
    # An instance may say which part it is (a wrapper that is fp8 or not depending on its recipe).
    name = getattr(obj, "lgh_part", None)
    if isinstance(name, str):
        return name
    cls = type(obj).__name__
    return cls if cls in PARTS else None


def parts_in(trainer: Any) -> dict[str, Any]:
    """The lightning_gh parts in ``trainer``: its callbacks, its strategy and its precision plugin."""
    found: dict[str, Any] = {}
    objs = list(getattr(trainer, "callbacks", None) or [])
    strategy = getattr(trainer, "strategy", None)
    objs += [strategy, getattr(strategy, "precision_plugin", None)]
    for obj in objs:
        name = part_name(obj) if obj is not None else None
        if name is not None:
            found.setdefault(name, obj)
    return found


def check(trainer: Any, part: str) -> None:
    """Raise :class:`IncompatiblePartsError` when ``part`` shares ``trainer`` with a part it does not combine with.

    Every part calls this at setup, so the first to get there stops the run before any step, with the same
    message whichever it is.

    Args:
        trainer: the Trainer being set up.
        part: the calling part's name (in :data:`PARTS`).
    """
    if part not in PARTS:
        raise ValueError(f"compat.check(part={part!r}): not a lightning_gh part; one of {list(PARTS)}.")
    for other in parts_in(trainer):
        if other == part:
            continue
        rule = verdict(part, other)
        if not rule.combine:
            raise IncompatiblePartsError(
                f"{rule.a} and {rule.b} cannot be used together: {rule.why}. Remove one of them "
                f"(the table of which parts combine is in the README and lightning_gh/compat.py).")


def markdown_table() -> str:
    """The table as markdown (the README's copy is checked against this by a test)."""
    lines = ["| parts | together? | why |", "| --- | --- | --- |"]
    for r in RULES:
        lines.append(f"| {r.a} + {r.b} | {'yes' if r.combine else 'no'} | {r.why} |")
    return "\n".join(lines)
