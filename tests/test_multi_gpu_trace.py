"""The N-GPU job's ``--trace`` on the CPU: the step summary read from synthetic Chrome-trace events (GPU busy time as
a union, clipping to the step, the compute stream's idle gaps and the host ranges running then, kernels by name,
NCCL, copies by direction, host ranges), the side-by-side comparison, the one-step tracer on a real CPU profile,
and the option on the command line."""

import gzip
import json
import sys

import pytest
from _benchmarks import load  # benchmarks/<name>.py as a module

job = load("multi_gpu_job")
ts = sys.modules["trace_summary"]  # benchmarks/trace_summary.py, which the job imports from its own folder

MAIN, WORKER = 100, 200  # host threads


def k(name, start_ms, ms, stream=7, cat="kernel", **args):
    """A GPU event: ``start_ms`` and ``ms`` in milliseconds of the trace clock."""
    return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * 1e3, "dur": ms * 1e3, "pid": 0, "tid": 99,
            "args": {"stream": stream, **args}}


def h(name, start_ms, ms, tid=MAIN, cat="cpu_op"):
    """A host event."""
    return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * 1e3, "dur": ms * 1e3, "pid": 1, "tid": tid,
            "args": {}}


def summarize(events, lo_ms=0.0, hi_ms=100.0, **kw):
    return ts.trace_summary(events, lo_ms * 1e3, hi_ms * 1e3, **kw)


@pytest.mark.parametrize(("events", "busy", "idle"), [
    ([], 0.0, 100.0),
    ([k("a", 10, 20)], 20.0, 80.0),
    ([k("a", 10, 20), k("b", 20, 20)], 30.0, 70.0),  # overlapping on one stream: counted once
    ([k("a", 10, 20), k("b", 15, 10, stream=9)], 20.0, 80.0),  # another stream inside: busy as one, idle per stream
    ([k("a", 10, 20), k("m", 40, 10, stream=9, cat="gpu_memcpy")], 30.0, 80.0),
    ([k("a", -10, 20), k("b", 95, 20)], 15.0, 85.0),  # clipped to the window on both sides
    ([k("a", -30, 20), k("b", 100, 5), k("c", 120, 5)], 0.0, 100.0),  # wholly outside
    ([k("a", 0, 100), k("b", 50, 10)], 100.0, 0.0),
])
def test_gpu_busy_is_the_union_of_gpu_intervals_clipped_to_the_window(events, busy, idle):
    s = summarize(events)
    assert s["wall_ms"] == 100.0
    assert s["gpu_busy_ms"] == pytest.approx(busy)
    assert s["compute_idle_ms"] == pytest.approx(idle)


def test_streams_and_the_compute_stream_exclude_nccl_time():
    events = [k("gemm", 0, 30, stream=7), k("gemm", 40, 30, stream=7),
              k("ncclDevKernel_AllGather", 0, 90, stream=20), k("Memcpy HtoD (Pinned -> Device)", 10, 5, stream=21,
                                                                  cat="gpu_memcpy")]
    s = summarize(events)
    assert s["compute_stream"] == "7"  # the NCCL stream is busier, but with NCCL kernels only
    assert [(r["stream"], r["busy_ms"], r["kernel_ms"], r["events"]) for r in s["streams"]] == [
        ("20", 90.0, 0.0, 1), ("7", 60.0, 60.0, 2), ("21", 5.0, 0.0, 1)]
    assert s["compute_busy_ms"] == 60.0 and s["compute_idle_ms"] == 40.0
    assert s["gpu_busy_ms"] == 90.0


def test_the_stream_is_the_tid_without_a_stream_argument():
    e = k("a", 0, 10)
    del e["args"]["stream"]
    e["tid"] = "stream 3"
    assert summarize([e])["compute_stream"] == "stream 3"


