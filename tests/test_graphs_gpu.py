"""CUDAGraphCapture on a CUDA GPU (skipped without one): parity with the eager run, LR schedules, clipping, validation,
checkpoint resume and in-place restore, the last smaller batch, and detection of what cannot be captured.

Parity is bitwise in fp32: both runs use deterministic kernels (``Trainer(deterministic=True)``) and the same
optimizer arithmetic (the eager reference converts its AdamW with ``make_capturable`` exactly as CUDAGraphCapture
does: capturable state, device-tensor lr). With bf16-mixed the tolerance is 1e-3 relative on every loss and 2e-3
relative (L2) on the parameters after 50 steps.
"""

from __future__ import annotations

import copy
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_gh.demo import LlamaLM, MarkovDataModule, preset
from lightning_gh.demo.data import MarkovDataset
from lightning_gh.graphs import CUDAGraphCapture, make_capturable

pytestmark = pytest.mark.gpu
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before the first handle

CFG = preset("small", n_layers=2)  # d=512, 8192 vocab, 4 x 128 tokens: launch-bound, fast to run


class Trace(Callback):
    """Per step: the logged loss, the loss handed to on_train_batch_end, the learning rate; per validation: val/loss."""

    def __init__(self):
        self.logged, self.outputs, self.lrs, self.val = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(trainer.callback_metrics["train/loss"].item())
        self.outputs.append(outputs["loss"].item())
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(trainer.callback_metrics["val/loss"].item())


class SameOptimizerArithmetic(Callback):
    """The eager reference: the optimizer converted as CUDAGraphCapture converts it (when training starts, after a
    resumed run's state is loaded), nothing captured."""

    def on_train_start(self, trainer, pl_module):
        make_capturable(trainer.optimizers[0])


class OrderedData(MarkovDataModule):
    """Markov batches in a fixed order, optionally keeping the last, smaller batch of each epoch."""

    def __init__(self, *args, drop_last: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop_last = drop_last

    def train_dataloader(self):
        self.setup()
        ds = MarkovDataset(self.corpus, self.seq_len, self.num_train_samples)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, drop_last=self.drop_last, pin_memory=True)


def fit(tmp_path, callbacks, *, steps=50, precision="32-true", model_cls=LlamaLM, samples=4 * 400, drop_last=True,
        ckpt_path=None, model_kwargs=None, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    model = model_cls(CFG, lr=2e-3, warmup_steps=20, **(model_kwargs or {}))
    dm = OrderedData.for_model(model, num_train_samples=samples, drop_last=drop_last, pin_memory=True)
    trace = Trace()
    trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=steps, precision=precision, deterministic="warn",
                        logger=False, enable_checkpointing=bool(trainer_kwargs.pop("checkpointing", False)),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path, callbacks=[trace, *callbacks], **trainer_kwargs)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer, trace


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs: max abs {(p - q).abs().max().item():.3e}"


def test_fp32_parity_over_50_steps_is_bitwise(tmp_path):
    eager, _, te = fit(tmp_path, [SameOptimizerArithmetic()])
    cb = CUDAGraphCapture(warmup_steps=3)
    graphed, trainer, tg = fit(tmp_path, [cb])
    assert tg.logged == te.logged and tg.outputs == te.outputs  # every step's logged value, not a frozen one
    assert len(set(tg.logged)) == 50
    assert_same_params(eager, graphed)
    r = cb.report
    assert (r.state, r.captures, r.warmup_steps, r.replayed_steps, r.eager_steps) == ("captured", 1, 3, 47, 0)
    assert r.pool_bytes and r.pool_bytes > 0 and r.fallbacks == {}
    # after the fit: hooks unwrapped, float learning rates back
    assert "optimizer_step" not in graphed.__dict__ and "log" not in graphed.__dict__
    assert isinstance(trainer.optimizers[0].param_groups[0]["lr"], float)


