"""Synthetic but learnable language-model data: token streams from a fixed random Markov chain.

Each token has ``branching`` possible successors with fixed, skewed probabilities, so a model can
learn the chain: the loss falls from ``ln(vocab_size)`` towards the chain's entropy
(:attr:`MarkovCorpus.entropy`, about 1.1 nats with the default branching). The corpus is generated
once, vectorised, from a seed; every sample is a window into it, so any worker produces the same
sample for the same index.

An optional artificial per-sample cost reproduces a slow input pipeline on purpose (decode,
tokenisation or storage latency), which is what the data-stall detector is tested against.

Example::

    >>> dm = MarkovDataModule(vocab_size=64, seq_len=32, batch_size=8)
    >>> dm.setup("fit")
    >>> tokens, targets = next(iter(dm.train_dataloader()))
    >>> tokens.shape, bool((tokens[:, 1:] == targets[:, :-1]).all())
    (torch.Size([8, 32]), True)
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["MarkovCorpus", "MarkovDataset", "MarkovDataModule"]

_COST_KINDS = ("sleep", "spin")


class MarkovCorpus:
    """A fixed random Markov chain over ``vocab_size`` tokens and ``n_streams`` sampled streams of it.

    Args:
        vocab_size: number of states / tokens.
        n_tokens: total tokens to generate (split over ``n_streams`` independent streams).
        branching: successors per state.
        seed: makes the chain and the streams reproducible.
        n_streams: independent streams sampled in parallel (vectorises generation).
    """

    def __init__(self, vocab_size: int, n_tokens: int, branching: int = 4, seed: int = 0, n_streams: int = 64) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r} must be >= 2.")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching={branching!r} must be in [1, vocab_size={vocab_size}].")
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        # successors[s, j]: the j-th possible next token after s; choice j has probability probs[j].
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])
        probs = torch.tensor([2.0 ** -j for j in range(branching)])
        self.probs = probs / probs.sum()
        length = max(2, math.ceil(n_tokens / n_streams))
        choices = torch.multinomial(self.probs, n_streams * length, replacement=True, generator=g).view(n_streams, length)
        streams = torch.empty(n_streams, length, dtype=torch.long)
        state = torch.randint(vocab_size, (n_streams,), generator=g)
        for t in range(length):
            streams[:, t] = state
            state = self.successors[state, choices[:, t]]
        self.streams = streams

    @property
    def entropy(self) -> float:
        """The chain's entropy rate in nats: the best achievable mean cross-entropy."""
        return float(-(self.probs * self.probs.log()).sum())


class MarkovDataset(Dataset):
    """``(tokens, targets)`` windows of ``seq_len`` from a :class:`MarkovCorpus`; targets are tokens shifted by one.

    Args:
        corpus: the token streams.
        seq_len: tokens per sample.
        num_samples: length of the dataset.
        offset: first sample index (keeps train and validation windows apart).
        sample_cost_ms: artificial cost per sample, in milliseconds.
        cost_kind: ``"sleep"`` (waits without using a core: the same on any number of cores) or
            ``"spin"`` (burns a core, like decoding or tokenising).
    """

    def __init__(
        self,
        corpus: MarkovCorpus,
        seq_len: int,
        num_samples: int,
        offset: int = 0,
        sample_cost_ms: float = 0.0,
        cost_kind: str = "sleep",
    ) -> None:
        n_streams, length = corpus.streams.shape
        if seq_len + 1 > length:
            raise ValueError(f"seq_len={seq_len} needs streams longer than {seq_len + 1} tokens; the corpus has {length}.")
        if sample_cost_ms < 0:
            raise ValueError(f"sample_cost_ms={sample_cost_ms!r} must be >= 0.")
        if cost_kind not in _COST_KINDS:
            raise ValueError(f"cost_kind={cost_kind!r} is not one of {_COST_KINDS}.")
        self.streams = corpus.streams
        self.seq_len, self.num_samples, self.offset = seq_len, num_samples, offset
        self.sample_cost_ms, self.cost_kind = sample_cost_ms, cost_kind
        self._positions = length - seq_len - 1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        if self.sample_cost_ms:
            self._spend(self.sample_cost_ms / 1e3)
        i = index + self.offset
        stream = i % self.streams.shape[0]
        # A multiplicative hash spreads consecutive indices over the stream.
        start = (i * 2654435761) % (self._positions + 1)
        window = self.streams[stream, start : start + self.seq_len + 1]
        return window[:-1].clone(), window[1:].clone()

    def _spend(self, seconds: float) -> None:
        if self.cost_kind == "sleep":
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


