"""Host memory shared by the offloading parts: one plan of host RAM, one error for "not enough host RAM", one
room check, and exact-size page-locked buffers.

ActivationOffload, SuperOffload and the KV-cache offload all keep data in host memory that the GPU's copy
engines read and write. They size it against :func:`lightning_gh.hardware.available_host_bytes` with
:func:`check_host_room`, raise :class:`HostMemoryError` when it does not fit (naming the numbers and what to
change), and allocate DMA buffers as :class:`HostBuffer`: torch's own pinned allocator rounds every request up
to a power of two, which can waste up to half of a multi-gigabyte buffer; registering an exact-size allocation
with ``cudaHostRegister`` does not.

One plan (:data:`PLAN`, a :class:`HostPlan`) holds every part's share of host RAM in this process: what each part
holds (``claim``) and what it announced at setup and will take later (``declare``). A part's room is the plan's
budget (``headroom`` of what the host had available before the parts took their shares) less what the other
parts hold or announced, so the part that allocates first cannot take what another needs, and the error, when
the sum cannot fit, names every part's share. See Note [One host-memory plan].

Example::

    >>> from lightning_gh._host import HostBuffer, HostPlan, check_host_room
    >>> plan = HostPlan(available=lambda: 100 * 2**30)
    >>> plan.declare("ActivationOffload", 10 * 2**30)
    >>> plan.room("SuperOffload", headroom=0.9) // 2**30  # 90 GiB budget less the 10 GiB announced
    80
    >>> buf = HostBuffer(1024, pin=False)
    >>> buf.tensor.numel(), buf.pinned
    (1024, False)
    >>> check_host_room(1024, what="a test buffer") is None or True
    True
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_gh import hardware
from lightning_gh._util import fmt_bytes

__all__ = ["PLAN", "HostBuffer", "HostMemoryError", "HostPlan", "HostShare", "check_host_room", "clear_cuda_error"]

_GIB = 2**30


class HostMemoryError(MemoryError, RuntimeError):
    """The host cannot hold what an offloading part would put there.

    A ``MemoryError`` (what it is) and a ``RuntimeError`` (so that ``except RuntimeError`` around a fit sees it).
    """


# Note [One host-memory plan]
# SuperOffload (master weights and moments), ActivationOffload (the pinned activation pool), the KV-cache offload
# (its host pool) and ManagedOptimizerState draw on the same host RAM. Each part sizes itself through
# ``PLAN.room(part)`` / ``PLAN.claim(part, nbytes)`` instead of taking a share of whatever is left when it
# happens to allocate: the budget is ``headroom`` of the host memory available to this process's parts
# (available now plus what the parts already hold), and a part's room is that budget less the other parts'
# holdings and their announced (declared, not yet claimed) needs. A part that allocates lazily (the activation
# pool grows during the first steps) declares its need at setup, before SuperOffload sizes its host state in
# ``setup_optimizers``. ``claim`` replaces the part's previous claim (it is the part's total); the share goes back
# with ``release`` or when the object that holds the memory (the claim's ``owner``) is collected. The collector
# may run that release anywhere, also inside the plan's own locked section on the same thread: so it only queues
# the release, and the plan applies queued releases the next time it takes its lock.


@dataclass(frozen=True)
class HostShare:
    """One part's line in the host-memory plan.

    Attributes:
        part: the part (``"SuperOffload"``, ``"ActivationOffload"``, ``"KVCache"``, ...).
        held_bytes: host bytes the part holds (claimed and allocated).
        declared_bytes: host bytes the part announced at setup and will claim later (0 once it has claimed them).
        what: what the bytes are for, for the plan's table and the errors.
    """

    part: str
    held_bytes: int = 0
    declared_bytes: int = 0
    what: str = ""


class HostPlan:
    """The process's plan of host RAM across the offloading parts. See Note [One host-memory plan].

    Args:
        available: how many bytes a new host allocation may take now (default:
            :func:`lightning_gh.hardware.available_host_bytes`, which reads ``MemAvailable``); ``None`` from it
            means unknown, and then every claim passes.
    """

    def __init__(self, available: Callable[[], int | None] | None = None) -> None:
        # Looked up at call time by default, so a test that replaces the hardware probe is seen here too.
        self._available = available or (lambda: hardware.available_host_bytes())
        self._shares: dict[str, HostShare] = {}
        self._lock = threading.Lock()
        self._released: collections.deque[tuple[str, int]] = collections.deque()  # by the collector, not applied

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The plan's lock, with the releases the collector queued applied first (see Note [One host-memory
        plan])."""
        with self._lock:
            while self._released:
                part, nbytes = self._released.popleft()
                share = self._shares.get(part)
                if share is not None and share.held_bytes == nbytes:
                    self._shares.pop(part)
            yield

    def shares(self) -> list[HostShare]:
        """Every part's share, in the order the parts first appeared."""
        with self._locked():
            return list(self._shares.values())

    def declare(self, part: str, nbytes: int, what: str = "") -> None:
        """Announce that ``part`` will claim about ``nbytes`` later; the other parts' room leaves it free."""
        _check_bytes("nbytes", nbytes)
        with self._locked():
            old = self._shares.get(part, HostShare(part))
            self._shares[part] = HostShare(part, old.held_bytes, max(0, nbytes - old.held_bytes), what or old.what)

    def budget(self, headroom: float = 0.9, held: Mapping[str, int] | None = None) -> int | None:
        """``headroom`` of the host memory the parts may use in all (available now plus what they hold; ``held``
        overrides the recorded holding of the parts it names)."""
        avail = self._available()
        if avail is None:
            return None
        holding = {s.part: s.held_bytes for s in self.shares()} | dict(held or {})
        return int(headroom * (avail + sum(holding.values())))

    def room(self, part: str, headroom: float = 0.9, held_now: int | None = None) -> int | None:
        """Bytes ``part`` may hold in all (its current holding included: ``held_now`` where the part knows it
        better than its last claim), or ``None`` where the host's memory cannot be read."""
        budget = self.budget(headroom, None if held_now is None else {part: held_now})
        if budget is None:
            return None
        others = sum(s.held_bytes + s.declared_bytes for s in self.shares() if s.part != part)
        return max(0, budget - others)

    def claim(self, part: str, nbytes: int, *, what: str, headroom: float = 0.9, tips: Sequence[str] = (),
              opt_out: str | None = None, owner: object | None = None, record: bool = True,
              held_now: int | None = None) -> int | None:
        """Record that ``part`` holds ``nbytes`` in all, or raise :class:`HostMemoryError` naming every share.

        With ``owner``, the share is released when ``owner`` is garbage-collected (a part that is never closed
        cannot keep its share). With ``record=False`` only the check is made (a plan that allocates nothing).
        ``held_now``: what the part holds at this moment, where it freed memory since its last claim.

        Returns:
            The part's room the decision used, or ``None`` where the host's memory cannot be read.
        """
        _check_bytes("nbytes", nbytes)
        room = self.room(part, headroom, held_now)
        if room is not None and nbytes > room:
            advice = f" To fit: {'; '.join(tips)}." if tips else ""
            skip = f" Pass {opt_out} to skip this check." if opt_out else ""
            others = [s for s in self.shares() if s.part != part and (s.held_bytes or s.declared_bytes)]
            table = "".join(f"; {s.part} {_share_text(s)}" for s in others)
            budget = self.budget(headroom, None if held_now is None else {part: held_now}) or 0
            raise HostMemoryError(
                f"{what} needs {fmt_bytes(nbytes)} of host RAM, but at most {headroom:.0%} of the "
                f"{fmt_bytes(budget / headroom if headroom else 0)} available to the offloading parts may be used "
                f"(the host-memory plan's budget: {fmt_bytes(budget)}), and its room there is {fmt_bytes(room)}"
                f"{table}.{advice}{skip}")
        if not record:
            return room
        with self._locked():
            old = self._shares.get(part, HostShare(part))
            self._shares[part] = HostShare(part, nbytes, max(0, old.declared_bytes - (nbytes - old.held_bytes)),
                                           what)
        if owner is not None:
            weakref.finalize(owner, self._release_if_held, part, nbytes)
        return room

    def _release_if_held(self, part: str, nbytes: int) -> None:
        # Run by the collector, possibly inside one of this plan's locked sections: queue, never lock here.
        self._released.append((part, nbytes))

    def release(self, part: str) -> None:
        """Forget ``part``'s holding and declaration (it freed its host memory)."""
        with self._locked():
            self._shares.pop(part, None)

    def describe(self) -> str:
        """The plan as one line per part (for logs and the memory plan)."""
        lines = [f"{s.part}: {_share_text(s)}{f' ({s.what})' if s.what else ''}" for s in self.shares()]
        return "\n".join(lines) if lines else "no host memory planned"