def test_lr_schedule_keeps_changing_after_capture(tmp_path):
    _, _, te = fit(tmp_path, [SameOptimizerArithmetic()], steps=30)
    cb = CUDAGraphCapture(warmup_steps=3)
    _, _, tg = fit(tmp_path, [cb], steps=30)
    assert tg.lrs == te.lrs
    assert tg.lrs == pytest.approx([2e-3 * min(1.0, (s + 1) / 21) for s in range(1, 31)])
    assert tg.logged == te.logged and cb.report.replayed_steps == 27


def test_plain_eager_run_is_within_rounding(tmp_path):
    """Against the untouched run (float lr, capturable=False) the difference is last-bit rounding only."""
    plain, _, tp = fit(tmp_path, [])
    graphed, _, tg = fit(tmp_path, [CUDAGraphCapture()])
    assert tg.logged == pytest.approx(tp.logged, rel=1e-5)
    for p, q in zip(plain.parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_bf16_mixed_parity_within_tolerance(tmp_path):
    eager, _, te = fit(tmp_path, [SameOptimizerArithmetic()], precision="bf16-mixed")
    cb = CUDAGraphCapture()
    graphed, _, tg = fit(tmp_path, [cb], precision="bf16-mixed")
    assert cb.report.replayed_steps == 47
    assert tg.logged == pytest.approx(te.logged, rel=1e-3)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        rel = ((p - q).norm() / p.norm()).item()
        assert rel <= 2e-3, f"{name}: relative L2 difference {rel:.2e}"


def test_gradient_norm_clipping_inside_the_graph(tmp_path):
    eager, _, te = fit(tmp_path, [SameOptimizerArithmetic()], gradient_clip_val=0.05)
    cb = CUDAGraphCapture()
    graphed, trainer, tg = fit(tmp_path, [cb], gradient_clip_val=0.05)
    assert tg.logged == te.logged
    assert_same_params(eager, graphed)
    # the clipping really ran in the replayed steps: the captured gradients have the clipped norm
    grads = [p.grad for p in graphed.parameters() if p.grad is not None]
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item() == pytest.approx(0.05, rel=1e-3)
    unclipped, _, _ = fit(tmp_path, [CUDAGraphCapture()])
    assert not all(torch.equal(p, q) for p, q in zip(unclipped.parameters(), graphed.parameters()))


def test_value_clipping_and_bf16_true(tmp_path):
    kw = dict(steps=20, precision="bf16-true", gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    eager, _, te = fit(tmp_path, [SameOptimizerArithmetic()], **kw)
    cb = CUDAGraphCapture()
    graphed, _, tg = fit(tmp_path, [cb], **kw)
    assert cb.report.replayed_steps == 17 and next(graphed.parameters()).dtype == torch.bfloat16
    assert tg.logged == pytest.approx(te.logged, rel=1e-3)
    grads = torch.cat([p.grad.flatten() for p in graphed.parameters() if p.grad is not None])
    assert grads.abs().max().item() <= 1.01e-3  # clipped by value inside the replayed step (1e-3 rounded to bf16)


def test_validation_between_replays(tmp_path):
    _, _, te = fit(tmp_path, [SameOptimizerArithmetic()], val_check_interval=10, limit_val_batches=2,
                   check_val_every_n_epoch=None)
    cb = CUDAGraphCapture()
    _, _, tg = fit(tmp_path, [cb], val_check_interval=10, limit_val_batches=2, check_val_every_n_epoch=None)
    assert len(tg.val) == 5 and tg.val == te.val
    assert tg.logged == te.logged and cb.report.replayed_steps == 47


def _saver(dirpath):
    return ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True,
                           filename="e{epoch}", auto_insert_metric_name=False)


def test_checkpoint_save_and_resume(tmp_path):
    """Epochs of 15 steps, 30 steps, a checkpoint after each epoch. Saving does not disturb the captured run (it
    equals the eager run, checkpoint included), the checkpoint is a plain one (float lr, capturable=False), and a
    run resumed from it captures again and equals the eager run resumed from it."""
    kw = dict(steps=30, samples=4 * 15, checkpointing=True)
    a, _, ta = fit(tmp_path, [_saver(tmp_path / "graph"), CUDAGraphCapture()], **kw)
    e, _, te = fit(tmp_path, [_saver(tmp_path / "eager"), SameOptimizerArithmetic()], **kw)
    assert ta.logged == te.logged
    assert_same_params(e, a)
    ck_a = torch.load(tmp_path / "graph" / "e0.ckpt", map_location="cpu", weights_only=False)
    ck_e = torch.load(tmp_path / "eager" / "e0.ckpt", map_location="cpu", weights_only=False)
    assert ck_a["global_step"] == 15
    groups = ck_a["optimizer_states"][0]["param_groups"]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in groups)
    for k, v in ck_e["state_dict"].items():
        assert torch.equal(ck_a["state_dict"][k], v), k
    for pid, st in ck_e["optimizer_states"][0]["state"].items():
        for k, v in st.items():
            assert torch.equal(ck_a["optimizer_states"][0]["state"][pid][k].float(), v.float()), (pid, k)

    path = str(tmp_path / "graph" / "e0.ckpt")
    resume = dict(steps=30, samples=4 * 15, ckpt_path=path)
    cb = CUDAGraphCapture()
    b, _, tb = fit(tmp_path, [cb], **resume)
    c, _, tc = fit(tmp_path, [SameOptimizerArithmetic()], **resume)
    assert cb.report.state == "captured" and cb.report.replayed_steps == 12  # 15 resumed steps: 3 warm-up
    assert tb.logged == tc.logged and tb.lrs == tc.lrs and len(tb.logged) == 15
    assert_same_params(c, b)
    plain, _, tp = fit(tmp_path, [], **resume)  # the checkpoint also resumes a run without the callback
    assert tp.logged == pytest.approx(tc.logged, rel=1e-5)


