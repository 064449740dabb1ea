"""Suite `graphs`: the whole Lightning training step, eager against CUDAGraphCapture and torch.compile, same process.

Every variant is a full step inside an ordinary `Trainer(precision="bf16-mixed")` (fused AdamW + LambdaLR from
`LlamaLM.configure_optimizers`, batches from `MarkovDataModule` in pinned memory), timed per step with CUDA events
from `on_train_batch_start` to `on_train_batch_end`:

  lightning eager                         the plain run (ratio base)
  lightning + CUDAGraphCapture            the whole step captured after 3 warm-up steps and replayed
  lightning + compile reduce-overhead     the decoder under torch.compile(mode="reduce-overhead") (CUDA graph trees
                                          for forward and backward; loss, optimizer and Lightning stay eager)
  lightning + compile + CUDAGraphCapture  the decoder under torch.compile (default mode), the whole step captured

With ``--hf mistral llama qwen2`` the suite runs Hugging Face ``transformers`` decoders instead:
a plain LightningModule around ``<Family>ForCausalLM`` (random init, default config options: ``use_cache=True``,
sdpa attention), hidden 512, 6 layers, 8 heads (4 KV heads), FFN 1408, vocab 32000, batch 4 x 128 tokens,
``bf16-mixed``, ``AdamW(fused=True)``, ``self.log("train/loss", loss)``; per family ``hf eager`` against
``hf + CUDAGraphCapture`` and ``hf eager use_cache=False`` (what a user gets by turning the cache off by hand;
preset name ``hf-<family>``), and ``hf-llama-item``: the same Llama with a ``loss.item()``
in ``training_step``, where the callback declines at its rehearsal, to measure what a declined callback costs
(goal: as fast as eager). ``loss_max_rel_diff`` compares every step's loss with the eager run's.

Anchors: a plain Lightning step of a 6-layer d=512 GPT and a hand-written whole-step CUDA graph of a similar GPT,
measured on the GPU machine (figures, machine and date in docs/cuda_graphs.md; ``ANCHOR_*`` below hold them for the
printed ratios). Goals (docs/cuda_graphs.md): a speed-up over `lightning eager`, and at least as fast as
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
# The anchors of docs/cuda_graphs.md: Lightning's eager step and a hand-written whole-step graph (d=512 GPT).
ANCHOR_PLAIN_LIGHTNING_MS = 6.79
ANCHOR_WHOLE_STEP_GRAPH_MS = 2.37
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


HF_FAMILIES = ("mistral", "llama", "qwen2")


def add_arguments(ap) -> None:
    ap.add_argument("--hf", nargs="+", default=None, choices=HF_FAMILIES,
                    help="run transformers decoders of these families instead of the demo presets")


def _hf_config(family: str):
    import transformers

    kw = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=512)
    cls = {"mistral": transformers.MistralConfig, "llama": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config}[family]
    return cls(**kw)


def _hf_module(family: str, item_in_step: bool = False, use_cache: bool = True):
    import lightning as L
    import transformers

    class HFDecoder(L.LightningModule):
        """What a user writes around a transformers decoder: no change for any lightning_gh part."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            name = {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
            self.model = getattr(transformers, name)(_hf_config(family))
            self.model.config.use_cache = use_cache

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            if item_in_step:
                self.seen = loss.item()  # a host sync: CUDAGraphCapture must decline and then cost nothing
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    return HFDecoder()


def _hf_run(ctx: BenchContext) -> list[Result]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class LossTrace(L.Callback):
        """Every step's loss, kept on the device (no sync during the timed steps)."""

        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach().float().clone())

    class Tokens(L.LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            n = (ctx.warmup + ctx.iters + 2) * 4
            return DataLoader(TensorDataset(torch.randint(0, 32000, (n, 128), generator=g)), batch_size=4,
                              pin_memory=ctx.cuda)

    results: list[Result] = []
    plan = [(f"hf-{f}", f, False) for f in ctx.args.hf]
    if "llama" in ctx.args.hf:
        plan.append(("hf-llama-item", "llama", True))
    for preset_name, family, item in plan:
        base_losses = None
        variants = [("hf eager", lambda: [], True), ("hf + CUDAGraphCapture", lambda: [CUDAGraphCapture()], True)]
        if not item:  # what a user can have without us: the same eager run with config.use_cache=False
            variants.append(("hf eager use_cache=False", lambda: [], False))
        for variant, callbacks, use_cache in variants:
            r = Result(ctx.suite, preset_name, variant, None, 4 * 128, 0.0)
            reset_memory(ctx.device)
            try:
                cbs, trace = callbacks(), LossTrace()
                r.timing, trainer = lightning_steps(_hf_module(family, item, use_cache), ctx,
                                                    callbacks=[*cbs, trace], datamodule=Tokens())
                r.peak_mem_bytes = peak_memory(ctx.device)
                losses = torch.stack(trace.losses).cpu()
                r.extra["loss_last"] = round(float(losses[-1]), 6)
                if base_losses is None:
                    base_losses = losses
                else:
                    rel = ((losses - base_losses).abs() / base_losses.abs()).max()
                    r.extra["loss_max_rel_diff"] = float(rel)
                    r.extra["loss_bitwise_equal"] = bool(torch.equal(losses, base_losses))
                for cb in cbs:
                    rep = cb.report
                    r.extra.update(graph_state=str(rep.state), graph_replayed=rep.replayed_steps,
                                   graph_eager=rep.eager_steps, graph_reason=rep.reason)
                del trainer  # free the model before the next variant
            except Exception as e:  # a failing variant is a result, not a crash of the suite
                r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc()
            results.append(r)
            reset_memory(ctx.device)
        rows = {r.variant: r for r in results if r.preset == preset_name}
        e, g = rows["hf eager"].median_ms, rows["hf + CUDAGraphCapture"].median_ms
        if e and g:
            gx = rows["hf + CUDAGraphCapture"].extra
            print(f"[graphs/{preset_name}] eager {e:.3f} ms, CUDAGraphCapture {g:.3f} ms: {e / g:.2f}x "
                  f"(state {gx.get('graph_state')}, loss max rel diff {gx.get('loss_max_rel_diff')}, "
                  f"bitwise {gx.get('loss_bitwise_equal')}; reason {gx.get('graph_reason')})", flush=True)
    return results


def run(ctx: BenchContext) -> list[Result]:
    if getattr(ctx.args, "hf", None):
        return _hf_run(ctx)
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
                        r.extra.update(graph_state=str(rep.state), graph_replayed=rep.replayed_steps,
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
          f"whole-step graph {ANCHOR_WHOLE_STEP_GRAPH_MS} ms (d=512 GPT, docs/cuda_graphs.md)")
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