def _share_text(s: HostShare) -> str:
    held = f"holds {fmt_bytes(s.held_bytes)}" if s.held_bytes else ""
    declared = f"will take {fmt_bytes(s.declared_bytes)}" if s.declared_bytes else ""
    return ", ".join(x for x in (held, declared) if x) or "nothing"


def _check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int number of bytes.")
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0.")


#: The process's one host-memory plan.
PLAN = HostPlan()


def check_host_room(needed_bytes: int, *, what: str, headroom: float = 0.9, held_bytes: int | None = None,
                    tips: Sequence[str] = (), opt_out: str | None = None, part: str | None = None,
                    owner: object | None = None, record: bool = True) -> int | None:
    """Raise :class:`HostMemoryError` unless ``needed_bytes`` fit in ``headroom`` of the host's available memory.

    With ``part``, the check is the host-memory plan's (:meth:`HostPlan.claim` on :data:`PLAN`): ``needed_bytes``
    is the part's total, other parts' shares are left free, and the claim is recorded.

    Args:
        needed_bytes: what the part is about to allocate.
        what: who needs it and for what, for the message (``"HeterogeneousAdamW's master weights and moments"``).
        headroom: the share of the available memory the part may take.
        held_bytes: host memory the part already holds and would reuse (counted as available); ``None``: 0 outside
            the plan, the part's last claim in it.
        tips: ways to need less, for the message.
        opt_out: the option that skips this check, for the message.

        part: the part making the claim in the host-memory plan, or ``None`` for a check outside the plan.
        owner: the object whose garbage collection releases the claim (see :meth:`HostPlan.claim`).
        record: record the claim in the plan (``False``: check only).

    Returns:
        The available bytes the decision used, or ``None`` where the host's memory cannot be read (then it passes).
    """
    if part is not None:
        return PLAN.claim(part, needed_bytes, what=what, headroom=headroom, tips=tips, opt_out=opt_out, owner=owner,
                          record=record, held_now=held_bytes)
    held_bytes = held_bytes or 0
    avail = hardware.available_host_bytes()
    if avail is None:
        return None
    room = headroom * (avail + held_bytes)
    if needed_bytes > room:
        advice = f" To fit: {'; '.join(tips)}." if tips else ""
        skip = f" Pass {opt_out} to skip this check." if opt_out else ""
        raise HostMemoryError(
            f"{what} needs {needed_bytes / _GIB:.2f} GiB of host RAM, but at most {headroom:.0%} of the "
            f"{(avail + held_bytes) / _GIB:.2f} GiB available (MemAvailable in /proc/meminfo"
            f"{' plus what it already holds' if held_bytes else ''}) may be used.{advice}{skip}")
    return avail


