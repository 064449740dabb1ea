"""Where host-preferred managed pages live on this GPU, and whether PyTorch's allocator is in a state that spoils GPU
memory measurements: one JSON document on stdout, for reading the unified-memory GPU tests.

Each section runs in a fresh child process of this script, so that one cannot disturb the next:

  env        torch, CUDA, the driver, the GPU, its managed-memory attributes, the nvidia_uvm module parameters
             (access-counter migration, HMM, thrashing), ``nvidia-smi -q`` lines about virtualization, MIG and
             confidential computing. (In this process.)
  shim       the toolchain found, the build, the loaded library's CUDA versions. (In this process.)
  tensor     1 GiB allocated inside ``managed_memory("cpu")``: GPU memory in use as the driver reports it
             (``cudaMemGetInfo``) before and after the allocation, after a GPU read (``sum``, twice), after an in-place
             GPU write (``mul_``, twice) and a last read; each kernel's rate (pages left in host memory are read at
             the host link's rate, pages that moved to the GPU at HBM rate); the advice the driver reports
             (``cuMemRangeGetAttribute`` through libcuda: preferred location, its type and id, accessed-by, last
             prefetch location) next to the shim's own query. Then a control: the same for ``managed_memory("gpu")``,
             whose pages are populated on the GPU and must show in the driver's count.
  optimizer  the shape of ``test_gpu_resident_memory_drops_by_the_state_size``: a plain Lightning fit and one with
             ``ManagedOptimizerState("cpu")``, three steps of the demo model (110M parameters) each, GPU memory at
             the end of training with caches emptied, the drop, and the state's advice and read rate.
  optimizer_after_failed_capture  the same after a CUDA graph capture that CUDA invalidated (a sync inside the
             capture): whether ``torch.cuda.empty_cache()`` still gives blocks back, what the drop becomes, and
             whether the process then exits cleanly (the managed pools are never destroyed).
  mempool_after_failed_capture  a plain ``torch.cuda.MemPool`` destroyed after such a capture: torch's INTERNAL
             ASSERT ``captures_underway.empty()`` (the exit crash of the GPU test run), with the exit status.

See Note [Managed pools are never destroyed] in lightning_gh/unified/lifetime.py for the allocator state.

    python benchmarks/managed_probe.py                          # every section
    python benchmarks/managed_probe.py --sections tensor optimizer --gib 2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 2**20
CHILD_SECTIONS = ("tensor", "optimizer", "optimizer_after_failed_capture", "mempool_after_failed_capture")
SECTIONS = ("env", "shim", *CHILD_SECTIONS)
_MARK = "PROBE_JSON "
_KEEP: list[Any] = []  # objects that must outlive the section (a graph whose capture failed)
# cuMemRangeGetAttribute's attributes and location types (cuda.h)
_RANGE = {"read_mostly": 1, "preferred_location": 2, "accessed_by": 3, "last_prefetch_location": 4,
          "preferred_location_type": 5, "preferred_location_id": 6, "last_prefetch_location_type": 7,
          "last_prefetch_location_id": 8}
_LOCATION_TYPES = {0: "invalid", 1: "device", 2: "host", 3: "host_numa", 4: "host_numa_current"}


# ------------------------------------------------------------------------------------------------------ helpers


def used_bytes() -> int:
    """GPU memory in use on the current device as the driver reports it (total - free)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def mib(n: int | float) -> float:
    return round(n / MIB, 1)


