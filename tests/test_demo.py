"""The main job, as `make demo` runs it: end to end on the CPU once in a subprocess (the real command line), its
argument and machine checks in process."""

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_gh import hardware
from lightning_gh.demo import run as demo_run

NO_FP8 = hardware.detect().fp8_unsupported_reason() is not None


def test_demo_runs_and_reports(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_gh", "demo", "--preset", "tiny", "--steps", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning_gh demo: trained the 'tiny'" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40
    assert summary["loss_last"] < summary["loss_first"]
    for key in ("metrics", "loss_plot", "checkpoint"):
        assert (tmp_path / summary["outputs"][key]).exists() or __import__("pathlib").Path(summary["outputs"][key]).exists()
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # The profiler part's window summary is one of the listed results.
    assert summary["outputs"]["profile"].endswith(".summary.md") and "profile " in proc.stdout


def _exit_status(argv, capsys):
    """``demo_run.main(argv)``'s exit status and stderr, whether it returns or exits through argparse."""
    try:
        rc = demo_run.main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0 must be a positive number"),
    (["--num-workers", "-1"], "--num-workers=-1 must be >= 0"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--accelerator", "tpu"], "invalid choice: 'tpu'"),
])
def test_demo_rejects_bad_arguments(argv, message, capsys):
    rc, err = _exit_status(argv, capsys)
    assert rc == 2 and message in err and "Traceback" not in err


def test_gpu_asked_for_without_a_gpu_is_one_line(capsys, monkeypatch, tmp_path):
    detect = hardware.detect
    monkeypatch.setattr(hardware, "detect", lambda *a, **k: hardware.cpu_view(detect(*a, **k)))
    rc, err = _exit_status(["--accelerator", "gpu", "--steps", "2", "--out", str(tmp_path / "run")], capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err == ("python -m lightning_gh demo: error: --accelerator=gpu but no CUDA GPU is visible; use "
                   "--accelerator auto or cpu.\n")
    assert not (tmp_path / "run").exists()  # nothing started


def test_demo_config_is_frozen_and_resolves_its_defaults(tmp_path):
    from lightning_gh.demo.config import DEFAULT_STEPS, DemoConfig

    cfg = DemoConfig(preset="small")
    assert cfg.steps == DEFAULT_STEPS["small"] and cfg.out.parent == Path("runs") and not cfg.wants_gpu
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg, accelerator="gpu").wants_gpu
    with pytest.raises(ValueError, match=r"--accelerator='tpu' is not known; choose one of \['auto', 'cpu', 'gpu', "
                                         r"'cuda'\]"):
        DemoConfig(accelerator="tpu", out=tmp_path)


def test_conflicting_parts_leave_the_first_on():
    from lightning_gh.demo.parts import Part, resolve_conflicts

    parts = resolve_conflicts([Part("CUDAGraphCapture", True), Part("ActivationOffload", True), Part("NVTX ranges", True)])
    assert [p.enabled for p in parts] == [True, False, True]
    assert parts[1].reason.startswith("off because CUDAGraphCapture is on")
    # Without the first, the second stays on.
    parts = resolve_conflicts([Part("CUDAGraphCapture", False, "no GPU"), Part("ActivationOffload", True)])
    assert parts[1].enabled


def test_demo_on_cpu_lists_every_part():
    from lightning_gh import hardware
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import PARTS, resolve_conflicts

    cfg = DemoConfig(preset="tiny", steps=30)
    parts = resolve_conflicts([f(cfg, hardware.detect(), cfg.out) for f in PARTS])
    names = [p.name for p in parts]
    assert len(names) == len(set(names)) == len(PARTS)
    for p in parts:
        assert p.enabled or p.reason, p.name  # every part that stays off says why


# ---------------------------------------------------------------------------------------------- the table of parts


def test_nvtx_part():
    from lightning_gh import hardware
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import nvtx_part as demo_part
    from lightning_gh.profiling.nvtx import NVTXRangeCallback

    part = demo_part(DemoConfig(out=Path("runs/x")), hardware.detect(), Path("runs/x"))
    assert part.name == "NVTX ranges" and part.reason
    if part.enabled:
        assert isinstance(part.callbacks[0], NVTXRangeCallback) and part.callbacks[0].gc_ranges


