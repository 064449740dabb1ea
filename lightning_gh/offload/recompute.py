"""Recompute in the backward what a transformer block saved for it: selectively (the cheap ops) or fully.

``"selective"`` is PyTorch's selective activation checkpointing (``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``): the outputs of the compute-heavy ops (matrix products and
scaled-dot-product attention) are kept, everything else a block saves (norms, which autocast runs in
fp32, rotary embeddings, SiLU and the gate product, dtype casts) is recomputed from them when the backward
reaches the block. Those ops are memory-bound: recomputing them costs a few percent of the block's time
and frees about half of what it saves. ``"full"`` keeps only the block's inputs (classic activation
checkpointing): the forward runs twice.

The offload engine (:mod:`lightning_gh.offload.activations`) applies this to the blocks its plan does not
offload, and only while its forward runs: :meth:`BlockRecompute.apply` sets an instance ``forward`` on
each chosen block that calls the original through a non-reentrant checkpoint, and :meth:`BlockRecompute.remove`
takes it away again, so the model is untouched outside the engine's ``with`` (validation, ``state_dict``).

How it meets the offload hooks: inside a checkpoint, autograd's saved tensors go to the checkpoint's own
``saved_tensors_hooks``, which shadow the engine's, and selective checkpointing keeps the heavy outputs in
its own cache, not as saved tensors. The engine therefore sees only the block's inputs (the checkpoint
saves them before entering its hooks): it keeps them on the device and counts them as the block's resident
bytes. Blocks the plan offloads are not wrapped, so everything they save still reaches the engine.

Example::

    rc = BlockRecompute(list(model.layers), "selective")
    rc.apply(range(len(rc.blocks)))           # blocks 0..N-1 now recompute their cheap ops
    loss = model(x).sum()
    rc.remove()                               # the backward may follow: it holds its own closures
    loss.backward()
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["RECOMPUTE_MODES", "BlockRecompute", "check_recomputable", "compute_heavy_ops", "selective_policy",
           "heavy_output_bytes"]

RECOMPUTE_MODES = ("selective", "full")
_MARK = "_lgh_recompute_forward"

# Autograd node names of the ops selective recompute keeps (their output sizes are in the node's metadata).
_HEAVY_NODES = frozenset({
    "MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "ScaledMmBackward0",
    "ScaledDotProductFlashAttentionBackward0", "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductCudnnAttentionBackward0", "ScaledDotProductFlashAttentionForCpuBackward0",
    "ScaledDotProductFusedAttentionOverrideableBackward0",
})


@functools.lru_cache(maxsize=1)
def compute_heavy_ops() -> frozenset[Any]:
    """The aten ops whose outputs ``"selective"`` keeps: matrix products and the fused attention kernels.

    Names missing from this torch build are left out, so the set works across versions.
    """
    names = [("mm", "default"), ("addmm", "default"), ("bmm", "default"), ("baddbmm", "default"),
             ("_scaled_mm", "default"), ("_scaled_dot_product_flash_attention", "default"),
             ("_scaled_dot_product_efficient_attention", "default"),
             ("_scaled_dot_product_cudnn_attention", "default"),
             ("_scaled_dot_product_flash_attention_for_cpu", "default"),
             ("_scaled_dot_product_fused_attention_overrideable", "default"),
             ("_flash_attention_forward", "default"), ("_efficient_attention_forward", "default")]
    ops = set()
    for op, overload in names:
        packet = getattr(torch.ops.aten, op, None)
        if packet is not None and hasattr(packet, overload):
            ops.add(getattr(packet, overload))
    return frozenset(ops)


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """``create_selective_checkpoint_contexts`` policy: keep the heavy ops' outputs, recompute the rest.

    ``MUST_SAVE`` (not ``PREFER_SAVE``) so that a compiler may not decide to recompute a matmul.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in compute_heavy_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def check_recomputable(block: nn.Module, index: int, mode: str) -> None:
    """Raise ``ValueError`` when ``block`` cannot take ``recompute=mode``: it already recomputes or
    offloads (a checkpoint wrapper, the composable ``checkpoint``, another engine's recompute), it is
    compiled, or it runs Transformer Engine layers (their GEMMs are not aten ops, so they would be
    recomputed too)."""
    what = None
    mro = {c.__name__ for c in type(block).__mro__}
    if mro & {"CheckpointWrapper", "OffloadWrapper", "ActivationWrapper"}:
        what = f"is wrapped in {type(block).__name__} (activation checkpointing or offload already)"
    elif getattr(block.__dict__.get("forward"), _MARK, False):
        what = "already recomputes under another ActivationOffload engine"
    elif "OptimizedModule" in mro or getattr(block, "_compiled_call_impl", None) is not None:
        what = ("is torch.compile'd (the compiler's partitioner already recomputes cheap pointwise ops; "
                "recompute= is for eager blocks)")
    else:
        try:
            from torch.distributed._composable.contract import _get_registry

            if "checkpoint" in (_get_registry(block) or {}):
                what = "uses the composable torch.distributed checkpoint already"
        except Exception:  # torch built without distributed, or the private API moved
            pass
        if what is None and any(type(m).__module__.startswith("transformer_engine") for m in block.modules()):
            what = ("runs Transformer Engine layers, whose GEMMs are not aten ops: selective recompute would "
                    "recompute them too")
    if what is not None:
        raise ValueError(f"recompute={mode!r}: block {index} ({type(block).__name__}) {what}. Remove the other "
                         "mechanism, or use recompute=None.")


