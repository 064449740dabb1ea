"""The allocator shim: a small C++ library over the CUDA runtime that PyTorch's ``CUDAPluggableAllocator`` calls,
built on first use and cached per machine.

PyTorch allocates with ``cudaMalloc``; a ``torch.cuda.MemPool`` can instead take its segments from any pair of C
functions ``void* alloc(ssize_t size, int device, cudaStream_t stream)`` / ``void free(void* ptr, ssize_t size,
int device, cudaStream_t stream)``. The shim's pair, ``lgh_managed_malloc`` / ``lgh_managed_free``, allocates with
``cudaMallocManaged``, applies the calling thread's advice (preferred location host or GPU, accessed-by GPU),
populates the pages at the preferred location, and runs the safety guard (:mod:`lightning_gh.unified.guard`)
*before* ``cudaMallocManaged``. A refused or failed allocation returns NULL, which PyTorch turns into an
out-of-memory error; the shim keeps the reason (per thread) so that :func:`~lightning_gh.unified.pool.managed_memory`
can raise a :class:`~lightning_gh.unified.guard.ManagedMemoryError` that says what happened. Advice, prefetch and
pointer queries are exported for ``ctypes``; the device's managed-memory attributes come from
:func:`lightning_gh.hardware.managed_memory_attributes`.

CUDA 13 changed ``cudaMemAdvise`` and ``cudaMemPrefetchAsync`` to take a ``cudaMemLocation`` (and the prefetch a
flags word); CUDA 12 took an int device with ``cudaCpuDeviceId`` for the host. The source handles both with
``#if CUDART_VERSION >= 13000``.

The source is ``csrc/managed.cpp`` (package data). Building: with a C++ compiler (``$CXX``, ``g++``, ``c++``,
``clang++``) against CUDA runtime headers and a ``libcudart`` of the same major version, else with ``nvcc``.
Headers are looked for under ``$LGH_CUDA_HOME``, ``$CUDA_HOME``, ``$CUDA_PATH``, nvcc's toolkit, ``/usr/local/cuda*``
and PyTorch's ``nvidia`` runtime wheels; the library torch itself loaded is preferred, so there is one CUDA runtime
in the process. :func:`lightning_gh._native.build_shared_library` compiles it into the package's build cache
(``$LGH_CACHE_DIR``) under a hash of the source, the flags (headers and library included), the headers' version
and the compiler. Nothing here runs at import time.

Example::

    >>> from lightning_gh.unified import shim
    >>> "lgh_managed_malloc" in shim.source()
    True
    >>> lib = shim.load()          # doctest: +SKIP
    >>> lib.guard_refuses(8 << 30, 10 << 30, 4 << 30, 0, coherent=False, allow_oversubscription=False)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import site
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gh import _native
from lightning_gh._util import env
from lightning_gh.unified.guard import ManagedMemoryUnavailable

__all__ = ["SOURCE_FILE", "Refusal", "Shim", "Toolchain", "build", "find_toolchain", "load", "source"]

#: The shim's C++ source, shipped as package data.
SOURCE_FILE = _native.package_source("lightning_gh.unified", "csrc/managed.cpp")

_LIB_NAME = "lgh_managed"
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


def source() -> str:
    """The shim's C++ source text."""
    return SOURCE_FILE.read_text()


def _header_version(include_dir: str) -> int | None:
    try:
        text = Path(include_dir, "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) if m else None


def _cuda_homes() -> list[str]:
    homes = [env("CUDA_HOME") or "", os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
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
    cxx = _native.find_compiler("c++")
    problems: list[str] = []
    if cxx is None:
        problems.append(f"no C++ compiler (looked for {', '.join(_native.compiler_candidates('c++'))} on PATH)")
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


def _flags(tc: Toolchain) -> tuple[list[str], list[str]]:
    """The compiler flags and the link arguments for ``tc``."""
    if tc.kind == "nvcc":
        return ["-shared", "-O2", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "shared"], []
    # Link the very libcudart file (its soname, e.g. libcudart.so.13, becomes the dependency) and find it again at
    # load time through the rpath, in case its folder is not on the loader's path.
    return (["-shared", "-fPIC", "-O2", "-std=c++17", f"-I{tc.include_dir}"],
            [tc.cudart, f"-Wl,-rpath,{os.path.dirname(tc.cudart)}"])


def build(toolchain: Toolchain | None = None, *, force: bool = False) -> Path:
    """Build the shim (or find it in the cache) and return the path of the ``.so``.

    Args:
        toolchain: how to build it (default: :func:`find_toolchain`).
        force: rebuild even when the cache has it.

    Raises:
        ManagedMemoryUnavailable: no toolchain, or the compiler failed (its output is in the message and in the
            build log next to where the library would be).
    """
    tc = toolchain or find_toolchain()
    flags, link = _flags(tc)
    try:
        return _native.build_shared_library(SOURCE_FILE, _LIB_NAME, flags, link_flags=link, compiler=tc.compiler,
                                            key_extra=(tc.kind, str(tc.cuda_version)), force=force)
    except _native.NativeBuildError as e:
        raise ManagedMemoryUnavailable(
            f"the managed-memory shim cannot be built with {tc.kind} (CUDA headers {tc.cuda_version} in "
            f"{tc.include_dir or 'nvcc'}): {e}") from None


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
