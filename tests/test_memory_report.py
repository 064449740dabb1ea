"""MemoryReport: the memory plan, the attribution of live memory to owners, and the out-of-memory report."""

import json

import lightning as L
import pytest
import torch

from lightning_gh import _host
from lightning_gh.memory import (
    MemoryReport,
    MemoryReportOptions,
    Shortfall,
    attribute,
    parse_cuda_oom,
    step_shortfall,
    suggest,
)

GIB = 2**30
OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
       "512.00 MiB is free. Including non-PyTorch memory, this process has 78.67 GiB memory in use.")


def owners(w=0, g=0, s=0, a=0):
    return {"weights": w * GIB, "gradients": g * GIB, "optimizer state": s * GIB,
            "activations and temporaries": a * GIB}


def test_parse_reads_the_request_and_the_free_memory():
    assert parse_cuda_oom(OOM) == Shortfall(requested=2 * GIB, free=512 * 2**20)
    assert parse_cuda_oom("something else") is None


@pytest.mark.parametrize(
    ("live", "short", "kw", "first"),
    [
        # activations dominate: a budget lower by the missing bytes plus the margin
        (owners(w=14, a=60), Shortfall(4 * GIB, 1 * GIB), {}, 'ActivationOffload(budget="56GiB")'),
        # the optimizer state dominates and is on the GPU: offload it
        (owners(w=14, g=14, s=56, a=2), Shortfall(8 * GIB, 0), {}, 'strategy="superoffload"'),
        # already offloaded: the GPU tail is what to shrink
        (owners(w=14, s=20, a=2), Shortfall(8 * GIB, 0), {"superoffload": True},
         "SuperOffloadStrategy(max_gpu_fraction=...)"),
        # a budget in force: the new one is lower than it
        (owners(w=14, a=30), Shortfall(3 * GIB, 0), {"activation_budget": 24 * GIB},
         'ActivationOffload(budget="20GiB")'),
    ],
)
def test_suggest_names_the_knob_that_frees_the_missing_bytes(live, short, kw, first):
    assert suggest(live, short, **kw)[0].knob == first


@pytest.mark.parametrize(
    ("kw", "first"),
    [
        # the failure's size alone: the budget frees the missing bytes
        ({}, 'ActivationOffload(budget="36GiB")'),
        # failed in the forward: the backward holds that tensor's gradient too, so the knobs free its size as well
        ({"in_forward": True}, 'ActivationOffload(budget="23GiB")'),
        # HF checkpointing already recomputes every block and the host has no room for their inputs: no budget
        ({"recomputing": True, "host_room": 0}, "at most 92,758 tokens per step (now 98,304)"),
        ({"recomputing": True, "host_room": 0, "in_forward": True}, "at most 59,486 tokens per step (now 98,304)"),
        # ... with room on the host, the budget offloads those inputs
        ({"recomputing": True, "host_room": 64 * GIB}, 'ActivationOffload(budget="36GiB")'),
        # blocks that do not recompute yet: a budget recomputes them, host room or not
        ({"host_room": 0}, 'ActivationOffload(budget="36GiB")'),
    ],
)
def test_the_activation_budget_is_suggested_only_where_it_can_free_memory(kw, first):
    live = owners(w=14, a=39)
    assert suggest(live, Shortfall(12 * GIB, 10 * GIB), tokens_per_step=98304, **kw)[0].knob == first


@pytest.mark.parametrize(("where", "phase"), [("training_step", "forward"), ("on_after_backward", "backward"),
                                           ("on_before_optimizer_step", "optimizer step")])
