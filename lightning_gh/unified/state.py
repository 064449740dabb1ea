"""Optimizer state in managed memory: the engine behind the ``ManagedOptimizerState`` callback, usable without
Lightning through :func:`manage_optimizer_state`.

The optimizer stays what it is (``torch.optim.AdamW(fused=True)`` reads and writes its moments in place, on the GPU);
only the memory behind its state changes. With ``preferred="cpu"`` the moments (and any fp32 master copy the
optimizer keeps in its state) live in host memory and take no GPU memory: each step the GPU's kernel reads and
writes them over the host link (NVLink-C2C on Grace Hopper, PCIe elsewhere). No CPU Adam, no copies we write.

When the state is created
    Adam and AdamW (torch's, or subclasses that keep their ``_init_group``) create their state lazily inside
    ``step()``. :meth:`OptimizerStatePlacement.ensure_state` runs the optimizer's own ``_init_group`` inside the
    managed pool just before that, for the parameters that have a gradient and no state, so the state is born in
    managed memory and never occupies GPU memory (Lightning: ``on_before_optimizer_step``; plain PyTorch: a step
    pre-hook). Other optimizers create their state in ``step()`` on the GPU; a step post-hook moves it into the pool
    after the step that created it (that step holds it on the GPU once).

What moves into the pool
    Every CUDA tensor in ``optimizer.state`` (moments, ``step`` counters that live on the GPU, master weights), on
    the device of its parameter. State that is already managed stays where it is. ``load_state_dict`` runs inside
    the pool, so a restored state lands in managed memory directly (from a CPU checkpoint) or is moved there
    right after (from GPU tensors).

Phases (``prefetch="step"``)
    Just before the optimizer step the state is prefetched to the GPU (only when the GPU has room for it plus the
    headroom; else that step reads it in place and one warning says so); for ``preferred="cpu"`` it is prefetched
    back to the host on a side stream right after the step, overlapping the next forward. Nothing is prefetched
    during a CUDA graph capture (a prefetch cannot be captured); the captured step reads the state where it is.
    On a PCIe GPU this is much slower than the default, reading the state in place (migrating pages costs far more
    than the GPU's direct reads of host memory; docs/unified_memory.md has the figures), so it is off by default;
    it is for GPU-preferred state that the driver may evict (Grace Hopper with oversubscription).

Example::

    model = MyModel().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    placement = manage_optimizer_state(opt, preferred="cpu")
    for batch in data:
        loss_fn(model(batch)).backward()
        opt.step()                     # the pre-hook created the moments in host-preferred managed memory
        opt.zero_grad()
    print(placement.report())
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_gh import hardware
from lightning_gh._host import check_host_room
from lightning_gh._util import fmt_bytes, warn_once
from lightning_gh.unified import shim as _shim
from lightning_gh.unified.guard import ManagedMemoryUnavailable, pool_bytes_for
from lightning_gh.unified.options import ManagedMemoryOptions
from lightning_gh.unified.pool import ManagedPool, get_pool

__all__ = ["OptimizerStatePlacement", "PlacementReport", "manage_optimizer_state", "creates_state_eagerly"]


def creates_state_eagerly(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the placement can create ``optimizer``'s state in the pool before its first step: torch's Adam and
    AdamW (and subclasses that keep their ``_init_group``), whose state layout is torch's own."""
    init = getattr(type(optimizer), "_init_group", None)
    known = {getattr(cls, "_init_group", None) for cls in (torch.optim.Adam, torch.optim.AdamW)}
    return init is not None and init in known


@dataclass
class PlacementReport:
    """What the placement holds in managed memory.

    Attributes:
        preferred: ``"cpu"`` or ``"gpu"``.
        tensors: state tensors in managed memory.
        state_bytes: their bytes.
        keys: the state keys seen (``exp_avg``, ``exp_avg_sq``, ``step``, a master-weight key ...).
        created_bytes: bytes created directly in the pool (Adam/AdamW's first step, or a load).
        moved_bytes: bytes moved into the pool from ordinary GPU memory.
        prefetches: per-step prefetches issued to the GPU; ``skipped_prefetches``: refused for lack of room.
    """

    preferred: str
    tensors: int = 0
    state_bytes: int = 0
    keys: list[str] = field(default_factory=list)
    created_bytes: int = 0
    moved_bytes: int = 0
    prefetches: int = 0
    skipped_prefetches: int = 0

    def describe(self) -> str:
        where = "host-preferred" if self.preferred == "cpu" else "GPU-preferred"
        return (f"{fmt_bytes(self.state_bytes)} of optimizer state ({self.tensors} tensors: "
                f"{', '.join(self.keys) or 'none yet'}) in {where} managed memory")


