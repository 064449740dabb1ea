"""CUDAGraphCapture on the CPU: argument validation, the no-CUDA path, the detectors, the optimizer guard, and the
canary on the Lightning internals it uses. The capture itself is tested on a GPU in tests/test_graphs_gpu.py."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections import namedtuple
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_gh._lightning import current_hook, in_hook, set_closure_result
from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.graphs import CUDAGraphCapture, GraphCaptureOptions, GraphReport, GraphState
from lightning_gh.graphs.buffers import StaticInputs, UnsupportedBatch, batch_signature, signature_difference
from lightning_gh.graphs.capture import _frozen_logs
from lightning_gh.graphs.detect import (
    SYNC_WARNING,
    Finding,
    SyncMonitor,
    _precision_finding,
    combine,
    dynamic_shape_finding,
    scheduler_finding,
    setup_findings,
    sync_finding,
)
from lightning_gh.graphs.logs import LogRecorder, detached, logged_value_problem
from lightning_gh.graphs.optim import (
    CapturableOptimizer,
    OptimizerGuard,
    live_tensors,
    make_capturable,
    move_lr_into_tensors,
    reassigned_lr_groups,
    unsupported_optimizer_reason,
)

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the machine-without-CUDA path")


# ----------------------------------------------------------------------------------------------------------------
# arguments


@pytest.mark.parametrize("kwargs, error, match", [
    ({"warmup_steps": 1}, ValueError, r"^CUDAGraphCapture\(warmup_steps=1\): expected an int >= 2"),
    ({"warmup_steps": 0}, ValueError, r"^CUDAGraphCapture\(warmup_steps=0\): expected"),
    ({"warmup_steps": 2.5}, TypeError, r"^CUDAGraphCapture\(warmup_steps=2.5\): expected"),
    ({"warmup_steps": True}, TypeError, r"^CUDAGraphCapture\(warmup_steps=True\): expected"),
    ({"max_recaptures": -1}, ValueError, r"^CUDAGraphCapture\(max_recaptures=-1\): expected an int >= 0"),
    ({"detect_syncs": "yes"}, TypeError, r"^CUDAGraphCapture\(detect_syncs='yes'\): expected True or False"),
    ({"strict": 1}, TypeError, r"^CUDAGraphCapture\(strict=1\): expected True or False"),
    ({"verbose": None}, TypeError, r"^CUDAGraphCapture\(verbose=None\): expected True or False"),
])
def test_arguments_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        CUDAGraphCapture(**kwargs)
    with pytest.raises(error, match=match):  # the options alone say the same
        GraphCaptureOptions(**kwargs)


def test_options_or_keywords_never_both():
    opts = GraphCaptureOptions(warmup_steps=4, strict=True)
    cb = CUDAGraphCapture(options=opts)
    assert cb.options is opts and (cb.warmup_steps, cb.strict) == (4, True)
    assert CUDAGraphCapture(warmup_steps=4, strict=True).options == opts
    with pytest.raises(TypeError, match="both options= and warmup_steps=5"):
        CUDAGraphCapture(5, options=opts)
    with pytest.raises(AttributeError):
        cb.warmup_steps = 6  # the options are read-only after construction


def test_states_are_an_enum_that_reads_as_text():
    assert [s.value for s in GraphState] == ["off", "warming up", "rehearsed", "captured", "eager"]
    report = GraphReport(state=GraphState.CAPTURED)
    assert report.state == "captured" and f"{report.state}" == "captured"
    assert report.to_dict()["state"] == "captured" and type(report.to_dict()["state"]) is str


def test_defaults():
    cb = CUDAGraphCapture()
    assert (cb.warmup_steps, cb.detect_syncs, cb.max_recaptures, cb.strict) == (3, True, 2, False)
    assert cb.report == GraphReport() and cb.report.summary().startswith("CUDAGraphCapture: off")


# ----------------------------------------------------------------------------------------------------------------
# no CUDA: one warning, and exactly the plain run


def _fit(callbacks, steps, tmp_path):
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny", lr=3e-3, warmup_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=callbacks)
    trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=256))
    return model, trainer


@no_cuda
def test_without_cuda_warns_once_and_equals_the_plain_run(tmp_path):
    plain, _ = _fit([], 6, tmp_path)
    cb = CUDAGraphCapture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed, trainer = _fit([cb], 6, tmp_path)
        _fit([cb], 2, tmp_path)  # a second fit with the same callback stays quiet
    ours = [str(w.message) for w in caught if "CUDAGraphCapture" in str(w.message)]
    assert ours == ["CUDAGraphCapture: no CUDA GPU is available, so nothing is captured; the run is the plain "
                    "eager run."]
    for (name, p), q in zip(plain.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    assert trainer.global_step == 6
    # nothing was wrapped or converted
    assert "optimizer_step" not in graphed.__dict__ and "log" not in graphed.__dict__
    assert not isinstance(trainer.optimizers[0].param_groups[0]["lr"], torch.Tensor)
    assert cb.report.state == "off" and cb.report.reason == "no CUDA GPU" and cb.report.replayed_steps == 0


@no_cuda
def test_setup_findings_without_cuda():
    model = LlamaLM.from_preset("tiny")
    assert setup_findings(object(), model) == [Finding("no-cuda", "no CUDA GPU is available")]


# ----------------------------------------------------------------------------------------------------------------
# static inputs and batch signatures


def test_static_inputs_copy_and_signature():
    Batch = namedtuple("Batch", "tokens targets")
    b1 = Batch(torch.arange(8).view(2, 4), torch.ones(2, 4, dtype=torch.long))
    static = StaticInputs({"batch": b1, "n": 3})
    assert static.batch["batch"].tokens is not b1.tokens and torch.equal(static.batch["batch"].tokens, b1.tokens)
    assert isinstance(static.batch["batch"], Batch) and static.batch["n"] == 3
    b2 = Batch(torch.arange(8, 16).view(2, 4), torch.zeros(2, 4, dtype=torch.long))
    assert static.difference({"batch": b2, "n": 3}) is None
    ptr = static.batch["batch"].tokens.data_ptr()
    static.copy_from({"batch": b2, "n": 3})
    assert static.batch["batch"].tokens.data_ptr() == ptr and torch.equal(static.batch["batch"].tokens, b2.tokens)
    # the last, smaller batch of an epoch
    small = Batch(torch.arange(4).view(1, 4), torch.zeros(1, 4, dtype=torch.long))
    assert static.difference({"batch": small, "n": 3}) == (
        "batch['batch'][0] is int64[1, 4] on cpu, captured int64[2, 4] on cpu")
    assert static.difference({"batch": b2, "n": 4}) == "batch['n'] is 4, captured 3"
    assert static.difference({"batch": b2}) == "batch has 1 entries, captured 2"
    assert static.nbytes == 2 * 8 * 8


def test_signature_detects_dtype_and_rejects_objects():
    a = batch_signature((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))
    b = batch_signature((torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.long)))
    assert signature_difference(a, b) == "batch[0] is float64[2, 3] on cpu, captured float32[2, 3] on cpu"
    assert signature_difference(a, a) is None

    class Custom:
        pass

    with pytest.raises(UnsupportedBatch, match="holds a .*Custom; a captured step takes tensors"):
        batch_signature([torch.zeros(1), Custom()])
    assert "holds a" in StaticInputs([torch.zeros(1)]).difference([Custom()])


def test_dynamic_shape_finding_names_the_change():
    sigs = [batch_signature((torch.zeros(4, n),)) for n in (128, 97, 64)]
    f = dynamic_shape_finding(sigs)
    assert f.cause == "dynamic-shapes"
    assert "batch[0] is float32[4, 97] on cpu, the step before had float32[4, 128] on cpu" in f.message
    assert "over 3 warm-up steps" in f.message and "pad or bucket" in f.message


# ----------------------------------------------------------------------------------------------------------------
# host synchronizations


def _user_step_that_syncs():
    warnings.warn(SYNC_WARNING, stacklevel=1)  # stands in for the warning CUDA's sync debug mode raises inside `.item()`
    return 1


def test_sync_monitor_names_the_users_line():
    with SyncMonitor(debug_mode=False) as mon:
        _user_step_that_syncs()
        _user_step_that_syncs()
        with warnings.catch_warnings(record=True) as other:
            warnings.simplefilter("always")
            warnings.warn("unrelated", stacklevel=1)
    assert len(mon.events) == 2
    assert [str(w.message) for w in other] == ["unrelated"]  # other warnings pass through
    f = sync_finding(mon.events)
    line = inspect.getsourcelines(_user_step_that_syncs)[1] + 1
    assert f.cause == "cpu-sync"
    assert f"test_graphs.py:{line} in _user_step_that_syncs: `warnings.warn(SYNC_WARNING, stacklevel=1)" in f.message
    assert "other place" not in f.message  # the same line twice is one place
    assert ".item()" in f.message


def test_sync_monitor_ignores_other_threads_and_reports_library_frames():
    import threading

    with SyncMonitor(debug_mode=False) as mon:
        t = threading.Thread(target=lambda: warnings.warn(SYNC_WARNING, stacklevel=1))  # e.g. the pin-memory thread
        t.start()
        t.join()
    assert mon.events == []
    # a sync raised inside library code is reported at the innermost frame of user code that led to it
    with SyncMonitor(debug_mode=False) as mon:
        exec(compile("import warnings; warnings.warn(%r)" % SYNC_WARNING, torch.__file__, "exec"))
    f = sync_finding(mon.events)
    assert f is not None and "test_graphs.py" in f.message  # this test is the innermost user frame
    assert sync_finding([]) is None


def test_combine_makes_one_message():
    a, b = Finding("cpu-sync", "syncs at x.py:1."), Finding("logged-value", "logs a float")
    assert combine([]) is None and combine([a]) is a
    c = combine([a, b])
    assert c.cause == "cpu-sync+logged-value" and c.message == "syncs at x.py:1. Also: logs a float."


# ----------------------------------------------------------------------------------------------------------------
# logged values


def test_logged_value_problems():
    dev = torch.device("cuda", 0)
    assert "Python number 0.001" in logged_value_problem("lr", 0.001, dev)
    assert "tensor on cpu" in logged_value_problem("x", torch.tensor(1.0), dev)
    assert "gets a object" in logged_value_problem("m", object(), dev)
    assert "'d.b'" in logged_value_problem("d", {"a": torch.tensor(1.0, device="meta"), "b": 2}, torch.device("meta"))
    assert logged_value_problem("ok", torch.tensor(1.0), torch.device("cpu")) is None


def test_log_recorder_reissues_under_the_recording_hook():
    module = LlamaLM.from_preset("tiny")
    seen = []

    def fake_log(name, value, prog_bar=False, logger=None, on_step=None, on_epoch=None, **kw):
        seen.append((current_hook(module), name, value, prog_bar, on_step))

    rec = LogRecorder(fake_log)
    w = torch.tensor(1.0, requires_grad=True)
    t = w * 2  # a loss with an autograd graph: recorded detached, on the same storage
    rec.record("training_step", ("train/loss", t), {"prog_bar": True})
    recorded = rec.calls[0].args[1]
    assert not recorded.requires_grad and recorded.data_ptr() == t.data_ptr()
    t = recorded
    rec.record("on_before_optimizer_step", (), {"name": "gn", "value": 3.5, "on_step": True})
    assert rec.logged_tensors() == [("train/loss", t)]
    with in_hook(module, "optimizer_step"):
        rec.reissue(module, fake_log)
        assert current_hook(module) == "optimizer_step"
    assert seen == [("training_step", "train/loss", t, True, None),
                    ("on_before_optimizer_step", "gn", 3.5, False, True)]
    problems = rec.findings(torch.device("cpu"))
    assert len(problems) == 1 and "self.log('gn') gets the Python number 3.5" in problems[0]
    assert problems[0].endswith("[in on_before_optimizer_step]")


# ----------------------------------------------------------------------------------------------------------------
# configuration checks


def test_precision_findings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler warns that it is disabled without CUDA
        fp16 = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda"))
    assert _precision_finding(fp16).cause == "grad-scaler"
    assert "bf16-mixed" in _precision_finding(fp16).message
    assert _precision_finding(MixedPrecision("bf16-mixed", "cuda")) is None

    class FP8Plugin(MixedPrecision):
        pass

    f = _precision_finding(FP8Plugin("bf16-mixed", "cuda"))
    assert f.cause == "precision"
    assert "FP8Plugin is not captured: its combination with whole-step capture has not been verified yet" in f.message
    assert "host" not in f.message  # no claim about where a recipe keeps its scaling state


def _cpu_adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, betas=(0.9, 0.99))


@pytest.mark.parametrize("make, expected", [
    (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10), "OneCycleLR cycles the momentum"),
    (lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-4, 1e-2, step_size_up=4), "CyclicLR cycles the momentum"),
    (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10, cycle_momentum=False), None),
    (lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-4, 1e-2, cycle_momentum=False), None),
    (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10, base_momentum=0.9,
                                                   max_momentum=0.9), None),
    (lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-4, 1e-2, base_momentum=0.9, max_momentum=0.9), None),
    (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0), None),
])
def test_momentum_cycling_schedulers_are_found_at_setup(make, expected):
    opt = _cpu_adamw()
    sched = make(opt)
    f = scheduler_finding([sched])
    if expected is None:
        assert f is None
        return
    assert f.cause == "momentum-schedule" and expected in f.message and "cycle_momentum=False" in f.message
    # what the finding predicts: the scheduler writes new betas on every step, which a graph would bake in
    seen = set()
    for _ in range(3):
        opt.step()
        sched.step()
        seen.add(opt.param_groups[0]["betas"])
    assert len(seen) == 3


def test_logs_of_live_tensors_are_not_frozen():
    """A logged tensor replays correctly when the graph computes it (pool) or changes it in place every step
    (parameters, the optimizer's lr tensors and state); anything else would log its capture-time value."""
    opt, params, lrs = _adamw_with_state()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    computed = torch.ones(4)  # stands in for an output of the graph, allocated from its pool
    pool = [(computed.untyped_storage().data_ptr(), computed.untyped_storage().data_ptr() + computed.nbytes)]
    rec = LogRecorder(lambda name, value, **kw: None)
    logged = {"loss": computed[1:], "weight": params[0][0], "lr": lrs[1], "exp_avg": opt.state[params[0]]["exp_avg"],
              "adam_step": opt.state[params[1]]["step"], "sched_lr": sched.get_last_lr()[0], "host": torch.zeros(1)}
    for name, value in logged.items():
        rec.record("training_step", (name, value), {})
    live = (*params, *live_tensors(opt, lrs))
    assert _frozen_logs(rec, pool, live) == ["sched_lr", "host"]  # get_last_lr() hands out a copy
    assert _frozen_logs(rec, [], params) == ["loss", "lr", "exp_avg", "adam_step", "sched_lr", "host"]


def test_logged_tensors_that_the_step_updates_are_copied_at_the_call():
    """Lightning takes a logged value at the call; a parameter or optimizer state logged before the update must be
    re-issued with that value, not the updated one (a capture copies it inside the graph, at the same place)."""
    opt, params, lrs = _adamw_with_state()
    step = opt.state[params[0]]["step"]
    loss = torch.tensor(2.0)
    rec = LogRecorder(lambda name, value, **kw: None,
                      snapshot=frozenset(t.untyped_storage().data_ptr() for t in (*params, *live_tensors(opt, lrs))))
    rec.record("training_step", ("adam_step", step), {})
    rec.record("training_step", (), {"name": "d", "value": {"w": params[0][0, 0], "loss": loss}})
    step.add_(1)  # the optimizer update, later in the step
    params[0].data.mul_(2)
    assert rec.calls[0].args[1].item() == 2 and rec.given[0].args[1].data_ptr() == step.data_ptr()
    assert torch.equal(rec.calls[1].kwargs["value"]["w"], rec.given[1].kwargs["value"]["w"] / 2)
    assert rec.calls[1].kwargs["value"]["loss"].data_ptr() == loss.data_ptr()  # what the step computes: as is
    assert [n for n, _ in rec.logged_tensors()] == ["adam_step", "d.loss", "d.w"]  # the tensors as given


def test_lr_assignments_are_found_and_moved_into_the_tensors():
    opt, _, lrs = _adamw_with_state()
    assert reassigned_lr_groups(opt.param_groups, lrs) == [] and move_lr_into_tensors(opt.param_groups, lrs) == []
    opt.param_groups[1]["lr"] = torch.tensor([0.5])  # another tensor, as a user might assign
    assert reassigned_lr_groups(opt.param_groups, lrs) == [1]
    assert move_lr_into_tensors(opt.param_groups, lrs) == [1]
    assert opt.param_groups[1]["lr"] is lrs[1] and lrs[1].shape == () and lrs[1].item() == 0.5


def test_eager_fallback_leaves_its_own_gradients_in_grad():
    """After an eager step between replays (the last, smaller batch) .grad must hold that step's gradients, in the
    captured tensors the later replays write (the GPU test checks the whole run against the eager one)."""
    cb = CUDAGraphCapture()
    p, q, r, s = (torch.nn.Parameter(torch.zeros(3)) for _ in range(4))
    last_replay = [torch.full((3,), 7.0) for _ in range(3)]  # the captured tensors, holding the last replay's values
    cb._static_grads = [(p, last_replay[0]), (q, last_replay[1]), (r, None), (s, last_replay[2])]
    s.grad = last_replay[2]

    def eager_step():
        p.grad = torch.ones(3)  # zero_grad(set_to_none=True), then backward: a fresh tensor
        q.grad = None  # no gradient in this step
        r.grad = torch.full((3,), 2.0)  # a gradient where the graph made none
        s.grad.zero_().add_(3.0)  # zero_grad(set_to_none=False): accumulated into the captured tensor itself

    cb._eager_step(eager_step, "smaller batch")
    assert p.grad is last_replay[0] and torch.equal(p.grad, torch.ones(3))
    assert q.grad is None and torch.equal(r.grad, torch.full((3,), 2.0))
    assert s.grad is last_replay[2] and torch.equal(s.grad, torch.full((3,), 3.0))
    # the next replay points these two back at what the graph wrote
    assert [(a is q, b is last_replay[1]) for a, b in cb._grads_to_repoint[:1]] == [(True, True)]
    assert len(cb._grads_to_repoint) == 2 and cb._grads_to_repoint[1][0] is r and cb._grads_to_repoint[1][1] is None
    assert cb.report.fallbacks == {"smaller batch": 1}


def test_detached_keeps_storage_and_structure():
    w = torch.ones(2, requires_grad=True)
    out = detached({"loss": w * 2, "extra": {"x": w * 3, "n": 1}, "s": "a"})
    assert not out["loss"].requires_grad and not out["extra"]["x"].requires_grad
    assert out["extra"]["n"] == 1 and out["s"] == "a" and detached(5) == 5
    t = w * 2
    assert detached(t).data_ptr() == t.data_ptr()


def test_optimizer_support():
    p = [torch.nn.Parameter(torch.zeros(3))]
    sgd = torch.optim.SGD(p, lr=0.1)
    assert unsupported_optimizer_reason(sgd).startswith("optimizer SGD is not supported")
    adamw = torch.optim.AdamW(p, lr=0.1)
    assert "on ['cpu']" in unsupported_optimizer_reason(adamw)
    with pytest.raises(ValueError, match=r"make_capturable\(optimizer\): optimizer parameters are on \['cpu'\]"):
        make_capturable(adamw)


# ----------------------------------------------------------------------------------------------------------------
# the optimizer guard (device-independent logic, on CPU tensors)


def _adamw_with_state():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2,
                            foreach=False)
    for _ in range(2):
        sum((q ** 2).sum() for q in params).backward()
        opt.step()
        opt.zero_grad()
    lrs = []
    for g in opt.param_groups:  # what make_capturable does on a GPU: the lr becomes a tensor
        g["lr"] = torch.tensor(float(g["lr"]))
        lrs.append(g["lr"])
    return opt, params, lrs


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_scheduler_fills_the_lr_tensor_in_place():
    opt, _, lrs = _adamw_with_state()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    guard = OptimizerGuard(opt, lrs)
    sched.step()
    assert guard.check().action == "replay"
    assert opt.param_groups[0]["lr"] is lrs[0] and lrs[0].item() == pytest.approx(5e-3)


