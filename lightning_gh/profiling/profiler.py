"""SelectiveProfiler: profile only chosen optimizer steps on chosen ranks, then say where the time went.

Windows count **optimizer steps** (``trainer.global_step``), inclusive, in the grammar of
:mod:`lightning_gh.profiling.windows` (``"10-14,30"``); the environment variable ``LGH_PROFILE_START_STOP``
overrides ``steps`` so a run can be profiled without editing it. Outside a window nothing is active: no profiler
object exists, no ``record_function`` range is opened, and each hook returns after one integer comparison.

Inside a window, per backend:

* ``"torch"``: ``torch.profiler`` (CPU, plus CUDA when present), driven by hand so that step ``n`` of the window
  is the trace's ``ProfilerStep#n`` (what Holistic Trace Analysis and TensorBoard read). One gzip chrome trace per
  window per rank, ``<output_dir>/steps<A-B>/rank<r>_steps<a-b>.pt.trace.json.gz`` (opens in Perfetto), then
  ``rank<r>_steps<a-b>.summary.{json,md,png}`` next to it (see :mod:`lightning_gh.profiling.summary`).
* ``"nsys"``: ``cudaProfilerStart/Stop`` around the window and NVTX ranges per step and phase, for
  ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat``. Without nsys attached (detected by
  the ``NSYS_PROFILING_SESSION_ID`` variable nsys sets in the processes it profiles, or an Nsight injection library
  in ``CUDA_INJECTION64_PATH``) the exact command to use is logged once.
* ``"memory"``: CUDA caching-allocator history during the window, dumped to ``rank<r>_steps<a-b>.memory.pickle``
  (open it at https://pytorch.org/memory_viz).

The backends use separate mechanisms, so all three can run in one window. Phase ranges ``lgh/data_wait``,
``lgh/forward``, ``lgh/backward``, ``lgh/optimizer`` (and ``lgh/validation``) are the phases of the shared
:class:`~lightning_gh.profiling.phases.StepPhaseTracker` (the definitions NVTXRangeCallback and DataStallDetector
use), opened inside windows only, one at a time, so the summary can break the step down: ``lgh/data_wait`` from the
start of Lightning's fetch to the forward (the host-to-device copy included), ``lgh/forward`` to the backward
(``zero_grad`` included), ``lgh/backward`` to its end, ``lgh/optimizer`` until the optimizer's ``step`` returns.

A step of the window spans from the end of the previous optimizer step to the end of its own: its data wait, its
forward/backward micro-batches and its optimizer step (plus validation, if Lightning runs it in between). The first
step of a window that starts at step 0 or on resume inside the window begins at its batch start instead.

Example::

    import lightning as L
    from lightning_gh.profiling import SelectiveProfiler

    trainer = L.Trainer(callbacks=[SelectiveProfiler(steps="20-24", ranks="0")])
    trainer.fit(model, datamodule)   # -> profiles/steps20-24/rank0_steps20-24.{pt.trace.json.gz,summary.md,...}
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gh import compat
from lightning_gh._lightning import is_last_training_batch, log_to_loggers
from lightning_gh.profiling.phases import StepPhaseTracker
from lightning_gh.profiling.windows import RankSelection, StepSchedule, StepWindow

__all__ = ["SelectiveProfiler", "ENV_VAR", "DEFAULT_STEPS", "BACKENDS", "under_nsys", "nsys_command"]

log = logging.getLogger(__name__)

ENV_VAR = "LGH_PROFILE_START_STOP"
DEFAULT_STEPS = "5-7"
BACKENDS = ("torch", "nsys", "memory")
NSYS_ENV_VARS = ("NSYS_PROFILING_SESSION_ID",)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


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


def _check_writable(output_dir: Path) -> None:
    """Fail now, naming the path, if ``output_dir`` cannot be created or written (not after the first window)."""
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"SelectiveProfiler(output_dir={str(output_dir)!r}): {str(existing)!r} is a file, not a "
                         "folder; pick a folder the windows can be written to.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"SelectiveProfiler(output_dir={str(output_dir)!r}): {str(existing)!r} is not writable by "
                         "this process, so no window could be saved; pick a writable folder.")


def window_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The window's verdict as logger metrics: GPU idle share, data-wait share and mean step time."""
    out: dict[str, float] = {}
    g = summary.get("gpu")
    if g is not None:
        out["lgh/profile_gpu_idle_frac"] = float(g["idle_share"])
    wait = summary.get("data_wait") or {}
    out["lgh/profile_data_wait_frac"] = float(wait.get("share", 0.0))
    st = summary.get("step_time_ms")
    if st:
        out["lgh/profile_step_time_ms"] = float(st["mean"])
    return out


