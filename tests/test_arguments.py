"""Every public constructor (and ``precision()``) refuses wrong types and out-of-range values at construction,
with an error that names the argument: TypeError for a value of the wrong type, ValueError for a value of an
accepted type that is out of range or not among the allowed names.

The bad values are derived from each parameter's default: a bool gets strings and numbers (TypeError), a number
gets strings (TypeError) and negatives or NaN (ValueError, drawn by hypothesis). The table KNOWN lists, value by
value, the parameters that take free text or have their own ranges, where the generic rules do not apply."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_gh as lgh


def _adamw(**kw: Any) -> Any:
    return lgh.HeterogeneousAdamW([torch.nn.Parameter(torch.zeros(4))], **kw)


def _precision(**kw: Any) -> Any:
    return lgh.precision("fp8-auto", **kw)


# name -> (constructor, parameters to leave out of the generic rules: free text, callables, objects)
CONSTRUCTORS: dict[str, tuple[Callable[..., Any], set[str]]] = {
    "ActivationOffload": (lgh.ActivationOffload, {"blocks", "options"}),
    "CUDAGraphCapture": (lgh.CUDAGraphCapture, set()),
    "DataStallDetector": (lgh.DataStallDetector, set()),
    "HeterogeneousAdamW": (_adamw, {"module", "options", "params"}),
    "LayerFilter": (lgh.LayerFilter, {"include", "exclude"}),
    "NVTXRangeCallback": (lgh.NVTXRangeCallback, {"domain", "module_ranges", "steps"}),
    "SelectiveProfiler": (lgh.SelectiveProfiler, {"output_dir", "steps", "backends"}),
    "SuperOffloadStrategy": (lgh.SuperOffloadStrategy, {"device", "accelerator", "checkpoint_io", "precision_plugin",
                                                         "options"}),
    "SuperOffloadFSDPStrategy": (lgh.SuperOffloadFSDPStrategy, {"options", "process_group_backend", "timeout"}),
    "precision(fp8-auto)": (_precision, set()),
    "ActivationOffloadOptions": (lgh.ActivationOffloadOptions, {"blocks"}),
    "SuperOffloadOptions": (lgh.SuperOffloadOptions, set()),
    "Float8Options": (lambda **kw: lgh.Float8Options(**{"recipe": "fp8-ao-tensorwise", **kw}), {"layer_filter", "name"}),
    "Float8Precision": (lgh.Float8Precision, {"include", "exclude", "backend_options"}),
    "KVOffloadOptions": (lgh.KVOffloadOptions, set()),
    "GenerationCallback": (lambda **kw: lgh.GenerationCallback(**{"prompts": [[1, 2, 3]], **kw}), {"prompts"}),
    "ManagedMemoryOptions": (lgh.ManagedMemoryOptions, set()),
    "ManagedOptimizerState": (lgh.ManagedOptimizerState, {"options"}),
    "MemoryReport": (lgh.MemoryReport, {"options", "folder"}),
    "MemoryReportOptions": (lgh.MemoryReportOptions, {"folder"}),
    "TEOptions": (lgh.TEOptions, set()),
    "GraphCaptureOptions": (lgh.GraphCaptureOptions, set()),
    "NVTXOptions": (lgh.NVTXOptions, {"domain", "module_ranges", "steps"}),
    "ProfilerOptions": (lgh.ProfilerOptions, {"output_dir", "steps", "backends"}),
    "StallOptions": (lgh.StallOptions, set()),
    "ThroughputMonitor": (lgh.ThroughputMonitor, {"options"}),
    "ThroughputOptions": (lgh.ThroughputOptions, set()),
}
# Constructors that take their options' fields as ``**kwargs``: the fields are their parameters too.
OPTIONS: dict[str, type] = {
    "HeterogeneousAdamW": lgh.SuperOffloadOptions,
    "SuperOffloadStrategy": lgh.SuperOffloadOptions,
    "SuperOffloadFSDPStrategy": lgh.SuperOffloadOptions,
    "MemoryReport": lgh.MemoryReportOptions,
}
# Parameters whose default is None or a string but which take a number in a range, or a name from a set: each bad
# value with the error it must raise (TypeError for a value of the wrong type, ValueError for a value of an accepted
# type that is out of range or not among the allowed names).
V, T = ValueError, TypeError
KNOWN: dict[str, dict[str, list[tuple[Any, type[Exception]]]]] = {
    "ActivationOffload": {
        "policy": [("sometimes", V), ("", V), ("ALL", V), (-1, V), (0.5, T)],
        "backend": [("gpu", V), ("", V), (3, T)],
        "bandwidth_gbps": [(0, V), (-5.0, V), (float("nan"), V), ("fast", T)],
        "recompute": [("some", V), (1, T), ("", V)],
        "lean_loss": [("yes", T), (1, T), (0.0, T)],
    },
    "HeterogeneousAdamW": {
        "gpu_fraction": [(-0.1, V), (1.5, V), ("most", V), (float("nan"), V)],
        "max_grad_norm": [(-1.0, V), (0.0, V), ("1", T), (float("nan"), V)],
        "max_grad_value": [(-1.0, V), (0.0, V), ("1", T), (float("nan"), V)],
        "cpu_threads": [(0, V), (-2, V), (1.5, T), ("4", T)],
        "max_gpu_fraction": [(-0.1, V), (1.5, V), ("x", T)],
        "pipeline_trigger": [("never", V), (1, T)],
        "betas": [((2.0, 2.0), V), ((0.9,), V), ("0.9", T), ((-0.1, 0.9), V)],
        "device_assist": [("no", V), (1, T)],
        "bind_numa": [("yes", V), (1, T)],
    },
    "SuperOffloadFSDPStrategy": {"data_parallel_size": [("x", V), (0, V), (-1, V), (1.5, T)],
                                 "device_assist": [("no", V), (1, T)], "bind_numa": [("yes", V), (1, T)],
                                 "lean_loss": [("yes", V), (1, T), (0.0, T)]},
    "SuperOffloadStrategy": {
        "gpu_fraction": [(-0.1, V), (1.5, V), ("most", V), (float("nan"), V)],
        "cpu_threads": [(0, V), (-2, V), (1.5, T), ("4", T)],
        "max_gpu_fraction": [(-0.1, V), (1.5, V), ("x", T)],
        "device_assist": [("no", V), (1, T)],
        "bind_numa": [("yes", V), (1, T)],
        "lean_loss": [("yes", V), (1, T), (0.0, T)],
    },
    "SelectiveProfiler": {"ranks": [(-1, T), (1.5, T), ("zero", V), (object(), T)]},  # a string of ranks
    "NVTXRangeCallback": {"ranks": [(-1, T), (1.5, T), ("zero", V), (object(), T)]},
    # backend recipe names are checked by each plugin
    "Float8Options": {"recipe": [(3, T), ("", V), (None, T)]},
    "Float8Precision": {"recipe": [("fp9", V), (3, T), ("", V)], "min_dim": [(-1, V), ("big", T)],
                        "skip_head": [("yes", T), (2, T)]},
    "KVOffloadOptions": {"resident_layers": [("some", V), (-1, V), (1.5, T)],
                         "placement": [("middle", V), (1, T)], "backend": [("tpu", V), (1, T)],
                         "max_length": [(0, V), (-5, V), ("long", T)]},
    "GenerationCallback": {"cache": [("disk", V), (1, T)], "every_n_steps": [(0, V), (-1, V), ("10", T)]},
    "ManagedMemoryOptions": {"preferred": [("disk", V), (1, T)], "prefetch": [("always", V), (1, T)]},
    "ManagedOptimizerState": {"preferred": [("disk", V), (1, T)], "prefetch": [("always", V), (1, T)]},
    "SuperOffloadOptions": {"gpu_fraction": [(-0.1, V), (1.5, V), ("most", V), (float("nan"), V)],
                            "cpu_threads": [(0, V), (-2, V), (1.5, T), ("4", T)],
                            "max_gpu_fraction": [(-0.1, V), (1.5, V), ("x", T)],
                            "device_assist": [("no", V), (1, T)],
                            "bind_numa": [("yes", V), (1, T)]},
    "precision(fp8-auto)": {
        "bogus": [(1, T), ("x", T), (None, T)],  # an unknown keyword is a TypeError, as for any Python call
        "min_dim": [(-1, V), (1.5, T), ("big", T)],
        "skip_head": [("yes", T), (2, T)],
    },
}
def _wrong_types(default: Any) -> list[Any]:
    """Values of a type that a parameter whose default is ``default`` does not take (each must raise TypeError)."""
    if isinstance(default, bool):
        return ["no", "False", 0, 1, 2, 1.0]
    if isinstance(default, int):
        return ["3", 2.5, float("nan")]
    if isinstance(default, float):
        return ["0.5"]
    return []


def _bad_values(default: Any) -> st.SearchStrategy | None:
    """Values out of range (ValueError) for a number, or any text (TypeError) for a bool, drawn by hypothesis."""
    if isinstance(default, bool):
        return st.text(min_size=1, max_size=5)
    if isinstance(default, int):
        return st.integers(max_value=-1)
    if isinstance(default, float):
        return st.one_of(st.floats(max_value=-1e-6, allow_infinity=False), st.just(float("nan")))
    return None


def _params(name: str) -> dict[str, inspect.Parameter]:
    ctor, _ = CONSTRUCTORS[name]
    target = {"HeterogeneousAdamW": lgh.HeterogeneousAdamW, "GenerationCallback": lgh.GenerationCallback,
              "Float8Options": lgh.Float8Options}.get(name, ctor)
    if name.startswith("precision"):
        return {}
    params = {n: p for n, p in inspect.signature(target).parameters.items() if p.kind != p.VAR_KEYWORD}
    if name in OPTIONS:
        params.update({n: p for n, p in inspect.signature(OPTIONS[name]).parameters.items() if n not in params})
    return params


def _generic() -> list[tuple[str, str, Any]]:
    """(constructor, parameter, default) that the generic rules cover."""
    return [(name, pname, p.default) for name, (_, skip) in CONSTRUCTORS.items() for pname, p in _params(name).items()
            if pname not in skip and pname not in KNOWN.get(name, {})
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _case(name: str, param: str, value: Any, expected: type[Exception]) -> Any:
    if isinstance(value, st.SearchStrategy):
        case_id = f"{name}-{param}"
    else:
        case_id = f"{name}-{param}-{value if isinstance(value, (str, int, float, tuple, type(None))) else 'object'!r}"
    return pytest.param(name, param, value, expected, id=case_id)


def _typed_cases() -> list[Any]:
    """Every value of the table above, and every wrong-typed value of the generic rules, each with its error."""
    known = [_case(name, pname, value, exc)
             for name, table in KNOWN.items() for pname, values in table.items() for value, exc in values]
    generic = [_case(name, pname, value, TypeError)
               for name, pname, default in _generic() for value in _wrong_types(default)]
    return known + generic


def _drawn_cases() -> list[Any]:
    out = []
    for name, pname, default in _generic():
        strat = _bad_values(default)
        if strat is not None:
            expected = TypeError if isinstance(default, bool) else ValueError
            out.append(_case(name, pname, strat, expected))
    return out


def _check(name: str, param: str, value: Any, expected: type[Exception]) -> None:
    ctor, _ = CONSTRUCTORS[name]
    with pytest.raises((ValueError, TypeError)) as err:
        ctor(**{param: value})
    assert param in str(err.value), f"{name}({param}={value!r}) raised without naming {param!r}: {err.value}"
    assert isinstance(err.value, expected), (
        f"{name}({param}={value!r}) raised {type(err.value).__name__}, expected {expected.__name__} "
        f"({'wrong type' if expected is TypeError else 'bad value'}): {err.value}")


@pytest.mark.parametrize("name,param,value,expected", _typed_cases())
def test_bad_argument_is_refused_naming_it(name: str, param: str, value: Any, expected: type[Exception]) -> None:
    _check(name, param, value, expected)


@pytest.mark.parametrize("name,param,values,expected", _drawn_cases())
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drawn_bad_argument_is_refused_naming_it(name: str, param: str, values: st.SearchStrategy,
                                                 expected: type[Exception], data: Any) -> None:
    _check(name, param, data.draw(values, label=param), expected)


def test_keyword_constructors_name_their_options():
    """A constructor that takes ``**kwargs`` is listed in OPTIONS, so its options' fields are covered."""
    for name, (ctor, _) in CONSTRUCTORS.items():
        target = {"HeterogeneousAdamW": lgh.HeterogeneousAdamW}.get(name, ctor)
        if not name.startswith("precision") and inspect.isclass(target):
            takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(target).parameters.values())
            assert not takes_kwargs or name in OPTIONS, name


def test_every_known_parameter_exists():
    """The table names parameters the constructors take (``precision()`` takes keywords, so it is not checked)."""
    for name, table in KNOWN.items():
        params = _params(name)
        if params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            assert set(table) <= set(params), (name, set(table) - set(params))


def test_every_public_constructor_is_covered():
    """A new public class must be added to the table above (or be a result/exception type)."""
    # results, or built from a model (own tests)
    results = {"GraphReport", "GraphState", "HardwareInfo", "OffloadedKVCache", "LeanLoss",
               "ShardedHostAdamW"}  # ShardedHostAdamW needs an FSDP2-sharded module
    for n in lgh.__all__:
        obj = getattr(lgh, n)
        if inspect.isclass(obj) and not issubclass(obj, BaseException) and n not in results:
            assert n in CONSTRUCTORS, n
