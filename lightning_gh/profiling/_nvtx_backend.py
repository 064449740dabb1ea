"""Where :class:`~lightning_gh.profiling.nvtx.NVTXRangeCallback` sends its ranges.

Three backends, tried in this order:

``nvtx``
    The ``nvtx`` package (``pip install nvtx``): a dedicated domain, registered message strings,
    colours, named categories and an int64 payload. When no tool is attached to the process (no
    Nsight Systems, no ``NVTX_INJECTION64_PATH``) the package hands back a dummy domain and every
    call would be a no-op; the backend then reports ``tool_attached = False`` and the callback stays
    out of the way entirely.
``torch``
    ``torch.cuda.nvtx`` (CUDA builds of torch only): plain ASCII messages in the global domain; no
    colour, category, payload or domain.
``none``
    Nothing to send to: the caller warns once and becomes a no-op.

The environment variable ``LGH_NVTX_BACKEND`` (``auto`` | ``nvtx`` | ``torch`` | ``none``) forces
one, for tests and for comparing backends; ``auto`` (the default) picks the first available.
Nothing here imports ``nvtx`` at module import time.
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["push_pop_cost_us", "BACKEND_ENV", "BACKEND_CHOICES", "Backend", "NvtxPackageBackend", "TorchBackend", "NullBackend",
           "select_backend"]

BACKEND_ENV = "LGH_NVTX_BACKEND"
BACKEND_CHOICES = ("auto", "nvtx", "torch", "none")


class Backend:
    """A sink for NVTX ranges; ``prepare`` once per message, then ``push``/``pop`` or ``start``/``end``."""

    name = "none"
    #: True when the events go somewhere (a tool is attached); False means every call is a no-op.
    tool_attached = False
    #: Why the backend is what it is (for the one warning / the demo's report).
    reason = ""

    def prepare(self, message: str, color: int, category: str) -> Any:
        """A reusable handle for ``message`` (registered string, colour, category), built once."""
        return message

    def push(self, handle: Any, payload: int | None = None) -> None:
        """Open a nested range on the calling thread."""

    def pop(self) -> None:
        """Close the innermost range this backend opened on the calling thread."""

    def start(self, handle: Any, payload: int | None = None) -> int | None:
        """Open a process range (may end on another thread); returns its id."""
        return None

    def end(self, range_id: int | None) -> None:
        """Close a process range opened by :meth:`start`."""


class NullBackend(Backend):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class NvtxPackageBackend(Backend):
    """The ``nvtx`` package, one domain per backend."""

    name = "nvtx"

    def __init__(self, domain: str) -> None:
        import nvtx  # lazy: an optional dependency

        self._nvtx = nvtx
        self._domain = nvtx.get_domain(domain)
        # A disabled domain (no tool attached, or NVTX_DISABLE set) is a dummy object without a handle.
        self.tool_attached = bool(nvtx.enabled()) and hasattr(self._domain, "handle")
        self.reason = (f"nvtx {getattr(nvtx, '__version__', '')}".strip() + f", domain {domain!r}"
                       + ("" if self.tool_attached else ", no NVTX tool attached"))
        if self.tool_attached:
            self._push = self._domain.push_range
            self._pop = self._domain.pop_range
            self._start = self._domain.start_range
            self._end = self._domain.end_range

    def prepare(self, message: str, color: int, category: str) -> Any:
        if not self.tool_attached:
            return None
        # Registers the message string and names the category once, in this domain.
        return self._domain.get_event_attributes(message=message, color=color, category=category)

    def push(self, handle: Any, payload: int | None = None) -> None:
        if payload is not None:
            handle.payload = payload
        self._push(handle)

    def pop(self) -> None:
        self._pop()

    def start(self, handle: Any, payload: int | None = None) -> int | None:
        if payload is not None:
            handle.payload = payload
        return self._start(handle)

    def end(self, range_id: int | None) -> None:
        if range_id is not None:
            self._end(range_id)


class TorchBackend(Backend):
    """``torch.cuda.nvtx``: the global domain, ASCII messages, nothing else."""

    name = "torch"

    def __init__(self) -> None:
        from torch._C import _nvtx  # ImportError on CPU-only builds

        self._push = _nvtx.rangePushA
        self._pop = _nvtx.rangePop
        # process ranges (start/end) arrived in torch later than push/pop
        self._start = getattr(_nvtx, "rangeStartA", None)
        self._end = getattr(_nvtx, "rangeEnd", None)
        # torch cannot tell whether a tool listens; an unattached NVTX call costs well under a microsecond.
        self.tool_attached = True
        self.reason = "torch.cuda.nvtx (global domain; no colours, categories or payloads)"

    def prepare(self, message: str, color: int, category: str) -> Any:
        return message

    def push(self, handle: Any, payload: int | None = None) -> None:
        self._push(handle)

    def pop(self) -> None:
        self._pop()

    def start(self, handle: Any, payload: int | None = None) -> int | None:
        return self._start(handle) if self._start is not None else None

    def end(self, range_id: int | None) -> None:
        if range_id is not None and self._end is not None:
            self._end(range_id)


def _try_nvtx(domain: str) -> tuple[Backend | None, str]:
    try:
        return NvtxPackageBackend(domain), ""
    except ImportError as e:
        return None, f"the nvtx package is not installed ({e})"


def _try_torch() -> tuple[Backend | None, str]:
    try:
        return TorchBackend(), ""
    except ImportError:
        return None, "this torch build has no NVTX (torch.cuda.nvtx needs a CUDA build)"


def select_backend(domain: str, choice: str | None = None) -> Backend:
    """The backend to use: ``choice`` or ``$LGH_NVTX_BACKEND`` or ``auto``.

    Raises:
        ValueError: the choice is not one of :data:`BACKEND_CHOICES`.
    """
    choice = (choice or os.environ.get(BACKEND_ENV) or "auto").strip().lower()
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={choice!r} is not valid; expected one of {BACKEND_CHOICES}.")
    if choice == "none":
        return NullBackend(f"{BACKEND_ENV}=none")
    reasons = []
    if choice in ("auto", "nvtx"):
        backend, why = _try_nvtx(domain)
        if backend is not None:
            return backend
        reasons.append(why)
    if choice in ("auto", "torch"):
        backend, why = _try_torch()
        if backend is not None:
            return backend
        reasons.append(why)
    return NullBackend("; ".join(reasons))


def push_pop_cost_us(backend: Backend, n: int = 20000) -> float:
    """Mean cost of one push+pop pair through ``backend``, as the callback makes it, in microseconds.

    The pairs are nested in an open outer range so that a tool's buffer is not flushed on every pop (tools flush
    when a thread's outermost range ends).
    """
    h, outer = backend.prepare("forward", 0xFF3498DB, "compute"), backend.prepare("outer", 0xFF000000, "step")
    backend.push(outer, 0)
    t0 = time.perf_counter()
    for i in range(n):
        backend.push(h, i)
        backend.pop()
    dt = time.perf_counter() - t0
    backend.pop()
    return dt / n * 1e6
