"""SuperOffload: AdamW with its fp32 master weights and moments in host memory, updated on the CPU while the
backward pass still runs, and a Lightning strategy (``Trainer(strategy="superoffload")``) that uses it.

Modules, one idea each:

* :mod:`.options`: :class:`SuperOffloadOptions`, the frozen, validated options the optimizer and the strategy share;
* :mod:`.memory`: how much host memory the state needs, and the plan that fits it (:class:`HostMemoryPlan`,
  :func:`check_host_memory`);
* :mod:`.layout`: :class:`~.layout.HostLayout`, parameters -> slots and host buckets with flat page-locked buffers;
* :mod:`.step`: the per-step records (:class:`~.step.StepCtx`, the decision, the gradient norms);
* :mod:`.worker`: :class:`~.worker.CpuUpdater`, the CPU thread (fused CPU AdamW, speculation, exact rollback, copies
  back);
* :mod:`.tail`: the auto GPU tail's pure policy (``decide(TailWindow) -> TailAction``); :mod:`.tail_mover` applies it
  and updates the GPU tail;
* :mod:`.zero`: :class:`~.zero.RankShard`, the state sharded over ranks (ZeRO-1/2): buckets dealt to the ranks,
  gradient reduce, norm sum, weight broadcast, the sharded GPU tail;
* :mod:`.state`: what the optimizer accepts, and its state dict in ``torch.optim.AdamW``'s format;
* :mod:`.optimizer`: :class:`HeterogeneousAdamW`, the ``torch.optim.Optimizer`` facade (param groups, hooks,
  ``step()``, state dict) over the parts above;
* :mod:`.strategy`: :class:`SuperOffloadStrategy` (``"superoffload"``, registered by ``import lightning_gh``);
* ZeRO-3 through FSDP2: :mod:`.fsdp_units` (FSDP2's shards as host rows), :mod:`.fsdp_optimizer`
  (:class:`ShardedHostAdamW`) and :mod:`.fsdp` (:class:`SuperOffloadFSDPStrategy`, ``"superoffload_fsdp"``).

Example::

    >>> import torch
    >>> from lightning_gh.superoffload import HeterogeneousAdamW, SuperOffloadOptions
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = HeterogeneousAdamW(model.parameters(), options=SuperOffloadOptions(gpu_fraction=0.0), module=model)
    >>> model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.close()
"""

from lightning_gh.superoffload.fsdp import SuperOffloadFSDPStrategy
from lightning_gh.superoffload.fsdp_optimizer import ShardedHostAdamW
from lightning_gh.superoffload.memory import (
    HostBuffer,
    HostMemoryError,
    HostMemoryPlan,
    available_host_bytes,
    check_host_memory,
    device_memory_room,
    host_bytes_per_param,
)
from lightning_gh.superoffload.optimizer import HeterogeneousAdamW
from lightning_gh.superoffload.options import SuperOffloadOptions, validate_options
from lightning_gh.superoffload.strategy import SuperOffloadStrategy

__all__ = [
    "HeterogeneousAdamW",
    "HostBuffer",
    "HostMemoryError",
    "HostMemoryPlan",
    "ShardedHostAdamW",
    "SuperOffloadFSDPStrategy",
    "SuperOffloadOptions",
    "SuperOffloadStrategy",
    "available_host_bytes",
    "check_host_memory",
    "device_memory_room",
    "host_bytes_per_param",
    "validate_options",
]
