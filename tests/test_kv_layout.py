"""What attention and the GPU get from ``OffloadedKVCache`` with every layer resident.

The checks behind docs/kv_offload.md, "Decode with every layer resident" (where an all-resident decode measured
slower than ``DynamicCache``'s), are pinned here:

* transformers' sdpa path gets the same call from both caches: no mask in decode, ``enable_gqa`` (no
  ``repeat_kv``), the same ``is_causal`` and the same shapes and numbers; only the strides differ (views of
  ``max_length`` rows against a ``torch.cat`` result);
* a resident layer's ``update`` runs two in-place copies and nothing else (no ring, transport, events or syncs);
* ``--profile-decode`` (the benchmark's decode study) runs on the CPU and interleaves the variants it compares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_gh.kv import KVOffloadEngine, KVOffloadOptions, OffloadedKVCache, cache_kwarg

ROOT = Path(__file__).resolve().parents[1]
HOST = dict(backend="host-copy")
VIEW_OPS = {"aten::slice", "aten::as_strided", "aten::view", "aten::select", "aten::alias"}


def _llama(layers=3):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=600)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, cache, new=5):
    p = torch.randint(96, (2, 9), generator=torch.Generator().manual_seed(3))
    return model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, **{cache_kwarg(model): cache})


@pytest.mark.parametrize("opts", [dict(), dict(resident_layers=1, max_length=14, **HOST)],
                         ids=["all-resident", "offloaded"])
def test_attention_gets_the_same_call_as_with_dynamic_cache(monkeypatch, opts):
    from transformers import DynamicCache

    calls: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), mask=attn_mask, is_causal=kw.get("is_causal"),
                          enable_gqa=kw.get("enable_gqa", False), contiguous=k.is_contiguous(),
                          data=(k.clone(), v.clone())))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = _llama()
    ref = _generate(model, DynamicCache(config=model.config))
    theirs = list(calls)
    calls.clear()
    out = _generate(model, OffloadedKVCache(model, **opts))
    assert torch.equal(out, ref)
    assert len(calls) == len(theirs) == 3 * 5  # 3 layers x (prefill + 4 decode steps)
    for a, b in zip(theirs, calls):
        assert a["mask"] is None and b["mask"] is None  # flash can take every call, decode included
        assert a["enable_gqa"] and b["enable_gqa"] and b["k"][1] == 2  # GQA inside sdpa: no repeat_kv to 4 heads
        assert (a["q"], a["k"], a["is_causal"]) == (b["q"], b["k"], b["is_causal"])
        assert all(torch.equal(x, y) for x, y in zip(a["data"], b["data"]))
    assert [c["is_causal"] for c in calls[:3]] == [True] * 3 and not any(c["is_causal"] for c in calls[3:])
    # The one difference: DynamicCache's torch.cat results are contiguous, ours are views of max_length rows.
    assert all(c["contiguous"] for c in theirs) and not any(c["contiguous"] for c in calls)


def test_a_resident_update_is_two_in_place_copies_and_nothing_else():
    from torch.profiler import ProfilerActivity, profile

    eng = KVOffloadEngine(4, KVOffloadOptions(max_length=32, **HOST))  # free GPU memory unknown: all resident
    k = torch.randn(2, 2, 7, 4)
    for i in range(4):
        eng.update(i, k, k)
    assert eng.plan.offloaded == () and eng.ring is None and eng.transport is None and eng.pool is None
    new = torch.randn(2, 1, 2, 4).transpose(1, 2)  # a projection's layout, as attention layers pass it
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(4):
            keys, _ = eng.update(i, new, new)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in VIEW_OPS]
    copies = [n for n in ops if n == "aten::copy_"]
    assert len(copies) == 2 * 4 and set(ops) <= {"aten::copy_"}, ops
    assert keys.shape == (2, 2, 8, 4) and keys.data_ptr() == eng.buffers(3)[0].data_ptr()


def test_decode_study_runs_on_cpu_and_interleaves(tmp_path, capsys, monkeypatch, frozen_heap):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run as bench_run

    rc = bench_run.main(["--suite", "kv", "--device", "cpu", "--iters", "2", "--warmup", "0", "--layers", "2",
                         "--new-tokens", "3", "--profile-decode", "--attention", "flash", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    study = json.loads((tmp_path / "kv_decode_study.json").read_text())
    assert study["tokens_equal"] is True and study["attention"] == "flash"
    # Round 0 starts with GPU-only, round 1 with ours: order effects show up instead of favouring one side.
    assert [list(r) for r in study["rounds"]] == [["GPU-only DynamicCache", "ours default"],
                                                  ["ours default", "GPU-only DynamicCache"]]
    assert len(study["ours default"]["per_round"]) == 2
    assert set(study["steps"]) == {"GPU-only DynamicCache", "ours default"}
    assert "busiest host-side ops" in study["steps"]["ours default"]["table"]
    assert study["layouts"][0]["layout"].startswith("contiguous") and len(study["layouts"]) >= 4
    rows = {r["variant"]: r for r in json.loads((tmp_path / "bench_kv.json").read_text())["results"]}
    assert list(rows) == ["ours R=0"] and rows["ours R=0"]["tokens_equal"] is True
