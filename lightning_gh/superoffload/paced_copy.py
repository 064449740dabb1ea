"""Host-to-device copies issued in pieces, few queued at a time, so that a small copy another stream queues meanwhile
does not wait behind all of them (:class:`PacedCopies`).

Note [Paced weight copies]
    A GPU runs the host-to-device copies of all its streams through one copy engine, in the order they reach it:
    a small copy that the compute stream reaches while a large copy is queued on another stream waits until the
    large copy has finished, and the compute stream with it. FSDP2 queues such a small copy on the compute stream
    before each unit's forward (the arguments of the all-gather output's split, from pinned memory), while the
    ZeRO-3 worker copies a host unit's new weights, hundreds of MB, to the GPU on a side stream
    (:class:`~.fsdp_optimizer.ShardedHostAdamW`). The engine keeps serving the stream it is on while that stream has
    copies queued: cutting the large copy into pieces does not help while the pieces are queued faster than the
    link drains them, even a few at a time (``benchmarks/copy_contention.py``). So a thread of its own issues the
    pieces, :data:`PIECE_BYTES` each, with at most :data:`DEPTH` queued on the device at any time (it waits on a
    blocking event for the oldest before it queues another): with one, the side stream's queue is empty between
    pieces and a small copy waits behind at most one piece. The thread records one event after a job's last piece and hands it to
    the job's callback, which publishes it (the unit's copy event, then the unit's ready flag): whoever waits for
    the copy waits for that flag first.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from typing import Any, Callable

import torch

__all__ = ["DEPTH", "PIECE_BYTES", "PacedCopies", "pieces"]

#: Bytes per queued piece of a paced copy.
PIECE_BYTES = 16 * 2**20
#: Pieces queued on the device at most.
DEPTH = 1


def pieces(numel: int, itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``(start, stop)`` element ranges cutting ``numel`` elements of ``itemsize`` bytes into pieces of at most
    ``piece_bytes`` (at least one element each).

    >>> pieces(10, 4, 16), pieces(0, 2), pieces(3, 8, 1)
    ([(0, 4), (4, 8), (8, 10)], [], [(0, 1), (1, 2), (2, 3)])
    """
    step = max(1, piece_bytes // max(1, itemsize))
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


class _Job:
    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], done: Callable[[Any], None]) -> None:
        self.pairs = pairs
        self.done = done
        self.finished = threading.Event()
        self.event: Any = None

    def synchronize(self) -> None:
        """Return once every piece has been read from the host (the job's thread queued them all, and the
        device ran them)."""
        self.finished.wait()
        if self.event is not None:
            self.event.synchronize()


class PacedCopies:
    """A thread that copies host tensors into device tensors on ``stream``, in pieces, few queued at a time (see
    Note [Paced weight copies]).

    Args:
        stream: the CUDA stream of the copies.
        on_error: called with an exception a job raised (the job's callback still runs, with ``None``).
        piece_bytes, depth: the pieces' size and how many may be queued on the device.
    """

    def __init__(self, stream: Any, on_error: Callable[[BaseException], None], piece_bytes: int = PIECE_BYTES,
                 depth: int = DEPTH) -> None:
        self.stream = stream
        self.on_error = on_error
        self.piece_bytes = piece_bytes
        self.depth = max(1, depth)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending = 0  # jobs submitted and not finished
        self._count = threading.Lock()  # both threads change _pending
        self._closed = False

    @classmethod
    def reporting_to(cls, owner: Any, stream: Any) -> PacedCopies:
        """Copies whose errors go to ``owner._error`` (held weakly: the thread does not keep ``owner`` alive)."""
        ref = weakref.ref(owner)

        def on_error(e: BaseException) -> None:
            if ref() is not None:
                ref()._error = e

        pacer = cls(stream, on_error)
        weakref.finalize(owner, pacer._queue.put, None)  # an owner collected unclosed stops the thread too
        return pacer

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], done: Callable[[Any], None]) -> _Job:
        """Copy each ``(dst, src)`` pair (same number of elements, contiguous), then call ``done(event)`` with an
        event recorded on the stream after the last piece. Returns the job (``synchronize()`` waits for it)."""
        if self._closed:
            raise RuntimeError("PacedCopies: submit() after close().")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="superoffload-paced-copies", daemon=True)
            self._thread.start()
        job = _Job(pairs, done)
        with self._count:
            self._pending += 1
        self._queue.put(job)
        return job

    def stalled(self) -> bool:
        """Whether jobs are pending that no thread will finish (the thread died)."""
        return self._pending > 0 and (self._thread is None or not self._thread.is_alive())

    def close(self) -> bool:
        """Stop the thread once the jobs queued are done; ``False`` if it is still running after the wait (it may
        still read the jobs' source tensors)."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                return False
        self._thread = None
        return True

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job)
            except BaseException as e:  # re-raised by the optimizer's waits
                job.event = self._fence()  # after the pieces already queued: the source is read until then
                self.on_error(e)
            finally:
                try:
                    job.done(job.event)
                except BaseException as e:
                    self.on_error(e)
                finally:
                    with self._count:
                        self._pending -= 1
                    job.finished.set()

    def _fence(self) -> Any:
        try:
            event = torch.cuda.Event()
            event.record(self.stream)
            return event
        except BaseException:  # the device itself failed: wait for whatever it still runs
            try:
                self.stream.synchronize()
            except BaseException:
                pass
            return None

    def _run(self, job: _Job) -> None:
        inflight: collections.deque = collections.deque()
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            for dst, src in job.pairs:
                if not (dst.is_contiguous() and src.is_contiguous()):  # one piece
                    d, s, cuts = dst, src.view(dst.shape), [(None, None)]
                else:
                    d, s = dst.view(-1), src.view(-1)
                    cuts = pieces(d.numel(), d.element_size(), self.piece_bytes)
                for lo, hi in cuts:
                    while len(inflight) >= self.depth:
                        inflight.popleft().synchronize()
                    d[lo:hi].copy_(s[lo:hi], non_blocking=True)
                    ev = torch.cuda.Event(blocking=True)
                    ev.record(self.stream)
                    inflight.append(ev)
            job.event = torch.cuda.Event()
            job.event.record(self.stream)
