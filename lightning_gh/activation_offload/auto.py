"""The ``"auto"`` policy's state: the measured steps, the plan made from them, and its forecast once recompute is seen.

:class:`AutoPlanner` takes the profiles of the first training steps (the engine times them block by block, see
:class:`~lightning_gh.activation_offload.policy.StepProfile`), and after ``profile_steps`` of them (the warm-up step
left out) plans with :func:`~lightning_gh.activation_offload.policy.plan_auto`, adding the ``recompute`` mode where
one is set. The first forward that recomputes tells what the recomputing blocks really keep; the forecast is
redone once from that.

Example::

    >>> from lightning_gh.activation_offload import ActivationOffloadOptions, BlockProfile, StepProfile
    >>> planner = AutoPlanner(ActivationOffloadOptions(profile_steps=1), lambda: (50.0, 50.0))
    >>> step = StepProfile(tuple(BlockProfile(2.0, 4.0, 100 * 2**20) for _ in range(4)))
    >>> planner.observe([step]).offloaded_blocks
    (0, 1, 2)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

from lightning_gh.activation_offload.options import ActivationOffloadOptions
from lightning_gh.activation_offload.policy import (
    OffloadPlan,
    StepProfile,
    median_profile,
    plan_auto,
    plan_with_recompute,
)

__all__ = ["AutoPlanner"]


class AutoPlanner:
    """Plans ``policy="auto"`` from measured steps (see the module docstring).

    Args:
        options: the engine's options (``profile_steps``, ``margin``, ``skip_last_blocks``, ``recompute``).
        link: returns the link bandwidth ``(d2h, h2d)`` in GB/s.

    Attributes:
        profile: the median of the measured steps, once planned (recompute's kept bytes added once measured).
    """

    def __init__(self, options: ActivationOffloadOptions, link: Callable[[], tuple[float, float]]) -> None:
        self.options = options
        self.link = link
        self.profile: StepProfile | None = None
        self._measured: list[StepProfile] = []
        self._recompute_seen = False

    def observe(self, steps: Sequence[StepProfile]) -> OffloadPlan | None:
        """Take in measured steps (not the warm-up); the plan once ``profile_steps`` are in, else ``None``."""
        if self.profile is not None:
            return None
        self._measured.extend(steps)
        if len(self._measured) < self.options.profile_steps:
            return None
        o = self.options
        self.profile = median_profile(self._measured)
        d2h, h2d = self.link()
        plan = plan_auto(self.profile, d2h, h2d, o.margin, o.skip_last_blocks)
        return plan_with_recompute(plan, o.recompute, self.profile, d2h, h2d, o.margin)

    def recompute_measured(self, plan: OffloadPlan, kept: Mapping[int, int]) -> OffloadPlan | None:
        """``plan`` with its forecast redone from what its recomputing blocks kept in their first forward (``kept``:
        block -> bytes that reached the engine plus the selective cache); ``None`` when there is nothing to redo.

        Measured, not predicted from the graph. Needs the profile the plan was made from; a fixed or restored plan
        states no forecast.
        """
        if self._recompute_seen or self.profile is None or plan.prediction is None or not plan.recompute:
            return None
        if set(kept) != set(plan.recompute):
            return None
        blocks = tuple(replace(b, recompute_kept_bytes=kept[i]) if i in kept else b
                       for i, b in enumerate(self.profile.blocks))
        self.profile = replace(self.profile, blocks=blocks)
        self._recompute_seen = True
        d2h, h2d = self.link()
        return plan_with_recompute(plan, self.options.recompute, self.profile, d2h, h2d, self.options.margin)
