"""The safety rule of the managed-memory pool, as pure arithmetic, and the two errors of the unified-memory part.

Why a rule: on a GPU that does not read host memory coherently (every PCIe GPU), managed memory that the GPU
touches migrates in and out of GPU memory on page faults. Holding more managed memory than the GPU has free can
then hang the GPU itself, not just the process. So by default the pool refuses, *before* calling
``cudaMallocManaged``, any allocation after which

    managed bytes already held on the device + this request + headroom  >  the GPU's free memory

The C shim applies the same test (``lgh_guard_refuses``) inside the allocator, where it sees the exact segment sizes
PyTorch's caching allocator asks for; Python applies it beforehand to sizes it knows (optimizer state) so that the
error comes early and names what did not fit. Both count every live managed byte, wherever its pages are: on a
GPU-preferred pool whose pages already sit in GPU memory (and so are already missing from "free") this is
conservative, never unsafe. ``allow_oversubscription=True`` lifts the rule, and only where the GPU is coherent
with host memory (Grace Hopper).

PyTorch's caching allocator asks the pool for whole segments, not tensors: requests up to 1 MiB share 2 MiB
segments, requests under 10 MiB get 20 MiB segments, larger ones are rounded up to 2 MiB. :func:`segment_bytes`
and :func:`pool_bytes_for` mirror that, so the early check counts the pool's bytes, not just the tensors'.

Example::

    >>> from lightning_gh.unified.guard import refusal_reason, segment_bytes
    >>> segment_bytes(4)
    2097152
    >>> refusal_reason(request_bytes=8 << 30, free_bytes=10 << 30, live_bytes=4 << 30, headroom_bytes=1 << 29,
    ...                coherent=False, allow_oversubscription=False) is not None
    True
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_gh._util import fmt_bytes

__all__ = ["ManagedMemoryError", "ManagedMemoryUnavailable", "guard_refuses", "pool_bytes_for", "refusal_reason",
           "segment_bytes"]

# PyTorch's CUDACachingAllocator constants (c10/cuda/CUDACachingAllocator.cpp, unchanged from torch 2.0 to 2.13).
MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


class ManagedMemoryError(MemoryError, RuntimeError):
    """The managed-memory pool refused an allocation (safety guard) or CUDA could not make it.

    A ``MemoryError`` (what it is) and a ``RuntimeError`` (what PyTorch's own out-of-memory error is).
    """


class ManagedMemoryUnavailable(RuntimeError):
    """Managed memory cannot be used from PyTorch here: no MemPool in this torch, an allocator setting that
    MemPool does not support, or no compiler / CUDA headers to build the allocator shim. The message says which."""


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int number of bytes.")
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0 bytes.")


def segment_bytes(nbytes: int) -> int:
    """The segment PyTorch's caching allocator asks a pool for when a tensor of ``nbytes`` finds no cached block.

    Args:
        nbytes: the tensor's size in bytes.
    """
    _check_size("nbytes", nbytes)
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def pool_bytes_for(sizes: Iterable[int]) -> int:
    """Managed bytes a fresh pool needs for tensors of ``sizes`` bytes, the way the caching allocator packs them:
    small tensors (<= 1 MiB, rounded to 512 B) share 2 MiB segments, mid-sized ones (< 10 MiB) share 20 MiB
    segments, large ones get a segment each (rounded to 2 MiB). An estimate within one segment per size class.

    Args:
        sizes: the tensors' sizes in bytes.
    """
    small = mid = large = 0
    for n in sizes:
        _check_size("size", n)
        r = -(-max(n, 1) // MIN_BLOCK) * MIN_BLOCK
        if r <= SMALL_SIZE:
            small += r
        elif r < MIN_LARGE_ALLOC:
            mid += r
        else:
            large += -(-r // ROUND_LARGE) * ROUND_LARGE
    return (-(-small // SMALL_BUFFER) * SMALL_BUFFER + -(-mid // LARGE_BUFFER) * LARGE_BUFFER + large)


def guard_refuses(request_bytes: int, free_bytes: int, live_bytes: int, headroom_bytes: int, coherent: bool | None,
                  allow_oversubscription: bool) -> bool:
    """The rule alone (the C shim's ``lgh_guard_refuses`` computes the same).

    Args:
        request_bytes: the allocation about to be made.
        free_bytes: the GPU's free memory now (``cudaMemGetInfo``).
        live_bytes: managed bytes already held on this device (every pool, cached segments included).
        headroom_bytes: GPU memory to keep free beyond them.
        coherent: the GPU reads host memory coherently (``None``: unknown, treated as not coherent).
        allow_oversubscription: the user lifted the rule (honoured only when ``coherent`` is True).
    """
    for name, v in (("request_bytes", request_bytes), ("free_bytes", free_bytes), ("live_bytes", live_bytes),
                    ("headroom_bytes", headroom_bytes)):
        _check_size(name, v)
    if allow_oversubscription and coherent is True:
        return False
    return live_bytes + request_bytes + headroom_bytes > free_bytes


def refusal_reason(request_bytes: int, free_bytes: int, live_bytes: int, headroom_bytes: int, coherent: bool | None,
                   allow_oversubscription: bool, *, what: str = "this allocation", device: str = "the GPU") -> str | None:
    """Why the guard refuses ``request_bytes`` (one paragraph naming the numbers and the ways out), or ``None``.

    Args:
        request_bytes, free_bytes, live_bytes, headroom_bytes, coherent, allow_oversubscription: as for
            :func:`guard_refuses`.
        what: what was being allocated, for the message.
        device: the device, for the message (``"cuda:0 (NVIDIA H200)"``).
    """
    if not guard_refuses(request_bytes, free_bytes, live_bytes, headroom_bytes, coherent, allow_oversubscription):
        return None
    need = live_bytes + request_bytes + headroom_bytes
    kind = ("reads host memory coherently" if coherent else
            "does not read host memory coherently (PCIe)" if coherent is False else
            "may not read host memory coherently (unknown)")
    msg = (f"the managed-memory pool refused {fmt_bytes(request_bytes)} for {what} on {device}: the pool already "
           f"holds {fmt_bytes(live_bytes)} of managed memory there, and with {fmt_bytes(headroom_bytes)} of headroom "
           f"that makes {fmt_bytes(need)}, more than the {fmt_bytes(free_bytes)} the GPU has free. This GPU {kind}")
    if coherent:
        return msg + ("; managed memory may exceed its free memory only when you say so: pass "
                      "allow_oversubscription=True (or free GPU memory, or put less in managed memory).")
    return msg + ("; there, managed memory beyond the GPU's free memory can hang the GPU, so the pool never allows "
                  "it. Free GPU memory, put less in managed memory, lower headroom_bytes, or use "
                  "SuperOffload (optimizer state in pinned host memory) instead.")
