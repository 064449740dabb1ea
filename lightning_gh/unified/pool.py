"""The managed-memory pool: a ``torch.cuda.MemPool`` whose segments come from ``cudaMallocManaged`` (the shim), and
``managed_memory()``, the context manager that scopes which allocations go to it.

One pool per (device, preferred location, accessed-by advice): the advice is given to whole segments when they are
allocated, and PyTorch's caching allocator reuses a pool's freed blocks only inside that pool, so a block never
moves between a host-preferred and a GPU-preferred scope. Pools live as long as the process, and their ``MemPool``
is never destroyed, not even at interpreter exit (see Note [Managed pools are never destroyed] in
:mod:`lightning_gh.unified.lifetime`); tensors from them may outlive any scope.

Inside ``with managed_memory(...)``, the *current thread's* CUDA allocations on that device come from the pool
(``torch.cuda.use_mem_pool``); allocations of other threads, of other devices, and of a CUDA graph capture do
not. Tensors keep their memory after the scope ends; they are ordinary CUDA tensors to every kernel.

What PyTorch cannot do, refused with the reason at the first use: a torch without ``MemPool``; the
``cudaMallocAsync`` allocator backend; a torch that cannot route allocations to a custom-allocator MemPool while
``expandable_segments:True`` is set (some releases raise "MemPool doesn't currently support expandable_segments";
torch 2.11 keeps expandable segments to the default pool and serves the MemPool from the shim, which is checked
with one small allocation when the pool is made); a device without concurrent managed access (pages could not be
read in place); a scope opened during a CUDA graph capture.

Example::

    import torch, lightning_gh as lgh

    with lgh.managed_memory("cpu"):                 # host-preferred, read in place by the GPU
        big = torch.zeros(1 << 28, device="cuda")    # 1 GiB of managed memory, no GPU memory taken
    (big + 1).sum()                                 # an ordinary CUDA tensor to every kernel
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gh import hardware
from lightning_gh._util import fmt_bytes, warn_once
from lightning_gh.unified import lifetime
from lightning_gh.unified import shim as _shim
from lightning_gh.unified.guard import ManagedMemoryError, ManagedMemoryUnavailable, refusal_reason
from lightning_gh.unified.options import DEFAULT_HEADROOM_BYTES, ManagedMemoryOptions

__all__ = ["ManagedPool", "PoolStats", "check_device_arg", "create_pool", "expandable_segments_enabled", "get_pool",
           "managed_memory", "pools", "resolve_device", "routing_failure", "unavailable_reason"]

_pools: dict[tuple[int, str, bool], ManagedPool] = {}
_pools_lock = threading.Lock()
_EXPANDABLE = re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE)


#: The warn-once key of the no-CUDA warning (:func:`lightning_gh._util.reset_warnings` makes it warn again).
NO_CUDA_WARNING = "unified:no-cuda"


def _warn_no_cuda(what: str) -> None:
    warn_once(NO_CUDA_WARNING, f"lightning_gh {what}: no CUDA GPU is available, so there is no managed memory; "
              "tensors are allocated as usual (this is the only warning).", stacklevel=5)


def check_device_arg(device: Any) -> None:
    """Validate a ``device=`` argument without needing CUDA (``None``, an int >= 0, ``"cuda[:N]"``, a CUDA
    ``torch.device``).

    Raises:
        TypeError: not an int, str, torch.device or None.
        ValueError: a negative index, an unparsable string, or a device that is not CUDA.
    """
    if device is None:
        return
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"device={device!r} must be a CUDA device (an int, 'cuda:N' or torch.device), or None for "
                        "the current one.")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device!r} must be a CUDA device index >= 0.")
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device name; use 'cuda' or 'cuda:N'.") from None
    if dev.type != "cuda":
        raise ValueError(f"device={device!r} is not a CUDA device; managed memory is CUDA memory (use 'cuda' or "
                         "'cuda:N').")


def resolve_device(device: int | str | torch.device | None) -> torch.device:
    """The CUDA device meant by ``device`` (``None``: the current one), with its index filled in (needs CUDA).

    Raises:
        TypeError, ValueError: as :func:`check_device_arg`.
    """
    check_device_arg(device)
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _allocator_settings() -> str:
    texts = [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", "")]
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch >= 2.9: the live settings
    if getter is not None:
        try:
            texts.append(str(getter()))
        except Exception:
            pass
    return ",".join(t for t in texts if t)


def expandable_segments_enabled() -> bool:
    """Whether PyTorch's caching allocator runs with ``expandable_segments:True`` (env or runtime setting)."""
    return bool(_EXPANDABLE.search(_allocator_settings()))


