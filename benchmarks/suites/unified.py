"""Suite `unified`: the optimizer state in CUDA managed memory, against the plain run and SuperOffload, in one
process tree, with the bandwidths that explain the step times and a GH200 forecast from them.

Part `env`: what the machine and torch offer (GPU coherent with host memory? managed-memory attributes, the MemPool
API, the allocator settings, the shim's toolchain).

Part `bandwidth`: GPU kernels on host-resident managed memory (``hardware.managed_bandwidth``: read, write,
in-place update, 256 MiB by default, well under the free memory) and pinned copies (``hardware.link_bandwidth``).

Part `speed`: one model (`preset("medium")`, 8 layers by default: 542M parameters, 4.0 GiB of fp32 AdamW moments;
`precision="bf16-mixed"`, fp32 weights, fused AdamW), each variant a full step of an ordinary `Trainer`, timed per
step with CUDA events (median) after `--warmup` steps, under `Trainer(deterministic="warn")`, losses recorded per
step and compared with the plain run's (the GPU tests check bitwise equality with deterministic attention):

  plain                        fused AdamW, state in GPU memory (the ratio base)
  plain again                  the same, again: how far two plain runs differ (flash attention's backward is
                               nondeterministic even under Trainer(deterministic="warn"))
  managed cpu                  ManagedOptimizerState("cpu"): state in host-preferred managed memory, read in place
  managed gpu                  ManagedOptimizerState("gpu"): state in GPU-preferred managed memory
  managed cpu prefetch=step    ManagedOptimizerState("cpu", prefetch="step"): to the GPU for the step, back after
  superoffload                 Trainer(strategy="superoffload"): state in pinned host memory, CPU AdamW

When training ends (model and optimizer alive, caches emptied; before Lightning moves the model to the CPU) each
variant records the GPU memory in use as the driver sees it (`cudaMemGetInfo`) and as PyTorch's allocator counts it
outside host-preferred managed memory (torch counts a MemPool's blocks in `memory_allocated`; the host-preferred
pools' allocated bytes are subtracted, GPU-preferred ones are as resident as any), the managed bytes, and the
optimizer state's bytes. `peak_resident_gib` is the allocator's peak minus the host-preferred managed bytes (the
state is live from the first step to the end). Then the GH200 forecast (arithmetic, marked as such; see
`lightning_gh.unified.forecast`) for the host-preferred variant.

Isolation: on CUDA every variant runs in a fresh Python process (`--um-in-process` turns that off), so each one's
memory figures start from an empty GPU. Every managed allocation stays far below the GPU's free memory (the pool's
guard refuses anything else).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before the first handle

import lightning as L  # noqa: E402
import torch  # noqa: E402

from common import (  # noqa: E402
    BenchContext,
    Result,
    child_context,
    emit_child_result,
    lightning_steps,
    peak_memory,
    reset_memory,
    run_isolated,
)
from lightning_gh import hardware  # noqa: E402
from lightning_gh.demo import LlamaLM, preset  # noqa: E402
from lightning_gh.unified import GH200_RMW_GBPS, ManagedOptimizerState, forecast_step_ms  # noqa: E402
from lightning_gh.unified import pool as um_pool  # noqa: E402
from lightning_gh.unified.forecast import state_traffic_ms  # noqa: E402

DEFAULT_PRESETS = ["medium"]
VARIANTS = ("plain", "plain again", "managed cpu", "managed gpu", "managed cpu prefetch=step", "superoffload")
_GIB = 2**30


def add_arguments(parser: Any) -> None:
    parser.add_argument("--um-layers", type=int, default=8, help="n_layers of the medium model (default 8: 542M)")
    parser.add_argument("--um-variants", nargs="+", default=None, choices=VARIANTS,
                        help="variants to run (the plain run always runs first)")
    parser.add_argument("--um-parts", nargs="+", default=["env", "bandwidth", "speed"],
                        choices=["env", "bandwidth", "speed"], help="parts to run (default: all)")
    parser.add_argument("--um-bw-mib", type=int, default=256, help="managed buffer of the bandwidth part (MiB)")
    parser.add_argument("--um-in-process", action="store_true", help="run the variants in this process")
    parser.add_argument("--um-nondeterministic", action="store_true",
                        help="allow nondeterministic kernels (the loss comparison may then differ by rounding)")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach().clone())  # no host sync inside the timed steps


# ------------------------------------------------------------------------------------------------------ env
def _env(ctx: BenchContext) -> list[Result]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "has_MemPool": hasattr(torch.cuda, "MemPool"),
                            "has_use_mem_pool": hasattr(torch.cuda, "use_mem_pool"),
                            "thread_local_pools": hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"),
                            "allocator_settings": um_pool._allocator_settings() or "(default)"}
    if ctx.cuda:
        hw = hardware.detect()
        info.update(gpu=hw.gpu_name, coherent_host_memory=hw.coherent_host_memory, link=hw.link,
                    attributes=hardware.managed_memory_attributes(), unavailable=um_pool.unavailable_reason())
        try:
            from lightning_gh.unified import shim

            t0 = time.perf_counter()
            tc = shim.find_toolchain()
            lib = shim.load()
            info.update(toolchain=f"{tc.kind} {tc.compiler} headers {tc.cuda_version} {tc.include_dir} {tc.cudart}",
                        shim_ready_s=round(time.perf_counter() - t0, 2), shim_runtime=lib.runtime_version())
        except Exception as e:
            info["toolchain_error"] = _err(e)
    print("[unified] env: " + json.dumps(info, default=str), flush=True)
    r = Result(ctx.suite, "env", "environment", None)
    r.extra.update({k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in info.items()})
    return [r]


# ------------------------------------------------------------------------------------------------ bandwidth
def _bandwidth(ctx: BenchContext) -> tuple[list[Result], dict[str, float]]:
    if not ctx.cuda:
        return [], {}
    out: list[Result] = []
    bw: dict[str, float] = {}
    try:
        mb = hardware.managed_bandwidth(int(ctx.args.um_bw_mib) * 2**20)
        if mb is not None:
            bw.update(read=mb.read_gbps, write=mb.write_gbps, rmw=mb.rmw_gbps, device_rmw=mb.device_rmw_gbps)
            for name, v in (("managed host-resident: GPU read", mb.read_gbps),
                            ("managed host-resident: GPU write", mb.write_gbps),
                            ("managed host-resident: GPU in-place update (read+write)", mb.rmw_gbps),
                            ("device memory: GPU in-place update (read+write)", mb.device_rmw_gbps)):
                r = Result(ctx.suite, "bandwidth", name, None)
                r.extra["gbps"] = round(v, 1)
                out.append(r)
        link = hardware.link_bandwidth()
        if link is not None:
            bw.update(h2d=link.h2d_gbps, d2h=link.d2h_gbps)
            for name, v in (("pinned copy host->GPU", link.h2d_gbps), ("pinned copy GPU->host", link.d2h_gbps)):
                r = Result(ctx.suite, "bandwidth", name, None)
                r.extra["gbps"] = round(v, 1)
                out.append(r)
    except Exception as e:
        out.append(Result(ctx.suite, "bandwidth", "managed bandwidth", None, error=_err(e)))
        traceback.print_exc()
    for r in out:
        print(f"[unified] bandwidth {r.variant}: {r.extra.get('gbps')} GB/s {r.error or ''}", flush=True)
    return out, bw


# ---------------------------------------------------------------------------------------------------- speed
def _config(ctx: BenchContext, name: str) -> Any:
    return preset(name, n_layers=int(ctx.args.um_layers)) if name == "medium" else preset(name)


def _variant_kwargs(name: str) -> tuple[list[Any], dict[str, Any]]:
    if name in ("plain", "plain again"):
        return [], {}
    if name == "managed cpu":
        return [ManagedOptimizerState("cpu")], {}
    if name == "managed gpu":
        return [ManagedOptimizerState("gpu")], {}
    if name == "managed cpu prefetch=step":
        return [ManagedOptimizerState("cpu", prefetch="step")], {}
    if name == "superoffload":
        return [], {"strategy": "superoffload"}
    raise ValueError(f"variant {name!r} is not one of {VARIANTS}")


class _MemoryAtTrainEnd(L.Callback):
    """GPU memory in use when training ends, before Lightning's teardown moves the model to the CPU."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not torch.cuda.is_available() or pl_module.device.type != "cuda":
            return
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        allocated = torch.cuda.memory_allocated()
        pool_alloc = sum(p.stats().pool_allocated_bytes for p in um_pool._pools.values())
        # Only host-preferred managed pages are off the GPU; GPU-preferred ones are as resident as cudaMalloc's.
        host_alloc = sum(p.stats().pool_allocated_bytes for p in um_pool._pools.values() if p.preferred == "cpu")
        state = 0
        for opt in trainer.optimizers:
            for st in getattr(opt, "state", {}).values():
                for t in st.values() if isinstance(st, dict) else ():
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        state += t.nbytes
        self.figures = {"gpu_used_gib": round((total - free) / _GIB, 3), "allocated_gib": round(allocated / _GIB, 3),
                        "managed_gib": round(pool_alloc / _GIB, 3), "host_managed_gib": round(host_alloc / _GIB, 3),
                        "cuda_state_gib": round(state / _GIB, 3),
                        "peak_resident_gib": round((torch.cuda.max_memory_allocated() - host_alloc) / _GIB, 3)}