class OptimizerStatePlacement:
    """Keep one optimizer's state in a managed-memory pool (see the module docstring for when and how).

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose parameters are on CUDA devices.
        options: pool, guard and prefetch options.
        step_pre_hook: create Adam/AdamW state in a step pre-hook (plain PyTorch). Lightning runs forward and
            backward inside ``optimizer.step(closure)``, after the pre-hooks, so its callback calls
            :meth:`before_step` from ``on_before_optimizer_step`` instead.

    Raises:
        ValueError: parameters that are not on a CUDA device.
        ManagedMemoryUnavailable: managed memory cannot be used here (the reason).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, options: ManagedMemoryOptions | None = None, *,
                 step_pre_hook: bool = True) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer.")
        self.optimizer = optimizer
        self.options = options or ManagedMemoryOptions()
        devices = {p.device for g in optimizer.param_groups for p in g["params"]}
        non_cuda = sorted(str(d) for d in devices if d.type != "cuda")
        if non_cuda:
            raise ValueError(f"{type(optimizer).__name__} has parameters on {non_cuda}; managed memory holds the state "
                             "of parameters on CUDA devices.")
        self._pools: dict[int, ManagedPool] = {d.index: get_pool(self.options, d) for d in devices}
        self.eager = creates_state_eagerly(optimizer)
        self._init_args: int | None = None
        if self.eager:
            self._init_args = len(inspect.signature(optimizer._init_group).parameters) - 1  # type: ignore[attr-defined]
        self.report_ = PlacementReport(self.options.preferred)
        self._storages: list[tuple[int, int, int]] = []
        self._scan_after_step = True
        self._complete = False
        self._side: dict[int, torch.cuda.Stream] = {}
        self._warned_room = False
        self._hooks: list[Any] = []
        self._original_load = optimizer.__dict__.get("load_state_dict")
        self._install(step_pre_hook)

    # ------------------------------------------------------------------ hooks
    def _install(self, step_pre_hook: bool) -> None:
        # The hooks hold the placement (strongly): it lives as long as the optimizer, until remove().
        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            self.before_step()

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            self.after_step()

        if step_pre_hook:
            self._hooks.append(self.optimizer.register_step_pre_hook(pre))
        self._hooks.append(self.optimizer.register_step_post_hook(post))
        original = self.optimizer.load_state_dict

        def load_state_dict(state_dict: dict[str, Any]) -> None:
            self._check_room(_state_dict_sizes(state_dict), what="the optimizer state being loaded")
            with self._scope():
                original(state_dict)
            self._after_load()

        self.optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]

    def remove(self) -> None:
        """Stop managing: remove the hooks and the ``load_state_dict`` wrapper (the state stays where it is)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._original_load is None:
            self.optimizer.__dict__.pop("load_state_dict", None)
        else:
            self.optimizer.load_state_dict = self._original_load  # type: ignore[method-assign]

    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for pool in self._pools.values():
                stack.enter_context(pool.scope(self.options))
            yield

    # ------------------------------------------------------------------ checks
    def _check_room(self, sizes: dict[int, list[int]], *, what: str) -> None:
        total = 0
        for dev, ns in sizes.items():
            pool = self._pools.get(dev)
            if pool is None or not ns:
                continue
            need = pool_bytes_for(ns)
            total += need
            pool.check_fits(need, self.options, what=what)
        if total and self.options.preferred == "cpu":
            check_host_room(total, what=f"ManagedOptimizerState: {what} in host-preferred managed memory",
                            tips=("use preferred='gpu'", "use fewer or smaller optimizer states"),
                            part="ManagedOptimizerState", owner=self)

    # ------------------------------------------------------------------ placement
    def ensure_state(self) -> int:
        """Create the missing state of parameters that have a gradient, inside the pool (Adam/AdamW only).
        Returns the bytes created."""
        if not self.eager or torch.cuda.is_current_stream_capturing():
            return 0
        state = self.optimizer.state
        if self._complete and len(state) >= self._n_params:
            return 0
        missing: dict[int, list[int]] = {}
        groups = []
        k = 3 if any(g.get("amsgrad", False) for g in self.optimizer.param_groups) else 2
        for g in self.optimizer.param_groups:
            need = [p for p in g["params"] if p.grad is not None and len(state.get(p, ())) == 0]
            if need:
                groups.append(g)
                for p in need:
                    missing.setdefault(p.device.index, []).extend([p.nbytes] * k + [4])
        self._complete = True
        if not groups:
            return 0
        self._check_room(missing, what="the optimizer's new state")
        self._refresh()
        before = self.report_.state_bytes
        with self._scope():
            for g in groups:
                self.optimizer._init_group(g, *([] for _ in range(self._init_args or 0)))  # type: ignore[attr-defined]
        self._refresh()
        created = self.report_.state_bytes - before
        self.report_.created_bytes += created
        return created

    @property
    def _n_params(self) -> int:
        return sum(1 for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad)

    def place(self) -> int:
        """Move every CUDA state tensor that is not in managed memory into the pool (returns the bytes moved)."""
        if torch.cuda.is_current_stream_capturing():
            return 0
        lib = _shim.load()
        todo: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for st in self.optimizer.state.values():
            for key, t in st.items():
                if not isinstance(t, torch.Tensor) or not t.is_cuda or t.numel() == 0:
                    continue
                if type(t) is not torch.Tensor:  # DTensor and other subclasses own their storage
                    raise ManagedMemoryUnavailable(
                        f"optimizer state '{key}' is a {type(t).__name__}; managed memory holds plain tensors "
                        "(FSDP/DTensor state is not supported).")
                if lib.pointer_kind(t.untyped_storage().data_ptr())[0] != "managed":
                    todo.append((st, key, t))
        if not todo:
            self._refresh()
            return 0
        sizes: dict[int, list[int]] = {}
        for _, _, t in todo:
            sizes.setdefault(t.device.index, []).append(t.nbytes)
        self._check_room(sizes, what="the optimizer state moved into managed memory")
        moved = 0
        with self._scope():
            for st, key, t in todo:
                new = torch.empty_like(t)
                new.copy_(t)
                st[key] = new
                moved += t.nbytes
        del todo
        # The old blocks stay in PyTorch's cache until emptied; give them back so the GPU memory is really free.
        torch.cuda.empty_cache()
        self.report_.moved_bytes += moved
        self._refresh()
        return moved

    def _refresh(self) -> None:
        lib = _shim.load()
        seen: set[int] = set()
        storages: list[tuple[int, int, int]] = []
        keys: dict[str, None] = {}
        tensors = nbytes = 0
        for st in self.optimizer.state.values():
            for key, t in st.items():
                if not isinstance(t, torch.Tensor) or not t.is_cuda or t.numel() == 0:
                    continue
                s = t.untyped_storage()
                if lib.pointer_kind(s.data_ptr())[0] != "managed":
                    continue
                keys[key] = None
                tensors += 1
                nbytes += t.nbytes
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    storages.append((s.data_ptr(), s.nbytes(), t.device.index))
        self._storages = storages
        r = self.report_
        r.tensors, r.state_bytes, r.keys = tensors, nbytes, list(keys)

    def _after_load(self) -> None:
        self._complete = False
        self._scan_after_step = True
        self.place()

    # ------------------------------------------------------------------ per step
    def before_step(self) -> None:
        """Just before the update: create missing Adam/AdamW state in the pool; with ``prefetch="step"``, move the
        state to the GPU when it has room."""
        self.ensure_state()
        if self.options.prefetch == "step" and self._storages and not torch.cuda.is_current_stream_capturing():
            self._prefetch_to_gpu()

    def after_step(self) -> None:
        """Right after the update: place state a non-Adam optimizer created on the GPU; with ``prefetch="step"`` and
        ``preferred="cpu"``, send the state back to the host on a side stream."""
        if torch.cuda.is_current_stream_capturing():
            return
        if self._scan_after_step:
            moved = self.place()
            if moved == 0 and self.optimizer.state:
                self._scan_after_step = False  # the state exists and is placed; check again after a load
        if self.options.prefetch == "step" and self.options.preferred == "cpu" and self._storages:
            lib = _shim.load()
            for ptr, nbytes, dev in self._storages:
                side = self._side.setdefault(dev, torch.cuda.Stream(device=dev))
                side.wait_stream(torch.cuda.current_stream(dev))  # after the update's kernels
                _check_prefetch(lib, lib.prefetch(ptr, nbytes, -1, int(side.cuda_stream)), nbytes, "the host")

    def _prefetch_to_gpu(self) -> None:
        lib = _shim.load()
        by_dev: dict[int, int] = {}
        for _, nbytes, dev in self._storages:
            by_dev[dev] = by_dev.get(dev, 0) + nbytes
        for dev, need in by_dev.items():
            pool = self._pools[dev]
            # GPU-preferred pages were populated on the GPU and normally are still there: no room needed.
            if self.options.preferred == "cpu" and not pool.coherent:
                room = hardware.gpu_memory_room(pool.device)
                if room is not None and need + self.options.headroom_bytes > room[0]:
                    self.report_.skipped_prefetches += 1
                    if not self._warned_room:
                        self._warned_room = True
                        warnings.warn(
                            f"ManagedOptimizerState(prefetch='step'): {fmt_bytes(need)} of optimizer state do not fit "
                            f"in the {fmt_bytes(room[0])} free on {pool.device} (headroom "
                            f"{fmt_bytes(self.options.headroom_bytes)}), so the step reads the state in place "
                            "instead (this is the only warning).", UserWarning, stacklevel=2)
                    continue
            current = torch.cuda.current_stream(dev)
            if dev in self._side:
                current.wait_stream(self._side[dev])  # the previous step's move to the host is done
            for ptr, nbytes, d in self._storages:
                if d == dev:
                    err = lib.prefetch(ptr, nbytes, dev, int(current.cuda_stream))
                    _check_prefetch(lib, err, nbytes, f"cuda:{dev}")
            self.report_.prefetches += 1

    def synchronize(self) -> None:
        """Wait for every prefetch this placement issued (before a CUDA graph capture, or a timing)."""
        for dev in self._pools:
            torch.cuda.synchronize(dev)

    def report(self) -> PlacementReport:
        """The latest :class:`PlacementReport`."""
        return self.report_


