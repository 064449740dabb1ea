"""Code of ours around a module compiled in place, outside its compiled function.

``module.compile()`` (what the fp8 plugins' regional compilation does to each transformer block) sets
``module._compiled_call_impl = torch.compile(module._call_impl)``, and ``nn.Module.__call__`` calls that instead of
``_call_impl``. The module's forward hooks run inside ``_call_impl``, so they are traced into the compiled function:
a hook that waits for a CPU thread, records a CUDA event or counts calls would break the graph or run once at trace
time. :class:`AroundCompiledCall` runs ``before`` and ``after`` around the compiled call instead, eagerly, each call.
SuperOffload's forward wait and ActivationOffload's block boundaries use it (Note [Forward hooks stay out of compiled
regions] in :mod:`lightning_gh.superoffload.layout`).

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> lin._compiled_call_impl = lin._call_impl  # stands in for what lin.compile() sets
    >>> calls = []
    >>> h = AroundCompiledCall(lin, lambda m, args: calls.append("before"), lambda m, args, out: calls.append("after"))
    >>> _ = lin(torch.zeros(1, 2)); calls
    ['before', 'after']
    >>> h.remove(); _ = lin(torch.zeros(1, 2)); calls
    ['before', 'after']
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["AroundCompiledCall", "is_compiled_in_place"]


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``module.compile()``): its own forward hooks would be traced.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> is_compiled_in_place(lin), is_compiled_in_place(torch.compile(lin))  # a wrapper runs its hooks eagerly
    (False, False)
    """
    return getattr(module, "_compiled_call_impl", None) is not None


class AroundCompiledCall:
    """Runs ``before(module, args)`` and ``after(module, args, output)`` around each call of a module compiled in
    place, outside the compiled function, as a forward pre-hook and a forward hook with ``always_call=True`` would
    run around an eager one (``after`` runs when the call raises too, with ``None`` as its output). A handle like a
    hook's: :meth:`remove` puts the compiled call back (unless the module was compiled again since), and
    :attr:`installed` says whether the wrapper is still the one called. Keyword arguments reach the compiled call
    but not ``args``.
    """

    def __init__(self, module: nn.Module, before: Callable[[nn.Module, tuple], Any] | None = None,
                 after: Callable[[nn.Module, tuple, Any], Any] | None = None) -> None:
        if not is_compiled_in_place(module):
            raise ValueError(f"AroundCompiledCall: {type(module).__name__} is not compiled in place "
                             "(module.compile() was not called on it).")
        self.module = module
        self.inner = inner = module._compiled_call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(module, args)
            out = None
            try:
                out = inner(*args, **kwargs)
            finally:
                if after is not None:
                    after(module, args, out)
            return out

        self.call = call
        module._compiled_call_impl = call

    @property
    def installed(self) -> bool:
        return getattr(self.module, "_compiled_call_impl", None) is self.call

    def remove(self) -> None:
        if self.installed:
            self.module._compiled_call_impl = self.inner
