"""SelectiveProfiler's backends: what starts and stops recording a window, one class per mechanism.

``torch`` drives ``torch.profiler`` by hand (one Kineto trace per window), ``nsys`` calls
``cudaProfilerStart/Stop`` and pushes NVTX ranges for ``nsys profile --capture-range=cudaProfilerApi``, ``memory``
records the CUDA caching allocator's history. They use separate mechanisms, so all three can run in one window.
A backend that cannot run here warns once (:func:`lightning_gh._util.warn_once`) and steps aside.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from lightning_gh._util import warn_once

__all__ = ["Backend", "MemoryBackend", "NSYS_ENV_VARS", "NsysBackend", "TorchBackend", "WARN_KEY", "nsys_command",
           "under_nsys"]

NSYS_ENV_VARS = ("NSYS_PROFILING_SESSION_ID",)
#: The prefix of SelectiveProfiler's keys in :func:`lightning_gh._util.warn_once` (tests reset them by it).
WARN_KEY = "profiler:"


def _warn_once(key: str, message: str) -> None:
    warn_once(WARN_KEY + key, message, UserWarning, stacklevel=4)


def under_nsys(environ: Mapping[str, str] | None = None) -> str | None:
    """Which environment variable shows this process runs under Nsight Systems, or ``None``.

    nsys sets ``NSYS_PROFILING_SESSION_ID`` in every process it profiles; as a fallback, a ``CUDA_INJECTION64_PATH``
    pointing at an Nsight ``ToolsInjection`` library also counts.
    """
    env = os.environ if environ is None else environ
    for name in NSYS_ENV_VARS:
        if env.get(name):
            return name
    if "ToolsInjection" in env.get("CUDA_INJECTION64_PATH", ""):
        return "CUDA_INJECTION64_PATH"
    return None


def nsys_command(output: str | os.PathLike, argv: Sequence[str] | None = None) -> str:
    """The ``nsys profile`` command line that captures exactly the windows of this process's command."""
    # sys.orig_argv is the command exactly as the interpreter got it (``python -m pkg ...`` stays that way).
    argv = list(argv) if argv is not None else list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    cmd = ["nsys", "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=repeat",
           "--trace=cuda,nvtx,osrt", "--sample=none", "--cpuctxsw=none", "-o", f"{output}/nsys_%p"]
    return shlex.join(cmd + argv)


class Backend:
    name = ""
    suffix: str | None = None  # file written per window, or None

    def start(self, step: int, meta: dict[str, Any]) -> bool:
        raise NotImplementedError

    def step(self, step: int) -> None:
        """The previous step finished; ``step`` begins."""

    def push(self, name: str) -> None:
        """Open a named range (phases)."""

    def pop(self) -> None:
        """Close the innermost range opened by :meth:`push`."""

    def stop(self, path: Path | None) -> Path | None:
        raise NotImplementedError


def _all_threads_config() -> dict[str, Any]:
    """``torch.profiler.profile`` keywords that record the host operators of every thread (SuperOffload's CPU update
    runs on a thread of its own; see :mod:`lightning_gh.profiling.offload_analysis`), or none where this torch
    cannot."""
    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        return {}


def _record_always(step: int) -> Any:
    # A schedule makes torch.profiler emit ProfilerStep#<n> markers; recording every step keeps the window whole.
    return torch.profiler.ProfilerAction.RECORD


class TorchBackend(Backend):
    name = "torch"
    suffix = ".pt.trace.json.gz"

    def __init__(self, record_shapes: bool, with_stack: bool, profile_memory: bool) -> None:
        self.kwargs = dict(record_shapes=record_shapes, with_stack=with_stack, profile_memory=profile_memory)
        self.prof: Any = None
        self._ranges: list[Any] = []

    #: sessions of this backend running in this process: one that records every thread leaves
    #: ``torch.autograd._profiler_enabled()`` off, so a second one is told apart here
    active = 0

    def start(self, step: int, meta: dict[str, Any]) -> bool:
        enabled = getattr(torch.autograd, "_profiler_enabled", lambda: False)()
        if enabled or TorchBackend.active:
            _warn_once("torch-busy", "SelectiveProfiler: another torch.profiler session is already active in this "
                                     "process, so the 'torch' backend skips this window (the other backends run).")
            return False
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, schedule=_record_always, **self.kwargs,
                                           **_all_threads_config())
        self.prof.step_num = step
        self.prof.start()
        TorchBackend.active += 1
        self.note("lgh", meta)
        return True

    def note(self, key: str, value: Any) -> None:
        """Add ``key: value`` (JSON) to the trace's top level; only while recording."""
        try:
            self.prof.add_metadata_json(key, json.dumps(value))
        except Exception:
            pass

    def step(self, step: int) -> None:
        # step() advances step_num by one; set it so the new marker is ProfilerStep#<global step> even when an
        # optimizer step moved global_step by more than one.
        self.prof.step_num = step - 1
        self.prof.step()

    def push(self, name: str) -> None:
        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        self._ranges.append(rf)

    def pop(self) -> None:
        if self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def stop(self, path: Path | None) -> Path | None:
        while self._ranges:
            self.pop()
        prof, self.prof = self.prof, None
        TorchBackend.active -= 1
        prof.stop()
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))  # gzip because the name ends in .gz
        return path


class NsysBackend(Backend):
    name = "nsys"

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self._depth = 0

    def start(self, step: int, meta: dict[str, Any]) -> bool:
        if not torch.cuda.is_available():
            _warn_once("nsys-cpu", "SelectiveProfiler: backend 'nsys' needs a CUDA GPU (cudaProfilerStart); "
                                   "none is available, so it is skipped.")
            return False
        if under_nsys() is None:
            _warn_once("nsys-cmd", f"SelectiveProfiler: backend 'nsys' is on but this process is not running under "
                                   f"Nsight Systems ({NSYS_ENV_VARS[0]} is not set). To capture exactly the profiled "
                                   f"windows, run:\n  {nsys_command(self.output_dir)}")
        torch.cuda.profiler.start()
        self.push(f"lgh/step {step}")
        return True

    def step(self, step: int) -> None:
        self.pop()
        self.push(f"lgh/step {step}")

    def push(self, name: str) -> None:
        torch.cuda.nvtx.range_push(name)
        self._depth += 1

    def pop(self) -> None:
        if self._depth:
            torch.cuda.nvtx.range_pop()
            self._depth -= 1

    def stop(self, path: Path | None) -> Path | None:
        while self._depth:
            self.pop()
        # Let the window's GPU work finish inside the capture range.
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return None


class MemoryBackend(Backend):
    name = "memory"
    suffix = ".memory.pickle"

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries

    def start(self, step: int, meta: dict[str, Any]) -> bool:
        if not torch.cuda.is_available():
            _warn_once("memory-cpu", "SelectiveProfiler: backend 'memory' records the CUDA caching allocator and "
                                     "needs a CUDA GPU; none is available, so it is skipped.")
            return False
        # Python stacks only: C++ stacks make every allocation and the snapshot's symbolisation far slower.
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return True

    def stop(self, path: Path | None) -> Path | None:
        try:
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return path
