"""``ManagedOptimizerState``: the Lightning way to keep the optimizer state in managed memory.

The callback changes where the optimizer's state lives, nothing else: ``configure_optimizers`` still returns
``torch.optim.AdamW(fused=True)`` and the GPU's fused kernel still does the update, reading and writing the
moments in place. With ``preferred="cpu"`` (the default) the state takes no GPU memory: on Grace Hopper the GPU
reaches it over NVLink-C2C, on a PCIe GPU over PCIe (slower; see docs/unified_memory.md for when that pays).

Lifecycle (single device or DDP, automatic or manual optimization):

* ``setup``: refuses what cannot work, with the reason: strategies that shard or own the optimizer state (FSDP,
  ModelParallel, DeepSpeed), parts it does not combine with (:mod:`lightning_gh.compat`: SuperOffload), a torch
  or allocator setting that cannot serve a MemPool from the shim (no MemPool, ``backend:cudaMallocAsync``, a release
  that refuses MemPools under ``expandable_segments:True``), ``allow_oversubscription=True`` on a GPU that is not
  coherent with host memory. It builds (or loads) the allocator shim here, so a missing compiler
  stops the run before any step. Without CUDA it warns once and does nothing.
* ``on_fit_start`` (after the optimizers exist, before a checkpoint's state is restored): wraps each optimizer
  (:class:`~lightning_gh.unified.state.OptimizerStatePlacement`), so a restored state lands in managed memory.
* ``on_train_start``: moves any state that already exists into the pool and waits for the device, so a
  ``CUDAGraphCapture`` that follows captures a step whose state is settled.
* ``on_before_optimizer_step`` (after backward, just before ``step()`` creates Adam's state): creates the missing
  AdamW state in the pool; with ``prefetch="step"`` prefetches the state to the GPU. A step post-hook sends it back.
* ``teardown`` (or ``on_exception`` when the fit fails, where Lightning skips ``teardown``): removes the hooks; the
  state stays where it is (checkpoints save it like any CUDA tensor). No managed scope stays open between hooks:
  each is a ``with`` block inside one hook.

Example::

    import lightning as L
    import lightning_gh as lgh

    trainer = L.Trainer(precision="bf16-mixed",
                        callbacks=[lgh.ManagedOptimizerState(preferred="cpu")])
    trainer.fit(model, datamodule)     # model.configure_optimizers returns torch.optim.AdamW(..., fused=True)
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_gh import _lightning, compat
from lightning_gh._options import resolve
from lightning_gh._util import fmt_bytes
from lightning_gh.unified.guard import ManagedMemoryUnavailable
from lightning_gh.unified.options import DEFAULT_HEADROOM_BYTES, ManagedMemoryOptions
from lightning_gh.unified.pool import get_pool, unavailable_reason
from lightning_gh.unified.state import OptimizerStatePlacement, PlacementReport

__all__ = ["ManagedOptimizerState", "check_strategy"]

_SHARDING = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


def check_strategy(strategy: Any) -> None:
    """Raise ``MisconfigurationException`` for strategies whose optimizer state the callback cannot place:
    FSDP and ModelParallel keep it as sharded DTensors, DeepSpeed in its own optimizer.

    Args:
        strategy: the trainer's strategy.
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    hit = next((n for n in _SHARDING if n in names), None)
    if hit is not None:
        raise MisconfigurationException(
            f"ManagedOptimizerState does not support strategy {type(strategy).__name__}: it shards or owns the "
            "optimizer state (DTensor shards or DeepSpeed's optimizer), which this callback does not place. "
            "Supported: one device or DDP (strategy='auto', 'ddp', 'ddp_spawn').")


