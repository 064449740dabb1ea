"""A short annotated fit of the demo model, to capture with Nsight Systems (see docs/nvtx.md).

``python -m lightning_gh.demo.nvtx_run --preset small --max-steps 40 --steps 20-24 --gc-ranges``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.demo.model import PRESETS
from lightning_gh.profiling.nvtx import NVTXRangeCallback

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Fit the demo model with :class:`NVTXRangeCallback` and say which NVTX backend recorded the ranges."""
    ap = argparse.ArgumentParser(prog="python -m lightning_gh.demo.nvtx_run", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--steps", default=None, help="optimizer steps to annotate, e.g. 10-14 (default: all)")
    ap.add_argument("--val-every", type=int, default=5, help="validate every N steps")
    ap.add_argument("--ckpt-every", type=int, default=15, help="save a checkpoint every N steps")
    ap.add_argument("--module-ranges", action="store_true")
    ap.add_argument("--gc-ranges", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="run folder for checkpoints (default: a temporary one)")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="lgh_nvtx_demo_"))
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = LlamaLM.from_preset(args.preset)
    dm = MarkovDataModule.for_model(model, pin_memory=cuda)
    cb = NVTXRangeCallback(steps=args.steps, module_ranges=args.module_ranges, gc_ranges=args.gc_ranges)
    ckpt = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=args.ckpt_every, save_top_k=1)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=args.max_steps,
                        precision="bf16-mixed" if cuda else "32-true", val_check_interval=args.val_every,
                        limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, callbacks=[cb, ckpt])
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    print(f"nvtx demo: {trainer.global_step} steps of '{args.preset}' in {time.perf_counter() - t0:.1f} s; "
          f"backend={cb.backend}; checkpoints in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
