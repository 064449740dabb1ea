"""Copies between the host pool and the GPU for KV-cache offload, and the stream order around them.

Every KV buffer has the layout ``(batch, heads, max_length, head_dim)``: the shape attention wants, with the
sequence inside each (batch, head) row. A valid prefix ``[:, :, :n]`` or an appended range ``[:, :, a:b]`` is
then ``batch * heads`` rows of ``(b - a) * head_dim`` elements, all at one pitch, on the host and on the GPU
alike: a single ``cudaMemcpy2DAsync`` moves it, at full link speed for rows of a few hundred KiB. torch's own
``copy_`` cannot: for a strided pinned source it first makes a pageable, contiguous copy on the CPU.

Two transports share one interface, so the engine's bookkeeping is the same on any device. They are named
``KV...`` because :mod:`lightning_gh.activation_offload.transport` has transports of its own with other semantics
(whole saved tensors, two side streams); these move strided row ranges between a host pool and a ring of GPU slots
on one side stream:

* :class:`KVCudaTransport`: one side stream for all copies, in both directions. One stream orders a layer's
  append (device to host) before any later fetch of it (host to device) and a slot's last read before its
  refill, without extra events. Markers are CUDA events; the compute stream waits on the copy stream only
  where a slot is about to be read, and the copy stream waits on the compute stream only where it reads what
  compute wrote or overwrites what attention may still read.
* :class:`KVHostCopyTransport`: synchronous copies between any tensors (CPU tensors in the tests), markers are
  counters, and every copy is written to :attr:`KVHostCopyTransport.log` so that tests can check which bytes
  moved where.

Example::

    >>> import torch
    >>> t = KVHostCopyTransport()
    >>> host, slot = torch.arange(2 * 3 * 8 * 4.0).view(2, 3, 8, 4), torch.zeros(2, 3, 8, 4)
    >>> t.fetch_prefix(slot, host, 5, layer=0, slot_index=1)
    >>> torch.equal(slot[:, :, :5], host[:, :, :5]) and slot[:, :, 5:].abs().sum().item() == 0
    True
    >>> t.log[-1]
    ('h2d', 0, 1, 0, 5)
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from lightning_gh._util import warn_once

__all__ = ["KVCudaTransport", "KVHostCopyTransport", "KVTransport", "rows_geometry"]


def rows_geometry(t: torch.Tensor, start: int, stop: int) -> tuple[int, int, int, int]:
    """``(offset_bytes, width_bytes, pitch_bytes, rows)`` of ``t[:, :, start:stop]`` for a contiguous
    ``(B, H, M, D)`` tensor ``t``."""
    if t.dim() != 4 or not t.is_contiguous():
        raise ValueError(f"KV buffers must be contiguous (batch, heads, length, head_dim); got shape "
                         f"{tuple(t.shape)} with strides {t.stride()}.")
    b, h, m, d = t.shape
    isz = t.element_size()
    return start * d * isz, (stop - start) * d * isz, m * d * isz, b * h


class KVTransport:
    """The interface the engine uses (see the module docstring)."""

    kind = "abstract"

    def compute_marker(self) -> Any:
        """A marker after everything queued so far on the compute stream."""
        raise NotImplementedError

    def copy_marker(self) -> Any:
        """A marker after everything queued so far on the copy stream."""
        raise NotImplementedError

    def copy_waits(self, marker: Any) -> None:
        """Later copies start after ``marker``."""
        raise NotImplementedError

    def compute_waits(self, marker: Any) -> None:
        """Later compute starts after ``marker``."""
        raise NotImplementedError

    def fetch_prefix(self, slot: torch.Tensor, host: torch.Tensor, length: int, layer: int = -1,
                     slot_index: int = -1) -> None:
        """Copy ``host[:, :, :length]`` into ``slot[:, :, :length]`` on the copy stream."""
        raise NotImplementedError

    def append(self, host: torch.Tensor, slot: torch.Tensor, start: int, stop: int, layer: int = -1,
               slot_index: int = -1) -> None:
        """Copy ``slot[:, :, start:stop]`` into ``host[:, :, start:stop]`` on the copy stream."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until every queued copy is done."""
        raise NotImplementedError


