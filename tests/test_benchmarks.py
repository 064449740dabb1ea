"""The benchmark runner works end to end on the CPU (functional run; timings are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_runner_rejects_unknown_suite():
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--suite", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr


def test_ratios_are_against_the_first_variant_even_when_it_failed():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import Result, Timing, add_ratios

    t = lambda ms: Timing(ms, ms, ms, [ms])  # noqa: E731
    rs = [Result("s", "large", "plain", None, error="OutOfMemoryError"), Result("s", "large", "compiled", t(100.0)),
          Result("s", "large", "fp8", t(50.0)), Result("s", "small", "plain", t(10.0)), Result("s", "small", "x", t(5.0))]
    add_ratios(rs)
    assert [r.extra["speedup_vs_first"] for r in rs] == [None, None, None, 1.0, 2.0]


def test_suite_help_lists_the_suites_own_options():
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--suite", "kv", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--iters" in proc.stdout and "--resident" in proc.stdout, proc.stderr[-2000:]
    missing = subprocess.run([sys.executable, "benchmarks/run.py"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "required: --suite" in missing.stderr
