"""Small helpers every part shares: warn once, format a byte count, read a package environment variable.

One implementation each, so that a part never grows its own copy.

Example::

    >>> from lightning_gh._util import fmt_bytes
    >>> fmt_bytes(3 * 2**30), fmt_bytes(1536 * 2**10), fmt_bytes(512)
    ('3.00 GiB', '1.5 MiB', '512 B')
"""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["ENV_PREFIX", "count_tokens", "env", "fmt_bytes", "local_tensor", "reset_warnings", "warn_once"]

#: The one prefix of the package's environment variables (``LGH_PROFILE_START_STOP``, ``LGH_CACHE_DIR``, ...).
ENV_PREFIX = "LGH_"

_WARNED: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process, nothing after.

    Keys are global to the package: prefix them with the part (``"nvtx:no-package"``).
    """
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)


def reset_warnings(prefix: str = "") -> None:
    """Forget the keys that start with ``prefix`` (all of them by default), so that they warn again (tests)."""
    for key in [k for k in _WARNED if k.startswith(prefix)]:
        _WARNED.discard(key)


def fmt_bytes(n: int | float) -> str:
    """A byte count for people: ``1.50 GiB``, ``20.0 MiB``, ``3.0 KiB``, ``512 B``."""
    n = float(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def local_tensor(t: Any) -> Any:
    """This process's part of ``t``: a ``DTensor``'s local shard (FSDP2's sharded parameters and gradients),
    any other tensor itself. Sizes and storages of a sharded model are read through this."""
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard as it is, without an autograd call
    if local is not None:
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def count_tokens(batch: Any) -> int | None:
    """Tokens in an LLM micro-batch: the size of its token ids (``input_ids`` or ``tokens`` of a dict, else its first
    entry, a few levels of tuples and dicts deep), or ``None`` where the first tensor found is not integer."""
    import torch  # here, so that importing this module never imports torch

    for _ in range(4):
        if isinstance(batch, torch.Tensor):
            return batch.numel() if not batch.is_floating_point() and not batch.is_complex() else None
        if isinstance(batch, dict):
            batch = batch.get("input_ids", batch.get("tokens", next(iter(batch.values()), None)))
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return None
    return None


def env(name: str, default: str | None = None) -> str | None:
    """The package environment variable ``LGH_<name>`` (``name`` without the prefix), or ``default``."""
    if name.startswith(ENV_PREFIX):
        raise ValueError(f"env(name={name!r}): give the name without the {ENV_PREFIX!r} prefix.")
    value = os.environ.get(ENV_PREFIX + name)
    return default if value is None or value == "" else value
