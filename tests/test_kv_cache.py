"""KV-cache offload: options, plan, spec, the pool/ring/transport bookkeeping, the transformers Cache,
the demo's generate, GenerationCallback in a Trainer (and under DDP), the benchmark suite, and GPU tests at the end.

On the CPU the offload path runs with ``backend="host-copy"``: host pool, staging ring, prefetch, append-only
writes and slot reuse all run, with synchronous copies between CPU tensors, and every copy is logged by the
transport. Greedy tokens must be bitwise those of transformers' ``DynamicCache`` (or the demo's growing cache).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gh._util import reset_warnings
from lightning_gh.demo import LlamaLM, MarkovDataModule, preset
from lightning_gh.kv import (
    GenerationCallback,
    KVOffloadEngine,
    KVOffloadOptions,
    OffloadedKVCache,
    cache_kwarg,
    kv_spec,
)
from lightning_gh.kv.plan import make_plan, place
from lightning_gh.kv.pool import HostKVPool, HostMemoryError, StagingRing
from lightning_gh.kv.transport import KVHostCopyTransport, rows_geometry

ROOT = Path(__file__).resolve().parents[1]
HOST = dict(backend="host-copy")


def _demo(n_layers=3, seed=0, **kw):
    torch.manual_seed(seed)
    return LlamaLM(preset("tiny", n_layers=n_layers, **kw)).eval()


def _drive(engine, steps, batch=2, heads=2, dim=4, prompt=5, seed=0):
    """Feed random keys/values (a prefill, then ``steps`` single tokens) through every layer; check each returned
    view bitwise against a concatenation of everything fed so far; returns the reference."""
    g = torch.Generator().manual_seed(seed)
    ref = [None] * engine.num_layers
    for step in range(steps + 1):
        q = prompt if step == 0 else 1
        for i in range(engine.num_layers):
            k = torch.randn(batch, heads, q, dim, generator=g)
            v = torch.randn(batch, heads, q, dim, generator=g)
            ref[i] = (k, v) if ref[i] is None else (torch.cat([ref[i][0], k], 2), torch.cat([ref[i][1], v], 2))
            ok, ov = engine.update(i, k, v)
            assert torch.equal(ok, ref[i][0]) and torch.equal(ov, ref[i][1]), (step, i)
    return ref


# ------------------------------------------------------------------------------------------ options, plan


@pytest.mark.parametrize("kw, match", [
    (dict(resident_layers=-1), "resident_layers=-1 must be 'auto' or an int >= 0"),
    (dict(resident_layers="all"), "resident_layers='all'"),
    (dict(max_length=0), "max_length=0 must be None or an int > 0"),
    (dict(gpu_budget_bytes=0), "gpu_budget_bytes=0 must be None or an int > 0"),
    (dict(gpu_memory_fraction=1.5), r"gpu_memory_fraction=1.5 must be a number in \(0, 1\]"),
    (dict(num_slots=1), "num_slots=1 must be an int >= 2"),
    (dict(placement="middle"), "placement='middle' is not known; choose one of \\['spread', 'first'\\]"),
    (dict(backend="tpu"), "backend='tpu' is not known"),
])
def test_options_refuse_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        KVOffloadOptions(**kw)


def test_options_replace_validates_and_refuses_unknown_fields():
    o = KVOffloadOptions().replace(resident_layers=2)
    assert o.resident_layers == 2 and o.num_slots == 2
    with pytest.raises(TypeError, match=r"\['slots'\] are not KVOffloadOptions fields"):
        o.replace(slots=3)


def test_placement_spreads_resident_layers_between_offloaded_ones():
    assert place(16, 8, "spread") == (1, 3, 5, 7, 9, 11, 13, 15)
    assert place(16, 4, "first") == (0, 1, 2, 3)
    assert place(4, 0, "spread") == () and place(4, 9, "spread") == (0, 1, 2, 3)
    assert len(place(16, 6, "spread")) == 6


def test_auto_plan_from_budget_counts_the_ring():
    kw = dict(num_layers=8, layer_bytes=100, batch_size=2, max_length=64, num_slots=2, placement="spread",
              backend="cuda")
    p = make_plan(resident_layers="auto", gpu_budget_bytes=500, **kw)
    assert len(p.resident) == 3 and p.slots == 2 and p.gpu_kv_bytes == 500 and p.gpu_fraction == 500 / 800
    assert make_plan(resident_layers="auto", gpu_budget_bytes=800, **kw).offloaded == ()
    free = make_plan(resident_layers="auto", gpu_budget_bytes=None, free_bytes=1000, gpu_memory_fraction=0.5, **kw)
    assert len(free.resident) == 3  # half of 1000 free bytes
    assert make_plan(resident_layers="auto", gpu_budget_bytes=None, **kw).offloaded == ()  # free memory unknown
    # Link bytes per step: every offloaded prefix in, the new token out.
    assert p.link_bytes_per_step(10) == 5 * (100 // 64) * 11


def test_budget_below_one_layer_and_below_the_ring_are_refused():
    kw = dict(num_layers=8, layer_bytes=100, batch_size=2, max_length=64, num_slots=2, placement="spread",
              backend="cuda")
    with pytest.raises(ValueError, match=r"gpu_budget_bytes=99 is below one layer: one layer's keys\+values for "
                                         r"batch 2 x max_length 64 is 100 bytes"):
        make_plan(resident_layers="auto", gpu_budget_bytes=99, **kw)
    with pytest.raises(ValueError, match="cannot hold the staging ring of num_slots=2"):
        make_plan(resident_layers="auto", gpu_budget_bytes=150, **kw)
    with pytest.raises(ValueError, match="gpu_memory_fraction=0.5 of the 200 free GPU bytes"):
        make_plan(resident_layers="auto", gpu_budget_bytes=None, free_bytes=200, **kw)
    with pytest.raises(ValueError, match="resident_layers=9 exceeds the model's 8 cached layers"):
        make_plan(resident_layers=9, gpu_budget_bytes=None, **kw)
    with pytest.raises(ValueError, match=r"resident_layers=6 with 2 staging slots needs 800 GPU bytes, above "
                                         r"gpu_budget_bytes=500.*resident_layers <= 3"):
        make_plan(resident_layers=6, gpu_budget_bytes=500, **kw)


def test_budget_below_one_layer_from_the_cache_names_the_argument():
    model = _demo(2)
    cache = OffloadedKVCache(model, gpu_budget_bytes=1000, max_length=40, **HOST)
    with pytest.raises(ValueError, match="gpu_budget_bytes=1,000 is below one layer"):
        model.generate(torch.randint(64, (2, 8)), 4, past_key_values=cache)


# ------------------------------------------------------------------------------------------ spec, bad input


def test_spec_from_demo_and_lightning_wrappers():
    s = kv_spec(_demo(3))
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.source) == (3, 2, 16, "LlamaLM")
    assert s.layer_bytes(2, 10, torch.float32) == 2 * 2 * 2 * 10 * 16 * 4


@pytest.mark.parametrize("model, match", [
    (nn.Linear(4, 4), "model=Linear has no KV cache.*found no decoder config"),
    ("gpt2", "model=str has no KV cache.*not a torch.nn.Module"),
])
def test_model_without_kv_cache_is_refused(model, match):
    with pytest.raises(TypeError, match=match):
        OffloadedKVCache(model)


def test_hf_models_without_a_kv_cache_are_refused():
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32))
    with pytest.raises(TypeError, match="model=BertModel has no KV cache.*is not a decoder"):
        OffloadedKVCache(bert)
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                                   state_size=4))
    with pytest.raises(TypeError, match="model=MambaForCausalLM has no KV cache"):
        OffloadedKVCache(mamba)


def test_max_length_below_the_prompt_and_overflow_are_refused():
    model = _demo(2)
    with pytest.raises(ValueError, match=r"max_length=6 is below the prompt: the first forward brings 8 tokens"):
        model.generate(torch.randint(64, (2, 8)), 4, past_key_values=OffloadedKVCache(model, max_length=6, **HOST))
    with pytest.raises(ValueError, match=r"max_length=10 is full: a forward needs 11 tokens"):
        model.generate(torch.randint(64, (2, 8)), 4, past_key_values=OffloadedKVCache(model, max_length=10, **HOST))


def test_batch_change_is_refused():
    eng = KVOffloadEngine(2, KVOffloadOptions(max_length=16, **HOST))
    eng.update(0, torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4))
    with pytest.raises(ValueError, match=r"sized for batch 2 x 1 key/value heads.*brings \(3, 1, 1, 4\)"):
        eng.update(1, torch.zeros(3, 1, 1, 4), torch.zeros(3, 1, 1, 4))


def test_cache_takes_options_or_keywords_never_both():
    with pytest.raises(TypeError, match=r"OffloadedKVCache\(options=...\) must be a KVOffloadOptions, got dict"):
        OffloadedKVCache(_demo(1), {"resident_layers": 1})
    with pytest.raises(TypeError, match="OffloadedKVCache got both options= and resident_layers=0: pass the options "
                                        "in one place"):
        OffloadedKVCache(_demo(1), KVOffloadOptions(num_slots=3), resident_layers=0)
    with pytest.raises(TypeError, match=r"OffloadedKVCache got unknown option\(s\) \['slots'\]"):
        OffloadedKVCache(_demo(1), slots=3)
    opts = KVOffloadOptions(num_slots=3, resident_layers=0)
    assert OffloadedKVCache(_demo(1), opts).options is opts
    assert OffloadedKVCache(_demo(1), num_slots=3, resident_layers=0).options == opts
    with pytest.raises(ValueError, match="resident_layers=-2"):
        OffloadedKVCache(_demo(1), resident_layers=-2)


# --------------------------------------------------------------------- pool, ring, transport bookkeeping


def test_transport_copies_rows_of_the_valid_prefix_and_appended_ranges_only():
    t = KVHostCopyTransport()
    host = torch.randn(2, 3, 10, 4)
    slot = torch.full((2, 3, 10, 4), float("nan"))
    t.fetch_prefix(slot, host, 6, layer=1, slot_index=0)
    assert torch.equal(slot[:, :, :6], host[:, :, :6]) and slot[:, :, 6:].isnan().all()
    slot[:, :, 6:8] = 7.0
    t.append(host, slot, 6, 8, layer=1, slot_index=0)
    assert (host[:, :, 6:8] == 7).all() and not (host[:, :, 8:] == 7).any()
    assert list(t.log) == [("h2d", 1, 0, 0, 6), ("d2h", 1, 0, 6, 8)]
    assert rows_geometry(host, 6, 8) == (6 * 4 * 4, 2 * 4 * 4, 10 * 4 * 4, 6)
    with pytest.raises(ValueError, match="must be contiguous"):
        rows_geometry(host[:, :, :5], 0, 1)


def test_ring_reserves_releases_and_evicts_the_layer_needed_last():
    ring = StagingRing(2, (1, 1, 4, 2), torch.float32, torch.device("cpu"))
    a = ring.take(0, {})
    b = ring.take(2, {})
    assert ring.take(4, {}) is None  # both reserved: nothing may be overwritten
    a.consumed = True
    assert ring.release_consumed("m1") == 1 and not a.reserved and a.free_after == "m1" and b.reserved
    a.length = 3
    assert ring.cached(0, 3) is a and ring.cached(0, 4) is None
    b.consumed = True
    ring.release_consumed("m2")
    # Layer 0 is needed again soonest, so layer 2's slot is the one refilled.
    assert ring.take(4, {0: 0, 4: 1, 2: 5}) is b
    ring.invalidate()
    assert all(s.owner is None and not s.reserved for s in ring.slots)


@pytest.mark.parametrize("resident, slots, placement", [(0, 2, "spread"), (2, 2, "spread"), (1, 3, "first"),
                                                        (0, 5, "spread")])
def test_engine_returns_exact_views_with_append_only_writes_and_prefix_reads(resident, slots, placement):
    eng = KVOffloadEngine(5, KVOffloadOptions(resident_layers=resident, num_slots=slots, placement=placement,
                                              max_length=32, **HOST))
    steps, prompt = 6, 5
    _drive(eng, steps, prompt=prompt)
    plan, log = eng.plan, list(eng.transport.log)
    assert len(plan.resident) == resident and plan.slots == min(slots, 5 - resident)
    for layer in plan.offloaded:
        d2h = [(a, b) for kind, lay, _, a, b in log if kind == "d2h" and lay == layer]
        # Append-only: each layer's keys and values go out once per update, the ranges tiling [0, n) in order.
        assert d2h[::2] == d2h[1::2]
        ends = [b for _, b in d2h[::2]]
        assert [a for a, _ in d2h[::2]] == [0] + ends[:-1] and ends[-1] == prompt + steps
        # Reads bring back the valid prefix only: starting at 0, never beyond what was appended before.
        h2d = [b for kind, lay, _, a, b in log if kind == "h2d" and lay == layer]
        assert all(b <= prompt + steps for b in h2d)
    for kind, lay, _, a, _b in log:
        assert lay not in plan.resident and (kind != "h2d" or a == 0)
    if plan.slots >= len(plan.offloaded):
        # The ring holds every offloaded layer: decode steps find them there and copy nothing back.
        assert eng.stats.ring_hits > 0 and all(b == 0 for kind, _, _, _, b in log if kind == "h2d")
    else:
        assert eng.stats.late_fetches <= 1 and eng.stats.prefetches >= steps * len(plan.offloaded)
        # Each decode step brings every offloaded layer's whole valid prefix back once (keys, then values).
        for n in range(prompt, prompt + steps):
            fetched = [lay for kind, lay, _, a, b in log if kind == "h2d" and b == n]
            assert fetched[::2] == fetched[1::2] and sorted(fetched[::2]) == list(plan.offloaded), n


def test_slots_wait_for_the_marker_behind_the_attention_that_read_them():
    eng = KVOffloadEngine(4, KVOffloadOptions(resident_layers=0, max_length=16, **HOST))
    _drive(eng, 2)
    t = eng.transport
    # Every fill of a reused slot is preceded by a copy-stream wait (on the release marker of its last reader).
    assert sum(1 for kind, _ in t.waits if kind == "copy") >= eng.stats.fetches
    assert sum(1 for kind, _ in t.waits if kind == "compute") >= eng.stats.updates


def test_addresses_stay_fixed_across_steps_and_reset():
    eng = KVOffloadEngine(3, KVOffloadOptions(resident_layers=1, max_length=20, **HOST))
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        eng.update(i, torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g))
    before = eng.addresses()
    _ = [eng.update(i, torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)) for i in range(3)]
    eng.reset()
    assert eng.seq_length() == 0
    _drive(eng, 3, batch=1, prompt=4)
    assert eng.addresses() == before and eng.stats.grown == 0


def test_buffers_grow_with_one_warning_when_max_length_is_left_open():
    reset_warnings("kv:grow")
    eng = KVOffloadEngine(2, KVOffloadOptions(resident_layers=1, **HOST))
    ref = _drive(eng, 2, prompt=500)
    assert eng.max_length == 768  # prompt + 256, rounded up to 256
    with pytest.warns(UserWarning, match="802 tokens do not fit the 768 allocated; reallocating for 1536"):
        for i in range(2):
            k = torch.randn(2, 2, 300, 4)
            ref[i] = (torch.cat([ref[i][0], k], 2), torch.cat([ref[i][1], k], 2))
            ok, ov = eng.update(i, k, k)
            assert torch.equal(ok, ref[i][0]) and torch.equal(ov, ref[i][1])
    assert eng.max_length == 1536 and eng.stats.grown == 1


def test_crop_and_reorder_keep_the_cache_consistent():
    eng = KVOffloadEngine(3, KVOffloadOptions(resident_layers=1, max_length=20, **HOST))
    ref = _drive(eng, 3)
    eng.crop(-2)
    assert eng.lengths == [6, 6, 6]
    idx = torch.tensor([1, 0])
    eng.reorder(idx)
    for i in range(3):
        k = torch.randn(2, 2, 1, 4)
        ok, _ = eng.update(i, k, k)
        assert torch.equal(ok, torch.cat([ref[i][0][:, :, :6][idx], k], 2))


def test_host_pool_checks_free_ram_first(monkeypatch):
    from lightning_gh import hardware

    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 1000)
    with pytest.raises(HostMemoryError, match=r"host pool \(2 offloaded layers.*at most 80% of the.*raise "
                                              r"host_memory_fraction=0.8"):
        HostKVPool(2, (1, 2, 64, 4), torch.float32, pin=False)
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 10**6)
    p = HostKVPool(1, (1, 1, 4, 2), torch.float32, pin=False)
    assert p.layer(0)[0].shape == (1, 1, 4, 2) and not p.pinned


def test_off_gpu_auto_runs_as_a_plain_cache_and_says_so_once():
    reset_warnings("kv:plain-cpu")
    model = _demo(2)
    p = torch.randint(64, (2, 6))
    with pytest.warns(UserWarning, match="not a CUDA GPU, so nothing is offloaded: it runs as a plain preallocated"):
        model.generate(p, 3, past_key_values=OffloadedKVCache(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = OffloadedKVCache(model)
        model.generate(p, 3, past_key_values=cache)
    assert cache.plan.offloaded == () and cache.plan.backend == "plain" and cache.engine.pool is None


# ------------------------------------------------------------------------------ bitwise-equal generation


def test_demo_generate_is_bitwise_equal_with_the_offloaded_cache():
    model = _demo(3)
    p = torch.randint(64, (3, 9))
    ref = model.generate(p, 8)
    assert ref.shape == (3, 17)
    # The cached prefill is the model's forward: its first token is the full forward's argmax.
    assert torch.equal(ref[:, 9], model(p)[:, -1].argmax(-1))
    for kw in (dict(resident_layers=0), dict(resident_layers=1, max_length=17, placement="first")):
        cache = OffloadedKVCache(model, **kw, **HOST)
        assert torch.equal(model.generate(p, 8, past_key_values=cache), ref), kw
        cache.reset()
        assert torch.equal(model.generate(p, 8, past_key_values=cache), ref), kw
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
        model.generate(p, 0)


def _hf(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    extra = {"Mistral": dict(sliding_window=12)}.get(name, {})
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(**common, **extra)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


@pytest.mark.parametrize("name", ["Llama", "Mistral", "Qwen2"])
def test_hf_generate_is_bitwise_equal_to_dynamic_cache(name):
    from transformers import Cache

    model = _hf(name)
    p = torch.randint(96, (2, 10))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(p), pad_token_id=0)
    ref = model.generate(p, **kw)
    # Mistral's sliding window (12) is shorter than prompt + new tokens: its mask, not the cache, drops the old keys.
    opts = dict(resident_layers=1, max_length=22) if name == "Llama" else dict(resident_layers=0)
    cache = OffloadedKVCache(model, **opts, **HOST)
    assert isinstance(cache, Cache) and isinstance(cache, OffloadedKVCache)
    out = model.generate(p, **{cache_kwarg(model): cache}, **kw)
    assert torch.equal(out, ref), (name, opts)
    assert cache.get_seq_length() == 21 and len(cache) == 3 and cache.layers[0].get_seq_length() == 21
    assert "offloaded" in cache.describe() and cache.stats.d2h_bytes > 0


def test_cache_kwarg_follows_the_forward_signature():
    class New(torch.nn.Module):  # transformers >= 5.24
        def forward(self, input_ids, cache=None, use_cache=None):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    class Both(torch.nn.Module):  # a model that takes both keeps the name every transformers version knows
        def forward(self, input_ids, cache=None, past_key_values=None):
            return input_ids

    assert [cache_kwarg(m()) for m in (New, Old, Both)] == ["cache", "past_key_values", "past_key_values"]
    assert cache_kwarg(_demo(1)) == "past_key_values" and cache_kwarg(object()) == "past_key_values"
    # Whatever this transformers calls it: the keyword is taken without a deprecation warning, and the cache is used.
    model = _hf("Llama")
    cache = OffloadedKVCache(model, **HOST)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.generate(torch.randint(96, (1, 5)), max_new_tokens=2, do_sample=False, pad_token_id=0,
                       **{cache_kwarg(model): cache})
    assert cache.get_seq_length() == 6


def test_hf_forward_with_the_cache_matches_dynamic_cache_logits():
    from transformers import DynamicCache

    model = _hf("Llama")
    p = torch.randint(96, (2, 7))
    with torch.no_grad():
        a, b = DynamicCache(), OffloadedKVCache(model, resident_layers=1, max_length=16, **HOST)
        name = cache_kwarg(model)
        la, lb = model(p, **{name: a}).logits, model(p, **{name: b}).logits
        assert torch.equal(la, lb)
        nxt = torch.randint(96, (2, 3))  # a chunk after a prefix: the mask path, not only single tokens
        assert torch.equal(model(nxt, **{name: a}).logits, model(nxt, **{name: b}).logits)
        assert torch.equal(a.layers[2].keys, b.layers[2].keys)


# ------------------------------------------------------------------------------------------ callback


def test_callback_arguments_are_validated():
    with pytest.raises(ValueError, match="every_n_steps=0 must be an int >= 1"):
        GenerationCallback(torch.zeros(1, 2, dtype=torch.long), every_n_steps=0)
    with pytest.raises(ValueError, match="max_new_tokens=-1 must be an int >= 1"):
        GenerationCallback(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"cache='static' is not known; choose one of \['offloaded', 'dynamic'\]"):
        GenerationCallback(torch.zeros(1, 2, dtype=torch.long), cache="static")
    with pytest.raises(ValueError, match=r"share one non-zero length; got lengths \[1, 2\]"):
        GenerationCallback([[1], [1, 2]])
    with pytest.raises(ValueError, match="a tokenizer is needed"):
        GenerationCallback(["hello"])
    with pytest.raises(ValueError, match="must be token ids of shape"):
        GenerationCallback(torch.zeros(1, 2))
    with pytest.raises(TypeError, match=r"GenerationCallback\(options=...\) must be a KVOffloadOptions, got dict"):
        GenerationCallback(torch.zeros(1, 2, dtype=torch.long), options={"resident_layers": 1})


@pytest.mark.parametrize("prompts, match", [
    ([[1, 2.7]], r"prompts must hold integer token ids; got 2.7 \(float\)"),
    ([[1, True]], r"got True \(bool\)"),
    ([[3, -1]], r"prompts hold the token id -1; allowed: ids >= 0"),
    (torch.tensor([[0, -5]]), r"prompts hold the token id -5; allowed: ids >= 0"),
])
def test_callback_refuses_float_and_negative_ids(prompts, match):
    with pytest.raises(ValueError, match=match):
        GenerationCallback(prompts)


@pytest.mark.parametrize("filename, error, match", [
    ("", ValueError, "filename='' must name a file"),
    ("   ", ValueError, "filename='   ' must name a file"),
    ("samples/", ValueError, "filename='samples/' must name a file"),
    (3, TypeError, r"GenerationCallback\(filename=3\): expected a string or None, got int"),
])
def test_callback_refuses_a_filename_that_names_no_file(filename, error, match):
    with pytest.raises(error, match=match):
        GenerationCallback(torch.zeros(1, 2, dtype=torch.long), filename=filename)


def _setup(cb, strategy, model=None):
    from types import SimpleNamespace

    cb.setup(SimpleNamespace(callbacks=[cb], strategy=strategy), model if model is not None else _demo(1), "fit")


def test_callback_refuses_out_of_vocabulary_ids_at_setup():
    model = _demo(1)
    vocab = model.model.cfg.vocab_size
    cb = GenerationCallback(torch.tensor([[0, vocab]]))
    with pytest.raises(ValueError, match=f"prompts hold the token id {vocab}, outside the model's vocabulary of "
                                         f"{vocab}; allowed: ids in 0..{vocab - 1}"):
        _setup(cb, object(), model)
    _setup(GenerationCallback(torch.tensor([[0, vocab - 1]])), object(), model)


class DeepSpeedStrategy:  # stands in for Lightning's (deepspeed is not installed here); matched by name
    def __init__(self, stage):
        self.zero_stage_3 = stage == 3


@pytest.mark.parametrize("strategy, zero_stage, expected", [
    ("SingleDeviceStrategy", None, "rank zero"),
    ("DDPStrategy", None, "rank zero"),
    ("DeepSpeedStrategy", 2, "rank zero"),
    ("ModelParallelStrategy", None, "every rank"),
    ("FSDPStrategy", None, "cannot generate under FSDPStrategy \\(FSDP1\\)"),
    ("DeepSpeedStrategy", 3, "cannot generate under DeepSpeed ZeRO stage 3"),
])
def test_which_ranks_generate_under_each_strategy(strategy, zero_stage, expected):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_gh.kv.callback import ranks_that_generate

    if expected.startswith("cannot"):
        with pytest.raises(MisconfigurationException, match=expected + ".*Allowed: ModelParallelStrategy"):
            ranks_that_generate(strategy, zero_stage)
    else:
        assert ranks_that_generate(strategy, zero_stage) == expected


def test_callback_refuses_fsdp1_and_deepspeed_stage_3_at_setup():
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.strategies import FSDPStrategy

    prompts = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(MisconfigurationException, match="under FSDPStrategy"):
        _setup(GenerationCallback(prompts), FSDPStrategy())
    with pytest.raises(MisconfigurationException, match="under DeepSpeed ZeRO stage 3"):
        _setup(GenerationCallback(prompts), DeepSpeedStrategy(3))
    _setup(GenerationCallback(prompts), DeepSpeedStrategy(2))


def test_callback_record_on_the_cpu_says_what_happened():
    reset_warnings("kv:plain-cpu")
    model = _demo(2)
    with pytest.warns(UserWarning, match="not a CUDA GPU"):
        record = GenerationCallback(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2).generate(model)
    assert record["kv"] == "OffloadedKVCache as a plain cache on cpu (no GPU): nothing offloaded"
    assert "GPU" not in record["plan"].replace("CUDA GPU", "") and record["gpu_kv_fraction"] is None
    assert record["plan"].startswith("all 2 layers on the CPU")
    record = GenerationCallback(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2,
                                options=KVOffloadOptions(resident_layers=1, **HOST)).generate(model)
    assert record["kv"] == "OffloadedKVCache: 1/2 layers offloaded to host memory, 1 resident on cpu"
    assert "pinned" not in record["plan"] and "CPU KV" in record["plan"]


def _fit(callbacks, tmp_path, steps=4, logger=True, sanity=1, val_every=2, **kw):
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    model = LlamaLM(preset("tiny", n_layers=2, seq_len=32, batch_size=2))
    dm = MarkovDataModule.for_model(model, num_train_samples=64, num_val_samples=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, val_check_interval=val_every, limit_val_batches=1,
                        check_val_every_n_epoch=None, num_sanity_val_steps=sanity,
                        logger=CSVLogger(tmp_path, name="", version="logs") if logger else False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=callbacks, **kw)
    trainer.fit(model, dm)
    return trainer, model


def test_callback_generates_in_validation_and_logs_speed_and_ids(tmp_path):
    prompts = torch.randint(64, (2, 6))
    cb = GenerationCallback(prompts, every_n_steps=4, max_new_tokens=5,
                            options=KVOffloadOptions(resident_layers=1, **HOST))
    trainer, model = _fit([cb], tmp_path, steps=6)
    # Validation at steps 2, 4 and 6; generation at 2 and 6 (4 steps apart); never in the sanity check.
    assert [h["step"] for h in cb.history] == [2, 6]
    rows = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "gen/tokens_per_s" in header and "gen/new_tokens" in header and "gen/gpu_kv_fraction" in header
    col = header.index("gen/new_tokens")
    assert [r.split(",")[col] for r in rows[1:] if r.split(",")[col]] == ["10.0", "10.0"]
    lines = [json.loads(x) for x in (tmp_path / "logs" / "generations.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 6] and len(lines[0]["ids"]) == 2 and len(lines[0]["ids"][0]) == 5
    # The ids are the model's greedy tokens (same as a plain cache), and the cache was built once.
    with torch.inference_mode():
        assert lines[-1]["ids"] == model.generate(prompts, 5)[:, 6:].tolist()
    assert cb._cache_obj is None  # released at teardown


class _OnlyRankZeroGenerates(L.Callback):
    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        (cb,) = [c for c in trainer.callbacks if isinstance(c, GenerationCallback)]
        expected = 1 if trainer.global_rank == 0 else 0
        if len(cb.history) != expected:
            raise AssertionError(f"rank {trainer.global_rank}: {len(cb.history)} generations, expected {expected}")


def test_callback_under_ddp_generates_on_rank_zero_only(tmp_path):
    cb = GenerationCallback(torch.randint(64, (2, 4)), every_n_steps=100, max_new_tokens=3,
                            options=KVOffloadOptions(resident_layers=0, **HOST))
    # Forked workers start in a moment (no re-import); spawn where CUDA is already initialised in this process.
    strategy = "ddp_spawn" if torch.cuda.is_available() and torch.cuda.is_initialized() else "ddp_fork"
    _fit([cb, _OnlyRankZeroGenerates()], tmp_path, steps=1, logger=False, sanity=0, val_every=1, devices=2,
         strategy=strategy)


_SHARDED_WORKER = """
import json, os, socket, sys, traceback
import lightning as L
import torch
import transformers
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from lightning_gh.kv import GenerationCallback, KVOffloadOptions

