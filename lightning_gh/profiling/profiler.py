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
    trainer.fit(model, datamodule)   # -> <log dir>/profiles/steps20-24/rank0_steps20-24.{pt.trace.json.gz,...}
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_gh import compat
from lightning_gh._lightning import is_last_training_batch, log_to_loggers
from lightning_gh._options import resolve
from lightning_gh._util import warn_once
from lightning_gh.profiling._profiler_backends import (
    WARN_KEY,
    Backend,
    MemoryBackend,
    NsysBackend,
    TorchBackend,
    nsys_command,
    under_nsys,
)
from lightning_gh.profiling.options import BACKENDS, ProfilerOptions
from lightning_gh.profiling.phases import StepPhaseTracker
from lightning_gh.profiling.windows import RankSelection, StepSchedule, StepWindow

__all__ = ["SelectiveProfiler", "ProfilerOptions", "ENV_VAR", "DEFAULT_STEPS", "BACKENDS", "under_nsys",
           "nsys_command", "unreached_windows"]

log = logging.getLogger(__name__)

ENV_VAR = "LGH_PROFILE_START_STOP"
#: The windows profiled when ``steps`` is not given (the default of :attr:`ProfilerOptions.steps`).
DEFAULT_STEPS: str = ProfilerOptions.steps  # type: ignore[assignment]


def _warn_once(key: str, message: str) -> None:
    warn_once(WARN_KEY + key, message, UserWarning, stacklevel=4)


def _announce(rank: int, message: str) -> None:
    """Log ``message`` on the rank that has something to say: through ``rank_zero_info`` (shown with Lightning's
    own lines) on global rank 0, through this module's logger elsewhere (``rank_zero_info`` would drop it)."""
    if rank == 0:
        rank_zero_info(message)
    else:
        log.info(message)


def unreached_windows(schedule: StepSchedule, end: int) -> list[StepWindow]:
    """The windows of ``schedule`` that a run whose last optimizer step is ``end - 1`` never reaches.

    >>> [str(w) for w in unreached_windows(StepSchedule.parse("2-3,8-9,20"), end=9)]
    ['20']
    """
    return [w for w in schedule.windows if w.start >= end]


def _prepare_folder(output_dir: Path) -> None:
    """Create ``output_dir`` now, or fail naming the path, so that no window is lost after training started."""
    head = f"SelectiveProfiler(output_dir={str(output_dir)!r}): expected a folder the windows can be written to"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (output_dir, *output_dir.parents) if _is_file(p)), None)
        if blocker is not None:
            raise ValueError(f"{head}; {str(blocker)!r} is a file.") from e
        raise ValueError(f"{head}; it cannot be created ({type(e).__name__}: {e.strerror or e}).") from e
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{head}; {str(output_dir)!r} is not writable by this process.")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name the file system refuses (too long, ...)
        return False


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


def _outcome(files: Mapping[str, str], lost: Mapping[str, str], backends: Sequence[str]) -> str:
    """What a window left behind, for its closing line: the files written, the nsys capture, what was lost.

    >>> _outcome({"torch": "a.json.gz", "memory": "a.pickle"}, {}, ["torch", "memory"])
    'a.json.gz, a.pickle'
    >>> _outcome({}, {"torch": "OSError: disk full"}, ["torch", "nsys"])
    'nsys capture (no file of ours); LOST torch (OSError: disk full)'
    """
    parts = [", ".join(files.values())] if files else []
    if "nsys" in backends:
        parts.append("nsys capture (no file of ours)")
    parts += [f"LOST {name} ({why})" for name, why in lost.items()]
    return "; ".join(parts) if parts else "no files"


# ---------------------------------------------------------------------------------------------- callback
@dataclass
class _Window:
    window: StepWindow
    first: int
    current: int
    backends: list[Backend]
    batches: int = 0
    last_run: int = -1  # the last step that started a batch
    open: list[str] = field(default_factory=list)
    fetch_ms: dict[int, float] = field(default_factory=dict)  # ms in Lightning's fetch, per step
    fetch_t0: float | None = None


