"""SuperOffload: AdamW with its fp32 master weights and moments in host memory, updated on the CPU while the
backward pass still runs, and a Lightning strategy (``Trainer(strategy="superoffload")``) that uses it.

Modules, one idea each:

* :mod:`.options`: :class:`SuperOffloadOptions`, the frozen, validated options the optimizer and the strategy share;
* :mod:`.memory`: how much host memory the state needs (:class:`HostMemoryPlan`, :func:`check_host_memory`);
* :mod:`.layout`: parameters -> slots and host buckets with flat page-locked buffers;
* :mod:`.tail`: the GPU-tail policy (``gpu_fraction="auto"``) and moving state between host and GPU;
* :mod:`.worker`: the CPU worker thread (fused CPU AdamW, speculation, exact rollback, copies back);
* :mod:`.zero`: the state sharded over ranks (ZeRO-1/2): partition, gradient reduce, norm sum, weight broadcast;
* :mod:`.optimizer`: :class:`HeterogeneousAdamW` (hooks, ``step()``, state dict) built from the parts above;
* :mod:`.strategy`: :class:`SuperOffloadStrategy`, registered as ``"superoffload"`` on import.

Example::

    >>> import torch
    >>> from lightning_gh.superoffload import HeterogeneousAdamW, SuperOffloadOptions
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = HeterogeneousAdamW(model.parameters(), options=SuperOffloadOptions(gpu_fraction=0.0), module=model)
    >>> model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.close()
"""

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
    "SuperOffloadOptions",
    "SuperOffloadStrategy",
    "available_host_bytes",
    "check_host_memory",
    "device_memory_room",
    "host_bytes_per_param",
    "validate_options",
]