class HostBuffer:
    """A flat host tensor (fp32 unless ``dtype`` says otherwise), page-locked when CUDA is in use so copies to/from
    the GPU are async.

    Page-locking registers an exact-size allocation (``cudaHostRegister``); where that fails it falls
    back to torch's pinned allocator, and where that fails too it stays pageable with one warning
    (copies are then synchronous but still correct). :meth:`release` unregisters; it runs at most once.
    """

    _warned = False

    def __init__(self, numel: int, pin: bool, zero: bool = True, dtype: torch.dtype = torch.float32) -> None:
        self.numel = int(numel)
        self.dtype = dtype
        self._registered_ptr: int | None = None
        if pin and self.numel > 0 and self._pin(zero):
            return
        self.tensor = torch.zeros(self.numel, dtype=dtype) if zero else torch.empty(self.numel, dtype=dtype)

    def _pin(self, zero: bool) -> bool:
        # Register whole pages that lie inside this allocation only: two registrations that share a page
        # fail (cudaErrorHostMemoryAlreadyRegistered), and a failed runtime call would surface later as the
        # "last error" of an unrelated kernel launch.
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        nbytes = self.numel * self.dtype.itemsize
        span = -(-nbytes // page) * page
        raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
        start = -(-raw.data_ptr() // page) * page
        first = start - raw.data_ptr()
        tensor = raw[first:first + nbytes].view(self.dtype)
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(start, span, 0))
        except Exception:  # no cudart binding in this build
            err = -1
        if err == 0:
            self._registered_ptr = start
            self.tensor = tensor
            if zero:
                self.tensor.zero_()
            return True
        clear_cuda_error()
        try:
            self.tensor = torch.zeros(self.numel, dtype=self.dtype, pin_memory=True)
            return True
        except RuntimeError as e:
            clear_cuda_error()
            if not HostBuffer._warned:
                HostBuffer._warned = True
                warnings.warn(f"lightning_gh: could not page-lock {nbytes / 2**20:.0f} MiB of host memory "
                              f"(cudaHostRegister error {err}; {e}); host<->GPU copies will be synchronous.",
                              stacklevel=3)
            return False

    @property
    def pinned(self) -> bool:
        return self._registered_ptr is not None or (self.numel > 0 and self.tensor.is_pinned())

    def release(self) -> None:
        if self._registered_ptr is not None:
            ptr, self._registered_ptr = self._registered_ptr, None
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:
                pass

    def __del__(self) -> None:  # the storage is freed right after, so it must be unregistered first
        try:
            self.release()
        except Exception:
            pass


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call made outside torch (best effort)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        get_last_error = getattr(lib, "cudaGetLastError", None)
        if get_last_error is not None:
            get_last_error()
            return
