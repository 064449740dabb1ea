"""How offloaded bytes travel, and how the engine times its blocks.

:class:`CudaTransport` copies device->host and host->device on two side streams and orders them against the
compute stream with events (the stream choreography is in docs/activation_offload.md and in the engine's module
docstring); :class:`HostCopyTransport` makes the same calls synchronously through a host buffer on any device,
the test mode in which a CPU checks that gradients stay bitwise equal. The clocks time the blocks for the
``"auto"`` policy; :func:`host_copy_gbps` is the host-copy mode's "link".

Example::

    >>> import torch
    >>> from lightning_gh.activation_offload.transport import HostCopyTransport
    >>> tr = HostCopyTransport(torch.device("cpu"))
    >>> host = torch.empty(4, dtype=torch.uint8)
    >>> tr.to_host(torch.arange(4, dtype=torch.uint8), host, None)
    >>> dev, _ = tr.to_device(host)
    >>> dev.tolist()
    [0, 1, 2, 3]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["CudaClock", "CudaTransport", "HostClock", "HostCopyTransport", "Transport", "host_copy_gbps"]

_MIB = 2**20


class CudaTransport:
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
        # See Note [Release point of an offloaded storage].
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


class HostCopyTransport:
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


class CudaClock:
    """GPU time between two marks (CUDA events on the current stream)."""

    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, a: Any, b: Any) -> float:
        b.synchronize()
        return a.elapsed_time(b)


class HostClock:
    """Host time between two marks (the host-copy mode on a CPU)."""

    def mark(self) -> Any:
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return (b - a) * 1e3


Transport = CudaTransport | HostCopyTransport
Clock = CudaClock | HostClock


_HOST_GBPS: float | None = None


def host_copy_gbps(nbytes: int = 64 * _MIB) -> float:
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