def routing_failure(error: BaseException | None, pointer_kind: str | None) -> str | None:
    """Why allocations inside a new pool did not reach the managed allocator (``None`` when they did).

    Args:
        error: what the probe allocation raised, if anything.
        pointer_kind: what memory the probe tensor got (``"managed"`` is right).
    """
    settings = _allocator_settings() or "(default)"
    if error is not None:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "expandable" in text.lower():
            return (f"this torch ({torch.__version__}) cannot route allocations to a MemPool while the caching "
                    f"allocator runs with expandable_segments:True ({text}); remove expandable_segments:True from "
                    "PYTORCH_CUDA_ALLOC_CONF for runs that use managed memory")
        return (f"a test allocation in the managed pool failed (allocator settings {settings}): "
                f"{type(error).__name__}: {text}")
    if pointer_kind != "managed":
        return (f"a test allocation in the managed pool got {pointer_kind} memory instead of managed memory (torch "
                f"{torch.__version__}, allocator settings {settings}); this torch does not route MemPool "
                "allocations to a pluggable allocator here")
    return None


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why this torch / allocator configuration cannot host a managed-memory pool, or ``None`` as far as can be told
    without allocating (a new pool also makes one small test allocation: :func:`routing_failure`).

    Does not build the shim (see :func:`lightning_gh.unified.shim.find_toolchain` for that).

    Args:
        device: the CUDA device (default: the current one); only checked for being CUDA.
    """
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    missing = [n for n in ("MemPool", "use_mem_pool") if not hasattr(torch.cuda, n)]
    if missing or not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        return (f"this torch ({torch.__version__}) has no torch.cuda.{'/'.join(missing) or 'memory.CUDAPluggableAllocator'}"
                ", which a managed-memory pool is built on; upgrade PyTorch (2.11 is tested)")
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        return (f"PyTorch's CUDA allocator backend is {backend!r} (PYTORCH_CUDA_ALLOC_CONF=backend:{backend}); a "
                "MemPool needs the native caching allocator: remove backend:cudaMallocAsync")
    return None


@dataclass(frozen=True)
class PoolStats:
    """Where a pool's memory is, in bytes.

    Attributes:
        device: the CUDA device index.
        pool_reserved_bytes: managed segments this pool holds (what PyTorch's caching allocator got from the shim).
        pool_allocated_bytes: of those, what live tensors use.
        managed_live_bytes: managed bytes held on the device by every pool of this process (the guard's count).
        managed_peak_bytes: the most ``managed_live_bytes`` has been.
        refusals: allocations the guard refused on this device.
    """

    device: int
    pool_reserved_bytes: int
    pool_allocated_bytes: int
    managed_live_bytes: int
    managed_peak_bytes: int
    refusals: int


class ManagedPool:
    """A ``torch.cuda.MemPool`` over ``cudaMallocManaged`` for one device and one advice. Get one with
    :func:`get_pool` or :func:`managed_memory` (:func:`create_pool` makes it); do not construct it directly.

    Args:
        device: the CUDA device.
        preferred: ``"cpu"`` or ``"gpu"``.
        accessed_by_gpu: the accessed-by advice of its pages.
        lib: the loaded shim.
        mempool: the ``torch.cuda.MemPool`` whose segments the shim allocates (kept alive by
            :func:`lightning_gh.unified.lifetime.keep_alive`).
        device_info: the device's managed-memory attributes
            (:func:`lightning_gh.hardware.managed_memory_attributes`).

    Attributes:
        device: the CUDA device.
        preferred: ``"cpu"`` or ``"gpu"``: where its pages live.
        accessed_by_gpu: whether its pages are advised accessed-by the GPU.
        coherent: the GPU reads host memory coherently (Grace Hopper).
        mempool: the ``torch.cuda.MemPool``.
    """

    def __init__(self, device: torch.device, preferred: str, accessed_by_gpu: bool, lib: _shim.Shim, *,
                 mempool: Any, device_info: dict[str, bool]) -> None:
        self.device = device
        self.preferred = preferred
        self.accessed_by_gpu = accessed_by_gpu
        self.shim = lib
        self.mempool = mempool
        self.device_info = device_info
        self.coherent = device_info["pageable_uses_host_page_tables"]

    def check_routing(self) -> None:
        """One small allocation (a 2 MiB segment, kept in the pool's cache) that must land in managed memory.

        Raises:
            ManagedMemoryUnavailable: it did not (:func:`routing_failure` says why).
        """
        error: BaseException | None = None
        kind: str | None = None
        try:
            with self.scope(ManagedMemoryOptions(preferred=self.preferred, accessed_by_gpu=self.accessed_by_gpu)):
                probe = torch.empty(128, dtype=torch.float32, device=self.device)
            kind = self.shim.pointer_kind(probe.data_ptr())[0]
            del probe
        except (RuntimeError, ManagedMemoryError) as e:
            error = e
        reason = routing_failure(error, kind)
        if reason is not None:
            raise ManagedMemoryUnavailable(f"managed memory is not available: {reason}.")

    def describe_device(self) -> str:
        return _describe(self.device)

    def __repr__(self) -> str:
        return (f"ManagedPool(device={str(self.device)!r}, preferred={self.preferred!r}, "
                f"accessed_by_gpu={self.accessed_by_gpu}, coherent={self.coherent})")

    # ------------------------------------------------------------------ the scope
    @contextlib.contextmanager
    def scope(self, options: ManagedMemoryOptions) -> Iterator[ManagedPool]:
        """Route this thread's allocations on :attr:`device` to the pool, with ``options``' guard settings.

        Raises:
            ManagedMemoryError: an allocation inside was refused or failed (the reason, with the numbers).
            ValueError: ``allow_oversubscription=True`` on a GPU that is not coherent with host memory.
        """
        if options.pool_key() != (self.preferred, self.accessed_by_gpu):
            raise ValueError(f"options {options.pool_key()} do not match this pool "
                             f"({self.preferred!r}, accessed_by_gpu={self.accessed_by_gpu}); use get_pool(options).")
        if options.allow_oversubscription and not self.coherent:
            raise ValueError(
                f"allow_oversubscription=True is honoured only where the GPU reads host memory coherently (Grace "
                f"Hopper); {self.describe_device()} does not (PCIe), and managed memory beyond its free memory can "
                "hang the GPU there. Remove allow_oversubscription=True.")
        if torch.cuda.is_current_stream_capturing():
            raise ManagedMemoryError(
                "managed_memory() was entered during a CUDA graph capture: cudaMallocManaged cannot be captured. "
                "Create the managed tensors before the capture (CUDAGraphCapture warms up eagerly first).")
        lib = self.shim
        previous = lib.get_config()
        lib.set_config(prefer_host=self.preferred == "cpu", accessed_by=self.accessed_by_gpu,
                       allow_oversubscription=options.allow_oversubscription, headroom_bytes=options.headroom_bytes)
        lib.clear_refusal()
        try:
            # Exited on every path out (exceptions and GeneratorExit too): see Note [Managed pools are never
            # destroyed] for what an allocation-to-pool context left open does.
            with lifetime.tracked(repr(self)), torch.cuda.use_mem_pool(self.mempool, device=self.device):
                yield self
        except torch.cuda.OutOfMemoryError as e:
            refusal = lib.last_refusal()
            if refusal is None:
                raise
            raise ManagedMemoryError(self.explain(refusal, options)) from e
        finally:
            lib.set_config(prefer_host=bool(previous["prefer_host"]), accessed_by=bool(previous["accessed_by"]),
                           allow_oversubscription=bool(previous["allow_oversubscription"]),
                           headroom_bytes=int(previous["headroom_bytes"]), populate=bool(previous["populate"]))

    def explain(self, refusal: _shim.Refusal, options: ManagedMemoryOptions) -> str:
        """A :class:`~lightning_gh.unified.shim.Refusal` in words."""
        where = f"managed_memory(preferred={self.preferred!r})"
        if refusal.kind == "guard":
            reason = refusal_reason(refusal.request, refusal.free_bytes, refusal.live_bytes, refusal.headroom_bytes,
                                    refusal.coherent, options.allow_oversubscription,
                                    what="a segment of PyTorch's caching allocator", device=self.describe_device())
            return f"{where}: {reason}"
        if refusal.kind == "malloc":
            return (f"{where}: cudaMallocManaged({fmt_bytes(refusal.request)}) failed on {self.describe_device()}: "
                    f"{refusal.cuda_error_text} (CUDA error {refusal.cuda_error}).")
        if refusal.kind == "advice":
            return (f"{where}: advising or populating {fmt_bytes(refusal.request)} of managed memory on "
                    f"{self.describe_device()} failed: {refusal.cuda_error_text} (CUDA error {refusal.cuda_error}); "
                    "the memory was given back.")
        if refusal.kind == "meminfo":
            return (f"{where}: cudaMemGetInfo failed on {self.describe_device()} ({refusal.cuda_error_text}), so the "
                    "safety guard could not run and nothing was allocated.")
        return f"{where}: the allocator was called with size {refusal.request} on device {refusal.device}."

    # ------------------------------------------------------------------ checks and numbers
    def check_fits(self, nbytes: int, options: ManagedMemoryOptions, *, what: str) -> None:
        """Raise :class:`ManagedMemoryError` now if ``nbytes`` more of managed memory would be refused.

        Args:
            nbytes: the pool bytes about to be allocated (:func:`~lightning_gh.unified.guard.pool_bytes_for`).
            options: the guard settings.
            what: what they are for, for the message.
        """
        room = hardware.gpu_memory_room(self.device)
        if room is None:
            return
        live = self.shim.stats(self.device.index)["live_bytes"]
        reason = refusal_reason(nbytes, room[0], live, options.headroom_bytes, self.coherent,
                                options.allow_oversubscription, what=what, device=self.describe_device())
        if reason is not None:
            raise ManagedMemoryError(reason)

    def stats(self) -> PoolStats:
        """Where this pool's memory is (reads PyTorch's allocator snapshot: not for every step)."""
        reserved = allocated = 0
        pool_id = tuple(self.mempool.id)
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") == self.device.index and tuple(seg.get("segment_pool_id", ())) == pool_id:
                reserved += int(seg.get("total_size", 0))
                allocated += int(seg.get("allocated_size", 0))
        s = self.shim.stats(self.device.index)
        return PoolStats(self.device.index, reserved, allocated, s["live_bytes"], s["peak_bytes"], s["refusals"])


def get_pool(options: ManagedMemoryOptions | None = None, device: int | str | torch.device | None = None
             ) -> ManagedPool:
    """The process's pool for ``device`` and ``options.preferred`` / ``options.accessed_by_gpu`` (made on first
    use, which builds or loads the shim).

    Raises:
        ManagedMemoryUnavailable: managed memory cannot be used here (the reason says why).
    """
    options = options or ManagedMemoryOptions()
    reason = unavailable_reason()
    if reason is not None:
        raise ManagedMemoryUnavailable(f"managed memory is not available: {reason}.")
    dev = resolve_device(device)
    key = (dev.index, *options.pool_key())
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = create_pool(dev, options.preferred, options.accessed_by_gpu, _shim.load())
    return pool


def pools() -> list[ManagedPool]:
    """Every pool this process has made (oldest first): they live as long as the process."""
    with _pools_lock:
        return list(_pools.values())


def _describe(device: torch.device) -> str:
    return f"{device} ({hardware.gpu_name(device) or 'GPU'})"


def create_pool(device: torch.device, preferred: str, accessed_by_gpu: bool, lib: _shim.Shim) -> ManagedPool:
    """A new :class:`ManagedPool` on ``device`` whose ``MemPool`` takes its segments from the shim, checked with
    one small allocation. Its ``MemPool`` and allocator live until the process ends, also when the check fails
    (see Note [Managed pools are never destroyed] in :mod:`lightning_gh.unified.lifetime`).

    Raises:
        ManagedMemoryUnavailable: the device cannot serve managed memory, or allocations do not reach the shim.
    """
    info = hardware.managed_memory_attributes(device.index)
    if info is None:
        raise ManagedMemoryUnavailable(f"{_describe(device)}: the CUDA driver cannot be asked for the device's "
                                       "managed-memory attributes (libcuda.so.1 missing or cuInit failed).")
    if not info["managed_memory"]:
        raise ManagedMemoryUnavailable(f"{_describe(device)} cannot allocate managed memory "
                                       "(cudaDevAttrManagedMemory is 0).")
    if not info["concurrent_managed_access"]:
        raise ManagedMemoryUnavailable(
            f"{_describe(device)} has no concurrent managed access (cudaDevAttrConcurrentManagedAccess is 0, as on "
            "Windows, WSL and some virtual machines): the GPU cannot keep host-resident managed pages mapped and "
            "read them in place, and advice and prefetch do not apply.")
    # The MemPool holds a raw pointer to the allocator object: both are kept, the allocator first.
    allocator = torch.cuda.memory.CUDAPluggableAllocator(lib.path, "lgh_managed_malloc", "lgh_managed_free")
    lifetime.keep_alive(allocator)
    mempool = torch.cuda.MemPool(allocator.allocator())
    lifetime.keep_alive(mempool)
    pool = ManagedPool(device, preferred, accessed_by_gpu, lib, mempool=mempool, device_info=info)
    pool.check_routing()
    return pool


@contextlib.contextmanager
def managed_memory(preferred: str = "cpu", *, device: int | str | torch.device | None = None,
                   accessed_by_gpu: bool = True, allow_oversubscription: bool = False,
                   headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> Iterator[ManagedPool | None]:
    """Put the CUDA tensors this thread allocates inside the block in managed memory.

    Args:
        preferred: ``"cpu"``: pages live in host memory and the GPU reads and writes them in place (no GPU memory
            taken; over NVLink-C2C on Grace Hopper, over PCIe elsewhere). ``"gpu"``: pages live in GPU memory and the
            driver may evict them to the host under pressure where oversubscription is allowed.
        device: the CUDA device whose allocations are routed (default: the current one).
        accessed_by_gpu: keep the GPU's mapping to the pages wherever they are (no faults on host-resident pages).
        allow_oversubscription: hold more managed memory than the GPU has free; only where the GPU is coherent with
            host memory (Grace Hopper), an error elsewhere.
        headroom_bytes: GPU memory the safety guard keeps free beyond the managed bytes.

    Yields:
        The :class:`ManagedPool` (for :meth:`~ManagedPool.stats`), or ``None`` without CUDA, where the block runs
        unchanged after one warning.

    Raises:
        ManagedMemoryError: an allocation in the block was refused by the safety guard or failed in CUDA.
        ManagedMemoryUnavailable: PyTorch cannot use a managed pool here (old torch, expandable segments, no
            compiler for the shim, ...).
        ValueError, TypeError: a bad argument (checked even without CUDA).

    Example::

        with lightning_gh.managed_memory("cpu"):
            model.embed = torch.nn.Embedding(256_000, 4096, device="cuda")   # a big table that the GPU reads in place
    """
    options = ManagedMemoryOptions(preferred=preferred, accessed_by_gpu=accessed_by_gpu,
                                   allow_oversubscription=allow_oversubscription, headroom_bytes=headroom_bytes)
    check_device_arg(device)
    if not torch.cuda.is_available():
        _warn_no_cuda("managed_memory()")
        yield None
        return
    pool = get_pool(options, device)
    with pool.scope(options) as p:
        yield p
