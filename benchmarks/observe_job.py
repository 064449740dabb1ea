"""What observing a run costs, and what a real trace of a small model says, on Hugging Face decoders.

The models users bring: ``transformers.LlamaForCausalLM`` (random init, SDPA attention) in a plain
``LightningModule`` that computes its own loss from the logits, ``torch.optim.AdamW(fused=True)``,
``Trainer(precision="bf16-mixed")``:

=======  ==========================================================================================================
model    shape
=======  ==========================================================================================================
small    hidden 256, 4 layers, FFN 688, 4 heads (2 KV heads), vocab 32000, 4 x 256 tokens: launch-bound on an H100
medium   hidden 2048, 8 layers, FFN 5632, 16 heads (4 KV heads), vocab 32000, 4 x 2048 tokens
=======  ==========================================================================================================

Variants, each a Lightning fit of ``--warmup`` + ``--iters`` steps, run in rounds (plain, profiler, memory, history,
then again) so that drift over the run hits every variant alike:

=========  ================================================================================================
variant    what runs beside the step
=========  ================================================================================================
plain      nothing: the base of the ratios
profiler   ``SelectiveProfiler(steps=--window)``, the window inside the warm-up: the timed steps are outside it
memory     ``MemoryReport()`` with default options (the plan and its prediction, the out-of-memory report armed)
history    ``MemoryReport(record_history=True)``: CUDA allocation history recorded on every step
sizes      ``MemoryReport(record_history=True, history_stacks=False)``: the history without Python stacks
=========  ================================================================================================

Timing: CUDA events at every batch start, the median period of the timed steps; per variant the median over the
rounds; ``overhead`` = variant / plain - 1. The profiler variant's window of the first round of ``--trace-model``
is kept: its Kineto trace (gzipped) and summary go to ``--out`` with the verdict, a real trace for the summary's
tests.

Usage (on the GPU machine)::

    python benchmarks/observe_job.py --out $OUT
    python benchmarks/observe_job.py --models small --rounds 2 --iters 30
    python benchmarks/observe_job.py --device cpu --smoke        # every code path on a tiny model, CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODELS = {
    "small": {"hidden": 256, "layers": 4, "ffn": 688, "heads": 4, "kv_heads": 2, "vocab": 32000, "batch": 4,
              "seq": 256},
    "medium": {"hidden": 2048, "layers": 8, "ffn": 5632, "heads": 16, "kv_heads": 4, "vocab": 32000, "batch": 4,
               "seq": 2048},
    "smoke": {"hidden": 32, "layers": 2, "ffn": 64, "heads": 2, "kv_heads": 1, "vocab": 128, "batch": 2, "seq": 16},
}
VARIANTS = ("plain", "profiler", "memory", "history", "sizes")


class OwnLossLM(L.LightningModule):
    """What users write: the HF model built in ``__init__``, the loss from the logits, their own fused AdamW."""

    def __init__(self, shape: dict[str, int]) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                          max_position_embeddings=shape["seq"], attn_implementation="sdpa", use_cache=False)
        self.model = LlamaForCausalLM(cfg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=next(self.parameters()).is_cuda or None)


class Periods(L.Callback):
    """A stamp at every batch start (a CUDA event on the GPU): the full period of each step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.stamps = warmup, []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.stamps.append(ev)
        else:
            self.stamps.append(time.perf_counter())

    def median_ms(self) -> float | None:
        s = self.stamps[self.warmup:]
        if len(s) < 2:
            return None
        if isinstance(s[0], torch.cuda.Event):
            torch.cuda.synchronize()
            return statistics.median(a.elapsed_time(b) for a, b in zip(s, s[1:]))
        return statistics.median((b - a) * 1e3 for a, b in zip(s, s[1:]))


