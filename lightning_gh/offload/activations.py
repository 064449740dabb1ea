"""Move saved activations to host memory during the forward and bring them back ahead of the backward.

The engine wraps every tensor autograd saves inside a transformer block (``saved_tensors_hooks``) and
knows which block is running from forward pre/post hooks on the blocks. For blocks the plan offloads:

* **Forward.** The tensor's whole storage is copied device->host on a dedicated stream (which first waits
  for the compute stream, so the data is complete) into a pinned buffer from a reusable pool. At the
  plan's release point the compute stream waits on the copy's event and the engine drops its reference:
  from then on the caching allocator can hand the memory to later compute-stream work, which the wait
  orders after the copy. Waiting on the GPU rather than polling on the host matters: the host runs ahead
  of the GPU, so a host-side "copy finished?" would almost never be true when the allocator is asked.
* **Backward.** The first time a block's saved tensor is used, the reloads the plan triggers there (by
  default the previous block's) are issued host->device on a second side stream, in reverse save order
  (the order backward needs them), into memory allocated on the compute stream after that stream's
  pending work (so nothing still reading it can race the copy). Each use makes the compute stream wait on
  that tensor's copy event: backward never reads an incomplete copy.
* **Skipped** (left on the device): parameters, buffers and casts or views of them (autocast's bf16
  weight copies), tensors below ``min_tensor_bytes``, tensors not on the model's device, tensor
  subclasses, blocks the plan keeps (by default the last one, whose activations backward uses first) and
  everything outside the blocks. Views and repeated saves of one storage within a block share one copy.

With ``recompute="norm-act"``, ``"selective"`` or ``"full"``, the blocks the plan does not offload
recompute what they saved in the backward instead of keeping it (:mod:`lightning_gh.offload.recompute`):
offload what the link can hide, recompute the cheap rest. Under ``"selective"``/``"full"`` those blocks run
inside a checkpoint whose own hooks shadow the engine's, so the engine sees (and keeps) only their inputs;
under ``"norm-act"`` only their norm and gate modules do. What the recomputing blocks keep is measured in
the first forward that recomputes, and the plan's forecast is redone from that measurement.

Without CUDA, ``backend="auto"`` warns once and leaves the run untouched. ``backend="host-copy"`` runs the
same hooks, plan and pool on any device, copying synchronously through a separate host buffer: it is the
test mode that lets a CPU check that gradients are bitwise unchanged.

Example::

    model = Llama(cfg).cuda()
    offload = offload_activations(model, policy="all")   # reuse it every step: its pinned pool persists
    for tokens, targets in loader:
        with offload, torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_gh.offload.activation_policy import (
    BlockProfile,
    OffloadPlan,
    StepProfile,
    plan_all,
    plan_auto,
    plan_first_k,
    plan_none,
    plan_with_recompute,
)
from lightning_gh.offload.recompute import RECOMPUTE_MODES, BlockRecompute
from lightning_gh.offload.superoffload_memory import available_host_bytes

__all__ = [
    "ActivationOffloader",
    "HostBufferPool",
    "HostMemoryError",
    "OffloadStats",
    "TimelinePoint",
    "find_blocks",
    "offload_activations",
]

log = logging.getLogger(__name__)

_MIB = 2**20
POLICIES = "'auto', 'all', or an int K >= 0 (offload the first K transformer blocks)"
BACKENDS = ("auto", "cuda", "host-copy")
_WARNED: set[str] = set()

# grad_fn types that keep a saved tensor "the same data as a parameter": autocast's cached casts and views.
_PARAM_PATH = {
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0",
    "ExpandBackward0", "AliasBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
}


_VIEWS = {"TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0", "AliasBackward0",
          "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0"}


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


class HostMemoryError(RuntimeError):
    """Pinning more host memory would exceed the share of available RAM the user allowed."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----------------------------------------------------------------------------------------- host buffers


class _HostBuffer:
    __slots__ = ("tensor", "size", "ready", "generation")

    def __init__(self, tensor: torch.Tensor, size: int, generation: int = 0) -> None:
        self.tensor = tensor  # may be larger than the request it serves: callers use the first nbytes
        self.size = size
        self.ready: Any = None  # event of the last copy that read or wrote it; the next writer waits on it
        self.generation = generation  # the pool's generation when it was allocated (see clear())


