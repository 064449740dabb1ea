"""``fp8-auto``: the fp8 recipe that measured fastest for *this* run, chosen at setup.

Which fp8 backend is fastest depends on things the Trainer only knows once the model is set up: whether the model
is compiled, and which strategy shards it. The table below is the rule measured on full Lightning steps (fused AdamW,
fp32 master weights, the default layer filter; the figures are in ``docs/precision.md``):

=====================  ===============================  =============================================
model                  fastest                          why not the other
=====================  ===============================  =============================================
compiled               ``fp8-ao-tensorwise``            Transformer Engine layers break the graph
not compiled           ``fp8-te-delayed``               on a par once both compile their blocks
=====================  ===============================  =============================================

On a large eager HF Llama both plugins compile the transformer blocks in place and land within the step-to-step
spread of each other, so the table keeps Transformer Engine for eager models and the setup trial breaks the tie on
the GPU at hand.

A model that is not compiled gets its blocks compiled in place when torchao is picked (regional compilation, see
``regional``), which is what makes torchao fp8 faster than ``bf16-mixed`` on such a model.

When more than one recipe can run on an uncompiled model (Transformer Engine and torchao both usable, one GPU or
DDP), ``fp8-auto`` does not trust the table: at setup it times each candidate on this model's own GEMM shapes on
this GPU (:mod:`lightning_gh.precision.trial`, ``trial=True``, the default) and picks the fastest, logging the
figures. A compiled model gets ``fp8-ao-tensorwise`` whenever torchao is usable, without a trial: timing one layer at
a time cannot see what decides there (Transformer Engine breaks the graph at every layer; torchao's casts fuse into
it), and on the ``medium`` preset it ranked them the wrong way round (figures in ``docs/precision.md``).
``trial=False`` applies the table as written; a callable ``trial(module, candidates, device) -> {name: ms}``
replaces the measurement.

So ``fp8-auto`` decides in ``convert_module`` (see :func:`choose_fp8`), builds that plugin with the same layer-filter
options, installs it as the strategy's precision plugin (everything after setup -- autocast, backward, optimizer
step, checkpoint state -- is the chosen plugin's) and logs the choice with its reason. When nothing fits (no fp8 GPU
under the Trainer, no usable backend, an uncompiled model with only torchao installed) it trains in ``bf16-mixed``
and warns once, saying why.

Example::

    trainer = L.Trainer(plugins=[lgh.precision("fp8-auto")])
    trainer.fit(model)                       # log: "fp8-auto chose fp8-te-delayed: the model is not compiled ..."
    trainer.precision_plugin.name            # 'fp8-auto (fp8-te-delayed)'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_gh import compat, hardware
from lightning_gh._lightning import is_compiled, trainer_of
from lightning_gh.precision.base import Float8PrecisionBase
from lightning_gh.precision.checks import ao_missing_reason, te_missing_reason, trainer_device
from lightning_gh.precision.fabric import FabricCompatibleMixedPrecision
from lightning_gh.precision.layer_filter import FIELDS as FILTER_FIELDS
from lightning_gh.precision.names import FP8_NAMES

__all__ = ["AutoFloat8Precision", "Fp8Choice", "choose_fp8", "auto_candidates", "pick_measured", "AUTO_OPTIONS",
           "TRIAL_OPTIONS", "check_auto_options"]

# The options fp8-auto forwards: the layer filter's, which both backends share. Backend-specific options belong to a
# named recipe (``precision("fp8-te-current", weights_dtype=...)``), where the backend is known.
AUTO_OPTIONS = ("layer_filter", *FILTER_FIELDS)
TRIAL_OPTIONS = ("trial", "trial_tokens")  # fp8-auto's own: how it measures the candidates


def check_auto_options(options: Mapping[str, Any], extra: tuple[str, ...] = ()) -> None:
    """Raise ``TypeError`` naming any option fp8-auto does not take, as Python does for an unknown keyword
    (``extra``: more names the caller allows)."""
    allowed = [*AUTO_OPTIONS, *extra]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"precision('fp8-auto') does not take option(s) {unknown}; allowed: {allowed} "
                        "(backend options need a named recipe, e.g. precision('fp8-te-current', ...)).")


def check_trial_options(trial: Any = True, trial_tokens: Any = 8192) -> None:
    """Check fp8-auto's ``trial`` / ``trial_tokens``: ``TypeError`` for a wrong type, ``ValueError`` for
    ``trial_tokens`` below 16 (see Note [Wrong type, wrong value] in :mod:`lightning_gh._options`)."""
    if not (isinstance(trial, bool) or callable(trial)):
        raise TypeError(f"precision('fp8-auto', trial={trial!r}): expected True, False or a callable "
                        f"(module, candidates, device) -> {{name: ms}}, got {type(trial).__name__}.")
    if isinstance(trial_tokens, bool) or not isinstance(trial_tokens, int):
        raise TypeError(f"precision('fp8-auto', trial_tokens={trial_tokens!r}): expected an int >= 16, got "
                        f"{type(trial_tokens).__name__}.")
    if trial_tokens < 16:
        raise ValueError(f"precision('fp8-auto', trial_tokens={trial_tokens!r}): expected an int >= 16.")


# Strategies that shard parameters: Transformer Engine layers are not sharded by our TE plugin.
_SHARDING = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


@dataclass(frozen=True)
class Fp8Choice:
    """What ``fp8-auto`` picked: ``name`` is an fp8 precision name, or ``None`` for the bf16-mixed fallback."""

    name: str | None
    reason: str


def auto_candidates(compiled: bool, strategy: str, te: str | None, ao: str | None) -> list[str]:
    """The recipes ``fp8-auto`` would time here, in the rule's order of preference (may be empty)."""
    sharded = strategy in _SHARDING
    te_ok, ao_ok = te is None and not sharded, ao is None and (compiled or not sharded)
    if compiled:
        # Not timed against each other: the per-layer trial sees neither the graph break around every TE layer
        # nor the casts torchao's layers fuse into the compiled graph, and ranks them the wrong way round (see the
        # module docs).
        return ["fp8-ao-tensorwise"] if ao_ok else (["fp8-te-current"] if te_ok else [])
    return [n for n, ok in (("fp8-te-delayed", te_ok), ("fp8-te-current", te_ok), ("fp8-ao-tensorwise", ao_ok))
            if ok]