def timed(fn: Any, nbytes: int) -> dict[str, float]:
    """One run of ``fn`` on the current stream, timed with CUDA events; ``gbps`` counts ``nbytes``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    return {"ms": round(ms, 3), "gbps": round(nbytes / (ms / 1e3) / 1e9, 1) if ms > 0 else None}


def range_attributes(ptr: int, nbytes: int) -> dict[str, Any]:
    """The driver's view of a managed range (``cuMemRangeGetAttribute``; -1 is the CPU, -2 none)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return {"error": f"libcuda.so.1: {e}"}
    fn = lib.cuMemRangeGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    out: dict[str, Any] = {}
    for name, attr in _RANGE.items():
        if name == "accessed_by":
            arr = (ctypes.c_int * max(1, torch.cuda.device_count()))()
            err = fn(arr, ctypes.sizeof(arr), attr, ptr, nbytes)
            out[name] = [v for v in arr if v != -2] if err == 0 else f"CUDA error {err}"
            continue
        v = ctypes.c_int()
        err = fn(ctypes.byref(v), 4, attr, ptr, nbytes)
        if err != 0:
            out[name] = f"CUDA error {err}"
        elif name.endswith("_type"):
            out[name] = _LOCATION_TYPES.get(v.value, v.value)
        else:
            out[name] = v.value
    return out


def advice_of(t: torch.Tensor) -> dict[str, Any]:
    """The driver's and the shim's view of the storage behind ``t``."""
    from lightning_gh.unified import shim

    s = t.untyped_storage()
    ptr, nbytes = s.data_ptr(), s.nbytes()
    lib = shim.load()
    pref, last = lib.range_locations(ptr, nbytes)
    return {"pointer_kind": lib.pointer_kind(ptr)[0], "driver": range_attributes(ptr, nbytes),
            "shim": {"preferred": pref, "last_prefetch": last}}


