"""Data-loader stall detection: how long does each training batch wait for its data, against the step it feeds?

The **wait** of a batch is the time Lightning spends in ``next(train_dataloader)`` for it (its profiler action
``"[_TrainingEpochLoop].train_dataloader_next"``, watched without replacing the user's profiler): producing or
receiving the batch, collating and pinning it. The **period** is the time between two consecutive
``on_train_batch_start`` calls: everything the loop does per batch. Only the fetch counts as waiting: on a GPU the
host usually runs ahead of the device, and time it then spends blocked elsewhere (a ``.item()`` in a progress bar,
a logger's sync) is the GPU's time, not the data loader's. If the fetch action is never seen (a custom loop), the
gap from ``on_train_batch_end`` to the next ``on_train_batch_start`` stands in for it. Periods holding validation or
a checkpoint save are dropped, and so are the first ``warmup`` batches of every epoch (worker start-up). Gradient
accumulation counts every micro-batch: each one waits for its own data.

The share ``sum(wait) / sum(period)`` over the last ``window`` batches is logged as ``lgh/data_wait_frac``
through the Trainer's loggers (at Lightning's ``log_every_n_steps`` cadence, without a GPU sync). When a full
window reaches ``threshold`` (default :data:`~lightning_gh.profiling.advice.DATA_WAIT_BOUND`), the detector warns
once with advice built from the real DataLoader settings and the CPUs this process may use. The share and the
threshold are the ones the trace summary uses for its ``input-bound`` verdict (:mod:`lightning_gh.profiling.advice`),
so the two agree on the same run. The fetch is seen through the shared
:class:`~lightning_gh.profiling.phases.StepPhaseTracker` (its ``data_wait`` phase).

Example::

    import lightning as L
    from lightning_gh.profiling import DataStallDetector

    trainer = L.Trainer(callbacks=[DataStallDetector(threshold=0.1, window=50)])   # options: StallOptions
"""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from typing import Any, Mapping

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_gh import compat, hardware
from lightning_gh._lightning import log_to_loggers, should_update_logs
from lightning_gh._options import resolve
from lightning_gh.profiling.advice import data_wait_share, is_input_bound, stall_advice
from lightning_gh.profiling.options import StallOptions
from lightning_gh.profiling.phases import StepPhaseTracker

__all__ = ["DataStallDetector", "DataStallWarning", "StallOptions", "loader_info", "stall_advice", "METRIC"]

METRIC = "lgh/data_wait_frac"


class DataStallWarning(UserWarning):
    """The training loop waits for its DataLoader for a material share of the time."""


def _find_dataloader(obj: Any) -> Any:
    """The first ``torch.utils.data.DataLoader`` inside what ``trainer.train_dataloader`` holds."""
    from torch.utils.data import DataLoader

    if isinstance(obj, DataLoader):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _find_dataloader(item)
            if found is not None:
                return found
    return None


