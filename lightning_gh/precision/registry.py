"""One string selects any precision: the fp8 plugins of this package and Lightning's own strings.

``precision(name, **options)`` returns a ``lightning.pytorch.plugins.Precision`` for ``Trainer(plugins=[...])``;
``list_precisions()`` says, for every name, ``"available"`` or why not on this machine. This module also owns the
hardware gate the fp8 plugins run at setup, so that every refusal reads the same way: which name, which device,
which capability, what to do instead.

Example::

    >>> import lightning_gh as lgh
    >>> lgh.precision("bf16-mixed", device="cpu").precision
    'bf16-mixed'
    >>> "fp8-te-delayed" in lgh.list_precisions()
    True
    >>> trainer = L.Trainer(plugins=[lgh.precision("fp8-ao-tensorwise")])  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_gh import hardware

__all__ = [
    "precision", "list_precisions", "precision_names", "unavailable_reason", "FP8UnavailableError",
    "TE_EXTRA", "AO_EXTRA", "export_bf16_state_dict",
]

TE_EXTRA = "pip install 'lightning-gh[te]'"
AO_EXTRA = "pip install 'lightning-gh[ao]'"


class FP8UnavailableError(RuntimeError):
    """An fp8 precision was asked for where it cannot run (no CUDA device, compute capability < 8.9, ...)."""


@dataclass(frozen=True)
class _Fp8Name:
    backend: str  # "te" or "ao"
    recipe: str
    summary: str


FP8_NAMES: dict[str, _Fp8Name] = {
    "fp8-te-delayed": _Fp8Name("te", "delayed", "Transformer Engine, per-tensor scales from an amax history"),
    "fp8-te-current": _Fp8Name("te", "current", "Transformer Engine, per-tensor scales from the current tensor"),
    "fp8-te-block": _Fp8Name("te", "block", "Transformer Engine, 1x128 / 128x128 block scales"),
    "fp8-te-mxfp8": _Fp8Name("te", "mxfp8", "Transformer Engine, MXFP8 32-element block scales (Blackwell)"),
    "fp4-te-nvfp4": _Fp8Name("te", "nvfp4", "Transformer Engine, NVFP4 (Blackwell)"),
    "fp8-ao-tensorwise": _Fp8Name("ao", "tensorwise", "torchao float8, per-tensor dynamic scales"),
    "fp8-ao-rowwise": _Fp8Name("ao", "rowwise", "torchao float8, per-row dynamic scales"),
    "fp8-ao-rowwise-gw-hp": _Fp8Name("ao", "rowwise_with_gw_hp",
                                     "torchao float8, per-row scales, weight gradient in bf16"),
}
# Lightning's own precision strings (and their aliases), passed through to Lightning's plugin classes.
LIGHTNING_NAMES = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true",
                   "transformer-engine", "transformer-engine-float16")
LIGHTNING_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def precision_names() -> list[str]:
    """Every name ``precision()`` accepts (aliases excluded)."""
    return [*FP8_NAMES, "fp8-auto", *LIGHTNING_NAMES]


# ----------------------------------------------------------------------------------------------------------
# availability


@functools.lru_cache(maxsize=None)
def _import_error(module: str) -> str | None:
    """``None`` when ``module`` imports, else a short reason. Cached: importing TE is slow and has side effects."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return "not installed"
    try:
        importlib.import_module(module)
    except Exception as e:  # a broken install (e.g. TE's cuDNN symbol mismatch) is "not usable", not a crash
        return f"installed but failed to import ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return None


def te_missing_reason() -> str | None:
    err = _import_error("transformer_engine.pytorch")
    return None if err is None else f"NVIDIA Transformer Engine is {err}: {TE_EXTRA}"


def ao_missing_reason() -> str | None:
    err = _import_error("torchao.float8")
    return None if err is None else f"torchao is {err}: {AO_EXTRA}"


def _cc(hw: hardware.HardwareInfo) -> str:
    return ".".join(map(str, hw.compute_capability or ()))


