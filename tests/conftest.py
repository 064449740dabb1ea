from __future__ import annotations

import gc
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


# Note [A frozen heap]: torch, Lightning, transformers and the other imported modules make the test process's heap
# hundreds of thousands of objects that live as long as the process, and every full collection (an automatic one, or
# an explicit gc.collect() in the package, the benchmarks' reset_memory between variants, or a test) scans them all
# again. gc.freeze() moves what is alive into a generation the collector leaves alone: done after collection (no
# automatic collection while the test modules are imported, where nearly nothing is garbage), at the start of every
# test module (what the previous module's tests and fixtures left is collected first; what is still alive then is
# imports and caches) and, through `frozen_heap`, before the tests that run a benchmark suite in process. Objects the
# tests make are collected as before.


def _freeze() -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()
    _freeze()


@pytest.fixture(scope="module", autouse=True)
def _frozen_at_module_start():
    """Note [A frozen heap]."""
    _freeze()
    yield


@pytest.fixture
def frozen_heap():
    """What is alive when the test starts is frozen (Note [A frozen heap]): a benchmark suite run in process collects
    garbage between its variants, each collection then scanning only what the suite made."""
    _freeze()
    yield


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


#: The optional backends a bare install lacks (tests/test_package.py).
OPTIONAL_BACKENDS = ("nvtx", "torchao", "transformer_engine")

#: What the bare-install child imports with the optional backends made unimportable.
BARE_INSTALL_CODE = textwrap.dedent(f"""
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in {OPTIONAL_BACKENDS!r}:
                raise ImportError(f'blocked {{name}}')
    sys.meta_path.insert(0, Block())
    import lightning_gh, lightning_gh.demo, lightning_gh.hardware
    from lightning_gh.demo.run import main
    mods = [m for m in sys.modules if m.split('.')[0] in {OPTIONAL_BACKENDS!r}]
    assert not mods, mods
""")

#: The standalone pytorch_lightning Trainer asked for the strategy name (tests/test_strategies_registry.py).
PYTORCH_LIGHTNING_CODE = textwrap.dedent("""
    import lightning_gh  # registers the names (lazily)
    import pytorch_lightning as pl
    try:
        pl.Trainer(strategy="superoffload", accelerator="cpu", logger=False)
    except TypeError as e:
        print("ERR", e)
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry
    print("REG", "superoffload" in StrategyRegistry)
""")


@pytest.fixture(scope="session")
def fresh_import_report(tmp_path_factory):
    """:func:`_fresh_import_report`, made once per run: under pytest-xdist the first worker to ask writes it to the
    run's shared temporary folder and the others read it there."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _fresh_import_report()
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp().parent / "fresh_import_report.json"
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            shared.write_text(json.dumps(_fresh_import_report()))
        return json.loads(shared.read_text())


def _fresh_import_report() -> dict:
    """What a fresh interpreter sees when it imports the package, for the tests that need a process where no
    lightning_gh module is loaded yet, from one interpreter instead of one each.

    It imports torch and Lightning (never this package) and then

    * forks one child per order in :data:`PRECISION_IMPORT_ORDERS`: each child starts with no lightning_gh module
      loaded, as a fresh interpreter would, and imports the precision modules in that order (``codes``: the
      children's exit codes, their tracebacks on stderr);
    * forks three more such children, each reporting its exit status and what it printed (``children``):
      ``bare`` runs :data:`BARE_INSTALL_CODE` (the package imports with the optional backends unimportable),
      ``cli`` runs ``lightning_gh`` as ``python -m lightning_gh info`` does (``runpy`` with ``alter_sys``), and
      ``pytorch_lightning`` runs :data:`PYTORCH_LIGHTNING_CODE` (skipped, as ``None``, where pytorch_lightning is
      not installed);
    * imports ``lightning_gh`` itself and records the matplotlib modules that this added (``matplotlib_added``,
      with ``lightning_gh.profiling.plot`` if it was loaded) and whether ``"superoffload"`` is in Lightning's
      ``StrategyRegistry`` (``superoffload_registered``);
    * imports ``lightning_gh.precision`` and lists the optional backends loaded by then (``optional_backends``).
    """
    code = textwrap.dedent(f"""
        import contextlib, importlib, importlib.util, io, json, os, runpy, sys, tempfile, traceback
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

        def run_cli():
            sys.argv = ["lightning_gh", "info"]
            try:
                runpy.run_module("lightning_gh", run_name="__main__", alter_sys=True)
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise

        jobs = {{"bare": lambda: exec({BARE_INSTALL_CODE!r}, {{"sys": sys}}), "cli": run_cli}}
        if importlib.util.find_spec("pytorch_lightning") is not None:
            jobs["pytorch_lightning"] = lambda: exec({PYTORCH_LIGHTNING_CODE!r}, {{}})
        folder = tempfile.mkdtemp(prefix="lgh_fresh_")
        forked = {{}}
        for name, job in jobs.items():
            pid = os.fork()
            if pid == 0:
                out, status = io.StringIO(), 0
                try:
                    with contextlib.redirect_stdout(out):
                        job()
                except BaseException:
                    traceback.print_exc()
                    status = 1
                with open(os.path.join(folder, name), "w") as f:
                    f.write(out.getvalue())
                os._exit(status)
            forked[name] = pid
        children = {{name: {{"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]),
                             "stdout": open(os.path.join(folder, name)).read()}} for name, pid in forked.items()}}
        children.setdefault("pytorch_lightning", None)
        before = {{m for m in sys.modules if m.split(".")[0] == "matplotlib"}}
        import lightning_gh
        added = {{m for m in sys.modules if m.split(".")[0] == "matplotlib"}} - before
        plot = [m for m in sys.modules if m == "lightning_gh.profiling.plot"]
        from lightning.pytorch.strategies import StrategyRegistry
        registered = "superoffload" in StrategyRegistry
        import lightning_gh.precision
        optional = [m for m in sys.modules if m.split(".")[0] in {OPTIONAL_BACKENDS!r}]
        print("REPORT " + json.dumps({{"codes": codes, "children": children, "matplotlib_added": sorted(added) + plot,
                                       "superoffload_registered": registered, "optional_backends": optional}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))
    return {**json.loads(line[len("REPORT "):]), "stderr": proc.stderr}
