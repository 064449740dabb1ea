"""The N-GPU job's benchmark script on the CPU: its smoke mode (2 gloo processes, the ZeRO-3 variant, a tiny model,
each variant its own multi-process job) and its pure decisions (the GPU-only FSDP fit check, fused or foreach, the
rank folding, the four-GH200 forecast)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _benchmarks import load  # benchmarks/<name>.py as a module

job = load("multi_gpu_job")
_PATH = Path(job.__file__)


def test_smoke_runs_the_zero3_variant_as_a_two_process_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "MASTER_", "WORLD_SIZE", "RANK"))}
    proc = subprocess.run([sys.executable, str(_PATH), "--smoke", "--trace", "--variants", "superoffload_fsdp",
                           "--timeout", "110", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "multi_gpu_job.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["superoffload_fsdp"]
    row = rows[0]
    logs = (tmp_path / "logs.txt").read_text()
    assert row["error"] is None, row["error"] + "\n" + logs[-3000:]
    assert row["world"] == 2 and row["step_ms"] > 0 and len(row["losses"]) == 2
    assert sorted(r["rank"] for r in row["notes"]["ranks"]) == [0, 1]  # every rank reported
    opt = row["notes"]["optimizer"]
    assert opt["type"] == "ShardedHostAdamW" and opt["timed_delta"]["steps"] == 1
    assert 0 < opt["local_params"] < row["params"]  # this rank's shards only
    assert "| superoffload_fsdp | smoke |" in proc.stdout and "FORECAST (not measured)" in proc.stdout
    assert not list(tmp_path.glob("child-*")), "the children's files are folded into the JSON lines"
    # --trace: rank 0 profiled one timed step and summarised it (one variant traced: nothing to compare)
    trace = json.loads((tmp_path / "trace-superoffload_fsdp.json").read_text())
    assert trace["wall_ms"] > 0 and trace["step"] == 1 and trace["ranges"]
    assert row["notes"]["trace"]["step"] == 1 and "error" not in row["notes"]["trace"]
    assert "trace superoffload_fsdp (step 1): wall" in logs and not (tmp_path / "trace-compare.md").exists()


def test_no_cuda_without_smoke_exits_cleanly(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the run would start")  # the CPU machines never skip this
    assert job.main(["--out", str(tmp_path)]) == 0
    assert not (tmp_path / "multi_gpu_job.jsonl").exists()


@pytest.mark.parametrize(("shape", "billions"),
                         [("mistral7b", 7.24), ("qwen14b", 14.77), ("qwen32b", 32.76), ("llama70b", 70.55)])
def test_param_counts_of_the_shapes(shape, billions):
    assert job.params_of(job.make_job("superoffload_fsdp", shape)) / 1e9 == pytest.approx(billions, abs=0.01)


def test_param_count_equals_transformers_own_count_for_qwen2():
    transformers = pytest.importorskip("transformers")
    j = job.MJob("x", arch="qwen2", layers=2, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=100)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    assert job.params_of(j) == sum(p.numel() for p in transformers.Qwen2ForCausalLM(cfg).parameters())


@pytest.mark.parametrize(("variant", "params", "world", "gpu_gib", "fits"), [
    ("fsdp_noclip", 7.24e9, 2, 80, True),
    ("fsdp_noclip", 32.76e9, 4, 80, False),
    ("fsdp_clip", 14.77e9, 2, 80, False),
    ("fsdp_clip", 14.77e9, 4, 80, True),
    ("fsdp_cpu_offload", 70e9, 2, 80, True),  # its state is in host memory
    ("superoffload_fsdp", 70e9, 2, 80, True),  # not a GPU-only variant
    ("fsdp_noclip", 70e9, 2, None, True),  # no GPU size known: run it
])
def test_fsdp_fit_check(variant, params, world, gpu_gib, fits):
    why = job.fsdp_fit_reason(variant, int(params), world, gpu_gib and gpu_gib * 2**30)
    assert (why is None) == fits
    if why:
        assert why.startswith("does not fit") and "not run" in why


@pytest.mark.parametrize(("precision", "clip", "fused"), [
    ("bf16-mixed", False, True), ("bf16-mixed", True, False), ("16-mixed", True, False),
    ("bf16-true", True, True), ("32-true", True, True),
])
def test_fused_adamw_table(precision, clip, fused):
    assert job.fused_adamw(precision, clip) is fused


def test_fold_ranks_takes_the_max_peak_and_any_rank_error():
    row = job.Row("superoffload_fsdp")
    job.fold_ranks(row, [{"rank": 1, "peak_gpu_gib": 30.0, "host_rss_gib": 9.0, "host_used_gib": 100.0,
                          "error": "OutOfMemoryError: x"},
                         {"rank": 0, "peak_gpu_gib": 20.0, "host_rss_gib": 8.0, "host_used_gib": 90.0, "error": None}])
    assert row.peak_gpu_gib_ranks == [20.0, 30.0] and row.peak_gpu_gib == 30.0
    assert row.host_rss_gib_ranks == [8.0, 9.0] and row.host_used_gib == 100.0
    assert row.error == "rank 1: OutOfMemoryError: x"


def test_cpu_rate_and_forecast_from_a_row():
    ranks = [{"rank": r, "optimizer": {"timed_steps": 4, "local_params": 1_000_000, "cpu_threads": 8,
                                       "timed_delta": {"cpu_ms": 40.0 + r}}} for r in range(2)]
    row = job.Row("superoffload_fsdp", step_ms=100.0, mfu=0.4, notes={"ranks": ranks})
    rate = job.cpu_ns_per_param(row)
    assert rate == pytest.approx(41.0 / 4 * 1e6 / 1e6 * 8)  # the slower rank, ns per parameter and thread
    text = job.forecast_text([row], 4, 4096)
    assert text.startswith("FORECAST (not measured)") and "4 x GH200" in text and "assumptions" in text
    assert job.forecast_text([job.Row("fsdp_noclip", step_ms=1.0)], 4, 4096).startswith("FORECAST (4 x GH200, 70B): none")


@pytest.mark.parametrize(("ns", "core_bound"), [(0.01, False), (100.0, True)])
def test_forecast_takes_the_slower_of_core_and_memory_bound(ns, core_bound):
    f = job.gh200_forecast(ns, 0.4, params=70_000_000_000)
    assert f["cpu_update_ms"] == max(f["cpu_update_core_bound_ms"], f["cpu_update_memory_bound_ms"])
    assert (f["cpu_update_core_bound_ms"] > f["cpu_update_memory_bound_ms"]) is core_bound
    assert f["step_ms"] >= f["gpu_ms"] and f["mfu"] <= 0.4


def test_table_ratios_against_the_anchor():
    rows = [job.Row("fsdp_noclip", params=7_240_000_000, world=2, step_ms=2000.0, peak_gpu_gib=60.0,
                    losses=[10.0, 9.0]),
            job.Row("superoffload_fsdp", params=7_240_000_000, world=2, step_ms=1600.0, peak_gpu_gib=30.0,
                    losses=[10.0, 9.09]),
            job.Row("deepspeed_zero3_offload", params=7_240_000_000, world=2, error="exit code -9")]
    text = job.table(rows, "fsdp_noclip")
    line = next(x for x in text.splitlines() if x.startswith("| superoffload_fsdp"))
    assert "| 1.25x |" in line and "| 50% |" in line and "| 1.0e-02 |" in line
    assert "exit code -9" in text
