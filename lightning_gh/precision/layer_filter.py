"""Which ``nn.Linear`` layers run in fp8: one rule shared by the Transformer Engine and torchao backends.

A layer is converted when all of these hold:

1. it is an ``nn.Linear`` (or a subclass) and not already converted;
2. both weight dimensions are multiples of 16 (what the fp8 tensor-core GEMMs accept);
3. it is not the output head (``skip_head``): the last ``nn.Linear`` in module order, any ``nn.Linear``
   whose weight is shared with an ``nn.Embedding`` (a tied head), and any widening ``nn.Linear`` whose
   ``out_features`` equals an embedding's vocabulary size (a head that is not last in module order).
   Logits feed a softmax over the whole vocabulary, where fp8's 3 mantissa bits cost the most accuracy;
4. it is not the model's first projection (``skip_first``): the first ``nn.Linear`` in module order that
   is not a head, and its siblings that read the same input. Siblings are recognised by structure and name: ``nn.Linear``
   children of the same parent with the same ``in_features`` whose names are query/key/value projections
   (``wq``/``wk``/``wv``, ``q_proj``/``k_proj``/``v_proj``, ``query``/``key``/``value``, ...). In a Llama that
   is ``layers.0.attn.wq``, ``wk`` and ``wv``, about 2% of the fp8 GEMM work on the ``large`` preset;
   keeping only ``wq`` would leave its siblings quantising the very same input;
5. its name matches an ``include`` pattern when any are given, and no ``exclude`` pattern;
6. its GEMM is big enough to gain (``min_dim``): fp8 adds a cast (and, for the weight gradient, a
   transpose) of each operand, memory-bound work of order ``tokens*(in+out)``, against a saving
   proportional to ``tokens*in*out``. Below ``min(in, out) = min_dim`` the casts eat the gain. The default,
   1024, is the measured crossover at a typical tokens-per-step; ``benchmarks/run.py --suite fp8_gemm``
   measures it (figures in ``docs/precision.md``).

Patterns are ``fnmatch`` globs on the module's qualified name, with ``torch.compile`` wrapper segments
(``_orig_mod``) removed, e.g. ``"model.layers.*.mlp.*"``.

Example::

    >>> import torch
    >>> from lightning_gh.demo import Llama, preset
    >>> from lightning_gh.precision import LayerFilter
    >>> with torch.device("meta"):
    ...     model = Llama(preset("large"))
    >>> plan = LayerFilter().plan(model)
    >>> plan.converted[:2]
    ['layers.0.attn.wo', 'layers.0.mlp.w1']
    >>> plan.decisions["head"].reason
    'output head'
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from torch import nn

from lightning_gh._options import check_types

__all__ = ["LayerFilter", "LayerDecision", "LayerPlan", "clean_name", "DEFAULT_MIN_DIM"]

# The crossover (min(in_features, out_features)) below which an fp8 GEMM is not faster than bf16 (see rule 6 in the
# module docs); measured by `benchmarks/run.py --suite fp8_gemm`.
DEFAULT_MIN_DIM = 1024
FP8_MULTIPLE = 16
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
# Last name segments of query/key/value projections across common LLM code bases (Llama, HF, GPT-NeoX, BERT).
_QKV_NAME = re.compile(r"^(w_?[qkv]|[qkv]|[qkv]_?proj|[qkv]_lin|query|key|value)$", re.IGNORECASE)


def clean_name(name: str) -> str:
    """A module name without the segments that wrappers (``torch.compile``, checkpointing, FSDP1) insert."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class LayerDecision:
    """What the filter decided for one ``nn.Linear``.

    Attributes:
        name: qualified module name (wrapper segments removed).
        in_features / out_features: the weight's shape.
        convert: whether the layer runs in fp8.
        reason: ``"converted"`` or why not, in words.
    """

    name: str
    in_features: int
    out_features: int
    convert: bool
    reason: str


