"""The main job: train the reference model with every lightning_gh part the hardware allows, and say what happened.

``python -m lightning_gh demo [--preset tiny|small|medium|large] [--steps N] [--out DIR]``

Each part registers a :class:`Part` factory in ``PARTS``; the factory looks at the machine and the
arguments and returns the callbacks / plugins it contributes, or why it stays off.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_gh import hardware
from lightning_gh.demo.data import MarkovDataModule
from lightning_gh.demo.model import PRESETS, LlamaLM
from lightning_gh.graphs.part import demo_part as _graphs_part
from lightning_gh.offload.callback import activation_offload_part as _offload_part
from lightning_gh.offload.superoffload_part import superoffload_part as _superoffload_part
from lightning_gh.precision.registry import demo_part as _fp8_part
from lightning_gh.profiling.nvtx import demo_part as _nvtx_part
from lightning_gh.profiling.profiler import demo_part as _profiler_part

__all__ = ["Part", "PARTS", "DemoConfig", "run_demo", "main"]

DEFAULT_STEPS = {"tiny": 300, "small": 200, "medium": 100, "large": 50}


@dataclass
class DemoConfig:
    preset: str = "tiny"
    steps: int | None = None
    out: Path | None = None
    accelerator: str = "auto"
    num_workers: int = 0
    seed: int = 0
    val_every: int = 100

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset={self.preset!r} is not known; choose one of {sorted(PRESETS)}.")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"--steps={self.steps!r} must be a positive number of optimizer steps.")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers={self.num_workers!r} must be >= 0.")
        self.steps = self.steps or DEFAULT_STEPS[self.preset]
        if self.out is None:
            self.out = Path("runs") / f"demo-{self.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out = Path(self.out)


@dataclass
class Part:
    """What one lightning_gh part contributes to the demo run."""

    name: str
    enabled: bool
    reason: str = ""
    callbacks: list[Any] = field(default_factory=list)
    plugins: list[Any] = field(default_factory=list)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


# Factories (config, hardware, run folder) -> Part, in the order they are applied. Each part of
# lightning_gh adds its own entry here when it lands.
PARTS: list[Callable[[DemoConfig, hardware.HardwareInfo, Path], Part]] = [
    _fp8_part,
    _profiler_part,
    _nvtx_part,
    _graphs_part,
    _offload_part,
    _superoffload_part,
]

# Parts that refuse to run together, each for the reason given (see their docs); the one earlier in
# PARTS stays on.
EXCLUSIVE: list[tuple[str, str, str]] = [
    ("fp8 precision (fp8-auto)", "CUDAGraphCapture", "CUDAGraphCapture does not capture the fp8 plugins yet"),
    ("CUDAGraphCapture", "ActivationOffload", "its host copies and events cannot run inside a captured CUDA graph"),
    ("CUDAGraphCapture", "SuperOffload", "its hooks, host copies and CPU worker cannot run inside a captured CUDA graph"),
    ("fp8 precision (fp8-auto)", "SuperOffload", "the fp8 plugins and the SuperOffload strategy are not tested together yet"),
]


def resolve_conflicts(parts: list[Part]) -> list[Part]:
    """Turn off the later part of every enabled pair in ``EXCLUSIVE``, saying why."""
    on = {p.name for p in parts if p.enabled}
    for first, second, why in EXCLUSIVE:
        if first in on and second in on:
            for p in parts:
                if p.name == second:
                    p.enabled, p.reason = False, f"off because {first} is on: {why}"
            on.discard(second)
    return parts


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
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
    plt.close(fig)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Train, write the run folder, and return the summary that was written to ``summary.json``."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    hw = hardware.detect()
    if cfg.accelerator == "gpu" and not hw.cuda_available:
        raise ValueError("--accelerator=gpu but no CUDA GPU is visible; use --accelerator auto or cpu.")
    use_cuda = hw.cuda_available and cfg.accelerator in ("auto", "gpu", "cuda")
    if not use_cuda:
        # The parts decide from `hw`: on a GPU machine told to train on the CPU they must see a CPU machine.
        hw = hardware.cpu_view(hw)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)

    parts = resolve_conflicts([factory(cfg, hw, out) for factory in PARTS])
    callbacks: list[Any] = [ModelCheckpoint(dirpath=out / "checkpoints", filename="step{step}", save_last=True,
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
        log_every_n_steps=5,
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
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _report(summary: dict[str, Any], out: Path) -> str:
    lines = [
        "",
        f"lightning_gh demo: trained the '{summary['preset']}' Llama-style model "
        f"({summary['parameters'] / 1e6:.2f}M parameters) for {summary['steps']} steps in {summary['wall_s']:.1f} s",
        f"  machine:   {summary['hardware']}",
        f"  precision: {summary['precision']}",
        f"  loss:      {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} "
        f"(validation {summary['val_loss_last'] if summary['val_loss_last'] is None else round(summary['val_loss_last'], 3)}; "
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
    torch.set_float32_matmul_precision("high")
    summary = run_demo(cfg)
    print(_report(summary, cfg.out))
    return 0
