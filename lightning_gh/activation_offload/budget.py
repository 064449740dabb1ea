"""Activation memory by budget: the user names the memory, the planner picks per block how to reach it.

``ActivationOffload(budget="6GiB")`` (or ``budget=0.5``, half of what the plain step needs: the same step with no
engine effect at all, which the engine measures) replaces the choice of a technique. The engine measures, in its
first steps, each transformer block under every way of saving memory it implements, and this module turns those
measurements into a plan:

* **keep**: the block keeps what it saves (costs nothing);
* **offload**: the engine copies what the block saves to host memory (all of it or a quarter, half, three
  quarters); free while the link hides the copies under compute, then the step waits on the link;
* **norm-act** recompute: the block's norms and gated activations are recomputed in the backward;
* **selective** recompute: all but the matmul and attention outputs are recomputed;
* **full** recompute (checkpointing): only the block's inputs are kept, its forward runs again;
* a recompute mode **and** offload of what the block then still saves (the floor: full checkpointing whose
  inputs go to the host).

Each option of each block has a measured cost: the extra milliseconds of its recompute (forward and backward of
the block, measured with the mode on against the plain step) and, for offload, the stall the timeline model of
:func:`~lightning_gh.activation_offload.policy.simulate` predicts for the link. The planner is a greedy knapsack
over those options, by milliseconds per byte of peak memory saved, followed by a pass that gives back memory it did
not need where that saves time. Memory is predicted as the saved-activation peak of the timeline model (what a
recomputing block re-creates during its own backward included) plus an **overhead**: what the plain step
measured above that model (temporaries, gradients of the logits, allocator rounding). The engine then measures the
real peak of the planned step, corrects the overhead and plans again (at most two rounds).

What "activation memory" means here: the step's peak allocation (``torch.cuda.max_memory_allocated`` over forward
and backward) minus the model state (the weights, their gradients at full size and the optimizer state). A budget
of ``B`` therefore bounds the step's peak at ``model state + B``. On a CPU (``backend="host-copy"``, tests) the
engine counts the saved bytes it tracks instead.

Example::

    >>> parse_budget("6GiB").bytes == 6 * 2**30
    True
    >>> parse_budget(0.5).fraction
    0.5
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping

from lightning_gh._util import fmt_bytes
from lightning_gh.activation_offload.policy import BlockProfile, OffloadPlan, StepProfile, _schedule, simulate

__all__ = ["Budget", "BudgetForecast", "BudgetProfile", "ModeCost", "OPTIONS_MODES", "compiler_budget", "evaluate",
           "parse_budget", "plan_budget", "plan_floor"]

GIB = 2**30
OPTIONS_MODES: tuple[str | None, ...] = (None, "norm-act", "selective", "full")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30}
_FORMS = ("a size string ('6GiB', '512MiB', '6GB'), an int number of bytes > 0, or a float in (0, 1]: a fraction "
          "of the activation memory the plain step measures")


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``bytes`` and ``fraction`` is set."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, activation_bytes: int) -> int:
        """The budget in bytes, given the plain step's measured activation memory."""
        return self.bytes if self.bytes is not None else int(self.fraction * activation_bytes)

    def describe(self) -> str:
        if self.bytes is not None:
            return f"{self.bytes / GIB:.2f} GiB"
        return f"{self.fraction:.0%} of the plain step's activation memory"


def parse_budget(value: str | int | float | Budget) -> Budget:
    """Parse ``ActivationOffload(budget=...)``.

    Args:
        value: ``"6GiB"`` / ``"512MiB"`` / ``"6GB"`` / ``"1.5 GiB"`` (binary or decimal units, case-insensitive);
            an int of bytes; a float in ``(0, 1]``, a fraction of the plain step's activation memory.

    Raises:
        ValueError: naming the value and the accepted forms.

    Example::

        >>> parse_budget("512MiB").bytes
        536870912
    """
    if isinstance(value, Budget):
        return value
    bad = ValueError(f"budget={value!r} is not valid; use {_FORMS}.")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value <= 0:
            raise bad
        return Budget(bytes=value)
    if isinstance(value, float):
        if not (0.0 < value <= 1.0) or math.isnan(value):
            raise ValueError(f"budget={value!r} is not valid: a float budget is a fraction of the plain step's "
                             f"activation memory and must be in (0, 1]; for a size use a string such as "
                             f"'{value:g}GiB' or an int of bytes."
                             if math.isfinite(value) and value > 0 else
                             f"budget={value!r} is not valid: a float budget is a fraction of the plain step's "
                             f"activation memory and must be in (0, 1]; for a size use a string such as '24GiB' or "
                             f"an int of bytes.")
        return Budget(fraction=float(value))
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise bad
        nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if nbytes <= 0:
            raise bad
        return Budget(bytes=nbytes)
    raise bad


