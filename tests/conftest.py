from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One intra-op thread per process, for the pytest(-xdist) workers and, through the environment, for every Python
# a test starts (demo, DDP ranks, benchmark suites). `make test` runs one worker per core: a second OpenMP thread per
# process has no core of its own and spins in OpenMP barriers against the other workers, which makes a small model's
# step many times slower than on one thread. A value the caller exported is kept. Inductor compiles in the process
# that asks (no pool of compile workers to start per process on two cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402  (after the environment above, which torch reads when it starts)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_threads = os.environ["OMP_NUM_THREADS"].split(",")[0]
torch.set_num_threads(int(_threads) if _threads.isdigit() and int(_threads) > 0 else 1)
if "torch._inductor.config" in sys.modules:  # imported before this file: set what it read from the environment
    sys.modules["torch._inductor.config"].compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


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
