"""SuperOffload's options: one frozen, validated dataclass shared by :class:`HeterogeneousAdamW` and
:class:`SuperOffloadStrategy`, plus the checks of the optimizer-only arguments.

The strategy and the optimizer take the same options under the same names; both build a
:class:`SuperOffloadOptions` from their keyword arguments (or take one as ``options=``), so a bad value fails
with the same message wherever it is given.

Example::

    >>> from lightning_gh.superoffload import SuperOffloadOptions
    >>> opts = SuperOffloadOptions(gpu_fraction=0.25, speculative=False)
    >>> opts.gpu_fraction, opts.needs_backup(validation=True)
    (0.25, False)
    >>> SuperOffloadOptions(speculative="no")
    Traceback (most recent call last):
    ...
    ValueError: speculative='no' must be True, False or 'auto'.
    >>> SuperOffloadOptions(cpu_threads="4")
    Traceback (most recent call last):
    ...
    TypeError: SuperOffloadOptions(cpu_threads='4'): expected an int or None, got str.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_gh._options import check_type, check_types, resolve

__all__ = ["SuperOffloadOptions", "resolve_options", "validate_hyperparameters", "validate_knobs", "validate_options"]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SuperOffloadOptions:
    """The options SuperOffload's optimizer and strategy share.

    Attributes:
        gpu_fraction: share of the parameters (by count, taken from the last-arriving gradients, i.e. the first
            layers) whose state stays on the GPU and is updated there with fused AdamW. ``"auto"``: everything
            starts on the host and, over the first pipelined steps, the tail grows while the next forward
            measurably waits for the CPU, each growth kept only if the step gets faster (see Note [Tail growth
            trial] in :mod:`.tail`; its decision is logged once and kept in ``stats["tail_decision"]``). ``0.0``
            saves the most GPU memory. Without CUDA the tail runs on the CPU in ``step()`` (same math) and
            ``"auto"`` means ``0.0``.
        max_gpu_fraction: upper bound on the share of parameters the ``"auto"`` tail may keep on the GPU, or
            ``None`` (bounded by free GPU memory only: what is left after a step's peak, less a headroom; a move
            that runs out of memory anyway leaves its bucket on the host). Ignored unless ``gpu_fraction="auto"``.
            Over several ranks with a sharded tail it bounds each rank's share of its own parameters.
        speculative: start CPU updates before the gradient norm is known and undo them exactly if the step
            must be clipped or skipped (see Note [Speculative update and exact rollback] in :mod:`.worker`); each
            speculatively updated bucket needs a 12 B/parameter copy in host RAM while the step may be clipped or
            skipped. ``"auto"``: speculate on as many buckets (those whose gradients arrive first) as the host's
            RAM has room for, none if none fits (see :func:`~lightning_gh.superoffload.memory.plan_host_memory`);
            ``True``: every bucket (refused when the host cannot hold the copies); ``False``: none, every bucket
            waits for the step's decision.
        skip_nonfinite: skip the whole step (no state change) when the gradient norm is inf/NaN.
        cpu_threads: threads of the CPU update, or ``None`` (all CPUs this process may use but two with CUDA,
            else torch's setting).
        bucket_size: parameters per host bucket (the unit of copy and CPU work).
        host_memory_check: refuse with a :class:`~lightning_gh._host.HostMemoryError` when host RAM cannot hold
            the state.
        rollback: how a speculative update is made undoable. ``"auto"``: each host bucket keeps two copies of its
            state and a speculative update writes the other one (out of place, with a small C kernel checked
            bitwise against torch's fused AdamW on this machine; see :mod:`.cpu_adamw`), so undoing costs
            nothing; that kernel then makes every CPU update, and reads the gradients of bf16 parameters in
            bf16 (one rank); where it cannot be built or differs, as ``"copy"``. ``"copy"``: torch's fused CPU
            AdamW in place, fp32 gradients on the host, the state copied aside before each speculative update
            and back on a rollback. Both need 12 B/parameter more host RAM for each bucket updated speculatively.
        device_assist: once a step's clip/skip decision is known, let the GPU update some of the host buckets still
            waiting for the CPU, streaming their state over the host link, while the CPU updates the others (see
            Note [Device-assisted update] in :mod:`.assist`); the moments of host buckets are then page-locked.
            Off by default: where the CPU update is bound by the host's memory bandwidth, the link's copies take
            that bandwidth from it (docs/benchmarks.md). ``"auto"``: with CUDA on one rank, unless
            ``torch.use_deterministic_algorithms(True)`` is in effect (which device updates a bucket depends on
            timing, and the GPU's fused AdamW may differ from the CPU's in the last bit); ``True``: also off CUDA,
            where the same split runs on the CPU (for tests); ``False``: the CPU updates every host bucket. Never
            with several ranks (each rank's CPU updates its own share) nor on the ZeRO-3 path.
        bind_numa: on a host with several NUMA nodes, run each rank's CPU threads on the CPUs of its GPU's node
            (ranks whose GPUs share a node split them, whole cores each), so its host state sits in that node's
            memory (see Note [A rank's CPUs near its GPU] in :mod:`.numa`). Only with CUDA; nothing changes on
            one node or where the OS does not say which node a GPU is on. ``"auto"``: also leaves alone a process
            already bound within one node (``numactl``, the cluster's launcher) and a host where some node would
            host no rank (its CPUs and memory would sit idle); ``True``: binds in both cases, within the process's
            mask, and warns where the GPU's node is unknown; ``False``: never binds.
        weights_first: once a step's decision is known (every step of a run clipped on each step), update each host
            bucket (ZeRO-3: each host unit) in two passes: its new weights first, which the next forward waits for,
            then its master weights and moments, which nothing waits for until the next backward fills its
            gradient buffer (see Note [Weights first, state after] in :mod:`.weights_first`). The same results,
            bitwise; the forward's wait moves less host memory, the update as a whole moves more. Needs the CPU AdamW
            kernel (:mod:`.cpu_adamw`) and host room for two page-locked staging buffers of the largest bucket;
            without them, with ``device_assist`` on, or with ``False``, one pass. Speculative updates (before the
            decision) and steps without clipping or the non-finite check are one pass either way.
    """

    gpu_fraction: float | str = "auto"
    max_gpu_fraction: float | None = None
    speculative: bool | str = "auto"
    skip_nonfinite: bool = True
    cpu_threads: int | None = None
    bucket_size: int = 1 << 24
    host_memory_check: bool = True
    rollback: str = "auto"
    device_assist: bool | str = False
    bind_numa: bool | str = "auto"
    weights_first: bool = True

    def __post_init__(self) -> None:
        check_types(self)  # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        gf = self.gpu_fraction
        if not (gf == "auto" or (_is_number(gf) and 0.0 <= gf <= 1.0)):
            raise ValueError(f"gpu_fraction={gf!r} must be a float in [0, 1] or 'auto'.")
        mgf = self.max_gpu_fraction
        if mgf is not None and not (_is_number(mgf) and 0.0 <= mgf <= 1.0):
            raise ValueError(f"max_gpu_fraction={mgf!r} must be a float in [0, 1] or None.")
        if not (isinstance(self.speculative, bool) or self.speculative == "auto"):
            raise ValueError(f"speculative={self.speculative!r} must be True, False or 'auto'.")
        for name in ("skip_nonfinite", "host_memory_check", "weights_first"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False.")
        if self.cpu_threads is not None and not (_is_count(self.cpu_threads) and self.cpu_threads >= 1):
            raise ValueError(f"cpu_threads={self.cpu_threads!r} must be an int >= 1 or None.")
        if not (isinstance(self.device_assist, bool) or self.device_assist == "auto"):
            raise ValueError(f"device_assist={self.device_assist!r} must be True, False or 'auto'.")
        if not (isinstance(self.bind_numa, bool) or self.bind_numa == "auto"):
            raise ValueError(f"bind_numa={self.bind_numa!r} must be True, False or 'auto'.")
        if self.rollback not in ("auto", "copy"):
            raise ValueError(f"rollback={self.rollback!r} must be 'auto' or 'copy'.")
        if not (_is_count(self.bucket_size) and self.bucket_size >= 1):
            raise ValueError(f"bucket_size={self.bucket_size!r} must be a positive int (parameters per bucket).")
        # Normalise numbers so equal options compare equal (0 and 0.0) and the optimizer does float math.
        if gf != "auto":
            object.__setattr__(self, "gpu_fraction", float(gf))
        if mgf is not None:
            object.__setattr__(self, "max_gpu_fraction", float(mgf))

    def needs_backup(self, validation: bool) -> bool:
        """Whether speculative updates may need an exact pre-step copy (only when the step may be clipped or
        skipped, and speculation is not off)."""
        return self.speculative is not False and validation

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of :class:`HeterogeneousAdamW` / :class:`SuperOffloadStrategy`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def resolve_options(options: SuperOffloadOptions | None, owner: str, **kwargs: Any) -> SuperOffloadOptions:
    """The options from ``options=`` or from the keyword arguments, never a mix of both (see
    :func:`lightning_gh._options.resolve`).

    Args:
        options: what the caller passed as ``options=``, or ``None``.
        owner: the class taking them, for the message.
        kwargs: the caller's option keyword arguments (the :class:`SuperOffloadOptions` fields).
    """
    return resolve(SuperOffloadOptions, options, owner, **kwargs)


# name -> (type, value check, what is allowed)
_HYPERPARAMETERS = {
    "lr": (float, lambda v: v >= 0, "a float >= 0"),
    "betas": (tuple[float, float], lambda v: len(v) == 2 and all(0.0 <= b < 1.0 for b in v),
              "a pair of floats in [0, 1)"),
    "eps": (float, lambda v: v >= 0, "a float >= 0"),
    "weight_decay": (float, lambda v: v >= 0, "a float >= 0"),
}
_KNOBS = {
    "max_grad_norm": (float | None, lambda v: v is None or v > 0, "a float > 0 or None"),
    "max_grad_value": (float | None, lambda v: v is None or v > 0, "a float > 0 or None"),
    "pipeline_trigger": (str, lambda v: v in ("backward", "closure"), "'backward' or 'closure'"),
}


def _check_argument(table: dict[str, Any], where: str, name: str, value: Any) -> None:
    annotation, ok, allowed = table[name]
    check_type(where.strip() or "HeterogeneousAdamW", name, value, annotation)
    if not ok(value):
        raise ValueError(f"{where}{name}={value!r} must be {allowed}.")


def validate_hyperparameters(where: str, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """Check AdamW's hyper-parameters as ``torch.optim.AdamW`` does, naming where they come from: ``TypeError`` for
    a value of the wrong type, ``ValueError`` for one out of range.

    Args:
        where: ``""`` for the constructor's arguments, or ``"param_groups[i] "`` for a param group.
    """
    for name, value in (("lr", lr), ("betas", betas), ("eps", eps), ("weight_decay", weight_decay)):
        _check_argument(_HYPERPARAMETERS, where, name, value)


def validate_knobs(**knobs: Any) -> None:
    """Check the optimizer's per-run knobs that are not :class:`SuperOffloadOptions` fields (``max_grad_norm``,
    ``max_grad_value``, ``pipeline_trigger``); only those given are checked.

    Example::

        >>> validate_knobs(max_grad_norm=1.0, pipeline_trigger="closure")
        >>> validate_knobs(max_grad_norm=0)
        Traceback (most recent call last):
        ...
        ValueError: max_grad_norm=0 must be a float > 0 or None.
        >>> validate_knobs(pipeline_trigger=1)
        Traceback (most recent call last):
        ...
        TypeError: HeterogeneousAdamW(pipeline_trigger=1): expected a string, got int.
    """
    unknown = sorted(set(knobs) - set(_KNOBS))
    if unknown:
        raise TypeError(f"unknown knob(s) {unknown}; the knobs are max_grad_norm, max_grad_value and "
                        f"pipeline_trigger.")
    for name, value in knobs.items():
        _check_argument(_KNOBS, "", name, value)


def validate_options(**kwargs: Any) -> None:
    """Check :class:`HeterogeneousAdamW`'s arguments as its constructor does, without building it: the AdamW
    hyper-parameters, the knobs (:func:`validate_knobs`) and the :class:`SuperOffloadOptions` fields. Raises
    ``TypeError`` for a value of the wrong type and ``ValueError`` for one out of range, naming the argument, the
    value and what is allowed."""
    for name in [k for k in kwargs if k in _HYPERPARAMETERS]:
        _check_argument(_HYPERPARAMETERS, "", name, kwargs.pop(name))
    validate_knobs(**{k: kwargs.pop(k) for k in ("max_grad_norm", "max_grad_value", "pipeline_trigger")
                      if k in kwargs})
    SuperOffloadOptions(**kwargs)
