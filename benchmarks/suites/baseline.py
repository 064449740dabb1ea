"""Suite `baseline`: the reference model's training step, bf16 eager against bf16 `torch.compile`.

Variants per preset (fp32 weights, bf16 autocast, fused AdamW, random tokens already on the GPU):
  eager step          forward + backward + optimizer step
  compiled step       the same with the decoder under torch.compile (default mode)
  eager fwd+bwd       forward + backward only (what the activation anchors time)
  compiled fwd+bwd    the same, compiled
  lightning bf16-mixed  a full step inside an ordinary Lightning Trainer(precision="bf16-mixed"), eager
"""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

from common import BenchContext, Result, lightning_steps, peak_memory, random_batch, reset_memory, time_fn
from lightning_gh.demo import Llama, LlamaLM, preset

DEFAULT_PRESETS = ["small", "medium", "large"]


def _step_fn(cfg, device, compiled: bool, with_optimizer: bool):
    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda") if with_optimizer else None
    tokens, targets = random_batch(cfg, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = fwd(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    return step


def run(ctx: BenchContext) -> list[Result]:
    results = []
    for name in ctx.presets:
        cfg = preset(name)
        variants = [
            ("eager step", False, True),
            ("compiled step", True, True),
            ("eager fwd+bwd", False, False),
            ("compiled fwd+bwd", True, False),
        ]
        for variant, compiled, with_optimizer in variants:
            reset_memory(ctx.device)
            r = Result(ctx.suite, name, variant, None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
            try:
                step = _step_fn(cfg, ctx.device, compiled, with_optimizer)
                r.timing = time_fn(step, ctx.device, ctx.warmup, ctx.iters)
                r.peak_mem_bytes = peak_memory(ctx.device)
            except Exception as e:  # an OOM or compile failure is a result, not a crash of the suite
                r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                traceback.print_exc()
            results.append(r)
            step = None
            reset_memory(ctx.device)
        r = Result(ctx.suite, name, "lightning bf16-mixed", None, cfg.tokens_per_batch, cfg.train_flops_per_batch())
        try:
            torch.manual_seed(0)
            model = LlamaLM(cfg, lr=1e-4, warmup_steps=0)
            r.timing, _ = lightning_steps(model, ctx)
            r.peak_mem_bytes = peak_memory(ctx.device)
        except Exception as e:
            r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()
        results.append(r)
        model = None
        reset_memory(ctx.device)
    return results
