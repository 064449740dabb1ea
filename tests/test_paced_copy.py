"""Paced host-to-device copies (Note [Paced weight copies]): how a copy is cut into pieces (CPU), and on a GPU that
the pieces land whole, that the job's event and callback come after the last one, and that an error reaches the
owner and still calls the job back."""

import threading

import pytest
import torch

from lightning_gh.superoffload import paced_copy
from lightning_gh.superoffload.paced_copy import PacedCopies, pieces

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("numel", "itemsize", "piece_bytes", "expected"), [
    (0, 2, 8, []),
    (4, 2, 8, [(0, 4)]),  # exactly one piece
    (5, 2, 8, [(0, 4), (4, 5)]),  # a short last piece
    (3, 8, 4, [(0, 1), (1, 2), (2, 3)]),  # an element larger than a piece: one element each
    (10, 4, 16, [(0, 4), (4, 8), (8, 10)]),
])
def test_pieces_table(numel, itemsize, piece_bytes, expected):
    got = pieces(numel, itemsize, piece_bytes)
    assert got == expected
    assert sum(hi - lo for lo, hi in got) == numel


def test_default_pieces_are_a_few_mib():
    cuts = pieces(218 * 2**20 // 2, 2)  # a 7B decoder layer's bf16 half
    assert len(cuts) == -(-218 * 2**20 // paced_copy.PIECE_BYTES)
    assert max(hi - lo for lo, hi in cuts) * 2 == paced_copy.PIECE_BYTES


class _Owner:
    _error = None


class _NoStream:
    """A stream object on a machine without CUDA: every job fails, which is the error path under test."""
    device = torch.device("cpu")

    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_a_failed_job_still_calls_back_and_the_copier_closes():
    owner, stream = _Owner(), _NoStream()
    pacer = PacedCopies.reporting_to(owner, stream)
    calls = []
    job = pacer.submit([(torch.zeros(4), torch.ones(4))], calls.append)
    job.synchronize()  # returns: the failure does not leave the waiter hanging
    assert calls == [None] and owner._error is not None  # no event could be recorded: none is published
    assert stream.synchronized == 1  # instead the stream was waited for (pieces queued before the failure)
    assert not pacer.stalled()
    assert pacer.close() is True
    with pytest.raises(RuntimeError, match="after close"):
        pacer.submit([], calls.append)


def test_a_callback_that_raises_is_reported_and_the_job_still_finishes():
    owner = _Owner()
    pacer = PacedCopies(_NoStream(), lambda e: setattr(owner, "_error", e))

    def bad(event):
        raise ValueError("callback")

    pacer.submit([], bad).synchronize()
    assert isinstance(owner._error, ValueError) and not pacer.stalled()
    pacer.close()


@cuda
@pytest.mark.gpu
def test_paced_copies_land_whole_and_publish_after_the_last_piece():
    owner = _Owner()
    pacer = PacedCopies.reporting_to(owner, torch.cuda.Stream())
    pacer.piece_bytes, pacer.depth = 1 << 16, 2
    src = [torch.randn(40_000).pin_memory(), torch.randn(3, 5000).to(torch.bfloat16).pin_memory()]
    dst = [torch.empty(40_000, device="cuda"), torch.empty(3, 5000, dtype=torch.bfloat16, device="cuda")]
    got = {}
    ready = threading.Event()

    def done(event):
        got["event"] = event
        ready.set()

    job = pacer.submit(list(zip(dst, src)), done)
    job.synchronize()
    assert ready.wait(10) and got["event"] is not None
    torch.cuda.current_stream().wait_event(got["event"])
    assert all(torch.equal(d.cpu(), s) for d, s in zip(dst, src))
    assert owner._error is None
    pacer.close()


@cuda
@pytest.mark.gpu
def test_a_failed_job_reports_to_its_owner_and_still_calls_back():
    owner = _Owner()
    pacer = PacedCopies.reporting_to(owner, torch.cuda.Stream())
    calls = []
    bad = [(torch.empty(4, 2, device="cuda").t(), torch.empty(5).pin_memory())]  # one piece, and 5 != 2 x 4
    pacer.submit(bad, calls.append).synchronize()
    assert isinstance(owner._error, RuntimeError)
    assert len(calls) == 1 and isinstance(calls[0], torch.cuda.Event)  # a fence after whatever was queued
    calls[0].synchronize()
    pacer.close()