class HostBufferPool:
    """Host buffers reused across steps, with a guard on how much may be pinned.

    Steps repeat the same tensor shapes, so after the first offloaded step every request is served from
    the free buffers and nothing is pinned again (``allocations`` stops growing). Shapes that vary from
    step to step (variable-length batches) are served by the smallest free buffer that is large enough;
    when a new buffer would break the guard, free buffers are dropped, least recently returned first,
    before the pool gives up with :class:`HostMemoryError`. So the pool only fails when the buffers in use
    (not the ones it merely keeps) exceed the limit.

    Args:
        pin: page-lock the buffers (needed for asynchronous copies); ``False`` in host-copy mode.
        host_memory_fraction: never hold more than this share of the host's available memory
            (``MemAvailable`` plus what the pool already holds), checked before each new buffer.
        granularity: sizes at or above it are rounded up to a multiple of it; smaller ones to a power of two.

    Example::

        pool = HostBufferPool(pin=False)
        buf = pool.acquire(3 * 2**20)       # buf.tensor[: 3 * 2**20] is the caller's
        pool.release(buf)
        assert pool.acquire(2**20) is buf   # a smaller request reuses the free buffer
    """

    def __init__(self, pin: bool, host_memory_fraction: float = 0.5, granularity: int = 2 * _MIB) -> None:
        if not 0.0 < host_memory_fraction <= 1.0:
            raise ValueError(f"host_memory_fraction={host_memory_fraction!r} must be in (0, 1].")
        self.pin = pin
        self.host_memory_fraction = host_memory_fraction
        self.granularity = granularity
        # Free buffers by size (exact hits are the common case) and in the order they came back
        # (the oldest are dropped first); both hold the same buffers.
        self._free: dict[int, list[_HostBuffer]] = {}
        self._order: dict[int, _HostBuffer] = {}
        self._generation = 0
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0
        self.larger_reuses = 0  # requests served by a free buffer of a larger size class
        self.dropped = 0  # free buffers dropped to stay under the guard
        self.reserved_bytes = 0  # what the buffers hold, as allocated (pinned memory rounds up to 2^k)
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def size_class(self, nbytes: int) -> int:
        g = self.granularity
        return -(-nbytes // g) * g if nbytes >= g else _next_pow2(max(nbytes, 1))

    def _charge(self, size: int) -> int:
        # torch's pinned allocator rounds every block up to a power of two: count what it really takes.
        return _next_pow2(size) if self.pin else size

    def _take(self, size: int, buf: _HostBuffer | None = None) -> _HostBuffer:
        bufs = self._free[size]
        if buf is None:
            buf = bufs.pop()  # the most recently returned: likeliest still in the CPU caches
        else:
            bufs.remove(buf)
        if not bufs:
            del self._free[size]
        del self._order[id(buf)]
        return buf

    def _drop_oldest(self) -> bool:
        if not self._order:
            return False
        buf = next(iter(self._order.values()))
        self._take(buf.size, buf)
        # A pinned buffer may still be read by a reload in flight: torch's pinned allocator records the
        # copy's stream and does not reuse the block before that copy is done.
        self.reserved_bytes -= self._charge(buf.size)
        self.dropped += 1
        return True

    def acquire(self, nbytes: int) -> _HostBuffer:
        size = self.size_class(nbytes)
        with self._lock:
            if size in self._free:
                buf = self._take(size)
                self.reuses += 1
            else:
                fit = min((s for s in self._free if s > size), default=None)
                if fit is not None:
                    buf = self._take(fit)
                    self.reuses += 1
                    self.larger_reuses += 1
                else:
                    buf = self._allocate(size)
            self.in_use_bytes += buf.size
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            return buf

    def _allocate(self, size: int) -> _HostBuffer:
        charge = self._charge(size)
        while True:
            avail = available_host_bytes()
            if avail is None:
                _warn_once("meminfo", "ActivationOffload: the host's available memory is unknown; "
                                      "the host_memory_fraction guard is off.")
                break
            limit = self.host_memory_fraction * (avail + self.reserved_bytes)
            if self.reserved_bytes + charge <= limit:
                break
            if not self._drop_oldest():
                raise HostMemoryError(
                    f"ActivationOffload would hold {(self.reserved_bytes + charge) / 2**30:.2f} GiB of "
                    f"{'pinned ' if self.pin else ''}host memory ({self.in_use_bytes / 2**30:.2f} GiB in use, "
                    f"{charge / 2**30:.2f} GiB more needed), more than host_memory_fraction="
                    f"{self.host_memory_fraction} of the {(avail + self.reserved_bytes) / 2**30:.2f} GiB "
                    "available (MemAvailable in /proc/meminfo plus what it already holds). Offload fewer "
                    "blocks (policy=K or 'auto'), raise host_memory_fraction, or free host memory.")
        t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.allocations += 1
        self.reserved_bytes += charge
        return _HostBuffer(t, size, self._generation)

    def release(self, buf: _HostBuffer, ready: Any = None) -> None:
        buf.ready = ready
        with self._lock:
            self.in_use_bytes -= buf.size
            if buf.generation != self._generation:  # handed out before clear(): drop it
                self.reserved_bytes -= self._charge(buf.size)
                return
            self._free.setdefault(buf.size, []).append(buf)
            self._order[id(buf)] = buf

    def clear(self) -> None:
        """Drop the free buffers now, and the buffers in use when they are released; the pool stays usable."""
        with self._lock:
            for size, bufs in self._free.items():
                self.reserved_bytes -= len(bufs) * self._charge(size)
            self._free.clear()
            self._order.clear()
            self._generation += 1


# ------------------------------------------------------------------------------------------- transports


class _CudaTransport:
    """Asynchronous copies on two side streams, ordered against the compute stream with events."""

    name = "cuda"
    synchronous = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)

    def to_host(self, src: torch.Tensor, host: torch.Tensor, after: Any) -> Any:
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))  # src is complete
        if after is not None:
            self.d2h_stream.wait_event(after)  # the buffer's previous reload has read it
        with torch.cuda.stream(self.d2h_stream):
            host.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h_stream)
        return ev

    def release(self, event: Any) -> None:
        # Compute work enqueued after this (including whatever reuses the memory) runs after the copy.
        torch.cuda.current_stream(self.device).wait_event(event)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compute = torch.cuda.current_stream(self.device)
        # Allocated from the compute stream's pool (so freeing it after use is ordered by that stream);
        # the copy stream first waits for compute so no earlier user of this memory is still reading it.
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        self.h2d_stream.wait_stream(compute)
        with torch.cuda.stream(self.h2d_stream):
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return dev, ev

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class _HostCopyTransport:
    """Synchronous copies through a separate host buffer: the device-agnostic test path."""

    name = "host-copy"
    synchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_host(self, src: torch.Tensor, host: torch.Tensor, after: Any) -> Any:
        host.copy_(src)
        return None

    def release(self, event: Any) -> None:
        pass

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        dev.copy_(host)
        return dev, None

    def wait(self, event: Any) -> None:
        pass


class _CudaClock:
    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, a: Any, b: Any) -> float:
        b.synchronize()
        return a.elapsed_time(b)


class _HostClock:
    def mark(self) -> Any:
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return (b - a) * 1e3


# ---------------------------------------------------------------------------------- entries and handles

_KEPT, _COPYING, _OFFLOADED, _RELOADED, _DEAD = range(5)


class _Entry:
    """One storage saved in one block of one forward: resident, or on its way to and from the host."""

    __slots__ = ("engine", "fwd", "block", "nbytes", "moved", "state", "sref", "version", "tref", "src",
                 "host", "d2h", "dev", "h2d", "refs", "dirty")

    def __init__(self, engine: ActivationOffloader, fwd: _Forward, block: int, nbytes: int, moved: bool,
                 sref: StorageWeakRef, t: torch.Tensor) -> None:
        self.engine = engine
        self.fwd = fwd
        self.block = block
        self.nbytes = nbytes
        self.moved = moved
        self.state = _KEPT
        self.sref = sref
        self.version = t._version
        self.tref = weakref.ref(t) if moved else None
        self.src: torch.Tensor | None = None
        self.host: _HostBuffer | None = None
        self.d2h: Any = None
        self.dev: torch.Tensor | None = None
        self.h2d: Any = None
        self.refs = 0
        self.dirty = False

    def modified(self) -> bool:
        t = self.src if self.src is not None else (self.tref() if self.tref is not None else None)
        return self.dirty or (t is not None and t._version != self.version)


