"""fp8 on a model the user compiled as a whole: SDPA keeps its causal path in HF decoders.

Under ``torch.compile`` transformers builds an explicit causal mask for SDPA (eagerly it passes none and
``is_causal=True``), which keeps SDPA off its flash kernel. ``keep_causal_sdpa`` (applied by the fp8-ao plugins on a
compiled model) skips the mask only for calls without ``attention_mask``, ``position_ids`` or cache. These tests
check the compiled graph, and that the results equal eager ones for plain, packed and padded calls.

CPU only: graphs are inspected with a recording Dynamo backend, runs use ``aot_eager`` (Inductor takes minutes here),
fp8 matmuls are emulated.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_gh import _hf
from lightning_gh._hf import hf_sdpa_decoders, keep_causal_sdpa
from lightning_gh.precision import TorchAOFloat8Precision, precision

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao.float8")

VOCAB, SEQ = 256, 32


def tiny(family: str = "LlamaForCausalLM", attn: str = "sdpa", layers: int = 2, **extra):
    cfg_cls = getattr(transformers, family.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(hidden_size=64, num_hidden_layers=layers, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=attn,
                  **extra)
    torch.manual_seed(0)
    return getattr(transformers, family)(cfg)


class _Recorder:
    """A Dynamo backend that records each SDPA call's (has a mask, is_causal) and runs the graph as traced."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def __call__(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if "scaled_dot_product_attention" in str(node.target):
                has_mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is not None
                self.calls.append((has_mask, bool(node.kwargs.get("is_causal", False))))
        return gm.forward


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_compiled_decoder_keeps_sdpa_causal_path_and_matches_eager(family):
    model = tiny(family)
    assert keep_causal_sdpa(model) == [""]
    x = _tokens()
    ref = model(input_ids=x, labels=x)
    ref.loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    rec = _Recorder()
    out = torch.compile(model, backend=rec)(input_ids=x, labels=x)
    out.loss.backward()
    assert rec.calls == [(False, True)] * 2  # both layers: no mask, is_causal=True (as eagerly)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    for g, r in zip((p.grad for p in model.parameters()), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _transformers_own_calls(model, monkeypatch, **kwargs) -> list[tuple[bool, bool]]:
    """The SDPA calls transformers itself makes for ``model(**kwargs)`` under ``torch.compile``: the mask builder
    without keep_causal_sdpa's wrapper. (transformers 5.17 builds an explicit causal mask there; later releases,
    e.g. 5.23, pass none and ``is_causal=True`` themselves.)"""
    from transformers.masking_utils import AttentionMaskInterface

    current = AttentionMaskInterface._global_mapping["sdpa"]
    original = getattr(current, "_lgh_original", current)
    rec = _Recorder()
    with monkeypatch.context() as m:
        m.setitem(AttentionMaskInterface._global_mapping, "sdpa", original)
        torch._dynamo.reset()
        torch.compile(model, backend=rec)(**kwargs)
    torch._dynamo.reset()
    return rec.calls


def test_packed_and_padded_calls_keep_their_mask_under_compile(monkeypatch):
    """Calls with positions or a padding mask are left to transformers: the same SDPA calls as without the wrapper,
    and the same results as eagerly."""
    model = tiny()
    keep_causal_sdpa(model)
    x = _tokens()
    pos = torch.cat([torch.arange(16), torch.arange(16)]).unsqueeze(0).expand(2, -1)  # packed: restart at 16
    am = torch.ones(2, SEQ, dtype=torch.long)
    am[1, :5] = 0  # left padding
    own = {name: _transformers_own_calls(model, monkeypatch, input_ids=x, **kw)
           for name, kw in (("packed", dict(position_ids=pos)), ("padded", dict(attention_mask=am)))}
    rec = _Recorder()
    compiled = torch.compile(model, backend=rec)
    compiled(input_ids=x)  # plain first, so the calls below must not reuse its causal graph
    assert rec.calls == [(False, True)] * 2
    for name, kw in (("packed", dict(position_ids=pos)), ("padded", dict(attention_mask=am))):
        rec.calls.clear()
        got = compiled(input_ids=x, **kw).logits
        assert rec.calls == own[name], name
        torch.testing.assert_close(got, model(input_ids=x, **kw).logits, rtol=1e-5, atol=1e-5)
    assert all(has_mask for has_mask, _ in own["padded"])  # padding always needs a mask


