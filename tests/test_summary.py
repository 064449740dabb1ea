"""The trace summary: exact shares on a hand-written Kineto trace, any-trace robustness, a real CPU trace, the CLI."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.profiling import SelectiveProfiler, summarize_trace
from lightning_gh.profiling.summary import kernel_kind, render_markdown, summarize, summary_paths
from lightning_gh.profiling.trace import load_trace, parse_trace

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "tests" / "data" / "kineto_small.json"
approx = lambda x: pytest.approx(x, abs=1e-9)  # noqa: E731


@pytest.fixture(scope="module")
def small():
    return summarize(load_trace(SMALL))


def test_parser_groups_events():
    t = load_trace(SMALL)
    assert [s.number for s in t.steps] == [5, 6]  # the GPU-side ProfilerStep#5 copy is not a host step
    assert len(t.kernels) == 8 and len(t.memcpys) == 3 and len(t.memsets) == 1
    assert sorted(t.runtime) == list(range(1, 13))
    assert t.rank == 0 and t.has_gpu
    assert [e.name for e in t.cpu_ops] == ["aten::linear", "aten::mm", "aten::add_"]
    assert {e.name for e in t.annotations} == {"lgh/forward", "lgh/backward", "lgh/optimizer", "lgh/data_wait"}


def test_steps_and_time_split_exact(small):
    # Worked out by hand in tests/data/kineto_small.json: each step is 1000 us.
    s5, s6 = small["steps"]
    assert (s5["step"], s6["step"]) == (5, 6) and small["span_source"] == "ProfilerStep"
    assert small["window_ms"] == approx(2.0) and small["step_time_ms"]["mean"] == approx(1.0)
    # step 5: compute [1050,1300]+[1400,1600]+[1700,1750]; NCCL alone [1620,1700]; copy alone [1600,1620].
    assert (s5["compute_ms"], s5["comm_ms"], s5["copy_ms"], s5["idle_ms"]) == (approx(0.5), approx(0.08), approx(0.02),
                                                                           approx(0.4))
    # idle gaps [1000,1050] / [1300,1400] / [1750,2000]; launches end at 1020 / 1390 / 2220 -> 20 + 90 + 250 us.
    assert s5["host_bound_idle_ms"] == approx(0.36)
    assert (s6["compute_ms"], s6["comm_ms"], s6["copy_ms"], s6["idle_ms"]) == (approx(0.53), approx(0.0), approx(0.07),
                                                                           approx(0.4))
    assert s6["host_bound_idle_ms"] == approx(0.318)  # 98 + 60 + 115 + 45; the tail [2960,3000] has no launch
    assert s6["data_wait_idle_ms"] == approx(0.14)  # idle inside lgh/data_wait [2000,2200]: 100 + 40


def test_gpu_shares_exact_and_add_up(small):
    g = small["gpu"]
    assert g["busy_share"] == approx(0.6) and g["idle_share"] == approx(0.4)
    assert (g["compute_share"], g["comm_share"], g["copy_share"]) == (approx(0.515), approx(0.04), approx(0.045))
    assert g["compute_share"] + g["comm_share"] + g["copy_share"] + g["idle_share"] == approx(1.0)
    assert g["idle"]["host_bound_share"] == approx(0.339) and g["idle"]["other_share"] == approx(0.061)
    assert g["idle"]["host_bound_share"] + g["idle"]["other_share"] == approx(g["idle_share"])
    assert g["idle"]["during_data_wait_share"] == approx(0.07)
    assert g["kernel_count"] == 8 and g["kernel_time_ms"] == approx(1.13) and g["median_kernel_us"] == 125.0


def test_top_kernels_kinds_copies_comm(small):
    top = small["top_kernels"]
    assert top[0]["name"].startswith("sm90_xmma_gemm") and top[0]["kind"] == "gemm"
    assert top[0]["count"] == 2 and top[0]["share"] == approx(round(400 / 1130, 6))
    assert [k["kind"] for k in top[1:4]] == ["gemm", "attention", "communication"]
    assert small["kernel_kinds"]["gemm"] == approx(round(700 / 1130, 6))
    assert sum(small["kernel_kinds"].values()) == pytest.approx(1.0, abs=1e-5)
    c = small["copies"]
    assert c["HtoD"] == {"count": 2, "bytes": 6_000_000, "time_ms": 0.1, "gbps": 60.0, "share": 0.05}
    assert c["DtoH"]["gbps"] == 10.0 and c["memset"]["count"] == 1 and "DtoD" not in c
    assert small["communication"] == {"kernels": 1, "time_ms": 0.1, "share": 0.05, "exposed_share": 0.04,
                                      "overlapped_fraction": 0.2}


def test_phases_and_gpu_time_by_launch(small):
    ph = small["phases"]
    assert list(ph) == ["data_wait", "forward", "backward", "optimizer", "other"]
    assert [ph[p]["ms"] for p in ph] == [approx(0.2), approx(0.6), approx(0.7), approx(0.35), approx(0.15)]
    assert sum(ph[p]["share"] for p in ph) == approx(1.0)
    # GPU work by the phase its launch was issued in (the backward launches come from another thread).
    assert [ph[p]["gpu_ms"] for p in ph] == [approx(0.06), approx(0.7), approx(0.4), approx(0.09), approx(0.0)]
    assert [o["name"] for o in small["top_cpu_ops"]] == ["aten::mm", "aten::add_", "aten::linear"]
    assert [o["self_ms"] for o in small["top_cpu_ops"]] == [approx(0.032), approx(0.015), approx(0.008)]


def test_verdict_with_evidence(small):
    v = small["verdict"]
    # 40% idle, 33.9% of the window host-bound: the GPU waited for launches.
    assert v["bound"] == "launch-bound"
    assert any("idle 40.0%" in e and "host-bound 33.9%" in e for e in v["evidence"])
    assert any("CUDA graph" in a for a in v["advice"])
    md = render_markdown(small)
    assert "verdict: **launch-bound**" in md and "| 5 | 1.000 | 60.0% |" in md and "| HtoD | 2 | 6.000 |" in md


def _event(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": args}


def test_trace_without_step_markers_is_one_span():
    # Someone else's trace: no ProfilerStep, old capitalised categories, a bare list of events.
    t = parse_trace([
        _event("Kernel", "ampere_bf16_s16816gemm_bf16_128x128", 0, 600),
        _event("Kernel", "vectorized_elementwise_kernel", 700, 100),
        _event("Memcpy", "Memcpy DtoD (Device -> Device)", 750, 50, bytes=4_000_000),
        _event("Runtime", "cudaLaunchKernel", 650, 10, correlation=9),
        {"ph": "i", "name": "instant", "ts": 5000},
    ])
    s = summarize(t)
    assert s["span_source"] == "whole trace" and len(s["steps"]) == 1 and s["steps"][0]["step"] is None
    assert s["window_ms"] == approx(0.8)
    g = s["gpu"]
    assert (g["busy_share"], g["compute_share"], g["copy_share"], g["idle_share"]) == (
        approx(0.875), approx(0.875), approx(0.0), approx(0.125))
    assert s["copies"]["DtoD"]["gbps"] == 80.0
    assert s["top_kernels"][0]["kind"] == "gemm" and s["verdict"]["bound"] == "compute-bound"
    assert "whole trace is one span" in render_markdown(s)


def test_gpu_work_after_the_last_host_step_is_counted():
    # The host ended step 1 at 100 us; the kernel it launched at 50-55 us runs 60-160 us.
    s = summarize(parse_trace({"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 50, "dur": 5,
         "args": {"correlation": 3}},
        _event("kernel", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 60, 100, correlation=3),
    ]}))
    (row,) = s["steps"]
    assert row["time_ms"] == approx(0.1) and row["span_ms"] == approx(0.16) and s["gpu_tail_ms"] == approx(0.06)
    assert s["step_time_ms"]["mean"] == approx(0.1) and s["window_ms"] == approx(0.16)
    g = s["gpu"]
    assert (g["busy_share"], g["idle_share"]) == (approx(0.625), approx(0.375))
    assert (g["idle"]["host_bound_share"], g["idle"]["other_share"]) == (approx(0.34375), approx(0.03125))
    assert "0.060 ms after the host ended the last step" in render_markdown(s)


def test_kernel_kinds():
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_TNT") == "gemm"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn") == "gemm"
    assert kernel_kind("triton_tem_fused_mm_0") == "gemm"
    assert kernel_kind("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kernel_kind("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert kernel_kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "communication"
    assert kernel_kind("triton_red_fused__to_copy_mean_pow_0") == "reduction"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, silu>") == "elementwise"
    assert kernel_kind("something_else") == "other"


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"not": "a trace"}')
    with pytest.raises(ValueError, match="not a chrome trace"):
        load_trace(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{oops")
    with pytest.raises(ValueError, match="not a readable JSON"):
        load_trace(tmp_path / "y.json")
    with pytest.raises(ValueError, match="top=0"):
        summarize(load_trace(SMALL), top=0)


def test_cli_on_gzip_copy(tmp_path):
    gz = tmp_path / "someone.pt.trace.json.gz"
    with gzip.open(gz, "wt") as f:
        f.write(SMALL.read_text())
    proc = subprocess.run([sys.executable, "-m", "lightning_gh.profiling", "summarize", str(gz)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: **launch-bound**" in proc.stdout
    paths = summary_paths(gz)
    assert paths["json"].name == "someone.summary.json"
    assert json.loads(paths["json"].read_text())["gpu"]["busy_share"] == 0.6
    assert paths["md"].read_text().startswith("# Trace summary: someone.pt.trace.json.gz")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_bad_files(tmp_path, capsys):
    from lightning_gh.profiling.__main__ import main

    assert main(["summarize", str(tmp_path / "nope.json"), "--no-plot"]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["summarize", str(SMALL), "--top", "0"])


def _event_list(*durations):
    return {"traceEvents": [_event("kernel", f"k{i}", 10 * i, d) for i, d in enumerate(durations)]}


@pytest.mark.parametrize("name, content, problem", [
    ("empty.json", "", "is empty (0 bytes): no events"),
    ("garbage.json", "\x00\x01 not json at all", "is not a Kineto trace: not a readable JSON"),
    ("numbers.json", "[1, 2, 3]", "is not a Kineto trace: none of its 3 entries is a trace event"),
    ("object.json", '{"not": "a trace"}', "is not a Kineto trace: not a chrome trace"),
    ("no_events.json", '{"traceEvents": []}', "has no events"),
    ("instants.json", '{"traceEvents": [{"ph": "i", "name": "x", "ts": 1}]}', "has no events"),
    ("negative.json", json.dumps(_event_list(5, -3)), "1 event(s) with a negative duration, e.g. 'k1' at ts=10 us"),
])
def test_cli_names_what_is_wrong_with_a_trace_and_fails(tmp_path, capsys, name, content, problem):
    from lightning_gh.profiling.__main__ import main

    path = tmp_path / name
    path.write_text(content)
    assert main(["summarize", str(path), "--no-plot"]) == 1
    captured = capsys.readouterr()
    assert problem in captured.err and captured.out == ""  # no verdict printed for it
    assert not summary_paths(path)["json"].exists()


def test_cli_on_a_folder_summarizes_the_traces_under_it(tmp_path, capsys):
    from lightning_gh.profiling.__main__ import main

    (tmp_path / "steps2-4").mkdir()
    shutil.copy(SMALL, tmp_path / "steps2-4" / "rank0_steps2-4.pt.trace.json")
    assert main(["summarize", str(tmp_path), "--no-plot"]) == 0
    assert "verdict: **launch-bound**" in capsys.readouterr().out
    assert (tmp_path / "steps2-4" / "rank0_steps2-4.summary.json").exists()
    assert main(["summarize", str(tmp_path / "steps2-4"), "--no-plot"]) == 0  # its own summaries are not traces
    (tmp_path / "empty").mkdir()
    assert main(["summarize", str(tmp_path / "empty"), "--no-plot"]) == 1
    err = capsys.readouterr().err
    assert "a folder with no Kineto traces" in err and "does not exist" not in err


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A real trace: the tiny model on the CPU, steps 2-4, through SelectiveProfiler."""
    out = tmp_path_factory.mktemp("profiles")
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny")
    prof = SelectiveProfiler(steps="2-4", output_dir=out, summary=False)
    L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              callbacks=[prof]).fit(model, MarkovDataModule.for_model(model))
    return Path(prof.written[0]["files"]["torch"])


