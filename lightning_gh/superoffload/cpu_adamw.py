"""An out-of-place CPU AdamW step, bitwise equal to torch's fused CPU AdamW, for SuperOffload's two-copy rollback.

A speculative update must be undoable exactly. Copying the master weights and moments aside before each
speculative update (and back on a rollback) moves 24 B per parameter on top of the update's own ~28 B (what that
costs is in docs/superoffload.md). Writing the update into a second copy of the state instead, and flipping to it
once the step is decided, costs nothing extra: the old copy is the rollback.

torch has no out-of-place fused AdamW, so this module builds a small C kernel (``csrc/adamw.c``, the arithmetic
of torch's vectorised loop operation for operation, streaming stores, its own threads) with the system C compiler
(``$CC``, else ``gcc`` or ``cc``) into the package's build cache (:func:`lightning_gh._native.cache_dir`), loads it
with :mod:`ctypes` (which releases the GIL for the call: the training loop's thread keeps running), and checks on
the running machine that its results equal ``torch._fused_adamw_`` bitwise before anything uses it. Where there is
no compiler, the build fails, or the check finds a difference, :func:`load` returns ``None`` and SuperOffload keeps
its copy-based rollback.

The same kernel also updates in place and reads bf16 gradients as they are (widened exactly, so the result equals
torch's on the fp32 copy of the gradient): the host then receives 2 B/parameter of gradient instead of 4, and the
update, bound by the host's memory bandwidth, reads 2 B less.

Example::

    >>> import torch
    >>> from lightning_gh.superoffload import cpu_adamw
    >>> k = cpu_adamw.load()
    >>> k is None or k.sq_mode in (0, 1, 2)
    True
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_gh import _native, hardware
from lightning_gh._util import env

__all__ = ["AdamWKernel", "isa_flags", "kernel_runs", "load", "step_constants", "update_spans", "weights_spans"]

log = logging.getLogger(__name__)

_SOURCE = _native.package_source("lightning_gh.superoffload", "csrc/adamw.c")
_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread"]
# torch processes each tensor in 16-float (64-byte) units and runs the last `numel % vector width` elements of a
# tensor through a scalar loop that its compiler may round differently; those tails go to torch itself.
_TAIL = 16

_lock = threading.Lock()
_loaded: dict[str, AdamWKernel | None] = {}


def isa_flags(host_arch: str, cpu_flags: frozenset[str] | set[str]) -> list[str]:
    """The instruction-set flags the kernel is compiled with on a host of ``host_arch`` whose CPU reports
    ``cpu_flags`` (:func:`lightning_gh.hardware.host_arch`, :func:`lightning_gh.hardware.cpu_flags`): AVX2 and FMA
    on an x86 CPU that has both, nothing else (the kernel's scalar path elsewhere).

    >>> isa_flags("x86_64", {"avx2", "fma", "sse2"}), isa_flags("x86_64", {"avx2"}), isa_flags("aarch64", {"fma"})
    (['-mavx2', '-mfma'], [], [])
    """
    if host_arch not in ("x86_64", "AMD64"):
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(cpu_flags) else []


def step_constants(step: float, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
                   coef: float | None) -> tuple[torch.Tensor, bool]:
    """The kernel's eight fp32 constants for one step, computed in double and rounded to fp32 as torch's fused
    AdamW does, and whether the first moment's lerp takes its small-weight form."""
    bc1 = 1.0 - math.pow(beta1, step)
    bc2 = 1.0 - math.pow(beta2, step)
    wdf = 1.0 - lr * weight_decay if weight_decay != 0 else 1.0
    c = torch.tensor([1.0 if coef is None else coef, wdf, 1.0 - beta1, beta2, 1.0 - beta2, math.sqrt(bc2), eps,
                      -(lr / bc1)], dtype=torch.float32)
    return c, abs(float(c[2])) < 0.5


@dataclass
class AdamWKernel:
    """The loaded kernel.

    Attributes:
        path: the shared library.
        sq_mode: how the second moment's multiply-add is rounded on this machine's torch (found by the check).
    """

    path: Path
    sq_mode: int
    _fn: ctypes._CFuncPtr | None = None
    _wfn: ctypes._CFuncPtr | None = None

    def __post_init__(self) -> None:
        lib = ctypes.CDLL(str(self.path))
        fn = lib.lgh_adamw
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_int]
        self._fn = fn
        wfn = lib.lgh_adamw_weights
        wfn.restype = ctypes.c_int
        wfn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int] * 5
        self._wfn = wfn

    def step(self, src: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor,
             dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor], consts: tuple[torch.Tensor, bool],
             threads: int, sq_mode: int | None = None) -> None:
        """One AdamW step over contiguous fp32 spans: ``src`` = (weights, exp_avg, exp_avg_sq) and ``grad`` (fp32
        or bf16) in, the new values written to ``dst`` (``src`` itself, or memory that does not overlap it), all of
        one length.

        The spans' per-tensor tails are not special-cased here: the caller (:func:`update_spans`) runs each
        parameter's last ``numel % 16`` elements through torch."""
        if grad.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"lgh_adamw: grad.dtype={grad.dtype} must be torch.float32 or torch.bfloat16.")
        c, small = consts
        n = grad.numel()
        rc = self._fn(src[0].data_ptr(), src[1].data_ptr(), src[2].data_ptr(), grad.data_ptr(), dst[0].data_ptr(),
                      dst[1].data_ptr(), dst[2].data_ptr(), n, c.data_ptr(), int(small),
                      self.sq_mode if sq_mode is None else sq_mode, int(threads), int(grad.dtype == torch.bfloat16))
        if rc < 0:
            raise RuntimeError(f"lgh_adamw rejected its arguments (sq_mode={sq_mode}).")

    def weights(self, src: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor, out: torch.Tensor,
                consts: tuple[torch.Tensor, bool], threads: int, sq_mode: int | None = None) -> None:
        """The new weights of the step :meth:`step` would take, written to ``out`` (fp32, or bf16 rounded to
        nearest even as torch casts; a NaN becomes a NaN whose bits may differ from torch's) and nothing else:
        ``src`` and ``grad`` are only read. A later :meth:`step` on the same inputs writes the same weights
        (bitwise) with the moments."""
        if grad.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"lgh_adamw_weights: grad.dtype={grad.dtype} must be torch.float32 or torch.bfloat16.")
        if out.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"lgh_adamw_weights: out.dtype={out.dtype} must be torch.float32 or torch.bfloat16.")
        n = grad.numel()
        if out.numel() != n or any(t.numel() != n for t in src):
            raise ValueError(f"lgh_adamw_weights: spans of {[t.numel() for t in src]}, {n} and {out.numel()} "
                             "elements; all must be equal.")
        c, small = consts
        rc = self._wfn(src[0].data_ptr(), src[1].data_ptr(), src[2].data_ptr(), grad.data_ptr(), out.data_ptr(), n,
                       c.data_ptr(), int(small), self.sq_mode if sq_mode is None else sq_mode, int(threads),
                       int(grad.dtype == torch.bfloat16), int(out.dtype == torch.bfloat16))
        if rc < 0:
            raise RuntimeError(f"lgh_adamw_weights rejected its arguments (sq_mode={sq_mode}).")


