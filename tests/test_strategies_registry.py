"""The strategy name in Lightning's registry, and a clear error from the standalone pytorch_lightning Trainer."""

import subprocess
import sys

import pytest

CODE = """
import lightning_gh  # registers the names (lazily)
import pytorch_lightning as pl
try:
    pl.Trainer(strategy="superoffload", accelerator="cpu", logger=False)
except TypeError as e:
    print("ERR", e)
import lightning as L
from lightning.pytorch.strategies import StrategyRegistry
print("REG", "superoffload" in StrategyRegistry)
"""


def test_pytorch_lightning_trainer_is_told_to_use_lightnings():
    pytest.importorskip("pytorch_lightning")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERR strategy=\"superoffload\" in a pytorch_lightning.Trainer" in out.stdout
    assert "`import lightning as L; L.Trainer(...)`" in out.stdout
    assert "REG True" in out.stdout
