"""What the step times measured on a PCIe GPU forecast for a Grace Hopper (GH200): arithmetic, not a measurement.

With the optimizer state in host-preferred managed memory, the GPU's optimizer kernel reads and writes the state
over the host link every step. The forecast assumes the extra time this costs over the plain run (state in GPU
memory) is that traffic, so it scales with the link's bandwidth for an in-place update: measured here with
:func:`lightning_gh.hardware.managed_bandwidth` (``rmw_gbps``), and for a GH200 taken from published measurements,
not ours. Fusco et al., "Understanding Data Movement in Tightly Coupled Heterogeneous Systems: A Case Study with the
Grace Hopper Superchip" (arXiv 2408.11556, 2024; Alps GH200, CUDA 12.4) measured NVLink-C2C at 375 GB/s host to
GPU and 297 GB/s GPU to host, and Grace's LPDDR5X at 486 GB/s (STREAM). An in-place update reads and writes host
memory in equal parts: about 331 GB/s of combined traffic when the two directions take turns (the low end of
:data:`GH200_RMW_GBPS`), up to 486 GB/s when they overlap and memory is the limit (the high end). The plain step
time is assumed to be the same on the GH200's GPU as here; the H200 has faster HBM than a 96 GB GH200.

Example::

    >>> from lightning_gh.unified.forecast import forecast_step_ms
    >>> round(forecast_step_ms(plain_ms=100.0, managed_ms=400.0, measured_gbps=50.0, target_gbps=500.0), 1)
    130.0
"""

from __future__ import annotations

__all__ = ["GH200_RMW_GBPS", "forecast_step_ms", "state_traffic_ms"]

#: (low, high) combined read+write GB/s of a GPU in-place update of Grace memory over NVLink-C2C, from the
#: published measurements in the module docstring (not measured by this project).
GH200_RMW_GBPS: tuple[float, float] = (2 / (1 / 375.0 + 1 / 297.0), 486.0)


def _positive(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a number > 0.")
    return float(v)


def forecast_step_ms(plain_ms: float, managed_ms: float, measured_gbps: float, target_gbps: float) -> float:
    """The step time on a machine whose host link updates memory in place at ``target_gbps``, from a run here: the
    plain step plus the managed run's extra time scaled by ``measured_gbps / target_gbps``. A forecast.

    Args:
        plain_ms: the plain run's step time here (state in GPU memory).
        managed_ms: the step time here with the state in host-preferred managed memory.
        measured_gbps: the in-place update bandwidth measured here (``hardware.managed_bandwidth().rmw_gbps``).
        target_gbps: the target's (e.g. an end of :data:`GH200_RMW_GBPS`).
    """
    plain, managed = _positive("plain_ms", plain_ms), _positive("managed_ms", managed_ms)
    ratio = _positive("measured_gbps", measured_gbps) / _positive("target_gbps", target_gbps)
    return plain + max(0.0, managed - plain) * ratio


def state_traffic_ms(state_bytes: int, gbps: float) -> float:
    """Milliseconds to read and write ``state_bytes`` once in place at ``gbps`` of combined traffic (the floor of a
    host-preferred optimizer step's extra time).

    Args:
        state_bytes: the optimizer state's bytes (AdamW: 8 per fp32 parameter).
        gbps: combined read+write GB/s (1e9 bytes/s).
    """
    if isinstance(state_bytes, bool) or not isinstance(state_bytes, int) or state_bytes < 0:
        raise ValueError(f"state_bytes={state_bytes!r} must be an int >= 0.")
    return 2 * state_bytes / (_positive("gbps", gbps) * 1e9) * 1e3
