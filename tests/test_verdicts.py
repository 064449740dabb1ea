"""Verdicts of the trace summary on synthetic Kineto traces with injected bottlenecks, and the decision as a table.

Each trace is built the way torch.profiler writes one for a CUDA run: a training thread marking ``ProfilerStep#n``
with ``lgh/`` phase ranges and ``aten::`` operators that launch kernels (``cudaLaunchKernel`` with a correlation
id), autograd's thread launching the backward, a CUDA compute stream, side streams for copies
(``Memcpy HtoD/DtoH`` with their bytes), and, for SuperOffload, a worker thread whose CPU update spans overlap the
backward. Kernels start when the host has launched them and their stream and dependencies are free, so idle gaps
come out of the simulated host and link times, not out of hand-placed holes.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest

from lightning_gh.profiling.advice import (
    BOUNDS,
    IDLE_BOUND,
    BoundFacts,
    bound_facts,
    decide,
    verdict,
)
from lightning_gh.profiling.render import render_markdown
from lightning_gh.profiling.summary import summarize, summarize_trace
from lightning_gh.profiling.trace import load_trace, parse_trace

DATA = Path(__file__).resolve().parent / "data"
PID = 4242
MAIN, AUTOGRAD, WORKER = (PID, PID), (PID, PID + 8), (PID, PID + 16)
COMPUTE, D2H, H2D, PUSH = 7, 20, 21, 22
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
FP8_GEMM = "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cga1x2x1_warpgroupsize1x1x1"
FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>"
SILU = "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>"
MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, MulFunctor>>"
NORM = "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0"
COPY = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>"
AMAX = "triton_red_fused_abs_amax_0"
CAST = "void at::native::vectorized_elementwise_kernel<4, at::native::float8_copy_kernel_cuda<c10::Float8_e4m3fn>>"
ADAM = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>"
MB = 1_000_000


class TraceBuilder:
    """A small simulator that writes a Kineto trace: host threads with clocks, CUDA streams with queues."""

    def __init__(self, device: str = "NVIDIA H100 80GB HBM3", link_gbps: float = 50.0) -> None:
        self.events: list[dict] = []
        self.corr = 0
        self.free: dict[int, float] = defaultdict(float)  # stream -> end of its queued work
        self.clock = {MAIN: 0.0, AUTOGRAD: 0.0, WORKER: 0.0}
        self.link_gbps = link_gbps
        self.meta = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
                     "deviceProperties": [{"id": 0, "name": device, "totalGlobalMem": 85_000_000_000,
                                           "computeMajor": 9, "computeMinor": 0}]}
        for key in (MAIN, AUTOGRAD, WORKER):
            self.events.append({"ph": "M", "name": "thread_name", "pid": key[0], "tid": key[1],
                                "args": {"name": f"thread {key[1]} (python)"}})
        for stream in (COMPUTE, D2H, H2D, PUSH):
            self.events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": stream,
                                "args": {"name": f"stream {stream}"}})

    def x(self, cat: str, name: str, ts: float, dur: float, key: tuple[int, int], **args) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": key[0], "tid": key[1], "ts": ts,
                            "dur": dur, "args": args})

    def span(self, name: str, key: tuple[int, int], t0: float, t1: float) -> None:
        self.x("user_annotation", name, t0, t1 - t0, key)

    def op(self, key, name: str, host_us: float, kernel: str | None = None, kernel_us: float = 0.0,
           stream: int = COMPUTE, after: float = 0.0, copy: str | None = None, nbytes: int = 0, gap: float = 0.0,
           pageable: bool = False) -> float:
        """A host operator on thread ``key`` launching one kernel or copy; returns when the GPU work ends."""
        t0 = self.clock[key] + gap
        self.x("cpu_op", name, t0, host_us, key, **{"External id": len(self.events)})
        self.clock[key] = t0 + host_us
        if kernel is None and copy is None:
            return t0 + host_us
        self.corr += 1
        launch = t0 + host_us - 6
        self.x("cuda_runtime", "cudaLaunchKernel" if kernel else "cudaMemcpyAsync", launch, 5, key,
               correlation=self.corr, cbid=211 if kernel else 41)
        start = max(launch + 7, self.free[stream], after)
        if kernel:
            self.x("kernel", kernel, start, kernel_us, (0, stream), device=0, context=1, stream=stream,
                   correlation=self.corr, grid=[132, 1, 1], block=[256, 1, 1])
        else:
            kernel_us = nbytes / (self.link_gbps * 1e3)
            host = "Pageable" if pageable else "Pinned"
            name = f"Memcpy {copy} ({host} -> Device)" if copy == "HtoD" else f"Memcpy {copy} (Device -> {host})"
            self.x("gpu_memcpy", name, start, kernel_us, (0, stream), device=0, context=1, stream=stream,
                   correlation=self.corr, bytes=nbytes, **{"memory bandwidth (GB/s)": self.link_gbps})
        self.free[stream] = start + kernel_us
        return start + kernel_us

    def sync(self, key) -> None:
        t0, end = self.clock[key], max([self.clock[key]] + list(self.free.values()))
        self.corr += 1
        self.x("cuda_runtime", "cudaDeviceSynchronize", t0, end - t0 + 3, key, correlation=self.corr, cbid=165)
        self.clock[key] = end + 3

    def step(self, n: int, *, wait_us: float = 40.0, batch_mb: float = 1.0, layers: int = 4,
             fwd: tuple = ((GEMM, 300.0), (FLASH, 100.0)), host_us: float = 12.0, gap_us: float = 3.0,
             bwd_factor: float = 2.0, optimizer: str = "gpu", update_us: float = 0.0, update_ranges: bool = True,
             grad_mb: float = 0.0, push_mb: float = 0.0, act_mb: float = 0.0, fp8: tuple = (),
             worker_seen: bool = True, wait_range: bool = False) -> None:
        """One training step: data wait and batch copy, forward, backward, optimizer, and the logging sync.
        ``worker_seen=False``: the profiler did not record the worker thread's operators (no
        ``profile_all_threads``); ``wait_range``: the training thread's wait for the update is a named range."""
        t0 = self.clock[MAIN]
        # data wait: the loader produces the batch, then the pinned batch is copied to the GPU
        self.clock[MAIN] = t0 + wait_us
        self.op(MAIN, "aten::copy_", 10, copy="HtoD", nbytes=int(batch_mb * MB))
        self.span("lgh/data_wait", MAIN, t0, self.clock[MAIN])
        f0 = self.clock[MAIN]
        offloaded = []
        for _ in range(layers):
            for name, dur in fp8:
                self.op(MAIN, "aten::amax" if "amax" in name else "aten::_to_copy", host_us, name, dur, gap=gap_us)
            for name, dur in fwd:
                self.op(MAIN, "aten::mm" if "gemm" in name else "aten::silu", host_us, name, dur, gap=gap_us)
            if act_mb:  # the block's saved activations go to pinned host memory on the D2H side stream
                offloaded.append(self.op(MAIN, "aten::copy_", 8, copy="DtoH", nbytes=int(act_mb * MB), stream=D2H,
                                         after=self.free[COMPUTE]))
        self.op(MAIN, "aten::nll_loss_forward", host_us, "void at::native::nll_loss_forward_reduce_cuda_kernel_2d",
                20.0, gap=gap_us)
        self.span("lgh/forward", MAIN, f0, self.clock[MAIN])
        # backward: autograd's thread launches it while the training thread waits inside .backward()
        b0 = self.clock[MAIN]
        self.clock[AUTOGRAD] = b0 + 5
        prefetched = {}
        grads_landed = []

        def prefetch(i):
            if act_mb and 0 <= i < layers:
                prefetched[i] = self.op(AUTOGRAD, "aten::copy_", 8, copy="HtoD", nbytes=int(act_mb * MB),
                                        stream=H2D, after=offloaded[i])

        prefetch(layers - 1)
        for i in reversed(range(layers)):
            prefetch(i - 1)
            for j, (name, dur) in enumerate(reversed(fwd + fp8)):
                self.op(AUTOGRAD, "aten::mm" if "gemm" in name else "aten::mul", host_us, name, bwd_factor * dur,
                        gap=gap_us, after=prefetched.get(i, 0.0) if j == 0 else 0.0)
            if grad_mb:  # SuperOffload: the bucket's gradients go to the host as soon as they are ready
                grads_landed.append(self.op(AUTOGRAD, "aten::_foreach_copy_", 10, copy="DtoH",
                                            nbytes=int(grad_mb * MB), stream=D2H, after=self.free[COMPUTE]))
        self.clock[MAIN] = max(self.clock[MAIN], self.clock[AUTOGRAD]) + 5
        self.span("lgh/backward", MAIN, b0, self.clock[MAIN])
        o0 = self.clock[MAIN]
        if optimizer == "gpu":
            self.op(MAIN, "aten::_fused_adamw_", 30, ADAM, 150.0)
        else:  # SuperOffload: the worker updates each bucket on the CPU, then streams its weights back
            pushed = 0.0
            for landed in grads_landed:
                start = max(self.clock[WORKER], landed + 20)
                self.clock[WORKER] = start
                if not worker_seen:
                    self.clock[WORKER] = start + update_us + 10
                    pushed = max(start + update_us + 20, self.free[PUSH]) + push_mb * MB / (self.link_gbps * 1e3)
                    self.free[PUSH] = pushed
                    continue
                if update_ranges:
                    self.op(WORKER, "aten::_foreach_mul_", 5)
                    self.span("superoffload/cpu_update", WORKER, start, start + update_us)
                    self.clock[WORKER] = start + update_us
                else:  # torch's fused CPU AdamW, no range around it
                    self.op(WORKER, "aten::_fused_adamw_", update_us)
                pushed = self.op(WORKER, "aten::copy_", 10, copy="HtoD", nbytes=int(push_mb * MB), stream=PUSH)
            # the training thread waits (a threading.Event: no operator) for the last bucket, then for its copy
            if wait_range and self.clock[WORKER] > self.clock[MAIN]:
                self.span("superoffload/wait_for_update", MAIN, self.clock[MAIN], self.clock[WORKER])
            self.clock[MAIN] = max(self.clock[MAIN], self.clock[WORKER])
            self.free[COMPUTE] = max(self.free[COMPUTE], pushed)
        self.span("Optimizer.step#AdamW.step" if optimizer == "gpu" else "Optimizer.step#SuperOffloadAdamW.step",
                  MAIN, o0, self.clock[MAIN])
        self.span("lgh/optimizer", MAIN, o0, self.clock[MAIN] + 1)
        self.clock[MAIN] += 1
        self.op(MAIN, "aten::item", 5, copy="DtoH", nbytes=4, pageable=True, gap=2)  # loss.item() for the logger
        self.sync(MAIN)
        self.x("user_annotation", f"ProfilerStep#{n}", t0, self.clock[MAIN] - t0, MAIN)

    def trace(self, steps: int = 3, **kw) -> dict:
        for n in range(10, 10 + steps):
            self.step(n, **kw)
        return {**self.meta, "traceEvents": self.events}