def _run_variant(ctx: BenchContext, preset_name: str, name: str) -> Result:
    cfg = _config(ctx, preset_name)
    label = f"{preset_name}-{cfg.n_layers}L" if preset_name == "medium" else preset_name
    r = Result(ctx.suite, label, name, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
    reset_memory(ctx.device)
    model = trainer = None
    try:
        callbacks, kw = _variant_kwargs(name)
        losses, memory = _Losses(), _MemoryAtTrainEnd()
        L.seed_everything(0, verbose=False)
        with torch.device(ctx.device):
            model = LlamaLM(cfg, lr=1e-4, warmup_steps=0)
        if ctx.cuda and not getattr(ctx.args, "um_nondeterministic", False):
            kw["deterministic"] = "warn"
        r.timing, trainer = lightning_steps(model, ctx, callbacks=[losses, memory, *callbacks], **kw)
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra["losses"] = [float(x) for x in losses.losses]
        r.extra["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        r.extra.update(memory.figures)
        for cb in callbacks:
            if isinstance(cb, ManagedOptimizerState) and cb.reports:
                rep = cb.reports[0]
                r.extra.update(state_gib=round(rep.state_bytes / _GIB, 3), prefetches=rep.prefetches,
                               skipped_prefetches=rep.skipped_prefetches)
    except Exception as e:  # an OOM or a refusal is a result, not a crash of the suite
        r.error = _err(e)
        traceback.print_exc()
    finally:
        del model, trainer  # both bound (None before the try): drop them before the collection
        gc.collect()
        reset_memory(ctx.device)
    print(f"[unified] {name}: {r.median_ms} ms  "
          f"{ {k: v for k, v in r.extra.items() if k != 'losses'} }  {r.error or ''}", flush=True)
    return r


def _isolated(ctx: BenchContext, preset_name: str, name: str) -> Result:
    r, proc = run_isolated(ctx, "suites.unified", {"preset": preset_name, "name": name}, echo="[unified]")
    if r is not None:
        return r
    sys.stderr.write(proc.stderr[-4000:])
    return Result(ctx.suite, preset_name, name, None, error=f"isolated run exited with {proc.returncode}")


def _child(args: dict[str, Any]) -> None:
    emit_child_result(_run_variant(child_context(args), args["preset"], args["name"]))


def _compare(block: list[Result]) -> None:
    base = block[0]
    ref = base.extra.get("losses")
    for r in block:
        ms, losses = r.median_ms, r.extra.get("losses")
        if base.median_ms and ms:
            r.extra["x_plain"] = round(ms / base.median_ms, 3)
        if ref and losses:
            r.extra["losses_equal_plain"] = losses == ref
            r.extra["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref))
            r.extra["loss_last"] = round(losses[-1], 4)
        if "gpu_used_gib" in r.extra and "gpu_used_gib" in base.extra:
            r.extra["gpu_used_drop_gib"] = round(base.extra["gpu_used_gib"] - r.extra["gpu_used_gib"], 3)
            resident = r.extra["allocated_gib"] - r.extra.get("host_managed_gib", 0.0)
            r.extra["resident_alloc_drop_gib"] = round(base.extra["allocated_gib"] - resident, 3)


def _forecast(block: list[Result], bw: dict[str, float]) -> list[str]:
    by = {r.variant: r for r in block}
    plain, managed = by.get("plain"), by.get("managed cpu")
    lines = []
    if not (plain and managed and plain.median_ms and managed.median_ms and bw.get("rmw")):
        return ["GH200 forecast: not computed (it needs a CUDA run of the bandwidth part and of the plain and "
                "managed cpu variants)."]
    lo, hi = GH200_RMW_GBPS
    f_lo = forecast_step_ms(plain.median_ms, managed.median_ms, bw["rmw"], lo)
    f_hi = forecast_step_ms(plain.median_ms, managed.median_ms, bw["rmw"], hi)
    managed.extra.update(gh200_forecast_ms_low=round(f_hi, 1), gh200_forecast_ms_high=round(f_lo, 1))
    state = int(round(managed.extra.get("state_gib", 0.0) * _GIB))
    lines += [
        "GH200 FORECAST (arithmetic from the measurements above, NOT measured on a GH200):",
        f"  measured here: plain {plain.median_ms:.1f} ms, managed cpu {managed.median_ms:.1f} ms, in-place update of "
        f"host-resident managed memory {bw['rmw']:.1f} GB/s (read+write)",
        f"  assumed GH200 in-place update of Grace memory over NVLink-C2C: {lo:.0f}-{hi:.0f} GB/s (published "
        "measurements, arXiv 2408.11556), plain step time as here",
        f"  forecast managed cpu step on a GH200: {f_hi:.1f}-{f_lo:.1f} ms = {f_hi / plain.median_ms:.2f}-"
        f"{f_lo / plain.median_ms:.2f}x the plain step (here {managed.median_ms / plain.median_ms:.2f}x)",
    ]
    if state:
        lines.append(f"  floor of the state traffic ({state / _GIB:.2f} GiB read and written once): "
                     f"{state_traffic_ms(state, bw['rmw']):.1f} ms here, {state_traffic_ms(state, hi):.1f}-"
                     f"{state_traffic_ms(state, lo):.1f} ms on a GH200 (forecast)")
    return lines


_COLS = ("x_plain", "losses_equal_plain", "max_loss_diff", "gpu_used_gib", "gpu_used_drop_gib", "allocated_gib",
         "managed_gib", "host_managed_gib", "resident_alloc_drop_gib", "peak_resident_gib", "cuda_state_gib", "state_gib", "prefetches", "skipped_prefetches",
         "gh200_forecast_ms_low", "gh200_forecast_ms_high", "params_M", "loss_last", "gbps")


def _print_table(results: list[Result], lines: list[str]) -> None:
    cols = [c for c in _COLS if any(r.extra.get(c) is not None for r in results)]
    head = ["preset", "variant", "median_ms", *cols]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.preset == "env":
            continue
        row = [r.preset, r.variant, f"{r.median_ms:.2f}" if r.median_ms else (r.error or "-")[:60]]
        row += ["-" if r.extra.get(c) is None else str(r.extra[c]) for c in cols]
        out.append("| " + " | ".join(row) + " |")
    print("\n[unified] figures:\n" + "\n".join(out + [""] + lines), flush=True)


def run(ctx: BenchContext) -> list[Result]:
    parts = getattr(ctx.args, "um_parts", None) or ["env", "bandwidth", "speed"]
    results: list[Result] = []
    bw: dict[str, float] = {}
    if "env" in parts:
        results += _env(ctx)
    if "bandwidth" in parts:
        rows, bw = _bandwidth(ctx)
        results += rows
    lines: list[str] = []
    if "speed" in parts:
        isolate = ctx.cuda and not getattr(ctx.args, "um_in_process", False)
        chosen = getattr(ctx.args, "um_variants", None)
        names = [v for v in VARIANTS if v == "plain" or not chosen or v in chosen]
        for preset_name in ctx.presets:
            block = [(_isolated if isolate else _run_variant)(ctx, preset_name, name) for name in names]
            _compare(block)
            lines += _forecast(block, bw)
            results += block
    _print_table(results, lines)
    for r in results:
        r.extra.pop("losses", None) if len(r.extra.get("losses", [])) > 64 else None
    return results
