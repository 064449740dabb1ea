"""Command line: ``python -m lightning_gh demo ...`` (the main job) and ``python -m lightning_gh info``.

Each command has its own ``--help``. ``info`` prints JSON: what lightning_gh sees of this machine, which
optional extras are installed (with versions), and which precision names work here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from typing import Any

# extra -> (distribution, import name) of what it installs
EXTRAS: dict[str, tuple[str, str]] = {
    "nvtx": ("nvtx", "nvtx"),
    "ao": ("torchao", "torchao"),
    "te": ("transformer-engine", "transformer_engine"),
    "transformers": ("transformers", "transformers"),
}
COMMANDS = ("demo", "info")


def installed_extras() -> dict[str, str | None]:
    """``extra -> installed version`` (``None`` where it is not installed), without importing any of them."""
    out: dict[str, str | None] = {}
    for extra, (dist, _) in EXTRAS.items():
        try:
            out[extra] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[extra] = None
    return out


def _info(args: argparse.Namespace) -> int:
    from lightning_gh import hardware
    from lightning_gh.precision import list_precisions

    info: dict[str, Any] = hardware.detect().to_dict()
    if args.bandwidth:
        bw = hardware.link_bandwidth()
        info["link_bandwidth"] = None if bw is None else vars(bw)
    info["extras"] = installed_extras()
    info["precisions"] = list_precisions()
    print(json.dumps(info, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightning_gh", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    # `demo` parses its own options (python -m lightning_gh demo --help lists them).
    sub.add_parser("demo", add_help=False,
                   help="train the reference Llama-style model with every part this machine allows")
    info = sub.add_parser("info", help="print what lightning_gh sees of this machine (GPU, fp8, host link, "
                                       "installed extras, precisions) as JSON",
                          description="Print what lightning_gh sees of this machine as JSON.")
    info.add_argument("--bandwidth", action="store_true", help="also measure the host<->GPU copy bandwidth")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    if not argv:
        ap.print_help(sys.stderr)
        return 2
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        print(f"unknown command {argv[0]!r}; expected one of: {', '.join(COMMANDS)}\n", file=sys.stderr)
        ap.print_help(sys.stderr)
        return 2
    if argv[0] == "demo":
        from lightning_gh.demo.run import main as demo_main

        return demo_main(argv[1:])
    args = ap.parse_args(argv)
    return _info(args)


if __name__ == "__main__":
    sys.exit(main())
