"""One string selects any precision: the fp8 plugins of this package and Lightning's own strings.

``precision(name, **options)`` returns a ``lightning.pytorch.plugins.Precision`` for ``Trainer(plugins=[...])``.
This module only maps names to plugins: the names live in :mod:`~lightning_gh.precision.names`, availability and the
setup-time checks in :mod:`~lightning_gh.precision.checks`, the plugins in their own modules.

Example::

    >>> import lightning_gh as lgh
    >>> lgh.precision("bf16-mixed", device="cpu").precision
    'bf16-mixed'
    >>> trainer = L.Trainer(plugins=[lgh.precision("fp8-ao-tensorwise")])  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch
from lightning.pytorch.plugins import precision as pl_precision

from lightning_gh import hardware
from lightning_gh.precision import checks as _checks
from lightning_gh.precision import names as _names
from lightning_gh.precision.auto import TRIAL_OPTIONS, AutoFloat8Precision, check_auto_options, check_trial_options
from lightning_gh.precision.base import Float8PrecisionBase
from lightning_gh.precision.fabric import FabricCompatibleMixedPrecision
from lightning_gh.precision.layer_filter import LayerFilter

__all__ = ["precision"]


def _construct(_label: str, _cls: Callable[..., Any], *args: Any, _hidden: tuple[str, ...] = (), **options: Any) -> Any:
    """Call ``_cls(*args, **options)``, turning a wrong keyword into an error that lists the allowed ones."""
    params = dict(inspect.signature(_cls).parameters)
    if isinstance(_cls, type) and issubclass(_cls, Float8PrecisionBase):
        # the fp8 plugins take their Float8Options fields as **kwargs: name them
        params = {k: v for k, v in params.items() if v.kind is not inspect.Parameter.VAR_KEYWORD}
        params.update((k, inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY)) for k in _cls.option_names()
                      if k not in params)
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
        ValueError: an unknown name (the message lists the valid ones) or option, or a bad option value; options
            are checked before anything is chosen, so also where fp8 cannot run.
        ModuleNotFoundError: the backend package is not installed (the message names the extra to install).

    The hardware check runs at ``Trainer.fit`` setup, not here, so a configuration can be built on a machine
    without a GPU: there an fp8 plugin raises ``FP8UnavailableError`` naming the device and its capability.

    Example::

        trainer = L.Trainer(plugins=[lgh.precision("fp8-te-current", exclude=["*.wo"])])
    """
    key = _names.canonical(name)
    if key == "fp8-auto":
        return _auto(**options)
    if key in _names.FP8_NAMES:
        spec = _names.FP8_NAMES[key]
        fixed = sorted({"recipe", "name"} & set(options))
        if fixed:
            raise ValueError(f"precision({key!r}) does not take option(s) {fixed}: the name selects the recipe.")
        if spec.backend == "te":
            from lightning_gh.precision.te import TEFloat8Precision as cls
        else:
            from lightning_gh.precision.ao import TorchAOFloat8Precision as cls
        return _construct(key, cls, recipe=spec.recipe, name=key, _hidden=("recipe", "name", "options"), **options)
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
    missing = _checks.te_missing_reason()
    if missing:
        raise ModuleNotFoundError(f"precision {key!r} needs Transformer Engine. {missing}")
    dtype = torch.bfloat16 if key == "transformer-engine" else torch.float16
    options.setdefault("weights_dtype", dtype)
    return _construct(key, pl_precision.TransformerEnginePrecision, **options)


_FALLBACK_OPTIONS = ("device", "scaler")  # bf16-mixed's, for the fallback


def _auto(**options: Any):
    """fp8-auto: an ``AutoFloat8Precision`` that picks the recipe at setup, or bf16-mixed now when no fp8 can run."""
    # Validate first: a wrong option is an error on every machine, not only on one where fp8 runs.
    check_auto_options(options, extra=(*_FALLBACK_OPTIONS, *TRIAL_OPTIONS))
    check_trial_options(**{k: v for k, v in options.items() if k in TRIAL_OPTIONS})
    fp8_options = {k: v for k, v in options.items() if k not in _FALLBACK_OPTIONS}
    filter_fields = {k: v for k, v in fp8_options.items() if k not in ("layer_filter", *TRIAL_OPTIONS)}
    LayerFilter.from_options(fp8_options.get("layer_filter"), **filter_fields)
    why = hardware.detect().fp8_unsupported_reason()
    if why is None:
        te, ao = _checks.te_missing_reason(), _checks.ao_missing_reason()
        if te and ao:
            why = f"no fp8 backend is usable (Transformer Engine: {te}; torchao: {ao})"
    if why:
        warnings.warn(f"precision 'fp8-auto' falls back to bf16-mixed: {why}.", UserWarning, stacklevel=3)
        rest = {k: v for k, v in options.items() if k in _FALLBACK_OPTIONS}  # fp8-only options do not apply
        rest.setdefault("device", _default_device())
        return _construct("bf16-mixed", FabricCompatibleMixedPrecision, "bf16-mixed", **rest)
    return AutoFloat8Precision(**fp8_options)
