"""``python -m lightning_gh.profiling summarize TRACE.json[.gz] [...]``: analyse any Kineto trace.

Writes ``<stem>.summary.json``, ``<stem>.summary.md`` and ``<stem>.summary.png`` next to each trace (or into
``--out``) and prints the Markdown report. A folder stands for the traces under it (a SelectiveProfiler output
folder, say). A file that is missing, empty, not a Kineto trace, without events or with negative durations is named
on stderr with the problem, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_gh.profiling",
                                 description="Analyse Kineto (torch.profiler) traces.")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="write <stem>.summary.{json,md,png} for each trace and print the report")
    s.add_argument("traces", nargs="+", type=Path,
                   help="Kineto chrome traces (.json or .json.gz), or folders holding them")
    s.add_argument("--out", type=Path, default=None, help="folder for the summaries (default: next to each trace)")
    s.add_argument("--top", type=int, default=10, help="kernels / host operators to list (default 10)")
    s.add_argument("--no-plot", action="store_true", help="skip the PNG")
    s.add_argument("--json", action="store_true", help="print the JSON summary instead of the Markdown")
    args = ap.parse_args(argv)
    if args.top <= 0:
        ap.error(f"--top={args.top} must be > 0")

    from lightning_gh.profiling.summary import render_markdown, summarize_trace
    from lightning_gh.profiling.trace import trace_files

    status = 0
    paths: list[Path] = []
    for given in args.traces:
        if not given.is_dir():
            paths.append(given)
            continue
        found = trace_files(given)
        if not found:
            print(f"error: {given}: a folder with no Kineto traces (*.json, *.json.gz) under it", file=sys.stderr)
            status = 1
        paths.extend(found)
    for path in paths:
        try:
            summary = summarize_trace(path, args.out, top=args.top, plot=not args.no_plot)
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            status = 1
            continue
        print(json.dumps(summary, indent=2) if args.json else render_markdown(summary))
        print("written: " + ", ".join(summary["files"].values()), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
