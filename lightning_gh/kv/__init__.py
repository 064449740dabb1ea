"""KV-cache offload for generation inside Lightning.

``OffloadedKVCache(model)`` is a transformers-compatible cache that keeps some layers' keys and values on the GPU
and the rest in a pinned host pool, fetching each offloaded layer's valid prefix into a ring of GPU staging slots
while the previous layer computes. ``GenerationCallback`` generates from fixed prompts during validation with it.
Importing this package does not import transformers.
"""

from lightning_gh.kv.cache import OffloadedKVCache
from lightning_gh.kv.callback import GenerationCallback
from lightning_gh.kv.engine import KVOffloadEngine, KVStats
from lightning_gh.kv.options import KVOffloadOptions
from lightning_gh.kv.plan import KVPlan
from lightning_gh.kv.spec import KVSpec, cache_kwarg, kv_spec

__all__ = ["GenerationCallback", "KVOffloadEngine", "KVOffloadOptions", "KVPlan", "KVSpec", "KVStats",
           "OffloadedKVCache", "cache_kwarg", "kv_spec"]
