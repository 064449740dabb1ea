"""How much host memory SuperOffload's state needs, and the check that refuses to start when it does not fit.

The optimizer keeps fp32 master weights and both AdamW moments in host memory. The generic pieces (free host
RAM, page-locked buffers, the one :class:`~lightning_gh._host.HostMemoryError`, free GPU memory) live in
:mod:`lightning_gh._host` and :mod:`lightning_gh.hardware`; this module holds only SuperOffload's sizing and
re-exports those pieces under the names SuperOffload used before.

Example::

    >>> from lightning_gh.superoffload.memory import host_bytes_per_param, available_host_bytes
    >>> host_bytes_per_param(speculative_backup=True)
    28
    >>> available_host_bytes() is None or available_host_bytes() > 0
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_gh import _host, hardware
from lightning_gh._host import HostBuffer, HostMemoryError

__all__ = [
    "HostBuffer",
    "local_world_size",
    "HostMemoryError",
    "HostMemoryPlan",
    "available_host_bytes",
    "check_host_memory",
    "device_memory_room",
    "host_bytes_per_param",
]

# fp32 master weight, fp32 exp_avg, fp32 exp_avg_sq, fp32 gradient landing buffer.
STATE_BYTES = 4 + 4 + 4
GRAD_BYTES = 4
# A copy of master + both moments taken before a speculative update, so it can be undone exactly.
BACKUP_BYTES = 12


def available_host_bytes() -> int | None:
    """Host memory available to a new allocation (bytes), or ``None`` where it cannot be read.

    The same as :func:`lightning_gh.hardware.available_host_bytes` (asked at call time, so a test that
    replaces the hardware probe is seen here too).
    """
    return hardware.available_host_bytes()


def device_memory_room(device: torch.device | str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device under this process's memory-fraction cap, or ``None`` off CUDA.

    The same as :func:`lightning_gh.hardware.gpu_memory_room`. The auto GPU tail asks through this name before it
    grows, so tests replace it here to simulate a small GPU.
    """
    return hardware.gpu_memory_room(device)


def host_bytes_per_param(speculative_backup: bool) -> int:
    """Host bytes one offloaded parameter costs: 16 (master, two moments, gradient buffer), plus 12
    when speculative updates keep an exact pre-step copy."""
    return STATE_BYTES + GRAD_BYTES + (BACKUP_BYTES if speculative_backup else 0)


@dataclass(frozen=True)
class HostMemoryPlan:
    """What the optimizer will allocate in host memory.

    Attributes:
        host_params: parameters whose state lives in host memory.
        speculative_backup: whether exact-rollback copies are allocated too.
        available_bytes: the host memory available when the plan was made, or ``None`` when unknown.
    """

    host_params: int
    speculative_backup: bool
    available_bytes: int | None

    @property
    def needed_bytes(self) -> int:
        return self.host_params * host_bytes_per_param(self.speculative_backup)

    def describe(self) -> str:
        gib = 2**30
        avail = "unknown" if self.available_bytes is None else f"{self.available_bytes / gib:.2f} GiB"
        backup = " + 12 B speculation backup" if self.speculative_backup else ""
        return (f"{self.host_params:,} offloaded parameters x {host_bytes_per_param(self.speculative_backup)} B "
                f"(16 B master/moments/gradient{backup}) = {self.needed_bytes / gib:.2f} GiB of host RAM; "
                f"available: {avail}")


def local_world_size() -> int:
    """Processes of this job on this host that each hold their own offloaded state (1 outside a distributed run).

    Read from ``LOCAL_WORLD_SIZE`` (torchrun), else from an initialised process group (its size, capped at the
    number of visible GPUs: one rank per GPU on a host), else 1.

    Example::

        >>> local_world_size() >= 1
        True
    """
    import os

    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env and env.isdigit() and int(env) >= 1:
        return int(env)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return max(1, min(world, gpus) if gpus else world)
    return 1


def check_host_memory(host_params: int, speculative_backup: bool, headroom: float = 0.9,
                      local_ranks: int | None = None) -> HostMemoryPlan:
    """Raise :class:`~lightning_gh._host.HostMemoryError` (a ``MemoryError``) naming the numbers when the host
    cannot hold this rank's offloaded state.

    Each rank on a host checks its own share against the available host memory divided by the ranks on that
    host, so a job whose ranks would together exhaust the host fails on every rank, before anything is allocated,
    instead of one rank being killed by the OOM killer later.

    Args:
        host_params: parameters whose state this rank keeps in host memory.
        speculative_backup: whether exact-rollback copies are allocated too (12 B per parameter).
        headroom: the share of the available host memory the optimizers of this host may take.
        local_ranks: ranks sharing this host's memory; ``None``: :func:`local_world_size`.

    Returns:
        The plan, with the available bytes the decision used.

    Example::

        >>> check_host_memory(1000, speculative_backup=False, local_ranks=2).needed_bytes
        16000
    """
    ranks = local_world_size() if local_ranks is None else local_ranks
    if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1):
        raise ValueError(f"local_ranks={local_ranks!r} must be an int >= 1 or None.")
    plan = HostMemoryPlan(host_params, speculative_backup, available_host_bytes())
    tips = ["raise gpu_fraction (keep more parameters on the GPU)"]
    if speculative_backup:
        tips.append("speculative=False or no gradient clipping/non-finite skipping (drops the 12 B backup)")
    if ranks > 1:
        tips.append(f"run fewer ranks per host (this host runs {ranks}, each with its own copy of the state)")
    share = "" if ranks == 1 else f", this rank's share: 1/{ranks} of the host"
    _host.check_host_room(plan.needed_bytes, what=f"HeterogeneousAdamW ({plan.describe()}{share})",
                          headroom=headroom / ranks, tips=tips, opt_out="host_memory_check=False")
    return plan
