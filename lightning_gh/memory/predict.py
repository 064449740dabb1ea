"""The step's memory before the step runs: one training step traced on fake tensors, and the peak it predicts.

:func:`trace_step` runs a step function (forward and loss) and its backward under
:class:`~torch._subclasses.fake_tensor.FakeTensorMode`: every tensor keeps its shape, dtype and device (``cuda``
stays ``cuda``, so autocast and the attention kernel are chosen as on the device) but owns no memory, so nothing is
allocated on the GPU and nothing real is changed (parameters, their gradients and buffers are copied to fake
ones). :class:`LiveBytes` follows the storage of every tensor the step creates (Note [What the allocator
counts]) and :class:`SavedBytes` counts what autograd saves for backward; the result is a :class:`StepTrace`.
:func:`peak_from_parts` (pure, tested as a table) adds the parts that live outside the step (weights, gradients,
optimizer state, the optimizer's temporaries) in each phase of a step and names the phase of the peak.

Example::

    >>> import torch
    >>> from lightning_gh.memory.predict import trace_step
    >>> layer = torch.nn.Linear(256, 256)
    >>> x = torch.randn(64, 256)
    >>> trace = trace_step(lambda: layer(x).relu().sum(), device_type="cpu")
    >>> trace.saved  # the linear's output, kept by relu's backward: 64 x 256 fp32
    65536
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BLOCK", "LiveBytes", "Peak", "SavedBytes", "StepTrace", "block_bytes", "peak_from_parts", "trace_step"]

#: The CUDA caching allocator's rounding: every block it hands out is a multiple of 512 bytes.
BLOCK = 512


def block_bytes(nbytes: int) -> int:
    """Bytes the caching allocator counts as allocated for a storage of ``nbytes`` (See Note [What the allocator
    counts]).

    >>> [block_bytes(n) for n in (0, 1, 512, 513)]
    [0, 512, 512, 1024]
    """
    return 0 if nbytes <= 0 else -(-nbytes // BLOCK) * BLOCK


# Note [What the allocator counts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.cuda.max_memory_allocated`` counts blocks, one per storage (views share their base's), each rounded up to
# BLOCK bytes. A storage is born as the output of an aten op (factories included) and dies when its last tensor does.
# LiveBytes sees every op's outputs after the op ran, with its inputs still alive, which is the moment the allocator
# holds both; before counting the outputs it drops the storages that died since the last op. It follows only storages
# born inside the traced step on the traced device: parameters, buffers and the batch existed before and are counted
# by the caller (in the plan's base). Memory a kernel allocates and frees inside itself (a workspace) is not seen.


class LiveBytes(TorchDispatchMode):
    """Bytes held by the storages created since it was entered, now and at their peak. See Note [What the
    allocator counts].

    Args:
        device_type: the device whose storages count (``"cuda"``; fake tensors report the device they stand for).
        fake_mode: the ``FakeTensorMode`` below this one, if any: real inputs it turns into fake ones (parameters)
            are pre-existing storages too.
    """

    def __init__(self, device_type: str, fake_mode: Any = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.fake_mode = fake_mode
        self.live = 0
        self.peak = 0
        self.ops = 0
        self.unseen: set[str] = set()  # types of outputs without one storage (tensor subclasses)
        self.born = 0  # storages created so far: each one's serial number
        self._storages: dict[int, tuple[StorageWeakRef, int, int, str]] = {}  # key -> (ref, bytes, serial, op)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was created inside the traced step and is alive."""
        key = _storage_key(t)
        return key is not None and key in self._storages and not self._storages[key][0].expired()

    def now(self) -> int:
        """Bytes alive now (after dropping the storages that died since the last op)."""
        self._sweep()
        return self.live

    def bytes_since(self, serial: int) -> int:
        """Bytes of the live storages created after the ``serial``-th one (``born`` then)."""
        self._sweep()
        return sum(n for _, n, s, _ in self._storages.values() if s > serial)

    def alive(self) -> list[tuple[int, str]]:
        """``(bytes, op that created it)`` of each live storage, largest first."""
        self._sweep()
        return sorted(((n, op) for _, n, _, op in self._storages.values()), reverse=True)

    def _input_keys(self, args: tuple, kwargs: dict | None) -> set[int | None]:
        keys = set()
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                keys.add(_storage_key(a))
                if self.fake_mode is not None:  # a real input (a parameter) stands for its fake twin below us
                    twin = self.fake_mode.fake_tensor_converter._get_memo(a)
                    keys.add(None if twin is None else _storage_key(twin))
        return keys

    def reset_peak(self) -> None:
        self._sweep()
        self.peak = self.live

    def _sweep(self) -> None:
        dead = [k for k, (ref, *_) in self._storages.items() if ref.expired()]
        for k in dead:
            self.live -= self._storages.pop(k)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = None
        swept = False
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            if not swept:  # drop the storages that died since the last op before counting new ones
                self._sweep()
                swept = True
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                self.unseen.add(type(t).__name__)
                continue
            ref = StorageWeakRef(st)
            if ref.cdata not in self._storages:
                if inputs is None:  # a view or in-place result shares an input's storage: nothing new allocated
                    inputs = self._input_keys(args, kwargs)
                if ref.cdata in inputs:
                    continue
                n = block_bytes(st.nbytes())
                self.born += 1
                self._storages[ref.cdata] = (ref, n, self.born, str(func))
                self.live += n
        self.peak = max(self.peak, self.live)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):
        return None


