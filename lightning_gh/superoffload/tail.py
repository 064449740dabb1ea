"""The GPU-tail policy: which parameters keep their optimizer state on the GPU, and moving them there and back.

With ``gpu_fraction="auto"`` (CUDA only) everything starts on the host. The policy then measures, over windows of
``_WINDOW`` pipelined steps (their medians: on the H200 machine single steps spread by +-15% and one slow step in a
window of two once undid a growth that paid), the step period, how long the next forward waited for the CPU (the
stall) and the CPU update time of the host buckets:

* everything still on the host fits in the GPU memory the tail may take (below): move all of it, once, as a trial
  (stall or not: a CPU update that hides under forward+backward still shares the host with the training loop);
* no stall (the CPU update hides under forward+backward): no tail; the decision is final;
* a stall: move the last-processed host buckets (the earliest layers) to the GPU, worth a little less than the
  stall in measured CPU time, as a *trial*. The forward waited for exactly that CPU work, so the trial is kept
  unless the next measured steps are slower by more than ``_TRIAL_NOISE`` (the noise of a comparison of two
  windows: on the H200 machine, with the burden of proof on the growth, one noisy comparison in three left the
  tail at 39-44% instead of ~52%, +15-25% step time) or the caching allocator had to free its cache to satisfy an
  allocation (``num_alloc_retries``, the thrash a tail that eats the activations' memory causes); otherwise the
  moved state goes back to the host and the tail stops growing. So the automatic tail never leaves a run
  measurably slower than ``gpu_fraction=0.0``;
* after a kept trial with no host-side wait left, the step may still wait on the GPU for the copies back: the
  policy probes a further quarter of the host's CPU work, kept only when the step gets faster by at least
  ``_TRIAL_MIN_GAIN`` (no stall showed that work was in the way; the same for the all-at-once trial above);
* growth is bounded by GPU memory measured *after a full step's peak*: the room under the device (or the
  ``set_per_process_memory_fraction`` cap) left by the peak reserved memory, less a margin of the larger of 1 GiB
  and 10% of that limit, and by ``max_gpu_fraction``; a move that runs out of memory anyway leaves its bucket on
  the host and stops the growth;
* after the decision is final, any later allocator retry while a tail exists sends the whole tail back.

When the decision is final the policy says in one log line (rank 0) how many parameters it placed on the GPU and
why, and keeps the same text in ``optimizer.stats["tail_decision"]``.

:class:`TailMixin` is that part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch

from lightning_gh.superoffload import memory
from lightning_gh.superoffload.layout import Bucket, Slot, chunk_by_size

__all__ = ["TailMixin", "allocator_retries"]

# Start deciding after this many pipelined steps (counted from the step that built the layout): the first steps
# pay one-time costs (allocator growth, cuDNN/cuBLAS heuristics, pinning).
_AUTO_FIRST_CHECK = 4
# Stop adjusting after this many pipelined steps: the decision is final then.
_AUTO_LAST_CHECK = 36
# Steps per measurement; the policy reads their median period and stall.
_WINDOW = 3
# The forward "waits for the CPU" when the stall is above this share of the step period.
_AUTO_STALL_SHARE = 0.03
# A probe or all-at-once trial is kept only when the step gets at least this much faster.
_TRIAL_MIN_GAIN = 0.02
# A growth made because the forward waited for the CPU is undone only when the step gets this much slower.
_TRIAL_NOISE = 0.03
# GPU memory the auto tail always leaves free beyond the peak of a full step: the larger of 1 GiB and 10% of the
# device's (or the cap's) memory, for a longer batch, fragmentation and other processes.
_TAIL_HEADROOM_MIN_BYTES = 1 << 30
_TAIL_HEADROOM_SHARE = 0.10
# The tail's fused update reads fp32 gradients; for bf16/fp16 weights it casts them a chunk of about this many
# parameters at a time, so the cast costs one chunk of transient GPU memory instead of 4 B for every tail parameter
# (3.4 GB for an 850M-parameter tail, which a step whose peak is the optimizer step cannot spare).
TAIL_UPDATE_CHUNK = 1 << 26
# Moving CPU work w to the GPU shortens the wait by a little more than w (the moved layers' own forward now runs
# before the first host bucket is needed): move this share of the wait, re-check later.
_GROW_SHARE = 0.85
# After a growth that paid and no more host-side wait: probe this share of the host's CPU work next.
_PROBE_SHARE = 0.25
# Give parameters back to the host when the first bucket the forward needed had been ready this share of the period.
_SLACK_SHARE = 0.15


def allocator_retries(device: torch.device) -> int:
    """How often torch's caching allocator had to free its cache and retry (plus its OOMs) on ``device``; 0 off CUDA.

    Under a memory cap a tail that takes the memory the activations need shows up here first: every such retry
    synchronises the device and frees and re-allocates segments (the likely cause of the old policy's slowdown,
    read from its code; it was not profiled).

    Args:
        device: the device whose allocator to ask.

    Example::

        >>> allocator_retries(torch.device("cpu"))
        0
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_alloc_retries", 0)) + int(stats.get("num_ooms", 0))


