"""SuperOffload's out-of-place CPU AdamW kernel (lightning_gh/superoffload/csrc/adamw.c) against torch's in-place
fused CPU AdamW, per build variant (vector width, streaming or ordinary stores), on this machine's cores.

    python benchmarks/cpu_adamw_kernel.py [--threads N] [--numel 268435456] [--bucket 16777216] [--out DIR]

For each variant: the bitwise check against ``torch._fused_adamw_`` (as the optimizer runs it before use), then
the median time of one out-of-place step over ``--numel`` parameters, as one call and as calls of ``--bucket``
parameters (the optimizer's bucket size: the per-call thread start-up shows there), in G params/s; for the build
the optimizer uses, also in place and with bf16 gradients (how it updates bf16 parameters). Anchors in the same
process: torch's fused AdamW in place (what a step costs when no undo is needed), and the same plus the rollback
copy the ``rollback="copy"`` path makes before a speculative update.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_s  # noqa: E402
from lightning_gh import _native, hardware  # noqa: E402
from lightning_gh.superoffload import cpu_adamw  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=max(1, hardware.cpus_available() - 2))
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--bucket", type=int, default=1 << 24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n, nt = args.numel, args.threads
    torch.set_num_threads(nt)
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    dst = tuple(torch.zeros(n) for _ in range(3))
    g_bf16 = g.to(torch.bfloat16)
    backup = torch.zeros(3 * n)
    step = torch.tensor(5.0)
    hp = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}
    rows = []

    def torch_inplace():
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)

    def torch_with_copy():
        backup[:n].copy_(p)
        backup[n:2 * n].copy_(m)
        backup[2 * n:].copy_(v)
        torch_inplace()

    for name, fn in (("torch fused, in place", torch_inplace), ("torch fused + rollback copy", torch_with_copy)):
        s = median_s(fn)
        rows.append({"variant": name, "one_call_ms": round(s * 1e3, 1), "gparams_s": round(n / s / 1e9, 2)})

    isa = cpu_adamw.isa_flags(hardware.host_arch(), hardware.cpu_flags())
    variants = [("avx2 stream", isa, 1), ("avx2 store", isa, 0)]
    if "avx512f" in hardware.cpu_flags():
        variants += [("avx512 stream", ["-mavx512f", "-mfma"], 1), ("avx512 store", ["-mavx512f", "-mfma"], 0)]
    for name, flags, stream in variants:
        so = _native.build_shared_library(cpu_adamw._SOURCE, "lgh_adamw_variant",
                                          [*cpu_adamw._CFLAGS, *flags, f"-DLGH_STREAM={stream}"], link_flags=["-lm"])
        k = cpu_adamw.AdamWKernel(so, 2)
        exact = next((mode for mode in (2, 1, 0) if cpu_adamw._matches_torch(k, mode)), None)
        k.sq_mode = 2 if exact is None else exact

        def one(k=k):
            cpu_adamw.update_spans(k, (p, m, v), g, dst, [n], 5.0, hp, None, nt)

        def bucketed(k=k):
            for lo in range(0, n, args.bucket):
                hi = min(n, lo + args.bucket)
                cpu_adamw.update_spans(k, (p[lo:hi], m[lo:hi], v[lo:hi]), g[lo:hi],
                                       tuple(d[lo:hi] for d in dst), [hi - lo], 5.0, hp, None, nt)

        s1, sb = median_s(one), median_s(bucketed)
        rows.append({"variant": f"ours {name}", "bitwise_sq_mode": exact, "one_call_ms": round(s1 * 1e3, 1),
                     "gparams_s": round(n / s1 / 1e9, 2), "bucketed_ms": round(sb * 1e3, 1),
                     "bucketed_gparams_s": round(n / sb / 1e9, 2)})
        if name == "avx2 stream":  # the build the optimizer uses: its other modes, in buckets
            for mode, grad, out in (("in place, fp32 grad", g, (p, m, v)), ("in place, bf16 grad", g_bf16, (p, m, v)),
                                    ("out of place, bf16 grad", g_bf16, dst)):
                def run(grad=grad, out=out, k=k):
                    for lo in range(0, n, args.bucket):
                        hi = min(n, lo + args.bucket)
                        cpu_adamw.update_spans(k, (p[lo:hi], m[lo:hi], v[lo:hi]), grad[lo:hi],
                                               tuple(d[lo:hi] for d in out), [hi - lo], 5.0, hp, None, nt)
                s = median_s(run)
                rows.append({"variant": f"ours {name}, {mode}", "bucketed_ms": round(s * 1e3, 1),
                             "bucketed_gparams_s": round(n / s / 1e9, 2)})
    print(f"{n:,} fp32 parameters, {nt} threads, buckets of {args.bucket:,}; {hardware.cpus_available()} CPUs")
    for r in rows:
        print(r)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "cpu_adamw_kernel.json").write_text(json.dumps({"numel": n, "threads": nt, "rows": rows},
                                                                      indent=1))


if __name__ == "__main__":
    main()