def _tiny(name: str) -> tuple:
    return ((name, 6.0), (SILU, 4.0), (MUL, 4.0), (NORM, 5.0))


# (id, expected verdict, builder keywords, link rate). Each injects one bottleneck into a realistic step.
SCENARIOS = [
    ("compute", "compute-bound", dict(), 50.0),
    ("compute-superoffload-hidden", "compute-bound",
     dict(optimizer="superoffload", update_us=400.0, grad_mb=20, push_mb=10), 50.0),
    ("compute-activation-offload-hidden", "compute-bound", dict(act_mb=8), 50.0),
    ("compute-fp8-compiled", "compute-bound",
     dict(fwd=((FP8_GEMM, 300.0), (FLASH, 100.0)), fp8=((AMAX, 8.0), (CAST, 8.0))), 50.0),
    ("launch", "launch-bound", dict(layers=8, fwd=_tiny(GEMM), host_us=25.0, gap_us=15.0), 50.0),
    ("launch-with-superoffload", "launch-bound",
     dict(layers=8, fwd=_tiny(GEMM), host_us=25.0, gap_us=15.0, optimizer="superoffload", update_us=150.0,
          grad_mb=1, push_mb=1), 50.0),
    ("input", "input-bound", dict(wait_us=5000.0), 50.0),
    ("input-superoffload-hidden", "input-bound",
     dict(wait_us=5000.0, optimizer="superoffload", update_us=400.0, grad_mb=20, push_mb=10), 50.0),
    ("cpu-update", "cpu-update-bound", dict(optimizer="superoffload", update_us=1500.0, grad_mb=20, push_mb=10), 50.0),
    ("cpu-update-no-ranges", "cpu-update-bound",
     dict(optimizer="superoffload", update_us=1500.0, update_ranges=False, grad_mb=20, push_mb=10), 50.0),
    ("cpu-update-worker-unseen-wait-range", "cpu-update-bound",
     dict(optimizer="superoffload", update_us=1500.0, grad_mb=20, push_mb=10, worker_seen=False, wait_range=True),
     50.0),
    ("cpu-update-then-link", "cpu-update-bound",
     dict(optimizer="superoffload", update_us=900.0, grad_mb=20, push_mb=10), 50.0),
    ("link-superoffload-weights", "link-bound",
     dict(optimizer="superoffload", update_us=300.0, grad_mb=20, push_mb=40), 25.0),
    ("link-slower-than-cpu-update", "link-bound",
     dict(optimizer="superoffload", update_us=1000.0, grad_mb=20, push_mb=30), 25.0),
    ("link-activation-offload", "link-bound", dict(act_mb=20), 25.0),
    ("memory", "memory-bound", dict(fwd=((GEMM, 60.0), (SILU, 120.0), (MUL, 120.0), (NORM, 100.0), (COPY, 80.0))),
     50.0),
    ("memory-fp8-eager-casts", "memory-bound",
     dict(fwd=((FP8_GEMM, 120.0), (SILU, 40.0)), fp8=((AMAX, 60.0), (CAST, 70.0), (AMAX, 50.0))), 50.0),
]


