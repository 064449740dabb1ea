"""What a model's KV cache looks like: layers, key/value heads, head size, layer kinds.

Read from the model alone, so ``OffloadedKVCache(model)`` needs no other argument. Two kinds of model are
understood: a transformers decoder (``model.config`` with ``num_hidden_layers``), and any module whose
``config``/``cfg`` has ``n_layers``, ``n_heads``, ``n_kv_heads`` and ``dim`` (the demo ``Llama``). A
LightningModule that wraps one of them is searched (its attributes, then its submodules) for it.
transformers is never imported here.

Example::

    >>> from lightning_gh.demo import LlamaLM
    >>> kv_spec(LlamaLM.from_preset("tiny"))
    KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, layer_types=('full_attention', 'full_attention'), source='LlamaLM')
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["KVSpec", "SUPPORTED_LAYER_TYPES", "cache_kwarg", "find_generator", "kv_spec", "vocab_size"]

# Layers whose cache is a plain, growing key/value sequence. Sliding-window layers are kept in full: the model's
# sliding mask hides what lies outside the window, so the output is the same.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class KVSpec:
    """Shape of a decoder's KV cache.

    Args:
        num_layers: layers that cache keys and values.
        num_kv_heads: key/value heads per layer (the shape's second dimension).
        head_dim: size of one head (the last dimension).
        layer_types: each layer's kind, as transformers names them.
        source: the class the spec was read from.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    source: str

    @property
    def is_sliding(self) -> list[bool]:
        return [t != "full_attention" for t in self.layer_types]

    def layer_bytes(self, batch_size: int, max_length: int, dtype: torch.dtype) -> int:
        """Bytes of one layer's keys plus values for ``batch_size`` sequences of ``max_length`` tokens."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * batch_size * self.num_kv_heads * max_length * self.head_dim * itemsize


def _hf_config(obj: Any) -> Any | None:
    cfg = getattr(obj, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    if hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config(decoder=True)
        except TypeError:
            cfg = cfg.get_text_config()
    return cfg if hasattr(cfg, "num_hidden_layers") else None


def _demo_config(obj: Any) -> Any | None:
    for name in ("cfg", "config"):
        cfg = getattr(obj, name, None)
        if cfg is not None and all(hasattr(cfg, a) for a in ("n_layers", "n_heads", "n_kv_heads", "dim")):
            return cfg
    return None


def _candidates(model: nn.Module) -> list[Any]:
    out: list[Any] = [model]
    for name in ("model", "module", "net", "lm", "decoder"):
        child = getattr(model, name, None)
        if isinstance(child, nn.Module) and child is not model:
            out.append(child)
    if isinstance(model, nn.Module):
        out.extend(m for _, m in model.named_modules() if m is not model)
    return out


def _no_cache(model: Any, why: str) -> TypeError:
    return TypeError(f"model={type(model).__name__} has no KV cache that OffloadedKVCache can hold: {why}. Allowed: a "
                     "transformers decoder-only causal LM with attention layers (e.g. LlamaForCausalLM), the demo "
                     "Llama/LlamaLM, or a LightningModule that holds one of them as an attribute.")


def _from_hf(model: Any, cfg: Any) -> KVSpec:
    name = type(model).__name__
    top = getattr(model, "config", None)
    if getattr(cfg, "is_encoder_decoder", False) or getattr(top, "is_encoder_decoder", False):
        raise _no_cache(model, "encoder-decoder models keep a cross-attention cache as well, which is not supported")
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        raise _no_cache(model, f"{name} keeps a recurrent state (no Cache instances)")
    can_generate = getattr(type(model), "can_generate", None)
    if callable(can_generate) and not can_generate() and not getattr(cfg, "is_decoder", False):
        raise _no_cache(model, f"{name} is not a decoder (can_generate() is False and config.is_decoder is not set)")
    layers = int(cfg.num_hidden_layers)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        raise _no_cache(model, "its config names no attention heads (num_attention_heads / num_key_value_heads)")
    types = getattr(cfg, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if getattr(cfg, "sliding_window", None) is not None else "full_attention"
        types = [kind] * layers
    shared = getattr(cfg, "num_kv_shared_layers", None)
    if shared:
        types = list(types)[: -shared]
    bad = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        raise _no_cache(model, f"its layers include {bad} (layers without a plain key/value sequence); supported "
                               f"layer types: {list(SUPPORTED_LAYER_TYPES)}")
    return KVSpec(len(types), int(kv_heads), int(head_dim), tuple(types), name)


def kv_spec(model: Any) -> KVSpec:
    """The KV-cache shape of ``model``; a ``TypeError`` naming the model when it has none.

    Args:
        model: a transformers causal LM, the demo ``Llama``/``LlamaLM``, or a module holding one of them.
    """
    if not isinstance(model, nn.Module):
        raise _no_cache(model, f"it is a {type(model).__name__}, not a torch.nn.Module")
    for cand in _candidates(model):
        cfg = _hf_config(cand)
        if cfg is not None:
            return _from_hf(cand, cfg)
        cfg = _demo_config(cand)
        if cfg is not None:
            return KVSpec(int(cfg.n_layers), int(cfg.n_kv_heads), int(cfg.dim // cfg.n_heads),
                          ("full_attention",) * int(cfg.n_layers), type(cand).__name__)
    raise _no_cache(model, "found no decoder config (num_hidden_layers, or n_layers/n_kv_heads) on it or its "
                           "submodules")


def vocab_size(model: Any) -> int | None:
    """The number of token ids ``model`` embeds (its config's ``vocab_size``), or ``None`` where no config says.

    Example::

        >>> from lightning_gh.demo import LlamaLM
        >>> vocab_size(LlamaLM.from_preset("tiny"))
        64
    """
    if not isinstance(model, nn.Module):
        return None
    for cand in _candidates(model):
        cfg = _hf_config(cand) or _demo_config(cand)
        n = getattr(cfg, "vocab_size", None) if cfg is not None else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def find_generator(model: nn.Module) -> nn.Module:
    """The module whose ``generate`` produces tokens: ``model`` itself when it has ``generate``, else the first
    attribute/submodule that has one (a transformers model inside a LightningModule)."""
    for cand in _candidates(model):
        if callable(getattr(cand, "generate", None)):
            return cand
    raise TypeError(f"model={type(model).__name__} has no generate() method, nor does any of its submodules; "
                    "give GenerationCallback a generate_fn=callable(pl_module, input_ids, cache, max_new_tokens).")


def cache_kwarg(model: Any) -> str:
    """The keyword by which ``model.generate`` and ``model(...)`` take a KV cache object.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works there, with a
    ``FutureWarning``); models that are not transformers' (the demo ``LlamaLM``) keep ``past_key_values``.

    Args:
        model: the module whose ``generate``/``forward`` will get the cache (see :func:`find_generator`).

    Example::

        >>> from lightning_gh.demo import LlamaLM
        >>> cache_kwarg(LlamaLM.from_preset("tiny"))
        'past_key_values'
    """
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters if callable(forward) else {}
    except (TypeError, ValueError):  # builtins and some C extensions have no signature
        params = {}
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
