"""The allocator shim: a small C++ library over the CUDA runtime that PyTorch's ``CUDAPluggableAllocator`` calls,
built on first use and cached per machine.

PyTorch allocates with ``cudaMalloc``; a ``torch.cuda.MemPool`` can instead take its segments from any pair of C
functions ``void* alloc(ssize_t size, int device, cudaStream_t stream)`` / ``void free(void* ptr, ssize_t size,
int device, cudaStream_t stream)``. The shim's pair, ``lgh_managed_malloc`` / ``lgh_managed_free``, allocates with
``cudaMallocManaged``, applies the calling thread's advice (preferred location host or GPU, accessed-by GPU),
populates the pages at the preferred location, and runs the safety guard (:mod:`lightning_gh.unified.guard`)
*before* ``cudaMallocManaged``. A refused or failed allocation returns NULL, which PyTorch turns into an
out-of-memory error; the shim keeps the reason (per thread) so that :func:`~lightning_gh.unified.pool.managed_memory`
can raise a :class:`~lightning_gh.unified.guard.ManagedMemoryError` that says what happened. Advice, prefetch,
pointer queries and device attributes are exported for ``ctypes``.

CUDA 13 changed ``cudaMemAdvise`` and ``cudaMemPrefetchAsync`` to take a ``cudaMemLocation`` (and the prefetch a
flags word); CUDA 12 took an int device with ``cudaCpuDeviceId`` for the host. The source handles both with
``#if CUDART_VERSION >= 13000``.

Building: with a C++ compiler (``$CXX``, ``g++``, ``c++``, ``clang++``) against CUDA runtime headers and a
``libcudart`` of the same major version, else with ``nvcc``. Headers are looked for under ``$LGH_CUDA_HOME``,
``$CUDA_HOME``, ``$CUDA_PATH``, nvcc's toolkit, ``/usr/local/cuda*`` and PyTorch's ``nvidia`` runtime wheels; the
library torch itself loaded is preferred, so there is one CUDA runtime in the process. The ``.so`` lands in
``$LGH_CACHE_DIR`` (default ``~/.cache/lightning_gh``) under a hash of the source, the headers' version, the
library and the architecture; concurrent builds (DDP ranks) each write a temporary file and rename it.
Nothing here runs at import time.

Example::

    >>> from lightning_gh.unified import shim
    >>> "lgh_managed_malloc" in shim.SOURCE
    True
    >>> lib = shim.load()          # doctest: +SKIP
    >>> lib.guard_refuses(8 << 30, 10 << 30, 4 << 30, 0, coherent=False, allow_oversubscription=False)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gh.unified.guard import ManagedMemoryUnavailable

__all__ = ["SOURCE", "Refusal", "Shim", "Toolchain", "build", "cache_dir", "find_toolchain", "load"]

SOURCE = r"""
// lightning_gh managed-memory allocator shim (see lightning_gh/unified/shim.py).
#include <cuda_runtime_api.h>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <sys/types.h>

#define LGH_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxDevices = 64;

// What the calling thread's allocations get. Set from Python (lgh_set_config) when a managed_memory() scope is
// entered: PyTorch's caching allocator calls the allocator on the thread that asked for the tensor.
struct Config {
  int prefer_host;                // 1: preferred location host memory, 0: the allocating GPU
  int accessed_by;                // 1: cudaMemAdviseSetAccessedBy the allocating GPU
  int allow_oversubscription;     // 1: lift the guard (honoured only where the GPU is coherent)
  unsigned long long headroom;    // GPU bytes the guard keeps free beyond the managed bytes
  int populate;                   // 1: prefetch new pages to the preferred location at once
};

// Why the calling thread's last allocation returned NULL.
// kind: 1 guard refused, 2 cudaMallocManaged failed, 3 advice/prefetch failed, 4 cudaMemGetInfo failed, 5 bad args
struct Refusal {
  long long request, free_bytes, total_bytes, live, headroom;
  int device, cuda_error, coherent, kind;
};

thread_local Config t_config = {1, 1, 0, 512ull << 20, 1};
thread_local Refusal t_refusal = {};
thread_local int t_has_refusal = 0;