def _build(kw: dict, link: float) -> dict:
    return TraceBuilder(link_gbps=link).trace(**kw)


@pytest.fixture(scope="module")
def summaries():
    return {sid: summarize(parse_trace(_build(kw, link))) for sid, _, kw, link in SCENARIOS}


@pytest.mark.parametrize("sid, expected", [(s[0], s[1]) for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_injected_bottleneck_gets_its_verdict(summaries, sid, expected):
    v = summaries[sid]["verdict"]
    assert v["bound"] == expected, (v["stalls"], v["evidence"])
    assert v["advice"], v


def test_verdict_accuracy_on_the_injected_traces(summaries):
    right = [sid for sid, expected, _, _ in SCENARIOS if summaries[sid]["verdict"]["bound"] == expected]
    assert len(SCENARIOS) >= 10 and {e for _, e, _, _ in SCENARIOS} >= {
        "compute-bound", "launch-bound", "input-bound", "cpu-update-bound", "link-bound", "memory-bound"}
    assert len(right) / len(SCENARIOS) >= 0.9, sorted(set(s[0] for s in SCENARIOS) - set(right))
    assert len(right) == len(SCENARIOS)


@pytest.mark.parametrize("sid, needle", [
    ("cpu-update", "SuperOffloadStrategy(gpu_fraction=...)"),
    ("cpu-update", "cpu_threads="),
    ("cpu-update-no-ranges", "max_gpu_fraction"),
    ("link-superoffload-weights", "SuperOffloadStrategy(gpu_fraction=...)"),
    ("link-activation-offload", "ActivationOffload(budget=...)"),
    ("launch", "CUDAGraphCapture"),
    ("launch-with-superoffload", "CUDAGraphCapture"),
    ("input", "num_workers"),
    ("memory-fp8-eager-casts", "compile the blocks"),
    ("memory", "fuse elementwise"),
])
def test_advice_names_our_knob(summaries, sid, needle):
    assert any(needle in a for a in summaries[sid]["verdict"]["advice"]), summaries[sid]["verdict"]["advice"]


def test_no_compile_advice_when_fp8_casts_are_cheap(summaries):
    s = summaries["compute-fp8-compiled"]
    assert 0 < s["fp8"]["cast_share"] < 0.1 and s["fp8"]["gemm_share"] > 0.5
    assert not any("compile the blocks" in a for a in s["verdict"]["advice"])
    eager = summaries["memory-fp8-eager-casts"]["fp8"]
    assert eager["cast_share"] > 0.4 and eager["top_casts"][0]["name"] in (AMAX, CAST)
    assert summaries["compute"]["fp8"] is None


def test_cpu_update_time_and_whether_it_hid(summaries):
    hidden, bound = summaries["compute-superoffload-hidden"]["cpu_update"], summaries["cpu-update"]["cpu_update"]
    assert hidden["source"] == bound["source"] == "ranges"
    assert hidden["per_step_ms"] == pytest.approx(4 * 0.4) and bound["per_step_ms"] == pytest.approx(4 * 1.5)
    # the last bucket's gradients land at the end of the backward: its update cannot hide under it
    assert hidden["under_backward_fraction"] >= 0.7 and hidden["exposed_share"] < 0.1
    assert bound["under_backward_fraction"] < 0.5 and bound["exposed_share"] > IDLE_BOUND
    assert bound["threads"] == [f"thread {WORKER[1]} (python)"]
    fallback = summaries["cpu-update-no-ranges"]["cpu_update"]
    assert fallback["source"] == "operators" and fallback["per_step_ms"] == pytest.approx(4 * 1.5)
    assert summaries["compute"]["cpu_update"] is None  # torch's Optimizer.step range on the training thread
    # idle time by cause adds up to the idle share
    g = summaries["cpu-update"]["gpu"]
    assert sum(g["idle"]["by_cause"].values()) == pytest.approx(g["idle_share"], abs=1e-5)
    assert g["idle"]["by_cause"]["cpu_update"] == pytest.approx(bound["exposed_share"], abs=1e-6)


def test_link_bytes_time_and_owners(summaries):
    link = summaries["link-superoffload-weights"]["link"]
    assert link["HtoD"]["bytes_per_step"] == 4 * 40 * MB + 1 * MB  # weights back + the batch
    assert link["DtoH"]["bytes_per_step"] == 4 * 20 * MB + 4  # gradients + the loss.item()
    assert link["HtoD"]["gbps"] == pytest.approx(25.0, rel=1e-3)
    assert link["HtoD"]["rate_gbps"] == 64.0 and link["rate_source"].startswith("nominal PCIe Gen5")
    assert link["HtoD"]["utilization"] == pytest.approx(25 / 64, rel=1e-3)
    owners = link["owners"]
    assert owners["optimizer"]["HtoD"] == 3 * 4 * 40 * MB and owners["optimizer"]["DtoH"] == 3 * 4 * 20 * MB
    assert owners["input"]["HtoD"] == 3 * MB and owners["other"]["DtoH"] == 3 * 4  # the loss.item()s
    assert max(owners.items(), key=lambda kv: kv[1]["alone_share"])[0] == "optimizer"
    assert summaries["link-superoffload-weights"]["activation_offload"] is None


def test_activation_offload_copies_and_their_overlap(summaries):
    hidden = summaries["compute-activation-offload-hidden"]["activation_offload"]
    exposed = summaries["link-activation-offload"]["activation_offload"]
    for a, mb in ((hidden, 8), (exposed, 20)):
        assert a["offload"]["count"] == a["prefetch"]["count"] == 3 * 4
        assert a["offload"]["bytes"] == a["prefetch"]["bytes"] == 3 * 4 * mb * MB
    # the last block's copies cannot hide: it is offloaded as the forward ends and reloaded first
    assert hidden["overlap_fraction"] > 0.7 and exposed["overlap_fraction"] < hidden["overlap_fraction"] - 0.15
    assert exposed["alone_share"] > IDLE_BOUND > hidden["alone_share"]


def test_measured_link_rate_from_context_wins():
    t = parse_trace(_build(dict(act_mb=20), 25.0))
    s = summarize(t, context={"link": {"h2d_gbps": 26.0, "d2h_gbps": 24.0}})
    assert s["link"]["rate_source"] == "measured (context)" and s["link"]["DtoH"]["rate_gbps"] == 24.0
    t.metadata["deviceProperties"] = [{"name": "NVIDIA GH200 480GB"}]
    assert summarize(t)["link"]["HtoD"]["rate_gbps"] == 450.0
    t.metadata.pop("deviceProperties")
    assert summarize(t)["link"]["HtoD"]["rate_gbps"] is None


def test_markdown_and_json_carry_the_new_sections(summaries, tmp_path):
    s = summaries["cpu-update"]
    md = render_markdown(s)
    assert "verdict: **cpu-update-bound**" in md and "## Offload, host link and fp8" in md
    assert "**CPU optimizer update** (ranges" in md and "| HtoD |" in md and "| optimizer |" in md
    assert "waiting for the CPU optimizer update" in md
    json.loads(json.dumps(s))  # JSON-ready
    assert "## Offload" not in render_markdown(summarize(parse_trace(
        {"traceEvents": [{"ph": "X", "cat": "kernel", "name": GEMM, "ts": 0, "dur": 5, "pid": 0, "tid": 7}]})))


def test_the_named_wait_shows_the_cpu_update_when_the_worker_thread_is_not_recorded():
    """A profiler that does not record other threads sees no CPU update: the GPU idles while the training thread,
    blocked, launches nothing, which reads as launch-bound (what a real trace of the 7B job showed before the wait had
    a name). The training thread's range around its wait for the update turns that idle time into the update's."""
    kw = dict(optimizer="superoffload", update_us=1500.0, grad_mb=20, push_mb=10, worker_seen=False)
    unnamed = summarize(parse_trace(TraceBuilder().trace(**kw)))
    named = summarize(parse_trace(TraceBuilder().trace(wait_range=True, **kw)))
    assert unnamed["verdict"]["bound"] == "launch-bound" and unnamed["verdict"]["stalls"]["cpu-update-bound"] == 0
    assert named["verdict"]["bound"] == "cpu-update-bound"
    assert named["verdict"]["stalls"]["cpu-update-bound"] == pytest.approx(
        unnamed["verdict"]["stalls"]["launch-bound"], abs=0.01)


# ---------------------------------------------------------------------------------------------- fixture files
FIXTURES = [("kineto_superoffload_cpu_update.json.gz", "cpu-update-bound"),
            ("kineto_activation_offload_link.json.gz", "link-bound")]


@pytest.mark.parametrize("name, expected", FIXTURES)
def test_fixture_traces(tmp_path, name, expected):
    s = summarize_trace(DATA / name, tmp_path, plot=True)
    assert s["verdict"]["bound"] == expected
    assert Path(s["files"]["png"]).stat().st_size > 1000


#: A real trace from the GPU machine: one settled step of the 7B job (HF Llama, Mistral-7B shape) with SuperOffload's
#: defaults, every step clipped, recorded by SelectiveProfiler (every thread) from one_gpu_job.py --profile-step.
REAL_7B = DATA / "kineto_superoffload_7b_settled_step.json.gz"


def test_a_real_superoffload_trace_shows_the_cpu_update_and_what_it_cost_the_gpu(tmp_path):
    """The worker thread's update ranges are read from the real trace; the update ran after backward (every step
    clipped) and the GPU waited for it only briefly: the host had run ahead and the GPU was still busy with the work
    queued before, so the window is compute-bound, and the stall the verdict weighs is the update's exposed share."""
    s = summarize_trace(REAL_7B, tmp_path, plot=False)
    cu = s["cpu_update"]
    assert cu["source"] == "ranges" and cu["per_step_ms"] > 0 and cu["under_backward_fraction"] < 0.05
    assert 0 < cu["exposed_share"] < 0.1
    assert s["verdict"]["bound"] == "compute-bound" and s["gpu"]["busy_share"] > 0.9
    assert s["verdict"]["stalls"]["cpu-update-bound"] == pytest.approx(cu["exposed_share"], abs=1e-6)
    # the offload's exposed time (CPU-update wait 3.9% + its copies alone 5.6%) comes with its knob
    lever = [a for a in s["verdict"]["advice"] if a.startswith("SuperOffload's offload is exposed")]
    assert len(lever) == 1 and "gpu_fraction" in lever[0]


#: A real trace from the GPU machine: one settled step of the one-GPU job at Llama-3.1-8B's shape (vocabulary 128256,
#: so the logits leave room for a small GPU tail) with SuperOffload's defaults, every step clipped, from
#: one_gpu_job.py --vocab 128256 --profile-step.
REAL_8B = DATA / "kineto_superoffload_8b_link_bound.json.gz"


def test_a_real_superoffload_trace_where_the_offload_bounds_the_step(tmp_path):
    """Most of the optimizer state is on the host: the GPU computes nothing for a third of the window, half of it
    waiting for the CPU update, half while only the host link's copies run. The verdict names the link, the update's
    stall gets its own advice, and the link's bytes each way are read from the copies."""
    s = summarize_trace(REAL_8B, tmp_path, plot=False)
    stalls, cu, link = s["verdict"]["stalls"], s["cpu_update"], s["link"]
    assert s["verdict"]["bound"] == "link-bound" and sum(stalls.values()) >= 0.25
    assert stalls["link-bound"] > 0.1 and stalls["cpu-update-bound"] > 0.1
    assert cu["source"] == "ranges" and cu["under_backward_fraction"] < 0.05 and cu["exposed_share"] > 0.1
    assert link["HtoD"]["bytes_per_step"] > link["DtoH"]["bytes_per_step"] > 1e10  # weights up in fp32, bf16 grads down
    advice = " ".join(s["verdict"]["advice"])
    assert "gpu_fraction" in advice and "cpu_threads" in advice and "speculative=True" in advice


#: A real trace from the GPU machine: two steps of a small HF Llama (hidden 256, 4 layers, 4 x 256 tokens,
#: bf16-mixed, fused AdamW, its own loss) on one H100, recorded by SelectiveProfiler from benchmarks/observe_job.py.
REAL_SMALL = DATA / "kineto_small_hf_launch_bound.json.gz"


def test_a_real_trace_of_a_small_model_is_launch_bound(tmp_path):
    """Tiny kernels, the GPU idle between them while the host launches the next: launch-bound, with the CUDA-graph
    advice; no CPU update, no link traffic to speak of."""
    s = summarize_trace(REAL_SMALL, tmp_path, plot=False)
    assert s["verdict"]["bound"] == "launch-bound"
    assert s["gpu"]["busy_share"] < 0.2 and s["verdict"]["stalls"]["launch-bound"] > 0.5
    assert any("CUDAGraphCapture" in a for a in s["verdict"]["advice"])
    assert s["verdict"]["stalls"]["cpu-update-bound"] == 0.0
    assert not any(a.startswith("SuperOffload's offload") for a in s["verdict"]["advice"])


def test_fixtures_are_what_the_builder_writes():
    """The fixtures are the ``cpu-update`` and ``link-activation-offload`` scenarios, two steps each."""
    kw = {sid: k for sid, _, k, _ in SCENARIOS}
    built = {"kineto_superoffload_cpu_update.json.gz": dict(kw["cpu-update"], layers=3),
             "kineto_activation_offload_link.json.gz": dict(kw["link-activation-offload"], layers=3)}
    for name, kw in built.items():
        link = 50.0 if "superoffload" in name else 25.0
        with gzip.open(DATA / name, "rt") as f:
            stored = json.load(f)
        assert stored == json.loads(json.dumps(TraceBuilder(link_gbps=link).trace(steps=2, **kw)))
        assert load_trace(DATA / name).steps[0].number == 10


# ---------------------------------------------------------------------------------------------- the decision
F = BoundFacts
DECISIONS = [
    # facts, expected
    (F(has_gpu=False), "cpu-only"),
    (F(has_gpu=False, data_wait=0.3), "input-bound"),
    (F(has_gpu=True, tensor_core=0.8), "compute-bound"),
    (F(has_gpu=True, tensor_core=0.3), "memory-bound"),
    (F(has_gpu=True, tensor_core=0.8, idle_cpu_update=0.2), "compute-bound"),  # under IDLE_BOUND
    (F(has_gpu=True, tensor_core=0.8, idle_cpu_update=0.2, link_alone=0.06), "cpu-update-bound"),
    (F(has_gpu=True, idle_launch=0.4, idle_cpu_update=0.1), "launch-bound"),
    (F(has_gpu=True, idle_launch=0.1, idle_cpu_update=0.3), "cpu-update-bound"),
    (F(has_gpu=True, link_alone=0.35, idle_cpu_update=0.1, tensor_core=0.9), "link-bound"),
    (F(has_gpu=True, data_wait=0.4, idle_data_wait=0.35, idle_launch=0.05), "input-bound"),
    # the loop waited for data only 5% of the window: not input-bound, its idle time is latency
    (F(has_gpu=True, data_wait=0.05, idle_data_wait=0.05, idle_other=0.22), "latency-bound"),
    (F(has_gpu=True, data_wait=0.05, idle_data_wait=0.05, idle_launch=0.22), "launch-bound"),
    (F(has_gpu=True, comm_alone=0.3, tensor_core=0.9), "communication-bound"),
    (F(has_gpu=True, idle_other=0.3), "latency-bound"),
    (F(has_gpu=True, idle_cpu_update=0.15, link_alone=0.15), "cpu-update-bound"),  # a tie: the first listed
]


@pytest.mark.parametrize("facts, expected", DECISIONS)
def test_decide_table(facts, expected):
    assert decide(facts) == expected and expected in BOUNDS


@pytest.mark.parametrize("kwargs, error", [
    (dict(has_gpu=1), TypeError),
    (dict(has_gpu=True, idle_launch=1.5), ValueError),
    (dict(has_gpu=True, link_alone=-0.1), ValueError),
    (dict(has_gpu=True, tensor_core="0.5"), ValueError),
])
def test_bound_facts_refuse_bad_values(kwargs, error):
    with pytest.raises(error, match=r"BoundFacts\("):
        BoundFacts(**kwargs)


def test_verdict_reads_a_summary_written_before_idle_causes(summaries):
    s = json.loads(json.dumps(summaries["launch"]))
    del s["gpu"]["idle"]["by_cause"]
    s.pop("link")
    assert bound_facts(s).idle_launch > IDLE_BOUND and verdict(s)["bound"] == "launch-bound"


def test_a_gpu_adamw_on_autograd_thread_is_not_a_cpu_update():
    """A GPU tail updated with torch's fused AdamW from a backward hook launches a kernel: not a CPU update."""
    b = TraceBuilder()
    b.step(1, optimizer="superoffload", update_us=300.0, update_ranges=False, grad_mb=20, push_mb=10)
    backward = next(e for e in b.events if e["name"] == "lgh/backward")
    b.clock[AUTOGRAD] = backward["ts"] + backward["dur"] / 2  # inside the step
    b.op(AUTOGRAD, "aten::_fused_adamw_", 40, ADAM, 150.0)
    s = summarize(parse_trace({"traceEvents": b.events}))
    assert s["cpu_update"]["per_step_ms"] == pytest.approx(4 * 0.3)
    assert s["cpu_update"]["threads"] == [f"thread {WORKER[1]} (python)"]
