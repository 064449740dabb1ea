"""The options every fp8 plugin shares, in one frozen, validated dataclass.

``Float8Options`` holds what the Transformer Engine, torchao and ``fp8-auto`` plugins have in common: the recipe,
the name shown in logs and the layer filter. The plugins' keyword arguments (``include=``, ``min_dim=``, ...) keep
working and build one; a ready ``Float8Options`` can be passed as ``options=`` instead.

Example::

    >>> from lightning_gh.precision import Float8Options
    >>> Float8Options.build("tensorwise", min_dim=0).layer_filter.min_dim
    0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_gh.precision.layer_filter import LayerFilter

__all__ = ["Float8Options"]


@dataclass(frozen=True)
class Float8Options:
    """What the fp8 plugins share.

    Attributes:
        recipe: the backend's recipe (``"delayed"``, ``"tensorwise"``, ...; ``"auto"`` for ``fp8-auto``).
        name: the precision name shown in logs (``"fp8-te-current"``); ``None`` lets the plugin derive it.
        layer_filter: which ``nn.Linear`` layers run in fp8.
    """

    recipe: str
    name: str | None = None
    layer_filter: LayerFilter = field(default_factory=LayerFilter)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, str) or not self.recipe:
            raise ValueError(f"Float8Options(recipe={self.recipe!r}): expected a recipe name (a non-empty string).")
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"Float8Options(name={self.name!r}): expected a string or None.")
        if not isinstance(self.layer_filter, LayerFilter):
            raise ValueError(f"Float8Options(layer_filter={self.layer_filter!r}): expected a LayerFilter; build one "
                             "from a dict or keyword arguments with Float8Options.build(...).")

    @classmethod
    def build(cls, recipe: str, *, name: str | None = None,
              layer_filter: LayerFilter | Mapping[str, Any] | None = None, **filter_fields: Any) -> Float8Options:
        """The options from the plugins' keyword arguments.

        Args:
            recipe: the backend's recipe name.
            name: the precision name shown in logs.
            layer_filter: a ``LayerFilter`` or a dict of its fields.
            **filter_fields: ``include``, ``exclude``, ``skip_head``, ``skip_first``, ``min_dim``: override single
                fields of ``layer_filter`` (``None`` keeps it).

        Raises:
            ValueError: a filter field with a bad value, or an unknown field.
        """
        return cls(recipe=recipe, name=name, layer_filter=LayerFilter.from_options(layer_filter, **filter_fields))
