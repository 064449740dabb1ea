"""Throughput and model FLOPs utilisation in the logger: ``lgh/tokens_per_s``, ``lgh/model_tflops``, ``lgh/mfu``.

The model's FLOPs per trained token are ``6 x N`` (``N`` the trainable parameters: 2 FLOPs per parameter per token
in the forward, 4 in the backward), the usual dense-transformer estimate; attention's own FLOPs
(``12 x layers x hidden x sequence`` per token) are not in it, so MFU reads a little low at long sequences. Pass
``flops_per_token`` to count them (or anything else) yourself. Then, over a window of optimizer steps:

* ``lgh/tokens_per_s``: tokens trained per second by all ranks (this rank's tokens x ``world_size``; the tokens of a
  micro-batch are the elements of its first integer tensor, the token ids);
* ``lgh/model_tflops``: ``flops_per_token x tokens / seconds`` per GPU, in TFLOP/s;
* ``lgh/mfu``: ``lgh/model_tflops`` over the GPU's dense peak for the precision in use (logged only when the peak
  is known: a GPU in :data:`DENSE_PEAK_TFLOPS`, or ``peak_tflops`` given).

The peak is the datasheet's *dense* tensor-core peak (no sparsity) of the GPU and the matmul precision: bf16/fp16
for ``"bf16-*"`` / ``"16-*"`` precisions, tf32 or fp32 for ``"32-true"`` (by ``torch.get_float32_matmul_precision``).
Where fp8 layers run (torchao's ``Float8Linear``, Transformer Engine modules), their share of the parameters runs at
the fp8 peak and the rest at the bf16 peak: the effective peak is ``1 / (s / fp8 + (1 - s) / bf16)``
(:func:`effective_peak`), so MFU stays below 1 for fp8 runs. A measured matmul peak can replace the table
(``peak_tflops``).

Time is host time between the ends of optimizer steps, with no GPU synchronisation: over a window of several steps
the host is held back by the GPU's queue, so the window measures the GPU's pace. The first ``warmup_steps`` steps of
a fit are not counted.

Example::

    >>> from lightning_gh.profiling.throughput import effective_peak, mfu, peak_tflops
    >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), peak_tflops("NVIDIA H100 PCIe", "fp8")
    (989.0, 1513.0)
    >>> round(effective_peak("NVIDIA H200", "bf16", fp8_share=0.5), 1)
    1318.9
    >>> round(mfu(tokens_per_s_per_gpu=10_000, flops_per_token=6 * 7e9, peak=989.0), 3)
    0.425
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_gh._lightning import log_to_loggers
from lightning_gh._options import resolve
from lightning_gh._util import count_tokens

__all__ = ["DENSE_PEAK_TFLOPS", "ThroughputMonitor", "ThroughputOptions", "effective_peak", "fp8_share",
           "matmul_dtype", "mfu", "peak_tflops"]

#: Datasheet dense (no sparsity) tensor-core peaks in TFLOP/s, by GPU form factor and matmul precision. GH200 and
#: H200 SXM share the H100 SXM's compute; the NVL parts run at a lower power limit.
DENSE_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
}

# The wall clock of the window measurements (tests replace it with a fake one).
_clock: Callable[[], float] = time.perf_counter


def gpu_model(device_name: str) -> str | None:
    """The :data:`DENSE_PEAK_TFLOPS` row of a ``torch.cuda.get_device_name()``, or ``None`` for another GPU.

    >>> gpu_model("NVIDIA GH200 480GB"), gpu_model("NVIDIA H100 NVL"), gpu_model("NVIDIA A100-SXM4-80GB")
    ('GH200', 'H100 NVL', None)
    """
    name = device_name.upper()
    if "GH200" in name:
        return "GH200"
    for chip in ("H200", "H100"):
        if chip in name:
            if "NVL" in name:
                return f"{chip} NVL"
            return f"{chip} PCIe" if "PCIE" in name else f"{chip} SXM"
    return None


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak of ``device_name`` for matmuls in ``dtype`` (``"fp8"``, ``"bf16"``, ``"fp16"``, ``"tf32"``,
    ``"fp32"``), or ``None`` for a GPU not in :data:`DENSE_PEAK_TFLOPS`."""
    row = gpu_model(device_name)
    return None if row is None else DENSE_PEAK_TFLOPS[row][dtype]


def matmul_dtype(precision: str, float32_matmul_precision: str = "highest") -> str:
    """The tensor-core precision of a Lightning precision string's matmuls.

    >>> matmul_dtype("bf16-mixed"), matmul_dtype("16-mixed"), matmul_dtype("32-true", "high")
    ('bf16', 'fp16', 'tf32')
    """
    p = str(precision)
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16") or p.startswith("fp16"):
        return "fp16"
    if p.startswith("transformer-engine"):
        return "bf16"  # outside the fp8 layers
    return "fp32" if float32_matmul_precision == "highest" else "tf32"


