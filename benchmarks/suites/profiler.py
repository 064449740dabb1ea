"""Suite `profiler`: what SelectiveProfiler and DataStallDetector cost, and what a window's summary says, on the GPU.

Variants per preset, each a full Lightning fit of warmup+iters steps (bf16-mixed, eager, fused AdamW), side by side:
  plain                      no callback: the base of the ratios
  selective (outside window) SelectiveProfiler with a window inside the warm-up (--window, default 1-3, backends
                             --backends, default torch,memory); every timed step is after the window
  stall detector             DataStallDetector on every step
  selective + stall          both
  lightning PyTorchProfiler  Trainer(profiler=PyTorchProfiler()) with Lightning's default schedule (the anchor: it
                             records steps 2-4 and keeps its per-hook and per-module record_function ranges on)
  plain (again)              the plain run once more: the run-to-run noise floor

Timing: the median period between consecutive on_train_batch_start CUDA events (everything a step costs,
hooks and data fetch included), after the warm-up; `busy_ms` is the batch-start-to-batch-end span of
benchmarks/common.StepTimer. `overhead_pct` = period / plain period - 1.

Checks from the window's summary (printed as CHECK lines and stored in the JSON): the top kernel is a GEMM; the
exclusive GPU shares compute + communication + copies + idle add up to 1 (and busy + idle, and the host phases);
the in-window step time against the plain step. The summary files are copied to $OUT/profiler/.

Example (GPU):  python benchmarks/run.py --suite profiler --preset small medium --iters 60 --warmup 6
Under nsys:     nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat ... python3 benchmarks/run.py
                --suite profiler --preset small --variants selective --backends nsys --window 1,3
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import traceback
from pathlib import Path

import torch

from common import BenchContext, Result, Timing, lightning_steps, peak_memory, reset_memory
from lightning_gh.demo import LlamaLM, preset
from lightning_gh.profiling import DataStallDetector, SelectiveProfiler, StepSchedule
from lightning_gh.profiling.profiler import BACKENDS, ENV_VAR, under_nsys

DEFAULT_PRESETS = ["small", "medium"]
VARIANTS = {
    "plain": "plain",
    "selective": "selective (outside window)",
    "stall": "stall detector",
    "both": "selective + stall",
    "lightning": "lightning PyTorchProfiler",
    "again": "plain (again)",
}


def add_arguments(parser) -> None:
    parser.add_argument("--window", default="1-3", help="SelectiveProfiler steps, inside the warm-up (default 1-3)")
    parser.add_argument("--backends", default="torch,memory", help=f"comma list of {BACKENDS} (default torch,memory)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")


def _period_timer(warmup: int):
    import lightning as L

    class PeriodTimer(L.Callback):
        """CUDA (or perf_counter) stamps at every batch start: the full period of each step."""

        def __init__(self) -> None:
            self.stamps: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if torch.cuda.is_available() and pl_module.device.type == "cuda":
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.stamps.append(ev)
            else:
                import time

                self.stamps.append(time.perf_counter())

        def timing(self) -> Timing:
            s = self.stamps[warmup:]
            if s and isinstance(s[0], torch.cuda.Event):
                torch.cuda.synchronize()
                samples = [a.elapsed_time(b) for a, b in zip(s, s[1:])]
            else:
                samples = [(b - a) * 1e3 for a, b in zip(s, s[1:])]
            return Timing.from_samples(samples)

    return PeriodTimer()


def _check_summary(summary: dict, plain_ms: float | None) -> dict:
    g = summary.get("gpu") or {}
    top = (summary.get("top_kernels") or [{}])[0]
    phases = summary.get("phases") or {}
    out = {
        "top_kernel": top.get("name"),
        "top_kernel_kind": top.get("kind"),
        "top_kernel_share": top.get("share"),
        "top_kernel_is_gemm": top.get("kind") == "gemm",
        "gpu_busy_share": g.get("busy_share"),
        "exclusive_shares_sum": round(sum(g.get(k, 0.0) for k in ("compute_share", "comm_share", "copy_share",
                                                                    "idle_share")), 6) if g else None,
        "busy_plus_idle": round(g["busy_share"] + g["idle_share"], 6) if g else None,
        "idle_split_sum": round(g["idle"]["host_bound_share"] + g["idle"]["other_share"] - g["idle_share"], 6)
        if g else None,
        "phase_shares_sum": round(sum(p["share"] for p in phases.values()), 6) if phases else None,
        "verdict": summary.get("verdict", {}).get("bound"),
        "window_steps": [r["step"] for r in summary.get("steps", [])],
        "window_step_ms": (summary.get("step_time_ms") or {}).get("median"),
    }
    if plain_ms and out["window_step_ms"]:
        out["window_step_vs_plain"] = round(out["window_step_ms"] / plain_ms, 3)
    return out


def run(ctx: BenchContext) -> list[Result]:
    args = ctx.args
    window = getattr(args, "window", "1-3")
    backends = tuple(b.strip() for b in getattr(args, "backends", "torch,memory").split(",") if b.strip())
    keys = [k.strip() for k in getattr(args, "variants", ",".join(VARIANTS)).split(",") if k.strip()]
    bad = [k for k in keys if k not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    sched = StepSchedule.parse(window, argument="--window")
    if sched.last_step + 2 > ctx.warmup:
        raise SystemExit(f"--window={window} must end at least 2 steps before the first timed step: "
                         f"raise --warmup to >= {sched.last_step + 2}")
    os.environ.pop(ENV_VAR, None)  # the suite places the window itself
    nsys = under_nsys()
    print(f"[profiler] window {window}, backends {backends}; nsys attached: "
          f"{'yes, via ' + nsys if nsys else 'no'}; NSYS_* variables: "
          f"{sorted(k for k in os.environ if k.startswith('NSYS'))}; CUDA_INJECTION64_PATH: "
          f"{os.path.basename(os.environ.get('CUDA_INJECTION64_PATH', '')) or '-'}", flush=True)
    save_dir = ctx.out_dir / "profiler"
    results: list[Result] = []
    for name in ctx.presets:
        cfg = preset(name)
        plain_ms = None
        for key in keys:
            variant = VARIANTS[key]
            reset_memory(ctx.device)
            r = Result(ctx.suite, name, variant, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
            tmp = Path(tempfile.mkdtemp(prefix=f"lgh_prof_{name}_"))
            try:
                torch.manual_seed(0)
                model = LlamaLM(cfg, lr=1e-4, warmup_steps=0)
                period = _period_timer(ctx.warmup)
                callbacks: list = [period]
                kwargs: dict = {}
                prof = None
                if key in ("selective", "both"):
                    prof = SelectiveProfiler(steps=window, backends=backends, output_dir=tmp / "profiles")
                    callbacks.append(prof)
                det = None
                if key in ("stall", "both"):
                    det = DataStallDetector()
                    callbacks.append(det)
                if key == "lightning":
                    from lightning.pytorch.profilers import PyTorchProfiler

                    kwargs["profiler"] = PyTorchProfiler(dirpath=str(tmp / "lightning"), filename="lightning")
                busy, trainer = lightning_steps(model, ctx, callbacks=callbacks, **kwargs)
                r.timing = period.timing()
                r.peak_mem_bytes = peak_memory(ctx.device)
                r.extra["busy_ms"] = round(busy.median_ms, 4)
                if key == "plain":
                    plain_ms = r.timing.median_ms
                if det is not None:
                    r.extra["data_wait_frac"] = None if det.data_wait_frac is None else round(det.data_wait_frac, 4)
                    r.extra["stall_warned"] = det.warned
                if prof is not None:
                    r.extra["windows_written"] = [w["steps"] for w in prof.written]
                    print(f"[profiler] {name} {variant}: windows closed {r.extra['windows_written']} "
                          f"({', '.join(w['reason'] for w in prof.written) or 'none'})", flush=True)
                    r.extra["files"] = sorted({Path(f).name for w in prof.written for f in w["files"].values()})
                    summaries = [w["files"]["summary_json"] for w in prof.written if "summary_json" in w["files"]]
                    if summaries:
                        summary = json.loads(Path(summaries[0]).read_text())
                        checks = _check_summary(summary, plain_ms)
                        r.extra.update(checks)
                        _report_checks(name, checks, summary)
                        dest = save_dir / f"{name}_{key}"
                        dest.mkdir(parents=True, exist_ok=True)
                        for w in prof.written:
                            for k, f in w["files"].items():
                                if k.startswith("summary_"):
                                    shutil.copy(f, dest / Path(f).name)
                    elif "torch" in backends:
                        print(f"CHECK {name}: no summary was written (windows: {prof.written})", flush=True)
                del trainer  # free the model before the next variant
            except Exception as e:  # an OOM is a result, not a crash of the suite
                r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            results.append(r)
            model = None
            reset_memory(ctx.device)
        base = next((x.median_ms for x in results if x.preset == name and x.variant == "plain" and x.median_ms), None)
        anchor = next((x.median_ms for x in results if x.preset == name and x.variant == VARIANTS["lightning"]
                       and x.median_ms), None)
        for x in results:
            if x.preset == name and x.median_ms:
                if base:
                    x.extra["overhead_pct"] = round(100 * (x.median_ms / base - 1), 3)
                if anchor:
                    x.extra["vs_lightning_profiler"] = round(anchor / x.median_ms, 3)
        for x in results:
            if x.preset == name and x.median_ms:
                print(f"[profiler] {name:<7} {x.variant:<28} period {x.median_ms:9.3f} ms  overhead vs plain "
                      f"{x.extra.get('overhead_pct', float('nan')):+7.3f}%  speedup vs Lightning PyTorchProfiler "
                      f"{x.extra.get('vs_lightning_profiler', float('nan')):.3f}x", flush=True)
    return results


def _report_checks(name: str, c: dict, summary: dict) -> None:
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    print(f"CHECK {name}: window steps {c['window_steps']} (expected the --window steps)", flush=True)
    if c["top_kernel"] is None:
        print(f"CHECK {name}: top kernel is a GEMM: n/a (no GPU kernels in the trace)", flush=True)
    else:
        print(f"CHECK {name}: top kernel is a GEMM: {ok(c['top_kernel_is_gemm'])} ({c['top_kernel_kind']}, "
              f"{c['top_kernel_share']:.1%} of kernel time: {c['top_kernel'][:90]})", flush=True)
    if c["exclusive_shares_sum"] is not None:
        print(f"CHECK {name}: compute+comm+copies+idle = {c['exclusive_shares_sum']} "
              f"{ok(abs(c['exclusive_shares_sum'] - 1) < 1e-3)}; busy+idle = {c['busy_plus_idle']}; "
              f"host-bound+other-idle = idle ({ok(abs(c['idle_split_sum']) < 1e-3)}); "
              f"phases = {c['phase_shares_sum']}", flush=True)
    print(f"CHECK {name}: GPU busy {c['gpu_busy_share']}, verdict {c['verdict']}, in-window step "
          f"{c['window_step_ms']} ms ({c.get('window_step_vs_plain', '-')}x plain)", flush=True)
    for k in (summary.get("top_kernels") or [])[:3]:
        print(f"    {k['share']:6.1%} {k['count']:5d}x {k['kind']:<13} {k['name'][:100]}", flush=True)
