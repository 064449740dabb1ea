"""How close MemoryReport's predicted peak comes to the measured one, on HF decoders in a plain LightningModule.

Each run builds a random-init ``transformers`` decoder, trains it a few steps with Lightning and ``MemoryReport``,
and prints one JSON line: the plan's predicted peak (before the first step, from the step traced on fake tensors),
the measured ``torch.cuda.max_memory_allocated`` of those steps, and the error in percent. Runs share the process;
each starts from an empty cache. Without CUDA it says so and exits 0.

    python benchmarks/memory_predict.py                      # the default configs and variants
    python benchmarks/memory_predict.py --configs llama-d2048 --variants bf16-mixed,bf16-mixed+ckpt --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch

from lightning_gh.memory import MemoryReport


@dataclass(frozen=True)
class Decoder:
    """An HF decoder config and the tokens of a step."""

    family: str  # "llama" or "qwen2"
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


CONFIGS = {
    "llama-d2048": Decoder("llama", 8, 2048, 5632, 16, 16, 32000, 4, 2048),
    "qwen2-d2048": Decoder("qwen2", 8, 2048, 5632, 16, 4, 32000, 4, 2048),
    "llama-d4096": Decoder("llama", 4, 4096, 11008, 32, 32, 32000, 4, 4096),
    "tiny": Decoder("llama", 2, 64, 128, 4, 2, 256, 2, 32),
}
#: variant -> (Lightning precision, HF gradient checkpointing)
VARIANTS = {"bf16-mixed": ("bf16-mixed", False), "bf16-mixed+ckpt": ("bf16-mixed", True),
            "bf16-true": ("bf16-true", False), "bf16-true+ckpt": ("bf16-true", True), "32-true": ("32-true", False)}
DEFAULT_RUNS = ["llama-d2048:bf16-mixed", "llama-d2048:bf16-mixed+ckpt", "llama-d2048:bf16-true",
                "qwen2-d2048:bf16-mixed"]


def hf_model(cfg: Decoder) -> torch.nn.Module:
    import transformers

    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[cfg.family]
    config = getattr(transformers, cls[0])(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(cfg.seq, 128), attn_implementation="sdpa", use_cache=False)
    return getattr(transformers, cls[1])(config)


class CausalLM(L.LightningModule):
    """A plain LightningModule around an HF causal LM that computes its own loss."""

    def __init__(self, cfg: Decoder, checkpointing: bool, steps: int) -> None:
        super().__init__()
        self.cfg, self.steps = cfg, steps
        self.model = hf_model(cfg)
        if checkpointing:
            self.model.gradient_checkpointing_enable()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        ids = torch.randint(0, self.cfg.vocab, (self.steps * self.cfg.batch, self.cfg.seq))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=self.cfg.batch)


def run_one(config: str, variant: str, *, steps: int = 3, device: str = "cuda", cfg: Decoder | None = None) -> dict:
    """Train ``steps`` steps of ``config`` in ``variant`` with MemoryReport; the plan's predicted and measured peaks."""
    cfg = cfg or CONFIGS[config]
    precision, ckpt = VARIANTS[variant]
    model = CausalLM(cfg, ckpt, steps)
    with tempfile.TemporaryDirectory() as folder:
        report = MemoryReport(folder=folder, measure_steps=steps)
        trainer = L.Trainer(accelerator=device, devices=1, precision=precision, max_steps=steps, logger=False,
                            callbacks=[report], enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(model)
    plan = report.plan
    assert plan is not None
    out = {"config": config, "variant": variant, **asdict(cfg), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "steps": steps,
           "predicted_peak": plan.predicted_peak, "measured_peak": plan.measured_peak,
           "measured_reserved": plan.measured_reserved,
           "error_pct": None if plan.peak_error() is None else round(100 * plan.peak_error(), 2),
           "parts": plan.predicted, "note": plan.prediction_note}
    del trainer, model, report
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=None, help=f"comma-separated, among {sorted(CONFIGS)}")
    p.add_argument("--variants", default=None, help=f"comma-separated, among {sorted(VARIANTS)}")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the prediction only (no measured peak); for the tests")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("memory_predict: no CUDA device; nothing measured (use --device cpu for the prediction alone)")
        return 0
    if args.configs or args.variants:
        runs = [f"{c}:{v}" for c in (args.configs or "llama-d2048").split(",")
                for v in (args.variants or "bf16-mixed").split(",")]
    else:
        runs = DEFAULT_RUNS
    for run in runs:
        config, variant = run.split(":")
        if config not in CONFIGS or variant not in VARIANTS:
            p.error(f"unknown run {run!r}: configs {sorted(CONFIGS)}, variants {sorted(VARIANTS)}")
        try:
            line = run_one(config, variant, steps=args.steps, device=args.device)
        except torch.cuda.OutOfMemoryError as e:
            line = {"config": config, "variant": variant, "error": f"OutOfMemoryError: {str(e)[:200]}"}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
