"""Budget mode on a ``torch.compile``'d model: the budget becomes the compiler's own knob.

On a compiled model the blocks' boundaries are traced into the compiled graph, not run, so the engine cannot offload
or recompute per block. A fraction budget goes to ``torch._functorch.config.activation_memory_budget`` at once
(:func:`~lightning_gh.activation_offload.budget.compiler_budget`); a size budget needs one measured compiled step
(CUDA) to turn into a fraction. :class:`CompiledBudget` holds these steps of
:class:`~lightning_gh.activation_offload.controller.BudgetController`, which inherits them: they read and set the
controller's state (``state``, ``plan``, ``budget_bytes``, ``plain_activation_bytes``, ``log``) as its other steps do.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from lightning_gh._util import fmt_bytes
from lightning_gh.activation_offload import budget as _budget
from lightning_gh.activation_offload.measure import BudgetState, CompilerKnob, MemoryProbe
from lightning_gh.activation_offload.policy import OffloadPlan, plan_none

if TYPE_CHECKING:
    from lightning_gh.activation_offload.options import ActivationOffloadOptions

__all__ = ["CompiledBudget"]

log = logging.getLogger("lightning_gh.activation_offload.controller")  # the controller's log lines, as before


class CompiledBudget:
    """The compiled-model steps of :class:`~lightning_gh.activation_offload.controller.BudgetController`.

    Uses the controller's ``options``, ``budget``, ``n``, ``probe``, ``on_plan`` and ``knob``, and sets its
    ``state``, ``plan``, ``plain_activation_bytes``, ``budget_bytes`` and ``log``.
    """

    options: ActivationOffloadOptions
    budget: _budget.Budget
    n: int
    probe: MemoryProbe
    on_plan: Callable[[OffloadPlan], None]
    knob: CompilerKnob
    state: BudgetState
    plan: OffloadPlan | None
    plain_activation_bytes: int | None
    budget_bytes: int | None
    log: list[dict[str, Any]]

    def start_compiled(self, owner: str, on_cuda: bool) -> None:
        """Budget mode on a ``torch.compile``'d model: a fraction goes to the compiler now; a size needs one measured
        compiled step (CUDA)."""
        if self.budget.fraction is not None:
            self.state = BudgetState.COMPILED
            self._set_knob(_budget.compiler_budget(self.budget.fraction), owner,
                           f"a fraction budget of {self.budget.fraction:.0%}")
        elif not on_cuda:
            self.state = BudgetState.FAILED
            raise ValueError(f"budget={self.options.budget!r} on the compiled module '{owner}': a size budget is "
                             "turned into the compiler's activation_memory_budget from a measured CUDA step; "
                             "on this device pass a fraction instead (e.g. budget=0.5).")
        else:
            self.state = BudgetState.COMPILED_MEASURE

    def compiled_forward(self, owner: str) -> None:
        """Called before each forward of a compiled model: the first compiles, the second is measured."""
        if self.state is not BudgetState.COMPILED_MEASURE:
            return
        self.knob.calls += 1
        if self.knob.calls <= 2:  # the first call compiles (not a step to measure); the second is measured
            if self.knob.calls == 2:
                self.knob.base = self.probe.start()
            return
        act = self.probe.peak(self.knob.base)
        self.plain_activation_bytes = act
        self.budget_bytes = self.budget.resolve(act)
        self.state = BudgetState.COMPILED
        frac = min(1.0, self.budget_bytes / max(act, 1))
        if frac >= 1.0:  # said as a plan, as for an eager model (the budget's measuring is over)
            self.plan = replace(plan_none(self.n, "budget-compiled"), notes=(
                f"budget {self.budget.describe()} >= the compiled step's measured {fmt_bytes(act)}: nothing to do",))
            self.on_plan(self.plan)
            return
        self._set_knob(_budget.compiler_budget(frac), owner,
                       f"{fmt_bytes(self.budget_bytes)} of the compiled step's measured {fmt_bytes(act)} "
                       "(torch._dynamo.reset(): the model recompiles once)")

    def _set_knob(self, value: float, owner: str, why: str) -> None:
        self.knob.set(value)
        msg = (f"ActivationOffload budget: '{owner}' is torch.compile'd, so its blocks' boundaries are traced, not "
               f"run; set torch._functorch.config.activation_memory_budget = {value:.3f} for {why} (the compiler "
               "recomputes what it must; restored when training ends)")
        log.info(msg)
        self.log.append({"activation_budget/compiler_budget": value})
        self.plan = replace(plan_none(self.n, "budget-compiled"), notes=(msg,))
        self.on_plan(self.plan)

    def close(self) -> None:
        """Restore the compiler's budget if this controller set it."""
        self.knob.restore()
