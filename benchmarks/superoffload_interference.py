"""What slows the training loop while SuperOffload's CPU worker updates: the update's cores and memory traffic,
or the worker's Python holding the GIL?

    python benchmarks/superoffload_interference.py [--layers 32] [--rounds 2] [--out DIR]

Forward+backward of the `superoffload` suite's HF Llama (hidden 2048, 1x2048 tokens, bf16 weights on the GPU, each
gradient dropped as it lands), timed with CUDA events while one background thread does, in turn:

  none            nothing (the reference)
  kernel          SuperOffload's CPU AdamW kernel in place with bf16 gradients (the worker's mode) over 256M fp32
                  parameters in one call per pass: the update's cores and memory traffic, the GIL released
  kernel+copies   the kernel in 16M-parameter calls with the worker's copies around each: the bucket's bf16
                  gradient copied GPU->pinned host before its update, its fp32 weights host->GPU after it (6 B per
                  parameter over the link, as SuperOffload moves them)
  kernel+python   the same in 16M-parameter calls through ``update_spans`` (the worker's Python per bucket)
  python          pure Python in a loop (small tensor ops and list building, as the worker does between kernel
                  calls): GIL contention only

Each mode's median ms, its ratio to ``none`` of the same round, and the background's rate are printed and written
to ``superoffload_interference.json``. Before the rounds, the kernel modes also run for ``--alone-s`` seconds with
no GPU work: their rates alone, so the update's rate under its own copies and under the training loop can be read
against it (what the host's memory bandwidth leaves the update: the bound assumes the rate alone). Rounds repeat
the modes in the same order. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "suites"))

from lightning_gh import hardware  # noqa: E402
from lightning_gh.superoffload import cpu_adamw  # noqa: E402

MODES = ("none", "kernel", "kernel+copies", "kernel+python", "python")
_HP = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}


class Background:
    """One thread doing ``mode``'s work until stopped; counts the parameters it updated (or loop passes)."""

    def __init__(self, mode: str, kernel: cpu_adamw.AdamWKernel | None, state: tuple[torch.Tensor, ...],
                 grad: torch.Tensor, threads: int, bucket: int) -> None:
        self.mode, self.kernel, self.state, self.grad = mode, kernel, state, grad
        self.threads, self.bucket = threads, bucket
        if mode == "kernel+copies":  # what the worker's copies need: pinned host buffers, GPU sources and targets
            n = grad.numel()
            self.host_grad = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
            self.dev_grad = torch.randn(n, device="cuda").to(torch.bfloat16)
            self.stage = torch.empty(bucket, dtype=torch.float32, device="cuda")
            self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        self.stop = threading.Event()
        self.work = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = self.grad.numel()
        small = torch.zeros(8)
        while not self.stop.is_set():
            if self.mode == "kernel":
                cpu_adamw.update_spans(self.kernel, self.state, self.grad, self.state, [n], 5.0, _HP, None,
                                       self.threads)
                self.work += n
            elif self.mode == "kernel+copies":
                weights = self.state[0]
                spans = [(lo, min(n, lo + self.bucket)) for lo in range(0, n, self.bucket)]
                landed = self._pull(*spans[0])
                for i, (lo, hi) in enumerate(spans):
                    # the next bucket's gradient lands while this one updates, as backward's copies run ahead of
                    # the worker
                    nxt = self._pull(*spans[i + 1]) if i + 1 < len(spans) else None
                    landed.synchronize()
                    view = tuple(t[lo:hi] for t in self.state)
                    cpu_adamw.update_spans(self.kernel, view, self.host_grad[lo:hi], view, [hi - lo], 5.0, _HP,
                                           None, self.threads)
                    with torch.cuda.stream(self.h2d):  # the stream orders the pushes into the one staging buffer
                        self.stage[:hi - lo].copy_(weights[lo:hi], non_blocking=True)
                    self.work += hi - lo
                    landed = nxt
                self.h2d.synchronize()
            elif self.mode == "kernel+python":
                for lo in range(0, n, self.bucket):
                    hi = min(n, lo + self.bucket)
                    view = tuple(t[lo:hi] for t in self.state)
                    cpu_adamw.update_spans(self.kernel, view, self.grad[lo:hi], view, [hi - lo], 5.0, _HP, None,
                                           self.threads)
                    self.work += hi - lo
            elif self.mode == "python":
                views = [small[i:i + 1] for i in range(8)]  # the kind of per-slot view building the worker does
                small.add_(1.0)
                self.work += len(views)

    def _pull(self, lo: int, hi: int) -> torch.cuda.Event:
        """Issue the copy of ``[lo, hi)`` of the GPU gradient into the pinned host buffer; its event."""
        with torch.cuda.stream(self.d2h):
            self.host_grad[lo:hi].copy_(self.dev_grad[lo:hi], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        return event

    def __enter__(self) -> Background:
        self.t0 = time.perf_counter()
        if self.mode != "none":
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.mode != "none":
            self.thread.join()
        self.seconds = time.perf_counter() - self.t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1 << 28, help="background kernel's parameters")
    ap.add_argument("--bucket", type=int, default=1 << 24)
    ap.add_argument("--threads", type=int, default=max(1, hardware.cpus_available() - 2))
    ap.add_argument("--alone-s", type=float, default=3.0, help="seconds each kernel mode runs alone first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("superoffload_interference.py needs a CUDA GPU (it times the GPU's forward+backward).")
    from superoffload import _fwd_bwd_ms, _HFLlamaLM, default_dtype  # the suite's model and timer

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        module = _HFLlamaLM(args.layers, hidden=2048, seq_len=2048)
    batch = torch.randint(0, 32000, (1, 2048), device="cuda")
    kernel = cpu_adamw.load()
    if kernel is None:
        raise SystemExit("our CPU kernel could not be built here (no C compiler?)")
    torch.set_num_threads(args.threads)
    n = args.numel
    state = (torch.randn(n).pin_memory(), torch.randn(n), torch.rand(n))  # fp32 weights pinned, as the worker's
    grad = torch.randn(n).to(torch.bfloat16)
    _fwd_bwd_ms(module, batch, autocast=False, warmup=3, iters=3)  # cuDNN/cuBLAS choices before any timing
    alone = {}
    for mode in ("kernel", "kernel+python", "kernel+copies", "kernel"):  # kernel twice: drift within the probe
        with Background(mode, kernel, state, grad, args.threads, args.bucket) as bg:
            time.sleep(args.alone_s)
        alone.setdefault(mode, []).append(round(bg.work / bg.seconds / 1e9, 2))
        print({"alone": mode, "rate": alone[mode][-1]}, flush=True)
    rows = []
    for rnd in range(args.rounds):
        base = None
        for mode in MODES:
            with Background(mode, kernel, state, grad, args.threads, args.bucket) as bg:
                time.sleep(0.2 if mode != "none" else 0.0)  # let the background reach its steady state
                ms = _fwd_bwd_ms(module, batch, autocast=False, warmup=2, iters=7)
            base = ms if mode == "none" else base
            rate = bg.work / bg.seconds
            row = {"round": rnd, "mode": mode, "fwd_bwd_ms": round(ms, 2), "x_none": round(ms / base, 3),
                   "background_rate": round(rate / 1e9, 2) if mode.startswith("kernel") else round(rate)}
            if mode.startswith("kernel"):
                row["x_rate_alone"] = round(rate / 1e9 / statistics.mean(alone["kernel"]), 3)
            rows.append(row)
            print(row, flush=True)
    summary = {m: round(statistics.median(r["x_none"] for r in rows if r["mode"] == m), 3) for m in MODES}
    print("median slowdown of forward+backward by background:", summary)
    print("kernel rate alone (G params/s):", alone)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "superoffload_interference.json").write_text(json.dumps(
            {"layers": args.layers, "threads": args.threads, "numel": n, "bucket": args.bucket,
             "cpus": hardware.cpus_available(), "rate_alone_G_per_s": alone, "rows": rows,
             "median_x_none": summary}, indent=1))


if __name__ == "__main__":
    main()
