"""CUDAGraphCapture: capture Lightning's whole training step once, then replay it every step.

When a small model's step is launch-bound, the GPU waits on Python between kernels. A CUDA graph of the
whole step (forward, loss, backward, gradient clipping, optimizer update) replays all of it with one launch.

How a fit goes with this callback (single GPU, automatic optimization):

1. ``on_train_start`` (after a resumed run's optimizer state is loaded): check the configuration
   (:func:`~lightning_gh.graphs.detect.setup_findings`), switch the optimizer to capturable state with a
   device-tensor learning rate (:func:`~lightning_gh.graphs.optim.make_capturable`), and wrap three public
   LightningModule hooks on the instance: ``optimizer_step`` (where Lightning runs the whole step: closure with
   ``training_step``, ``zero_grad`` and ``backward``, then clipping, then ``optimizer.step``), ``training_step``
   (to feed it the static batch) and ``log`` (to record calls made while capturing). Hugging Face ``transformers``
   models inside the module get ``config.use_cache=False`` for the training steps (:mod:`~lightning_gh.graphs.hf`).
2. Warm-up: ``warmup_steps`` eager steps on a side stream (lazy initialisation, cuBLAS workspaces and the
   optimizer state all happen outside the graph). The last one is a *rehearsal*: it runs on the static input
   buffers with ``self.log`` recorded and CUDA's sync debug mode on, so anything uncapturable (a host sync, a
   Python number logged, a learning rate assigned inside the step) is found with its file and line while the
   step still runs correctly.
3. Capture: the next step with the same batch shapes runs Lightning's ``optimizer_step`` inside
   ``torch.cuda.graph`` (side stream, ``capture_error_mode="thread_local"`` so the pin-memory thread may keep
   working, autocast weight cache off), then replays it once for that batch.
4. Every later step: copy the batch into the static inputs, replay, re-issue the recorded ``self.log`` calls
   (with this step's values), hand the loss to Lightning's loop. A batch of another shape (the last, smaller
   batch of an epoch) runs eagerly and is counted; its gradients are copied into the captured gradient tensors,
   which ``.grad`` keeps pointing at. Before each replay the optimizer is checked: a float
   assigned to ``param_group["lr"]`` is moved into the lr tensor; a state replaced by ``load_state_dict`` is
   copied back into the captured tensors (restore in place); a changed baked-in hyperparameter triggers a
   recapture.
5. Anything that cannot be captured produces ONE warning naming the cause, and the run continues eagerly.

Inside a replayed step, the hooks Lightning calls within the step (``on_before_zero_grad``,
``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``)
ran once, at capture: their GPU work is replayed, their Python is not, and what they ``self.log`` is
re-issued with each replay's values. Hooks outside the step (``on_train_batch_start/end``, validation,
checkpointing, LR schedulers) run as usual.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_gh import compat
from lightning_gh._lightning import current_hook, log_to_loggers, set_closure_result
from lightning_gh._options import resolve
from lightning_gh._util import warn_once
from lightning_gh.graphs.buffers import StaticInputs, UnsupportedBatch, batch_signature
from lightning_gh.graphs.detect import (
    Finding,
    SyncMonitor,
    combine,
    dynamic_shape_finding,
    is_library_file,
    setup_findings,
    sync_finding,
)
from lightning_gh.graphs.hf import TrainingKVCacheOff
from lightning_gh.graphs.logs import LogRecorder, detached
from lightning_gh.graphs.optim import (
    CapturableOptimizer,
    OptimizerGuard,
    live_tensors,
    make_capturable,
    move_lr_into_tensors,
    reassigned_lr_groups,
)
from lightning_gh.graphs.options import GraphCaptureOptions
from lightning_gh.graphs.report import GraphReport, GraphState

__all__ = ["CUDAGraphCapture", "GraphCaptureError", "GraphCaptureOptions", "GraphReport", "GraphState"]

_WARMUP, _READY, _CAPTURED, _EAGER, _OFF = (GraphState.WARMING_UP, GraphState.REHEARSED, GraphState.CAPTURED,
                                            GraphState.EAGER, GraphState.OFF)
# After warm-up, how many more steps may pass without two consecutive batches of one shape.
_SHAPE_PATIENCE = 8
_MISSING = object()
_NOTHING = object()


class GraphCaptureError(RuntimeError):
    """Raised instead of falling back to eager when ``CUDAGraphCapture(strict=True)`` cannot capture."""


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    """Autocast's weight-cast cache would hand a capture tensors cast outside it; autocast regions that do not
    set ``cache_enabled`` themselves take this global default (Lightning's own already pass False)."""
    prev = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(prev)


def _fresh_output(output: Any) -> Any:
    """The step output with every tensor that the next replay overwrites cloned. Lightning's loop already makes a
    new tensor of the loss (it divides by the accumulation factor), so only the extra entries are cloned."""
    if isinstance(output, Mapping):
        return type(output)((k, v.clone() if isinstance(v, Tensor) and k != "loss" else v) for k, v in output.items())
    return output


def _output_finding(output: Any) -> Finding | None:
    if output is _NOTHING:
        return Finding("no-training-step", "optimizer_step did not run training_step (a custom optimizer_step that "
                                           "skips the closure cannot be captured)")
    if output is None:
        return Finding("skipped-step", "training_step returned None (a skipped step); a graph cannot skip")
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor) or loss.device.type != "cuda":
        return Finding("loss", f"training_step returned a loss of type {type(loss).__name__} on "
                               f"{getattr(loss, 'device', 'the host')}; a captured step needs a CUDA tensor")
    return None


