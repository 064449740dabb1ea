"""Which modules are the transformer blocks, and whether a compiled module hides their boundaries.

The engine hooks each block's forward to know which block saved a tensor; :func:`find_blocks` finds them
(the largest ``nn.ModuleList``/``nn.Sequential`` of one module type, unless told), and :func:`compiled_owner`
names a ``torch.compile``'d module that would trace those hooks instead of running them.

Example::

    >>> from torch import nn
    >>> from lightning_gh.activation_offload import find_blocks
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    >>> name, blocks = find_blocks(model)
    >>> name, len(blocks)
    ('1', 2)
"""

from __future__ import annotations

from typing import Sequence

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_gh._lightning import is_compiled

__all__ = ["compiled_owner", "find_blocks"]


def find_blocks(model: nn.Module, blocks: str | Sequence[nn.Module] | None = None) -> tuple[str, list[nn.Module]]:
    """The transformer blocks of ``model``, in forward order, and the name of their container.

    Args:
        model: the module whose forward runs the blocks.
        blocks: ``None`` finds the largest ``nn.ModuleList`` / ``nn.Sequential`` of two or more children of
            one type (``Llama.layers``); a name (``"model.layers"``) picks a container; a sequence of
            modules is used as given.
    """
    if blocks is not None and not isinstance(blocks, str):
        mods = list(blocks)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise ValueError(f"blocks={blocks!r} must be a module name or a non-empty sequence of nn.Module.")
        return "<given>", mods
    if isinstance(blocks, str):
        try:
            container = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"blocks={blocks!r} names no submodule of {type(model).__name__}: {e}") from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            raise ValueError(f"blocks={blocks!r} is a {type(container).__name__}; it must name a non-empty "
                             "nn.ModuleList or nn.Sequential of transformer blocks.")
        return blocks, list(container)
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kids = list(mod)
            if len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
                size = sum(p.numel() for p in mod.parameters())
                if best is None or size > best[0]:
                    best = (size, name, kids)
    if best is None:
        raise ValueError(f"no transformer blocks found in {type(model).__name__}: no nn.ModuleList of two or more "
                         "children of one type. Pass blocks='<name of the ModuleList>' or a list of modules.")
    return best[1], best[2]


def compiled_owner(model: nn.Module, blocks: list[nn.Module]) -> str | None:
    """Name of a compiled module whose forward runs a block (its hooks would be traced, not run), or ``None``.

    A module counts when it is a ``torch.compile`` wrapper (``OptimizedModule``) or was compiled in place
    (``module.compile()``) and contains a block (a block compiled in place itself does not count: the engine runs
    its boundaries around its compiled call, :class:`~lightning_gh._compiled.AroundCompiledCall`); and a
    LightningModule that Lightning unwrapped from a compiled one (:func:`lightning_gh._lightning.is_compiled`) when
    no compiled submodule explains that.
    """
    block_ids = {id(b) for b in blocks}
    compiled_inside = False
    for name, m in model.named_modules():
        if isinstance(m, OptimizedModule):
            compiled_inside = True
            if any(id(x) in block_ids for x in m._orig_mod.modules()):
                return name or f"<the model itself, {type(model).__name__}>"
        if getattr(m, "_compiled_call_impl", None) is not None:
            compiled_inside = True
            # a block compiled in place itself is not one: the engine runs its boundaries around the compiled call
            if any(id(x) in block_ids for x in m.modules() if x is not m):
                return name or f"<the model itself, {type(model).__name__}>"
    if not compiled_inside and is_compiled(model):
        return f"<the model itself, {type(model).__name__}, compiled before Trainer.fit>"
    return None
