"""Forwarding for the modules of ``lightning_gh.offload``, which moved in 0.2 (kept for one release).

Activation offload now lives in :mod:`lightning_gh.activation_offload`, SuperOffload in
:mod:`lightning_gh.superoffload`. Each old module keeps its names through a module-level ``__getattr__``
that imports the new home on first use (so importing an old module costs nothing and cannot form a cycle)
and warns ``DeprecationWarning`` naming the new import path.

Example::

    __getattr__, __dir__ = forward_to(__name__, ("lightning_gh.activation_offload.engine",))
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["forward_to"]


def forward_to(old: str, targets: Sequence[str],
               public: str | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for the old module ``old`` that look names up in ``targets``.

    Args:
        old: the old module's name (``__name__``).
        targets: the new modules, searched in order; the first that has the name provides it.
        public: the new package; the warning points there for the names in its ``__all__``.
    """

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # module dunders (``__path__``, ``__wrapped__``...) are never forwarded
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        for target in targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                home = target
                if public is not None and name in getattr(importlib.import_module(public), "__all__", ()):
                    home = public
                warnings.warn(f"{old}.{name} is deprecated and will be removed in the next release: "
                              f"import it from {home} instead.", DeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {targets[0]}, "
                             "which has no such name either)")

    def __dir__() -> list[str]:
        names: set[str] = set()
        for target in targets:
            names.update(getattr(importlib.import_module(target), "__all__", ()))
        return sorted(names)

    return __getattr__, __dir__