def pick_measured(candidates: list[str], timings: Mapping[str, float], tie: float = 0.02) -> Fp8Choice | None:
    """The fastest measured candidate, with the figures in the reason; ``None`` when none was measured.

    Candidates within ``tie`` (relative) of the fastest count as equal; the earlier one in ``candidates`` wins.
    """
    measured = [(n, float(timings[n])) for n in candidates
                if n in timings and isinstance(timings[n], (int, float)) and 0 < float(timings[n]) < float("inf")]
    if not measured:
        return None
    best = min(ms for _, ms in measured)
    name = next(n for n, ms in measured if ms <= best * (1 + tie))
    figures = ", ".join(f"{n} {ms:.2f} ms" for n, ms in sorted(measured, key=lambda x: x[1]))
    base = timings.get("bf16")
    vs = f"; bf16 {float(base):.2f} ms" if isinstance(base, (int, float)) and base > 0 else ""
    return Fp8Choice(name, f"fastest in the setup trial on this model's GEMM shapes ({figures}{vs})")


def choose_fp8(compiled: bool, strategy: str, te: str | None, ao: str | None,
               timings: Mapping[str, float] | None = None) -> Fp8Choice:
    """The rule ``fp8-auto`` applies at setup (pure, so the table in the module docs is tested as written).

    Args:
        compiled: the model (or a submodule) is under ``torch.compile``.
        strategy: the Trainer's strategy class name.
        te: why Transformer Engine is unusable here, or ``None`` when it is usable.
        ao: the same for torchao.
        timings: milliseconds per candidate from the setup trial; when it measured a candidate of
            :func:`auto_candidates`, the fastest wins over the table.
    """
    if timings:
        measured = pick_measured(auto_candidates(compiled, strategy, te, ao), timings)
        if measured is not None:
            return measured
    sharded = strategy in _SHARDING
    if compiled:
        if ao is None:
            return Fp8Choice("fp8-ao-tensorwise", "the model is compiled: torchao tensorwise fp8 is traced into the "
                                                  "compiled graph, while Transformer Engine layers break it")
        if te is None and not sharded:
            return Fp8Choice("fp8-te-current", "the model is compiled and torchao is not usable "
                                               f"({ao}); current scaling is the TE recipe that compiles")
    else:
        if te is None and not sharded:
            return Fp8Choice("fp8-te-delayed", "the model is not compiled: Transformer Engine's fp8 layers run "
                                               "eagerly inside its compiled blocks and need no tracing")
        if ao is None and not sharded:
            return Fp8Choice("fp8-ao-tensorwise", f"the model is not compiled and Transformer Engine is not usable "
                                                  f"({te}): torchao tensorwise fp8 with each transformer block "
                                                  "compiled in place (regional compilation)")
        if ao is None:
            why_not_te = f"Transformer Engine does not support {strategy}" if te is None else f"{te}"
            return Fp8Choice(None, f"the model is not compiled and sharded by {strategy}, where blocks are not "
                                   f"compiled for you and eager torchao fp8 is slower than bf16 ({why_not_te}); "
                                   "compile the blocks in configure_model to train in fp8")
    if sharded and te is None:
        return Fp8Choice(None, f"Transformer Engine does not support {strategy} and torchao is not usable ({ao})")
    return Fp8Choice(None, "no fp8 backend is usable (" + "; ".join(
        f"{n}: {r}" for n, r in (("Transformer Engine", te), ("torchao", ao)) if r) + ")")


