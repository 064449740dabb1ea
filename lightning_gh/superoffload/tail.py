"""The auto GPU tail's policy (``gpu_fraction="auto"``): a pure function from a frozen record of measurements
(:class:`TailWindow`) to an action (:class:`TailAction`), and the step timings it is measured from
(:class:`StepTimes`). :class:`~lightning_gh.superoffload.tail_mover.TailMover` gathers the window after every
step and applies the action.

Note [Tail growth trial]
    Everything starts on the host. Over windows of ``WINDOW`` pipelined steps (their medians: single steps
    are noisy) the policy reads the step period, how long the next forward waited for the CPU (the stall) and the
    CPU update time of the host buckets:

    * everything still on the host fits in the GPU memory the tail may take: move all of it, once, as a trial
      (stall or not: a CPU update that hides under forward+backward still shares the host with the training
      loop);
    * no stall (the CPU update hides under forward+backward): no tail; the decision is final;
    * a stall: move the last-processed host buckets (the earliest layers) to the GPU, worth a little less than the
      stall in measured CPU time, as a *trial*. The forward waited for exactly that CPU work, so the trial is kept
      unless the next measured steps are slower by more than ``TRIAL_NOISE`` (the noise of a comparison of two
      windows) or the caching allocator had to free its cache to satisfy an allocation (``num_alloc_retries``,
      the thrash a tail that eats the activations' memory causes); otherwise the moved state goes back to the
      host and the tail stops growing. So the automatic tail never leaves a run measurably slower than
      ``gpu_fraction=0.0``;
    * after a kept trial with no host-side wait left, the step may still wait on the GPU for the copies back: the
      policy probes a further ``PROBE_SHARE`` of the host's CPU work, kept only when the step gets faster by at
      least ``TRIAL_MIN_GAIN`` (no stall showed that work was in the way; the same for the all-at-once trial);
    * when the first bucket the forward needed had long been ready, some parameters go back to the host;
    * growth is bounded by the GPU memory measured after a full step's peak, less a headroom, and by
      ``max_gpu_fraction`` (the mover's budget); a move that runs out of memory anyway leaves its bucket on the
      host and stops the growth;
    * after the decision is final, any later allocator retry while a tail exists sends the tail back, once.

    The undo of a trial moves exactly the trial's parameters back to new host buckets: the host copy of a
    parameter exists only while its state lives on the host.

Example::

    >>> w = TailWindow(steps=4, periods=(100.0,) * 3, stalls=(0.0,) * 3, cpu_ms=30.0, host_numel=1000)
    >>> decide(w)
    TailAction(kind=<TailActionKind.FINAL: 'final'>, why='the CPU update hides under forward+backward', need_ms=0.0, on_stall=False, numel=0, judged_trial=False)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

__all__ = ["ShardCandidate", "StepTimes", "TailAction", "TailActionKind", "TailStage", "TailWindow", "Trial",
           "allocator_retries", "decide", "sharded_tail"]

#: Start deciding after this many pipelined steps (counted from the step that built the layout): the first steps
#: pay one-time costs (allocator growth, cuDNN/cuBLAS heuristics, pinning).
FIRST_CHECK = 4
#: Stop adjusting after this many pipelined steps: the decision is final then.
LAST_CHECK = 36
#: Steps per measurement; the policy reads their median period and stall.
WINDOW = 3
#: The forward "waits for the CPU" when the stall is above this share of the step period.
STALL_SHARE = 0.03
#: A probe or all-at-once trial is kept only when the step gets at least this much faster.
TRIAL_MIN_GAIN = 0.02
#: A growth made because the forward waited for the CPU is undone only when the step gets this much slower.
TRIAL_NOISE = 0.03
#: Moving CPU work w to the GPU shortens the wait by a little more than w (the moved layers' own forward now runs
#: before the first host bucket is needed): move this share of the wait, re-check later.
GROW_SHARE = 0.85
#: After a growth that paid and no more host-side wait: probe this share of the host's CPU work next.
PROBE_SHARE = 0.25
#: Give parameters back to the host when the first bucket the forward needed had been ready this share of the period.
SLACK_SHARE = 0.15


def allocator_retries(device: torch.device) -> int:
    """How often torch's caching allocator had to free its cache and retry (plus its OOMs) on ``device``; 0 off CUDA.

    Under a memory cap a tail that takes the memory the activations need shows up here first: every such retry
    synchronises the device and frees and re-allocates segments.

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


