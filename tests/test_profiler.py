"""SelectiveProfiler on the CPU: windows of optimizer steps, env override, resume, faults, ranks (DDP), conflicts."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import inspect
import json
import logging
import pickle
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_gh._util import reset_warnings
from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.profiling import ProfilerOptions, SelectiveProfiler, StepSchedule, summarize_trace
from lightning_gh.profiling import profiler as profiler_mod
from lightning_gh.profiling._profiler_backends import WARN_KEY
from lightning_gh.profiling.profiler import ENV_VAR, nsys_command, under_nsys
from lightning_gh.profiling.trace import load_trace


def _trainer(tmp_path, callbacks, max_steps, **kw):
    kw.setdefault("limit_val_batches", 0)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks, **kw)


def _model():
    L.seed_everything(0, verbose=False)
    return LlamaLM.from_preset("tiny")


def _dm(model):
    return MarkovDataModule.for_model(model, num_train_samples=512)


def _steps_and_phases(path):
    """ProfilerStep numbers, and per step the lgh/ phases in order; asserts every phase lies inside a step."""
    t = load_trace(path)
    phases = {s.number: [] for s in t.steps}
    for a in t.annotations:
        if a.name.startswith("lgh/"):
            owner = [s for s in t.steps if s.ts - 1e-3 <= a.ts and a.end <= s.end + 1e-3]
            assert owner, f"{a.name} at {a.ts} lies outside every ProfilerStep"
            phases[owner[0].number].append(a.name[4:])
    return [s.number for s in t.steps], phases


class Probe(L.Callback):
    """Records, inside each step, whether any profiler or phase range is live."""

    def __init__(self, prof: SelectiveProfiler) -> None:
        self.prof = prof
        self.seen: dict[int, tuple[bool, bool]] = {}

    def on_before_backward(self, trainer, pl_module, loss):
        # a torch.profiler session of this thread, or ours (which records every thread, so this thread's flag
        # may stay off while it runs)
        torch_on = torch.autograd._profiler_enabled() or any(
            getattr(b, "prof", None) is not None for b in self.prof._backend_objs)
        self.seen[trainer.global_step] = (torch_on, self.prof._active is not None)


def test_trace_holds_exactly_the_window_steps(tmp_path):
    prof = SelectiveProfiler(steps="2-3,4,6", output_dir=tmp_path / "p", summary=True)
    probe = Probe(prof)
    model = _model()
    _trainer(tmp_path, [prof, probe], max_steps=8).fit(model, _dm(model))

    # Nothing is live outside the windows; the profiler runs exactly in steps 2, 3 and 6.
    assert {s for s, (on, active) in probe.seen.items() if on or active} == {2, 3, 4, 6}
    assert all(on == active for on, active in probe.seen.values()), probe.seen
    assert prof._backend_objs[0].prof is None and not torch.autograd._profiler_enabled()

    assert [(w["window"], w["steps"], w["reason"]) for w in prof.written] == [
        ("2-3", [2, 3], "window complete"), ("4", [4, 4], "window complete"), ("6", [6, 6], "window complete")]
    first = tmp_path / "p" / "steps2-3" / "rank0_steps2-3.pt.trace.json.gz"
    assert Path(prof.written[0]["files"]["torch"]) == first
    steps, phases = _steps_and_phases(first)
    assert steps == [2, 3]
    # Every step, the first included (begun at the end of step 1), runs data wait -> forward -> backward -> optimizer.
    assert phases == {2: ["data_wait", "forward", "backward", "optimizer"],
                      3: ["data_wait", "forward", "backward", "optimizer"]}
    # An adjacent window begins as the previous one ends, its data wait included.
    assert _steps_and_phases(tmp_path / "p" / "steps4" / "rank0_steps4.pt.trace.json.gz") == (
        [4], {4: ["data_wait", "forward", "backward", "optimizer"]})
    assert _steps_and_phases(tmp_path / "p" / "steps6" / "rank0_steps6.pt.trace.json.gz")[0] == [6]
    with gzip.open(first, "rt") as f:
        meta = json.load(f)["lgh"]
    assert meta == {"window": "2-3", "first_step": 2, "rank": 0, "world_size": 1, "backends": ["torch"]}
    summary = json.loads((tmp_path / "p" / "steps2-3" / "rank0_steps2-3.summary.json").read_text())
    assert [r["step"] for r in summary["steps"]] == [2, 3] and summary["window_end"] == "window complete"
    assert (tmp_path / "p" / "steps2-3" / "rank0_steps2-3.summary.png").exists()
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["steps2-3", "steps4", "steps6"]


def test_env_overrides_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1-2")
    prof = SelectiveProfiler(steps="5-6", output_dir=tmp_path, summary=False)
    assert str(prof.schedule) == "1-2"
    model = _model()
    _trainer(tmp_path, [prof], max_steps=7).fit(model, _dm(model))
    assert [w["steps"] for w in prof.written] == [[1, 2]]
    assert _steps_and_phases(prof.written[0]["files"]["torch"])[0] == [1, 2]
    monkeypatch.setenv(ENV_VAR, "9-8")
    with pytest.raises(ValueError, match=ENV_VAR):
        SelectiveProfiler(steps="5-6")


def test_windows_count_optimizer_steps_not_batches(tmp_path):
    prof = SelectiveProfiler(steps="1-2", output_dir=tmp_path, summary=False)
    model = _model()
    _trainer(tmp_path, [prof], max_steps=3, accumulate_grad_batches=2).fit(model, _dm(model))
    steps, phases = _steps_and_phases(prof.written[0]["files"]["torch"])
    assert steps == [1, 2]
    for n in steps:  # two micro-batches per optimizer step, one optimizer phase
        assert phases[n].count("forward") == 2 and phases[n].count("backward") == 2
        assert phases[n].count("optimizer") == 1 and phases[n][-1] == "optimizer"


def test_resume_inside_a_window_profiles_the_rest_and_nothing_twice(tmp_path):
    out = tmp_path / "p"
    model = _model()
    first = SelectiveProfiler(steps="3-6", output_dir=out, summary=False)
    t1 = _trainer(tmp_path, [first], max_steps=5)
    t1.fit(model, _dm(model))
    t1.save_checkpoint(tmp_path / "step5.ckpt")
    assert [(w["steps"], w["reason"]) for w in first.written] == [([3, 4], "end of training")]

    model = _model()
    second = SelectiveProfiler(steps="3-6", output_dir=out, summary=False)
    t2 = _trainer(tmp_path, [second], max_steps=9)
    t2.fit(model, _dm(model), ckpt_path=tmp_path / "step5.ckpt")
    t2.save_checkpoint(tmp_path / "step9.ckpt")
    assert [w["steps"] for w in second.written] == [[5, 6]]
    recorded = [_steps_and_phases(w["files"]["torch"])[0] for w in first.written + second.written]
    assert recorded == [[3, 4], [5, 6]]  # the window, whole, once

    model = _model()
    third = SelectiveProfiler(steps="3-6", output_dir=out, summary=False)
    _trainer(tmp_path, [third], max_steps=11).fit(model, _dm(model), ckpt_path=tmp_path / "step9.ckpt")
    assert third.written == []  # resumed after the window: nothing again
    assert sorted(p.name for p in (out / "steps3-6").iterdir()) == [
        "rank0_steps3-4.pt.trace.json.gz", "rank0_steps5-6.pt.trace.json.gz"]


class Boom(LlamaLM):
    """Raises ``exc`` in the training step of optimizer step ``at``."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at:
            raise self.exc("boom at step %d" % self.fail_at)
        return super().training_step(batch, batch_idx)


