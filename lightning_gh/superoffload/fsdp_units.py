"""The pieces of SuperOffload's ZeRO-3 path (:class:`~.fsdp_optimizer.ShardedHostAdamW`) that describe FSDP2's sharding:
which parameters each ``fully_shard``-ed module manages (:func:`fsdp_units`), one parameter's local rows on this
rank (:class:`LocalShard`), one module's rows in host memory or on the device (:class:`HostUnit`), which units keep
their state on the device (:func:`device_share`, sized by :func:`auto_device_fraction` with ``gpu_fraction="auto"``)
and their update there (:func:`update_on_device`), the row-exact
torch AdamW of a shard's rows (:func:`positioned_update`, see Note [A shard's rows, updated as the full tensor's]),
the host-backed DTensors of the state dict (:func:`host_dtensor`), and the checks made before the first step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gh._host import HostBuffer
from lightning_gh._util import local_tensor
from lightning_gh.superoffload.cpu_adamw import _TAIL as _UNIT  # torch's fused CPU AdamW's unit of work
from lightning_gh.superoffload.options import SuperOffloadOptions

__all__ = ["AUTO_SHARE_STEP", "HostUnit", "LocalShard", "auto_device_fraction", "check_host_on_every_rank",
           "check_no_forward_prefetch",
           "device_share", "share_decision", "fsdp_units", "gather_streams", "host_dtensor",
           "local_rows", "norm_owner", "positioned_update", "tail_range", "unsupported_options", "update_on_device"]


def norm_owner(index: int, ranks: int) -> int:
    """The rank that assembles parameter ``index``'s full gradient and takes its norm: round-robin.

    >>> [norm_owner(i, 2) for i in range(5)]
    [0, 1, 0, 1, 0]
    """
    return index % ranks


def unsupported_options(options: SuperOffloadOptions) -> list[str]:
    """The :class:`SuperOffloadOptions` fields set to something the ZeRO-3 path cannot honour, as ``name=value``.

    The ZeRO-3 path updates each unit once its step's decision is known (no speculation: ``speculative`` must be
    ``"auto"`` or ``False``; nor does the GPU share the host update: ``device_assist`` must be ``"auto"`` or
    ``False``); ``bucket_size`` and ``rollback`` do not apply (the unit of work is the FSDP module).
    Every ``gpu_fraction`` is accepted: a float keeps the state of the first units in forward order on the device
    (:func:`device_share`); ``"auto"`` sizes that share from the measured device memory (:func:`auto_device_fraction`).

    >>> unsupported_options(SuperOffloadOptions())
    []
    >>> unsupported_options(SuperOffloadOptions(gpu_fraction=0.5, speculative=True, device_assist=True))
    ['speculative=True', 'device_assist=True']
    """
    bad = []
    if options.speculative is True:
        bad.append("speculative=True")
    if options.device_assist is True:  # each rank's CPU updates its own rows (see .assist)
        bad.append("device_assist=True")
    return bad


#: With ``gpu_fraction="auto"``, the step at whose end the ranks size the GPU share: the peak of a full step is known.
AUTO_SHARE_STEP = 2


def auto_device_fraction(room: int | None, local_elements: int, grad_bytes: int,
                         cap: float | None = None) -> float:
    """``gpu_fraction="auto"`` on the ZeRO-3 path: the share of the state whose fp32 master and moments (12 B per
    local element) and gradient rows (``grad_bytes``, kept on the device until ``step()``) fit in ``room`` bytes, the
    smallest room of any rank beside a full step's peak, for a rank of ``local_elements`` elements; at most
    ``cap`` (``max_gpu_fraction``). ``0.0`` when the room is unknown or none is left.

    >>> auto_device_fraction(14_000, 2_000, 2), auto_device_fraction(10**9, 2_000, 2, cap=0.5)
    (0.5, 0.5)
    >>> auto_device_fraction(None, 2_000, 2), auto_device_fraction(-5, 2_000, 2), auto_device_fraction(10**9, 2_000, 4)
    (0.0, 0.0, 1.0)
    """
    if room is None or room <= 0 or local_elements <= 0:
        return 0.0
    share = min(1.0, room / ((12 + grad_bytes) * local_elements))
    return share if cap is None else min(share, cap)


def check_host_on_every_rank(host_bytes: int, *, options: SuperOffloadOptions, world: int, device: torch.device,
                             group: Any, owner: object) -> None:
    """Check this rank's host room for ``host_bytes`` before any rank pins its buffers, and fail on every rank
    together: a rank that checked after another had pinned would see that memory as gone, and a rank that raised
    alone would leave the others waiting in their next collective (``group``: the ranks' process group)."""
    import torch.distributed as dist

    from lightning_gh._host import PLAN, HostMemoryError, check_host_room
    from lightning_gh.superoffload.memory import PLAN_PART, local_world_size

    err: Exception | None = None  # any failure of the check, so that no rank skips the flag's all_reduce
    if options.host_memory_check:
        try:
            check_host_room(host_bytes, what="ShardedHostAdamW (fp32 master, moments and gradient rows of this "
                            "rank's shards)", headroom=0.9 / max(1, min(local_world_size(), world)),
                            tips=["run more ranks (each holds 1/N of the state)", "fewer ranks per host"],
                            opt_out="host_memory_check=False", part=PLAN_PART, owner=owner)
        except Exception as e:
            err = e
    if world > 1:
        failed = torch.tensor([0.0 if err is None else 1.0], device=device)
        dist.all_reduce(failed, group=group)
        if err is None and failed.item():
            if options.host_memory_check:
                PLAN.release(PLAN_PART)  # this rank's claim: nothing gets pinned
            raise HostMemoryError(
                f"ShardedHostAdamW: {int(failed.item())} other rank(s) of this job lack host memory for their shards "
                "or could not check it (see their error); no rank pinned its buffers. Run more ranks (each holds 1/N "
                "of the state), fewer ranks per host, or pass host_memory_check=False.")
    if err is not None:
        raise err


def share_decision(units: list[HostUnit], room: str | None, how: str | None, failed: bool) -> str:
    """The one log line of ``gpu_fraction="auto"``'s decision on the ZeRO-3 path: how many units (and what share of
    the elements) keep their state on the GPUs, and the room that decided it (``None``: unknown)."""
    total = sum(sum(s.numels) for u in units for s in u.shards)
    on = sum(sum(s.numels) for u in units if u.on_device for s in u.shards)
    why = "no device memory reading" if room is None else f"on the tightest rank {room} (here: {how})"
    if failed:
        why += "; moving the share ran out of memory on some rank, so every rank keeps its state on the host"
    return (f"SuperOffload ZeRO-3 auto GPU share: {sum(u.on_device for u in units)} of {len(units)} FSDP units "
            f"({on / max(total, 1):.1%} of the elements) keep their fp32 master and moments on the GPUs; room for "
            f"state beside a step's peak: {why}.")


def device_share(order: list[int], numels: list[int], fraction: float) -> list[int]:
    """The units whose fp32 master and moments stay on the device with ``gpu_fraction=fraction``: the longest prefix
    of ``order`` (unit indices, forward order: the next forward needs them first) in which every unit has at least
    half of its elements within ``fraction`` of all of them. ``numels[i]``: unit ``i``'s elements over all ranks,
    so every rank, given the same order, chooses the same units.

    >>> device_share([0, 1, 2], [72, 312, 575], 0.5), device_share([2, 0, 1], [72, 312, 575], 0.5)
    ([0, 1], [2])
    >>> device_share([0, 1], [10, 10], 0.0), device_share([0, 1], [10, 10], 0.74), device_share([0, 1], [10, 10], 0.75)
    ([], [0], [0, 1])
    """
    if fraction <= 0.0:
        return []
    target = fraction * sum(numels)
    out: list[int] = []
    done = 0
    for i in order:
        if done + numels[i] / 2 > target:
            break
        out.append(i)
        done += numels[i]
    return out


def fsdp_units(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Every ``fully_shard``-ed module of ``module`` with the parameters it manages (its own and its children's,
    less those of nested ``fully_shard``-ed modules), in ``named_modules`` order (the root first).

    Raises:
        ValueError: no module of ``module`` is ``fully_shard``-ed.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(
            f"ShardedHostAdamW needs a model sharded with FSDP2: no module of {type(module).__name__} is "
            "fully_shard-ed. In the LightningModule's configure_model(), call "
            "torch.distributed.fsdp.fully_shard(block, mesh=self.device_mesh['data_parallel']) on each decoder "
            "layer, then on the root module.")
    out = []
    for unit in units:
        params: list[nn.Parameter] = []
        stack = [unit]
        while stack:
            m = stack.pop()
            params.extend(m.parameters(recurse=False))
            stack.extend(reversed([c for c in m.children() if not isinstance(c, FSDPModule)]))
        out.append((unit, params))
    return out


def check_no_forward_prefetch(unit: nn.Module) -> None:
    """Refuse FSDP2's explicit forward prefetching on ``unit`` (see Note [ZeRO-3 step and the forward's wait])."""
    state = getattr(unit, "_get_fsdp_state", None)
    state = state() if state is not None else None
    if state is not None and getattr(state, "_states_to_forward_prefetch", None):
        raise ValueError(
            f"ShardedHostAdamW: {type(unit).__name__} has explicit forward prefetching "
            "(set_modules_to_forward_prefetch), which all-gathers a later module before that module's update is "
            "in place. Remove the set_modules_to_forward_prefetch call (backward prefetching is fine).")


def gather_streams(unit: nn.Module) -> list[Any]:
    """The CUDA streams on which FSDP2 all-gathers ``unit``'s parameters in the forward (its copy-in stream and its
    all-gather stream; FSDP2's private state, created at the root's first forward), or ``[]`` where they cannot be
    read: before that, or where this torch lays them out otherwise. See Note [ZeRO-3 step and the forward's wait]."""
    state = getattr(unit, "_get_fsdp_state", None)
    ctx = getattr(state(), "_comm_ctx", None) if state is not None else None
    streams = [getattr(ctx, name, None) for name in ("all_gather_copy_in_stream", "all_gather_stream")]
    return streams if all(s is not None and hasattr(s, "wait_event") for s in streams) else []


def tail_range(numels: list[int], rank: int) -> tuple[int, int]:
    """The local range ``[lo, hi)`` of rank ``rank``'s elements that lie in the full tensor's tail (its last
    ``numel % 16`` elements; empty when ``lo == hi``), for a tensor whose ranks hold ``numels`` elements each, in rank
    order. See Note [A shard's rows, updated as the full tensor's].

    >>> tail_range([12, 11], 0), tail_range([12, 11], 1), tail_range([2, 1], 1), tail_range([16, 16], 1)
    ((12, 12), (4, 11), (0, 1), (16, 16))
    """
    full = sum(numels)
    start = sum(numels[:rank])
    tail = full - full % _UNIT
    return min(max(tail - start, 0), numels[rank]), numels[rank]


@dataclass
class LocalShard:
    """One parameter's local rows and where their state lives in its unit's host buffers."""

    index: int  # position in the optimizer's parameter order
    param: torch.Tensor  # the DTensor
    group: int
    numel: int  # local elements on this rank
    offset: int  # in the unit's flat buffers
    numels: list[int]  # local elements on each rank
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    master_loaded: bool = False  # the master rows came from a checkpoint (else re-derived from the weights)
    rank: int = 0

    def tail_rows(self) -> tuple[int, int]:
        """:func:`tail_range` of this shard."""
        return tail_range(self.numels, self.rank)


class _DeviceBuffer:
    """A flat fp32 tensor on the device, shaped like a :class:`~lightning_gh._host.HostBuffer` (``tensor``,
    ``release``)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.tensor = torch.zeros(numel, dtype=torch.float32, device=device)

    def release(self) -> None:
        self.tensor = self.tensor.new_empty(0)


class HostUnit:
    """One ``fully_shard``-ed module's parameters: the unit of gradient copy, norm exchange, CPU work and wait.

    Its fp32 state lives in host memory, or, with ``device`` (see :func:`device_share`), on the parameters' device:
    then it has no host gradient buffer (its gradients stay in ``param.grad`` until ``step()`` updates it there)."""

    def __init__(self, index: int, module: nn.Module, shards: list[LocalShard], pin: bool,
                 device: torch.device | None = None) -> None:
        self.index = index
        self.module = module
        self.shards = shards
        self.numel = sum(s.numel for s in shards)
        dtypes = {s.param.dtype for s in shards}
        self.grad_dtype = dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16} \
            else torch.float32
        # [master | exp_avg | exp_avg_sq], fp32, and the gradient rows in the parameters' dtype (once the update has
        # read them, the staging of the cast master rows copied back: see Note [ZeRO-3 step and the forward's wait])
        self.on_device = device is not None
        self.state: Any = None
        self.grad: Any = None
        self.place(device, pin)
        self.ready = threading.Event()  # the last step's weights are in the parameters
        self.ready.set()
        self.done = threading.Event()  # ... and its host state is final (see Note [Weights first, state after])
        self.done.set()
        self.active: list[LocalShard] = []  # shards with a gradient this step
        self.d2h_event: Any = None
        self.h2d_event: Any = None
        self.hook: Any = None  # the forward pre-hook's handle
        self.expected = 0  # gradients that complete the unit in a backward (its parameters that take one)

    def region(self, k: int) -> torch.Tensor:
        """0: master, 1: exp_avg, 2: exp_avg_sq (flat fp32 views over the unit)."""
        return self.state.tensor[k * self.numel:(k + 1) * self.numel]

    def view(self, s: LocalShard, k: int) -> torch.Tensor:
        return self.region(k)[s.offset:s.offset + s.numel]

    def place(self, device: torch.device | None, pin: bool) -> None:
        """Keep the state on ``device`` (``None``: in host memory, with a host gradient buffer), moving what it
        holds."""
        old = self.state
        if device is not None:
            self.state = _DeviceBuffer(3 * self.numel, device)
            self.grad = None
        else:
            self.state = HostBuffer(3 * self.numel, pin=pin, zero=True)
            self.grad = HostBuffer(self.numel, pin=pin, zero=True, dtype=self.grad_dtype)
        self.on_device = device is not None
        if old is not None:
            self.state.tensor.copy_(old.tensor)
            old.release()

    def release(self) -> None:
        self.state.release()
        if self.grad is not None:
            self.grad.release()


def local_rows(p: torch.Tensor) -> torch.Tensor:
    """The DTensor's local rows, as the tensor FSDP2 all-gathers from (fetched each time: FSDP2 may re-point it)."""
    return local_tensor(p)


def host_dtensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor sharded like the parameter ``like`` whose local tensor is ``local`` itself (host memory, no copy).

    ``DTensor.from_local`` would move a host tensor to the mesh's device (the GPU); FSDP2's CPU offload builds its
    host-resident DTensors with the constructor used here."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = like._spec
    meta = TensorMeta(like.shape, like.stride(), local.dtype)
    return DTensor(local.view(local_rows(like).shape), DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta),
                   requires_grad=False)


# Note [A shard's rows, updated as the full tensor's]
# torch's fused CPU AdamW is not the same function for every element of a tensor: it works in 16-float units and runs
# the last ``numel % vector width`` elements of each tensor through a scalar loop that rounds differently from its
# vector loop (see cpu_adamw). A rank holds a slice of each tensor, so its local tensors have other tails than the
# full ones, and updating them as tensors of their own would change the last bits of some rows. Each row is
# therefore updated as it would be in the full tensor: the rows of the full tensor's body by the package's kernel
# (elementwise, the vector loop's arithmetic), the rows of its tail (the last ``numel % 16``, found from the rank's
# global offset) by torch on a span that starts where the full tensor's tail starts, padded with zeros where other
# ranks hold the rows, so torch splits it into vector and scalar parts exactly as it splits the full tensor.
# Without the kernel, each shard's body goes through torch padded to whole units (every row on the vector path).


def positioned_update(rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor, s: LocalShard, lo: int,
                hi: int, hp: dict[str, float], coef: torch.Tensor | None, body: bool = False,
                found_inf: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """torch's fused AdamW on local rows ``[lo, hi)`` of shard ``s`` (``rows``, ``grad``: those rows only), placed in
    a zero-padded span as the full tensor's tail (or, ``body``, a span of whole units); returns the new
    (master, exp_avg, exp_avg_sq) rows (the old ones where ``found_inf`` is 1). See Note [A shard's rows, updated
    as the full tensor's]."""
    n = hi - lo
    if body:
        lead, length = 0, -(-n // _UNIT) * _UNIT
    else:
        full = sum(s.numels)
        tail = full - full % _UNIT
        lead, length = sum(s.numels[:s.rank]) + lo - tail, full % _UNIT
    span = [torch.zeros(length, dtype=torch.float32) for _ in range(4)]
    for t, r in zip(span, (*rows, grad)):
        t[lead:lead + n].copy_(r)
    if coef is not None:
        torch._foreach_mul_([span[3]], coef)
    torch._fused_adamw_([span[0]], [span[3]], [span[1]], [span[2]], [], [s.step + 1], lr=hp["lr"],
                        beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
                        amsgrad=False, maximize=False, found_inf=found_inf)
    return tuple(t[lead:lead + n] for t in span[:3])


@torch.no_grad()
def update_on_device(u: HostUnit, hp: list[dict[str, float]], coef: torch.Tensor | None,
                     found_inf: torch.Tensor | None) -> None:
    """Update a device-resident unit's active shards with ``torch._fused_adamw_`` on the device, from their
    ``param.grad`` times ``coef`` (the step's clip coefficient, a device tensor, or ``None``), skipped where
    ``found_inf`` (the step's skip decision, on the device) is 1, and write the new master rows into the parameters'
    local shards, cast to their dtype. No host synchronization: the decision stays on the device. The shards' step
    counts are not advanced here (the caller does once the decision is known on the host).

    On CUDA the kernel is elementwise, so each shard's rows are updated as one tensor; on the CPU its result depends
    on where a row sits in its tensor, so the rows are positioned as the full tensor's (see Note [A shard's rows,
    updated as the full tensor's])."""
    shards = [s for s in u.active if s.numel]
    if not shards:
        return
    if u.state.tensor.device.type != "cpu":
        runs: dict[tuple[int, float], list[LocalShard]] = {}
        for s in shards:
            runs.setdefault((s.group, float(s.step)), []).append(s)
        for (group, step), run in runs.items():
            h = hp[group]
            grads = [local_rows(s.param.grad).reshape(-1).float() for s in run]
            if coef is not None:
                grads = torch._foreach_mul(grads, coef)
            steps = [torch.full((), step + 1.0, dtype=torch.float32, device=grads[0].device)] * len(run)
            torch._fused_adamw_([u.view(s, 0) for s in run], grads, [u.view(s, 1) for s in run],
                                [u.view(s, 2) for s in run], [], steps, lr=h["lr"], beta1=h["beta1"],
                                beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False,
                                maximize=False, found_inf=found_inf)
    else:
        for s in shards:
            grad = local_rows(s.param.grad).reshape(-1)
            tail_lo, tail_hi = s.tail_rows()
            for lo, hi, body in ((0, tail_lo, True), (tail_lo, tail_hi, False)):
                if hi > lo:
                    rows = tuple(u.view(s, k)[lo:hi] for k in range(3))
                    out = positioned_update(rows, grad[lo:hi], s, lo, hi, hp[s.group], coef, body=body,
                                            found_inf=found_inf)
                    for d, o in zip(rows, out):
                        d.copy_(o)
    for s in shards:
        loc = local_rows(s.param)
        loc.copy_(u.view(s, 0).view(loc.shape))