def _recent(values: list[float]) -> float:
    """The median of the last ``_WINDOW`` measurements (0 when there are none)."""
    last = sorted(values[-_WINDOW:])
    return last[len(last) // 2] if last else 0.0


class TailMixin:
    """Sizes the GPU tail from measured stalls, trial by trial, and moves state between host buckets and the GPU.

    A part of :class:`~lightning_gh.superoffload.HeterogeneousAdamW`, which holds the measurements these methods
    read (step periods, stalls, slack) and calls :meth:`_auto_tail` after every step.
    """

    def _auto_tail(self) -> None:
        if self._rg is not None:
            self._auto_tail_ranks()
            return
        if self._tail_final:
            self._guard_tail()
            return
        k = self._step_id - self._layout_step
        if k < _AUTO_FIRST_CHECK or len(self._periods) < _WINDOW:
            return
        stall = _recent(self._stalls)
        period = _recent(self._periods)
        cpu_ms = sum(b.cpu_ms for b in self._buckets)
        compute_ms = max(period - stall, 0.0)
        retries = allocator_retries(self.device)
        trial = self._tail_trial
        if trial is not None:
            self._tail_trial = None
            self._tail_gained = True  # reset below when the trial is undone
            limit = 1.0 + _TRIAL_NOISE if trial["on_stall"] else 1.0 - _TRIAL_MIN_GAIN
            slower = period > limit * trial["period"]
            if retries > trial["retries"] or slower:
                moved = [self._slots[i] for i in trial["slots"]]
                self.synchronize()
                self._move_slots_to_host(moved)
                self._tail_gained = False
                why = (f"the allocator had to free its cache {retries - trial['retries']} time(s)" if not slower
                       else f"the step took {period:.0f} ms instead of {trial['period']:.0f} ms")
                self._finish_tail(f"growing it by {sum(s.numel for s in moved):,} parameters was undone: {why}; "
                                  f"the tail stops there", cpu_ms, compute_ms)
                return
        if k > _AUTO_LAST_CHECK:
            self._finish_tail("settled", cpu_ms, compute_ms)
            return
        slacks = [x for x in self._slack[-2:] if x is not None]
        device_slots = [i for i in self._order if self._slots[i].residency == "device"]
        if not self._buckets and self._tail_gained:
            self._finish_tail("all of the state fits on the GPU and the step was faster with it there", cpu_ms,
                              compute_ms)
            return
        if not self._all_in_tried and self._buckets and not self._tail_blocked and self._all_fits():
            # Everything left on the host fits beside a step's peak: try the GPU-only end point once, stall or
            # not. Even a CPU update that hides under forward+backward shares the host's cores and memory
            # bandwidth with the training loop's own threads (measured: docs/superoffload.md); the trial is
            # kept only if the step gets faster, like any other growth.
            self._all_in_tried = True
            self._start_trial(math.inf, period, on_stall=False)
            return
        stalled = stall > _AUTO_STALL_SHARE * period
        # After a growth that paid, the step may still wait for the copies back (a GPU-side wait the host-side
        # stall does not see): probe a further quarter of the host's CPU work, kept only if it pays again.
        probe = not stalled and self._tail_gained and bool(device_slots)
        if (stalled or probe) and self._buckets and not self._tail_blocked:
            # The CPU update does not hide under forward+backward: try a larger tail.
            if not self._start_trial(_GROW_SHARE * stall if stalled else _PROBE_SHARE * cpu_ms, period,
                                     on_stall=stalled):
                self._finish_tail(self._tail_limit or "the tail cannot grow", cpu_ms, compute_ms)
            return
        elif len(slacks) == 2 and min(slacks) > _SLACK_SHARE * period and device_slots:
            # The CPU finished well before the forward needed its work: give some parameters back to the host.
            host_numel = sum(b.numel for b in self._buckets)
            host_ms = sum(b.cpu_ms for b in self._buckets)
            if host_ms <= 0:
                return
            budget = 0.5 * min(slacks) * host_numel / host_ms
            self.synchronize()
            take, size = [], 0
            for i in device_slots:  # arrival order: the device slots right after the host set come first
                if size >= budget:
                    break
                take.append(self._slots[i])
                size += self._slots[i].numel
            self._move_slots_to_host(take)
        else:
            why = ("the CPU update hides under forward+backward" if not device_slots
                   else "the forward no longer waits for the CPU")
            self._finish_tail(why, cpu_ms, compute_ms)
            return
        self._measure_afresh()

    def _auto_tail_ranks(self) -> None:
        """The auto tail on several ranks, decided once, by memory, the same on every rank.

        Per-rank timings differ, and ranks that decided apart would lay out different buckets, so the ranks do not
        time trials here. After a few steps (the peak of a step is then known) they check together whether the
        whole optimizer state fits on every GPU beside a step's peak; if so every bucket's state is sent from its
        owner to every rank and kept on the GPUs, replicated, the way DDP keeps it (measured on 2 H200s: the
        host-side update of the whole state ran at the host's memory bandwidth whatever the number of ranks, 3x
        DDP's step on a model that fits; docs/superoffload.md). Otherwise each rank keeps its share on the host.
        """
        if self._tail_final or self._step_id - self._layout_step < _AUTO_FIRST_CHECK:
            return
        import torch.distributed as dist

        cpu_ms = sum(b.cpu_ms for b in self._buckets)
        compute_ms = max(_recent(self._periods) - _recent(self._stalls), 0.0)
        budget = self._tail_budget()
        need = sum(self._tail_bytes(b.slots) for b in self._buckets)
        fits = (budget is not None and need <= budget[0] and bool(self._buckets)
                and (self.max_gpu_fraction is None or self.max_gpu_fraction >= 1.0))
        flag = torch.tensor([1.0 if fits else 0.0],
                            device=self.device if self._rg.tensors_on_gpu else torch.device("cpu"))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if float(flag) < 1.0:
            if budget is None:
                why = "no GPU memory reading on some rank (no CUDA device): each rank keeps its share on the host"
            else:
                why = (f"the whole state does not fit beside a step's peak on every GPU ({need / 2**30:.2f} GiB "
                       f"needed here; {budget[1]}): each rank keeps its share on the host")
            self._finish_tail(why, cpu_ms, compute_ms)
            return
        self.synchronize()  # also sends the last step's weights to every rank (a collective on every rank)
        with self._state_lock:
            for b in list(self._buckets):
                states = self._bucket_slot_states(b)  # a collective: from the bucket's owner, on every rank
                for s in b.slots:
                    self._install_device_state(s, self._device_state(s, states[s.index]))
                self._buckets.remove(b)
                b.release_host()
            if self._block is not None:  # the rank's page-locked host block held only those buckets
                self._block.release()
                self._block = self._moment_block = None
        self.stats["tail_moves"] += 1
        self._finish_tail(f"the whole state fits beside a step's peak on every GPU ({need / 2**30:.2f} GiB; "
                          f"{budget[1]}): kept there on every rank, as DDP keeps it", cpu_ms, compute_ms)

    def _measure_afresh(self) -> None:
        """Forget the measurements taken before a move of state."""
        self._auto_adjustments += 1
        self._periods.clear()
        self._stalls.clear()
        self._slack.clear()
        # The step after a move pays its one-time costs (new allocations): measure from the step after it.
        self._last_step_t = None

    def _start_trial(self, need_ms: float, period: float, on_stall: bool) -> bool:
        """Move host buckets worth ``need_ms`` of CPU time (``math.inf``: all that fit) to the GPU as a trial that
        the next measured steps keep or undo (``on_stall``: a growth the forward's wait asked for, undone only when
        measurably slower). Returns ``False`` when nothing could move."""
        self.synchronize()
        before = {s.index for s in self._slots if s.residency == "device"}
        if self._grow_tail(need_ms) == 0:
            return False
        # in arrival order, so an undo lays the buckets out as before
        moved = [i for i in self._order if self._slots[i].residency == "device" and i not in before]
        self._tail_trial = {"period": period, "retries": allocator_retries(self.device), "slots": moved,
                            "on_stall": on_stall}
        self._measure_afresh()
        return True

    def _all_fits(self) -> bool:
        """Whether the state still on the host fits in the GPU memory the tail may take (known room only) and
        under ``max_gpu_fraction``."""
        measured = self._tail_budget()
        if measured is None:
            return False
        if sum(self._tail_bytes(b.slots) for b in self._buckets) > measured[0]:
            return False
        return self.max_gpu_fraction is None or self.max_gpu_fraction >= 1.0

    def _guard_tail(self) -> None:
        """After the decision: an allocator retry while a tail exists means the tail now takes memory the
        activations need (a longer batch, say): send the whole tail back to the host, once."""
        if self.device_numel == 0 or self._tail_guard_done:
            return
        retries = allocator_retries(self.device)
        if retries > self._tail_retries_seen:
            self._tail_guard_done = True
            self.synchronize()
            slots = [self._slots[i] for i in self._order if self._slots[i].residency == "device"]
            n = sum(s.numel for s in slots)
            self._move_slots_to_host(slots)
            self._tail_blocked = True
            warnings.warn(f"HeterogeneousAdamW (gpu_fraction='auto'): the caching allocator had to free its cache "
                          f"{retries - self._tail_retries_seen} time(s) with {n:,} parameters in the GPU tail; the "
                          f"tail went back to the host so the activations have the memory.", stacklevel=4)
        self._tail_retries_seen = retries

    def _finish_tail(self, why: str, cpu_ms: float, compute_ms: float) -> None:
        """Make the decision final and say it in one log line (rank 0)."""
        self._tail_final = True
        self._tail_retries_seen = allocator_retries(self.device)
        total = sum(s.numel for s in self._slots if s.step is not None)
        on_gpu = self.device_numel
        gib = self._tail_bytes(s for s in self._slots if s.residency == "device" and s.step is not None) / 2**30
        text = (f"SuperOffload auto GPU tail: {on_gpu:,} of {total:,} parameters ({on_gpu / max(total, 1):.1%}, "
                f"{gib:.2f} GiB) on the GPU, {total - on_gpu:,} on the host; why: {why} (CPU update "
                f"{cpu_ms:.0f} ms, forward+backward about {compute_ms:.0f} ms per step).")
        self.stats["tail_decision"] = text
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # Lightning's rank-0 logger

        rank_zero_info(text)

    @staticmethod
    def _tail_bytes(slots: Iterable[Slot]) -> int:
        """GPU bytes these parameters cost in the tail: fp32 moments; for non-fp32 weights an fp32 master; and the
        gradient itself, which stays on the GPU until ``zero_grad`` instead of being freed as it lands on the host.
        The fp32 copy of the gradient the fused update reads is made a chunk at a time (``TAIL_UPDATE_CHUNK``): the
        budget holds one chunk of it back before the first move (:meth:`_tail_budget`)."""
        return sum(s.numel * (8 + (0 if s.param.dtype == torch.float32 else 4) + s.param.element_size())
                   for s in slots)

    def _cast_chunk_bytes(self) -> int:
        """GPU bytes of one chunk of fp32 gradient copies the tail's update makes (0 when every weight is fp32);
        the largest parameter counts in full, as a chunk never splits a parameter."""
        cast = [s.numel for s in self._slots if s.param.dtype != torch.float32]
        return 4 * (TAIL_UPDATE_CHUNK + max(cast)) if cast else 0

    def _tail_budget(self) -> tuple[int, str] | None:
        """GPU bytes the tail may still take, and how that was worked out; ``None`` when the room is unknown.

        The room is measured after a full step: the allocator's peak reserved memory (the activations the next
        step needs again) counts as used even where it is cached now."""
        room = memory.device_memory_room(self.device)
        if room is None:
            return None
        free, device_total = room
        limit = device_total
        peak_extra = 0
        if self._cuda and torch.cuda.is_available():
            fraction = torch.cuda.get_per_process_memory_fraction(self.device) \
                if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
            limit = min(device_total, int(fraction * device_total))
            # memory the step's peak needed beyond what is reserved now (the cache may have been trimmed)
            peak_extra = max(0, torch.cuda.max_memory_reserved(self.device) - torch.cuda.memory_reserved(self.device))
        margin = max(_TAIL_HEADROOM_MIN_BYTES, int(_TAIL_HEADROOM_SHARE * limit))
        # one chunk of the update's fp32 gradient copies, before the first move: afterwards the measured peak of a
        # full step holds it (the copies are made in step(), after the activations are freed)
        cast = self._cast_chunk_bytes() if self.device_numel == 0 else 0
        budget = free - peak_extra - margin - cast
        how = (f"{max(free - peak_extra, 0) / 2**30:.2f} GiB free after a step's peak under a {limit / 2**30:.1f} GiB "
               f"limit, less a margin of {margin / 2**30:.2f} GiB")
        return budget, how

    def _grow_tail(self, need_ms: float) -> int:
        """Move host buckets, last-processed first (the earliest layers), to the GPU tail until they account
        for ``need_ms`` of measured CPU time, within ``max_gpu_fraction`` and the GPU memory left after a step's
        peak less the margin. Returns the number of buckets moved."""
        total = sum(s.numel for s in self._slots if s.step is not None)
        cap = None if self.max_gpu_fraction is None else int(self.max_gpu_fraction * total) - self.device_numel
        measured = self._tail_budget()
        budget, how = (None, "") if measured is None else measured
        moved_ms, count = 0.0, 0
        while self._buckets and moved_ms < need_ms and not self._tail_blocked:
            b = self._buckets[-1]
            nbytes = self._tail_bytes(b.slots)
            if cap is not None and b.numel > cap:
                self._tail_limit = (f"limited by max_gpu_fraction={self.max_gpu_fraction} "
                                    f"({self.device_numel:,} of {total:,} parameters are on the GPU)")
                self._warn_tail_limit(f"max_gpu_fraction={self.max_gpu_fraction} would be exceeded "
                                      f"({self.device_numel:,} of {total:,} parameters are on the GPU)")
                break
            if budget is not None and nbytes > budget:
                self._tail_limit = f"limited by GPU memory ({how})"
                self._warn_tail_limit(
                    f"the next bucket needs {nbytes / 2**20:.0f} MiB of GPU memory and only "
                    f"{max(budget, 0) / 2**20:.0f} MiB are free beyond the headroom ({how})")
                break
            if not self._move_bucket_to_device(b):
                self._tail_blocked = True  # the allocator disagrees with the free-memory estimate: stop growing
                self._tail_limit = "limited by GPU memory (moving the next bucket ran out of memory)"
                self._warn_tail_limit(f"moving {nbytes / 2**20:.0f} MiB to the GPU ran out of memory; the bucket "
                                      f"stays on the host and the tail stops growing")
                break
            moved_ms += b.cpu_ms
            count += 1
            if cap is not None:
                cap -= b.numel
            if budget is not None:
                budget -= nbytes
        return count

    def _warn_tail_limit(self, why: str) -> None:
        """Count a limited growth. No warning: the final decision's one log line says what limited the tail
        (the full reason of the first limit is kept in ``stats["tail_limit_detail"]``)."""
        self.stats["tail_limited"] += 1
        if not self._tail_warned:
            self._tail_warned = True
            self.stats["tail_limit_detail"] = why

    def _move_bucket_to_device(self, b: Bucket) -> bool:
        """Give bucket ``b``'s state to the GPU tail. Returns ``False``, with the bucket unchanged on the host,
        when the GPU runs out of memory on the way."""
        with self._state_lock:
            staged: list[tuple[Slot, dict[str, torch.Tensor | None]]] | None = []
            try:
                for s in b.slots:
                    host = {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "step": s.step, "master": s.master}
                    staged.append((s, self._device_state(s, host)))
            except torch.cuda.OutOfMemoryError:
                staged = None  # drop what was allocated; the host state was only read
            if staged is None:
                self.stats["tail_move_failures"] += 1
                return False
            for s, st in staged:
                self._install_device_state(s, st)
            self._buckets.remove(b)
            b.release_host()
        self.stats["tail_moves"] += 1
        return True

    def _move_slots_to_host(self, slots: list[Slot]) -> None:
        with self._state_lock:
            for chunk in chunk_by_size(slots, self.bucket_size):
                dev = {s.index: (s.exp_avg, s.exp_avg_sq, s.step, s.dev_master) for s in chunk}
                self._new_bucket(chunk)
                for s in chunk:
                    m, v, step, master = dev[s.index]
                    s.exp_avg.copy_(m.reshape(-1))
                    s.exp_avg_sq.copy_(v.reshape(-1))
                    s.step.copy_(step)
                    if master is not None:
                        s.master.copy_(master.reshape(-1))
        self.stats["tail_moves_back"] += 1

