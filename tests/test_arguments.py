"""Every public constructor (and ``precision()``) refuses wrong types and out-of-range values at construction,
with a ValueError or TypeError that names the argument. Property-based: hypothesis draws the bad values.

The bad values are derived from each parameter's default (a bool gets strings and numbers, a number gets strings,
NaN and negatives, an enumeration gets names outside it); the table below says which parameters take free text
or have their own ranges, so the generic rules do not apply to them.
"""

from __future__ import annotations

import inspect
import math
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
    "precision(fp8-auto)": (_precision, set()),
    "ActivationOffloadOptions": (lgh.ActivationOffloadOptions, {"blocks"}),
    "SuperOffloadOptions": (lgh.SuperOffloadOptions, set()),
    "Float8Options": (lambda **kw: lgh.Float8Options(**{"recipe": "fp8-ao-tensorwise", **kw}), {"layer_filter", "name"}),
    "Float8Precision": (lgh.Float8Precision, {"include", "exclude", "backend_options"}),
    "KVOffloadOptions": (lgh.KVOffloadOptions, set()),
    "GenerationCallback": (lambda **kw: lgh.GenerationCallback(**{"prompts": [[1, 2, 3]], **kw}), {"prompts"}),
    "ManagedMemoryOptions": (lgh.ManagedMemoryOptions, set()),
    "ManagedOptimizerState": (lgh.ManagedOptimizerState, {"options"}),
}
# Parameters whose default is None or a string but which take a number in a range, or a name from a set.
KNOWN: dict[str, dict[str, st.SearchStrategy]] = {
    "ActivationOffload": {
        "policy": st.sampled_from(["sometimes", "", "ALL", -1]),
        "backend": st.sampled_from(["gpu", "", 3]),
        "bandwidth_gbps": st.sampled_from([0, -5.0, float("nan"), "fast"]),
        "recompute": st.sampled_from(["some", 1, ""]),
        "lean_loss": st.sampled_from(["yes", 1, 0.0]),
    },
    "HeterogeneousAdamW": {
        "gpu_fraction": st.sampled_from([-0.1, 1.5, "most", float("nan")]),
        "max_grad_norm": st.sampled_from([-1.0, 0.0, "1", float("nan")]),
        "max_grad_value": st.sampled_from([-1.0, 0.0, "1", float("nan")]),
        "cpu_threads": st.sampled_from([0, -2, 1.5, "4"]),
        "max_gpu_fraction": st.sampled_from([-0.1, 1.5, "x"]),
        "pipeline_trigger": st.sampled_from(["never", 1]),
        "betas": st.sampled_from([(2.0, 2.0), (0.9,), "0.9", (-0.1, 0.9)]),
    },
    "SuperOffloadStrategy": {
        "gpu_fraction": st.sampled_from([-0.1, 1.5, "most", float("nan")]),
        "cpu_threads": st.sampled_from([0, -2, 1.5, "4"]),
        "max_gpu_fraction": st.sampled_from([-0.1, 1.5, "x"]),
    },
    "SelectiveProfiler": {"ranks": st.sampled_from([-1, 1.5, "zero", object()])},
    "NVTXRangeCallback": {"ranks": st.sampled_from([-1, 1.5, "zero", object()])},
    "Float8Options": {"recipe": st.sampled_from([3, "", None])},  # backend recipe names are checked by each plugin
    "Float8Precision": {"recipe": st.sampled_from(["fp9", 3, ""]), "min_dim": st.sampled_from([-1, "big"]),
                        "skip_head": st.sampled_from(["yes", 2])},
    "KVOffloadOptions": {"resident_layers": st.sampled_from(["some", -1, 1.5]),
                         "placement": st.sampled_from(["middle", 1]), "backend": st.sampled_from(["tpu", 1]),
                         "max_length": st.sampled_from([0, -5, "long"])},
    "GenerationCallback": {"cache": st.sampled_from(["disk", 1]), "every_n_steps": st.sampled_from([0, -1, "10"])},
    "ManagedMemoryOptions": {"preferred": st.sampled_from(["disk", 1]), "prefetch": st.sampled_from(["always", 1])},
    "ManagedOptimizerState": {"preferred": st.sampled_from(["disk", 1]), "prefetch": st.sampled_from(["always", 1])},
    "SuperOffloadOptions": {"gpu_fraction": st.sampled_from([-0.1, 1.5, "most", float("nan")]),
                            "cpu_threads": st.sampled_from([0, -2, 1.5, "4"]),
                            "max_gpu_fraction": st.sampled_from([-0.1, 1.5, "x"])},
    "precision(fp8-auto)": {
        "bogus": st.sampled_from([1, "x", None]),
        "min_dim": st.sampled_from([-1, 1.5, "big"]),
        "skip_head": st.sampled_from(["yes", 2]),
    },
}


def _bad_values(default: Any) -> st.SearchStrategy | None:
    """Values of the wrong type or out of range for a parameter whose default is ``default``."""
    if isinstance(default, bool):
        return st.one_of(st.sampled_from(["no", "False", 0, 1, 2, 1.0]), st.text(min_size=1, max_size=5))
    if isinstance(default, int):
        return st.one_of(st.integers(max_value=-1), st.sampled_from(["3", 2.5, float("nan")]))
    if isinstance(default, float):
        return st.one_of(st.floats(max_value=-1e-6, allow_infinity=False), st.sampled_from(["0.5", float("nan")]))
    return None


def _cases() -> list[tuple[str, str, st.SearchStrategy]]:
    cases = []
    for name, (ctor, skip) in CONSTRUCTORS.items():
        target = {"HeterogeneousAdamW": lgh.HeterogeneousAdamW, "GenerationCallback": lgh.GenerationCallback,
                  "Float8Options": lgh.Float8Options}.get(name, ctor)
        params = {} if name.startswith("precision") else inspect.signature(target).parameters
        for pname, p in params.items():
            if pname in skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            strat = KNOWN.get(name, {}).get(pname) or _bad_values(p.default)
            if strat is not None:
                cases.append((name, pname, strat))
        for pname, strat in KNOWN.get(name, {}).items():
            if pname not in params:
                cases.append((name, pname, strat))
    return cases


CASES = _cases()


@pytest.mark.parametrize("name,param,values", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_argument_is_refused_naming_it(name: str, param: str, values: st.SearchStrategy, data: Any) -> None:
    ctor, _ = CONSTRUCTORS[name]
    value = data.draw(values, label=param)
    if isinstance(value, float) and math.isnan(value) and param == "bogus":
        return
    with pytest.raises((ValueError, TypeError)) as err:
        ctor(**{param: value})
    assert param in str(err.value), f"{name}({param}={value!r}) raised without naming {param!r}: {err.value}"


def test_every_public_constructor_is_covered():
    """A new public class must be added to the table above (or be a result/exception type)."""
    # results, or built from a model (own tests)
    results = {"GraphReport", "HardwareInfo", "OffloadedKVCache", "LeanLoss"}
    for n in lgh.__all__:
        obj = getattr(lgh, n)
        if inspect.isclass(obj) and not issubclass(obj, BaseException) and n not in results:
            assert n in CONSTRUCTORS, n
