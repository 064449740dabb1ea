"""The GPU tail: its update in ``step()`` (:func:`update_device_tail`) and, with ``gpu_fraction="auto"``, the mover
that gathers the policy's measurements after each step, asks :func:`~lightning_gh.superoffload.tail.decide` and
applies the action (:class:`TailMover`).

When the decision is final the mover says in one log line (rank 0) how many parameters it placed on the GPU and
why, and keeps the same text in ``optimizer.stats["tail_decision"]``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_gh import _gpu_plan
from lightning_gh._util import fmt_bytes
from lightning_gh.superoffload import memory, tail
from lightning_gh.superoffload.layout import HostLayout, Slot, chunk_by_size
from lightning_gh.superoffload.tail import StepTimes, TailAction, TailActionKind, TailStage, TailWindow, Trial

__all__ = ["TAIL_UPDATE_CHUNK", "TailMover", "device_room", "update_device_tail"]

#: The tail's fused update reads fp32 gradients; for bf16/fp16 weights it casts them a chunk of about this many
#: parameters at a time, so the cast costs one chunk of transient GPU memory instead of 4 B for every tail parameter.
TAIL_UPDATE_CHUNK = 1 << 26
#: GPU memory the auto tail always leaves free beyond the peak of a full step: the larger of these bytes and this
#: share of the device's (or the cap's) memory, for a longer batch, fragmentation and other processes.
TAIL_HEADROOM_MIN_BYTES = 1 << 30
TAIL_HEADROOM_SHARE = 0.10


def update_device_tail(slots: list[Slot], hp: list[dict[str, float]], coef: torch.Tensor | None,
                       found_inf: torch.Tensor | None) -> None:
    """The fused AdamW step of the GPU tail's ``slots`` (those with a gradient), group by group, with the step's
    clip coefficient and non-finite flag (a skipped step leaves their state and step counters as they were). A
    sharded tail's owner reads the rank-averaged fp32 gradient the reduce left in ``avg_grad`` (as a host bucket
    reads its fp32 average), and drops it."""
    by_group: dict[int, list[Slot]] = {}
    for s in slots:
        if s.avg_grad is not None or s.param.grad is not None:
            by_group.setdefault(s.group, []).append(s)
    for gi, group_slots in sorted(by_group.items()):
        h = hp[gi]
        # The fp32 copies of bf16 gradients the fused update reads are made a chunk at a time: they then cost
        # one chunk of GPU memory, not 4 B per tail parameter (the auto tail budgets for one chunk). fp32
        # weights' gradients are read as they are: one call, no chunks.
        cast = any(s.dev_master is not None for s in group_slots)
        for chunk in chunk_by_size(group_slots, TAIL_UPDATE_CHUNK) if cast else [group_slots]:
            grads = [s.avg_grad.view(s.param.shape) if s.avg_grad is not None else s.param.grad
                     if s.dev_master is None else s.param.grad.to(torch.float32) for s in chunk]
            for s in chunk:
                s.avg_grad = None
            if coef is not None:
                torch._foreach_mul_(grads, coef)
            targets = [s.param if s.dev_master is None else s.dev_master for s in chunk]
            steps = [s.step for s in chunk]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(targets, grads, [s.exp_avg for s in chunk], [s.exp_avg_sq for s in chunk], [],
                                steps, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                                weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False, maximize=False,
                                found_inf=found_inf)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))
            mastered = [s for s in chunk if s.dev_master is not None]
            if mastered:  # one multi-tensor cast back into the module's (bf16) weights
                torch._foreach_copy_([s.param for s in mastered], [s.dev_master for s in mastered])
            del grads  # free this chunk's fp32 copies before the next chunk makes its own


def device_room(dev: torch.device) -> tuple[int, str] | None:
    """GPU bytes optimizer state may still take on ``dev`` beside a full step's peak, and how that was worked out in
    words; ``None`` when the device's memory cannot be read (not CUDA).

    Measured after a full step: the allocator's peak reserved memory (the activations the next step needs again)
    counts as used even where it is cached now, and a margin of ``TAIL_HEADROOM_MIN_BYTES`` or
    ``TAIL_HEADROOM_SHARE`` of the limit (the device, or a per-process cap) stays free."""
    room = memory.device_memory_room(dev)
    if room is None:
        return None
    free, device_total = room
    limit = device_total
    peak_extra = 0
    if dev.type == "cuda" and torch.cuda.is_available():
        fraction = torch.cuda.get_per_process_memory_fraction(dev) \
            if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
        limit = min(device_total, int(fraction * device_total))
        # memory the step's peak needed beyond what is reserved now (the cache may have been trimmed)
        peak_extra = max(0, torch.cuda.max_memory_reserved(dev) - torch.cuda.memory_reserved(dev))
    margin = max(TAIL_HEADROOM_MIN_BYTES, int(TAIL_HEADROOM_SHARE * limit))
    how = (f"{fmt_bytes(max(free - peak_extra, 0))} free after a step's peak under a {fmt_bytes(limit)} "
           f"limit, less a margin of {fmt_bytes(margin)}")
    return free - peak_extra - margin, how


def tail_bytes(slots: Iterable[Slot], sharded: bool = False) -> int:
    """GPU bytes these parameters cost in the tail: fp32 moments; for non-fp32 weights an fp32 master; and the
    gradient itself, which stays on the GPU until ``zero_grad`` instead of being freed as it lands on the host
    (``sharded``: the owner's share of a sharded tail, whose gradient is held as its fp32 rank average until the
    update). The fp32 copy of the gradient the fused update reads is made a chunk at a time
    (``TAIL_UPDATE_CHUNK``): the budget holds one chunk of it back before the first move (:meth:`TailMover.budget`)."""
    return sum(s.numel * (8 + (0 if s.param.dtype == torch.float32 else 4) + (4 if sharded else s.param.element_size()))
               for s in slots)


class TailMover:
    """Applies the auto tail's actions: moves host buckets to the GPU tail and back, keeps the policy's memory
    (the open trial, whether the decision is final) and says the final decision in one line.

    Args:
        layout: the optimizer's host layout.
        max_gpu_fraction: see :class:`~lightning_gh.superoffload.SuperOffloadOptions`.
        stats: the optimizer's ``stats`` dict.
        shard: the rank shard of a run over several ranks (decided once, by memory), or ``None``.
    """

    def __init__(self, layout: HostLayout, max_gpu_fraction: float | None, stats: dict[str, Any],
                 shard: Any = None) -> None:
        self.layout = layout
        self.max_gpu_fraction = max_gpu_fraction
        self.stats = stats
        self.shard = shard
        self.stage = TailStage.SEARCHING
        self.trial: Trial | None = None
        self.gained = False  # the last trial was kept
        self.all_in_tried = False  # the one trial of moving everything left on the host was made
        self.blocked = False  # no more growth: a move ran out of memory, or the tail was sent home
        self.retries_seen = 0
        self.held_until = 0  # the last step the tail was held (Note [One part sizes GPU memory at a time])
        self.limit: str | None = None  # what stopped the growth, for the decision's line

    @property
    def final(self) -> bool:
        return self.stage is not TailStage.SEARCHING

    # ------------------------------------------------------------------ measurements -> action -> moves
    def window(self, times: StepTimes, steps: int) -> TailWindow:
        """The measurements of ``times`` and the mover's memory as the policy's input, ``steps`` pipelined steps
        after the layout."""
        lay = self.layout
        ready = self.stage is TailStage.SEARCHING and steps >= tail.FIRST_CHECK and len(times.periods) >= tail.WINDOW
        host = sum(b.numel for b in lay.buckets)
        device = sum(s.numel for s in lay.device_slots(movable=True))
        asks_retries = ready or (self.stage is TailStage.FINAL and device > 0)
        return TailWindow(
            steps=steps, periods=tuple(times.periods), stalls=tuple(times.stalls),
            slacks=tuple(x for x in times.slacks[-2:] if x is not None),
            cpu_ms=sum(b.cpu_ms for b in lay.buckets), host_numel=host, device_numel=device,
            all_fits=ready and not self.all_in_tried and host > 0 and not self.blocked and self._all_fits(),
            retries=tail.allocator_retries(lay.device) if asks_retries else 0, trial=self.trial,
            gained=self.gained, all_in_tried=self.all_in_tried, blocked=self.blocked, stage=self.stage,
            retries_seen=self.retries_seen)

    def step(self, times: StepTimes, steps: int, sync: Callable[[], None],
             spec_budget: Callable[[int], float] | None = None) -> TailAction:
        """After a step: decide from the window and apply the action (``sync`` waits for every CPU update). Once
        the decision is final, ``spec_budget`` (host parameters -> parameters that may speculate) lets the host
        room the tail freed hold rollback copies for more buckets."""
        if self._hold(times, steps):
            return TailAction(TailActionKind.KEEP)
        steps -= self.held_until  # the policy's step counts start after the hold
        if self.shard is not None:
            self._step_ranks(times, steps, sync)
            return TailAction(TailActionKind.KEEP)
        w = self.window(times, steps)
        action = tail.decide(w)
        self.apply(action, w, times, sync)
        if self.final and spec_budget is not None:
            self._fit_speculation(spec_budget, sync)
        return action

    def _hold(self, times: StepTimes, steps: int) -> bool:
        """Whether the tail waits this step because another part is sizing its GPU memory (Note [One part sizes
        GPU memory at a time]); the timings of the held steps are forgotten, and the policy counts its steps from
        the end of the hold. Several ranks hold together (any rank's part holds them all)."""
        if self.final:
            return False
        sizing = bool(_gpu_plan.sizing(exclude="SuperOffload"))
        if self.shard is not None:
            sizing = not self.shard.all_agree(not sizing)
        if sizing:
            self.held_until = steps
            times.forget()
        return sizing

    def _fit_speculation(self, spec_budget: Callable[[int], float], sync: Callable[[], None]) -> None:
        """Apply the speculation budget for the host's current share (stat ``speculative_params``); one log line when
        more (or fewer) host parameters may now speculate."""
        lay = self.layout
        host = lay.host_numel()
        speculating = lambda: sum(b.numel for b in lay.buckets if b.speculative and lay.owns(b))  # noqa: E731
        was = speculating()
        lay.fit_speculation(spec_budget(host), sync)
        self.stats["speculative_params"] = spec = speculating()
        if spec == was:
            return
        text = (f"SuperOffload: with the GPU tail settled, {spec:,} of the {host:,} parameters on the host may be "
                f"updated speculatively (the host memory the tail freed holds their rollback copies).")
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # Lightning's rank-0 logger

        rank_zero_info(text)

    def apply(self, action: TailAction, w: TailWindow, times: StepTimes, sync: Callable[[], None]) -> None:
        """Carry out ``action``, decided from window ``w``."""
        if action.judged_trial:
            trial, self.trial = self.trial, None
            self.gained = action.kind is not TailActionKind.UNDO
        kind = action.kind
        if kind is TailActionKind.KEEP:
            if self.stage is TailStage.FINAL and w.device_numel:
                self.retries_seen = w.retries
        elif kind is TailActionKind.GROW:
            all_in = math.isinf(action.need_ms)
            if all_in:
                self.all_in_tried = True
            if not self._start_trial(action.need_ms, w.period, action.on_stall, times, sync) and not all_in:
                self._finish(self.limit or "the tail cannot grow", w.cpu_ms, w.compute_ms)
        elif kind is TailActionKind.UNDO:
            sync()
            self.to_host([self.layout.slots[i] for i in trial.slots])
            self._finish(action.why, w.cpu_ms, w.compute_ms)
        elif kind is TailActionKind.SHRINK:
            sync()
            take, size = [], 0
            for s in self.layout.device_slots(movable=True):  # arrival order: right after the host set first
                if size >= action.numel:
                    break
                take.append(s)
                size += s.numel
            self.to_host(take)
            times.forget()
        elif kind is TailActionKind.FINAL:
            self._finish(action.why, w.cpu_ms, w.compute_ms)
        elif kind is TailActionKind.SEND_HOME:
            self.stage = TailStage.SENT_HOME
            sync()
            self.to_host(self.layout.device_slots(movable=True))
            self.blocked = True
            warnings.warn(f"HeterogeneousAdamW (gpu_fraction='auto'): {action.why}; the tail went back to the host "
                          f"so the activations have the memory.", stacklevel=4)
            self.retries_seen = w.retries

    def _start_trial(self, need_ms: float, period: float, on_stall: bool, times: StepTimes,
                     sync: Callable[[], None]) -> bool:
        """Move host buckets worth ``need_ms`` of CPU time (``math.inf``: all that fit) to the GPU as a trial that
        the next measured steps keep or undo. Returns ``False`` when nothing could move."""
        sync()
        lay = self.layout
        before = {s.index for s in lay.device_slots()}
        if self.grow(need_ms) == 0:
            return False
        # in arrival order, so an undo lays the buckets out as before
        moved = tuple(s.index for s in lay.device_slots() if s.index not in before)
        self.trial = Trial(period=period, retries=tail.allocator_retries(lay.device), slots=moved,
                           numel=sum(lay.slots[i].numel for i in moved), on_stall=on_stall)
        times.forget()
        return True

    def _finish(self, why: str, cpu_ms: float, compute_ms: float) -> None:
        """Make the decision final and say it in one log line (rank 0)."""
        self.stage = TailStage.FINAL
        lay = self.layout
        self.retries_seen = tail.allocator_retries(lay.device)
        total = sum(s.numel for s in lay.slots if s.step is not None)
        on_gpu = lay.device_numel()
        size = fmt_bytes(tail_bytes(s for s in lay.slots if s.residency == "device" and s.step is not None))
        text = (f"SuperOffload auto GPU tail: {on_gpu:,} of {total:,} parameters ({on_gpu / max(total, 1):.1%}, "
                f"{size}) on the GPU, {total - on_gpu:,} on the host; why: {why} (CPU update "
                f"{cpu_ms:.0f} ms, forward+backward about {compute_ms:.0f} ms per step).")
        self.stats["tail_decision"] = text
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # Lightning's rank-0 logger

        rank_zero_info(text)

    # ------------------------------------------------------------------ moves and their budget
    def grow(self, need_ms: float) -> int:
        """Move host buckets, last-processed first (the earliest layers), to the GPU tail until they account
        for ``need_ms`` of measured CPU time, within ``max_gpu_fraction`` and the GPU memory left after a step's
        peak less the headroom. Returns the number of buckets moved."""
        lay = self.layout
        total = sum(s.numel for s in lay.slots if s.step is not None)
        mgf = self.max_gpu_fraction
        cap = None if mgf is None else int(mgf * total) - lay.device_numel()
        measured = self.budget()
        budget, how = (None, "") if measured is None else measured
        moved_ms, count = 0.0, 0
        while lay.buckets and moved_ms < need_ms and not self.blocked:
            b = lay.buckets[-1]
            nbytes = tail_bytes(b.slots)
            if cap is not None and b.numel > cap:
                on = f"({lay.device_numel():,} of {total:,} parameters are on the GPU)"
                self._limited(f"limited by max_gpu_fraction={mgf} {on}", f"max_gpu_fraction={mgf} would be exceeded {on}")
                break
            if budget is not None and nbytes > budget:
                self._limited(f"limited by GPU memory ({how})",
                              f"the next bucket needs {fmt_bytes(nbytes)} of GPU memory and only "
                              f"{fmt_bytes(max(budget, 0))} are free beyond the headroom ({how})")
                break
            if not lay.to_device(b):
                self.stats["tail_move_failures"] += 1
                self.blocked = True  # the allocator disagrees with the free-memory estimate: stop growing
                self._limited("limited by GPU memory (moving the next bucket ran out of memory)",
                              f"moving {fmt_bytes(nbytes)} to the GPU ran out of memory; the bucket stays on the "
                              f"host and the tail stops growing")
                break
            self.stats["tail_moves"] += 1
            moved_ms += b.cpu_ms
            count += 1
            if cap is not None:
                cap -= b.numel
            if budget is not None:
                budget -= nbytes
        return count

    def to_host(self, slots: list[Slot]) -> None:
        """Move GPU-tail slots back into new host buckets."""
        self.layout.to_host(slots)
        self.stats["tail_moves_back"] += 1

    def _limited(self, limit: str, detail: str) -> None:
        """Count a limited growth. No warning: the final decision's one log line says what limited the tail
        (the full reason of the first limit is kept in ``stats["tail_limit_detail"]``)."""
        self.limit = limit
        self.stats["tail_limited"] += 1
        self.stats.setdefault("tail_limit_detail", detail)

    def _all_fits(self) -> bool:
        """Whether the state still on the host fits in the GPU memory the tail may take (known room only) and
        under ``max_gpu_fraction``."""
        measured = self.budget()
        if measured is None or sum(tail_bytes(b.slots) for b in self.layout.buckets) > measured[0]:
            return False
        return self.max_gpu_fraction is None or self.max_gpu_fraction >= 1.0

    def cast_chunk_bytes(self) -> int:
        """GPU bytes of one chunk of fp32 gradient copies the tail's update makes (0 when every weight is fp32);
        the largest parameter counts in full, as a chunk never splits a parameter."""
        cast = [s.numel for s in self.layout.slots if s.param.dtype != torch.float32]
        return 4 * (TAIL_UPDATE_CHUNK + max(cast)) if cast else 0

    def budget(self) -> tuple[int, str] | None:
        """GPU bytes the tail may still take, and how that was worked out; ``None`` when the room is unknown (see
        :func:`device_room`)."""
        room = device_room(self.layout.device)
        if room is None:
            return None
        # one chunk of the update's fp32 gradient copies, before the first move: afterwards the measured peak of a
        # full step holds it (the copies are made in step(), after the activations are freed)
        cast = self.cast_chunk_bytes() if self.layout.device_numel() == 0 else 0
        return room[0] - cast, room[1]

    # ------------------------------------------------------------------ several ranks
    def _step_ranks(self, times: StepTimes, steps: int, sync: Callable[[], None]) -> None:
        """The auto tail on several ranks, decided once, by memory, the same on every rank.

        Per-rank timings differ, and ranks that decided apart would lay out different buckets, so the ranks do not
        time trials here. After a few steps (the peak of a step is then known) they check together whether the
        whole optimizer state fits on every GPU beside a step's peak; if so every bucket's state is sent from its
        owner to every rank and kept on the GPUs, replicated, the way DDP keeps it (the host-side update of the
        whole state runs at the host's memory bandwidth whatever the number of ranks; see
        docs/superoffload.md). Otherwise each rank moves the state of its own first-needed buckets to its GPU, as
        much as the GPU with the least room holds (:func:`~lightning_gh.superoffload.tail.sharded_tail`): the
        sharded tail, updated by its owner in ``step()`` and broadcast from there; the rest stays on the hosts.
        """
        if self.final or steps < tail.FIRST_CHECK:
            return
        lay = self.layout
        cpu_ms = sum(b.cpu_ms for b in lay.buckets)
        compute_ms = max(tail.median(times.periods) - tail.median(times.stalls), 0.0)
        budget = self.budget()
        need = sum(tail_bytes(b.slots) for b in lay.buckets)
        fits = (budget is not None and need <= budget[0] and bool(lay.buckets)
                and (self.max_gpu_fraction is None or self.max_gpu_fraction >= 1.0))
        if self.shard.all_agree(fits):
            sync()  # also sends the last step's weights to every rank (a collective on every rank)
            with lay.lock:
                self.shard.replicate_to_devices()
            self.stats["tail_moves"] += 1
            self._finish(f"the whole state fits beside a step's peak on every GPU ({fmt_bytes(need)}; "
                         f"{budget[1]}): kept there on every rank, as DDP keeps it", cpu_ms, compute_ms)
            return
        if not self.shard.all_agree(budget is not None):
            self._finish("no GPU memory reading on some rank (no CUDA device): each rank keeps its share on the "
                         "host", cpu_ms, compute_ms)
            return
        room = self.shard.least(budget[0])  # may be negative: then nothing moves
        candidates = [tail.ShardCandidate(b.index, b.owner, b.numel, tail_bytes(b.slots, sharded=True),
                                          sum(s.numel * s.param.element_size() for s in b.slots))
                      for b in lay.buckets]
        chosen = set(tail.sharded_tail(candidates, self.shard.group.size, room, self.max_gpu_fraction))
        why = (f"the whole state does not fit beside a step's peak on every GPU ({fmt_bytes(need)} needed here; "
               f"{budget[1]})")
        if chosen:
            sync()
            with lay.lock:
                moved = self.shard.shard_to_devices(chosen)
            if moved:
                self.stats["tail_moves"] += 1
                share = sum(c.numel for c in candidates if c.index in chosen) / max(sum(c.numel for c in candidates), 1)
                self._finish(f"{why}: each rank keeps the state of its own first-needed buckets on its GPU "
                             f"({share:.1%} of all parameters, sharded; {fmt_bytes(room)} of room on the GPU with "
                             "the least), the rest on the hosts", cpu_ms, compute_ms)
                return
            why += "; moving a sharded share ran out of GPU memory"
        self._finish(f"{why}: each rank keeps its share on the host", cpu_ms, compute_ms)
