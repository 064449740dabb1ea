"""Which parts are still sizing their GPU memory step by step (see Note [One part sizes GPU memory at a time]).

Note [One part sizes GPU memory at a time]
    ActivationOffload's budget measures and relaxes its plan one step at a time against the device's memory, and
    SuperOffload's auto tail grows into the room it measures beside a step's peak. Each takes the other's memory as
    fixed: if both change the step's footprint in the same steps, the room one measured is gone when it acts, and a
    step can run out of memory. So a part that is sizing its GPU footprint says so here (:func:`set_sizing`) while
    it does, and the other parts hold their own growth until :func:`sizing` names nobody else.

Example::

    >>> class Budget: ...
    >>> owner = Budget()
    >>> set_sizing(owner, "ActivationOffload", True)
    >>> sizing(exclude="SuperOffload")
    ['ActivationOffload']
    >>> set_sizing(owner, "ActivationOffload", False)
    >>> sizing()
    []
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["set_sizing", "sizing"]

_lock = threading.Lock()
_sizing: dict[int, tuple[weakref.ref, str]] = {}  # id(owner) -> (owner, part)


def set_sizing(owner: object, part: str, on: bool) -> None:
    """Say that ``owner`` (of ``part``) is (``on``) or is no longer sizing its GPU memory. An owner that is
    garbage-collected stops sizing."""
    with _lock:
        if on:
            _sizing[id(owner)] = (weakref.ref(owner), part)
        else:
            _sizing.pop(id(owner), None)


def sizing(exclude: str | None = None) -> list[str]:
    """The parts sizing their GPU memory now, but ``exclude``."""
    with _lock:
        for key in [k for k, (ref, _) in _sizing.items() if ref() is None]:
            del _sizing[key]
        return sorted({part for _, part in _sizing.values() if part != exclude})
