"""Suite `graphs`: the whole Lightning training step, eager against CUDAGraphCapture and torch.compile, same process.

Every variant is a full step inside an ordinary `Trainer(precision="bf16-mixed")` (fused AdamW + LambdaLR from
`LlamaLM.configure_optimizers`, batches from `MarkovDataModule` in pinned memory), timed per step with CUDA events
from `on_train_batch_start` to `on_train_batch_end`:

  lightning eager                         the plain run (ratio base)
  lightning + CUDAGraphCapture            the whole step captured after 3 warm-up steps and replayed
  lightning + compile reduce-overhead     the decoder under torch.compile(mode="reduce-overhead") (CUDA graph trees
                                          for forward and backward; loss, optimizer and Lightning stay eager)
  lightning + compile + CUDAGraphCapture  the decoder under torch.compile (default mode), the whole step captured

Anchors (../shared/gpu/README.md, H200): plain Lightning step of a 6-layer d=512 GPT 6.79 ms; a hand-written
whole-step CUDA graph of a similar GPT 2.37 ms. Goal: >= 2.5x over `lightning eager`, and at least as fast as
`lightning + compile reduce-overhead`. `loss_last` (the last step's logged loss, same seed and data for every
variant) shows that the graph trains the same model.
"""

from __future__ import annotations

import traceback

import torch

from common import BenchContext, Result, lightning_steps, peak_memory, reset_memory

from lightning_gh.demo import LlamaLM, preset
from lightning_gh.graphs import CUDAGraphCapture

DEFAULT_PRESETS = ["small"]
ANCHOR_PLAIN_LIGHTNING_MS = 6.79  # Lightning Trainer full step, 6-layer d=512 small GPT, bf16-mixed, eager
ANCHOR_WHOLE_STEP_GRAPH_MS = 2.37  # hand-written whole-step CUDA graph, 6-layer d=512 GPT
GOAL_SPEEDUP = 2.5


class CompiledLM(LlamaLM):
    """LlamaLM whose decoder is compiled with a chosen ``torch.compile`` mode in ``configure_model``."""

    def __init__(self, *args, compile_mode: str = "default", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._compile_mode = compile_mode

    def configure_model(self) -> None:
        if not getattr(self, "_compiled", False):
            self.model = torch.compile(self.model, mode=self._compile_mode)
            self._compiled = True


def _variants(cfg, ctx: BenchContext):
    def model(compile_mode=None):
        torch.manual_seed(0)
        if compile_mode is None:
            return LlamaLM(cfg, lr=1e-4, warmup_steps=10)
        return CompiledLM(cfg, lr=1e-4, warmup_steps=10, compile_mode=compile_mode)

    return [
        ("lightning eager", lambda: model(), lambda: [], False),
        ("lightning + CUDAGraphCapture", lambda: model(), lambda: [CUDAGraphCapture(warmup_steps=3)], False),
        ("lightning + compile reduce-overhead", lambda: model("reduce-overhead"), lambda: [], True),
        ("lightning + compile + CUDAGraphCapture", lambda: model("default"), lambda: [CUDAGraphCapture(warmup_steps=3)],
         True),
    ]


def run(ctx: BenchContext) -> list[Result]:
    results = []
    for name in ctx.presets:
        cfg = preset(name)
        for variant, make_model, make_callbacks, needs_cuda in _variants(cfg, ctx):
            r = Result(ctx.suite, name, variant, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
            if needs_cuda and not ctx.cuda:
                r.error = "skipped: needs CUDA (torch.compile on the CPU says nothing about this suite)"
                results.append(r)
                continue
            reset_memory(ctx.device)
            try:
                callbacks = make_callbacks()
                r.timing, trainer = lightning_steps(make_model(), ctx, callbacks=callbacks)
                r.peak_mem_bytes = peak_memory(ctx.device)
                loss = trainer.callback_metrics.get("train/loss")
                r.extra["loss_last"] = round(float(loss), 6) if loss is not None else None
                for cb in callbacks:
                    if isinstance(cb, CUDAGraphCapture):
                        rep = cb.report
                        r.extra.update(graph_state=rep.state, graph_replayed=rep.replayed_steps,
                                       graph_eager=rep.eager_steps, graph_reason=rep.reason,
                                       graph_pool_mib=round(rep.pool_bytes / 2**20, 1) if rep.pool_bytes else None,
                                       graph_capture_ms=round(rep.capture_ms, 1) if rep.capture_ms else None)
                if ctx.cuda and r.timing:
                    r.extra["vs_anchor_plain_lightning"] = round(ANCHOR_PLAIN_LIGHTNING_MS / r.timing.median_ms, 3)
                trainer = None
            except Exception as e:  # a failing variant is a result, not a crash of the suite
                r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc()
            results.append(r)
            reset_memory(ctx.device)
        _print_verdict(name, [r for r in results if r.preset == name])
    return results


def _print_verdict(preset_name: str, rows: list[Result]) -> None:
    ms = {r.variant: r.median_ms for r in rows}
    eager, graph = ms.get("lightning eager"), ms.get("lightning + CUDAGraphCapture")
    ro = ms.get("lightning + compile reduce-overhead")
    both = ms.get("lightning + compile + CUDAGraphCapture")
    print(f"\n[graphs/{preset_name}] anchor: plain Lightning step {ANCHOR_PLAIN_LIGHTNING_MS} ms, hand-written "
          f"whole-step graph {ANCHOR_WHOLE_STEP_GRAPH_MS} ms (d=512 GPT, H200)")
    for label, v in (("lightning eager", eager), ("CUDAGraphCapture", graph), ("compile reduce-overhead", ro),
                     ("compile + CUDAGraphCapture", both)):
        if v:
            vs_eager = f"{eager / v:.2f}x vs eager" if eager else "-"
            print(f"  {label:<28} {v:7.3f} ms  {vs_eager:>16}  {ANCHOR_PLAIN_LIGHTNING_MS / v:5.2f}x vs anchor "
                  f"plain, {ANCHOR_WHOLE_STEP_GRAPH_MS / v:5.2f}x vs anchor graph")
    if eager and graph:
        ok = eager / graph >= GOAL_SPEEDUP
        print(f"  goal >= {GOAL_SPEEDUP}x over eager Lightning: {eager / graph:.2f}x -> {'met' if ok else 'NOT met'}")
    if graph and ro:
        print(f"  goal at least as fast as reduce-overhead: {ro / graph:.2f}x -> {'met' if graph <= ro else 'NOT met'}")
