"""``Float8Precision``: any precision name as a Lightning ``Precision`` class, for ``LightningCLI`` YAML.

A config file names plugins by class, not by calling a function, so ``precision("fp8-auto")`` cannot be written
there. ``Float8Precision(recipe=...)`` builds the plugin ``precision(recipe, ...)`` would, forwards every Precision
hook to it, and at setup installs that plugin as the strategy's own (as ``fp8-auto`` hands over to its choice), so
from then on ``trainer.precision_plugin`` is the real plugin: the parts table, checkpoints and logs see it.

Example (``config.yaml``)::

    trainer:
      plugins:
        - class_path: lightning_gh.Float8Precision
          init_args:
            recipe: fp8-auto
            exclude: ["*.wo"]
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_gh._lightning import trainer_of

__all__ = ["Float8Precision"]


class Float8Precision(Precision):
    """The precision plugin ``lightning_gh.precision(recipe, ...)`` builds, as a class a config file can name.

    Args:
        recipe: any name ``precision()`` accepts: ``"fp8-auto"``, ``"fp8-te-delayed"``, ``"fp8-ao-tensorwise"``, ...
            or one of Lightning's strings (``"bf16-mixed"``, ``"32-true"``, ...).
        include: layer-filter glob patterns of the layers that may run in fp8 (fp8 recipes only).
        exclude: layer-filter glob patterns of layers kept out of fp8 (fp8 recipes only).
        skip_head: keep the output head out of fp8 (fp8 recipes only; ``None`` keeps the default).
        skip_first: keep the first projection out of fp8 (fp8 recipes only; ``None`` keeps the default).
        min_dim: convert only layers with ``min(in, out) >= min_dim`` (fp8 recipes only; ``None`` keeps the default).
        backend_options: further keyword arguments for the recipe's plugin, e.g. ``{"emulate": true}`` for a
            torchao recipe or ``{"device": "cpu"}`` for ``bf16-mixed``.

    Raises:
        ValueError: an unknown ``recipe`` (the message lists the valid names) or an option the recipe does not take.

    Example::

        trainer = L.Trainer(plugins=[lgh.Float8Precision("fp8-auto", exclude=["*.wo"])])
    """

    def __init__(
        self,
        recipe: str = "fp8-auto",
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        skip_head: bool | None = None,
        skip_first: bool | None = None,
        min_dim: int | None = None,
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        from lightning_gh.precision.registry import precision

        if backend_options is not None and not isinstance(backend_options, dict):
            raise ValueError(f"Float8Precision(backend_options={backend_options!r}): expected a dict or None.")
        fields = dict(include=include, exclude=exclude, skip_head=skip_head, skip_first=skip_first, min_dim=min_dim)
        options = {k: v for k, v in fields.items() if v is not None}
        clash = sorted(set(options) & set(backend_options or {}))
        if clash:
            raise ValueError(f"Float8Precision: {clash} given both as arguments and in backend_options; give each once.")
        self.recipe = recipe
        try:
            self.plugin: Precision = precision(recipe, **options, **(backend_options or {}))
        except (TypeError, ValueError) as e:
            # name the argument the user wrote in the config, not precision()'s own
            raise type(e)(f"Float8Precision(recipe={recipe!r}, ...): {e}") from None
        self.precision = self.plugin.precision

    def __repr__(self) -> str:
        return f"Float8Precision(recipe={self.recipe!r}, plugin={self.plugin!r})"

    def convert_module(self, module: nn.Module) -> nn.Module:
        trainer = trainer_of(module)
        if trainer is not None:
            # From here on the strategy talks to the built plugin itself (which may hand over again, as fp8-auto does).
            trainer.strategy.precision_plugin = self.plugin
        return self.plugin.convert_module(module)


def _forward(name: str) -> Any:
    def method(self: Float8Precision, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.plugin, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}`` of the built plugin."
    return method


# Every Precision hook besides convert_module, so that a caller still holding this object (before setup, or a test
# driving the plugin by hand) reaches the built plugin.
_FORWARDED = ("_after_closure", "_clip_gradients", "_wrap_closure", "backward", "clip_grad_by_norm",
              "clip_grad_by_value", "clip_gradients", "connect", "convert_input", "convert_output", "forward_context",
              "load_state_dict", "main_params", "module_init_context", "on_load_checkpoint", "on_save_checkpoint",
              "optimizer_step", "post_backward", "pre_backward", "predict_step_context", "state_dict", "teardown",
              "tensor_init_context", "test_step_context", "train_step_context", "unscale_gradients",
              "val_step_context")
for _name in _FORWARDED:
    setattr(Float8Precision, _name, _forward(_name))
del _name