class ReloadOptimizer(Callback):
    """Saves the optimizer state after step 10 and loads it back after step 20 (a mid-run restore)."""

    def __init__(self):
        self.saved = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        if trainer.global_step == 10:
            self.saved = copy.deepcopy(opt.state_dict())
        elif trainer.global_step == 20:
            opt.load_state_dict(self.saved)


def test_optimizer_state_restored_in_place_into_the_captured_tensors(tmp_path):
    eager, _, te = fit(tmp_path, [SameOptimizerArithmetic(), ReloadOptimizer()], steps=30)
    cb = CUDAGraphCapture()
    graphed, trainer, tg = fit(tmp_path, [cb, ReloadOptimizer()], steps=30)
    assert tg.logged == te.logged
    assert_same_params(eager, graphed)
    assert any(k.startswith("optimizer state (restored in place") for k in cb.report.repairs)
    assert cb.report.replayed_steps == 27 and cb.report.captures == 1


class GradTrace(Callback):
    """What ``.grad`` holds after every step: each gradient's sum (float64) and address; full copies after the
    smaller batches."""

    def __init__(self):
        self.sums, self.ptrs, self.small = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        grads = [p.grad for p in pl_module.parameters()]
        self.sums.append([None if g is None else g.double().sum().item() for g in grads])
        self.ptrs.append([None if g is None else g.data_ptr() for g in grads])
        if batch[0].shape[0] != 4:
            self.small.append([None if g is None else g.clone() for g in grads])


def test_last_smaller_batch_runs_eagerly_and_is_counted(tmp_path):
    # 6 full batches and one of 2 samples per epoch: steps 7, 14 and 21 are the smaller ones
    ge, gg = GradTrace(), GradTrace()
    eager, _, te = fit(tmp_path, [SameOptimizerArithmetic(), ge], steps=21, samples=4 * 6 + 2, drop_last=False)
    cb = CUDAGraphCapture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed, _, tg = fit(tmp_path, [cb, gg], steps=21, samples=4 * 6 + 2, drop_last=False)
    # the eager steps do not meet autograd nodes left over from the capture stream
    assert not [w for w in caught if "AccumulateGrad node's stream" in str(w.message)]
    assert tg.logged == te.logged
    assert_same_params(eager, graphed)
    # .grad after every step, the eager fallbacks included, holds that step's gradients (not the last replay's)...
    assert len(gg.small) == 3 and gg.sums == ge.sums
    for step_e, step_g in zip(ge.small, gg.small):
        for a, b in zip(step_e, step_g):
            assert (a is None and b is None) or torch.equal(a, b)
    # ...and, from the capture on, lives in the captured tensors the replays write
    assert all(ptrs == gg.ptrs[3] for ptrs in gg.ptrs[3:])
    r = cb.report
    assert r.eager_steps == 3 and r.replayed_steps == 21 - 3 - 3
    assert r.fallbacks == {"batch differs from the captured one (batch[0] is int64[2, 128] on cuda:0, captured "
                           "int64[4, 128] on cuda:0)": 3}