// One guard check + allocation at a time: two threads must not both pass the guard on the same free bytes.
std::mutex g_mutex;
unsigned long long g_live[kMaxDevices] = {};
unsigned long long g_peak[kMaxDevices] = {};
unsigned long long g_allocs[kMaxDevices] = {};
unsigned long long g_frees[kMaxDevices] = {};
unsigned long long g_refusals[kMaxDevices] = {};
int g_coherent[kMaxDevices];
std::once_flag g_init;

void init_globals() { for (int i = 0; i < kMaxDevices; ++i) g_coherent[i] = -1; }

int coherent_of(int device) {
  std::call_once(g_init, init_globals);
  if (g_coherent[device] < 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccessUsesHostPageTables, device) != cudaSuccess) {
      cudaGetLastError();
      v = 0;  // unknown counts as not coherent: the safe side
    }
    g_coherent[device] = v ? 1 : 0;
  }
  return g_coherent[device];
}

// location < 0: host; otherwise a device ordinal.
#if CUDART_VERSION >= 13000
cudaMemLocation make_location(int location) {
  cudaMemLocation loc;
  if (location < 0) { loc.type = cudaMemLocationTypeHost; loc.id = 0; }
  else { loc.type = cudaMemLocationTypeDevice; loc.id = location; }
  return loc;
}
cudaError_t do_advise(const void* p, size_t n, cudaMemoryAdvise a, int location) {
  return cudaMemAdvise(p, n, a, make_location(location));
}
cudaError_t do_prefetch(const void* p, size_t n, int location, cudaStream_t s) {
  return cudaMemPrefetchAsync(p, n, make_location(location), 0, s);
}
#else
cudaError_t do_advise(const void* p, size_t n, cudaMemoryAdvise a, int location) {
  return cudaMemAdvise(p, n, a, location < 0 ? cudaCpuDeviceId : location);
}
cudaError_t do_prefetch(const void* p, size_t n, int location, cudaStream_t s) {
  return cudaMemPrefetchAsync(p, n, location < 0 ? cudaCpuDeviceId : location, s);
}
#endif

void refuse(int kind, long long request, int device, cudaError_t err, size_t free_b, size_t total_b,
            unsigned long long live, unsigned long long headroom, int coherent) {
  t_refusal.request = request;
  t_refusal.free_bytes = (long long)free_b;
  t_refusal.total_bytes = (long long)total_b;
  t_refusal.live = (long long)live;
  t_refusal.headroom = (long long)headroom;
  t_refusal.device = device;
  t_refusal.cuda_error = (int)err;
  t_refusal.coherent = coherent;
  t_refusal.kind = kind;
  t_has_refusal = 1;
}

}  // namespace

// The guard (lightning_gh.unified.guard.guard_refuses computes the same). Overflow-safe.
LGH_API int lgh_guard_refuses(unsigned long long request, unsigned long long free_bytes, unsigned long long live,
                              unsigned long long headroom, int coherent, int allow_oversubscription) {
  if (allow_oversubscription && coherent) return 0;
  if (request > free_bytes) return 1;
  unsigned long long room = free_bytes - request;
  if (live > room) return 1;
  room -= live;
  return headroom > room ? 1 : 0;
}