def loader_info(trainer: L.Trainer) -> dict[str, Any]:
    """The train DataLoader's settings and the CPUs available per process, for advice.

    ``cpus_per_process`` is the process's CPU affinity divided by the processes per node
    (``LOCAL_WORLD_SIZE``, else the Trainer's devices): ranks on one node usually share the same cores.
    """
    dl = _find_dataloader(getattr(trainer, "train_dataloader", None))
    cpus = hardware.cpus_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or getattr(trainer, "num_devices", 1) or 1)
    info: dict[str, Any] = {
        "found": dl is not None,
        "num_workers": getattr(dl, "num_workers", None),
        "pin_memory": getattr(dl, "pin_memory", None),
        "persistent_workers": getattr(dl, "persistent_workers", None),
        "prefetch_factor": getattr(dl, "prefetch_factor", None),
        "batch_size": getattr(dl, "batch_size", None),
        "cpus_available": cpus,
        "processes_per_node": local,
        "cpus_per_process": max(cpus // max(local, 1), 1),
        "cuda": getattr(getattr(trainer, "strategy", None), "root_device", None) is not None
        and trainer.strategy.root_device.type == "cuda",
    }
    return info


class DataStallDetector(Callback):
    """Measure on every training batch how long it waited for data; log the share and warn once when material.

    Args:
        threshold, window, warmup, log_metric: the options, each documented once in
            :class:`~lightning_gh.profiling.options.StallOptions` (defaults there too).
        options: the same options as one :class:`StallOptions`, instead of the keywords (never both).

    Raises:
        TypeError: an argument of the wrong type; ``options`` together with a keyword that differs from its default.
        ValueError: a value out of range (the message names the argument, the value and what is allowed).

    Attributes:
        options: the :class:`StallOptions` in force.
        data_wait_frac: the latest rolling share (``None`` before the first counted batch).
        warned: whether the warning has fired.

    Example::

        trainer = L.Trainer(callbacks=[DataStallDetector()])
        trainer.fit(model, datamodule)
        # DataStallWarning: the training loop waited for data <share> of the time over the last <window> batches ...
    """

    lgh_part = "DataStallDetector"

    def __init__(self, threshold: float = StallOptions.threshold, window: int = StallOptions.window,
                 warmup: int = StallOptions.warmup, log_metric: bool = StallOptions.log_metric, *,
                 options: StallOptions | None = None) -> None:
        self.options = resolve(StallOptions, options, "DataStallDetector", threshold=threshold, window=window,
                               warmup=warmup, log_metric=log_metric)
        self.data_wait_frac: float | None = None
        self.warned = False
        self._samples: deque[tuple[float, float]] = deque()
        self._sum_wait = 0.0
        self._sum_total = 0.0
        self._prev_end: float | None = None
        self._prev_start: float | None = None
        self._fetch_t0: float | None = None
        self._fetched = 0.0
        self._saw_fetch = False
        self._tracker: StepPhaseTracker | None = None
        self._skip = self.options.warmup

    # The options, read-only (set them through the constructor or ``options=``).
    threshold = property(lambda self: self.options.threshold, doc="See :attr:`StallOptions.threshold`.")
    window = property(lambda self: self.options.window, doc="See :attr:`StallOptions.window`.")
    warmup = property(lambda self: self.options.warmup, doc="See :attr:`StallOptions.warmup`.")
    log_metric = property(lambda self: self.options.log_metric, doc="See :attr:`StallOptions.log_metric`.")

    # -- watching the fetch (Lightning reports it only to its profiler; the phase tracker watches it)
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            compat.check(trainer, self.lgh_part)
            self._tracker = StepPhaseTracker([self])
            self._tracker.attach(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._tracker is not None:
            self._tracker.detach()
            self._tracker = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def phase_started(self, phase: str, step: int, t: float) -> None:
        if phase == "data_wait":
            self._fetch_t0 = t

    def phase_ended(self, phase: str, step: int, t: float) -> None:
        if phase == "data_wait" and self._fetch_t0 is not None:
            self._fetched += t - self._fetch_t0
            self._fetch_t0 = None
            self._saw_fetch = True

    # -- measurement (the per-step path: keep it to arithmetic)
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prev_end = self._prev_start = None
        self._skip = self.warmup

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._prev_start is not None:
            wait = self._fetched if self._saw_fetch else (now - self._prev_end if self._prev_end is not None else 0.0)
            if self._skip > 0:
                self._skip -= 1
            else:
                self._add(min(wait, now - self._prev_start), now - self._prev_start, trainer)
        self._prev_start = now
        self._fetched = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._prev_end = time.perf_counter()

    def _add(self, wait: float, total: float, trainer: L.Trainer) -> None:
        self._samples.append((wait, total))
        self._sum_wait += wait
        self._sum_total += total
        if len(self._samples) > self.window:
            w, t = self._samples.popleft()
            self._sum_wait -= w
            self._sum_total -= t
        frac = data_wait_share(self._sum_wait, self._sum_total)
        self.data_wait_frac = frac
        if self.log_metric and trainer.loggers and should_update_logs(trainer):
            log_to_loggers(trainer, {METRIC: frac})
        if not self.warned and len(self._samples) >= self.window and is_input_bound(frac, self.threshold):
            self.warned = True
            self._warn(trainer, frac)

    # -- periods that are not a training batch's
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prev_start = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # The save happens after this hook, before the next batch: drop that period.
        self._prev_start = None

    # -- the warning
    def _warn(self, trainer: L.Trainer, frac: float) -> None:
        n = len(self._samples)
        wait = self._sum_wait / n
        step = (self._sum_total - self._sum_wait) / n
        info = loader_info(trainer)
        rank = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""
        settings = (f"num_workers={info['num_workers']}, pin_memory={info['pin_memory']}, "
                    f"persistent_workers={info['persistent_workers']}, prefetch_factor={info['prefetch_factor']}"
                    if info["found"] else "a train loader that is not a torch DataLoader")
        msg = (f"{rank}lightning_gh DataStallDetector: the training loop waited for data {frac:.1%} of the time over "
               f"the last {n} batches (mean wait {1e3 * wait:.2f} ms per batch, mean step {1e3 * step:.2f} ms; "
               f"threshold {self.threshold:.0%}). The train DataLoader has {settings}; this process can use "
               f"{info['cpus_per_process']} CPUs ({info['cpus_available']} in its affinity mask / "
               f"{info['processes_per_node']} process{'es' * (info['processes_per_node'] != 1)} per node). Try: "
               + "; ".join(stall_advice(info if info["found"] else None, wait, step)) + ".")
        warnings.warn(msg, DataStallWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        return {"warned": self.warned}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.warned = bool(state_dict.get("warned", False))