class SyncsOnItem(LlamaLM):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if loss.item() > 1e6:  # a host sync in the step
            raise RuntimeError("diverged")
        self.log("train/loss", loss)
        return loss


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if "CUDAGraphCapture" in str(w.message)]


def test_item_in_the_step_is_named_and_the_run_continues_eagerly(tmp_path):
    ref, _, tr = fit(tmp_path, [], steps=12, model_cls=SyncsOnItem)
    cb = CUDAGraphCapture()
    (model, _, tm), msgs = _warnings_of(lambda: fit(tmp_path, [cb], steps=12, model_cls=SyncsOnItem))
    assert len(msgs) == 1
    assert "synchronizes the host with the GPU at test_graphs_gpu.py:" in msgs[0]
    assert "in training_step: `if loss.item() > 1e6:" in msgs[0] and msgs[0].endswith("The run continues eagerly.")
    assert cb.report.state == "eager" and cb.report.captures == 0 and len(tm.logged) == 12
    assert tm.logged == pytest.approx(tr.logged, rel=1e-5)


def test_item_is_caught_by_the_capture_when_detection_is_off(tmp_path):
    cb = CUDAGraphCapture(detect_syncs=False)
    (model, trainer, tm), msgs = _warnings_of(lambda: fit(tmp_path, [cb], steps=12, model_cls=SyncsOnItem))
    assert len(msgs) == 1 and "capturing the step failed with" in msgs[0]
    assert cb.report.state == "eager" and trainer.global_step == 12
    _, _, tr = fit(tmp_path, [], steps=12, model_cls=SyncsOnItem)
    assert tm.logged == pytest.approx(tr.logged, rel=1e-5)


class LogsPythonNumber(LlamaLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("step_size", 0.5 * self.hparams.lr)
        return loss


class LogsSchedulerTensor(LlamaLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])  # a tensor made outside the step
        return loss


@pytest.mark.parametrize("model_cls, expected", [
    (LogsPythonNumber, "self.log('step_size') gets the Python number 0.001"),
    (LogsSchedulerTensor, "self.log('lr') gets a tensor that the step does not compute"),
])
def test_values_a_replay_would_freeze_are_refused(tmp_path, model_cls, expected):
    cb = CUDAGraphCapture()
    (model, trainer, tm), msgs = _warnings_of(lambda: fit(tmp_path, [cb], steps=10, model_cls=model_cls))
    assert len(msgs) == 1 and expected in msgs[0]
    assert cb.report.state == "eager" and trainer.global_step == 10 and len(set(tm.logged)) == 10