def test_the_report_knows_whether_the_step_failed_in_the_forward(tmp_path, monkeypatch, where, phase):
    """Raised in training_step, the knobs also free the failed tensor's gradient (``in_forward``); raised later in
    the step, only the missing bytes. HF checkpointing and the host room reach the knobs too."""
    from lightning_gh import _host
    from lightning_gh.memory import callback as cb_mod

    seen = {}
    monkeypatch.setattr(cb_mod, "suggest", lambda *a, **kw: seen.update(kw) or [])
    monkeypatch.setattr(_host.PLAN, "room", lambda part, *a, **kw: 123 if part == "ActivationOffload" else None)

    class Late(Tiny):
        def on_after_backward(self):
            if where == "on_after_backward" and self.global_step == 1:
                raise torch.cuda.OutOfMemoryError(OOM)

        def on_before_optimizer_step(self, optimizer):
            if where == "on_before_optimizer_step" and self.global_step == 1:
                raise torch.cuda.OutOfMemoryError(OOM)

    model = Late(fail_at=1 if where == "training_step" else None, error=torch.cuda.OutOfMemoryError(OOM))
    cb = MemoryReport(folder=str(tmp_path), predict=False)
    trainer = L.Trainer(max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.fit(model)
    assert cb._phase == phase
    assert seen["in_forward"] is (phase == "forward")
    assert seen["recomputing"] is False and seen["host_room"] == 123


def test_hf_gradient_checkpointing_is_seen_inside_the_module():
    from lightning_gh._hf import checkpointing_owner

    inner = torch.nn.Linear(2, 2)
    inner.gradient_checkpointing_disable = lambda: None  # what a Hugging Face model has
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(inner))
    assert checkpointing_owner(outer) is None
    inner.is_gradient_checkpointing = True
    assert checkpointing_owner(outer) == ("1.0", inner)


def test_the_report_gives_the_failures_own_figures_beside_the_unwound_owners():
    """The owners are read after the exception unwound part of the step; the report says so, with what torch's
    message gave for the moment of the failure, and takes the allocator's cache from the message too."""
    from lightning_gh.memory.oom import report

    msg = ("CUDA out of memory. Tried to allocate 11.72 GiB. GPU 0 has a total capacity of 79.18 GiB of which 9.76 GiB "
           "is free. Including non-PyTorch memory, this process has 69.32 GiB memory in use. Of the allocated memory "
           "63.96 GiB is allocated by PyTorch, and 4.63 GiB is reserved by PyTorch but unallocated.")
    short = parse_cuda_oom(msg)
    assert short.requested == int(11.72 * GIB) and short.cached == int(4.63 * GIB)
    text = report(owners(w=13, a=39), short, [], reserved=68 * GIB, allocated=52 * GIB, error=msg)
    assert "At the failure PyTorch had 63.96 GiB allocated" in text and "(52.00 GiB allocated then)" in text
    assert "fragmentation), at the failure | 4.63 GiB |" in text and "16.00 GiB" not in text
    # without those figures in the message: the reading after the error, as before
    text = report(owners(w=13, a=39), Shortfall(2 * GIB, GIB), [], reserved=68 * GIB, allocated=52 * GIB)
    assert "At the failure" not in text and "| allocator cache (reserved, not allocated: fragmentation) | 16.00 GiB |" in text


def test_suggest_fewer_tokens_in_proportion_to_the_activations():
    knobs = suggest(owners(w=14, a=40), Shortfall(12 * GIB, 2 * GIB), tokens_per_step=16384)
    fewer = [k for k in knobs if "tokens per step" in k.knob]
    assert fewer and fewer[0].knob.startswith("at most 11,878 tokens")  # 16384 x (1 - 11 GiB / 40 GiB)


@pytest.mark.parametrize(
    ("parts", "peak", "capacity", "first"),
    [
        # the first forward failed with only weights and activations live; the whole step also needs the gradients
        # and the optimizer state: the budget leaves room for them (90 GiB > 0.95 x 80 GiB: 14 GiB missing)
        ({"before the step": 14 * GIB, "gradients": 14 * GIB, "optimizer state": 28 * GIB}, 90 * GIB, 80 * GIB,
         'ActivationOffload(budget="18GiB")'),
        # a SuperOffload tail the plan expected to grow is not counted as activations
        ({"before the step": 15 * GIB, "gradients": 0, "optimizer state": 0,
          "GPU tail grown after the first steps": 5 * GIB}, 95 * GIB, 80 * GIB, 'ActivationOffload(budget="59GiB")'),
        # the peak is the optimizer step's: no activation knob, the state is what to move
        ({"before the step": 14 * GIB, "gradients": 14 * GIB, "optimizer state": 56 * GIB,
          "optimizer step temporaries": 6 * GIB, "activations": 20 * GIB}, 90 * GIB, 80 * GIB,
         'strategy="superoffload"'),
    ],
)
def test_a_predicted_step_sizes_the_knob_for_the_whole_step(parts, peak, capacity, first):
    owners, short = step_shortfall(parts, peak, capacity)
    assert suggest(owners, short)[0].knob == first


