"""Every part, the precision by name and the strategy, configured from one LightningCLI YAML, fit on the CPU.

Two configurations, because the compat table forbids some pairs (CUDAGraphCapture with SuperOffload or
ActivationOffload; SuperOffload with ManagedOptimizerState): every part is in one of them, each with its options
as a user writes them. The GPU-only parts step aside on the CPU with their one warning.
"""

from __future__ import annotations

import csv
import textwrap
import warnings

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_gh.demo import LlamaLM, MarkovDataModule

MODEL = """\
model:
  config: {vocab_size: 64, dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 176, seq_len: 32, batch_size: 4}
data:
  vocab_size: 64
  seq_len: 32
  batch_size: 4
"""


def _fit(tmp_path, body: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        seed_everything: 0
        trainer:
          accelerator: cpu
          devices: 1
          max_steps: 6
          val_check_interval: 3
          limit_val_batches: 1
          log_every_n_steps: 1
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          default_root_dir: {tmp_path}
          logger:
            class_path: lightning.pytorch.loggers.CSVLogger
            init_args: {{save_dir: {tmp_path}, name: logs, version: ""}}
        """) + textwrap.indent(textwrap.dedent(body), "  ") + MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LightningCLI(LlamaLM, MarkovDataModule, args=["fit", "--config", str(config)],
                            save_config_callback=None)


def _logged(tmp_path) -> set[str]:
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    return {k for r in rows for k, v in r.items() if v}


def test_profilers_offload_precision_and_strategy_from_one_yaml(tmp_path):
    cli = _fit(tmp_path, f"""\
        strategy: superoffload
        plugins:
          - class_path: lightning_gh.Float8Precision
            init_args: {{recipe: 32-true}}
        callbacks:
          - class_path: lightning_gh.SelectiveProfiler
            init_args: {{steps: 2, output_dir: {tmp_path}/profiles}}
          - class_path: lightning_gh.DataStallDetector
            init_args: {{window: 2, warmup: 0}}
          - class_path: lightning_gh.NVTXRangeCallback
            init_args: {{steps: 1-3}}
          - class_path: lightning_gh.ActivationOffload
            init_args: {{policy: all, backend: host-copy, min_tensor_bytes: 0, skip_last_blocks: 0}}
          - class_path: lightning_gh.GenerationCallback
            init_args: {{prompts: [[1, 2, 3]], every_n_steps: 3, max_new_tokens: 4}}
        """)
    trainer = cli.trainer
    assert trainer.global_step == 6
    assert type(trainer.strategy).__name__ == "SuperOffloadStrategy"
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"SelectiveProfiler", "DataStallDetector", "NVTXRangeCallback", "ActivationOffload",
            "GenerationCallback"} <= names
    assert list((tmp_path / "profiles").rglob("*.summary.md"))  # the window at step 2 was written
    logged = _logged(tmp_path)
    assert "lgh/data_wait_frac" in logged and any(k.startswith("lgh/superoffload/") for k in logged), logged
    assert any(k.startswith("lgh/profile_") for k in logged), logged


def test_cuda_graphs_and_managed_state_from_one_yaml(tmp_path):
    cli = _fit(tmp_path, """\
        precision: 32-true
        callbacks:
          - class_path: lightning_gh.CUDAGraphCapture
            init_args: {warmup_steps: 2}
          - class_path: lightning_gh.ManagedOptimizerState
            init_args: {preferred: cpu}
        """)
    assert cli.trainer.global_step == 6
    assert {"CUDAGraphCapture", "ManagedOptimizerState"} <= {type(c).__name__ for c in cli.trainer.callbacks}


def test_a_forbidden_pair_in_yaml_names_both_parts(tmp_path):
    from lightning_gh.compat import IncompatiblePartsError

    with pytest.raises(IncompatiblePartsError, match="CUDAGraphCapture and SuperOffload cannot be used together"):
        _fit(tmp_path, """\
            strategy: superoffload
            callbacks:
              - class_path: lightning_gh.CUDAGraphCapture
            """)
