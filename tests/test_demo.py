"""The main job, as `make demo` runs it, end to end on the CPU."""

import json
import subprocess
import sys


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


def test_demo_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "lightning_gh", "demo", "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--steps=0 must be a positive number" in proc.stderr


def test_conflicting_parts_leave_the_first_on():
    from lightning_gh.demo.run import Part, resolve_conflicts

    parts = resolve_conflicts([Part("CUDAGraphCapture", True), Part("ActivationOffload", True), Part("NVTX ranges", True)])
    assert [p.enabled for p in parts] == [True, False, True]
    assert parts[1].reason.startswith("off because CUDAGraphCapture is on")
    # Without the first, the second stays on.
    parts = resolve_conflicts([Part("CUDAGraphCapture", False, "no GPU"), Part("ActivationOffload", True)])
    assert parts[1].enabled


def test_demo_on_cpu_lists_every_part():
    from lightning_gh import hardware
    from lightning_gh.demo.run import PARTS, DemoConfig, resolve_conflicts

    cfg = DemoConfig(preset="tiny", steps=30)
    parts = resolve_conflicts([f(cfg, hardware.detect(), cfg.out) for f in PARTS])
    names = [p.name for p in parts]
    assert len(names) == len(set(names)) == len(PARTS)
    for p in parts:
        assert p.enabled or p.reason, p.name  # every part that stays off says why
