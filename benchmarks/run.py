"""One entry point for every GPU benchmark suite.

    python benchmarks/run.py --suite baseline [--preset small medium] [--iters 30] [--warmup 5] [--out DIR]

A suite is a module ``benchmarks/suites/<name>.py`` with ``run(ctx) -> list[Result]`` and, optionally,
``add_arguments(parser)``. Variants run side by side in this process; the table's ``speedup_vs_first``
is each variant against the first variant of the same preset. JSON goes to ``--out``, else ``$OUT``,
else ``bench_out/``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root, so `lightning_gh` imports without installing
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from common import BenchContext, format_table, machine_info, out_dir, write_report  # noqa: E402
from lightning_gh.demo import PRESETS  # noqa: E402


def suites() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE / "suites")]) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # No help until the suite's own options are added, so `--suite X --help` lists them too.
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--suite", default=None, choices=suites(), help="the suite to run (required)")
    ap.add_argument("--preset", nargs="+", default=None, choices=sorted(PRESETS),
                    help="presets to run (default: the suite's own list)")
    ap.add_argument("--iters", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None, help="folder for the JSON (default: $OUT or bench_out/)")
    known, _ = ap.parse_known_args(argv)
    if known.suite is not None:
        suite = importlib.import_module(f"suites.{known.suite}")
        if hasattr(suite, "add_arguments"):
            suite.add_arguments(ap)
    ap.add_argument("-h", "--help", action="help", help="show this help (with --suite X: that suite's options too)")
    args = ap.parse_args(argv)
    if args.suite is None:
        ap.error("the following arguments are required: --suite")
    if args.iters <= 0 or args.warmup < 0:
        ap.error(f"--iters={args.iters} must be > 0 and --warmup={args.warmup} >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device=cuda but no CUDA GPU is visible; use --device cpu for a functional (untimed) run")
    ctx = BenchContext(
        suite=args.suite,
        presets=args.preset or list(getattr(suite, "DEFAULT_PRESETS", ["small"])),
        device=torch.device(args.device),
        warmup=args.warmup,
        iters=args.iters,
        out_dir=out_dir(args.out),
        args=args,
    )
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    results = suite.run(ctx)
    command = "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in argv)
    path = write_report(ctx, results, command)
    info = machine_info()
    print(f"\n## suite {args.suite} - {info['date']} - {info['machine']}\n`{command}`\n")
    print(format_table(results))
    print(f"\nJSON: {path}")
    # A variant that fails (say, out of memory) is a result; the run fails only when nothing was timed.
    return 0 if any(r.timing for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
