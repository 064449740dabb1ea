"""The CPU worker: a thread that updates host buckets with torch's fused CPU AdamW, speculating before the step's
clip/skip decision is known and undoing a speculative update exactly when it must be redone.

The worker waits for a bucket's gradient copy, updates its fp32 master weights and moments, and streams the
weights back to the GPU on a second stream. Before a speculative update it copies the bucket's state aside;
when ``step()`` posts the decision (:class:`Decision`), speculative buckets are committed, or restored bitwise and
redone with the clipped gradients, or left restored (skipped step). While nothing is queued it makes the copies
the next speculative updates will need.

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
        if self._cuda:
            b.d2h_event.synchronize()
        # Speculate while it pays: after a step whose speculation had to be redone (clipped, skipped,
        # hyper-parameters changed) the next step waits for its decision instead; the numbers are the same.
        speculate = self.speculative and not self._last_redo
        dec = self._poll_decision(ctx, block=not speculate)
        t0 = time.perf_counter()  # CPU time only: waiting for gradients or the decision is not work
        if dec is not None:
            self._resolve_speculation(ctx, dec)
            self._final_update(b, dec)
        else:  # speculate: assume no clip/skip; keep an exact copy to undo
            if not b.backup_fresh:
                self._backup(b)
            self._update(b, ctx.hp, None)
            self._push(b)
            ctx.spec.append(b)
            self.stats["speculative_buckets"] += 1
        self._account(b, t0)

    def _idle_work(self) -> bool:
        """With nothing queued, copy aside the state of the next bucket a speculative update will need, so
        the copy is off the critical path. Returns whether there was anything to do."""
        if not (self._backup_needed() and not self._last_redo) or self._worker_error is not None:
            return False
        if not self._state_lock.acquire(blocking=False):
            return False
        try:
            for b in list(self._buckets):
                if not b.backup_fresh and b.ready.is_set() and b.master_buf is not None:
                    self._backup(b)
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
            if dec.redo:
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

    def _update(self, b: Bucket, hp: list[dict[str, float]], coef: torch.Tensor | None) -> None:
        if self._cuda:
            b.h2d_event.synchronize()  # the previous copy back must have read the master weights
        b.backup_fresh = False
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

    def _backup(self, b: Bucket) -> None:
        n = b.numel
        if b.backup is None:
            b.backup = torch.empty(3 * n, dtype=torch.float32)
        b.backup[:n].copy_(b.master_buf.tensor)
        b.backup[n:].copy_(b.moments)
        b.backup_steps = {s.index: float(s.step) for s in b.slots}
        b.backup_fresh = True

    def _restore(self, b: Bucket) -> None:
        if self._cuda:
            b.h2d_event.synchronize()  # the speculative copy back may still read the master weights
        n = b.numel
        b.master_buf.tensor.copy_(b.backup[:n])
        b.moments.copy_(b.backup[n:])
        for s in b.slots:
            s.step.fill_(b.backup_steps[s.index])
        b.backup_fresh = True

    def _push(self, b: Bucket) -> None:
        """Copy the bucket's committed master weights into the model's parameters."""
        if self._cuda:
            with torch.cuda.stream(self._h2d_stream):
                for s in b.active:
                    p = s.param
                    if p.dtype == torch.float32:
                        p.data.copy_(s.master.view(p.shape), non_blocking=True)
                    else:
                        tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                        tmp.copy_(s.master.view(p.shape), non_blocking=True)
                        p.data.copy_(tmp)
                b.h2d_event.record(self._h2d_stream)
        else:
            for s in b.active:
                s.param.data.copy_(s.master.view(s.param.shape))
        b.pushed = True


def worker_loop(wself: Callable[[], Any], q: queue.Queue) -> None:
    """The CPU update thread: runs queued bucket tasks in order until it gets ``None`` or its optimizer is gone."""
    opt = wself()
    if opt is None:
        return
    opt._worker_setup()
    del opt
    while True:
        try:
            task = q.get_nowait()
        except queue.Empty:
            opt = wself()
            busy = opt is not None and opt._idle_work()
            del opt
            if busy:
                continue
            task = q.get()
        try:
            if task is None:
                return
            opt = wself()
            if opt is None:
                return
            opt._worker_task(task)
            del opt
        finally:
            q.task_done()
