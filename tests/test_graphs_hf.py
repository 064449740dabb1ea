"""CUDAGraphCapture on Hugging Face transformers decoders, on the CPU with tiny random configs.

Training needs no KV cache: the callback finds every ``transformers.PreTrainedModel`` in the LightningModule and
turns ``config.use_cache`` off for the training steps only (back for validation and after the fit), without changing
a loss. A declined capture leaves no wrapper of the callback on the module or the optimizer. The capture itself, and
the step-time ratios, are measured on a GPU (tests/test_graphs_gpu.py, benchmarks/suites/graphs.py).
"""

from __future__ import annotations

import sys
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gh.graphs import CUDAGraphCapture
from lightning_gh.graphs.hf import TrainingKVCacheOff, transformers_models
from lightning_gh.graphs.optim import CapturableOptimizer

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 16


def _config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=8, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


_CLASSES = {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class HFModule(L.LightningModule):
    """A plain LightningModule around a transformers decoder, as users write it."""

    def __init__(self, family: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = getattr(transformers, _CLASSES[family])(_config(family))
        self.cache_in_training: list[bool] = []
        self.cache_in_validation: list[bool] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        self.cache_in_training.append(self.model.config.use_cache)
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.cache_in_validation.append(self.model.config.use_cache)
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (16, SEQ), generator=g)), batch_size=4)


def _fit(module: L.LightningModule, callbacks: list, steps: int = 4, val: bool = False) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        limit_val_batches=1 if val else 0, val_check_interval=2 if val else None,
                        num_sanity_val_steps=1 if val else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), _data() if val else None)
    return trainer


@pytest.mark.parametrize("family", ["mistral", "llama", "qwen2"])
def test_training_runs_without_kv_cache_and_losses_are_unchanged(family):
    plain = HFModule(family)
    _fit(plain, [])
    assert plain.cache_in_training == [True] * 4  # the default config builds a cache in training

    module = HFModule(family)
    _fit(module, [CUDAGraphCapture(verbose=False)], val=True)
    assert module.cache_in_training == [False] * 4
    # Validation (sanity check, then after steps 2 and 4) sees the user's setting: generate() keeps its cache.
    assert module.cache_in_validation and all(module.cache_in_validation)
    assert module.model.config.use_cache is True  # restored after the fit
    assert module.losses == plain.losses  # the cache never feeds the loss: bitwise equal


def test_one_info_line_names_the_model(caplog):
    module = HFModule("mistral")
    with caplog.at_level("INFO"):
        _fit(module, [CUDAGraphCapture(verbose=False)], steps=1)
    lines = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(lines) == 1 and "MistralForCausalLM (model)" in lines[0] and "use_cache=False" in lines[0]


def test_finds_outermost_models_and_shared_configs():
    module = HFModule("llama")
    assert [(n, type(m).__name__) for n, m in transformers_models(module)] == [("model", "LlamaForCausalLM")]
    off = TrainingKVCacheOff.find(module)
    assert off is not None and len(off.configs) == 1  # LlamaForCausalLM and its inner LlamaModel share one config
    off.disable()
    assert module.model.model.config.use_cache is False
    off.restore()
    assert module.model.config.use_cache is True
    module.model.config.use_cache = False
    assert TrainingKVCacheOff.find(module) is None  # nothing to do: the user already trains without a cache
    assert transformers_models(torch.nn.Linear(2, 2)) == []


def test_without_transformers_imported_nothing_is_looked_for(monkeypatch):
    """A run whose model never imported transformers pays one dictionary look-up; nothing imports it."""
    monkeypatch.delitem(sys.modules, "transformers")
    module = HFModule.__new__(HFModule)  # never built: only named_modules would be walked
    assert transformers_models(torch.nn.Linear(2, 2)) == [] and TrainingKVCacheOff.find(torch.nn.Linear(2, 2)) is None
    assert "transformers" not in sys.modules
    del module


def test_the_packed_sequence_check_is_not_a_reason_to_decline():
    """Without a KV cache, transformers checks each batch for packed sequences with a host sync, and skips that check
    while a CUDA stream is capturing: the rehearsal must not decline for it, and must still decline for a user's."""
    import traceback

    from lightning_gh.graphs.detect import SyncEvent, sync_finding

    def frame(path, line, name, text=""):
        return traceback.FrameSummary(path, line, name, line=text)

    user = frame("/home/me/train.py", 12, "training_step", "loss = self.model(input_ids=ids, labels=ids).loss")
    packed = SyncEvent((user, frame("/site-packages/transformers/masking_utils.py", 755, "find_packed_sequence_indices",
                                    "if not is_tracing(packed_sequence_mask) and (packed_sequence_mask[:, -1] == 0)"
                                    ".all():")))
    item = SyncEvent((frame("/home/me/train.py", 13, "training_step", "print(loss.item())"),))
    assert sync_finding([packed]) is None
    finding = sync_finding([packed, item])
    assert finding is not None and "train.py:13" in finding.message and "masking_utils" not in finding.message


