"""The pieces of SuperOffload's ZeRO-3 path (:class:`~.fsdp_optimizer.ShardedHostAdamW`) that describe FSDP2's sharding:
which parameters each ``fully_shard``-ed module manages (:func:`fsdp_units`), one parameter's local rows on this
rank (:class:`LocalShard`), one module's rows in host memory (:class:`HostUnit`), the row-exact torch AdamW of a shard's rows
(:func:`positioned_update`, see Note [A shard's rows, updated as the full tensor's]), the host-backed DTensors of
the state dict (:func:`host_dtensor`), and the checks made before the first step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gh._host import HostBuffer
from lightning_gh.superoffload.cpu_adamw import _TAIL as _UNIT  # torch's fused CPU AdamW's unit of work
from lightning_gh.superoffload.options import SuperOffloadOptions

__all__ = ["HostUnit", "LocalShard", "check_no_forward_prefetch", "fsdp_units", "host_dtensor", "local_rows", "norm_owner",
           "positioned_update", "tail_range", "unsupported_options"]


def norm_owner(index: int, ranks: int) -> int:
    """The rank that assembles parameter ``index``'s full gradient and takes its norm: round-robin.

    >>> [norm_owner(i, 2) for i in range(5)]
    [0, 1, 0, 1, 0]
    """
    return index % ranks


def unsupported_options(options: SuperOffloadOptions) -> list[str]:
    """The :class:`SuperOffloadOptions` fields set to something the ZeRO-3 path cannot honour, as ``name=value``.

    The ZeRO-3 path keeps the whole state in host memory (no GPU tail: ``gpu_fraction`` must be ``"auto"`` or
    ``0.0``) and updates each unit once its step's decision is known (no speculation: ``speculative`` must be
    ``"auto"`` or ``False``); ``bucket_size`` and ``rollback`` do not apply (the unit of work is the FSDP module).

    >>> unsupported_options(SuperOffloadOptions())
    []
    >>> unsupported_options(SuperOffloadOptions(gpu_fraction=0.5, speculative=True))
    ['gpu_fraction=0.5', 'speculative=True']
    """
    bad = []
    if options.gpu_fraction not in ("auto", 0.0):
        bad.append(f"gpu_fraction={options.gpu_fraction!r}")
    if options.speculative is True:
        bad.append("speculative=True")
    return bad


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


class HostUnit:
    """One ``fully_shard``-ed module's parameters: the unit of gradient copy, norm exchange, CPU work and wait."""

    def __init__(self, index: int, module: nn.Module, shards: list[LocalShard], pin: bool) -> None:
        self.index = index
        self.module = module
        self.shards = shards
        self.numel = sum(s.numel for s in shards)
        dtypes = {s.param.dtype for s in shards}
        self.grad_dtype = dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16} \
            else torch.float32
        # [master | exp_avg | exp_avg_sq], fp32, and the gradient rows in the parameters' dtype (once the update has
        # read them, the staging of the cast master rows copied back: see Note [ZeRO-3 step and the forward's wait])
        self.state = HostBuffer(3 * self.numel, pin=pin, zero=True)
        self.grad = HostBuffer(self.numel, pin=pin, zero=True, dtype=self.grad_dtype)
        self.ready = threading.Event()
        self.ready.set()
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

    def release(self) -> None:
        self.state.release()
        self.grad.release()


def local_rows(p: torch.Tensor) -> torch.Tensor:
    """The DTensor's local rows, as the tensor FSDP2 all-gathers from (fetched each time: FSDP2 may re-point it)."""
    with torch.no_grad():
        return p.to_local()


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
                hi: int, hp: dict[str, float], coef: torch.Tensor | None, body: bool = False) -> tuple[torch.Tensor, ...]:
    """torch's fused AdamW on local rows ``[lo, hi)`` of shard ``s`` (``rows``, ``grad``: those rows only), placed in
    a zero-padded span as the full tensor's tail (or, ``body``, a span of whole units); returns the new
    (master, exp_avg, exp_avg_sq) rows. See Note [A shard's rows, updated as the full tensor's]."""
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
                        amsgrad=False, maximize=False)
    return tuple(t[lead:lead + n] for t in span[:3])
