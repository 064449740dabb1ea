"""The import paths of ``lightning_gh.offload`` (before 0.2) still work for one release and warn.

Each old name must be the very object of its new home (not a copy), and reading it must warn
``DeprecationWarning`` naming the old path and where to import it from now.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

ACTIVATION = [
    ("lightning_gh.offload", "ActivationOffload", "lightning_gh.activation_offload"),
    ("lightning_gh.offload", "HostMemoryError", "lightning_gh._host"),
    ("lightning_gh.offload", "offload_activations", "lightning_gh.activation_offload"),
    ("lightning_gh.offload", "plan_auto", "lightning_gh.activation_offload.policy"),
    ("lightning_gh.offload.activations", "ActivationOffloader", "lightning_gh.activation_offload.engine"),
    ("lightning_gh.offload.activations", "HostBufferPool", "lightning_gh.activation_offload.pool"),
    ("lightning_gh.offload.activations", "HostMemoryError", "lightning_gh._host"),
    ("lightning_gh.offload.activations", "OffloadStats", "lightning_gh.activation_offload.stats"),
    ("lightning_gh.offload.activations", "find_blocks", "lightning_gh.activation_offload.blocks"),
    ("lightning_gh.offload.activation_policy", "OffloadPlan", "lightning_gh.activation_offload.policy"),
    ("lightning_gh.offload.activation_policy", "plan_none", "lightning_gh.activation_offload.policy"),
    ("lightning_gh.offload.recompute", "BlockRecompute", "lightning_gh.activation_offload.recompute"),
    ("lightning_gh.offload.recompute", "is_norm_act_module", "lightning_gh.activation_offload.recompute"),
    ("lightning_gh.offload.callback", "ActivationOffload", "lightning_gh.activation_offload.callback"),
    ("lightning_gh.offload.callback", "check_strategy", "lightning_gh.activation_offload.callback"),
]

SUPEROFFLOAD = [
    ("lightning_gh.offload.superoffload", "HeterogeneousAdamW", "lightning_gh.superoffload"),
    ("lightning_gh.offload.strategy", "SuperOffloadStrategy", "lightning_gh.superoffload"),
    ("lightning_gh.offload.superoffload_memory", "HostMemoryPlan", "lightning_gh.superoffload"),
    ("lightning_gh.offload.superoffload_memory", "available_host_bytes", "lightning_gh.superoffload"),
    ("lightning_gh.offload.superoffload_memory", "check_host_memory", "lightning_gh.superoffload"),
]


def _check(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated .* import it from lightning_gh\."):
        obj = getattr(module, name)
    assert obj is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize(("old", "name", "new"), ACTIVATION, ids=[f"{o}.{n}" for o, n, _ in ACTIVATION])
def test_old_activation_offload_paths_forward_and_warn(old, name, new):
    _check(old, name, new)


@pytest.mark.parametrize(("old", "name", "new"), SUPEROFFLOAD, ids=[f"{o}.{n}" for o, n, _ in SUPEROFFLOAD])
def test_old_superoffload_paths_forward_and_warn(old, name, new):
    pytest.importorskip("lightning_gh.superoffload", reason="lightning_gh.superoffload is not in this tree yet")
    _check(old, name, new)


def test_from_import_warns_at_the_importing_line_and_gives_the_new_class():
    from lightning_gh.activation_offload import ActivationOffload as New

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from lightning_gh.offload import ActivationOffload as Old  # noqa: PLC0415
    assert Old is New
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert dep and dep[0].filename == __file__, "the warning must point at the user's import, not at the shim"
    assert "import it from lightning_gh.activation_offload instead" in str(dep[0].message)


def test_star_import_and_unknown_names():
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning):
        exec("from lightning_gh.offload.callback import *", namespace)
    assert {"ActivationOffload", "check_strategy"} <= set(namespace)
    import lightning_gh.offload.activations as old

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        old.no_such_name  # noqa: B018
    assert "ActivationOffloader" in dir(old)
