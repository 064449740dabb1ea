"""``Trainer(strategy="superoffload")`` and ``"superoffload_fsdp"`` after ``import lightning_gh``, without importing torch or Lightning for it.

``import lightning_gh`` loads its parts on first use, so a command that only parses a trace
(``python -m lightning_gh.profiling summarize``) never pays for torch. The strategy name must still be known to
Lightning whenever Lightning is in use: it is registered now if Lightning's strategies are already imported, else
the moment they are (a post-import hook on ``lightning.pytorch.strategies``). The registered entry is a factory, so
the SuperOffload code itself loads only when a Trainer asks for it.

The standalone ``pytorch_lightning`` package has a Trainer of its own whose classes are not Lightning's: our
strategy, callbacks and plugins cannot run in it. Its registry gets the same name with a factory that says so, so
``pytorch_lightning.Trainer(strategy="superoffload")`` fails with that message instead of a generic one.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["install"]

_TARGET = "lightning.pytorch.strategies"
_PL_TARGET = "pytorch_lightning.strategies"
_TARGETS = (_TARGET, _PL_TARGET)
NAME = "superoffload"
DESCRIPTION = ("Heterogeneous CPU/GPU AdamW (lightning_gh): optimizer state in host memory, CPU update overlapped "
               "with backward")


FSDP_NAME = "superoffload_fsdp"
FSDP_DESCRIPTION = ("ZeRO-3 through FSDP2 (lightning_gh): AdamW state of each rank's shards in host memory, CPU "
                    "update overlapped with the next forward, exact clipping")


def _superoffload(**kwargs: Any) -> Any:
    from lightning_gh.superoffload import SuperOffloadStrategy

    return SuperOffloadStrategy(**kwargs)


def _superoffload_fsdp(**kwargs: Any) -> Any:
    from lightning_gh.superoffload.fsdp import SuperOffloadFSDPStrategy

    return SuperOffloadFSDPStrategy(**kwargs)


WRONG_TRAINER = ("lightning_gh's strategy, callbacks and precision plugins run in the `lightning` package's Trainer "
                 "(`import lightning as L; L.Trainer(...)`), not in the standalone `pytorch_lightning` package's: "
                 "import the Trainer and LightningModule from `lightning` instead.")


def _wrong_trainer(**kwargs: Any) -> Any:
    raise TypeError(f'strategy="{NAME}" in a pytorch_lightning.Trainer: {WRONG_TRAINER}')


def _register(target: str = _TARGET) -> None:
    if target == _PL_TARGET:
        from pytorch_lightning.strategies import StrategyRegistry as registry
        factory = _wrong_trainer
    else:
        from lightning.pytorch.strategies import StrategyRegistry as registry
        factory = _superoffload
    if NAME not in registry:
        registry.register(NAME, factory, description=DESCRIPTION)
    if FSDP_NAME not in registry:
        registry.register(FSDP_NAME, factory if target == _PL_TARGET else _superoffload_fsdp,
                          description=FSDP_DESCRIPTION)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds one strategies module with the normal machinery, then registers once it has run."""

    def __init__(self, target: str = _TARGET) -> None:
        self.target = target

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.target:
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
        _register(self.target)


def install() -> None:
    """Register the strategy names now, or as soon as Lightning's (or pytorch_lightning's) strategies are
    imported."""
    for target in _TARGETS:
        if target in sys.modules:
            _register(target)
        elif not any(isinstance(f, _AfterImport) and f.target == target for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(target))
