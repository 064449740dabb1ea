"""Command line: ``python -m lightning_gh demo ...`` (the main job) and ``python -m lightning_gh info``."""

from __future__ import annotations

import json
import sys

USAGE = """usage: python -m lightning_gh COMMAND [options]

commands:
  demo    train the reference Llama-style model with every part this machine allows (--help for options)
  info    print what lightning_gh sees of this machine (GPU, fp8 support, host link) as JSON
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from lightning_gh.demo.run import main as demo_main

        return demo_main(rest)
    if cmd == "info":
        from lightning_gh import hardware

        info = hardware.detect().to_dict()
        if "--bandwidth" in rest:
            bw = hardware.link_bandwidth()
            info["link_bandwidth"] = None if bw is None else vars(bw)
        print(json.dumps(info, indent=2))
        return 0
    print(f"unknown command {cmd!r}; expected one of: demo, info\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