# ---------------------------------------------------------------------------------------------- backends
class _Backend:
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


def _record_always(step: int) -> Any:
    # A schedule makes torch.profiler emit ProfilerStep#<n> markers; recording every step keeps the window whole.
    return torch.profiler.ProfilerAction.RECORD


class _TorchBackend(_Backend):
    name = "torch"
    suffix = ".pt.trace.json.gz"

    def __init__(self, record_shapes: bool, with_stack: bool, profile_memory: bool) -> None:
        self.kwargs = dict(record_shapes=record_shapes, with_stack=with_stack, profile_memory=profile_memory)
        self.prof: Any = None
        self._ranges: list[Any] = []

    def start(self, step: int, meta: dict[str, Any]) -> bool:
        enabled = getattr(torch.autograd, "_profiler_enabled", lambda: False)()
        if enabled:
            _warn_once("torch-busy", "SelectiveProfiler: another torch.profiler session is already active in this "
                                     "process, so the 'torch' backend skips this window (the other backends run).")
            return False
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, schedule=_record_always, **self.kwargs)
        self.prof.step_num = step
        self.prof.start()
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
        prof.stop()
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))  # gzip because the name ends in .gz
        return path


class _NsysBackend(_Backend):
    name = "nsys"

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self._depth = 0

    def start(self, step: int, meta: dict[str, Any]) -> bool:
        if not torch.cuda.is_available():
            _warn_once("nsys-cpu", "SelectiveProfiler: backend 'nsys' needs a CUDA GPU (cudaProfilerStart); "
                                   "none is available, so it is skipped.")
            return False
        if under_nsys() is None and "nsys-cmd" not in _warned:
            _warned.add("nsys-cmd")
            log.warning("SelectiveProfiler: backend 'nsys' is on but this process is not running under Nsight Systems "
                        "(%s is not set). To capture exactly the profiled windows, run:\n  %s",
                        NSYS_ENV_VARS[0], nsys_command(self.output_dir))
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


class _MemoryBackend(_Backend):
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


# ---------------------------------------------------------------------------------------------- callback
@dataclass
class _Window:
    window: StepWindow
    first: int
    current: int
    backends: list[_Backend]
    batches: int = 0
    last_run: int = -1  # the last step that started a batch
    open: list[str] = field(default_factory=list)
    fetch_ms: dict[int, float] = field(default_factory=dict)  # ms in Lightning's fetch, per step
    fetch_t0: float | None = None