def _boom(exc, at):
    L.seed_everything(0, verbose=False)
    m = Boom.from_preset("tiny")
    m.exc, m.fail_at = exc, at
    return m


def test_exception_during_window_still_writes_trace_and_summary(tmp_path):
    prof = SelectiveProfiler(steps="2-5", output_dir=tmp_path)
    model = _boom(RuntimeError, 3)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        _trainer(tmp_path, [prof], max_steps=8).fit(model, _dm(model))
    assert not torch.autograd._profiler_enabled()  # the profiler was stopped
    (entry,) = prof.written
    assert entry["steps"] == [2, 3] and entry["reason"].startswith("exception: RuntimeError: boom at step 3")
    steps, phases = _steps_and_phases(entry["files"]["torch"])
    assert steps == [2, 3] and phases[3][-1] == "forward"  # step 3 died in its forward
    summary = json.loads(Path(entry["files"]["summary_json"]).read_text())
    assert summary["window_end"].startswith("exception: RuntimeError")


def test_keyboard_interrupt_during_window_still_writes_trace(tmp_path):
    prof = SelectiveProfiler(steps="1-4", output_dir=tmp_path, summary=False)
    model = _boom(KeyboardInterrupt, 2)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning turns Ctrl+C into a graceful shutdown and exit(1)
            _trainer(tmp_path, [prof], max_steps=8).fit(model, _dm(model))
    finally:
        signal.signal(signal.SIGINT, handler)
    assert not torch.autograd._profiler_enabled()
    (entry,) = prof.written
    assert entry["steps"] == [1, 2] and entry["reason"].startswith("exception: KeyboardInterrupt")
    assert _steps_and_phases(entry["files"]["torch"])[0] == [1, 2]


