"""Host memory shared by the offloading parts: one error for "not enough host RAM", one room check, and
exact-size page-locked buffers.

ActivationOffload, SuperOffload and the KV-cache offload all keep data in host memory that the GPU's copy
engines read and write. They size it against :func:`lightning_gh.hardware.available_host_bytes` with
:func:`check_host_room`, raise :class:`HostMemoryError` when it does not fit (naming the numbers and what to
change), and allocate DMA buffers as :class:`HostBuffer`: torch's own pinned allocator rounds every request up
to a power of two, which can waste up to half of a multi-gigabyte buffer; registering an exact-size allocation
with ``cudaHostRegister`` does not.

Example::

    >>> from lightning_gh._host import HostBuffer, check_host_room
    >>> buf = HostBuffer(1024, pin=False)
    >>> buf.tensor.numel(), buf.pinned
    (1024, False)
    >>> check_host_room(1024, what="a test buffer") is None or True
    True
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Sequence

import torch

from lightning_gh import hardware

__all__ = ["HostBuffer", "HostMemoryError", "check_host_room", "clear_cuda_error"]

_GIB = 2**30


class HostMemoryError(MemoryError, RuntimeError):
    """The host cannot hold what an offloading part would put there.

    A ``MemoryError`` (what it is) and a ``RuntimeError`` (what ActivationOffload raised before 0.2).
    """


def check_host_room(needed_bytes: int, *, what: str, headroom: float = 0.9, held_bytes: int = 0,
                    tips: Sequence[str] = (), opt_out: str | None = None) -> int | None:
    """Raise :class:`HostMemoryError` unless ``needed_bytes`` fit in ``headroom`` of the host's available memory.

    Args:
        needed_bytes: what the part is about to allocate.
        what: who needs it and for what, for the message (``"HeterogeneousAdamW's master weights and moments"``).
        headroom: the share of the available memory the part may take.
        held_bytes: host memory the part already holds and would reuse (counted as available).
        tips: ways to need less, for the message.
        opt_out: the option that skips this check, for the message.

    Returns:
        The available bytes the decision used, or ``None`` where the host's memory cannot be read (then it passes).
    """
    avail = hardware.available_host_bytes()
    if avail is None:
        return None
    room = headroom * (avail + held_bytes)
    if needed_bytes > room:
        advice = f" To fit: {'; '.join(tips)}." if tips else ""
        skip = f" Pass {opt_out} to skip this check." if opt_out else ""
        raise HostMemoryError(
            f"{what} needs {needed_bytes / _GIB:.2f} GiB of host RAM, but at most {headroom:.0%} of the "
            f"{(avail + held_bytes) / _GIB:.2f} GiB available (MemAvailable in /proc/meminfo"
            f"{' plus what it already holds' if held_bytes else ''}) may be used.{advice}{skip}")
    return avail


class HostBuffer:
    """A flat host tensor (fp32 unless ``dtype`` says otherwise), page-locked when CUDA is in use so copies to/from
    the GPU are async.

    Page-locking registers an exact-size allocation (``cudaHostRegister``); where that fails it falls
    back to torch's pinned allocator, and where that fails too it stays pageable with one warning
    (copies are then synchronous but still correct). :meth:`release` unregisters; it runs at most once.
    """

    _warned = False

    def __init__(self, numel: int, pin: bool, zero: bool = True, dtype: torch.dtype = torch.float32) -> None:
        self.numel = int(numel)
        self.dtype = dtype
        self._registered_ptr: int | None = None
        if pin and self.numel > 0 and self._pin(zero):
            return
        self.tensor = torch.zeros(self.numel, dtype=dtype) if zero else torch.empty(self.numel, dtype=dtype)

    def _pin(self, zero: bool) -> bool:
        # Register whole pages that lie inside this allocation only: two registrations that share a page
        # fail (cudaErrorHostMemoryAlreadyRegistered), and a failed runtime call would surface later as the
        # "last error" of an unrelated kernel launch.
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        nbytes = self.numel * self.dtype.itemsize
        span = -(-nbytes // page) * page
        raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
        start = -(-raw.data_ptr() // page) * page
        first = start - raw.data_ptr()
        tensor = raw[first:first + nbytes].view(self.dtype)
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(start, span, 0))
        except Exception:  # no cudart binding in this build
            err = -1
        if err == 0:
            self._registered_ptr = start
            self.tensor = tensor
            if zero:
                self.tensor.zero_()
            return True
        clear_cuda_error()
        try:
            self.tensor = torch.zeros(self.numel, dtype=self.dtype, pin_memory=True)
            return True
        except RuntimeError as e:
            clear_cuda_error()
            if not HostBuffer._warned:
                HostBuffer._warned = True
                warnings.warn(f"lightning_gh: could not page-lock {nbytes / 2**20:.0f} MiB of host memory "
                              f"(cudaHostRegister error {err}; {e}); host<->GPU copies will be synchronous.",
                              stacklevel=3)
            return False

    @property
    def pinned(self) -> bool:
        return self._registered_ptr is not None or (self.numel > 0 and self.tensor.is_pinned())

    def release(self) -> None:
        if self._registered_ptr is not None:
            ptr, self._registered_ptr = self._registered_ptr, None
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:
                pass

    def __del__(self) -> None:  # the storage is freed right after, so it must be unregistered first
        try:
            self.release()
        except Exception:
            pass


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call made outside torch (best effort)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        get_last_error = getattr(lib, "cudaGetLastError", None)
        if get_last_error is not None:
            get_last_error()
            return