@pytest.mark.parametrize(("parts", "peak", "capacity"), [({}, 90 * GIB, 80 * GIB), ({"gradients": GIB}, None, 80 * GIB),
                                                        ({"gradients": GIB}, 90 * GIB, None),
                                                        ({"gradients": GIB}, 70 * GIB, 80 * GIB)])
def test_no_step_shortfall_without_a_prediction_or_when_it_fits(parts, peak, capacity):
    assert step_shortfall(parts, peak, capacity) is None


def test_attribute_counts_each_storage_once():
    model = torch.nn.Linear(16, 16)  # 16x16 + 16 fp32 = 1088 B
    model.weight.grad = torch.zeros_like(model.weight)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    got = attribute(model, [opt], allocated=100_000, device_type="cpu")
    assert attribute(model, [opt], allocated=100_000)["weights"] == 0  # nothing of it is on a GPU
    assert got["weights"] == 1088
    assert got["gradients"] == 1088
    assert got["optimizer state"] == 2 * 1088 + 2 * 4  # exp_avg, exp_avg_sq, two scalar steps
    assert got["activations and temporaries"] == 100_000 - sum(v for k, v in got.items()
                                                               if k != "activations and temporaries")


class Tiny(L.LightningModule):
    def __init__(self, fail_at=None, error=None):
        super().__init__()
        self.layer = torch.nn.Embedding(32, 8)
        self.fail_at, self.error = fail_at, error

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise self.error
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(0, 32, (16, 8))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def cb_model(cb):
    return cb.model


def fit(tmp_path, model, **kw):
    cb = MemoryReport(folder=str(tmp_path), **kw)
    trainer = L.Trainer(max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model)
    cb.model = model
    return cb


def test_the_plan_is_written_before_the_first_step(tmp_path):
    cb = fit(tmp_path, Tiny(), measure_steps=2)
    data = json.loads((tmp_path / "memory_plan.json").read_text())
    assert set(data["gpu"]) >= {"weights", "gradients", "optimizer state"}
    assert cb.plan is not None and "| CPU | weights |" in cb.plan.table()
    assert data["gpu"]["weights"] == sum(p.numel() * p.element_size() for p in cb_model(cb).parameters())


def test_the_plan_before_the_first_step_has_the_predicted_peak(tmp_path, caplog):
    with caplog.at_level("INFO", logger="lightning_gh.memory.callback"):
        cb = fit(tmp_path, Tiny(), measure_steps=2)
    titles = [r.getMessage().splitlines()[0] for r in caplog.records if "memory plan" in r.getMessage()]
    assert titles == ["memory plan before the first step:", "memory plan after 2 steps:"]
    assert cb.plan.predicted_peak >= sum(cb.plan.gpu[k] for k in ("weights", "gradients", "optimizer state"))
    assert cb.plan.predicted["gradients"] == 32 * 8 * 4  # the embedding's, before AdamW has made any


def test_a_cuda_oom_writes_the_report_and_the_error_is_reraised(tmp_path):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fit(tmp_path, Tiny(fail_at=2, error=torch.cuda.OutOfMemoryError(OOM)))
    text = (tmp_path / "oom_report.md").read_text()
    assert "asked for 2.00 GiB with 512.0 MiB free" in text
    assert "## What would have fit" in text and "| weights |" in text