class ManagedOptimizerState(L.Callback):
    """Keep the optimizer state (AdamW moments, and any master weights the optimizer keeps in its state) in CUDA
    managed memory, host-preferred by default, updated in place by the GPU's own optimizer kernel.

    Args:
        preferred: ``"cpu"``: the state lives in host memory and takes no GPU memory (the GPU reads and writes it
            over the host link each step). ``"gpu"``: the state lives in GPU memory as usual but is managed, so the
            driver may evict it to the host where oversubscription is allowed (Grace Hopper).
        prefetch: ``"none"`` (default: the step reads the state where it lives) or ``"step"`` (prefetch it to the
            GPU just before each step when the GPU has room, and back to the host right after for ``"cpu"``; much
            slower than ``"none"`` on PCIe GPUs, see :class:`~lightning_gh.unified.options.ManagedMemoryOptions`).
        accessed_by_gpu: keep the GPU's mapping to host-resident pages (reads without page faults).
        allow_oversubscription: let managed memory exceed the GPU's free memory; only on GPUs coherent with host
            memory (Grace Hopper), an error elsewhere.
        headroom_bytes: GPU memory the safety guard keeps free beyond the managed bytes.
        options: a ready :class:`~lightning_gh.unified.options.ManagedMemoryOptions` instead of the keyword
            arguments (never both: see :func:`lightning_gh._options.resolve`).

    Attributes:
        options: the :class:`~lightning_gh.unified.options.ManagedMemoryOptions` in use.
        reports: one :class:`~lightning_gh.unified.state.PlacementReport` per optimizer after ``on_train_start``.

    Example::

        trainer = L.Trainer(precision="bf16-mixed", callbacks=[ManagedOptimizerState()])
        trainer.fit(model, dm)
        print(trainer.callbacks[0].reports[0].describe())
    """

    lgh_part = "ManagedOptimizerState"

    def __init__(self, preferred: str = "cpu", *, prefetch: str = "none", accessed_by_gpu: bool = True,
                 allow_oversubscription: bool = False, headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
                 options: ManagedMemoryOptions | None = None) -> None:
        super().__init__()
        self.options = resolve(ManagedMemoryOptions, options, "ManagedOptimizerState", preferred=preferred,
                               prefetch=prefetch, accessed_by_gpu=accessed_by_gpu,
                               allow_oversubscription=allow_oversubscription, headroom_bytes=headroom_bytes)
        self.enabled = False
        self._placements: dict[int, OptimizerStatePlacement] = {}
        self.reports: list[PlacementReport] = []
        self._logged = True

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        compat.check(trainer, self.lgh_part)
        check_strategy(trainer.strategy)
        device = trainer.strategy.root_device
        if device.type != "cuda" or not torch.cuda.is_available():
            self.enabled = False
            rank_zero_warn(f"ManagedOptimizerState: the run is on {device.type}, not a CUDA GPU, so there is no managed "
                           "memory; the optimizer state stays where the optimizer puts it (no-op).")
            return
        reason = unavailable_reason(device)
        if reason is not None:
            raise ManagedMemoryUnavailable(f"ManagedOptimizerState cannot put the optimizer state in managed memory: "
                                           f"{reason}.")
        pool = get_pool(self.options, device)  # builds or loads the shim now, not at the first step
        if self.options.allow_oversubscription and not pool.coherent:
            raise ValueError(
                f"ManagedOptimizerState(allow_oversubscription=True): honoured only where the GPU reads host memory "
                f"coherently (Grace Hopper); {pool.describe_device()} does not (PCIe), and managed memory beyond its "
                "free memory can hang the GPU there. Remove allow_oversubscription=True.")
        self.enabled = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        for opt in trainer.optimizers:
            raw = _lightning.unwrap_optimizer(opt)
            if id(raw) in self._placements:
                continue
            # Lightning runs forward and backward inside optimizer.step(closure), after the step pre-hooks: the
            # state is created from on_before_optimizer_step instead.
            self._placements[id(raw)] = OptimizerStatePlacement(raw, self.options, step_pre_hook=False)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self.on_fit_start(trainer, pl_module)  # optimizers a strategy rebuilt after on_fit_start
        for placement in self._placements.values():
            placement.place()
        # Advice and prefetches are asynchronous: settle them before anything (a CUDA graph capture) follows.
        torch.cuda.synchronize(trainer.strategy.root_device)
        self.reports = [p.report() for p in self._placements.values()]
        rank_zero_info(f"ManagedOptimizerState: {len(self._placements)} optimizer(s); the state is created in "
                       f"{'host' if self.options.preferred == 'cpu' else 'GPU'}-preferred managed memory at the first "
                       f"step (prefetch={self.options.prefetch!r}).")
        self._logged = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.enabled:
            return
        placement = self._placements.get(id(_lightning.unwrap_optimizer(optimizer)))
        if placement is not None:
            placement.before_step()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.enabled and not self._logged and any(p.report().tensors for p in self._placements.values()):
            self._logged = True
            self.reports = [p.report() for p in self._placements.values()]
            total = sum(r.state_bytes for r in self.reports)
            rank_zero_info("ManagedOptimizerState: " + "; ".join(r.describe() for r in self.reports)
                           + f" (total {fmt_bytes(total)}).")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._release()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning skips the callbacks' teardown when a fit fails: the hooks go here instead.
        self._release()

    def _release(self) -> None:
        """Remove every placement's hooks (no managed scope is open between hooks: each one is a `with` block inside
        a single hook)."""
        if self._placements:
            self.reports = [p.report() for p in self._placements.values()]
        for placement in self._placements.values():
            placement.remove()
        self._placements.clear()
