"""Options given either as one frozen dataclass (``options=``) or as keyword arguments, never both.

Every part keeps its options in one frozen, validated dataclass that its engine and its callback or strategy share;
the constructors also take the same options as keyword arguments, which build that dataclass. This is the one place
that decides between the two.

Example::

    >>> import dataclasses
    >>> from lightning_gh._options import resolve
    >>> @dataclasses.dataclass(frozen=True)
    ... class Opts:
    ...     size: int = 1
    >>> resolve(Opts, None, "Part", size=3)
    Opts(size=3)
    >>> resolve(Opts, Opts(size=2), "Part", size=1)  # a keyword left at its default does not count as given
    Opts(size=2)
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["resolve"]

T = TypeVar("T")


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # objects whose == is elementwise or raises are never a default
        return False


def resolve(cls: type[T], options: T | None, where: str, **given: Any) -> T:
    """``options``, or a ``cls`` built from the keyword arguments ``given``; both at once is a ``TypeError``.

    A keyword argument left at its default cannot be told from one not given, so only values that differ from the
    dataclass's defaults count as given next to ``options``.

    Args:
        cls: the options dataclass.
        options: what the caller passed as ``options=``, or ``None``.
        where: the caller, for the error (``"ActivationOffload"``).
        given: the option keyword arguments (all of them, with their values).

    Raises:
        TypeError: an unknown option, ``options`` of another type, or both ``options`` and a changed keyword.
        ValueError: a bad value (from the dataclass's own validation).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; the options are {sorted(defaults)}.")
    if options is None:
        return cls(**given)
    if not isinstance(options, cls):
        article = "an" if cls.__name__[:1] in "AEIOU" else "a"
        raise TypeError(f"{where}(options=...) must be {article} {cls.__name__}, got {type(options).__name__}.")
    changed = {k: v for k, v in given.items() if not _same(v, defaults[k])}
    if changed:
        shown = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        raise TypeError(f"{where} got both options= and {shown}: pass the options in one place "
                        f"(e.g. options=dataclasses.replace(options, {next(iter(changed))}=...)).")
    return options