def test_guard_repairs_a_float_lr_assignment():
    opt, _, lrs = _adamw_with_state()
    guard = OptimizerGuard(opt, lrs)
    opt.param_groups[1]["lr"] = 0.25  # e.g. ReduceLROnPlateau or user code
    r = guard.check()
    assert (r.action, r.repaired) == ("replay", ("lr of param group 1",))
    assert opt.param_groups[1]["lr"] is lrs[1] and lrs[1].item() == 0.25


def test_guard_restores_a_loaded_state_in_place():
    opt, params, lrs = _adamw_with_state()
    saved = copy.deepcopy(opt.state_dict())
    captured = {id(p): dict(opt.state[p]) for p in params}
    state_obj = opt.state
    guard = OptimizerGuard(opt, lrs)
    sum((q ** 2).sum() for q in params).backward()
    opt.step()  # move the state on, then load the older one, as a resume would
    lrs[0].fill_(0.5)
    opt.load_state_dict(saved)
    assert opt.state is not state_obj
    r = guard.check()
    assert r.action == "replay" and r.repaired[0].startswith("optimizer state (restored in place")
    assert opt.state is state_obj  # the captured objects are back...
    for i, p in enumerate(params):
        for k, t in opt.state[p].items():
            assert t is captured[id(p)][k]  # ...the very tensors the graph reads...
            assert torch.equal(t, saved["state"][i][k])  # ...holding the loaded values
    assert opt.param_groups[0]["lr"] is lrs[0] and lrs[0].item() == pytest.approx(1e-2)


