"""The strategy name in Lightning's registry, and a clear error from the standalone pytorch_lightning Trainer."""

import pytest


def test_pytorch_lightning_trainer_is_told_to_use_lightnings(fresh_import_report):
    pytest.importorskip("pytorch_lightning")
    # lightning_gh, then pytorch_lightning, imported in a fresh interpreter with no lightning_gh module loaded yet,
    # running PYTORCH_LIGHTNING_CODE (tests/conftest.py)
    child = fresh_import_report["children"]["pytorch_lightning"]
    assert child["code"] == 0, fresh_import_report["stderr"][-2000:]
    assert "ERR strategy=\"superoffload\" in a pytorch_lightning.Trainer" in child["stdout"]
    assert "`import lightning as L; L.Trainer(...)`" in child["stdout"]
    assert "REG True" in child["stdout"]
