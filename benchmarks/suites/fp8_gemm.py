"""Suite `fp8_gemm`: the GEMM cross-over behind the layer filter's ``min_dim`` rule.

One Linear layer, forward + backward (three GEMMs), fp32 master weight under bf16 autocast, on M tokens: bf16
(eager and compiled) against torchao float8 (compiled; tensorwise and rowwise) and Transformer Engine fp8 (delayed,
current and block scaling), for square sizes and the Llama presets' MLP shapes. The fp8 kinds whose backend is
missing are left out. The table gives each fp8 kind's speed-up (torchao against compiled bf16, TE against eager
bf16) and, per M, the smallest square size from which fp8 is faster at every larger size tried.

    python benchmarks/run.py --suite fp8_gemm
    python benchmarks/run.py --suite fp8_gemm --tokens 4096 8192 --dims 1024 2048 4096 --shapes 4096x14336
"""

from __future__ import annotations

import torch

from common import BenchContext, Result, reset_memory, time_fn
from lightning_gh.precision import LayerFilter
from suites._fp8 import Variant, error_text

DEFAULT_PRESETS = ["small"]  # unused: the shapes come from --dims and --shapes

KINDS: dict[str, Variant] = {
    "bf16": Variant("bf16", precision="bf16-mixed"),
    "bf16-compiled": Variant("bf16 compiled", precision="bf16-mixed", compile="model"),
    "ao-tensorwise": Variant("fp8-ao-tensorwise compiled", plugin=("fp8-ao-tensorwise", {}), compile="model"),
    "ao-rowwise": Variant("fp8-ao-rowwise compiled", plugin=("fp8-ao-rowwise", {}), compile="model"),
    "te-delayed": Variant("fp8-te-delayed", plugin=("fp8-te-delayed", {})),
    "te-current": Variant("fp8-te-current", plugin=("fp8-te-current", {})),
    "te-block": Variant("fp8-te-block", plugin=("fp8-te-block", {})),
}


def add_arguments(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens (M) per GEMM")
    ap.add_argument("--dims", type=int, nargs="+", default=[512, 768, 1024, 1536, 2048, 3072, 4096, 8192],
                    help="square in=out sizes")
    ap.add_argument("--shapes", nargs="*", default=["4096x14336", "14336x4096", "2048x5632", "5632x2048",
                                                    "512x1408", "1408x512"],
                    help="extra in x out shapes (default: the Llama presets' MLP shapes)")


def _step(kind: str, m: int, k: int, n: int, device: torch.device):
    """One Linear(k -> n) forward + backward on m tokens, fp32 master weight under bf16 autocast."""
    variant = KINDS[kind]
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=device)
    fp8_ctx = None
    if variant.backend == "ao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        holder = torch.nn.Sequential(lin)
        recipe = variant.plugin[0].removeprefix("fp8-ao-")
        convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(recipe))
        lin = holder[0]
    elif variant.backend == "te":
        import transformer_engine.pytorch as te

        from lightning_gh.precision.te import make_recipe, te_autocast

        lin = te.Linear(k, n, bias=False, params_dtype=torch.float32, device=device)
        recipe = make_recipe(variant.plugin[0].removeprefix("fp8-te-"))

        def fp8_ctx():
            return te_autocast(recipe)

    fn = torch.compile(lin) if variant.compiled else lin

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if fp8_ctx is not None:
                with fp8_ctx():
                    y = fn(x)
            else:
                y = fn(x)
        y.backward(grad)
        x.grad = None
        lin.weight.grad = None

    return step


def _available_kinds() -> list[str]:
    from lightning_gh.precision.checks import ao_missing_reason, te_missing_reason

    missing = {"ao": ao_missing_reason() is not None, "te": te_missing_reason() is not None}
    return [k for k, v in KINDS.items() if v.backend is None or not missing[v.backend]]


def _speedup(row: dict[str, float | None], kind: str) -> float | None:
    base = row.get("bf16-compiled") if KINDS[kind].backend == "ao" else row.get("bf16")
    return base / row[kind] if base and row.get(kind) else None


def _crossover(table: dict[tuple[int, int, int], dict[str, float | None]], m: int, kind: str,
               squares: list[int]) -> int | None:
    """The smallest square size from which every larger size tried is faster in fp8."""
    wins = [(d, (_speedup(table[(m, d, d)], kind) or 0) > 1.0) for d in squares]
    for i, (d, _) in enumerate(wins):
        if all(w for _, w in wins[i:]):
            return d
    return None


def run(ctx: BenchContext) -> list[Result]:
    kinds = _available_kinds()
    shapes = [(d, d) for d in ctx.args.dims]
    shapes += [tuple(int(v) for v in spec.lower().split("x")) for spec in ctx.args.shapes]
    results: list[Result] = []
    table: dict[tuple[int, int, int], dict[str, float | None]] = {}
    for m in ctx.args.tokens:
        for k, n in shapes:
            row = table.setdefault((m, k, n), {})
            for kind in kinds:
                reset_memory(ctx.device)
                # One "preset" per shape, so the runner's speedup_vs_first is each kind against eager bf16.
                r = Result(ctx.suite, f"gemm {m}x{k}x{n}", kind, None, m, 6.0 * m * k * n)
                r.extra.update({"kind": kind, "m": m, "k": k, "n": n})
                try:
                    step = _step(kind, m, k, n, ctx.device)
                    r.timing = time_fn(step, ctx.device, max(ctx.warmup, 3), ctx.iters)
                except Exception as e:
                    r.error = error_text(e)
                row[kind] = r.median_ms
                results.append(r)
                step = None
                torch._dynamo.reset()
    fp8_kinds = [k for k in kinds if KINDS[k].backend is not None]

    def fmt(v: float | None) -> str:
        return f"{v:.3f}" if v else "-"

    lines = ["\n### GEMM cross-over: one Linear forward+backward (3 GEMMs), fp32 master weight, bf16 autocast",
             "speed-up of each fp8 kind over bf16 (torchao against compiled bf16, TE against eager bf16)",
             "| M | in | out | bf16 ms | bf16 compiled ms | " + " | ".join(fp8_kinds) + " |",
             "|---:|---:|---:|---:|---:|" + "---:|" * len(fp8_kinds)]
    for (m, k, n), row in table.items():
        cells = [f"{x:.2f}x" if (x := _speedup(row, kind)) else "-" for kind in fp8_kinds]
        lines.append(f"| {m} | {k} | {n} | {fmt(row.get('bf16'))} | {fmt(row.get('bf16-compiled'))} | "
                     + " | ".join(cells) + " |")
    squares = sorted(ctx.args.dims)
    for m in ctx.args.tokens:
        for kind in fp8_kinds:
            start = _crossover(table, m, kind, squares)
            lines.append(f"cross-over M={m} {kind}: fp8 faster from in=out={start} on" if start else
                         f"cross-over M={m} {kind}: fp8 not consistently faster on the square sizes tried")
    lines.append(f"layer filter default: min_dim={LayerFilter().min_dim} (convert when min(in, out) >= min_dim)")
    print("\n".join(lines), flush=True)
    return results