def _torch_tail(src: tuple[torch.Tensor, ...], grad: torch.Tensor, step: float, hp: dict[str, float],
                coef: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """torch's fused AdamW on copies of a short span: (weights, exp_avg, exp_avg_sq) after the step."""
    out = tuple(t.clone() for t in src)
    g = grad.to(torch.float32, copy=True)
    if coef is not None:
        torch._foreach_mul_([g], coef)
    torch._fused_adamw_([out[0]], [g], [out[1]], [out[2]], [], [torch.tensor(step)], lr=hp["lr"],
                        beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
                        amsgrad=False, maximize=False)
    return out


def kernel_runs(slots: Iterable[Any]) -> list[list[Any]]:
    """``slots`` (in offset order) cut into the runs one kernel call updates: each slot right after the previous one
    in the flat buffers (``offset + numel``), of the same param group (``group``) and step count (``step``).

    Example::

        >>> from types import SimpleNamespace as S
        >>> a = S(offset=0, numel=4, group=0, step=1)
        >>> b = S(offset=4, numel=2, group=0, step=1)
        >>> c = S(offset=6, numel=2, group=1, step=1)
        >>> [[s.offset for s in run] for run in kernel_runs([a, b, c])]
        [[0, 4], [6]]
    """
    runs: list[list[Any]] = []
    for s in slots:
        last = runs[-1][-1] if runs else None
        if (last is not None and last.offset + last.numel == s.offset and last.group == s.group
                and float(last.step) == float(s.step)):
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _tail_spans(sizes: list[int]) -> list[tuple[int, int]]:
    """The last ``numel % 16`` elements of each parameter laid out back to back (``sizes``), which torch's own
    scalar loop updates (see ``_TAIL``)."""
    spans, off = [], 0
    for n in sizes:
        if n % _TAIL:
            spans.append((off + n - n % _TAIL, off + n))
        off += n
    return spans


def update_spans(kernel: AdamWKernel, src: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor,
                 dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor], sizes: list[int], step: float,
                 hp: dict[str, float], coef: torch.Tensor | None, threads: int, sq_mode: int | None = None) -> None:
    """Update a run of parameters laid out back to back (``sizes`` elements each) with one hyper-parameter set
    and one step count, bitwise as ``torch._fused_adamw_`` would update each parameter in place given the fp32
    gradient (after ``grad *= coef`` when ``coef`` is given; ``grad`` itself is left unchanged).

    Args:
        kernel: from :func:`load`.
        src, dst: (weights, exp_avg, exp_avg_sq) spans in and out, each ``sum(sizes)`` long; ``dst`` may be
            ``src`` (in place) or must not overlap it.
        grad: the gradient span, fp32 or bf16.
        sizes: the parameters' element counts, in order.
        step: the step number after this update (1 for the first).
        hp: ``lr``, ``beta1``, ``beta2``, ``weight_decay``, ``eps``.
        coef: the clip multiplier (a 0-dim fp32 CPU tensor) or ``None``.
        threads: threads of the kernel.
    """
    consts = step_constants(step, hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"], hp["eps"],
                            None if coef is None else float(coef))
    # the tails are computed first, from the inputs, since an in-place kernel call overwrites them
    tails = [(lo, hi, _torch_tail(tuple(t[lo:hi] for t in src), grad[lo:hi], step, hp, coef))
             for lo, hi in _tail_spans(sizes)]
    kernel.step(src, grad, dst, consts, threads, sq_mode)
    for lo, hi, out in tails:
        for d, o in zip(dst, out):
            d[lo:hi].copy_(o)


