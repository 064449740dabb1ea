"""SuperOffload's CPU update is visible in a profiler trace that records every thread: a named range on its worker
thread (the trace summary reads the CPU update from it)."""

from typing import Any

import torch

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload.worker import CPU_UPDATE_RANGE


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