def test_window_begun_at_the_last_batch_of_training_writes_nothing(tmp_path):
    # Step 2 ends the epoch and the run (limit_train_batches): the window 3-4 never runs a step.
    prof = SelectiveProfiler(steps="3-4", output_dir=tmp_path / "p", summary=False)
    model = _model()
    with pytest.warns(UserWarning, match="steps 3-4 of steps='3-4' will not be profiled: training ended after step 2"):
        _trainer(tmp_path, [prof], max_steps=-1, max_epochs=1, limit_train_batches=3).fit(model, _dm(model))
    # The folder is made at setup; nothing is written in it.
    assert prof.written == [] and not list((tmp_path / "p").iterdir()) and not torch.autograd._profiler_enabled()


class StopAfter(L.Callback):
    """Sets should_stop in on_train_batch_end, after SelectiveProfiler's hook has run (like Lightning's Timer)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_a_stop_decided_after_our_hook_names_the_steps_that_ran(tmp_path):
    prof = SelectiveProfiler(steps="2-5", output_dir=tmp_path, summary=False)
    model = _model()
    _trainer(tmp_path, [prof, StopAfter(4)], max_steps=8).fit(model, _dm(model))
    (entry,) = prof.written
    assert entry["steps"] == [2, 3] and entry["reason"] == "end of training"
    assert Path(entry["files"]["torch"]).name == "rank0_steps2-3.pt.trace.json.gz"
    steps, phases = _steps_and_phases(entry["files"]["torch"])
    # The marker of step 4 was opened before the stop was known; it holds no batch and no fetch (lgh/data_wait is
    # the tracker's fetch, and Lightning fetches nothing once should_stop is set).
    assert steps == [2, 3, 4] and phases[4] == []
    assert [r["step"] for r in summarize_trace(entry["files"]["torch"], write=False)["steps"]] == [2, 3]


def test_lightning_pytorch_profiler_is_refused_at_setup(tmp_path):
    prof = SelectiveProfiler(steps="1", output_dir=tmp_path)
    model = _model()
    trainer = _trainer(tmp_path, [prof], max_steps=2, profiler="pytorch")
    with pytest.raises(ValueError, match=r"cannot run with Trainer\(profiler=PyTorchProfiler\)") as e:
        trainer.fit(model, _dm(model))
    assert "backends=('nsys', 'memory')" in str(e.value)
    # Lightning's PyTorchProfiler fails in its __del__ when a fit stops before it recorded anything (its own
    # bug, not ours): drop its never-started torch profiler so that garbage collection stays quiet.
    trainer.profiler.profiler = None


def test_works_beside_simple_profiler_and_gpu_backends_step_aside(tmp_path):
    reset_warnings(WARN_KEY)
    prof = SelectiveProfiler(steps="1", backends=("torch", "nsys", "memory"), output_dir=tmp_path, summary=False)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, [prof], max_steps=3, profiler="simple").fit(model, _dm(model))
    mine = [str(w.message) for w in caught if "SelectiveProfiler" in str(w.message)]
    assert len(mine) == 2 and any("'nsys' needs a CUDA GPU" in m for m in mine)
    assert any("'memory' records the CUDA caching allocator" in m for m in mine)
    assert [w["steps"] for w in prof.written] == [[1, 1]] and set(prof.written[0]["files"]) == {"torch"}


def test_another_torch_profiler_session_is_not_a_crash(tmp_path):
    reset_warnings(WARN_KEY)
    prof = SelectiveProfiler(steps="1", output_dir=tmp_path, summary=False)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            _trainer(tmp_path, [prof], max_steps=2).fit(model, _dm(model))
    assert any("already active" in str(w.message) for w in caught)
    assert prof.written == []


def test_only_selected_ranks_write_under_ddp(tmp_path):
    prof = SelectiveProfiler(steps="1-2", ranks="last", output_dir=tmp_path / "p", summary=False)
    prof = pickle.loads(pickle.dumps(prof))  # what ddp_spawn does; the ranks are forked (no fresh interpreter each)
    model = _model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[prof], default_root_dir=tmp_path)
    trainer.fit(model, _dm(model))
    files = sorted(p.name for p in (tmp_path / "p" / "steps1-2").iterdir())
    assert files == ["rank1_steps1-2.pt.trace.json.gz"]
    t = load_trace(tmp_path / "p" / "steps1-2" / files[0])
    assert [s.number for s in t.steps] == [1, 2]
    assert t.metadata["distributedInfo"]["rank"] == 1 and t.metadata["distributedInfo"]["world_size"] == 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"steps": "4-2"}, ValueError, r"^SelectiveProfiler\(steps='4-2'\): window '4-2' is reversed"),
    ({"steps": "1-3,2"}, ValueError, "overlap"),
    ({"steps": "-1"}, ValueError, "negative"),
    ({"steps": 5.0}, TypeError, r"^SelectiveProfiler\(steps=5.0\): expected"),  # an int is a single step
    ({"steps": True}, TypeError, r"^SelectiveProfiler\(steps=True\): expected"),
    ({"ranks": "first"}, ValueError, r"^SelectiveProfiler\(ranks='first'\): bad item 'first'"),
    ({"ranks": 0}, TypeError, r"^SelectiveProfiler\(ranks=0\): expected a string"),
    ({"backends": ("torch", "perf")}, ValueError, r"unknown backend\(s\) \['perf'\]"),
    ({"backends": ()}, ValueError, r"^SelectiveProfiler\(backends=\(\)\): expected at least one"),
    ({"backends": 3}, TypeError, r"^SelectiveProfiler\(backends=3\): expected a sequence"),
    ({"backends": ("torch", "torch")}, ValueError, "once"),
    ({"output_dir": ""}, ValueError, r"^SelectiveProfiler\(output_dir=''\): expected a non-empty path"),
    ({"output_dir": 3}, TypeError, r"^SelectiveProfiler\(output_dir=3\): expected a path"),
    ({"summary": "yes"}, TypeError, r"^SelectiveProfiler\(summary='yes'\): expected True or False"),
])
def test_argument_validation(kwargs, error, match, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(error, match=match):
        SelectiveProfiler(**kwargs)
    with pytest.raises(error, match=match):  # the options alone say the same
        ProfilerOptions(**kwargs)


def test_options_or_keywords_never_both(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    opts = ProfilerOptions(steps="3-4", backends="memory")
    prof = SelectiveProfiler(options=opts)
    assert prof.options is opts and prof.backends == ("memory",) and str(prof.schedule) == "3-4"
    assert SelectiveProfiler(steps="3-4", backends=["memory"]).options == opts
    with pytest.raises(TypeError, match="both options= and summary=False"):
        SelectiveProfiler(summary=False, options=opts)
    with pytest.raises(TypeError, match="must be a ProfilerOptions"):
        SelectiveProfiler(options={"steps": "3-4"})
    # Every default is stated once, in the dataclass: the constructor's defaults are read from it.
    sig = inspect.signature(SelectiveProfiler).parameters
    for f in dataclasses.fields(ProfilerOptions):
        assert sig[f.name].default == f.default, f.name


def test_defaults_and_single_string_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    p = SelectiveProfiler(backends="memory")
    assert p.backends == ("memory",) and str(p.schedule) == "5-7" and isinstance(p.schedule, StepSchedule)


def test_nsys_detection_and_command(tmp_path):
    assert under_nsys({}) is None
    assert under_nsys({"NSYS_PROFILING_SESSION_ID": "12"}) == "NSYS_PROFILING_SESSION_ID"
    assert under_nsys({"CUDA_INJECTION64_PATH": "/opt/nvidia/nsys/libToolsInjection64.so"}) == "CUDA_INJECTION64_PATH"
    cmd = nsys_command(tmp_path, ["python3", "-m", "lightning_gh", "demo", "--steps", "50"])
    assert cmd.startswith("nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat --trace=cuda,nvtx")
    assert cmd.endswith(f"-o {tmp_path}/nsys_%p python3 -m lightning_gh demo --steps 50")




def test_an_int_step_is_that_single_step(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert SelectiveProfiler(steps=7).schedule == StepSchedule.parse("7")


def test_an_unwritable_output_dir_fails_at_setup_naming_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    prof = SelectiveProfiler(steps="1", output_dir=blocker / "profiles")
    model = _model()
    with pytest.raises(ValueError, match="output_dir") as e:
        _trainer(tmp_path, [prof], max_steps=3).fit(model, _dm(model))
    assert str(blocker / "profiles") in str(e.value) and str(blocker) in str(e.value)
    assert prof.written == []


@pytest.mark.parametrize("where", ["long-name", "proc"])
def test_an_output_dir_that_cannot_be_created_fails_at_setup(tmp_path, monkeypatch, where):
    # The parent looks writable (a permission check passes), yet the folder cannot be made: no file system takes a
    # 300-character name, and /proc takes no new folders even from root. The folder is created at setup (or the run
    # fails there), not when the first window is written.
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    monkeypatch.delenv(ENV_VAR, raising=False)
    out = tmp_path / ("x" * 300) if where == "long-name" else Path("/proc/lightning_gh_profiles")
    prof = SelectiveProfiler(steps="1", output_dir=out)
    model = _model()
    seen = []
    with pytest.raises(ValueError, match=r"cannot be created") as e:
        _trainer(tmp_path, [prof, _StepProbe(seen)], max_steps=3).fit(model, _dm(model))
    assert str(out) in str(e.value) and seen == [] and prof.written == []


class _StepProbe(L.Callback):
    def __init__(self, seen: list) -> None:
        self.seen = seen

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(trainer.global_step)


class _FolderThief(L.Callback):
    """Replaces the profiler's output folder by a file once training runs: no window can be written any more."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        assert self.folder.is_dir()  # created at setup
        self.folder.rmdir()
        self.folder.write_text("not a folder any more")


