"""How long managed pools and their scopes live: every ``MemPool`` this package makes lives until the process ends,
every scope is tracked from its entry to its exit, and a check tells whether PyTorch's allocator still has an
allocation-to-pool context open somewhere.

Note [Managed pools are never destroyed]
    ``torch.cuda.use_mem_pool`` and a CUDA graph capture each register an "allocation to pool" entry in PyTorch's
    caching allocator (``captures_underway``) until they end. While any such entry exists, anywhere in the process:

    * destroying a ``torch.cuda.MemPool`` fails an INTERNAL ASSERT (``captures_underway.empty()``) inside its C++
      destructor, which ``std::terminate``\\ s the process (at interpreter exit: "terminate called after throwing an
      instance of 'c10::Error'", exit status 134);
    * ``torch.cuda.empty_cache()`` silently stops giving the default pool's cached blocks back to the driver.

    An entry can outlive its owner: a thread stopped inside a ``with`` block (a daemon thread at exit), a context
    entered by hand and never exited, and every CUDA graph capture that CUDA invalidated in torch releases without
    pytorch/pytorch#180395 (torch 2.11 among them: ``CUDAGraph::capture_end`` raises at ``cudaStreamEndCapture``,
    before it ends the allocation to the graph's pool, so the entry stays for the rest of the process); captures
    that fail before their end are not unwound by that fix either. A capture that fails on an ``.item()`` and falls
    back to eager is enough.

    So a managed pool is never destroyed: :func:`keep_alive` holds each ``MemPool`` (and the pluggable allocator it
    points to) from its creation, a pool that failed its routing check included, and at interpreter exit takes a
    reference the interpreter never gives back, so no ``MemPool`` destructor runs during shutdown, whatever is
    left open. The driver frees the managed memory when the process ends. Scopes are tracked per thread
    (:func:`open_scopes`) so a scope left open can be named, and :func:`empty_cache_releases` tells whether the
    allocator is in that state (the GPU tests measure memory only when it is not).

Example::

    >>> from lightning_gh.unified import lifetime
    >>> lifetime.open_scopes()
    []
    >>> with lifetime.tracked("ManagedPool(...)"):
    ...     [s.pool for s in lifetime.open_scopes()]
    ['ManagedPool(...)']
    >>> lifetime.open_scopes()
    []
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["ScopeRecord", "empty_cache_releases", "keep_alive", "kept", "open_scopes", "tracked"]

_lock = threading.Lock()
_kept: list[Any] = []
_open: dict[int, ScopeRecord] = {}
_ids = itertools.count()
_exit_registered = False
_PROBE_BYTES = 24 * 2**20  # a large block: its own segment when no cached block of its stream fits


@dataclass(frozen=True)
class ScopeRecord:
    """One managed scope that is open now.

    Attributes:
        pool: the pool's description (its ``repr``).
        thread_name: the thread that entered it.
        thread_id: that thread's ``threading.get_ident()``.
    """

    pool: str
    thread_name: str
    thread_id: int


def keep_alive(*objects: Any) -> None:
    """Hold ``objects`` (a ``MemPool``, the allocator it points to) until the process ends.

    See Note [Managed pools are never destroyed].
    """
    global _exit_registered
    with _lock:
        _kept.extend(objects)
        if not _exit_registered:
            atexit.register(_at_exit)
            _exit_registered = True


def kept() -> list[Any]:
    """The objects :func:`keep_alive` holds (a copy of the list), oldest first."""
    with _lock:
        return list(_kept)


def open_scopes() -> list[ScopeRecord]:
    """The managed scopes open now, on every thread, oldest first."""
    with _lock:
        return list(_open.values())


@contextlib.contextmanager
def tracked(pool: str) -> Iterator[None]:
    """Record a scope of ``pool`` on the calling thread from entry to exit (exceptions and ``GeneratorExit``
    included): :func:`open_scopes` lists it meanwhile.

    Args:
        pool: the pool's description.
    """
    key = next(_ids)
    thread = threading.current_thread()
    with _lock:
        _open[key] = ScopeRecord(pool, thread.name, threading.get_ident())
    try:
        yield
    finally:
        with _lock:
            _open.pop(key, None)


def _at_exit() -> None:
    # Runs before the interpreter clears the modules (and with them the pools): one reference that is never given
    # back keeps the list, and so every MemPool in it, alive through shutdown.
    with _lock:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept))
        left = list(_open.values())
    if left:
        names = "; ".join(f"{s.pool} on thread {s.thread_name!r}" for s in left)
        warnings.warn(f"lightning_gh: {len(left)} managed_memory() scope(s) still open at exit ({names}); the pools "
                      "are kept alive so that PyTorch does not abort at exit. Leave every scope with its `with` "
                      "block (a daemon thread stopped inside one leaves it open).", RuntimeWarning, stacklevel=1)


def _free_default_segments(device: int) -> tuple[int, bool]:
    """``(segments of the default pool on device with no allocated block, any expandable segment)``."""
    import torch

    free, expandable = 0, False
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") != device or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        expandable |= bool(seg.get("is_expandable", False))
        free += int(seg.get("allocated_size", 0)) == 0
    return free, expandable


def empty_cache_releases(device: int | None = None) -> bool | None:
    """Whether ``torch.cuda.empty_cache()`` gives the default pool's cached blocks back to the driver now:
    ``False`` while an allocation-to-pool context is open somewhere in the process (see Note [Managed pools are
    never destroyed]), ``True`` when it gives them back, ``None`` without CUDA or when it cannot be told (expandable
    segments, or the test block shared a segment with live tensors). Allocates and frees one small block; reads
    the allocator's snapshot (not for every step).

    Args:
        device: the CUDA device index (default: the current one).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device() if device is None else int(device)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, expandable = _free_default_segments(dev)
    if expandable:
        return None
    if free:
        return False  # empty_cache() left whole free segments behind
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        block = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=dev)
    address = block.data_ptr()
    del block
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    for seg in torch.cuda.memory_snapshot():
        start = int(seg.get("address", 0))
        if seg.get("device") == dev and start <= address < start + int(seg.get("total_size", 0)):
            return False if int(seg.get("allocated_size", 0)) == 0 else None
    return True