def fit_once(model_name: str, variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One Lightning fit of ``variant`` on ``model_name``: the median period and what the callbacks wrote."""
    from lightning_gh.memory import MemoryReport
    from lightning_gh.profiling import SelectiveProfiler

    shape = MODELS[model_name]
    torch.manual_seed(0)
    model = OwnLossLM(shape)
    steps = args.warmup + args.iters
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, shape["vocab"], (steps * shape["batch"], shape["seq"]), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=shape["batch"],
                                         pin_memory=args.device == "cuda")
    periods = Periods(args.warmup)
    callbacks: list[Any] = [periods]
    if variant == "profiler":
        callbacks.append(SelectiveProfiler(steps=args.window, output_dir=work / "profiles"))
    elif variant == "memory":
        callbacks.append(MemoryReport(folder=str(work / "memory")))
    elif variant == "history":
        callbacks.append(MemoryReport(folder=str(work / "memory"), record_history=True))
    elif variant == "sizes":
        callbacks.append(MemoryReport(folder=str(work / "memory"), record_history=True, history_stacks=False))
    trainer = L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, max_steps=steps,
                        precision="bf16-mixed" if args.device == "cuda" else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(model, loader)
    row: dict[str, Any] = {"model": model_name, "variant": variant, "step_ms": periods.median_ms()}
    for cb in callbacks[1:]:
        for entry in getattr(cb, "written", []):
            row["files"] = dict(entry["files"])
    return row


def keep_trace(row: dict[str, Any], out: Path) -> dict[str, Any]:
    """Copy the window's trace (gzipped) and summary to ``out``; return the summary's verdict."""
    files = row.get("files") or {}
    trace, summary = files.get("torch"), files.get("summary_json")
    kept: dict[str, Any] = {}
    if trace and Path(trace).exists():
        dest = out / f"kineto_{row['model']}_hf.json.gz"
        opener = gzip.open if str(trace).endswith(".gz") else open
        with opener(trace, "rb") as src, gzip.open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst)
        kept["trace"] = dest.name
    if summary and Path(summary).exists():
        data = json.loads(Path(summary).read_text())
        (out / f"summary_{row['model']}_hf.json").write_text(json.dumps(data, indent=1))
        kept["verdict"] = data.get("verdict")
        kept["gpu_busy_share"] = (data.get("gpu") or {}).get("busy_share")
    return kept


def overheads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and variant: the median over the rounds and the overhead against plain's.

    >>> overheads([{"model": "m", "variant": "plain", "step_ms": 10.0}, {"model": "m", "variant": "memory",
    ...            "step_ms": 10.2}, {"model": "m", "variant": "plain", "step_ms": 10.0}])[1]["overhead_pct"]
    2.0
    """
    table: list[dict[str, Any]] = []
    def median_of(model: str, variant: str) -> tuple[list[float], float | None]:
        ms = [r["step_ms"] for r in rows if r["model"] == model and r["variant"] == variant and r["step_ms"]]
        return ms, statistics.median(ms) if ms else None

    for model in dict.fromkeys(r["model"] for r in rows):
        base = median_of(model, "plain")[1]
        for variant in dict.fromkeys(r["variant"] for r in rows if r["model"] == model):
            ms, med = median_of(model, variant)
            pct = round(100 * (med / base - 1), 2) if med and base else None
            table.append({"model": model, "variant": variant, "step_ms": med, "rounds": ms, "overhead_pct": pct})
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small", "medium"], choices=[m for m in MODELS if m != "smoke"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps (the profiler's window lies in them)")
    ap.add_argument("--iters", type=int, default=60, help="timed steps")
    ap.add_argument("--window", default="3-4", help="SelectiveProfiler's steps, inside the warm-up")
    ap.add_argument("--trace-model", default="small", help="the model whose first profiler window is kept")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 1 round, few steps (CPU check)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.rounds, args.warmup, args.iters, args.trace_model = ["smoke"], 1, 4, 3, "smoke"
        args.window = "1-2"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, kept = [], {}
    with tempfile.TemporaryDirectory(prefix="lgh-observe-") as tmp:
        for model_name in args.models:
            for rnd in range(args.rounds):
                for variant in args.variants:
                    work = Path(tmp) / f"{model_name}-{variant}-{rnd}"
                    try:
                        row = fit_once(model_name, variant, args, work)
                    except Exception as e:  # a failed variant is a row
                        row = {"model": model_name, "variant": variant, "step_ms": None,
                               "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    if variant == "profiler" and model_name == args.trace_model and not kept:
                        kept = keep_trace(row, out)
                    row.pop("files", None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    # every row as it finishes: a run stopped at its time limit keeps the rows it completed
                    (out / "observe_job.json").write_text(json.dumps({"rows": rows, "overheads": overheads(rows),
                                                                       "trace": kept}, indent=1))
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    summary = {"rows": rows, "overheads": overheads(rows), "trace": kept,
               "device": torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available()
               else "cpu"}
    (out / "observe_job.json").write_text(json.dumps(summary, indent=1))
    lines = ["| model | variant | step ms (median of rounds) | overhead vs plain | per round |",
             "| --- | --- | ---: | ---: | --- |"]
    for t in summary["overheads"]:
        ms = "" if t["step_ms"] is None else f"{t['step_ms']:.3f}"
        pct = "" if t["overhead_pct"] is None else f"{t['overhead_pct']:+.2f}%"
        lines.append(f"| {t['model']} | {t['variant']} | {ms} | {pct} | "
                     f"{', '.join(f'{x:.3f}' for x in t['rounds'])} |")
    lines.append(f"\ntrace of {args.trace_model}: {kept or 'none kept'}")
    print("\n".join(lines))
    (out / "observe_job.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
