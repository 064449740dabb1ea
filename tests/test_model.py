"""The reference Llama-style model: shapes, presets, attention, rotary embeddings, and that it learns."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_gh.demo import PRESETS, Llama, LlamaLM, MarkovDataModule, preset
from lightning_gh.demo.model import apply_rotary, rotary_tables


def test_presets_have_their_documented_shapes():
    s, m, g = PRESETS["small"], PRESETS["medium"], PRESETS["large"]
    assert (s.dim, s.n_layers, s.n_heads, s.ffn_dim, s.vocab_size, s.batch_size, s.seq_len) == (512, 6, 8, 1408, 8192, 4, 128)
    assert (m.dim, m.n_layers, m.n_heads, m.ffn_dim, m.vocab_size, m.batch_size, m.seq_len) == (2048, 8, 16, 5632, 32000, 4, 2048)
    assert (g.dim, g.n_layers, g.n_heads, g.ffn_dim, g.vocab_size, g.batch_size, g.seq_len) == (4096, 4, 32, 14336, 32000, 2, 4096)
    # The medium preset is the 542M-parameter model of the activation anchors.
    assert round(m.num_params() / 1e6) == 542


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_formula_matches_the_module(name):
    with torch.device("meta"):
        model = Llama(PRESETS[name])
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params()


def test_tied_head_shares_the_embedding():
    cfg = preset("tiny", tie_embeddings=True)
    model = Llama(cfg)
    assert model.head.weight is model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_forward_shape_and_causality():
    cfg = preset("tiny")
    model = Llama(cfg).eval()
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
    logits = model(tokens)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    changed = tokens.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % cfg.vocab_size
    # Positions before the change cannot see it.
    torch.testing.assert_close(model(changed)[:, :40], logits[:, :40])
    assert not torch.allclose(model(changed)[:, 40:], logits[:, 40:])


def test_gqa_equals_repeated_kv_heads():
    cfg = preset("tiny")  # 4 query heads, 2 kv heads
    assert cfg.n_kv_heads < cfg.n_heads
    q = torch.randn(2, cfg.n_heads, 16, cfg.head_dim)
    k = torch.randn(2, cfg.n_kv_heads, 16, cfg.head_dim)
    v = torch.randn(2, cfg.n_kv_heads, 16, cfg.head_dim)
    rep = cfg.n_heads // cfg.n_kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)


def test_rotary_scores_depend_only_on_relative_position():
    cos, sin = rotary_tables(16, 64, 10000.0)
    q, k = torch.randn(16), torch.randn(16)

    def score(i, j):
        qi = apply_rotary(q.expand(64, 16)[None, None], cos, sin)[0, 0, i]
        kj = apply_rotary(k.expand(64, 16)[None, None], cos, sin)[0, 0, j]
        return float(qi @ kj)

    assert math.isclose(score(10, 3), score(30, 23), rel_tol=1e-4, abs_tol=1e-5)
    assert not math.isclose(score(10, 3), score(10, 4), rel_tol=1e-3)


def test_flops_formula_counts_the_matmuls():
    cfg = PRESETS["large"]
    # 6*N*T for the matrix products dominates; attention adds a few percent at seq 4096.
    base = 6 * cfg.matmul_params() * cfg.tokens_per_batch
    assert base < cfg.train_flops_per_batch() < 1.1 * base


@pytest.mark.parametrize("bad", [dict(dim=60, n_heads=8), dict(n_kv_heads=3), dict(n_layers=0)])
def test_bad_config_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="LlamaConfig"):
        preset("tiny", **bad)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match=r"preset='huge'.*\['large', 'medium', 'small', 'tiny'\]"):
        preset("huge")
    with pytest.raises(ValueError, match="not LlamaConfig fields"):
        preset("tiny", width=3)


def test_tiny_learns_in_100_cpu_steps(cpu_trainer_kwargs):
    """100 optimizer steps on the CPU must lower the loss clearly: the model and the data can be learned."""
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny", lr=3e-3)
    dm = MarkovDataModule.for_model(model)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(max_steps=100, limit_val_batches=0, callbacks=[Record()], **cpu_trainer_kwargs)
    trainer.fit(model, dm)
    assert trainer.global_step == 100
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert first > math.log(64) - 0.3  # starts near uniform over 64 tokens
    assert last < 0.5 * first, (first, last)
    assert last < dm.corpus.entropy + 0.6  # and gets close to the chain's entropy floor


def test_lightning_module_roundtrips_a_checkpoint(tmp_path, cpu_trainer_kwargs):
    model = LlamaLM.from_preset("tiny")
    dm = MarkovDataModule.for_model(model)
    kwargs = {**cpu_trainer_kwargs, "enable_checkpointing": True}
    trainer = L.Trainer(max_steps=3, limit_val_batches=0, **kwargs)
    trainer.fit(model, dm)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = LlamaLM.load_from_checkpoint(path)
    assert loaded.config == model.config
    for a, b in zip(loaded.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_loss_matches_the_eager_loss():
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny", compile_loss=True)
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    eager = model.loss(batch)
    model.configure_model()  # what Lightning calls at setup: wraps the loss in torch.compile
    from lightning_gh.demo.model import _cross_entropy

    assert model._cross_entropy is not _cross_entropy
    torch.testing.assert_close(model.loss(batch), eager, rtol=1e-5, atol=1e-5)
    assert model.hparams.compile_loss is True