def test_guard_asks_for_recapture_or_eager():
    opt, params, lrs = _adamw_with_state()
    guard = OptimizerGuard(opt, lrs)
    opt.param_groups[0]["betas"] = (0.8, 0.95)
    r = guard.check()
    assert r.action == "recapture" and "param group 0's 'betas' changed from (0.9, 0.999) to (0.8, 0.95)" in r.reason
    opt, params, lrs = _adamw_with_state()
    guard = OptimizerGuard(opt, lrs)
    fresh = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2)
    opt.load_state_dict(fresh.state_dict())  # a state without entries cannot be restored into the graph's tensors
    r = guard.check()
    assert r.action == "eager" and "different entries" in r.reason


def test_checkpoint_state_is_written_plain_without_touching_the_optimizer():
    opt, params, lrs = _adamw_with_state()
    for g in opt.param_groups:
        g["capturable"] = True
    for p in params:  # capturable Adam keeps the step on the device; here the "device" is the CPU
        opt.state[p]["step"] = opt.state[p]["step"].clone()
    record = CapturableOptimizer(opt, lrs, [False, False])
    sd = record.plain_state_dict(opt.state_dict())
    assert [g["lr"] for g in sd["param_groups"]] == [pytest.approx(1e-2)] * 2
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in sd["param_groups"])
    assert opt.param_groups[0]["lr"] is lrs[0] and opt.param_groups[0]["capturable"] is True
    step_before = opt.state[params[0]]["step"]
    sd["state"][0]["step"] += 100  # the checkpoint's copy, not the live one
    assert opt.state[params[0]]["step"] is step_before and step_before.item() == 2
    record.restore()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2) and opt.param_groups[0]["capturable"] is False


