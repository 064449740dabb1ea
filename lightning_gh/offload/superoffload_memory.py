"""Host memory for SuperOffload: how much there is, how much a model needs, and page-locked buffers.

The optimizer keeps fp32 master weights and both AdamW moments in host memory. Before it allocates
anything it checks the machine can hold them (:func:`check_host_memory`, numbers from ``/proc/meminfo``
because ``psutil`` is optional), and it allocates the buffers that DMA engines read or write (master
weights and gradients) page-locked with ``cudaHostRegister`` on an ordinary allocation
(:class:`HostBuffer`). torch's own pinned allocator rounds every request up to a power of two,
which can waste up to half of a multi-gigabyte buffer; registering an exact-size allocation does not.

Example::

    >>> from lightning_gh.offload.superoffload_memory import host_bytes_per_param, available_host_bytes
    >>> host_bytes_per_param(speculative_backup=True)
    28
    >>> available_host_bytes() is None or available_host_bytes() > 0
    True
"""

from __future__ import annotations

import ctypes
import os
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "HostBuffer",
    "HostMemoryPlan",
    "available_host_bytes",
    "check_host_memory",
    "device_memory_room",
    "host_bytes_per_param",
]

# fp32 master weight, fp32 exp_avg, fp32 exp_avg_sq, fp32 gradient landing buffer.
STATE_BYTES = 4 + 4 + 4
GRAD_BYTES = 4
# A copy of master + both moments taken before a speculative update, so it can be undone exactly.
BACKUP_BYTES = 12


def host_bytes_per_param(speculative_backup: bool) -> int:
    """Host bytes one offloaded parameter costs: 16 (master, two moments, gradient buffer), plus 12
    when speculative updates keep an exact pre-step copy."""
    return STATE_BYTES + GRAD_BYTES + (BACKUP_BYTES if speculative_backup else 0)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    out[key.strip()] = int(parts[0]) * scale
    except OSError:
        pass
    return out


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (bytes), or ``None`` where it cannot be read."""
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    if "MemFree" in info:  # very old kernels
        return info["MemFree"] + info.get("Cached", 0)
    return None


@dataclass(frozen=True)
class HostMemoryPlan:
    """What the optimizer will allocate in host memory."""

    host_params: int
    speculative_backup: bool
    available_bytes: int | None

    @property
    def needed_bytes(self) -> int:
        return self.host_params * host_bytes_per_param(self.speculative_backup)

    def describe(self) -> str:
        gib = 2**30
        avail = "unknown" if self.available_bytes is None else f"{self.available_bytes / gib:.2f} GiB"
        backup = " + 12 B speculation backup" if self.speculative_backup else ""
        return (f"{self.host_params:,} offloaded parameters x {host_bytes_per_param(self.speculative_backup)} B "
                f"(16 B master/moments/gradient{backup}) = {self.needed_bytes / gib:.2f} GiB of host RAM; "
                f"available: {avail}")


def check_host_memory(host_params: int, speculative_backup: bool, headroom: float = 0.9) -> HostMemoryPlan:
    """Raise ``MemoryError`` naming the numbers when the host cannot hold the offloaded state.

    Args:
        host_params: parameters whose state lives in host memory.
        speculative_backup: whether exact-rollback copies are allocated too (12 B per parameter).
        headroom: the share of ``MemAvailable`` the optimizer may take.
    """
    plan = HostMemoryPlan(host_params, speculative_backup, available_host_bytes())
    if plan.available_bytes is not None and plan.needed_bytes > headroom * plan.available_bytes:
        tips = ["raise gpu_fraction (keep more parameters on the GPU)"]
        if speculative_backup:
            tips.append("speculative=False or no gradient clipping/non-finite skipping (drops the 12 B backup)")
        raise MemoryError(
            f"HeterogeneousAdamW needs {plan.describe()} (at most {headroom:.0%} of it may be used). "
            f"To fit: {'; '.join(tips)}; or pass host_memory_check=False to skip this check."
        )
    return plan


def device_memory_room(device: torch.device | str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device as this process's allocator sees them, or ``None`` for a
    device that is not CUDA (or when the driver cannot be asked).

    ``free`` is what the driver reports free (``torch.cuda.mem_get_info``), lowered to what is left under a
    ``torch.cuda.set_per_process_memory_fraction`` cap. Memory torch's caching allocator already holds is not
    counted as free: after an optimizer step it mostly holds the activations the next forward needs again.
    The optimizer's GPU tail asks this before it grows (tests replace it to simulate a small GPU).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        fraction = torch.cuda.get_per_process_memory_fraction(device) \
            if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    except (RuntimeError, AssertionError):
        return None
    if fraction < 1.0:
        free = min(free, max(0, int(fraction * total) - torch.cuda.memory_reserved(device)))
    return int(free), int(total)


class HostBuffer:
    """A flat fp32 host tensor, page-locked when CUDA is in use so copies to/from the GPU are async.

    Page-locking registers an exact-size allocation (``cudaHostRegister``); where that fails it falls
    back to torch's pinned allocator, and where that fails too it stays pageable with one warning
    (copies are then synchronous but still correct). :meth:`release` unregisters; it runs at most once.
    """

    _warned = False

    def __init__(self, numel: int, pin: bool, zero: bool = True) -> None:
        self.numel = int(numel)
        self._registered_ptr: int | None = None
        if pin and self.numel > 0 and self._pin(zero):
            return
        self.tensor = torch.zeros(self.numel, dtype=torch.float32) if zero else torch.empty(self.numel, dtype=torch.float32)

    def _pin(self, zero: bool) -> bool:
        # Register whole pages that lie inside this allocation only: two registrations that share a page
        # fail (cudaErrorHostMemoryAlreadyRegistered), and a failed runtime call would surface later as the
        # "last error" of an unrelated kernel launch.
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        nbytes = self.numel * 4
        span = -(-nbytes // page) * page
        raw = torch.empty(self.numel + 2 * page // 4, dtype=torch.float32)
        start = -(-raw.data_ptr() // page) * page
        first = (start - raw.data_ptr()) // 4
        tensor = raw[first:first + self.numel]
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
        _clear_cuda_error()
        try:
            self.tensor = torch.zeros(self.numel, dtype=torch.float32, pin_memory=True)
            return True
        except RuntimeError as e:
            _clear_cuda_error()
            if not HostBuffer._warned:
                HostBuffer._warned = True
                warnings.warn(f"HeterogeneousAdamW: could not page-lock {nbytes / 2**20:.0f} MiB of host memory "
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


def _clear_cuda_error() -> None:
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
