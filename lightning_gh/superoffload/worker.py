"""The CPU updater: a thread that updates host buckets with a fused CPU AdamW (our kernel, :mod:`.cpu_adamw`, or
torch's), speculating before the step's clip/skip decision is known, and streams the weights back to the GPU.

The training thread hands it work through :meth:`CpuUpdater.submit` (a bucket whose gradients have landed) and
:meth:`CpuUpdater.finish` (the step's decision is posted); it waits for a bucket with :meth:`CpuUpdater.wait`.

Note [Speculative update and exact rollback]
    The worker may update a bucket before ``step()`` knows the global gradient norm, assuming the step will be
    neither clipped nor skipped. Such an update must be undoable bitwise, not by an algebraic inverse:

    * with two copies of the state (``rollback="auto"``, our kernel), the speculative update writes the *other*
      copy out of place and the bucket's current copy stays untouched; committing flips the two (:meth:`_flip`),
      undoing is free (the current copy is the pre-step state);
    * otherwise (``rollback="copy"``) the bucket's master weights, moments and step counters are copied aside
      first (:meth:`_backup`) and copied back on a rollback (:meth:`_restore`). While nothing is queued the
      worker makes the copies the next speculative updates will need, off the critical path.

    When the decision arrives, speculative buckets are committed, or restored and redone with the clipped
    gradients and the current hyper-parameters, or left restored (a skipped step), and their weights are copied
    back again, each bucket in the order the next forward needs it. Buckets the worker reaches after the decision
    is known are updated once, in place, with no copy. Whether a step speculates at all is decided once, at its
    first bucket, from the recent steps (:func:`~lightning_gh.superoffload.step.should_speculate`): a run clipped
    on almost every step stops speculating, so its CPU does each update once, after the decision, and makes no
    rollback copy. The result is identical to the non-speculative path: the same kernel on the same inputs.

    A bucket updated once its step's decision is known goes weights first where ``weights_first`` is on and our
    kernel is loaded (and the GPU does not share the update): its new weights are written, in the parameters'
    dtype, into a staging buffer and copied to the GPU, the bucket is ready, and its state is written in place when
    the step's end is reached (:meth:`CpuUpdater._work_finish`), in the order the next backward fills the buckets.
    The next backward's first gradient of a bucket waits for that (``Bucket.done``). See Note [Weights first,
    state after] in :mod:`.weights_first`.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from lightning_gh.profiling.offload_analysis import CPU_UPDATE_RANGE, UPDATE_WAIT_RANGE
from lightning_gh.superoffload.assist import DeviceAssist, SharedBuckets
from lightning_gh.superoffload.layout import Bucket, HostLayout, Slot
from lightning_gh.superoffload.step import SPECULATION_WINDOW, Decision, StepCtx, should_speculate
from lightning_gh.superoffload.weights_first import WRITEBACK_RANGE, StageRing

__all__ = ["CPU_UPDATE_RANGE", "UPDATE_WAIT_RANGE", "CpuUpdater", "worker_loop"]

# The profiler ranges around each bucket's CPU work (update, rollback, copies back) and around the training thread's
# wait for a bucket: named where the trace summary reads them (lightning_gh.profiling.offload_analysis).

Task = tuple[str, Bucket | None, StepCtx]


class CpuUpdater:
    """The CPU side of the pipeline: bucket updates, speculation, rollback and the copies back, on one thread.

    Args:
        layout: the host layout whose buckets it updates (and whose lock it takes while copying state).
        h2d_stream: the CUDA stream of the copies back, or ``None`` off CUDA.
        cpu_threads: threads of the CPU update.
        speculative: whether buckets may be updated before the step's decision is known.
        stats: the optimizer's ``stats`` dict, where the worker counts what it did.
        assist: the GPU's worker that shares the updates made once a step's decision is known, or ``None`` (see
            Note [Device-assisted update] in :mod:`.assist`).
        weights_first: a bucket updated once its step's decision is known sends its weights before its state is
            written (with our kernel and no ``assist``; see the module's Note).
    """

    def __init__(self, layout: HostLayout, h2d_stream: Any, cpu_threads: int, speculative: bool,
                 stats: dict[str, Any], assist: DeviceAssist | None = None, weights_first: bool = False) -> None:
        self.layout = layout
        self.weights_first = weights_first
        self._stage: StageRing | None = None  # made at the first bucket that goes weights first
        self.assist = assist
        self.h2d_stream = h2d_stream
        self.cpu_threads = cpu_threads
        self.speculative = speculative
        self.stats = stats
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        # whether each of the last decided steps invalidated speculation (see should_speculate)
        self._redone: deque[bool] = deque(maxlen=SPECULATION_WINDOW)
        self._uncounted: list[StepCtx] = []  # validated steps with no host work: their decision is counted here
        self._waiting_for_decision = False  # the worker is blocked until a step's decision is posted

    # ------------------------------------------------------------------ the training thread's side
    @property
    def will_speculate(self) -> bool:
        """Whether a step that starts now may speculate (its buckets marked speculative by the host plan), from the
        steps decided so far (:func:`~lightning_gh.superoffload.step.should_speculate`)."""
        return self.speculative and should_speculate(self._redone)

    def speculates(self, ctx: StepCtx) -> bool:
        """Whether step ``ctx``'s buckets may be updated before its decision: decided once per step, when the worker
        reaches its first bucket (every earlier step's decision is counted by then)."""
        if ctx.speculate is None:
            ctx.speculate = self.will_speculate
        return ctx.speculate

    @property
    def settled(self) -> bool:
        """Nothing the worker could run now is left: every queued task has run, or the worker waits for a step's
        decision (tests use this to have speculative updates finish before ``step()``)."""
        return self._queue.unfinished_tasks == 0 or self._waiting_for_decision

    def submit(self, b: Bucket, ctx: StepCtx) -> None:
        """Queue bucket ``b``'s update for step ``ctx`` (its gradients are on their way to the host)."""
        self._start()
        self._queue.put(("bucket", b, ctx))

    def finish(self, ctx: StepCtx) -> None:
        """Queue the end of step ``ctx``: resolve its speculative updates once its decision is posted."""
        self._start()
        self._queue.put(("finish", None, ctx))

    def count_later(self, ctx: StepCtx) -> None:
        """Count the decision of a validated step the worker has nothing to do for (all state on the GPU)."""
        self._uncounted.append(ctx)

    def count_decisions(self, block: bool) -> None:
        """Count the skipped and clipped steps the worker did not see; without ``block``, only those whose decision
        has reached the host already, so no step waits for it."""
        while self._uncounted:
            dec = self._uncounted[0].poll(block=block)
            if dec is None:
                return
            self.stats["last_grad_norm"] = self._uncounted.pop(0).norm
            self._count(dec)

    def _count(self, dec: Decision) -> None:
        if dec.skip:
            self.stats["skipped_steps"] += 1
        elif dec.coef is not None:
            self.stats["clipped_steps"] += 1

    def raise_error(self) -> None:
        """Re-raise, on the training thread, what made the worker fail."""
        if self._error is not None:
            err = self._error
            raise RuntimeError(f"HeterogeneousAdamW CPU worker failed: {type(err).__name__}: {err}") from err

    def wait(self, b: Bucket, state: bool = False) -> float:
        """Block until bucket ``b``'s update is committed (its weights; with ``state``, its host state too);
        returns the milliseconds waited."""
        flag = b.done if state else b.ready
        if flag.is_set():
            return 0.0
        t0 = time.perf_counter()
        with torch.profiler.record_function(UPDATE_WAIT_RANGE):
            while not flag.wait(0.05):
                self.raise_error()
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("HeterogeneousAdamW: the CPU worker stopped with a bucket still pending.")
        return (time.perf_counter() - t0) * 1e3

    def join(self) -> None:
        """Block until every queued task has run."""
        self.raise_error()
        if self._thread is not None:
            self._queue.join()
        self.raise_error()

    def close(self) -> None:
        """Stop the thread (after the tasks already queued), then the GPU's worker."""
        alive = False
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            alive, self._thread = self._thread.is_alive(), None
        if self.assist is not None:
            self.assist.close()
        if self._stage is not None and not alive:  # a worker still running may still write the ring: keep it
            if self.h2d_stream is not None:
                self.h2d_stream.synchronize()  # the last copies from the ring have read it
            self._stage.release()
            self._stage = None

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._queue.put(None)
        if getattr(self, "assist", None) is not None:
            self.assist.close()  # its thread holds the layout (and its page-locked buffers) until closed

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # The thread holds only a weak reference, so an updater nobody uses any more is collected (its
            # __del__ then stops the thread).
            self._thread = threading.Thread(target=worker_loop, args=(weakref.ref(self), self._queue),
                                            name="superoffload-cpu-adamw", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the worker thread
    def wait_for_decision(self, ctx: StepCtx) -> Decision:
        """Block the worker until step ``ctx``'s decision is known."""
        t0 = time.perf_counter()
        self._waiting_for_decision = True
        dec = ctx.poll(block=True)
        self._waiting_for_decision = False
        self._phase("wait_decision", t0)
        return dec

    def needs_decision(self, task: Task) -> bool:
        """Whether ``task`` cannot run before its step's decision is known: a bucket that will not be updated
        speculatively, the redo of one that was, or the end of the step."""
        kind, b, ctx = task
        if ctx.poll(block=False) is not None:
            return False
        return kind != "bucket" or not (self.speculates(ctx) and b.speculative)

    def setup_thread(self) -> None:
        torch.set_num_threads(self.cpu_threads)
        if self.layout.cuda:
            torch.cuda.set_device(self.layout.device)

    def run(self, task: Task) -> None:
        """Run one task; an exception is kept and re-raised on the training thread at its next call."""
        try:
            if self._error is None:
                kind, b, ctx = task
                with torch.no_grad():
                    if kind == "bucket":
                        self._work_bucket(b, ctx)
                    elif kind == "redo":
                        self._redo(b, ctx.poll(block=True))
                    else:
                        self._work_finish(ctx)
        except BaseException as e:  # surfaced on the main thread at the next step/forward
            self.fail(e)

    def run_shared(self, tasks: list[Task]) -> None:
        """Run one step's bucket updates, its decision known, together with the GPU: the GPU takes buckets from
        the front of the next forward's order, this thread from the back (see Note [Device-assisted update] in
        :mod:`.assist`); returns once both are done and the buckets' host state is final."""
        ctx = tasks[0][2]
        try:
            if self._error is not None:
                return
            dec = ctx.poll(block=True)
            self._resolve_speculation(ctx, dec)
            shared = SharedBuckets([b for _, b, _ in tasks])
            self.assist.start(shared, dec, ctx.result_event)
            while (b := shared.take_back()) is not None:
                self.run(("bucket", b, ctx))
            t0 = time.perf_counter()
            self.assist.wait()
            self._phase("wait_assist", t0)
        except BaseException as e:  # surfaced on the main thread at the next step/forward
            self.fail(e)

    def fail(self, error: BaseException) -> None:
        """Keep ``error`` for the training thread and release everyone waiting for a bucket."""
        self._error = error
        for bk in self.layout.buckets:
            bk.ready.set()
            bk.done.set()

    def _work_bucket(self, b: Bucket, ctx: StepCtx) -> None:
        t0 = time.perf_counter()
        if self.layout.cuda:
            b.d2h_event.synchronize()
        self._phase("wait_d2h", t0)
        speculate = self.speculates(ctx) and b.speculative
        t0 = time.perf_counter()
        self._waiting_for_decision = not speculate
        dec = ctx.poll(block=not speculate)
        self._waiting_for_decision = False
        self._phase("wait_decision", t0)
        t0 = time.perf_counter()  # CPU time only: waiting for gradients or the decision is not work
        b.speculated = dec is None
        with torch.profiler.record_function(CPU_UPDATE_RANGE):
            if dec is not None:
                self._resolve_speculation(ctx, dec)
                self._final_update(b, dec, ctx)
            elif b.alt_master is not None:  # speculate into the other copy; the current one is the undo
                self._update_other(b, ctx.hp, None)
                self._push(b, b.alt_master.tensor)
                ctx.spec.append(b)
                self.stats["speculative_buckets"] += 1
            else:  # speculate: assume no clip/skip; keep an exact copy to undo
                if not b.backup.fresh:
                    self._backup(b, "backup")
                self._update(b, ctx.hp, None)
                self._push(b)
                ctx.spec.append(b)
                self.stats["speculative_buckets"] += 1
        self._account(b, t0)

    def idle_work(self) -> bool:
        """With nothing queued, copy aside the state of the next bucket a speculative update will need, so
        the copy is off the critical path. Returns whether there was anything to do.

        Only buckets updated speculatively last step are copied: the others are likely to get the decision
        first again, and a copy nobody reads costs 24 B/parameter of host memory traffic, which slows the
        training loop's own thread (see docs/superoffload.md)."""
        if not self.will_speculate or self._error is not None:
            return False
        if not self.layout.lock.acquire(blocking=False):
            return False
        try:
            for b in list(self.layout.buckets):
                if (b.speculated and b.speculative and not b.backup.fresh and b.done.is_set() and b.ready.is_set()
                        and b.master_buf is not None and b.alt_master is None):
                    self._backup(b, "backup_idle")
                    self.stats["prefetched_backups"] += 1
                    return True
            return False
        finally:
            self.layout.lock.release()

    def _work_finish(self, ctx: StepCtx) -> None:
        dec = ctx.poll(block=True)
        t0 = time.perf_counter()
        self._resolve_speculation(ctx, dec)
        self._redone.append(dec.redo)
        self._count(dec)
        st = self.stats
        st["last_grad_norm"] = ctx.norm
        st["last_speculated"] = spec = bool(ctx.speculate)
        st["speculated_steps"] += spec
        st["finish_ms"] = (time.perf_counter() - t0) * 1e3
        # how long after step() posted its decision the step's last bucket was ready: the CPU work the next
        # forward may wait for
        st["last_cpu_after_step_ms"] = (time.perf_counter() - ctx.posted_t) * 1e3
        later, ctx.later = ctx.later, []
        for b in sorted(later, key=lambda b: b.index):  # the next backward's order: the first gradients first
            try:
                t0 = time.perf_counter()
                with torch.profiler.record_function(WRITEBACK_RANGE):
                    self._update(b, dec.hp, dec.coef)
                # not in the bucket's cpu_ms: the auto tail sizes by the CPU work the next forward waits for
                st["writeback_ms"] += (time.perf_counter() - t0) * 1e3
            finally:
                b.done.set()

    def _resolve_speculation(self, ctx: StepCtx, dec: Decision) -> None:
        """Commit, or undo and redo, the step's speculative updates now. See Note [Speculative update and exact
        rollback]."""
        redo = self.take_speculation(ctx, dec)
        for b in redo:
            self._redo(b, dec)

    def take_speculation(self, ctx: StepCtx, dec: Decision) -> list[Bucket]:
        """Commit the step's speculative updates that stand; return the buckets whose update must be redone
        (the caller redoes them with :meth:`run`, as ``("redo", bucket, ctx)`` tasks, in the order it likes)."""
        spec, ctx.spec = ctx.spec, []
        if dec.redo:
            return spec
        for b in spec:
            if b.alt_master is not None:
                self._flip(b)
            b.ready_t = time.perf_counter()
            b.ready.set()
        return []

    def _redo(self, b: Bucket, dec: Decision) -> None:
        """Undo a speculative update exactly and redo it with the decision's coefficient and hyper-parameters, or
        leave it undone (a skipped step), and copy the weights back."""
        t0 = time.perf_counter()
        self.stats["rollbacks"] += 1
        with torch.profiler.record_function(CPU_UPDATE_RANGE):
            if b.alt_master is not None:
                if dec.skip:
                    self._push(b)  # the current copy was never touched: put its weights back on the GPU
                else:
                    self._update_other(b, dec.hp, dec.coef)
                    self._push(b, b.alt_master.tensor)
                    self._flip(b)
            else:
                self._restore(b)
                if not dec.skip:
                    self._update(b, dec.hp, dec.coef)
                self._push(b)  # the redone (or restored) weights back on the GPU
        self._account(b, t0)
        b.ready_t = time.perf_counter()
        b.ready.set()

    def _final_update(self, b: Bucket, dec: Decision, ctx: StepCtx | None = None) -> None:
        # only a step validated after backward: without validation the one pass overlaps the backward
        if not dec.skip and b.active and ctx is not None and ctx.needs_validation and self._goes_weights_first():
            b.done.clear()  # before `ready`: the next backward's wait for the state sees it pending
            self._send_weights(b, dec)
            ctx.later.append(b)
        elif not dec.skip:
            self._update(b, dec.hp, dec.coef)
            self._push(b)
        b.ready_t = time.perf_counter()
        b.ready.set()

    def _goes_weights_first(self) -> bool:
        return self.weights_first and self.layout.kernel is not None and self.layout.staging and self.assist is None

    def _send_weights(self, b: Bucket, dec: Decision) -> None:
        """The first pass (see the module's Note): the bucket's new weights, in its parameters' dtype where they
        are all bf16 (else fp32), into the next staging buffer, and copied into the parameters."""
        from lightning_gh.superoffload.cpu_adamw import kernel_runs, weights_spans

        t0 = time.perf_counter()
        bf16 = all(s.param.dtype == torch.bfloat16 for s in b.active)
        if self._stage is None:  # sized for the largest bucket now (it grows if a larger one comes)
            self._stage = StageRing((2 if bf16 else 4) * max(bk.numel for bk in self.layout.buckets), self.layout.cuda)
        slot, out = self._stage.take(b.numel, torch.bfloat16 if bf16 else torch.float32)
        self._phase("wait_h2d", t0)
        t0 = time.perf_counter()
        n = b.numel
        cur = (b.master_buf.tensor, b.moments[:n], b.moments[n:])
        grad = b.grad_buf.tensor
        active = {s.index for s in b.active}
        for run in kernel_runs(s for s in b.slots if s.index in active):
            lo, hi = run[0].offset, run[-1].offset + run[-1].numel
            weights_spans(self.layout.kernel, tuple(c[lo:hi] for c in cur), grad[lo:hi], out[lo:hi],
                          [s.numel for s in run], float(run[0].step) + 1.0, dec.hp[run[0].group], dec.coef,
                          self.cpu_threads)
        self._phase("update", t0)
        self._push(b, out)
        self._stage.copied(slot, b.h2d_event if self.layout.cuda else None)

    def _account(self, b: Bucket, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        b.cpu_ms = ms if b.cpu_ms == 0.0 else 0.7 * b.cpu_ms + 0.3 * ms

    def _phase(self, name: str, t0: float) -> None:
        """Add the time since ``t0`` to the worker's cumulative time in ``name`` (``stats["cpu_phases_ms"]``)."""
        phases = self.stats["cpu_phases_ms"]
        phases[name] = phases.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ the update, its undo, the copies back
    def _update(self, b: Bucket, hp: list[dict[str, float]], coef: torch.Tensor | None) -> None:
        """Update the bucket's current copy of its state in place (our kernel where it is loaded, else torch's)."""
        t0 = time.perf_counter()
        if self.layout.cuda:
            b.h2d_event.synchronize()  # the previous copy back must have read the master weights
        self._phase("wait_h2d", t0)
        t0 = time.perf_counter()
        b.backup.fresh = False
        if self.layout.kernel is not None:
            # One kernel for every update, not torch's for some: the two thread pools would otherwise take turns
            # on the same cores, and ours reads bf16 gradients as they are.
            self._kernel_update(b, hp, coef, in_place=True)
            for s in b.active:
                s.step.add_(1)
            self._phase("update", t0)
            return
        by_group: dict[int, list[Slot]] = {}
        for s in b.active:
            by_group.setdefault(s.group, []).append(s)
        for gi, slots in by_group.items():
            h = hp[gi]
            grads = [s.grad for s in slots]
            if coef is not None:
                torch._foreach_mul_(grads, coef)
            steps = [s.step for s in slots]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_([s.master for s in slots], grads, [s.exp_avg for s in slots],
                                [s.exp_avg_sq for s in slots], [], steps, lr=h["lr"], beta1=h["beta1"],
                                beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False,
                                maximize=False)
        self._phase("update", t0)

    def _update_other(self, b: Bucket, hp: list[dict[str, float]], coef: torch.Tensor | None) -> None:
        """Write the bucket's updated state into its other copy (out of place, bitwise as ``_update`` in place);
        the current copy and the slots' ``step`` stay as they were until :meth:`_flip` commits."""
        t0 = time.perf_counter()
        if self.layout.cuda:
            b.h2d_event.synchronize()  # a copy back from the other copy may still be reading it
        self._phase("wait_h2d", t0)
        t0 = time.perf_counter()
        self._kernel_update(b, hp, coef, in_place=False)
        self._phase("update", t0)

    def _kernel_update(self, b: Bucket, hp: list[dict[str, float]], coef: torch.Tensor | None,
                       in_place: bool) -> None:
        """Our kernel's step over the bucket's slots with a gradient, from its current copy of the state into the
        same copy (``in_place``) or into the other one (slots without a gradient are then copied over unchanged)."""
        from lightning_gh.superoffload.cpu_adamw import kernel_runs, update_spans

        n = b.numel
        cur = (b.master_buf.tensor, b.moments[:n], b.moments[n:])
        out = cur if in_place else (b.alt_master.tensor, b.alt_moments[:n], b.alt_moments[n:])
        grad = b.grad_buf.tensor
        active = {s.index for s in b.active}
        if not in_place:  # slots without a gradient this step: their state carries over
            for s in b.slots:
                if s.index not in active:
                    lo, hi = s.offset, s.offset + s.numel
                    for o, c in zip(out, cur):
                        o[lo:hi].copy_(c[lo:hi])
        # runs of consecutive slots with a gradient (in offset order): one kernel call each
        for run in kernel_runs(s for s in b.slots if s.index in active):
            lo, hi = run[0].offset, run[-1].offset + run[-1].numel
            update_spans(self.layout.kernel, tuple(c[lo:hi] for c in cur), grad[lo:hi],
                         tuple(o[lo:hi] for o in out), [s.numel for s in run], float(run[0].step) + 1.0,
                         hp[run[0].group], coef, self.cpu_threads)

    def _flip(self, b: Bucket) -> None:
        """Commit an update written by :meth:`_update_other`: the other copy becomes the current one."""
        b.master_buf, b.alt_master = b.alt_master, b.master_buf
        b.moments, b.alt_moments = b.alt_moments, b.moments
        self.layout.bind_views(b, b.slots)
        for s in b.active:
            s.step.add_(1)
        b.backup.fresh = False

    def _backup(self, b: Bucket, phase: str) -> None:
        t0 = time.perf_counter()
        if self.layout.cuda:
            b.h2d_event.synchronize()  # a GPU-side update may still be copying the state back (see .assist)
        n = b.numel
        copy = b.backup
        if copy.tensor is None:
            copy.tensor = torch.empty(3 * n, dtype=torch.float32)
        copy.tensor[:n].copy_(b.master_buf.tensor)
        copy.tensor[n:].copy_(b.moments)
        copy.steps = {s.index: float(s.step) for s in b.slots}
        b.backup.fresh = True
        self._phase(phase, t0)

    def _restore(self, b: Bucket) -> None:
        t0 = time.perf_counter()
        if self.layout.cuda:
            b.h2d_event.synchronize()  # the speculative copy back may still read the master weights
        n = b.numel
        b.master_buf.tensor.copy_(b.backup.tensor[:n])
        b.moments.copy_(b.backup.tensor[n:])
        for s in b.slots:
            s.step.fill_(b.backup.steps[s.index])
        b.backup.fresh = True
        self._phase("restore", t0)

    def _push(self, b: Bucket, master: torch.Tensor | None = None) -> None:
        """Copy the bucket's master weights (its current copy, or ``master``: fp32, or the first pass's weights in
        the parameters' dtype) into the model's parameters."""
        t0 = time.perf_counter()
        src = b.master_buf.tensor if master is None else master
        if self.layout.cuda and b.active:
            with torch.cuda.stream(self.h2d_stream):
                # One host->GPU copy of the bucket's span of the flat master buffer and one multi-tensor copy
                # (with the cast) into the parameters: a few calls per bucket instead of three per parameter,
                # so the worker spends less time in Python, where it competes with the training loop's threads.
                # Allocated on the copy stream, so the caching allocator reuses it only after the copies ran.
                lo = min(s.offset for s in b.active)
                hi = max(s.offset + s.numel for s in b.active)
                stage = torch.empty(hi - lo, dtype=src.dtype, device=self.layout.device)
                stage.copy_(src[lo:hi], non_blocking=True)
                torch._foreach_copy_([s.param.data for s in b.active],
                                     [stage[s.offset - lo:s.offset - lo + s.numel].view(s.param.shape)
                                      for s in b.active])
                b.h2d_event.record(self.h2d_stream)
        elif self.layout.cuda:  # nothing to copy back; the event still orders the next forward's wait
            b.h2d_event.record(self.h2d_stream)
        else:
            for s in b.active:
                s.param.data.copy_(src[s.offset:s.offset + s.numel].view(s.param.shape))
        b.pushed = True
        self._phase("push", t0)


def _drain(q: queue.Queue, pending: list[Any]) -> None:
    """Move every task waiting in ``q`` to ``pending`` (each is marked done only once it has run)."""
    while True:
        try:
            pending.append(q.get_nowait())
        except queue.Empty:
            return


def next_task(pending: list[Task | None]) -> int:
    """Index in ``pending`` of the task to run next: the oldest, except that once a step's decision is known its
    queued bucket updates and redos run in the order the next forward needs them (the earliest layer first;
    gradients arrive last layer first), so the next forward's per-module waits can end while the CPU still
    updates later layers. Speculative updates keep the arrival order: the backward is still producing them. The
    order of updates of different buckets does not change any number, only how soon the forward may go on."""
    head = pending[0]
    if head is None or head[0] == "finish" or head[2].poll(block=False) is None:
        return 0
    ctx = head[2]
    run = 0
    while run < len(pending) and pending[run] is not None and pending[run][0] != "finish" and pending[run][2] is ctx:
        run += 1
    # buckets are numbered in gradient-arrival order (see HostLayout), so the forward needs the highest first
    return max(range(run), key=lambda j: pending[j][1].index)


def take_shared(updater: CpuUpdater, pending: list[Task | None]) -> list[Task]:
    """The bucket updates at the front of ``pending`` that the CPU and the GPU share (removed from ``pending``):
    a run of two or more of one step whose decision is known and does not skip it, with no redo pending, when the
    updater has a GPU worker (see Note [Device-assisted update] in :mod:`.assist`); else none."""
    head = pending[0] if pending else None
    if updater.assist is None or head is None or head[0] != "bucket":
        return []
    ctx = head[2]
    dec = ctx.poll(block=False)
    if dec is None or dec.skip:
        return []
    run = 0
    while run < len(pending) and pending[run] is not None and pending[run][0] == "bucket" and pending[run][2] is ctx:
        run += 1
    if run < 2:
        return []
    shared, pending[:run] = pending[:run], []
    return shared


def _prepare(updater: CpuUpdater, q: queue.Queue, pending: list[Any]) -> None:
    """Before choosing the next task: when it needs its step's decision, wait for it and take in what was queued
    meanwhile (the rest of the step); once the decision is known, commit the step's speculative updates or queue
    their redos (worker-made ``("redo", bucket, ctx)`` tasks, not counted in ``q``)."""
    head = pending[0]
    if head is None:
        return
    ctx = head[2]
    try:
        if updater.needs_decision(head):
            updater.wait_for_decision(ctx)
            _drain(q, pending)
        dec = ctx.poll(block=False)
        if dec is not None and ctx.spec:
            pending[:0] = [("redo", b, ctx) for b in updater.take_speculation(ctx, dec)]
    except BaseException as e:  # surfaced on the main thread at the next step/forward
        updater.fail(e)


def worker_loop(wself: Callable[[], CpuUpdater | None], q: queue.Queue) -> None:
    """The CPU update thread: runs queued tasks (see :func:`next_task` for the order) until it gets ``None`` or its
    updater is gone."""
    updater = wself()
    if updater is None:
        return
    updater.setup_thread()
    del updater
    pending: list[Any] = []
    try:
        while True:
            _drain(q, pending)
            if not pending:
                updater = wself()
                busy = updater is not None and updater.idle_work()
                del updater
                if busy:
                    continue
                pending.append(q.get())
                _drain(q, pending)
            updater = wself()
            if updater is None:
                return
            _prepare(updater, q, pending)
            shared = take_shared(updater, pending)
            if shared:
                try:
                    updater.run_shared(shared)
                finally:
                    del updater
                    for _ in shared:
                        q.task_done()
                continue
            task = pending.pop(next_task(pending))
            try:
                if task is None:
                    return
                updater.run(task)
            finally:
                del updater
                if task is None or task[0] != "redo":  # the worker's own redo tasks were never in the queue
                    q.task_done()
    finally:
        for task in pending:  # never run (the thread is stopping): release anyone joining the queue
            if task is None or task[0] != "redo":
                q.task_done()
