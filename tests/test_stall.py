"""DataStallDetector: it fires on a slow loader (num_workers=0), stays quiet with enough workers, logs the share.

Both sides are made independent of the machine's speed and load: the data module's per-sample cost is a sleep
(cost_kind="sleep": 8 samples x 20 ms = 160 ms per batch), and each training step sleeps 60 ms on top of the tiny
model's compute, standing in for GPU work. Without workers the loop waits 160 ms per batch against >= 60 ms of work,
well above the threshold even on a loaded machine; 8 workers deliver a batch every 20 ms, three times faster than the
loop consumes them, well below it.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import time
import warnings

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.profiling import DataStallDetector, DataStallWarning, StallOptions, advice
from lightning_gh.profiling.stall import METRIC, loader_info
from lightning_gh.profiling.summary import stall_advice


class SlowStep(LlamaLM):
    def training_step(self, batch, batch_idx):
        time.sleep(0.06)
        return super().training_step(batch, batch_idx)


class BlockingCallback(L.Callback):
    """Blocks 80 ms after each batch, like a progress bar's .item() waiting for a GPU that is still busy."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.08)


def _fit(tmp_path, detector, extra_callbacks=(), **dm_kwargs):
    L.seed_everything(0, verbose=False)
    model = SlowStep.from_preset("tiny")
    dm = MarkovDataModule.for_model(model, sample_cost_ms=20.0, cost_kind="sleep", num_train_samples=2048, **dm_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=14, limit_val_batches=0, log_every_n_steps=1,
                        logger=CSVLogger(tmp_path, name="", version="logs"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[detector, *extra_callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, dm)
    stalls = [w for w in caught if issubclass(w.category, DataStallWarning)]
    with (tmp_path / "logs" / "metrics.csv").open() as f:
        logged = [float(r[METRIC]) for r in csv.DictReader(f) if r.get(METRIC)]
    return stalls, logged, trainer


def test_fires_once_without_workers_with_real_values(tmp_path):
    det = DataStallDetector(window=10, warmup=3)
    stalls, logged, trainer = _fit(tmp_path, det, num_workers=0)
    assert det.warned and len(stalls) == 1  # once, although every later batch is over the threshold too
    msg = str(stalls[0].message)
    assert "num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None" in msg
    assert "raise num_workers from 0 to " in msg and "threshold 10%" in msg
    assert "CPUs" in msg and "affinity mask" in msg
    assert det.data_wait_frac > 0.10
    assert logged and logged[-1] == pytest.approx(det.data_wait_frac, rel=1e-6)
    assert max(logged) > 0.10
    info = loader_info(trainer)
    assert info["found"] and info["num_workers"] == 0 and info["batch_size"] == 8 and info["cuda"] is False
    assert info["cpus_per_process"] >= 1 and info["processes_per_node"] == 1


def test_quiet_with_enough_workers(tmp_path):
    det = DataStallDetector(window=10, warmup=3)
    # 8 workers x 4 batches ahead: a batch every 20 ms against a step of at least 60 ms.
    stalls, logged, _ = _fit(tmp_path, det, num_workers=8, persistent_workers=True, prefetch_factor=4)
    assert not stalls and not det.warned
    assert det.data_wait_frac is not None and det.data_wait_frac < 0.10
    assert logged and all(v < 0.10 for v in logged[-3:])


def test_advice_uses_the_numbers():
    info = {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None,
            "cpus_available": 2, "processes_per_node": 1, "cpus_per_process": 2, "cuda": True}
    advice = stall_advice(info, wait_s=0.016, step_s=0.008)
    # The main process makes a batch in ~16 ms; a 8 ms step needs 16/8 = 2 workers, +25% -> 3.
    assert advice[0].startswith("raise num_workers from 0 to 3 ") and "more workers than the 2 CPUs" in advice[0]
    assert any("pin_memory=True" in a for a in advice)
    info.update(num_workers=2, pin_memory=True, prefetch_factor=2, cpus_available=64, cpus_per_process=8,
                processes_per_node=8)
    advice = stall_advice(info, wait_s=0.002, step_s=0.010)
    # Two workers keep a 12 ms period, so a batch takes ~24 ms per worker: 24/10 * 1.25 -> 3 workers.
    assert advice[0].startswith("raise num_workers from 2 to 3 ") and "more workers than" not in advice[0]
    assert any("persistent_workers=True" in a for a in advice)
    assert any("prefetch_factor from 2 to 4" in a for a in advice)
    assert not any("pin_memory" in a for a in advice)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"threshold": 0.0}, ValueError, r"^DataStallDetector\(threshold=0.0\): expected a share strictly between 0 and 1"),
    ({"threshold": 1.5}, ValueError, r"^DataStallDetector\(threshold=1.5\): expected"),
    ({"threshold": float("nan")}, ValueError, r"^DataStallDetector\(threshold=nan\): expected"),
    ({"threshold": True}, TypeError, r"^DataStallDetector\(threshold=True\): expected"),
    ({"threshold": "0.1"}, TypeError, r"^DataStallDetector\(threshold='0.1'\): expected"),
    ({"window": 0}, ValueError, r"^DataStallDetector\(window=0\): expected an int >= 1"),
    ({"window": 2.5}, TypeError, r"^DataStallDetector\(window=2.5\): expected an int >= 1"),
    ({"warmup": -1}, ValueError, r"^DataStallDetector\(warmup=-1\): expected an int >= 0"),
    ({"log_metric": 1}, TypeError, r"^DataStallDetector\(log_metric=1\): expected True or False"),
])
def test_argument_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataStallDetector(**kwargs)
    with pytest.raises(error, match=match):  # the options alone say the same
        StallOptions(**kwargs)


