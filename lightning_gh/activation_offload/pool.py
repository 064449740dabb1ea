"""A reusable pool of host buffers for offloaded activations, guarded by the host's available memory.

Steps repeat the same tensor shapes, so after the first offloaded step every copy lands in a buffer the pool
already holds and nothing is pinned again. The guard (``host_memory_fraction`` of what
:func:`lightning_gh.hardware.available_host_bytes` reports, through :func:`lightning_gh._host.check_host_room`)
raises the shared :class:`~lightning_gh._host.HostMemoryError` only when the buffers in use, not the ones the
pool merely keeps, would exceed it.

Example::

    >>> from lightning_gh.activation_offload.pool import HostBufferPool
    >>> pool = HostBufferPool(pin=False)
    >>> buf = pool.acquire(3 * 2**20)
    >>> pool.release(buf)
    >>> pool.acquire(2**20) is buf
    True
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lightning_gh._host import HostMemoryError, check_host_room
from lightning_gh._util import warn_once

__all__ = ["HostBufferPool", "HostMemoryError"]

_MIB = 2**20


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _HostBuffer:
    __slots__ = ("tensor", "size", "ready", "generation")

    def __init__(self, tensor: torch.Tensor, size: int, generation: int = 0) -> None:
        self.tensor = tensor  # may be larger than the request it serves: callers use the first nbytes
        self.size = size
        # Event of the last copy that read or wrote it; the next writer waits on it.
        # See Note [Release point of an offloaded storage].
        self.ready: Any = None
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
            try:
                avail = check_host_room(
                    self.reserved_bytes + charge, headroom=self.host_memory_fraction, held_bytes=self.reserved_bytes,
                    what=f"ActivationOffload's {'pinned ' if self.pin else ''}host buffers ("
                         f"{self.in_use_bytes / 2**30:.2f} GiB in use, {charge / 2**30:.2f} GiB more needed; "
                         f"host_memory_fraction={self.host_memory_fraction} of what is available)",
                    tips=("offload fewer blocks (policy=K or 'auto')", "raise host_memory_fraction",
                          "free host memory"), part="ActivationOffload", owner=self)
            except HostMemoryError:
                if self._drop_oldest():  # free buffers go first, oldest first: only the ones in use count
                    continue
                raise
            if avail is None:
                warn_once("activation_offload:meminfo", "ActivationOffload: the host's available memory is unknown; "
                                      "the host_memory_fraction guard is off.")
            break
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