def test_lightning_accepts_a_step_handed_over_without_its_closure(tmp_path):
    """The replay path's contract with Lightning, end to end on the CPU: optimizer_step does the step itself,
    re-issues the recorded logs under training_step and hands the loss over; Lightning counts the step, logs the
    value of this step and steps the scheduler."""

    class HandOver(LlamaLM):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            if batch_idx < 2:
                return optimizer.step(closure=optimizer_closure)
            rec = LogRecorder(LlamaLM.log.__get__(self))
            self.log = lambda *a, **k: rec.record(current_hook(self), a, k)
            with in_hook(self, "training_step"):
                loss = LlamaLM.training_step(self, self.batch_now, batch_idx)
            del self.log
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.reissue(self, self.log)
            set_closure_result(optimizer_closure, loss.detach(), 1)

    class Trace(Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pl_module.batch_now = batch

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows.append((trainer.global_step, trainer.callback_metrics["train/loss"].item(),
                              outputs["loss"].item(), trainer.optimizers[0].param_groups[0]["lr"]))

    L.seed_everything(0, verbose=False)
    model, trace = HandOver.from_preset("tiny", lr=3e-3, warmup_steps=4), Trace()
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[trace])
    trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=256))
    assert [r[0] for r in trace.rows] == [1, 2, 3, 4, 5]
    assert all(logged == out for _, logged, out, _ in trace.rows)  # each step's own value
    assert len({r[1] for r in trace.rows}) == 5
    assert [r[3] for r in trace.rows] == pytest.approx([3e-3 * min(1, (s + 1) / 5) for s in range(1, 6)])