@dataclass(frozen=True)
class ModeCost:
    """One way of running one block, measured.

    Args:
        kept_bytes: saved bytes the block holds on the device from its forward to its backward under this mode.
        offloadable_bytes: of those, the bytes the engine may move to the host.
        extra_ms: step time added against keeping everything (the recompute, in the block's backward).
    """

    kept_bytes: int
    offloadable_bytes: int
    extra_ms: float = 0.0


@dataclass(frozen=True)
class BudgetProfile:
    """What the planner plans from.

    Args:
        step: the plain step (per-block times and saved bytes), as ``plan_auto`` measures it.
        costs: per block, mode -> :class:`ModeCost`; ``None`` (keep) is filled from ``step`` when missing.
        overhead_bytes: measured activation memory above the timeline model's saved-activation peak (0 on a CPU).
    """

    step: StepProfile
    costs: tuple[Mapping[str | None, ModeCost], ...]
    overhead_bytes: int = 0

    def __post_init__(self) -> None:
        if len(self.costs) != self.step.n_blocks:
            raise ValueError(f"BudgetProfile.costs has {len(self.costs)} blocks, the step {self.step.n_blocks}.")
        full = []
        for b, c in zip(self.step.blocks, self.costs):
            c = dict(c)
            c.setdefault(None, ModeCost(b.saved_bytes, b.offloadable_bytes, 0.0))
            full.append(c)
        object.__setattr__(self, "costs", tuple(full))

    def with_overhead(self, overhead_bytes: int) -> BudgetProfile:
        return replace(self, overhead_bytes=int(overhead_bytes))

    def describe_block(self, i: int = 0) -> str:
        """Block ``i``'s measured options, for the plan's log line: its plain forward+backward time, then per mode
        what it keeps on the device, of that what may be offloaded, and the time it adds."""
        b = self.step.blocks[i]
        out = [f"plain {b.forward_ms + b.backward_ms:.1f} ms"]
        for mode in OPTIONS_MODES:
            c = self.costs[i].get(mode)
            if c is not None:
                out.append(f"{mode or 'keep'} {fmt_bytes(c.kept_bytes)} ({fmt_bytes(c.offloadable_bytes)} "
                           f"offloadable) +{c.extra_ms:.1f} ms")
        return "; ".join(out)


@dataclass(frozen=True)
class BudgetForecast:
    """What a budget plan is expected to do: the activation memory (model peak + overhead) and the step time."""

    activation_bytes: int
    step_ms: float
    plain_step_ms: float
    stall_ms: float
    recompute_ms: float
    choices: tuple[tuple[str | None, float], ...] = field(default=())

    @property
    def ratio(self) -> float:
        return self.step_ms / self.plain_step_ms if self.plain_step_ms else float("nan")

    def describe_choices(self) -> str:
        """``"0-3 full+offload 100%, 4-6 selective, 7 keep"``."""
        parts: list[str] = []
        for i, (mode, frac) in enumerate(self.choices):
            label = (mode or ("offload" if frac else "keep")) + \
                (f"+offload {frac:.0%}" if frac and mode else (f" {frac:.0%}" if frac else ""))
            if parts and parts[-1][1] == label:
                parts[-1] = (parts[-1][0] + [i], label)
            else:
                parts.append(([i], label))
        out = []
        for idx, label in parts:
            out.append(f"{idx[0]}{'' if len(idx) == 1 else f'-{idx[-1]}'} {label}")
        return ", ".join(out)


# ----------------------------------------------------------------------------------------------- planning