#: The warn-once key of a failed per-step prefetch (:func:`lightning_gh._util.reset_warnings` makes it warn again).
PREFETCH_FAILED_WARNING = "unified:prefetch-failed"


def _check_prefetch(lib: _shim.Shim, err: int, nbytes: int, where: str) -> None:
    """A per-step prefetch is a hint (the step reads the state wherever it is), so a failure warns once instead of
    stopping the run; it is never dropped silently."""
    if err:
        warn_once(PREFETCH_FAILED_WARNING,
                  f"ManagedOptimizerState(prefetch='step'): cudaMemPrefetchAsync of {fmt_bytes(nbytes)} of optimizer "
                  f"state to {where} failed: {lib.error_text(err)} (CUDA error {err}); the step reads the state where "
                  "it is (this is the only warning).", RuntimeWarning, stacklevel=4)


def _state_dict_sizes(state_dict: dict[str, Any]) -> dict[int, list[int]]:
    """Bytes per CUDA device index of the tensors a ``load_state_dict`` will create, guessed from the saved state
    (each lands on its parameter's device; counted on the current device, where single-device runs keep them)."""
    out: dict[int, list[int]] = {}
    dev = torch.cuda.current_device()
    for st in (state_dict.get("state") or {}).values():
        if isinstance(st, dict):
            for t in st.values():
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    out.setdefault(dev, []).append(t.nbytes)
    return out


