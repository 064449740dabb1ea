"""KV-cache offload with a chunked prefill (transformers' ``prefill_chunk_size``), the way to decode a long prompt
under a memory cap: prefill activations are bounded by the chunk, not by the prompt.

On the CPU with ``backend="host-copy"``. Greedy tokens must be bitwise those of ``DynamicCache`` with the same
chunks; a cache sized at first use (``max_length=None``) sees the prompt one chunk at a time, grows, and must make
its split again for the longer layers, staying inside its budget.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_gh._util import reset_warnings
from lightning_gh.demo import LlamaLM, preset
from lightning_gh.kv import GenerationCallback, OffloadedKVCache, cache_kwarg

transformers = pytest.importorskip("transformers")
HOST = dict(backend="host-copy")


def _hf(name: str, layers: int = 4, positions: int = 64, **sizes):
    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=positions)
    common.update(sizes)
    extra = {"Mistral": dict(sliding_window=12)}.get(name, {})
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(**common, **extra)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


def _kv(model, cache):
    return {cache_kwarg(model): cache}


def _greedy(model, prompts, new, **kw):
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("name", ["Llama", "Mistral", "Qwen2"])
def test_chunked_prefill_gives_the_tokens_of_dynamic_cache_with_the_same_chunks(name):
    model = _hf(name)
    p = torch.randint(96, (2, 20))
    plain = _greedy(model, p, 10)
    ref = _greedy(model, p, 10, prefill_chunk_size=6)
    # 4 layers, none resident, 2 slots: every chunk and every step fetches prefixes back from the host pool.
    cache = OffloadedKVCache(model, resident_layers=0, max_length=30, **HOST)
    out = _greedy(model, p, 10, **_kv(model, cache), prefill_chunk_size=6)
    assert torch.equal(out, ref), name
    # Greedy tokens of the tiny models do not depend on the chunking either (their logits may, in the last bits).
    assert torch.equal(out, plain), name
    assert cache.get_seq_length() == 29 and cache.plan.offloaded == (0, 1, 2, 3)
    s = cache.stats
    assert s.h2d_bytes > 0 and s.d2h_bytes > 0 and s.ring_hits == 0, s
    # The 4 chunks (6, 6, 6, 2 tokens) were appended to the host pool, not written in one piece.
    assert s.updates == 4 * (4 + 9)


def test_chunked_prefill_logits_match_dynamic_cache_chunk_by_chunk():
    model = _hf("Llama")
    p = torch.randint(96, (2, 18))
    a = transformers.DynamicCache()
    b = OffloadedKVCache(model, resident_layers=1, max_length=18, **HOST)
    with torch.no_grad():
        for chunk in p.split(5, dim=1):
            la, lb = model(chunk, past_key_values=a).logits, model(chunk, past_key_values=b).logits
            assert torch.equal(la, lb)
    for i in range(4):
        assert torch.equal(a.layers[i].keys, b.layers[i].keys) and torch.equal(a.layers[i].values, b.layers[i].values)


def test_cache_sized_at_first_use_grows_through_the_chunks_and_plans_again_within_its_budget():
    reset_warnings("kv:grow")
    model = _hf("Llama", positions=1024)
    p = torch.randint(96, (1, 900))
    ref = _greedy(model, p, 5, prefill_chunk_size=300)
    # One layer (batch 1, 2 kv heads, head dim 8, fp32) is 2 * 2 * 8 * 4 = 128 bytes per token: at the first chunk's
    # sizing (300 + 256 -> 768 tokens) all 4 layers fit this budget; at 1536 tokens only the 2 staging slots do.
    budget = 4 * 128 * 768
    cache = OffloadedKVCache(model, gpu_budget_bytes=budget, **HOST)
    plans = []
    real_build = cache.engine._build

    def spy(max_len):
        plans.append((max_len, cache.engine.plan.resident, cache.engine.plan.gpu_kv_bytes))
        real_build(max_len)

    cache.engine._build = spy
    with pytest.warns(UserWarning, match="900 tokens do not fit the 768 allocated; reallocating for 1536"):
        out = _greedy(model, p, 5, **_kv(model, cache), prefill_chunk_size=300)
    assert torch.equal(out, ref)
    assert plans == [(768, (0, 1, 2, 3), budget), (1536, (), budget)]
    assert cache.stats.grown == 1 and cache.plan.offloaded == (0, 1, 2, 3) and cache.plan.gpu_kv_bytes <= budget
    # Reuse after reset: no growth, no warning, same tokens.
    cache.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_greedy(model, p, 5, **_kv(model, cache), prefill_chunk_size=300), ref)
    assert cache.stats.grown == 1


def test_growth_keeps_a_fixed_resident_count_and_moves_every_layer_kept_so_far():
    model = _hf("Qwen2", positions=1024)
    p = torch.randint(96, (2, 700))
    ref = _greedy(model, p, 4, prefill_chunk_size=200)
    cache = OffloadedKVCache(model, resident_layers=1, **HOST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _greedy(model, p, 4, **_kv(model, cache), prefill_chunk_size=200)
    assert torch.equal(out, ref)
    # 200 + 256 -> 512 tokens at the first chunk; the third chunk (600) grows them to 1024.
    assert cache.stats.grown == 1 and cache.engine.max_length == 1024
    assert cache.plan.resident == (3,) and cache.plan.offloaded == (0, 1, 2) and cache.stats.h2d_bytes > 0


class _HFModule(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model


def test_callback_passes_prefill_chunk_size_to_transformers_generate(monkeypatch):
    model = _hf("Llama")
    p = torch.randint(96, (2, 12))
    seen = {}
    real = model.generate

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(model, "generate", spy)
    cb = GenerationCallback(p, max_new_tokens=5, prefill_chunk_size=4,
                            options=OffloadedKVCache(model).options.replace(resident_layers=0, backend="host-copy"))
    record = cb.generate(_HFModule(model))
    assert seen["prefill_chunk_size"] == 4
    assert isinstance(seen[cache_kwarg(model)], OffloadedKVCache)  # under the keyword this transformers takes
    ref = _greedy(model, p, 5, prefill_chunk_size=4)[:, 12:]
    assert record["ids"] == ref.tolist() and record["gpu_kv_fraction"] == 0.5


def test_callback_prefill_chunk_size_is_validated_and_refused_for_other_generates():
    ids = torch.zeros(1, 4, dtype=torch.long)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"prefill_chunk_size={bad!r} must be None or an int >= 1"):
            GenerationCallback(ids, prefill_chunk_size=bad)
    for bad in (1.5, True, "512"):
        with pytest.raises(TypeError, match=rf"prefill_chunk_size={bad!r}\): expected an int or None, got "):
            GenerationCallback(ids, prefill_chunk_size=bad)
    lm = LlamaLM(preset("tiny", n_layers=1))
    cb = GenerationCallback(torch.randint(64, (1, 4)), max_new_tokens=2, prefill_chunk_size=2)
    with pytest.raises(ValueError, match="prefill_chunk_size=2 is an option of transformers' generate"):
        cb.generate(lm)


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(), dict(resident_layers=2), dict(gpu_budget_bytes=4 * 2 * 4 * 2 * 1024 * 32 * 2)])
def test_gpu_chunked_prefill_with_growth_is_bitwise_equal_to_dynamic_cache(opts):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _hf("Llama", layers=6, positions=1024, vocab_size=512, hidden_size=256, intermediate_size=512,
                num_attention_heads=8).to("cuda", torch.bfloat16)
    p = torch.randint(512, (4, 600), device="cuda")
    # Chunks after the first attend through a mask, which flash attention does not take: flash or memory-efficient.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        ref = _greedy(model, p, 24, prefill_chunk_size=200)
        # max_length is left open: 200 + 256 -> 512 tokens at the first chunk, grown to 1024 at the third.
        cache = OffloadedKVCache(model, **opts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _greedy(model, p, 24, **_kv(model, cache), prefill_chunk_size=200)
        assert torch.equal(out, ref), cache.describe()
        assert cache.stats.grown == 1 and cache.engine.max_length == 1024
        if "gpu_budget_bytes" in opts:  # 4 layers of 1024 tokens: 2 resident + the 2 slots after growing
            assert cache.plan.gpu_kv_bytes <= opts["gpu_budget_bytes"] and len(cache.plan.resident) == 2
            assert cache.engine.pool.pinned
        cache.reset()
        assert torch.equal(_greedy(model, p, 24, **_kv(model, cache), prefill_chunk_size=200), ref)
        assert cache.stats.grown == 1