def effective_peak(device_name: str, dtype: str, fp8_share: float = 0.0) -> float | None:
    """The peak of a step whose ``fp8_share`` of the FLOPs runs in fp8 and the rest in ``dtype``: the time-weighted
    (harmonic) mean ``1 / (s / peak_fp8 + (1 - s) / peak_dtype)``."""
    base = peak_tflops(device_name, dtype)
    if base is None:
        return None
    if fp8_share <= 0:
        return base
    fp8 = DENSE_PEAK_TFLOPS[gpu_model(device_name) or ""]["fp8"]
    return 1.0 / (fp8_share / fp8 + (1.0 - fp8_share) / base)


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model TFLOP/s per GPU over ``peak`` (TFLOP/s)."""
    return tokens_per_s_per_gpu * flops_per_token / 1e12 / peak


def _is_fp8_layer(module: torch.nn.Module) -> bool:
    cls = type(module)
    return "Float8" in cls.__name__ or (cls.__module__.startswith("transformer_engine")
                                        and cls.__name__ in ("Linear", "LayerNormLinear", "LayerNormMLP",
                                                             "GroupedLinear"))


def fp8_share(model: torch.nn.Module) -> float:
    """The share of the trainable parameters that sit in fp8 layers (torchao ``Float8Linear``, Transformer Engine
    linear modules): their matmuls run in fp8."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if total == 0:
        return 0.0
    seen: set[int] = set()
    in_fp8 = 0
    for module in model.modules():
        if _is_fp8_layer(module):
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    in_fp8 += p.numel()
    return in_fp8 / total


def _positive_or_none(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"ThroughputMonitor({name}={value!r}): expected a number > 0 or None.")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"ThroughputMonitor({name}={value!r}): expected a number > 0 or None.")


@dataclass(frozen=True)
class ThroughputOptions:
    """The options of :class:`ThroughputMonitor`."""

    window: int = 10
    """Optimizer steps per measurement; the metrics are logged once per window (>= 1)."""

    warmup_steps: int = 2
    """Optimizer steps of each fit not counted (compilation, allocator warm-up), >= 0."""

    flops_per_token: float | None = None
    """Model FLOPs per trained token; ``None``: ``6 x`` the trainable parameters (see the module docs)."""

    peak_tflops: float | None = None
    """The peak to divide by for ``lgh/mfu``, in TFLOP/s per GPU (e.g. a measured matmul peak); ``None``: the
    datasheet dense peak of the GPU for the precision in use, fp8 layers counted (:func:`effective_peak`)."""

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"ThroughputMonitor({name}={value!r}): expected an int >= {low} (optimizer steps).")
            if value < low:
                raise ValueError(f"ThroughputMonitor({name}={value!r}): expected an int >= {low} (optimizer steps).")
        _positive_or_none("flops_per_token", self.flops_per_token)
        _positive_or_none("peak_tflops", self.peak_tflops)


class ThroughputMonitor(Callback):
    """Log ``lgh/tokens_per_s``, ``lgh/model_tflops`` and ``lgh/mfu`` once per window of optimizer steps.

    Args:
        window, warmup_steps, flops_per_token, peak_tflops: the options, each documented once in
            :class:`ThroughputOptions` (defaults there too).
        options: the same options as one :class:`ThroughputOptions`, instead of the keywords (never both).

    Attributes:
        options: the :class:`ThroughputOptions` in force.
        last: the metrics of the last window (empty before the first).
        peak: the peak ``lgh/mfu`` divides by (TFLOP/s per GPU), or ``None`` when unknown (no ``lgh/mfu`` then).

    Example::

        trainer = L.Trainer(precision="bf16-mixed", callbacks=[ThroughputMonitor(window=20)])
    """

    lgh_part = "ThroughputMonitor"

    def __init__(self, window: int = ThroughputOptions.window, warmup_steps: int = ThroughputOptions.warmup_steps,
                 flops_per_token: float | None = ThroughputOptions.flops_per_token,
                 peak_tflops: float | None = ThroughputOptions.peak_tflops, *,
                 options: ThroughputOptions | None = None) -> None:
        self.options = resolve(ThroughputOptions, options, "ThroughputMonitor", window=window,
                               warmup_steps=warmup_steps, flops_per_token=flops_per_token, peak_tflops=peak_tflops)
        self.last: dict[str, float] = {}
        self.peak: float | None = None
        self._flops_per_token = 0.0
        self._t0: float | None = None
        self._tokens = 0
        self._steps = 0
        self._seen_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        o = self.options
        params = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        self._flops_per_token = o.flops_per_token if o.flops_per_token is not None else 6.0 * params
        self.peak = o.peak_tflops
        if self.peak is None and torch.cuda.is_available() and pl_module.device.type == "cuda":
            dtype = matmul_dtype(str(trainer.precision), torch.get_float32_matmul_precision())
            self.peak = effective_peak(torch.cuda.get_device_name(pl_module.device), dtype, fp8_share(pl_module))
        self._t0, self._tokens, self._steps, self._seen_step = None, 0, 0, trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._t0 is not None:
            self._tokens += count_tokens(batch) or 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # accumulating: the optimizer step is not over
            return
        self._seen_step = step
        now = _clock()
        if self._t0 is None:
            if step >= self.options.warmup_steps:  # the window starts at the end of the last warm-up step
                self._t0 = now
            return
        self._steps += 1
        if self._steps < self.options.window:
            return
        self.last = self._metrics(now - self._t0, self._tokens, trainer.world_size)
        log_to_loggers(trainer, self.last)
        self._t0, self._tokens, self._steps = now, 0, 0

    def _metrics(self, seconds: float, tokens: int, world_size: int) -> dict[str, float]:
        if seconds <= 0 or tokens <= 0:
            return {}
        per_gpu = tokens / seconds
        out = {"lgh/tokens_per_s": per_gpu * world_size,
               "lgh/model_tflops": per_gpu * self._flops_per_token / 1e12}
        if self.peak:
            out["lgh/mfu"] = mfu(per_gpu, self._flops_per_token, self.peak)
        return out
