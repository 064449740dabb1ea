"""The main job: train the reference model with every lightning_gh part the hardware allows, and say what happened.

``python -m lightning_gh demo [--preset tiny|small|medium|large] [--steps N] [--out DIR]``

The table of parts (what each contributes here, or why it stays off) is ``lightning_gh.demo.parts``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_gh import hardware
from lightning_gh.demo.config import DemoConfig
from lightning_gh.demo.data import MarkovDataModule
from lightning_gh.demo.model import PRESETS, LlamaLM
from lightning_gh.demo.parts import PARTS, resolve_conflicts

__all__ = ["DemoConfig", "accelerator_problem", "main", "run_demo"]


def accelerator_problem(cfg: DemoConfig, hw: hardware.HardwareInfo) -> str | None:
    """Why the demo cannot train where ``cfg`` asks on the machine ``hw`` describes, or ``None``.

    >>> from pathlib import Path
    >>> hw = hardware.cpu_view(hardware.detect())
    >>> accelerator_problem(DemoConfig(accelerator="gpu", out=Path("/tmp/x")), hw)
    '--accelerator=gpu but no CUDA GPU is visible; use --accelerator auto or cpu.'
    >>> accelerator_problem(DemoConfig(accelerator="auto", out=Path("/tmp/x")), hw) is None
    True
    """
    if cfg.wants_gpu and not hw.cuda_available:
        return f"--accelerator={cfg.accelerator} but no CUDA GPU is visible; use --accelerator auto or cpu."
    return None


def _read_metrics(log_dir: Path) -> list[dict[str, str]]:
    path = log_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    out = []
    for r in rows:
        v = r.get(key)
        if v not in (None, ""):
            out.append((int(r["step"]), float(v)))
    return out


def _plot_losses(train: list[tuple[int, float]], val: list[tuple[int, float]], entropy: float, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: the demo may run inside a user's session

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.axhline(entropy, color="gray", ls="--", lw=1, label=f"chain entropy ({entropy:.2f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Train, write the run folder, and return the summary that was written to ``summary.json``."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    hw = hardware.detect()
    problem = accelerator_problem(cfg, hw)
    if problem is not None:
        raise ValueError(problem)
    use_cuda = hw.cuda_available and cfg.accelerator in ("auto", "gpu", "cuda")
    if not use_cuda:
        # The parts decide from `hw`: on a GPU machine told to train on the CPU they must see a CPU machine.
        hw = hardware.cpu_view(hw)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)

    parts = resolve_conflicts([factory(cfg, hw, out) for factory in PARTS])
    # save_last="link": last.ckpt points at the newest stepN.ckpt instead of being a second copy of it.
    callbacks: list[Any] = [ModelCheckpoint(dirpath=out / "checkpoints", filename="step{step}", save_last="link",
                                            auto_insert_metric_name=False)]
    plugins: list[Any] = []
    trainer_kwargs: dict[str, Any] = {}
    for p in parts:
        if p.enabled:
            callbacks += p.callbacks
            plugins += p.plugins
            trainer_kwargs.update(p.trainer_kwargs)

    model = LlamaLM.from_preset(cfg.preset, lr=3e-3 if cfg.preset == "tiny" else 3e-4)
    dm = MarkovDataModule.for_model(model, num_workers=cfg.num_workers, pin_memory=use_cuda,
                                    persistent_workers=cfg.num_workers > 0)
    trainer_kwargs.setdefault("precision", "bf16-mixed" if use_cuda else "32-true")
    trainer = L.Trainer(
        accelerator="gpu" if use_cuda else "cpu",
        devices=1,
        max_steps=cfg.steps,
        val_check_interval=min(cfg.val_every, cfg.steps),
        limit_val_batches=4,
        check_val_every_n_epoch=None,
        log_every_n_steps=min(5, cfg.steps),
        logger=CSVLogger(out, name="", version="logs"),
        callbacks=callbacks,
        plugins=plugins or None,
        default_root_dir=out,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    wall = time.perf_counter() - t0

    rows = _read_metrics(out / "logs")
    train, val = _series(rows, "train/loss"), _series(rows, "val/loss")
    entropy = dm.corpus.entropy
    _plot_losses(train, val, entropy, out / "loss.png")
    first = train[0][1] if train else math.nan
    last = train[-1][1] if train else math.nan
    summary = {
        "preset": cfg.preset,
        "config": model.config.to_dict(),
        "parameters": model.config.num_params(),
        "steps": trainer.global_step,
        "wall_s": round(wall, 2),
        # An fp8 plugin reports "bf16-mixed" as trainer.precision (what runs outside its layers); name the recipe too.
        "precision": str(trainer.precision) + (f" ({name})" if (name := getattr(trainer.precision_plugin, "name", None))
                                               else ""),
        "hardware": hw.describe(),
        "loss_first": first,
        "loss_last": last,
        "val_loss_last": val[-1][1] if val else None,
        "entropy_floor": entropy,
        "parts": [{"name": p.name, "enabled": p.enabled, "reason": p.reason} for p in parts],
        "outputs": {
            "metrics": str(out / "logs" / "metrics.csv"),
            "loss_plot": str(out / "loss.png"),
            "checkpoint": str(out / "checkpoints" / "last.ckpt"),
        },
    }
    for i, md in enumerate(sorted(out.glob("profiles/**/*.summary.md"))):
        summary["outputs"][f"profile{i or ''}"] = str(md)
    # JSON has no NaN: a value that does not exist (no loss logged) is written as null.
    summary = _finite(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    return summary


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by ``None``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3f}"


def _report(summary: dict[str, Any], out: Path) -> str:
    lines = [
        "",
        f"lightning_gh demo: trained the '{summary['preset']}' Llama-style model "
        f"({summary['parameters'] / 1e6:.2f}M parameters) for {summary['steps']} steps in {summary['wall_s']:.1f} s",
        f"  machine:   {summary['hardware']}",
        f"  precision: {summary['precision']}",
        f"  loss:      {_fmt(summary['loss_first'])} -> {_fmt(summary['loss_last'])} "
        f"(validation {_fmt(summary['val_loss_last'])}; "
        f"the chain's entropy floor is {summary['entropy_floor']:.3f})",
        "  parts:",
    ]
    if not summary["parts"]:
        lines.append("    (no lightning_gh parts exist yet)")
    for p in summary["parts"]:
        state = "on " if p["enabled"] else "off"
        lines.append(f"    [{state}] {p['name']}" + (f": {p['reason']}" if p["reason"] else ""))
    lines += [f"  results in {out}/:"]
    lines += [f"    {k:<10} {v}" for k, v in summary["outputs"].items()]
    lines.append(f"    {'summary':<10} {out / 'summary.json'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line: parse, check, train, print the report. Returns the exit status (argument errors exit 2
    through argparse; a machine that cannot do what was asked prints one line and returns 1)."""
    ap = argparse.ArgumentParser(prog="python -m lightning_gh demo", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (default: tiny)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: depends on the preset)")
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: runs/demo-<preset>-<time>)")
    ap.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu"], help="where to train")
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        cfg = DemoConfig(preset=args.preset, steps=args.steps, out=args.out, accelerator=args.accelerator,
                         num_workers=args.num_workers, seed=args.seed)
    except ValueError as e:
        ap.error(str(e))
    problem = accelerator_problem(cfg, hardware.detect())
    if problem is not None:
        print(f"{ap.prog}: error: {problem}", file=sys.stderr)
        return 1
    torch.set_float32_matmul_precision("high")
    summary = run_demo(cfg)
    print(_report(summary, cfg.out))
    return 0
