"""The demo's options: one frozen, validated dataclass that the command line builds and the table of parts reads.

Example::

    >>> from pathlib import Path
    >>> from lightning_gh.demo.config import DemoConfig
    >>> cfg = DemoConfig(preset="tiny", out=Path("/tmp/lgh-doc"))
    >>> cfg.steps
    300
    >>> DemoConfig(steps=0)
    Traceback (most recent call last):
    ...
    ValueError: --steps=0 must be a positive number of optimizer steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from lightning_gh.demo.model import PRESETS

__all__ = ["ACCELERATORS", "DEFAULT_STEPS", "DemoConfig"]

#: Optimizer steps per preset when ``steps`` is not given.
DEFAULT_STEPS: dict[str, int] = {"tiny": 300, "small": 200, "medium": 100, "large": 50}
#: Where the demo may train: ``"auto"`` (a CUDA GPU when there is one), ``"cpu"``, ``"gpu"`` (``"cuda"``).
ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "gpu", "cuda")


@dataclass(frozen=True)
class DemoConfig:
    """What ``python -m lightning_gh demo`` runs. Messages name the command-line flag of each field."""

    preset: str = "tiny"
    """The model size, a key of :data:`lightning_gh.demo.model.PRESETS`."""
    steps: int | None = None
    """Optimizer steps (``None``: :data:`DEFAULT_STEPS` of the preset)."""
    out: Path | None = None
    """The run folder, created if missing (``None``: ``runs/demo-<preset>-<time>``)."""
    accelerator: str = "auto"
    """One of :data:`ACCELERATORS`."""
    num_workers: int = 0
    """DataLoader workers."""
    seed: int = 0
    """The seed of the model, the data and the workers."""
    val_every: int = 100
    """Validate every this many optimizer steps (at most once per run shorter than that)."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset={self.preset!r} is not known; choose one of {sorted(PRESETS)}.")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps <= 0):
            raise ValueError(f"--steps={self.steps!r} must be a positive number of optimizer steps.")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"--accelerator={self.accelerator!r} is not known; choose one of {list(ACCELERATORS)}.")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers={self.num_workers!r} must be >= 0.")
        out = Path(self.out) if self.out is not None else \
            Path("runs") / f"demo-{self.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out={str(out)!r} is a file; give a folder for the run (it is created if missing).")
        # Frozen: the resolved defaults are written once, here.
        object.__setattr__(self, "steps", self.steps or DEFAULT_STEPS[self.preset])
        object.__setattr__(self, "out", out)

    @property
    def wants_gpu(self) -> bool:
        """The user asked for a GPU by name (``--accelerator gpu`` or ``cuda``), not just allowed one."""
        return self.accelerator in ("gpu", "cuda")
