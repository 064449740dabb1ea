"""SuperOffload's CPU update is visible in a profiler trace that records every thread: a named range on its worker
thread (the trace summary reads the CPU update from it)."""

from typing import Any

import torch

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload.worker import CPU_UPDATE_RANGE, UPDATE_WAIT_RANGE


def _with_all_threads(kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        return {**kwargs, "experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):  # an older torch: the training thread only
        return dict(kwargs)


def test_the_cpu_update_range_is_recorded_from_the_worker_thread():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, module=model, bucket_size=1024)
    kwargs = _with_all_threads({})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **kwargs) as prof:
        for _ in range(3):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    opt.close()
    names = [e.name for e in prof.events()]
    if "experimental_config" in kwargs:  # this torch records other threads: the range must be there
        assert CPU_UPDATE_RANGE in names
    threads = {e.thread for e in prof.events() if e.name == CPU_UPDATE_RANGE}
    main = {e.thread for e in prof.events() if e.name.startswith("aten::mm")}
    assert not threads & main  # the update runs off the training thread


def test_range_names_match_what_the_trace_summary_reads():
    from lightning_gh.profiling import offload_analysis

    assert CPU_UPDATE_RANGE == offload_analysis.CPU_UPDATE_RANGE
    assert UPDATE_WAIT_RANGE == offload_analysis.UPDATE_WAIT_RANGE


def test_selective_profilers_torch_backend_records_other_threads(tmp_path):
    """SelectiveProfiler's torch backend asks torch to record every thread (where torch can), so a CPU update on its
    own thread is in the trace."""
    import threading

    from lightning_gh.profiling._profiler_backends import TorchBackend, _all_threads_config
    from lightning_gh.profiling.trace import load_trace

    backend = TorchBackend(record_shapes=False, with_stack=False, profile_memory=False)
    assert backend.start(1, {})

    def work():
        with torch.profiler.record_function(CPU_UPDATE_RANGE):
            torch.ones(64).add_(1)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    torch.ones(8).mul_(2)
    path = backend.stop(tmp_path / "trace.pt.trace.json.gz")
    ranges = [e for e in load_trace(path).annotations if e.name == CPU_UPDATE_RANGE]
    if _all_threads_config():  # this torch records other threads
        assert len(ranges) == 1


def test_a_second_session_of_the_torch_backend_steps_aside(tmp_path):
    """A session that records every thread leaves torch's per-thread "profiler enabled" flag off; a second one started
    in the same process still sees the first and skips its window instead of ending the first one's trace."""
    import warnings

    from lightning_gh._util import reset_warnings
    from lightning_gh.profiling._profiler_backends import WARN_KEY, TorchBackend

    reset_warnings(WARN_KEY + "torch-busy")  # a window skipped earlier in the session must not silence this one
    first = TorchBackend(record_shapes=False, with_stack=False, profile_memory=False)
    second = TorchBackend(record_shapes=False, with_stack=False, profile_memory=False)
    assert first.start(1, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not second.start(1, {})
    assert any("already active" in str(w.message) for w in caught)
    torch.ones(4).add_(1)
    assert first.stop(tmp_path / "t.pt.trace.json.gz").exists()
    assert TorchBackend.active == 0 and second.start(2, {})
    second.stop(None)
