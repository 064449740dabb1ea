from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
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


@pytest.fixture(autouse=True)
def _nobody_sizing_gpu_memory():
    """Every test starts with no part sizing its GPU memory (Note [One part sizes GPU memory at a time] in
    lightning_gh/_gpu_plan.py): an engine another test left measuring must not hold this test's GPU tail."""
    from lightning_gh import _gpu_plan

    with _gpu_plan._lock:
        _gpu_plan._sizing.clear()
    yield


#: Import orders of the precision modules that a cycle among them would fail (tests/test_precision.py).
PRECISION_IMPORT_ORDERS = [
    [first] + [f"lightning_gh.precision.{m}" for m in ("export", "plugin", "registry", "auto", "ao", "te", "trial",
                                                         "regional", "master", "fused_master", "base", "options",
                                                         "checks", "names")]
    for first in ("lightning_gh.precision.te", "lightning_gh.precision.auto", "lightning_gh.precision.registry")
]


@pytest.fixture(scope="session")
def fresh_import_report():
    """What a fresh interpreter sees when it imports the package, for the tests that need a process where no
    lightning_gh module is loaded yet, from one interpreter instead of one each.

    It imports torch and Lightning (never this package) and then

    * forks one child per order in :data:`PRECISION_IMPORT_ORDERS`: each child starts with no lightning_gh module
      loaded, as a fresh interpreter would, and imports the precision modules in that order (``codes``: the
      children's exit codes, their tracebacks on stderr);
    * imports ``lightning_gh`` itself and records the matplotlib modules that this added (``matplotlib_added``,
      with ``lightning_gh.profiling.plot`` if it was loaded) and whether ``"superoffload"`` is in Lightning's
      ``StrategyRegistry`` (``superoffload_registered``);
    * imports ``lightning_gh.precision`` and lists the optional backends loaded by then (``optional_backends``).
    """
    code = textwrap.dedent(f"""
        import importlib, json, os, sys, traceback
        import torch, lightning
        assert not [m for m in sys.modules if m.split(".")[0] == "lightning_gh"]
        pids = []
        for order in {PRECISION_IMPORT_ORDERS!r}:
            pid = os.fork()
            if pid == 0:
                try:
                    for name in order:
                        importlib.import_module(name)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
                os._exit(0)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        before = {{m for m in sys.modules if m.split(".")[0] == "matplotlib"}}
        import lightning_gh
        added = {{m for m in sys.modules if m.split(".")[0] == "matplotlib"}} - before
        plot = [m for m in sys.modules if m == "lightning_gh.profiling.plot"]
        from lightning.pytorch.strategies import StrategyRegistry
        registered = "superoffload" in StrategyRegistry
        import lightning_gh.precision
        optional = [m for m in sys.modules if m.split(".")[0] in ("torchao", "transformer_engine", "nvtx")]
        print("REPORT " + json.dumps({{"codes": codes, "matplotlib_added": sorted(added) + plot,
                                       "superoffload_registered": registered, "optional_backends": optional}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))
    return {**json.loads(line[len("REPORT "):]), "stderr": proc.stderr}
