"""How long a small host-to-device copy on one stream waits behind large host-to-device copies on another.

FSDP2's all-gather copy-out queues a small pinned host-to-device copy (the split kernel's arguments) on the compute
stream before each unit's forward, while SuperOffload's ZeRO-3 worker copies a host unit's new weights (hundreds of
MB) to the GPU on a side stream. Both go through the GPU's copy engine for that direction. This measures, per way
of cutting the large copy into pieces, the small copy's latency from the moment its stream reaches it (CUDA events
around it, after a device-side sleep that lets the large copies start first) and the large copies' bandwidth.

    python benchmarks/copy_contention.py --mb 218 --pieces 1 9 32 128 --paced 16:1 8:3 --out $OUT

Prints one JSON line per variant and writes ``copy_contention.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

SMALL_BYTES = 33_104  # the size of the copy-out's argument copy seen in a 7B trace


def measure_paced(total_bytes: int, piece_bytes: int, depth: int, trials: int, sleep_cycles: int) -> dict[str, float]:
    """The same with the large copy issued by :class:`lightning_gh.superoffload.paced_copy.PacedCopies` (pieces of
    ``piece_bytes``, at most ``depth`` queued); the bulk time is the host's, from submit to the job's end."""
    import time

    from lightning_gh.superoffload.paced_copy import PacedCopies

    host = torch.empty(total_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    small_h = torch.empty(SMALL_BYTES, dtype=torch.uint8).pin_memory()
    small_d = torch.empty(SMALL_BYTES, dtype=torch.uint8, device="cuda")
    compute = torch.cuda.Stream()
    errors: list[BaseException] = []
    pacer = PacedCopies(torch.cuda.Stream(), errors.append, piece_bytes=piece_bytes, depth=depth)
    waits, bulk = [], []
    for t in range(trials + 2):
        torch.cuda.synchronize()
        b0, b1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(sleep_cycles)
            b0.record(compute)
            small_d.copy_(small_h, non_blocking=True)
            b1.record(compute)
        t0 = time.perf_counter()
        job = pacer.submit([(dst, host)], lambda event: None)
        job.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        if t >= 2:
            waits.append(b0.elapsed_time(b1))
            bulk.append(ms)
    pacer.close()
    if errors:
        raise errors[0]
    ms = statistics.median(bulk)
    return {"paced": True, "depth": depth, "piece_mb": piece_bytes / 2**20, "small_copy_ms": statistics.median(waits),
            "small_copy_max_ms": max(waits), "bulk_ms": ms, "bulk_gbps": total_bytes / ms / 1e6}


def measure(total_bytes: int, pieces: int, trials: int, sleep_cycles: int) -> dict[str, float]:
    """The small copy's median latency (ms) with the large copy cut into ``pieces`` copies, and the large copies'
    median time (ms) and rate (GB/s)."""
    host = torch.empty(total_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    small_h = torch.empty(SMALL_BYTES, dtype=torch.uint8).pin_memory()
    small_d = torch.empty(SMALL_BYTES, dtype=torch.uint8, device="cuda")
    side, compute = torch.cuda.Stream(), torch.cuda.Stream()
    step = -(-total_bytes // pieces)
    waits, bulk = [], []
    for t in range(trials + 2):
        torch.cuda.synchronize()
        a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        b0, b1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(sleep_cycles)  # the compute stream reaches its copy while the large ones run
            b0.record(compute)
            small_d.copy_(small_h, non_blocking=True)
            b1.record(compute)
        with torch.cuda.stream(side):
            a0.record(side)
            for i in range(0, total_bytes, step):
                dst[i:i + step].copy_(host[i:i + step], non_blocking=True)
            a1.record(side)
        torch.cuda.synchronize()
        if t >= 2:  # two warm-up rounds
            waits.append(b0.elapsed_time(b1))
            bulk.append(a0.elapsed_time(a1))
    ms = statistics.median(bulk)
    return {"pieces": pieces, "piece_mb": step / 2**20, "small_copy_ms": statistics.median(waits),
            "small_copy_max_ms": max(waits), "bulk_ms": ms, "bulk_gbps": total_bytes / ms / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=218, help="the large copy, MiB (a 7B decoder layer's bf16 half)")
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 9, 32, 128])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--sleep-cycles", type=int, default=1_000_000, help="the compute stream's head start for the large copies")
    ap.add_argument("--paced", nargs="*", default=[], metavar="MIB:DEPTH",
                    help="also through PacedCopies with pieces of MIB MiB, at most DEPTH queued (e.g. 16:1 8:3)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_contention needs a CUDA GPU")
    rows = []
    for p in args.pieces:
        r = measure(args.mb * 2**20, p, args.trials, args.sleep_cycles)
        rows.append(r)
        print(json.dumps(r), flush=True)
    for spec in args.paced:
        mib, depth = (int(v) for v in spec.split(":"))
        r = measure_paced(args.mb * 2**20, mib * 2**20, depth, args.trials, args.sleep_cycles)
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "copy_contention.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                         indent=1))


if __name__ == "__main__":
    main()
