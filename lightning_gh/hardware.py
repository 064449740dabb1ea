"""What this machine is: one small typed object that the other parts consult instead of probing themselves.

``detect()`` is cheap (no GPU work) and cached per device; it reads the device's properties, which initialises
CUDA in this process: with Lightning's fork-based launchers (``ddp_notebook``, ``ddp_fork``) call it in the
workers, not before the Trainer starts them. ``link_bandwidth()`` measures pinned host<->device copy
bandwidth once per process (a few hundred milliseconds on a GPU) and caches it; offload policies use it
to decide how much traffic the link can hide under compute.

Example::

    >>> from lightning_gh import hardware
    >>> hw = hardware.detect()
    >>> hw.fp8_capable in (True, False)
    True
    >>> hardware.link_bandwidth() is None or hardware.link_bandwidth().h2d_gbps > 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["HardwareInfo", "LinkBandwidth", "detect", "link_bandwidth", "classify", "cpu_view"]

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores.
HOPPER_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class HardwareInfo:
    """A description of the current process's machine and device.

    Attributes:
        cuda_available: a CUDA device is usable from this process.
        device_index: the CUDA device the fields describe (``None`` without CUDA).
        gpu_name: e.g. ``"NVIDIA H200"``.
        compute_capability: e.g. ``(9, 0)``.
        gpu_memory_bytes: total device memory.
        gpu_count: visible CUDA devices.
        fp8_capable: the GPU has fp8 tensor cores (compute capability >= 8.9).
        is_hopper: compute capability 9.x.
        is_grace_hopper: an aarch64 (Grace) host with a Hopper GPU, linked by NVLink-C2C.
        link: ``"nvlink-c2c"``, ``"pcie"`` or ``None`` without CUDA.
        host_arch: ``platform.machine()``.
        cpu_count: CPUs this process may use.
        torch_version / cuda_version: the runtime versions.
    """

    cuda_available: bool
    device_index: int | None
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    gpu_memory_bytes: int | None
    gpu_count: int
    fp8_capable: bool
    is_hopper: bool
    is_grace_hopper: bool
    link: str | None
    host_arch: str
    cpu_count: int
    torch_version: str
    cuda_version: str | None

    def describe(self) -> str:
        """One line for logs and reports."""
        if not self.cuda_available:
            return f"CPU only ({self.host_arch}, {self.cpu_count} CPUs, torch {self.torch_version})"
        cc = ".".join(map(str, self.compute_capability or ()))
        mem = (self.gpu_memory_bytes or 0) / 2**30
        return (
            f"{self.gpu_count}x {self.gpu_name} (sm_{cc.replace('.', '')}, {mem:.0f} GiB, fp8 {'yes' if self.fp8_capable else 'no'}, "
            f"link {self.link}) on {self.host_arch}, {self.cpu_count} CPUs, torch {self.torch_version}, CUDA {self.cuda_version}"
        )

    def fp8_unsupported_reason(self) -> str | None:
        """Why fp8 tensor-core training cannot run here, or ``None`` when it can."""
        if not self.cuda_available:
            return "no CUDA GPU is available (fp8 needs an NVIDIA GPU with compute capability >= 8.9)"
        if not self.fp8_capable:
            cc = ".".join(map(str, self.compute_capability or ()))
            return f"{self.gpu_name} has compute capability {cc}; fp8 needs >= 8.9 (Ada, Hopper or newer)"
        return None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LinkBandwidth:
    """Measured pinned-memory copy bandwidth, in GB/s (1e9 bytes/s), median of several copies."""

    h2d_gbps: float
    d2h_gbps: float
    nbytes: int


def classify(host_arch: str, compute_capability: tuple[int, int] | None) -> dict[str, object]:
    """Derived flags from the raw facts (separate from probing so it can be tested anywhere)."""
    cc = compute_capability
    is_hopper = cc is not None and cc[0] == 9
    is_gh = is_hopper and host_arch.lower() in ("aarch64", "arm64")
    return {
        "fp8_capable": cc is not None and tuple(cc) >= FP8_MIN_CAPABILITY,
        "is_hopper": is_hopper,
        "is_grace_hopper": is_gh,
        "link": None if cc is None else ("nvlink-c2c" if is_gh else "pcie"),
    }


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def detect(device_index: int | None = None) -> HardwareInfo:
    """Describe this machine and the current (or the given) CUDA device. Cached per device index.

    Reading the device's properties initialises CUDA in this process (see the module docstring).
    """
    if torch.cuda.is_available() and device_index is None:
        device_index = torch.cuda.current_device()
    return _detect(device_index)


@functools.lru_cache(maxsize=None)
def _detect(device_index: int | None) -> HardwareInfo:
    arch = platform.machine()
    cuda = torch.cuda.is_available()
    name = cc = mem = None
    idx = None
    count = 0
    if cuda:
        count = torch.cuda.device_count()
        idx = device_index
        props = torch.cuda.get_device_properties(idx)
        name, cc, mem = props.name, (props.major, props.minor), props.total_memory
    flags = classify(arch, cc)
    return HardwareInfo(
        cuda_available=cuda,
        device_index=idx,
        gpu_name=name,
        compute_capability=cc,
        gpu_memory_bytes=mem,
        gpu_count=count,
        host_arch=arch,
        cpu_count=_cpu_count(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        **flags,
    )


def cpu_view(hw: HardwareInfo) -> HardwareInfo:
    """``hw`` as a process that trains on the CPU sees it: no GPU, no fp8, no host link."""
    return replace(hw, cuda_available=False, device_index=None, gpu_name=None, compute_capability=None,
                   gpu_memory_bytes=None, gpu_count=0, fp8_capable=False, is_hopper=False, is_grace_hopper=False,
                   link=None)


@functools.lru_cache(maxsize=None)
def link_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> LinkBandwidth | None:
    """Measure pinned host<->device copy bandwidth once (cached); ``None`` without CUDA.

    Args:
        nbytes: bytes per copy; large enough to amortise launch latency (256 MiB by default).
        repeats: timed copies per direction, after one warm-up; the median is reported.
    """
    if not torch.cuda.is_available():
        return None
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes={nbytes!r} and repeats={repeats!r} must be > 0.")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def timed(copy) -> float:
        samples = []
        with torch.cuda.stream(stream):
            copy()  # warm-up
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                copy()
                end.record(stream)
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
        return nbytes / statistics.median(samples) / 1e9

    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    del host, dev
    # Give the buffers back to the driver: the callers (offload policies) run where memory is tight.
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()
    return LinkBandwidth(h2d_gbps=h2d, d2h_gbps=d2h, nbytes=nbytes)

