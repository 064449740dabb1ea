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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gh import _host, hardware
from lightning_gh._host import HostBuffer, HostMemoryError
from lightning_gh._util import fmt_bytes

__all__ = [
    "HostBuffer",
    "local_world_size",
    "HostMemoryError",
    "HostMemoryPlan",
    "available_host_bytes",
    "check_host_memory",
    "device_memory_room",
    "host_bytes_per_param",
    "plan_host_memory",
    "speculation_budget",
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


def host_bytes_per_param(speculative_backup: bool, grad_bytes: int = GRAD_BYTES) -> int:
    """Host bytes one offloaded parameter costs: master and two moments (12), its gradient landing buffer
    (``grad_bytes``: 4 for fp32, 2 for bf16), plus 12 when its speculative updates keep an exact pre-step copy."""
    return STATE_BYTES + grad_bytes + (BACKUP_BYTES if speculative_backup else 0)


@dataclass(frozen=True)
class HostMemoryPlan:
    """What the optimizer will allocate in host memory, and why.

    Attributes:
        host_params: parameters whose state this rank keeps in host memory.
        speculative_backup: whether exact-rollback copies (or second copies) of the state are allocated.
        available_bytes: the host memory available when the plan was made, or ``None`` when unknown.
        speculative_params: parameters whose buckets may be updated speculatively, each with a 12 B copy;
            ``None``: all of ``host_params`` (when ``speculative_backup``).
        grad_bytes: bytes of one parameter's gradient landing buffer (4: fp32, 2: bf16).
        device_params: parameters whose state starts on the GPU tail (a fixed ``gpu_fraction``, or what the host
            cannot hold).
        reason: why, in words (the one log line).
        largest_params: the most parameters this host (and GPU) could hold with the leanest configuration.
    """

    host_params: int
    speculative_backup: bool
    available_bytes: int | None
    speculative_params: int | None = None
    grad_bytes: int = GRAD_BYTES
    device_params: int = 0
    reason: str = ""
    largest_params: int | None = None

    @property
    def backup_params(self) -> int:
        """Parameters with a 12 B exact-rollback copy."""
        if not self.speculative_backup:
            return 0
        return self.host_params if self.speculative_params is None else self.speculative_params

    @property
    def needed_bytes(self) -> int:
        return self.host_params * host_bytes_per_param(False, self.grad_bytes) + self.backup_params * BACKUP_BYTES

    def describe(self) -> str:
        avail = "unknown" if self.available_bytes is None else fmt_bytes(self.available_bytes)
        per = host_bytes_per_param(False, self.grad_bytes)
        if self.backup_params and self.backup_params == self.host_params:
            what = (f"{self.host_params:,} offloaded parameters x {per + BACKUP_BYTES} B ({per} B "
                    f"master/moments/gradient + 12 B speculation backup)")
        else:
            what = f"{self.host_params:,} offloaded parameters x {per} B (master/moments/gradient)"
            if self.backup_params:
                what += f" + {self.backup_params:,} speculatively updated x 12 B (backup)"
        return f"{what} = {fmt_bytes(self.needed_bytes)} of host RAM; available: {avail}"


def plan_host_memory(params: int, *, available_bytes: int | None, speculative: bool | str = "auto",
                     validation: bool = True, grad_bytes: int = GRAD_BYTES, gpu_share: float | None = None,
                     gpu_room_bytes: int = 0, gpu_bytes_per_param: int = 14, shards: int = 1, local_ranks: int = 1,
                     headroom: float = 0.9) -> HostMemoryPlan:
    """The fastest configuration of host state that fits: a pure function of the sizes (no probing).

    Every offloaded parameter needs its master, moments and gradient buffer on the host; the 12 B exact-rollback
    copy is needed only for the buckets updated speculatively. With ``speculative="auto"`` the buckets whose
    gradients arrive first speculate, as many as the host's room for copies allows (none if none fits). When the
    host cannot hold even the state, an auto tail (``gpu_share=None``) keeps the last-arriving parameters' state on
    the GPU from the start, within ``gpu_room_bytes``. A plan whose :attr:`~HostMemoryPlan.needed_bytes` exceed the
    room is what the leanest configuration needs: nothing fits (:func:`check_host_memory` then refuses).

    Args:
        params: trainable parameters to place (all ranks together).
        available_bytes: host memory available, or ``None`` when unknown (then everything may speculate).
        speculative: ``True`` (a copy for every bucket), ``False`` (no speculation) or ``"auto"``.
        validation: steps may be clipped or skipped (without, speculation needs no copy).
        grad_bytes: bytes of a gradient landing buffer per parameter.
        gpu_share: a fixed share of the parameters on the GPU tail, or ``None`` for the auto tail.
        gpu_room_bytes: GPU memory the auto tail may take from the start.
        gpu_bytes_per_param: GPU bytes of one tail parameter's state.
        shards: ranks that share the state (each holds ``1/shards`` of the host part).
        local_ranks: ranks on this host, each with its own share of host memory.
        headroom: the share of the available host memory the optimizers of this host may take.

    Example::

        >>> p = plan_host_memory(1000, available_bytes=40_000)  # 36,000 B may be used: state 16,000, copies 12,000
        >>> p.host_params, p.speculative_params, p.needed_bytes
        (1000, 1000, 28000)
        >>> plan_host_memory(1000, available_bytes=22_223).speculative_params  # 4,000 B left: copies of 333
        333
    """
    per = host_bytes_per_param(False, grad_bytes)
    device = 0 if gpu_share is None else int(math.ceil(gpu_share * params))
    host = -(-(params - device) // shards)
    wanted = validation and speculative is not False  # speculation that needs a copy
    room = None if available_bytes is None else int(headroom * available_bytes / local_ranks)

    def plan(host_params: int, spec: int | None, reason: str, largest: int | None = None) -> HostMemoryPlan:
        return HostMemoryPlan(host_params, wanted and spec != 0, available_bytes, spec, grad_bytes, device, reason,
                              largest)

    if not wanted:
        why = ("speculative=False: every bucket waits for the step's decision" if speculative is False else
               "no clipping or non-finite skip: speculative updates need no backup")
        if room is None or host * per <= room:
            return plan(host, 0, why)
    if room is None:
        return plan(host, None, "host memory unknown: every bucket may be updated speculatively")
    prefix = ""
    if host * per > room:
        over = host - room // per  # this rank's parameters the host cannot hold
        if gpu_share is None and over * shards * gpu_bytes_per_param <= gpu_room_bytes:
            device, host = over * shards, host - over
            prefix = (f"the host cannot hold every parameter's state: the last-arriving {device:,} keep theirs on "
                      f"the GPU from the start; ")
        else:
            largest = (room // per) * shards
            largest = int(largest / (1 - gpu_share)) if gpu_share and gpu_share < 1 else \
                largest + (gpu_room_bytes // gpu_bytes_per_param if gpu_share is None else 0)
            return plan(host, None if speculative is True else 0, "the host cannot hold the state", largest=largest)
    spare = room - host * per
    if not wanted:
        return plan(host, 0, prefix + why)
    if speculative is True:
        return plan(host, None, prefix + "speculative=True: a backup for every bucket",
                    largest=None if host * (per + BACKUP_BYTES) <= room else (room // (per + BACKUP_BYTES)) * shards)
    spec = min(host, spare // BACKUP_BYTES)
    if spec == host:
        why = "room for a backup of every bucket: all may be updated speculatively"
    elif spec > 0:
        why = (f"room for backups of {spec:,} of {host:,} parameters: the buckets whose gradients arrive first "
               f"speculate, the rest wait for the step's decision")
    else:
        why = "no host RAM left for a backup: every bucket waits for the step's decision"
    return plan(host, spec, prefix + why)


def speculation_budget(plan: HostMemoryPlan, host_params: int | None = None) -> int:
    """Parameters whose buckets may keep an exact-rollback copy (and so be updated speculatively) while the host
    holds the state of ``host_params`` parameters: the plan's copies, plus copies in the room the plan counted for
    state that has since moved to the GPU tail. The host then never holds more than the plan's
    :attr:`~HostMemoryPlan.needed_bytes`; ``None``: as planned.

    Example::

        >>> p = plan_host_memory(1000, available_bytes=22_223)  # copies of 333 of the 1,000 parameters fit
        >>> speculation_budget(p), speculation_budget(p, 1000), speculation_budget(p, 850), speculation_budget(p, 400)
        (333, 333, 533, 400)
    """
    if host_params is None:
        return plan.backup_params
    freed = max(0, plan.host_params - host_params) * host_bytes_per_param(False, plan.grad_bytes)
    return min(host_params, plan.backup_params + freed // BACKUP_BYTES)


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


#: SuperOffload's name in the host-memory plan.
PLAN_PART = "SuperOffload"


#: Host bytes per trainable parameter of the whole model that a ZeRO-1/2 rank's process holds beyond its plan's buffers
#: (every rank holds the whole model; measured on GPU hosts, docs/superoffload.md "Host memory per rank").
ZERO12_PROCESS_BYTES_PER_PARAM = 2.5


def rank_process_bytes(model_params: int, ranks: int) -> int:
    """Host bytes a rank's process takes beside the host plan's buffers: none counted on one rank (the plan's
    headroom covers it); with several ZeRO-1/2 ranks, :data:`ZERO12_PROCESS_BYTES_PER_PARAM` per trainable
    parameter of the whole model (``model_params``), on every rank.

    >>> rank_process_bytes(1000, 1), rank_process_bytes(1000, 2)
    (0, 2500)
    """
    return 0 if ranks <= 1 else int(ZERO12_PROCESS_BYTES_PER_PARAM * model_params)


def check_host_memory(params: int, speculative_backup: bool = True, headroom: float = 0.9,
                      local_ranks: int | None = None, *, speculative: bool | str | None = None,
                      enforce: bool = True, owner: object | None = None, process_bytes: int = 0,
                      stage_bytes: int = 0, **sizes: Any) -> HostMemoryPlan:
    """Plan this rank's host state from the host memory available now (:func:`plan_host_memory`) and raise
    :class:`~lightning_gh._host.HostMemoryError` (a ``MemoryError``) naming the numbers, and the largest model that
    would fit, when no configuration fits.

    Each rank on a host plans its own share against the available host memory divided by the ranks on that host,
    so a job whose ranks would together exhaust the host fails on every rank, before anything is allocated,
    instead of one rank being killed by the OOM killer later.

    Args:
        params: parameters to place (with ``speculative=None``: whose state this rank keeps in host memory).
        speculative_backup: with ``speculative=None``, whether every parameter gets an exact-rollback copy.
        headroom: the share of the available host memory the optimizers of this host may take.
        local_ranks: ranks sharing this host's memory; ``None``: :func:`local_world_size`.
        speculative: ``True`` / ``False`` / ``"auto"``: plan the speculation too (see :func:`plan_host_memory`).
        enforce: read the host's memory and refuse when nothing fits; ``False``: plan as if the host's memory were
            unknown (``host_memory_check=False``).
        owner: the object whose lifetime the claim in the host-memory plan follows (see Note [One host-memory
            plan] in :mod:`lightning_gh._host`); ``None``: the plan is checked, not recorded.
        process_bytes: host bytes this rank's process takes beyond the plan's buffers (see
            :func:`rank_process_bytes`): the room shrinks by them and the claim counts them.
        stage_bytes: the weights-first staging buffers' host bytes (see :mod:`.weights_first`), counted the same way.
        **sizes: the other arguments of :func:`plan_host_memory` (``validation``, ``grad_bytes``, ``gpu_share``,
            ``gpu_room_bytes``, ``gpu_bytes_per_param``, ``shards``).

    Returns:
        The plan, with the available bytes the decision used.

    Example::

        >>> check_host_memory(1000, speculative_backup=False, local_ranks=2).needed_bytes
        16000
    """
    ranks = local_world_size() if local_ranks is None else local_ranks
    if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1):
        raise ValueError(f"local_ranks={local_ranks!r} must be an int >= 1 or None.")
    if speculative is None:
        speculative = bool(speculative_backup)
    # The room is this rank's share of the host-memory plan's budget less what the other offloading parts hold or
    # announced (Note [One host-memory plan]); the claim below checks the same number.
    room = _host.PLAN.room(PLAN_PART, headroom=headroom / ranks) if enforce and available_host_bytes() is not None \
        else None
    if room is not None:
        room = max(0, room - process_bytes - stage_bytes)
    plan = plan_host_memory(params, available_bytes=room, speculative=speculative, local_ranks=1, headroom=1.0,
                            **sizes)
    if room is not None:  # the plan says what the host has; the room it was made for is in the claim's message
        plan = dataclasses.replace(plan, available_bytes=available_host_bytes())
    if not enforce:
        return plan
    tips = ["raise gpu_fraction (keep more parameters on the GPU)"]
    if plan.backup_params:
        tips.append("speculative='auto' or False, or no gradient clipping/non-finite skipping (drops the 12 B "
                    "backup)")
    if ranks > 1:
        tips.append(f"run fewer ranks per host (this host runs {ranks}, each with its own copy of the state)")
    if plan.largest_params is not None:
        tips.append(f"a model of at most {plan.largest_params:,} parameters fits this host")
    share = "" if ranks == 1 else f", this rank's share: 1/{ranks} of the host"
    if process_bytes:
        share += f", plus {fmt_bytes(process_bytes)} the rank's process takes beside them"
        tips.append('strategy="superoffload_fsdp" (ZeRO-3: the parameters sharded too, less host memory per rank '
                    "beside the state)")
    if stage_bytes:
        share += f", plus {fmt_bytes(stage_bytes)} of staging buffers (weights first)"
    _host.check_host_room(plan.needed_bytes + process_bytes + stage_bytes,
                          what=f"HeterogeneousAdamW ({plan.describe()}{share})",
                          headroom=headroom / ranks, tips=tips, opt_out="host_memory_check=False", part=PLAN_PART,
                          owner=owner, record=owner is not None)
    return plan