class SavedBytes:
    """Bytes autograd saves for backward among the storages ``live`` follows (activations: never parameters, the
    batch or buffers), each storage once. A context manager over :func:`torch.autograd.graph.saved_tensors_hooks`.

    What a non-reentrant ``torch.utils.checkpoint`` region saves goes to that region's own hooks, not to these:
    its inputs are held by the region and show in :attr:`StepTrace.retained`, not here.
    """

    def __init__(self, live: LiveBytes) -> None:
        self.live = live
        self.bytes = 0
        self.tensors = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._seen and self.live.owns(t):
            self._seen.add(key)
            self.bytes += block_bytes(t.untyped_storage().nbytes())
            self.tensors += 1
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


#: Largest output (bytes) an op whose inputs are all real runs for real with (See Note [Real small ops]).
SMALL = 1 << 20


# Note [Real small ops]
# ~~~~~~~~~~~~~~~~~~~~~
# A fake tensor has no values, so code that reads them (``.item()``, ``if mask.all()``, a boolean index) cannot run
# on one, and code that checks for fake tensors takes another path (transformers builds a 4-D attention mask and
# repeats grouped k/v heads "while tracing" where the real run uses SDPA's ``is_causal`` and its GQA). So the batch
# stays real (a copy: the step may edit it in place), and an op whose tensor inputs are all real and whose outputs
# are small (positions, masks, shifted labels: at most SMALL bytes, measured on meta tensors first) runs for real;
# anything that touches a parameter, a buffer or an activation runs on fake tensors. The step then takes the branches
# the real step takes, and its small real tensors are counted like the others.


