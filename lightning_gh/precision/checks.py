"""Where each precision can run: backend availability, hardware gating and the checks the fp8 plugins run at setup.

Every refusal reads the same way: which name, which device, which capability, what to do instead. The machine is
probed only through :mod:`lightning_gh.hardware`; the Trainer only through :mod:`lightning_gh._lightning`.

Example::

    >>> from lightning_gh.precision.checks import list_precisions
    >>> list_precisions()["32-true"]
    'available'
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Callable

import torch
from torch import nn

from lightning_gh import _lightning, hardware
from lightning_gh.precision.names import FP8_NAMES, Fp8Name, canonical, precision_names

__all__ = [
    "AO_EXTRA", "FP8UnavailableError", "TE_EXTRA", "ao_missing_reason", "list_precisions", "recipe_unsupported_reason",
    "require_fp8_device", "te_missing_reason", "token_check_hook", "trainer_device", "unavailable_reason",
]

TE_EXTRA = "pip install 'lightning-gh[te]'"
AO_EXTRA = "pip install 'lightning-gh[ao]'"


class FP8UnavailableError(RuntimeError):
    """An fp8 precision was asked for where it cannot run (no CUDA device, compute capability < 8.9, ...)."""


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
    """Why Transformer Engine cannot be used here (naming the extra to install), or ``None``."""
    err = _import_error("transformer_engine.pytorch")
    return None if err is None else f"NVIDIA Transformer Engine is {err}: {TE_EXTRA}"


def ao_missing_reason() -> str | None:
    """Why torchao's float8 cannot be used here (naming the extra to install), or ``None``."""
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
    key = canonical(name)
    if key == "fp8-auto":
        return None  # always resolves: to an fp8 plugin, else to bf16-mixed with a warning
    if key not in FP8_NAMES and not key.startswith("transformer-engine"):
        return None
    hw = hardware.detect()
    reasons: list[str] = []
    hw_reason = hw.fp8_unsupported_reason()
    if hw_reason:
        reasons.append(hw_reason)
    spec = FP8_NAMES.get(key, Fp8Name("te", "delayed", ""))
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
# setup-time checks shared by the fp8 plugins


def trainer_device(module: nn.Module) -> torch.device:
    """The device the Trainer trains ``module`` on (its strategy's root device), else where CUDA would put it."""
    trainer = _lightning.trainer_of(module)
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
