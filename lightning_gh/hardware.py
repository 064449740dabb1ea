"""What this machine is: one small typed object that the other parts consult instead of probing themselves.

``detect()`` is cheap (no GPU work) and cached per device; it reads the device's properties, which initialises
CUDA in this process: with Lightning's fork-based launchers (``ddp_notebook``, ``ddp_fork``) call it in the
workers, not before the Trainer starts them. ``link_bandwidth()`` measures pinned host<->device copy
bandwidth once per process (a few copies of 256 MiB each way) and caches it; offload policies use it
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

import ctypes
import functools
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

__all__ = [
    "HardwareInfo", "LinkBandwidth", "ManagedBandwidth", "available_host_bytes", "coherent_host_memory",
    "managed_bandwidth", "managed_memory_attributes", "classify", "cpu_affinity", "cpu_flags", "cpu_siblings",
    "cpu_view", "cpus_available", "detect", "gpu_memory_room", "gpu_name", "gpu_numa_node", "host_arch",
    "link_bandwidth", "median_cuda_ms", "numa_nodes", "parse_cpulist",
]

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
        host_arch: :func:`host_arch`.
        cpu_count: CPUs this process may use.
        torch_version / cuda_version: the runtime versions.
        coherent_host_memory: the GPU reads host memory coherently through the host's page tables (Grace Hopper's
            NVLink-C2C: ``cudaDevAttrPageableMemoryAccessUsesHostPageTables``); ``False`` on PCIe GPUs, ``None``
            without CUDA or where the driver cannot be asked.
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
    coherent_host_memory: bool | None = None

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


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_affinity() -> frozenset[int] | None:
    """The CPUs this process may run on (its affinity mask), or ``None`` where the OS has no such mask."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a Linux cpulist (``/sys``'s ``"0-3,8,10-11"`` form; blank means none).

    >>> sorted(parse_cpulist("0-3,8,10-11"))
    [0, 1, 2, 3, 8, 10, 11]
    >>> parse_cpulist("\\n")
    frozenset()
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not (lo.isdigit() and (not hi or hi.isdigit())) or (hi and int(hi) < int(lo)):
            raise ValueError(f"cpulist={text!r}: {part!r} is not a CPU number or a range 'a-b' with a <= b.")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def _read_cpulist(path: str) -> frozenset[int] | None:
    try:
        with open(path) as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return None


