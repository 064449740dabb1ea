"""One step-phase tracker: which phase of a training step the loop is in, told to listeners on enter and exit.

Lightning reports a step's phases through different seams: callback hooks for the batch, zero_grad, backward,
the optimizer step and validation, and only its profiler for the fetch of the next batch
(``"[_TrainingEpochLoop].train_dataloader_next"``) and a checkpoint save (``"save_checkpoint"``), watched with
:class:`~lightning_gh.profiling._actions.ProfilerActionWatcher`. :class:`StepPhaseTracker` puts them together once,
so the parts that care about phases (SelectiveProfiler, NVTXRangeCallback, DataStallDetector) agree on what "data
wait" or "backward" means. The phases, in the order they usually come:

``data_wait``   Lightning's fetch of the next batch (``next(train_dataloader)``), the one definition of waiting for
                data (:mod:`lightning_gh.profiling.advice`).
``forward``     ``on_train_batch_start`` .. ``on_before_zero_grad`` / ``on_before_backward``.
``zero_grad``   ``on_before_zero_grad`` .. ``on_before_backward``.
``backward``    ``on_before_backward`` .. ``on_after_backward``.
``optimizer``   ``on_before_optimizer_step`` .. the optimizer's step post-hook when :meth:`~StepPhaseTracker.watch_optimizers`
                was called (gradient clipping is inside), else ``on_train_batch_end``.
``validation``  ``on_validation_start`` .. ``on_validation_end``.
``checkpoint``  the whole ``Trainer.save_checkpoint``.

With manual optimization (``automatic=False``) ``zero_grad``, ``backward`` and ``optimizer`` happen inside
``training_step``: they nest inside ``forward``, which then closes at ``on_train_batch_end``.

Each part maps the phases onto its own ranges: SelectiveProfiler onto ``lgh/<phase>`` ``record_function``
ranges, NVTXRangeCallback onto NVTX ranges, DataStallDetector onto its wait timer.

The step index handed to listeners is ``trainer.global_step`` when the phase begins (the optimizer step the
phase belongs to, the number step windows select). The tracker is fed by its owner's hooks (a callback calls the
method of the same name) and costs one ``perf_counter`` and a loop over the listeners per event.

Example::

    class Timer(PhaseListener):
        def phase_started(self, phase, step, t): ...
        def phase_ended(self, phase, step, t): ...

    tracker = StepPhaseTracker([Timer()])
    tracker.attach(trainer)               # in setup: starts watching the fetch and the save
    tracker.on_train_batch_start(trainer) # from the callback's hook of the same name, and so on
    tracker.detach()                      # in teardown: the profiler is left as it was
"""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

from lightning_gh.profiling._actions import SAVE_ACTION, ProfilerActionWatcher, is_fetch

__all__ = ["PHASES", "PhaseListener", "StepPhaseTracker"]

#: Every phase the tracker reports.
PHASES = ("data_wait", "forward", "zero_grad", "backward", "optimizer", "validation", "checkpoint")

# The phases of one batch's compute: a new one closes whichever of these is open.
_BATCH = ("forward", "zero_grad", "backward", "optimizer")


class PhaseListener(Protocol):
    """Told when a phase begins and ends; ``t`` is ``time.perf_counter()`` at the event."""

    def phase_started(self, phase: str, step: int, t: float) -> None: ...

    def phase_ended(self, phase: str, step: int, t: float) -> None: ...


class StepPhaseTracker:
    """Tracks the current phase of the training loop from Lightning's hooks and profiler actions.

    Args:
        listeners: told of every phase's start and end, in order.
        automatic: the LightningModule uses automatic optimization (``pl_module.automatic_optimization``);
            with ``False`` the optimizer phases nest inside ``forward``.

    Attributes:
        phase: the innermost open phase, or ``None``.
        step: the step the open phases belong to.
    """

    def __init__(self, listeners: Sequence[PhaseListener] = (), automatic: bool = True) -> None:
        self.listeners: list[PhaseListener] = list(listeners)
        self.automatic = automatic
        self.open: list[str] = []
        self.step = 0
        self._trainer: Any = None
        self._watcher = ProfilerActionWatcher(self._action_start, self._action_stop)
        self._opt_hooks: list[Any] = []

    @property
    def phase(self) -> str | None:
        return self.open[-1] if self.open else None

    # -- the profiler seam
    def attach(self, trainer: Any) -> None:
        """Start watching ``trainer.profiler`` for fetches and saves (call in ``setup``)."""
        self._trainer = trainer
        self._watcher.attach(trainer.profiler)

    def detach(self) -> None:
        """Stop watching and restore the profiler's methods (call in ``teardown`` and ``on_exception``)."""
        self._watcher.detach()
        for h in self._opt_hooks:
            h.remove()
        self._opt_hooks = []
        self._trainer = None
        self.open.clear()

    def watch_optimizers(self, optimizers: Sequence[Any]) -> None:
        """End ``optimizer`` when an optimizer's ``step`` returns (its step post-hook), not at the batch end.

        Call in ``on_fit_start`` (the optimizers exist by then); :meth:`detach` removes the hooks.
        """
        for opt in optimizers:
            self._opt_hooks.append(opt.register_step_post_hook(self._on_optimizer_step_end))

    def _on_optimizer_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if "optimizer" in self.open:
            self._exit("optimizer")

    @property
    def attached(self) -> bool:
        return self._watcher.attached

    def _action_start(self, action: str) -> None:
        if is_fetch(action):
            self._enter("data_wait")
        elif action == SAVE_ACTION:
            self._enter("checkpoint")

    def _action_stop(self, action: str) -> None:
        if is_fetch(action):
            self._exit("data_wait")
        elif action == SAVE_ACTION:
            self._exit("checkpoint")

    # -- events
    def _enter(self, phase: str) -> None:
        if self._trainer is not None:
            self.step = self._trainer.global_step
        self.open.append(phase)
        t = time.perf_counter()
        for listener in self.listeners:
            listener.phase_started(phase, self.step, t)

    def _exit(self, phase: str) -> None:
        if phase not in self.open:
            return
        t = time.perf_counter()
        while self.open:
            top = self.open.pop()
            for listener in self.listeners:
                listener.phase_ended(top, self.step, t)
            if top == phase:
                return

    def _exit_batch(self, keep_forward: bool = False) -> None:
        for phase in _BATCH:
            if not (keep_forward and phase == "forward"):
                self._exit(phase)

    # -- Lightning hooks (the owner forwards them)
    def on_train_batch_start(self, trainer: Any) -> None:
        self._exit("data_wait")
        self._exit_batch()
        self._enter("forward")

    def on_before_zero_grad(self, trainer: Any) -> None:
        if self.automatic:
            self._exit("forward")
        self._enter("zero_grad")

    def on_before_backward(self, trainer: Any) -> None:
        self._exit("zero_grad")
        if self.automatic:
            self._exit("forward")
        self._enter("backward")

    def on_after_backward(self, trainer: Any) -> None:
        self._exit("backward")

    def on_before_optimizer_step(self, trainer: Any) -> None:
        # Manual optimization steps inside training_step: the forward stays open around it.
        self._exit_batch(keep_forward=not self.automatic)
        self._enter("optimizer")

    def on_train_batch_end(self, trainer: Any) -> None:
        self._exit_batch()

    def on_validation_start(self, trainer: Any) -> None:
        self._enter("validation")

    def on_validation_end(self, trainer: Any) -> None:
        self._exit("validation")