class _RealSmallOps(TorchDispatchMode):
    """Runs ops whose tensor inputs are all real and whose outputs are small for real. See Note [Real small ops]."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            try:
                meta = func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
                size = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(meta)
                           if isinstance(t, torch.Tensor))
            except Exception:  # no meta kernel, or a shape that depends on the values: decide by the inputs
                size = sum(t.numel() * t.element_size() for t in tensors)
            if size <= SMALL:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _to_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


@dataclass(frozen=True)
class StepTrace:
    """What one traced step holds on its device, in allocator blocks (Note [What the allocator counts]).

    Attributes:
        saved: bytes saved for backward (see :class:`SavedBytes`).
        retained: bytes alive when the forward (step function) returned: what the step holds into backward (saved
            tensors, the inputs a checkpointed region keeps, the returned loss).
        forward_peak: the most bytes alive at once during the forward (retained plus its largest transient: the
            logits and their fp32 copy beside the loss's softmax, for a language model).
        backward_peak: the most bytes alive at once during backward, counted from before the forward: what is left
            of the retained bytes, the gradients of the parameters as they arrive, the gradients of the activations,
            and a checkpointed block's recompute.
        grads: bytes of the gradients the backward created (alive when it returned).
        ops: aten ops the trace ran (forward and backward).
        seconds: how long the trace took (host time).
    """

    saved: int
    retained: int
    forward_peak: int
    backward_peak: int
    grads: int
    ops: int
    seconds: float


@contextlib.contextmanager
def _fake_weights(module: torch.nn.Module | None, mode: Any) -> Iterator[None]:
    """Swap ``module``'s parameters and buffers for fake twins (tied ones stay tied) while the trace runs, so that the
    backward's gradients land on the twins and views of a weight share the twin's storage."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    twins: dict[int, torch.Tensor] = {}
    try:
        for mod in (module.modules() if module is not None else ()):
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in twins:
                        twins[id(t)] = mode.from_tensor(t)
                    swapped.append((table, name, t))
                    table[name] = twins[id(t)]
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def trace_step(step: Callable[..., Any], *args: Any, device_type: str, module: torch.nn.Module | None = None,
               backward: bool = True, fake: bool = True) -> StepTrace:
    """Run ``step(*args)`` (forward and loss; returns the loss, or something holding it) and its backward once, and
    say what they hold on ``device_type``.

    Args:
        step: the forward and loss; the ``"loss"`` of a returned dict, else the first floating-point tensor that
            requires grad among its outputs, else its ``.loss``, is the loss.
        args: passed to ``step`` (a copy of their tensors; See Note [Real small ops]).
        device_type: the device whose memory is predicted (``"cuda"``).
        module: the module whose parameters and buffers ``step`` uses: they become fake ones while it runs, and the
            backward's gradients land on those (nothing real gets a gradient).
        backward: also run the backward (``loss.backward()``).
        fake: under ``FakeTensorMode`` (nothing allocated, nothing real changed); ``False`` runs it for real (how the
            tests measure what the trace predicts).

    Raises whatever the step raises on fake tensors (an op without a fake kernel, a shape that depends on data:
    :class:`~torch._subclasses.fake_tensor.DataDependentOutputException` and its kind); callers turn it into a
    reason.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    if mode is not None:  # the step may edit its batch in place: it gets a copy (See Note [Real small ops])
        args = pytree.tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)
    with (mode or contextlib.nullcontext()), _fake_weights(module if fake else None, mode), \
            LiveBytes(device_type, mode) as live, (_RealSmallOps() if fake else contextlib.nullcontext()):
        with SavedBytes(live) as saved:
            out = step(*args)
        loss = _loss_of(out)
        retained, forward_peak = live.now(), live.peak
        grads = 0
        if backward and loss is not None:
            born = live.born
            live.reset_peak()
            loss.backward()
            grads = live.bytes_since(born)  # what backward leaves behind: the gradients
        backward_peak = live.peak
        ops = live.ops
        del out, loss
    return StepTrace(saved=saved.bytes, retained=retained, forward_peak=forward_peak, backward_peak=backward_peak,
                     grads=grads, ops=ops, seconds=time.perf_counter() - t0)


def _loss_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            return t
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


@dataclass(frozen=True)
class Peak:
    """The predicted peak of a step and the phase it falls in.

    Attributes:
        allocated: the peak of ``torch.cuda.max_memory_allocated`` over a step after the first.
        phase: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        phases: the peak of each phase.
    """

    allocated: int
    phase: str
    phases: dict[str, int]


def peak_from_parts(*, base: int, grads: int, state: int, step_temp: int, forward_peak: int, backward_peak: int,
                    grads_made: int, grads_kept: bool = False) -> Peak:
    """The peak of a training step from its parts (bytes), in the order Lightning's automatic optimization runs
    them: the forward (``training_step``) with last step's gradients still alive (``zero_grad`` runs after it,
    before backward), the backward, then the optimizer step.

    Args:
        base: what is allocated before the step and stays: weights, buffers, the batch, any buffers of the parts.
        grads: the gradients' bytes on the device once backward has run.
        state: the optimizer state on the device once created.
        step_temp: the optimizer step's temporaries (see :func:`lightning_gh.memory.optim.step_temporaries`).
        forward_peak: :attr:`StepTrace.forward_peak`.
        backward_peak: :attr:`StepTrace.backward_peak` (counts the gradients it created, ``grads_made``).
        grads_made: :attr:`StepTrace.grads`.
        grads_kept: gradients are not freed before backward (gradient accumulation between optimizer steps), so
            backward adds into them instead of creating them.

    >>> peak_from_parts(base=10, grads=4, state=8, step_temp=4, forward_peak=30, backward_peak=25, grads_made=4)
    Peak(allocated=52, phase='forward', phases={'forward': 52, 'backward': 43, 'optimizer step': 26})
    """
    backward = base + state + backward_peak + (grads - grads_made if grads_kept else 0)
    phases = {"forward": base + grads + state + forward_peak, "backward": backward,
              "optimizer step": base + grads + state + step_temp}
    phase = max(phases, key=lambda k: phases[k])
    return Peak(phases[phase], phase, phases)
