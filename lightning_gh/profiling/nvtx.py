"""NVTX ranges for every phase of a Lightning training step, for reading Nsight Systems timelines.

One callback annotates the step the way an engineer would by hand: ``train_step`` (one per
optimizer step, the step number as payload) holding ``dataloader``, ``forward``, ``zero_grad``,
``backward`` and ``optimizer_step``; then ``validation`` and ``checkpoint`` where they happen;
optionally a range per module and per Python garbage collection. Ranges go to a dedicated NVTX
domain with registered strings, a colour and a category per phase, so a tool pays no string copy
per event. Unlike ``torch.autograd.profiler.emit_nvtx`` it does not annotate every operator: about
ten ranges per step.

How the ranges map onto Lightning 2.6 (``lightning/pytorch/loops``)::

    train_step      opens when the first micro-batch of an optimizer step is fetched (Lightning's
                    profiler action "[_TrainingEpochLoop].train_dataloader_next"; on_train_batch_start
                    if that action is not seen) and closes at on_train_batch_end of the batch whose
                    optimizer step advanced trainer.global_step. Payload: the step (global_step
                    before the update, the number the `steps` argument selects).
    dataloader      fetch start .. on_train_batch_start: next(loader) plus the host-to-device copy
                    (batch_to_device). One per micro-batch. Payload: the step.
    forward         on_train_batch_start .. on_before_zero_grad / on_before_backward: the
                    training_step. Payload: tokens in the micro-batch when the batch holds integer
                    token ids, else the step.
    zero_grad       on_before_zero_grad .. on_before_backward. Lightning zeroes the gradients inside
                    its closure, after training_step and before backward, on the first micro-batch
                    of each optimizer step only.
    backward        on_before_backward .. on_after_backward (includes DDP's gradient all-reduce).
    optimizer_step  on_before_optimizer_step .. the optimizer's step post-hook
                    (torch.optim.Optimizer.register_step_post_hook). Gradient clipping, which
                    Lightning runs after on_before_optimizer_step, is inside. When the step is
                    skipped (a GradScaler that found inf), it closes at on_train_batch_end.
    validation      on_validation_start .. on_validation_end. Payload: trainer.global_step.
    checkpoint      the whole Trainer.save_checkpoint (Lightning's profiler action
                    "save_checkpoint": gathering the state, writing it, the barrier), whether
                    ModelCheckpoint or the user asked for it. Payload: trainer.global_step.

With gradient accumulation ``dataloader``/``forward``/``backward`` repeat inside one
``train_step``. With manual optimization ``backward``/``optimizer_step``/``zero_grad`` nest inside
``forward`` (they happen inside training_step). Validation and checkpoints that follow step N
belong to step N: they are annotated when step N is selected.

Every range but ``train_step`` is a phase of the shared :class:`~lightning_gh.profiling.phases.StepPhaseTracker`
(``dataloader`` is its ``data_wait``, held open to the forward; ``optimizer_step`` its ``optimizer``), the one
definition SelectiveProfiler and DataStallDetector use too: this callback forwards Lightning's hooks to the tracker
and maps phase starts and ends onto ranges. For the fetch and the save the tracker watches Lightning's profiler actions by
wrapping ``trainer.profiler.start``/``stop`` on the instance for the duration of the run (any Lightning
profiler, including the default pass-through one, keeps working); Lightning has no callback hook at the
start of a fetch or around a save.

Example::

    import lightning as L
    from lightning_gh.profiling.nvtx import NVTXRangeCallback

    trainer = L.Trainer(callbacks=[NVTXRangeCallback(steps="20-24", ranks="0")])
    trainer.fit(model, datamodule)
    # nsys profile --trace=cuda,nvtx -o run python train.py
"""

from __future__ import annotations

import fnmatch
import gc
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_gh import compat
from lightning_gh._options import resolve
from lightning_gh._util import count_tokens, warn_once
from lightning_gh.profiling._nvtx_backend import Backend, select_backend
from lightning_gh.profiling.options import NVTXOptions
from lightning_gh.profiling.phases import StepPhaseTracker
from lightning_gh.profiling.windows import RankSelection, StepSchedule