def heavy_output_bytes(output: Any, stop: set[int], seen: set[int], limit: int = 100_000) -> int | None:
    """Bytes of the heavy ops' outputs in the autograd graph from ``output`` back to the ``stop`` nodes.

    What ``"selective"`` would keep of a block that ran without it, from autograd's own metadata; nodes in
    ``seen`` (earlier blocks') are not walked and new ones are added. ``None`` when the graph does not
    carry the metadata (an older torch).
    """
    tensors = [t for t in _tensors(output) if t.grad_fn is not None]
    todo = [t.grad_fn for t in tensors]
    total = 0
    while todo and limit > 0:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        limit -= 1
        if type(node).__name__ in _HEAVY_NODES:
            try:
                meta = node._input_metadata
            except AttributeError:
                return None
            for m in meta:
                numel = 1
                for s in m.shape:
                    numel *= int(s)
                total += numel * torch.empty(0, dtype=m.dtype).element_size()
        todo.extend(f for f, _ in node.next_functions if f is not None)
    return total


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _cached_bytes(storage: Any) -> int:
    """Bytes of the distinct tensors in a selective-checkpoint cache (its layout differs between torch
    versions: walk whatever containers it holds)."""
    seen: set[int] = set()
    total = 0
    todo = [storage]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, torch.Tensor):
            try:
                st = x.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
            except (RuntimeError, NotImplementedError):
                pass
        elif hasattr(x, "val"):  # torch's _VersionWrapper around a cached output
            todo.append(x.val)
    return total


class BlockRecompute:
    """Wraps chosen blocks' forwards in a non-reentrant checkpoint (selective or full), and unwraps them.

    Args:
        blocks: the transformer blocks, in forward order.
        mode: ``"selective"`` (keep matmul and attention outputs, recompute the rest) or ``"full"``.
        preserve_rng_state: restore the RNG in the recompute (dropout gives the same mask).

    Attributes:
        cached_bytes: per block, the bytes the selective cache held after the block's latest wrapped
            forward (``0`` for ``"full"``; ``None`` for blocks not wrapped since :meth:`reset_counts`).
    """

    def __init__(self, blocks: Sequence[nn.Module], mode: str, preserve_rng_state: bool = True) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={mode!r} is not valid; use None or one of {RECOMPUTE_MODES}.")
        self.blocks = list(blocks)
        self.mode = mode
        self.preserve_rng_state = preserve_rng_state
        self.cached_bytes: list[int | None] = [None] * len(self.blocks)
        self._applied: dict[int, Any] = {}  # block index -> its previous instance forward, or _ABSENT

    def check(self) -> None:
        for i, b in enumerate(self.blocks):
            check_recomputable(b, i, self.mode)

    @property
    def applied(self) -> tuple[int, ...]:
        return tuple(sorted(self._applied))

    def reset_counts(self) -> None:
        self.cached_bytes = [None] * len(self.blocks)

    def apply(self, indices: Iterable[int]) -> None:
        for i in indices:
            if i in self._applied:
                continue
            block = self.blocks[i]
            check_recomputable(block, i, self.mode)  # cheap; catches another engine wrapping it meanwhile
            self._applied[i] = block.__dict__.get("forward", _ABSENT)
            block.forward = self._wrap(i, block.forward)

    def remove(self) -> None:
        for i, prev in self._applied.items():
            block = self.blocks[i]
            if prev is _ABSENT:
                block.__dict__.pop("forward", None)
            else:
                block.forward = prev
        self._applied = {}

    def _wrap(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            modes: list[Any] = []
            if self.mode == "selective":
                def context_fn() -> Any:
                    ctxs = create_selective_checkpoint_contexts(selective_policy)
                    modes.append(ctxs[0])
                    return ctxs

                out = checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn,
                                 preserve_rng_state=self.preserve_rng_state, **kwargs)
                # Measure now, and keep no reference: the cache must die with the backward.
                self.cached_bytes[index] = sum(_cached_bytes(getattr(m, "storage", None)) for m in modes)
            else:
                out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state,
                                 **kwargs)
                self.cached_bytes[index] = 0
            return out

        wrapped.__dict__[_MARK] = True
        return wrapped


_ABSENT = object()