class _Probe(L.Callback):
    """Records, at every batch, whether any instance attribute of the callback is on the module or optimizer."""

    def __init__(self) -> None:
        self.wrapped: list[set[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.wrapped.append({k for k in ("optimizer_step", "training_step", "log") if k in pl_module.__dict__}
                            | ({"optimizer.step"} if "step" in opt.__dict__ else set())
                            | {f"capturable[{i}]" for i, g in enumerate(opt.param_groups) if g.get("capturable")}
                            | {f"lr[{i}]" for i, g in enumerate(opt.param_groups) if isinstance(g["lr"], torch.Tensor)})


def test_after_a_forced_decline_the_eager_path_is_lightnings(monkeypatch):
    """Force the callback past its no-CUDA check, let it install, then decline at the first step: from that step on
    nothing of it remains on the module or the optimizer, and the losses equal a run without the callback."""
    from lightning_gh.graphs import capture as capture_mod

    class _Stream:  # the side stream of a CPU run: never used, the decline comes first
        def __init__(self, device=None) -> None:
            pass

    def unsupported(batch):
        raise capture_mod.UnsupportedBatch("a test batch the callback refuses")

    def cpu_capturable(optimizer):  # make_capturable's change, allowed on CPU parameters (never stepped so)
        optimizer = getattr(optimizer, "optimizer", optimizer)
        lrs, flags = [], []
        for group in optimizer.param_groups:
            flags.append(bool(group.get("capturable", False)))
            group["capturable"], group["lr"] = True, torch.tensor(float(group["lr"]))
            lrs.append(group["lr"])
        return CapturableOptimizer(optimizer, lrs, flags)

    monkeypatch.setattr(capture_mod, "setup_findings", lambda trainer, pl_module: [])
    monkeypatch.setattr(capture_mod, "make_capturable", cpu_capturable)
    monkeypatch.setattr(capture_mod.torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(capture_mod, "batch_signature", unsupported)

    plain = HFModule("qwen2")
    _fit(plain, [])
    module, probe, cb = HFModule("qwen2"), _Probe(), CUDAGraphCapture(verbose=False)
    installed: list[bool] = []

    class _SeeInstall(L.Callback):
        def on_train_start(self, trainer, pl_module):
            installed.append("optimizer_step" in pl_module.__dict__)

    _fit(module, [cb, _SeeInstall(), probe])
    assert installed == [True] and cb.report.state == "eager" and "refuses" in cb.report.reason
    # The first batch starts before the decline (it happens inside that step); every later one is plain Lightning.
    assert probe.wrapped[1:] == [set()] * 3
    assert module.losses == plain.losses
    assert "optimizer_step" not in module.__dict__ and module.model.config.use_cache is True


class _GPUDecoder(L.LightningModule):
    """A user's module on a GPU: no .item() in the step (the loss is read by a callback, after the fact)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = getattr(transformers, _CLASSES[family])(_config(family))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class _LossTrace(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().float().clone())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["mistral", "llama", "qwen2"])
def test_hf_decoders_are_captured_with_default_options(family):
    """With default config options (use_cache=True) the step of every family is captured, and
    the losses follow the eager run's. Tolerance 1e-2 relative (bf16-mixed): without a cache, the captured step takes
    transformers' explicit-causal-mask attention (its packed-sequence check is skipped under capture), the eager run
    the is_causal kernel, so the two differ by bf16 rounding, not bitwise."""
    runs = {}
    for name, callbacks in (("eager", []), ("graph", [CUDAGraphCapture(verbose=False)])):
        module, trace = _GPUDecoder(family), _LossTrace()
        trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=12, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=[*callbacks, trace])
        g = torch.Generator().manual_seed(1)
        data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (48, SEQ), generator=g)), batch_size=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, data)
        runs[name] = (torch.stack(trace.losses).cpu(), callbacks)
        assert module.model.config.use_cache is True
    (cb,) = runs["graph"][1]
    assert cb.report.state == "captured", cb.report.reason
    assert cb.report.replayed_steps >= 12 - cb.report.warmup_steps - 1
    eager, graph = runs["eager"][0], runs["graph"][0]
    assert torch.allclose(graph, eager, rtol=1e-2, atol=0), (eager, graph)