__all__ = ["NVTXOptions", "NVTXRangeCallback", "PHASES", "STEPS_ENV", "WARN_KEY"]

#: Overrides the ``steps`` argument when set (same grammar), like ``LGH_PROFILE_START_STOP`` for the profiler.
STEPS_ENV = "LGH_NVTX_STEPS"


@dataclass(frozen=True)
class RangeStyle:
    """How a range looks in Nsight Systems: an ARGB colour and a named category."""

    color: int
    category: str


#: Every range the callback emits by default, in the order they usually appear, with its style.
PHASES: dict[str, RangeStyle] = {
    "train_step": RangeStyle(0xFF76B900, "step"),
    "dataloader": RangeStyle(0xFFF39C12, "data"),
    "forward": RangeStyle(0xFF3498DB, "compute"),
    "zero_grad": RangeStyle(0xFF95A5A6, "optimizer"),
    "backward": RangeStyle(0xFF9B59B6, "compute"),
    "optimizer_step": RangeStyle(0xFFE74C3C, "optimizer"),
    "validation": RangeStyle(0xFF1ABC9C, "eval"),
    "checkpoint": RangeStyle(0xFFF1C40F, "io"),
}
_GC_STYLE = RangeStyle(0xFF7F8C8D, "gc")
_MODULE_STYLE = RangeStyle(0xFF5DADE2, "module")
_MODULE_BACKWARD_STYLE = RangeStyle(0xFFAF7AC5, "module")
_USER_STYLE = RangeStyle(0xFFBDC3C7, "user")

#: The prefix of this module's keys in :func:`lightning_gh._util.warn_once` (tests reset them by it).
WARN_KEY = "nvtx:"


