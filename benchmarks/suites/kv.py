"""Suite `kv`: greedy `generate` with KV-cache offload against the GPU-only cache and transformers' offloaded cache.

One process, one random-init transformers `LlamaForCausalLM` (bf16, sdpa attention), one batch of random prompts;
each variant generates `--new-tokens` greedily from the same prompts, and is timed over whole `generate` calls
(prefill + decode, CUDA events, after warm-up calls: the first call of a process is slower):

  GPU-only DynamicCache             the default cache (the plain run; reference tokens)
  transformers offloaded            `cache_implementation="offloaded"`: every layer's whole cache both ways per step
  ours R=k                          `OffloadedKVCache(model, resident_layers=k, max_length=prompt+new)`, k = 0, 25%, 50%
  ours 50% KV budget                `gpu_budget_bytes` = half the GPU-only cache's KV bytes (resident + staging ring)
  ours default                      `OffloadedKVCache(model)`: what a user gets with no options (`"auto"` split from
                                    half the free GPU memory, sized at first use)
  ours all resident                 every layer on the GPU in preallocated buffers (no copies)
  GPU-only chunked prefill          DynamicCache with `prefill_chunk_size` (`--prefill-chunk`): reference tokens of
                                    the capped variants

then, under `torch.cuda.set_per_process_memory_fraction` (`--cap-gib`, default 5 GiB: below weights + the GPU-only
KV bytes of the anchor, so GPU-only cannot fit however the prefill runs), every variant with transformers'
`prefill_chunk_size` (prefill activations bounded by the chunk, not the prompt): GPU-only (expected to run out of
memory), transformers' offloaded cache, ours default, ours with only `max_length` given; and ours default without
chunking (its prompt-sized prefill activations alone exceed the cap). An ours variant that runs out of memory is
retried once with the allocator's expandable segments, and the row says so. The chunked variants run under flash
and memory-efficient SDPA together (flash cannot take the mask of a chunk after the first).

Tokens are compared bitwise, so on the GPU a probe runs first (8 new tokens): GPU-only twice, transformers' offloaded
cache, ours; under torch's default SDPA choice, then forced SDPA backends (flash, efficient, cudnn), then
`torch.use_deterministic_algorithms`. The variants run under the first setting where GPU-only repeats itself and ours
matches it (docs/kv_offload.md, "Bitwise equality and the attention backend", says where the default did not).

Reported per variant: tokens/s (batch x new tokens / generate time), peak GiB (`max_memory_allocated`, weights
included), KV bytes held on the GPU and their share of the GPU-only cache's, `tokens_equal` (bitwise against the
GPU-only run), prefill ms, decode ms per token, and for ours the PCIe bound: the bytes one decode step must move
(every offloaded layer's prefix in, new tokens out) over the measured link bandwidth.

Anchor: the shape in ``ANCHOR`` (hidden 2048, 16 layers, 16/4 heads, bf16, batch 32, prompt 4096, 64 new tokens);
its GPU-only and transformers-offloaded figures (``ANCHOR_*_TPS``, printed next to ours) are recorded in
docs/benchmarks.md. Goals (``GOAL_*``): same tokens; a multiple of transformers' offloaded cache; a share of GPU-only
holding at most half of its KV bytes.

    python benchmarks/run.py --suite kv --iters 3 --warmup 1                # anchor shape, on the GPU
    python benchmarks/run.py --suite kv --iters 2 --warmup 1 --resident 0 --lean --cap-gib 5   # under a memory cap
    python benchmarks/run.py --suite kv --device cpu --iters 1 --warmup 0   # tiny functional run
    python benchmarks/run.py --suite kv --iters 5 --warmup 1 --attention flash --profile-decode
                    # all-resident decode, GPU-only vs ours: interleaved rounds, layouts, profiler last
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import traceback
from typing import Any, Callable

import torch

from common import BenchContext, Result, Timing, peak_memory, reset_memory, sync

DEFAULT_PRESETS = ["anchor"]
ANCHOR_GPU_ONLY_TPS = 461.0
ANCHOR_HF_OFFLOADED_TPS = 141.0
GOAL_VS_HF = 2.5
GOAL_VS_GPU_ONLY = 0.8
GOAL_KV_FRACTION = 0.5

ANCHOR = dict(batch=32, prompt=4096, new_tokens=64, layers=16, hidden=2048, ffn=5632, heads=16, kv_heads=4, vocab=32000)
TINY = dict(batch=2, prompt=24, new_tokens=6, layers=4, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256)


def add_arguments(ap) -> None:
    g = ap.add_argument_group("kv suite (defaults: the anchor on CUDA, a tiny model with --device cpu)")
    for name in ANCHOR:
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=f"kv_{name}")
    g.add_argument("--resident", type=float, nargs="+", default=[0.0, 0.25, 0.5],
                   help="resident-layer shares for the `ours R=k` variants")
    g.add_argument("--cap-gib", type=float, default=5.0, help="memory cap of the capped variants (0: skip them)")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="transformers' prefill_chunk_size of the chunked and capped variants (default: 512 on CUDA, a "
                        "quarter of the prompt on the CPU)")
    g.add_argument("--lean", action="store_true",
                   help="skip `ours R=50%% first` and `ours all resident` (GPU time is scarce)")
    g.add_argument("--no-probe", action="store_true", help="skip the determinism probe (GPU)")
    g.add_argument("--no-hf-offloaded", action="store_true", help="skip transformers' offloaded cache (slow)")
    g.add_argument("--attention", default=None, choices=MODES,
                   help="run the variants under this attention setting instead of probing for one")
    g.add_argument("--profile-decode", action="store_true",
                   help="decode study, GPU-only against `OffloadedKVCache(model)` (all resident uncapped): whole "
                        "`generate` calls interleaved over --iters rounds, ours R=0 for the record, attention on each "
                        "KV layout, and last (CUPTI stays loaded after it) torch.profiler tables of decode steps")


def _shape(ctx: BenchContext) -> dict[str, int]:
    base = dict(ANCHOR if ctx.cuda else TINY)
    args = ctx.args
    for name in base:
        v = getattr(args, f"kv_{name}", None) if args is not None else None
        if v is not None:
            base[name] = v
    return base


def _model(shape: dict[str, int], device: torch.device):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                   intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                                   num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                                   max_position_embeddings=shape["prompt"] + shape["new_tokens"] + 8)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def _link_gbps(device: torch.device) -> dict[str, float] | None:
    """Pinned host->GPU bandwidth, plain (256 MiB contiguous) and as our transport copies one layer prefix."""
    if device.type != "cuda":
        return None
    from lightning_gh.kv.transport import KVCudaTransport

    def median_gbps(fn: Callable[[], None], nbytes: int, stream) -> float:
        fn()
        samples = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            samples.append(a.elapsed_time(b) / 1e3)
        return nbytes / statistics.median(samples) / 1e9

    n = 256 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    s = torch.cuda.Stream(device)
    with torch.cuda.stream(s):
        plain = median_gbps(lambda: dev.copy_(host, non_blocking=True), n, s)
    # A (32, 4, 4160, 128) bf16 layer, prefix of 4128 tokens: 128 rows at a 1 MiB pitch.
    t = KVCudaTransport(device)
    shape = (32, 4, 4160, 128)
    hk = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    dk = torch.empty(shape, dtype=torch.bfloat16, device=device)
    rows = median_gbps(lambda: t.fetch_prefix(dk, hk, 4128), 32 * 4 * 4128 * 128 * 2, t.stream)
    return {"h2d_plain_gbps": round(plain, 1), "h2d_rows_gbps": round(rows, 1),
            "memcpy2d": t._memcpy2d is not None}


def _time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> tuple[Timing, Any]:
    out = None
    for _ in range(warmup):
        out = fn()
    sync(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.from_samples(samples), out


def run(ctx: BenchContext) -> list[Result]:
    from lightning_gh.kv import OffloadedKVCache, cache_kwarg

    shape = _shape(ctx)
    dev = ctx.device
    model = _model(shape, dev)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(shape["vocab"], (shape["batch"], shape["prompt"]), generator=g).to(dev)
    mask = torch.ones_like(prompts)
    new = shape["new_tokens"]
    max_len = shape["prompt"] + new
    name = f"b{shape['batch']}-p{shape['prompt']}-n{new}-L{shape['layers']}-d{shape['hidden']}"
    kv_heads, head_dim = shape["kv_heads"], shape["hidden"] // shape["heads"]
    itemsize = 2 if dev.type == "cuda" else 4
    layer_bytes = 2 * shape["batch"] * kv_heads * max_len * head_dim * itemsize
    full_kv = shape["layers"] * layer_bytes
    link = _link_gbps(dev)
    if link:
        print(f"[kv] link: plain pinned H2D {link['h2d_plain_gbps']} GB/s, layer-prefix rows "
              f"{link['h2d_rows_gbps']} GB/s (cudaMemcpy2DAsync: {link['memcpy2d']})")
    backend = "cuda" if ctx.cuda else "host-copy"

    mode_box = {"mode": "default"}

    def generate(max_new: int, mode: str | None = None, **kw) -> torch.Tensor:
        with _mode(mode or mode_box["mode"]):
            return model.generate(prompts, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                  do_sample=False, pad_token_id=0, **kw)

    def ours(default: bool = False, chunk: int | None = None, **opts):
        """`default`: `OffloadedKVCache(model)` as a user writes it (on the CPU with the host-copy backend, since
        `"auto"` does not offload there); `chunk`: transformers' `prefill_chunk_size`."""
        cache_box: dict[str, Any] = {}
        if not default:
            opts = dict(max_length=max_len, **opts)
        if not default or not ctx.cuda:
            opts["backend"] = backend
        gen_kw: dict[str, Any] = {} if chunk is None else {"prefill_chunk_size": chunk, "mode": chunk_mode()}

        def fn(max_new: int = new):
            c = cache_box.get("c")
            if c is None:
                t0 = time.perf_counter()
                c = cache_box["c"] = OffloadedKVCache(model, **opts)
                cache_box["built_s"] = time.perf_counter() - t0
            else:
                c.reset()
            return generate(max_new, **{cache_kwarg(model): c}, **gen_kw)
        fn.box = cache_box  # type: ignore[attr-defined]
        return fn

    chunk = getattr(ctx.args, "prefill_chunk", None) if ctx.args is not None else None
    chunk = chunk or (512 if ctx.cuda else max(1, shape["prompt"] // 4))

    def chunk_mode() -> str:
        # A chunk after the first attends with an explicit mask, which the flash kernel does not take.
        return "flash+efficient" if mode_box["mode"] == "flash" else mode_box["mode"]

    def chunked(max_new: int = new, **kw) -> torch.Tensor:
        return generate(max_new, prefill_chunk_size=chunk, mode=chunk_mode(), **kw)

    lean = bool(getattr(ctx.args, "lean", False)) if ctx.args is not None else False
    layers = shape["layers"]
    forced = getattr(ctx.args, "attention", None) if ctx.args is not None else None
    if forced:
        mode_box["mode"] = forced
    elif ctx.cuda and not getattr(ctx.args, "no_probe", False):
        mode_box["mode"] = _probe(generate, ours, full_kv, layers, mode_box)
    print(f"[kv] attention mode for the variants: {mode_box['mode']}", flush=True)
    if getattr(ctx.args, "profile_decode", False) if ctx.args is not None else False:
        return _decode_study(ctx, model, prompts, shape, mode_box["mode"], generate, ours, name, full_kv,
                             layer_bytes, link)
    variants: list[tuple[str, Callable[..., torch.Tensor], bool]] = [
        ("GPU-only DynamicCache", lambda max_new=new: generate(max_new), False)]
    if not getattr(ctx.args, "no_hf_offloaded", False):
        variants.append(("transformers offloaded",
                         lambda max_new=new: generate(max_new, cache_implementation="offloaded"), True))
    for share in ctx.args.resident if ctx.args is not None else [0.0, 0.25, 0.5]:
        k = int(round(share * layers))
        variants.append((f"ours R={k}", ours(resident_layers=k), False))
    variants.append(("ours 50% KV budget", ours(gpu_budget_bytes=full_kv // 2), False))
    variants.append(("ours default", ours(default=True), False))
    if ctx.cuda and not lean:
        variants.append(("ours R=50% first", ours(resident_layers=layers // 2, placement="first"), False))
    if not lean:
        variants.append(("ours all resident", ours(resident_layers=layers), False))
    # The decode step is bound by the host at the anchor, and the same DynamicCache decode gets slower later in a
    # process (docs/kv_offload.md): this row shows that drift next to ours.
    variants.append(("GPU-only DynamicCache, again", lambda max_new=new: generate(max_new), False))

    results: list[Result] = []
    reference: torch.Tensor | None = None
    for variant, fn, needs_cuda in variants:
        results.append(_one(ctx, name, variant, fn, needs_cuda, shape, full_kv, layer_bytes, link, reference))
        if reference is None and results[-1].extra.get("_out") is not None:
            reference = results[-1].extra["_out"]
        results[-1].extra.pop("_out", None)
        _progress(ctx, results)
        gc.collect()
    # The capped variants prefill in chunks, which changes the prefill's numbers: their reference is GPU-only
    # with the same chunks, uncapped, and the tokens it gives against the one-forward prefill are recorded too.
    r = _one(ctx, name, "GPU-only chunked prefill", chunked, False, shape, full_kv, layer_bytes, link, reference)
    chunk_reference = r.extra.pop("_out", None)
    r.extra.update(prefill_chunk_size=chunk, attention=chunk_mode())
    results.append(r)
    _progress(ctx, results)
    gc.collect()

    cap = getattr(ctx.args, "cap_gib", 0.0) if ctx.args is not None else 0.0
    if ctx.cuda and cap:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        capped = f"{name}-cap{cap:g}GiB"
        # With the prompt in one forward, the prefill's activations alone can exceed the cap (docs/kv_offload.md,
        # "Long prompts under a memory cap"). Chunks bound those activations by design. Expandable segments
        # (keeping reserved memory close to allocated) are only the fallback, and the row says when.
        set_alloc = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        capped_variants: list[tuple[str, Callable[[], Callable[..., torch.Tensor]], bool]] = [
            ("GPU-only DynamicCache", lambda: chunked, False),
            ("transformers offloaded",
             lambda: (lambda max_new=new: chunked(max_new, cache_implementation="offloaded")), False),
            ("ours default", lambda: ours(default=True, chunk=chunk), True),
            ("ours max_length given", lambda: ours(chunk=chunk), True),
            ("ours default, prompt in one forward", lambda: ours(default=True), False),
        ]

        def run_capped(variant: str, fn: Callable[..., torch.Tensor], expandable: bool) -> Result:
            gc.collect()
            torch.cuda.empty_cache()
            reset_memory(dev)
            if expandable:
                try:
                    set_alloc("expandable_segments:True")
                except RuntimeError as e:  # this torch cannot switch it at run time: the row says so
                    print(f"[kv] expandable segments could not be turned on: {e}", flush=True)
                    expandable = False
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total), index)
            try:
                ref = reference if "one forward" in variant else chunk_reference
                r = _one(ctx, capped, variant, fn, False, shape, full_kv, layer_bytes, link, ref)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, index)
                box = getattr(fn, "box", None)
                if box and box.get("c") is not None:
                    box["c"].close()  # a cache left by a failed call: unpin its pool now
                if expandable:
                    set_alloc("expandable_segments:False")
            r.extra.pop("_out", None)
            r.extra.update(cap_gib=cap, expandable_segments=expandable,
                           prefill_chunk_size=None if "one forward" in variant else chunk)
            return r

        for variant, make, retry in capped_variants:
            r = run_capped(variant, make(), False)
            if retry and set_alloc is not None and r.error and "OutOfMemory" in r.error:
                results.append(r)
                _progress(ctx, results)
                r = run_capped(variant + ", expandable segments", make(), True)
            results.append(r)
            _progress(ctx, results)
        gc.collect()
        torch.cuda.empty_cache()
    for preset in dict.fromkeys(r.preset for r in results):
        _verdict(results, preset, shape)
    return results


def _progress(ctx: BenchContext, results: list[Result]) -> None:
    """Print the variant just measured and keep a partial JSON, so a later failure loses nothing."""
    import json

    r = results[-1]
    row = r.row()
    keep = ("tokens_per_s", "peak_mem_gib", "kv_gpu_fraction", "tokens_equal", "tokens_match_frac",
            "first_diff_step", "resident", "prefill_ms", "decode_ms_per_token",
            "pcie_bound_ms_per_token", "link_gb_per_step", "late_fetches", "first_call_s", "error")
    print(f"[kv] {r.preset} | {r.variant}: " + ", ".join(f"{k}={row.get(k)}" for k in keep if row.get(k) is not None),
          flush=True)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "bench_kv_partial.json").write_text(json.dumps([x.row() for x in results], indent=1, default=str))


MODES = ("default", "flash", "efficient", "cudnn", "deterministic")


class _mode:
    """Run generate under one attention setting: torch's default SDPA choice, one forced SDPA backend, or
    ``torch.use_deterministic_algorithms``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ctx = None
        self._old = None

    def __enter__(self):
        if self.name in ("flash", "efficient", "cudnn", "flash+efficient"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = {"flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                        "cudnn": [SDPBackend.CUDNN_ATTENTION],
                        "flash+efficient": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]}[self.name]
            self._ctx = sdpa_kernel(backends)
            self._ctx.__enter__()
        elif self.name == "deterministic":
            self._old = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True, warn_only=True)
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        if self._old is not None:
            torch.use_deterministic_algorithms(self._old)
        return False


def _probe(generate, ours, full_kv: int, layers: int, mode_box: dict) -> str:
    """Greedy tokens are compared bitwise, so first check that the GPU-only run repeats itself and which attention
    setting makes the runs agree: 8 new tokens from the same prompts, GPU-only twice, transformers' offloaded cache,
    ours all resident and ours at half the KV bytes. Returns the first setting where GPU-only repeats and ours
    matches it (else "default")."""
    chosen = None
    for m in MODES:
        mode_box["mode"] = m
        row: dict[str, Any] = {}
        try:
            with torch.inference_mode():
                a1, a2 = generate(8), generate(8)
                if m == "default":
                    row["hf_offloaded"] = _first_diff(generate(8, cache_implementation="offloaded"), a1)
                o1, o2 = ours(resident_layers=layers), ours(gpu_budget_bytes=full_kv // 2)
                row["gpu_only_repeat"] = _first_diff(a2, a1)
                row["ours_all_resident"] = _first_diff(o1(8), a1)
                row["ours_50pct"] = _first_diff(o2(8), a1)
                for f in (o1, o2):
                    f.box["c"].close()
                if row["ours_all_resident"] != "equal" and row["gpu_only_repeat"] == "equal":
                    # Diagnosis: do the strided views (a prefix of a longer buffer) change the attention kernels?
                    o3 = ours(resident_layers=layers)
                    o3(1)
                    eng = o3.box["c"].engine
                    plain_update = eng.update
                    eng.update = lambda *a: tuple(t.contiguous() for t in plain_update(*a))  # noqa: B023
                    row["ours_contiguous_copies"] = _first_diff(o3(8), a1)
                    o3.box["c"].close()
        except Exception as e:  # a backend that cannot run this shape
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        ok = "error" not in row and all(v == "equal" for k, v in row.items()
                                        if k not in ("hf_offloaded", "ours_contiguous_copies"))
        verdict = "  <- all equal" if ok else ""
        print(f"[kv] probe {m:<13} " + ", ".join(f"{k}: {v}" for k, v in row.items()) + verdict, flush=True)
        if ok and chosen is None:
            chosen = m
            break
    return chosen or "default"


def _first_diff(out: torch.Tensor, ref: torch.Tensor) -> str:
    if torch.equal(out, ref):
        return "equal"
    same = out == ref
    cols = (~same).any(0).nonzero()
    return f"differ from position {int(cols[0])} ({same.float().mean().item():.1%} of tokens equal)"


def _one(ctx, preset_name, variant, fn, needs_cuda, shape, full_kv, layer_bytes, link, reference) -> Result:
    new, batch = shape["new_tokens"], shape["batch"]
    r = Result(ctx.suite, preset_name, variant, None, tokens_per_step=batch * new)
    if needs_cuda and not ctx.cuda:
        r.error = "skipped: transformers' offloaded cache needs CUDA"
        return r
    reset_memory(ctx.device)
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            fn()  # first call: allocation, pinning, kernel selection
            sync(ctx.device)
            r.extra["first_call_s"] = round(time.perf_counter() - t0, 3)
            r.timing, out = _time_calls(fn, ctx.device, max(0, ctx.warmup - 1), ctx.iters)
            prefill, _ = _time_calls(lambda: fn(1), ctx.device, 0, 1)
        r.peak_mem_bytes = peak_memory(ctx.device)
        r.extra["_out"] = out
        r.extra["tokens_equal"] = None if reference is None else bool(torch.equal(out, reference))
        if reference is not None and out.shape == reference.shape:
            same = (out == reference)[:, shape["prompt"]:]
            r.extra["tokens_match_frac"] = round(same.float().mean().item(), 4)
            cols = (~same).any(0).nonzero()
            r.extra["first_diff_step"] = int(cols[0]) if len(cols) else None
        r.extra["prefill_ms"] = round(prefill.median_ms, 2)
        r.extra["decode_ms_per_token"] = round((r.timing.median_ms - prefill.median_ms) / max(1, new - 1), 3)
        box = getattr(fn, "box", None)
        cache = box.get("c") if box else None
        if cache is not None and cache.plan is not None:
            plan = cache.plan
            r.extra.update(kv_gpu_gib=round(plan.gpu_kv_bytes / 2**30, 3), kv_gpu_fraction=round(plan.gpu_fraction, 3),
                           resident=len(plan.resident), offloaded=len(plan.offloaded), slots=plan.slots,
                           host_pool_gib=round(plan.host_kv_bytes / 2**30, 3), build_s=round(box.get("built_s", 0), 3))
            mean_len = shape["prompt"] + new // 2
            step_bytes = plan.link_bytes_per_step(mean_len)
            r.extra["link_gb_per_step"] = round(step_bytes / 1e9, 3)
            if link:
                bound_ms = step_bytes / (link["h2d_plain_gbps"] * 1e9) * 1e3
                r.extra["pcie_bound_ms_per_token"] = round(bound_ms, 2)
                bound_s = (prefill.median_ms + (new - 1) * bound_ms) / 1e3
                r.extra["pcie_bound_tokens_per_s"] = round(batch * new / bound_s, 1) if bound_ms else None
            s = cache.stats
            r.extra.update(late_fetches=s.late_fetches, ring_hits=s.ring_hits)
            cache.close()
        elif variant.startswith("GPU-only"):
            r.extra.update(kv_gpu_gib=round(full_kv / 2**30, 3), kv_gpu_fraction=1.0)
        elif variant.startswith("transformers"):
            # Two layers on the GPU at a time (the one computing, the one prefetched), moved whole both ways.
            r.extra.update(kv_gpu_gib=round(2 * layer_bytes / 2**30, 3),
                           kv_gpu_fraction=round(2 / shape["layers"], 3),
                           link_gb_per_step=round(2 * full_kv * (shape["prompt"] + new // 2)
                                                  / (shape["prompt"] + new) / 1e9, 3))
    except Exception as e:  # a variant that fails (out of memory under the cap) is a result
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if not isinstance(e, torch.OutOfMemoryError):
            traceback.print_exc()
        r.timing = None
    reset_memory(ctx.device)
    return r


def _verdict(results: list[Result], name: str, shape: dict[str, int]) -> None:
    rows = {r.variant: r for r in results if r.preset == name}
    tps = {v: (r.tokens_per_step / (r.median_ms / 1e3) if r.median_ms else None) for v, r in rows.items()}
    gpu, hf = tps.get("GPU-only DynamicCache"), tps.get("transformers offloaded")
    for r in results:
        t = r.tokens_per_step / (r.median_ms / 1e3) if r.median_ms else None
        if r.preset == name and t:
            r.extra["vs_gpu_only"] = round(t / gpu, 3) if gpu else None
            r.extra["vs_hf_offloaded"] = round(t / hf, 3) if hf else None
    cap = next((r.extra["cap_gib"] for r in rows.values() if r.extra.get("cap_gib")), None)
    print(f"\n[kv/{name}] anchor (docs/benchmarks.md): GPU-only {ANCHOR_GPU_ONLY_TPS} tokens/s, transformers offloaded "
          f"{ANCHOR_HF_OFFLOADED_TPS} tokens/s" + (f"; memory cap {cap:g} GiB" if cap else ""))
    for v, r in rows.items():
        t = tps.get(v)
        if not t:
            print(f"  {v:<24} {r.error}")
            continue
        e = r.extra
        print(f"  {v:<24} {t:8.1f} tokens/s  {e.get('vs_gpu_only') or 0:5.2f}x GPU-only  "
              f"{(e.get('vs_hf_offloaded') or 0):5.2f}x HF-offloaded  peak {(r.peak_mem_bytes or 0) / 2**30:6.2f} GiB  "
              f"KV on GPU {e.get('kv_gpu_fraction', 0):.0%}  same tokens: {e.get('tokens_equal')}  "
              f"decode {e.get('decode_ms_per_token')} ms/token  "
              f"PCIe bound {e.get('pcie_bound_ms_per_token', '-')} ms/token")
    ours = [(v, tps[v], rows[v]) for v in rows if v.startswith("ours") and tps.get(v)]
    if gpu and hf and ours:
        ok_hf = [v for v, t, _ in ours if t >= GOAL_VS_HF * hf]
        half = [(v, t) for v, t, r in ours if (r.extra.get("kv_gpu_fraction") or 1) <= GOAL_KV_FRACTION]
        best = max(half, key=lambda x: x[1]) if half else None
        print(f"  goal >= {GOAL_VS_HF}x transformers offloaded: {', '.join(ok_hf) or 'none'} -> "
              f"{'met' if ok_hf else 'NOT met'}")
        if best:
            ratio = best[1] / gpu
            print(f"  goal >= {GOAL_VS_GPU_ONLY}x GPU-only at <= {GOAL_KV_FRACTION:.0%} KV on GPU: best {best[0]} "
                  f"{ratio:.2f}x -> {'met' if ratio >= GOAL_VS_GPU_ONLY else 'NOT met'}")
    if cap:
        fits = [v for v in rows if v.startswith("ours") and tps.get(v)]
        gpu_row = rows.get("GPU-only DynamicCache")
        oom = gpu_row is not None and "OutOfMemory" in (gpu_row.error or "")
        print(f"  goal: GPU-only runs out of memory under the cap and ours decodes: GPU-only "
              f"{'ran out of memory' if oom else 'did not run out of memory'}; ours decoded: {', '.join(fits) or 'none'}"
              f" -> {'met' if oom and fits else 'NOT met'}")
    # GPU-only with a chunked prefill is compared to the one-forward prefill for information only.
    same = [v for v, r in rows.items() if r.extra.get("tokens_equal") is False and not v.startswith("GPU-only")]
    print(f"  tokens bitwise equal to GPU-only: {'all' if not same else 'NOT for ' + ', '.join(same)}")


# ------------------------------------------------------------------------------------ --profile-decode
#
# At the anchor a decode step is bound by the host (the GPU idles for most of it), and the same DynamicCache decode
# gets slower later in a process (docs/kv_offload.md, "Decode with every layer resident"). A torch.profiler session
# also leaves CUPTI loaded, which slows every later launch (pytorch/pytorch#144455). So variants compared here run
# interleaved, round by round, and profiling comes last.


def _median_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 3, iters: int = 15) -> float:
    return _time_calls(fn, device, warmup, iters)[0].median_ms


def _layout_study(shape: dict[str, int], device: torch.device, dtype: torch.dtype, mode: str) -> list[dict]:
    """One layer's decode attention (under `mode`) on keys/values in each layout attention may get: a `torch.cat`
    result (DynamicCache), views of longer buffers with several row lengths (ours), a (B, M, H, D) storage; plus the
    cost of writing one token into a view and of a contiguous copy of it."""
    b, hk, hq = shape["batch"], shape["kv_heads"], shape["heads"]
    d = shape["hidden"] // hq
    n = shape["prompt"] + shape["new_tokens"] // 2
    q = torch.randn(b, hq, 1, d, device=device, dtype=dtype)
    new = torch.randn(b, 1, hk, d, device=device, dtype=dtype).transpose(1, 2)  # a projection's layout
    exact = shape["prompt"] + shape["new_tokens"]
    default = int(math.ceil((shape["prompt"] + 256) / 256) * 256)
    layouts: list[tuple[str, Callable[[], torch.Tensor]]] = [
        (f"contiguous ({n} tokens, DynamicCache)", lambda: torch.randn(b, hk, n, d, device=device, dtype=dtype))]
    for rows in dict.fromkeys([exact, exact + 1, default, default + 1]):
        layouts.append((f"view of {rows}-token rows", lambda r=rows: torch.randn(b, hk, r, d, device=device,
                                                                                 dtype=dtype)[:, :, :n]))
    layouts.append((f"view of (B, {default}, H, D) storage",
                    lambda: torch.randn(b, default, hk, d, device=device, dtype=dtype).transpose(1, 2)[:, :, :n]))
    out = []
    for label, make in layouts:
        k, v = make(), make()
        with _mode(mode), torch.inference_mode():
            attn = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),  # noqa: B023
                              device)
        write = _median_ms(lambda: k[:, :, n - 1:n].copy_(new), device)  # noqa: B023
        row = {"layout": label, "k_stride": list(k.stride()), "attention_us": round(attn * 1e3, 1),
               "write_token_us": round(write * 1e3, 1)}
        if not k.is_contiguous():
            row["contiguous_copy_us"] = round(_median_ms(lambda: (k.contiguous(), v.contiguous()), device) * 1e3, 1)  # noqa: B023
        print(f"[kv/layout] {label:<42} attention {row['attention_us']:8.1f} us  write 1 token "
              f"{row['write_token_us']:6.1f} us  k/v contiguous copy {row.get('contiguous_copy_us', '-')} us  "
              f"stride {tuple(k.stride())}", flush=True)
        out.append(row)
    return out


def _step_profile(model, prompts: torch.Tensor, make_cache: Callable[[], Any], device: torch.device, mode: str,
                  steps: int, profile_steps: int) -> dict[str, Any]:
    """Prefill, then greedy decode steps through the model's forward (no mask: attention's decode path, as in
    `generate` without padding): ms per step over `steps` steps, then the kernels of `profile_steps` steps by GPU
    time and the busiest host-side ops (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_gh.kv import cache_kwarg

    cache = make_cache()
    with _mode(mode), torch.inference_mode():
        kv_name = cache_kwarg(model)
        out = model(prompts, **{kv_name: cache}, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)

        def step():
            nonlocal tok
            tok = model(tok, **{kv_name: cache}, use_cache=True).logits[:, -1:].argmax(-1)

        ms = _median_ms(step, device, warmup=3, iters=steps)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(profile_steps):
                step()
            sync(device)
    avgs = prof.key_averages()
    kernels = [e for e in avgs if "cuda" in str(getattr(e, "device_type", "")).lower()]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in kernels)
    rows = [f"{'us/step':>10} {'calls/step':>10} {'share':>6}  kernel"]
    for e in kernels[:15]:
        rows.append(f"{e.self_device_time_total / profile_steps:10.1f} {e.count / profile_steps:10.1f} "
                    f"{e.self_device_time_total / max(1e-9, total_us):6.1%}  {e.key[:110]}")
    cpu_ops = sorted((e for e in avgs if e not in kernels), key=lambda e: -e.self_cpu_time_total)[:8]
    rows.append(f"{'host us':>10} {'calls/step':>10}         busiest host-side ops")
    for e in cpu_ops:
        rows.append(f"{e.self_cpu_time_total / profile_steps:10.1f} {e.count / profile_steps:10.1f}         "
                    f"{e.key[:110]}")
    close = getattr(cache, "close", None)
    if close:
        close()
    return {"ms_per_step": round(ms, 3), "table": "\n".join(rows),
            "gpu_kernel_ms_per_step": round(total_us / 1e3 / profile_steps, 3) if device.type == "cuda" else None}


def _decode_study(ctx, model, prompts, shape, mode, generate, ours, name, full_kv, layer_bytes, link) -> list[Result]:
    import json

    from transformers import DynamicCache

    from lightning_gh.kv import OffloadedKVCache

    dev, new = ctx.device, shape["new_tokens"]
    report: dict[str, Any] = {"attention": mode, "shape": shape, "rounds": []}
    pair = [("GPU-only DynamicCache", lambda max_new=new: generate(max_new)), ("ours default", ours(default=True))]
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for label, fn in pair:  # first calls: allocation, kernel choice
            outs[label] = fn()
        for r in range(ctx.iters):
            row = {}
            for label, fn in pair[r % 2:] + pair[:r % 2]:  # alternate which variant goes first
                total = _median_ms(lambda: fn(), dev, warmup=0, iters=1)  # noqa: B023
                prefill = _median_ms(lambda: fn(1), dev, warmup=0, iters=1)  # noqa: B023
                row[label] = {"generate_ms": round(total, 2), "prefill_ms": round(prefill, 2),
                              "decode_ms_per_token": round((total - prefill) / max(1, new - 1), 3)}
            report["rounds"].append(row)
            print(f"[kv/interleaved] round {r}: " + ", ".join(f"{k} {v['decode_ms_per_token']} ms/token"
                                                          for k, v in row.items()), flush=True)
    for label, _ in pair:
        dec = [row[label]["decode_ms_per_token"] for row in report["rounds"]]
        report[label] = {"decode_ms_per_token_median": round(statistics.median(dec), 3), "per_round": dec}
    ref = outs["GPU-only DynamicCache"]
    report["tokens_equal"] = bool(torch.equal(outs["ours default"], ref))
    cache = pair[1][1].box.get("c")
    report["ours_plan"] = cache.describe() if cache is not None else None
    if cache is not None:
        cache.close()
    g, o = (report[k]["decode_ms_per_token_median"] for k, _ in pair)
    print(f"[kv/interleaved] decode ms/token, median of {ctx.iters} rounds: GPU-only {g}, ours default {o} "
          f"({o / g:.3f}x); tokens equal: {report['tokens_equal']}; ours: {report['ours_plan']}", flush=True)

    results = [_one(ctx, name, "ours R=0", ours(resident_layers=0), False, shape, full_kv, layer_bytes, link, ref)]
    results[-1].extra.pop("_out", None)
    _progress(ctx, results)
    gc.collect()

    dtype = next(model.parameters()).dtype
    report["layouts"] = _layout_study(shape, dev, dtype, mode)
    gc.collect()
    report["steps"] = {}
    backend = {} if ctx.cuda else {"backend": "host-copy"}
    for label, make in [("GPU-only DynamicCache", lambda: DynamicCache(config=model.config)),
                        ("ours default", lambda: OffloadedKVCache(model, **backend))]:
        r = _step_profile(model, prompts, make, dev, mode, steps=16 if ctx.cuda else 2,
                          profile_steps=4 if ctx.cuda else 1)
        report["steps"][label] = r
        print(f"\n[kv/profile] {label}: {r['ms_per_step']} ms per decode step, GPU kernels "
              f"{r['gpu_kernel_ms_per_step']} ms per step\n{r['table']}", flush=True)
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "kv_decode_study.json").write_text(json.dumps(report, indent=1, default=str))
    return results
