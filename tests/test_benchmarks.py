"""The benchmark runner works end to end on the CPU (functional runs; timings are not asserted).

One run goes through ``python benchmarks/run.py`` in a subprocess (the command line the docs give); the others
call the runner's ``main`` in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import run as runner  # noqa: E402  (puts benchmarks/ on sys.path: `common`, `suites`)
from common import Result, Timing, add_ratios  # noqa: E402
from suites import _fp8, fp8_gemm, fp8_steps  # noqa: E402


def test_baseline_suite_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--suite", "baseline", "--preset", "tiny", "--iters", "2",
         "--warmup", "1", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_baseline.json").read_text())
    variants = [r["variant"] for r in data["results"]]
    assert variants == ["eager step", "compiled step", "eager fwd+bwd", "compiled fwd+bwd", "lightning bf16-mixed"]
    for r in data["results"]:
        assert r["error"] is None and r["median_ms"] > 0 and len(r["samples_ms"]) == 2
    assert data["results"][0]["speedup_vs_first"] == 1.0
    assert "| tiny   | eager step" in proc.stdout


def test_runner_rejects_unknown_suite(capsys):
    with pytest.raises(SystemExit) as e:
        runner.main(["--suite", "nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_ratios_are_against_the_first_variant_even_when_it_failed():
    def t(ms: float) -> Timing:
        return Timing(ms, ms, ms, [ms])

    rs = [Result("s", "large", "plain", None, error="OutOfMemoryError"), Result("s", "large", "compiled", t(100.0)),
          Result("s", "large", "fp8", t(50.0)), Result("s", "small", "plain", t(10.0)), Result("s", "small", "x", t(5.0))]
    add_ratios(rs)
    assert [r.extra["speedup_vs_first"] for r in rs] == [None, None, None, 1.0, 2.0]


@pytest.mark.parametrize("suite,option", [("kv", "--resident"), ("fp8_steps", "--check-loss"),
                                          ("fp8_hf", "--master-update"), ("fp8_gemm", "--dims")])
def test_suite_help_lists_the_suites_own_options(capsys, suite, option):
    with pytest.raises(SystemExit) as e:
        runner.main(["--suite", suite, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--iters" in out and option in out


def test_runner_requires_a_suite(capsys):
    with pytest.raises(SystemExit) as e:
        runner.main([])
    assert e.value.code == 2 and "required: --suite" in capsys.readouterr().err


def test_every_suite_imports_and_runs_by_name():
    """Each module in benchmarks/suites/ is a suite the runner lists (helpers start with an underscore)."""
    import importlib

    names = runner.suites()
    assert {"baseline", "fp8_steps", "fp8_hf", "fp8_gemm"} <= set(names) and "_fp8" not in names
    for name in names:
        assert callable(importlib.import_module(f"suites.{name}").run), name


def test_fp8_hf_suite_runs_a_tiny_model_on_cpu(tmp_path, capsys, frozen_heap):
    pytest.importorskip("transformers")
    rc = runner.main(["--suite", "fp8_hf", "--device", "cpu", "--iters", "2", "--warmup", "1", "--out", str(tmp_path),
                      "--shape", "32", "1", "64", "4", "2", "64", "2", "16", "--variants", "bf16"])
    assert rc == 0
    rows = json.loads((tmp_path / "bench_fp8_hf.json").read_text())["results"]
    assert [r["variant"] for r in rows] == ["bf16-mixed eager"] and rows[0]["error"] is None
    assert "fp8 summary: HF LlamaForCausalLM" in capsys.readouterr().out


def test_fp8_variant_names_one_way_to_set_the_precision():
    with pytest.raises(ValueError, match="exactly one of"):
        _fp8.Variant("x", precision="bf16-mixed", plugin=("fp8-auto", {}))
    with pytest.raises(ValueError, match="compile='graph'"):
        _fp8.Variant("x", precision="bf16-mixed", compile="graph")
    backends = {name: _fp8.Variant(name, plugin=(name, {})).backend
                for name in ("fp8-te-delayed", "fp8-ao-rowwise", "fp8-auto")}
    assert backends == {"fp8-te-delayed": "te", "fp8-ao-rowwise": "ao", "fp8-auto": None}
    assert _fp8.Variant("lte", precision="transformer-engine").backend == "te"


@pytest.mark.parametrize("wins,expected", [
    ((False, True, True), 2048),    # faster from the second size on
    ((True, False, True), 4096),    # a loss in the middle: only the last size counts
    ((True, True, True), 1024),
    ((True, True, False), None),    # slower at the largest size: no cross-over
])
def test_gemm_crossover_is_the_smallest_size_from_which_fp8_always_wins(wins, expected):
    squares = [1024, 2048, 4096]
    table = {(8, d, d): {"bf16": 1.0, "te-delayed": 0.5 if w else 2.0} for d, w in zip(squares, wins)}
    assert fp8_gemm._crossover(table, 8, "te-delayed", squares) == expected


def test_fp8_loss_check_flags_curves_outside_one_percent():
    ref = [4.0 - 0.02 * i for i in range(40)]
    rows = []
    curves = {"bf16": ref, "te-current": [x * 1.004 for x in ref], "ao-rowwise": [x * 1.03 for x in ref]}
    for key, curve in curves.items():
        r = Result("fp8_steps", "large", key, None)
        r.extra.update({"key": key, "losses": curve, "first_batch_checksum": 7})
        rows.append(r)
    text = fp8_steps._summary_losses("large", rows)
    assert rows[1].extra["loss_within_tolerance"] and not rows[2].extra["loss_within_tolerance"]
    assert abs(rows[1].extra["loss_max_rel_diff"] - 0.004) < 1e-9
    assert "| ao-rowwise | yes |" in text and text.rstrip().endswith("| NO |")