class MarkovDataModule(L.LightningDataModule):
    """Train/validation loaders over a :class:`MarkovCorpus`.

    Args:
        vocab_size: tokens in the vocabulary (match the model's).
        seq_len: tokens per sample (match the model's).
        batch_size: samples per batch.
        num_train_samples: samples per training epoch.
        num_val_samples: samples in the validation set.
        num_workers: DataLoader worker processes.
        pin_memory: page-lock batches for faster host-to-GPU copies.
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        prefetch_factor: batches each worker prepares ahead (only with ``num_workers > 0``).
        sample_cost_ms: artificial per-sample cost, to reproduce a slow data loader on purpose.
        cost_kind: ``"sleep"`` or ``"spin"`` (see :class:`MarkovDataset`).
        corpus_tokens: size of the generated corpus.
        branching: successors per state of the chain.
        seed: seed of the chain and the streams.

    Example::

        dm = MarkovDataModule.for_model(model, num_workers=4, sample_cost_ms=2.0)
        trainer.fit(model, dm)
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 64,
        batch_size: int = 8,
        num_train_samples: int = 100_000,
        num_val_samples: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        sample_cost_ms: float = 0.0,
        cost_kind: str = "sleep",
        corpus_tokens: int | None = None,
        branching: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0.")
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be > 0.")
        if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
            raise ValueError(
                f"persistent_workers={persistent_workers!r} / prefetch_factor={prefetch_factor!r} need num_workers > 0 "
                f"(num_workers={num_workers})."
            )
        if cost_kind not in _COST_KINDS:
            raise ValueError(f"cost_kind={cost_kind!r} is not one of {_COST_KINDS}.")
        self.save_hyperparameters()
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.persistent_workers, self.prefetch_factor = persistent_workers, prefetch_factor
        self.sample_cost_ms, self.cost_kind = sample_cost_ms, cost_kind
        self.num_train_samples, self.num_val_samples = num_train_samples, num_val_samples
        # Enough tokens for every stream to hold several windows, at most ~4M (32 MB) per corpus.
        self.corpus_tokens = corpus_tokens or min(4_000_000, max(64 * 8 * (seq_len + 1), 200_000))
        self.branching, self.seed = branching, seed
        self.corpus: MarkovCorpus | None = None

    @classmethod
    def for_model(cls, model: Any, **kwargs: Any) -> MarkovDataModule:
        """A data module matching ``model.config`` (vocabulary, sequence length, batch size)."""
        cfg = model.config
        kwargs.setdefault("vocab_size", cfg.vocab_size)
        kwargs.setdefault("seq_len", cfg.seq_len)
        kwargs.setdefault("batch_size", cfg.batch_size)
        return cls(**kwargs)

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is None:
            self.corpus = MarkovCorpus(self.vocab_size, self.corpus_tokens, self.branching, self.seed)

    def _dataset(self, num_samples: int, offset: int, cost: float) -> MarkovDataset:
        self.setup()
        return MarkovDataset(self.corpus, self.seq_len, num_samples, offset, cost, self.cost_kind)

    def _loader(self, ds: MarkovDataset, shuffle: bool) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, drop_last=shuffle, **kwargs)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._dataset(self.num_train_samples, 0, self.sample_cost_ms), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        # Validation windows are drawn from indices past the training ones, with no artificial cost.
        return self._loader(self._dataset(self.num_val_samples, self.num_train_samples, 0.0), shuffle=False)