def _fracs(n_blocks: int) -> tuple[float, ...]:
    # Quarters give the last ~3% of a budget on 8 blocks; halves keep the search quick on deep models.
    return (0.0, 0.25, 0.5, 0.75, 1.0) if n_blocks <= 16 else (0.0, 0.5, 1.0)


def _evaluate(bp: BudgetProfile, choices: list[tuple[str | None, float]], d2h: float, h2d: float, margin: float,
              ) -> tuple[int, float, OffloadPlan, BudgetForecast]:
    step = bp.step
    n = step.n_blocks
    blocks, budgets, transient, extra = [], [], [], 0.0
    for i, (mode, frac) in enumerate(choices):
        b, c = step.blocks[i], bp.costs[i][mode]
        kept = min(c.kept_bytes, b.saved_bytes) if mode else c.kept_bytes
        offl = min(c.offloadable_bytes, kept)
        blocks.append(BlockProfile(b.forward_ms, b.backward_ms + c.extra_ms, offl, kept - offl))
        budgets.append(0 if frac <= 0 or offl == 0 else (None if frac >= 1 else max(1, int(offl * frac))))
        transient.append(max(b.saved_bytes - kept, 0) if mode else 0)
        extra += c.extra_ms
    prof = replace(step, blocks=tuple(blocks))
    bt = tuple(budgets)
    release, prefetch, _ = _schedule(prof, bt, d2h, h2d, margin)
    # Memory first: an offloaded block's memory must come free before the forward's end (the peak) and come back
    # no earlier than two blocks ahead of its backward; the timeline model charges any stall this causes.
    release = tuple(min(r, n) if bt[i] != 0 else r for i, r in enumerate(release))
    prefetch = tuple(min(p, i + 2, n) if bt[i] != 0 else p for i, p in enumerate(prefetch))
    pred = simulate(prof, bt, release, prefetch, d2h, h2d, margin, tuple(transient))
    plain_ms = step.forward_ms + step.backward_ms
    ms = plain_ms + extra + pred.stall_ms
    act = pred.peak_bytes + bp.overhead_bytes
    modes = tuple(m for m, _ in choices)
    plan = OffloadPlan("budget", bt, release, prefetch, pred, modes=modes if any(modes) else ())
    return act, ms, plan, BudgetForecast(act, ms, plain_ms, pred.stall_ms, extra, tuple(choices))


def evaluate(bp: BudgetProfile, choices: list[tuple[str | None, float]], d2h_gbps: float, h2d_gbps: float,
             margin: float = 0.25) -> tuple[OffloadPlan, BudgetForecast]:
    """The plan and forecast of one mix: per block, its mode and the share of what it still saves offloaded."""
    return _evaluate(bp, list(choices), d2h_gbps, h2d_gbps, margin)[2:]


def _options(bp: BudgetProfile, i: int, eligible: int) -> list[tuple[str | None, float]]:
    out = []
    for mode in OPTIONS_MODES:
        c = bp.costs[i].get(mode)
        if c is None:
            continue
        fracs = _fracs(bp.step.n_blocks) if i < eligible and c.offloadable_bytes > 0 else (0.0,)
        out += [(mode, f) for f in fracs]
    return out


def plan_floor(bp: BudgetProfile, d2h_gbps: float, h2d_gbps: float, margin: float = 0.0,
               skip_last_blocks: int = 1) -> BudgetForecast:
    """The least activation memory the measured options reach: every block at its smallest kept bytes
    (full recompute where measured), everything it still saves offloaded (but the last ``skip_last_blocks``).

    Example::

        floor = plan_floor(profile, 55.0, 55.0)
        print(f"{floor.activation_bytes / 2**30:.2f} GiB at {floor.ratio:.2f}x")
    """
    n = bp.step.n_blocks
    eligible = max(0, n - skip_last_blocks)
    choices: list[tuple[str | None, float]] = []
    for i in range(n):
        mode = min((m for m in OPTIONS_MODES if m in bp.costs[i]), key=lambda m: bp.costs[i][m].kept_bytes)
        choices.append((mode, 1.0 if i < eligible and bp.costs[i][mode].offloadable_bytes else 0.0))
    best = _evaluate(bp, choices, d2h_gbps, h2d_gbps, margin)[3]
    # Offloading the last blocks' inputs may free nothing at the peak; the floor is the smaller of the two.
    kept_only = _evaluate(bp, [(m, 0.0) for m, _ in choices], d2h_gbps, h2d_gbps, margin)[3]
    return best if best.activation_bytes <= kept_only.activation_bytes else kept_only


