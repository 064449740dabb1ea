"""Hugging Face ``transformers`` models train without their KV cache while CUDAGraphCapture is attached.

A transformers decoder builds a KV cache whenever ``config.use_cache`` is true, in training too, although no
training loss reads it. Building it can be uncapturable: ``MistralForCausalLM`` (and other models with sliding-window
layers) makes a sliding-window cache whose ``lazy_initialization`` in ``cache_utils.py`` synchronises with the host,
so the whole step cannot be captured; on the others it is wasted work and memory. :class:`TrainingKVCacheOff` sets
``config.use_cache=False`` on every ``transformers.PreTrainedModel`` inside the LightningModule for the training
steps, puts the user's values back for validation (so ``generate`` in a validation step uses its cache as usual) and
at the end of the fit. Losses do not change: the cache only holds keys and values for later tokens.

transformers is never imported here: a LightningModule holding a transformers model has imported it already, so
looking it up in ``sys.modules`` finds it, and a run without transformers pays one dictionary look-up.

Example::

    cache_off = TrainingKVCacheOff.find(pl_module)   # None when no transformers model uses its cache
    if cache_off is not None:
        cache_off.disable()                           # on_train_start, and after each validation
        ...
        cache_off.restore()                           # on_validation_start, teardown
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["TrainingKVCacheOff", "transformers_models"]


def transformers_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``transformers.PreTrainedModel`` submodules of ``module`` (itself included), with their names.

    Args:
        module: usually the LightningModule.

    Returns:
        ``(qualified name, model)`` pairs, outermost first; empty when transformers was never imported.

    Example::

        >>> transformers_models(nn.Linear(2, 2))
        []
    """
    tf = sys.modules.get("transformers")
    if tf is None:
        return []
    try:
        base = tf.PreTrainedModel  # transformers resolves its public names lazily; a broken install has none
    except Exception:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, base) and not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            found.append((name, sub))
    return found


@dataclass
class TrainingKVCacheOff:
    """``config.use_cache=False`` on some transformers models' configs during training steps, and back.

    Build it with :meth:`find`. Configs shared by several modules (a ``*ForCausalLM`` and its inner ``model``) are
    changed once.

    Attributes:
        models: ``(qualified name, class name)`` of the models whose cache is turned off, for the log line.
        original: each config's own ``use_cache`` value, restored by :meth:`restore`.
    """

    models: list[tuple[str, str]]
    configs: list[Any] = field(repr=False)
    original: list[Any] = field(default_factory=list)

    @classmethod
    def find(cls, module: nn.Module) -> "TrainingKVCacheOff | None":
        """The transformers models inside ``module`` whose config asks for a cache; ``None`` when there are none."""
        models, configs, seen = [], [], set()
        for name, model in transformers_models(module):
            config = getattr(model, "config", None)
            if config is None or not getattr(config, "use_cache", False):
                continue
            # Also the inner model's config, in case a wrapper holds a copy rather than the same object.
            for sub in model.modules():
                cfg = getattr(sub, "config", None)
                if cfg is not None and id(cfg) not in seen and getattr(cfg, "use_cache", False):
                    seen.add(id(cfg))
                    configs.append(cfg)
            models.append((name or "<the LightningModule>", type(model).__name__))
        if not configs:
            return None
        return cls(models=models, configs=configs, original=[c.use_cache for c in configs])

    def disable(self) -> None:
        """Training steps from here on build no KV cache."""
        for cfg in self.configs:
            cfg.use_cache = False

    def restore(self) -> None:
        """The user's ``use_cache`` values again (for validation, ``generate`` and after the fit)."""
        for cfg, value in zip(self.configs, self.original):
            cfg.use_cache = value

    def message(self) -> str:
        """The one log line."""
        names = ", ".join(f"{cls} ({name})" for name, cls in self.models)
        return (f"CUDAGraphCapture: training {names} without its KV cache (config.use_cache=False in training steps, "
                "restored for validation and after fit): a training loss never reads it, and building it can sync "
                "the host, which a graph cannot capture.")
