"""hardware.py on the CPU; its GPU fields are checked by the GPU test at the end (skipped without CUDA)."""

import pytest
import torch

from lightning_gh import hardware


def test_detect_on_this_machine():
    hw = hardware.detect()
    assert hw is hardware.detect()  # cached
    assert hw.cpu_count >= 1 and hw.host_arch
    if not torch.cuda.is_available():
        assert (hw.cuda_available, hw.gpu_name, hw.compute_capability, hw.fp8_capable, hw.link) == (False, None, None, False, None)
        assert "CPU only" in hw.describe()
        assert "no CUDA GPU" in hw.fp8_unsupported_reason()
        assert hardware.link_bandwidth() is None


def test_host_facts_on_this_machine(monkeypatch):
    import platform

    assert hardware.host_arch() == platform.machine() == hardware.detect().host_arch
    flags = hardware.cpu_flags()
    assert isinstance(flags, frozenset) and all(f == f.lower() for f in flags)
    if not torch.cuda.is_available():
        assert hardware.gpu_name() is None and hardware.managed_memory_attributes() is None
        assert hardware.coherent_host_memory() is None


def test_cpu_flags_read_the_first_flags_line(monkeypatch, tmp_path):
    import builtins

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu SSE2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(cpuinfo if f == "/proc/cpuinfo" else f, *a, **k))
    hardware.cpu_flags.cache_clear()
    try:
        assert hardware.cpu_flags() == {"fpu", "sse2", "avx2", "fma"}
    finally:
        hardware.cpu_flags.cache_clear()


@pytest.mark.parametrize(
    "arch, cc, fp8, hopper, gh, link",
    [
        ("x86_64", (9, 0), True, True, False, "pcie"),  # H100 / H200 on PCIe
        ("aarch64", (9, 0), True, True, True, "nvlink-c2c"),  # GH200
        ("x86_64", (8, 9), True, False, False, "pcie"),  # L40S / RTX 4090
        ("x86_64", (8, 0), False, False, False, "pcie"),  # A100
        ("aarch64", (8, 0), False, False, False, "pcie"),  # Arm host with an Ampere card is not Grace Hopper
        ("x86_64", None, False, False, False, None),
    ],
)
def test_classify(arch, cc, fp8, hopper, gh, link):
    assert hardware.classify(arch, cc) == {"fp8_capable": fp8, "is_hopper": hopper, "is_grace_hopper": gh, "link": link}


def test_fp8_reason_names_the_gpu_and_capability():
    hw = hardware.HardwareInfo(True, 0, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * 2**30, 1, False, False, False, "pcie",
                               "x86_64", 16, "2.11", "13.0")
    assert hw.fp8_unsupported_reason() == "NVIDIA A100-SXM4-80GB has compute capability 8.0; fp8 needs >= 8.9 (Ada, Hopper or newer)"
    assert "sm_80" in hw.describe()


@pytest.mark.gpu
def test_gpu_fields_and_bandwidth():
    hw = hardware.detect()
    assert hw.cuda_available and hw.gpu_name and hw.compute_capability and hw.gpu_memory_bytes > 0
    bw = hardware.link_bandwidth(nbytes=64 * 2**20, repeats=3)
    assert bw.h2d_gbps > 1 and bw.d2h_gbps > 1


def test_cpu_view_hides_the_gpu_from_the_parts():
    from lightning_gh.demo.config import DemoConfig
    from lightning_gh.demo.parts import PARTS

    h200 = hardware.HardwareInfo(True, 0, "NVIDIA H200", (9, 0), 140 * 2**30, 1, True, True, False, "pcie",
                                 "x86_64", 16, "2.11", "13.0")
    cpu = hardware.cpu_view(h200)
    assert (cpu.cuda_available, cpu.fp8_capable, cpu.link, cpu.gpu_name) == (False, False, None, None)
    assert cpu.cpu_count == 16 and "no CUDA GPU" in cpu.fp8_unsupported_reason()
    # What `demo --accelerator cpu` hands the parts on a GPU machine: every GPU-only part stays off.
    cfg = DemoConfig(preset="tiny", steps=30, accelerator="cpu")
    on = {p.name for p in (f(cfg, cpu, cfg.out) for f in PARTS) if p.enabled}
    assert on <= {"SelectiveProfiler + DataStallDetector", "NVTX ranges"}, on
