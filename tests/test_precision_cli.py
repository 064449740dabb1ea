"""``lightning_gh.Float8Precision`` named in a ``LightningCLI`` YAML config, on the CPU."""

from __future__ import annotations

import textwrap

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

import lightning_gh
from lightning_gh import hardware
from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.precision import Float8Precision, precision_names

# The top-level name is what users write; the package's own path is the same class.
CLASS_PATH = ("lightning_gh.Float8Precision" if hasattr(lightning_gh, "Float8Precision")
              else "lightning_gh.precision.Float8Precision")
NO_FP8 = hardware.detect().fp8_unsupported_reason() is not None


def _run_cli(tmp_path, recipe: str, extra: str = ""):
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        seed_everything: 0
        trainer:
          accelerator: cpu
          devices: 1
          max_steps: 2
          limit_val_batches: 0
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          default_root_dir: {tmp_path}
          plugins:
            - class_path: {CLASS_PATH}
              init_args:
                recipe: {recipe}
        {extra}
        model:
          config: {{vocab_size: 64, dim: 64, n_layers: 1, n_heads: 4, n_kv_heads: 2, ffn_dim: 176, seq_len: 32,
                    batch_size: 4}}
        data:
          vocab_size: 64
          seq_len: 32
          batch_size: 4
        """))
    return LightningCLI(LlamaLM, MarkovDataModule, args=["fit", "--config", str(config)], save_config_callback=None)


def test_cli_yaml_trains_with_a_lightning_recipe(tmp_path):
    cli = _run_cli(tmp_path, "bf16-mixed")
    assert cli.trainer.global_step == 2
    assert cli.trainer.precision == "bf16-mixed"
    # after setup the strategy holds the built plugin itself
    assert isinstance(cli.trainer.precision_plugin, MixedPrecision)
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


@pytest.mark.skipif(not NO_FP8, reason="this machine has an fp8 GPU")
def test_cli_yaml_fp8_auto_falls_back_on_the_cpu_and_trains(tmp_path):
    with pytest.warns(UserWarning, match="fp8-auto' falls back to bf16-mixed: no CUDA GPU"):
        cli = _run_cli(tmp_path, "fp8-auto")
    assert cli.trainer.global_step == 2 and cli.trainer.precision == "bf16-mixed"
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_cli_yaml_bogus_recipe_names_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match=r"precision name='fp8-bogus' is not known; valid names: .*fp8-auto"):
        _run_cli(tmp_path, "fp8-bogus")


def test_plugin_is_a_lightning_precision_that_forwards_to_the_built_one():
    plugin = Float8Precision("32-true")
    assert isinstance(plugin, Precision) and type(plugin.plugin) is Precision and plugin.precision == "32-true"
    assert plugin.state_dict() == {} and plugin.convert_input(torch.ones(1)).dtype == torch.float32
    with pytest.raises(ValueError, match=r"precision\('32-true'\) does not take option\(s\) \['min_dim'\]"):
        Float8Precision("32-true", min_dim=0)
    assert "fp8-auto" in precision_names()