def plan_budget(
    bp: BudgetProfile,
    budget_bytes: int,
    d2h_gbps: float,
    h2d_gbps: float,
    margin: float = 0.25,
    skip_last_blocks: int = 1,
    offload_last: bool = False,
) -> tuple[OffloadPlan, BudgetForecast]:
    """The per-block mix of keep / offload / recompute whose predicted activation memory fits ``budget_bytes`` at
    the lowest predicted step time (with ``offload_last``, the mix without offload where one fits).

    Greedy: from "keep everything", repeatedly take the option (one block's mode and offload share) with the
    fewest predicted milliseconds per byte of predicted peak saved, until the prediction fits; then, while some
    block can switch to a faster option and still fit, switch the one that saves the most time.

    Args:
        bp: the measurements (:class:`BudgetProfile`).
        budget_bytes: activation memory to fit in (see the module doc).
        d2h_gbps / h2d_gbps: link bandwidth each way (GB/s); a forecast for another link takes its figure here.
        margin: transfer times are counted ``1 + margin`` times.
        skip_last_blocks: blocks at the end never offloaded.
        offload_last: plan with no block offloaded first, and offload only where that does not fit.

    Raises:
        ValueError: the budget is below what full recompute plus offload reaches (the floor, named in GiB).

    Example::

        plan, forecast = plan_budget(profile, 6 * 2**30, 55.0, 55.0)
        print(plan.describe(), forecast.ratio)
    """
    n = bp.step.n_blocks
    if offload_last and skip_last_blocks < n:
        try:
            return plan_budget(bp, budget_bytes, d2h_gbps, h2d_gbps, margin, n)
        except ValueError:  # below what recomputing alone reaches: the least offload that fits
            floor = plan_floor(bp, d2h_gbps, h2d_gbps, margin, skip_last_blocks)
            if floor.activation_bytes <= budget_bytes:
                return _least_offload(bp, list(floor.choices), budget_bytes,
                                      lambda ch: _evaluate(bp, ch, d2h_gbps, h2d_gbps, margin))
    eligible = max(0, n - skip_last_blocks)
    choices: list[tuple[str | None, float]] = [(None, 0.0)] * n
    act, ms, plan, fc = _evaluate(bp, choices, d2h_gbps, h2d_gbps, margin)
    if act <= budget_bytes:
        return plan, fc
    floor = plan_floor(bp, d2h_gbps, h2d_gbps, margin, skip_last_blocks)
    if floor.activation_bytes > budget_bytes:
        raise ValueError(
            f"budget={fmt_bytes(budget_bytes)} of activation memory is below the floor of full recompute"
            f"{' plus offload' if eligible else ' (nothing offloaded)'}, {fmt_bytes(floor.activation_bytes)} measured "
            "on this model and batch (the plain step needs "
            f"{fmt_bytes(act)}). Raise the budget to at least {fmt_bytes(floor.activation_bytes)}, or shrink "
            "the batch or sequence.")
    opts = [_options(bp, i, eligible) for i in range(n)]
    kept_sum = lambda ch: sum(bp.costs[i][m].kept_bytes * (1 - f) for i, (m, f) in enumerate(ch))  # noqa: E731

    def neighbours(ch: list[tuple[str | None, float]]) -> Iterator[tuple[list[tuple[str | None, float]], Any]]:
        """Every mix that moves one block of ``ch`` to another of its options, with its evaluation."""
        for i in range(n):
            for opt in opts[i]:
                if opt != ch[i]:
                    cand = ch[:i] + [opt] + ch[i + 1:]
                    yield cand, _evaluate(bp, cand, d2h_gbps, h2d_gbps, margin)

    climbed = None
    if budget_bytes - floor.activation_bytes < act - budget_bytes:
        # Nearer the floor than the plain step: climb from the floor (few moves); descending from keeping everything
        # takes many, each of which may leave the peak where it was, and may end on the floor's mix. Also from the
        # floor's modes with nothing offloaded, where that fits: a climb moves one block at a time, and from the
        # floor the link is already busy, so a block that would offload more only pays once another stops
        # offloading. On up to CLIMB_ONLY_ABOVE blocks the descent runs too and the faster plan wins; beyond, its
        # cost (a pass over every block's options per move, for many moves) is the climb's alone.
        starts = [list(floor.choices), [(m, 0.0) for m, _ in floor.choices]]
        climbed = _climb_from_floor(starts, budget_bytes, neighbours,
                                    lambda ch: _evaluate(bp, ch, d2h_gbps, h2d_gbps, margin), len(opts) * 4)
        if n > CLIMB_ONLY_ABOVE:
            return climbed
    # Each step takes one block to another of its options; a bound on the steps keeps a plateau (moves that only
    # shift the peak) from spinning: every block can walk through each of its options once.
    for _ in range(sum(len(o) for o in opts)):
        if act <= budget_bytes:
            break
        best = None
        for cand, (a, t, p, f) in neighbours(choices):
            dmem = act - a
            if dmem <= 0:
                # No change at the peak: still worth it if it lowers what the blocks keep (the peak may move).
                dmem = (kept_sum(choices) - kept_sum(cand)) * 1e-3
                if dmem <= 0:
                    continue
            score = (max(t - ms, 0.0) + 1e-9) / dmem
            if best is None or score < best[0]:
                best = (score, cand, a, t, p, f)
        if best is None:
            break
        _, choices, act, ms, plan, fc = best
    # Give back: a faster option for one block that still fits.
    for _ in range(4 * n):
        best = None
        for cand, (a, t, p, f) in neighbours(choices):
            # Faster, or as fast and closer to the budget (less traffic and recompute for nothing).
            better = t < ms - 1e-6 or (t <= ms + 1e-6 and a > act)
            if a <= budget_bytes and better and (best is None or (t, -a) < (best[3], -best[2])):
                best = (None, cand, a, t, p, f)
        if best is None:
            break
        _, choices, act, ms, plan, fc = best
    if act > budget_bytes:  # the floor said it fits; the greedy path did not get there: take the floor's mix
        floor_choices = list(floor.choices)
        act, ms, plan, fc = _evaluate(bp, floor_choices, d2h_gbps, h2d_gbps, margin)
    if climbed is not None and climbed[1].step_ms < fc.step_ms:
        return climbed
    return plan, fc