LGH_API void* lgh_managed_malloc(ssize_t size, int device, cudaStream_t stream) {
  t_has_refusal = 0;
  if (size <= 0 || device < 0 || device >= kMaxDevices) {
    refuse(5, (long long)size, device, cudaErrorInvalidValue, 0, 0, 0, 0, 0);
    return nullptr;
  }
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device) cudaSetDevice(device);
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const Config c = t_config;
    const int coherent = coherent_of(device);
    const unsigned long long live = g_live[device];
    size_t free_b = 0, total_b = 0;
    cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
    if (err != cudaSuccess) {
      refuse(4, (long long)size, device, err, 0, 0, live, c.headroom, coherent);
    } else if (lgh_guard_refuses((unsigned long long)size, free_b, live, c.headroom, coherent,
                                 c.allow_oversubscription)) {
      // Refused before cudaMallocManaged: nothing was allocated.
      g_refusals[device] += 1;
      refuse(1, (long long)size, device, cudaSuccess, free_b, total_b, live, c.headroom, coherent);
    } else {
      err = cudaMallocManaged(&ptr, (size_t)size, cudaMemAttachGlobal);
      if (err != cudaSuccess) {
        ptr = nullptr;
        refuse(2, (long long)size, device, err, free_b, total_b, live, c.headroom, coherent);
      } else {
        const int where = c.prefer_host ? -1 : device;
        err = do_advise(ptr, (size_t)size, cudaMemAdviseSetPreferredLocation, where);
        if (err == cudaSuccess && c.accessed_by)
          err = do_advise(ptr, (size_t)size, cudaMemAdviseSetAccessedBy, device);
        if (err == cudaSuccess && c.populate) {
          // Touch nothing during a stream capture: a prefetch cannot be captured.
          cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
          if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) { cudaGetLastError(); status = cudaStreamCaptureStatusNone; }
          if (status == cudaStreamCaptureStatusNone) err = do_prefetch(ptr, (size_t)size, where, stream);
        }
        if (err != cudaSuccess) {
          cudaFree(ptr);
          ptr = nullptr;
          refuse(3, (long long)size, device, err, free_b, total_b, live, c.headroom, coherent);
        } else {
          g_live[device] += (unsigned long long)size;
          if (g_live[device] > g_peak[device]) g_peak[device] = g_live[device];
          g_allocs[device] += 1;
        }
      }
    }
  }
  // PyTorch checks cudaGetLastError() before its next allocation: leave no error of ours behind.
  if (ptr == nullptr) cudaGetLastError();
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
  return ptr;
}

LGH_API void lgh_managed_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)stream;
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  // cudaFree synchronises the device, so no kernel still reads the pages given back. At interpreter exit the
  // runtime may already be gone; the error is dropped.
  if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
  if (device >= 0 && device < kMaxDevices) {
    const unsigned long long n = size > 0 ? (unsigned long long)size : 0ull;
    g_live[device] = g_live[device] > n ? g_live[device] - n : 0ull;
    g_frees[device] += 1;
  }
}

LGH_API void lgh_set_config(int prefer_host, int accessed_by, int allow_oversubscription,
                            unsigned long long headroom, int populate) {
  t_config.prefer_host = prefer_host ? 1 : 0;
  t_config.accessed_by = accessed_by ? 1 : 0;
  t_config.allow_oversubscription = allow_oversubscription ? 1 : 0;
  t_config.headroom = headroom;
  t_config.populate = populate ? 1 : 0;
}

LGH_API void lgh_get_config(long long* out) {
  out[0] = t_config.prefer_host;
  out[1] = t_config.accessed_by;
  out[2] = t_config.allow_oversubscription;
  out[3] = (long long)t_config.headroom;
  out[4] = t_config.populate;
}

LGH_API int lgh_last_refusal(long long* out) {
  out[0] = t_refusal.request; out[1] = t_refusal.free_bytes; out[2] = t_refusal.total_bytes;
  out[3] = t_refusal.live; out[4] = t_refusal.headroom; out[5] = t_refusal.device;
  out[6] = t_refusal.cuda_error; out[7] = t_refusal.coherent; out[8] = t_refusal.kind;
  return t_has_refusal;
}

LGH_API void lgh_clear_refusal(void) { t_has_refusal = 0; }

LGH_API int lgh_stats(int device, unsigned long long* out) {
  if (device < 0 || device >= kMaxDevices) return -1;
  std::lock_guard<std::mutex> lock(g_mutex);
  out[0] = g_live[device]; out[1] = g_peak[device]; out[2] = g_allocs[device];
  out[3] = g_frees[device]; out[4] = g_refusals[device];
  return 0;
}

LGH_API void lgh_reset_peak(int device) {
  if (device < 0 || device >= kMaxDevices) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_peak[device] = g_live[device];
}