def test_a_window_whose_trace_is_lost_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    out = tmp_path / "p"
    prof = SelectiveProfiler(steps="1", output_dir=out, summary=False)
    model = _model()
    with _recording_logs() as lines, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, [prof, _FolderThief(out)], max_steps=3).fit(model, _dm(model))
    (entry,) = prof.written
    assert entry["files"] == {} and list(entry["lost"]) == ["torch"]
    (line,) = [ln for ln in lines if ln.startswith("SelectiveProfiler: rank 0 steps 1-1")]
    assert "LOST torch (" in line and "nsys" not in line and "no files" not in line
    assert any("its file is lost" in str(w.message) for w in caught)


def test_the_default_folder_is_the_trainers_log_dir(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.delenv(ENV_VAR, raising=False)
    model = _model()
    prof = SelectiveProfiler(steps="1", summary=False)
    assert prof.output_dir is None  # decided at setup
    _trainer(tmp_path / "root", [prof], max_steps=2).fit(model, _dm(model))  # no logger: default_root_dir
    assert prof.output_dir == tmp_path / "root" / "profiles"
    assert (tmp_path / "root" / "profiles" / "steps1" / "rank0_steps1.pt.trace.json.gz").exists()
    prof = SelectiveProfiler(steps="1", summary=False)
    logger = CSVLogger(tmp_path / "logs", name="run", version="v0")
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger, limit_val_batches=0,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[prof]).fit(model, _dm(model))
    assert prof.output_dir == Path(logger.log_dir) / "profiles"
    assert (Path(logger.log_dir) / "profiles" / "steps1" / "rank0_steps1.pt.trace.json.gz").exists()


