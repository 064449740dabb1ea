"""Options given either as one frozen dataclass (``options=``) or as keyword arguments, never both; and the one
type check every options dataclass runs first.

Every part keeps its options in one frozen, validated dataclass that its engine and its callback or strategy share;
the constructors also take the same options as keyword arguments, which build that dataclass. This is the one place
that decides between the two (:func:`resolve`), and the one place that refuses a value of the wrong type
(:func:`check_types` for a dataclass's fields, :func:`check_type` for one argument), before the part checks ranges.
See Note [Wrong type, wrong value].

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
    >>> check_types(Opts(size="3"))
    Traceback (most recent call last):
    ...
    TypeError: Opts(size='3'): expected an int, got str.
    >>> check_type("Part", "lr", True, float)
    Traceback (most recent call last):
    ...
    TypeError: Part(lr=True): expected a float, got bool.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Mapping, TypeVar, Union

__all__ = ["check_type", "check_types", "resolve"]

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


# Note [Wrong type, wrong value]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A constructor refuses a value of a type its parameter does not take with a TypeError, and a value of an accepted
# type that is out of range or not among the allowed names with a ValueError; both name the argument, the value and
# what is allowed. The type comes from the annotation, read by check_type / check_types before any range check, so
# the two errors never depend on the order of a part's own checks. The rules, for the simple annotations the options
# use (bool, int, float, str, None, tuple[...], a class, and unions of them):
#   * bool is not a number here, although it is an int subclass: True for an int or a float is a TypeError, and so
#     is 0 or 1 for a bool;
#   * an int is a float (1 for a float option is fine); a float is never an int (2.5, nan and inf for an int option
#     are TypeErrors, not rounded);
#   * a string is never a number or a bool ("3", "0.5", "no" are TypeErrors);
#   * a tuple annotation takes a tuple or a list whose elements have the element types (its length is a value);
#   * a generic such as Sequence[nn.Module] or Mapping[str, Any] is checked against its class only; a field
#     annotated Any, or with anything else, is left to the part's own checks.

_SIMPLE = (bool, int, float, str)
_NAMES = {int: "an int", float: "a float", str: "a string", type(None): "None"}
_PLURAL = {bool: "bools", int: "ints", float: "floats", str: "strings"}


def _kinds(annotation: Any) -> tuple[Any, ...] | None:
    """The kinds a value of ``annotation`` may be, or ``None`` when the annotation says nothing checkable."""
    if annotation is None or annotation is type(None):
        return (type(None),)
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        out: list[Any] = []
        for member in typing.get_args(annotation):
            kinds = _kinds(member)
            if kinds is None:
                return None
            out.extend(kinds)
        return tuple(out)
    if origin is tuple:
        args = typing.get_args(annotation)
        elements = [_kinds(a) for a in args if a is not Ellipsis]
        return ((tuple, args[1:] == (Ellipsis,) if args else True, tuple(elements)),)
    if isinstance(origin, type):  # Sequence[nn.Module], Mapping[str, Any]: the class only
        return (origin,)
    if isinstance(annotation, type) and annotation is not object:
        return (annotation,)
    return None


def _accepts(kind: Any, value: Any) -> bool:
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(kind, tuple):
        _, repeated, elements = kind
        if not isinstance(value, (tuple, list)):
            return False
        pairs = zip(value, elements * len(value) if repeated else elements)
        return all(e is None or any(_accepts(k, v) for k in e) for v, e in pairs)
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    if kind in _NAMES:
        return _NAMES[kind]
    if isinstance(kind, tuple):
        _, repeated, elements = kind
        if not elements or any(e is None or len(e) != 1 for e in elements):
            return "a tuple"
        if repeated:
            return f"a tuple of {_PLURAL.get(elements[0][0], elements[0][0].__name__)}"
        names = ", ".join(getattr(e[0], "__name__", "?") for e in elements)
        return f"a ({names}) tuple"
    name = getattr(kind, "__name__", repr(kind))
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _allowed(kinds: tuple[Any, ...]) -> str:
    """``"an int or None"``, ``"True, False or a string"``: the kinds in words, ``None`` last."""
    ordered = sorted(kinds, key=lambda k: k is type(None))
    names = list(dict.fromkeys(n for k in ordered for n in (("True", "False") if k is bool else (_describe(k),))))
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_type(where: str, name: str, value: Any, annotation: Any, allowed: str | None = None) -> None:
    """Raise ``TypeError`` when ``value`` is not of the type ``annotation`` names (see Note [Wrong type, wrong
    value]): ``"<where>(<name>=<value>): expected <allowed>, got <type>."``.

    Args:
        where: the constructor, for the message (``"HeterogeneousAdamW"``).
        name: the argument.
        value: what the caller passed.
        annotation: a type (``float``), a union (``int | None``), a ``tuple[float, float]``, or a string that is
            none of these (then nothing is checked).
        allowed: what is allowed, in words, where the types alone say too little (``"'auto', True, False or a
            dict of torch.compile arguments"``); default: the types.
    """
    kinds = _kinds(annotation)
    if kinds is None or any(_accepts(k, value) for k in kinds):
        return
    raise TypeError(f"{where}({name}={value!r}): expected {allowed or _allowed(kinds)}, got {type(value).__name__}.")


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints.get(f.name)) for f in dataclasses.fields(cls))


def check_types(instance: Any, where: str | None = None, *, skip: tuple[str, ...] = (),
                allowed: Mapping[str, str] | None = None) -> None:
    """Run :func:`check_type` on every field of the dataclass ``instance`` against its declared type; called first
    in each options dataclass's ``__post_init__``, before its range checks (see Note [Wrong type, wrong value]).

    Args:
        instance: the dataclass instance being built.
        where: the name in the message; default: the class's name.
        skip: fields the dataclass checks itself (free-form values normalised before the check).
        allowed: for some fields, what is allowed in words (see :func:`check_type`).
    """
    cls = type(instance)
    where = where or cls.__name__
    allowed = allowed or {}
    for name, annotation in _field_types(cls):
        if name not in skip:
            check_type(where, name, getattr(instance, name), annotation, allowed.get(name))
