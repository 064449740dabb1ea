"""The lean loss's cross-entropy in two Triton kernels on CUDA: no fp32 copy of the logits at all.

The row-chunked path in :mod:`lightning_gh.activation_offload.lean_loss` keeps no fp32 copy between forward and
backward, but it still writes and reads fp32 chunks in both passes and launches a handful of kernels per chunk;
on a step that already waits for its host, those launches cost more than the memory traffic they avoid. Here each
pass is one kernel, one program per row:

- forward: an online log-sum-exp over the row, read once in its own dtype and summed in fp32; stores the row's
  log-sum-exp (kept for the backward, four bytes a row) and its loss, ``lse - x[target]`` (``0`` for an ignored
  target, NaN for a target outside ``[0, vocab)``, where torch's kernel would stop on a device assert);
- backward: ``(exp(x - lse) - onehot(target)) * scale`` per element, written straight in the logits' dtype, where
  ``scale`` is the incoming gradient over the reduction's divisor (``0`` for an ignored row).

That is the gradient autograd computes for ``cross_entropy(logits.float())`` followed by the cast back, with the
fp32 arithmetic in another order: the values agree to within a unit in the last place of the logits' dtype, not
bitwise (the chunked path is bitwise). :func:`kernel_for` decides which path a call takes; ``LGH_LEAN_LOSS_KERNEL``
(``auto``, ``triton`` or ``torch``) overrides the choice for the whole process.

Example::

    if kernel_for(logits) == "triton":
        lse, rows = forward(logits, targets, ignore_index=-100)
        grad = backward(logits, targets, lse, scale, ignore_index=-100)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from lightning_gh._util import env

__all__ = ["KERNELS", "backward", "choose_kernel", "forward", "kernel_for", "triton_available"]

KERNELS = ("auto", "triton", "torch")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 4096  # columns one program holds at a time: 16 fp32 values a thread at 8 warps


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch; CPU builds have none)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails at import
        return False
    return True


def setting() -> str:
    """``LGH_LEAN_LOSS_KERNEL`` (default ``"auto"``); a ``ValueError`` naming the variable for anything else."""
    value = (env("LEAN_LOSS_KERNEL") or "auto").strip().lower()
    if value not in KERNELS:
        raise ValueError(f"LGH_LEAN_LOSS_KERNEL={value!r} is not valid; use one of {KERNELS}.")
    return value


def choose_kernel(setting: str, *, device_type: str, dtype: torch.dtype, dims: int, last_stride: int,
                  compiling: bool, triton_ok: bool, fake: bool = False) -> str:
    """Which path computes a lean cross-entropy: ``"triton"`` or ``"torch"`` (the row chunks). Pure.

    ``"auto"`` takes Triton for 2-D CUDA logits in bf16, fp16 or fp32 with unit stride along the vocabulary, in
    eager mode, where Triton imports; ``"torch"`` always takes the chunks; ``"triton"`` takes Triton wherever
    ``"auto"`` would and raises on CUDA where it cannot (so a forced choice never passes silently). Logits off
    CUDA always take the chunks, and so do fake logits (``fake``: a step traced for its memory, as MemoryReport's
    prediction does, where no kernel runs; the chunks hold no more than a chunk's fp32 rows above Triton's path).

    Example::

        >>> choose_kernel("auto", device_type="cpu", dtype=torch.bfloat16, dims=2, last_stride=1,
        ...               compiling=False, triton_ok=True)
        'torch'
    """
    if setting not in KERNELS:
        raise ValueError(f"LGH_LEAN_LOSS_KERNEL={setting!r} is not valid; use one of {KERNELS}.")
    if setting == "torch" or device_type != "cuda" or fake:
        return "torch"
    why = None
    if not triton_ok:
        why = "Triton does not import"
    elif dtype not in _DTYPES:
        why = f"the logits are {dtype} (Triton's path takes {', '.join(str(d) for d in _DTYPES)})"
    elif dims != 2 or last_stride != 1:
        why = "the logits are not 2-D with unit stride along the vocabulary"
    elif compiling:
        why = "the loss is being traced by torch.compile"
    if why is None:
        return "triton"
    if setting == "triton":
        raise RuntimeError(f"LGH_LEAN_LOSS_KERNEL='triton', but {why}; unset it or use 'torch'.")
    return "torch"


def kernel_for(logits: torch.Tensor) -> str:
    """:func:`choose_kernel` for these logits, under the process's :func:`setting`."""
    return choose_kernel(setting(), device_type=logits.device.type, dtype=logits.dtype, dims=logits.dim(),
                         last_stride=logits.stride(-1) if logits.dim() else 1,
                         compiling=torch.compiler.is_compiling(),
                         triton_ok=logits.device.type == "cuda" and triton_available(),
                         fake=is_fake(logits))


@functools.lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def ce_forward(x_ptr, x_stride, t_ptr, lse_ptr, loss_ptr, vocab, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: the running maximum and sum of exp(x - m)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen only -inf sums nothing
            s = s * tl.exp(m - ref) + tl.exp(x - ref)
            m = m_new
        mx = tl.max(m, axis=0)
        ref = tl.where(mx == float("-inf"), 0.0, mx)
        lse = ref + tl.log(tl.sum(s * tl.exp(m - ref), axis=0))
        t = tl.load(t_ptr + row)
        inside = (t >= 0) & (t < vocab)
        xt = tl.load(x_row + tl.where(inside, t, 0)).to(tl.float32)
        loss = tl.where(inside, lse - xt, float("nan"))
        loss = tl.where(t == ignore_index, 0.0, loss)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, loss)

    @triton.jit
    def ce_backward(x_ptr, x_stride, t_ptr, lse_ptr, scale_ptr, g_ptr, g_stride, vocab, ignore_index,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        g_row = g_ptr + row * g_stride
        t = tl.load(t_ptr + row)
        lse = tl.load(lse_ptr + row)
        ignored = t == ignore_index
        scale = tl.where(ignored, 0.0, tl.load(scale_ptr))
        cols = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            c = start + cols
            mask = c < vocab
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            d = tl.where(c == t, p - 1.0, p) * scale
            d = tl.where(ignored, 0.0, d)
            tl.store(g_row + c, d.to(g_ptr.dtype.element_ty), mask=mask)

    return ce_forward, ce_backward


def forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, loss)`` per row of 2-D CUDA ``logits`` with unit stride along the vocabulary (any row stride), both
    fp32, one value a row; ``targets``: contiguous int64, one a row. See the module docstring."""
    if not targets.is_contiguous():
        raise ValueError("fused_ce.forward: targets must be contiguous (one int64 target a row at unit stride).")
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        with torch.cuda.device(logits.device):
            _kernels()[0][(rows,)](logits, logits.stride(0), targets, lse, loss, vocab, ignore_index,
                                   BLOCK=_BLOCK, num_warps=8)
    return lse, loss


def backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
             ignore_index: int) -> torch.Tensor:
    """The gradient of the lean cross-entropy for ``logits``, in their dtype; ``targets`` and ``lse`` as
    :func:`forward` took and returned them; ``scale``: a 0-d fp32 CUDA tensor, the incoming gradient over the
    reduction's divisor."""
    if not targets.is_contiguous():
        raise ValueError("fused_ce.backward: targets must be contiguous (one int64 target a row at unit stride).")
    rows, vocab = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if rows:
        with torch.cuda.device(logits.device):
            _kernels()[1][(rows,)](logits, logits.stride(0), targets, lse, scale, grad, grad.stride(0), vocab,
                                   ignore_index, BLOCK=_BLOCK, num_warps=8)
    return grad
