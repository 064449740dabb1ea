"""``fp8-auto``'s setup-time trial: time each candidate recipe on this model's own GEMM shapes, on this GPU.

Which recipe is fastest depends on the GPU, the layer shapes and the backend releases installed, so instead of a
fixed table ``fp8-auto`` measures, once, at setup: for every distinct ``(in_features, out_features)`` the layer filter
would convert, one layer's forward + backward at ``tokens`` tokens, per candidate (bf16 as the yardstick), weighted
by how many layers have that shape. torchao layers are timed compiled (as the plugin runs them: regional
compilation or a compiled model); Transformer Engine layers under its autocast with the candidate's recipe. The sum
is the fp8 GEMM time of one step in milliseconds: the choice is the smallest; ties (within 2%) keep the rule's order.

Example::

    timings = measure_gemm_shapes(model, ["fp8-te-delayed", "fp8-ao-tensorwise"], torch.device("cuda"))
    # {"bf16": 31.2, "fp8-te-delayed": 19.8, "fp8-ao-tensorwise": 18.9}
"""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_gh import hardware
from lightning_gh.precision.layer_filter import LayerFilter
from lightning_gh.precision.names import FP8_NAMES

__all__ = ["gemm_shapes", "measure_gemm_shapes"]


def gemm_shapes(model: nn.Module, layer_filter: LayerFilter) -> Counter:
    """``{(in_features, out_features): count}`` of the layers the filter converts."""
    plan = layer_filter.plan(model)
    return Counter((d.in_features, d.out_features) for d in plan.decisions.values() if d.convert)




def _call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _layer_step(name: str, k: int, n: int, tokens: int, device: torch.device) -> Callable[[], Any]:
    """One layer's forward + backward for candidate ``name`` (or ``"bf16"``), on fresh bf16 inputs."""
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    spec = FP8_NAMES.get(name)
    if spec is None or spec.backend == "ao":
        lin = nn.Linear(k, n, bias=False, device=device)
    if name == "bf16":
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lin(x).sum().backward()
        return step
    if spec.backend == "ao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = convert_to_float8_training(nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(spec.recipe))
        # A function of the trial's own, not ``model.compile()``: that compiles ``nn.Module._call_impl``, the code
        # object regional compilation compiles the model's blocks through later, and would leave the trial's cache
        # entries there, and (shapes changing from one trial layer to the next) its automatic-dynamic marks, so the
        # blocks would be compiled for dynamic shapes. ``dynamic=False``: one static graph per shape, as training has.
        compiled = torch.compile(_call, dynamic=False)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                compiled(model, x).sum().backward()
        return step
    import transformer_engine.pytorch as te

    from lightning_gh.precision.te import make_recipe, te_autocast

    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
    recipe = make_recipe(spec.recipe)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16), te_autocast(recipe):
            out = layer(x)
        out.sum().backward()
    return step


def measure_gemm_shapes(model: nn.Module, candidates: list[str], device: torch.device,
                        layer_filter: LayerFilter | None = None, tokens: int = 8192) -> dict[str, float]:
    """Milliseconds of the converted layers' forward + backward per step, for bf16 and each candidate.

    Args:
        model: the model (before conversion).
        candidates: fp8 precision names to time (``"fp8-te-delayed"``, ``"fp8-ao-tensorwise"``, ...).
        device: the CUDA device the Trainer trains on.
        layer_filter: which layers are converted (the plugin's filter).
        tokens: tokens per step (batch x sequence) to time the GEMMs at.

    Returns:
        ``{"bf16": ms, candidate: ms, ...}``; a candidate that fails to run is left out.
    """
    shapes = gemm_shapes(model, layer_filter or LayerFilter())
    out: dict[str, float] = {}
    with torch.cuda.device(device), _te_global_buffers_restored():
        for name in ["bf16", *candidates]:
            try:
                out[name] = sum(count * hardware.median_cuda_ms(_layer_step(name, k, n, tokens, device),
                                                                repeats=10, warmup=3)
                                for (k, n), count in shapes.items())
            except Exception:  # a backend that cannot run here is not a candidate
                continue
    gc.collect()  # the trial's layers and inputs go now, not at some later collection during training
    torch.cuda.empty_cache()
    return out


@contextmanager
def _te_global_buffers_restored() -> Iterator[None]:
    """Drop what the trial's Transformer Engine layers add to TE's global DelayedScaling buffers.

    Every TE layer run under DelayedScaling appends its amax history and scale to process-wide lists, keyed by the
    recipe, which TE reduces and updates at every autocast exit from then on. The trial's recipe equals the one
    training uses, so without this the trial's dead layers would ride along in every training step's amax update
    (and stay alive with it). Appended entries are cut back off the end; a TE release without these buffers is left
    alone.
    """
    state = None
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        state = FP8GlobalStateManager.quantization_state
    except Exception:
        pass
    names = ("global_amax_buffer", "global_amax_history_buffer", "global_scale_buffer")
    before = {name: {key: len(v) for key, v in getattr(state, name, {}).items()} for name in names}
    try:
        yield
    finally:
        for name in names:
            buffers = getattr(state, name, None)
            if not isinstance(buffers, dict):
                continue
            for key in list(buffers):
                keep = before[name].get(key, 0)
                if keep:
                    del buffers[key][keep:]
                else:
                    del buffers[key]
