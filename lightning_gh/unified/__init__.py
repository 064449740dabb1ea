"""Unified (managed) memory for PyTorch Lightning: a ``torch.cuda.MemPool`` over ``cudaMallocManaged`` with advice
and prefetch, ``managed_memory()`` to scope allocations into it, and ``ManagedOptimizerState`` to keep the
optimizer state there (host-preferred, updated in place by the GPU's own fused AdamW).

Built for Grace Hopper, where the GPU reads host memory coherently over NVLink-C2C; safe on PCIe GPUs, where the
pool refuses to hold more managed memory than the GPU has free (:mod:`lightning_gh.unified.guard`).

Importing this package compiles nothing and needs no GPU: the allocator shim is built on first use.

Modules: ``options`` (one frozen options dataclass), ``guard`` (the safety rule and the errors), ``shim`` (loads the
C++ allocator of ``csrc/managed.cpp``, built at first use by :mod:`lightning_gh._native`), ``pool`` (MemPool,
``managed_memory()``), ``lifetime`` (pools never destroyed, scopes tracked, the allocator's open-context check),
``advice`` (advise / prefetch tensors), ``state`` (optimizer state placement), ``callback``
(the Lightning callback), ``forecast`` (the GH200 forecast from measured step times; the bandwidth itself is
measured by ``hardware.managed_bandwidth``).
"""

from lightning_gh.unified.advice import advise, is_managed, locations, prefetch
from lightning_gh.unified.callback import ManagedOptimizerState
from lightning_gh.unified.forecast import GH200_RMW_GBPS, forecast_step_ms
from lightning_gh.unified.guard import ManagedMemoryError, ManagedMemoryUnavailable, pool_bytes_for, refusal_reason
from lightning_gh.unified.options import ManagedMemoryOptions
from lightning_gh.unified.pool import ManagedPool, PoolStats, get_pool, managed_memory
from lightning_gh.unified.state import OptimizerStatePlacement, PlacementReport, manage_optimizer_state

__all__ = [
    "GH200_RMW_GBPS",
    "ManagedMemoryError",
    "ManagedMemoryOptions",
    "ManagedMemoryUnavailable",
    "ManagedOptimizerState",
    "ManagedPool",
    "OptimizerStatePlacement",
    "PlacementReport",
    "PoolStats",
    "advise",
    "forecast_step_ms",
    "get_pool",
    "is_managed",
    "locations",
    "manage_optimizer_state",
    "managed_memory",
    "pool_bytes_for",
    "prefetch",
    "refusal_reason",
]
