"""Writing a summary: Markdown, JSON and the PNG, next to the trace or into a folder.

matplotlib is imported only when a PNG is drawn (:mod:`lightning_gh.profiling.plot`), so importing lightning_gh or
summarising without ``plot`` never loads it.

Example::

    >>> from lightning_gh.profiling.render import render_markdown, summary_paths, write_summary
    >>> write_summary(summary, summary_paths("rank0_steps10-14.pt.trace.json.gz"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from lightning_gh.profiling.advice import short_name as _short

__all__ = ["render_markdown", "summary_paths", "write_summary"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_markdown(s: Mapping[str, Any]) -> str:
    """The summary as a Markdown report (what ``summary.md`` holds)."""
    name = Path(s["trace"]).name if s.get("trace") else "trace"
    steps = s["steps"]
    nums = [r["step"] for r in steps if r["step"] is not None]
    what = (f"{len(steps)} step{'s' * (len(steps) != 1)} (ProfilerStep#{nums[0]}..#{nums[-1]})" if nums
            else "no ProfilerStep markers: the whole trace is one span")
    rank = f"rank {s['rank']} · " if s.get("rank") is not None else ""
    v = s["verdict"]
    lines = [f"# Trace summary: {name}", "",
             f"{rank}{what} · window {s['window_ms']:.3f} ms · verdict: **{v['bound']}**", "",
             "## Verdict", "", f"**{v['bound']}**. Evidence:", ""]
    lines += [f"- {e}" for e in v["evidence"]]
    if v["advice"]:
        lines += ["", "What to try:", ""] + [f"- {a}" for a in v["advice"]]
    g = s.get("gpu")
    lines += ["", "## Steps", ""]
    if g is not None:
        lines += ["| step | time ms | GPU busy | compute ms | comm ms | copies ms | idle ms | host-bound idle ms | "
                  "data wait ms |", "|---|---|---|---|---|---|---|---|---|"]
        for r in steps:
            lines.append(f"| {r['step'] if r['step'] is not None else 'all'} | {r['time_ms']:.3f} | "
                         f"{_pct(r['busy_ms'] / r['span_ms'] if r['span_ms'] else 0)} | {r['compute_ms']:.3f} | "
                         f"{r['comm_ms']:.3f} | {r['copy_ms']:.3f} | {r['idle_ms']:.3f} | "
                         f"{r['host_bound_idle_ms']:.3f} | {r['phases_ms'].get('data_wait', 0.0):.3f} |")
    else:
        phase_names = list((s.get("phases") or {}).keys())
        phase_names = [p for p in phase_names if p != "other"]
        lines += ["| step | time ms | " + " | ".join(f"{p} ms" for p in phase_names) + (" |" if phase_names else "|"),
                  "|---|---|" + "---|" * len(phase_names)]
        for r in steps:
            cells = " | ".join(f"{r['phases_ms'].get(p, 0.0):.3f}" for p in phase_names)
            lines.append(f"| {r['step'] if r['step'] is not None else 'all'} | {r['time_ms']:.3f} |"
                         + (f" {cells} |" if phase_names else ""))
    if s.get("gpu_tail_ms"):
        lines += ["", f"The GPU finished the window's work {s['gpu_tail_ms']:.3f} ms after the host ended the last "
                      "step; the GPU columns of the last step include that tail."]
    st = s.get("step_time_ms")
    if st:
        lines += ["", f"Step time: mean {st['mean']:.3f} ms, median {st['median']:.3f} ms, "
                      f"min {st['min']:.3f} ms, max {st['max']:.3f} ms."]
    if g is not None:
        w = s["window_ms"]
        lines += ["", "## GPU time (share of the window)", "", "| | ms | share |", "|---|---|---|"]
        for label, key in (("compute", "compute_share"), ("communication (not under compute)", "comm_share"),
                           ("copies / memsets (alone)", "copy_share"), ("idle", "idle_share")):
            lines.append(f"| {label} | {g[key] * w:.3f} | {_pct(g[key])} |")
        for label, key in (("idle: host-bound (waiting for launches)", "host_bound_share"),
                           ("idle: other (syncs, dependencies, latency)", "other_share"),
                           ("idle while the loop waited for data", "during_data_wait_share")):
            lines.append(f"| {label} | {g['idle'][key] * w:.3f} | {_pct(g['idle'][key])} |")
        causes = g["idle"].get("by_cause")
        if causes:
            lines += ["", "Idle time by cause (each instant once): " + ", ".join(
                f"{label} {_pct(causes[key])}" for key, label in (
                    ("data_wait", "waiting for data"), ("cpu_update", "waiting for the CPU optimizer update"),
                    ("launch", "waiting for launches"), ("other", "other"))) + "."]
        lines += ["", f"{g['kernel_count']} kernels, {g['kernel_time_ms']:.3f} ms of kernel time, "
                      f"median kernel {g['median_kernel_us']} µs."]
        lines += ["", "## Top kernels (share of kernel time)", "",
                  "| # | kernel | kind | calls | total ms | share | mean µs |",
                  "|---|---|---|---|---|---|---|"]
        for i, k in enumerate(s["top_kernels"], 1):
            lines.append(f"| {i} | `{_short(k['name'])}` | {k['kind']} | {k['count']} | {k['total_ms']:.3f} | "
                         f"{_pct(k['share'])} | {k['mean_us']:.1f} |")
        lines += ["", "Kernel kinds: " + ", ".join(f"{k} {_pct(v)}" for k, v in s["kernel_kinds"].items()) + "."]
        if s["copies"]:
            lines += ["", "## Copies and memsets", "", "| kind | count | MB | ms | GB/s | share of window |",
                      "|---|---|---|---|---|---|"]
            for k, c in s["copies"].items():
                lines.append(f"| {k} | {c['count']} | {c['bytes'] / 1e6:.3f} | {c['time_ms']:.3f} | "
                             f"{_f(c['gbps'], 1)} | {_pct(c['share'])} |")
        c = s.get("communication")
        lines += ["", "## Communication", ""]
        lines.append("No NCCL kernels in the trace." if not c else
                     f"{c['kernels']} NCCL kernels, {c['time_ms']:.3f} ms ({_pct(c['share'])} of the window); "
                     f"{_pct(c['overlapped_fraction'])} of it overlaps compute, {_pct(c['exposed_share'])} "
                     "of the window is exposed communication.")
    lines += _offload_lines(s)
    ph = s.get("phases")
    if ph:
        lines += ["", "## Phases (lgh/ ranges on the host)", "",
                  "| phase | host ms | share of window | GPU ms launched |",
                  "|---|---|---|---|"]
        for p, r in ph.items():
            lines.append(f"| {p} | {r['ms']:.3f} | {_pct(r['share'])} | {_f(r['gpu_ms'])} |")
    if s["top_cpu_ops"]:
        lines += ["", "## Top host operators (self time)", "", "| operator | calls | self ms | share of window |",
                  "|---|---|---|---|"]
        for o in s["top_cpu_ops"]:
            lines.append(f"| `{_short(o['name'])}` | {o['calls']} | {o['self_ms']:.3f} | {_pct(o['share'])} |")
    lines += ["", "Definitions: lightning_gh/profiling/analysis.py and advice.py (docs/profiling.md)."]
    return "\n".join(lines) + "\n"


def _offload_lines(s: Mapping[str, Any]) -> list[str]:
    """The CPU update, host link, activation offload and fp8 sections (only those the trace shows)."""
    cu, link, act, fp8 = (s.get(k) for k in ("cpu_update", "link", "activation_offload", "fp8"))
    if not (cu or link or act or fp8):
        return []
    lines = ["", "## Offload, host link and fp8"]
    if cu:
        under = cu["under_backward_fraction"]
        lines += ["", f"**CPU optimizer update** ({cu['source']}, on {', '.join(cu['threads'])}): "
                     f"{cu['per_step_ms']:.3f} ms per step, {_pct(cu['share'])} of the window; "
                     f"{'-' if under is None else _pct(under)} of it under backward, "
                     f"{_pct(cu['under_gpu_compute_fraction'])} while GPU kernels ran; the GPU waited for it "
                     f"{cu['exposed_ms']:.3f} ms ({_pct(cu['exposed_share'])} of the window)."]
    if link:
        lines += ["", "**Host link** (rate: " + (link["rate_source"] or "unknown") + ")", "",
                  "| direction | copies | MB per step | copy ms | busy ms | GB/s | rate GB/s | utilisation | "
                  "pageable MB |", "|---|---|---|---|---|---|---|---|---|"]
        for d in ("HtoD", "DtoH"):
            c = link.get(d)
            if c:
                lines.append(f"| {d} | {c['count']} | {c['bytes_per_step'] / 1e6:.3f} | {c['time_ms']:.3f} | "
                             f"{c['busy_ms']:.3f} | {_f(c['gbps'], 1)} | {_f(c['rate_gbps'], 0)} | "
                             f"{_pct(c['utilization'])} | {c['pageable_bytes'] / 1e6:.3f} |")
        lines += ["", f"Link copies ran with no kernel {_pct(link['alone_share'])} of the window. By owner:", "",
                  "| owner | HtoD MB | DtoH MB | busy ms | with no kernel |", "|---|---|---|---|---|"]
        for owner, o in link["owners"].items():
            lines.append(f"| {owner} | {o['HtoD'] / 1e6:.3f} | {o['DtoH'] / 1e6:.3f} | {o['busy_ms']:.3f} | "
                         f"{_pct(o['alone_share'])} |")
    if act:
        lines += ["", f"**Activation offload**: {act['offload']['count']} copies to the host "
                      f"({act['offload']['bytes'] / 1e6:.3f} MB, {act['offload']['time_ms']:.3f} ms), "
                      f"{act['prefetch']['count']} back ({act['prefetch']['bytes'] / 1e6:.3f} MB, "
                      f"{act['prefetch']['time_ms']:.3f} ms); {_pct(act['overlap_fraction'])} of their time "
                      f"overlapped compute kernels, {_pct(act['alone_share'])} of the window without."]
    if fp8:
        top = ", ".join(f"`{_short(t['name'], 50)}` {_pct(t['share'])}" for t in fp8["top_casts"])
        lines += ["", f"**fp8**: casts, amax and scales {_pct(fp8['cast_share'])} of kernel time "
                      f"({fp8['cast_kernels']} kernels, {fp8['cast_time_ms']:.3f} ms"
                      + (f"; {top}" if top else "") + f"); fp8 GEMMs {_pct(fp8['gemm_share'])} of kernel time."]
    steps = s["steps"]
    if cu or link:
        lines += ["", "| step | CPU update ms | GPU waited for it ms | link alone ms | HtoD MB | DtoH MB |",
                  "|---|---|---|---|---|---|"]
        for r in steps:
            lines.append(f"| {r['step'] if r['step'] is not None else 'all'} | {r['cpu_update_ms']:.3f} | "
                         f"{r['cpu_update_idle_ms']:.3f} | {r['link_alone_ms']:.3f} | {r['htod_bytes'] / 1e6:.3f} | "
                         f"{r['dtoh_bytes'] / 1e6:.3f} |")
    return lines


_TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json", ".json.gz", ".json", ".gz")


def summary_paths(trace_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Where the summary of ``trace_path`` goes: ``<stem>.summary.{json,md,png}`` next to it (or in ``out_dir``)."""
    p = Path(trace_path)
    stem = p.name
    for suffix in _TRACE_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    d = Path(out_dir) if out_dir is not None else p.parent
    return {ext: d / f"{stem}.summary.{ext}" for ext in ("json", "md", "png")}


def write_summary(summary: Mapping[str, Any], paths: Mapping[str, Path], plot: bool = True) -> dict[str, Path]:
    """Write ``summary.json``, ``summary.md`` and (``plot=True``) the PNG; returns the paths written."""
    written = {}
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps(summary, indent=2))
    written["json"] = paths["json"]
    paths["md"].write_text(render_markdown(summary))
    written["md"] = paths["md"]
    if plot:
        from lightning_gh.profiling.plot import plot_summary

        written["png"] = plot_summary(summary, paths["png"])
    return written

