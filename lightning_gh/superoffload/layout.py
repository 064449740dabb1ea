"""Where each parameter's optimizer state lives: slots (one per parameter), host buckets and their flat buffers.

A :class:`Slot` is one parameter; a :class:`Bucket` is a run of host-resident slots, consecutive in
gradient-arrival order, whose fp32 master weights and gradients sit in two flat page-locked
:class:`~lightning_gh._host.HostBuffer` s and whose moments sit in one flat host tensor: the unit of copy and
CPU work. Slots not in a bucket form the GPU tail (their state on the GPU, see :mod:`.tail_mover`; over several
ranks a sharded tail's state is on its owner's GPU only, see :mod:`.zero`).

:class:`HostLayout` owns the slots and buckets: it lays them out once (:meth:`HostLayout.build`), moves a
parameter's state between a bucket and the GPU tail, and writes loaded state into them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_gh._compiled import AroundCompiledCall
from lightning_gh._util import fmt_bytes
from lightning_gh.superoffload import memory
from lightning_gh.superoffload.memory import HostBuffer

__all__ = ["Bucket", "HostLayout", "RollbackCopy", "Slot", "WaitBeforeCompiledCall", "chunk_by_size",
           "compiled_regions", "forward_hook_sites",
           "is_compiled_region"]

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """One parameter: where its state lives and, per step, whether its gradient arrived."""

    index: int
    param: torch.Tensor
    group: int
    numel: int
    residency: Literal["host", "device"] = "host"
    bucket: Bucket | None = None
    offset: int = 0
    step: torch.Tensor | None = None
    # host residency: flat fp32 views into the bucket's buffers
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    # device residency (GPU tail): fp32 master copy only when the parameter itself is not fp32
    dev_master: torch.Tensor | None = None
    owner: int | None = None  # the sharded GPU tail of several ranks: the rank holding the state (see .zero)
    avg_grad: torch.Tensor | None = None  # there, on the owner: the rank-averaged fp32 gradient until the update
    step_id: int = -1  # the step in which this slot's gradient last arrived
    normed_step: int = -1  # the step whose gradient norm was last written for this slot


@dataclass
class RollbackCopy:
    """A bucket's state copied aside before a speculative update (``rollback="copy"``); see
    Note [Speculative update and exact rollback] in :mod:`.worker`.

    Attributes:
        tensor: ``[master | exp_avg | exp_avg_sq]`` (fp32, 12 B per parameter), allocated at the first copy.
        steps: each slot's step count, by slot index.
        fresh: the copy equals the current state (taken since the last update).
    """

    tensor: torch.Tensor | None = None
    steps: dict[int, float] = field(default_factory=dict)
    fresh: bool = False


@dataclass
class Bucket:
    """A run of host-resident parameters, consecutive in gradient-arrival order, updated as one task."""

    index: int
    slots: list[Slot]
    numel: int
    master_buf: HostBuffer | None = None
    grad_buf: HostBuffer | None = None
    moments: torch.Tensor | None = None
    # two-copy rollback (rollback="auto"): the other copy of master weights and moments, which a speculative
    # update writes; committing flips the two (see .worker)
    alt_master: HostBuffer | None = None
    alt_moments: torch.Tensor | None = None
    backup: RollbackCopy = field(default_factory=lambda: RollbackCopy())  # copy rollback (rollback="copy")
    speculative: bool = True  # the host plan has room for this bucket's exact-rollback copy (see .memory)
    speculated: bool = False  # the worker's last update of this bucket ran before the step's decision was known
    ready_t: float = 0.0  # when the worker last committed this bucket (perf_counter)
    ready: threading.Event = field(default_factory=threading.Event)
    # set while no second pass of the bucket's update is pending (see Note [Weights first, state after])
    done: threading.Event = field(default_factory=threading.Event)
    step_id: int = -1
    active: list[Slot] = field(default_factory=list)  # slots with a gradient in step `step_id`
    arrived: int = 0
    pushed: bool = False  # an H2D copy was issued for step `step_id`
    stream_synced: int = -1  # last step whose H2D the compute stream already waits on
    d2h_event: Any = None
    h2d_event: Any = None
    cpu_ms: float = 0.0  # exponential average of the worker's time on this bucket
    # several ranks (see .zero): the rank holding this bucket's state, the gradients being reduced onto it, and
    # the last step whose weights every rank received
    owner: int = 0
    staging: Any = None
    bcast_step: int = -1
    pinned_moments: tuple[HostBuffer, ...] = ()  # the page-locked buffers behind `moments` and `alt_moments`

    def __post_init__(self) -> None:
        self.ready.set()
        self.done.set()

    def release_host(self) -> None:
        """Unpin and drop the bucket's host buffers (its state has moved to the GPU, or the optimizer closes)."""
        for buf in (self.master_buf, self.grad_buf, self.alt_master):
            if buf is not None:
                buf.release()
        self.master_buf = self.grad_buf = self.alt_master = None
        for buf in self.pinned_moments:
            buf.release()
        self.moments = self.alt_moments = self.staging = None
        self.pinned_moments = ()
        self.backup = RollbackCopy()



