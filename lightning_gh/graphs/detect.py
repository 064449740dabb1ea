"""Finding what cannot be captured, before it breaks a capture or, worse, produces wrong numbers.

Three kinds of checks, each giving a :class:`Finding` (a short cause and one sentence for the user):

* when training starts, from the configuration (:func:`setup_findings`): no CUDA, a strategy other than one device,
  manual optimization, gradient accumulation, an fp16 ``GradScaler`` (its ``step`` reads ``found_inf`` on the
  host), an unverified precision plugin, an optimizer without capturable state, a scheduler that cycles the
  momentum (:func:`scheduler_finding`) (which other lightning_gh parts may share the Trainer is decided once, in
  :mod:`lightning_gh.compat`, at setup);
* while one warm-up step is rehearsed eagerly with CUDA's sync debug mode on (:class:`SyncMonitor`): any
  host<->device synchronization (``.item()``, ``.cpu()``, ``print(tensor)``, ``torch.cuda.synchronize()``,
  a tensor in a Python ``if``), reported with the user's file and line (:func:`sync_finding`);
* across warm-up steps: batch shapes that change on every step (:func:`dynamic_shape_finding`).

Example::

    with SyncMonitor() as mon:
        run_one_step()
    finding = sync_finding(mon.events)     # None, or Finding("cpu-sync", "... at model.py:42 in training_step ...")
"""

from __future__ import annotations

import linecache
import os
import sysconfig
import threading
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gh.graphs.buffers import signature_difference
from lightning_gh.graphs.optim import unsupported_optimizer_reason

__all__ = ["CAPTURE_SKIPPED_SYNCS", "Finding", "SyncEvent", "SyncMonitor", "SYNC_WARNING", "combine",
           "dynamic_shape_finding", "is_library_file", "scheduler_finding", "setup_findings", "sync_finding"]

# The text of the warning CUDA's sync debug mode raises (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"

@dataclass(frozen=True)
class Finding:
    """Why a step cannot be captured.

    Attributes:
        cause: a short key (``"no-cuda"``, ``"cpu-sync"``, ``"dynamic-shapes"``, ``"grad-scaler"``...).
        message: one sentence for the user, naming the cause and, where known, the place and the fix.
    """

    cause: str
    message: str


def combine(findings: Sequence[Finding]) -> Finding | None:
    """One finding that names every cause (the user gets one message, not one per cause)."""
    if not findings:
        return None
    if len(findings) == 1:
        return findings[0]
    return Finding("+".join(dict.fromkeys(f.cause for f in findings)),
                   " Also: ".join(f.message.rstrip(".") + "." for f in findings))


# --------------------------------------------------------------------------------------------------------------
# configuration


def _precision_finding(plugin: Any) -> Finding | None:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    if getattr(plugin, "scaler", None) is not None:
        return Finding("grad-scaler",
                       "precision='16-mixed' uses a GradScaler, whose step reads the found-inf flag on the host "
                       "every step; use precision='bf16-mixed' (no scaler) to capture the step")
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
        return Finding("precision",
                       f"precision plugin {type(plugin).__name__} is not captured: its combination with whole-step "
                       "capture has not been verified yet (this covers the FP8 plugins; verified: '32-true', "
                       "'bf16-mixed', 'bf16-true'; Lightning's '16-true' and '64-true' are allowed)")
    return None


