"""The CPU worker: a thread that updates host buckets with a fused CPU AdamW (our kernel, :mod:`.cpu_adamw`, or
torch's), speculating before the step's clip/skip decision is known and undoing a speculative update exactly when
it must be redone.

The worker waits for a bucket's gradient copy, updates its fp32 master weights and moments, and streams the
weights back to the GPU on a second stream. With two copies of the state (``rollback="auto"``) a speculative
update writes the other copy and committing flips them; otherwise it copies the bucket's state aside first, and
while nothing is queued makes the copies the next speculative updates will need. When ``step()`` posts the
decision (:class:`Decision`), speculative buckets are committed, or undone bitwise and redone with the clipped
gradients, or left undone (skipped step).

:class:`WorkerMixin` is that part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW`; :func:`worker_loop`
is the thread's body.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gh.superoffload.layout import Bucket, Slot

__all__ = ["Decision", "StepCtx", "WorkerMixin", "worker_loop"]


@dataclass
class Decision:
    """What ``step()`` decided for one step, once the global gradient norm is known."""

    skip: bool
    coef: torch.Tensor | None  # clip multiplier (fp32, 0-dim, CPU) or None when no clipping applies
    hp: list[dict[str, float]]
    redo: bool  # speculative results are invalid (clip, skip or hyper-parameters changed)


class StepCtx:
    """What the worker knows about one optimizer step."""

    def __init__(self, step_id: int, hp: list[dict[str, float]], needs_validation: bool) -> None:
        self.id = step_id
        self.hp = hp
        self.needs_validation = needs_validation
        self.decision: Decision | None = None if needs_validation else Decision(False, None, hp, False)
        self.posted = threading.Event()
        self.spec: list[_Bucket] = []
        self.arrival: list[int] = []
        # filled by step() before `posted` is set
        self.result_host: torch.Tensor | None = None  # [total_norm, clip_coef]
        self.result_event: Any = None
        self.hp_now: list[dict[str, float]] = hp
        self.max_norm: float | None = None
        self.skip_nonfinite = True


class WorkerMixin:
    """Runs the CPU side of the pipeline: bucket updates, speculation, rollback and the copies back.

    A part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW`, which holds the state these methods use
    (buckets, streams, the task queue, ``stats``); the worker thread calls them through a weak reference.
    """

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            # The thread holds only a weak reference, so an optimizer nobody uses any more is collected
            # (its __del__ then stops the thread).
            self._worker = threading.Thread(target=worker_loop, args=(weakref.ref(self), self._queue),
                                            name="superoffload-cpu-adamw", daemon=True)
            self._worker.start()

    def _raise_worker_error(self) -> None:
        if self._worker_error is not None:
            err = self._worker_error
            raise RuntimeError(f"HeterogeneousAdamW CPU worker failed: {type(err).__name__}: {err}") from err

    def _worker_setup(self) -> None:
        torch.set_num_threads(self.cpu_threads)
        if self._cuda:
            torch.cuda.set_device(self.device)

    def _worker_task(self, task: tuple[str, Bucket | None, StepCtx]) -> None:
        try:
            if self._worker_error is None:
                kind, b, ctx = task
                with torch.no_grad():
                    if kind == "bucket":
                        self._work_bucket(b, ctx)
                    else:
                        self._work_finish(ctx)
        except BaseException as e:  # surfaced on the main thread at the next step/forward
            self._worker_error = e
            for bk in self._buckets:
                bk.ready.set()

    def _poll_decision(self, ctx: StepCtx, block: bool) -> Decision | None:
        if ctx.decision is not None:
            return ctx.decision
        if not ctx.posted.is_set():
            if not block:
                return None
            ctx.posted.wait()
        if ctx.result_event is not None:
            if not block and not ctx.result_event.query():
                return None
            ctx.result_event.synchronize()
        total, coef = (float(v) for v in ctx.result_host.tolist())
        skip = ctx.skip_nonfinite and not math.isfinite(total)
        coef_t = None
        if not skip and ctx.max_norm is not None and coef != 1.0:
            coef_t = torch.tensor(coef, dtype=torch.float32)
        redo = skip or coef_t is not None or ctx.hp_now != ctx.hp
        ctx.decision = Decision(skip, coef_t, ctx.hp_now, redo)
        return ctx.decision

    def _work_bucket(self, b: Bucket, ctx: StepCtx) -> None:
        t0 = time.perf_counter()
        if self._cuda:
            b.d2h_event.synchronize()
        self._phase("wait_d2h", t0)
        # Speculate while it pays: after a step whose speculation had to be redone (clipped, skipped,
        # hyper-parameters changed) the next step waits for its decision instead; the numbers are the same.
        speculate = self.speculative and not self._last_redo
        t0 = time.perf_counter()
        dec = self._poll_decision(ctx, block=not speculate)
        self._phase("wait_decision", t0)
        t0 = time.perf_counter()  # CPU time only: waiting for gradients or the decision is not work
        b.speculated = dec is None
        if dec is not None:
            self._resolve_speculation(ctx, dec)
            self._final_update(b, dec)
        elif b.alt_master is not None:  # speculate into the other copy; the current one is the undo
            self._update_other(b, ctx.hp, None)
            self._push(b, b.alt_master.tensor)
            ctx.spec.append(b)
            self.stats["speculative_buckets"] += 1
        else:  # speculate: assume no clip/skip; keep an exact copy to undo
            if not b.backup_fresh:
                self._backup(b, "backup")
            self._update(b, ctx.hp, None)
            self._push(b)
            ctx.spec.append(b)
            self.stats["speculative_buckets"] += 1
        self._account(b, t0)

    def _idle_work(self) -> bool:
        """With nothing queued, copy aside the state of the next bucket a speculative update will need, so
        the copy is off the critical path. Returns whether there was anything to do.

        Only buckets updated speculatively last step are copied: the others are likely to get the decision
        first again, and a copy nobody reads costs 24 B/parameter of host memory traffic, which slows the
        training loop's own thread (measured on the H200 machine: docs/superoffload.md)."""
        if not (self._backup_needed() and not self._last_redo) or self._worker_error is not None:
            return False
        if not self._state_lock.acquire(blocking=False):
            return False
        try:
            for b in list(self._buckets):
                if (b.speculated and not b.backup_fresh and b.ready.is_set() and b.master_buf is not None
                        and b.alt_master is None):
                    self._backup(b, "backup_idle")
                    self.stats["prefetched_backups"] += 1
                    return True
            return False
        finally:
            self._state_lock.release()

    def _work_finish(self, ctx: StepCtx) -> None:
        dec = self._poll_decision(ctx, block=True)
        t0 = time.perf_counter()
        self._resolve_speculation(ctx, dec)
        self._last_redo = dec.redo
        if dec.skip:
            self.stats["skipped_steps"] += 1
        elif dec.coef is not None:
            self.stats["clipped_steps"] += 1
        self.stats["finish_ms"] = (time.perf_counter() - t0) * 1e3

    def _resolve_speculation(self, ctx: StepCtx, dec: Decision) -> None:
        if not ctx.spec:
            return
        spec, ctx.spec = ctx.spec, []
        for b in spec:
            t0 = time.perf_counter()
            if b.alt_master is not None:
                if dec.redo:
                    self.stats["rollbacks"] += 1
                    if dec.skip:
                        self._push(b)  # the current copy was never touched: put its weights back on the GPU
                    else:
                        self._update_other(b, dec.hp, dec.coef)
                        self._push(b, b.alt_master.tensor)
                        self._flip(b)
                    self._account(b, t0)
                else:
                    self._flip(b)
            elif dec.redo:
                self.stats["rollbacks"] += 1
                self._restore(b)
                if dec.skip:
                    self._push(b)  # put the restored weights back on the GPU
                else:
                    self._update(b, dec.hp, dec.coef)
                    self._push(b)
                self._account(b, t0)
            b.ready_t = time.perf_counter()
            b.ready.set()

    def _final_update(self, b: Bucket, dec: Decision) -> None:
        if not dec.skip:
            self._update(b, dec.hp, dec.coef)
            self._push(b)
        b.ready_t = time.perf_counter()
        b.ready.set()

    def _account(self, b: Bucket, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        b.cpu_ms = ms if b.cpu_ms == 0.0 else 0.7 * b.cpu_ms + 0.3 * ms

    def _phase(self, name: str, t0: float) -> None:
        """Add the time since ``t0`` to the worker's cumulative time in ``name`` (``stats["cpu_phases_ms"]``)."""
        phases = self.stats["cpu_phases_ms"]
        phases[name] = phases.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def _update(self, b: Bucket, hp: list[dict[str, float]], coef: torch.Tensor | None) -> None:
        """Update the bucket's current copy of its state in place (our kernel where it is loaded, else torch's)."""
        t0 = time.perf_counter()
        if self._cuda:
            b.h2d_event.synchronize()  # the previous copy back must have read the master weights
        self._phase("wait_h2d", t0)
        t0 = time.perf_counter()
        b.backup_fresh = False
        if self._kernel is not None:
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
        if self._cuda:
            b.h2d_event.synchronize()  # a copy back from the other copy may still be reading it
        self._phase("wait_h2d", t0)
        t0 = time.perf_counter()
        self._kernel_update(b, hp, coef, in_place=False)
        self._phase("update", t0)

    def _kernel_update(self, b: Bucket, hp: list[dict[str, float]], coef: torch.Tensor | None,
                       in_place: bool) -> None:
        """Our kernel's step over the bucket's slots with a gradient, from its current copy of the state into the
        same copy (``in_place``) or into the other one (slots without a gradient are then copied over unchanged)."""
        from lightning_gh.superoffload.cpu_adamw import update_spans

        n = b.numel
        cur = (b.master_buf.tensor, b.moments[:n], b.moments[n:])
        out = cur if in_place else (b.alt_master.tensor, b.alt_moments[:n], b.alt_moments[n:])
        grad = b.grad_buf.tensor
        active = {s.index for s in b.active}
        # runs of consecutive slots with a gradient, one param group and one step count: one kernel call each
        runs: list[list[Slot]] = []
        for s in b.slots:  # in offset order
            if s.index not in active:
                if not in_place:  # no gradient this step: its state carries over
                    lo, hi = s.offset, s.offset + s.numel
                    for o, c in zip(out, cur):
                        o[lo:hi].copy_(c[lo:hi])
                continue
            last = runs[-1][-1] if runs else None
            if (last is not None and last.offset + last.numel == s.offset and last.group == s.group
                    and float(last.step) == float(s.step)):
                runs[-1].append(s)
            else:
                runs.append([s])
        for run in runs:
            lo, hi = run[0].offset, run[-1].offset + run[-1].numel
            update_spans(self._kernel, tuple(c[lo:hi] for c in cur), grad[lo:hi], tuple(o[lo:hi] for o in out),
                         [s.numel for s in run], float(run[0].step) + 1.0, hp[run[0].group], coef,
                         self.cpu_threads)

    def _flip(self, b: Bucket) -> None:
        """Commit an update written by :meth:`_update_other`: the other copy becomes the current one."""
        b.master_buf, b.alt_master = b.alt_master, b.master_buf
        b.moments, b.alt_moments = b.alt_moments, b.moments
        self._bind_views(b, b.slots)
        for s in b.active:
            s.step.add_(1)
        b.backup_fresh = False

    def _backup(self, b: Bucket, phase: str) -> None:
        t0 = time.perf_counter()
        n = b.numel
        if b.backup is None:
            b.backup = torch.empty(3 * n, dtype=torch.float32)
        b.backup[:n].copy_(b.master_buf.tensor)
        b.backup[n:].copy_(b.moments)
        b.backup_steps = {s.index: float(s.step) for s in b.slots}
        b.backup_fresh = True
        self._phase(phase, t0)

    def _restore(self, b: Bucket) -> None:
        t0 = time.perf_counter()
        if self._cuda:
            b.h2d_event.synchronize()  # the speculative copy back may still read the master weights
        n = b.numel
        b.master_buf.tensor.copy_(b.backup[:n])
        b.moments.copy_(b.backup[n:])
        for s in b.slots:
            s.step.fill_(b.backup_steps[s.index])
        b.backup_fresh = True
        self._phase("restore", t0)

    def _push(self, b: Bucket, master: torch.Tensor | None = None) -> None:
        """Copy the bucket's master weights (its current copy, or ``master``) into the model's parameters."""
        t0 = time.perf_counter()
        src = b.master_buf.tensor if master is None else master
        if self._cuda and b.active:
            with torch.cuda.stream(self._h2d_stream):
                # One host->GPU copy of the bucket's span of the flat master buffer and one multi-tensor copy
                # (with the cast) into the parameters: a few calls per bucket instead of three per parameter,
                # so the worker spends less time in Python, where it competes with the training loop's threads.
                # Allocated on the copy stream, so the caching allocator reuses it only after the copies ran.
                lo = min(s.offset for s in b.active)
                hi = max(s.offset + s.numel for s in b.active)
                stage = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
                stage.copy_(src[lo:hi], non_blocking=True)
                torch._foreach_copy_([s.param.data for s in b.active],
                                     [stage[s.offset - lo:s.offset - lo + s.numel].view(s.param.shape)
                                      for s in b.active])
                b.h2d_event.record(self._h2d_stream)
        elif self._cuda:  # nothing to copy back; the event still orders the next forward's wait
            b.h2d_event.record(self._h2d_stream)
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


def _next_task(opt: Any, pending: list[Any]) -> int:
    """Index in ``pending`` of the task to run next: the oldest, except that once a step's decision is known its
    queued bucket updates run in the order the next forward needs them (the earliest layer first; gradients
    arrive last layer first). Speculative updates keep the arrival order: the backward is still producing them.
    The order of final updates does not change any number, only how soon the forward may go on."""
    head = pending[0]
    if head is None or head[0] != "bucket" or opt._poll_decision(head[2], block=False) is None:
        return 0
    ctx = head[2]
    run = 0
    while run < len(pending) and pending[run] is not None and pending[run][0] == "bucket" and pending[run][2] is ctx:
        run += 1
    # parameter registration order follows the forward (embedding, layer 0, ..., head) in the models users bring
    return min(range(run), key=lambda j: min(s.index for s in pending[j][1].slots))


def worker_loop(wself: Callable[[], Any], q: queue.Queue) -> None:
    """The CPU update thread: runs queued tasks (see :func:`_next_task` for the order) until it gets ``None`` or its
    optimizer is gone."""
    opt = wself()
    if opt is None:
        return
    opt._worker_setup()
    del opt
    pending: list[Any] = []
    try:
        while True:
            _drain(q, pending)
            if not pending:
                opt = wself()
                busy = opt is not None and opt._idle_work()
                del opt
                if busy:
                    continue
                pending.append(q.get())
                _drain(q, pending)
            opt = wself()
            if opt is None:
                return
            task = pending.pop(_next_task(opt, pending))
            try:
                if task is None:
                    return
                opt._worker_task(task)
            finally:
                del opt
                q.task_done()
    finally:
        for _ in pending:  # never run (the thread is stopping): release anyone joining the queue
            q.task_done()