class SelectiveProfiler(Callback):
    """Profile chosen optimizer steps on chosen ranks with torch.profiler / nsys / CUDA memory history.

    Args:
        steps, ranks, backends, output_dir, summary, record_shapes, with_stack, profile_memory: the options, each
            documented once in :class:`~lightning_gh.profiling.options.ProfilerOptions` (defaults there too).
        options: the same options as one :class:`ProfilerOptions`, instead of the keywords (never both).

    Raises:
        TypeError: an argument of the wrong type; ``options`` together with a keyword that differs from its default.
        ValueError: a bad value (the message names the argument, the value and what is allowed); at setup, a
            ``Trainer(profiler=PyTorchProfiler(...))`` together with the ``"torch"`` backend, or an output folder
            that cannot be created or written.

    Attributes:
        options: the :class:`ProfilerOptions` in force.
        written: one entry per finished window: ``{"window", "steps", "files", "lost", "reason"}`` (``lost``: the
            backends whose file could not be written, with why). Each window is also announced in one log line
            (``rank_zero_info`` on rank 0, this module's logger on other ranks), and its verdict logged through
            ``trainer.loggers`` (``lgh/profile_gpu_idle_frac``, ``lgh/profile_data_wait_frac``,
            ``lgh/profile_step_time_ms``). A window that training never reaches is warned about at setup when
            ``max_steps`` tells, else at the end of training.

    Example::

        trainer = L.Trainer(callbacks=[SelectiveProfiler(steps="20-24", ranks="0,last", backends=("torch", "memory"))])
        trainer.fit(model, datamodule)
        # <log dir>/profiles/steps20-24/rank0_steps20-24.summary.md: step times, GPU idle, top kernels, verdict
    """

    lgh_part = "SelectiveProfiler"
    # Its on_before_optimizer_step only marks a phase boundary: the fp8 plugins' fused master update may run.
    lgh_reads_gradients = False

    def __init__(
        self,
        steps: str | int | None = ProfilerOptions.steps,
        ranks: str = ProfilerOptions.ranks,
        backends: Sequence[str] | str = ProfilerOptions.backends,
        output_dir: str | Path | None = ProfilerOptions.output_dir,
        summary: bool = ProfilerOptions.summary,
        record_shapes: bool = ProfilerOptions.record_shapes,
        with_stack: bool = ProfilerOptions.with_stack,
        profile_memory: bool = ProfilerOptions.profile_memory,
        *,
        options: ProfilerOptions | None = None,
    ) -> None:
        self.options = resolve(ProfilerOptions, options, "SelectiveProfiler", steps=steps, ranks=ranks,
                               backends=backends, output_dir=output_dir, summary=summary, record_shapes=record_shapes,
                               with_stack=with_stack, profile_memory=profile_memory)
        self._schedule = self._resolve()
        self._ranks = RankSelection.parse(self.options.ranks, argument="ranks", where="SelectiveProfiler")
        self._folder: Path | None = None  # the output folder in use, decided at setup
        self.written: list[dict[str, Any]] = []
        self._selected = False
        self._rank, self._world = 0, 1
        self._arm_start: int | None = None
        self._active: _Window | None = None
        self._backend_objs: list[Backend] = []
        self._tracker: StepPhaseTracker | None = None
        self._warned_unreached: set[StepWindow] = set()

    # The options, read-only (set them through the constructor or ``options=``).
    steps = property(lambda self: self.options.steps, doc="See :attr:`ProfilerOptions.steps`.")
    ranks = property(lambda self: self.options.ranks, doc="See :attr:`ProfilerOptions.ranks`.")
    backends = property(lambda self: self.options.backends, doc="See :attr:`ProfilerOptions.backends`.")
    summary = property(lambda self: self.options.summary, doc="See :attr:`ProfilerOptions.summary`.")
    record_shapes = property(lambda self: self.options.record_shapes, doc="See :attr:`ProfilerOptions.record_shapes`.")
    with_stack = property(lambda self: self.options.with_stack, doc="See :attr:`ProfilerOptions.with_stack`.")
    profile_memory = property(lambda self: self.options.profile_memory,
                              doc="See :attr:`ProfilerOptions.profile_memory`.")

    @property
    def output_dir(self) -> Path | None:
        """The folder windows are written to: decided at setup (see :attr:`ProfilerOptions.output_dir`); before
        setup, the folder given, or ``None`` for the trainer's log dir."""
        if self._folder is not None:
            return self._folder
        return None if self.options.output_dir is None else Path(self.options.output_dir)

    def _resolve(self) -> StepSchedule:
        schedule = StepSchedule.resolve(self.options.schedule_spec, ENV_VAR, where="SelectiveProfiler")
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
        if env:
            # A run profiling other steps than its config says must say why.
            rank_zero_info(f"SelectiveProfiler: {ENV_VAR}={env!r} overrides steps={self.steps!r}; profiling steps "
                           f"{self._schedule}.")
        self._warned_unreached = set()
        if stage == "fit" and trainer.max_steps is not None and trainer.max_steps >= 0:
            self._warn_unreached(trainer.max_steps, f"max_steps={trainer.max_steps} ends training first")
        self._rank = trainer.global_rank
        unmatched = self._ranks.unmatched(trainer.world_size, trainer.num_devices)
        if unmatched:
            rank_zero_warn(f"SelectiveProfiler: {unmatched}")
        # Lightning's convention (its own profilers, ModelCheckpoint): the trainer's log dir. trainer.log_dir is a
        # broadcast, so every rank asks, selected or not.
        self._folder = self.options.folder(trainer.log_dir if self.options.output_dir is None else None)
        self._selected = self._ranks.selects(trainer.global_rank, trainer.local_rank, trainer.world_size)
        if self._selected:
            _prepare_folder(self._folder)
        self._world = trainer.world_size
        if self._tracker is not None:
            self._tracker.detach()
        self._tracker = StepPhaseTracker([self])
        if self._selected:
            self._tracker.attach(trainer)
        self._backend_objs = []
        for name in self.backends:
            if name == "torch":
                self._backend_objs.append(TorchBackend(self.record_shapes, self.with_stack, self.profile_memory))
            elif name == "nsys":
                self._backend_objs.append(NsysBackend(self._folder))
            else:
                self._backend_objs.append(MemoryBackend())

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
        self._warn_unreached(trainer.global_step, f"training ended after step {trainer.global_step - 1}")

    def _warn_unreached(self, end: int, why: str) -> None:
        """Warn once per window about windows that start at or after optimizer step ``end``."""
        missed = [w for w in unreached_windows(self._schedule, end) if w not in self._warned_unreached]
        if not missed:
            return
        self._warned_unreached.update(missed)
        shown = ",".join(str(w) for w in missed)
        rank_zero_warn(f"SelectiveProfiler: steps {shown} of steps={str(self._schedule)!r} will not be profiled: "
                       f"{why} (optimizer steps run 0..{end - 1}). Pick steps below {end}.")

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
            if isinstance(b, TorchBackend):
                b.note("lgh_steps", [win.first, last])  # the summary ignores a trailing marker without a batch
                if win.fetch_ms:
                    b.note("lgh_fetch_ms", {str(k): round(v, 6) for k, v in sorted(win.fetch_ms.items())})
        stem = f"rank{self._rank}_steps{win.first}" + (f"-{last}" if last != win.first else "")
        stem = self._unique(folder, stem, [b.suffix for b in win.backends if b.suffix])
        files: dict[str, str] = {}
        lost: dict[str, str] = {}
        for b in win.backends:
            path = folder / f"{stem}{b.suffix}" if (b.suffix and not discard) else None
            try:
                written = b.stop(path)
                if written is not None:
                    files[b.name] = str(written)
            except Exception as e:
                lost[b.name] = f"{type(e).__name__}: {e}"
                warnings.warn(f"SelectiveProfiler: backend {b.name!r} failed to stop or write for window "
                              f"{win.window} ({type(e).__name__}: {e}); its file is lost.", UserWarning, stacklevel=2)
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
        entry = {"window": str(win.window), "steps": [win.first, last], "files": files, "lost": lost,
                 "reason": reason}
        self.written.append(entry)
        _announce(self._rank, f"SelectiveProfiler: rank {self._rank} steps {win.first}-{last} ({reason}): "
                  + _outcome(files, lost, [b.name for b in win.backends]))

    @staticmethod
    def _unique(folder: Path, stem: str, suffixes: list[str]) -> str:
        # A resumed run can profile the same steps again: keep the earlier files.
        candidate, n = stem, 1
        while any((folder / f"{candidate}{s}").exists() for s in suffixes):
            n += 1
            candidate = f"{stem}_{n}"
        return candidate