def recipe_unsupported_reason(backend: str, recipe: str, hw: hardware.HardwareInfo) -> str | None:
    """Why this GPU cannot run this recipe, beyond plain fp8 support (``None`` when it can)."""
    cc = hw.compute_capability or (0, 0)
    if backend == "te" and recipe in ("mxfp8", "nvfp4"):
        if cc < (10, 0):
            return (f"{recipe.upper()} needs a Blackwell GPU (compute capability >= 10.0); {hw.gpu_name} is "
                    f"{_cc(hw)}. On Hopper use fp8-te-current or fp8-te-block")
    if backend == "te" and recipe == "block":
        cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
        if cc < (9, 0) or cuda < (12, 9):
            return (f"fp8 block scaling needs compute capability >= 9.0 and CUDA >= 12.9; this is "
                    f"{hw.gpu_name} ({_cc(hw)}) with CUDA {torch.version.cuda}")
    if backend == "ao" and recipe.startswith("rowwise") and cc < (9, 0):
        return f"row-wise scaled fp8 GEMMs need compute capability >= 9.0 (Hopper); {hw.gpu_name} is {_cc(hw)}"
    return None


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot train on this machine (``None`` when it can). Reasons are joined with ``"; "``."""
    canonical = _canonical(name)
    hw = hardware.detect()
    reasons: list[str] = []
    if canonical == "fp8-auto":
        return None  # always resolves: to an fp8 plugin, else to bf16-mixed with a warning
    if canonical in FP8_NAMES or canonical.startswith("transformer-engine"):
        hw_reason = hw.fp8_unsupported_reason()
        if hw_reason:
            reasons.append(hw_reason)
        spec = FP8_NAMES.get(canonical, _Fp8Name("te", "delayed", ""))
        pkg = te_missing_reason() if spec.backend == "te" else ao_missing_reason()
        if pkg:
            reasons.append(pkg)
        if not hw_reason:
            rec = recipe_unsupported_reason(spec.backend, spec.recipe, hw)
            if rec:
                reasons.append(rec)
    return "; ".join(reasons) or None


def list_precisions() -> dict[str, str]:
    """Every precision name with ``"available"`` or the reason it cannot run on this machine.

    Example::

        >>> import lightning_gh as lgh
        >>> lgh.list_precisions()["32-true"]
        'available'
    """
    return {name: unavailable_reason(name) or "available" for name in precision_names()}


# ----------------------------------------------------------------------------------------------------------
# the registry


def _canonical(name: Any) -> str:
    if not isinstance(name, str):
        raise ValueError(f"precision name={name!r} must be a string; valid names: {', '.join(precision_names())}.")
    key = name.strip().lower()
    key = LIGHTNING_ALIASES.get(key, key)
    if key not in FP8_NAMES and key not in LIGHTNING_NAMES and key != "fp8-auto":
        raise ValueError(f"precision name={name!r} is not known; valid names: {', '.join(precision_names())} "
                         f"(aliases: {', '.join(LIGHTNING_ALIASES)}).")
    return key


def _construct(_label: str, _cls: Callable[..., Any], *args: Any, _hidden: tuple[str, ...] = (), **options: Any) -> Any:
    """Call ``_cls(*args, **options)``, turning a wrong keyword into an error that lists the allowed ones."""
    params = inspect.signature(_cls).parameters
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    allowed = [p for p, v in params.items() if v.kind is not inspect.Parameter.VAR_KEYWORD][len(args):]
    unknown = sorted(set(options) - set(allowed))
    allowed = [p for p in allowed if p not in _hidden]
    if unknown and not accepts_kwargs:
        raise ValueError(f"precision({_label!r}) does not take option(s) {unknown}; allowed: {allowed or 'none'}.")
    return _cls(*args, **options)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def precision(name: str, **options: Any):
    """The precision plugin that ``name`` selects, for ``Trainer(plugins=[...])``.

    Args:
        name: one of ``list_precisions()``: ``fp8-te-delayed``, ``fp8-te-current``, ``fp8-te-block``
            (Transformer Engine), ``fp8-ao-tensorwise``, ``fp8-ao-rowwise``, ``fp8-ao-rowwise-gw-hp`` (torchao),
            ``fp8-auto`` (the fastest available here, else ``bf16-mixed`` with a warning), or one of Lightning's
            strings (``bf16-mixed``, ``bf16-true``, ``16-mixed``, ``16-true``, ``32-true``, ``64-true``,
            ``transformer-engine``, ``transformer-engine-float16``) and their aliases (``bf16``, ``16``, ``32``,
            ``64``).
        **options: passed to the plugin: for fp8 names the layer filter fields (``include``, ``exclude``,
            ``skip_head``, ``skip_first``, ``min_dim``) or ``layer_filter=``, and the backend's own options
            (see ``TEFloat8Precision`` / ``TorchAOFloat8Precision``); for ``*-mixed``, ``device`` and ``scaler``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones) or option.
        ModuleNotFoundError: the backend package is not installed (the message names the extra to install).

    The hardware check runs at ``Trainer.fit`` setup, not here, so a configuration can be built on a machine
    without a GPU: there an fp8 plugin raises ``FP8UnavailableError`` naming the device and its capability.

    Example::

        trainer = L.Trainer(plugins=[lgh.precision("fp8-te-current", exclude=["*.wo"])])
    """
    key = _canonical(name)
    from lightning.pytorch.plugins import precision as pl_precision

    if key == "fp8-auto":
        return _auto(**options)
    if key in FP8_NAMES:
        spec = FP8_NAMES[key]
        fixed = sorted({"recipe", "name"} & set(options))
        if fixed:
            raise ValueError(f"precision({key!r}) does not take option(s) {fixed}: the name selects the recipe.")
        if spec.backend == "te":
            from lightning_gh.precision.te import TEFloat8Precision

            return _construct(key, TEFloat8Precision, recipe=spec.recipe, name=key, _hidden=("recipe", "name"),
                              **options)
        from lightning_gh.precision.ao import TorchAOFloat8Precision

        return _construct(key, TorchAOFloat8Precision, recipe=spec.recipe, name=key, _hidden=("recipe", "name"),
                          **options)
    if key in ("bf16-mixed", "16-mixed"):
        options.setdefault("device", _default_device())
        return _construct(key, pl_precision.MixedPrecision, key, **options)
    if key in ("bf16-true", "16-true"):
        return _construct(key, pl_precision.HalfPrecision, key, **options)
    if key == "32-true":
        return _construct(key, pl_precision.Precision, **options)
    if key == "64-true":
        return _construct(key, pl_precision.DoublePrecision, **options)
    # Lightning's own Transformer Engine plugin: bf16 (or fp16) weights, DelayedScaling, every Linear swapped.
    missing = te_missing_reason()
    if missing:
        raise ModuleNotFoundError(f"precision {key!r} needs Transformer Engine. {missing}")
    dtype = torch.bfloat16 if key == "transformer-engine" else torch.float16
    options.setdefault("weights_dtype", dtype)
    return _construct(key, pl_precision.TransformerEnginePrecision, **options)


def _auto(**options: Any):
    """fp8-auto: an ``AutoFloat8Precision`` that picks the recipe at setup, or bf16-mixed now when no fp8 can run."""
    why = hardware.detect().fp8_unsupported_reason()
    if why is None:
        te, ao = te_missing_reason(), ao_missing_reason()
        if te and ao:
            why = f"no fp8 backend is usable (Transformer Engine: {te}; torchao: {ao})"
    if why:
        warnings.warn(f"precision 'fp8-auto' falls back to bf16-mixed: {why}.", UserWarning, stacklevel=3)
        rest = {k: v for k, v in options.items() if k in ("device", "scaler")}  # fp8-only options do not apply
        return precision("bf16-mixed", **rest)
    from lightning_gh.precision.auto import AutoFloat8Precision

    return AutoFloat8Precision(**{k: v for k, v in options.items() if k not in ("device", "scaler")})


# ----------------------------------------------------------------------------------------------------------
# setup-time checks shared by the fp8 plugins


def trainer_device(module: nn.Module) -> torch.device:
    """The device the Trainer trains ``module`` on (its strategy's root device), else where CUDA would put it."""
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        return trainer.strategy.root_device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def require_fp8_device(name: str, device: torch.device, backend: str, recipe: str) -> None:
    """Raise ``FP8UnavailableError`` unless ``device`` runs fp8 ``recipe``, naming the device and its capability."""
    if device.type != "cuda":
        hw = hardware.detect()
        if hw.cuda_available:
            here = (f"this machine has {hw.gpu_name} (compute capability {_cc(hw)}) but the Trainer uses "
                    f"device '{device}'")
        else:
            here = f"this machine has no CUDA GPU; the Trainer uses device '{device}'"
        raise FP8UnavailableError(
            f"precision {name!r} needs an NVIDIA GPU with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper "
            f"or newer); {here}. Train with Trainer(accelerator='gpu') on such a GPU, or use 'bf16-mixed'.")
    hw = hardware.detect(device.index)
    reason = hw.fp8_unsupported_reason() or recipe_unsupported_reason(backend, recipe, hw)
    if reason:
        raise FP8UnavailableError(f"precision {name!r} cannot run on {device} ({hw.gpu_name}, compute capability "
                                  f"{_cc(hw)}): {reason}. Use 'bf16-mixed' on this GPU.")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) is wrapped by ``torch.compile``."""
    from torch._dynamo.eval_frame import OptimizedModule

    if getattr(module, "_compiler_ctx", None):  # Lightning unwraps a compiled LightningModule and keeps this
        return True
    return any(isinstance(m, OptimizedModule) for m in module.modules())


def warn_untested_callbacks(name: str, module: nn.Module) -> None:
    """Say so when a part that has not been tested with the fp8 plugins is in the same Trainer."""
    trainer = getattr(module, "_trainer", None)
    callbacks = getattr(trainer, "callbacks", None) or []
    if any(type(cb).__name__ == "CUDAGraphCapture" for cb in callbacks):
        warnings.warn(f"precision {name!r} with CUDAGraphCapture: the step is not captured under an fp8 plugin (the "
                      "combination is not verified yet), so it runs eagerly in fp8; drop CUDAGraphCapture to silence "
                      "this (see docs/precision.md).", UserWarning, stacklevel=3)


def token_check_hook(layer: str, backend: str) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook that turns fp8's tokens-multiple-of-16 GEMM constraint into a clear error.

    The token count (batch x sequence) is the reduction dimension of the weight-gradient GEMM, which fp8
    kernels need to be a multiple of 16; without this check a ragged last batch fails deep inside cuBLAS.
    """

    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] > 0:
            tokens = x.numel() // x.shape[-1]
            if tokens % 16:
                raise ValueError(
                    f"fp8 ({backend}) layer {layer!r} got {tokens} tokens (input shape {tuple(x.shape)}); fp8 GEMMs "
                    "need the token count (batch x sequence) to be a multiple of 16. Pad the batch or use "
                    "DataLoader(drop_last=True).")

    return hook


