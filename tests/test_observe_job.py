"""benchmarks/observe_job.py: the overhead table and the kept trace (the GPU runs are the benchmark's own)."""

import gzip
import json

from _benchmarks import load  # benchmarks/<name>.py as a module

obs = load("observe_job")


def test_overheads_take_the_median_of_the_rounds_against_plain():
    rows = [{"model": "m", "variant": v, "step_ms": ms} for v, ms in
            [("plain", 10.0), ("memory", 10.4), ("plain", 10.2), ("memory", 10.1), ("plain", 9.8), ("memory", 10.3),
             ("history", None)]]
    got = {t["variant"]: t for t in obs.overheads(rows)}
    assert got["plain"]["step_ms"] == 10.0 and got["memory"]["step_ms"] == 10.3
    assert got["memory"]["overhead_pct"] == 3.0
    assert got["history"]["step_ms"] is None and got["history"]["overhead_pct"] is None


def test_the_kept_trace_is_gzipped_and_the_verdict_read(tmp_path):
    trace = tmp_path / "w.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    summary = tmp_path / "w.summary.json"
    summary.write_text(json.dumps({"verdict": {"bound": "launch"}, "gpu": {"busy_share": 0.4}}))
    out = tmp_path / "out"
    out.mkdir()
    kept = obs.keep_trace({"model": "small", "files": {"torch": str(trace), "summary_json": str(summary)}}, out)
    assert kept == {"trace": "kineto_small_hf.json.gz", "verdict": {"bound": "launch"}, "gpu_busy_share": 0.4}
    with gzip.open(out / kept["trace"]) as f:
        assert json.load(f) == {"traceEvents": []}
