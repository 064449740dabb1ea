"""The reference workload: a Llama-style LightningModule, learnable synthetic data, and the demo job."""

from lightning_gh.demo.data import MarkovCorpus, MarkovDataModule, MarkovDataset
from lightning_gh.demo.model import PRESETS, Llama, LlamaConfig, LlamaLM, preset

__all__ = ["PRESETS", "Llama", "LlamaConfig", "LlamaLM", "MarkovCorpus", "MarkovDataModule", "MarkovDataset", "preset"]
