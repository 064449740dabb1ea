"""The GPU suite benchmarks/suites/profiler.py runs end to end on the CPU (functional only: no timing asserted).

In-process through the runner's main (tests/test_benchmarks.py runs the command line in a subprocess once), so the
test pays no second interpreter start and import of torch and Lightning.
"""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profiler_suite_runs_on_cpu(tmp_path, capsys, monkeypatch, frozen_heap):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delenv("LGH_PROFILE_START_STOP", raising=False)  # the suite drops it: put back what was there
    import run as bench_run

    rc = bench_run.main(["--suite", "profiler", "--preset", "tiny", "--iters", "2", "--warmup", "5", "--device", "cpu",
                         "--variants", "plain,selective", "--backends", "torch", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    data = json.loads((tmp_path / "bench_profiler.json").read_text())
    plain, sel = data["results"]
    assert (plain["variant"], sel["variant"]) == ("plain", "selective (outside window)")
    assert plain["error"] is None and sel["error"] is None and len(sel["samples_ms"]) == 1  # 2 periods -> 1 gap
    assert sel["windows_written"] == [[1, 3]] and sel["window_steps"] == [1, 2, 3]
    assert "rank0_steps1-3.pt.trace.json.gz" in sel["files"] and sel["verdict"] == "cpu-only"
    assert abs(sel["phase_shares_sum"] - 1.0) < 1e-4 and "overhead_pct" in sel
    assert (tmp_path / "profiler" / "tiny_selective" / "rank0_steps1-3.summary.md").exists()
    assert "CHECK tiny: window steps [1, 2, 3]" in out