def invalidate_a_capture() -> str | None:
    """Capture a step that synchronizes: CUDA invalidates the capture and torch's capture_end raises before it ends
    the allocation to the graph's pool. Returns the error (``None`` if the capture did not fail)."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    x = torch.ones(16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side), torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
            (x * 2).sum().item()
    except Exception as e:
        _KEEP.append(g)  # the allocator's leftover entry refers to the graph: keep it alive
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    _KEEP.append(g)
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError as e:
        return f"unreadable: {e.strerror}"


def allocator_state() -> dict[str, Any]:
    from lightning_gh.unified import lifetime

    return {"empty_cache_releases": lifetime.empty_cache_releases(),
            "open_scopes": [f"{s.pool} on {s.thread_name}" for s in lifetime.open_scopes()]}


# ------------------------------------------------------------------------------------------------------ sections


def section_env() -> dict[str, Any]:
    from lightning_gh import hardware

    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    try:
        drv = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(drv))
        out["driver_cuda_version"] = drv.value
    except (OSError, AttributeError) as e:
        out["driver_cuda_version"] = f"unknown: {e}"
    try:
        out["nvidia_driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        out["nvidia_driver"] = None
    params = Path("/sys/module/nvidia_uvm/parameters")
    out["nvidia_uvm_parameters"] = ({p.name: _read(p) for p in sorted(params.iterdir()) if p.is_file()}
                                    if params.is_dir() else None)
    try:
        smi = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        keys = ("Product Name", "Driver Version", "CUDA Version", "Bus Id", "Virtualization Mode", "Addressing Mode",
                "MIG Mode", "Confidential", "CC Mode", "Persistence Mode")
        # "MIG Mode" is a heading: its "Current" line follows it
        picked = [i for i, ln in enumerate(smi) if any(k in ln for k in keys)]
        picked += [i + 1 for i in picked if "MIG Mode" in smi[i] and i + 1 < len(smi)]
        out["nvidia_smi"] = [smi[i].strip() for i in sorted(set(picked))][:40]
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    if torch.cuda.is_available():
        out["gpu"] = hardware.gpu_name()
        out["managed_memory_attributes"] = hardware.managed_memory_attributes()
        out["allocator_backend"] = torch.cuda.get_allocator_backend()
    out["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return out


def section_shim() -> dict[str, Any]:
    from dataclasses import asdict

    from lightning_gh.unified import pool, shim

    out: dict[str, Any] = {"unavailable_reason": pool.unavailable_reason() if torch.cuda.is_available() else None}
    try:
        tc = shim.find_toolchain()
        out["toolchain"] = asdict(tc)
    except Exception as e:
        out["toolchain_error"] = str(e)
        return out
    t0 = time.perf_counter()
    try:
        out["library"] = str(shim.build(tc))
        out["build_or_cache_s"] = round(time.perf_counter() - t0, 2)
        lib = shim.load()
        compiled, runtime = lib.runtime_version()
        out["compiled_cudart_version"], out["runtime_cudart_version"] = compiled, runtime
        out["api_form"] = "cudaMemLocation (CUDA 13)" if compiled >= 13000 else "int device (CUDA 12)"
        out["thread_config"] = lib.get_config()
    except Exception as e:
        out["build_error"] = f"{type(e).__name__}: {e}"
    return out


def _rates_and_use(t: torch.Tensor, base: int) -> dict[str, Any]:
    n = t.nbytes
    steps: dict[str, Any] = {}
    for name, fn, moved in (("read_1", lambda: t.sum(), n), ("read_2", lambda: t.sum(), n),
                            ("write_1", lambda: t.mul_(1.0), 2 * n), ("write_2", lambda: t.mul_(1.0), 2 * n),
                            ("read_3", lambda: t.sum(), n)):
        r = timed(fn, moved)
        r["gpu_used_delta_mib"] = mib(used_bytes() - base)
        steps[name] = r
    return steps


def section_tensor(gib: float) -> dict[str, Any]:
    from lightning_gh.unified import managed_memory

    n = int(gib * 2**30) // 4 * 4
    torch.zeros(1, device="cuda")
    out: dict[str, Any] = {"bytes": n, "allocator_before": allocator_state()}
    for preferred in ("cpu", "gpu"):  # gpu last: its pages stay on the GPU in the pool's cache
        base = used_bytes()
        with managed_memory(preferred) as pool:
            t = torch.empty(n // 4, dtype=torch.float32, device="cuda")
        r: dict[str, Any] = {"gpu_used_before_mib": mib(base), "after_allocation_delta_mib": mib(used_bytes() - base),
                             "advice_after_allocation": advice_of(t)}
        r["kernels"] = _rates_and_use(t, base)
        r["advice_after_kernels"] = advice_of(t)
        r["pool"] = vars(pool.stats()) if pool is not None else None
        delta = r["kernels"]["read_3"]["gpu_used_delta_mib"]
        r["pages"] = "in GPU memory" if delta > n / MIB / 2 else "in host memory (read in place)"
        out[f"preferred_{preferred}"] = r
        del t
    cpu_rate = out["preferred_cpu"]["kernels"]["read_2"]["gbps"] or 0
    gpu_rate = out["preferred_gpu"]["kernels"]["read_2"]["gbps"] or 0
    out["read_rate_cpu_over_gpu_preferred"] = round(cpu_rate / gpu_rate, 4) if gpu_rate else None
    return out


def _optimizer_runs(tmp: str) -> dict[str, Any]:
    import lightning as L

    from lightning_gh.demo import LlamaLM, MarkovDataModule, preset
    from lightning_gh.unified import ManagedOptimizerState, is_managed
    from lightning_gh.unified import pool as pool_mod

    cfg = preset("small", vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816)

    class AtTrainEnd(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            st = trainer.optimizers[0].state
            tensors = [t for s in st.values() for t in s.values() if isinstance(t, torch.Tensor) and t.is_cuda]
            moments = [s["exp_avg_sq"] for s in st.values() if "exp_avg_sq" in s]
            big = max(moments, key=lambda t: t.nbytes)
            nbytes = sum(t.nbytes for t in moments)
            self.figures = {
                "gpu_used_mib": mib(used_bytes()), "allocated_mib": mib(torch.cuda.memory_allocated()),
                "reserved_mib": mib(torch.cuda.memory_reserved()),
                "state_mib": mib(sum(t.nbytes for t in tensors)),
                "managed_pools_allocated_mib": mib(sum(p.stats().pool_allocated_bytes
                                                       for p in pool_mod.pools())),
                "state_managed": all(is_managed(t) for t in moments),
                "read_exp_avg_sq": timed(lambda: [t.sum() for t in moments], nbytes),
                "read_params": timed(lambda: [p.sum() for p in pl_module.parameters()],
                                     sum(p.nbytes for p in pl_module.parameters())),
                "advice_largest_exp_avg_sq": advice_of(big) if is_managed(big) else "not managed",
            }

    def fit(callbacks: list[Any]) -> dict[str, Any]:
        L.seed_everything(0, verbose=False)
        model = LlamaLM(cfg, lr=2e-3, warmup_steps=2)
        probe = AtTrainEnd()
        trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=3, precision="bf16-mixed", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, default_root_dir=tmp, callbacks=[*callbacks, probe])
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=4 * 64))
        del model, trainer
        gc.collect()
        torch.cuda.empty_cache()
        return probe.figures

    torch.zeros(1, device="cuda")
    out: dict[str, Any] = {"allocator_before": allocator_state(), "plain": fit([])}
    cb = ManagedOptimizerState("cpu")
    out["managed_cpu"] = fit([cb])
    out["managed_report"] = cb.reports[0].describe() if cb.reports else None
    out["driver_used_drop_mib"] = round(out["plain"]["gpu_used_mib"] - out["managed_cpu"]["gpu_used_mib"], 1)
    out["allocator_after"] = allocator_state()
    return out


def section_optimizer(tmp: str, after_failed_capture: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if after_failed_capture:
        torch.zeros(1, device="cuda")
        out["capture_error"] = invalidate_a_capture()
    out.update(_optimizer_runs(tmp))
    return out


def section_mempool_after_failed_capture() -> dict[str, Any]:
    """Prints its JSON before destroying the MemPool: the process may abort there."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(1 << 20, device="cuda")
    del a
    out = {"capture_error": invalidate_a_capture(), "allocator": allocator_state()}
    print(_MARK + json.dumps(out), flush=True)
    del pool
    gc.collect()
    print("MEMPOOL_DESTROYED", flush=True)
    return out


