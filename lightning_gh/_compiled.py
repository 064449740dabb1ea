"""Code of ours around a module compiled in place, outside its compiled function.

``module.compile()`` (what the fp8 plugins' regional compilation does to each transformer block) sets
``module._compiled_call_impl = torch.compile(module._call_impl)``, and ``nn.Module.__call__`` calls that instead of
``_call_impl``. The module's forward hooks run inside ``_call_impl``, so they are traced into the compiled function:
a hook that waits for a CPU thread, records a CUDA event or counts calls would break the graph or run once at trace
time. :class:`WrappedCompiledCall` puts a function of ours in front of the compiled call instead, run eagerly on
each call; :class:`AroundCompiledCall` is the pair of hooks form. SuperOffload's forward wait, ActivationOffload's
block boundaries and its full recompute use them (Note [Forward hooks stay out of compiled regions] in
:mod:`lightning_gh.superoffload.layout`).

Several parts may wrap the same module, and their handles may be removed in any order: each wrapper calls what
is below it through its handle (``inner``), so a handle removed from the middle of the chain links its neighbours
(:meth:`WrappedCompiledCall.remove`), and the chain below and above it stays as it was.

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> lin._compiled_call_impl = lin._call_impl  # stands in for what lin.compile() sets
    >>> calls = []
    >>> a = AroundCompiledCall(lin, lambda m, args: calls.append("a"), None)
    >>> b = AroundCompiledCall(lin, lambda m, args: calls.append("b"), None)
    >>> _ = lin(torch.zeros(1, 2)); calls
    ['b', 'a']
    >>> a.remove(); _ = lin(torch.zeros(1, 2)); calls[2:]  # out of the middle: b still runs
    ['b']
    >>> b.remove(); lin._compiled_call_impl == lin._call_impl
    True
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from torch import nn

__all__ = ["AroundCompiledCall", "WrappedCompiledCall", "compiled_call_wrappers", "is_compiled_in_place"]

_HANDLE = "_lgh_compiled_call_handle"  # on each wrapper function: its handle


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``module.compile()``): its own forward hooks would be traced.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> is_compiled_in_place(lin), is_compiled_in_place(torch.compile(lin))  # a wrapper runs its hooks eagerly
    (False, False)
    """
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_call_wrappers(module: nn.Module) -> list[WrappedCompiledCall]:
    """The handles of our wrappers around ``module``'s compiled call, outermost first."""
    out: list[WrappedCompiledCall] = []
    f = getattr(module, "_compiled_call_impl", None)
    while f is not None:
        h = getattr(f, _HANDLE, None)
        if h is None:
            break
        out.append(h)
        f = h.inner
    return out


class WrappedCompiledCall:
    """Calls ``wrap(inner, args, kwargs)`` instead of the compiled call ``inner`` of a module compiled in place,
    eagerly, on each call. A handle like a hook's: :meth:`remove` takes the wrapper out (also from the middle of a
    chain of wrappers), :attr:`installed` says whether it is still in the module's chain.

    Args:
        module: a module compiled in place.
        wrap: runs the call: ``wrap(inner, args, kwargs)`` must call ``inner(*args, **kwargs)`` (or not) and return
            the output.
        tag: what the wrapper is for (``"recompute"``, ...), for :func:`compiled_call_wrappers`' readers.
    """

    def __init__(self, module: nn.Module, wrap: Callable[[Callable[..., Any], tuple, dict], Any],
                 tag: str = "") -> None:
        if not is_compiled_in_place(module):
            raise ValueError(f"{type(self).__name__}: {type(module).__name__} is not compiled in place "
                             "(module.compile() was not called on it).")
        self.module = module
        self.tag = tag
        self.inner: Callable[..., Any] = module._compiled_call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            return wrap(self.inner, args, kwargs)

        setattr(call, _HANDLE, self)
        self.call = call
        module._compiled_call_impl = call

    @property
    def installed(self) -> bool:
        return any(h is self for h in compiled_call_wrappers(self.module))

    def remove(self) -> None:
        """Take the wrapper out: the module's compiled call, or the wrapper above it, calls what it called. Nothing
        when the module was compiled again since (the chain no longer leads to it)."""
        if getattr(self.module, "_compiled_call_impl", None) is self.call:
            self.module._compiled_call_impl = self.inner
            return
        for h in compiled_call_wrappers(self.module):
            if h.inner is self.call:
                h.inner = self.inner
                return


class AroundCompiledCall(WrappedCompiledCall):
    """Runs ``before(module, args)`` and ``after(module, args, output)`` around each call of a module compiled in
    place, as a forward pre-hook and a forward hook with ``always_call=True`` run around an eager one: ``after``
    also runs when ``before`` or the call raises (with ``None`` as the output), and an error of ``after`` then is a
    warning, not the error the caller sees. Keyword arguments reach the compiled call but not ``args``.
    """

    def __init__(self, module: nn.Module, before: Callable[[nn.Module, tuple], Any] | None = None,
                 after: Callable[[nn.Module, tuple, Any], Any] | None = None, tag: str = "") -> None:
        def wrap(inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            try:
                if before is not None:
                    before(module, args)
                out = inner(*args, **kwargs)
            except BaseException:
                if after is not None:
                    try:
                        after(module, args, None)
                    except Exception as e:  # the call's own error is the one to see
                        warnings.warn(f"{type(module).__name__}: an after-call hook raised while the call was "
                                      f"failing: {type(e).__name__}: {e}", stacklevel=2)
                raise
            if after is not None:
                after(module, args, out)
            return out

        super().__init__(module, wrap, tag)
