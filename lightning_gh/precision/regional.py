"""Regional compilation: ``torch.compile`` each transformer block in place, so eager torchao fp8 is fast.

torchao's ``Float8Linear`` casts each operand to float8 (an amax reduction, a scale, a cast, and for the weight
gradient a transpose) in separate kernels. Eagerly those memory-bound kernels cost more than the fp8 GEMM saves
(eager fp8 is slower than ``bf16-mixed``; figures in ``docs/precision.md``). Under ``torch.compile`` Inductor fuses them
into the neighbouring ops. Compiling the whole model is the user's choice; compiling each *block* in place is
safe to do for them: the block boundary is a plain ``forward`` call, every block of one class reuses the same
compiled code, the rest of the model (embedding, head, loss, the user's ``training_step``) stays eager, and
state-dict keys do not change (``nn.Module.compile()`` wraps nothing, unlike ``torch.compile(module)``).
The Transformer Engine plugins use it too: their TE layers stay eager inside the compiled blocks (a graph break
around each), and the norms, rotary embeddings and activations between them are fused.

Blocks are found the way the layer filter walks the model: the largest ``nn.ModuleList`` / ``nn.Sequential`` of
two or more children of one class that holds converted fp8 layers (HF ``model.model.layers``, the demo's
``model.layers``). Without such a list each fp8 layer is compiled on its own (smaller fusion, still the casts).

Example::

    >>> from torch import nn
    >>> from lightning_gh.precision.regional import find_fp8_blocks
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    >>> name, blocks = find_fp8_blocks(model, lambda m: isinstance(m, nn.Linear))
    >>> name, len(blocks)
    ('1', 2)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_gh._lightning import is_compiled

__all__ = ["compile_regions", "find_fp8_blocks", "is_region_compiled", "EAGER_COST_NOTE"]

# Said whenever torchao fp8 runs eagerly: what it costs and why (the figures are in docs/precision.md).
EAGER_COST_NOTE = ("torchao fp8 without torch.compile is slower than bf16-mixed (its float8 casts run as separate "
                   "memory-bound kernels; see docs/precision.md)")


def is_region_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: a ``torch.compile`` wrapper, or compiled in place (``module.compile()``)."""
    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def find_fp8_blocks(model: nn.Module, is_fp8: Callable[[nn.Module], bool]) -> tuple[str, list[nn.Module]]:
    """The transformer blocks of ``model`` that hold fp8 layers, and their container's name.

    Args:
        model: the (converted) model.
        is_fp8: whether a submodule is an fp8 layer (e.g. ``isinstance(m, Float8Linear)``).

    Returns:
        ``(name, blocks)``: the largest ``nn.ModuleList`` / ``nn.Sequential`` of two or more children of one class
        with an fp8 layer inside, or ``("", [])`` when there is none.
    """
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        kids = list(mod)
        if len({type(k) for k in kids}) != 1 or not any(is_fp8(m) for k in kids for m in k.modules()):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[0]:
            best = (size, name, kids)
    return ("", []) if best is None else (best[1], best[2])


def compile_regions(model: nn.Module, is_fp8: Callable[[nn.Module], bool],
                    compile_kwargs: Mapping[str, Any] | None = None) -> str:
    """``module.compile()`` each block holding fp8 layers (else each fp8 layer), once, in place.

    Skips regions already compiled, and everything when the model is compiled as a whole
    (:func:`lightning_gh._lightning.is_compiled`) or a compiled module contains the fp8 layers.

    Args:
        model: the converted model.
        is_fp8: whether a submodule is an fp8 layer.
        compile_kwargs: passed to ``nn.Module.compile`` (``torch.compile``'s arguments, e.g. ``{"mode": ...}``).

    Returns:
        What was done, in words, for the log line (``""`` when nothing was compiled).
    """
    if is_compiled(model):
        return ""
    for m in model.modules():
        if is_region_compiled(m) and any(is_fp8(x) for x in m.modules()):
            return ""  # the user compiled a region holding fp8 layers already: compiling again would nest
    kwargs = dict(compile_kwargs or {})
    name, blocks = find_fp8_blocks(model, is_fp8)
    if blocks:
        for block in blocks:
            block.compile(**kwargs)
        return f"compiled {len(blocks)} blocks of {name or 'the model'} in place (regional torch.compile)"
    layers = [m for m in model.modules() if is_fp8(m)]
    for layer in layers:
        layer.compile(**kwargs)
    return (f"no repeated transformer blocks found: compiled {len(layers)} fp8 layers one by one "
            "(regional torch.compile)") if layers else ""