def _pool_segments(graph: torch.cuda.CUDAGraph) -> list[tuple[int, int]] | None:
    """``(start, end)`` address ranges of the segments in the graph's private memory pool (None if unknown)."""
    try:
        pool = tuple(graph.pool())
        return [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == pool]
    except Exception:  # an allocator without snapshots: the report says "unknown size"
        return None


def _frozen_logs(recorder: LogRecorder, segments: list[tuple[int, int]], live: Iterable[Tensor]) -> list[str]:
    """Names of logged tensors that the graph neither computes (outside its pool) nor keeps up to date in place
    (not on the storage of a ``live`` tensor): a replay would leave them at their capture-time value.

    Args:
        recorder: the ``self.log`` calls recorded during the capture.
        segments: ``(start, end)`` addresses of the graph's pool (:func:`_pool_segments`).
        live: tensors changed in place on every step: the module's parameters and buffers, the optimizer's lr
            tensors (filled before each replay) and state tensors (updated by the step).
    """
    own = {t.untyped_storage().data_ptr() for t in live}
    out = []
    for name, t in recorder.logged_tensors():
        ptr = t.untyped_storage().data_ptr()
        if ptr in own or any(a <= ptr < b for a, b in segments):
            continue
        out.append(name)
    return out


def _capture_failure(e: BaseException) -> Finding:
    """A finding from an exception raised while capturing. The error that reaches us is often the graph's own
    ``capture_end`` complaining about "a previous error during capture"; the cause is the first one in the chain."""
    root = e
    while root.__context__ is not None and root.__context__ is not root:
        root = root.__context__
    text = str(root).strip().splitlines()
    first = text[0][:300] if text else ""
    frames = traceback.extract_tb(root.__traceback__)
    user = next((f for f in reversed(frames) if not is_library_file(f.filename)), None)
    where = f" at {os.path.basename(user.filename)}:{user.lineno} in {user.name}: `{(user.line or '').strip()}`" \
        if user is not None else ""
    return Finding("capture-failed", f"capturing the step failed with {type(root).__name__}: {first}{where} (a host "
                                     "synchronization or a host-memory copy inside the step cannot be captured)")


