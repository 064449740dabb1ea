"""Data-loader stall detection: how long does each training batch wait for its data, against the step it feeds?

The measurement is two ``time.perf_counter()`` calls per batch. The **wait** of a batch is the time from the
end of the previous batch (``on_train_batch_end``) to the start of this one (``on_train_batch_start``): fetching
the batch from the DataLoader and moving it to the device, plus Lightning's own bookkeeping between batches. The
**step** is ``on_train_batch_start`` to ``on_train_batch_end``. Validation is cut out of the gap it falls in; a gap
holding a checkpoint save is dropped, and so are the first ``warmup`` batches of every epoch (worker start-up).
Gradient accumulation counts every micro-batch: each one waits for its own data.

The share ``sum(wait) / sum(wait + step)`` over the last ``window`` batches is logged as ``lgh/data_wait_frac``
through the Trainer's loggers (at Lightning's ``log_every_n_steps`` cadence, without a GPU sync). When a full
window exceeds ``threshold`` (default 10%), the detector warns once with advice built from the real DataLoader
settings and the CPUs this process may use.

Example::

    import lightning as L
    from lightning_gh.profiling import DataStallDetector

    trainer = L.Trainer(callbacks=[DataStallDetector(threshold=0.1, window=50)])
"""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from typing import Any, Mapping

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_gh.profiling.summary import stall_advice

__all__ = ["DataStallDetector", "DataStallWarning", "loader_info", "stall_advice", "METRIC"]

METRIC = "lgh/data_wait_frac"


class DataStallWarning(UserWarning):
    """The training loop waits for its DataLoader for a material share of the time."""


def _cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
    cpus = _cpus_available()
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
        threshold: warn when ``sum(wait) / sum(wait + step)`` over a full window exceeds this share (0 < x < 1).
        window: batches in the rolling window (>= 1).
        warmup: batches not counted at the start of every epoch (DataLoader workers start up), >= 0.
        log_metric: log ``lgh/data_wait_frac`` through ``trainer.loggers``.

    Attributes:
        data_wait_frac: the latest rolling share (``None`` before the first counted batch).
        warned: whether the warning has fired.

    Example::

        trainer = L.Trainer(callbacks=[DataStallDetector()])
        trainer.fit(model, datamodule)
        # DataStallWarning: the training loop waited for data 47.3% of the time over the last 50 batches ...
    """

    def __init__(self, threshold: float = 0.10, window: int = 50, warmup: int = 5, log_metric: bool = True) -> None:
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 < threshold < 1:
            raise ValueError(f"DataStallDetector(threshold={threshold!r}): must be a share strictly between 0 and 1.")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"DataStallDetector(window={window!r}): must be an int >= 1 (batches).")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"DataStallDetector(warmup={warmup!r}): must be an int >= 0 (batches per epoch).")
        self.threshold = float(threshold)
        self.window = window
        self.warmup = warmup
        self.log_metric = bool(log_metric)
        self.data_wait_frac: float | None = None
        self.warned = False
        self._samples: deque[tuple[float, float]] = deque()
        self._sum_wait = 0.0
        self._sum_total = 0.0
        self._prev_end: float | None = None
        self._start = 0.0
        self._wait: float | None = None
        self._skip = warmup

    # -- measurement (the per-step path: keep it to arithmetic)
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prev_end = None
        self._skip = self.warmup

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        self._wait = None if self._prev_end is None else now - self._prev_end
        self._start = now

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self._wait is not None:
            if self._skip > 0:
                self._skip -= 1
            else:
                self._add(self._wait, self._wait + (now - self._start), trainer)
        self._prev_end = time.perf_counter()

    def _add(self, wait: float, total: float, trainer: L.Trainer) -> None:
        self._samples.append((wait, total))
        self._sum_wait += wait
        self._sum_total += total
        if len(self._samples) > self.window:
            w, t = self._samples.popleft()
            self._sum_wait -= w
            self._sum_total -= t
        frac = self._sum_wait / self._sum_total if self._sum_total > 0 else 0.0
        self.data_wait_frac = frac
        if self.log_metric and trainer.loggers and _should_log(trainer):
            step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
            for logger in trainer.loggers:
                logger.log_metrics({METRIC: frac}, step=step)
        if not self.warned and len(self._samples) >= self.window and frac > self.threshold:
            self.warned = True
            self._warn(trainer, frac)

    # -- gaps that are not data waits
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prev_end = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prev_end = time.perf_counter()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # The save happens after this hook, before the next batch: drop that gap.
        self._prev_end = None

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


def _should_log(trainer: L.Trainer) -> bool:
    connector = getattr(trainer, "_logger_connector", None)
    flag = getattr(connector, "should_update_logs", None)
    if isinstance(flag, bool):
        return flag
    return (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0
