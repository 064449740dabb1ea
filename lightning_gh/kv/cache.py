"""``OffloadedKVCache``: the KV-offload engine behind transformers' ``Cache`` interface.

``OffloadedKVCache(model)`` reads the number of layers from the model (:func:`~lightning_gh.kv.spec.kv_spec`)
and sizes everything else at its first use. With transformers installed the object is also an instance of
``transformers.Cache`` (the subclass is built on first construction, so importing this module never imports
transformers), and ``model.generate(..., past_key_values=cache)`` accepts it (``cache=cache`` from transformers
5.24: :func:`~lightning_gh.kv.spec.cache_kwarg`). Without transformers it still
serves the demo ``Llama.generate``.

Per layer it answers what transformers asks of a growing cache: ``update`` returns all keys and values so far,
``get_seq_length`` the tokens cached, ``get_mask_sizes`` ``(cached + query, 0)``. The attention mask, positions
and tensors attention sees are therefore those of ``DynamicCache``, and greedy tokens are bitwise the same.

Example::

    from transformers import AutoModelForCausalLM
    import lightning_gh as lgh

    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16).cuda()
    cache = lgh.OffloadedKVCache(model, max_length=prompt_len + 64)     # resident_layers="auto"
    out = model.generate(input_ids, max_new_tokens=64, do_sample=False, past_key_values=cache)
    print(cache.describe())   # which layers stay on the GPU, pinned host GiB, staging slots
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightning_gh._options import resolve
from lightning_gh.kv.engine import KVOffloadEngine
from lightning_gh.kv.options import KVOffloadOptions
from lightning_gh.kv.spec import KVSpec, kv_spec

__all__ = ["OffloadedKVCache"]


class _LayerView:
    """What transformers may read of one layer (``cache.layers[i]``); storage stays in the engine."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, engine: KVOffloadEngine, index: int, sliding: bool) -> None:
        self._engine, self.index, self.is_sliding = engine, index, sliding

    @property
    def is_initialized(self) -> bool:
        return self._engine.allocated

    @property
    def keys(self) -> torch.Tensor | None:
        return self._kv(0)

    @property
    def values(self) -> torch.Tensor | None:
        return self._kv(1)

    def _kv(self, which: int) -> torch.Tensor | None:
        if not self._engine.allocated:
            return None
        self._engine.synchronize()
        return self._engine.buffers(self.index)[which][:, :, : self._engine.lengths[self.index]]

    def get_seq_length(self) -> int:
        return self._engine.seq_length(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def __repr__(self) -> str:
        where = "GPU" if self._engine.is_resident(self.index) else ("host" if self._engine.allocated else "?")
        return f"OffloadedLayer({self.index}, {where}, {self.get_seq_length()} tokens)"


@functools.lru_cache(maxsize=None)
def _with_transformers_base() -> type | None:
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return None
    return type("OffloadedKVCache", (OffloadedKVCache, Cache),
                {"__module__": __name__, "__doc__": OffloadedKVCache.__doc__, "__qualname__": "OffloadedKVCache"})


class OffloadedKVCache:
    """A KV cache for autoregressive decoding that keeps some layers on the GPU and the rest in pinned host memory.

    Offloaded layers live in one pinned host pool allocated once for ``max_length``. Each decode step appends only
    the new tokens to it (GPU to host, on a side stream) and brings back only the valid prefix of each offloaded
    layer into a ring of GPU staging slots, the next layer's copy overlapping the current layer's compute; events
    keep a slot from being refilled while attention still reads it. Resident layers are preallocated GPU buffers.
    No buffer moves after the first use (unless ``max_length`` was left to grow), so a decode step touches fixed
    addresses. Off the GPU it runs as a plain preallocated cache and says so once.

    Args:
        model: the model that will use the cache: a transformers causal LM, the demo ``Llama``/``LlamaLM``, or a
            LightningModule holding one. Only its layer count and layer kinds are read.
        options: see :class:`~lightning_gh.kv.KVOffloadOptions`.
        **kwargs: the fields of :class:`~lightning_gh.kv.KVOffloadOptions`, instead of ``options`` (one or the
            other, never both: a ``TypeError``).

    Example::

        cache = OffloadedKVCache(model, max_length=4096 + 64, resident_layers="auto")
        tokens = model.generate(input_ids, max_new_tokens=64, do_sample=False, past_key_values=cache)
        cache.describe()            # which layers stay on the GPU, the pinned host pool, the staging slots
        cache.reset()               # reuse the same buffers for the next batch of prompts

    On the CPU (``backend="host-copy"`` runs the offload bookkeeping with synchronous copies)::

        >>> import torch
        >>> from lightning_gh.demo import LlamaLM
        >>> model = LlamaLM.from_preset("tiny").eval()
        >>> cache = OffloadedKVCache(model, resident_layers=1, max_length=16, backend="host-copy")
        >>> ids = model.generate(torch.zeros(1, 4, dtype=torch.long), 3, past_key_values=cache)
        >>> cache.plan.resident, cache.plan.offloaded, cache.get_seq_length()
        ((1,), (0,), 6)
        >>> OffloadedKVCache(model, KVOffloadOptions(num_slots=3), resident_layers=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: OffloadedKVCache got both options= and resident_layers=0: pass the options in one place ...
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> OffloadedKVCache:
        if cls is OffloadedKVCache:
            cls = _with_transformers_base() or cls
        return object.__new__(cls)

    def __init__(self, model: nn.Module, options: KVOffloadOptions | None = None, **kwargs: Any) -> None:
        opts = resolve(KVOffloadOptions, options, "OffloadedKVCache", **kwargs)
        self.spec: KVSpec = kv_spec(model)
        self.options = opts
        self.engine = KVOffloadEngine(self.spec.num_layers, opts, name="OffloadedKVCache")
        # transformers.Cache's attributes, set here because its __init__ wants layer objects or a layer class.
        self.layers = [_LayerView(self.engine, i, s) for i, s in enumerate(self.spec.is_sliding)]
        self.layer_class_to_replicate = None
        self.offloading = False

    # ------------------------------------------------------------------------- transformers Cache API

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values of ``layer_idx`` and return all of that layer's keys and values."""
        return self.engine.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.engine.seq_length(layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.engine.seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.engine.seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        # -1 ("grows") like DynamicCache: generate then applies no static-cache length rules to it.
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def __len__(self) -> int:
        return self.spec.num_layers

    def __repr__(self) -> str:
        return f"OffloadedKVCache({self.describe()})"

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.engine.allocated

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return list(self.spec.is_sliding)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.spec.num_layers

    @property
    def batch_size(self) -> int:
        return self.engine.batch_size if self.engine.allocated else -1

    @property
    def max_batch_size(self) -> int:
        return self.batch_size

    @property
    def max_cache_len(self) -> int:
        return self.engine.max_length if self.engine.allocated else -1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        raise ValueError("OffloadedKVCache holds attention layers only; has_previous_state is for linear-attention "
                         "layers.")

    def reset(self) -> None:
        """Empty the cache for the next prompts; every buffer (and its address) is kept."""
        self.engine.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.engine.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.engine.reorder(beam_idx)

    def activate_past_recording(self) -> None:
        pass  # every token is kept anyway

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OffloadedKVCache is sized for one batch at first use; batch_repeat_interleave "
                                  f"(contrastive search) would change it to x{repeats}. Use greedy, sampling or beam "
                                  "search, or DynamicCache.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("OffloadedKVCache is sized for one batch at first use; batch_select_indices would "
                                  "shrink it. Use DynamicCache for this decoding strategy.")

    def early_initialization(self, *args: Any, **kwargs: Any) -> None:
        pass  # sized at first use

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        pass  # the engine prefetches on its own

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        pass

    # -------------------------------------------------------------------------------------- our own

    @property
    def plan(self):
        """The :class:`~lightning_gh.kv.plan.KVPlan` (``None`` before first use)."""
        return self.engine.plan

    @property
    def stats(self):
        """Bytes and copies moved (:class:`~lightning_gh.kv.engine.KVStats`)."""
        return self.engine.stats

    def describe(self) -> str:
        """One line: which layers are resident, host pool size, slots, GPU share of the KV bytes."""
        return self.engine.describe()

    def close(self) -> None:
        """Unlock the pinned pool and drop every buffer now (otherwise done when the cache is garbage-collected)."""
        self.engine.close()