def _build_named(name: str, **options: Any) -> Precision:
    """The plugin for an fp8 name, or bf16-mixed: what fp8-auto can hand over to (the backends load lazily)."""
    if name == "bf16-mixed":
        return FabricCompatibleMixedPrecision("bf16-mixed", **options)
    spec = FP8_NAMES[name]
    if spec.backend == "te":
        from lightning_gh.precision.te import TEFloat8Precision as cls
    else:
        from lightning_gh.precision.ao import TorchAOFloat8Precision as cls
    return cls(spec.recipe, name=name, **options)


class AutoFloat8Precision(Float8PrecisionBase):
    """The plugin behind ``precision("fp8-auto")``: picks an fp8 recipe at setup and hands over to it.

    Args:
        trial: time the candidate recipes on this model's GEMM shapes at setup when more than one can run
            (``True``, default), apply the table (``False``), or a callable ``(module, candidates, device) ->
            {name: ms}`` that measures instead.
        trial_tokens: tokens per step (batch x sequence) the trial times the GEMMs at.
        **options: layer-filter options (``include``, ``exclude``, ``skip_head``, ``skip_first``, ``min_dim``,
            ``layer_filter``), passed to the chosen plugin.

    Raises:
        TypeError: an option that is not a layer-filter option, or a value of the wrong type.
        ValueError: a bad value.

    After ``Trainer.fit`` has set up, ``trainer.precision_plugin`` is the chosen plugin (its ``name`` reads
    ``"fp8-auto (fp8-...)"``) and ``choice`` on this object says what was picked and why.

    Example::

        trainer = L.Trainer(plugins=[lgh.precision("fp8-auto", exclude=["*.wo"])])
    """

    recipes = ("auto",)

    def __init__(self, trial: bool | Callable[..., Mapping[str, float]] = True, trial_tokens: int = 8192,
                 **options: Any) -> None:
        check_auto_options(options)
        check_trial_options(trial, trial_tokens)
        super().__init__("auto", name="fp8-auto", **options)
        self.trial = trial
        self.trial_tokens = trial_tokens
        self.timings: dict[str, float] = {}
        self.choice: Fp8Choice | None = None
        self.chosen: Precision | None = None

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments handed to the chosen plugin (its layer filter)."""
        return {"layer_filter": self.layer_filter}

    def __repr__(self) -> str:
        return f"AutoFloat8Precision(layer_filter={self.layer_filter}, choice={self.choice})"

    def convert_module(self, module: nn.Module) -> nn.Module:
        trainer = trainer_of(module)
        if trainer is not None:
            compat.check(trainer, self.lgh_part)
        device = trainer_device(module)
        strategy = type(getattr(trainer, "strategy", None)).__name__
        hw_reason = self._device_reason(device)
        if hw_reason:
            self.choice = Fp8Choice(None, hw_reason)
        else:
            compiled, te, ao = is_compiled(module), te_missing_reason(), ao_missing_reason()
            if trainer is None and te is None:  # See Note [One plugin object for the Trainer and Fabric]
                te = "the Transformer Engine plugin needs Lightning's Trainer (this is Fabric or a loop of your own)"
            self.timings = self._measure(module, auto_candidates(compiled, strategy, te, ao), device)
            self.choice = choose_fp8(compiled, strategy, te, ao, self.timings)
        self.chosen = self._build(self.choice, device, _build_named)
        if self.choice.name is None:
            warnings.warn(f"precision 'fp8-auto' falls back to bf16-mixed: {self.choice.reason}.", UserWarning,
                          stacklevel=2)
        else:
            rank_zero_info(f"fp8-auto chose {self.choice.name}: {self.choice.reason}.")
        if trainer is not None:
            # From here on the strategy talks to the chosen plugin (autocast, backward, optimizer step, state).
            trainer.strategy.precision_plugin = self.chosen
        return self.chosen.convert_module(module)

    def _measure(self, module: nn.Module, candidates: list[str], device: Any) -> dict[str, float]:
        """The trial's milliseconds per candidate, or ``{}`` (one candidate, trial off, or the trial failed)."""
        if self.trial is False or len(candidates) < 2:
            return {}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            # Timings differ between ranks, and every rank must pick the same recipe: the table decides under DDP.
            return {}
        try:
            if callable(self.trial):
                return dict(self.trial(module, candidates, device))
            from lightning_gh.precision.trial import measure_gemm_shapes

            return measure_gemm_shapes(module, candidates, device, self.layer_filter, self.trial_tokens)
        except Exception as e:  # a trial that cannot run must not stop training: the table decides then
            warnings.warn(f"fp8-auto: the setup trial failed ({type(e).__name__}: {e}); choosing by the table.",
                          UserWarning, stacklevel=3)
            return {}

    def _build(self, choice: Fp8Choice, device: Any, precision: Callable[..., Precision]) -> Precision:
        if choice.name is None:
            return precision("bf16-mixed", device=device.type)
        plugin = precision(choice.name, **self.options)
        plugin.name = f"fp8-auto ({choice.name})"
        return plugin

    @staticmethod
    def _device_reason(device: Any) -> str | None:
        if device.type != "cuda":
            return f"the Trainer trains on '{device}', not on an fp8-capable CUDA GPU"
        return hardware.detect(device.index).fp8_unsupported_reason()

    # Before setup nothing of the step has run yet; after it the strategy holds the chosen plugin. These keep a
    # direct caller (e.g. a test driving the plugin by hand after convert_module) on the chosen one as well.
    def forward_context(self):  # type: ignore[override]
        return self.chosen.forward_context() if self.chosen is not None else super().forward_context()

    def state_dict(self) -> dict[str, Any]:
        return self.chosen.state_dict() if self.chosen is not None else {}

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Any = None, **kwargs: Any) -> Any:
        # Under Fabric this object stays the precision plugin (no Trainer to hand over to): the chosen fp8 plugin's
        # step runs (see Note [One plugin object for the Trainer and Fabric]).
        if model is None and closure is None and isinstance(self.chosen, Float8PrecisionBase):
            return self.chosen.optimizer_step(optimizer, **kwargs)
        return super().optimizer_step(optimizer, model, closure, **kwargs)
