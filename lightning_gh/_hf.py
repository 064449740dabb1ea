"""Hugging Face ``transformers`` helpers the parts share; ``transformers`` is imported only when a model uses it.

``keep_causal_sdpa``: keep SDPA's causal (flash) path when a Hugging Face decoder is compiled as a whole.

Eagerly, ``transformers`` builds no causal mask for SDPA when nothing is padded: it returns ``None`` and the
attention calls ``scaled_dot_product_attention(..., is_causal=True)``, which runs a causal kernel (flash or cuDNN:
only the lower triangle is computed) and lets SDPA handle grouped KV heads without copying them. Under
``torch.compile`` it cannot prove that nothing is padded (its checks read tensor values, or decline whenever Dynamo
traces), so it materialises a ``(batch, 1, q, kv)`` boolean mask for every step. SDPA with an explicit mask computes
the full square and reads the mask, and the KV heads are repeated to the query heads, forward and backward. On a
large HF Llama that can make a whole-model-compiled step slower than one with only the decoder blocks compiled
(figures in ``docs/precision.md``).

What is needed to skip the mask is known before any tensor value is read: the caller passed no
``attention_mask``, no ``position_ids`` (so the positions are the model's own ``arange``: no packed sequences)
and no cache. ``keep_causal_sdpa`` records exactly that in a forward pre-hook on each decoder it accepts, and wraps
transformers' SDPA mask builder so that, while Dynamo compiles (never while exporting, where a hard-coded
``is_causal`` would be wrong for other lengths), such a call returns ``None`` as it does eagerly. Everything else
(padding masks, packed sequences, caches with an offset, other model families, eager runs) goes to transformers' own
builder unchanged; a sliding window is skipped, as eagerly, only when it is longer than the
sequence. The decision depends only on which arguments are ``None`` and on the lengths,
which Dynamo guards on, so a later call that passes a mask recompiles rather than reusing the causal graph.

Only the decoder families whose mask calls are known to be plain causal masks are accepted (``FAMILIES``); a
model's own ``or``/``and`` mask functions (image tokens, bidirectional blocks) would make the skip wrong.

Used by the fp8 plugins (``precision.ao``) and by activation offload's budget mode.

Example::

    >>> from torch import nn
    >>> from lightning_gh._hf import keep_causal_sdpa
    >>> keep_causal_sdpa(nn.Linear(2, 2))   # no transformers decoder in it: nothing to do
    []

    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    keep_causal_sdpa(model)          # ['']: the model itself was accepted
    model = torch.compile(model)     # attention now runs SDPA's flash kernel with is_causal=True
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["FAMILIES", "checkpointing_owner", "keep_causal_sdpa", "hf_sdpa_decoders"]

# ``config.model_type`` of the decoders whose mask calls are plain causal or sliding-window causal.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class _State:
    """Set by the pre-hook while an accepted decoder runs a call without mask, positions or cache."""

    plain = False


_STATE = _State()
_ACCEPTED: set[int] = set()  # id(config) of the accepted decoders' configs (dropped when a config is collected)


def checkpointing_owner(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The Hugging Face model inside ``model`` (its qualified name and itself) whose gradient checkpointing is on
    (``gradient_checkpointing_enable()``), or ``None``."""
    return next(((n, m) for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing_disable")
                 and getattr(m, "is_gradient_checkpointing", False) is True), None)


def hf_sdpa_decoders(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost Hugging Face decoders in ``model`` that ``keep_causal_sdpa`` accepts, by name.

    Accepted: a ``transformers`` ``PreTrainedModel`` whose ``config.model_type`` is in ``FAMILIES`` and whose
    attention implementation is ``"sdpa"``.
    """
    found: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if any(name.startswith(f + ".") or f == "" for f in found):
            continue
        config = getattr(m, "config", None)
        if (type(m).__module__.startswith("transformers.") and hasattr(m, "base_model_prefix")
                and getattr(config, "model_type", None) in FAMILIES
                and getattr(config, "_attn_implementation", None) == "sdpa"):
            found[name] = m
    return found


def _plain_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    # HF forwards take input_ids first; anything else positional might be a mask or positions: not plain. The KV
    # cache is ``cache`` from transformers 5.24, ``past_key_values`` before.
    _STATE.plain = (len(args) <= 1 and all(kwargs.get(k) is None for k in ("attention_mask", "position_ids",
                                                                          "past_key_values", "cache",
                                                                          "cache_position")))


def _call_done(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _STATE.plain = False


def _exporting() -> bool:
    """Whether ``torch.export`` is tracing. Reads the flag export sets: under Dynamo, torch 2.11's
    ``torch.compiler.is_exporting()`` folds to ``True`` for every trace, ``torch.compile`` included (fixed later)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def _skip(kwargs: dict[str, Any]) -> bool:
    """Whether this mask call is a plain causal mask that SDPA's ``is_causal`` expresses exactly."""
    if not torch.compiler.is_compiling() or _exporting() or not _STATE.plain:
        return False
    if id(kwargs.get("config")) not in _ACCEPTED:
        return False
    q, kv, window = kwargs.get("q_length"), kwargs.get("kv_length"), kwargs.get("local_size")
    # A sliding window no longer than the sequence masks more than causality does; a longer one is plain causal.
    return (kwargs.get("attention_mask") is None and (window is None or (kv is not None and kv < window))
            and not kwargs.get("use_vmap", False)  # the model's own or/and mask functions
            and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
            and q is not None and q == kv)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def sdpa_mask_keeping_causal(*args: Any, **kwargs: Any) -> Any:
        if not args and _skip(kwargs):
            return None  # what transformers returns eagerly for the same call: SDPA runs with is_causal=True
        return original(*args, **kwargs)

    sdpa_mask_keeping_causal._lgh_original = original  # type: ignore[attr-defined]
    return sdpa_mask_keeping_causal


def _install_mask_wrapper() -> None:
    from transformers.masking_utils import AttentionMaskInterface

    current = AttentionMaskInterface._global_mapping["sdpa"]
    if getattr(current, "_lgh_original", None) is None:
        AttentionMaskInterface.register("sdpa", _wrap(current))


def keep_causal_sdpa(model: nn.Module) -> list[str]:
    """Let the Hugging Face decoders in ``model`` keep SDPA's causal flash path under ``torch.compile``.

    Call it before the first compiled forward (the fp8 plugins call it at setup). Idempotent; in eager runs it
    changes nothing. The mask builder of transformers' SDPA is wrapped once per process; it acts only for the
    decoders passed here.

    Args:
        model: a module holding ``transformers`` decoders (``LlamaForCausalLM``, a LightningModule around one, or
            a ``torch.compile`` wrapper of either).

    Returns:
        The names (within ``model``) of the decoders it applies to; ``[]`` when there is none (transformers not
        loaded, another attention implementation, another model family).

    Example::

        names = keep_causal_sdpa(lightning_module)   # ['model']
    """
    import sys

    if "transformers" not in sys.modules:  # a model built from transformers has imported it
        return []
    decoders = hf_sdpa_decoders(model)
    if not decoders:
        return []
    _install_mask_wrapper()
    for m in decoders.values():
        if id(m.config) not in _ACCEPTED:
            _ACCEPTED.add(id(m.config))
            weakref.finalize(m.config, _ACCEPTED.discard, id(m.config))
        if not getattr(m, "_lgh_causal_sdpa", False):
            m.register_forward_pre_hook(_plain_call, with_kwargs=True)
            m.register_forward_hook(_call_done, with_kwargs=True, always_call=True)
            m._lgh_causal_sdpa = True
    return list(decoders)