def test_options_or_keywords_never_both():
    opts = StallOptions(window=7, warmup=0)
    det = DataStallDetector(options=opts)
    assert det.options is opts and (det.window, det.warmup, det.threshold) == (7, 0, advice.DATA_WAIT_BOUND)
    assert DataStallDetector(window=7, warmup=0).options == opts
    with pytest.raises(TypeError, match="both options= and window=8"):
        DataStallDetector(window=8, options=opts)
    sig = inspect.signature(DataStallDetector).parameters
    for f in dataclasses.fields(StallOptions):  # every default stated once, in the dataclass
        assert sig[f.name].default == f.default, f.name


def test_time_blocked_outside_the_fetch_is_not_a_data_wait(tmp_path):
    # Fast data (8 workers) but 80 ms of blocking after every batch in another callback: the old measure (batch end
    # to next batch start) called that a stall; only the fetch itself counts now.
    det = DataStallDetector(window=10, warmup=3)
    stalls, _, _ = _fit(tmp_path, det, extra_callbacks=[BlockingCallback()], num_workers=8, persistent_workers=True,
                        prefetch_factor=4)
    assert not stalls and det.data_wait_frac < 0.10
    # Lightning's fetch action was seen, so the fallback gap measure was not used.
    assert det._saw_fetch


def test_a_reused_trainer_keeps_one_profiler_wrapper_across_fits(tmp_path):
    """A Trainer reused for several fits with DataStallDetector and NVTX: the profiler is wrapped once at most while
    a fit runs, and left exactly as it was after each (no wrapper per fit holding an old callback)."""
    from lightning_gh.profiling import NVTXRangeCallback, _actions

    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny")
    dm = MarkovDataModule.for_model(model, num_train_samples=64)
    seen: list[int] = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            d = _actions._DISPATCHERS.get(trainer.profiler)
            seen.append(len(d.watchers) if d and vars(trainer.profiler)["start"] is d.start else 0)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[DataStallDetector(window=1, warmup=0), NVTXRangeCallback(), Count()])
    own = {k: vars(trainer.profiler).get(k) for k in ("start", "stop")}
    for max_steps in (2, 4):
        trainer.fit_loop.epoch_loop.max_steps = max_steps
        trainer.fit(model, dm)
        # nothing of ours left on the profiler
        assert {k: vars(trainer.profiler).get(k) for k in ("start", "stop")} == own == {"start": None, "stop": None}
    assert seen and max(seen) == 1


def test_detector_and_summary_share_one_definition_and_threshold():
    from lightning_gh.profiling import advice

    assert DataStallDetector().threshold == advice.DATA_WAIT_BOUND
    # 8.1% of the step time waiting is fine for both; 10.1% is input-bound for both.
    assert not advice.is_input_bound(advice.data_wait_share(8.1, 100.0))
    assert advice.is_input_bound(advice.data_wait_share(10.1, 100.0))