def _cpulists(root: str, prefix: str, *rel: str, keep_empty: bool) -> dict[int, frozenset[int]]:
    """``{N: cpulist}`` of each ``<root>/<prefix><N>/<rel...>`` file that reads as a CPU list (empty ones only with
    ``keep_empty``); ``{}`` where ``root`` cannot be listed."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            cpus = _read_cpulist(os.path.join(root, name, *rel))
            if cpus is not None and (cpus or keep_empty):
                out[int(name[len(prefix):])] = cpus
    return dict(sorted(out.items()))


def numa_nodes(root: str = "/sys/devices/system/node") -> dict[int, frozenset[int]]:
    """Each NUMA node's CPUs (``node<N>/cpulist``), nodes without CPUs included; ``{}`` where the OS does not say.

    Args:
        root: where the nodes are listed (a fake tree in tests).
    """
    return _cpulists(root, "node", "cpulist", keep_empty=True)


def cpu_siblings(root: str = "/sys/devices/system/cpu") -> dict[int, frozenset[int]]:
    """Each CPU's hardware threads on the same core (``cpu<N>/topology/thread_siblings_list``, the CPU itself
    included); ``{}`` where the OS does not say.

    Args:
        root: where the CPUs are listed (a fake tree in tests).
    """
    return _cpulists(root, "cpu", "topology", "thread_siblings_list", keep_empty=False)


def gpu_numa_node(device_index: int, root: str = "/sys/bus/pci/devices") -> int | None:
    """The NUMA node the CUDA device hangs off (its PCI device's ``numa_node``), or ``None``: no CUDA, a device
    the OS does not place (``-1``, as on one-node hosts and most VMs), or nothing to read.

    Args:
        device_index: the CUDA device, as torch numbers them (after ``CUDA_VISIBLE_DEVICES``).
        root: where the PCI devices are listed (a fake tree in tests).
    """
    if not torch.cuda.is_available():
        return None
    bus_id = _pci_bus_id(int(device_index))
    return None if bus_id is None else _pci_numa_node(bus_id, root)


def _pci_bus_id(device_index: int) -> str | None:
    """The device's PCI address, ``"0000:1b:00.0"``: from torch's device properties where they carry it (a string,
    or the domain, bus and device numbers), else from the driver (``cuDeviceGetPCIBusId``)."""
    try:
        props = torch.cuda.get_device_properties(device_index)
    except (RuntimeError, AssertionError, ValueError):
        return None
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, str) and bus:
        return bus
    domain, device = getattr(props, "pci_domain_id", None), getattr(props, "pci_device_id", None)
    if all(isinstance(v, int) for v in (domain, bus, device)):
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    lib = _libcuda()
    dev, buf = ctypes.c_int(), ctypes.create_string_buffer(64)
    if lib is None or lib.cuDeviceGet(ctypes.byref(dev), device_index) != 0 \
            or lib.cuDeviceGetPCIBusId(buf, len(buf), dev) != 0:
        return None
    return buf.value.decode() or None


def _pci_numa_node(bus_id: str, root: str) -> int | None:
    # torch reports "00000000:1B:00.0" (a 32-bit domain on some drivers); sysfs names it "0000:1b:00.0".
    name = bus_id.strip().lower()
    domain, _, rest = name.partition(":")
    candidates = [name] + ([f"{domain[-4:]}:{rest}"] if len(domain) > 4 else [])
    for cand in candidates:
        try:
            with open(os.path.join(root, cand, "numa_node")) as f:
                node = int(f.read().strip())
        except (OSError, ValueError):
            continue
        return node if node >= 0 else None
    return None


def host_arch() -> str:
    """The host's architecture as the OS names it (``platform.machine()``: ``"x86_64"``, ``"aarch64"``)."""
    return platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set features the host CPU reports (``/proc/cpuinfo``'s ``flags`` on x86, ``Features`` on
    Arm: ``"avx2"``, ``"fma"``, ``"sve"``, ...), lower case; empty where the OS does not say. Cached."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(rest.lower().split())
    except OSError:
        pass
    return frozenset()


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
    """Host memory available to new allocations (``MemAvailable`` in ``/proc/meminfo``, bytes), or ``None``.

    Read fresh on every call (it changes as the run allocates); ``psutil`` is not needed.
    """
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    if "MemFree" in info:  # kernels before 3.14
        return info["MemFree"] + info.get("Cached", 0)
    return None


def gpu_memory_room(device: torch.device | str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device as this process's allocator sees them, or ``None`` for a
    device that is not CUDA (or when the driver cannot be asked).

    ``free`` is what the driver reports free (``torch.cuda.mem_get_info``), lowered to what is left under a
    ``torch.cuda.set_per_process_memory_fraction`` cap. Memory torch's caching allocator already holds is not
    counted as free: after an optimizer step it mostly holds the activations the next forward needs again.
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


def gpu_name(device: torch.device | str | int | None = None) -> str | None:
    """The CUDA device's name (``"NVIDIA H100 80GB HBM3"``), or ``None`` without CUDA or where it cannot be read.

    Args:
        device: the CUDA device (default: the current one).
    """
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError, ValueError):
        return None


def detect(device_index: int | None = None) -> HardwareInfo:
    """Describe this machine and the current (or the given) CUDA device. Cached per device index.

    Reading the device's properties initialises CUDA in this process (see the module docstring).
    """
    if torch.cuda.is_available() and device_index is None:
        device_index = torch.cuda.current_device()
    return _detect(device_index)


@functools.lru_cache(maxsize=None)
def _detect(device_index: int | None) -> HardwareInfo:
    arch = host_arch()
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
        cpu_count=cpus_available(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        coherent_host_memory=coherent_host_memory(idx) if cuda else None,
        **flags,
    )


def cpu_view(hw: HardwareInfo) -> HardwareInfo:
    """``hw`` as a process that trains on the CPU sees it: no GPU, no fp8, no host link."""
    return replace(hw, cuda_available=False, device_index=None, gpu_name=None, compute_capability=None,
                   gpu_memory_bytes=None, gpu_count=0, fp8_capable=False, is_hopper=False, is_grace_hopper=False,
                   link=None, coherent_host_memory=None)


def median_cuda_ms(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
                   stream: torch.cuda.Stream | None = None) -> float:
    """Median device time in ms of ``fn()`` between two CUDA events on ``stream`` (the current one by default),
    after ``warmup`` untimed calls (allocations, kernel selection); each timed call is waited for.

    Args:
        fn: the work to time; it launches on the stream that is current while it runs.
        repeats: timed calls.
        warmup: untimed calls first.
        stream: where the events are recorded and ``fn`` runs.

    Example::

        ms = median_cuda_ms(lambda: a @ b, repeats=10)
    """
    stream = stream if stream is not None else torch.cuda.current_stream()
    samples = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


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
        return nbytes / (median_cuda_ms(copy, repeats, stream=stream) / 1e3) / 1e9

    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    host = dev = None  # the lambdas above are done with them
    # Give the buffers back to the driver: the callers (offload policies) run where memory is tight.
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()
    return LinkBandwidth(h2d_gbps=h2d, d2h_gbps=d2h, nbytes=nbytes)


# CUDA device attributes that say how the GPU reaches host memory (cuda.h's CUdevice_attribute; the runtime's
# cudaDeviceAttr has the same values). Read from the driver (libcuda) with ctypes: no compiler, no toolkit.
_CU_ATTRIBUTES = {"managed_memory": 83, "pageable_memory_access": 88, "concurrent_managed_access": 89,
                  "pageable_uses_host_page_tables": 100, "direct_managed_access_from_host": 101}


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


@functools.lru_cache(maxsize=None)
def managed_memory_attributes(device_index: int | None = None) -> dict[str, bool] | None:
    """The CUDA device's managed-memory attributes (``managed_memory``, ``pageable_memory_access``,
    ``concurrent_managed_access``, ``pageable_uses_host_page_tables``, ``direct_managed_access_from_host``), read from
    the driver; ``None`` without CUDA or a readable driver. Cached.

    Args:
        device_index: the CUDA device (default: the current one).
    """
    if not torch.cuda.is_available():
        return None
    lib = _libcuda()
    if lib is None:
        return None
    idx = torch.cuda.current_device() if device_index is None else int(device_index)
    # The driver's ordinals follow CUDA_VISIBLE_DEVICES like the runtime's, so torch's index names the same GPU.
    dev, out = ctypes.c_int(), {}
    if lib.cuDeviceGet(ctypes.byref(dev), idx) != 0:
        return None
    for name, attr in _CU_ATTRIBUTES.items():
        v = ctypes.c_int()
        if lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev) != 0:
            return None
        out[name] = bool(v.value)
    return out


