"""The synthetic Markov data: deterministic, learnable, and slow on purpose when asked."""

import time

import pytest
import torch

from lightning_gh.demo import MarkovCorpus, MarkovDataModule, MarkovDataset


def test_streams_follow_the_chain():
    c = MarkovCorpus(vocab_size=32, n_tokens=10_000, branching=3, seed=1)
    s = c.streams
    # Every transition in every stream is one of the state's successors.
    allowed = torch.zeros(32, 32, dtype=torch.bool)
    allowed[torch.arange(32)[:, None], c.successors] = True
    assert allowed[s[:, :-1], s[:, 1:]].all()
    assert 0 < c.entropy < torch.log(torch.tensor(3.0))


def test_same_seed_same_data_different_seed_different_data():
    a = MarkovCorpus(64, 5000, seed=3).streams
    b = MarkovCorpus(64, 5000, seed=3).streams
    c = MarkovCorpus(64, 5000, seed=4).streams
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_samples_are_shifted_windows_and_deterministic():
    dm = MarkovDataModule(vocab_size=64, seq_len=32, batch_size=4)
    dm.setup("fit")
    ds = dm.train_dataloader().dataset
    x, y = ds[7]
    assert x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1])
    x2, _ = ds[7]
    assert torch.equal(x, x2)


def test_loader_options_reach_the_dataloader():
    dm = MarkovDataModule(vocab_size=64, seq_len=16, batch_size=4, num_workers=2, pin_memory=True,
                          persistent_workers=True, prefetch_factor=3)
    loader = dm.train_dataloader()
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers, loader.prefetch_factor) == (2, True, True, 3)


def test_workers_produce_the_same_batches_as_the_main_process():
    kw = dict(vocab_size=64, seq_len=16, batch_size=4, num_train_samples=64)
    a = MarkovDataModule(**kw).val_dataloader()
    b = MarkovDataModule(num_workers=2, **kw).val_dataloader()
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("kind", ["sleep", "spin"])
def test_artificial_cost_slows_each_sample(kind):
    c = MarkovCorpus(64, 5000)
    ds = MarkovDataset(c, seq_len=16, num_samples=10, sample_cost_ms=20.0, cost_kind=kind)
    t0 = time.perf_counter()
    for i in range(5):
        ds[i]
    assert time.perf_counter() - t0 >= 5 * 0.02


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_workers=-1), "num_workers=-1"),
        (dict(persistent_workers=True), "need num_workers > 0"),
        (dict(cost_kind="busy"), "cost_kind='busy'"),
        (dict(batch_size=0), "batch_size=0"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MarkovDataModule(**kwargs)


def test_sequence_longer_than_the_streams_is_a_clear_error():
    with pytest.raises(ValueError, match="seq_len=100"):
        MarkovDataset(MarkovCorpus(8, 500, n_streams=10), seq_len=100, num_samples=1)