class _Handle:
    """What autograd stores instead of a tensor saved inside (or after) the blocks."""

    __slots__ = ("fwd", "block", "tensor", "entry", "dtype", "offset", "size", "stride")

    def __init__(self, fwd: _Forward, block: int, tensor: torch.Tensor | None, entry: _Entry | None) -> None:
        self.fwd = fwd
        self.block = block
        self.tensor = tensor  # kept tensors only
        self.entry = entry
        if entry is not None:
            entry.refs += 1

    def __del__(self) -> None:
        e = self.entry
        if e is not None:
            try:
                e.engine._unref(e)
            except Exception:  # never raise from a finaliser (interpreter shutdown, CUDA torn down)
                pass


class _Recast:
    """A saved view of a parameter's dtype cast, remade from the parameter when the backward needs it."""

    __slots__ = ("fwd", "block", "param", "version", "dtype", "size", "stride", "offset")

    def __init__(self, fwd: _Forward, block: int, param: torch.Tensor, t: torch.Tensor) -> None:
        self.fwd, self.block, self.param, self.version = fwd, block, param, param._version
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def make(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError(
                "a parameter was modified in place between the forward and the backward; ActivationOffload "
                "re-casts parameters for the backward (recompute_param_casts=True) and would use the new values. "
                "Pass recompute_param_casts=False if the model needs this.")
        with torch.no_grad():
            cast = self.param.detach().to(self.dtype)
        return cast.as_strided(self.size, self.stride, self.offset)


@dataclass
class OffloadStats:
    """Counters over the engine's life (``last_*``: the most recent forward)."""

    forwards: int = 0
    saved_tensors: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    deduplicated_saves: int = 0
    deduplicated_casts: int = 0
    recomputed_param_casts: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0
    on_demand_reloads: int = 0
    used_before_release: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    last_offloaded_bytes: int = 0
    last_resident_bytes: int = 0
    last_offloaded_by_block: list[int] = field(default_factory=list)
    peak_device_saved_bytes: int = 0
    recompute_forwards: int = 0  # forwards in which some blocks recomputed
    last_recompute_blocks: list[int] = field(default_factory=list)
    last_recompute_cached_bytes: int = 0  # what the selective caches of those blocks held (not via the hooks)
    # per recomputing block: what it kept (bytes through the hooks + its selective cache), latest forward
    last_recompute_kept_by_block: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TimelinePoint:
    """One event of the engine's own accounting (``record_timeline=True``).

    ``saved_bytes``: bytes of saved activations the engine accounts on the device (resident, copying or
    reloaded); ``allocated_bytes``: ``torch.cuda.memory_allocated()`` at the same moment (CUDA only).
    """

    t_ms: float
    event: str
    block: int
    saved_bytes: int
    allocated_bytes: int | None


class _Forward:
    """State of one forward pass and, later, of its backward."""

    def __init__(self, index: int, plan: OffloadPlan, profiling: bool) -> None:
        n = plan.n_blocks
        self.index = index
        self.plan = plan
        self.n = n
        self.profiling = profiling
        self.current: int | None = None
        self.started = False
        self.by_key: dict[tuple[int, int], _Entry] = {}
        self.moved: list[list[_Entry]] = [[] for _ in range(n)]
        self.used = [0] * n
        self.offloadable = [0] * n
        self.resident = [0] * n
        self.other = 0
        self.other_ptrs: set[int] = set()
        self.casts: dict[tuple[Any, ...], tuple[Any, _Entry, Any, int]] = {}
        self.pending: dict[int, list[_Entry]] = {}
        self.bwd_point = n + 1
        self.prefetched: set[int] = set()
        self.marks: dict[Any, Any] = {}


# ------------------------------------------------------------------------------------------ the blocks


def find_blocks(model: nn.Module, blocks: str | Sequence[nn.Module] | None = None) -> tuple[str, list[nn.Module]]:
    """The transformer blocks of ``model``, in forward order, and the name of their container.

    Args:
        model: the module whose forward runs the blocks.
        blocks: ``None`` finds the largest ``nn.ModuleList`` / ``nn.Sequential`` of two or more children of
            one type (``Llama.layers``); a name (``"model.layers"``) picks a container; a sequence of
            modules is used as given.
    """
    if blocks is not None and not isinstance(blocks, str):
        mods = list(blocks)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise ValueError(f"blocks={blocks!r} must be a module name or a non-empty sequence of nn.Module.")
        return "<given>", mods
    if isinstance(blocks, str):
        try:
            container = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"blocks={blocks!r} names no submodule of {type(model).__name__}: {e}") from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            raise ValueError(f"blocks={blocks!r} is a {type(container).__name__}; it must name a non-empty "
                             "nn.ModuleList or nn.Sequential of transformer blocks.")
        return blocks, list(container)
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kids = list(mod)
            if len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
                size = sum(p.numel() for p in mod.parameters())
                if best is None or size > best[0]:
                    best = (size, name, kids)
    if best is None:
        raise ValueError(f"no transformer blocks found in {type(model).__name__}: no nn.ModuleList of two or more "
                         "children of one type. Pass blocks='<name of the ModuleList>' or a list of modules.")
    return best[1], best[2]


def _compiled_owner(model: nn.Module, blocks: list[nn.Module]) -> str | None:
    """Name of a compiled module that contains a block's forward (its hooks would be traced, not run)."""
    block_ids = {id(b) for b in blocks}
    for name, m in model.named_modules():
        if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod"):
            inner = m._orig_mod
            if any(id(x) in block_ids for x in inner.modules()):
                return name or f"<the model itself, {type(model).__name__}>"
        if getattr(m, "_compiled_call_impl", None) is not None:
            if any(id(x) in block_ids for x in m.modules()):
                return name or f"<the model itself, {type(model).__name__}>"
    return None


# ------------------------------------------------------------------------------------------ the engine


