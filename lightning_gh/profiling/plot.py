"""The summary's picture: per-step stacked bars of where the time went, and the top kernels.

With GPU activity the bars are compute / communication / copies / idle (the exclusive split of
:mod:`lightning_gh.profiling.analysis`; idle time the GPU spent waiting for a CPU optimizer update is its own bar) and the right panel ranks kernels by share of kernel time. A CPU-only trace
shows the host phases per step and the top host operators instead.

Example::

    >>> from lightning_gh.profiling.plot import plot_summary
    >>> plot_summary(summary_dict, "rank0_steps10-14.summary.png")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["plot_summary"]

_GPU_PARTS = (("compute_ms", "compute", "#4C72B0"), ("comm_ms", "communication", "#DD8452"),
              ("copy_ms", "copies/memsets", "#55A868"), ("cpu_update_idle_ms", "idle: CPU update", "#C44E52"),
              ("idle_ms", "GPU idle", "#C8C8C8"))
_PHASE_COLORS = {"data_wait": "#C44E52", "forward": "#4C72B0", "backward": "#8172B3", "optimizer": "#55A868",
                 "validation": "#CCB974", "other": "#C8C8C8"}


def _label(name: str, n: int = 48) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def plot_summary(summary: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Draw ``summary`` (from :func:`~lightning_gh.profiling.summary.summarize`) into a PNG at ``path``."""
    # A Figure of its own, not pyplot: drawing a file must not switch the backend of the user's notebook or session.
    from matplotlib.figure import Figure

    path = Path(path)
    steps = summary["steps"]
    labels = [str(r["step"]) if r["step"] is not None else "all" for r in steps]
    x = list(range(len(steps)))
    fig = Figure(figsize=(13, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.25]})

    bottom = [0.0] * len(steps)
    if summary.get("gpu") is not None:
        for key, label, color in _GPU_PARTS:
            if key == "cpu_update_idle_ms" and not any(r.get(key) for r in steps):
                continue
            if key == "idle_ms":  # the rest of the idle time
                vals = [r[key] - r.get("cpu_update_idle_ms", 0.0) for r in steps]
            else:
                vals = [r.get(key, 0.0) for r in steps]
            left.bar(x, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        left.set_title("per step: GPU compute / communication / copies / idle")
    elif summary.get("phases"):
        names = [p for p in summary["phases"] if p != "other"]
        for p in names + ["other"]:
            if p == "other":
                vals = [max(r["time_ms"] - sum(r["phases_ms"].get(q, 0.0) for q in names), 0.0) for r in steps]
            else:
                vals = [r["phases_ms"].get(p, 0.0) for r in steps]
            left.bar(x, vals, bottom=bottom, label=p, color=_PHASE_COLORS.get(p))
            bottom = [b + v for b, v in zip(bottom, vals)]
        left.set_title("per step: host phases (no GPU activity in the trace)")
    else:
        left.bar(x, [r["time_ms"] for r in steps], color="#4C72B0", label="step time")
        left.set_title("per step: step time")
    left.set_xticks(x, labels)
    left.set_xlabel("optimizer step" if any(r["step"] is not None for r in steps) else "span")
    left.set_ylabel("ms")
    if steps:
        left.set_ylim(0, 1.3 * max(max(bottom), max(r["time_ms"] for r in steps), 1e-9))
    left.legend(fontsize=8, loc="upper right", ncol=3)
    left.grid(axis="y", alpha=0.3)

    if summary.get("top_kernels"):
        rows = summary["top_kernels"][:10]
        right.barh(range(len(rows)), [100 * r["share"] for r in rows], color="#4C72B0")
        right.set_yticks(range(len(rows)), [f"{_label(r['name'])} ({r['kind']}, {r['count']}x)" for r in rows],
                         fontsize=7)
        right.set_xlabel("% of GPU kernel time")
        right.set_title("top kernels")
    elif summary.get("top_cpu_ops"):
        rows = summary["top_cpu_ops"][:10]
        right.barh(range(len(rows)), [100 * r["share"] for r in rows], color="#8172B3")
        right.set_yticks(range(len(rows)), [f"{_label(r['name'])} ({r['calls']}x)" for r in rows], fontsize=7)
        right.set_xlabel("% of the window (self time)")
        right.set_title("top host operators")
    else:
        right.text(0.5, 0.5, "no kernels or operators in the trace", ha="center", va="center")
        right.set_axis_off()
    if right.has_data():
        right.invert_yaxis()
        right.grid(axis="x", alpha=0.3)
    verdict = summary.get("verdict", {}).get("bound", "")
    title = Path(summary["trace"]).name if summary.get("trace") else "trace"
    fig.suptitle(f"{title} — {verdict}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