def _least_offload(
    bp: BudgetProfile,
    choices: list[tuple[str | None, float]],
    budget_bytes: int,
    evaluate: Callable[[list[tuple[str | None, float]]], tuple[int, float, OffloadPlan, BudgetForecast]],
) -> tuple[OffloadPlan, BudgetForecast]:
    """From the floor (``choices``, which fits), lower one block's offloaded share at a time, the move that keeps
    the most bytes off the link first (the faster on a tie), while the mix still fits: :func:`plan_budget`'s
    ``offload_last`` plan below what recomputing alone reaches."""
    fracs = _fracs(bp.step.n_blocks)
    offl = [min(bp.costs[i][m].offloadable_bytes, bp.costs[i][m].kept_bytes) for i, (m, _) in enumerate(choices)]
    _, _, plan, fc = evaluate(choices)
    while True:
        best = None
        for i, (mode, f) in enumerate(choices):
            lower = [g for g in fracs if g < f]
            if not lower:
                continue
            cand = choices[:i] + [(mode, lower[-1])] + choices[i + 1:]
            a, t, p, c = evaluate(cand)
            key = (-(f - lower[-1]) * offl[i], t)
            if a <= budget_bytes and (best is None or key < best[0]):
                best = (key, cand, p, c)
        if best is None:
            return plan, fc
        _, choices, plan, fc = best


#: Blocks above which a budget nearer the floor than the plain step is planned by the climb from the floor alone.
CLIMB_ONLY_ABOVE = 16


