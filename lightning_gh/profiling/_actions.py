"""Watching Lightning's profiler actions: the only seam Lightning offers around a batch fetch and a checkpoint save.

Lightning has no callback hook at the start of ``next(dataloader)`` or around ``Trainer.save_checkpoint``, but it
reports both to ``trainer.profiler`` (actions ``"[_TrainingEpochLoop].train_dataloader_next"`` and
``"save_checkpoint"``). :class:`ProfilerActionWatcher` wraps ``start``/``stop`` on that profiler *instance* and
delegates, so whatever profiler the user chose (the default pass-through one included) keeps working, and several
watchers can stack.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["FETCH_SUFFIX", "SAVE_ACTION", "ProfilerActionWatcher", "is_fetch"]

FETCH_SUFFIX = "].train_dataloader_next"
SAVE_ACTION = "save_checkpoint"


def is_fetch(action_name: str) -> bool:
    """Whether ``action_name`` is the training loop's fetch of the next batch."""
    return action_name.endswith(FETCH_SUFFIX)


class ProfilerActionWatcher:
    """Calls ``on_start(action)`` before and ``on_stop(action)`` after every action the profiler times.

    Args:
        on_start: called with the action name before the profiler's own ``start``.
        on_stop: called with the action name after the profiler's own ``stop``.

    Example::

        watcher = ProfilerActionWatcher(lambda a: print("start", a), lambda a: print("stop", a))
        watcher.attach(trainer.profiler)   # in setup
        watcher.detach()                   # in teardown / on_exception
    """

    def __init__(self, on_start: Callable[[str], None], on_stop: Callable[[str], None]) -> None:
        self._on_start, self._on_stop = on_start, on_stop
        self._profiler: Any = None
        self._patched: dict[str, Any] = {}
        self.live = False

    @property
    def attached(self) -> bool:
        return self._profiler is not None

    def attach(self, profiler: Any) -> None:
        if self._profiler is not None:
            self.detach()
        orig_start, orig_stop = profiler.start, profiler.stop
        watcher = self

        def start(action_name: str) -> None:
            if watcher.live:
                watcher._on_start(action_name)
            return orig_start(action_name)

        def stop(action_name: str) -> None:
            out = orig_stop(action_name)
            if watcher.live:
                watcher._on_stop(action_name)
            return out

        self._patched = {"start": start, "stop": stop,
                         "had": {k: k in vars(profiler) for k in ("start", "stop")},
                         "orig": {"start": vars(profiler).get("start"), "stop": vars(profiler).get("stop")}}
        profiler.start, profiler.stop = start, stop
        self._profiler = profiler
        self.live = True

    def detach(self) -> None:
        profiler, patched = self._profiler, self._patched
        # If someone wrapped over us, our wrapper has to stay in their chain; it then only delegates.
        self.live = False
        if profiler is None or not patched:
            return
        for k in ("start", "stop"):
            if vars(profiler).get(k) is patched[k]:
                if patched["had"][k]:
                    setattr(profiler, k, patched["orig"][k])
                else:
                    delattr(profiler, k)
        self._profiler, self._patched = None, {}