def chunk_by_size(slots: list[Slot], bucket_size: int) -> list[list[Slot]]:
    """Consecutive runs of ``slots`` of at least ``bucket_size`` elements each (the last run may be smaller)."""
    groups: list[list[Slot]] = []
    chunk: list[Slot] = []
    size = 0
    for slot in slots:
        chunk.append(slot)
        size += slot.numel
        if size >= bucket_size:
            groups.append(chunk)
            chunk, size = [], 0
    if chunk:
        groups.append(chunk)
    return groups



def is_compiled_region(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled: a ``torch.compile`` wrapper (``OptimizedModule``) or a module compiled in
    place (``module.compile()``, which sets its ``_compiled_call_impl``)."""
    wrapper = type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")
    return wrapper or getattr(module, "_compiled_call_impl", None) is not None


def compiled_regions(modules: Iterable[torch.nn.Module]) -> frozenset[int]:
    """The ``id`` of every compiled region among ``modules`` (see :func:`is_compiled_region`)."""
    return frozenset(id(m) for m in modules if is_compiled_region(m))


def forward_hook_sites(module: torch.nn.Module,
                       slot_of: dict[int, Slot]) -> list[tuple[torch.nn.Module, list[Slot], bool]]:
    """Where the optimizer's forward pre-hooks go, as ``(module, slots it waits for, compiled)``.

    Note [Forward hooks stay out of compiled regions]
        A compiled region traces the forward pre-hooks of its submodules into its graph, where a hook that waits
        for a CPU thread breaks the graph; a module compiled in place (``module.compile()`` compiles
        ``_call_impl``) traces its own pre-hooks too. So a compiled region gets one wait for every parameter under
        it and its submodules none. A ``torch.compile`` wrapper (``OptimizedModule``) runs its own hooks eagerly:
        it gets a forward pre-hook. A module compiled in place gets no hook at all: the wait runs in front of its
        compiled call (:class:`WaitBeforeCompiledCall`), so nothing of ours is inside the compiled function.
        Elsewhere each module waits for the parameters it owns itself, so a layer waits only for its own bucket.

    Args:
        module: the model.
        slot_of: the optimizer's slots, by ``id`` of their parameter.
    """
    sites: list[tuple[torch.nn.Module, list[Slot], bool]] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module) -> None:
        if id(m) in seen:  # a module registered twice gets one hook
            return
        seen.add(id(m))
        compiled = is_compiled_region(m)
        slots = [slot_of[id(p)] for p in m.parameters(recurse=compiled) if id(p) in slot_of]
        if slots:
            sites.append((m, slots, compiled))
        if not compiled:
            for child in m.children():
                visit(child)

    visit(module)
    return sites


class WaitBeforeCompiledCall(AroundCompiledCall):
    """Runs ``wait()`` before each call of a module compiled in place, outside the compiled function
    (:class:`~lightning_gh._compiled.AroundCompiledCall`). See Note [Forward hooks stay out of compiled regions].
    """

    def __init__(self, module: torch.nn.Module, wait: Callable[[], None]) -> None:
        super().__init__(module, before=lambda m, args: wait())


class HostLayout:
    """The slots (one per parameter), their order, the host buckets and the state of the GPU tail.

    Built once, from the order gradients arrive in (:meth:`build`); afterwards the tail mover moves whole buckets
    to the GPU tail (:meth:`to_device`) and runs of tail slots back into new buckets (:meth:`to_host`). Every
    change of a bucket's buffers happens under :attr:`lock`, which the CPU worker takes while it copies state.

    Args:
        device: the parameters' device.
        rank: this process's rank when the state is sharded over ranks (a bucket is this rank's when its
            ``owner`` equals it), else 0.
    """

    def __init__(self, device: torch.device, rank: int = 0) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.slots: list[Slot] = []
        self.slot_of: dict[int, Slot] = {}  # id(param) -> slot
        self.buckets: list[Bucket] = []
        self.order: list[int] = []  # slot indices in the order gradients arrive (the first-arriving first)
        self.built = False
        self.built_at = 0  # the optimizer step that built the layout
        self.pending: dict[int, dict[str, torch.Tensor]] = {}  # loaded state for slots not laid out yet
        self.lock = threading.Lock()
        self.kernel: Any = None  # .cpu_adamw.AdamWKernel, when every CPU update runs our kernel
        self.staging = True  # the host plan had room for the weights-first staging buffers (see .worker)
        self.two_copies = False  # host buckets keep two copies of their state (see Note [Speculative update ...])
        self.pin_moments = False  # page-lock the host buckets' moments (the GPU copies them; see .assist)
        self.plan: memory.HostMemoryPlan | None = None
        self.bucket_size = 1
        self.spec_budget: float = math.inf  # parameters whose buckets may be updated speculatively
        self.planned_device: frozenset[int] = frozenset()  # slots the host plan put on the GPU (they stay there)
        self.sharded = False  # the host buckets are slices of a rank's blocks (see .zero)

    # ------------------------------------------------------------------ slots
    def add_slot(self, p: torch.Tensor, group: int) -> Slot:
        slot = Slot(index=len(self.slots), param=p, group=group, numel=p.numel())
        self.slots.append(slot)
        self.slot_of[id(p)] = slot
        return slot

    def trainable_numel(self) -> int:
        return sum(s.numel for s in self.slots if s.param.requires_grad)

    def owns(self, b: Bucket) -> bool:
        """Whether this rank holds bucket ``b``'s state."""
        return b.owner == self.rank

    def host_numel(self) -> int:
        return sum(b.numel for b in self.buckets if self.owns(b))

    def device_numel(self) -> int:
        return sum(s.numel for s in self.slots if s.residency == "device" and s.step is not None)

    def device_slots(self, movable: bool = False) -> list[Slot]:
        """The GPU tail's slots, in gradient-arrival order; ``movable``: only those the host may take back (not
        those the host plan put on the GPU because the host cannot hold them)."""
        return [self.slots[i] for i in self.order if self.slots[i].residency == "device"
                and not (movable and i in self.planned_device)]

    # ------------------------------------------------------------------ build
    def build(self, arrival: list[int], *, bucket_size: int, spec_budget: float, auto_tail: bool, step_id: int,
              shard: Any = None) -> None:
        """Lay the slots out as :attr:`plan` says: its ``device_params`` last-arriving parameters (whole parameters,
        at least that many) on the GPU tail, the rest in host buckets of about ``bucket_size`` parameters,
        consecutive in arrival order; the first-arriving buckets within ``spec_budget`` parameters may be
        updated speculatively.

        Args:
            arrival: slot indices in the order their gradients arrived (or are expected to).
            bucket_size: see :class:`~lightning_gh.superoffload.SuperOffloadOptions`.
            spec_budget: parameters whose buckets may be updated speculatively (``math.inf``: all).
            auto_tail: the tail is the auto tail's, which must leave the plan's device parameters on the GPU.
            step_id: the optimizer step this happens in.
            shard: the :class:`~lightning_gh.superoffload.zero.RankShard` of a run over several ranks, or ``None``.
        """
        seen: set[int] = set()
        if shard is not None:  # every rank must lay out the same buckets: the parameter order, not arrival
            arrival = [s.index for s in reversed(self.slots) if s.param.requires_grad]
        order = [i for i in arrival if not (i in seen or seen.add(i))]
        order += [s.index for s in reversed(self.slots) if s.param.requires_grad and s.index not in seen]
        plan = self.plan
        device_idx: set[int] = set()
        acc = 0
        for i in reversed(order):  # the last-arriving gradients form the tail
            if acc >= plan.device_params:
                break
            device_idx.add(i)
            acc += self.slots[i].numel
        self.order, self.bucket_size, self.spec_budget = order, bucket_size, spec_budget
        self.sharded = shard is not None
        self.planned_device = frozenset(device_idx) if auto_tail else frozenset()
        # two copies of the state for the buckets that speculate with a copy (see Note [Speculative update ...])
        self.two_copies = self.kernel is not None and plan.backup_params > 0
        host_slots = [self.slots[i] for i in order if i not in device_idx]
        if shard is None:
            chunks = [(c, 0) for c in chunk_by_size(host_slots, bucket_size)]
        else:
            chunks = shard.cut(host_slots, bucket_size)
            owned = [sum(s.numel for s in c) for c, r in chunks if r == self.rank]
            alt = sum(n for n, spec in zip(owned, self._speculative_runs(owned)) if spec)
            shard.alloc_block(sum(owned), alt_numel=alt if self.two_copies else 0)
        for chunk, owner in chunks:
            self.new_bucket(chunk, owner, shard)
        for i in sorted(device_idx):
            s = self.slots[i]
            self.install_device_state(s, self.device_state(s, None))
            self._apply_pending(s)
        self.pending.clear()
        self.built = True
        self.built_at = step_id

    def plan_host(self, options: Any, validation: bool, shard: Any, gpu_room: int) -> memory.HostMemoryPlan:
        """Load the CPU kernel the options ask for and plan the host state of the trainable parameters (see
        :func:`~lightning_gh.superoffload.memory.plan_host_memory`; :func:`~.memory.check_host_memory` refuses
        when nothing fits).

        Args:
            options: the :class:`~lightning_gh.superoffload.SuperOffloadOptions`.
            validation: steps may be clipped or skipped.
            shard: the rank shard, or ``None``.
            gpu_room: GPU bytes an auto tail may take from the start for what the host cannot hold.
        """
        if options.rollback == "auto":  # our CPU kernel where it builds and matches torch (see .cpu_adamw)
            from lightning_gh.superoffload import cpu_adamw

            self.kernel = cpu_adamw.load()
        trainable = [s for s in self.slots if s.param.requires_grad]
        gpu_per_param = max((8 + (0 if s.param.dtype == torch.float32 else 4) + s.param.element_size()
                             for s in trainable), default=14)  # moments, master, gradient (see .tail_mover)
        auto = options.gpu_fraction == "auto"

        def check(stage: int) -> memory.HostMemoryPlan:
            return memory.check_host_memory(
                self.trainable_numel(), owner=self, local_ranks=None if shard is None else shard.group.local_size,
                speculative=options.speculative, enforce=options.host_memory_check, validation=validation,
                grad_bytes=self.grad_bytes(self.kernel, shard is not None),
                gpu_share=None if auto else options.gpu_fraction, gpu_room_bytes=gpu_room if auto else 0,
                gpu_bytes_per_param=gpu_per_param, shards=1 if shard is None else shard.group.size,
                process_bytes=memory.rank_process_bytes(self.trainable_numel(), 1 if shard is None else
                                                        shard.group.size), stage_bytes=stage)

        stage = self._stage_bytes(options, trainable)
        try:
            self.plan = check(stage)
        except memory.HostMemoryError:
            if not stage:
                raise
            self.plan, self.staging = check(0), False  # weights first is what does not fit: one pass
            log.info("SuperOffload: no host room for the weights-first staging buffers (%s); every update takes "
                     "one pass.", fmt_bytes(stage))
        return self.plan

    def _stage_bytes(self, options: Any, trainable: list[Slot]) -> int:
        """The weights-first staging ring's host bytes (see .worker): two buffers of the largest bucket's weights
        (a parameter larger than ``bucket_size`` is a bucket of its own), in bf16 where every parameter is."""
        from lightning_gh.superoffload.weights_first import stage_bytes

        if not (options.weights_first and self.kernel is not None and trainable):
            return 0
        size = 2 if all(s.param.dtype == torch.bfloat16 for s in trainable) else 4
        return stage_bytes([size * max(options.bucket_size, max(s.numel for s in trainable))])

    def _speculative_runs(self, numels: list[int], used: int = 0) -> list[bool]:
        """Which of the next owned buckets (``numels``, in arrival order) fit in the speculation budget, after
        ``used`` parameters of it."""
        out = []
        for n in numels:
            fits = used + n <= self.spec_budget
            used += n if fits else 0
            out.append(fits)
        return out

    def set_spec_budget(self, budget: float, resize: bool = True) -> None:
        """Let the first-arriving buckets within ``budget`` parameters speculate, and no other. With ``resize``
        (call it between steps, with no CPU update pending, under :attr:`lock`) a bucket that stops speculating
        drops its rollback copy and (with two copies of the state) its second copy, and one that starts gets its
        second copy here (a finite budget only: without validation nothing is undone), or its rollback copy at its
        first speculative update. Over several ranks a bucket's buffers are slices of the rank's blocks and stay as
        they are."""
        self.spec_budget = budget
        owned = [b for b in self.buckets if self.owns(b)]
        for b, spec in zip(owned, self._speculative_runs([b.numel for b in owned])):
            was, b.speculative = b.speculative, spec
            if spec == was or not resize or self.sharded or b.master_buf is None:
                continue
            if not spec:
                b.speculated = False  # no rollback copy is made ahead for it (see CpuUpdater.idle_work)
                b.backup = RollbackCopy()
                self._drop_second_copy(b)
            elif self.two_copies and math.isfinite(budget):
                self._add_second_copy(b)

    def _add_second_copy(self, b: Bucket) -> None:
        """Give host bucket ``b`` the other copy of its master weights and moments that a speculative update writes
        (see Note [Speculative update and exact rollback] in :mod:`.worker`); the master part page-locked, as a
        speculative update's weights are copied from it."""
        b.alt_master = HostBuffer(b.numel, pin=self.cuda, zero=False)
        alt = HostBuffer(2 * b.numel, pin=self.cuda and self.pin_moments)
        b.pinned_moments, b.alt_moments = (*b.pinned_moments, alt), alt.tensor

    @staticmethod
    def _drop_second_copy(b: Bucket) -> None:
        if b.alt_master is None:
            return
        if b.h2d_event is not None:
            b.h2d_event.synchronize()  # a copy of weights from the second copy may still be queued
        b.alt_master.release()
        for buf in b.pinned_moments:
            if buf.tensor is b.alt_moments:
                buf.release()
        b.pinned_moments = tuple(buf for buf in b.pinned_moments if buf.tensor is not b.alt_moments)
        b.alt_master = b.alt_moments = None

    def fit_speculation(self, budget: float, sync: Callable[[], None]) -> bool:
        """Apply a new speculation ``budget`` (see :func:`~lightning_gh.superoffload.memory.speculation_budget`)
        once ``sync`` has waited for every CPU update. Returns whether anything changed."""
        if budget == self.spec_budget or not self.built:
            return False
        sync()
        with self.lock:
            self.set_spec_budget(budget)
        return True

    def new_bucket(self, slots: list[Slot], owner: int = 0, shard: Any = None) -> Bucket:
        """A host bucket for ``slots`` (their state is written by the caller or from loaded state)."""
        numel = sum(s.numel for s in slots)
        b = Bucket(index=len(self.buckets), slots=list(slots), numel=numel, owner=owner)
        owned = self.owns(b)
        used = sum(x.numel for x in self.buckets if x.speculative and self.owns(x))
        b.speculative = owned and self._speculative_runs([numel], used)[0]
        alt = self.two_copies and b.speculative
        if shard is not None and owned:  # a slice of this rank's host blocks
            b.master_buf, b.grad_buf, b.moments, b.alt_master, b.alt_moments = shard.slice_block(numel, alt)
        elif owned:
            b.master_buf = HostBuffer(numel, pin=self.cuda, zero=False)
            b.grad_buf = HostBuffer(numel, pin=self.cuda, zero=False, dtype=self._grad_dtype(slots, shard))
            b.pinned_moments = (HostBuffer(2 * numel, pin=self.cuda and self.pin_moments),)
            b.moments = b.pinned_moments[0].tensor
            if alt:
                self._add_second_copy(b)
        if self.cuda and owned:
            b.d2h_event = torch.cuda.Event()
            b.h2d_event = torch.cuda.Event()
        off = 0
        for s in slots:
            s.bucket, s.offset, s.residency = b, off, "host"
            s.dev_master = None
            off += s.numel
            if not owned:  # another rank holds this parameter's state
                s.master = s.grad = s.exp_avg = s.exp_avg_sq = s.step = None
                continue
            s.grad = b.grad_buf.tensor[s.offset:s.offset + s.numel]
            self.bind_views(b, [s])
            s.master.view(s.param.shape).copy_(s.param.detach())
            s.step = torch.zeros((), dtype=torch.float32)
            self._apply_pending(s)
        self.buckets.append(b)
        return b

    @staticmethod
    def bind_views(b: Bucket, slots: list[Slot]) -> None:
        """Point the slots' master and moment views at the bucket's current copy of the state."""
        n = b.numel
        for s in slots:
            o = s.offset
            s.master = b.master_buf.tensor[o:o + s.numel]
            s.exp_avg = b.moments[o:o + s.numel]
            s.exp_avg_sq = b.moments[n + o:n + o + s.numel]

    def grad_bytes(self, kernel: Any, sharded: bool) -> int:
        """Bytes per parameter of the host gradient buffers the layout will allocate (2 where every trainable
        parameter is bf16 and ``kernel`` reads bf16 gradients on one rank, else 4)."""
        bf16 = all(s.param.dtype == torch.bfloat16 for s in self.slots if s.param.requires_grad)
        return 2 if kernel is not None and not sharded and bf16 and self.slots else 4

    def _grad_dtype(self, slots: list[Slot], shard: Any) -> torch.dtype:
        """bf16 for a bucket of bf16 parameters when our kernel updates it (it reads bf16 gradients exactly, and
        the host then receives and reads 2 B/parameter less); fp32 otherwise. Several ranks reduce their
        gradients in fp32 (see .zero)."""
        if self.kernel is not None and shard is None and all(s.param.dtype == torch.bfloat16 for s in slots):
            return torch.bfloat16
        return torch.float32

    # ------------------------------------------------------------------ the GPU tail
    def device_state(self, s: Slot, host_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor | None]:
        """Allocate (and fill from ``host_state``) a parameter's GPU-tail state without touching the slot, so an
        allocation that fails leaves the slot as it was."""
        p = s.param
        dev = p.device
        st: dict[str, torch.Tensor | None] = {
            "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=dev),
            "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=dev),
            "dev_master": None if p.dtype == torch.float32 else p.detach().to(torch.float32),
            "step": torch.zeros((), dtype=torch.float32, device=dev),
        }
        if host_state is not None:
            st["exp_avg"].copy_(host_state["exp_avg"].view(p.shape))
            st["exp_avg_sq"].copy_(host_state["exp_avg_sq"].view(p.shape))
            st["step"].copy_(host_state["step"])
            if st["dev_master"] is not None:
                st["dev_master"].copy_(host_state["master"].view(p.shape))
        return st

    def stage_device_state(self, slots: list[Slot]) -> list[tuple[Slot, dict[str, torch.Tensor | None]]] | None:
        """GPU-tail state for host-resident ``slots``, filled from their host state (:meth:`device_state`), not yet
        installed; ``None`` when the GPU ran out of memory on the way (what was allocated is dropped; the host state
        was only read)."""
        try:
            return [(s, self.device_state(s, {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "step": s.step,
                                               "master": s.master})) for s in slots]
        except torch.cuda.OutOfMemoryError:
            return None

    @staticmethod
    def install_device_state(s: Slot, st: dict[str, torch.Tensor | None]) -> None:
        s.residency, s.bucket = "device", None
        s.exp_avg, s.exp_avg_sq, s.dev_master, s.step = st["exp_avg"], st["exp_avg_sq"], st["dev_master"], st["step"]
        s.master = s.grad = None

    def to_device(self, b: Bucket) -> bool:
        """Give bucket ``b``'s state to the GPU tail. Returns ``False``, with the bucket unchanged on the host,
        when the GPU runs out of memory on the way."""
        with self.lock:
            staged = self.stage_device_state(b.slots)
            if staged is None:
                return False
            for s, st in staged:
                self.install_device_state(s, st)
            self.buckets.remove(b)
            b.release_host()
        return True

    def to_host(self, slots: list[Slot]) -> None:
        """Move GPU-tail slots back into new host buckets (runs of about ``bucket_size`` parameters). Rollback
        copies made in the room the tail had freed are dropped first, so the host stays within its plan."""
        with self.lock:
            if self.plan is not None and self.plan.backup_params < self.spec_budget < math.inf:
                incoming = sum(s.numel for s in slots)
                self.set_spec_budget(memory.speculation_budget(self.plan, self.host_numel() + incoming))
            for chunk in chunk_by_size(slots, self.bucket_size):
                dev = {s.index: (s.exp_avg, s.exp_avg_sq, s.step, s.dev_master) for s in chunk}
                self.new_bucket(chunk)
                for s in chunk:
                    m, v, step, master = dev[s.index]
                    s.exp_avg.copy_(m.reshape(-1))
                    s.exp_avg_sq.copy_(v.reshape(-1))
                    s.step.copy_(step)
                    if master is not None:
                        s.master.copy_(master.reshape(-1))

    # ------------------------------------------------------------------ loaded state
    def _apply_pending(self, s: Slot) -> None:
        st = self.pending.get(s.index)
        if st is not None:
            self.write_state(s, st)

    def write_state(self, s: Slot, st: dict[str, torch.Tensor]) -> None:
        """Write one parameter's loaded AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``, optional ``master``)."""
        if s.residency == "host" and s.master is None:
            return  # another rank owns this parameter's state; it loads it from the same (unsharded) dict
        if s.residency == "host":
            s.bucket.backup.fresh = False
            s.exp_avg.copy_(st["exp_avg"].reshape(-1))
            s.exp_avg_sq.copy_(st["exp_avg_sq"].reshape(-1))
            if "master" in st:
                s.master.copy_(st["master"].reshape(-1))
            else:
                s.master.view(s.param.shape).copy_(s.param.detach())
        else:
            s.exp_avg.copy_(st["exp_avg"].view(s.param.shape))
            s.exp_avg_sq.copy_(st["exp_avg_sq"].view(s.param.shape))
            if s.dev_master is not None:
                if "master" in st:
                    s.dev_master.copy_(st["master"].view(s.param.shape))
                else:
                    s.dev_master.copy_(s.param.detach())
        s.step.copy_(st["step"].reshape(()))

    def load(self, s: Slot, st: dict[str, torch.Tensor]) -> None:
        """Write loaded state now (laid out) or when the slot is laid out."""
        if self.built and s.step is not None:
            with self.lock:
                self.write_state(s, st)
        else:
            self.pending[s.index] = st

    def release(self) -> None:
        """Unpin and drop every bucket's host buffers."""
        for b in self.buckets:
            b.release_host()
