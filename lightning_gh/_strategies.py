"""``Trainer(strategy="superoffload")`` after ``import lightning_gh``, without importing torch or Lightning for it.

``import lightning_gh`` loads its parts on first use, so a command that only parses a trace
(``python -m lightning_gh.profiling summarize``) never pays for torch. The strategy name must still be known to
Lightning whenever Lightning is in use: it is registered now if Lightning's strategies are already imported, else
the moment they are (a post-import hook on ``lightning.pytorch.strategies``). The registered entry is a factory, so
the SuperOffload code itself loads only when a Trainer asks for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["install"]

_TARGET = "lightning.pytorch.strategies"
NAME = "superoffload"
DESCRIPTION = ("Heterogeneous CPU/GPU AdamW (lightning_gh): optimizer state in host memory, CPU update overlapped "
               "with backward")


def _superoffload(**kwargs: Any) -> Any:
    from lightning_gh.superoffload import SuperOffloadStrategy

    return SuperOffloadStrategy(**kwargs)


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if NAME not in StrategyRegistry:
        StrategyRegistry.register(NAME, _superoffload, description=DESCRIPTION)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning.pytorch.strategies`` with the normal machinery, then registers once it has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _register()


def install() -> None:
    """Register the strategy names now, or as soon as Lightning's strategies are imported."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