def test_gaps_of_the_compute_stream_with_the_host_ranges_running_then():
    events = [k("a", 0, 10), k("b", 12, 8), k("c", 50, 10), k("d", 60.1, 39.9),
              h("ProfilerStep", 0, 100, cat="user_annotation"),
              h("superoffload/wait_for_update", 19, 30, cat="user_annotation"),
              h("aten::copy_", 19.5, 2), h("cudaStreamSynchronize", 19.9, 1, cat="cuda_runtime"),
              h("superoffload/cpu_update", 15, 30, tid=WORKER, cat="user_annotation"),
              h("aten::_fused_adamw_", 16, 10, tid=WORKER)]
    s = summarize(events, host_tid=MAIN)
    # gaps: [10, 12) 2 ms, [20, 50) 30 ms, [60, 60.1) below the floor
    assert [(g["start_ms"], g["ms"]) for g in s["gaps"]] == [(20.0, 30.0), (10.0, 2.0)]
    assert s["gaps"][0]["host"] == ["cudaStreamSynchronize", "aten::copy_", "superoffload/wait_for_update",
                                    "ProfilerStep"]  # innermost first
    assert s["gaps"][0]["other_threads"] == ["aten::_fused_adamw_", "superoffload/cpu_update"]
    assert s["gaps"][1]["host"] == ["ProfilerStep"] and s["gaps"][1]["other_threads"] == []
    assert (s["gaps_count"], s["gaps_ms"]) == (2, 32.0)
    assert (s["small_gaps_count"], s["small_gaps_ms"]) == (1, 0.1)
    assert s["compute_idle_ms"] == pytest.approx(s["gaps_ms"] + s["small_gaps_ms"])