class KVHostCopyTransport(KVTransport):
    """Synchronous copies on any device; markers are increasing integers; every copy is logged as
    ``(direction, layer, slot, start, stop)``."""

    kind = "host-copy"

    def __init__(self, log_size: int = 100_000) -> None:
        self.log: deque[tuple[str, int, int, int, int]] = deque(maxlen=log_size)
        self._clock = 0
        self.waits: deque[tuple[str, int]] = deque(maxlen=log_size)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def compute_marker(self) -> int:
        return self._tick()

    def copy_marker(self) -> int:
        return self._tick()

    def copy_waits(self, marker: Any) -> None:
        if marker is not None:
            self.waits.append(("copy", int(marker)))

    def compute_waits(self, marker: Any) -> None:
        if marker is not None:
            self.waits.append(("compute", int(marker)))

    def fetch_prefix(self, slot, host, length, layer=-1, slot_index=-1) -> None:
        rows_geometry(slot, 0, length), rows_geometry(host, 0, length)
        if length:
            slot[:, :, :length].copy_(host[:, :, :length])
        self.log.append(("h2d", layer, slot_index, 0, length))

    def append(self, host, slot, start, stop, layer=-1, slot_index=-1) -> None:
        rows_geometry(slot, start, stop), rows_geometry(host, start, stop)
        if stop > start:
            host[:, :, start:stop].copy_(slot[:, :, start:stop])
        self.log.append(("d2h", layer, slot_index, start, stop))

    def synchronize(self) -> None:
        pass


def _cudart_candidates() -> list[tuple[str, int]]:
    """Where to look for the CUDA runtime, first the copy torch already loaded (found by its soname without
    loading anything: ``RTLD_NOLOAD``), then the pip package's, then the system's."""
    noload = getattr(os, "RTLD_NOLOAD", 0)
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    out = [(n, noload | ctypes.RTLD_GLOBAL) for n in names]
    try:
        import nvidia  # the CUDA runtime of torch's pip wheels lives under nvidia/*/lib

        for root in getattr(nvidia, "__path__", []):
            out += [(str(p), ctypes.DEFAULT_MODE) for p in sorted(Path(root).glob("*/lib/libcudart.so*"))]
    except ImportError:
        pass
    return out + [(n, ctypes.DEFAULT_MODE) for n in names]


_MEMCPY2D: Callable[..., int] | None | bool = False  # False: not looked up yet


def _cuda_memcpy2d() -> Callable[..., int] | None:
    """``cudaMemcpy2DAsync`` from the CUDA runtime torch already loaded, or ``None`` where it cannot be found."""
    global _MEMCPY2D
    if _MEMCPY2D is not False:
        return _MEMCPY2D  # type: ignore[return-value]
    fn = None
    if torch.cuda.is_available():
        torch.cuda.init()  # torch loads its CUDA runtime lazily
    for name, mode in _cudart_candidates():
        try:
            lib = ctypes.CDLL(name, mode=mode)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        break
    _MEMCPY2D = fn
    return fn


_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


class KVCudaTransport(KVTransport):
    """Copies on one side stream of ``device`` with ``cudaMemcpy2DAsync``; markers are CUDA events.

    Where the runtime function cannot be found it falls back to torch's ``copy_`` (correct, but a strided
    pinned source is staged through pageable memory on the CPU) and warns once.
    """

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
        self._memcpy2d = _cuda_memcpy2d()
        if self._memcpy2d is None:
            warn_once("kv:no-memcpy2d", "OffloadedKVCache: cudaMemcpy2DAsync was not found in the loaded CUDA "
                      "runtime; KV copies fall back to torch copy_, which stages strided host reads through pageable "
                      "memory (correct, but slower).")

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def compute_marker(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self._compute_stream())
        return ev

    def copy_marker(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def copy_waits(self, marker: Any) -> None:
        if marker is not None:
            self.stream.wait_event(marker)

    def compute_waits(self, marker: Any) -> None:
        if marker is not None:
            self._compute_stream().wait_event(marker)

    def _rows(self, dst: torch.Tensor, src: torch.Tensor, start: int, stop: int) -> None:
        if stop <= start:
            return
        d_off, width, d_pitch, rows = rows_geometry(dst, start, stop)
        s_off, _, s_pitch, s_rows = rows_geometry(src, start, stop)
        if rows != s_rows or dst.shape[-1] != src.shape[-1] or dst.dtype != src.dtype:
            raise ValueError(f"KV copy between mismatched buffers {tuple(src.shape)} {src.dtype} -> "
                             f"{tuple(dst.shape)} {dst.dtype}.")
        if self._memcpy2d is None:
            with torch.cuda.stream(self.stream):
                dst[:, :, start:stop].copy_(src[:, :, start:stop], non_blocking=True)
            return
        err = self._memcpy2d(dst.data_ptr() + d_off, d_pitch, src.data_ptr() + s_off, s_pitch, width, rows,
                             _CUDA_MEMCPY_DEFAULT, self.stream.cuda_stream)
        if err != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err} copying {rows} rows of {width} "
                               f"bytes ({tuple(src.shape)} {src.device} -> {tuple(dst.shape)} {dst.device}).")

    def fetch_prefix(self, slot, host, length, layer=-1, slot_index=-1) -> None:
        self._rows(slot, host, 0, length)

    def append(self, host, slot, start, stop, layer=-1, slot_index=-1) -> None:
        self._rows(host, slot, start, stop)

    def synchronize(self) -> None:
        self.stream.synchronize()