def _climb_from_floor(
    starts: list[list[tuple[str | None, float]]],
    budget_bytes: int,
    neighbours: Callable[[list[tuple[str | None, float]]], Iterator[tuple[list[tuple[str | None, float]], Any]]],
    evaluate: Callable[[list[tuple[str | None, float]]], tuple[int, float, OffloadPlan, BudgetForecast]],
    max_moves: int,
) -> tuple[OffloadPlan, BudgetForecast]:
    """:func:`plan_budget` from the floor up: from each start that fits, repeatedly take the one-block move that
    saves the most predicted milliseconds per byte of predicted peak it adds (a move adding nothing first), or in a
    second climb the most milliseconds, and still fits, until none is faster; the fastest end wins. The first start
    (the floor) fits, as the caller checked."""
    results = []
    for choices, per_byte in [(c, b) for c in starts for b in (True, False)]:
        act, ms, plan, fc = evaluate(choices)
        if act > budget_bytes:
            continue
        for _ in range(max_moves):
            best = None
            for cand, (a, t, p, f) in neighbours(choices):
                if a > budget_bytes or t >= ms - 1e-6:
                    continue
                score = (ms - t) / max(a - act, 1) if per_byte else (ms - t, -a)
                if best is None or score > best[0]:
                    best = (score, cand, a, t, p, f)
            if best is None:
                break
            _, choices, act, ms, plan, fc = best
        results.append((ms, plan, fc))
    _, plan, fc = min(results, key=lambda r: r[0])
    return plan, fc


def lean_profile(bp: BudgetProfile, lean_step: StepProfile, other_bytes: int, act_peak: int | None,
                 alone_ms: float | None, d2h_gbps: float, h2d_gbps: float, margin: float, skip_last_blocks: int,
                 ) -> tuple[BudgetProfile, dict[str, float]]:
    """``bp`` with the lean loss's head, from the lean loss's measuring step (``lean_step``, what it saved outside
    the blocks, its measured peak): the head's time, and the overhead the peak shows above the timeline model; with
    what was measured, for the log.

    Only the head differs from the plain step. Its extra time is signed (the fused kernels are faster than Hugging
    Face's loss, the row chunks slower) and charged to the tail; ``alone_ms``, the head timed alone on the logits'
    shape (CUDA), replaces the single step's reading, which is too noisy for it.
    """
    step = bp.step
    step_extra = max(0.0, lean_step.tail_forward_ms + lean_step.tail_backward_ms - step.tail_forward_ms
                     - step.tail_backward_ms)
    extra = step_extra if alone_ms is None else alone_ms
    lstep = replace(step, tail_backward_ms=max(0.0, step.tail_backward_ms + extra), other_bytes=other_bytes)
    lbp = BudgetProfile(lstep, bp.costs, 0)
    model = plan_budget(lbp, 2**62, d2h_gbps, h2d_gbps, margin, skip_last_blocks)[1].activation_bytes
    act = act_peak if act_peak is not None else model
    measured = {"activation_gib": act / 2**30, "head_extra_ms": extra, "head_extra_in_step_ms": step_extra,
                "other_gib": other_bytes / 2**30}
    return lbp.with_overhead(act - model), measured


# ------------------------------------------------------------------------------------------ compiled models


def compiler_budget(fraction: float, overhead_fraction: float = 0.0) -> float:
    """The value for ``torch._functorch.config.activation_memory_budget`` that aims at ``fraction`` of the
    compiled step's activation memory.

    The compiler's knob is a fraction of what its partitioner saves between forward and backward; the step's
    activation memory also holds what the knob does not touch (``overhead_fraction`` of it: the logits and
    their gradient, temporaries), so the knob must go lower than the fraction: ``(fraction - o) / (1 - o)``,
    clamped to ``[0, 1]``. With no measurement (``o = 0``) it is the fraction itself.

    Example::

        >>> compiler_budget(0.5)
        0.5
        >>> round(compiler_budget(0.5, overhead_fraction=0.2), 3)
        0.375
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction!r} must be in (0, 1].")
    if not 0.0 <= overhead_fraction < 1.0:
        raise ValueError(f"overhead_fraction={overhead_fraction!r} must be in [0, 1).")
    if fraction >= 1.0:
        return 1.0
    return min(1.0, max(0.0, (fraction - overhead_fraction) / (1.0 - overhead_fraction)))

