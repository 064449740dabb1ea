"""Recompute in the backward what a transformer block saved for it: its norms and gates, its cheap ops, or all.

``"norm-act"`` needs no dispatch mode: inside the block, the normalisation modules and the gated activation
modules each run in a small non-reentrant checkpoint (Megatron-LM calls this recomputing the ``layernorm``
and activation modules). What such a module saves inside (an unfused norm's fp32 normalised input, the
SiLU output that the gate product saves) is recomputed from the module's inputs when the backward reaches
it; everything else the block saves still goes through the offload engine's hooks. Which modules: see
:func:`is_norm_act_module`. Torch's own fused norms (``F.rms_norm``/``F.layer_norm`` on CUDA) save only
their input and per-row statistics, so checkpointing them frees nothing there: the engine measures what
the recomputing blocks keep in their first recomputing forward instead of assuming it.

``"selective"`` is PyTorch's selective activation checkpointing (``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``): the outputs of the compute-heavy ops (matrix products and
scaled-dot-product attention) are kept, everything else a block saves (norms, which autocast runs in
fp32, rotary embeddings, SiLU and the gate product, dtype casts) is recomputed from them when the backward
reaches the block. Those ops are memory-bound, a few percent of the block's GPU time, and it frees about
half of what the block saves; but the dispatch mode runs Python for every op in the forward and again in
the recompute, which can cost far more than those ops' GPU time (measured in docs/activation_offload.md).
``"full"`` keeps only the block's inputs (classic activation checkpointing): the forward runs twice.

The offload engine (:mod:`lightning_gh.activation_offload.engine`) applies this to the blocks its plan does not
offload, and only while its forward runs: :meth:`BlockRecompute.apply` sets an instance ``forward`` on
each chosen block that calls the original through a non-reentrant checkpoint, and :meth:`BlockRecompute.remove`
takes it away again, so the model is untouched outside the engine's ``with`` (validation, ``state_dict``). A block
compiled in place (``block.compile()``) would trace an instance ``forward`` into its compiled call: for ``"full"``
the checkpoint goes in front of the compiled call instead (:class:`~lightning_gh._compiled.WrappedCompiledCall`).

How it meets the offload hooks: inside a checkpoint, autograd's saved tensors go to the checkpoint's own
``saved_tensors_hooks``, which shadow the engine's, and selective checkpointing keeps the heavy outputs in
its own cache, not as saved tensors. The engine sees the block's inputs (the checkpoint saves them before
entering its hooks) and, given ``cache_hooks``, the cache: right after the block's forward each cached tensor
goes through the engine's pack hook (:func:`route_cache`) and the recompute reads it back through the unpack
hook, so the plan keeps or offloads the cache like any saved tensor of the block.

For ``"norm-act"`` the engine's hooks still see everything the block saves outside those small
checkpoints (including their inputs), so its block boundaries and backward points are unchanged.

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

from lightning_gh._compiled import WrappedCompiledCall, compiled_call_wrappers, is_compiled_in_place

__all__ = ["RECOMPUTE_MODES", "RECOMPUTE_ATTR", "BlockRecompute", "check_recomputable", "compute_heavy_ops",
           "is_norm_act_module", "selective_policy"]

RECOMPUTE_MODES = ("selective", "full", "norm-act")
RECOMPUTE_ATTR = "lgh_recompute"  # a module attribute: True forces a "norm-act" region, False forbids one
_MARK = "_lgh_recompute_forward"


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
    elif any(getattr(m.__dict__.get("forward"), _MARK, False) for m in block.modules()) or \
            any(h.tag == "recompute" for h in compiled_call_wrappers(block)):
        what = "already recomputes under another ActivationOffload engine"
    elif "OptimizedModule" in mro or (is_compiled_in_place(block) and mode != "full"):
        what = ("is torch.compile'd (the compiler's partitioner already recomputes cheap pointwise ops; "
                f"recompute={mode!r} is for eager blocks, 'full' also for a block compiled in place)")
    else:
        try:
            from torch.distributed._composable.contract import _get_registry

            if "checkpoint" in (_get_registry(block) or {}):
                what = "uses the composable torch.distributed checkpoint already"
        except Exception:  # torch built without distributed, or the private API moved
            pass
        if what is None and any(type(m).__module__.startswith("transformer_engine") for m in block.modules()):
            what = ("runs Transformer Engine layers (their GEMMs are not aten ops, so selective recompute would "
                    "recompute them, and a recompute would update their fp8 scaling state a second time)")
    if what is not None:
        raise ValueError(f"recompute={mode!r}: block {index} ({type(block).__name__}) {what}. Remove the other "
                         "mechanism, or use recompute=None.")


def is_norm_act_module(module: nn.Module) -> bool:
    """Whether ``recompute="norm-act"`` runs ``module`` in a checkpoint of its own.

    ``True`` for a module whose ``lgh_recompute`` attribute is ``True``; otherwise for a leaf module (no
    children) that is a normalisation (``nn.LayerNorm``, ``nn.RMSNorm``, or a class name ending in ``"Norm"``
    such as ``LlamaRMSNorm``) or a parameter-free gated activation (a class name ending in ``"GLU"`` or
    ``"Gate"``, e.g. ``SwiGLUGate`` computing ``silu(gate) * up``), and whose ``lgh_recompute`` is not
    ``False``. Plain activation modules (``nn.SiLU``, ``nn.GELU``, ``nn.GLU``) are left out: one op that
    saves only its input frees nothing when checkpointed alone.
    """
    flag = getattr(module, RECOMPUTE_ATTR, None)
    if flag is not None:
        return flag is True
    if next(module.children(), None) is not None:
        return False
    name = type(module).__name__
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith("Norm"):
        return True
    if isinstance(module, nn.GLU) or type(module).__module__.startswith("torch.nn"):
        return False
    return name.endswith(("GLU", "Gate")) and next(module.parameters(), None) is None


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


class _RoutedEntry:
    """A selective-checkpoint cache entry whose tensor went through the engine's pack hook: the recompute reads it
    back through the unpack hook, which waits for its reload from the host when it was offloaded. Duck-types
    torch's cache wrapper (``get_val``), including its check that a kept tensor was not modified in place."""

    __slots__ = ("handle", "unpack", "version")

    def __init__(self, handle: Any, unpack: Callable[[Any], torch.Tensor], version: int | None) -> None:
        self.handle, self.unpack, self.version = handle, unpack, version

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        h, self.handle = self.handle, None  # read once: the cache entry's memory goes with its last reader
        kept = getattr(h, "tensor", None)
        if kept is not None and self.version is not None and not allow_cache_entry_mutation \
                and kept._version != self.version:
            raise RuntimeError("Tensor cached during selective activation checkpoint has been mutated")
        return self.unpack(h)


