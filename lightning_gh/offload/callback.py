"""``ActivationOffload``: the activation-offload engine as a Lightning callback.

The engine is entered when a training batch starts and left just before the backward
(``on_before_backward``), so it sees exactly the training forward: validation, prediction and anything
under ``torch.no_grad()`` are untouched, and each micro-batch of gradient accumulation is one offloaded
forward/backward. Works under DDP (each rank offloads its own activations), with bf16/fp16 autocast and
with activation checkpointing (it then offloads only what checkpointing still saves: the blocks' inputs).
FSDP and ModelParallel strategies are refused at setup (see :func:`check_strategy`). ``recompute=`` makes
the blocks the plan does not offload recompute in the backward (see :mod:`lightning_gh.offload.recompute`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gh.offload.activation_policy import OffloadPlan, Prediction
from lightning_gh.offload.activations import ActivationOffloader, validate_options

__all__ = ["ActivationOffload", "activation_offload_part", "check_strategy"]

_MIB = 2**20


def check_strategy(strategy: Any) -> None:
    """Raise ``MisconfigurationException`` for strategies the engine is not tested with: FSDP and
    ModelParallel (FSDP2).

    The engine tells parameters from activations by the storages the parameters have when a forward begins.
    FSDP gathers each block's sharded weights during the forward into new storages, so the gathered weights
    would be offloaded as activations, and FSDP may free that storage while a side-stream copy still reads it.
    The callback calls this in ``setup``.

    Args:
        strategy: the trainer's strategy (``trainer.strategy``).

    Example::

        check_strategy(DDPStrategy())   # fine
        check_strategy(FSDPStrategy())  # MisconfigurationException naming FSDPStrategy and what is supported
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        raise MisconfigurationException(
            f"ActivationOffload does not support strategy {type(strategy).__name__} yet: FSDP gathers the sharded "
            "weights during the forward, so the engine would offload the gathered weights as activations and FSDP "
            "could free their memory while a copy still reads it. Supported: one device or DDP "
            "(strategy='auto', 'ddp', 'ddp_spawn'). Remove ActivationOffload, or use activation checkpointing "
            "with FSDP.")