def test_a_window_past_max_steps_warns_at_setup(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    prof = SelectiveProfiler(steps="2,20-24", output_dir=tmp_path / "p", summary=False)
    model = _model()
    seen: list = []

    class WarnedBeforeTraining(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append([str(w.message) for w in caught if "will not be profiled" in str(w.message)])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, [prof, WarnedBeforeTraining()], max_steps=10).fit(model, _dm(model))
    (before,) = seen
    assert len(before) == 1 and "steps 20-24 of steps='2,20-24' will not be profiled: max_steps=10" in before[0]
    assert len([w for w in caught if "will not be profiled" in str(w.message)]) == 1  # not again at the end
    assert [w["steps"] for w in prof.written] == [[2, 2]]


def test_a_window_past_the_last_epoch_warns_at_the_end(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    prof = SelectiveProfiler(steps="10-12", output_dir=tmp_path / "p", summary=False)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, [prof], max_steps=-1, max_epochs=1, limit_train_batches=4).fit(model, _dm(model))
    (msg,) = [str(w.message) for w in caught if "will not be profiled" in str(w.message)]
    assert "steps 10-12" in msg and "training ended after step 3" in msg and prof.written == []
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").iterdir())


def test_unreached_windows_table():
    from lightning_gh.profiling.profiler import unreached_windows

    for spec, end, expected in [("5-7", 10, []), ("5-7", 7, []), ("5-7", 5, ["5-7"]), ("1,8-9,20", 9, ["20"]),
                                ("0", 0, ["0"])]:
        assert [str(w) for w in unreached_windows(StepSchedule.parse(spec), end)] == expected, (spec, end)


def test_a_written_window_logs_one_line_and_the_env_override_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    prof = SelectiveProfiler(steps="2-3", output_dir=tmp_path / "p", summary=False)
    model = _model()
    with _recording_logs() as lines:
        _trainer(tmp_path, [prof], max_steps=3).fit(model, _dm(model))
    assert not [ln for ln in lines if "no files" in ln or "nsys" in ln]
    window = [ln for ln in lines if ln.startswith("SelectiveProfiler: rank 0 steps 1-1")]
    assert len(window) == 1 and str(tmp_path / "p" / "steps1" / "rank0_steps1.pt.trace.json.gz") in window[0]
    overrides = [ln for ln in lines if f"{ENV_VAR}='1' overrides steps='2-3'" in ln]
    assert len(overrides) == 1


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _recording_logs():
    """The messages logged through Lightning's rank-zero logger and the profiler's own (what a user sees)."""
    handler = _Lines()
    # Lightning's rank-zero logger is named after the package its module was imported as: lightning.pytorch, or
    # pytorch_lightning where the standalone package is installed and was imported first in this process.
    loggers = [logging.getLogger("lightning.pytorch"), logging.getLogger("pytorch_lightning"),
               logging.getLogger(profiler_mod.__name__)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def test_window_verdict_is_logged_through_the_loggers(tmp_path, monkeypatch):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.delenv(ENV_VAR, raising=False)
    prof = SelectiveProfiler(steps="2-3", output_dir=tmp_path / "p", summary=True)
    model = _model()
    L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=CSVLogger(tmp_path, name="", version="logs"),
              log_every_n_steps=1, limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[prof]).fit(model, _dm(model))
    with (tmp_path / "logs" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("lgh/profile_data_wait_frac")]
    assert len(rows) == 1
    assert 0.0 <= float(rows[0]["lgh/profile_data_wait_frac"]) < 1.0
    assert float(rows[0]["lgh/profile_step_time_ms"]) > 0


# ----------------------------------------------------------------------------------------------------------------
# the shared step-phase tracker: the phases SelectiveProfiler, NVTXRangeCallback and
# DataStallDetector all map onto their own ranges


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def phase_started(self, phase, step, t):
        self.events.append(f"+{phase}")

    def phase_ended(self, phase, step, t):
        self.events.append(f"-{phase}")


def _one_batch(tracker, manual: bool = False) -> None:
    t = None
    tracker.on_train_batch_start(t)
    if manual:  # training_step runs backward and the optimizer itself
        tracker.on_before_backward(t)
        tracker.on_after_backward(t)
        tracker.on_before_optimizer_step(t)
        tracker._on_optimizer_step_end(None, (), {})  # the post-hook of a watched optimizer
        tracker.on_before_zero_grad(t)
    else:
        tracker.on_before_zero_grad(t)
        tracker.on_before_backward(t)
        tracker.on_after_backward(t)
        tracker.on_before_optimizer_step(t)
    tracker.on_train_batch_end(t)


def test_tracker_phases_with_automatic_optimization():
    from lightning_gh.profiling.phases import StepPhaseTracker

    rec = _Recorder()
    _one_batch(StepPhaseTracker([rec]))
    assert rec.events == ["+forward", "-forward", "+zero_grad", "-zero_grad", "+backward", "-backward", "+optimizer",
                          "-optimizer"]


def test_tracker_nests_the_optimizer_phases_in_forward_with_manual_optimization():
    from lightning_gh.profiling.phases import StepPhaseTracker

    rec = _Recorder()
    _one_batch(StepPhaseTracker([rec], automatic=False), manual=True)
    assert rec.events == ["+forward", "+backward", "-backward", "+optimizer", "-optimizer", "+zero_grad", "-zero_grad",
                          "-forward"]


def test_tracker_ends_the_optimizer_phase_when_the_step_returns():
    from lightning_gh.profiling.phases import StepPhaseTracker

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    rec = _Recorder()
    tracker = StepPhaseTracker([rec])
    tracker.watch_optimizers([opt])
    tracker.on_before_optimizer_step(None)
    p.grad = torch.ones(2)
    opt.step()
    assert rec.events == ["+optimizer", "-optimizer"] and tracker.phase is None
    tracker.on_train_batch_end(None)  # nothing left to close
    assert rec.events == ["+optimizer", "-optimizer"]
    tracker.detach()  # removes the optimizer hook
    tracker.on_before_optimizer_step(None)
    opt.step()
    assert tracker.phase == "optimizer"


def test_every_part_listens_to_the_one_tracker():
    """No part keeps its own phase hooks: each forwards Lightning's hooks to a StepPhaseTracker and implements only
    the listener side."""
    from lightning_gh.profiling import DataStallDetector, NVTXRangeCallback
    from lightning_gh.profiling.phases import StepPhaseTracker

    for part in (SelectiveProfiler(steps="1", summary=False), NVTXRangeCallback(), DataStallDetector()):
        assert callable(part.phase_started) and callable(part.phase_ended)
    assert isinstance(NVTXRangeCallback()._phases, StepPhaseTracker)