def test_the_report_sizes_its_knobs_from_the_plans_prediction(tmp_path):
    """An error early in the step, with a plan that predicted the whole step: the knobs are sized for the step."""

    class Predicted(MemoryReport):
        def build_plan(self, trainer, pl_module):
            plan = super().build_plan(trainer, pl_module)
            plan.gpu_free, plan.reserved = 70 * GIB, 10 * GIB
            plan.predicted_peak = 90 * GIB
            plan.predicted = {"before the step": 14 * GIB, "gradients": 14 * GIB, "optimizer state": 28 * GIB}
            return plan

    cb = Predicted(folder=str(tmp_path))
    trainer = L.Trainer(max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.fit(Tiny(fail_at=1, error=torch.cuda.OutOfMemoryError(OOM)))
    text = (tmp_path / "oom_report.md").read_text()
    assert "sized for the whole step" in text and "| optimizer state | 28.00 GiB |" in text
    assert cb.oom_knobs[0].knob == 'ActivationOffload(budget="18GiB")'


def test_a_host_memory_error_reports_the_host_plan(tmp_path):
    _host.PLAN.declare("ActivationOffload", 3 * GIB)
    try:
        with pytest.raises(MemoryError):
            fit(tmp_path, Tiny(fail_at=1, error=_host.HostMemoryError("no room")))
    finally:
        _host.PLAN.release("ActivationOffload")
    text = (tmp_path / "oom_report.md").read_text()
    assert "Out of host memory" in text and "ActivationOffload: will take 3.00 GiB" in text


@pytest.mark.parametrize(("kw", "exc"), [({"measure_steps": 0}, ValueError), ({"plan": "yes"}, TypeError),
                                         ({"folder": ""}, ValueError), ({"history_entries": 1.5}, TypeError),
                                         ({"predict": 1}, TypeError), ({"history_stacks": "no"}, TypeError)])
def test_bad_options_are_refused_with_the_name(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        MemoryReport(**kw)


@pytest.mark.parametrize(("stacks", "context"), [(True, "alloc"), (False, None)])
def test_history_records_python_stacks_of_allocations_or_none(stacks, context):
    from lightning_gh.memory.callback import history_arguments

    kw = history_arguments(MemoryReportOptions(record_history=True, history_stacks=stacks, history_entries=7))
    assert kw == {"enabled": "all", "context": context, "stacks": "python", "max_entries": 7}
    import inspect
    assert set(kw) <= set(inspect.signature(torch.cuda.memory._record_memory_history_impl).parameters)


def test_options_or_keywords_never_both():
    with pytest.raises(TypeError, match="both"):
        MemoryReport(options=MemoryReportOptions(), measure_steps=5)


def test_it_sits_beside_every_part_of_the_table(tmp_path):
    """Parts check the table at setup with every lightning_gh callback of the Trainer in it."""
    from lightning_gh import compat

    assert all(compat.verdict("MemoryReport", p).combine for p in compat.PARTS if p != "MemoryReport")
    model = Tiny()
    trainer = L.Trainer(max_steps=2, callbacks=[MemoryReport(folder=str(tmp_path))], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", strategy="superoffload")
    with pytest.warns(UserWarning, match="SuperOffloadStrategy on cpu"):
        trainer.fit(model)
    data = json.loads((tmp_path / "memory_plan.json").read_text())
    assert data["decisions"]["SuperOffload"].startswith("SuperOffload host plan:")
    # no GPU memory reading: the auto tail stays empty, and the plan says so
    assert "SuperOffload: gpu_fraction='auto' without a GPU memory reading: no tail" in data["prediction_note"]
    assert data["predicted"]["GPU tail grown after the first steps"] == 0


def test_the_predicted_peak_holds_the_gpu_tail_superoffload_settles_on(tmp_path, monkeypatch):
    """A GPU with room for the whole state beyond the tail's margin (the memory query replaced): the predicted peak
    holds the whole state, which the first step's plan does not have yet."""
    from lightning_gh.superoffload import memory as superoffload_memory
    from lightning_gh.superoffload.tail_mover import tail_bytes

    monkeypatch.setattr(superoffload_memory, "device_memory_room", lambda dev: (8 * GIB, 2 * GIB))
    model = Tiny()
    trainer = L.Trainer(max_steps=1, callbacks=[MemoryReport(folder=str(tmp_path))], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", strategy="superoffload")
    with pytest.warns(UserWarning, match="SuperOffloadStrategy on cpu"):
        trainer.fit(model)
    data = json.loads((tmp_path / "memory_plan.json").read_text())
    state = tail_bytes(trainer.optimizers[0].layout.slots)
    assert state == 32 * 8 * (8 + 4)  # fp32 embedding: moments and its gradient, no separate master
    assert data["predicted"]["GPU tail grown after the first steps"] == state
    assert "SuperOffload: the whole state (3.0 KiB) fits below the auto tail's target" in data["prediction_note"]
    assert "HeterogeneousAdamW: its state is counted as allocated now" not in data["prediction_note"]
    assert data["predicted_peak"] >= sum(data["predicted"][k] for k in ("before the step", "activations")) + state
