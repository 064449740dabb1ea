"""Advice and prefetch for tensors in managed memory: where their pages should live, and moving them ahead of use.

All functions take a tensor or an iterable of tensors and act on each tensor's whole storage, once per storage.
A tensor that is not in managed memory is refused with its name (advice on ordinary device memory is a CUDA
error). Advice and prefetch work on whole pages (4 KiB host, 2 MiB GPU): tensors that share a page with a neighbour
in the same pool share its advice; pools never share pages, so advice never leaks between pools.

``prefetch(..., to="gpu")`` needs GPU memory for the pages it moves. Where the GPU is not coherent with host memory
it is refused unless the GPU has room for them plus ``headroom_bytes`` (the same rule as the pool's guard).

Example::

    with lightning_gh.managed_memory("cpu"):
        table = torch.zeros(1 << 28, device="cuda")
    prefetch(table, to="gpu")        # before a phase that reads it many times
    ...
    prefetch(table, to="cpu")        # give the GPU memory back
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import torch

from lightning_gh import hardware
from lightning_gh._util import fmt_bytes
from lightning_gh.unified import shim as _shim
from lightning_gh.unified.guard import ManagedMemoryError
from lightning_gh.unified.options import DEFAULT_HEADROOM_BYTES, PREFERRED

__all__ = ["advise", "is_managed", "locations", "managed_storages", "prefetch"]

Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


def _as_list(tensors: Tensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor.")
    return out


def managed_storages(tensors: Tensors, *, strict: bool = True) -> list[tuple[int, int, int]]:
    """``(pointer, bytes, device)`` of each distinct managed storage behind ``tensors``.

    Args:
        tensors: CUDA tensors in managed memory.
        strict: raise on a tensor that is not in managed memory (else skip it).

    Raises:
        ValueError: (``strict``) a tensor that is not a CUDA tensor in managed memory.
    """
    lib = _shim.load()
    seen: set[int] = set()
    out: list[tuple[int, int, int]] = []
    for i, t in enumerate(_as_list(tensors)):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in seen:
            continue
        kind = lib.pointer_kind(ptr)[0] if t.is_cuda else "host"
        if kind != "managed":
            if strict:
                raise ValueError(f"tensors[{i}] (shape {tuple(t.shape)}, {t.dtype}, {t.device}) is in {kind} memory, "
                                 "not managed memory; allocate it inside lightning_gh.managed_memory().")
            continue
        seen.add(ptr)
        out.append((ptr, nbytes, t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return out


def is_managed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is CUDA managed memory (``False`` without CUDA)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor is a {type(tensor).__name__}, not a torch.Tensor.")
    if not tensor.is_cuda or not torch.cuda.is_available():
        return False
    return bool(managed_storages(tensor, strict=False))


def locations(tensor: torch.Tensor) -> dict[str, str]:
    """Where the advice says ``tensor``'s pages should be, and where they were last prefetched to:
    ``{"preferred": "cpu" | "cuda:N" | "none", "last_prefetch": ...}``."""
    ((ptr, nbytes, _),) = managed_storages(tensor)
    pref, last = _shim.load().range_locations(ptr, nbytes)
    name = lambda v: "cpu" if v == -1 else ("none" if v < -1 else f"cuda:{v}")  # noqa: E731
    return {"preferred": name(pref), "last_prefetch": name(last)}


def _check_preferred(name: str, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or value not in PREFERRED):
        raise ValueError(f"{name}={value!r} is not a location; allowed: 'cpu' or 'gpu'.")


def advise(tensors: Tensors, *, preferred: str | None = None, accessed_by_gpu: bool | None = None) -> int:
    """Change the advice of managed tensors (``None`` leaves that advice as it is).

    Args:
        tensors: CUDA tensors in managed memory.
        preferred: ``"cpu"`` or ``"gpu"`` (their own device): the preferred location of their pages.
        accessed_by_gpu: ``True`` keeps their device's mapping to the pages wherever they are; ``False`` drops it.

    Returns:
        The bytes advised.
    """
    _check_preferred("preferred", preferred)
    if accessed_by_gpu is not None and not isinstance(accessed_by_gpu, bool):
        raise TypeError(f"accessed_by_gpu={accessed_by_gpu!r} must be True, False or None.")
    lib = _shim.load()
    total = 0
    for ptr, nbytes, dev in managed_storages(tensors):
        calls = []
        if preferred is not None:
            calls.append(("set_preferred", -1 if preferred == "cpu" else dev))
        if accessed_by_gpu is not None:
            calls.append(("set_accessed_by" if accessed_by_gpu else "unset_accessed_by", dev))
        for advice, loc in calls:
            err = lib.advise(ptr, nbytes, advice, loc)
            if err:
                raise RuntimeError(f"cudaMemAdvise({advice}) on {fmt_bytes(nbytes)} at cuda:{dev} failed: "
                                   f"{lib.error_text(err)}")
        total += nbytes
    return total


def prefetch(tensors: Tensors, to: str, *, stream: torch.cuda.Stream | None = None,
             headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> int:
    """Start moving managed tensors' pages to the host or to their GPU (``cudaMemPrefetchAsync``, asynchronous on
    ``stream``; kernels later on that stream see the pages there). Inside a CUDA graph capture it does nothing.

    Args:
        tensors: CUDA tensors in managed memory.
        to: ``"cpu"`` or ``"gpu"``.
        stream: the CUDA stream (default: the current stream of the tensors' device).
        headroom_bytes: for ``to="gpu"`` on a GPU that is not coherent with host memory: GPU memory that must stay
            free after the move.

    Returns:
        The bytes prefetched.

    Raises:
        ManagedMemoryError: ``to="gpu"`` on a non-coherent GPU without room for the pages plus the headroom.
    """
    _check_preferred("to", to)
    if isinstance(headroom_bytes, bool) or not isinstance(headroom_bytes, int) or headroom_bytes < 0:
        raise ValueError(f"headroom_bytes={headroom_bytes!r} must be an int >= 0.")
    if torch.cuda.is_current_stream_capturing():
        return 0
    lib = _shim.load()
    storages = managed_storages(tensors)
    if to == "gpu":
        by_dev: dict[int, int] = {}
        for _, nbytes, dev in storages:
            by_dev[dev] = by_dev.get(dev, 0) + nbytes
        for dev, nbytes in by_dev.items():
            if hardware.coherent_host_memory(dev):
                continue
            room = hardware.gpu_memory_room(torch.device("cuda", dev))
            if room is not None and nbytes + headroom_bytes > room[0]:
                raise ManagedMemoryError(
                    f"prefetch(to='gpu') of {fmt_bytes(nbytes)} refused on cuda:{dev}: the GPU has "
                    f"{fmt_bytes(room[0])} free and {fmt_bytes(headroom_bytes)} must stay free; on a GPU that does "
                    "not read host memory coherently, migrating more than fits can hang the GPU.")
    total = 0
    for ptr, nbytes, dev in storages:
        s = stream if stream is not None else torch.cuda.current_stream(dev)
        err = lib.prefetch(ptr, nbytes, -1 if to == "cpu" else dev, int(s.cuda_stream))
        if err:
            raise RuntimeError(f"cudaMemPrefetchAsync of {fmt_bytes(nbytes)} to {to} failed: {lib.error_text(err)}")
        total += nbytes
    return total
