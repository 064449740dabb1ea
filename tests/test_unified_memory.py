"""Unified (managed) memory: the pool, its safety guard, the optimizer-state placement and its Lightning callback.

CPU: the API imports without building anything, degrades with one warning, validates its arguments; the guard's
arithmetic (Python, and the compiled C guard where a compiler and CUDA headers exist); the callback in a real CPU
Trainer is a no-op whose losses equal the plain run; the benchmark suite runs with ``--device cpu``.

GPU (skipped without CUDA; written for a PCIe GPU, not coherent): the pool's pages are managed with the advice
asked for; the guard refuses before allocating (tested with a huge headroom and a 24 MiB request, so a broken guard
could never allocate much); Lightning runs with the state in managed memory give losses and parameters bitwise
equal to the plain run (deterministic kernels, ``Trainer(deterministic="warn")``); resume from a checkpoint and
CUDAGraphCapture compose. Every managed allocation here is < 2 GiB. The drop of GPU-resident memory by the state's
size, measured in a fresh process, and the scopes' and pools' lifetime are in ``test_unified_lifetime.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before the first handle

from lightning_gh._util import reset_warnings  # noqa: E402
from lightning_gh.demo import LlamaLM, MarkovDataModule, preset  # noqa: E402
from lightning_gh.unified import (  # noqa: E402
    ManagedMemoryError,
    ManagedMemoryOptions,
    ManagedMemoryUnavailable,
    ManagedOptimizerState,
    forecast_step_ms,
    guard,
    managed_memory,
    pool_bytes_for,
    refusal_reason,
    shim,
)
from lightning_gh.unified import pool as pool_mod  # noqa: E402
from lightning_gh.unified.forecast import GH200_RMW_GBPS, state_traffic_ms  # noqa: E402
from lightning_gh.unified.state import creates_state_eagerly  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB, MIB = 2**30, 2**20
CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------- CPU: import


def test_import_builds_nothing():
    # Nothing in this file has asked for the shim yet (the C-guard test below builds it into a temporary folder).
    assert shim._loaded is None and shim._load_error is None
    import lightning_gh.unified as u

    assert "lgh_managed_malloc" in u.shim.source() and "lgh_managed_free" in u.shim.source()
    assert u.shim.SOURCE_FILE.name == "managed.cpp" and u.shim.SOURCE_FILE.is_file()


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA path")
def test_without_cuda_one_warning_and_a_plain_block():
    reset_warnings(pool_mod.NO_CUDA_WARNING)
    with pytest.warns(UserWarning, match="no CUDA GPU is available") as rec:
        with managed_memory("cpu") as pool:
            t = torch.zeros(4)
    assert pool is None and t.device.type == "cpu" and len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use is silent
        with managed_memory("gpu") as pool:
            pass
    assert pool is None
    with pytest.raises(ManagedMemoryUnavailable, match="no CUDA GPU"):
        pool_mod.get_pool()


# ----------------------------------------------------------------------------------------------- CPU: arguments


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(preferred="disk"), ValueError, r"preferred='disk' is not a location .* allowed: 'cpu' .* or 'gpu'"),
    (dict(preferred=None), TypeError, r"preferred=None\): expected a string, got NoneType"),
    (dict(preferred=1), TypeError, r"preferred=1\): expected a string, got int"),
    (dict(prefetch="always"), ValueError, r"prefetch='always' is not a prefetch policy; allowed: 'none' .* 'step'"),
    (dict(headroom_bytes=-1), ValueError, r"headroom_bytes=-1 must be >= 0 bytes"),
    (dict(headroom_bytes=1.5), TypeError, r"headroom_bytes=1.5\): expected an int, got float"),
    (dict(headroom_bytes=True), TypeError, r"headroom_bytes=True\): expected an int, got bool"),
    (dict(accessed_by_gpu=1), TypeError, r"accessed_by_gpu=1\): expected True or False, got int"),
    (dict(allow_oversubscription="yes"), TypeError, r"allow_oversubscription='yes'\): expected True or False"),
])
def test_options_reject_bad_values_everywhere(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ManagedMemoryOptions(**kwargs)
    with pytest.raises(exc, match=match):
        ManagedOptimizerState(**kwargs)
    if "prefetch" not in kwargs:
        with pytest.raises(exc, match=match):
            with managed_memory(**kwargs):
                pass


def test_callback_takes_options_or_keywords_not_both():
    opts = ManagedMemoryOptions(preferred="gpu", prefetch="step", headroom_bytes=1 << 20)
    assert ManagedOptimizerState(options=opts).options is opts
    assert ManagedOptimizerState("gpu", prefetch="step", headroom_bytes=1 << 20).options == opts
    assert ManagedOptimizerState(options=opts, preferred="cpu").options is opts  # a default: not counted as given
    with pytest.raises(TypeError, match=r"ManagedOptimizerState got both options= and accessed_by_gpu=False"):
        ManagedOptimizerState(options=opts, accessed_by_gpu=False)
    with pytest.raises(TypeError, match=r"ManagedOptimizerState\(options=\.\.\.\) must be a ManagedMemoryOptions"):
        ManagedOptimizerState(options={"preferred": "gpu"})


@pytest.mark.parametrize("device, exc, match", [
    ("cpu", ValueError, r"device='cpu' is not a CUDA device"),
    (-1, ValueError, r"device=-1 must be a CUDA device index >= 0"),
    (1.5, TypeError, r"device=1.5 must be a CUDA device"),
    (True, TypeError, r"device=True must be a CUDA device"),
    ("nonsense", ValueError, r"device='nonsense' is not a device name"),
])
def test_device_argument_errors(device, exc, match):
    with pytest.raises(exc, match=match):
        with managed_memory("cpu", device=device):
            pass


def test_options_are_frozen_and_describe_themselves():
    o = ManagedMemoryOptions()
    assert (o.preferred, o.accessed_by_gpu, o.allow_oversubscription, o.prefetch) == ("cpu", True, False, "none")
    assert o.location == "host" and o.replace(preferred="gpu").location == "device"
    assert o.pool_key() == ("cpu", True) and o.to_dict()["headroom_bytes"] == 512 * MIB
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.preferred = "gpu"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------- CPU: the guard


def test_segment_sizes_follow_the_caching_allocator():
    assert guard.segment_bytes(1) == 2 * MIB
    assert guard.segment_bytes(MIB) == 2 * MIB
    assert guard.segment_bytes(MIB + 1) == 20 * MIB
    assert guard.segment_bytes(10 * MIB - 1) == 20 * MIB
    assert guard.segment_bytes(10 * MIB) == 10 * MIB
    assert guard.segment_bytes(10 * MIB + 1) == 12 * MIB
    with pytest.raises(ValueError, match="nbytes=-1 must be >= 0"):
        guard.segment_bytes(-1)


def test_pool_bytes_pack_small_and_mid_tensors():
    assert pool_bytes_for([]) == 0
    assert pool_bytes_for([4] * 1000) == 2 * MIB  # 1000 x 512 B share one 2 MiB segment
    assert pool_bytes_for([3 * MIB] * 2) == 20 * MIB  # mid-sized tensors share a 20 MiB segment
    assert pool_bytes_for([100 * MIB + 1, 4]) == 102 * MIB + 2 * MIB
    assert pool_bytes_for([11 * MIB, 5 * MIB, 10]) == 12 * MIB + 20 * MIB + 2 * MIB
    with pytest.raises(ValueError, match="size=-5"):
        pool_bytes_for([-5])


def test_guard_arithmetic():
    r = guard.guard_refuses
    # live + request + headroom <= free passes, one byte more is refused
    assert not r(4 * GIB, 10 * GIB, 5 * GIB, GIB, False, False)
    assert r(4 * GIB + 1, 10 * GIB, 5 * GIB, GIB, False, False)
    assert r(1, 0, 0, 0, False, False) and not r(0, 0, 0, 0, False, False)
    # oversubscription: only with the flag AND a coherent GPU; unknown coherence is treated as not coherent
    assert not r(100 * GIB, 10 * GIB, 50 * GIB, GIB, True, True)
    assert r(100 * GIB, 10 * GIB, 0, 0, False, True)
    assert r(100 * GIB, 10 * GIB, 0, 0, None, True)
    assert r(100 * GIB, 10 * GIB, 0, 0, True, False)
    with pytest.raises(ValueError, match="live_bytes=-1"):
        r(1, 1, -1, 0, False, False)
    with pytest.raises(TypeError, match="request_bytes=1.0"):
        r(1.0, 1, 1, 0, False, False)


def test_refusal_reason_names_numbers_and_ways_out():
    assert refusal_reason(GIB, 10 * GIB, 0, 0, False, False) is None
    msg = refusal_reason(8 * GIB, 10 * GIB, 4 * GIB, GIB // 2, False, False, what="the AdamW state",
                         device="cuda:0 (NVIDIA H200)")
    for part in ("refused 8.00 GiB for the AdamW state on cuda:0 (NVIDIA H200)", "holds 4.00 GiB",
                 "512.0 MiB of headroom", "12.50 GiB", "10.00 GiB the GPU has free", "does not read host memory "
                 "coherently", "can hang the GPU", "SuperOffload"):
        assert part in msg, (part, msg)
    coherent = refusal_reason(8 * GIB, 10 * GIB, 4 * GIB, 0, True, False)
    assert "allow_oversubscription=True" in coherent and "hang" not in coherent


def _toolchain_or_skip():
    try:
        return shim.find_toolchain()
    except ManagedMemoryUnavailable as e:
        pytest.skip(f"no toolchain for the shim here: {e}")


def test_compiled_guard_equals_the_python_guard(tmp_path, monkeypatch):
    tc = _toolchain_or_skip()
    monkeypatch.setenv("LGH_CACHE_DIR", str(tmp_path))
    path = shim.build(tc)
    assert path.is_file() and path.parent == tmp_path and path.with_suffix(".log").is_file()
    stamp = path.stat().st_mtime_ns
    assert shim.build(tc) == path and path.stat().st_mtime_ns == stamp  # cached: no rebuild
    lib = shim.Shim(path)
    assert lib.runtime_version()[0] == tc.cuda_version
    big = 2**63 - 1
    values = [0, 1, MIB, GIB, 10 * GIB, big]
    for req in values:
        for free in values:
            for live in (0, GIB, big):
                for head in (0, 512 * MIB, big):
                    for coherent in (False, True):
                        for allow in (False, True):
                            want = guard.guard_refuses(req, free, live, head, coherent, allow)
                            got = lib.guard_refuses(req, free, live, head, coherent=coherent,
                                                    allow_oversubscription=allow)
                            assert got == want, (req, free, live, head, coherent, allow)
    # the per-thread settings the allocator reads
    lib.set_config(prefer_host=False, accessed_by=True, allow_oversubscription=False, headroom_bytes=123)
    assert lib.get_config() == {"prefer_host": 0, "accessed_by": 1, "allow_oversubscription": 0,
                                "headroom_bytes": 123, "populate": 1}
    assert lib.last_refusal() is None and lib.stats(0)["live_bytes"] == 0
    with pytest.raises(ValueError, match="device=99"):
        lib.stats(99)


def test_missing_toolchain_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(shim, "_include_dirs", lambda: [])
    monkeypatch.setattr(shim, "_cuda_homes", lambda: [])
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ManagedMemoryUnavailable) as e:
        shim.find_toolchain()
    msg = str(e.value)
    assert "no C++ compiler" in msg and "no CUDA runtime headers" in msg and "no nvcc" in msg and "CUDA_HOME" in msg


def test_allocator_settings_that_mempool_cannot_serve_are_refused(monkeypatch):
    monkeypatch.setattr(pool_mod, "_allocator_settings", lambda: "max_split_size_mb:128,expandable_segments:True")
    assert pool_mod.expandable_segments_enabled()
    # what the pool's test allocation found, in words
    why = pool_mod.routing_failure(RuntimeError("MemPool doesn't currently support expandable_segments."), None)
    assert "cannot route allocations to a MemPool while the caching allocator runs with expandable_segments:True" in why
    assert "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF" in why
    assert "got device memory instead of managed memory" in pool_mod.routing_failure(None, "device")
    assert pool_mod.routing_failure(None, "managed") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert "backend is 'cudaMallocAsync'" in pool_mod.unavailable_reason()
    monkeypatch.setattr(pool_mod, "_allocator_settings", lambda: "expandable_segments:False")
    assert not pool_mod.expandable_segments_enabled()


def test_forecast_arithmetic():
    assert forecast_step_ms(100.0, 400.0, 50.0, 500.0) == pytest.approx(130.0)
    assert forecast_step_ms(100.0, 90.0, 50.0, 500.0) == 100.0  # never faster than the plain run
    assert forecast_step_ms(100.0, 400.0, 50.0, 50.0) == pytest.approx(400.0)  # the same link: the same step
    # a faster target link forecasts a shorter step, never below the plain run
    lo, hi = GH200_RMW_GBPS
    assert 0 < lo < hi
    at_lo, at_hi = (forecast_step_ms(100.0, 400.0, 50.0, t) for t in (lo, hi))
    assert 100.0 < at_hi < at_lo < 400.0
    assert state_traffic_ms(10**9, 100.0) == pytest.approx(20.0)  # 1 GB read and written at 100 GB/s
    assert state_traffic_ms(0, 100.0) == 0.0
    with pytest.raises(ValueError, match="target_gbps=0"):
        forecast_step_ms(1.0, 2.0, 3.0, 0)
    with pytest.raises(ValueError, match="state_bytes=-1"):
        state_traffic_ms(-1, 1.0)


def test_which_optimizers_get_their_state_created_in_the_pool():
    p = [nn.Parameter(torch.zeros(2))]

    class MyAdamW(torch.optim.AdamW):
        pass

    assert creates_state_eagerly(torch.optim.Adam(p)) and creates_state_eagerly(torch.optim.AdamW(p))
    assert creates_state_eagerly(MyAdamW(p))
    assert not creates_state_eagerly(torch.optim.SGD(p, lr=0.1, momentum=0.9))


def test_hardware_reports_coherence_and_measures_managed_bandwidth_only_with_cuda():
    from lightning_gh import hardware

    hw = hardware.detect()
    assert "coherent_host_memory" in hw.to_dict()
    assert hardware.cpu_view(hw).coherent_host_memory is None
    with pytest.raises(ValueError, match="nbytes=3 must be a positive multiple of 4"):
        hardware.managed_bandwidth(3)
    with pytest.raises(ValueError, match="repeats=0 must be an int > 0"):
        hardware.managed_bandwidth(1024, 0)
    if not CUDA:
        assert hw.coherent_host_memory is None and hardware.coherent_host_memory() is None
        assert hardware.managed_bandwidth() is None and hardware.managed_memory_attributes() is None


# ------------------------------------------------------------------------------------------ CPU: Lightning


def _fit(callbacks, steps=4, tmp_path=None, accelerator="cpu", precision="32-true", cfg=None, lr=2e-3, **kw):
    L.seed_everything(0, verbose=False)
    model = LlamaLM(cfg or preset("tiny"), lr=lr, warmup_steps=2)
    dm = MarkovDataModule.for_model(model, num_train_samples=4 * 64)
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach().clone())

    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=steps, precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[Losses(), *callbacks], **kw)
    trainer.fit(model, dm)
    return model, trainer, [x.item() for x in losses]


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="checks the CPU path")
def test_callback_on_cpu_is_a_noop_with_one_warning(tmp_path):
    _, _, plain = _fit([], steps=2, tmp_path=tmp_path)
    cb = ManagedOptimizerState()
    with pytest.warns(UserWarning, match="not a CUDA GPU, so there is no managed memory") as rec:
        model, trainer, managed = _fit([cb], steps=2, tmp_path=tmp_path)
    assert sum("ManagedOptimizerState" in str(w.message) for w in rec) == 1
    assert managed == plain and not cb.enabled and cb.reports == []
    assert all(t.device.type == "cpu" for st in trainer.optimizers[0].state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def test_callback_refuses_superoffload_and_sharded_strategies():
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_gh.compat import IncompatiblePartsError
    from lightning_gh.unified.callback import check_strategy

    with pytest.raises(MisconfigurationException, match="does not support strategy FSDPStrategy"):
        check_strategy(FSDPStrategy())
    check_strategy(L.pytorch.strategies.SingleDeviceStrategy(device="cpu"))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ManagedOptimizerState()])
    with pytest.raises(IncompatiblePartsError, match="SuperOffload and ManagedOptimizerState cannot be used together"):
        trainer.fit(LlamaLM(preset("tiny")), MarkovDataModule.for_model(LlamaLM(preset("tiny"))))


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="CPU functional run of the suite")
def test_benchmark_suite_runs_on_cpu(tmp_path, capsys, monkeypatch, frozen_heap):
    # In-process through the runner's main (tests/test_benchmarks.py runs the command line in a subprocess once), so
    # the test pays no second interpreter start and import of torch and Lightning.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run as bench_run

    rc = bench_run.main(["--suite", "unified", "--preset", "tiny", "--iters", "1", "--warmup", "0", "--device", "cpu",
                         "--out", str(tmp_path), "--um-in-process"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    data = json.loads((tmp_path / "bench_unified.json").read_text())
    rows = [r for r in data["results"] if r["preset"] == "tiny"]
    assert [r["variant"] for r in rows] == ["plain", "plain again", "managed cpu", "managed gpu",
                                            "managed cpu prefetch=step", "superoffload"]
    for r in rows:
        assert r["error"] is None and r["median_ms"] > 0, r
    assert rows[2]["losses_equal_plain"] is True  # on the CPU the callback is a no-op
    assert "forecast" in out.lower()


# ================================================================================================= GPU

gpu = pytest.mark.gpu


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@gpu
def test_guard_refuses_before_allocating():
    """A 24 MiB request with a headroom larger than the free memory: refused, nothing allocated. (If the guard were
    broken this would allocate 24 MiB, never more. 24 MiB is larger than any block the pool's first, 2 MiB test
    allocation left in its cache, so the caching allocator must ask the shim for a new segment.)"""
    lib = shim.load()
    dev = torch.cuda.current_device()
    free = _free_bytes()
    with managed_memory("gpu", accessed_by_gpu=False):  # the pool exists (its test allocation is done)
        pass
    before = lib.stats(dev)
    with pytest.raises(ManagedMemoryError) as e:
        with managed_memory("gpu", accessed_by_gpu=False, headroom_bytes=free + GIB):
            torch.empty(24 * MIB, dtype=torch.uint8, device="cuda")
    msg = str(e.value)
    assert "refused 24.0 MiB" in msg and "does not read host memory coherently" in msg, msg
    after = lib.stats(dev)
    assert after["refusals"] >= before["refusals"] + 1
    assert after["live_bytes"] == before["live_bytes"] and after["allocations"] == before["allocations"]
    assert lib.get_config()["headroom_bytes"] == 512 * MIB  # the thread's settings are restored


@gpu
def test_hardware_coherence_and_managed_bandwidth_on_the_gpu():
    from lightning_gh import hardware

    attrs = hardware.managed_memory_attributes()
    assert attrs is not None and attrs["managed_memory"] and attrs["concurrent_managed_access"]
    hw = hardware.detect()
    assert hw.coherent_host_memory == attrs["pageable_uses_host_page_tables"]
    assert pool_mod.get_pool().coherent == hw.coherent_host_memory  # the pool asks hardware.py
    bw = hardware.managed_bandwidth(64 * MIB, 3)
    print(f"managed bandwidth (64 MiB): {bw}")
    assert bw.read_gbps > 1 and bw.write_gbps > 1 and bw.rmw_gbps > 1 and bw.device_rmw_gbps > bw.rmw_gbps
    assert bw.coherent == hw.coherent_host_memory


@gpu
def test_oversubscription_flag_is_refused_on_a_pcie_gpu():
    from lightning_gh import hardware

    if hardware.coherent_host_memory():
        pytest.skip("this GPU is coherent with host memory (Grace Hopper)")
    with pytest.raises(ValueError, match="allow_oversubscription=True is honoured only where the GPU reads host"):
        with managed_memory("cpu", allow_oversubscription=True):
            pass


@gpu
def test_host_preferred_pages_take_no_gpu_memory_and_compute_correctly():
    from lightning_gh.unified import is_managed, locations

    n = 256 * MIB // 4
    free0 = _free_bytes()
    with managed_memory("cpu") as pool:
        t = torch.empty(n, dtype=torch.float32, device="cuda")
    free1 = _free_bytes()
    assert is_managed(t) and locations(t)["preferred"] == "cpu"
    assert abs(free0 - free1) < 64 * MIB, (free0 - free1) / MIB  # the pages are in host memory
    ref = (torch.arange(n) % 1024).float()  # small integers: every sum below is exact
    t.copy_(ref)
    assert t.double().sum().item() == ref.double().sum().item()
    t.mul_(2)
    assert torch.equal(t.cpu(), ref * 2)
    s = pool.stats()
    assert s.pool_reserved_bytes >= 256 * MIB and s.pool_allocated_bytes >= 256 * MIB
    assert s.managed_live_bytes >= 256 * MIB
    del t


@gpu
def test_gpu_preferred_pages_live_on_the_gpu_and_advice_and_prefetch_move_them():
    from lightning_gh.unified import advise, is_managed, locations, prefetch

    free0 = _free_bytes()
    with managed_memory("gpu"):
        t = torch.ones(128 * MIB // 4, device="cuda")
    free1 = _free_bytes()
    assert locations(t)["preferred"] == f"cuda:{torch.cuda.current_device()}"
    assert free0 - free1 >= 100 * MIB  # populated on the GPU
    assert advise(t, preferred="cpu") == 128 * MIB and locations(t)["preferred"] == "cpu"
    assert prefetch(t, to="cpu") == 128 * MIB
    torch.cuda.synchronize()
    assert locations(t)["last_prefetch"] == "cpu"
    prefetch(t, to="gpu")
    torch.cuda.synchronize()
    assert locations(t)["last_prefetch"].startswith("cuda") and t.sum().item() == t.numel()
    plain = torch.ones(4, device="cuda")
    assert not is_managed(plain)
    with pytest.raises(ValueError, match=r"tensors\[0\] .* is in device memory, not managed memory"):
        advise(plain, preferred="cpu")
    with pytest.raises(ValueError, match="to='disk' is not a location"):
        prefetch(t, to="disk")


@gpu
def test_no_managed_scope_inside_a_graph_capture():
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            with pytest.raises(ManagedMemoryError, match="during a CUDA graph capture"):
                with managed_memory("cpu"):
                    pass
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    assert x.sum().item() == 4


@gpu
def test_expandable_segments_work_or_are_refused_in_a_fresh_process():
    """torch 2.11 keeps expandable segments to the default pool and serves a custom-allocator MemPool from the shim:
    the pool works. Releases that raise instead get ManagedMemoryUnavailable naming the setting."""
    code = textwrap.dedent("""
        import torch
        from lightning_gh.unified import managed_memory, is_managed, ManagedMemoryUnavailable
        torch.zeros(1, device="cuda")
        try:
            with managed_memory("cpu"):
                t = torch.zeros(1 << 20, device="cuda")
            big = torch.zeros(1 << 26, device="cuda")   # the default pool keeps working
            print("WORKS", is_managed(t), is_managed(big), t.sum().item())
        except ManagedMemoryUnavailable as e:
            print("REFUSED:", e)
    """)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    print(out.stdout)
    assert "WORKS True False 0.0" in out.stdout or ("REFUSED:" in out.stdout and "expandable_segments:True"
                                                    in out.stdout), out.stdout + out.stderr[-2000:]


@gpu
def test_plain_pytorch_state_placement_adamw_and_sgd():
    from lightning_gh.unified import is_managed, manage_optimizer_state

    def run(opt_cls, managed, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
        opt = opt_cls(model.parameters(), **kw)
        placement = manage_optimizer_state(opt, "cpu") if managed else None
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(32, 64, generator=g).cuda()).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt, placement

    for cls, kw in ((torch.optim.AdamW, dict(lr=1e-2, fused=True)), (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))):
        ref, _, _ = run(cls, False, **kw)
        got, opt, placement = run(cls, True, **kw)
        for a, b in zip(ref.parameters(), got.parameters()):
            assert torch.equal(a, b), cls.__name__
        tensors = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.is_cuda]
        assert tensors and all(is_managed(t) for t in tensors), cls.__name__
        rep = placement.report()
        if cls is torch.optim.AdamW:
            assert rep.created_bytes > 0 and rep.moved_bytes == 0 and {"exp_avg", "exp_avg_sq"} <= set(rep.keys)
        else:
            assert rep.moved_bytes > 0 and rep.keys == ["momentum_buffer"]
        placement.remove()


def _gpu_fit(callbacks, steps=12, cfg=None, precision="bf16-mixed", **kw):
    return _fit(callbacks, steps=steps, accelerator="gpu", precision=precision, cfg=cfg or preset("small"),
                deterministic="warn", **kw)


@pytest.fixture
def deterministic_attention():
    """Flash, memory-efficient and cuDNN attention backwards are nondeterministic under Trainer(deterministic="warn")
    (warn-only mode keeps their atomics); the math kernel is deterministic."""
    b = torch.backends.cuda
    flags = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled())
    b.enable_flash_sdp(False)
    b.enable_mem_efficient_sdp(False)
    b.enable_cudnn_sdp(False)
    yield
    b.enable_flash_sdp(flags[0])
    b.enable_mem_efficient_sdp(flags[1])
    b.enable_cudnn_sdp(flags[2])


@gpu
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_losses_bitwise_equal_to_the_plain_run(tmp_path, precision, deterministic_attention):
    plain_model, _, plain = _gpu_fit([], tmp_path=tmp_path, precision=precision)
    again_model, _, again = _gpu_fit([], tmp_path=tmp_path, precision=precision)
    assert again == plain, "two plain runs differ: the comparison below would mean nothing"
    for preferred, prefetch in (("cpu", "none"), ("gpu", "none"), ("cpu", "step")):
        cb = ManagedOptimizerState(preferred, prefetch=prefetch)
        model, trainer, losses = _gpu_fit([cb], tmp_path=tmp_path, precision=precision)
        assert losses == plain, (preferred, prefetch, losses, plain)
        for (name, a), b in zip(plain_model.named_parameters(), model.parameters()):
            assert torch.equal(a.cpu(), b.cpu()), (preferred, prefetch, name)
        rep = cb.reports[0]
        nparams = sum(p.numel() for p in model.parameters())
        assert rep.state_bytes >= 8 * nparams and rep.created_bytes >= 8 * nparams, rep
        assert {"exp_avg", "exp_avg_sq"} <= set(rep.keys)
        if prefetch == "step":
            assert rep.prefetches + rep.skipped_prefetches >= 11, rep
        del model, trainer
        gc.collect()


@gpu
def test_state_lives_where_it_was_asked_to_during_the_run(tmp_path):
    from lightning_gh.unified import is_managed, locations

    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            st = trainer.optimizers[0].state
            moments = [s[k] for s in st.values() for k in ("exp_avg", "exp_avg_sq")]
            seen[batch_idx] = (len(moments), all(is_managed(t) for t in moments), locations(moments[0]))

    for preferred in ("cpu", "gpu"):
        seen.clear()
        _gpu_fit([ManagedOptimizerState(preferred), Look()], steps=3, tmp_path=tmp_path, cfg=preset("small", n_layers=2))
        want = "cpu" if preferred == "cpu" else f"cuda:{torch.cuda.current_device()}"
        assert all(n > 0 and managed and loc["preferred"] == want for n, managed, loc in seen.values()), seen


@gpu
def test_resume_from_a_checkpoint_keeps_the_state_managed_and_equal(tmp_path, deterministic_attention):
    from lightning_gh.unified import is_managed

    cfg = preset("small", n_layers=2)
    L.seed_everything(0, verbose=False)
    model = LlamaLM(cfg, lr=2e-3, warmup_steps=2)
    dm = MarkovDataModule.for_model(model, num_train_samples=4 * 64)
    common = dict(accelerator="gpu", devices=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, deterministic="warn",
                  default_root_dir=tmp_path)
    trainer = L.Trainer(max_steps=4, callbacks=[ManagedOptimizerState()], **common)
    trainer.fit(model, dm)
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)

    def resume(callbacks):
        L.seed_everything(0, verbose=False)
        m = LlamaLM(cfg, lr=2e-3, warmup_steps=2)
        t = L.Trainer(max_steps=8, callbacks=callbacks, **common)
        t.fit(m, MarkovDataModule.for_model(m, num_train_samples=4 * 64), ckpt_path=ckpt)
        return m, t

    class Look(L.Callback):
        # Lightning moves the optimizer state to the CPU when fit ends: look while it trains.
        def on_train_end(self, trainer, pl_module):
            st = trainer.optimizers[0].state
            self.managed = [is_managed(s["exp_avg"]) and is_managed(s["exp_avg_sq"]) for s in st.values()]

    plain_model, _ = resume([])
    look = Look()
    managed_model, t = resume([ManagedOptimizerState(), look])
    for a, b in zip(plain_model.parameters(), managed_model.parameters()):
        assert torch.equal(a, b)
    assert look.managed and all(look.managed)


@gpu
def test_composes_with_cuda_graph_capture(tmp_path, deterministic_attention):
    from lightning_gh import CUDAGraphCapture

    cfg = preset("small", n_layers=2)
    _, _, graphed = _gpu_fit([CUDAGraphCapture(warmup_steps=3)], steps=10, cfg=cfg, precision="32-true",
                             tmp_path=tmp_path)
    cap = CUDAGraphCapture(warmup_steps=3)
    managed_cb = ManagedOptimizerState()
    _, trainer, both = _gpu_fit([cap, managed_cb], steps=10, cfg=cfg, precision="32-true", tmp_path=tmp_path)
    assert cap.report.state == "captured" and cap.report.replayed_steps >= 6, cap.report.summary()
    assert both == graphed
    assert managed_cb.reports[0].state_bytes > 0
