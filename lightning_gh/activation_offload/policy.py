"""Which transformer blocks' saved activations to move to host memory, and when to move them.

The engine (:mod:`lightning_gh.activation_offload.engine`) executes an :class:`OffloadPlan`; this module makes one.
A plan says, per block, how many bytes to offload, at which forward point the compute stream waits for
those copies to finish (so their GPU memory can be reused), and at which backward point their reload is
issued. Three policies:

* ``plan_all`` / ``plan_first_k``: a fixed set of blocks; the forward may stall on the copies, which
  bounds GPU memory whatever the link's speed.
* ``plan_auto``: from a measured :class:`StepProfile` (per-block forward/backward time and saved bytes)
  and the link bandwidth, offload the longest prefix of blocks (the last one possibly in part) whose
  device->host copies finish under the remaining forward and whose host->device reloads finish under the
  backward of the blocks after them, with transfer times inflated by ``margin``. A block's copies hide
  best when it runs early in the forward and late in the backward, so the prefix is the best choice.

``plan_with_recompute`` adds recomputation to a plan: the blocks it does not offload recompute in the
backward what they saved (``"selective"``: all but the matmul and attention outputs; ``"full"``: all but
the block's inputs), and its forecast counts what they then keep.

The timeline model (``simulate``) is deliberately simple and stated in full so its predictions can be
checked: copies of block ``i`` start when block ``i`` ends (conservative; they really start as each
tensor is saved), each direction of the link is one FIFO queue at its measured bandwidth, compute and
copies overlap perfectly, and memory is counted as saved-activation bytes only (no allocator rounding,
no temporaries, no gradients).

Forward points are numbered ``1..N-1`` (block ``j`` starts), ``N`` (the last block ended) and ``N+1``
(the forward ended, backward about to start). Backward points are ``N`` (backward started) and
``j < N`` (block ``j``'s backward starts: the first time one of its saved tensors is used).

Example::

    >>> prof = StepProfile(blocks=tuple(BlockProfile(2.0, 4.0, 100 * 2**20) for _ in range(8)))
    >>> plan = plan_auto(prof, d2h_gbps=55.0, h2d_gbps=55.0, margin=0.25)
    >>> plan.offloaded_blocks  # blocks 0-4 whole and part of block 5 hide under the forward
    (0, 1, 2, 3, 4, 5)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = [
    "BlockProfile",
    "StepProfile",
    "OffloadPlan",
    "Prediction",
    "simulate",
    "plan_none",
    "plan_all",
    "plan_first_k",
    "plan_auto",
    "plan_with_recompute",
    "median_profile",
]

_MIB = 2**20


@dataclass(frozen=True)
class BlockProfile:
    """What one transformer block costs in one training step.

    Args:
        forward_ms: its forward time.
        backward_ms: its backward time (the engine measures it between the first reloads of consecutive
            blocks; twice the forward when it could not).
        offloadable_bytes: bytes of saved activations the engine may move (after skipping parameters,
            small tensors and duplicate views).
        resident_bytes: other saved bytes of the block, which always stay on the device.
        recompute_kept_bytes: bytes the block keeps when it recomputes, measured in the first forward in which
            it did (what reached the engine's hooks plus the selective cache); ``None``: not measured.
    """

    forward_ms: float
    backward_ms: float
    offloadable_bytes: int
    resident_bytes: int = 0
    recompute_kept_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_ms"):
            v = getattr(self, name)
            if not v >= 0.0:
                raise ValueError(f"BlockProfile.{name}={v!r} must be a non-negative number of milliseconds.")
        for name in ("offloadable_bytes", "resident_bytes", "recompute_kept_bytes"):
            v = getattr(self, name)
            if v is None and name == "recompute_kept_bytes":
                continue
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"BlockProfile.{name}={v!r} must be a non-negative int.")

    @property
    def saved_bytes(self) -> int:
        return self.offloadable_bytes + self.resident_bytes


@dataclass(frozen=True)
class StepProfile:
    """One step, measured: the blocks in forward order and what runs outside them.

    Args:
        blocks: per-block measurements, block 0 first.
        tail_forward_ms: forward time after the last block (final norm, head, loss).
        tail_backward_ms: backward time before the last block's backward starts.
        other_bytes: bytes saved outside the blocks (embedding, head, loss); always resident.
        backward_extra_bytes: bytes the backward allocates at its start on top of the saved activations,
            while the head's backward runs (the gradient of the logits). ``None``: as many as ``other_bytes``
            (the head's saved logits and their gradient have the same size).
    """

    blocks: tuple[BlockProfile, ...]
    tail_forward_ms: float = 0.0
    tail_backward_ms: float = 0.0
    other_bytes: int = 0
    backward_extra_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("StepProfile.blocks must hold at least one BlockProfile.")
        if not (self.tail_forward_ms >= 0 and self.tail_backward_ms >= 0 and self.other_bytes >= 0):
            raise ValueError("StepProfile tail times and other_bytes must be non-negative.")
        if self.backward_extra_bytes is not None and self.backward_extra_bytes < 0:
            raise ValueError(f"StepProfile.backward_extra_bytes={self.backward_extra_bytes!r} must be >= 0 or None.")

    @property
    def backward_extra(self) -> int:
        return self.other_bytes if self.backward_extra_bytes is None else self.backward_extra_bytes

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def forward_ms(self) -> float:
        return sum(b.forward_ms for b in self.blocks) + self.tail_forward_ms

    @property
    def backward_ms(self) -> float:
        return sum(b.backward_ms for b in self.blocks) + self.tail_backward_ms

    @property
    def saved_bytes(self) -> int:
        return sum(b.saved_bytes for b in self.blocks) + self.other_bytes


@dataclass(frozen=True)
class Prediction:
    """What ``simulate`` expects a plan to do to one step."""

    forward_stall_ms: float
    backward_stall_ms: float
    baseline_peak_bytes: int
    peak_bytes: int
    offloaded_bytes: int
    recompute_freed_bytes: int = 0  # saved bytes the recomputing blocks no longer keep (per step)

    @property
    def stall_ms(self) -> float:
        return self.forward_stall_ms + self.backward_stall_ms

    @property
    def saving_bytes(self) -> int:
        return self.baseline_peak_bytes - self.peak_bytes


@dataclass(frozen=True)
class OffloadPlan:
    """Per-block offload decisions for the engine.

    Attributes:
        policy: a label (``"none"``, ``"all"``, ``"first-3"``, ``"auto"``).
        budgets: bytes of each block's offloadable tensors to move, in save order; ``None`` moves all
            of them, ``0`` none. A partial budget moves whole tensors while they fit.
        release_at: forward point at which the compute stream waits for each block's copies and their
            GPU memory is given back (``i+1 .. N+1``; ignored for blocks with a zero budget).
        prefetch_at: backward point whose start issues each block's reload (``i+1 .. N``).
        prediction: the timeline model's forecast, when the plan was made from a profile.
        notes: human-readable reasons (what limited the choice).
        recompute: blocks that recompute their saved activations in the backward instead of keeping
            them (never an offloaded block); see :func:`plan_with_recompute`.
        recompute_mode: ``"norm-act"``, ``"selective"`` or ``"full"`` when ``recompute`` is not empty
            (``"mixed"`` when ``modes`` names more than one).
        modes: per block, its recompute mode or ``None`` (budget plans, which may mix modes and combine a mode with
            offloading what the block still saves); empty: ``recompute``/``recompute_mode`` say it.
        lean_loss: the engine installs the lean causal-LM loss for the forwards of this plan
            (:mod:`lightning_gh.activation_offload.lean_loss`).
    """

    policy: str
    budgets: tuple[int | None, ...]
    release_at: tuple[int, ...]
    prefetch_at: tuple[int, ...]
    prediction: Prediction | None = None
    notes: tuple[str, ...] = field(default=())
    recompute: tuple[int, ...] = ()
    recompute_mode: str | None = None
    modes: tuple[str | None, ...] = ()
    lean_loss: bool = False

    def __post_init__(self) -> None:
        n = len(self.budgets)
        if self.modes:
            if len(self.modes) != n or any(m not in (None, "norm-act", "selective", "full") for m in self.modes):
                raise ValueError(f"OffloadPlan.modes={self.modes!r} must hold one of None, 'norm-act', 'selective', "
                                 f"'full' per block ({n} blocks).")
            used = sorted({m for m in self.modes if m})
            object.__setattr__(self, "modes", tuple(self.modes))
            object.__setattr__(self, "recompute", tuple(i for i, m in enumerate(self.modes) if m))
            object.__setattr__(self, "recompute_mode", None if not used else used[0] if len(used) == 1 else "mixed")
        if len(self.release_at) != n or len(self.prefetch_at) != n:
            raise ValueError("OffloadPlan budgets, release_at and prefetch_at must have one entry per block.")
        for i, (r, p) in enumerate(zip(self.release_at, self.prefetch_at)):
            if not i + 1 <= r <= n + 1:
                raise ValueError(f"OffloadPlan.release_at[{i}]={r} must be in [{i + 1}, {n + 1}].")
            if not i + 1 <= p <= n:
                raise ValueError(f"OffloadPlan.prefetch_at[{i}]={p} must be in [{i + 1}, {n}].")
        for i in self.recompute:
            if not 0 <= i < n or (self.offloads(i) and not self.modes):
                raise ValueError(f"OffloadPlan.recompute holds block {i}: it must be a block in [0, {n - 1}] "
                                 "that the plan does not offload.")
        if self.recompute and self.recompute_mode is None:
            raise ValueError("OffloadPlan.recompute_mode must name the mode ('norm-act', 'selective' or 'full') when "
                             "recompute lists blocks.")

    @property
    def n_blocks(self) -> int:
        return len(self.budgets)

    @property
    def offloaded_blocks(self) -> tuple[int, ...]:
        return tuple(i for i, b in enumerate(self.budgets) if b is None or b > 0)

    def mode_of(self, block: int) -> str | None:
        """Block ``block``'s recompute mode (``None``: it keeps what it saves, or offloads it)."""
        if self.modes:
            return self.modes[block]
        return self.recompute_mode if block in self.recompute else None

    def recompute_groups(self) -> dict[str, tuple[int, ...]]:
        """Recompute mode -> the blocks that use it."""
        out: dict[str, list[int]] = {}
        for i in self.recompute:
            out.setdefault(self.mode_of(i), []).append(i)
        return {m: tuple(v) for m, v in out.items()}

    def offloads(self, block: int) -> bool:
        return 0 <= block < self.n_blocks and (self.budgets[block] is None or self.budgets[block] > 0)

    def describe(self) -> str:
        """A few lines for the log: what is offloaded, when it is waited for and reloaded, the forecast."""
        blocks = self.offloaded_blocks
        if not blocks:
            head = f"policy {self.policy}: offload nothing"
        else:
            parts = []
            for i in blocks:
                b = self.budgets[i]
                size = "all" if b is None else f"{b / _MIB:.0f} MiB"
                parts.append(f"{i}({size}, wait@{_fwd_point_name(self.release_at[i], self.n_blocks)}, "
                             f"reload@{_bwd_point_name(self.prefetch_at[i], self.n_blocks)})")
            head = f"policy {self.policy}: offload blocks " + ", ".join(parts) + f" of {self.n_blocks}"
        if self.recompute:
            head += "; " + "; ".join(f"{m} recompute in blocks {_ranges(b)}"
                                     for m, b in sorted(self.recompute_groups().items()))
        if self.lean_loss:
            head += "; lean loss (logits kept as they come; fused kernels where Triton runs, else fp32 row chunks)"
        lines = [head]
        p = self.prediction
        if p is not None:
            pct = 100.0 * p.saving_bytes / p.baseline_peak_bytes if p.baseline_peak_bytes else 0.0
            rc = (f", recompute keeps {p.recompute_freed_bytes / 2**30:.2f} GiB less"
                  if self.recompute and p.recompute_freed_bytes else "")
            lines.append(
                f"predicted: {p.offloaded_bytes / 2**30:.2f} GiB moved each way per step{rc}, saved-activation peak "
                f"{p.baseline_peak_bytes / 2**30:.2f} -> {p.peak_bytes / 2**30:.2f} GiB ({pct:.0f}% less), "
                f"stall {p.stall_ms:.2f} ms per step"
            )
        lines += list(self.notes)
        return "\n".join(lines)


def _ranges(blocks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = None
    for b in sorted(blocks) + [None]:
        if b is not None and prev is not None and b == prev + 1:
            prev = b
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = b
    return ", ".join(out)


def _fwd_point_name(point: int, n: int) -> str:
    return "fwd-end" if point == n + 1 else ("last-block-end" if point == n else f"block{point}")


def _bwd_point_name(point: int, n: int) -> str:
    return "bwd-start" if point == n else f"block{point}"


# --------------------------------------------------------------------------------------------- the model


def simulate(
    profile: StepProfile,
    budgets: tuple[int | None, ...],
    release_at: tuple[int, ...],
    prefetch_at: tuple[int, ...],
    d2h_gbps: float,
    h2d_gbps: float,
    margin: float = 0.0,
    transient: tuple[int, ...] | None = None,
) -> Prediction:
    """Forecast stalls and the saved-activation peak of a plan on a measured step (see the module doc).

    ``transient[j]``: bytes block ``j`` holds again during its own backward only (what a recomputing block
    re-creates); counted in the peak at that moment.
    """
    n = profile.n_blocks
    if not (len(budgets) == len(release_at) == len(prefetch_at) == n):
        raise ValueError(f"simulate: plan has {len(budgets)} blocks, the profile {n}.")
    x = [_moved(profile.blocks[i], budgets[i]) for i in range(n)]
    ms_per_byte_d2h = (1.0 + margin) / (d2h_gbps * 1e6)
    ms_per_byte_h2d = (1.0 + margin) / (h2d_gbps * 1e6)

    fwd_stall, bwd_stall, peak = _timeline(profile, x, release_at, prefetch_at, ms_per_byte_d2h, ms_per_byte_h2d,
                                           transient)
    baseline = _timeline(profile, [0] * n, release_at, prefetch_at, ms_per_byte_d2h, ms_per_byte_h2d)[2]
    return Prediction(fwd_stall, bwd_stall, baseline, peak, sum(x))


def _timeline(profile: StepProfile, x: list[int], release_at: tuple[int, ...], prefetch_at: tuple[int, ...],
              k_d2h: float, k_h2d: float, transient: tuple[int, ...] | None = None) -> tuple[float, float, int]:
    """(forward stall, backward stall, saved-activation peak) of moving ``x[i]`` bytes of each block."""
    n = profile.n_blocks
    # Forward: compute time t (stalls included), one FIFO device->host queue.
    t, link, fwd_stall = 0.0, 0.0, 0.0
    done = [0.0] * n
    mem, peak = 0, 0

    def release(point: int) -> None:
        nonlocal t, fwd_stall, mem
        for i in range(n):
            if x[i] and release_at[i] == point:
                wait = max(0.0, done[i] - t)
                t += wait
                fwd_stall += wait
                mem -= x[i]

    for j, blk in enumerate(profile.blocks):
        if j:
            release(j)
        t += blk.forward_ms
        mem += blk.saved_bytes
        peak = max(peak, mem)
        if x[j]:
            link = max(link, t) + x[j] * k_d2h
            done[j] = link
    release(n)
    t += profile.tail_forward_ms
    mem += profile.other_bytes
    peak = max(peak, mem)
    release(n + 1)

    # Backward: t restarts at 0; the head's backward holds its extra bytes; one FIFO host->device queue.
    t, link, bwd_stall = 0.0, 0.0, 0.0
    ready = [0.0] * n

    def issue(point: int) -> None:
        nonlocal link, mem, peak
        for i in range(n - 1, -1, -1):
            if x[i] and prefetch_at[i] == point:
                link = max(link, t) + x[i] * k_h2d
                ready[i] = link
                mem += x[i]
        peak = max(peak, mem)

    mem += profile.backward_extra
    issue(n)
    t += profile.tail_backward_ms
    mem -= profile.backward_extra + profile.other_bytes
    for j in range(n - 1, -1, -1):
        if x[j]:
            wait = max(0.0, ready[j] - t)
            t += wait
            bwd_stall += wait
        issue(j)
        if transient:
            peak = max(peak, mem + transient[j])
        t += profile.blocks[j].backward_ms
        mem -= profile.blocks[j].saved_bytes
    return fwd_stall, bwd_stall, peak


def _moved(blk: BlockProfile, budget: int | None) -> int:
    return blk.offloadable_bytes if budget is None else min(budget, blk.offloadable_bytes)


def median_profile(profiles: list[StepProfile]) -> StepProfile:
    """Per field, the median of several measured steps of one model (block by block)."""
    n = profiles[0].n_blocks
    med = statistics.median
    blocks = tuple(
        BlockProfile(med(p.blocks[i].forward_ms for p in profiles), med(p.blocks[i].backward_ms for p in profiles),
                     int(med(p.blocks[i].offloadable_bytes for p in profiles)),
                     int(med(p.blocks[i].resident_bytes for p in profiles)),
                     None if any(p.blocks[i].recompute_kept_bytes is None for p in profiles)
                     else int(med(p.blocks[i].recompute_kept_bytes for p in profiles)))
        for i in range(n))
    return StepProfile(blocks, med(p.tail_forward_ms for p in profiles), med(p.tail_backward_ms for p in profiles),
                       int(med(p.other_bytes for p in profiles)))

# ---------------------------------------------------------------------------------------------- policies


def _check_n(n_blocks: int, skip_last_blocks: int) -> None:
    if not isinstance(n_blocks, int) or n_blocks <= 0:
        raise ValueError(f"n_blocks={n_blocks!r} must be a positive int.")
    if not isinstance(skip_last_blocks, int) or skip_last_blocks < 0:
        raise ValueError(f"skip_last_blocks={skip_last_blocks!r} must be an int >= 0.")


def plan_none(n_blocks: int, policy: str = "none") -> OffloadPlan:
    """Offload nothing (profiling steps, or a link that hides nothing)."""
    _check_n(n_blocks, 0)
    return OffloadPlan(policy, (0,) * n_blocks, tuple(range(2, n_blocks + 2)), tuple(range(1, n_blocks + 1)))


def plan_first_k(
    n_blocks: int,
    k: int,
    skip_last_blocks: int = 1,
    max_inflight_blocks: int | None = 2,
    prefetch_blocks: int = 1,
    policy: str | None = None,
) -> OffloadPlan:
    """Offload every offloadable tensor of blocks ``0..k-1`` (never the last ``skip_last_blocks``).

    Args:
        n_blocks: transformer blocks in the model.
        k: blocks to offload, counted from the first.
        skip_last_blocks: blocks at the end that stay resident: backward needs them first, so their
            reload could not hide under anything.
        max_inflight_blocks: block ``i``'s copies are waited for when block ``i + max_inflight_blocks``
            starts, which bounds the GPU memory held by unfinished copies (``None``: at the forward's end).
        prefetch_blocks: block ``i``'s reload is issued when the backward of block ``i + prefetch_blocks``
            starts.
    """
    _check_n(n_blocks, skip_last_blocks)
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0.")
    if max_inflight_blocks is not None and (not isinstance(max_inflight_blocks, int) or max_inflight_blocks < 1):
        raise ValueError(f"max_inflight_blocks={max_inflight_blocks!r} must be an int >= 1 or None.")
    if not isinstance(prefetch_blocks, int) or prefetch_blocks < 1:
        raise ValueError(f"prefetch_blocks={prefetch_blocks!r} must be an int >= 1.")
    k_eff = max(0, min(k, n_blocks - skip_last_blocks))
    budgets = tuple(None if i < k_eff else 0 for i in range(n_blocks))
    lag = n_blocks + 1 if max_inflight_blocks is None else max_inflight_blocks
    release = tuple(min(i + lag, n_blocks + 1) for i in range(n_blocks))
    prefetch = tuple(min(i + prefetch_blocks, n_blocks) for i in range(n_blocks))
    notes = ()
    if k_eff < k and policy != "all":
        notes = (f"k={k} asked for, {k_eff} offloaded: the last {skip_last_blocks} block(s) stay resident "
                 f"(skip_last_blocks={skip_last_blocks}).",)
    return OffloadPlan(policy or f"first-{k}", budgets, release, prefetch, None, notes)


def plan_all(n_blocks: int, skip_last_blocks: int = 1, max_inflight_blocks: int | None = 2,
             prefetch_blocks: int = 1) -> OffloadPlan:
    """Offload every block but the last ``skip_last_blocks`` (see :func:`plan_first_k`)."""
    return plan_first_k(n_blocks, n_blocks, skip_last_blocks, max_inflight_blocks, prefetch_blocks, policy="all")


def _prefix_budgets(profile: StepProfile, total: int, eligible: int) -> tuple[int | None, ...]:
    """Fill blocks 0, 1, ... with ``total`` bytes: whole blocks, then part of the next."""
    out: list[int | None] = []
    left = total
    for i, blk in enumerate(profile.blocks):
        if i >= eligible or left <= 0 or blk.offloadable_bytes == 0:
            out.append(0)
        elif left >= blk.offloadable_bytes:
            out.append(None)
            left -= blk.offloadable_bytes
        else:
            out.append(left)
            left = 0
    return tuple(out)


def _schedule(profile: StepProfile, budgets: tuple[int | None, ...], d2h_gbps: float, h2d_gbps: float,
              margin: float) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """Earliest stall-free release point and latest stall-free prefetch point per block; ``ok`` is False
    when some block has neither (its copies cannot hide)."""
    n = profile.n_blocks
    x = [_moved(profile.blocks[i], budgets[i]) for i in range(n)]
    k_d2h = (1.0 + margin) / (d2h_gbps * 1e6)
    k_h2d = (1.0 + margin) / (h2d_gbps * 1e6)
    ok = True

    # Forward points' times with no stall: point j = start of block j; N = last block end; N+1 = forward end.
    starts = [0.0]
    for blk in profile.blocks:
        starts.append(starts[-1] + blk.forward_ms)
    point_time = {j: starts[j] for j in range(1, n + 1)}
    point_time[n + 1] = starts[n] + profile.tail_forward_ms
    release = []
    link = 0.0
    for i in range(n):
        if not x[i]:
            release.append(min(i + 2, n + 1))
            continue
        link = max(link, starts[i + 1]) + x[i] * k_d2h
        r = next((j for j in range(i + 1, n + 2) if point_time[j] >= link), None)
        if r is None:
            ok, r = False, n + 1
        release.append(r)

    # Backward points' times with no stall: N = 0; block j starts after the tail and blocks > j.
    bstart = {n: 0.0}
    t = profile.tail_backward_ms
    for j in range(n - 1, -1, -1):
        bstart[j] = t
        t += profile.blocks[j].backward_ms
    # As late as possible, from the block needed last (block 0) upwards: each reload must end by its block's
    # backward and before the next reload in the FIFO queue (the one needed after it) has to start; it is
    # issued at the latest backward point not after that start.
    prefetch = [min(i + 1, n) for i in range(n)]
    next_start = float("inf")
    for i in range(n):
        if not x[i]:
            continue
        start = min(bstart[i], next_start) - x[i] * k_h2d
        points = [p for p in range(i + 1, n + 1) if bstart[p] <= start + 1e-9]
        if points:
            prefetch[i] = min(points)
        else:
            ok, prefetch[i], start = False, n, 0.0
        next_start = start
    return tuple(release), tuple(prefetch), ok


def plan_auto(
    profile: StepProfile,
    d2h_gbps: float,
    h2d_gbps: float,
    margin: float = 0.25,
    skip_last_blocks: int = 1,
    granularity_bytes: int = 16 * _MIB,
) -> OffloadPlan:
    """The most bytes (a prefix of blocks, the last in part) whose copies hide under compute.

    Args:
        profile: one measured step.
        d2h_gbps / h2d_gbps: link bandwidth each way, GB/s (``hardware.link_bandwidth()``).
        margin: transfer times are multiplied by ``1 + margin`` before testing whether they hide (0.25:
            plan as if the link were 20% slower than measured, for contention and per-copy latency).
        skip_last_blocks: blocks at the end never offloaded.
        granularity_bytes: the search resolution of the byte budget.
    """
    _check_n(profile.n_blocks, skip_last_blocks)
    if not (d2h_gbps > 0 and h2d_gbps > 0):
        raise ValueError(f"d2h_gbps={d2h_gbps!r} and h2d_gbps={h2d_gbps!r} must be > 0 GB/s.")
    if not margin >= 0:
        raise ValueError(f"margin={margin!r} must be >= 0 (0.25 inflates transfer times by 25%).")
    n = profile.n_blocks
    eligible = max(0, n - skip_last_blocks)
    total = sum(b.offloadable_bytes for b in profile.blocks[:eligible])

    def feasible(nbytes: int) -> tuple[bool, OffloadPlan]:
        budgets = _prefix_budgets(profile, nbytes, eligible)
        release, prefetch, ok = _schedule(profile, budgets, d2h_gbps, h2d_gbps, margin)
        pred = simulate(profile, budgets, release, prefetch, d2h_gbps, h2d_gbps, margin)
        ok = ok and pred.stall_ms <= 1e-6
        return ok, OffloadPlan("auto", budgets, release, prefetch, pred)

    ok, best = feasible(total)
    if not ok:
        lo, hi = 0, total  # lo is feasible (nothing moved), hi is not
        best = feasible(0)[1]
        while hi - lo > granularity_bytes:
            mid = (lo + hi) // 2
            ok_mid, plan_mid = feasible(mid)
            if ok_mid:
                lo, best = mid, plan_mid
            else:
                hi = mid
    link_ms = total / (d2h_gbps * 1e6)
    notes = [
        f"measured: forward {profile.forward_ms:.2f} ms, backward {profile.backward_ms:.2f} ms, "
        f"{total / 2**30:.2f} GiB offloadable in blocks 0-{eligible - 1} ({link_ms:.1f} ms at {d2h_gbps:.1f} GB/s "
        f"device->host), link {d2h_gbps:.1f}/{h2d_gbps:.1f} GB/s d2h/h2d, margin {margin:.0%}",
    ]
    moved = best.prediction.offloaded_bytes if best.prediction else 0
    if moved < total:
        notes.append(f"limited by the link: {moved / 2**30:.2f} of {total / 2**30:.2f} GiB hide under compute; "
                     "use policy='all' or an int to trade step time for memory")
    if not best.offloaded_blocks:
        notes.append("the link hides no offload on this model and batch: nothing is offloaded")
    return OffloadPlan("auto", best.budgets, best.release_at, best.prefetch_at, best.prediction, tuple(notes))


def plan_with_recompute(
    plan: OffloadPlan,
    mode: str | None,
    profile: StepProfile | None = None,
    d2h_gbps: float | None = None,
    h2d_gbps: float | None = None,
    margin: float = 0.0,
) -> OffloadPlan:
    """``plan`` with every block it does not offload recomputing in the backward (``mode=None``: none).

    The offload part is unchanged: what the link hides does not depend on the other blocks' memory, and
    recomputation only lengthens their backward, which leaves more time for the reloads. With a
    ``profile`` whose blocks carry ``recompute_kept_bytes`` (measured with ``mode`` on), the forecast is redone
    with the recomputing blocks keeping only that. The recompute time is not modelled: it is the
    recomputed ops' forward time, added to the backward.

    Args:
        plan: an offload plan (its ``recompute`` is replaced).
        mode: ``"norm-act"``, ``"selective"``, ``"full"`` or ``None``.
        profile: the step the plan was made from (optional; for the forecast).
        d2h_gbps / h2d_gbps / margin: as for :func:`plan_auto` (needed with ``profile``).

    Example::

        >>> plan = plan_with_recompute(plan_first_k(8, 1), "selective")
        >>> plan.recompute
        (1, 2, 3, 4, 5, 6, 7)
    """
    from dataclasses import replace

    notes = tuple(x for x in plan.notes if not x.startswith("recompute:"))
    pred = plan.prediction
    if pred is not None and pred.recompute_freed_bytes:  # a forecast that counted recompute: not ours to reuse
        pred = None
    if mode is None:
        return replace(plan, recompute=(), recompute_mode=None, prediction=pred, notes=notes)
    if mode not in ("norm-act", "selective", "full"):
        raise ValueError(f"mode={mode!r} is not valid; use None, 'norm-act', 'selective' or 'full'.")
    blocks = tuple(i for i in range(plan.n_blocks) if not plan.offloads(i))
    if blocks and profile is not None and pred is not None and d2h_gbps and h2d_gbps \
            and all(profile.blocks[i].recompute_kept_bytes is not None for i in blocks):
        new_blocks = list(profile.blocks)
        freed = 0
        for i in blocks:
            b = profile.blocks[i]
            kept = min(b.saved_bytes, b.recompute_kept_bytes)
            freed += b.saved_bytes - kept
            new_blocks[i] = BlockProfile(b.forward_ms, b.backward_ms, 0, kept, b.recompute_kept_bytes)
        after = simulate(replace(profile, blocks=tuple(new_blocks)), plan.budgets, plan.release_at, plan.prefetch_at,
                         d2h_gbps, h2d_gbps, margin)
        pred = Prediction(pred.forward_stall_ms, pred.backward_stall_ms, pred.baseline_peak_bytes, after.peak_bytes,
                          pred.offloaded_bytes, freed)
        saved = sum(profile.blocks[i].saved_bytes for i in blocks) / len(blocks) / _MIB
        notes += (f"recompute: {mode} in blocks {_ranges(blocks)}: each keeps {saved - freed / len(blocks) / _MIB:.1f} "
                  f"of the {saved:.1f} MiB it saved without recompute (mean, both measured); the recompute time "
                  "(their recomputed ops' forward, in the backward) is not in the stall forecast",)
    elif blocks:
        why = ("measured in the first recomputing forward, then logged" if profile is not None
               else "no measured profile")
        notes += (f"recompute: {mode} in blocks {_ranges(blocks)} (saving not forecast yet: {why})",)
    return replace(plan, recompute=blocks, recompute_mode=mode if blocks else None, prediction=pred, notes=notes)
