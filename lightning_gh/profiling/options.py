"""The options of the profiling parts: one frozen, validated dataclass per part.

:class:`ProfilerOptions` (SelectiveProfiler), :class:`NVTXOptions` (NVTXRangeCallback) and :class:`StallOptions`
(DataStallDetector). Each field is documented once, here, with its default; the callbacks take either
``options=`` or the same names as keyword arguments (see :func:`lightning_gh._options.resolve`). A bad value fails
at construction, naming the part, the argument, the value and what is allowed: ``TypeError`` for a wrong type,
``ValueError`` for a value out of range.

Example::

    >>> from lightning_gh.profiling.options import NVTXOptions, ProfilerOptions, StallOptions
    >>> ProfilerOptions(steps="20-24", backends="torch").backends
    ('torch',)
    >>> NVTXOptions(module_ranges=["Block"]).module_ranges
    ('Block',)
    >>> StallOptions(window=0)
    Traceback (most recent call last):
    ...
    ValueError: DataStallDetector(window=0): expected an int >= 1 (batches).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

from lightning_gh.profiling.advice import DATA_WAIT_BOUND
from lightning_gh.profiling.windows import RankSelection, StepSchedule

__all__ = ["BACKENDS", "NVTXOptions", "ProfilerOptions", "StallOptions"]

#: The backends SelectiveProfiler knows, in the order they start.
BACKENDS = ("torch", "nsys", "memory")


def _head(part: str, name: str, value: Any) -> str:
    return f"{part}({name}={value!r})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(part: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{_head(part, name, value)}: expected True or False.")


def _check_count(part: str, name: str, value: Any, low: int, unit: str) -> None:
    if not _is_int(value):
        raise TypeError(f"{_head(part, name, value)}: expected an int >= {low} ({unit}).")
    if value < low:
        raise ValueError(f"{_head(part, name, value)}: expected an int >= {low} ({unit}).")


def _check_steps(part: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, int)) or isinstance(value, bool):
        raise TypeError(f"{_head(part, 'steps', value)}: expected None, a string such as '10-14' or an int (that "
                        "single step).")
    if value is not None:
        StepSchedule.parse(value, argument="steps", where=part)


@dataclass(frozen=True)
class ProfilerOptions:
    """The options of :class:`~lightning_gh.profiling.SelectiveProfiler`."""

    _PART: ClassVar[str] = "SelectiveProfiler"

    steps: str | int | None = "5-7"
    """Inclusive windows of optimizer steps (``trainer.global_step``) to profile: ``"10-14"``, ``"10-14,50-52"``,
    ``"7"`` or ``7`` (an int is that single step); ``None`` is the default windows. The environment variable
    ``LGH_PROFILE_START_STOP`` (same grammar) overrides it, and says so once."""

    ranks: str = "0"
    """Which processes profile: ``"0"``, ``"0,3"``, ``"all"``, ``"local0"`` (local rank 0 of every node) or
    ``"last"``. Other ranks do nothing."""

    backends: tuple[str, ...] = ("torch",)
    """Any of ``"torch"`` (a Kineto trace), ``"nsys"`` (``cudaProfilerStart/Stop`` and NVTX ranges) and
    ``"memory"`` (CUDA caching-allocator history), each once; a single string is one backend. The GPU-only
    backends warn once and step aside off-GPU."""

    output_dir: str | os.PathLike | None = None
    """Where windows are written, one folder per window (``steps10-14/``) holding every rank's files. ``None``:
    ``profiles/`` in the trainer's log dir (the first logger's folder, else ``Trainer(default_root_dir=...)``),
    where Lightning's own profilers write. Created at setup: a folder that cannot be created fails the run before
    its first step."""

    summary: bool = True
    """After each window, analyse the torch trace into ``*.summary.{json,md,png}`` and log its verdict."""

    record_shapes: bool = False
    """Passed to ``torch.profiler.profile``: record operator input shapes (grows the trace)."""

    with_stack: bool = False
    """Passed to ``torch.profiler.profile``: record Python stacks of operators (grows the trace)."""

    profile_memory: bool = False
    """Passed to ``torch.profiler.profile``: record tensor allocations and frees (grows the trace)."""

    def __post_init__(self) -> None:
        part = self._PART
        _check_steps(part, self.steps)
        RankSelection.parse(self.ranks, argument="ranks", where=part)
        backends = self.backends
        if isinstance(backends, str):
            backends = (backends,)
        if not isinstance(backends, (list, tuple)) or not all(isinstance(b, str) for b in backends):
            raise TypeError(f"{_head(part, 'backends', self.backends)}: expected a sequence of names from {BACKENDS}.")
        if not backends:
            raise ValueError(f"{_head(part, 'backends', self.backends)}: expected at least one of {BACKENDS}.")
        bad = [b for b in backends if b not in BACKENDS]
        if bad:
            raise ValueError(f"{_head(part, 'backends', tuple(backends))}: expected names from {BACKENDS}; unknown "
                             f"backend(s) {bad}.")
        if len(set(backends)) != len(backends):
            raise ValueError(f"{_head(part, 'backends', tuple(backends))}: expected each backend once.")
        object.__setattr__(self, "backends", tuple(backends))
        out = self.output_dir
        if out is not None and not isinstance(out, (str, os.PathLike)):
            raise TypeError(f"{_head(part, 'output_dir', out)}: expected a path (str or os.PathLike) or None.")
        if out is not None and not str(out):
            raise ValueError(f"{_head(part, 'output_dir', out)}: expected a non-empty path, or None (the trainer's "
                             "log dir).")
        for name in ("summary", "record_shapes", "with_stack", "profile_memory"):
            _check_bool(part, name, getattr(self, name))

    @property
    def schedule_spec(self) -> str | int:
        """``steps``, with ``None`` replaced by the default windows."""
        return ProfilerOptions.steps if self.steps is None else self.steps  # type: ignore[return-value]

    def folder(self, log_dir: str | os.PathLike | None) -> Path:
        """The folder windows go to: ``output_dir``, else ``profiles/`` under ``log_dir`` (else the working dir)."""
        if self.output_dir is not None:
            return Path(self.output_dir)
        return Path(log_dir or ".") / "profiles"


@dataclass(frozen=True)
class NVTXOptions:
    """The options of :class:`~lightning_gh.profiling.NVTXRangeCallback`."""

    _PART: ClassVar[str] = "NVTXRangeCallback"

    steps: str | int | None = None
    """Optimizer steps to annotate, e.g. ``"20-24"`` or ``"10-14,50"`` (the grammar of
    :class:`~lightning_gh.profiling.windows.StepSchedule`); ``None`` annotates every step. The environment
    variable ``LGH_NVTX_STEPS`` overrides it. Outside the selected steps nothing is pushed, and module hooks are
    removed."""

    ranks: str = "all"
    """Which processes annotate: ``"all"``, ``"0"``, ``"0,3"``, ``"local0"``, ``"last"``."""

    domain: str = "lightning_gh"
    """The NVTX domain name (Nsight Systems shows it as its own row)."""

    module_ranges: bool | tuple[str, ...] = False
    """``True`` for a range around each module two levels below the LightningModule (containers such as
    ``nn.ModuleList`` are looked through: for an LLM, the network, its embedding, each block, the final norm and
    the head); a list of fnmatch patterns on qualified names or class names (``["Block", "model.head"]``) to
    choose; ``False`` for none. Modules inside a ``torch.compile`` wrapper are skipped with a warning. Patterns
    that match no module fail at setup."""

    gc_ranges: bool = False
    """A ``gc`` range around every Python garbage collection (payload: its generation)."""

    def __post_init__(self) -> None:
        part = self._PART
        _check_steps(part, self.steps)
        RankSelection.parse(self.ranks, argument="ranks", where=part)
        if not isinstance(self.domain, str):
            raise TypeError(f"{_head(part, 'domain', self.domain)}: expected a non-empty string, e.g. 'lightning_gh'.")
        if not self.domain.strip():
            raise ValueError(f"{_head(part, 'domain', self.domain)}: expected a non-empty string, e.g. "
                             "'lightning_gh'.")
        object.__setattr__(self, "module_ranges", _module_patterns(part, self.module_ranges))
        _check_bool(part, "gc_ranges", self.gc_ranges)


def _module_patterns(part: str, spec: Any) -> bool | tuple[str, ...]:
    if isinstance(spec, bool):
        return spec
    head = _head(part, "module_ranges", spec)
    if isinstance(spec, str):
        raise TypeError(f"{head}: expected True/False or a list of patterns; write [{spec!r}] for one pattern.")
    if not isinstance(spec, Sequence):
        raise TypeError(f"{head}: expected True/False or a list of module name / class name patterns such as "
                        "['Block', 'model.head'].")
    patterns = tuple(spec)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{head}: expected a list of strings (fnmatch patterns on module names or class names).")
    if not patterns or not all(p.strip() for p in patterns):
        raise ValueError(f"{head}: expected a non-empty list of non-empty strings (fnmatch patterns on module names "
                         "or class names), or True/False.")
    return patterns


@dataclass(frozen=True)
class StallOptions:
    """The options of :class:`~lightning_gh.profiling.DataStallDetector`."""

    _PART: ClassVar[str] = "DataStallDetector"

    threshold: float = DATA_WAIT_BOUND
    """Warn when the data-wait share ``sum(wait) / sum(wait + step)`` over a full window reaches this share
    (0 < x < 1); the default is the trace summary's input-bound threshold,
    :data:`~lightning_gh.profiling.advice.DATA_WAIT_BOUND`."""

    window: int = 50
    """Batches in the rolling window (>= 1)."""

    warmup: int = 5
    """Batches not counted at the start of every epoch, while DataLoader workers start up (>= 0)."""

    log_metric: bool = True
    """Log ``lgh/data_wait_frac`` through ``trainer.loggers``."""

    def __post_init__(self) -> None:
        part = self._PART
        t = self.threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            raise TypeError(f"{_head(part, 'threshold', t)}: expected a share strictly between 0 and 1.")
        if math.isnan(t) or not 0 < t < 1:
            raise ValueError(f"{_head(part, 'threshold', t)}: expected a share strictly between 0 and 1.")
        object.__setattr__(self, "threshold", float(t))
        _check_count(part, "window", self.window, 1, "batches")
        _check_count(part, "warmup", self.warmup, 0, "batches per epoch")
        _check_bool(part, "log_metric", self.log_metric)