# ----------------------------------------------------------------------------------------------------------
# checkpoints


def export_bf16_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                           device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Plain weights of a model trained with any fp8 plugin, for the unconverted model (inference, export).

    Floating-point tensors are cast to ``dtype`` (bf16 by default), torchao's float8 weight wrappers are
    unwrapped, FSDP2 shards are gathered (call it on every rank then), Transformer Engine's ``_extra_state`` is
    dropped and ``torch.compile`` wrapper segments are removed from the keys. The result loads with
    ``strict=True`` into the same model class built without any precision plugin. Tensors are copies (on
    ``device`` when given), never views of the training parameters.

    Example::

        >>> from lightning_gh.demo import LlamaLM
        >>> from lightning_gh.precision import export_bf16_state_dict
        >>> sd = export_bf16_state_dict(LlamaLM.from_preset("tiny").model)
        >>> sd["head.weight"].dtype
        torch.bfloat16
    """
    from lightning_gh.precision.layer_filter import clean_name

    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        if hasattr(value, "full_tensor"):  # DTensor (FSDP2): gather the shards
            value = value.full_tensor()
        inner = getattr(value, "_tensor", None)  # torchao WeightWithDynamicFloat8CastTensor
        if isinstance(inner, torch.Tensor):
            value = inner
        value = value.detach()
        target = dtype if value.is_floating_point() else value.dtype
        out[clean_name(key)] = value.to(device=device or value.device, dtype=target, copy=True)
    return out


# ----------------------------------------------------------------------------------------------------------
# the demo job's part


def demo_part(cfg: Any, hw: hardware.HardwareInfo, out: Any) -> Any:
    """``make demo``'s fp8 part: ``fp8-auto`` where the GPU and an installed backend allow, else why not.

    Registered in ``lightning_gh.demo.run.PARTS``; signature ``(DemoConfig, HardwareInfo, Path) -> Part``.
    """
    from lightning_gh.demo.model import Llama, preset
    from lightning_gh.demo.run import Part
    from lightning_gh.precision.auto import choose_fp8
    from lightning_gh.precision.layer_filter import LayerFilter

    title = "fp8 precision (fp8-auto)"
    why = hw.fp8_unsupported_reason()
    if why:
        return Part(title, False, why)
    # The demo trains an uncompiled model on one device: the same rule fp8-auto applies at setup.
    choice = choose_fp8(False, "SingleDeviceStrategy", te_missing_reason(), ao_missing_reason())
    if choice.name is None:
        return Part(title, False, f"{choice.reason}; the GPU trains in bf16-mixed")
    with torch.device("meta"):
        plan = LayerFilter().plan(Llama(preset(cfg.preset)))
    if not plan.converted:
        return Part(title, False, f"no layer of the '{cfg.preset}' preset is big enough to gain from fp8 "
                                  f"(all too small, first or head); the GPU trains in bf16-mixed")
    plugin = precision("fp8-auto")
    return Part(title, True, f"fp8-auto will choose {choice.name}: {plan.summary(limit=2)}", plugins=[plugin],
                trainer_kwargs={"precision": None})
