"""Static input buffers: the fixed tensors a captured step reads its batch from.

A CUDA graph reads its inputs from the addresses it saw at capture, so every replay first copies the new
batch into the same tensors. Whether a batch fits is decided by its *signature*: the container structure,
each tensor's shape, dtype and device, and the value of every plain Python leaf (an int or a string in the
batch is baked into the graph, so a different value needs an eager step just like a different shape).

Example::

    static = StaticInputs(batch)              # clones the batch once, outside any graph
    ...capture training_step(static.batch)...
    if static.difference(next_batch) is None:
        static.copy_from(next_batch)          # then replay
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["UnsupportedBatch", "StaticInputs", "batch_signature", "signature_difference"]

_PLAIN = (int, float, bool, str, bytes, type(None))


class UnsupportedBatch(TypeError):
    """The batch holds something a graph cannot take as an input (the message says what)."""


def batch_signature(batch: Any) -> tuple:
    """A hashable description of ``batch``: equal signatures mean the same captured graph can take both batches.

    Args:
        batch: a tensor, or tuples / lists / dicts / namedtuples of tensors and plain Python values.

    Raises:
        UnsupportedBatch: the batch holds another kind of object.
    """
    if isinstance(batch, Tensor):
        return ("tensor", tuple(batch.shape), batch.dtype, batch.device, batch.requires_grad)
    if isinstance(batch, _PLAIN):
        return ("value", type(batch).__name__, batch)
    if isinstance(batch, Mapping):
        return ("map", type(batch).__name__, tuple((k, batch_signature(v)) for k, v in batch.items()))
    if isinstance(batch, (tuple, list)):
        return ("seq", type(batch).__name__, tuple(batch_signature(v) for v in batch))
    raise UnsupportedBatch(
        f"the batch holds a {type(batch).__module__}.{type(batch).__qualname__}; a captured step takes tensors and "
        "plain values in tuples, lists and dicts (convert the batch in `on_before_batch_transfer` or "
        "`transfer_batch_to_device`)")


def _describe(sig: tuple) -> str:
    kind = sig[0]
    if kind == "tensor":
        _, shape, dtype, device, _ = sig
        return f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}"
    if kind == "value":
        return repr(sig[2])
    return sig[1]


def signature_difference(captured: tuple, new: tuple, where: str = "batch", was: str = "captured") -> str | None:
    """The first difference between two signatures, in words (``None`` when equal).

    Args:
        captured: the signature the graph was captured with (or any earlier one).
        new: the signature of the batch at hand.
        where: the name of the position being compared (used in the message).
        was: how the message names the earlier signature.
    """
    if captured == new:
        return None
    if captured[0] != new[0] or captured[1] != new[1] or captured[0] in ("tensor", "value"):
        return f"{where} is {_describe(new)}, {was} {_describe(captured)}"
    a, b = captured[2], new[2]
    if len(a) != len(b):
        return f"{where} has {len(b)} entries, captured {len(a)}"
    if captured[0] == "map":
        for (ka, va), (kb, vb) in zip(a, b):
            if ka != kb:
                return f"{where} has key {kb!r} where {ka!r} was captured"
            d = signature_difference(va, vb, f"{where}[{ka!r}]", was)
            if d:
                return d
    else:
        for i, (va, vb) in enumerate(zip(a, b)):
            d = signature_difference(va, vb, f"{where}[{i}]", was)
            if d:
                return d
    return f"{where} differs from the {was} one"


def _clone(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch.detach().clone()
    if isinstance(batch, _PLAIN):
        return batch
    if isinstance(batch, Mapping):
        return type(batch)((k, _clone(v)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_clone(v) for v in batch))
    return type(batch)(_clone(v) for v in batch)


def _tensors(batch: Any, out: list[Tensor]) -> list[Tensor]:
    if isinstance(batch, Tensor):
        out.append(batch)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            _tensors(v, out)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            _tensors(v, out)
    return out


class StaticInputs:
    """The batch a graph is captured on: one clone, refilled in place before every replay.

    Args:
        batch: the first batch (its signature becomes the captured one).

    Attributes:
        batch: the static copy, with the same structure as ``batch``; pass it to the captured step.
        signature: :func:`batch_signature` of it.
    """

    def __init__(self, batch: Any) -> None:
        self.signature = batch_signature(batch)
        self.batch = _clone(batch)
        self._dst = _tensors(self.batch, [])

    def difference(self, batch: Any) -> str | None:
        """Why ``batch`` cannot be copied in (``None`` when it can)."""
        try:
            sig = batch_signature(batch)
        except UnsupportedBatch as e:
            return str(e)
        return signature_difference(self.signature, sig)

    def copy_from(self, batch: Any) -> None:
        """Copy ``batch`` (which must match, see :meth:`difference`) into the static tensors on the current stream."""
        src = _tensors(batch, [])
        if len(src) != len(self._dst):
            raise ValueError(f"batch has {len(src)} tensors, the static inputs {len(self._dst)}")
        for d, s in zip(self._dst, src):
            if d is not s:
                d.copy_(s, non_blocking=True)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._dst)