def _momentum_bounds(scheduler: Any) -> list[tuple[Any, Any]] | None:
    """``(base, max)`` momentum per param group of a momentum-cycling scheduler (None when not known)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.CyclicLR):
        base, top = getattr(scheduler, "base_momentums", None), getattr(scheduler, "max_momentums", None)
        return list(zip(base, top)) if base is not None and top is not None else None
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
    if groups is None or not all("base_momentum" in g and "max_momentum" in g for g in groups):
        return None
    return [(g["base_momentum"], g["max_momentum"]) for g in groups]


def scheduler_finding(schedulers: Sequence[Any]) -> Finding | None:
    """The finding for a scheduler that cycles Adam's beta1 (``OneCycleLR`` or ``CyclicLR`` with
    ``cycle_momentum=True``, their default), or ``None``.

    Such a scheduler assigns a new ``param_group["betas"]`` on every step. The betas are Python numbers that a
    captured step bakes in, so every change would force a re-capture until ``max_recaptures`` gives up: the
    capture would be abandoned within a few steps, so it is not attempted.

    Args:
        schedulers: the fit's LR schedulers (``[c.scheduler for c in trainer.lr_scheduler_configs]``).
    """
    for sched in schedulers:
        if not isinstance(sched, (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.CyclicLR)):
            continue
        if not getattr(sched, "cycle_momentum", False):
            continue
        bounds = _momentum_bounds(sched)
        if bounds is not None and all(b == m for b, m in bounds):
            continue  # the same betas value on every step: nothing the graph baked in changes
        name = type(sched).__name__
        return Finding("momentum-schedule",
                       f"{name} cycles the momentum (cycle_momentum=True, the default), assigning a new "
                       "param_group['betas'] every step; a captured step bakes the betas in, so it would be "
                       f"re-captured every step and then abandoned (construct {name} with cycle_momentum=False, "
                       "or base_momentum equal to max_momentum, to capture the step)")
    return None


def setup_findings(trainer: Any, pl_module: Any) -> list[Finding]:
    """Everything about this fit's configuration that rules capture out (empty when capture may go ahead).

    Args:
        trainer: the ``Trainer`` at ``on_train_start`` (optimizers exist, any checkpoint is loaded).
        pl_module: the LightningModule.
    """
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.strategies import SingleDeviceStrategy

    if not torch.cuda.is_available():
        return [Finding("no-cuda", "no CUDA GPU is available")]
    if pl_module.device.type != "cuda":
        return [Finding("not-on-cuda", f"the model is on {pl_module.device}, not on a CUDA GPU")]
    out: list[Finding] = []
    if not isinstance(trainer.strategy, SingleDeviceStrategy) or trainer.world_size > 1:
        out.append(Finding("strategy", f"strategy {type(trainer.strategy).__name__} with {trainer.world_size} "
                                       "process(es): this version captures single-GPU runs only"))
    if not pl_module.automatic_optimization:
        out.append(Finding("manual-optimization", "the module uses manual optimization; CUDAGraphCapture captures "
                                                  "Lightning's automatic optimization step"))
    acc = int(getattr(trainer, "accumulate_grad_batches", 1))
    if acc != 1 or any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        out.append(Finding("accumulation",
                           f"gradient accumulation (accumulate_grad_batches={acc}) is not supported: Lightning runs "
                           "the accumulation micro-steps outside any hook that can be wrapped; raise the batch size "
                           "instead, or drop CUDAGraphCapture"))
    f = _precision_finding(trainer.precision_plugin)
    if f:
        out.append(f)
    if len(trainer.optimizers) != 1:
        out.append(Finding("optimizer", f"{len(trainer.optimizers)} optimizers; a captured step takes exactly one"))
    else:
        reason = unsupported_optimizer_reason(trainer.optimizers[0])
        if reason:
            out.append(Finding("optimizer", reason))
    f = scheduler_finding([c.scheduler for c in getattr(trainer, "lr_scheduler_configs", [])])
    if f:
        out.append(f)
    import inspect

    try:
        params = inspect.signature(pl_module.training_step).parameters
    except (TypeError, ValueError):
        params = {}
    if "dataloader_iter" in params:
        out.append(Finding("dataloader-iter", "training_step takes `dataloader_iter` and fetches its own batches, "
                                              "so there is no batch to copy into static inputs"))
    return out


# --------------------------------------------------------------------------------------------------------------
# host synchronizations


@dataclass(frozen=True)
class SyncEvent:
    """One synchronizing CUDA call seen by :class:`SyncMonitor`: the Python stack at the call, innermost last."""

    stack: tuple[traceback.FrameSummary, ...]


def _library_roots() -> tuple[str, ...]:
    roots = [os.path.dirname(torch.__file__), os.path.dirname(__file__)]
    for mod in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities"):
        try:
            m = __import__(mod)
            roots.append(os.path.dirname(m.__file__))
        except Exception:
            pass
    roots.append(sysconfig.get_paths()["stdlib"])
    return tuple(os.path.realpath(r) + os.sep for r in roots)


_ROOTS: tuple[str, ...] | None = None


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to torch, Lightning, the standard library or this package (not user code)."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _library_roots()
    path = os.path.realpath(filename)
    return path.startswith(_ROOTS) or filename.startswith("<")


def _where(frame: traceback.FrameSummary) -> str:
    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    loc = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return f"{loc}: `{code}`" if code else loc


def _culprit(event: SyncEvent) -> tuple[traceback.FrameSummary | None, traceback.FrameSummary | None]:
    """(the innermost frame of user code, the innermost frame of all) for one event."""
    frames = [f for f in event.stack if os.path.basename(f.filename) != "warnings.py"]
    user = next((f for f in reversed(frames) if not is_library_file(f.filename)), None)
    return user, (frames[-1] if frames else None)


#: Host syncs that their library skips while a CUDA stream is capturing (it asks
#: ``torch.cuda.is_current_stream_capturing()``), so a captured step never makes them: ``(file name, function)``.
#: transformers (>= 5) checks in ``find_packed_sequence_indices`` whether a training batch packs several sequences
#: (``if not is_tracing(mask) and (mask[:, -1] == 0).all()``) whenever a decoder runs without a KV cache, without an
#: attention mask; under capture it skips the check and builds the (equivalent) explicit causal mask instead.
CAPTURE_SKIPPED_SYNCS: frozenset[tuple[str, str]] = frozenset({("masking_utils.py", "find_packed_sequence_indices")})


def _skipped_under_capture(event: SyncEvent) -> bool:
    return any((os.path.basename(f.filename), f.name) in CAPTURE_SKIPPED_SYNCS for f in event.stack)


def sync_finding(events: Sequence[SyncEvent]) -> Finding | None:
    """One finding naming where the step synchronizes with the host (``None`` when it never does).

    Syncs listed in :data:`CAPTURE_SKIPPED_SYNCS` are not counted: the library makes them only outside a capture.
    """
    events = [ev for ev in events if not _skipped_under_capture(ev)]
    if not events:
        return None
    places: dict[str, None] = {}
    for ev in events:
        user, inner = _culprit(ev)
        if user is not None:
            places[_where(user)] = None
        elif inner is not None:
            places[f"inside {_where(inner)}"] = None
    first = next(iter(places), "an unknown place")
    more = len(places) - 1
    extra = f" (and {more} other place{'s' if more > 1 else ''}: {'; '.join(list(places)[1:4])})" if more else ""
    return Finding("cpu-sync",
                   f"the training step synchronizes the host with the GPU at {first}{extra}; a CUDA graph cannot "
                   "contain a host synchronization such as .item(), .cpu(), .tolist(), print(tensor), a tensor in a "
                   "Python `if`, or torch.cuda.synchronize() (log the tensor itself, or move the host work to "
                   "on_train_batch_end)")


class SyncMonitor:
    """While active, record every synchronizing CUDA call made by this thread, with its Python stack.

    It switches CUDA's sync debug mode to ``"warn"`` and intercepts that warning (other warnings pass
    through). The step still runs to the end, so a rehearsal step stays a correct eager step.

    Args:
        enabled: record nothing and touch nothing when ``False``.
        debug_mode: switch CUDA's sync debug mode on while active (``False`` only collects sync warnings raised
            some other way, which is how the CPU tests drive it).

    Attributes:
        events: the :class:`SyncEvent` list, in call order.
    """

    def __init__(self, enabled: bool = True, debug_mode: bool = True) -> None:
        self.enabled = enabled
        self.debug_mode = debug_mode
        self.events: list[SyncEvent] = []

    def __enter__(self) -> SyncMonitor:
        if not self.enabled:
            return self
        self._thread = threading.get_ident()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        # torch announces the debug mode as a prototype on first use: noise for the user of this callback
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype feature")
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning
        if self.debug_mode:
            self._prev_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _on_warning(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        if SYNC_WARNING in str(message) and threading.get_ident() == self._thread:
            self.events.append(SyncEvent(tuple(traceback.extract_stack()[:-1])))
            return
        self._show(message, category, filename, lineno, file, line)

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self.debug_mode:
            torch.cuda.set_sync_debug_mode(self._prev_mode)
        self._catch.__exit__(*exc)


# --------------------------------------------------------------------------------------------------------------
# shapes


def dynamic_shape_finding(signatures: Sequence[tuple]) -> Finding:
    """The finding for a warm-up in which no two consecutive batches had the same signature.

    Args:
        signatures: the :func:`~lightning_gh.graphs.buffers.batch_signature` of each warm-up batch, in order.
    """
    diffs = [signature_difference(a, b, was="the step before had") for a, b in zip(signatures, signatures[1:])]
    diffs = [d for d in diffs if d]
    shown = "; then ".join(diffs[:2]) if diffs else "the batch changed"
    return Finding("dynamic-shapes",
                   f"batch shapes change from step to step ({shown}) over {len(signatures)} warm-up steps; a graph "
                   "replays one shape (pad or bucket batches to a fixed shape, e.g. drop_last=True and fixed seq_len)")
