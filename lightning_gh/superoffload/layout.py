"""Where each parameter's optimizer state lives: slots (one per parameter), host buckets and their flat buffers.

A :class:`Slot` is one parameter; a :class:`Bucket` is a run of host-resident slots, consecutive in
gradient-arrival order, whose fp32 master weights and gradients sit in two flat page-locked
:class:`~lightning_gh._host.HostBuffer` s and whose moments sit in one flat host tensor: the unit of copy and
CPU work. Slots not in a bucket form the GPU tail (their state on the GPU, see :mod:`.tail`).

:class:`LayoutMixin` is the part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW` that builds this
layout and writes loaded state into it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_gh.superoffload import memory
from lightning_gh.superoffload.memory import HostBuffer

__all__ = ["Bucket", "LayoutMixin", "Slot", "chunk_by_size"]


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
    step_id: int = -1  # the step in which this slot's gradient last arrived
    normed_step: int = -1  # the step whose gradient norm was last written for this slot


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
    backup: torch.Tensor | None = None
    backup_steps: dict[int, float] = field(default_factory=dict)
    backup_fresh: bool = False  # the backup equals the current state (taken since the last update)
    speculated: bool = False  # the worker's last update of this bucket ran before the step's decision was known
    ready_t: float = 0.0  # when the worker last committed this bucket (perf_counter)
    ready: threading.Event = field(default_factory=threading.Event)
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

    def __post_init__(self) -> None:
        self.ready.set()

    def release_host(self) -> None:
        """Unpin and drop the bucket's host buffers (its state has moved to the GPU, or the optimizer closes)."""
        for buf in (self.master_buf, self.grad_buf, self.alt_master):
            if buf is not None:
                buf.release()
        self.master_buf = self.grad_buf = self.alt_master = None
        self.moments = self.alt_moments = self.staging = None



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



