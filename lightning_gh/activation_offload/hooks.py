"""The saved-tensor hooks: what happens to each tensor autograd saves inside a block, and when it comes back.

:class:`SavedTensorHooks` is the engine's half that runs inside autograd. Forward pre/post hooks on the
blocks tell it which block is running; ``pack`` decides per saved storage whether it stays (parameters and
casts or views of them, small tensors, other devices, subclasses, blocks the plan keeps, everything outside
the blocks) or starts its device->host copy, and returns a handle (a kept block of a forward that measures
nothing gets ``(tensor, version, block)`` tuples: Note [A kept block's saved tensors go untracked]); the plan's
release points let the compute stream reuse the memory once the copy is done; ``unpack`` issues the reloads the
plan places at each backward point, waits for the one it needs and rebuilds the view. Views and repeated saves of
one storage in one block share one copy; repeated casts of one tensor share one entry (``dedupe_casts``);
autocast's weight casts are re-made from the parameter (``recompute_param_casts``).

The engine (:class:`~lightning_gh.activation_offload.engine.ActivationOffloader`) sets the state these methods
use: ``_fwd`` (the :class:`Forward` being packed), ``_lock``, ``_transport``, ``_clock``, ``_pool``,
``_device``, ``_param_ptrs``, ``_saved_bytes``, ``_t0``, ``stats``, ``timeline`` and ``options`` (of which these
read ``min_tensor_bytes``, ``dedupe_casts``, ``recompute_param_casts`` and ``record_timeline``).

Example::

    hooks = torch.autograd.graph.saved_tensors_hooks(engine._pack, engine._unpack)
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_gh._host import HostMemoryError
from lightning_gh._util import warn_once
from lightning_gh.activation_offload.policy import OffloadPlan
from lightning_gh.activation_offload.pool import HostBufferPool, _HostBuffer
from lightning_gh.activation_offload.stats import OffloadStats, TimelinePoint
from lightning_gh.activation_offload.transport import Clock, Transport

if TYPE_CHECKING:
    from lightning_gh.activation_offload.controller import Measure
    from lightning_gh.activation_offload.options import ActivationOffloadOptions

__all__ = ["Forward", "SavedTensorHooks"]

# grad_fn types that keep a saved tensor "the same data as a parameter": autocast's cached casts and views.
_PARAM_PATH = {
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0",
    "ExpandBackward0", "AliasBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
}


_VIEWS = {"TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0", "AliasBackward0",
          "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0"}

_KEPT, _COPYING, _OFFLOADED, _RELOADED, _DEAD = range(5)


def _is_param(leaf: torch.Tensor, param_ptrs: set[int]) -> bool:
    """Whether an autograd leaf is a model parameter: an ``nn.Parameter`` (FSDP2's gathered weights are
    parameters made during the forward, see Note [FSDP2's gathered weights are parameters]) or a tensor whose
    storage a parameter had when the forward began."""
    return isinstance(leaf, nn.Parameter) or leaf.untyped_storage().data_ptr() in param_ptrs


class _Entry:
    """One storage saved in one block of one forward: resident, or on its way to and from the host."""

    # No reference to its Forward (which holds it): no cycle, so a forward is freed with its graph, not by the
    # garbage collector some steps later.
    __slots__ = ("engine", "block", "nbytes", "moved", "state", "sref", "version", "tref", "src",
                 "host", "d2h", "dev", "h2d", "refs", "dirty")

    def __init__(self, engine: SavedTensorHooks, block: int, nbytes: int, moved: bool,
                 sref: StorageWeakRef, t: torch.Tensor) -> None:
        self.engine = engine
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


def _held(t: torch.Tensor) -> torch.Tensor:
    """What a handle keeps of a tensor it keeps on the device. See Note [A kept saved tensor is held detached]."""
    try:
        return t.detach()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without detach: the tensor itself
        return t


def _version(t: torch.Tensor | None) -> int | None:
    """``t``'s version counter, or ``None`` (no tensor, or a subclass without one)."""
    try:
        return t._version if t is not None else None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


# Note [A kept saved tensor keeps its version check]
# With saved-tensor hooks installed autograd does not compare a saved tensor's version counter with the one it had
# when saved: the hooks decide what comes back. An offloaded entry checks its own (``_Entry.modified``); a tensor
# kept on the device is checked at unpack against the version it had when its handle (or, in an untracked block,
# its ``(tensor, version, block)`` tuple) was made, so an in-place change between forward and backward raises as it
# would without the engine, instead of feeding the backward the changed values.
def _check_version(t: torch.Tensor, version: int | None, block: int) -> None:
    if version is not None and _version(t) != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation after "
            f"it was saved (ActivationOffload, block {block}: saved at version {version}, now {_version(t)}).")


class _Handle:
    """What autograd stores instead of a tensor saved inside (or after) the blocks."""

    __slots__ = ("fwd", "block", "tensor", "version", "entry", "dtype", "offset", "size", "stride")

    def __init__(self, fwd: Forward, block: int, tensor: torch.Tensor | None, entry: _Entry | None) -> None:
        self.fwd = fwd
        self.block = block
        self.tensor = tensor  # kept tensors only
        self.version = _version(tensor)  # See Note [A kept saved tensor keeps its version check]
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

    def __init__(self, fwd: Forward, block: int, param: torch.Tensor, t: torch.Tensor) -> None:
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


class Forward:
    """State of one forward pass and, later, of its backward."""

    def __init__(self, index: int, plan: OffloadPlan, profiling: bool, measure: Measure | None = None) -> None:
        n = plan.n_blocks
        self.index = index
        self.plan = plan
        self.n = n
        self.profiling = profiling
        self.reference = False  # run with nothing installed, only timed (``"auto"``'s reference step)
        self.current: int | None = None
        self.started = False
        self.by_key: dict[tuple[int, int], _Entry] = {}
        self.moved: list[list[_Entry]] = [[] for _ in range(n)]
        self.used = [0] * n
        self.offloadable = [0] * n
        self.resident = [0] * n
        self.other = 0
        self.no_host_room = False  # the pool refused a buffer: nothing more is offloaded in this forward
        self.other_ptrs: set[int] = set()
        # cast key -> (its source node, the entry (None in an untracked block), a weak ref to the first cast, its
        # version)
        self.casts: dict[tuple[Any, ...], tuple[Any, _Entry | None, Any, int]] = {}
        self.pending: dict[int, list[_Entry]] = {}
        self.bwd_point = n + 1
        self.prefetched: set[int] = set()
        self.marks: dict[Any, Any] = {}
        # budget mode: what this forward is measured for, the memory base and peak, the selective caches' bytes
        self.measure = measure
        # untracked block -> the storages it saved so far, by address (See Note [A kept block's saved tensors go
        # untracked]); set by the engine when it installs this forward; None: every block is tracked
        self.untracked: dict[int, dict[int, StorageWeakRef]] | None = None
        self.mem_base: int | None = None
        self.act_peak: int | None = None
        self.rc_cached: dict[int, int] = {}

    @property
    def raw(self) -> bool:
        """Budget mode's reference step: no cast dedupe, no weight re-cast, nothing moved (what a plain run keeps)."""
        return self.measure is not None and self.measure.raw


class SavedTensorHooks:
    """Pack/unpack hooks and block boundary hooks over the state an engine sets (see the module docstring)."""

    _fwd: Forward | None
    _lock: threading.RLock
    _transport: Transport | None
    _clock: Clock | None
    _pool: HostBufferPool | None
    _device: torch.device | None
    _param_ptrs: set[int]
    _saved_bytes: int
    _t0: float
    stats: OffloadStats
    timeline: list[TimelinePoint]
    options: ActivationOffloadOptions

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
            if fwd.untracked and index in fwd.untracked and fwd.plan.offloaded_blocks:
                self._mark_backward_point(fwd, index, output)

        return post

    def _mark_backward_point(self, fwd: Forward, index: int, output: Any) -> None:
        """Reach backward point ``index`` when the gradient of the block's output is ready: the block's backward
        starts next. See Note [A kept block's saved tensors go untracked]."""
        items = [output] if isinstance(output, torch.Tensor) else list(output.values()) \
            if isinstance(output, Mapping) else list(output) if isinstance(output, (tuple, list)) else []
        out = next((x for x in items if isinstance(x, torch.Tensor) and x.requires_grad), None)
        if out is None:  # nothing to hook: the point comes at the next tracked block's first unpack
            return

        def reached(grad: torch.Tensor) -> None:
            with self._lock:
                if fwd.bwd_point > index:
                    self._backward_point(fwd, index)

        out.register_hook(reached)

    def _skip_reason(self, t: torch.Tensor, ptr: int, nbytes: int) -> str | None:
        if type(t) is not torch.Tensor:
            return "parameter" if isinstance(t, nn.Parameter) else "subclass"
        if t.device != self._device:
            return "other-device"
        if t.layout != torch.strided or t.is_conj() or t.is_neg():
            return "layout"
        if ptr in self._param_ptrs or isinstance(t._base, nn.Parameter):
            return "parameter"  # a view of a weight, frozen or not (Note [FSDP2's gathered weights are parameters])
        if nbytes < self.options.min_tensor_bytes:
            return "small"
        fn, hops = t.grad_fn, 0
        while fn is not None and hops < 6:
            name = type(fn).__name__
            if name == "AccumulateGrad":
                # A cast or view of a parameter (autocast's cached bf16 weights); other leaves are data.
                leaf = getattr(fn, "variable", None)
                if leaf is not None and _is_param(leaf, self._param_ptrs):
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
            fn = t.grad_fn
            # Only a view of a dtype cast can be a parameter's cast or a repeated cast: the rest skip both walks.
            castish = fn is not None and (type(fn).__name__ == "ToCopyBackward0" or type(fn).__name__ in _VIEWS)
            if castish and self.options.recompute_param_casts and not fwd.raw:
                param = self._param_of_cast(t)
                if param is not None:
                    self.stats.recomputed_param_casts += 1
                    return _Recast(fwd, block if block is not None else (fwd.n if fwd.started else -1), param, t)
            seen = fwd.untracked.get(block) if fwd.untracked and block is not None else None
            if seen is not None:
                return self._untracked(fwd, block, t, castish, seen)
            if block is None:
                # Outside the blocks: stays; the handle still tells the backward where it is.
                try:
                    st = t.untyped_storage()
                    if st.data_ptr() not in fwd.other_ptrs:
                        fwd.other_ptrs.add(st.data_ptr())
                        fwd.other += st.nbytes()
                except (RuntimeError, NotImplementedError):
                    pass
                return _Handle(fwd, fwd.n if fwd.started else -1, _held(t), None)
            try:
                st = t.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # no storage (e.g. some subclasses)
                self._count_skip("no-storage")
                return _Handle(fwd, block, _held(t), None)
            e = fwd.by_key.get((block, ptr))
            if e is not None and e.state != _DEAD and not e.sref.expired() and e.nbytes == nbytes \
                    and (not e.moved or t._version == e.version):
                self.stats.deduplicated_saves += 1
                return self._handle(fwd, block, _held(t), e)
            ck = self._cast_key(t, block) if castish and self.options.dedupe_casts and not fwd.raw else None
            if ck is not None:
                hit = fwd.casts.get(ck[0])
                if hit is not None:
                    h = self._cast_hit(fwd, block, t, hit)
                    if h is not None:
                        return h
            reason = self._skip_reason(t, ptr, nbytes)
            budget = fwd.plan.budgets[block]
            moved = reason is None and (budget is None or fwd.used[block] + nbytes <= budget)
            host = self._host_buffer(fwd, nbytes) if moved else None
            if moved and host is None:  # kept, and not offloadable: the planner plans without it
                moved, reason = False, "no host room"
            e = _Entry(self, block, nbytes, moved, StorageWeakRef(st), t)
            fwd.by_key[(block, ptr)] = e
            if reason is None:
                fwd.offloadable[block] += nbytes
            else:
                self._count_skip(reason)
            if host is not None:
                self._start_copy(fwd, e, t, st, host)
            else:
                fwd.resident[block] += nbytes
                self._saved_bytes += nbytes
                self._event("keep", block)
            # See Note [A kept saved tensor is held detached]
            held = _held(t)
            if ck is not None and reason is None:
                fwd.casts[ck[0]] = (ck[1], e, weakref.ref(held), t._version)
            return self._handle(fwd, block, held, e)

    # Note [A kept block's saved tensors go untracked]
    # In a forward that neither measures nor profiles (``Forward.untracked``, set by the engine), a block whose plan
    # moves nothing and recomputes nothing hands autograd its saved tensors as they are, detached (Note [A kept saved
    # tensor is held detached]), in a ``(tensor, version, block)`` tuple that ``_unpack`` checks (Note [A kept saved
    # tensor keeps its version check]): no handle, no entry, no dedupe by storage, since they stay on the device
    # whatever happens. What saves memory there still runs: a parameter's dtype cast is re-made in the backward
    # (``_Recast``), and a repeated cast of one tensor shares the first (``dedupe_casts``, through
    # ``Forward.casts`` without an entry). Each storage's bytes still count once in ``Forward.resident``
    # (``stats.last_resident_bytes``); the engine's ``_saved_bytes`` (``stats.peak_device_saved_bytes``),
    # ``stats.deduplicated_saves`` and ``stats.skipped`` leave them out. Without handles such a
    # block's backward point, where the plan may issue other blocks' reloads, would come late (at the next tracked
    # block's first unpack), so a gradient hook on the block's output reaches it as the block's backward starts.
    # The reason for all this: the tracked way costs the host tens of microseconds per saved tensor, in every step,
    # and a step that already waits for its kernel launches pays that time in full.
    def _untracked(self, fwd: Forward, block: int, t: torch.Tensor, castish: bool,
                   seen: dict[int, StorageWeakRef]) -> tuple[torch.Tensor, int | None, int]:
        ck = self._cast_key(t, block) if castish and self.options.dedupe_casts else None
        if ck is not None:
            hit = fwd.casts.get(ck[0])
            first = hit[2]() if hit is not None else None
            if first is not None and first._version == hit[3] and t._version == 0:
                self.stats.deduplicated_casts += 1
                return first, hit[3], block
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            ref = seen.get(ptr)
            if ref is None or ref.expired():  # a new storage (or a freed one's address reused)
                seen[ptr] = StorageWeakRef(st)
                fwd.resident[block] += st.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (e.g. some subclasses): counted nowhere
            pass
        held = _held(t)
        if ck is not None:
            fwd.casts[ck[0]] = (ck[1], None, weakref.ref(held), t._version)
        return held, _version(held), block

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

    def _cast_hit(self, fwd: Forward, block: int, t: torch.Tensor,
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
        if param is None or not _is_param(param, self._param_ptrs):
            return None
        if not param.is_contiguous() or param.dtype == t.dtype or t.device != param.device:
            return None
        if t.untyped_storage().nbytes() != param.numel() * t.element_size():
            return None
        return param

    # Note [A kept saved tensor is held detached]
    # A handle that keeps its tensor on the device holds ``t.detach()``: the same storage and version counter, no
    # ``grad_fn``. Holding ``t`` itself would make a cycle whenever a node saves its own output (``t.grad_fn`` is
    # that node, which holds the handle, which holds ``t``). A backward breaks such cycles as it frees the saved
    # tensors; a forward whose graph is dropped without one (a training_step that returns None, an exception)
    # would otherwise keep all it saved alive, through C++ the garbage collector cannot see. Autograd rebuilds the
    # saved variable from the unpacked data and its own record of the grad_fn, so nothing is lost. The handles'
    # version checks read the shared counter. (An offloaded tensor is held as itself only until its release point.)
    def _handle(self, fwd: Forward, block: int, t: torch.Tensor, e: _Entry) -> _Handle:
        if not e.moved:
            return _Handle(fwd, block, t, e)
        h = _Handle(fwd, block, None, e)
        h.dtype, h.offset, h.size, h.stride = t.dtype, t.storage_offset(), t.size(), t.stride()
        return h

    def _count_skip(self, reason: str) -> None:
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1

    def _host_buffer(self, fwd: Forward, nbytes: int) -> _HostBuffer | None:
        """A pinned buffer for an offload, or ``None`` where the host-memory plan has no room and a budget plans
        the offloads: the tensor then stays on the device, is not counted as offloadable (so the budget's planner
        plans to recompute instead), and the rest of the forward offloads nothing (another part, SuperOffload say,
        may hold the host's memory). A fixed policy raises the :class:`~lightning_gh._host.HostMemoryError`
        instead."""
        if fwd.no_host_room:
            return None
        try:
            return self._pool.acquire(nbytes)
        except HostMemoryError as err:
            if self.options.budget is None:
                raise
            fwd.no_host_room = True
            warn_once("activation_offload:no-host-room",
                      f"ActivationOffload(budget={self.options.budget!r}): {err} What it would offload stays on the "
                      "device; the budget is reached by recomputing instead (see stats.skipped['no host room']).")
            return None

    def _start_copy(self, fwd: Forward, e: _Entry, t: torch.Tensor, st: torch.UntypedStorage,
                    host: _HostBuffer) -> None:
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

    # Note [Release point of an offloaded storage]
    # An offloaded storage's device->host copy runs on a side stream that first waits for the compute stream, so
    # the data it reads is complete. Until its block's release point (``OffloadPlan.release_at``, a forward point)
    # the engine holds the saved tensor itself: the memory cannot be reused, and a backward that comes early reads
    # the original (``stats.used_before_release``). At the release point the compute stream waits on the copy's
    # event (``Transport.release``) and the engine drops its reference: from then on the caching allocator may hand
    # the memory to later compute-stream work, which that wait orders after the copy. The wait is on the device,
    # not on the host: the host runs ahead of the GPU, so a host-side "copy finished?" would almost never be true
    # when the allocator is asked. ``end_forward`` releases every point still pending, and a storage whose last
    # handle dies while copying is released the same way (``_drop``). The host side mirrors it: a pinned buffer
    # returns to the pool with the event of the last copy that used it, and the next copy into it waits on it.
    def _release_point(self, fwd: Forward, point: int) -> None:
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
        if type(h) is tuple:  # (tensor, version, block): See Note [A kept block's saved tensors go untracked]
            _check_version(h[0], h[1], h[2])
            return h[0]
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
                _check_version(h.tensor, h.version, h.block)  # See Note [A kept saved tensor keeps its version check]
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

    def _backward_point(self, fwd: Forward, target: int) -> None:
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
                self._transport.release(e.d2h)  # See Note [Release point of an offloaded storage]
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
        if self.options.record_timeline:
            alloc = torch.cuda.memory_allocated(self._device) if self._device is not None and \
                self._device.type == "cuda" else None
            self.timeline.append(TimelinePoint((time.perf_counter() - self._t0) * 1e3, name, block,
                                               self._saved_bytes, alloc))