out = sys.argv[1]
transformers.logging.set_verbosity_error()

# The two ranks are this interpreter and a fork of it, made here after the imports (Lightning's own launcher would
# start a second interpreter); LOCAL_RANK in the environment tells Lightning the processes exist already.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
child = os.fork()
rank = 1 if child == 0 else 0
os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))


class LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))

    def configure_model(self):
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)

    def training_step(self, batch, i):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch, i):
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Recording(GenerationCallback):  # keeps what every rank generated, not only rank 0's record
    generated = []

    def generate(self, pl_module, every_rank=False):
        record = super().generate(pl_module, every_rank)
        self.generated.append(record["ids"])
        return record


data = DataLoader(TensorDataset(torch.randint(64, (16, 8), generator=torch.Generator().manual_seed(0))), batch_size=2)
cb = Recording(torch.randint(64, (2, 4), generator=torch.Generator().manual_seed(1)), every_n_steps=1,
               max_new_tokens=3, options=KVOffloadOptions(resident_layers=0, backend="host-copy"))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                    tensor_parallel_size=1), max_steps=2, val_check_interval=1, limit_val_batches=1,
                    check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, callbacks=[cb])
try:
    trainer.fit(LM(), data, data)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"history": [h["ids"] for h in cb.history], "generated": cb.generated}, f)
