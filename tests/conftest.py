from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Two cores on CI: keep torch from oversubscribing them when tests start subprocesses.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_trainer_kwargs(tmp_path):
    """Quiet, fast CPU Trainer settings for functional tests."""
    return dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)


@pytest.fixture(autouse=True)
def _fresh_host_plan():
    """Every test starts with an empty host-memory plan (Note [One host-memory plan] in lightning_gh/_host.py): a
    share another test left behind must not shrink this test's room."""
    from lightning_gh import _host

    for share in _host.PLAN.shares():
        _host.PLAN.release(share.part)
    yield