def test_idle_per_tenth_and_by_the_training_threads_innermost_range():
    # compute stream busy on [0, 5), [30, 55), [60, 100): idle [5, 30) across three tenths and [55, 60) in one
    events = [k("a", 0, 5), k("b", 30, 25), k("c", 60, 40),
              h("step", 0, 100, cat="user_annotation"),
              h("FSDP::pre_forward (model.layers.1)", 4, 10, cat="user_annotation"),
              h("superoffload/wait_for_update", 6, 2, cat="user_annotation"),
              h("FSDP::pre_forward (model.layers.2)", 54, 10, cat="user_annotation"),
              h("superoffload/cpu_update", 0, 100, tid=WORKER, cat="user_annotation")]
    s = summarize(events, host_tid=MAIN)
    assert s["idle_by_tenth_ms"] == pytest.approx([5.0, 10.0, 10.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    assert sum(s["idle_by_tenth_ms"]) == pytest.approx(s["compute_idle_ms"])
    # the gap at 5 begins inside pre_forward of layer 1 (wait_for_update starts later); the one at 55 inside that of
    # layer 2: one row for both modules; the worker's range is not the training thread's
    assert s["idle_by_range_ms"] == pytest.approx({"FSDP::pre_forward": 30.0})
    assert summarize(events[:3])["idle_by_range_ms"] == {"": 30.0}  # no host ranges at all
    # two ranges starting together (a range clipped to the window's start): the inner one takes the gap
    tied = [k("a", 30, 70), h("step", 0, 100, cat="user_annotation"),
            h("superoffload/wait_for_update", 0, 30, cat="user_annotation")]
    assert summarize(tied, host_tid=MAIN)["idle_by_range_ms"] == pytest.approx({"superoffload/wait_for_update": 30.0})


def test_gap_host_names_without_a_training_thread_come_from_every_thread():
    events = [k("a", 0, 10), k("b", 30, 70), h("outer", 0, 100, cat="user_annotation"), h("ended", 5, 5),
              h("on_worker", 5, 10, tid=WORKER)] + [h(f"op{i}", 10 - i * 0.5, 1 + i) for i in range(7)]
    g = summarize(events)["gaps"][0]
    assert (g["start_ms"], g["ms"]) == (10.0, 20.0) and "other_threads" not in g
    assert g["host"] == ["op0", "op1", "op2", "op3", "op4"]  # at most five, the shortest first; "ended" ended then
    assert summarize(events[:4] + [events[4]])["gaps"][0]["host"] == ["on_worker", "outer"]


@pytest.mark.parametrize(("starts", "shown"), [
    ([10, 20, 30], 4),
    (list(range(2, 98, 6)), ts.TOP_GAPS),  # sixteen gaps: the longest twelve
])
def test_at_most_the_longest_gaps_are_listed_with_their_offsets(starts, shown):
    events = [k(f"k{i}", a, 1 + (i % 3) * 0.5) for i, a in enumerate(starts)]
    s = summarize(events, lo_ms=0.0, hi_ms=100.0)
    lengths = [g["ms"] for g in s["gaps"]]
    assert len(lengths) == shown and lengths == sorted(lengths, reverse=True)
    assert s["gaps_count"] == len(starts) + 1  # before each kernel, and after the last


def test_the_window_offsets_gaps_from_its_start():
    s = summarize([k("a", 1000, 10), k("b", 1015, 85)], lo_ms=1000.0, hi_ms=1100.0)
    assert [(g["start_ms"], g["ms"]) for g in s["gaps"]] == [(10.0, 5.0)]


def test_kernels_are_grouped_by_name_truncated_and_ranked():
    long = "void at::native::elementwise_kernel<" + "x" * 200
    events = [k("gemm", 0, 5), k("gemm", 10, 5), k(long + "A", 20, 3), k(long + "B", 30, 4), k("softmax", 40, 1)] + \
        [k(f"tiny{i:02d}", 50 + i, 0.01) for i in range(30)]
    s = summarize(events)
    top = s["kernels"]
    assert len(top) == ts.TOP_KERNELS
    assert [(t["name"], t["ms"], t["count"]) for t in top[:3]] == [
        ("gemm", 10.0, 2), (long[:90], 7.0, 2), ("softmax", 1.0, 1)]  # the two long names are one after truncation
    assert s["kernel_count"] == 35 and s["kernel_ms_total"] == pytest.approx(18.3)
    assert len(s["kernel_ms_by_name"]) == 33  # every name, for the comparison


def test_nccl_kernels_are_summed_whatever_their_case():
    events = [k("ncclDevKernel_AllGather_RING_LL", 0, 4, stream=20), k("NCCL_ReduceScatter", 10, 6, stream=21),
              k("gemm", 0, 20), k("my_nccl_like", 30, 1)]
    assert summarize(events)["nccl_ms"] == pytest.approx(11.0)


@pytest.mark.parametrize(("name", "kind"), [
    ("Memcpy HtoD (Pinned -> Device)", "HtoD"),
    ("Memcpy HtoD (Pageable -> Device)", "HtoD"),
    ("Memcpy DtoH (Device -> Pinned)", "DtoH"),
    ("Memcpy DtoD (Device -> Device)", "DtoD"),
    ("Memcpy PtoP (Device -> Device)", "PtoP"),
    ("Memcpy", "other"),
])
def test_memcpy_direction_from_the_name(name, kind):
    assert ts.memcpy_kind(name) == kind


def test_memcpy_time_and_bytes_by_direction_and_memsets():
    events = [k("Memcpy HtoD (Pinned -> Device)", 0, 2, cat="gpu_memcpy", stream=21, bytes=2**20),
              k("Memcpy HtoD (Pinned -> Device)", 5, 3, cat="gpu_memcpy", stream=21, bytes=2**21),
              k("Memcpy DtoH (Device -> Pinned)", 10, 4, cat="GPU_MEMCPY", stream=22),  # no bytes: time only
              k("Memset (Device)", 20, 1, cat="gpu_memset")]
    s = summarize(events)
    assert s["memcpy"] == {"DtoH": {"ms": 4.0, "bytes": 0, "count": 1},
                           "HtoD": {"ms": 5.0, "bytes": 3 * 2**20, "count": 2}}
    assert s["memcpy_ms"] == 9.0 and s["memset_ms"] == 1.0 and s["kernel_ms_total"] == 0.0
    assert s["gpu_busy_ms"] == 10.0


def test_host_ranges_are_the_user_annotations_by_name_clipped():
    events = [h("superoffload/wait_for_update", 10, 5, cat="user_annotation"),
              h("superoffload/wait_for_update", 90, 20, cat="user_annotation"),  # half outside
              h("superoffload/cpu_update", 0, 30, tid=WORKER, cat="user_annotation"),
              h("aten::mm", 0, 50),  # an operator, not a range
              h("ProfilerStep#3", 0, 100, cat="gpu_user_annotation")]  # the GPU-side copy of a range
    assert summarize(events)["ranges"] == [{"name": "superoffload/cpu_update", "ms": 30.0, "count": 1},
                                           {"name": "superoffload/wait_for_update", "ms": 15.0, "count": 2}]


def test_other_phases_and_categories_are_ignored():
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "x"}},
              {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1.0, "pid": 0, "tid": 1},
              {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "ts": 0.0, "dur": 1e9, "pid": "Spans"},
              {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5.0}]
    s = summarize(events)
    assert s["gpu_busy_ms"] == 0.0 and s["compute_stream"] is None and s["gaps"] == [] and s["ranges"] == []
    assert s["compute_idle_ms"] == 100.0


