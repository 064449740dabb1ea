"""The GPU suite benchmarks/suites/profiler.py runs end to end on the CPU (functional only: no timing asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profiler_suite_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--suite", "profiler", "--preset", "tiny", "--iters", "2", "--warmup",
         "5", "--device", "cpu", "--variants", "plain,selective", "--backends", "torch", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_profiler.json").read_text())
    plain, sel = data["results"]
    assert (plain["variant"], sel["variant"]) == ("plain", "selective (outside window)")
    assert plain["error"] is None and sel["error"] is None and len(sel["samples_ms"]) == 1  # 2 periods -> 1 gap
    assert sel["windows_written"] == [[1, 3]] and sel["window_steps"] == [1, 2, 3]
    assert "rank0_steps1-3.pt.trace.json.gz" in sel["files"] and sel["verdict"] == "cpu-only"
    assert abs(sel["phase_shares_sum"] - 1.0) < 1e-4 and "overhead_pct" in sel
    assert (tmp_path / "profiler" / "tiny_selective" / "rank0_steps1-3.summary.md").exists()
    assert "CHECK tiny: window steps [1, 2, 3]" in proc.stdout

