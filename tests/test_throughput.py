"""ThroughputMonitor on the CPU: the peak table, the fp8-weighted peak, MFU, and a fit measured with a fake clock."""

from __future__ import annotations

import csv
import dataclasses
import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.profiling import throughput
from lightning_gh.profiling.throughput import (
    ThroughputMonitor,
    ThroughputOptions,
    effective_peak,
    fp8_share,
    gpu_model,
    matmul_dtype,
    mfu,
    peak_tflops,
)


@pytest.mark.parametrize("name, row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-80GB", None),
    ("cpu", None),
])
def test_gpu_names_map_to_their_datasheet_row(name, row):
    assert gpu_model(name) == row


@pytest.mark.parametrize("precision, matmul, dtype", [
    ("bf16-mixed", "highest", "bf16"),
    ("bf16-true", "highest", "bf16"),
    ("16-mixed", "highest", "fp16"),
    ("32-true", "highest", "fp32"),
    ("32-true", "high", "tf32"),
    ("transformer-engine", "highest", "bf16"),
])
def test_matmul_precision_of_a_lightning_precision(precision, matmul, dtype):
    assert matmul_dtype(precision, matmul) == dtype


def test_peaks_are_dense_and_fp8_is_weighted_by_time():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0 and peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") is None
    h200 = "NVIDIA H200"
    assert effective_peak(h200, "bf16", 0.0) == 989.0
    assert effective_peak(h200, "bf16", 1.0) == pytest.approx(1979.0)
    # Half the FLOPs at twice the rate: 4/3 of the bf16 peak, not the arithmetic mean (which would be 1.5x).
    assert effective_peak(h200, "bf16", 0.5) == pytest.approx(989.0 / (0.5 * 989.0 / 1979.0 + 0.5))
    assert effective_peak("NVIDIA A100-SXM4-80GB", "bf16", 0.5) is None


def test_mfu_formula():
    # 6 x 7e9 FLOPs per token at 10,000 tokens/s per GPU is 420 TFLOP/s.
    assert mfu(10_000, 6 * 7e9, 840.0) == pytest.approx(0.5)


def test_fp8_share_counts_the_parameters_of_fp8_layers():
    class Float8Linear(torch.nn.Linear):  # stands in for torchao's class (matched by name)
        pass

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), Float8Linear(4, 4, bias=False), torch.nn.Linear(4, 2))
    assert fp8_share(model) == pytest.approx(16 / (40 + 16 + 10))
    assert fp8_share(torch.nn.Linear(2, 2)) == 0.0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"window": 0}, ValueError, r"^ThroughputMonitor\(window=0\): expected an int >= 1"),
    ({"window": 2.5}, TypeError, r"^ThroughputMonitor\(window=2.5\): expected"),
    ({"warmup_steps": -1}, ValueError, r"^ThroughputMonitor\(warmup_steps=-1\): expected an int >= 0"),
    ({"flops_per_token": 0}, ValueError, r"^ThroughputMonitor\(flops_per_token=0\): expected a number > 0"),
    ({"peak_tflops": "989"}, TypeError, r"^ThroughputMonitor\(peak_tflops='989'\): expected a number > 0"),
    ({"peak_tflops": float("nan")}, ValueError, r"^ThroughputMonitor\(peak_tflops=nan\)"),
])
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        ThroughputMonitor(**kwargs)
    with pytest.raises(error, match=match):
        ThroughputOptions(**kwargs)


def test_options_or_keywords_never_both():
    opts = ThroughputOptions(window=3)
    assert ThroughputMonitor(options=opts).options is opts and ThroughputMonitor(window=3).options == opts
    with pytest.raises(TypeError, match="both options= and window=4"):
        ThroughputMonitor(window=4, options=opts)
    sig = inspect.signature(ThroughputMonitor).parameters
    for f in dataclasses.fields(ThroughputOptions):
        assert sig[f.name].default == f.default, f.name


class _FakeClock:
    """Each call is 0.5 s after the previous one: the monitor reads the clock once per optimizer step."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


def test_a_fit_logs_tokens_tflops_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "_clock", _FakeClock())
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny")
    dm = MarkovDataModule.for_model(model, num_train_samples=256)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mon = ThroughputMonitor(window=3, warmup_steps=2, peak_tflops=0.5)
    L.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=CSVLogger(tmp_path, name="", version="logs"),
              log_every_n_steps=1, limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, accumulate_grad_batches=2, callbacks=[mon]).fit(model, dm)
    tokens_per_batch = model.config.batch_size * model.config.seq_len
    # Steps 2..4 and 5..7 form the two windows: 3 steps of 2 micro-batches each, 0.5 s per step.
    per_s = 3 * 2 * tokens_per_batch / 1.5
    with (tmp_path / "logs" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("lgh/tokens_per_s")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["lgh/tokens_per_s"]) == pytest.approx(per_s)
        assert float(row["lgh/model_tflops"]) == pytest.approx(per_s * 6 * params / 1e12)
        assert float(row["lgh/mfu"]) == pytest.approx(per_s * 6 * params / 1e12 / 0.5)
    assert mon.last["lgh/tokens_per_s"] == pytest.approx(per_s)


def test_no_mfu_without_a_known_peak_and_it_composes_with_the_other_parts(tmp_path, monkeypatch):
    from lightning_gh.profiling import DataStallDetector, SelectiveProfiler

    monkeypatch.setattr(throughput, "_clock", _FakeClock())
    model = LlamaLM.from_preset("tiny")
    mon = ThroughputMonitor(window=2, warmup_steps=0, flops_per_token=1e9)
    parts = [SelectiveProfiler(steps="1", output_dir=tmp_path, summary=False), DataStallDetector(), mon]
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, limit_val_batches=0,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=parts).fit(model, MarkovDataModule.for_model(model, num_train_samples=64))
    assert mon.peak is None and set(mon.last) == {"lgh/tokens_per_s", "lgh/model_tflops"}
    assert mon.last["lgh/model_tflops"] == pytest.approx(mon.last["lgh/tokens_per_s"] * 1e9 / 1e12)
