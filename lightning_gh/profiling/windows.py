"""Step windows and rank selection, the grammar shared by every callback that acts on chosen steps.

Steps are *optimizer* steps (``trainer.global_step``), so gradient accumulation and checkpoint resume
do not shift a window. The grammar follows TensorRT-LLM's ``TLLM_PROFILE_START_STOP``: comma-separated
inclusive windows, each ``A-B`` or a single step ``N``.

Example::

    >>> sched = StepSchedule.parse("10-14,30")
    >>> sched.window_for(12), sched.window_for(20)
    (StepWindow(start=10, stop=14), None)
    >>> RankSelection.parse("0,3").selects(global_rank=3, local_rank=1, world_size=4)
    True
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass

__all__ = ["STEPS_GRAMMAR", "RANKS_GRAMMAR", "StepWindow", "StepSchedule", "RankSelection"]

STEPS_GRAMMAR = (
    "comma-separated inclusive optimizer-step windows, each 'A-B' (A <= B) or a single step 'N', "
    "non-negative and not overlapping, e.g. '10-14', '10-14,50-52', '7' or '10-14,30' (an int N is step N)"
)
RANKS_GRAMMAR = (
    "'all', or comma-separated items each a global rank 'N', 'last' (the highest rank) or "
    "'localN' (local rank N of every node), e.g. '0', '0,3', 'local0', 'last'"
)

_WINDOW_RE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def _named(where: str, argument: str, value: object) -> str:
    """The head of an error: ``Part(argument=value)``, or ``argument=value`` for an environment variable."""
    return f"{where}({argument}={value!r})" if where else f"{argument}={value!r}"


@dataclass(frozen=True, order=True)
class StepWindow:
    """An inclusive range of optimizer steps ``[start, stop]``."""

    start: int
    stop: int

    def __contains__(self, step: int) -> bool:
        return self.start <= step <= self.stop

    def __len__(self) -> int:
        return self.stop - self.start + 1

    def __str__(self) -> str:
        return str(self.start) if self.start == self.stop else f"{self.start}-{self.stop}"


class StepSchedule:
    """A sorted, non-overlapping set of :class:`StepWindow` with O(log n) lookup per step."""

    def __init__(self, windows: tuple[StepWindow, ...]) -> None:
        self.windows = tuple(sorted(windows))
        self._starts = [w.start for w in self.windows]

    @classmethod
    def parse(cls, spec: str | int, argument: str = "steps", where: str = "") -> StepSchedule:
        """Parse ``spec``; raise naming ``where`` (the part), ``argument``, the bad part and the grammar.

        An int is that single step (``steps=7``, or ``steps: 3`` in a LightningCLI YAML, which arrives as an int).

        Raises:
            TypeError: ``spec`` is neither a string nor an int.
            ValueError: ``spec`` does not follow the grammar.
        """
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = str(spec)
        head = _named(where, argument, spec)
        if not isinstance(spec, str):
            raise TypeError(f"{head}: expected a string of {STEPS_GRAMMAR}; got {type(spec).__name__}.")
        if not spec.strip():
            raise ValueError(f"{head}: expected {STEPS_GRAMMAR}; got an empty string.")
        windows = []
        for part in spec.split(","):
            m = _WINDOW_RE.match(part)
            if m is None:
                hint = " (negative steps are not allowed)" if part.strip().startswith("-") else ""
                raise ValueError(f"{head}: bad window {part.strip()!r}{hint}; expected {STEPS_GRAMMAR}.")
            start = int(m.group(1))
            stop = int(m.group(2)) if m.group(2) is not None else start
            if stop < start:
                raise ValueError(
                    f"{head}: window {part.strip()!r} is reversed ({start} > {stop}); expected {STEPS_GRAMMAR}."
                )
            windows.append(StepWindow(start, stop))
        windows.sort()
        for a, b in zip(windows, windows[1:]):
            if b.start <= a.stop:
                raise ValueError(f"{head}: windows {a} and {b} overlap; expected {STEPS_GRAMMAR}.")
        return cls(tuple(windows))

    @classmethod
    def resolve(cls, steps: str | int | None, env_var: str | None = None, argument: str = "steps",
                where: str = "") -> StepSchedule | None:
        """``steps`` unless the environment variable ``env_var`` is set (it wins); ``None`` means every step."""
        env = os.environ.get(env_var) if env_var else None
        if env is not None and env.strip():
            return cls.parse(env, argument=env_var)
        if steps is None:
            return None
        return cls.parse(steps, argument=argument, where=where)

    def window_for(self, step: int) -> StepWindow | None:
        """The window holding ``step``, or ``None``."""
        i = bisect.bisect_right(self._starts, step) - 1
        if i >= 0 and step <= self.windows[i].stop:
            return self.windows[i]
        return None

    def __contains__(self, step: int) -> bool:
        return self.window_for(step) is not None

    def next_window(self, step: int) -> StepWindow | None:
        """The first window that still has steps at or after ``step`` (used to resume inside a window)."""
        i = max(bisect.bisect_right(self._starts, step) - 1, 0)
        for w in self.windows[i:]:
            if w.stop >= step:
                return w
        return None

    @property
    def last_step(self) -> int:
        return self.windows[-1].stop

    def __str__(self) -> str:
        return ",".join(str(w) for w in self.windows)

    def __repr__(self) -> str:
        return f"StepSchedule({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepSchedule) and self.windows == other.windows

    def __hash__(self) -> int:
        return hash(self.windows)


@dataclass(frozen=True)
class RankSelection:
    """Which processes act: ``'all'``, global ranks, ``'last'`` and/or ``'localN'``."""

    all_ranks: bool = False
    global_ranks: frozenset[int] = frozenset()
    local_ranks: frozenset[int] = frozenset()
    last: bool = False

    @classmethod
    def parse(cls, spec: str, argument: str = "ranks", where: str = "") -> RankSelection:
        """Parse ``spec``; raise naming ``where`` (the part), ``argument``, the bad item and the grammar.

        Raises:
            TypeError: ``spec`` is not a string.
            ValueError: ``spec`` does not follow the grammar.
        """
        head = _named(where, argument, spec)
        if not isinstance(spec, str):
            raise TypeError(f"{head}: expected a string, {RANKS_GRAMMAR}; got {type(spec).__name__}.")
        if not spec.strip():
            raise ValueError(f"{head}: expected {RANKS_GRAMMAR}; got an empty string.")
        if spec.strip().lower() == "all":
            return cls(all_ranks=True)
        global_ranks, local_ranks, last = set(), set(), False
        for part in spec.split(","):
            item = part.strip().lower()
            if item.isdigit():
                global_ranks.add(int(item))
            elif item == "last":
                last = True
            elif item.startswith("local") and item[5:].isdigit():
                local_ranks.add(int(item[5:]))
            else:
                raise ValueError(f"{head}: bad item {part.strip()!r}; expected {RANKS_GRAMMAR}.")
        return cls(False, frozenset(global_ranks), frozenset(local_ranks), last)

    def unmatched(self, world_size: int, local_world_size: int, argument: str = "ranks") -> str | None:
        """Why this selection picks no process of a run of ``world_size`` (``local_world_size`` per node), or ``None``."""
        if self.all_ranks or self.last:
            return None
        if any(r < world_size for r in self.global_ranks) or any(r < local_world_size for r in self.local_ranks):
            return None
        items = sorted(self.global_ranks) + [f"local{r}" for r in sorted(self.local_ranks)]
        return (f"`{argument}` selects {items}, but this run has global ranks 0..{world_size - 1} and local ranks "
                f"0..{local_world_size - 1}: no process is selected, so nothing will be recorded.")

    def selects(self, global_rank: int, local_rank: int, world_size: int) -> bool:
        return (
            self.all_ranks
            or global_rank in self.global_ranks
            or local_rank in self.local_ranks
            or (self.last and global_rank == world_size - 1)
        )
