"""The demo's table of parts: for each lightning_gh part, whether ``make demo`` turns it on here, and with what.

Each factory looks at the demo's options, the machine and the run folder, and returns a :class:`Part`: the
callbacks, plugins and Trainer arguments it contributes, or the reason it stays off. The demo's own policy
(which profiling window, how much host RAM SuperOffload may take) lives here, not in the parts. Which parts
may run together comes from :mod:`lightning_gh.compat`, the same table every part consults at setup.

Example::

    >>> from pathlib import Path
    >>> from lightning_gh import hardware
    >>> from lightning_gh.demo.parts import PARTS, resolve_conflicts
    >>> from lightning_gh.demo.config import DemoConfig
    >>> cfg = DemoConfig(preset="tiny", out=Path("/tmp/lgh-doc"))
    >>> parts = resolve_conflicts([f(cfg, hardware.cpu_view(hardware.detect()), cfg.out) for f in PARTS])
    >>> [p.name for p in parts][:2]
    ['fp8 precision (fp8-auto)', 'SelectiveProfiler + DataStallDetector']
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from lightning_gh import compat, hardware
from lightning_gh.demo.config import DemoConfig
from lightning_gh.demo.model import PRESETS, Llama, preset

__all__ = ["Part", "PARTS", "resolve_conflicts"]

# SuperOffload stays off in the demo when its host state would take more than this share of MemAvailable.
_HOST_RAM_SHARE = 0.9


@dataclass
class Part:
    """What one lightning_gh part contributes to the demo run.

    Attributes:
        name: the title the demo prints.
        enabled: whether the part is on.
        reason: why it is on (what it does here) or off.
        callbacks, plugins, trainer_kwargs: what the Trainer gets when the part is on.
        parts: the :mod:`lightning_gh.compat` names of the parts this entry turns on (for the conflict check).
    """

    name: str
    enabled: bool
    reason: str = ""
    callbacks: list[Any] = field(default_factory=list)
    plugins: list[Any] = field(default_factory=list)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    parts: tuple[str, ...] = ()


def fp8_part(cfg: DemoConfig, hw: hardware.HardwareInfo, out: Path) -> Part:
    """``fp8-auto`` where the GPU and an installed backend allow, else why not."""
    from lightning_gh.precision import LayerFilter, precision
    from lightning_gh.precision.auto import choose_fp8
    from lightning_gh.precision.checks import ao_missing_reason, te_missing_reason

    title = "fp8 precision (fp8-auto)"
    why = hw.fp8_unsupported_reason()
    if why:
        return Part(title, False, why, parts=("fp8",))
    # The demo trains an uncompiled model on one device: the same rule fp8-auto applies at setup.
    choice = choose_fp8(False, "SingleDeviceStrategy", te_missing_reason(), ao_missing_reason())
    if choice.name is None:
        return Part(title, False, f"{choice.reason}; the GPU trains in bf16-mixed", parts=("fp8",))
    with torch.device("meta"):
        plan = LayerFilter().plan(Llama(preset(cfg.preset)))
    if not plan.converted:
        return Part(title, False, f"no layer of the '{cfg.preset}' preset is big enough to gain from fp8 "
                                  f"(all too small, first or head); the GPU trains in bf16-mixed", parts=("fp8",))
    return Part(title, True, f"fp8-auto will choose {choice.name}: {plan.summary(limit=2)}",
                plugins=[precision("fp8-auto")], trainer_kwargs={"precision": None}, parts=("fp8",))


def profiler_part(cfg: DemoConfig, hw: hardware.HardwareInfo, out: Path) -> Part:
    """A SelectiveProfiler window of three early steps plus the DataStallDetector.

    The window starts at step ``min(10, steps // 3)`` (after warm-up, away from validation);
    ``LGH_PROFILE_START_STOP`` overrides it. Output goes to ``out/profiles``.
    """
    from lightning_gh.profiling.profiler import ENV_VAR, SelectiveProfiler
    from lightning_gh.profiling.stall import DataStallDetector

    total = int(cfg.steps or 0)
    start = max(0, min(10, total // 3))
    stop = max(start, min(start + 2, total - 1))
    backends = ("torch", "memory") if hw.cuda_available else ("torch",)
    prof = SelectiveProfiler(steps=f"{start}-{stop}", ranks="0", backends=backends, output_dir=Path(out) / "profiles")
    window = os.environ.get(ENV_VAR) or f"{start}-{stop}"
    stall = DataStallDetector()
    return Part(
        name="SelectiveProfiler + DataStallDetector",
        enabled=True,
        reason=f"profiles optimizer steps {window} on rank 0 with {'+'.join(backends)} into {Path(out) / 'profiles'}; "
               f"warns when the loop waits for data more than {stall.threshold:.0%} of the time",
        callbacks=[prof, stall],
        parts=("SelectiveProfiler", "DataStallDetector"),
    )


def nvtx_part(cfg: DemoConfig, hw: hardware.HardwareInfo, out: Path) -> Part:
    """Phase and GC ranges on every step, in the ``lightning_gh`` domain.

    Always on: with no NVTX tool attached it costs nothing; under ``nsys profile --trace=cuda,nvtx`` the
    timeline shows each step's phases.
    """
    from lightning_gh.profiling._nvtx_backend import select_backend
    from lightning_gh.profiling.nvtx import NVTXRangeCallback

    name = "NVTX ranges"
    backend = select_backend("lightning_gh")
    if backend.name == "none":
        return Part(name, False, f"no NVTX backend ({backend.reason}); pip install nvtx", parts=("NVTXRangeCallback",))
    if backend.tool_attached and backend.name == "nvtx":
        reason = f"recording to the attached NVTX tool ({backend.reason})"
    elif backend.name == "torch":
        reason = backend.reason
    else:
        reason = (f"{backend.reason}: ranges cost nothing now; to see them run "
                  f"`nsys profile --trace=cuda,nvtx -o {out}/nvtx python -m lightning_gh demo ...`")
    return Part(name, True, reason, callbacks=[NVTXRangeCallback(gc_ranges=True)], parts=("NVTXRangeCallback",))


def graphs_part(cfg: DemoConfig, hw: hardware.HardwareInfo, out: Path) -> Part:
    """CUDAGraphCapture: on with a CUDA GPU, off (with the reason) without one."""
    from lightning_gh.graphs.capture import CUDAGraphCapture

    name = "CUDAGraphCapture"
    if not hw.cuda_available:
        return Part(name, False, "needs a CUDA GPU (the whole-step graph replays CUDA kernels)", parts=(name,))
    if cfg.accelerator == "cpu":
        return Part(name, False, "the demo runs on the CPU (--accelerator cpu)", parts=(name,))
    return Part(name, True, "whole training step captured after 3 warm-up steps and replayed",
                callbacks=[CUDAGraphCapture(warmup_steps=3)], parts=(name,))


def activation_offload_part(cfg: DemoConfig, hw: hardware.HardwareInfo, out: Path) -> Part:
    """``ActivationOffload(policy="auto")`` on a CUDA GPU; off (with the reason) elsewhere."""
    from lightning_gh.activation_offload import ActivationOffload

    name = "ActivationOffload"
    if not hw.cuda_available:
        return Part(name, False, "no CUDA GPU: saved activations stay on the device", parts=(name,))
    return Part(name, True, "policy='auto': offloads what the host link hides under compute",
                callbacks=[ActivationOffload(policy="auto")], parts=(name,))


def superoffload_part(cfg: DemoConfig, hw: hardware.HardwareInfo, out: Path) -> Part:
    """``strategy=SuperOffloadStrategy()`` when a CUDA GPU is in use and the host can hold the state.

    Off the GPU the part stays off (the optimizer state already lives in host memory on a CPU run); it also
    stays off, with the numbers, when the host cannot hold the offloaded state.
    """
    from lightning_gh.superoffload import HostMemoryPlan, SuperOffloadStrategy

    name = "SuperOffload"
    if not hw.cuda_available or cfg.accelerator not in ("auto", "gpu", "cuda"):
        return Part(name, False, "no CUDA GPU in use: on a CPU run the optimizer state is already in host memory",
                    parts=(name,))
    plan = HostMemoryPlan(PRESETS[cfg.preset].num_params(), speculative_backup=True,
                          available_bytes=hardware.available_host_bytes())
    if plan.available_bytes is not None and plan.needed_bytes > _HOST_RAM_SHARE * plan.available_bytes:
        return Part(name, False, f"host RAM too small: {plan.describe()}", parts=(name,))
    return Part(name, True, "AdamW state in pinned host memory, CPU update overlapped with backward, auto GPU tail",
                trainer_kwargs={"strategy": SuperOffloadStrategy()}, parts=(name,))


# Factories (config, hardware, run folder) -> Part, in the order they are applied; on a conflict the earlier stays on.
PARTS: list[Callable[[DemoConfig, hardware.HardwareInfo, Path], Part]] = [
    fp8_part,
    profiler_part,
    nvtx_part,
    graphs_part,
    activation_offload_part,
    superoffload_part,
]


def resolve_conflicts(parts: list[Part]) -> list[Part]:
    """Turn off every enabled part that :mod:`lightning_gh.compat` says cannot run with an earlier enabled one.

    Parts built by hand without ``parts`` are matched by their name.
    """
    on: list[Part] = []
    for p in parts:
        if not p.enabled:
            continue
        mine = p.parts or (p.name,)
        for earlier in on:
            clash = next(((a, b) for a in mine for b in (earlier.parts or (earlier.name,))
                          if a in compat.PARTS and b in compat.PARTS and not compat.verdict(a, b).combine), None)
            if clash is not None:
                rule = compat.verdict(*clash)
                p.enabled, p.reason = False, f"off because {earlier.name} is on: {rule.why}"
                break
        if p.enabled:
            on.append(p)
    return parts
