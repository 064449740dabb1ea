"""Compile the transformer blocks only where it pays: a short measured trial over the first training steps.

Compiling each block in place (``regional``) fuses the norms, rotary embeddings and activations between the
Transformer Engine GEMMs, but the TE layers stay eager inside, so every block is cut into pieces by a graph break
around each TE layer. Whether the fusion outweighs the breaks depends on the model: a large HF Llama gains, the demo
``medium`` model loses (figures in ``docs/precision.md``). So ``compile_blocks="auto"`` (the TE plugins' default)
measures: it times a few steps with the blocks
eager, compiles them, times a few more once the compile is done, and keeps whichever ran faster, logging the
figures in one line. The blocks are compiled in place (``nn.Module.compile``), so undoing it is dropping the
compiled call; the weights, the optimizer and the state-dict keys are the same either way.

Example::

    trial = BlockCompileTrial(compile_fn=lambda: compile_regions(model, is_fp8), blocks_fn=compiled_modules)
    for step in range(...):
        train_one_step()
        trial.step()            # after each optimizer step; decides at the 16th step with the defaults
    trial.decision              # "compiled" or "eager" (None while measuring)
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

__all__ = ["BlockCompileTrial", "cuda_clock", "uncompile"]


def cuda_clock() -> float:
    """Seconds, after the GPU has finished the work queued so far (so a step period is the GPU's time too)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def uncompile(modules: list[nn.Module]) -> None:
    """Undo ``nn.Module.compile()`` on ``modules``: they run their eager ``forward`` again."""
    for m in modules:
        m._compiled_call_impl = None


class BlockCompileTrial:
    """Time ``steps`` eager steps, compile, time ``steps`` compiled steps, keep the faster.

    Args:
        compile_fn: compiles the blocks in place and returns what it did, in words ("" when it compiled nothing).
        blocks_fn: the modules ``compile_fn`` compiled (called after it), for undoing.
        warmup: steps before each measurement (the first eager steps; the compile itself and the steps after it).
        steps: step periods measured per side (their median is compared).
        margin: the compiled blocks are kept only if at least this much faster (relative).
        clock: seconds now, after the GPU's queued work (default :func:`cuda_clock`).
        agree: makes every process take the same decision (e.g. rank 0's, broadcast); identity by default.
        log: where the one-line decision goes.
        name: the plugin's name, for the log line.
    """

    def __init__(self, compile_fn: Callable[[], str], blocks_fn: Callable[[], list[nn.Module]], *, warmup: int = 3,
                 steps: int = 5, margin: float = 0.02, clock: Callable[[], float] = cuda_clock,
                 agree: Callable[[bool], bool] | None = None, log: Callable[[str], None] = print,
                 name: str = "fp8") -> None:
        if warmup < 1 or steps < 1:
            raise ValueError(f"BlockCompileTrial(warmup={warmup}, steps={steps}): both must be >= 1.")
        self.compile_fn, self.blocks_fn = compile_fn, blocks_fn
        self.warmup, self.steps, self.margin = warmup, steps, margin
        self.clock, self.agree, self.log, self.name = clock, agree or (lambda x: x), log, name
        self.decision: str | None = None
        self.eager_ms: float | None = None
        self.compiled_ms: float | None = None
        self._n = 0  # optimizer steps seen in the current phase
        self._phase = "eager"
        self._marks: list[float] = []
        self._compiled: list[nn.Module] = []
        self._what = ""

    @property
    def done(self) -> bool:
        return self.decision is not None

    @property
    def phase(self) -> str:
        """``"eager"`` while the eager steps are timed, ``"compiled"`` once the blocks are compiled and timed."""
        return self._phase

    def step(self) -> None:
        """Call once after every optimizer step."""
        if self.done:
            return
        self._n += 1
        if self._n < self.warmup:
            return
        self._marks.append(self.clock())
        if len(self._marks) <= self.steps:
            return
        periods = [(b - a) * 1e3 for a, b in zip(self._marks, self._marks[1:])]
        median = statistics.median(periods)
        if self._phase == "eager":
            self.eager_ms = median
            self._what = self.compile_fn()
            self._compiled = list(self.blocks_fn())
            if not self._compiled:  # nothing to compile here: nothing to decide
                self.decision = "eager"
                return
            self._phase, self._n, self._marks = "compiled", 0, []
            return
        self.compiled_ms = median
        keep = self.agree(self.compiled_ms < self.eager_ms * (1.0 - self.margin))
        self.decision = "compiled" if keep else "eager"
        if not keep:
            uncompile(self._compiled)
        verdict = "kept them compiled" if keep else "left them eager"
        self.log(f"{self.name}: compile_blocks='auto': {self.compiled_ms:.1f} ms/step with the blocks compiled "
                 f"({self._what}) against {self.eager_ms:.1f} eager, medians of {self.steps} steps; {verdict}.")
