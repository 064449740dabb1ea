"""The GPU's share of the host buckets' update, once a step's decision is known: :class:`SharedBuckets` (the buckets
the CPU worker and the GPU take from opposite ends) and :class:`DeviceAssist` (the thread that updates the GPU's
share by streaming each bucket's state over the host link).

Note [Device-assisted update]
    When the CPU worker learns a step's clip/skip decision before it has updated all of the step's host buckets
    (every step of a run that is clipped on each step, and the late buckets of a speculating run), the buckets still
    to update are shared, in the order the next forward needs them, by two workers: the GPU takes them from the
    front, the CPU worker from the back. For a bucket the GPU takes, its fp32 master weights, moments and gradient
    are copied to the GPU a chunk at a time, updated with the GPU tail's arithmetic
    (:func:`~lightning_gh.superoffload.tail_mover.update_device_tail`: the gradient cast to fp32, multiplied by the
    clip coefficient, then torch's fused AdamW), cast into the module's weights on the GPU, and the state copied
    back into the bucket's host buffers, all on one copy stream (two streams alternate by bucket, so one bucket's
    copies to the GPU overlap the previous one's copies back). The bucket's ``h2d_event`` is recorded after the
    copies back: the next forward's stream waits on it as it waits for a CPU-updated bucket's weights, and every
    host reader of the bucket's state (the CPU worker's next update or rollback copy of it, and the worker's
    ``join``, which checkpoints and the tail mover go through) synchronises on it first.

    A bucket the GPU updates is marked ready when its work is queued, so the forward's wait for it is a wait of
    the GPU's stream, not of the host: the auto tail's stall and slack measurements do not see it.

    The GPU takes a bucket only when the one before its last has finished, so at most two of its buckets are in
    flight and each worker's share follows its speed on this machine and this step: no split is computed. A
    parameter updated on the GPU gets the GPU tail's arithmetic and one updated on the CPU the CPU kernel's (bitwise
    torch's fused CPU AdamW); as for the tail, which device updates a parameter may change from step to step, and
    here with the timing of the run, so two runs may differ in the last bits of some parameters. The clip
    coefficient is exact either way. Under ``torch.use_deterministic_algorithms(True)`` the ``"auto"`` option keeps
    every host update on the CPU. Off CUDA (``device_assist=True``, for tests) the same split runs on the CPU with
    torch's fused AdamW, which is bitwise the CPU kernel's result.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from lightning_gh.superoffload.cpu_adamw import kernel_runs

if TYPE_CHECKING:
    from lightning_gh.superoffload.layout import Bucket, HostLayout
    from lightning_gh.superoffload.step import Decision

__all__ = ["ASSIST_CHUNK", "DeviceAssist", "SharedBuckets", "assist_enabled", "chunk_spans"]

#: Elements of a bucket's state on the GPU at once (per stream): the fp32 master weights, both moments and the fp32
#: gradient of this many parameters.
ASSIST_CHUNK = 1 << 24


def assist_enabled(option: bool | str, cuda: bool, sharded: bool, deterministic: bool = False) -> bool:
    """Whether the GPU shares the host buckets' update (see Note [Device-assisted update]).

    Args:
        option: ``SuperOffloadOptions.device_assist``.
        cuda: the parameters live on a CUDA device.
        sharded: the state is sharded across ranks (each rank's CPU updates its own share; not assisted).
        deterministic: ``torch.use_deterministic_algorithms(True)`` is in effect: ``"auto"`` then keeps every host
            update on the CPU, since which device updates a bucket depends on timing.

    Example::

        >>> [assist_enabled(o, cuda, False) for o in ("auto", True, False) for cuda in (True, False)]
        [True, False, True, True, False, False]
        >>> assist_enabled("auto", True, sharded=True), assist_enabled("auto", True, False, deterministic=True)
        (False, False)
    """
    if sharded or option is False:
        return False
    if option is True:
        return True
    return cuda and not deterministic


def chunk_spans(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into consecutive spans of at most ``chunk`` elements.

    Example::

        >>> chunk_spans(0, 10, 4)
        [(0, 4), (4, 8), (8, 10)]
        >>> chunk_spans(3, 3, 4)
        []
    """
    return [(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)]


class SharedBuckets:
    """Buckets in the order the next forward needs them; the GPU takes from the front, the CPU from the back.

    Args:
        buckets: the buckets still to update, in any order (they are numbered in gradient-arrival order, so the
            forward needs the highest index first).

    Example::

        >>> from types import SimpleNamespace as S
        >>> shared = SharedBuckets([S(index=i) for i in (0, 2, 1)])
        >>> shared.take_front().index, shared.take_back().index, shared.take_back().index, shared.take_front()
        (2, 0, 1, None)
    """

    def __init__(self, buckets: list[Bucket]) -> None:
        self._left: deque[Bucket] = deque(sorted(buckets, key=lambda b: -b.index))
        self._lock = threading.Lock()

    def take_front(self) -> Bucket | None:
        with self._lock:
            return self._left.popleft() if self._left else None

    def take_back(self) -> Bucket | None:
        with self._lock:
            return self._left.pop() if self._left else None


class DeviceAssist:
    """The GPU's worker of Note [Device-assisted update]: a thread that, per job, takes buckets from the front of a
    :class:`SharedBuckets` until none is left.

    Args:
        layout: the host layout whose buckets it updates.
        stats: the optimizer's ``stats`` dict (``assisted_buckets``, ``assisted_numel``).
    """

    def __init__(self, layout: HostLayout, stats: dict[str, Any]) -> None:
        self.layout = layout
        self.stats = stats
        self.device = layout.device if layout.cuda else torch.device("cpu")
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if layout.cuda else ()
        self._jobs: deque[tuple[SharedBuckets, Decision, Any]] = deque()
        self._wake = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._done: list[Bucket] = []  # the buckets the last job updated

    def start(self, shared: SharedBuckets, dec: Decision, after: Any = None) -> None:
        """Take buckets from the front of ``shared`` with decision ``dec`` until none is left; ``after``: a CUDA
        event the GPU work must follow (the step's decision), or ``None``."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="superoffload-device-assist", daemon=True)
            self._thread.start()
        with self._wake:
            self._idle.clear()
            self._jobs.append((shared, dec, after))
            self._wake.notify()

    def wait(self) -> list[Bucket]:
        """Block until the job has run and its GPU work has finished (its buckets' host state is final); returns
        the buckets the GPU updated. Re-raises what made the job fail."""
        self._idle.wait()
        err, self._error = self._error, None
        if err is not None:
            raise err
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    # ------------------------------------------------------------------ the assist thread
    def _loop(self) -> None:
        if self.layout.cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:  # closed, nothing left to run
                    return
                job = self._jobs.popleft()
            try:
                with torch.no_grad():
                    self._done = self._run(*job)
            except BaseException as e:  # re-raised by wait() on the CPU worker
                self._error = e
            finally:
                self._idle.set()

    def _run(self, shared: SharedBuckets, dec: Decision, after: Any) -> list[Bucket]:
        done: list[Bucket] = []
        coef = None
        if dec.coef is not None:  # on the assist's stream, not behind the training thread's queued work
            with torch.cuda.stream(self._streams[0]) if self._streams else contextlib.nullcontext():
                coef = dec.coef.to(self.device)
        in_flight: deque[Any] = deque()
        try:
            while True:
                if len(in_flight) == 2:  # the one before the last must finish before another bucket is taken
                    in_flight.popleft().synchronize()
                b = shared.take_front()
                if b is None:
                    break
                stream = self._streams[len(done) % 2] if self._streams else None
                self._update(b, dec, coef, stream, after)
                if stream is not None:
                    in_flight.append(b.h2d_event)
                done.append(b)
        finally:  # also after a failure: no copy into host memory may still run once the caller goes on
            for stream in self._streams:
                stream.synchronize()
        self.stats["assisted_buckets"] += len(done)
        self.stats["assisted_numel"] += sum(sum(s.numel for s in b.active) for b in done)
        return done

    def _update(self, b: Bucket, dec: Decision, coef: torch.Tensor | None, stream: Any, after: Any) -> None:
        """Bucket ``b``'s update on the GPU (see Note [Device-assisted update]); on ``stream``, or at once off CUDA."""
        b.speculated = False
        b.backup.fresh = False  # updated in place: a rollback copy taken before is stale (as CpuUpdater._update)
        if stream is None:
            self._update_spans(b, dec, coef)
        else:
            with torch.cuda.stream(stream):
                stream.wait_event(b.d2h_event)  # its gradients have landed in the host buffer
                stream.wait_event(b.h2d_event)  # its last copy back has finished
                if after is not None:
                    stream.wait_event(after)
                self._update_spans(b, dec, coef)
                b.h2d_event.record(stream)
        # the next forward's stream waits on h2d_event (see CpuUpdater.wait and HeterogeneousAdamW._wait_ready)
        b.pushed = True
        b.ready_t = time.perf_counter()
        b.ready.set()

    def _update_spans(self, b: Bucket, dec: Decision, coef: torch.Tensor | None) -> None:
        n = b.numel
        master, moments, grad = b.master_buf.tensor, b.moments, b.grad_buf.tensor
        dev, cuda = self.device, self.layout.cuda
        for run in kernel_runs(sorted(b.active, key=lambda s: s.offset)):
            h = dec.hp[run[0].group]
            step = float(run[0].step) + 1.0
            lo, hi = run[0].offset, run[-1].offset + run[-1].numel
            for a, z in chunk_spans(lo, hi, ASSIST_CHUNK):
                w = master[a:z].to(dev, non_blocking=True)
                m = moments[a:z].to(dev, non_blocking=True)
                v = moments[n + a:n + z].to(dev, non_blocking=True)
                g = grad[a:z].to(dev, non_blocking=True)
                # an fp32 copy on the GPU; off CUDA never the host gradient itself (it is scaled in place below)
                g = g.to(torch.float32) if g.dtype != torch.float32 else (g if cuda else g.clone())
                if coef is not None:
                    g.mul_(coef)
                steps = [torch.full((), step, dtype=torch.float32, device=dev)]
                torch._fused_adamw_([w], [g], [m], [v], [], steps, lr=h["lr"], beta1=h["beta1"],
                                    beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False,
                                    maximize=False)
                params = [s for s in run if s.offset < z and s.offset + s.numel > a]
                dst, src = [], []
                for s in params:  # the part of each parameter inside this chunk
                    p0, p1 = max(s.offset, a), min(s.offset + s.numel, z)
                    dst.append(s.param.data.view(-1)[p0 - s.offset:p1 - s.offset])
                    src.append(w[p0 - a:p1 - a])
                torch._foreach_copy_(dst, src)
                master[a:z].copy_(w, non_blocking=True)
                moments[a:z].copy_(m, non_blocking=True)
                moments[n + a:n + z].copy_(v, non_blocking=True)
        for s in b.active:
            s.step.add_(1)
