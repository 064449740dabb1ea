"""``lightning_gh._compiled``: wrappers in front of a module's compiled call (``module.compile()``), chained by
several parts and removed in any order, with the always-call semantics of forward hooks."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_gh._compiled import AroundCompiledCall, WrappedCompiledCall, compiled_call_wrappers


def _compiled_linear():
    lin = torch.nn.Linear(2, 2)
    lin._compiled_call_impl = lin._call_impl  # what lin.compile() sets, without compiling
    return lin, lin._compiled_call_impl


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_wrappers_removed_in_any_order_leave_the_others_running_and_then_the_compiled_call(order):
    lin, original = _compiled_linear()
    calls = []
    handles = [AroundCompiledCall(lin, lambda m, a, k=k: calls.append(k), None, tag=str(k)) for k in range(3)]
    assert [h.tag for h in compiled_call_wrappers(lin)] == ["2", "1", "0"]  # outermost first
    left = [0, 1, 2]
    for k in order:
        handles[k].remove()
        left.remove(k)
        assert not handles[k].installed and all(handles[j].installed for j in left)
        calls.clear()
        lin(torch.zeros(1, 2))
        assert calls == sorted(left, reverse=True)
    assert lin._compiled_call_impl == original and compiled_call_wrappers(lin) == []


def test_after_runs_when_before_or_the_call_raises_and_the_callers_error_wins():
    lin, _ = _compiled_linear()
    seen = []

    def before(m, args):
        raise KeyError("before")

    def after(m, args, out):
        seen.append(out)
        raise RuntimeError("after")

    h = AroundCompiledCall(lin, before, after)
    with pytest.warns(UserWarning, match="an after-call hook raised while the call was failing: RuntimeError"), \
            pytest.raises(KeyError, match="before"):
        lin(torch.zeros(1, 2))
    assert seen == [None]
    h.remove()
    out = []
    AroundCompiledCall(lin, None, lambda m, a, o: out.append(o))
    y = lin(torch.zeros(1, 2))
    assert out[0] is y


def test_a_wrapper_needs_a_module_compiled_in_place_and_a_recompile_drops_the_chain():
    with pytest.raises(ValueError, match="Linear is not compiled in place"):
        WrappedCompiledCall(torch.nn.Linear(2, 2), lambda inner, a, k: inner(*a, **k))
    lin, _ = _compiled_linear()
    h = WrappedCompiledCall(lin, lambda inner, a, k: inner(*a, **k) * 2)
    assert torch.equal(lin(torch.ones(1, 2)), 2 * lin._call_impl(torch.ones(1, 2)))
    lin._compiled_call_impl = lin._call_impl  # compiled again: the chain no longer leads to the wrapper
    assert not h.installed
    h.remove()  # nothing to take out
    assert lin._compiled_call_impl == lin._call_impl