@pytest.mark.parametrize("wrapped", [True, False])
@pytest.mark.parametrize("gz", [True, False])
def test_load_events_and_the_step_window(tmp_path, wrapped, gz):
    events = [h(ts.MARKER, 10, 50, cat="user_annotation"), k("a", 12, 5)]
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    text = json.dumps({"traceEvents": events} if wrapped else events)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    loaded = ts.load_events(path)
    assert loaded == events
    assert ts.step_window(loaded) == (10e3, 60e3, MAIN)
    assert ts.step_window([k("a", 0, 1)]) is None


def test_compare_puts_the_anchor_first_and_differences_per_kernel():
    a = summarize([k("gemm", 0, 50), k("ncclDevKernel_AllGather", 0, 10, stream=20)])
    b = summarize([k("gemm", 0, 52), k("adam", 60, 3), k("Memcpy DtoH (Device -> Pinned)", 70, 4, cat="gpu_memcpy",
                                                                      stream=21)])
    a["step"] = b["step"] = 5
    text = ts.compare_markdown([("fsdp_noclip", a), ("superoffload_fsdp", b)])
    rows = [line for line in text.splitlines() if line.startswith("| fsdp_noclip |")
            or line.startswith("| superoffload_fsdp |")]
    assert rows[0].startswith("| fsdp_noclip | 5 | 100.0 | 50.0 | 50.0 | 50.0 |")
    assert rows[1].startswith("| superoffload_fsdp | 5 | 100.0 | 59.0 | 55.0 | 45.0 |")
    assert "| 4.0 (0.0/4.0/0.0) |" in rows[1]
    diff = text.split("superoffload_fsdp minus fsdp_noclip")[1].splitlines()
    kernels = [line for line in diff if line.startswith("| `")]
    assert kernels[:3] == ["| `ncclDevKernel_AllGather` | 10.00 | 0.00 | -10.00 |", "| `adam` | 0.00 | 3.00 | +3.00 |",
                           "| `gemm` | 50.00 | 52.00 | +2.00 |"]


def test_summary_lines_are_a_few_lines():
    s = summarize([k("gemm", 0, 50), h("x", 0, 100, cat="user_annotation")], host_tid=MAIN)
    lines = ts.summary_lines("v", {"step": 5, **s})
    assert 4 <= len(lines) <= 8 and lines[0].startswith("trace v (step 5): wall 100.0 ms")
    assert lines[-2].startswith("  idle per tenth of the step (ms): 0.0 0.0 0.0 0.0 0.0 10.0 10.0 10.0 10.0 10.0")
    assert lines[-1] == "  idle by the training thread's range (ms): x 50.0"


@pytest.mark.parametrize(("warmup", "steps", "at"), [(4, 8, 5), (1, 1, 1), (0, 3, 1), (2, 2, 3)])
def test_the_traced_step_is_the_second_timed_one_else_the_only_one(warmup, steps, at):
    assert job.trace_step(job.MJob("x", warmup=warmup, steps=steps)) == at


def test_old_job_json_without_trace_still_loads():
    old = {k: v for k, v in job.asdict(job.make_job("superoffload_fsdp", "smoke")).items() if k != "trace"}
    assert job.MJob(**old).trace is False


def test_step_tracer_profiles_one_cpu_step(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    tracer = ts.StepTracer(step=1, cuda=False)
    x = torch.randn(64, 64)
    for step in range(3):  # the hooks' order: close, open at the step, time stamp, stop
        tracer.close()
        if step == tracer.step:
            tracer.open()
        tracer.stop()
        with torch.profiler.record_function("work"):
            x = (x @ x).tanh()
    s = tracer.analyze(tmp_path, "v")
    assert json.loads((tmp_path / "trace-v.json").read_text()) == s
    assert s["variant"] == "v" and s["step"] == 1 and s["wall_ms"] > 0 and "note" not in s
    assert [r["name"] for r in s["ranges"]] == ["work"]  # one step's range, the marker left out
    assert (tmp_path / "trace-v.json.gz").exists() and not (tmp_path / "trace-v.raw.json").exists()
    assert "trace v (step 1): wall" in capsys.readouterr().out


def test_step_tracer_says_when_its_step_never_came(tmp_path):
    with pytest.raises(RuntimeError, match="never profiled"):
        ts.StepTracer(step=7, cuda=False).analyze(tmp_path, "v")


def test_help_lists_trace(capsys):
    with pytest.raises(SystemExit) as e:
        job.main(["--help"])
    assert e.value.code == 0 and "--trace" in capsys.readouterr().out
