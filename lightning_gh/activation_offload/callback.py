"""``ActivationOffload``: the activation-offload engine as a Lightning callback.

The engine is entered when a training batch starts and left just before the backward
(``on_before_backward``), so it sees exactly the training forward: validation, prediction and anything
under ``torch.no_grad()`` are untouched, and each micro-batch of gradient accumulation is one offloaded
forward/backward. Works under DDP (each rank offloads its own activations), with bf16/fp16 autocast and
with activation checkpointing (it then offloads only what checkpointing still saves: the blocks' inputs),
and under FSDP2 (``ModelParallelStrategy``; each rank plans for its own GPU). FSDP1 (``FSDPStrategy``) is
refused at setup (see :func:`check_strategy`), and so are the parts
it does not combine with (:mod:`lightning_gh.compat`). ``recompute=`` makes
the blocks the plan does not offload recompute in the backward (see :mod:`lightning_gh.activation_offload.recompute`).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Sequence

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gh import compat
from lightning_gh._lightning import log_to_loggers, should_update_logs
from lightning_gh._util import fmt_bytes
from lightning_gh.activation_offload.engine import ActivationOffloader
from lightning_gh.activation_offload.options import MIB, ActivationOffloadOptions
from lightning_gh.activation_offload.policy import OffloadPlan, Prediction

__all__ = ["ActivationOffload", "check_strategy"]


def check_strategy(strategy: Any) -> None:
    """Raise ``MisconfigurationException`` for ``FSDPStrategy`` (FSDP1) and for tensor parallelism, which the engine
    does not combine with.

    FSDP1 gathers each unit's weights into a flat buffer and hands the modules plain tensor views of it, so the
    engine could not tell the gathered weights from activations: it would copy them to the host, and FSDP may
    free that buffer while a side-stream copy still reads it. FSDP2 (``ModelParallelStrategy``, and
    ``strategy="superoffload_fsdp"`` built on it) gathers them into parameters, which the engine skips (Note
    [FSDP2's gathered weights are parameters]). Each rank plans its own blocks, so a ``ModelParallelStrategy``
    whose ``tensor_parallel_size`` is above one is refused: a block one rank recomputes would issue its
    tensor-parallel collectives on that rank only. The callback calls this in ``setup``.

    Args:
        strategy: the trainer's strategy (``trainer.strategy``).

    Example::

        check_strategy(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))  # fine
        check_strategy(ModelParallelStrategy(tensor_parallel_size=2))  # MisconfigurationException: data parallel only
        check_strategy(FSDPStrategy())  # MisconfigurationException naming ModelParallelStrategy
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        tp = _tensor_parallel_size(strategy)
        if isinstance(tp, int) and tp > 1:
            raise MisconfigurationException(
                f"ActivationOffload does not support ModelParallelStrategy with tensor_parallel_size={tp}: each rank "
                "plans its own blocks, and a tensor-parallel block that one rank recomputes and another does not "
                "would issue collectives on one rank only. Supported: data parallel only "
                "(ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1), fully_shard in configure_model).")
    if isinstance(strategy, FSDPStrategy):
        raise MisconfigurationException(
            f"ActivationOffload does not support strategy {type(strategy).__name__}: FSDP1 gathers the sharded "
            "weights into a flat buffer of plain tensors, so the engine would offload the gathered weights as "
            "activations and FSDP could free their memory while a copy still reads it. Supported: one device, DDP, "
            "and FSDP2 through ModelParallelStrategy (fully_shard in configure_model) or strategy='superoffload_fsdp'.")


def _tensor_parallel_size(strategy: Any) -> Any:
    """The tensor-parallel size of a ``ModelParallelStrategy``: its device mesh's, once built, else as given
    (``"auto"`` before Lightning resolves it)."""
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None:
        try:
            return mesh["tensor_parallel"].size()
        except (KeyError, RuntimeError, ValueError):
            pass
    return getattr(strategy, "_tensor_parallel_size", 1)


class ActivationOffload(L.Callback):
    """Move saved activations of the transformer blocks to pinned host memory during the forward and
    prefetch them back during the backward, overlapping both with compute on side streams.

    Args:
        policy, min_tensor_bytes, blocks, skip_last_blocks, prefetch_blocks, max_inflight_blocks, margin,
        profile_steps, host_memory_fraction, backend, bandwidth_gbps, record_timeline, dedupe_casts,
        recompute_param_casts, recompute, budget, lean_loss, budget_offload, causal_sdpa: the options, documented
            once in :class:`ActivationOffloadOptions` (``profile_steps`` counts training batches here); they build
            ``options``.
        options: all of them as one :class:`ActivationOffloadOptions` instead (then pass no other option).

    Attributes:
        options: the options in force.
        engine: the :class:`ActivationOffloader`, from ``on_fit_start`` on.
        plan: the plan the engine adopted last (restored from a checkpoint for ``"auto"``).

    Example::

        trainer = L.Trainer(precision="bf16-mixed", callbacks=[ActivationOffload(policy="auto")])
        trainer.fit(model, datamodule)
        print(trainer.callbacks[-1].plan.describe())
    """

    lgh_part = "ActivationOffload"

    def __init__(
        self,
        policy: int | str = "auto",
        min_tensor_bytes: int = MIB,
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
        dedupe_casts: bool = True,
        recompute_param_casts: bool = True,
        recompute: str | None = None,
        budget: str | int | float | None = None,
        lean_loss: bool | None = None,
        budget_offload: bool | str | None = None,
        causal_sdpa: bool = True,
        options: ActivationOffloadOptions | None = None,
    ) -> None:
        super().__init__()
        self.options = ActivationOffloadOptions.build(
            options, "ActivationOffload", policy=policy, min_tensor_bytes=min_tensor_bytes, blocks=blocks,
            skip_last_blocks=skip_last_blocks, prefetch_blocks=prefetch_blocks,
            max_inflight_blocks=max_inflight_blocks, margin=margin, profile_steps=profile_steps,
            host_memory_fraction=host_memory_fraction, backend=backend, bandwidth_gbps=bandwidth_gbps,
            record_timeline=record_timeline, dedupe_casts=dedupe_casts,
            recompute_param_casts=recompute_param_casts, recompute=recompute, budget=budget,
            lean_loss=lean_loss, budget_offload=budget_offload, causal_sdpa=causal_sdpa)
        self.engine: ActivationOffloader | None = None
        self.plan: OffloadPlan | None = None
        self._restored: dict[str, Any] | None = None
        self._logged = 0

    @property
    def policy(self) -> str | int:
        return self.options.policy

    @property
    def budget(self) -> str | int | float | None:
        return self.options.budget

    @property
    def recompute(self) -> str | None:
        return self.options.recompute

    @property
    def blocks(self) -> str | Sequence[nn.Module] | None:
        return self.options.blocks

    @property
    def record_timeline(self) -> bool:
        return self.options.record_timeline

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    # ------------------------------------------------------------------------------------- lifecycle

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            compat.check(trainer, self.lgh_part)
            check_strategy(trainer.strategy)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        options = beside_optimizers(self.options, trainer.optimizers)
        self.engine = ActivationOffloader(pl_module, options=options, on_plan=self._on_plan)
        if self.engine.enabled and self._restored is not None and self.policy == "auto" \
                and (self.budget is None) == (self._restored.get("policy") != "budget"):
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
            if trainer.loggers and should_update_logs(trainer) and \
                    (self.engine.stats.forwards or self.engine.stats.plain_forwards):
                st = self.engine.stats
                # what this step moved off the device and what it kept there (the memory the plan saved)
                log_to_loggers(trainer, {
                    "lgh/activation_offload/offloaded_bytes": float(st.last_offloaded_bytes),
                    "lgh/activation_offload/resident_bytes": float(st.last_resident_bytes),
                    "lgh/activation_offload/offloaded_blocks": float(sum(1 for b in st.last_offloaded_by_block if b)),
                    "lgh/activation_offload/recompute_blocks": float(len(st.last_recompute_blocks)),
                })
            log = self.engine.budget.log if self.engine.budget is not None else []
            if len(log) > self._logged:
                # The plan, its forecast and each correction round's measured peak, at this step, rank 0.
                for entry in log[self._logged:]:
                    log_to_loggers(trainer, entry)
                self._logged = len(log)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.engine is not None:
            self.engine.end_forward()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.engine is not None and stage == "fit":
            self.engine.close()

    # -------------------------------------------------------------------------------------- the plan

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        b = self.engine.budget if self.engine is not None else None
        if b is not None and b.forecast is not None and b.achieved_bytes is not None:
            rank_zero_info(f"ActivationOffload budget: target {fmt_bytes(b.budget_bytes)}, predicted "
                           f"{fmt_bytes(b.forecast.activation_bytes)} at {b.forecast.ratio:.2f}x, achieved "
                           f"{fmt_bytes(b.achieved_bytes)}; plan: {b.forecast.describe_choices()}")

    def _on_plan(self, plan: OffloadPlan) -> None:
        self.plan = plan
        rank_zero_info(f"ActivationOffload ({self.engine.blocks_name if self.engine else '?'}, "
                       f"{len(plan.budgets)} blocks) {plan.describe()}")

    def state_dict(self) -> dict[str, Any]:
        # "auto" keeps its decision across a resume instead of measuring again.
        if self.policy == "auto" and self.plan is not None and self.plan.policy in ("auto", "budget"):
            return {"plan": asdict(self.plan)}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("plan")


def beside_optimizers(options: ActivationOffloadOptions, optimizers: Sequence[Any]) -> ActivationOffloadOptions:
    """``options`` with ``budget_offload`` decided where the user left it to the run: ``"last"`` (offload only what
    recomputing cannot fit) when a budget plans beside an optimizer that updates parameters on the host CPU (its
    ``updates_on_host`` is true: SuperOffload's), whose update the activation copies into host memory would slow;
    otherwise ``options`` unchanged.

    >>> import torch
    >>> opts = ActivationOffloadOptions(budget="8GiB")
    >>> host = type("HostAdamW", (torch.optim.SGD,), {"updates_on_host": True})([torch.zeros(1)], lr=0.1)
    >>> beside_optimizers(opts, [host]).budget_offload, beside_optimizers(opts, []).budget_offload
    ('last', None)
    >>> beside_optimizers(ActivationOffloadOptions(budget="8GiB", budget_offload=True), [host]).budget_offload
    True
    """
    if options.budget is None or options.budget_offload is not None:
        return options
    host = [type(o).__name__ for o in optimizers if getattr(o, "updates_on_host", False)]
    if not host:
        return options
    rank_zero_info(f"ActivationOffload budget={options.budget!r}: the plan offloads only what recomputing cannot fit "
                   f"(budget_offload='last'), since {host[0]} updates parameters on the host CPU and activation "
                   "copies into host memory slow its update. budget_offload=True offloads whatever is fastest.")
    return replace(options, budget_offload="last")


def _plan_from_dict(d: dict[str, Any]) -> OffloadPlan:
    pred = d.get("prediction")
    return OffloadPlan(
        policy=d["policy"], budgets=tuple(d["budgets"]), release_at=tuple(d["release_at"]),
        prefetch_at=tuple(d["prefetch_at"]), prediction=Prediction(**pred) if pred else None,
        notes=tuple(d.get("notes", ())) + ("(restored from the checkpoint)",),
        recompute=tuple(d.get("recompute", ())), recompute_mode=d.get("recompute_mode"),
        modes=tuple(d.get("modes", ())), lean_loss=bool(d.get("lean_loss", False)))
