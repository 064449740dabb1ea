"""Suite `superoffload_ddp`: SuperOffload across GPUs (ZeRO-1/2 with the AdamW state in host memory) against DDP and
FSDP with CPU offload, side by side, on a model that fits every way.

Model: a plain LightningModule around `transformers.LlamaForCausalLM` (hidden 2048, 16 layers, FFN 5632, 16 / 4
heads, vocab 32000: 845M parameters), 1x2048 random tokens per rank per step. Each variant is an ordinary
`Trainer(devices=N)` under Lightning's own launcher (a subprocess per GPU, NCCL), run in a fresh process group:

  ddp                          strategy="ddp", precision="bf16-mixed", torch.optim.AdamW(fused=True) on the GPU
  superoffload                 strategy=SuperOffloadStrategy() (default options), "bf16-mixed", devices=2
  superoffload bf16-true       the same with bf16 weights on the GPU (fp32 master on the host)
  superoffload gpu_fraction=0.5  half of the parameters (the first layers) replicated on every GPU with fused GPU
                               AdamW (their gradients all-reduced), the other half sharded on the hosts
  fsdp cpu_offload             FSDPStrategy(cpu_offload=True), one unit per decoder layer, "bf16-mixed", fused
                               AdamW on the CPU (what FSDP's offload runs)
  superoffload 1 rank tail=0   devices=1, gpu_fraction=0.0: the single-rank host memory the per-rank figure is
                               compared with (the 2-rank default puts all state on the host too)

Per variant and rank: median step time (wall clock between the ends of consecutive steps, the GPU synchronised,
after `--warmup` steps), host memory (VmRSS at the end of training and VmHWM, from /proc/self/status), the
optimizer's own host bytes for SuperOffload (its share of the parameters x 28 B), GPU peak memory. The summary
prints each variant's ratio to ddp (goal for superoffload <= 1.15) and fsdp's time over superoffload's (goal >= 2),
and the per-rank host memory of the 2-rank run over the 1-rank run's (goal about 1/2).

SuperOffload's host-memory guard runs with `host_memory_check=False` here and its decision is recorded instead
(`guard`): on the 2-GPU machine MemTotal starts near 31 GiB and grows as memory is used, so MemAvailable at start
under-reports what the job may use (see docs/superoffload.md).

Each variant runs `python benchmarks/suites/superoffload_ddp.py '<json>'` in its own session with a timeout (a
variant that hangs is killed with its ranks); ranks write JSON beside the suite's report.

    python benchmarks/run.py --suite superoffload_ddp --warmup 8 --iters 15
    python benchmarks/run.py --suite superoffload_ddp --device cpu --warmup 1 --iters 2   # functional, gloo
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
GOAL_VS_DDP = 1.15
GOAL_VS_FSDP = 2.0
VARIANTS = ["ddp", "superoffload", "superoffload bf16-true", "superoffload gpu_fraction=0.5", "fsdp cpu_offload",
            "superoffload 1 rank tail=0"]
_MARK = "[superoffload_ddp]"


def add_arguments(parser: Any) -> None:
    parser.add_argument("--ddp-variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="variants to run")
    parser.add_argument("--ddp-devices", type=int, default=2, help="ranks of the multi-device variants")
    parser.add_argument("--ddp-layers", type=int, default=16, help="decoder layers (CUDA); the CPU run uses 2")
    parser.add_argument("--ddp-seq", type=int, default=2048, help="tokens per rank per step (batch 1)")
    parser.add_argument("--ddp-timeout-s", type=float, default=150.0, help="wall-clock limit of one variant")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


# ---------------------------------------------------------------------------------------------- the ranks' side
def _host_memory() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _module(cuda: bool, layers: int, seq: int, fused: bool) -> Any:
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    class HFLlama(L.LightningModule):
        """A plain LightningModule around LlamaForCausalLM, as a user would write it."""

        def __init__(self) -> None:
            super().__init__()
            if cuda:
                cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                                  num_key_value_heads=4, num_hidden_layers=layers, vocab_size=32000,
                                  max_position_embeddings=seq)
            else:
                cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, vocab_size=256, max_position_embeddings=seq)
            cfg._attn_implementation = "sdpa"
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(cfg)
            self.vocab = cfg.vocab_size

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(1 + self.global_rank)
            ids = torch.randint(0, self.vocab, (64, seq), generator=g)
            return torch.utils.data.DataLoader(ids, batch_size=1, pin_memory=cuda)

    return HFLlama()


def _rank_main(args: dict[str, Any]) -> None:
    import lightning as L

    from lightning_gh import hardware
    from lightning_gh._host import HostMemoryError
    from lightning_gh.superoffload import HeterogeneousAdamW, SuperOffloadStrategy, memory

    cuda = args["device"] == "cuda"
    name = args["variant"]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    devices = 1 if "1 rank" in name else args["devices"]
    precision = "bf16-true" if "bf16-true" in name else "bf16-mixed"
    record: dict[str, Any] = {"variant": name, "rank": rank, "devices": devices, "precision": precision,
                              "mem_available_at_start": hardware.available_host_bytes()}
    module = _module(cuda, args["layers"], args["seq"], fused=True)
    n_params = sum(p.numel() for p in module.parameters())
    record["params"] = n_params
    record["host_before_fit"] = _host_memory()
    if name.startswith("superoffload"):
        kw: dict[str, Any] = {"gpu_fraction": 0.0} if "tail=0" in name else {}
        if "gpu_fraction=" in name:
            kw = {"gpu_fraction": float(name.split("gpu_fraction=")[1])}
        try:
            memory.check_host_memory(n_params // devices, speculative_backup=True, local_ranks=devices)
            record["guard"] = "pass"
        except HostMemoryError as e:
            record["guard"] = f"would refuse: {e}"
        strategy: Any = SuperOffloadStrategy(host_memory_check=not cuda, **kw)
    elif name == "ddp":
        strategy = "ddp"
    else:
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy = FSDPStrategy(cpu_offload=True, auto_wrap_policy={LlamaDecoderLayer})
    ends: list[float] = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            record["host_train_end"] = _host_memory()
            opt = trainer.optimizers[0]
            if isinstance(opt, HeterogeneousAdamW):
                record["so_host_params"] = opt.host_numel
                record["so_host_bytes"] = None if opt.layout.plan is None else opt.layout.plan.needed_bytes
                record["so_cpu_threads"] = opt.cpu_threads
                record["so_stats"] = {k: v for k, v in opt.stats.items() if isinstance(v, (int, float, str))}
            if cuda:
                record["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()

    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=devices, strategy=strategy,
                        precision=precision, max_steps=args["warmup"] + args["iters"] + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Probe()], use_distributed_sampler=False)
    trainer.fit(module)
    steps = [(b - a) * 1e3 for a, b in zip(ends, ends[1:])][args["warmup"]:]
    record["step_ms"] = steps
    record["median_ms"] = statistics.median(steps) if steps else None
    Path(args["out"]).mkdir(parents=True, exist_ok=True)
    with open(Path(args["out"]) / f"{_slug(name)}-rank{trainer.global_rank}.json", "w") as f:
        json.dump(record, f)


# ---------------------------------------------------------------------------------------------- the suite's side
def _launch(ctx: Any, name: str) -> tuple[list[dict[str, Any]], str | None]:
    a = ctx.args
    out = Path(ctx.out_dir) / "superoffload_ddp"
    for old in out.glob(f"{_slug(name)}-rank*.json"):
        old.unlink()
    args = {"variant": name, "device": ctx.device.type, "devices": a.ddp_devices, "layers": a.ddp_layers,
            "seq": a.ddp_seq if ctx.cuda else 32, "warmup": ctx.warmup, "iters": ctx.iters, "out": str(out)}
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent.parent), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=a.ddp_timeout_s)
        error = None if proc.returncode == 0 else f"exit {proc.returncode}: {log[-1500:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children are in the same session
        log, _ = proc.communicate()
        error = f"timed out after {a.ddp_timeout_s:.0f} s: {log[-1500:]}"
    print(f"{_MARK} {name}: {time.perf_counter() - t0:.0f} s wall{'' if error is None else ' ERROR ' + error}",
          flush=True)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{_slug(name)}-rank*.json"))]
    return ranks, error


def run(ctx: Any) -> list[Any]:
    from common import Result, Timing

    results: list[Any] = []
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name in ctx.args.ddp_variants:
        ranks, error = _launch(ctx, name)
        by_name[name] = ranks
        _summary({name: ranks}, totals=False)  # as it lands: a later variant may run out of time
        r0 = ranks[0] if ranks else None
        timing = Timing.from_samples(r0["step_ms"]) if r0 and r0.get("step_ms") else None
        extra = {"ranks": [{k: v for k, v in r.items() if k != "step_ms"} for r in ranks]}
        results.append(Result(ctx.suite, f"hf llama {ctx.args.ddp_layers}L" if ctx.cuda else "hf llama tiny", name,
                              timing, tokens_per_step=(ctx.args.ddp_seq if ctx.cuda else 32) * (r0 or {}).get("devices", 1),
                              peak_mem_bytes=(r0 or {}).get("gpu_peak_bytes"), extra=extra, error=error))
    _summary(by_name)
    return results


def _summary(by_name: dict[str, list[dict[str, Any]]], totals: bool = True) -> None:
    def med(name: str) -> float | None:
        ranks = by_name.get(name) or []
        meds = [r["median_ms"] for r in ranks if r.get("median_ms")]
        return max(meds) if meds else None  # the slowest rank sets the pace

    gib = 2**30
    ddp, so, fsdp = med("ddp"), med("superoffload"), med("fsdp cpu_offload")
    for name, ranks in by_name.items():
        m = med(name)
        vs = f", x ddp {m / ddp:.2f}" if m and ddp else ""
        mem = "; ".join(f"rank {r['rank']}: RSS {r.get('host_train_end', {}).get('VmRSS', 0) / gib:.1f} GiB, HWM "
                        f"{r.get('host_train_end', {}).get('VmHWM', 0) / gib:.1f} GiB"
                        + (f", state {r['so_host_bytes'] / gib:.1f} GiB ({r['so_host_params']:,} params, "
                           f"{r['so_cpu_threads']} threads)" if "so_host_bytes" in r else "")
                        + (f", guard {r['guard'][:60]}" if "guard" in r else "") for r in ranks)
        print(f"{_MARK} {name}: median {m if m is None else round(m, 1)} ms{vs}; {mem}", flush=True)
    if not totals:
        return
    if so and ddp:
        print(f"{_MARK} superoffload / ddp = {so / ddp:.2f} (goal <= {GOAL_VS_DDP})", flush=True)
    if so and fsdp:
        print(f"{_MARK} fsdp cpu_offload / superoffload = {fsdp / so:.2f} (goal >= {GOAL_VS_FSDP})", flush=True)
    one = by_name.get("superoffload 1 rank tail=0") or []
    two = by_name.get("superoffload") or []
    if one and two and "so_host_bytes" in one[0] and all("so_host_bytes" in r for r in two):
        ratio = max(r["so_host_bytes"] for r in two) / one[0]["so_host_bytes"]
        rss = max(r["host_train_end"]["VmRSS"] for r in two) / one[0]["host_train_end"]["VmRSS"]
        print(f"{_MARK} per-rank host state, 2 ranks / 1 rank = {ratio:.2f} (goal about 0.5); RSS {rss:.2f}", flush=True)


if __name__ == "__main__":
    sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]
    _rank_main(json.loads(sys.argv[1]))