class ActivationOffloader:
    """The offload engine; use it as a context manager around each forward (the backward may follow outside).

    Args:
        model: the module that runs the transformer blocks.
        policy: ``"auto"`` (measure the first steps, then offload what the link hides), ``"all"`` (every
            block but the last ``skip_last_blocks``) or an int ``K`` (the first K blocks).
        blocks: how to find the blocks (see :func:`find_blocks`).
        min_tensor_bytes: saved tensors (storages) smaller than this stay on the device.
        skip_last_blocks: blocks at the end never offloaded: backward needs them first.
        prefetch_blocks: fixed policies reload block ``i`` when block ``i + prefetch_blocks``'s backward starts.
        max_inflight_blocks: fixed policies wait for block ``i``'s copies when block ``i + max_inflight_blocks``
            starts (bounds GPU memory held by unfinished copies); ``None``: at the forward's end.
        margin: ``"auto"`` plans as if transfers took ``1 + margin`` times their measured time.
        profile_steps: ``"auto"`` measures this many forward/backward passes, after one warm-up pass.
        host_memory_fraction: never hold more than this share of the host's available memory.
        backend: ``"auto"`` (CUDA when the model is on a GPU; otherwise warn once and do nothing),
            ``"cuda"``, or ``"host-copy"`` (synchronous copies through a host buffer on any device: tests).
        bandwidth_gbps: link bandwidth for ``"auto"`` in GB/s, one number or ``(d2h, h2d)``; ``None``
            measures it (``lightning_gh.hardware.link_bandwidth()``; a memcpy in host-copy mode).
        record_timeline: keep :class:`TimelinePoint` events of the latest step in ``timeline``.
        dedupe_casts: keep one copy of repeated casts of one tensor within a block (autocast casts a norm's
            output to bf16 once per consuming matmul: q, k and v each save their own identical copy).
        recompute_param_casts: do not keep autocast's low-precision copies of the weights for the backward;
            cast the parameter again when the backward needs it (bitwise the same; a parameter changed in
            place between forward and backward is an error). Frees about 2 bytes per parameter during the
            backward for one extra read of the weights.
        recompute: ``None`` (default), ``"norm-act"``, ``"selective"`` or ``"full"``: the blocks the plan does
            not offload recompute part of their saved activations in the backward. ``"norm-act"`` checkpoints
            only their normalisation and gated-activation modules (no dispatch mode; see
            :func:`lightning_gh.offload.recompute.is_norm_act_module`); ``"selective"`` keeps the outputs of
            matmuls and attention and recomputes the memory-bound rest (norms, rotary, SiLU, products, casts)
            through a dispatch mode; ``"full"`` keeps only the block inputs. ``"auto"`` measures the blocks
            without it, plans the offload, recomputes the blocks it does not offload (the log lists both),
            and forecasts the saving again from the first recomputing forward's measurement.
        on_plan: called with each plan the engine adopts (default: log it at INFO).
    """

    def __init__(
        self,
        model: nn.Module,
        policy: str | int = "auto",
        *,
        blocks: str | Sequence[nn.Module] | None = None,
        min_tensor_bytes: int = _MIB,
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
        on_plan: Callable[[OffloadPlan], None] | None = None,
    ) -> None:
        validate_options(policy=policy, min_tensor_bytes=min_tensor_bytes, skip_last_blocks=skip_last_blocks,
                         prefetch_blocks=prefetch_blocks, max_inflight_blocks=max_inflight_blocks, margin=margin,
                         profile_steps=profile_steps, host_memory_fraction=host_memory_fraction, backend=backend,
                         bandwidth_gbps=bandwidth_gbps, recompute=recompute)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
        self.model = model
        self.policy = policy
        self._blocks_arg = blocks
        self.min_tensor_bytes = min_tensor_bytes
        self.skip_last_blocks = skip_last_blocks
        self.prefetch_blocks = prefetch_blocks
        self.max_inflight_blocks = max_inflight_blocks
        self.margin = margin
        self.profile_steps = profile_steps
        self.host_memory_fraction = host_memory_fraction
        self.backend = backend
        self.bandwidth_gbps = bandwidth_gbps
        self.record_timeline = record_timeline
        self.dedupe_casts = bool(dedupe_casts)
        self.recompute_param_casts = bool(recompute_param_casts)
        self.recompute = recompute
        self._rc: BlockRecompute | None = None
        self._rc_forecast_done = False
        self.on_plan = on_plan or (lambda plan: log.info("ActivationOffload %s", plan.describe()))

        self.stats = OffloadStats()
        self.plan: OffloadPlan | None = None
        self.profile: StepProfile | None = None
        self.timeline: list[TimelinePoint] = []
        self.blocks_name: str | None = None
        self.blocks: list[nn.Module] = []
        self._resolved = False
        self._enabled = False
        self._transport: _CudaTransport | _HostCopyTransport | None = None
        self._clock: _CudaClock | _HostClock | None = None
        self._pool: HostBufferPool | None = None
        self._device: torch.device | None = None
        self._fwd: _Forward | None = None
        self._hooks_ctx: Any = None
        self._module_hooks: list[Any] = []
        self._param_ptrs: set[int] = set()
        self._lock = threading.RLock()
        self._forwards = 0
        self._profiles: list[_Forward] = []
        self._profiled: list[StepProfile] = []
        self._saved_bytes = 0
        self._t0 = time.perf_counter()
        self._last_fixed_report = -1

    # ------------------------------------------------------------------------------- public surface

    @property
    def enabled(self) -> bool:
        """Whether the engine moves anything on this machine (``False``: the warned no-op without CUDA)."""
        self._resolve()
        return self._enabled

    @property
    def pool(self) -> HostBufferPool | None:
        return self._pool

    @property
    def transport(self) -> str | None:
        return self._transport.name if self._transport else None

    def set_plan(self, plan: OffloadPlan) -> None:
        """Adopt ``plan`` from the next forward on (e.g. restored from a checkpoint)."""
        self._resolve()
        if plan.n_blocks != len(self.blocks):
            raise ValueError(f"plan has {plan.n_blocks} blocks, the model {len(self.blocks)}.")
        if plan.recompute_mode != self.recompute or \
                (self.recompute and set(plan.recompute) != set(range(plan.n_blocks)) - set(plan.offloaded_blocks)):
            plan = plan_with_recompute(plan, self.recompute)
        self.plan = plan
        self.on_plan(plan)

    def __enter__(self) -> ActivationOffloader:
        self.begin_forward()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.end_forward()
        return False

    def begin_forward(self) -> None:
        """Start offloading the forward that follows (same thread until :meth:`end_forward`)."""
        if self._fwd is not None or self._hooks_ctx is not None:
            raise RuntimeError("ActivationOffloader.begin_forward() called again before end_forward(): "
                               "the engine's context does not nest.")
        self._resolve()
        if not self._enabled or not torch.is_grad_enabled():
            return  # no grad (validation, inference): nothing is saved, nothing to do
        owner = _compiled_owner(self.model, self.blocks)
        if owner is not None:
            raise RuntimeError(
                f"ActivationOffload cannot see block boundaries inside the torch.compile'd module '{owner}': "
                "its forward hooks would be traced, not run. Compile each block instead "
                f"(`for i, b in enumerate(<{self.blocks_name}>): <{self.blocks_name}>[i] = torch.compile(b)`), "
                "or turn compilation off for this model.")
        if self._transport is not None and self._transport.name == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("ActivationOffload cannot run inside a CUDA graph capture (e.g. CUDAGraphCapture): "
                               "its copies are ordered by host-side hooks that a replay would skip. "
                               "Use one or the other.")
        self._harvest_profiles()
        profiling = self.policy == "auto" and self.plan is None
        plan = plan_none(len(self.blocks), "profiling") if profiling else self.plan
        assert plan is not None
        fwd = _Forward(self._forwards, plan, profiling)
        self._forwards += 1
        self.stats.forwards += 1
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._param_ptrs |= {b.untyped_storage().data_ptr() for b in self.model.buffers()}
        if self.record_timeline:
            self.timeline = []
            self._t0 = time.perf_counter()
        self._fwd = fwd
        for i, blk in enumerate(self.blocks):
            self._module_hooks.append(blk.register_forward_pre_hook(self._make_pre(i)))
            self._module_hooks.append(blk.register_forward_hook(self._make_post(i), always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        if self._rc is not None and plan.recompute:
            self._rc.reset_counts()
            try:
                self._rc.apply(plan.recompute)
            except BaseException:
                self.end_forward()
                raise

    def end_forward(self) -> None:
        """Stop packing; wait (on the device) for every copy still in flight and release its memory."""
        ctx, fwd = self._hooks_ctx, self._fwd
        self._hooks_ctx, self._fwd = None, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        applied: tuple[int, ...] = ()
        if self._rc is not None:
            applied = self._rc.applied
            self._rc.remove()  # the backward recomputes through closures of its own, not through these
        if fwd is None:
            return
        if applied:
            self.stats.recompute_forwards += 1
            self.stats.last_recompute_blocks = list(applied)
            self.stats.last_recompute_cached_bytes = sum(self._rc.cached_bytes[i] or 0 for i in applied)
            self.stats.last_recompute_kept_by_block = {
                i: fwd.resident[i] + fwd.used[i] + (self._rc.cached_bytes[i] or 0) for i in applied}
        with self._lock:
            for point in sorted(fwd.pending):
                self._release_point(fwd, point)
            fwd.current = None
            if fwd.profiling:
                fwd.marks["fwd_end"] = self._clock.mark()
                self._profiles.append(fwd)
            self.stats.last_offloaded_bytes = sum(fwd.used)
            self.stats.last_offloaded_by_block = list(fwd.used)
            self.stats.last_resident_bytes = sum(fwd.resident)
            self._event("forward-end", fwd.n)
        if applied:
            self._forecast_recompute(fwd.plan)
        if not fwd.profiling and self.policy != "auto" and self._last_fixed_report < 0:
            self._last_fixed_report = fwd.index
            log.info("ActivationOffload: first offloaded forward moved %.2f GiB (%d blocks), %.2f GiB of saved "
                     "activations stayed in blocks%s", sum(fwd.used) / 2**30, len(fwd.plan.offloaded_blocks),
                     sum(fwd.resident) / 2**30,
                     f"; {len(applied)} blocks recomputed ({self.recompute}), their selective caches held "
                     f"{self.stats.last_recompute_cached_bytes / 2**30:.2f} GiB" if applied else "")

    def end_backward(self) -> None:
        """Optional: mark the backward's end (lets ``"auto"`` measure block 0's backward exactly)."""
        for fwd in self._profiles:
            if "bwd_end" not in fwd.marks and fwd.bwd_point <= fwd.n:
                fwd.marks["bwd_end"] = self._clock.mark()

    def _forecast_recompute(self, plan: OffloadPlan) -> None:
        """Redo the plan's forecast once, from what the recomputing blocks kept in this (their first) forward.

        Measured, not predicted from the graph: the first forward that recomputes counts, per block, the
        bytes that reached the engine (inputs of the checkpoints, and for ``"norm-act"`` everything the block
        saves outside its norm and gate modules) plus what the selective caches hold. Needs the profile the
        plan was made from (``"auto"``); a fixed or restored plan states no forecast.
        """
        if self._rc_forecast_done or self.profile is None or plan is not self.plan \
                or plan.prediction is None or not plan.recompute:
            return
        kept = self.stats.last_recompute_kept_by_block
        if set(kept) != set(plan.recompute):
            return
        from dataclasses import replace

        blocks = tuple(replace(b, recompute_kept_bytes=kept[i]) if i in kept else b
                       for i, b in enumerate(self.profile.blocks))
        self.profile = replace(self.profile, blocks=blocks)
        self._rc_forecast_done = True
        d2h, h2d = self._link_gbps()
        self.plan = plan_with_recompute(plan, self.recompute, self.profile, d2h, h2d, self.margin)
        self.on_plan(self.plan)

    def close(self) -> None:
        """Remove hooks and drop the free host buffers."""
        self.end_forward()
        if self._pool is not None:
            self._pool.clear()

    # ---------------------------------------------------------------------------------- set-up

    def _resolve(self) -> None:
        if self._resolved:
            return
        self.blocks_name, self.blocks = find_blocks(self.model, self._blocks_arg)
        param = next(self.model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if self.backend == "host-copy":
            self._device = device
            self._transport = _HostCopyTransport(device)
            self._clock = _HostClock() if device.type != "cuda" else _CudaClock()
            self._pool = HostBufferPool(pin=False, host_memory_fraction=self.host_memory_fraction)
            self._enabled = True
        elif device.type == "cuda" and torch.cuda.is_available():
            self._device = device
            self._transport = _CudaTransport(device)
            self._clock = _CudaClock()
            self._pool = HostBufferPool(pin=True, host_memory_fraction=self.host_memory_fraction)
            self._enabled = True
        elif self.backend == "cuda":
            raise RuntimeError(f"ActivationOffload backend='cuda' needs the model on a CUDA device; its parameters "
                               f"are on {device}.")
        else:
            warnings.warn(f"ActivationOffload: the model is on {device}, not a CUDA GPU; activations stay where "
                          "they are (the run equals a run without it).", stacklevel=3)
            self._enabled = False
        self._resolved = True
        n = len(self.blocks)
        if self._enabled and self.recompute is not None:
            self._rc = BlockRecompute(self.blocks, self.recompute)
            self._rc.check()  # already checkpointed, compiled or TE blocks: a clear error now, not mid-step
        if self._enabled and self.policy != "auto" and self.plan is None:
            if self.policy == "all":
                plan = plan_all(n, self.skip_last_blocks, self.max_inflight_blocks, self.prefetch_blocks)
            else:
                plan = plan_first_k(n, int(self.policy), self.skip_last_blocks, self.max_inflight_blocks,
                                    self.prefetch_blocks)
            self.plan = plan_with_recompute(plan, self.recompute)
            self.on_plan(self.plan)

    def _link_gbps(self) -> tuple[float, float]:
        bw = self.bandwidth_gbps
        if isinstance(bw, (int, float)):
            return float(bw), float(bw)
        if bw is not None:
            return float(bw[0]), float(bw[1])
        if self._transport is not None and self._transport.name == "cuda":
            from lightning_gh import hardware

            link = hardware.link_bandwidth()
            if link is not None:
                return link.d2h_gbps, link.h2d_gbps
        g = _host_copy_gbps()
        return g, g

    # ---------------------------------------------------------------------------------- hooks

    def _make_pre(self, index: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            fwd = self._fwd
            if fwd is None:
                return
            if torch.compiler.is_compiling():
                raise RuntimeError("ActivationOffload's block hooks are being traced by torch.compile; compile "
                                   "each block rather than the module that runs them.")
            with self._lock:
                fwd.started = True
                if index:
                    self._release_point(fwd, index)
                fwd.current = index
                if fwd.profiling:
                    fwd.marks[("fs", index)] = self._clock.mark()
                self._event("block-start", index)

        return pre

    def _make_post(self, index: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            fwd = self._fwd
            if fwd is None:
                return
            with self._lock:
                fwd.current = None
                if fwd.profiling:
                    fwd.marks[("fe", index)] = self._clock.mark()
                if index == fwd.n - 1:
                    self._release_point(fwd, fwd.n)
                self._event("block-end", index)

        return post

    def _skip_reason(self, t: torch.Tensor, ptr: int, nbytes: int) -> str | None:
        if type(t) is not torch.Tensor:
            return "parameter" if isinstance(t, nn.Parameter) else "subclass"
        if t.device != self._device:
            return "other-device"
        if t.layout != torch.strided or t.is_conj() or t.is_neg():
            return "layout"
        if ptr in self._param_ptrs:
            return "parameter"
        if nbytes < self.min_tensor_bytes:
            return "small"
        fn, hops = t.grad_fn, 0
        while fn is not None and hops < 6:
            name = type(fn).__name__
            if name == "AccumulateGrad":
                # A cast or view of a parameter (autocast's cached bf16 weights); other leaves are data.
                leaf = getattr(fn, "variable", None)
                if leaf is not None and leaf.untyped_storage().data_ptr() in self._param_ptrs:
                    return "parameter"
                break
            if name not in _PARAM_PATH:
                break
            nxt = [f for f, _ in fn.next_functions if f is not None]
            if len(nxt) != 1:
                break
            fn, hops = nxt[0], hops + 1
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        fwd = self._fwd
        if fwd is None:
            return t
        with self._lock:
            self.stats.saved_tensors += 1
            block = fwd.current
            if self.recompute_param_casts and t.grad_fn is not None:
                param = self._param_of_cast(t)
                if param is not None:
                    self.stats.recomputed_param_casts += 1
                    return _Recast(fwd, block if block is not None else (fwd.n if fwd.started else -1), param, t)
            if block is None:
                # Outside the blocks: stays; the handle still tells the backward where it is.
                try:
                    st = t.untyped_storage()
                    if st.data_ptr() not in fwd.other_ptrs:
                        fwd.other_ptrs.add(st.data_ptr())
                        fwd.other += st.nbytes()
                except (RuntimeError, NotImplementedError):
                    pass
                return _Handle(fwd, fwd.n if fwd.started else -1, t, None)
            try:
                st = t.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # no storage (e.g. some subclasses)
                self._count_skip("no-storage")
                return _Handle(fwd, block, t, None)
            e = fwd.by_key.get((block, ptr))
            if e is not None and e.state != _DEAD and not e.sref.expired() and e.nbytes == nbytes \
                    and (not e.moved or t._version == e.version):
                self.stats.deduplicated_saves += 1
                return self._handle(fwd, block, t, e)
            ck = self._cast_key(t, block) if self.dedupe_casts else None
            if ck is not None:
                hit = fwd.casts.get(ck[0])
                if hit is not None:
                    h = self._cast_hit(fwd, block, t, hit)
                    if h is not None:
                        return h
            reason = self._skip_reason(t, ptr, nbytes)
            budget = fwd.plan.budgets[block]
            moved = reason is None and (budget is None or fwd.used[block] + nbytes <= budget)
            e = _Entry(self, fwd, block, nbytes, moved, StorageWeakRef(st), t)
            fwd.by_key[(block, ptr)] = e
            if reason is None:
                fwd.offloadable[block] += nbytes
            else:
                self._count_skip(reason)
            if moved:
                self._start_copy(fwd, e, t, st)
            else:
                fwd.resident[block] += nbytes
                self._saved_bytes += nbytes
                self._event("keep", block)
            if ck is not None and reason is None:
                fwd.casts[ck[0]] = (ck[1], e, weakref.ref(t), t._version)
            return self._handle(fwd, block, t, e)

    @staticmethod
    def _cast_key(t: torch.Tensor, block: int) -> tuple[tuple[Any, ...], Any] | None:
        """Identity of "this view of a dtype cast of that autograd output": equal keys hold equal bytes.

        ``t``'s grad_fn chain must be views, then one ``ToCopyBackward0`` whose input is named by its
        node and output number. An in-place change of the source would give it a new node, so equal keys
        imply the same source values; the key also pins the view (shape, stride, offset) and the storage
        size. The node is kept alive with the key, so its id cannot be reused meanwhile.
        """
        fn, hops = t.grad_fn, 0
        while fn is not None and hops < 4 and type(fn).__name__ != "ToCopyBackward0":
            if type(fn).__name__ not in _VIEWS:
                return None
            nxt = fn.next_functions
            if len(nxt) != 1:
                return None
            fn, hops = nxt[0][0], hops + 1
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return None
        nxt = fn.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        node, nr = nxt[0]
        key = (block, id(node), nr, hops, t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset(),
               t.untyped_storage().nbytes())
        return key, node

    def _cast_hit(self, fwd: _Forward, block: int, t: torch.Tensor,
                  hit: tuple[Any, _Entry, Any, int]) -> _Handle | None:
        _node, e, tref, version = hit
        first = tref()
        if e.state == _DEAD or (first is not None and first._version != version) or t._version != 0:
            return None
        if e.moved:
            self.stats.deduplicated_casts += 1
            return self._handle(fwd, block, t, e)
        if first is None:
            return None
        self.stats.deduplicated_casts += 1
        return _Handle(fwd, block, first, e)

    def _param_of_cast(self, t: torch.Tensor) -> torch.Tensor | None:
        """The parameter ``t`` is a view of a dtype cast of (autocast's cached weight copies), if it is one.

        The cast must be a plain contiguous copy of the parameter, so that re-casting it and applying
        ``t``'s (size, stride, offset) gives back exactly ``t``.
        """
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return None
        fn, hops = t.grad_fn, 0
        while fn is not None and hops < 4 and type(fn).__name__ in _VIEWS:
            nxt = fn.next_functions
            if len(nxt) != 1:
                return None
            fn, hops = nxt[0][0], hops + 1
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
            return None
        acc = fn.next_functions[0][0]
        if acc is None or type(acc).__name__ != "AccumulateGrad":
            return None
        param = getattr(acc, "variable", None)
        if param is None or param.untyped_storage().data_ptr() not in self._param_ptrs:
            return None
        if not param.is_contiguous() or param.dtype == t.dtype or t.device != param.device:
            return None
        if t.untyped_storage().nbytes() != param.numel() * t.element_size():
            return None
        return param

    def _handle(self, fwd: _Forward, block: int, t: torch.Tensor, e: _Entry) -> _Handle:
        if not e.moved:
            return _Handle(fwd, block, t, e)
        h = _Handle(fwd, block, None, e)
        h.dtype, h.offset, h.size, h.stride = t.dtype, t.storage_offset(), t.size(), t.stride()
        return h

    def _count_skip(self, reason: str) -> None:
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1

    def _start_copy(self, fwd: _Forward, e: _Entry, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        host = self._pool.acquire(e.nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        e.d2h = self._transport.to_host(src, host.tensor[: e.nbytes], host.ready)
        host.ready = None
        # Hold ``t`` itself (not just its storage) until the release point: its version counter then
        # tells whether the forward changed it in place after it was saved (end_forward always releases,
        # which also breaks the cycle t -> grad_fn -> saved handle -> entry -> t).
        e.host, e.src, e.state = host, t, _COPYING
        fwd.used[e.block] += e.nbytes
        fwd.moved[e.block].append(e)
        fwd.pending.setdefault(fwd.plan.release_at[e.block], []).append(e)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += e.nbytes
        self._saved_bytes += e.nbytes
        self._event("offload", e.block)

    def _release_point(self, fwd: _Forward, point: int) -> None:
        entries = fwd.pending.pop(point, ())
        for e in entries:
            if e.state != _COPYING:
                continue
            if e.modified():
                e.dirty = True
            self._transport.release(e.d2h)
            e.src, e.state = None, _OFFLOADED
            self._saved_bytes -= e.nbytes
        if entries:
            self._event("release", point)

    def _unpack(self, h: Any) -> torch.Tensor:
        if isinstance(h, _Recast):
            with self._lock:
                if h.block >= -1 and h.fwd.bwd_point > max(h.block, 0):
                    self._backward_point(h.fwd, max(h.block, 0))
            return h.make()
        if not isinstance(h, _Handle):
            return h
        with self._lock:
            fwd = h.fwd
            if h.block >= -1 and fwd.bwd_point > max(h.block, 0):
                self._backward_point(fwd, max(h.block, 0))
            e = h.entry
            if e is None or not e.moved:
                return h.tensor
            if e.modified():
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation after ActivationOffload saved it (block {e.block}): its saved copy is stale.")
            if e.state == _COPYING:
                # Backward began before the copy's release point: the original is still on the device.
                self.stats.used_before_release += 1
                data = e.src
            else:
                if e.state == _OFFLOADED:
                    self.stats.on_demand_reloads += 1
                    self._reload(e)
                self._transport.wait(e.h2d)
                data = e.dev
            return torch.empty(0, dtype=h.dtype, device=data.device).set_(
                data.untyped_storage(), h.offset, h.size, h.stride)

    def _backward_point(self, fwd: _Forward, target: int) -> None:
        while fwd.bwd_point > target:
            fwd.bwd_point -= 1
            p = fwd.bwd_point
            if fwd.profiling:
                fwd.marks[("b", p)] = self._clock.mark()
            plan = fwd.plan
            # Blocks whose reload the plan issues here, needed soonest first; and, in case a plan left it
            # late, the block whose backward starts now.
            todo = [i for i in range(min(p, fwd.n) - 1, -1, -1) if plan.prefetch_at[i] == p]
            if p < fwd.n and p not in fwd.prefetched:
                todo.insert(0, p)
            self._event("backward-point", p)
            for i in todo:
                if i in fwd.prefetched:
                    continue
                fwd.prefetched.add(i)
                for e in reversed(fwd.moved[i]):
                    if e.state == _OFFLOADED and e.refs > 0:
                        self._reload(e)

    def _reload(self, e: _Entry) -> None:
        host = e.host
        e.dev, e.h2d = self._transport.to_device(host.tensor[: e.nbytes])
        self._pool.release(host, e.h2d)
        e.host, e.state = None, _RELOADED
        self.stats.reloaded_tensors += 1
        self.stats.reloaded_bytes += e.nbytes
        self._saved_bytes += e.nbytes
        self._event("reload", e.block)

    def _unref(self, e: _Entry) -> None:
        with self._lock:
            e.refs -= 1
            if e.refs == 0:
                self._drop(e)

    def _drop(self, e: _Entry) -> None:
        """The last handle of ``e`` is gone: give its memory back."""
        with self._lock:
            st = e.state
            if st == _KEPT:
                self._saved_bytes -= e.nbytes
            elif st == _COPYING:
                self._transport.release(e.d2h)
                self._pool.release(e.host, e.d2h)
                self._saved_bytes -= e.nbytes
            elif st == _OFFLOADED:
                self._pool.release(e.host, e.d2h)
            elif st == _RELOADED:
                self._transport.wait(e.h2d)  # the allocator may reuse dev at once: order it after the copy
                self._saved_bytes -= e.nbytes
            e.state, e.src, e.host, e.dev = _DEAD, None, None, None
            self._event("free", e.block)

    def _event(self, name: str, block: int) -> None:
        self.stats.peak_device_saved_bytes = max(self.stats.peak_device_saved_bytes, self._saved_bytes)
        if self.record_timeline:
            alloc = torch.cuda.memory_allocated(self._device) if self._device is not None and \
                self._device.type == "cuda" else None
            self.timeline.append(TimelinePoint((time.perf_counter() - self._t0) * 1e3, name, block,
                                               self._saved_bytes, alloc))

    # -------------------------------------------------------------------------------- "auto"

    def _harvest_profiles(self) -> None:
        if self.policy != "auto" or self.plan is not None or not self._profiles:
            return
        done = [f for f in self._profiles if f.bwd_point <= 0 or "bwd_end" in f.marks]
        for fwd in done:
            self._profiles.remove(fwd)
            if fwd.index == 0:
                continue  # warm-up: allocator growth, kernel selection, lazy initialisation
            prof = self._measure(fwd)
            if prof is not None:
                self._profiled.append(prof)
        if len(self._profiled) >= self.profile_steps:
            self.profile = _median_profile(self._profiled)
            d2h, h2d = self._link_gbps()
            plan = plan_auto(self.profile, d2h, h2d, self.margin, self.skip_last_blocks)
            self.plan = plan_with_recompute(plan, self.recompute, self.profile, d2h, h2d, self.margin)
            self.on_plan(self.plan)

    def _measure(self, fwd: _Forward) -> StepProfile | None:
        m, n, ms = fwd.marks, fwd.n, self._clock.ms
        need = [("fs", i) for i in range(n)] + [("fe", i) for i in range(n)] + ["fwd_end"] + \
               [("b", i) for i in range(n)]
        if any(k not in m for k in need):
            return None
        blocks = []
        for i in range(n):
            f = ms(m[("fs", i)], m[("fe", i)])
            if i > 0:
                b = ms(m[("b", i)], m[("b", i - 1)])
            else:
                b = ms(m[("b", 0)], m["bwd_end"]) if "bwd_end" in m else 2.0 * f
            # fwd.resident also counts offloadable bytes that stayed (all of them while profiling); the profile's
            # resident bytes are the others, so that offloadable + resident is what the block saved.
            resident = max(fwd.resident[i] - (fwd.offloadable[i] - fwd.used[i]), 0)
            blocks.append(BlockProfile(max(f, 0.0), max(b, 0.0), fwd.offloadable[i], resident))
        bstart = m.get(("b", n), m["fwd_end"])
        return StepProfile(tuple(blocks), max(ms(m[("fe", n - 1)], m["fwd_end"]), 0.0),
                           max(ms(bstart, m[("b", n - 1)]), 0.0), fwd.other)


def _median_profile(profiles: list[StepProfile]) -> StepProfile:
    n = profiles[0].n_blocks
    med = statistics.median
    blocks = tuple(
        BlockProfile(med(p.blocks[i].forward_ms for p in profiles), med(p.blocks[i].backward_ms for p in profiles),
                     int(med(p.blocks[i].offloadable_bytes for p in profiles)),
                     int(med(p.blocks[i].resident_bytes for p in profiles)),
                     None if any(p.blocks[i].recompute_kept_bytes is None for p in profiles)
                     else int(med(p.blocks[i].recompute_kept_bytes for p in profiles)))
        for i in range(n))
    return StepProfile(blocks, med(p.tail_forward_ms for p in profiles), med(p.tail_backward_ms for p in profiles),
                       int(med(p.other_bytes for p in profiles)))


_HOST_GBPS: float | None = None


def _host_copy_gbps(nbytes: int = 64 * _MIB) -> float:
    """memcpy bandwidth of this host (the link in host-copy mode), measured once."""
    global _HOST_GBPS
    if _HOST_GBPS is None:
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        b.copy_(a)
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            b.copy_(a)
            samples.append(time.perf_counter() - t0)
        _HOST_GBPS = nbytes / statistics.median(samples) / 1e9
    return _HOST_GBPS


def validate_options(*, policy: Any, min_tensor_bytes: Any, skip_last_blocks: Any, prefetch_blocks: Any,
                     max_inflight_blocks: Any, margin: Any, profile_steps: Any, host_memory_fraction: Any,
                     backend: Any, bandwidth_gbps: Any, recompute: Any = None) -> None:
    """Check the engine's (and the callback's) arguments; errors name the argument, value and what is allowed."""
    if isinstance(policy, bool) or not (policy in ("auto", "all") or (isinstance(policy, int) and policy >= 0)):
        raise ValueError(f"policy={policy!r} is not valid; use {POLICIES}.")
    for name, v, lo in (("min_tensor_bytes", min_tensor_bytes, 0), ("skip_last_blocks", skip_last_blocks, 0),
                        ("prefetch_blocks", prefetch_blocks, 1), ("profile_steps", profile_steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r} must be an int >= {lo}.")
    if max_inflight_blocks is not None and (isinstance(max_inflight_blocks, bool) or
                                            not isinstance(max_inflight_blocks, int) or max_inflight_blocks < 1):
        raise ValueError(f"max_inflight_blocks={max_inflight_blocks!r} must be an int >= 1 or None.")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ValueError(f"margin={margin!r} must be a number >= 0 (0.25: transfers planned 25% slower than measured).")
    if isinstance(host_memory_fraction, bool) or not isinstance(host_memory_fraction, (int, float)) \
            or not 0 < host_memory_fraction <= 1:
        raise ValueError(f"host_memory_fraction={host_memory_fraction!r} must be in (0, 1].")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not valid; use one of {BACKENDS}.")
    if recompute is not None and (not isinstance(recompute, str) or recompute not in RECOMPUTE_MODES):
        raise ValueError(f"recompute={recompute!r} is not valid; use None (keep what the blocks save), 'norm-act' "
                         "(recompute the norm and gated-activation modules), 'selective' (recompute all but matmul "
                         "and attention outputs) or 'full' (keep only the block inputs).")
    if bandwidth_gbps is not None:
        vals = bandwidth_gbps if isinstance(bandwidth_gbps, (tuple, list)) else (bandwidth_gbps,)
        if len(vals) not in (1, 2) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                                for v in vals):
            raise ValueError(f"bandwidth_gbps={bandwidth_gbps!r} must be a positive number or a (d2h, h2d) "
                             "pair of them.")


def offload_activations(model: nn.Module, policy: str | int = "auto", **kwargs: Any) -> ActivationOffloader:
    """An :class:`ActivationOffloader` for plain PyTorch: ``with`` it around each forward.

    Create it once and reuse it every step (its pinned buffer pool and the ``"auto"`` measurements live
    in it); the backward may run outside the ``with``. Arguments as :class:`ActivationOffloader`.

    Example::

        offload = offload_activations(model, policy=2)
        with offload:
            loss = model(x).square().mean()
        loss.backward()
    """
    return ActivationOffloader(model, policy, **kwargs)