@dataclass
class LayerPlan:
    """The filter's decisions for every ``nn.Linear`` of one model, in module order."""

    decisions: dict[str, LayerDecision] = field(default_factory=dict)

    @property
    def converted(self) -> list[str]:
        return [n for n, d in self.decisions.items() if d.convert]

    @property
    def skipped(self) -> dict[str, str]:
        return {n: d.reason for n, d in self.decisions.items() if not d.convert}

    def should_convert(self, name: str) -> bool:
        d = self.decisions.get(clean_name(name))
        return bool(d and d.convert)

    def module_filter_fn(self) -> Callable[[nn.Module, str], bool]:
        """The ``(module, fqn) -> bool`` callable torchao's ``convert_to_float8_training`` takes."""
        return lambda module, fqn: isinstance(module, nn.Linear) and self.should_convert(fqn)

    def summary(self, limit: int = 6) -> str:
        """One line for logs: how many were converted and the first few skipped layers with reasons."""
        skipped = self.skipped
        text = f"{len(self.converted)} of {len(self.decisions)} nn.Linear layers in fp8"
        if skipped:
            shown = ", ".join(f"{n} ({r})" for n, r in list(skipped.items())[:limit])
            more = f", and {len(skipped) - limit} more" if len(skipped) > limit else ""
            text += f"; kept in higher precision: {shown}{more}"
        return text

    def table(self) -> str:
        """A markdown table of every decision (for notebooks and docs)."""
        rows = ["| layer | in | out | fp8 | reason |", "|---|---:|---:|:---:|---|"]
        rows += [f"| {d.name} | {d.in_features} | {d.out_features} | {'yes' if d.convert else 'no'} | {d.reason} |"
                 for d in self.decisions.values()]
        return "\n".join(rows)


def _as_patterns(value: Any, arg: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise TypeError(f"LayerFilter({arg}={value!r}): expected a glob string or a sequence of them, got "
                        f"{type(value).__name__}.") from None
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"LayerFilter({arg}={value!r}): every pattern must be a string, got {p!r}.")
        if not p:
            raise ValueError(f"LayerFilter({arg}={value!r}): every pattern must be a non-empty string, got {p!r}.")
    return patterns