def test_only_accepted_decoders_are_changed(monkeypatch):
    assert keep_causal_sdpa(tiny(attn="eager")) == []  # not SDPA
    assert keep_causal_sdpa(torch.nn.Linear(2, 2)) == []
    other = tiny()
    other.config.model_type = "gemma3"  # a family whose mask calls may carry its own or/and masks
    assert hf_sdpa_decoders(other) == {}

    # a decoder that was not passed to keep_causal_sdpa keeps transformers' behaviour under compile
    keep_causal_sdpa(tiny())  # the wrapper is installed process-wide ...
    untouched = tiny()
    own = _transformers_own_calls(untouched, monkeypatch, input_ids=_tokens())
    rec = _Recorder()
    torch.compile(untouched, backend=rec)(input_ids=_tokens())
    assert rec.calls == own  # ... but acts only for the decoders it was given


def test_wrapper_declines_outside_compile_and_while_exporting(monkeypatch):
    model = tiny()
    keep_causal_sdpa(model)
    call = dict(config=model.config, q_length=SEQ, kv_length=SEQ, q_offset=0, kv_offset=0, attention_mask=None,
                local_size=None, use_vmap=False)
    monkeypatch.setattr(_hf._STATE, "plain", True)
    assert not _hf._skip(call)  # eager: transformers decides (it returns None itself)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _hf._skip(call)
    assert not _hf._skip({**call, "local_size": 8})  # a sliding window shorter than the sequence
    assert _hf._skip({**call, "local_size": SEQ + 1})  # ... longer: plain causal, skipped as eagerly
    assert not _hf._skip({**call, "use_vmap": True})  # the model's own or/and mask functions
    assert not _hf._skip({**call, "kv_length": SEQ + 4, "kv_offset": 4})  # a cache with an offset
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True, raising=False)  # what torch.export sets
    assert not _hf._skip(call)  # export: is_causal would be hard-coded for every later length


class CompiledHFLM(L.LightningModule):
    """A user who compiles the whole transformers model in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        # One decoder layer: the mask (or its absence) is built once per forward for all layers, so one layer shows
        # what the plugin changes, and the whole model compiles (fp8 emulated) in about half the time of two.
        self.model = tiny(layers=1)

    def configure_model(self) -> None:
        self.model = torch.compile(self.model, backend="aot_eager")

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(plugin, cpu_trainer_kwargs, steps: int = 3) -> tuple[list[float], CompiledHFLM]:
    L.seed_everything(0)
    model = CompiledHFLM()
    rec = _Losses()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randint(VOCAB, (steps * 2, SEQ), generator=torch.Generator().manual_seed(1))), batch_size=2)
    L.Trainer(max_steps=steps, callbacks=[rec], plugins=[plugin], **cpu_trainer_kwargs).fit(model, data)
    return rec.losses, model


def test_ao_plugin_on_a_compiled_hf_model_keeps_causal_sdpa_with_equal_losses(cpu_trainer_kwargs, caplog):
    # min_dim=0 and no skips, so the tiny model's layers do train in (emulated) fp8
    opts = dict(emulate=True, min_dim=0, skip_head=False, skip_first=False)
    torch._dynamo.reset()
    with caplog.at_level("INFO"):
        on, model = _fit(precision("fp8-ao-tensorwise", **opts), cpu_trainer_kwargs)
    assert getattr(model.model._orig_mod, "_lgh_causal_sdpa", False)
    assert "keeps its causal flash path" in caplog.text
    torch._dynamo.reset()
    off, model = _fit(precision("fp8-ao-tensorwise", causal_sdpa=False, **opts), cpu_trainer_kwargs)
    assert not getattr(model.model._orig_mod, "_lgh_causal_sdpa", False)
    # the same attention through two kernels: equal up to float rounding at the first step; after AdamW updates
    # the emulated fp8 casts (a rounding step) can amplify those differences a little
    assert on[0] == pytest.approx(off[0], rel=1e-5)
    assert on == pytest.approx(off, rel=2e-3)


def test_ao_plugin_leaves_an_eager_model_without_the_hook(cpu_trainer_kwargs):
    class EagerHFLM(CompiledHFLM):
        def configure_model(self) -> None:
            pass

    plugin = precision("fp8-ao-tensorwise", emulate=True, min_dim=0, compile_blocks={"backend": "aot_eager"})
    L.seed_everything(0)
    model = EagerHFLM()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))), batch_size=2)
    L.Trainer(max_steps=1, plugins=[plugin], **cpu_trainer_kwargs).fit(model, data)
    # regional compilation builds the mask eagerly (None): nothing to change there
    assert not getattr(model.model, "_lgh_causal_sdpa", False)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_causal_sdpa_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"causal_sdpa={value!r}\): expected True or False"):
        TorchAOFloat8Precision(causal_sdpa=value, emulate=True)