# ----------------------------------------------------------------------------------------------------------------
# the demo part and the benchmark suite


@no_cuda
def test_graphs_suite_runs_on_cpu(tmp_path, capsys, monkeypatch, frozen_heap):
    import json

    # In-process through the runner's main (tests/test_benchmarks.py runs the command line in a subprocess once), so
    # the test pays no second interpreter start and import of torch and Lightning.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run as bench_run

    rc = bench_run.main(["--suite", "graphs", "--preset", "tiny", "--iters", "2", "--warmup", "1", "--device", "cpu",
                         "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    data = json.loads((tmp_path / "bench_graphs.json").read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows)[:2] == ["lightning eager", "lightning + CUDAGraphCapture"]
    assert rows["lightning eager"]["median_ms"] > 0 and rows["lightning + CUDAGraphCapture"]["median_ms"] > 0
    assert rows["lightning + CUDAGraphCapture"]["graph_state"] == "off"
    assert "needs CUDA" in rows["lightning + compile reduce-overhead"]["error"]
    assert "anchor" in out


def test_replayed_and_eager_step_counts_reach_the_loggers(tmp_path, monkeypatch):
    """The counts go through Lightning's loggers at the end of the fit (here a CSVLogger's metrics.csv).
    On a CPU nothing is captured; a declined capture (any setup finding) still reports its counts."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_gh.graphs import capture as capture_mod

    monkeypatch.setattr(capture_mod, "setup_findings",
                        lambda trainer, pl_module: [Finding("strategy", "a test finding: nothing is captured")])
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny")
    cb = CUDAGraphCapture(verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=CSVLogger(tmp_path, name="", version="logs"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=64))
    with (tmp_path / "logs" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("lgh/graph_replayed_steps")]
    assert len(rows) == 1 and cb.report.state == "eager"
    assert float(rows[0]["lgh/graph_replayed_steps"]) == cb.report.replayed_steps == 0
    assert float(rows[0]["lgh/graph_eager_steps"]) == cb.report.eager_steps


def test_capture_is_refused_next_to_activation_offload_at_setup(tmp_path):
    """Which parts combine is decided once (lightning_gh.compat), at setup, naming both parts."""
    from lightning_gh.activation_offload import ActivationOffload
    from lightning_gh.compat import IncompatiblePartsError

    with pytest.raises(IncompatiblePartsError) as e:
        _fit([CUDAGraphCapture(), ActivationOffload()], 2, tmp_path)
    assert "ActivationOffload" in str(e.value) and "CUDAGraphCapture" in str(e.value)
    assert CUDAGraphCapture.lgh_part == "CUDAGraphCapture"