# ------------------------------------------------------------------------------------------------------ driver


def run_child(section: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", section, "--gib", str(args.gib)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = [ln[len(_MARK):] for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    out: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    out["exit_status"] = proc.returncode
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["exit_assert_captures_underway"] = "captures_underway" in proc.stderr
    if section == "mempool_after_failed_capture":
        out["mempool_destroyed_without_abort"] = "MEMPOOL_DESTROYED" in proc.stdout
    if proc.returncode != 0 or not lines:
        out["stderr_tail"] = proc.stderr[-2500:]
    return out


def child_main(section: str, gib: float) -> None:
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            if section == "tensor":
                out = section_tensor(gib)
            elif section == "optimizer":
                out = section_optimizer(tmp, after_failed_capture=False)
            elif section == "optimizer_after_failed_capture":
                out = section_optimizer(tmp, after_failed_capture=True)
            else:
                section_mempool_after_failed_capture()
                return
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(_MARK + json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--gib", type=float, default=1.0, help="size of the managed test tensor (default 1)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per child process")
    ap.add_argument("--child", choices=CHILD_SECTIONS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args.child, args.gib)
        return 0
    report: dict[str, Any] = {}
    if "env" in args.sections:
        report["env"] = section_env()
    if not torch.cuda.is_available():
        report["note"] = "no CUDA GPU: only the environment is reported"
        print(json.dumps(report, indent=1, default=str))
        return 0
    if "shim" in args.sections:
        report["shim"] = section_shim()
    for section in CHILD_SECTIONS:
        if section in args.sections:
            report[section] = run_child(section, args)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