class ActivationOffload(L.Callback):
    """Move saved activations of the transformer blocks to pinned host memory during the forward and
    prefetch them back during the backward, overlapping both with compute on side streams.

    Args:
        policy: ``"auto"`` measures the first steps (per-block forward/backward time and saved bytes) and the
            link bandwidth, then offloads the blocks whose copies hide under compute with ``margin`` to spare,
            and logs the decision with its predicted memory saving; ``"all"`` offloads every block but the
            last ``skip_last_blocks`` (memory first: the step may wait on the link); an int ``K`` offloads the
            first ``K`` blocks.
        min_tensor_bytes: saved tensors smaller than this stay on the GPU (a copy's fixed cost outweighs them).
        blocks: the blocks, if not the model's largest ``nn.ModuleList`` of one module type: a submodule name
            such as ``"model.layers"``, or a list of modules.
        skip_last_blocks: blocks at the end never offloaded (backward needs their activations first).
        prefetch_blocks: fixed policies reload block ``i`` when block ``i + prefetch_blocks``'s backward starts.
        max_inflight_blocks: fixed policies make the compute stream wait for block ``i``'s copies when block
            ``i + max_inflight_blocks`` starts; ``None`` waits only at the forward's end.
        margin: ``"auto"`` plans as if transfers took ``1 + margin`` times their measured time.
        profile_steps: ``"auto"`` measures this many training batches after one warm-up batch.
        host_memory_fraction: the most of the host's available memory (``/proc/meminfo``) the pinned pool
            may take; a clear error before going over.
        backend: ``"auto"`` (CUDA if the model is on a GPU, else warn once and do nothing), ``"cuda"``, or
            ``"host-copy"`` (synchronous copies through a host buffer on any device; for tests).
        bandwidth_gbps: link GB/s for ``"auto"`` (a number or ``(d2h, h2d)``); ``None`` measures it.
        record_timeline: keep the engine's memory events of the latest step (``engine.timeline``).
        recompute: ``None`` (default: blocks keep what they save), ``"norm-act"``, ``"selective"`` or ``"full"``:
            the blocks the plan does not offload recompute in the backward instead. ``"norm-act"`` checkpoints
            only their normalisation and gated-activation modules (cheapest: no dispatch mode, but frees only
            what those modules save inside); ``"selective"`` keeps the outputs of the matmuls and attention and
            recomputes the memory-bound ops (norms, rotary embeddings, SiLU, products, casts) through a dispatch
            mode (19% of the step on the H200 medium run); ``"full"`` keeps only each block's input. With
            ``"auto"``: offload what the link hides, recompute in the other blocks, and log the saving measured
            in the first recomputing forward. Refused for blocks that are already checkpointed, compiled, or
            run Transformer Engine layers.

    Example::

        trainer = L.Trainer(precision="bf16-mixed", callbacks=[ActivationOffload(policy="auto")])
        trainer.fit(model, datamodule)
        print(trainer.callbacks[-1].plan.describe())
    """

    def __init__(
        self,
        policy: str | int = "auto",
        min_tensor_bytes: int = _MIB,
        *,
        blocks: str | Sequence[nn.Module] | None = None,
        skip_last_blocks: int = 1,
        prefetch_blocks: int = 1,
        max_inflight_blocks: int | None = 2,
        margin: float = 0.25,
        profile_steps: int = 2,
        host_memory_fraction: float = 0.5,
        backend: str = "auto",
        bandwidth_gbps: float | tuple[float, float] | None = None,
        record_timeline: bool = False,
        recompute: str | None = None,
    ) -> None:
        super().__init__()
        self._options = dict(min_tensor_bytes=min_tensor_bytes, skip_last_blocks=skip_last_blocks,
                             prefetch_blocks=prefetch_blocks, max_inflight_blocks=max_inflight_blocks, margin=margin,
                             profile_steps=profile_steps, host_memory_fraction=host_memory_fraction, backend=backend,
                             bandwidth_gbps=bandwidth_gbps, recompute=recompute)
        validate_options(policy=policy, **self._options)
        if blocks is not None and not isinstance(blocks, str) and isinstance(blocks, nn.Module):
            raise ValueError(f"blocks={type(blocks).__name__} must be a submodule name or a list of modules, "
                             "not a single module.")
        self.policy = policy
        self.recompute = recompute
        self.blocks = blocks
        self.record_timeline = record_timeline
        self.engine: ActivationOffloader | None = None
        self.plan: OffloadPlan | None = None
        self._restored: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    # ------------------------------------------------------------------------------------- lifecycle

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer.strategy)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for cb in trainer.callbacks:
            if type(cb).__name__ == "CUDAGraphCapture":
                raise MisconfigurationException(
                    "ActivationOffload and CUDAGraphCapture cannot be used together: a captured step replays its "
                    "kernels without running the Python hooks that order the offload copies. Remove one of them.")
        self.engine = ActivationOffloader(pl_module, self.policy, blocks=self.blocks,
                                          record_timeline=self.record_timeline, on_plan=self._on_plan,
                                          **self._options)
        if self.engine.enabled and self._restored is not None and self.policy == "auto":
            self.engine.set_plan(_plan_from_dict(self._restored))
        self._restored = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.engine is not None:
            self.engine.end_forward()  # a previous batch that never reached backward
            self.engine.begin_forward()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        if self.engine is not None:
            self.engine.end_forward()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.engine is not None:
            self.engine.end_backward()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.engine is not None:
            self.engine.end_forward()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.engine is not None:
            self.engine.end_forward()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.engine is not None and stage == "fit":
            self.engine.close()

    # -------------------------------------------------------------------------------------- the plan

    def _on_plan(self, plan: OffloadPlan) -> None:
        self.plan = plan
        rank_zero_info(f"ActivationOffload ({self.engine.blocks_name if self.engine else '?'}, "
                       f"{len(plan.budgets)} blocks) {plan.describe()}")

    def state_dict(self) -> dict[str, Any]:
        # "auto" keeps its decision across a resume instead of measuring again.
        if self.policy == "auto" and self.plan is not None and self.plan.policy == "auto":
            return {"plan": asdict(self.plan)}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("plan")


def _plan_from_dict(d: dict[str, Any]) -> OffloadPlan:
    pred = d.get("prediction")
    return OffloadPlan(
        policy=d["policy"], budgets=tuple(d["budgets"]), release_at=tuple(d["release_at"]),
        prefetch_at=tuple(d["prefetch_at"]), prediction=Prediction(**pred) if pred else None,
        notes=tuple(d.get("notes", ())) + ("(restored from the checkpoint)",),
        recompute=tuple(d.get("recompute", ())), recompute_mode=d.get("recompute_mode"))


def activation_offload_part(cfg: Any, hw: Any, out: Any) -> Any:
    """Demo part: ``ActivationOffload(policy="auto")`` on a CUDA GPU; off (with the reason) elsewhere."""
    from lightning_gh.demo.run import Part

    if not hw.cuda_available:
        return Part("ActivationOffload", False, "no CUDA GPU: saved activations stay on the device")
    return Part("ActivationOffload", True, "policy='auto': offloads what the host link hides under compute",
                callbacks=[ActivationOffload(policy="auto")])