class LogsOptimizerTensors(LlamaLM):
    """Logs tensors kept up to date in place: the lr tensor, Adam's step counter and a weight (before its update)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        opt = self.trainer.optimizers[0]
        p = opt.param_groups[0]["params"][0]
        self.log("lr_now", opt.param_groups[0]["lr"])
        if "step" in opt.state.get(p, {}):
            self.log("adam_step", opt.state[p]["step"])
        self.log("w0", p.detach().reshape(-1)[0])
        return loss


class MetricTrace(Callback):
    def __init__(self, keys):
        self.keys, self.rows = keys, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append({k: m[k].item() for k in self.keys if k in m})


def test_logged_optimizer_tensors_replay_with_the_value_at_the_log_call(tmp_path):
    keys = ("lr_now", "adam_step", "w0")
    me, mg = MetricTrace(keys), MetricTrace(keys)
    _, _, te = fit(tmp_path, [SameOptimizerArithmetic(), me], steps=12, model_cls=LogsOptimizerTensors)
    cb = CUDAGraphCapture()
    (_, _, tg), msgs = _warnings_of(lambda: fit(tmp_path, [cb, mg], steps=12, model_cls=LogsOptimizerTensors))
    assert msgs == [] and cb.report.state == "captured" and cb.report.replayed_steps == 9
    assert mg.rows == me.rows and tg.logged == te.logged
    assert [r["adam_step"] for r in mg.rows[1:]] == list(range(1, 12))  # the count before this step's update
    assert len({r["lr_now"] for r in mg.rows}) == 12 and len({r["w0"] for r in mg.rows}) == 12


def test_fp16_grad_scaler_is_declined_and_the_run_is_plain(tmp_path):
    plain, _, tp = fit(tmp_path, [], steps=10, precision="16-mixed")
    cb = CUDAGraphCapture()
    (graphed, _, tg), msgs = _warnings_of(lambda: fit(tmp_path, [cb], steps=10, precision="16-mixed"))
    assert len(msgs) == 1 and "GradScaler" in msgs[0] and "bf16-mixed" in msgs[0]
    assert cb.report.state == "eager" and tg.logged == tp.logged
    assert_same_params(plain, graphed)
    with pytest.raises(Exception, match="GradScaler"):
        fit(tmp_path, [CUDAGraphCapture(strict=True)], steps=2, precision="16-mixed")


class VaryingLengthData(OrderedData):
    def train_dataloader(self):
        def collate(items):
            n = 64 + 8 * (len(collate.calls) % 5)  # a different sequence length on every step
            collate.calls.append(n)
            return (torch.stack([t[:n] for t, _ in items]), torch.stack([y[:n] for _, y in items]))

        collate.calls = []
        self.setup()
        ds = MarkovDataset(self.corpus, self.seq_len, self.num_train_samples)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, drop_last=True, collate_fn=collate)


def test_dynamic_shapes_are_detected(tmp_path):
    cb = CUDAGraphCapture()

    def run():
        L.seed_everything(0, verbose=False)
        model = LlamaLM(CFG, lr=2e-3)
        trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=16, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            default_root_dir=tmp_path, callbacks=[cb])
        trainer.fit(model, VaryingLengthData.for_model(model, num_train_samples=4 * 40))
        return trainer

    trainer, msgs = _warnings_of(run)
    assert len(msgs) == 1 and "batch shapes change from step to step (batch[0] is int64[4, 72]" in msgs[0]
    assert cb.report.state == "eager" and trainer.global_step == 16


def test_summary_reports_replays_and_pool(tmp_path):
    cb = CUDAGraphCapture()
    fit(tmp_path, [cb], steps=8, samples=4 * 6 + 2, drop_last=False)
    s = cb.report.summary()
    assert s.startswith("CUDAGraphCapture: captured; captured 1x after 3 eager warm-up steps (graph pool ")
    assert "replayed 4 steps, 1 eager after capture" in s and "fallbacks: 1x batch differs" in s


def test_composes_with_nvtx_ranges(tmp_path):
    from lightning_gh.profiling import nvtx

    ref, _, tr = fit(tmp_path, [CUDAGraphCapture()], steps=20)
    cb = CUDAGraphCapture()
    model, _, tm = fit(tmp_path, [nvtx.NVTXRangeCallback(module_ranges=True), cb], steps=20)
    assert cb.report.replayed_steps == 17 and tm.logged == tr.logged
    assert_same_params(ref, model)


def test_activation_offload_combination_is_refused_clearly(tmp_path):
    """Activation offload orders host copies from Python hooks on every step; a replay would skip them. Whichever
    part reaches its setup first refuses the combination (lightning_gh.compat) with a message naming both, before
    any step runs (never a silent run)."""
    from lightning_gh.activation_offload import ActivationOffload
    from lightning_gh.compat import IncompatiblePartsError

    cb = CUDAGraphCapture()
    with pytest.raises(IncompatiblePartsError) as e:
        fit(tmp_path, [ActivationOffload(), cb], steps=4)
    assert "ActivationOffload" in str(e.value) and "CUDAGraphCapture" in str(e.value)