def test_demo_part_says_why_fp8_is_off(tmp_path):
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import fp8_part as demo_part

    part = demo_part(DemoConfig(preset="tiny", out=tmp_path), hardware.detect(), tmp_path)
    assert part.name == "fp8 precision (fp8-auto)"
    if NO_FP8:
        assert not part.enabled and hardware.detect().fp8_unsupported_reason() in part.reason
    else:
        assert not part.enabled and part.reason  # tiny's layers are below min_dim, or no backend is installed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        demo_part(DemoConfig(preset="large", out=tmp_path), hardware.detect(), tmp_path)
    # fp8-auto is only built when it will really be fp8: never its bf16 fallback warning
    assert not [w for w in caught if "falls back to bf16-mixed" in str(w.message)]


def test_demo_part_is_off_without_cuda_and_carries_the_strategy_with_it():
    import dataclasses

    from lightning_gh import hardware
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import superoffload_part
    from lightning_gh.superoffload import SuperOffloadStrategy

    cfg = DemoConfig(preset="tiny", out=Path("unused"))
    hw = dataclasses.replace(hardware.detect(), cuda_available=False)
    off = superoffload_part(cfg, hw, Path("unused"))
    assert not off.enabled and "no CUDA GPU" in off.reason
    on = superoffload_part(cfg, dataclasses.replace(hw, cuda_available=True), Path("unused"))
    assert on.enabled and isinstance(on.trainer_kwargs["strategy"], SuperOffloadStrategy)


def test_graphs_part():
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import graphs_part as demo_part
    from lightning_gh.graphs import CUDAGraphCapture

    cfg = DemoConfig(preset="tiny", out=Path("unused"))
    off = demo_part(cfg, dataclasses.replace(hardware.detect(), cuda_available=False), Path("unused"))
    assert not off.enabled and "needs a CUDA GPU" in off.reason and off.callbacks == []
    on = demo_part(cfg, dataclasses.replace(hardware.detect(), cuda_available=True), Path("unused"))
    assert on.enabled and len(on.callbacks) == 1 and isinstance(on.callbacks[0], CUDAGraphCapture)
    cpu = demo_part(dataclasses.replace(cfg, accelerator="cpu"), dataclasses.replace(hardware.detect(),
                                                                                    cuda_available=True), Path("x"))
    assert not cpu.enabled


def test_profiler_part(tmp_path, monkeypatch):
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import profiler_part as demo_part
    from lightning_gh.profiling import DataStallDetector
    from lightning_gh.profiling.profiler import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    part = demo_part(DemoConfig(preset="tiny", steps=300, out=tmp_path), hardware.detect(), tmp_path)
    prof, det = part.callbacks
    assert part.enabled and isinstance(det, DataStallDetector)
    assert str(prof.schedule) == "10-12" and prof.output_dir == tmp_path / "profiles"
    assert prof.backends == (("torch", "memory") if torch.cuda.is_available() else ("torch",))
    short = demo_part(DemoConfig(preset="tiny", steps=4, out=tmp_path), hardware.detect(), tmp_path)
    assert str(short.callbacks[0].schedule) == "1-3"


def test_short_run_writes_valid_json_and_one_copy_per_checkpoint(tmp_path):
    """A run shorter than the logging interval: no NaN in summary.json, 'n/a' in the report, and last.ckpt is a
    link to the step checkpoint rather than a second copy of it."""
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.run import _report, run_demo

    cfg = DemoConfig(preset="tiny", steps=2, out=tmp_path / "run", accelerator="cpu")
    summary = run_demo(cfg)
    text = (cfg.out / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text)["steps"] == 2
    ckpts = sorted(p.name for p in (cfg.out / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step2.ckpt"] and (cfg.out / "checkpoints" / "last.ckpt").is_symlink()
    assert "nan" not in _report(summary, cfg.out)


def test_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, err = _exit_status(["--out", str(f)], capsys)
    assert rc == 2 and "is a file; give a folder" in err and "Traceback" not in err