class CUDAGraphCapture(Callback):
    r"""Capture the whole training step (forward, loss, backward, clipping, optimizer) once and replay it.

    Works with an unchanged LightningModule whose ``training_step`` returns the loss (and may ``self.log``
    tensors) and whose ``configure_optimizers`` returns Adam or AdamW, with or without an LR scheduler that
    changes the learning rate only. ``Trainer(gradient_clip_val=...)``, ``precision="bf16-mixed"``, validation
    and checkpoint save/resume work. Off a CUDA GPU it warns once and the run is exactly the plain run. What
    cannot be captured (a host sync such as ``.item()`` in the step, batch shapes that change every step, an
    fp16 ``GradScaler``, gradient accumulation, multi-GPU strategies, other optimizers, a scheduler that cycles
    the momentum, the FP8 precision plugins, whose combination with capture is not verified yet) is reported
    in one warning naming the cause, and the run continues eagerly, exactly Lightning's eager step (every wrapper
    of this callback removed, the optimizer put back). :attr:`report` says what happened (:class:`GraphReport`).

    Hugging Face ``transformers`` models inside the LightningModule train without their KV cache
    (``config.use_cache=False`` during training steps, said in one log line; the user's value is back for
    validation and after the fit): a training loss never reads the cache, and building it can sync the host
    (Mistral's sliding-window cache), which would make the step uncapturable. This is the one change made off a
    CUDA GPU or after a decline too; it leaves the losses unchanged (:mod:`lightning_gh.graphs.hf`).

    Args:
        warmup_steps, detect_syncs, max_recaptures, strict, verbose: the options, each documented once in
            :class:`~lightning_gh.graphs.options.GraphCaptureOptions` (defaults there too).
        options: the same options as one :class:`GraphCaptureOptions`, instead of the keywords (never both).

    Raises:
        TypeError: an argument of the wrong type; ``options`` together with a keyword that differs from its default.
        ValueError: a value out of range (the message names the argument, the value and what is allowed).

    Example::

        import lightning as L
        import lightning_gh as lgh
        from lightning_gh.demo import LlamaLM, MarkovDataModule

        model = LlamaLM.from_preset("small")
        graphs = lgh.CUDAGraphCapture(warmup_steps=3)
        trainer = L.Trainer(precision="bf16-mixed", max_steps=200, gradient_clip_val=1.0, callbacks=[graphs])
        trainer.fit(model, MarkovDataModule.for_model(model, pin_memory=True))
        print(graphs.report.summary())
    """

    lgh_part = "CUDAGraphCapture"

    def __init__(self, warmup_steps: int = GraphCaptureOptions.warmup_steps, *,
                 detect_syncs: bool = GraphCaptureOptions.detect_syncs,
                 max_recaptures: int = GraphCaptureOptions.max_recaptures, strict: bool = GraphCaptureOptions.strict,
                 verbose: bool = GraphCaptureOptions.verbose, options: GraphCaptureOptions | None = None) -> None:
        self.options = resolve(GraphCaptureOptions, options, "CUDAGraphCapture", warmup_steps=warmup_steps,
                               detect_syncs=detect_syncs, max_recaptures=max_recaptures, strict=strict,
                               verbose=verbose)
        self.report = GraphReport()
        self._cache_off: TrainingKVCacheOff | None = None
        self._reset()

    # The options, read-only (set them through the constructor or ``options=``).
    warmup_steps = property(lambda self: self.options.warmup_steps, doc="See :attr:`GraphCaptureOptions.warmup_steps`.")
    detect_syncs = property(lambda self: self.options.detect_syncs, doc="See :attr:`GraphCaptureOptions.detect_syncs`.")
    max_recaptures = property(lambda self: self.options.max_recaptures,
                              doc="See :attr:`GraphCaptureOptions.max_recaptures`.")
    strict = property(lambda self: self.options.strict, doc="See :attr:`GraphCaptureOptions.strict`.")
    verbose = property(lambda self: self.options.verbose, doc="See :attr:`GraphCaptureOptions.verbose`.")

    # ----------------------------------------------------------------------------------------------------------
    # per-fit state

    def _reset(self) -> None:
        self._phase = _OFF
        self._replayed_now = False
        self._device = torch.device("cpu")
        self._trainer: pl.Trainer | None = None
        self._module: pl.LightningModule | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._capturable: CapturableOptimizer | None = None
        self._saved_attrs: dict[str, Any] = {}
        self._original_log: Callable[..., Any] | None = None
        self._side: torch.cuda.Stream | None = None
        self._batch: Any = None
        self._signatures: list[tuple] = []
        self._static: StaticInputs | None = None
        self._recorder: LogRecorder | None = None
        self._redirect: Any = None
        self._last_output: Any = _NOTHING
        self._release_graph()

    def _release_graph(self) -> None:
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_output: Any = None
        self._captured_logs: LogRecorder | None = None
        self._static_grads: list[tuple[Tensor, Tensor | None]] = []
        self._grads_to_repoint: list[tuple[Tensor, Tensor | None]] = []
        self._guard: OptimizerGuard | None = None

    # ----------------------------------------------------------------------------------------------------------
    # Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            compat.check(trainer, self.lgh_part)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_fit_start: Lightning loads the optimizer and scheduler state of a resumed run after on_fit_start,
        # and load_state_dict would put float learning rates and capturable=False back.
        self._uninstall()
        self._reset()
        self.report = GraphReport()
        self._train_without_kv_cache(pl_module)
        finding = combine(setup_findings(trainer, pl_module))
        if finding is not None and finding.cause == "no-cuda":
            self.report.reason = "no CUDA GPU"
            if pl.utilities.rank_zero_only.rank == 0:  # once per callback, on rank 0
                warn_once(f"graphs:no-cuda:{id(self)}", "CUDAGraphCapture: no CUDA GPU is available, so nothing is "
                          "captured; the run is the plain eager run.")
            return
        if finding is not None:
            self._decline(finding)
            return
        self._trainer, self._module, self._device = trainer, pl_module, pl_module.device
        self._optimizer = trainer.optimizers[0]
        self._capturable = make_capturable(self._optimizer)
        self._install(pl_module)
        self._side = torch.cuda.Stream(device=self._device)
        self._phase = self.report.state = _WARMUP

    def _train_without_kv_cache(self, pl_module: pl.LightningModule) -> None:
        # Training needs no KV cache, and building one can sync the host (Mistral's sliding-window cache), which
        # would make the step uncapturable. Done off-GPU too and kept after a decline: losses are unchanged and the
        # step only gets cheaper. Validation and the end of the fit get the user's setting back (generation).
        self._restore_kv_cache()
        self._cache_off = TrainingKVCacheOff.find(pl_module)
        if self._cache_off is not None:
            self._cache_off.disable()
            rank_zero_info(self._cache_off.message())

    def _restore_kv_cache(self) -> None:
        if self._cache_off is not None:
            self._cache_off.restore()
            self._cache_off = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cache_off is not None:
            self._cache_off.restore()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cache_off is not None:
            self._cache_off.disable()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch = batch

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.report.captures and not self._replayed_now:
            self.report.eager_steps += 1
        self._replayed_now = False
        self._batch = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # Write the checkpoint the plain run would write: float learning rates, original optimizer flags. A resume
        # (with or without this callback) then starts from ordinary state, converted again when its training starts.
        if self._capturable is None:
            return
        for state in checkpoint.get("optimizer_states", []):
            self._capturable.plain_state_dict(state)
        for sched in checkpoint.get("lr_schedulers", []):
            for k, v in list(sched.items()):
                if isinstance(v, list) and any(isinstance(x, Tensor) for x in v):
                    sched[k] = [float(x) if isinstance(x, Tensor) and x.numel() == 1 else x for x in v]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Once per fit, not per step: the counts are a run's verdict, and logging per step would cost a call per
        # logger on the replayed path.
        if self.report.state != _OFF:
            log_to_loggers(trainer, {"lgh/graph_replayed_steps": float(self.report.replayed_steps),
                                     "lgh/graph_eager_steps": float(self.report.eager_steps)})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verbose and self.report.state != _OFF:
            rank_zero_info(self.report.summary())

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()
            self._restore_kv_cache()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish()
        self._restore_kv_cache()

    def _finish(self) -> None:
        self._uninstall()
        if self._capturable is not None:
            self._capturable.restore()
            self._capturable = None
        self._release_graph()
        self._static = None
        self._batch = None

    # ----------------------------------------------------------------------------------------------------------
    # wrapping the LightningModule's public hooks on the instance

    def _install(self, pl_module: pl.LightningModule) -> None:
        makers = {"optimizer_step": self._wrap_optimizer_step, "training_step": self._wrap_training_step,
                  "log": self._wrap_log}
        for name, make in makers.items():
            self._saved_attrs[name] = pl_module.__dict__.get(name, _MISSING)
            original = getattr(pl_module, name)
            if name == "log":
                self._original_log = original
            setattr(pl_module, name, make(original))

    def _uninstall(self) -> None:
        module = self._module
        if module is None:
            return
        for name, saved in self._saved_attrs.items():
            if saved is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, saved)
        self._saved_attrs = {}

    def _wrap_optimizer_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def optimizer_step(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None,
                           *args: Any, **kwargs: Any) -> Any:
            def run() -> Any:
                return original(epoch, batch_idx, optimizer, optimizer_closure, *args, **kwargs)

            if self._phase in (_WARMUP, _READY):
                return self._warmup_step(run, optimizer_closure)
            if self._phase == _CAPTURED:
                return self._captured_step(run, optimizer_closure)
            return run()

        return optimizer_step

    def _wrap_training_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            static = self._redirect
            if static is None:
                return original(*args, **kwargs)
            if args:
                args = (static, *args[1:])
            else:
                kwargs = {**kwargs, "batch": static}
            out = original(*args, **kwargs)
            self._last_output = out
            return out

        return training_step

    def _wrap_log(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def log(*args: Any, **kwargs: Any) -> None:
            recorder = self._recorder
            if recorder is None:
                return original(*args, **kwargs)
            assert self._module is not None
            recorder.record(current_hook(self._module), args, kwargs)
            return None

        return log

    @contextlib.contextmanager
    def _capturing(self, recorder: LogRecorder) -> Iterator[None]:
        assert self._static is not None
        self._recorder, self._redirect, self._last_output = recorder, self._static.batch, _NOTHING
        try:
            yield
        finally:
            self._recorder = self._redirect = None

    # ----------------------------------------------------------------------------------------------------------
    # the step

    def _on_side_stream(self, fn: Callable[[], Any]) -> Any:
        main = torch.cuda.current_stream(self._device)
        assert self._side is not None
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            out = fn()
        main.wait_stream(self._side)
        return out

    def _live_tensors(self) -> list[Tensor]:
        """Tensors kept up to date in place on every step (see :func:`_frozen_logs`)."""
        assert self._module is not None and self._capturable is not None
        return [*self._module.parameters(), *self._module.buffers(),
                *live_tensors(self._capturable.optimizer, self._capturable.lr_tensors)]

    @staticmethod
    def _storages(tensors: Iterable[Tensor]) -> frozenset[int]:
        return frozenset(t.untyped_storage().data_ptr() for t in tensors)

    def _lr_in_step_finding(self) -> Finding | None:
        """After a rehearsed or captured step: a learning rate assigned inside it, which a graph would freeze."""
        assert self._capturable is not None
        groups = reassigned_lr_groups(self._capturable.optimizer.param_groups, self._capturable.lr_tensors)
        if not groups:
            return None
        return Finding("lr-in-step", f"param group {groups[0]}'s learning rate is assigned a new value inside the "
                                     "step (e.g. in optimizer_step); a graph would freeze it: use an LR scheduler, "
                                     "or fill_ the lr tensor in place")

    def _warmup_step(self, run: Callable[[], Any], closure: Any) -> Any:
        assert self._capturable is not None
        move_lr_into_tensors(self._capturable.optimizer.param_groups, self._capturable.lr_tensors)
        try:
            sig = batch_signature(self._batch)
        except UnsupportedBatch as e:
            self._give_up(Finding("batch", str(e)))
            self.report.warmup_steps += 1
            return run()
        self._signatures.append(sig)
        sigs = self._signatures
        if self._phase == _READY and self._static is not None and sig == self._static.signature:
            return self._capture(run, closure)
        if self._phase == _WARMUP and len(sigs) >= self.warmup_steps and sigs[-2] == sig:
            return self._rehearse(run)
        self.report.warmup_steps += 1
        if len(sigs) >= self.warmup_steps + _SHAPE_PATIENCE:
            self._give_up(dynamic_shape_finding(sigs[-(self.warmup_steps + _SHAPE_PATIENCE):]))
            return run()
        return self._on_side_stream(run)

    def _rehearse(self, run: Callable[[], Any]) -> Any:
        """One eager step exactly as it will be captured, with everything uncapturable looked for."""
        batch = self._batch
        self._static = StaticInputs(batch)
        assert self._original_log is not None and self._module is not None
        recorder = LogRecorder(self._original_log, snapshot=self._storages(self._live_tensors()))
        monitor = SyncMonitor(enabled=self.detect_syncs)

        def step() -> Any:
            assert self._static is not None
            self._static.copy_from(batch)
            return run()

        with self._capturing(recorder), _autocast_cache_off(), monitor:
            out = self._on_side_stream(step)
            output = detached(self._last_output)
        self._last_output = _NOTHING
        recorder.reissue(self._module, self._original_log)
        self.report.warmup_steps += 1
        findings = [sync_finding(monitor.events), _output_finding(output)]
        findings += [Finding("logged-value", m) for m in recorder.findings(self._device)]
        findings.append(self._lr_in_step_finding())
        finding = combine([f for f in findings if f is not None])
        if finding is not None:
            self._give_up(finding)
        else:
            self._phase = self.report.state = _READY
        return out

    def _capture(self, run: Callable[[], Any], closure: Any) -> Any:
        assert self._static is not None and self._original_log is not None and self._capturable is not None
        live = self._live_tensors()
        recorder = LogRecorder(self._original_log, snapshot=self._storages(live))
        graph = torch.cuda.CUDAGraph()
        self._static.copy_from(self._batch)
        t0 = time.perf_counter()
        try:
            # The outer stream context puts the main stream back even when capture_end raises.
            with self._capturing(recorder), _autocast_cache_off(), torch.cuda.stream(self._side):
                with torch.cuda.graph(graph, stream=self._side, capture_error_mode="thread_local"):
                    run()
                # Detached: the captured loss needs no autograd graph, and holding one would keep the AccumulateGrad
                # nodes made on the capture stream alive into later eager steps on the main stream.
                output = detached(self._last_output)
                self._last_output = _NOTHING
        except Exception as e:  # a capture that fails has executed nothing: run the step eagerly
            del graph
            self._give_up(_capture_failure(e))
            self.report.warmup_steps += 1
            return run()
        problem = _output_finding(output)
        segments = _pool_segments(graph)
        frozen = []
        if segments is not None:
            frozen = _frozen_logs(recorder, segments, live)
        if problem is None and frozen:
            problem = Finding("logged-value", f"self.log({frozen[0]!r}) gets a tensor that the step does not compute "
                                              "(made before the step, e.g. by scheduler.get_last_lr()); a replay would "
                                              "keep logging its capture-time value (log a value computed in the step; "
                                              "for the learning rate, the optimizer's param_groups[i]['lr'] or "
                                              "LearningRateMonitor)")
        if problem is None:
            problem = self._lr_in_step_finding()
        if problem is not None:
            del graph
            self._give_up(problem)
            self.report.warmup_steps += 1
            return run()
        self.report.capture_ms = (time.perf_counter() - t0) * 1e3
        self._graph = graph
        self._static_output = output
        self._captured_logs = recorder
        opt = self._capturable.optimizer
        self._static_grads = [(p, p.grad) for g in opt.param_groups for p in g["params"]]
        self._guard = OptimizerGuard(opt, self._capturable.lr_tensors)
        self.report.captures += 1
        self.report.pool_bytes = sum(b - a for a, b in segments) if segments is not None else None
        self._phase = self.report.state = _CAPTURED
        return self._replay(closure)

    def _replay(self, closure: Any) -> None:
        assert self._static is not None and self._graph is not None and self._captured_logs is not None
        assert self._module is not None and self._trainer is not None and self._original_log is not None
        self._static.copy_from(self._batch)
        self._graph.replay()
        if self._grads_to_repoint:
            for p, g in self._grads_to_repoint:
                p.grad = g
            self._grads_to_repoint = []
        self._captured_logs.reissue(self._module, self._original_log)
        set_closure_result(closure, _fresh_output(self._static_output), self._trainer.accumulate_grad_batches)
        self.report.replayed_steps += 1
        self._replayed_now = True

    def _captured_step(self, run: Callable[[], Any], closure: Any) -> Any:
        assert self._static is not None and self._guard is not None
        diff = self._static.difference(self._batch)
        if diff is not None:
            return self._eager_step(run, f"batch differs from the captured one ({diff})")
        check = self._guard.check()
        for what in check.repaired:
            self.report.repairs[what] = self.report.repairs.get(what, 0) + 1
        if check.action == "recapture":
            if self.report.captures > self.max_recaptures:
                self._give_up(Finding("recapture-limit", f"{check.reason}, and the graph was already captured "
                                                         f"{self.report.captures} times (max_recaptures="
                                                         f"{self.max_recaptures})"))
                return run()
            self._release_graph()
            return self._capture(run, closure)
        if check.action == "eager":
            self._give_up(Finding("optimizer-state", check.reason))
            return run()
        return self._replay(closure)

    def _eager_step(self, run: Callable[[], Any], reason: str) -> Any:
        self.report.fallbacks[reason] = self.report.fallbacks.get(reason, 0) + 1
        try:
            return run()
        finally:
            self._adopt_eager_grads()

    def _adopt_eager_grads(self) -> None:
        """After an eager step ``p.grad`` holds that step's fresh gradients, while the graph writes the captured
        ones. Copy the eager values into the captured tensors and point ``p.grad`` back at them, so code reading
        ``.grad`` now sees this step's gradients and after each later replay sees that replay's. A parameter whose
        gradient is None on one side keeps the eager value (None included) until the next replay re-points it."""
        later = []
        for p, g in self._static_grads:
            eager = p.grad
            if eager is g:  # zero_grad(set_to_none=False) accumulated into the captured tensor itself
                continue
            if eager is not None and g is not None:
                g.copy_(eager)
                p.grad = g
            else:
                later.append((p, g))
        self._grads_to_repoint = later

    # ----------------------------------------------------------------------------------------------------------
    # giving up

    def _message(self, finding: Finding) -> str:
        return f"CUDAGraphCapture: not capturing the training step: {finding.message.rstrip('.')}. " \
               "The run continues eagerly."

    def _decline(self, finding: Finding) -> None:
        """At fit start, before anything was changed."""
        self.report.state, self.report.reason = _EAGER, finding.message
        message = self._message(finding)
        if self.strict:
            raise GraphCaptureError(message)
        rank_zero_warn(message)

    def _give_up(self, finding: Finding) -> None:
        """During the fit: undo the conversion, unwrap the hooks, and let every later step run eagerly."""
        self._phase = self.report.state = _EAGER
        self.report.reason = finding.message
        self._finish()
        message = self._message(finding)
        if self.strict:
            raise GraphCaptureError(message)
        rank_zero_warn(message)