def coherent_host_memory(device_index: int | None = None) -> bool | None:
    """Whether the GPU reads host memory coherently through the host's page tables (Grace Hopper's NVLink-C2C with
    ATS); ``False`` on PCIe GPUs; ``None`` without CUDA or a readable driver.

    Args:
        device_index: the CUDA device (default: the current one).
    """
    attrs = managed_memory_attributes(device_index)
    return None if attrs is None else attrs["pageable_uses_host_page_tables"]


@dataclass(frozen=True)
class ManagedBandwidth:
    """GB/s (1e9 bytes/s) of GPU kernels on host-resident managed memory (preferred location host, accessed-by the
    GPU, so read and written in place without migration), medians of several runs.

    Attributes:
        read_gbps: a kernel reading the buffer (a sum).
        write_gbps: a kernel writing it (a fill).
        rmw_gbps: an in-place update (an add), counting bytes read plus bytes written: what an optimizer does to
            its moments.
        device_rmw_gbps: the same update on ordinary GPU memory, for reference.
        nbytes: the buffer's size.
        coherent: :func:`coherent_host_memory` of the device.
    """

    read_gbps: float
    write_gbps: float
    rmw_gbps: float
    device_rmw_gbps: float
    nbytes: int
    coherent: bool | None

    def to_dict(self) -> dict:
        return asdict(self)


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CudaArray:
    """A raw device pointer as a tensor-convertible object (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, numel: int) -> None:
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": "<f4", "data": (ptr, False), "version": 2}


@functools.lru_cache(maxsize=None)
def managed_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> ManagedBandwidth | None:
    """Measure GPU reads, writes and in-place updates of host-resident managed memory once (cached); ``None``
    without CUDA.

    The buffer is allocated with ``cudaMallocManaged`` through the driver, advised to prefer the host and to be
    accessed by the GPU, and populated on the host, so every kernel reaches it over the host link (NVLink-C2C on
    Grace Hopper, PCIe elsewhere). It is refused unless it and 512 MiB fit in the GPU's free memory: on a GPU that is
    not coherent with host memory, managed memory beyond that can hang the GPU.

    Args:
        nbytes: the buffer (a positive multiple of 4; 256 MiB by default).
        repeats: timed runs per kernel after one warm-up; the median is reported.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or nbytes % 4:
        raise ValueError(f"nbytes={nbytes!r} must be a positive multiple of 4.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats <= 0:
        raise ValueError(f"repeats={repeats!r} must be an int > 0.")
    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device()
    device = torch.device("cuda", idx)
    room = gpu_memory_room(device)
    if room is not None and nbytes + 512 * 2**20 > room[0]:
        raise ValueError(f"managed_bandwidth(nbytes={nbytes}) needs {nbytes + 512 * 2**20} bytes free on {device} "
                         f"(the buffer and 512 MiB); {room[0]} are free. Pass a smaller nbytes.")
    lib = _libcuda()
    if lib is None:
        return None
    ref = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # also makes torch's context current here
    stream = torch.cuda.current_stream(device)
    try:  # the location forms of advice and prefetch: drivers of CUDA 12.2 and newer
        advise, prefetch, free = lib.cuMemAdvise_v2, lib.cuMemPrefetchAsync_v2, lib.cuMemFree_v2
    except AttributeError:
        return None
    advise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _CUmemLocation]
    prefetch.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _CUmemLocation, ctypes.c_uint, ctypes.c_void_p]
    free.argtypes = [ctypes.c_uint64]
    host, gpu = _CUmemLocation(2, 0), _CUmemLocation(1, idx)  # CU_MEM_LOCATION_TYPE_HOST / _DEVICE
    ptr = ctypes.c_uint64()
    if lib.cuMemAllocManaged(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 1) != 0:  # CU_MEM_ATTACH_GLOBAL
        return None
    try:
        # 3: CU_MEM_ADVISE_SET_PREFERRED_LOCATION, 5: CU_MEM_ADVISE_SET_ACCESSED_BY
        if (advise(ptr.value, nbytes, 3, host) or advise(ptr.value, nbytes, 5, gpu)
                or prefetch(ptr.value, nbytes, host, 0, stream.cuda_stream)):
            return None
        buf = torch.as_tensor(_CudaArray(ptr.value, nbytes // 4), device=device)
        buf.fill_(1.0)

        def gbps(fn, moved: int) -> float:
            return moved / (median_cuda_ms(fn, repeats, stream=stream) / 1e3) / 1e9

        result = ManagedBandwidth(
            read_gbps=gbps(lambda: buf.sum(), nbytes), write_gbps=gbps(lambda: buf.fill_(1.0), nbytes),
            rmw_gbps=gbps(lambda: buf.add_(1.0), 2 * nbytes), device_rmw_gbps=gbps(lambda: ref.add_(1.0), 2 * nbytes),
            nbytes=nbytes, coherent=coherent_host_memory(idx))
        buf = None
    finally:
        torch.cuda.synchronize(device)
        free(ptr.value)
    ref = None
    torch.cuda.empty_cache()
    return result