class SelectiveProfiler(Callback):
    """Profile chosen optimizer steps on chosen ranks with torch.profiler / nsys / CUDA memory history.

    Args:
        steps: inclusive windows of optimizer steps (``trainer.global_step``): ``"10-14"``, ``"10-14,50-52"``,
            ``"7"`` or ``7`` (an int is that single step). ``None`` means ``"5-7"``. The environment variable
            ``LGH_PROFILE_START_STOP`` (same grammar) overrides it, and says so once.
        ranks: ``"0"``, ``"0,3"``, ``"all"``, ``"local0"`` (local rank 0 of every node) or ``"last"``. Other ranks
            do nothing.
        backends: any of ``"torch"``, ``"nsys"``, ``"memory"``. GPU-only backends warn once and step aside off-GPU.
        output_dir: where windows are written, one folder per window (``steps10-14/``) holding every rank's files.
            Checked at setup: a folder that cannot be created or written fails the run before its first step.
        summary: after each window, analyse the torch trace into ``*.summary.{json,md,png}``.
        record_shapes / with_stack / profile_memory: passed to ``torch.profiler.profile`` (they grow the trace).

    Raises:
        ValueError: a bad argument (the message names it, the value and what is allowed); at setup, a
            ``Trainer(profiler=PyTorchProfiler(...))`` together with the ``"torch"`` backend, or an ``output_dir``
            that cannot be written.

    Attributes:
        written: one entry per finished window: ``{"window", "steps", "files", "reason"}``. Each written window
            is also announced in one line on stdout, and its verdict logged through ``trainer.loggers``
            (``lgh/profile_gpu_idle_frac``, ``lgh/profile_data_wait_frac``, ``lgh/profile_step_time_ms``).

    Example::

        trainer = L.Trainer(callbacks=[SelectiveProfiler(steps="20-24", ranks="0,last", backends=("torch", "memory"))])
        trainer.fit(model, datamodule)
        # profiles/steps20-24/rank0_steps20-24.summary.md: step times, GPU busy/idle, top kernels, phases, verdict
    """

    lgh_part = "SelectiveProfiler"
    # Its on_before_optimizer_step only marks a phase boundary: the fp8 plugins' fused master update may run.
    lgh_reads_gradients = False

    def __init__(
        self,
        steps: str | int | None = None,
        ranks: str = "0",
        backends: Sequence[str] = ("torch",),
        output_dir: str | Path = "profiles",
        summary: bool = True,
        record_shapes: bool = False,
        with_stack: bool = False,
        profile_memory: bool = False,
    ) -> None:
        if steps is not None and (not isinstance(steps, (str, int)) or isinstance(steps, bool)):
            raise ValueError(f"SelectiveProfiler(steps={steps!r}): must be a string such as '10-14', an int (that "
                             "single step) or None.")
        self.steps = steps
        self._schedule = self._resolve()
        self.ranks = ranks
        self._ranks = RankSelection.parse(ranks, argument="ranks")
        if isinstance(backends, str):
            backends = (backends,)
        if not isinstance(backends, (list, tuple)) or not backends:
            raise ValueError(f"SelectiveProfiler(backends={backends!r}): must be a non-empty sequence of {BACKENDS}.")
        bad = [b for b in backends if b not in BACKENDS]
        if bad:
            raise ValueError(f"SelectiveProfiler(backends={tuple(backends)!r}): unknown backend(s) {bad}; "
                             f"allowed: {BACKENDS}.")
        if len(set(backends)) != len(backends):
            raise ValueError(f"SelectiveProfiler(backends={tuple(backends)!r}): each backend may appear once.")
        self.backends = tuple(backends)
        if not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir):
            raise ValueError(f"SelectiveProfiler(output_dir={output_dir!r}): must be a non-empty path.")
        self.output_dir = Path(output_dir)
        for name, value in (("summary", summary), ("record_shapes", record_shapes), ("with_stack", with_stack),
                            ("profile_memory", profile_memory)):
            if not isinstance(value, bool):
                raise ValueError(f"SelectiveProfiler({name}={value!r}): must be True or False.")
        self.summary = summary
        self.record_shapes, self.with_stack, self.profile_memory = record_shapes, with_stack, profile_memory
        self.written: list[dict[str, Any]] = []
        self._selected = False
        self._rank, self._world = 0, 1
        self._arm_start: int | None = None
        self._active: _Window | None = None
        self._backend_objs: list[_Backend] = []
        self._tracker: StepPhaseTracker | None = None

    def _resolve(self) -> StepSchedule:
        schedule = StepSchedule.resolve(self.steps if self.steps is not None else DEFAULT_STEPS, ENV_VAR)
        assert schedule is not None
        return schedule

    @property
    def schedule(self) -> StepSchedule:
        """The windows in force (after the environment override)."""
        return self._schedule

    # -- setup
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.profilers import PyTorchProfiler

        if "torch" in self.backends and isinstance(trainer.profiler, PyTorchProfiler):
            raise ValueError(
                "SelectiveProfiler(backends=%r) cannot run with Trainer(profiler=%s): both drive torch.profiler, and "
                "only one torch.profiler session can be enabled in a process (torch fails with 'profiler already "
                "enabled'). Drop Trainer(profiler=...) (SelectiveProfiler's windows replace it), or keep it and use "
                "SelectiveProfiler(backends=('nsys', 'memory')). SimpleProfiler and AdvancedProfiler work alongside."
                % (self.backends, type(trainer.profiler).__name__))
        compat.check(trainer, self.lgh_part)
        self._schedule = self._resolve()  # the environment may have changed since __init__
        env = os.environ.get(ENV_VAR, "").strip()
        if env and f"env:{env}" not in _warned and trainer.global_rank == 0:
            # stdout, once per process: a run profiling other steps than its config says must say why.
            _warned.add(f"env:{env}")
            print(f"SelectiveProfiler: {ENV_VAR}={env!r} overrides steps={self.steps!r}; profiling steps "
                  f"{self._schedule}.", flush=True)
        self._rank = trainer.global_rank
        unmatched = self._ranks.unmatched(trainer.world_size, trainer.num_devices)
        if unmatched:
            rank_zero_warn(f"SelectiveProfiler: {unmatched}")
        self._selected = self._ranks.selects(trainer.global_rank, trainer.local_rank, trainer.world_size)
        if self._selected:
            _check_writable(self.output_dir)
        self._world = trainer.world_size
        if self._tracker is not None:
            self._tracker.detach()
        self._tracker = StepPhaseTracker([self])
        if self._selected:
            self._tracker.attach(trainer)
        self._backend_objs = []
        for name in self.backends:
            if name == "torch":
                self._backend_objs.append(_TorchBackend(self.record_shapes, self.with_stack, self.profile_memory))
            elif name == "nsys":
                self._backend_objs.append(_NsysBackend(self.output_dir))
            else:
                self._backend_objs.append(_MemoryBackend())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # global_step is restored from a checkpoint by now: a resumed run arms what remains of its windows.
        self._arm(trainer.global_step)
        if self._selected and self._tracker is not None:
            self._tracker.automatic = pl_module.automatic_optimization
            self._tracker.watch_optimizers(trainer.optimizers)

    def _arm(self, step: int) -> None:
        w = self._schedule.next_window(step) if self._selected else None
        self._arm_start = None if w is None else max(w.start, step)

    # -- the per-step path: outside a window each hook is one or two comparisons. Inside one, the hooks feed the
    # shared phase tracker, whose phases become the lgh/ ranges (phase_started / phase_ended below).
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        win = self._active
        if win is None:
            if self._arm_start is None or trainer.global_step < self._arm_start:
                return
            step = trainer.global_step
            if self._schedule.window_for(step) is None:  # jumped past a window (several steps per batch)
                self._arm(step)
                if self._arm_start is None or step < self._arm_start:
                    return
            win = self._begin(trainer, step)
            if win is None:
                return
        win.batches += 1
        win.last_run = win.current
        self._tracker.on_train_batch_start(trainer)

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._active is not None:
            self._tracker.on_before_zero_grad(trainer)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._active is not None:
            self._tracker.on_before_backward(trainer)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active is not None:
            self._tracker.on_after_backward(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._active is not None:
            self._tracker.on_before_optimizer_step(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        win = self._active
        if win is None:
            if self._arm_start is not None and trainer.global_step == self._arm_start:
                self._begin_early(trainer)
            return
        self._tracker.on_train_batch_end(trainer)
        self._close()
        step = trainer.global_step
        if step <= win.current:  # accumulating: the next micro-batch belongs to the same optimizer step
            return
        if step > win.window.stop:
            self._finish(trainer, "window complete")
            self._arm(step)
            if self._arm_start == step:  # an adjacent window ("2-3,4-5") begins right away
                self._begin_early(trainer)
            return
        if not self._may_continue(trainer):
            # The run ends here: close the window now rather than open a step that never runs.
            self._finish(trainer, "end of training")
            return
        for b in win.backends:
            b.step(step)
        win.current = step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active is not None:
            self._tracker.on_validation_start(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active is not None:
            self._tracker.on_validation_end(trainer)

    # -- ends that are not a window's last step
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer, "end of training")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._finish(trainer, f"exception: {type(exception).__name__}: {str(exception)[:200]}")
        if self._tracker is not None:  # leave the Trainer's profiler as it was, whatever follows the fault
            self._tracker.detach()
            self._tracker = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._finish(trainer, "teardown")
        if self._tracker is not None:
            self._tracker.detach()
            self._tracker = None

    # -- phases of the shared tracker -> lgh/ ranges, one open at a time. The fetch is also timed exactly: the
    # summary's data wait is the stall detector's.
    _RANGED = ("data_wait", "forward", "backward", "optimizer", "validation")

    def phase_started(self, phase: str, step: int, t: float) -> None:
        win = self._active
        if win is None:
            return
        if phase == "data_wait":
            win.fetch_t0 = t
            if "forward" in win.open:  # training_step fetching for itself: its forward goes on
                return
        if phase in self._RANGED:  # zero_grad stays in lgh/forward, a checkpoint in what holds it
            self._close()
            self._open(phase)

    def phase_ended(self, phase: str, step: int, t: float) -> None:
        win = self._active
        if win is None:
            return
        if phase == "data_wait" and win.fetch_t0 is not None:
            win.fetch_ms[step] = win.fetch_ms.get(step, 0.0) + 1e3 * (t - win.fetch_t0)
            win.fetch_t0 = None
        # lgh/data_wait holds the host-to-device copy up to the forward, and lgh/forward the zero_grad up to the
        # backward: those end when the next phase starts. The others end with their phase.
        if phase in ("backward", "optimizer", "validation") and phase in win.open:
            self._close()

    # -- internals
    def _begin_early(self, trainer: L.Trainer) -> None:
        """Step ``start - 1`` just finished: begin now, so the first step's data wait is inside the window."""
        if trainer.global_step > 0 and self._may_continue(trainer):
            self._begin(trainer, trainer.global_step)

    @staticmethod
    def _may_continue(trainer: L.Trainer) -> bool:
        """Whether another training batch follows the one that just ended."""
        if (trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step) or trainer.should_stop:
            return False
        last_batch = is_last_training_batch(trainer)
        last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
        return not (last_batch and last_epoch)

    def _open(self, phase: str) -> None:
        win = self._active
        win.open.append(phase)
        for b in win.backends:
            b.push("lgh/" + phase)

    def _close(self) -> None:
        win = self._active
        while win.open:
            win.open.pop()
            for b in reversed(win.backends):
                b.pop()

    def _begin(self, trainer: L.Trainer, step: int) -> _Window | None:
        window = self._schedule.window_for(step)
        if window is None:
            return None
        meta = {"window": str(window), "first_step": step, "rank": self._rank, "world_size": self._world,
                "backends": list(self.backends)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # Start from an idle GPU: kernels queued before the window would run unrecorded inside its first step
            # and read as idle time.
            torch.cuda.synchronize()
        started = []
        for b in self._backend_objs:
            try:
                if b.start(step, meta):
                    started.append(b)
            except Exception as e:  # a profiler that cannot start must not stop training
                _warn_once(f"start-{b.name}", f"SelectiveProfiler: backend {b.name!r} failed to start "
                                              f"({type(e).__name__}: {e}); it is skipped.")
        if not started:
            # Nothing can record here (e.g. only GPU backends on a CPU run): skip to the next window.
            self._arm(window.stop + 1)
            return None
        self._active = _Window(window, step, step, started)
        return self._active

    def _finish(self, trainer: L.Trainer, reason: str) -> None:
        win = self._active
        if win is None:
            return
        self._close()
        self._active = None
        discard = win.batches == 0  # begun early but training ended before the step ran: nothing to keep
        folder = self.output_dir / f"steps{win.window}"
        # Name by the steps that ran: a stop decided after this hook (another callback setting should_stop) can
        # leave the last marker without a batch.
        last = max(win.last_run, win.first)
        for b in win.backends:
            if isinstance(b, _TorchBackend):
                b.note("lgh_steps", [win.first, last])  # the summary ignores a trailing marker without a batch
                if win.fetch_ms:
                    b.note("lgh_fetch_ms", {str(k): round(v, 6) for k, v in sorted(win.fetch_ms.items())})
        stem = f"rank{self._rank}_steps{win.first}" + (f"-{last}" if last != win.first else "")
        stem = self._unique(folder, stem, [b.suffix for b in win.backends if b.suffix])
        files: dict[str, str] = {}
        for b in win.backends:
            path = folder / f"{stem}{b.suffix}" if (b.suffix and not discard) else None
            try:
                written = b.stop(path)
                if written is not None:
                    files[b.name] = str(written)
            except Exception as e:
                warnings.warn(f"SelectiveProfiler: backend {b.name!r} failed to stop or write for window "
                              f"{win.window} ({type(e).__name__}: {e}).", UserWarning, stacklevel=2)
        if discard:
            return
        if self.summary and "torch" in files:
            try:
                from lightning_gh.profiling.stall import loader_info
                from lightning_gh.profiling.summary import summarize, summary_paths, write_summary
                from lightning_gh.profiling.trace import load_trace

                try:
                    loader = loader_info(trainer)
                except Exception:  # the loader may be gone after a fault; the advice then stays generic
                    loader = None
                summary = summarize(load_trace(files["torch"]), context={"loader": loader})
                summary["window_end"] = reason
                log_to_loggers(trainer, window_metrics(summary))
                for k, p in write_summary(summary, summary_paths(files["torch"])).items():
                    files[f"summary_{k}"] = str(p)
            except Exception as e:  # the trace is written; a failed analysis must not end the run
                warnings.warn(f"SelectiveProfiler: could not summarise {files['torch']} ({type(e).__name__}: {e}).",
                              UserWarning, stacklevel=2)
        entry = {"window": str(win.window), "steps": [win.first, last], "files": files, "reason": reason}
        self.written.append(entry)
        # One line on stdout per window, on the rank that wrote it (rank_zero_info would hide other ranks' files).
        print(f"SelectiveProfiler: rank {self._rank} steps {win.first}-{last} ({reason}): "
              + (", ".join(files.values()) or "no files (nsys capture only)"), flush=True)

    @staticmethod
    def _unique(folder: Path, stem: str, suffixes: list[str]) -> str:
        # A resumed run can profile the same steps again: keep the earlier files.
        candidate, n = stem, 1
        while any((folder / f"{candidate}{s}").exists() for s in suffixes):
            n += 1
            candidate = f"{stem}_{n}"
        return candidate
