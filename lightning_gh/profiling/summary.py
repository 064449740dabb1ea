"""Where the time went: :func:`summarize_trace` reads one Kineto trace and writes JSON, Markdown and a PNG.

The public entry point of the trace summary. The work is split by idea: :mod:`~lightning_gh.profiling.trace`
parses, :mod:`~lightning_gh.profiling.analysis` computes the numbers (definitions there),
:mod:`~lightning_gh.profiling.advice` turns them into a verdict and advice (and holds the one definition of a data
stall, shared with :class:`~lightning_gh.profiling.DataStallDetector`), :mod:`~lightning_gh.profiling.render`
writes the files. Works on any Kineto trace, not only the ones :class:`~lightning_gh.profiling.SelectiveProfiler`
writes, and without torch or Lightning installed in the process.

Example::

    >>> from lightning_gh.profiling import summarize_trace
    >>> s = summarize_trace("profiles/steps10-14/rank0_steps10-14.pt.trace.json.gz")  # doctest: +SKIP
    >>> s["verdict"]["bound"], s["top_kernels"][0]["name"]  # doctest: +SKIP
    ('compute-bound', 'nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN')
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from lightning_gh.profiling.advice import (
    BOUNDS,
    DATA_WAIT_BOUND,
    IDLE_BOUND,
    TENSOR_CORE_BOUND,
    BoundFacts,
    decide,
    stall_advice,
    verdict,
)
from lightning_gh.profiling.analysis import PHASES, analyze, kernel_kind
from lightning_gh.profiling.render import render_markdown, summary_paths, write_summary
from lightning_gh.profiling.trace import KinetoTrace, load_trace

__all__ = [
    "summarize",
    "summarize_trace",
    "render_markdown",
    "write_summary",
    "kernel_kind",
    "summary_paths",
    "IDLE_BOUND",
    "TENSOR_CORE_BOUND",
    "DATA_WAIT_BOUND",
    "PHASES",
    "stall_advice",
    "BOUNDS",
    "BoundFacts",
    "decide",
]


def summarize(trace: KinetoTrace, top: int = 10, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Analyse a parsed trace and judge it; returns a JSON-ready dict (the schema ``summary.json`` holds).

    Args:
        trace: from :func:`~lightning_gh.profiling.trace.load_trace`.
        top: how many kernels and host operators to list.
        context: optional facts about the run the trace cannot know (``"loader"``: the DataLoader settings from
            :func:`lightning_gh.profiling.stall.loader_info`, used for concrete advice; ``"link"``: the host
            link's measured ``{"h2d_gbps": ..., "d2h_gbps": ...}``, which the link's achieved rate is set against).
    """
    out = analyze(trace, top=top, context=context)
    out["verdict"] = verdict(out, context)
    return out


def summarize_trace(path: str | os.PathLike, out_dir: str | os.PathLike | None = None, *, top: int = 10,
                    plot: bool = True, write: bool = True, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read a Kineto trace, analyse it and (``write=True``) write ``<stem>.summary.{json,md,png}`` next to it.

    Args:
        path: a ``.json`` or ``.json.gz`` Kineto trace (any producer).
        out_dir: where to write the files (default: next to the trace).
        top: kernels and host operators listed.
        plot: also write the PNG.
        write: write files at all (``False`` only returns the dict).
        context: facts about the run for advice (see :func:`summarize`).

    Returns:
        The summary dict; with ``write=True`` its ``"files"`` key maps ``json``/``md``/``png`` to the paths.
    """
    summary = summarize(load_trace(path), top=top, context=context)
    if write:
        files = write_summary(summary, summary_paths(path, out_dir), plot=plot)
        summary["files"] = {k: str(v) for k, v in files.items()}
    return summary
