"""``MemoryReport``: the memory plan before the first step and after the first measured steps, and an
out-of-memory report when a step does not fit.

At ``on_train_start`` (after the strategy has placed the weights and built the optimizer) the callback reads where
the bytes live (:class:`~lightning_gh.memory.plan.MemoryPlan`: GPU bytes per owner, the host-memory plan's shares,
free memory, the parts' decisions). At the first batch, before its step runs, it predicts the step's peak (the
step traced once on fake tensors, see :mod:`.forecast`; or an ActivationOffload budget), then prints the plan on
rank 0 and writes it as ``memory_plan.json``. After ``measure_steps`` optimizer steps it adds the measured peak
beside the predicted one, with the error. On a CUDA out-of-memory error inside ``fit``
it writes ``oom_report.md`` (the request, the owners of the live memory, the knob that would have fit: sized for
the whole step when the plan predicted its peak, since an error in the first forward does not yet see the gradients
and optimizer state the step allocates later; the knobs also in ``oom_knobs``) and, when
``record_history`` is on, ``oom_snapshot.pickle`` (``torch.cuda.memory._snapshot()``, readable at
https://pytorch.org/memory_viz); a host ``MemoryError`` gets the host plan's shares. Lightning then re-raises
the original error.

Example::

    >>> import lightning as L
    >>> from lightning_gh.memory import MemoryReport
    >>> trainer = L.Trainer(callbacks=[MemoryReport(measure_steps=2)], logger=False)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from lightning_gh import _host, hardware
from lightning_gh._hf import checkpointing_owner
from lightning_gh._options import resolve
from lightning_gh._util import count_tokens, warn_once
from lightning_gh.memory import forecast
from lightning_gh.memory.oom import Knob, parse_cuda_oom, report, step_shortfall, suggest
from lightning_gh.memory.plan import MemoryPlan, attribute

__all__ = ["MemoryReport", "MemoryReportOptions", "history_arguments"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReportOptions:
    """Options of :class:`MemoryReport`."""

    plan: bool = True
    """Print and write the memory plan at the start of training and after ``measure_steps`` steps."""
    oom_report: bool = True
    """On an out-of-memory error inside ``fit``, write ``oom_report.md`` (and the snapshot, see
    ``record_history``)."""
    record_history: bool = False
    """Record CUDA allocation history (``torch.cuda.memory._record_memory_history``, the Python stack of each
    allocation) from the start of training, so the out-of-memory report comes with a snapshot of the last
    ``history_entries`` allocations. Off by default: recording stacks costs step time in steps of many small
    allocations (see ``history_stacks``). The history is process-wide: ``SelectiveProfiler``'s ``"memory"`` backend
    turns it off at the end of its window."""
    history_entries: int = 100_000
    """Allocations the history keeps (the newest)."""
    history_stacks: bool = True
    """Record the Python stack of each allocation in the history (the snapshot then says where every live block was
    allocated). ``False`` records sizes, streams and times only, which costs less in steps of many small
    allocations."""
    predict: bool = True
    """Predict the step's peak before the first step: its training_step and backward traced once on fake tensors
    (no GPU memory is used; host time grows with the number of ops of the step). The module's ``training_step``
    runs once more for it, with fake tensors, its parameters and buffers swapped and ``self.log`` silenced: a step
    with other side effects (counters, files, state outside parameters and buffers) should turn it off; modules
    holding torchmetrics metrics and compiled models are not traced. Without it, only an ActivationOffload budget
    gives a prediction."""
    measure_steps: int = 3
    """Optimizer steps after which the measured peak is compared with the plan."""
    folder: str | None = None
    """Where the files go; ``None``: the trainer's log dir (``default_root_dir`` without a logger)."""

    def __post_init__(self) -> None:
        for name in ("plan", "oom_report", "record_history", "history_stacks", "predict"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MemoryReport({name}={getattr(self, name)!r}): expected True or False.")
        for name, low in (("history_entries", 1), ("measure_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MemoryReport({name}={value!r}): expected an int.")
            if value < low:
                raise ValueError(f"MemoryReport({name}={value!r}): expected an int >= {low}.")
        if self.folder is not None and (not isinstance(self.folder, str) or not self.folder):
            raise ValueError(f"MemoryReport(folder={self.folder!r}): expected a non-empty path or None.")


def history_arguments(options: MemoryReportOptions) -> dict[str, Any]:
    """The keyword arguments of ``torch.cuda.memory._record_memory_history`` for ``options``.

    Python stacks of allocations only, never C++ unwinding or a stack for every free: those cost a step of many
    small allocations a multiple of what the allocations' Python stacks cost, and the snapshot names every live
    block's Python stack without them.

    Example::

        >>> history_arguments(MemoryReportOptions(record_history=True, history_stacks=False))
        {'enabled': 'all', 'context': None, 'stacks': 'python', 'max_entries': 100000}
    """
    return {"enabled": "all", "context": "alloc" if options.history_stacks else None, "stacks": "python",
            "max_entries": options.history_entries}


class MemoryReport(Callback):
    """The memory plan of a run and an out-of-memory report. See :class:`MemoryReportOptions` for the options.

    Args:
        options: a :class:`MemoryReportOptions`, or its fields as keyword arguments (never both).
    """

    lgh_part = "MemoryReport"

    def __init__(self, options: MemoryReportOptions | None = None, **kwargs: Any) -> None:
        self.options = resolve(MemoryReportOptions, options, "MemoryReport", **kwargs)
        self.plan: MemoryPlan | None = None
        self.oom_files: list[Path] = []
        self.oom_knobs: list[Knob] = []  # what the last out-of-memory report suggested, the first knob first
        self._steps = 0
        self._tokens: int | None = None
        self._recording = False
        self._pending = False  # the plan waits for the first batch's prediction before it is printed
        self._phase: str | None = None  # where the step is: "forward", "backward" or "optimizer step"

    # ------------------------------------------------------------------ where files go
    def folder(self, trainer: Any) -> Path:
        if self.options.folder is not None:
            return Path(self.options.folder)
        return Path(trainer.log_dir or trainer.default_root_dir)

    # ------------------------------------------------------------------ the plan
    def build_plan(self, trainer: Any, pl_module: Any) -> MemoryPlan:
        """The plan as things stand now (weights placed, optimizers built)."""
        device = pl_module.device
        cuda = device.type == "cuda"
        owners = attribute(pl_module, trainer.optimizers, device_type=device.type,
                           allocated=torch.cuda.memory_allocated(device) if cuda else None)
        room = hardware.gpu_memory_room(device) if cuda else None
        decisions: dict[str, str] = {}
        for opt in trainer.optimizers:  # SuperOffload's host plan and, once decided, its GPU tail
            stats = getattr(opt, "stats", None)
            said = [str(stats[k]) for k in ("host_plan", "tail_decision") if isinstance(stats, dict) and stats.get(k)]
            if said:
                decisions["SuperOffload"] = " ".join(said)
        budget = None
        for cb in trainer.callbacks:
            opts = getattr(cb, "options", None)
            if getattr(cb, "lgh_part", None) == "ActivationOffload" and getattr(opts, "budget", None) is not None:
                decisions["ActivationOffload"] = f"budget={opts.budget!r}"
                budget = getattr(cb, "budget_bytes", None)
        static = owners["weights"] + owners["gradients"] + owners["optimizer state"]
        return MemoryPlan(
            gpu=owners, gpu_free=room[0] if room else None, gpu_total=room[1] if room else None,
            reserved=torch.cuda.memory_reserved(device) if cuda else None,
            host={s.part: s.held_bytes + s.declared_bytes for s in _host.PLAN.shares()},
            host_available=hardware.available_host_bytes(), decisions=decisions,
            predicted_peak=static + budget if isinstance(budget, int) else None,
            prediction_note="weights, gradients and optimizer state now plus the ActivationOffload budget"
            if isinstance(budget, int) else None,
            device="GPU" if cuda else device.type.upper())

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        cuda = pl_module.device.type == "cuda"
        if self.options.record_history and cuda:
            torch.cuda.memory._record_memory_history(**history_arguments(self.options))
            self._recording = True
        elif self.options.record_history:
            warn_once("memory:no-cuda-history", "MemoryReport(record_history=True): no CUDA device, so there is no "
                      "allocation history to record; the plan and the report still work.")
        if cuda:
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        if self.options.plan:
            self.plan = self.build_plan(trainer, pl_module)
            self._pending = True

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._phase = "validation"

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._phase = "backward"

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._phase = "optimizer step"

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._phase = "forward"
        if self._tokens is None:
            self._tokens = count_tokens(batch)
        if self._pending and self.plan is not None:
            self._pending = False
            if self.plan.predicted_peak is None:
                self.predict(trainer, pl_module, batch)
            self._emit(trainer, "memory plan before the first step")

    def predict(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """Add the predicted peak of a step on ``batch`` to the plan, or the reason there is none."""
        assert self.plan is not None
        if not self.options.predict:
            self.plan.prediction_note = "not predicted: MemoryReport(predict=False)"
            return
        if not trainer.is_global_zero:
            return
        device = pl_module.device
        owners = attribute(pl_module, trainer.optimizers, device_type=device.type,
                           allocated=torch.cuda.memory_allocated(device) if device.type == "cuda" else None)
        got = forecast.predict(trainer, pl_module, batch, owners, forecast.allocated_now(pl_module, owners, batch))
        if isinstance(got, str):
            self.plan.prediction_note = f"no prediction: {got}"
            return
        self.plan.predicted_peak = got.peak.allocated
        self.plan.predicted = dict(got.parts)
        notes = "; ".join(got.notes)
        self.plan.prediction_note = (f"peak in the {got.peak.phase}: training_step and backward traced on fake "
                                     f"tensors ({got.trace.ops} ops, {got.trace.seconds:.1f} s)"
                                     + (f"; {notes}" if notes else ""))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._pending and self.plan is not None:  # no batch ran
            self._pending = False
            self._emit(trainer, "memory plan")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._phase = None
        if not self.options.plan or self.plan is None or self._steps >= self.options.measure_steps:
            return
        self._steps = trainer.global_step
        if self._steps >= self.options.measure_steps:
            if pl_module.device.type == "cuda":
                self.plan.measured_peak = torch.cuda.max_memory_allocated(pl_module.device)
                self.plan.measured_reserved = torch.cuda.max_memory_reserved(pl_module.device)
            self._emit(trainer, f"memory plan after {self._steps} steps")

    @rank_zero_only
    def _emit(self, trainer: Any, title: str) -> None:
        assert self.plan is not None
        log.info("%s:\n%s", title, self.plan.table())
        folder = self.folder(trainer)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "memory_plan.json").write_text(json.dumps(self.plan.as_dict(), indent=1))
        except OSError as e:
            warn_once("memory:plan-file", f"MemoryReport: could not write memory_plan.json under {folder}: {e}")

    # ------------------------------------------------------------------ out of memory
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not self.options.oom_report:
            return
        if isinstance(exception, torch.cuda.OutOfMemoryError):
            self._cuda_report(trainer, pl_module, exception)
        elif isinstance(exception, MemoryError):
            self._host_report(trainer, exception)

    def _cuda_report(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        device = pl_module.device
        cuda = device.type == "cuda" and torch.cuda.is_available()
        allocated = torch.cuda.memory_allocated(device) if cuda else 0
        owners = attribute(pl_module, trainer.optimizers, allocated=allocated if cuda else None,
                           device_type=device.type)
        shortfall = parse_cuda_oom(str(exception))
        tokens = self._tokens * trainer.accumulate_grad_batches if self._tokens else None
        step = self._step_shortfall()
        sized_for = step if step is not None and (shortfall is None or step[1].missing > shortfall.missing) else None
        knobs = suggest(*(sized_for or (owners, shortfall)), tokens_per_step=tokens,
                        superoffload=getattr(trainer.strategy, "lgh_part", None) == "SuperOffload",
                        in_forward=sized_for is None and self._phase == "forward",
                        recomputing=checkpointing_owner(pl_module) is not None, host_room=_host.PLAN.room("ActivationOffload"))
        self.oom_knobs = knobs
        text = report(owners, shortfall, knobs, reserved=torch.cuda.memory_reserved(device) if cuda else None,
                      allocated=allocated if cuda else None, error=str(exception), step=sized_for)
        folder = self.folder(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "oom_report.md"
        path.write_text(text)
        self.oom_files = [path]
        if self._recording:
            snap = folder / "oom_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
            self.oom_files.append(snap)
        log.error("out of GPU memory: the report is in %s%s", path,
                  f"; first knob to try: {knobs[0].knob}" if knobs else "")

    def _step_shortfall(self) -> Any:
        """:func:`~lightning_gh.memory.oom.step_shortfall` of the plan's prediction (``None`` without one)."""
        plan = self.plan
        if plan is None or plan.gpu_free is None or plan.reserved is None:
            return None
        return step_shortfall(plan.predicted, plan.predicted_peak, plan.gpu_free + plan.reserved)

    def _host_report(self, trainer: Any, exception: BaseException) -> None:
        folder = self.folder(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        avail = hardware.available_host_bytes()
        path = folder / "oom_report.md"
        path.write_text("# Out of host memory\n\n"
                        f"Error: `{str(exception).splitlines()[0][:500] if str(exception) else type(exception).__name__}`\n\n"
                        f"Host memory available now: {'unknown' if avail is None else f'{avail / 2**30:.2f} GiB'}\n\n"
                        "## The host-memory plan\n\n" + _host.PLAN.describe() + "\n")
        self.oom_files = [path]
        log.error("out of host memory: the report is in %s", path)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    def state_dict(self) -> dict[str, Any]:
        return {"options": dataclasses.asdict(self.options)}