def test_summary_of_a_real_cpu_trace(cpu_trace, tmp_path):
    s = summarize_trace(cpu_trace, tmp_path)
    assert [r["step"] for r in s["steps"]] == [2, 3, 4]
    assert s["gpu"] is None and s["verdict"]["bound"] == "cpu-only"
    ph = s["phases"]
    assert list(ph)[:4] == ["data_wait", "forward", "backward", "optimizer"]
    assert all(ph[p]["ms"] > 0 for p in ("forward", "backward", "optimizer"))
    assert sum(ph[p]["share"] for p in ph) == pytest.approx(1.0, abs=1e-4)
    for r in s["steps"]:  # phases never exceed their step
        assert sum(r["phases_ms"].values()) <= r["time_ms"] + 1e-6
    names = [o["name"] for o in s["top_cpu_ops"]]
    assert any(n in ("aten::mm", "aten::addmm", "aten::bmm") for n in names[:3]), names
    assert sum(o["share"] for o in s["top_cpu_ops"]) <= 1.0
    assert s["lgh"]["window"] == "2-4" and s["lgh"]["first_step"] == 2
    assert Path(s["files"]["png"]).stat().st_size > 10_000
    md = Path(s["files"]["md"]).read_text()
    assert "## Phases" in md and "ProfilerStep#2..#4" in md