except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
if child == 0:
    sys.stdout.flush()
    os._exit(0)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


@pytest.mark.slow
def test_callback_under_fsdp2_generates_on_every_rank_in_lock_step(tmp_path):
    """Two gloo processes under ModelParallelStrategy (FSDP2): every rank joins the generation's all-gathers and
    generates the same tokens; only rank 0 records. Run in a subprocess that is killed, with its rank-1 child, if it
    does not end in time: a hang fails the test instead of stalling the suite."""
    import os
    import signal
    import subprocess
    import sys

    pytest.importorskip("transformers")
    script = tmp_path / "worker.py"
    script.write_text(_SHARDED_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's rank-1 child is in the same process group
        log, _ = proc.communicate()
        pytest.fail(f"generation under FSDP2 did not finish in 600 s (hang?):\n{log[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["history"]) == 2 and r1["history"] == []  # validation at steps 1 and 2; rank 0 records
    assert r0["generated"] == r1["generated"] == r0["history"]
    assert all(len(ids) == 2 and len(ids[0]) == 3 for ids in r0["history"])


# ------------------------------------------------------------------------------------- package, suite


def test_kv_imports_transformers_only_on_use():
    import ast

    # (lightning's torchmetrics imports transformers whenever it is installed, so sys.modules cannot tell.)
    for path in sorted((ROOT / "lightning_gh" / "kv").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "transformers" for n in names), f"{path.name}: module-level import"


def test_kv_works_without_transformers(monkeypatch):
    import lightning_gh.kv.cache as cache_mod

    monkeypatch.setattr(cache_mod, "_with_transformers_base", lambda: None)
    model = _demo(1)
    p = torch.randint(64, (1, 4))
    cache = OffloadedKVCache(model, resident_layers=0, **HOST)
    assert type(cache).__mro__ == (OffloadedKVCache, object)
    assert torch.equal(model.generate(p, 3, past_key_values=cache), model.generate(p, 3))


def test_kv_suite_runs_on_cpu(tmp_path, capsys, monkeypatch, frozen_heap):
    pytest.importorskip("transformers")
    # In-process (the runner is importable), so the test pays no second interpreter start and import of transformers.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run as bench_run

    rc = bench_run.main(["--suite", "kv", "--device", "cpu", "--iters", "1", "--warmup", "0", "--layers", "4",
                         "--new-tokens", "3", "--resident", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    data = json.loads((tmp_path / "bench_kv.json").read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["GPU-only DynamicCache", "transformers offloaded", "ours R=0", "ours 50% KV budget",
                          "ours default", "ours all resident", "GPU-only DynamicCache, again",
                          "GPU-only chunked prefill"]
    assert rows["transformers offloaded"]["error"].startswith("skipped")
    assert rows["GPU-only chunked prefill"]["prefill_chunk_size"] == 6  # a quarter of the tiny prompt
    for v in ("ours R=0", "ours 50% KV budget", "ours default", "ours all resident"):
        assert rows[v]["error"] is None and rows[v]["tokens_equal"] is True, rows[v]
    assert rows["ours R=0"]["offloaded"] == 4 and rows["ours R=0"]["kv_gpu_fraction"] == 0.5  # the 2 slots
    assert rows["ours 50% KV budget"]["kv_gpu_fraction"] <= 0.5 and rows["ours all resident"]["offloaded"] == 0
    assert rows["GPU-only DynamicCache, again"]["tokens_equal"] is True  # the drift control repeats the reference
    assert "tokens bitwise equal to GPU-only: all" in out


# ------------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.gpu


@gpu
def test_gpu_transport_copies_match_torch():
    from lightning_gh.kv.transport import KVCudaTransport

    t = KVCudaTransport(torch.device("cuda"))
    shape = (3, 2, 40, 16)
    host = torch.randn(shape, dtype=torch.bfloat16).pin_memory()
    slot = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    t.fetch_prefix(slot, host, 25)
    t.synchronize()
    assert torch.equal(slot[:, :, :25].cpu(), host[:, :, :25]) and slot[:, :, 25:].isnan().all()
    slot[:, :, 25:31] = 3.0
    t.copy_waits(t.compute_marker())
    t.append(host, slot, 25, 31)
    t.synchronize()
    assert (host[:, :, 25:31] == 3).all() and not (host[:, :, 31:] == 3).any()
    assert t._memcpy2d is not None, "cudaMemcpy2DAsync not found: the fallback path is slow"


@gpu
@pytest.mark.parametrize("opts", [dict(resident_layers=0), dict(resident_layers=2),
                                  dict(resident_layers=1, num_slots=3),
                                  dict(gpu_budget_bytes=3 * 2 * 4 * 2 * 4 * 200 * 8 * 2)])
def test_gpu_hf_generate_is_bitwise_equal_to_dynamic_cache(opts):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    p = torch.randint(512, (4, 150), device="cuda")
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(p), pad_token_id=0)
    ref = model.generate(p, **kw)
    cache = OffloadedKVCache(model, max_length=190, **opts)
    out = model.generate(p, **{cache_kwarg(model): cache}, **kw)
    assert torch.equal(out, ref)
    assert cache.plan.backend == "cuda" and cache.engine.pool.pinned
    before = cache.engine.addresses()
    cache.reset()
    assert torch.equal(model.generate(p, **{cache_kwarg(model): cache}, **kw), ref)
    assert cache.engine.addresses() == before
    if cache.plan.slots < len(cache.plan.offloaded):
        assert cache.stats.late_fetches <= 2  # one per generate (the first layer of the prefill); the rest prefetched


@gpu
def test_gpu_demo_generate_is_bitwise_equal():
    torch.manual_seed(0)
    model = LlamaLM(preset("small", n_layers=4, seq_len=256)).to("cuda", torch.bfloat16).eval()
    p = torch.randint(8192, (4, 100), device="cuda")
    ref = model.generate(p, 30)
    for r in (0, 2):
        assert torch.equal(model.generate(p, 30, past_key_values=OffloadedKVCache(model, resident_layers=r,
                                                                                   max_length=130)), ref)