class LayoutMixin:
    """Builds the slots' layout (host buckets and GPU-tail state) and writes loaded state into it."""

    # Provided by HeterogeneousAdamW.
    _slots: list[Slot]
    _buckets: list[Bucket]
    _pending_state: dict[int, dict[str, torch.Tensor]]
    _cuda: bool
    _rg: Any  # .zero.RankGroup, or None on one rank

    def _build_layout(self, arrival: list[int]) -> None:
        seen: set[int] = set()
        if self._rg is not None:  # every rank must lay out the same buckets: the parameter order, not arrival
            arrival = [s.index for s in reversed(self._slots) if s.param.requires_grad]
        order = [i for i in arrival if not (i in seen or seen.add(i))]
        order += [s.index for s in reversed(self._slots) if s.param.requires_grad and s.index not in seen]
        total = sum(self._slots[i].numel for i in order)
        frac = 0.0 if self.gpu_fraction == "auto" else float(self.gpu_fraction)
        device_target = int(math.ceil(frac * total))
        device_idx: set[int] = set()
        acc = 0
        for i in reversed(order):  # the last-arriving gradients form the tail
            if acc >= device_target:
                break
            device_idx.add(i)
            acc += self._slots[i].numel
        self._order = order
        host_slots = [self._slots[i] for i in order if i not in device_idx]
        if self._rg is None:
            chunks = [(c, 0) for c in chunk_by_size(host_slots, self.bucket_size)]
        else:
            chunks = self._shard_buckets(host_slots, chunk_by_size)
        owned_numel = sum(sum(s.numel for s in c) for c, r in chunks if self._rg is None or r == self._rg.rank)
        if self.host_memory_check:
            self._plan = memory.check_host_memory(owned_numel, self._backup_needed(),
                                                  local_ranks=None if self._rg is None else self._rg.local_size)
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._h2d_stream = torch.cuda.Stream(self.device)
        self._kernel = self._update_kernel()
        self._two_copies = self._kernel is not None and self._backup_needed()
        if self._rg is not None:
            self._alloc_block(owned_numel, alt=self._two_copies)
        for chunk, owner in chunks:
            self._new_bucket(chunk, owner)
        for i in sorted(device_idx):
            self._make_device_slot(self._slots[i])
        self._pending_state.clear()
        self._layout_built = True
        self._layout_step = self._step_id

    def _new_bucket(self, slots: list[Slot], owner: int = 0) -> None:
        numel = sum(s.numel for s in slots)
        b = Bucket(index=len(self._buckets), slots=list(slots), numel=numel, owner=owner)
        owned = self._rg is None or owner == self._rg.rank
        if self._rg is not None and owned:  # a slice of this rank's host blocks
            b.master_buf, b.grad_buf, b.moments, b.alt_master, b.alt_moments = self._slice_block(numel)
        elif owned:
            b.master_buf = HostBuffer(numel, pin=self._cuda, zero=False)
            b.grad_buf = HostBuffer(numel, pin=self._cuda, zero=False, dtype=self._host_grad_dtype(slots))
            b.moments = torch.zeros(2 * numel, dtype=torch.float32)
            if self._two_copies:  # page-locked too: a speculative update's weights are copied from it
                b.alt_master = HostBuffer(numel, pin=self._cuda, zero=False)
                b.alt_moments = torch.zeros(2 * numel, dtype=torch.float32)
        if self._cuda and owned:
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
            self._bind_views(b, [s])
            s.master.view(s.param.shape).copy_(s.param.detach())
            s.step = torch.zeros((), dtype=torch.float32)
            self._apply_pending(s)
        self._buckets.append(b)

    @staticmethod
    def _bind_views(b: Bucket, slots: list[Slot]) -> None:
        """Point the slots' master and moment views at the bucket's current copy of the state."""
        n = b.numel
        for s in slots:
            o = s.offset
            s.master = b.master_buf.tensor[o:o + s.numel]
            s.exp_avg = b.moments[o:o + s.numel]
            s.exp_avg_sq = b.moments[n + o:n + o + s.numel]

    def _update_kernel(self) -> Any:
        """Our CPU AdamW kernel (:mod:`.cpu_adamw`) with ``rollback="auto"`` where it builds and matches torch,
        else ``None``: then torch's fused CPU AdamW updates in place and, when a speculative update needs an
        exact undo, the worker copies the state aside first."""
        if self.rollback != "auto":
            return None
        from lightning_gh.superoffload import cpu_adamw

        return cpu_adamw.load()

    def _host_grad_dtype(self, slots: list[Slot]) -> torch.dtype:
        """bf16 for a bucket of bf16 parameters when our kernel updates it (it reads bf16 gradients exactly, and
        the host then receives and reads 2 B/parameter less); fp32 otherwise. Several ranks reduce their
        gradients in fp32 (see .zero)."""
        if self._kernel is not None and self._rg is None and all(s.param.dtype == torch.bfloat16 for s in slots):
            return torch.bfloat16
        return torch.float32

    def _make_device_slot(self, s: Slot) -> None:
        self._install_device_state(s, self._device_state(s, None))
        self._apply_pending(s)

    def _device_state(self, s: Slot, host_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor | None]:
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

    @staticmethod
    def _install_device_state(s: Slot, st: dict[str, torch.Tensor | None]) -> None:
        s.residency, s.bucket = "device", None
        s.exp_avg, s.exp_avg_sq, s.dev_master, s.step = st["exp_avg"], st["exp_avg_sq"], st["dev_master"], st["step"]
        s.master = s.grad = None

    def _apply_pending(self, s: Slot) -> None:
        st = self._pending_state.get(s.index)
        if st is None:
            return
        self._write_state(s, st)

    def _write_state(self, s: Slot, st: dict[str, torch.Tensor]) -> None:
        if s.residency == "host" and s.master is None:
            return  # another rank owns this parameter's state; it loads it from the same (unsharded) dict
        if s.residency == "host":
            s.bucket.backup_fresh = False
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