def weights_spans(kernel: AdamWKernel, src: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor,
                  out: torch.Tensor, sizes: list[int], step: float, hp: dict[str, float], coef: torch.Tensor | None,
                  threads: int) -> None:
    """The weights :func:`update_spans` would write, into ``out`` (fp32 or bf16, cast as torch casts), with the
    same arguments; nothing else is written."""
    consts = step_constants(step, hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"], hp["eps"],
                            None if coef is None else float(coef))
    kernel.weights(src, grad, out, consts, threads)
    for lo, hi in _tail_spans(sizes):
        out[lo:hi].copy_(_torch_tail(tuple(t[lo:hi] for t in src), grad[lo:hi], step, hp, coef)[0])


def _build() -> Path | None:
    """The built kernel's path, or ``None`` (logged) where it cannot be built."""
    flags = _CFLAGS + isa_flags(hardware.host_arch(), hardware.cpu_flags())
    try:
        return _native.build_shared_library(_SOURCE, "lgh_adamw", flags, link_flags=["-lm"], timeout_s=120)
    except _native.NativeBuildError as e:
        log.info("SuperOffload: the CPU AdamW kernel is not used (rollback copies instead): %s", e)
        return None


def _matches_torch(kernel: AdamWKernel, sq_mode: int) -> bool:
    """Whether the kernel reproduces ``torch._fused_adamw_`` bitwise on varied data, sizes (with and without
    tails), both forms of the lerp, with and without weight decay and clipping, out of place and in place, with
    fp32 and bf16 gradients; and whether its weights-only form writes those weights, and their bf16 cast."""
    gen = torch.Generator().manual_seed(1234)
    cases = [(1e-3, 0.9, 0.999, 0.1, 1e-8, None, 1.0), (3e-4, 0.9, 0.95, 0.0, 1e-6, 0.37, 7.0),
             (1e-2, 0.3, 0.5, 0.01, 1e-8, None, 1000.0), (5e-4, 0.8, 0.99, 0.05, 1e-8, 2.5, 3.0)]
    for i, (lr, b1, b2, wd, eps, coef, step) in enumerate(cases):
        sizes = [[4096, 160, 1000, 33, 7], [65536 + 3], [1024, 16 * 1000], [8, 24, 4099]][i]
        n = sum(sizes)
        scale = torch.pow(10.0, torch.randint(-6, 2, (n,), generator=gen).float())
        p = torch.randn(n, generator=gen) * scale
        g = torch.randn(n, generator=gen) * scale.flip(0)
        m = torch.randn(n, generator=gen) * 1e-3
        v = torch.rand(n, generator=gen) * 1e-4
        hp = {"lr": lr, "beta1": b1, "beta2": b2, "weight_decay": wd, "eps": eps}
        coef_t = None if coef is None else torch.tensor(coef, dtype=torch.float32)
        for in_place, grad in ((False, g), (i % 2 == 1, g.to(torch.bfloat16))):
            src = (p.clone(), m.clone(), v.clone())
            dst = src if in_place else (torch.empty(n), torch.empty(n), torch.empty(n))
            consts = step_constants(step, lr, b1, b2, wd, eps, coef)
            weights = {dt: torch.empty(n, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
            for out in weights.values():  # read before the step below, which may update in place
                kernel.weights(src, grad, out, consts, threads=2, sq_mode=sq_mode)
            update_spans(kernel, src, grad, dst, sizes, step, hp, coef_t, threads=2, sq_mode=sq_mode)
            body = torch.ones(n, dtype=torch.bool)  # the parameters' tails are torch's (update_spans)
            off = 0
            for size in sizes:
                body[off + size - size % _TAIL:off + size] = False
                off += size
            if not (torch.equal(weights[torch.float32][body], dst[0][body])
                    and torch.equal(weights[torch.bfloat16][body], dst[0][body].to(torch.bfloat16))):
                return False
            off = 0
            for size in sizes:
                sl = slice(off, off + size)
                rp, rm, rv, rg = p[sl].clone(), m[sl].clone(), v[sl].clone(), grad[sl].to(torch.float32, copy=True)
                if coef_t is not None:
                    torch._foreach_mul_([rg], coef_t)
                torch._fused_adamw_([rp], [rg], [rm], [rv], [], [torch.tensor(step)], lr=lr, beta1=b1, beta2=b2,
                                    weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
                if not all(torch.equal(a, b[sl]) for a, b in zip((rp, rm, rv), dst)):
                    return False
                off += size
    return True


def load() -> AdamWKernel | None:
    """The kernel, built and checked once per process, or ``None`` when it cannot be used here (no C compiler,
    a failed build, or results that differ from torch's fused AdamW). ``LGH_CPU_ADAMW=0`` turns it off."""
    with _lock:
        if "k" in _loaded:
            return _loaded["k"]
        kernel = None
        if env("CPU_ADAMW", "1") != "0":
            path = _build()
            if path is not None:
                try:
                    probe = AdamWKernel(path, 0)
                    mode = next((m for m in (2, 1, 0) if _matches_torch(probe, m)), None)
                    if mode is None:
                        log.info("SuperOffload: the CPU AdamW kernel differs from torch's on this machine; "
                                 "rollback copies are used instead.")
                    else:
                        kernel = AdamWKernel(path, mode)
                except OSError as e:
                    log.info("SuperOffload: loading the CPU AdamW kernel failed: %s", e)
        _loaded["k"] = kernel
        return kernel