def _warn_once(key: str, message: str) -> None:
    warn_once(WARN_KEY + key, message, UserWarning, stacklevel=4)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _default_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Two levels below the LightningModule, looking through ModuleList/ModuleDict containers.

    For a typical LLM module that is the network itself and its embedding, each transformer block,
    the final norm and the head: readable in a timeline, and a handful of hooks per block.
    """
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module, depth: int) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}.{name}" if prefix else name
            if isinstance(child, _CONTAINERS):
                visit(qual, child, depth)  # a container has no forward of its own
                continue
            out.append((qual, child))
            if depth < 2:
                visit(qual, child, depth + 1)

    visit("", root, 1)
    return out


def _matching_modules(root: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """Modules whose qualified name or class name matches one of the fnmatch ``patterns``."""
    named = [(n, m) for n, m in root.named_modules() if n]
    out, unmatched = [], []
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(type(m).__name__, p) for n, m in named):
            unmatched.append(p)
    if unmatched:
        types = sorted({type(m).__name__ for _, m in named})
        names = [n for n, _ in named][:4]
        raise ValueError(
            f"NVTXRangeCallback(module_ranges={list(patterns)!r}): expected fnmatch globs on qualified names or class "
            f"names of modules; patterns {unmatched} match no module of {type(root).__name__}, whose module types "
            f"are {types}, and names look like {names}."
        )
    for n, m in named:
        if any(fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(type(m).__name__, p) for p in patterns):
            out.append((n, m))
    return out


def _without_compiled(modules: list[tuple[str, nn.Module]]) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """Drop modules inside a ``torch.compile`` wrapper (their path runs through ``_orig_mod``).

    A Python hook in a compiled region would break its graph. The wrapper itself is kept: its hooks run
    outside the compiled code, so its range spans the compiled call.
    """
    keep, dropped = [], []
    for name, module in modules:
        (dropped if "_orig_mod" in name.split(".") else keep).append((name, module))
    return keep, [n for n, _ in dropped]


class NVTXRangeCallback(Callback):
    r"""Annotate each phase of training with NVTX ranges, for Nsight Systems.

    Ranges (exact messages): ``train_step``, ``dataloader``, ``forward``, ``zero_grad``, ``backward``,
    ``optimizer_step``, ``validation``, ``checkpoint``; with ``module_ranges`` one per module call
    (its qualified name, and ``"<name> (backward)"`` where the backward can be bounded cheaply); with
    ``gc_ranges`` a ``gc`` range per Python garbage collection. See the module docstring for the exact
    Lightning hooks behind each range.

    Backends: the ``nvtx`` package (dedicated domain, registered strings, colours, categories,
    payloads), else ``torch.cuda.nvtx`` (global domain, messages only), else one warning and nothing.
    With the ``nvtx`` package and no tool attached (the usual run outside ``nsys``), the callback does
    no work at all.

    Args:
        steps, ranks, domain, module_ranges, gc_ranges: the options, each documented once in
            :class:`~lightning_gh.profiling.options.NVTXOptions` (defaults there too).
        options: the same options as one :class:`NVTXOptions`, instead of the keywords (never both).

    Raises:
        TypeError: an argument of the wrong type; ``options`` together with a keyword that differs from its default.
        ValueError: a value out of its allowed values (the message names the argument, the value and the grammar);
            at setup, ``module_ranges`` patterns that match no module (always, whether or not a tool is attached).

    Example::

        trainer = L.Trainer(callbacks=[NVTXRangeCallback(steps="20-24", ranks="0", gc_ranges=True)])
        # then:  nsys profile --trace=cuda,nvtx -o run python train.py
    """

    lgh_part = "NVTXRangeCallback"
    # Its on_before_optimizer_step only marks a phase boundary: the fp8 plugins' fused master update may run.
    lgh_reads_gradients = False

    def __init__(
        self,
        steps: str | int | None = NVTXOptions.steps,
        ranks: str = NVTXOptions.ranks,
        domain: str = NVTXOptions.domain,
        module_ranges: bool | Sequence[str] = NVTXOptions.module_ranges,
        gc_ranges: bool = NVTXOptions.gc_ranges,
        *,
        options: NVTXOptions | None = None,
    ) -> None:
        self.options = resolve(NVTXOptions, options, "NVTXRangeCallback", steps=steps, ranks=ranks, domain=domain,
                               module_ranges=module_ranges, gc_ranges=gc_ranges)
        self._schedule = StepSchedule.resolve(self.options.steps, STEPS_ENV, argument="steps",
                                              where="NVTXRangeCallback")
        self._ranks = RankSelection.parse(self.options.ranks, argument="ranks", where="NVTXRangeCallback")
        self._backend: Backend | None = None
        self._reset()

    # The options, read-only (set them through the constructor or ``options=``).
    steps = property(lambda self: self.options.steps, doc="See :attr:`NVTXOptions.steps`.")
    ranks = property(lambda self: self.options.ranks, doc="See :attr:`NVTXOptions.ranks`.")
    domain = property(lambda self: self.options.domain, doc="See :attr:`NVTXOptions.domain`.")
    module_ranges = property(lambda self: self.options.module_ranges, doc="See :attr:`NVTXOptions.module_ranges`.")
    gc_ranges = property(lambda self: self.options.gc_ranges, doc="See :attr:`NVTXOptions.gc_ranges`.")

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        self._on = False  # backend live and this rank selected: the hooks do anything at all
        self._trainer: L.Trainer | None = None
        self._handles: dict[str, Any] = {}
        self._stack: list[str] = []  # keys pushed on the main thread, innermost last
        self._main_thread = threading.get_ident()
        self._pid = os.getpid()
        self._tls = threading.local()
        self._active = False  # the current step (and what follows it) is annotated
        self._in_step = False
        self._seen_step = False
        self._step = 0
        self._batches = 0
        self._tokens: int | None = None  # the current micro-batch's token count, the forward range's payload
        self._phases = StepPhaseTracker([self])
        self._module_targets: list[tuple[str, nn.Module]] | None = None
        self._module_hooks: list[Any] = []
        self._open_backward: dict[int, list[Any]] = {}
        self._gc_installed = False
        self._gc_open = False

    @property
    def backend(self) -> str:
        """The backend in use after ``setup``: ``"nvtx"``, ``"torch"`` or ``"none"``."""
        return self._backend.name if self._backend is not None else "none"

    @property
    def active(self) -> bool:
        """True while the current step is being annotated (a tool is attached and the step is selected)."""
        return self._on and self._active

    def _selected(self, step: int) -> bool:
        return self._schedule is None or step in self._schedule

    def _tail_selected(self, trainer: L.Trainer) -> bool:
        # Validation and checkpoints after step N belong to step N; before any step, to global_step.
        if not self._on:
            return False
        return self._active if self._seen_step else self._selected(trainer.global_step)

    # ------------------------------------------------------------------ push / pop on the main thread

    def _push(self, key: str, payload: int | None) -> None:
        self._backend.push(self._handles[key], payload)
        self._stack.append(key)

    def _pop_to(self, key: str) -> None:
        """Close ``key`` and anything opened inside it; nothing if ``key`` is not open."""
        stack = self._stack
        if key not in stack:
            return
        backend = self._backend
        while stack:
            top = stack.pop()
            backend.pop()
            if top == key:
                return

    def _unwind_to(self, key: str) -> None:
        """Close everything opened inside ``key``, keeping ``key`` open."""
        stack = self._stack
        if key not in stack:
            return
        while stack[-1] != key:
            stack.pop()
            self._backend.pop()

    def _pop_all(self) -> None:
        while self._stack:
            self._stack.pop()
            self._backend.pop()
        self._end_open_backward()

    # ------------------------------------------------------------------ setup / teardown

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._cleanup()
        self._reset()
        compat.check(trainer, self.lgh_part)
        if isinstance(self.module_ranges, tuple):
            # Checked on every rank and with no tool attached too: a typo must fail the first run, not the one
            # under nsys.
            _matching_modules(pl_module, self.module_ranges)
        self._trainer = trainer
        unmatched = self._ranks.unmatched(trainer.world_size, trainer.num_devices)
        if unmatched:
            rank_zero_warn(f"NVTXRangeCallback: {unmatched}")
        if not self._ranks.selects(trainer.global_rank, trainer.local_rank, trainer.world_size):
            return  # not even the domain is created on an unselected rank
        if self._backend is None:
            self._backend = select_backend(self.domain)
        backend = self._backend
        if backend.name == "none":
            _warn_once("no-backend", f"NVTXRangeCallback: no NVTX backend, ranges are off ({backend.reason}). "
                                     "Install the `nvtx` package (pip install nvtx) or use a CUDA build of torch.")
            return
        if not backend.tool_attached:
            return  # nvtx package, no tool listening: every call would be a no-op, so make none
        self._on = True
        for name, style in PHASES.items():
            self._handles[name] = backend.prepare(name, style.color, style.category)
        if self.gc_ranges:
            self._handles["gc"] = backend.prepare("gc", _GC_STYLE.color, _GC_STYLE.category)
            gc.callbacks.append(self._on_gc)
            self._gc_installed = True
        self._phases.attach(trainer)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._on:
            return
        self._phases.automatic = pl_module.automatic_optimization
        self._phases.watch_optimizers(trainer.optimizers)
        if self.module_ranges:
            self._resolve_modules(pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._cleanup()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Every push gets its pop even when a step raises; Lightning calls no teardown hook then.
        self._cleanup()

    def _cleanup(self) -> None:
        if getattr(self, "_backend", None) is None or not getattr(self, "_on", False):
            return
        self._pop_all()
        self._in_step = False
        self._active = False
        self._remove_module_hooks()
        if self._gc_installed:
            if self._gc_open:  # unlikely: a collection running while we clean up
                self._gc_open = False
                self._backend.pop()
            try:
                gc.callbacks.remove(self._on_gc)
            except ValueError:
                pass
            self._gc_installed = False
        self._phases.detach()
        self._on = False

    # ------------------------------------------------------------------ phases -> ranges

    # Every phase range comes from the shared step-phase tracker; this callback forwards Lightning's hooks to it
    # and maps each phase's start and end onto its NVTX range. Only ``train_step`` (one per optimizer step, which
    # spans the micro-batches of gradient accumulation) is this callback's own bookkeeping.
    _RANGE = {"forward": "forward", "zero_grad": "zero_grad", "backward": "backward", "optimizer": "optimizer_step"}

    def phase_started(self, phase: str, step: int, t: float) -> None:
        if phase == "data_wait":
            self._on_fetch_start()
        elif phase == "checkpoint":
            if self._trainer is not None and self._tail_selected(self._trainer):
                self._push("checkpoint", self._trainer.global_step)
        elif phase == "validation":
            if self._trainer is not None and self._tail_selected(self._trainer):
                self._push("validation", self._trainer.global_step)
        elif self._active and self._in_step:
            if phase == "forward":
                self._pop_to("dataloader")  # the fetch's range holds the host-to-device copy up to here
                self._push("forward", self._tokens if self._tokens is not None else self._step)
            else:
                self._push(self._RANGE[phase], self._step)

    def phase_ended(self, phase: str, step: int, t: float) -> None:
        if phase == "data_wait":
            # Usually "dataloader" stays open through the host-to-device copy until the forward starts; when
            # training_step fetches for itself (dataloader_iter), it ends with the fetch.
            if self._active and "forward" in self._stack:
                self._pop_to("dataloader")
        elif phase in self._RANGE or phase in ("validation", "checkpoint"):
            self._pop_to(self._RANGE.get(phase, phase))
            if phase == "backward":
                self._end_open_backward()

    # ------------------------------------------------------------------ steps

    def _open_step(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        self._in_step, self._seen_step = True, True
        self._step, self._batches = step, 0
        active = self._selected(step)
        if active != self._active:
            self._active = active
            self._sync_module_hooks()
        if active:
            self._push("train_step", step)

    def _on_fetch_start(self) -> None:
        if not self._on or self._trainer is None or not self._trainer.training:
            return
        if not self._in_step:
            self._open_step(self._trainer)
        if self._active:
            self._pop_to("dataloader")  # a previous fetch that never reached a batch
            self._push("dataloader", self._step)

    # ------------------------------------------------------------------ Lightning hooks, forwarded to the tracker

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._on:
            return
        if not self._in_step:
            self._open_step(trainer)
        self._batches += 1
        self._tokens = count_tokens(batch) if self._active else None
        self._phases.on_train_batch_start(trainer)

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._on:
            self._phases.on_before_zero_grad(trainer)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._on:
            self._phases.on_before_backward(trainer)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._on:
            self._phases.on_after_backward(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._on:
            self._phases.on_before_optimizer_step(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._on:
            return
        self._phases.on_train_batch_end(trainer)
        if not self._in_step:
            return
        if self._active:
            self._unwind_to("train_step")  # e.g. a fetch of training_step's own that reached no batch
            self._end_open_backward()
        if trainer.global_step != self._step:  # this batch's optimizer step ran: the step is over
            if self._active:
                self._pop_to("train_step")
            self._in_step = False

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning steps the optimizer on an epoch's last batch, so no step spans epochs; one still open
        # here fetched no batch (an iterable that ran dry) or was cut short (on_train_batch_start -> -1).
        if self._on and self._in_step:
            self._pop_to("train_step")
            self._in_step = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._on:
            self._pop_all()
            self._in_step = False

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._on:
            self._phases.on_validation_start(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._on:
            self._phases.on_validation_end(trainer)

    # ------------------------------------------------------------------ garbage collection

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Collections are never concurrent, and start/stop run on the same thread: push/pop pair up.
        # A forked DataLoader worker inherits gc.callbacks; it has no step to annotate.
        if phase == "start":
            if self._active and os.getpid() == self._pid:
                self._backend.push(self._handles["gc"], info.get("generation"))
                self._gc_open = True
        elif self._gc_open:
            self._gc_open = False
            self._backend.pop()

    # ------------------------------------------------------------------ module ranges

    def _resolve_modules(self, pl_module: L.LightningModule) -> None:
        spec = self.module_ranges
        found = _default_modules(pl_module) if spec is True else _matching_modules(pl_module, spec)
        targets, dropped = _without_compiled(found)
        if dropped:
            shown = dropped[:5] + (["..."] if len(dropped) > 5 else [])
            _warn_once("compiled", f"NVTXRangeCallback: no module ranges inside torch.compile'd modules ({shown}); "
                                   "a Python hook there would break the compiled graph.")
        backend = self._backend
        for name, _ in targets:
            self._handles.setdefault(f"m:{name}", backend.prepare(name, _MODULE_STYLE.color, _MODULE_STYLE.category))
            self._handles.setdefault(f"b:{name}", backend.prepare(f"{name} (backward)", _MODULE_BACKWARD_STYLE.color,
                                                                  _MODULE_BACKWARD_STYLE.category))
        self._module_targets = targets
        self._sync_module_hooks()

    def _sync_module_hooks(self) -> None:
        # Hooks exist only while steps are annotated: outside the windows the modules run hook-free.
        if not self._module_targets:
            return
        if self._active and not self._module_hooks:
            for name, module in self._module_targets:
                pre, post = self._module_hook_pair(name)
                self._module_hooks.append(module.register_forward_pre_hook(pre))
                self._module_hooks.append(module.register_forward_hook(post))
        elif not self._active and self._module_hooks:
            self._remove_module_hooks()

    def _remove_module_hooks(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    def _thread_stack(self) -> list[str]:
        if threading.get_ident() == self._main_thread:
            return self._stack
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _module_hook_pair(self, name: str) -> tuple[Any, Any]:
        fkey, bkey = f"m:{name}", f"b:{name}"
        handle, bhandle = self._handles[fkey], self._handles[bkey]
        backend = self._backend

        def pre(module: nn.Module, args: Any) -> None:
            if self._active:
                backend.push(handle, self._step)
                self._thread_stack().append(fkey)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            stack = self._thread_stack()
            if fkey not in stack:
                return
            while stack:
                top = stack.pop()
                backend.pop()
                if top == fkey:
                    break
            if torch.is_grad_enabled() and stack is self._stack:
                self._bound_backward(bhandle, args, output)

        return pre, post

    def _bound_backward(self, bhandle: Any, args: Any, output: Any) -> None:
        # The module's backward starts when the gradient of its output is ready and ends when the
        # gradient of its input is: two tensor hooks, no extra autograd node. Modules whose input needs
        # no gradient (an embedding of token ids) have no cheap end, so no backward range.
        out, inp = _first_tensor(output), _first_tensor(args)
        if out is None or inp is None or not out.requires_grad or not inp.requires_grad:
            return
        cell: list[Any] = [None]
        backend, step, open_ranges = self._backend, self._step, self._open_backward

        def on_output_grad(grad: torch.Tensor) -> None:
            if cell[0] is None:
                cell[0] = backend.start(bhandle, step)
                open_ranges[id(cell)] = cell

        def on_input_grad(grad: torch.Tensor) -> None:
            rid = cell[0]
            if rid is not None and open_ranges.pop(id(cell), None) is not None:
                cell[0] = None
                backend.end(rid)

        out.register_hook(on_output_grad)
        inp.register_hook(on_input_grad)

    def _end_open_backward(self) -> None:
        if not self._open_backward:
            return
        for cell in list(self._open_backward.values()):
            rid, cell[0] = cell[0], None
            if rid is not None:
                self._backend.end(rid)
        self._open_backward.clear()

    # ------------------------------------------------------------------ for other parts

    @contextmanager
    def annotate(self, message: str, payload: int | None = None) -> Iterator[None]:
        """A range of your own (for example around a CUDA graph replay), in this callback's domain.

        Pushed only while the current step is annotated. ``message`` is registered once and reused.

        Example::

            nvtx_cb = next(cb for cb in trainer.callbacks if isinstance(cb, NVTXRangeCallback))
            with nvtx_cb.annotate("graph_replay"):
                graph.replay()
        """
        if not (self._on and self._active):
            yield
            return
        key = f"u:{message}"
        if key not in self._handles:
            self._handles[key] = self._backend.prepare(message, _USER_STYLE.color, _USER_STYLE.category)
        stack = self._thread_stack()
        self._backend.push(self._handles[key], self._step if payload is None else payload)
        stack.append(key)
        try:
            yield
        finally:
            while key in stack:
                top = stack.pop()
                self._backend.pop()
                if top == key:
                    break

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callbacks into each process: keep the configuration, not the run's state
        # (thread-locals, hooks, the backend's native handles are rebuilt in setup there).
        keep = ("options", "_schedule", "_ranks")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._backend = None
        self._reset()

    def __repr__(self) -> str:
        return (f"NVTXRangeCallback(steps={self.steps!r}, ranks={self.ranks!r}, domain={self.domain!r}, "
                f"module_ranges={self.module_ranges!r}, gc_ranges={self.gc_ranges!r})")