def test_summary_files_default_next_to_the_trace(cpu_trace, tmp_path):
    copy = tmp_path / cpu_trace.name
    shutil.copy(cpu_trace, copy)
    s = summarize_trace(copy, plot=False)
    assert set(s["files"]) == {"json", "md"} and Path(s["files"]["json"]).parent == tmp_path


def _data_wait_trace(gpu_busy_during_wait: bool):
    # One 1000 us step whose first 400 us the host spends in lgh/data_wait.
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "lgh/data_wait", "pid": 1, "tid": 1, "ts": 0, "dur": 400},
        {"ph": "X", "cat": "user_annotation", "name": "lgh/forward", "pid": 1, "tid": 1, "ts": 400, "dur": 600},
        _event("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 400, 590),
    ]
    if gpu_busy_during_wait:  # the previous step's work still runs: the host is ahead of the GPU
        events.append(_event("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 0, 390))
    return parse_trace(events)


def test_data_wait_is_a_stall_only_when_the_gpu_idles_through_it():
    loader = {"loader": {"num_workers": 0, "cuda": True, "pin_memory": True, "cpus_per_process": 8}}
    stalled = summarize(_data_wait_trace(gpu_busy_during_wait=False), context=loader)
    assert stalled["verdict"]["bound"] == "input-bound"
    assert any("raise num_workers from 0" in a for a in stalled["verdict"]["advice"])
    ahead = summarize(_data_wait_trace(gpu_busy_during_wait=True), context=loader)
    assert ahead["verdict"]["bound"] == "compute-bound"
    assert not any("num_workers" in a for a in ahead["verdict"]["advice"])
    assert any("host was ahead of the GPU" in e for e in ahead["verdict"]["evidence"])


_HEAVY = ("torch", "lightning", "pytorch_lightning", "matplotlib")
_OTHER_PARTS = ("lightning_gh.offload", "lightning_gh.activation_offload", "lightning_gh.superoffload",
                "lightning_gh.precision", "lightning_gh.graphs")


def _heavy_modules_after(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOADED "))
    return json.loads(line[len("LOADED "):])


def _cli_run_code(out_dir: Path, stub_package: bool) -> str:
    """Python that runs ``python -m lightning_gh.profiling summarize SMALL`` in-process, then prints what it loaded."""
    stub = (f"import types; pkg = types.ModuleType('lightning_gh'); pkg.__path__ = [{str(ROOT / 'lightning_gh')!r}]; "
            "sys.modules['lightning_gh'] = pkg") if stub_package else ""
    return f"""
import json, runpy, sys
{stub}
sys.argv = ["lightning_gh.profiling", "summarize", {str(SMALL)!r}, "--out", {str(out_dir)!r}, "--no-plot"]
try:
    runpy.run_module("lightning_gh.profiling", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not e.code, e.code
heavy = {_HEAVY!r}; parts = {_OTHER_PARTS!r}
print("LOADED " + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m.startswith(parts))))
"""


def test_summarize_cli_parses_a_trace_without_torch_lightning_or_other_parts(tmp_path):
    """``python -m lightning_gh.profiling summarize FILE`` works on a laptop without the training stack.

    The profiling package is run as ``__main__`` under an empty ``lightning_gh`` package, so this checks the
    profiling modules' own imports whatever the package's ``__init__`` loads."""
    assert _heavy_modules_after(_cli_run_code(tmp_path, stub_package=True)) == []
    assert (tmp_path / "kineto_small.summary.md").exists() and (tmp_path / "kineto_small.summary.json").exists()


def test_importing_lightning_gh_does_not_import_matplotlib(fresh_import_report):
    """lightning_gh draws its PNG with matplotlib imported inside the drawing function. (Lightning itself may load
    matplotlib through torchmetrics when it is installed: only what lightning_gh adds on top counts.) The fresh
    interpreter imports lightning and torch, then lightning_gh (tests/conftest.py)."""
    assert fresh_import_report["matplotlib_added"] == []


def test_summarize_cli_as_users_run_it_imports_no_torch(tmp_path):
    assert _heavy_modules_after(_cli_run_code(tmp_path, stub_package=False)) == []