@dataclass(frozen=True)
class LayerFilter:
    """The shared rule that picks the ``nn.Linear`` layers an fp8 backend converts (see the module docs).

    Args:
        include: glob patterns on qualified module names; when given, only matching layers are candidates.
        exclude: glob patterns; matching layers stay in higher precision. Checked after ``include``.
        skip_head: keep the output head (last ``nn.Linear``, or one tied to an ``nn.Embedding``) out of fp8.
        skip_first: keep the first ``nn.Linear`` in module order (the input projection) out of fp8.
        min_dim: convert only when ``min(in_features, out_features) >= min_dim``; 0 disables the size rule.

    Example::

        LayerFilter(exclude=["*.wo"], min_dim=2048)
        lgh.precision("fp8-ao-tensorwise", exclude=["*.wo"])   # the same, through the registry
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_head: bool = True
    skip_first: bool = True
    min_dim: int = DEFAULT_MIN_DIM

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", _as_patterns(self.include, "include"))
        object.__setattr__(self, "exclude", _as_patterns(self.exclude, "exclude"))
        check_types(self)  # TypeError before the range check; see Note [Wrong type, wrong value]
        if self.min_dim < 0:
            raise ValueError(f"LayerFilter(min_dim={self.min_dim!r}): expected an int >= 0 (0 converts any size).")

    @classmethod
    def from_options(cls, value: LayerFilter | Mapping[str, Any] | None = None, **overrides: Any) -> LayerFilter:
        """Build from a ``LayerFilter``, a dict of its fields, or ``None`` (the defaults), then apply overrides.

        Raises:
            TypeError: ``value`` of another type, an unknown field, or a field of the wrong type.
            ValueError: a field with a bad value.
        """
        if value is None:
            base: dict[str, Any] = {}
        elif isinstance(value, LayerFilter):
            base = {f: getattr(value, f) for f in FIELDS}
        elif isinstance(value, Mapping):
            base = dict(value)
        else:
            raise TypeError(f"layer_filter={value!r}: expected a LayerFilter, a dict of its fields, or None, got "
                            f"{type(value).__name__}.")
        base.update({k: v for k, v in overrides.items() if v is not None})
        unknown = sorted(set(base) - set(FIELDS))
        if unknown:
            raise TypeError(f"layer_filter fields {unknown} are not known; allowed: {list(FIELDS)}.")
        return cls(**base)

    def plan(self, model: nn.Module, already_converted: Iterable[type] = ()) -> LayerPlan:
        """Decide for every ``nn.Linear`` of ``model`` (no tensor data is read: works on the meta device)."""
        converted_types = tuple(already_converted)
        linears: list[tuple[str, nn.Linear]] = []
        seen: set[int] = set()
        for raw, module in model.named_modules():
            if isinstance(module, nn.Linear) and id(module) not in seen:
                seen.add(id(module))
                linears.append((clean_name(raw), module))
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        embedding_weights = {id(m.weight) for m in embeddings}
        vocab_sizes = {m.num_embeddings for m in embeddings}
        # A head is never the model's first projection, even when it comes first in module order (HF models).
        first = _first_group([(n, m) for n, m in linears
                              if id(m.weight) not in embedding_weights and not _vocab_head(m, vocab_sizes)])
        last = linears[-1][0] if linears else None

        plan = LayerPlan()
        for name, lin in linears:
            if converted_types and isinstance(lin, converted_types):
                # Converted before setup (e.g. in configure_model, ahead of FSDP2's fully_shard): keep it.
                plan.decisions[name] = LayerDecision(name, lin.in_features, lin.out_features, True,
                                                     "converted earlier")
                continue
            reason = self._reason(name, lin, first, last, embedding_weights, vocab_sizes)
            plan.decisions[name] = LayerDecision(name, lin.in_features, lin.out_features, reason is None,
                                                 reason or "converted")
        return plan

    def _reason(self, name: str, lin: nn.Linear, first: set[str], last: str | None,
                embedding_weights: set[int], vocab_sizes: set[int]) -> str | None:
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return f"not matched by include={list(self.include)}"
        for p in self.exclude:
            if fnmatch.fnmatchcase(name, p):
                return f"excluded by pattern {p!r}"
        if self.skip_head and (name == last or id(lin.weight) in embedding_weights
                               or _vocab_head(lin, vocab_sizes)):
            return "output head"
        if self.skip_first and name in first:
            return "first linear layer (input projection)"
        for dim_name, dim in (("in_features", lin.in_features), ("out_features", lin.out_features)):
            if dim % FP8_MULTIPLE:
                return f"{dim_name}={dim} is not a multiple of {FP8_MULTIPLE}"
        smaller = min(lin.in_features, lin.out_features)
        if smaller < self.min_dim:
            return f"too small to gain: min(in, out)={smaller} < min_dim={self.min_dim}"
        return None


def _vocab_head(lin: nn.Linear, vocab_sizes: set[int]) -> bool:
    return lin.out_features in vocab_sizes and lin.out_features > lin.in_features


def _first_group(linears: list[tuple[str, nn.Linear]]) -> set[str]:
    """The first ``nn.Linear`` and the query/key/value siblings that read its input (see rule 4)."""
    if not linears:
        return set()
    name, lin = linears[0]
    parent, _, leaf = name.rpartition(".")
    group = {name}
    if _QKV_NAME.match(leaf):
        for other, olin in linears[1:]:
            o_parent, _, o_leaf = other.rpartition(".")
            if o_parent == parent and olin.in_features == lin.in_features and _QKV_NAME.match(o_leaf):
                group.add(other)
    return group


FIELDS = ("include", "exclude", "skip_head", "skip_first", "min_dim")
