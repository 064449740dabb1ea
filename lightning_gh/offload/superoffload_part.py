"""The demo's SuperOffload part: train with ``strategy=SuperOffloadStrategy()`` when a CUDA GPU is in use.

Off the GPU the part stays off (the optimizer state already lives in host memory on a CPU run); it also
stays off, with the numbers, when the host cannot hold the offloaded state.

Example::

    >>> from pathlib import Path
    >>> from lightning_gh import hardware
    >>> from lightning_gh.demo.run import DemoConfig
    >>> from lightning_gh.offload.superoffload_part import superoffload_part
    >>> part = superoffload_part(DemoConfig(preset="tiny", out=Path("/tmp/x")), hardware.detect(), Path("/tmp/x"))
    >>> part.name
    'SuperOffload'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["superoffload_part"]


def superoffload_part(cfg: Any, hw: Any, out: Path) -> Any:
    """``(DemoConfig, HardwareInfo, run folder) -> Part`` for ``lightning_gh.demo.run.PARTS``."""
    from lightning_gh.demo.model import PRESETS
    from lightning_gh.demo.run import Part
    from lightning_gh.offload.strategy import SuperOffloadStrategy
    from lightning_gh.offload.superoffload_memory import HostMemoryPlan, available_host_bytes

    name = "SuperOffload"
    if not hw.cuda_available or cfg.accelerator not in ("auto", "gpu", "cuda"):
        return Part(name, False, "no CUDA GPU in use: on a CPU run the optimizer state is already in host memory")
    plan = HostMemoryPlan(PRESETS[cfg.preset].num_params(), speculative_backup=True,
                          available_bytes=available_host_bytes())
    if plan.available_bytes is not None and plan.needed_bytes > 0.9 * plan.available_bytes:
        return Part(name, False, f"host RAM too small: {plan.describe()}")
    return Part(name, True, "AdamW state in pinned host memory, CPU update overlapped with backward, auto GPU tail",
                trainer_kwargs={"strategy": SuperOffloadStrategy()})