def manage_optimizer_state(optimizer: torch.optim.Optimizer, preferred: str = "cpu", *, prefetch: str = "none",
                           accessed_by_gpu: bool = True, allow_oversubscription: bool = False,
                           headroom_bytes: int | None = None) -> OptimizerStatePlacement | None:
    """Keep ``optimizer``'s state in managed memory from now on (plain PyTorch; Lightning users add the
    ``ManagedOptimizerState`` callback instead).

    Args:
        optimizer: the optimizer (its parameters on CUDA).
        preferred, prefetch, accessed_by_gpu, allow_oversubscription, headroom_bytes: see
            :class:`~lightning_gh.unified.options.ManagedMemoryOptions`.

    Returns:
        The :class:`OptimizerStatePlacement` (``.report()`` says what it holds, ``.remove()`` stops it), or ``None``
        without CUDA (after one warning).
    """
    kw: dict[str, Any] = dict(preferred=preferred, prefetch=prefetch, accessed_by_gpu=accessed_by_gpu,
                              allow_oversubscription=allow_oversubscription)
    if headroom_bytes is not None:
        kw["headroom_bytes"] = headroom_bytes
    options = ManagedMemoryOptions(**kw)
    if not torch.cuda.is_available():
        from lightning_gh.unified.pool import _warn_no_cuda

        _warn_no_cuda("manage_optimizer_state()")
        return None
    placement = OptimizerStatePlacement(optimizer, options, step_pre_hook=True)
    placement.place()
    return placement