// advice: 0 set preferred location, 1 unset it, 2 set accessed-by, 3 unset it, 4 set read-mostly, 5 unset it.
LGH_API int lgh_advise(void* ptr, unsigned long long size, int advice, int location) {
  static const cudaMemoryAdvise table[6] = {
      cudaMemAdviseSetPreferredLocation, cudaMemAdviseUnsetPreferredLocation, cudaMemAdviseSetAccessedBy,
      cudaMemAdviseUnsetAccessedBy, cudaMemAdviseSetReadMostly, cudaMemAdviseUnsetReadMostly};
  if (advice < 0 || advice > 5) return (int)cudaErrorInvalidValue;
  cudaError_t err = do_advise(ptr, (size_t)size, table[advice], location);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

LGH_API int lgh_prefetch(void* ptr, unsigned long long size, int location, void* stream) {
  cudaError_t err = do_prefetch(ptr, (size_t)size, location, (cudaStream_t)stream);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

// kind: 0 unregistered host memory, 1 pinned host, 2 device, 3 managed.
LGH_API int lgh_pointer_kind(void* ptr, int* kind, int* device) {
  cudaPointerAttributes a;
  cudaError_t err = cudaPointerGetAttributes(&a, ptr);
  if (err != cudaSuccess) { cudaGetLastError(); return (int)err; }
  *kind = (int)a.type;
  *device = a.device;
  return 0;
}

// The preferred location (device ordinal, -1 host, -2 none or mixed) and the last prefetch location of a range.
LGH_API int lgh_range_locations(void* ptr, unsigned long long size, int* preferred, int* last_prefetch) {
  cudaError_t err = cudaMemRangeGetAttribute(preferred, sizeof(int), cudaMemRangeAttributePreferredLocation, ptr,
                                             (size_t)size);
  if (err == cudaSuccess)
    err = cudaMemRangeGetAttribute(last_prefetch, sizeof(int), cudaMemRangeAttributeLastPrefetchLocation, ptr,
                                   (size_t)size);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

// managed memory, concurrent managed access, pageable memory access, pageable access uses host page tables,
// direct managed access from host.
LGH_API int lgh_device_info(int device, int* out) {
  const cudaDeviceAttr attrs[5] = {cudaDevAttrManagedMemory, cudaDevAttrConcurrentManagedAccess,
                                   cudaDevAttrPageableMemoryAccess, cudaDevAttrPageableMemoryAccessUsesHostPageTables,
                                   cudaDevAttrDirectManagedMemAccessFromHost};
  for (int i = 0; i < 5; ++i) {
    cudaError_t err = cudaDeviceGetAttribute(&out[i], attrs[i], device);
    if (err != cudaSuccess) { cudaGetLastError(); return (int)err; }
  }
  return 0;
}

LGH_API int lgh_runtime_version(int* compiled, int* runtime) {
  *compiled = CUDART_VERSION;
  cudaError_t err = cudaRuntimeGetVersion(runtime);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

LGH_API const char* lgh_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
"""

_LIB_NAME = "liblgh_managed.so"
_lock = threading.Lock()
_loaded: Shim | None = None
_load_error: ManagedMemoryUnavailable | None = None


@dataclass(frozen=True)
class Toolchain:
    """How the shim gets built.

    Attributes:
        kind: ``"c++"`` (a host compiler against the CUDA headers) or ``"nvcc"``.
        compiler: the compiler's path.
        include_dir: the folder holding ``cuda_runtime_api.h`` (``""`` for nvcc, which knows its own).
        cudart: the ``libcudart`` shared library linked against (``""`` for nvcc: its own, dynamically).
        cuda_version: ``CUDART_VERSION`` of the headers (13000 for CUDA 13.0).
    """

    kind: str
    compiler: str
    include_dir: str
    cudart: str
    cuda_version: int

    def key(self) -> str:
        h = hashlib.sha256()
        for part in (SOURCE, self.kind, self.compiler, self.include_dir, self.cudart, str(self.cuda_version),
                     platform.machine(), sys.platform):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where built shims are kept: ``$LGH_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_gh``, else
    ``~/.cache/lightning_gh``."""
    env = os.environ.get("LGH_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_gh"


def _header_version(include_dir: str) -> int | None:
    try:
        text = Path(include_dir, "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) if m else None


def _cuda_homes() -> list[str]:
    homes = [os.environ.get(k, "") for k in ("LGH_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    homes += ["/usr/local/cuda", "/opt/cuda"]
    homes += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    out: list[str] = []
    for h in homes:
        if h and os.path.isdir(h) and os.path.realpath(h) not in {os.path.realpath(o) for o in out}:
            out.append(h)
    return out


def _wheel_roots() -> list[str]:
    """The ``nvidia`` folders of pip's CUDA wheels next to torch (``nvidia/cu13``, ``nvidia/cuda_runtime``)."""
    roots: list[str] = []
    bases: list[str] = []
    try:
        bases += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    bases += [p for p in sys.path if p.endswith("site-packages")]
    try:
        import torch

        bases.append(os.path.dirname(os.path.dirname(torch.__file__)))
    except ImportError:
        pass
    for b in dict.fromkeys(bases):
        for sub in sorted(glob.glob(os.path.join(b, "nvidia", "cu[0-9]*")), reverse=True) + \
                [os.path.join(b, "nvidia", "cuda_runtime")]:
            if os.path.isdir(sub):
                roots.append(sub)
    return roots


def _include_dirs() -> list[str]:
    cands: list[str] = []
    for home in _cuda_homes():
        cands += [os.path.join(home, "include")]
        cands += sorted(glob.glob(os.path.join(home, "targets", "*", "include")))
    cands += [os.path.join(r, "include") for r in _wheel_roots()]
    return [c for c in dict.fromkeys(cands) if os.path.isfile(os.path.join(c, "cuda_runtime_api.h"))]


def _loaded_cudart(major: int | None) -> str | None:
    """The path of the ``libcudart`` this process already loaded (PyTorch's), via ``dlopen(RTLD_NOLOAD)`` + ``dladdr``."""
    if major is None:
        return None
    RTLD_NOLOAD = 4
    try:
        lib = ctypes.CDLL(f"libcudart.so.{major}", mode=RTLD_NOLOAD | getattr(os, "RTLD_GLOBAL", 0))
    except OSError:
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        libdl = ctypes.CDLL(None)
        if not hasattr(libdl, "dladdr"):  # glibc < 2.34 keeps it in libdl
            libdl = ctypes.CDLL("libdl.so.2")
        info = DlInfo()
        addr = ctypes.cast(lib.cudaRuntimeGetVersion, ctypes.c_void_p)
        if libdl.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            path = os.fsdecode(info.dli_fname)
            return path if os.path.isfile(path) else None
    except (AttributeError, OSError):
        return None
    return None


def _cudart_candidates(include_dir: str, major: int) -> list[str]:
    root = os.path.dirname(include_dir)
    dirs = [os.path.join(root, d) for d in ("lib64", "lib", os.path.join("lib", "x64"))]
    dirs += sorted(glob.glob(os.path.join(root, "targets", "*", "lib")))
    out = []
    for d in dirs:
        for name in (f"libcudart.so.{major}", "libcudart.so"):
            p = os.path.join(d, name)
            if os.path.isfile(p):
                out.append(p)
    return out


def _torch_cuda_major() -> int | None:
    try:
        import torch

        v = torch.version.cuda
    except ImportError:
        return None
    return int(v.split(".")[0]) if v else None


def find_toolchain() -> Toolchain:
    """Find a way to build the shim, preferring one that links the CUDA runtime PyTorch already uses.

    Raises:
        ManagedMemoryUnavailable: naming what is missing (compiler, headers, ``libcudart``) and where it looked.
    """
    want = _torch_cuda_major()
    includes = _include_dirs()
    # Headers of the runtime's own major version first: the exported symbols are versioned per major.
    includes.sort(key=lambda d: 0 if want is not None and (_header_version(d) or 0) // 1000 == want else 1)
    compilers = [c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c]
    cxx = next((shutil.which(c) for c in compilers if shutil.which(c)), None)
    problems: list[str] = []
    if cxx is None:
        problems.append(f"no C++ compiler (looked for {', '.join(compilers)} on PATH)")
    if not includes:
        problems.append("no CUDA runtime headers (cuda_runtime_api.h) under $LGH_CUDA_HOME, $CUDA_HOME, $CUDA_PATH, "
                        "nvcc's toolkit, /usr/local/cuda* or torch's nvidia-cuda-runtime wheel")
    if cxx is not None:
        for inc in includes:
            version = _header_version(inc)
            if version is None:
                continue
            major = version // 1000
            libs = ([p] if (p := _loaded_cudart(major)) else []) + _cudart_candidates(inc, major)
            if libs:
                return Toolchain("c++", cxx, inc, libs[0], version)
        if includes:
            problems.append(f"no libcudart.so of the headers' major version next to {', '.join(includes)} "
                            "(and none loaded by torch)")
    for home in _cuda_homes():
        nvcc = os.path.join(home, "bin", "nvcc")
        inc = os.path.join(home, "include")
        version = _header_version(inc)
        if os.path.isfile(nvcc) and version is not None:
            return Toolchain("nvcc", nvcc, inc, "", version)
    problems.append("no nvcc (looked in the CUDA homes above and on PATH)")
    raise ManagedMemoryUnavailable(
        "managed memory needs a small allocator shim compiled on first use, and it cannot be built here: "
        + "; ".join(problems) + ". Install a C++ compiler and the CUDA toolkit (or the nvidia-cuda-runtime wheel "
        "with headers), or point $CUDA_HOME at a toolkit.")


def _compile_command(tc: Toolchain, src: Path, out: Path) -> list[str]:
    if tc.kind == "nvcc":
        return [tc.compiler, "-shared", "-O2", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "shared",
                "-o", str(out), str(src)]
    libdir = os.path.dirname(tc.cudart)
    # Link the very libcudart file (its soname, e.g. libcudart.so.13, becomes the dependency) and find it again at
    # load time through the rpath, in case its folder is not on the loader's path.
    return [tc.compiler, "-shared", "-fPIC", "-O2", "-std=c++17", f"-I{tc.include_dir}", "-o", str(out), str(src),
            tc.cudart, f"-Wl,-rpath,{libdir}"]


def build(toolchain: Toolchain | None = None, *, force: bool = False) -> Path:
    """Build the shim (or find it in the cache) and return the path of the ``.so``.

    Args:
        toolchain: how to build it (default: :func:`find_toolchain`).
        force: rebuild even when the cache has it.

    Raises:
        ManagedMemoryUnavailable: no toolchain, or the compiler failed (its output is in the message and in
            ``build.log`` next to where the library would be).
    """
    tc = toolchain or find_toolchain()
    folder = cache_dir() / f"unified-{tc.key()}"
    out = folder / _LIB_NAME
    if out.is_file() and not force:
        return out
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ManagedMemoryUnavailable(f"cannot create the shim cache folder {folder} ({e}); set $LGH_CACHE_DIR to a "
                                       "writable folder") from None
    src = folder / f"lgh_managed.{os.getpid()}.cpp"
    tmp = folder / f".{_LIB_NAME}.{os.getpid()}.tmp"
    src.write_text(SOURCE)
    cmd = _compile_command(tc, src, tmp)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ManagedMemoryUnavailable(f"building the managed-memory shim failed to run {cmd[0]}: {e}") from None
    finally:
        src.unlink(missing_ok=True)
    log = f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    (folder / "build.log").write_text(log)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise ManagedMemoryUnavailable(
            f"building the managed-memory shim with {tc.kind} ({tc.compiler}, CUDA headers {tc.cuda_version} in "
            f"{tc.include_dir or 'nvcc'}) failed with exit code {proc.returncode}:\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent build (another rank) renames an identical file
    return out


@dataclass(frozen=True)
class Refusal:
    """Why the calling thread's last managed allocation returned NULL (read from the shim).

    Attributes:
        kind: ``"guard"`` (refused by the safety guard, nothing allocated), ``"malloc"`` (``cudaMallocManaged``
            failed), ``"advice"`` (advice or the populating prefetch failed; the memory was given back),
            ``"meminfo"`` (``cudaMemGetInfo`` failed), ``"arguments"`` (size <= 0 or a bad device).
        request, free_bytes, total_bytes, live_bytes, headroom_bytes: the numbers the decision used.
        device: the CUDA device.
        cuda_error: the CUDA error code (0 for a guard refusal) and its text.
        coherent: whether the shim found the GPU coherent with host memory.
    """

    kind: str
    request: int
    free_bytes: int
    total_bytes: int
    live_bytes: int
    headroom_bytes: int
    device: int
    cuda_error: int
    cuda_error_text: str
    coherent: bool


_KINDS = {1: "guard", 2: "malloc", 3: "advice", 4: "meminfo", 5: "arguments"}
_ADVICE = {"set_preferred": 0, "unset_preferred": 1, "set_accessed_by": 2, "unset_accessed_by": 3,
           "set_read_mostly": 4, "unset_read_mostly": 5}


class Shim:
    """Typed ``ctypes`` access to a built shim.

    Args:
        path: the ``.so`` (from :func:`build`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        lib = ctypes.CDLL(self.path)
        u64, i32, vp = ctypes.c_ulonglong, ctypes.c_int, ctypes.c_void_p
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "lgh_guard_refuses": (i32, [u64, u64, u64, u64, i32, i32]),
            "lgh_set_config": (None, [i32, i32, i32, u64, i32]),
            "lgh_get_config": (None, [ctypes.POINTER(ctypes.c_longlong)]),
            "lgh_last_refusal": (i32, [ctypes.POINTER(ctypes.c_longlong)]),
            "lgh_clear_refusal": (None, []),
            "lgh_stats": (i32, [i32, ctypes.POINTER(u64)]),
            "lgh_reset_peak": (None, [i32]),
            "lgh_advise": (i32, [vp, u64, i32, i32]),
            "lgh_prefetch": (i32, [vp, u64, i32, vp]),
            "lgh_pointer_kind": (i32, [vp, ctypes.POINTER(i32), ctypes.POINTER(i32)]),
            "lgh_range_locations": (i32, [vp, u64, ctypes.POINTER(i32), ctypes.POINTER(i32)]),
            "lgh_device_info": (i32, [i32, ctypes.POINTER(i32)]),
            "lgh_runtime_version": (i32, [ctypes.POINTER(i32), ctypes.POINTER(i32)]),
            "lgh_error_string": (ctypes.c_char_p, [i32]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self._lib = lib

    # ------------------------------------------------------------------ pure
    def guard_refuses(self, request: int, free_bytes: int, live_bytes: int, headroom_bytes: int, *, coherent: bool,
                      allow_oversubscription: bool) -> bool:
        """The C guard, for checking it against :func:`lightning_gh.unified.guard.guard_refuses`."""
        return bool(self._lib.lgh_guard_refuses(request, free_bytes, live_bytes, headroom_bytes, int(bool(coherent)),
                                                int(bool(allow_oversubscription))))

    def error_text(self, err: int) -> str:
        s = self._lib.lgh_error_string(int(err))
        return s.decode(errors="replace") if s else f"CUDA error {err}"

    def runtime_version(self) -> tuple[int, int | None]:
        """``(CUDART_VERSION compiled against, cudaRuntimeGetVersion() or None without a driver)``."""
        compiled, runtime = ctypes.c_int(), ctypes.c_int()
        err = self._lib.lgh_runtime_version(ctypes.byref(compiled), ctypes.byref(runtime))
        return compiled.value, (runtime.value if err == 0 else None)

    # ------------------------------------------------------------------ the allocator's per-thread settings
    def set_config(self, *, prefer_host: bool, accessed_by: bool, allow_oversubscription: bool, headroom_bytes: int,
                   populate: bool = True) -> None:
        self._lib.lgh_set_config(int(prefer_host), int(accessed_by), int(allow_oversubscription), int(headroom_bytes),
                                 int(populate))

    def get_config(self) -> dict[str, int]:
        out = (ctypes.c_longlong * 5)()
        self._lib.lgh_get_config(out)
        return dict(zip(("prefer_host", "accessed_by", "allow_oversubscription", "headroom_bytes", "populate"), out))

    def last_refusal(self) -> Refusal | None:
        out = (ctypes.c_longlong * 9)()
        if not self._lib.lgh_last_refusal(out):
            return None
        v = list(out)
        return Refusal(kind=_KINDS.get(int(v[8]), "unknown"), request=v[0], free_bytes=v[1], total_bytes=v[2],
                       live_bytes=v[3], headroom_bytes=v[4], device=int(v[5]), cuda_error=int(v[6]),
                       cuda_error_text=self.error_text(int(v[6])) if v[6] else "", coherent=bool(v[7]))

    def clear_refusal(self) -> None:
        self._lib.lgh_clear_refusal()

    def stats(self, device: int) -> dict[str, int]:
        """``live_bytes`` (managed bytes held now, every pool of this process on ``device``), ``peak_bytes``,
        ``allocations``, ``frees``, ``refusals``."""
        out = (ctypes.c_ulonglong * 5)()
        if self._lib.lgh_stats(int(device), out) != 0:
            raise ValueError(f"device={device!r} is not a CUDA device ordinal the shim tracks (0..63).")
        return dict(zip(("live_bytes", "peak_bytes", "allocations", "frees", "refusals"), (int(x) for x in out)))

    def reset_peak(self, device: int) -> None:
        self._lib.lgh_reset_peak(int(device))

    # ------------------------------------------------------------------ advice, prefetch, queries
    def advise(self, ptr: int, nbytes: int, advice: str, location: int) -> int:
        """``cudaMemAdvise``; ``advice`` one of ``set_preferred``, ``unset_preferred``, ``set_accessed_by``,
        ``unset_accessed_by``, ``set_read_mostly``, ``unset_read_mostly``; ``location`` -1 host or a device.
        Returns the CUDA error code (0 on success)."""
        return int(self._lib.lgh_advise(ctypes.c_void_p(ptr), int(nbytes), _ADVICE[advice], int(location)))

    def prefetch(self, ptr: int, nbytes: int, location: int, stream: int) -> int:
        """``cudaMemPrefetchAsync`` to ``location`` (-1 host) on the CUDA stream handle ``stream``; error code."""
        return int(self._lib.lgh_prefetch(ctypes.c_void_p(ptr), int(nbytes), int(location), ctypes.c_void_p(stream)))

    def pointer_kind(self, ptr: int) -> tuple[str, int]:
        """``("managed" | "device" | "host" | "unregistered", device)`` from ``cudaPointerGetAttributes``."""
        kind, dev = ctypes.c_int(), ctypes.c_int()
        err = self._lib.lgh_pointer_kind(ctypes.c_void_p(ptr), ctypes.byref(kind), ctypes.byref(dev))
        if err != 0:
            raise RuntimeError(f"cudaPointerGetAttributes failed: {self.error_text(err)}")
        return {0: "unregistered", 1: "host", 2: "device", 3: "managed"}.get(kind.value, "unknown"), dev.value

    def range_locations(self, ptr: int, nbytes: int) -> tuple[int, int]:
        """``(preferred location, last prefetch location)`` of a managed range: a device ordinal, -1 for the host,
        -2 for none (or mixed)."""
        pref, last = ctypes.c_int(), ctypes.c_int()
        err = self._lib.lgh_range_locations(ctypes.c_void_p(ptr), int(nbytes), ctypes.byref(pref), ctypes.byref(last))
        if err != 0:
            raise RuntimeError(f"cudaMemRangeGetAttribute failed: {self.error_text(err)}")
        return pref.value, last.value

    def device_info(self, device: int) -> dict[str, bool]:
        """The device's managed-memory attributes (``cudaDeviceGetAttribute``)."""
        out = (ctypes.c_int * 5)()
        err = self._lib.lgh_device_info(int(device), out)
        if err != 0:
            raise RuntimeError(f"cudaDeviceGetAttribute failed for device {device}: {self.error_text(err)}")
        names = ("managed_memory", "concurrent_managed_access", "pageable_memory_access",
                 "pageable_uses_host_page_tables", "direct_managed_access_from_host")
        return {n: bool(v) for n, v in zip(names, out)}


def load(*, force_build: bool = False) -> Shim:
    """The process's shim: built (or taken from the cache) and loaded once; later calls return the same object.

    Raises:
        ManagedMemoryUnavailable: it cannot be built or loaded here (the same error again on later calls).
    """
    global _loaded, _load_error
    with _lock:
        if _loaded is not None and not force_build:
            return _loaded
        if _load_error is not None and not force_build:
            raise _load_error
        try:
            path = build(force=force_build)
            _loaded = Shim(path)
        except ManagedMemoryUnavailable as e:
            _load_error = e
            raise
        except OSError as e:
            _load_error = ManagedMemoryUnavailable(f"the managed-memory shim was built but cannot be loaded: {e}")
            raise _load_error from None
        return _loaded
