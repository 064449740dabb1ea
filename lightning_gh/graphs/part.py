"""The demo's Part for CUDAGraphCapture: on with a CUDA GPU, off (with the reason) without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["demo_part"]


def demo_part(cfg: Any, hw: Any, out: Path) -> Any:
    """Part factory for ``lightning_gh.demo.run.PARTS``.

    Args:
        cfg: the demo's ``DemoConfig``.
        hw: ``lightning_gh.hardware.HardwareInfo`` of this machine.
        out: the run folder (unused: the report goes to the log).

    Example::

        from lightning_gh.demo.run import PARTS
        PARTS.append(demo_part)
    """
    from lightning_gh.demo.run import Part
    from lightning_gh.graphs.capture import CUDAGraphCapture

    name = "CUDAGraphCapture"
    if not hw.cuda_available:
        return Part(name, False, "needs a CUDA GPU (the whole-step graph replays CUDA kernels)")
    if getattr(cfg, "accelerator", "auto") == "cpu":
        return Part(name, False, "the demo runs on the CPU (--accelerator cpu)")
    return Part(name, True, "whole training step captured after 3 warm-up steps and replayed",
                callbacks=[CUDAGraphCapture(warmup_steps=3)])