def route_cache(storage: Any, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> int:
    """Send every tensor of a block's selective-checkpoint cache through the engine's ``pack`` hook (which keeps,
    offloads or deduplicates it as the plan says), replacing its entry by one that reads it back through
    ``unpack``. Returns the bytes still in the cache: entries ``pack`` handed back (no engine step) and entries
    modified in place inside the block, which stay with torch's own check.

    The cache's layout differs between torch versions (a list per op, or a dict per op keyed by call index): both
    are walked, and entries that are not cached tensors (recompute markers, non-tensor outputs) stay as they are.
    """
    from torch.utils._pytree import tree_map

    def route(leaf: Any) -> Any:
        val = getattr(leaf, "val", None)
        version = getattr(leaf, "version", None)
        if not (hasattr(leaf, "get_val") and isinstance(val, torch.Tensor)):
            return leaf
        if version is not None and val._version != version:
            return leaf  # modified in place inside the block: torch's own check raises in the recompute
        h = pack(val)
        return leaf if h is val else _RoutedEntry(h, unpack, version)

    for entries in (storage or {}).values():
        keys = list(entries) if isinstance(entries, dict) else range(len(entries)) \
            if isinstance(entries, list) else ()
        for k in keys:
            entries[k] = tree_map(route, entries[k])
    return _cached_bytes(storage)  # what is still in the cache: routed entries hold handles, not tensors


class BlockRecompute:
    """Wraps chosen blocks' forwards (or, for ``"norm-act"``, their norm and gate modules' forwards) in
    non-reentrant checkpoints, and unwraps them.

    Args:
        blocks: the transformer blocks, in forward order.
        mode: ``"selective"`` (keep matmul and attention outputs, recompute the rest), ``"full"``, or
            ``"norm-act"`` (checkpoint each of the block's :func:`is_norm_act_module` submodules).
        preserve_rng_state: restore the RNG in the recompute (dropout gives the same mask).
        cache_hooks: ``(pack, unpack)``: the engine's saved-tensor hooks, through which ``"selective"`` sends the
            matmul and attention outputs its cache keeps (:func:`route_cache`), so that the plan may offload them
            like any saved tensor of the block. ``None``: the cache stays on the device.

    Attributes:
        cached_bytes: per block, the bytes the selective cache held after the block's latest wrapped
            forward (``0`` for ``"full"`` and ``"norm-act"``; ``None`` for blocks not wrapped since
            :meth:`reset_counts`).
        regions: per block, the submodules ``"norm-act"`` checkpoints (empty for the other modes).
    """

    def __init__(self, blocks: Sequence[nn.Module], mode: str, preserve_rng_state: bool = True,
                 cache_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
                 ) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={mode!r} is not valid; use None or one of {RECOMPUTE_MODES}.")
        self.blocks = list(blocks)
        self.mode = mode
        self.preserve_rng_state = preserve_rng_state
        self.cache_hooks = cache_hooks
        self.cached_bytes: list[int | None] = [None] * len(self.blocks)
        self.regions: list[list[nn.Module]] = [
            [m for m in b.modules() if m is not b and is_norm_act_module(m)] if mode == "norm-act" else []
            for b in self.blocks]
        # block index -> [(wrapped module, its previous instance forward or _ABSENT)]
        self._applied: dict[int, list[tuple[nn.Module, Any]]] = {}

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
            targets = self.regions[i] if self.mode == "norm-act" else [block]
            done: list[tuple[nn.Module, Any]] = []
            self._applied[i] = done
            if is_compiled_in_place(block):  # "full" (check_recomputable)
                # compiled in place: an instance forward would be traced into the compiled call (a recompile);
                # the checkpoint goes around the compiled call, as Hugging Face's checkpointing calls the block
                handle = WrappedCompiledCall(block, lambda inner, a, k, i=i: self._wrap(i, inner)(*a, **k),
                                             tag="recompute")
                done.append((block, (_COMPILED, handle)))
                continue
            for m in targets:
                done.append((m, m.__dict__.get("forward", _ABSENT)))
                m.forward = self._wrap(i, m.forward) if m is block else self._wrap_region(m, m.forward)
            self.cached_bytes[i] = 0 if self.mode == "norm-act" else self.cached_bytes[i]

    def remove(self) -> None:
        for done in reversed(list(self._applied.values())):
            for m, prev in reversed(done):
                if isinstance(prev, tuple) and prev[0] is _COMPILED:
                    prev[1].remove()  # also from under a wrapper installed since
                elif prev is _ABSENT:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = prev
        self._applied = {}

    def _wrap_region(self, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        from torch.utils.checkpoint import checkpoint

        # Norms and gates draw no random numbers; only a module the user marked may (dropout inside).
        rng = self.preserve_rng_state and getattr(module, RECOMPUTE_ATTR, None) is True

        def region(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=rng, **kwargs)

        region.__dict__[_MARK] = True
        return region

    def _wrap(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        block = self.blocks[index]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            kwargs = _drop_kv_cache(block, kwargs)
            modes: list[Any] = []
            if self.mode == "selective":
                def context_fn() -> Any:
                    ctxs = create_selective_checkpoint_contexts(selective_policy)
                    modes.append(ctxs[0])
                    return ctxs

                out = checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn,
                                 preserve_rng_state=self.preserve_rng_state, **kwargs)
                # Measure now, and keep no reference: the cache must die with the backward. What went through the
                # engine's hooks is counted there, kept or offloaded, not here.
                hooks = self.cache_hooks
                self.cached_bytes[index] = sum(
                    route_cache(getattr(m, "storage", None), *hooks) if hooks is not None
                    else _cached_bytes(getattr(m, "storage", None)) for m in modes)
            else:
                out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state,
                                 **kwargs)
                self.cached_bytes[index] = 0
            return out

        wrapped.__dict__[_MARK] = True
        return wrapped


_ABSENT = object()
_COMPILED = object()  # marks a block compiled in place whose compiled call the recompute wrapped (its handle next)


def _drop_kv_cache(block: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face decoder layer's keyword arguments without its KV cache, as HF's own gradient checkpointing
    does (``GradientCheckpointingLayer``): the recompute would append the keys and values to the cache a second
    time, and the longer cache changes the ops the recompute runs (selective checkpointing then fails)."""
    if getattr(block, "_can_checkpoint_with_cache", False):
        return kwargs
    out = kwargs
    # ``cache`` from transformers 5.24; ``past_key_values`` / ``past_key_value`` / ``layer_past`` before.
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if out.get(name) is not None:
            out = {**out, name: None}
    if out is not kwargs and out.get("use_cache"):
        out["use_cache"] = False
    return out
