"""Watching Lightning's profiler actions: the only seam Lightning offers around a batch fetch and a checkpoint save.

Lightning has no callback hook at the start of ``next(dataloader)`` or around ``Trainer.save_checkpoint``, but it
reports both to ``trainer.profiler`` (actions ``"[_TrainingEpochLoop].train_dataloader_next"`` and
``"save_checkpoint"``). :class:`ProfilerActionWatcher` wraps ``start``/``stop`` on that profiler *instance* and
delegates, so whatever profiler the user chose (the default pass-through one included) keeps working. Several
watchers share one wrapper per profiler, removed when the last one detaches.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["FETCH_SUFFIX", "SAVE_ACTION", "ProfilerActionWatcher", "is_fetch"]

FETCH_SUFFIX = "].train_dataloader_next"
SAVE_ACTION = "save_checkpoint"


def is_fetch(action_name: str) -> bool:
    """Whether ``action_name`` is the training loop's fetch of the next batch."""
    return action_name.endswith(FETCH_SUFFIX)


class _Dispatcher:
    """The one wrapper installed on a profiler instance; every watcher of that profiler is called through it.

    One wrapper per profiler, however many watchers and fits: a Trainer reused for several ``fit`` calls would
    otherwise stack one more wrapper per fit, each holding a callback of an earlier fit.
    """

    def __init__(self, profiler: Any) -> None:
        self.watchers: list[ProfilerActionWatcher] = []
        self.had = {k: k in vars(profiler) for k in ("start", "stop")}
        self.orig = {k: vars(profiler).get(k) for k in ("start", "stop")}
        orig_start, orig_stop = profiler.start, profiler.stop
        watchers = self.watchers

        # Later watchers wrap earlier ones: the last attached sees a start first and a stop last.
        def start(action_name: str) -> None:
            for w in reversed(watchers):
                if w.live:
                    w._on_start(action_name)
            return orig_start(action_name)

        def stop(action_name: str) -> None:
            out = orig_stop(action_name)
            for w in list(watchers):
                if w.live:
                    w._on_stop(action_name)
            return out

        self.start, self.stop = start, stop
        profiler.start, profiler.stop = start, stop

    def uninstall(self, profiler: Any) -> bool:
        """Put the profiler's own methods back; ``False`` when someone wrapped over us (we then stay, delegating)."""
        if any(vars(profiler).get(k) is not getattr(self, k) for k in ("start", "stop")):
            return False
        for k in ("start", "stop"):
            if self.had[k]:
                setattr(profiler, k, self.orig[k])
            else:
                delattr(profiler, k)
        return True


_DISPATCHERS: weakref.WeakKeyDictionary[Any, _Dispatcher] = weakref.WeakKeyDictionary()


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
        self.live = False

    @property
    def attached(self) -> bool:
        return self._profiler is not None

    def attach(self, profiler: Any) -> None:
        if self._profiler is not None:
            self.detach()
        dispatcher = _DISPATCHERS.get(profiler)
        if dispatcher is None:
            dispatcher = _DISPATCHERS[profiler] = _Dispatcher(profiler)
        dispatcher.watchers.append(self)
        self._profiler = profiler
        self.live = True

    def detach(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.live = False
        if profiler is None:
            return
        dispatcher = _DISPATCHERS.get(profiler)
        if dispatcher is None:
            return
        if self in dispatcher.watchers:
            dispatcher.watchers.remove(self)
        # The last watcher out restores the profiler; if someone wrapped over us the dispatcher stays (empty, only
        # delegating) and is reused by the next attach rather than stacked again.
        if not dispatcher.watchers and dispatcher.uninstall(profiler):
            del _DISPATCHERS[profiler]