def median(values: tuple[float, ...] | list[float]) -> float:
    """The median of the last ``WINDOW`` measurements (0 when there are none)."""
    last = sorted(values[-WINDOW:])
    return last[len(last) // 2] if last else 0.0


class TailStage(enum.Enum):
    """Where the auto tail's decision stands."""

    SEARCHING = "searching"  # measuring and moving, trial by trial
    FINAL = "final"  # decided; an allocator retry while a tail exists would still send it home
    SENT_HOME = "sent_home"  # decided, and the tail went back to the host after an allocator retry


@dataclass(frozen=True)
class Trial:
    """A growth of the tail the next window keeps or undoes (see Note [Tail growth trial]).

    Attributes:
        period: the median step period before the growth (ms).
        retries: the allocator's retry count before the growth.
        slots: the slots moved, in arrival order.
        numel: their parameters.
        on_stall: the forward's wait asked for the growth (undone only when measurably slower); otherwise a probe
            or the all-at-once trial (kept only when measurably faster).
    """

    period: float
    retries: int
    slots: tuple[int, ...]
    numel: int
    on_stall: bool


@dataclass(frozen=True)
class TailWindow:
    """What the policy decides from: the measurements of the last steps and what it decided before.

    Attributes:
        steps: pipelined steps since the layout was built.
        periods: step periods since the last move (ms).
        stalls: per step, how long the next forward waited for the CPU (ms).
        slacks: the last two steps' slack (ms): how long the first bucket the forward needed had been ready
            (negative: waited for), steps with no reading left out.
        cpu_ms: the host buckets' CPU update time per step (ms).
        host_numel: parameters in host buckets.
        device_numel: parameters on the GPU tail the policy may move back to the host.
        all_fits: everything still on the host fits in the GPU memory the tail may take.
        retries: the allocator's retry count now.
        trial: the open trial, or ``None``.
        gained: the last trial was kept.
        all_in_tried: the one trial of moving everything left on the host was made.
        blocked: a move ran out of GPU memory (or the tail was sent home): no more growth.
        stage: where the decision stands.
        retries_seen: the allocator's retry count when the decision became final.
    """

    steps: int
    periods: tuple[float, ...] = ()
    stalls: tuple[float, ...] = ()
    slacks: tuple[float, ...] = ()
    cpu_ms: float = 0.0
    host_numel: int = 0
    device_numel: int = 0
    all_fits: bool = False
    retries: int = 0
    trial: Trial | None = None
    gained: bool = False
    all_in_tried: bool = False
    blocked: bool = False
    stage: TailStage = TailStage.SEARCHING
    retries_seen: int = 0

    @property
    def period(self) -> float:
        return median(self.periods)

    @property
    def stall(self) -> float:
        return median(self.stalls)

    @property
    def compute_ms(self) -> float:
        """Forward+backward of a step, about: the period less the wait for the CPU."""
        return max(self.period - self.stall, 0.0)


class TailActionKind(enum.Enum):
    KEEP = "keep"  # nothing to do this step
    GROW = "grow"  # move host buckets worth `need_ms` of CPU time to the GPU, as a trial
    UNDO = "undo"  # move the open trial's parameters back; the decision is final
    SHRINK = "shrink"  # give `numel` parameters back to the host
    FINAL = "final"  # the decision is final, for reason `why`
    SEND_HOME = "send_home"  # after the decision: send the whole tail back to the host


@dataclass(frozen=True)
class TailAction:
    """What the policy asks the mover to do.

    Attributes:
        kind: the action.
        why: the reason (FINAL, UNDO, SEND_HOME), for the log line.
        need_ms: GROW: CPU time to move (``math.inf``: everything that fits).
        on_stall: GROW: the forward's wait asked for it.
        numel: SHRINK: parameters to give back.
        judged_trial: the open trial was judged by this window (kept, unless the action is UNDO).
    """

    kind: TailActionKind
    why: str = ""
    need_ms: float = 0.0
    on_stall: bool = False
    numel: int = 0
    judged_trial: bool = False


_KEEP = TailAction(TailActionKind.KEEP)


def decide(w: TailWindow) -> TailAction:
    """The auto tail's next action from window ``w``. See Note [Tail growth trial].

    Args:
        w: the measurements and the policy's earlier decisions.
    """
    if w.stage is not TailStage.SEARCHING:
        if w.stage is TailStage.FINAL and w.device_numel and w.retries > w.retries_seen:
            return TailAction(TailActionKind.SEND_HOME,
                              why=f"the caching allocator had to free its cache {w.retries - w.retries_seen} "
                                  f"time(s) with {w.device_numel:,} parameters in the GPU tail")
        return _KEEP
    if w.steps < FIRST_CHECK or len(w.periods) < WINDOW:
        return _KEEP
    period, stall = w.period, w.stall
    judged = w.trial is not None
    if w.trial is not None:
        t = w.trial
        limit = 1.0 + TRIAL_NOISE if t.on_stall else 1.0 - TRIAL_MIN_GAIN
        slower = period > limit * t.period
        if w.retries > t.retries or slower:
            why = (f"the allocator had to free its cache {w.retries - t.retries} time(s)" if not slower
                   else f"the step took {period:.0f} ms instead of {t.period:.0f} ms")
            return TailAction(TailActionKind.UNDO, judged_trial=True,
                              why=f"growing it by {t.numel:,} parameters was undone: {why}; the tail stops there")
    gained = w.gained or judged
    if w.steps > LAST_CHECK:
        return TailAction(TailActionKind.FINAL, why="settled", judged_trial=judged)
    if not w.host_numel and gained:
        return TailAction(TailActionKind.FINAL, judged_trial=judged,
                          why="all of the state fits on the GPU and the step was faster with it there")
    if not w.all_in_tried and w.host_numel and not w.blocked and w.all_fits:
        # Everything left on the host fits beside a step's peak: try the GPU-only end point once, stall or not.
        return TailAction(TailActionKind.GROW, need_ms=math.inf, judged_trial=judged)
    stalled = stall > STALL_SHARE * period
    # After a growth that paid, the step may still wait for the copies back (a GPU-side wait the host-side
    # stall does not see): probe a further share of the host's CPU work, kept only if it pays again.
    probe = not stalled and gained and w.device_numel > 0
    if (stalled or probe) and w.host_numel and not w.blocked:
        return TailAction(TailActionKind.GROW, need_ms=GROW_SHARE * stall if stalled else PROBE_SHARE * w.cpu_ms,
                          on_stall=stalled, judged_trial=judged)
    if len(w.slacks) == 2 and min(w.slacks) > SLACK_SHARE * period and w.device_numel:
        # The CPU finished well before the forward needed its work: give some parameters back to the host.
        if w.cpu_ms <= 0:
            return TailAction(TailActionKind.KEEP, judged_trial=judged)
        return TailAction(TailActionKind.SHRINK, numel=int(0.5 * min(w.slacks) * w.host_numel / w.cpu_ms),
                          judged_trial=judged)
    why = ("the CPU update hides under forward+backward" if not w.device_numel
           else "the forward no longer waits for the CPU")
    return TailAction(TailActionKind.FINAL, why=why, judged_trial=judged)


@dataclass
class StepTimes:
    """The training thread's timings of recent steps, the auto tail's measurements.

    Attributes:
        periods: time between the ends of consecutive ``step()`` calls (ms).
        stalls: per step, how long the forward (or ``step()`` without hooks) waited for the CPU (ms).
        slacks: per step, how long the first bucket the next forward needed had been ready (negative: how long
            the forward waited for it), or ``None``.
        stall_ms: the waits of the step in progress so far.
        slack_ms: the slack of the step in progress, once measured.
        first_measured: the step in progress already measured its first needed bucket.
        last_step_t: when the last ``step()`` ended (``perf_counter``), or ``None`` (not measured: after a move).
    """

    periods: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    slacks: list[float | None] = field(default_factory=list)
    stall_ms: float = 0.0
    slack_ms: float | None = None
    first_measured: bool = False
    last_step_t: float | None = None

    def claim_first(self) -> bool:
        """``True`` once per step: for the first bucket of the last step that the next forward needs (the critical
        one, whose slack or wait sizes the tail)."""
        if self.first_measured:
            return False
        self.first_measured = True
        return True

    def end_step(self, now: float) -> None:
        """Record the step that ends at ``now`` and start measuring the next."""
        if self.last_step_t is not None:
            self.periods.append((now - self.last_step_t) * 1e3)
            self.stalls.append(self.stall_ms)
            self.slacks.append(self.slack_ms)
        self.last_step_t = now
        self.stall_ms = 0.0
        self.slack_ms = None
        self.first_measured = False

    def forget(self) -> None:
        """Forget what was measured before a move of state; the step after it pays one-time costs (new
        allocations), so measuring starts from the step after it."""
        self.periods.clear()
        self.stalls.clear()
        self.slacks.clear()
        self.last_step_t = None


@dataclass(frozen=True)
class ShardCandidate:
    """A host bucket that may move to the sharded GPU tail of a run over several ranks.

    Attributes:
        index: the bucket's index (the same on every rank).
        owner: the rank holding its state.
        numel: its parameters.
        own_bytes: GPU bytes it costs its owner in the tail (state and gradient).
        remote_bytes: GPU bytes it costs every other rank (the gradient, held until ``step()``).
    """

    index: int
    owner: int
    numel: int
    own_bytes: int
    remote_bytes: int


def sharded_tail(candidates: list[ShardCandidate], ranks: int, room: int, max_share: float | None) -> list[int]:
    """The buckets of a sharded GPU tail: each rank's own buckets, those the forward needs first (the highest
    indices: buckets are laid out in reverse parameter order) before the rest, taken one at a time from the rank
    whose own share on the GPU is the smallest so far, while every rank's GPU bytes stay within ``room`` (the least
    any rank has) and no rank moves more than ``max_share`` of its own parameters (``None``: no cap). A pure
    function of values every rank holds, so every rank decides the same. Returns the chosen indices, sorted.

    Example::

        >>> c = [ShardCandidate(i, i // 2, 10, 140, 20) for i in range(4)]  # rank 0 owns buckets 0-1, rank 1 owns 2-3
        >>> sharded_tail(c, 2, 300, None), sharded_tail(c, 2, 1000, 0.5), sharded_tail(c, 2, 100, None)
        ([0, 1, 3], [1, 3], [])
    """
    owned = [0] * ranks
    queues: list[list[ShardCandidate]] = [[] for _ in range(ranks)]
    for c in sorted(candidates, key=lambda c: -c.index):
        owned[c.owner] += c.numel
        queues[c.owner].append(c)
    used, taken, chosen = [0] * ranks, [0] * ranks, []
    open_ranks = {r for r in range(ranks) if queues[r]}
    while open_ranks:
        r = min(open_ranks, key=lambda q: (taken[q] / owned[q], q))
        c = queues[r][0]
        after = [u + (c.own_bytes if q == r else c.remote_bytes) for q, u in enumerate(used)]
        if max(after) > room or (max_share is not None and taken[r] + c.numel > max_share * owned[r]):
            open_ranks.discard(r)
            continue
        used, taken[r] = after, taken[r] + c.numel
        chosen.append(c.index)
        queues[r].pop(0)
        if not queues[r]:
            open_ranks.discard(r)
    return sorted(chosen)
