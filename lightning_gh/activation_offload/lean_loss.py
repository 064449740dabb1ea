"""A memory-lean causal-LM loss for Hugging Face models: keep the low-precision logits, nothing in fp32.

Hugging Face's ``ForCausalLMLoss`` upcasts the whole ``batch x sequence x vocab`` logits to fp32 and calls
``cross_entropy``, which saves an fp32 log-softmax of the same size for the backward; at the start of the backward
that saved tensor, the gradient of the log-softmax and the gradient of the logits (both fp32) are alive together
with every activation the blocks saved. Under ``bf16-mixed`` that is six bytes per logit held, and up to twelve in
flight, where the logits themselves take two.

:func:`lean_causal_lm_loss` computes the same loss in row chunks: the forward upcasts one chunk at a time and keeps
only the logits as they came (bf16 under autocast); the backward recomputes each chunk's log-softmax and writes that
chunk's gradient into one buffer of the logits' dtype. The backward calls the ops autograd would call for
``cross_entropy`` on the fp32 chunk, directly rather than through a nested autograd pass, so each gradient element
is computed exactly as Hugging Face computes it (softmax rows are independent); the loss differs only in the order
its fp32 row losses are summed (bitwise with one chunk). The price is one more log-softmax over the logits in the
backward. On CUDA, where Triton imports, the same function runs as two fused kernels instead
(:mod:`lightning_gh.activation_offload.fused_ce`): one pass over the logits each way, no fp32 chunks, gradients
within a unit in the last place of the logits' dtype rather than bitwise; ``LGH_LEAN_LOSS_KERNEL=torch`` keeps the
chunks.

It is installed through transformers' own hook (``model.loss_function``) for a model called with ``labels=``, and,
for a ``LightningModule`` that computes its own loss from the logits, by catching that loss (Note [A loss of the
user's own over the logits]); the budget planner (:mod:`lightning_gh.activation_offload.budget`) turns it on for a
step only where its plan needs the memory, and ``ActivationOffload(lean_loss=True)`` turns it on always.

Note [A loss of the user's own over the logits]
    Most training steps compute the loss themselves: ``F.cross_entropy(logits.float().flatten(0, 1), targets)``,
    with a shift (``logits[:, :-1]``), a ``view``, a ``contiguous`` or ``torch.nn.CrossEntropyLoss`` on the way. The
    fp32 log-softmax such a call saves costs what Hugging Face's loss costs. While :class:`LeanLoss` is on, a
    forward hook on the causal LM marks the low-precision logits it returns (requiring grad) and, the first time it
    marks any, puts a ``TorchFunctionMode`` on the mode stack at the depth it had when :class:`LeanLoss` was entered
    (below any mode the step entered since, so those still exit by popping themselves; the model's forward before
    the hook runs without it). The mode follows the logits through shape-only ops and an upcast to fp32, each
    recorded as a recipe on the logits, holding every tensor weakly and with its version counter. A
    ``cross_entropy`` whose input came out of that chain, still alive and unmodified in place, requiring grad, 2-D,
    on the targets' device, without class weights or label smoothing, with ``"mean"`` or ``"sum"`` reduction and
    ``ignore_index`` as given, in fp32 (after the upcast, or under autocast, which computes it in fp32), runs as the
    lean loss on the recipe replayed over the logits instead: the same loss and, element by element, the same
    gradient for the logits (the upcast is exact, the gradient's cast back is the one autograd would apply).
    Anything else runs as written, as does a loss whose logits were already freed (``model(x).logits.float()``
    keeps no reference to them). The user's own fp32 copy is still made in the forward; only what the backward
    keeps changes. The mode is taken off the stack, wherever it is, when :class:`LeanLoss` exits, at the end of the
    step's forward.

Example::

    model = transformers.LlamaForCausalLM(config)
    with LeanLoss(find_causal_lm(model)):
        loss = model(input_ids=x, labels=x).loss     # the lean loss
    loss.backward()
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_gh import hardware
from lightning_gh.activation_offload import fused_ce

__all__ = ["CHUNK_BYTES", "LeanLoss", "find_causal_lm", "lean_causal_lm_loss", "lean_cross_entropy_args",
           "lean_loss_overhead_ms"]

# fp32 bytes of one chunk of logits: the backward holds three such temporaries at once (the chunk's log-softmax, its
# gradient and the chunk's gradient; the upcast chunk goes once its log-softmax exists); 32 MiB keeps them near a
# tenth of a GiB while each kernel still streams enough to run at memory bandwidth.
CHUNK_BYTES = 32 * 2**20
_SUM, _MEAN = torch.nn._reduction.get_enum("sum"), torch.nn._reduction.get_enum("mean")


class _LeanCrossEntropy(torch.autograd.Function):
    """Cross-entropy over rows of ``logits`` that saves ``logits`` as they are and recomputes the rest."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                divisor: torch.Tensor | None, chunk_rows: int) -> torch.Tensor:  # type: ignore[override]
        rows = logits.shape[0]
        mean = divisor is None
        ctx.ignore_index, ctx.chunk_rows, ctx.mean = ignore_index, chunk_rows, mean
        if fused_ce.kernel_for(logits) == "triton":
            targets = targets.contiguous()  # the kernels read one target a row at unit stride
            with torch.autocast(logits.device.type, enabled=False):
                lse, per_row = fused_ce.forward(logits, targets, ignore_index)
                den = (targets != ignore_index).sum().float() if mean else divisor
                loss = per_row.sum() / den
            ctx.save_for_backward(logits, targets, den, lse)  # the backward divides by the same denominator
            ctx.fused = True
            return loss
        ctx.fused = False
        with torch.autocast(logits.device.type, enabled=False):
            if rows <= chunk_rows:
                # One chunk: exactly Hugging Face's reduction, so the loss is bitwise its own.
                loss = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
                                       reduction="mean" if mean else "sum")
            else:
                loss = torch.zeros((), dtype=torch.float32, device=logits.device)
                for s in range(0, rows, chunk_rows):
                    loss += F.cross_entropy(logits[s:s + chunk_rows].float(), targets[s:s + chunk_rows],
                                            ignore_index=ignore_index, reduction="sum")
                if mean:
                    loss = loss / (targets != ignore_index).sum().float()
            if not mean:
                loss = loss / divisor
        ctx.save_for_backward(logits, targets, divisor if divisor is not None else torch.empty(0))
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.fused:
            logits, targets, den, lse = ctx.saved_tensors
            with torch.autocast(logits.device.type, enabled=False):
                scale = (grad.float() / den).reshape(())
                return fused_ce.backward(logits, targets, lse, scale, ctx.ignore_index), None, None, None, None
        logits, targets, divisor = ctx.saved_tensors
        rows, step, ignore = logits.shape[0], ctx.chunk_rows, ctx.ignore_index
        count = (targets != ignore).sum().float()  # nll_loss's total weight: the targets that count
        # The gradient each chunk's cross-entropy receives, as autograd would hand it to nll_loss: for a mean over
        # several chunks (each summed), nll_loss's own mean divides the incoming gradient by the count; the same
        # single division here keeps every element bitwise equal.
        if not ctx.mean:
            grad, reduction = grad / divisor, _SUM
        elif rows <= step:
            reduction = _MEAN
        else:
            grad, reduction = grad / count, _SUM
        out = torch.empty_like(logits)
        # The ops autograd runs for cross_entropy's backward, called directly: a nested autograd.grad per chunk costs
        # the host several times as much, time an idle GPU waits for at the start of the backward.
        for s in range(0, rows, step):
            logp = torch._log_softmax(logits[s:s + step].float(), 1, False)
            g = torch.ops.aten.nll_loss_backward(grad, logp, targets[s:s + step], None, reduction, ignore, count)
            out[s:s + step].copy_(torch._log_softmax_backward_data(g, logp, 1, torch.float32))  # the .float()'s cast
            del logp, g
        return out, None, None, None, None


def lean_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``: shift, flatten, fp32 cross-entropy, mean or sum divided
    by ``num_items_in_batch``) without fp32 copies of the logits between forward and backward.

    Args:
        logits: ``(..., vocab_size)`` as the head returns them (bf16 under ``bf16-mixed``); kept as they are.
        labels: token ids, shifted here unless ``shift_labels`` is given (as Hugging Face does).
        vocab_size: the logits' last dimension.
        num_items_in_batch: divide the summed loss by this (gradient accumulation); ``None``: the mean.
        ignore_index: targets with this id count for nothing.
        shift_labels: already shifted targets.
        chunk_bytes: fp32 bytes per chunk of rows (default :data:`CHUNK_BYTES`).
        kwargs: what Hugging Face passes on to its losses; unused, as there.

    Example::

        model.loss_function = lean_causal_lm_loss     # what LeanLoss does for one forward (noting the shape)
    """
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    flat = logits.reshape(-1, vocab_size)
    targets = shift_labels.reshape(-1).to(flat.device)
    chunk = chunk_bytes if chunk_bytes is not None else CHUNK_BYTES
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} must be an int > 0 (fp32 bytes of logits per chunk).")
    rows = max(1, chunk // (4 * vocab_size))
    divisor = None
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch, device=flat.device)
    return _LeanCrossEntropy.apply(flat, targets, ignore_index, divisor, rows)


_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
                "label_smoothing": 0.0}


def lean_cross_entropy_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """``(ignore_index, reduction)`` when a ``F.cross_entropy(*args, **kwargs)`` call is one the lean loss computes
    alike (Note [A loss of the user's own over the logits]), else ``None``: a 2-D input of class scores with 1-D
    int64 targets (what ``cross_entropy`` takes), no class weights, no label smoothing, reduction ``"mean"`` or ``"sum"``, no legacy
    ``size_average``/``reduce``.

    Example::

        >>> x, t = torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)
        >>> lean_cross_entropy_args((x, t), {}), lean_cross_entropy_args((x, t), {"reduction": "sum"})
        ((-100, 'mean'), (-100, 'sum'))
        >>> lean_cross_entropy_args((x, t), {"label_smoothing": 0.1}), lean_cross_entropy_args((x, t, None, None, 7), {})
        (None, (7, 'mean'))
    """
    if len(args) > len(_CE_PARAMS) or any(k not in _CE_PARAMS for k in kwargs):
        return None
    bound = dict(_CE_DEFAULTS, **dict(zip(_CE_PARAMS, args)), **kwargs)
    x, t = bound.get("input"), bound.get("target")
    if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor) or x.dim() != 2 or t.dim() != 1 \
            or t.dtype != torch.int64 or t.shape[0] != x.shape[0]:
        return None
    if bound["weight"] is not None or bound["size_average"] is not None or bound["reduce"] is not None \
            or bound["label_smoothing"] != 0.0 or bound["reduction"] not in ("mean", "sum"):
        return None
    ignore = bound["ignore_index"]
    return (int(ignore), bound["reduction"]) if isinstance(ignore, int) and not isinstance(ignore, bool) else None


#: Ops that only reshape or select (their recipe replays on the low-precision logits); and the upcasts.
_SHAPE_OPS = frozenset({torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten,
                        torch.Tensor.contiguous, torch.Tensor.squeeze, torch.Tensor.unsqueeze, torch.flatten,
                        torch.reshape, torch.squeeze, torch.unsqueeze})
_CAST_OPS = frozenset({torch.Tensor.float, torch.Tensor.to})
_LOW = (torch.bfloat16, torch.float16)


def _insert_mode(mode: TorchFunctionMode, depth: int) -> None:
    """Put ``mode`` on the torch-function mode stack at ``depth`` (the modes above it stay above it), so that a mode
    entered later, inside a ``with``, still exits by popping itself."""
    above = [torch.overrides._pop_mode() for _ in range(max(0, torch._C._len_torch_function_stack() - depth))]
    torch.overrides._push_mode(mode)
    for m in reversed(above):
        torch.overrides._push_mode(m)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the torch-function mode stack wherever it is (nothing if it is not there)."""
    n = torch._C._len_torch_function_stack()
    at = next((i for i in range(n) if torch._C._get_function_stack_at(i) is mode), None)
    if at is None:
        return
    above = [torch.overrides._pop_mode() for _ in range(n - 1 - at)]
    torch.overrides._pop_mode()
    for m in reversed(above):
        torch.overrides._push_mode(m)


class _OwnLossMode(TorchFunctionMode):
    """Follows the logits :class:`LeanLoss` marked and runs a matching ``cross_entropy`` as the lean loss (Note [A
    loss of the user's own over the logits])."""

    def __init__(self, lean: LeanLoss) -> None:
        super().__init__()
        self.lean = lean
        # tensor id -> (weak refs to it and to the low-precision logits, their versions when noted, the recipe:
        # (op, args after the tensor, kwargs)); weak, so that a noted tensor the user drops is freed as it would be
        self.derived: dict[int, tuple[weakref.ref, weakref.ref, int, int, tuple[tuple[Callable, tuple, dict], ...]]] = {}

    def mark(self, logits: torch.Tensor) -> bool:
        """Follow ``logits`` (low-precision, requiring grad); whether they were."""
        if logits.dtype not in _LOW or not logits.requires_grad:
            return False
        self._note(logits, logits, ())
        return True

    def _note(self, t: torch.Tensor, root: torch.Tensor, recipe: tuple) -> None:
        self.derived[id(t)] = (weakref.ref(t), weakref.ref(root), t._version, root._version, recipe)

    def _source(self, t: Any) -> tuple[torch.Tensor, tuple] | None:
        """The logits ``t`` came from and the recipe, if ``t`` was noted, both are alive and neither was modified in
        place since (an in-place change of the user's copy would not reach the logits)."""
        e = self.derived.get(id(t)) if isinstance(t, torch.Tensor) else None
        if e is None or e[0]() is not t:
            return None
        root = e[1]()
        if root is None or t._version != e[2] or root._version != e[3]:
            return None
        return root, e[4]

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy and torch.is_grad_enabled():
            out = self._lean_cross_entropy(args, kwargs)
            if out is not None:
                return out
        out = func(*args, **kwargs)
        src = self._source(args[0]) if args else None
        if src is not None and isinstance(out, torch.Tensor) and out is not args[0]:
            root, recipe = src
            if func in _SHAPE_OPS:
                self._note(out, root, recipe + ((func, args[1:], kwargs),))
            elif func in _CAST_OPS and out.dtype == torch.float32 and args[0].dtype in _LOW \
                    and out.device == args[0].device and out.shape == args[0].shape:
                self._note(out, root, recipe)  # the exact upcast: the recipe stays on the low-precision logits
        return out

    def _lean_cross_entropy(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        how = lean_cross_entropy_args(args, kwargs)
        x = args[0] if args else kwargs.get("input")
        src = self._source(x) if how is not None and x.requires_grad else None
        if src is None or (x.dtype in _LOW and not torch.is_autocast_enabled(x.device.type)):
            return None  # low-precision scores outside autocast: cross_entropy computes in their precision
        target = args[1] if len(args) > 1 else kwargs["target"]
        if target.device != x.device:
            return None  # cross_entropy raises here; so should the user's call
        root, recipe = src
        low = root
        for op, rest, kw in recipe:
            low = op(low, *rest, **kw)
        if not isinstance(low, torch.Tensor) or low.shape != x.shape or low.dtype not in _LOW:
            return None
        ignore, reduction = how
        vocab = low.shape[1]
        self.lean.last_logits = (low.shape[0], vocab, low.dtype, low.device)
        divisor = None if reduction == "mean" else torch.ones((), dtype=torch.float32, device=low.device)
        return _LeanCrossEntropy.apply(low, target, ignore, divisor, max(1, CHUNK_BYTES // (4 * vocab)))


def lean_loss_overhead_ms(rows: int, vocab: int, dtype: torch.dtype, device: torch.device,
                          reps: int = 3) -> float | None:
    """How much longer the lean loss's forward+backward takes than Hugging Face's (fp32 upcast + ``cross_entropy``)
    on ``rows x vocab`` logits, timed alone on ``device``; negative where it is faster; ``None`` off CUDA.

    The budget planner charges this to the lean plan. Read from a whole measuring step instead, the difference sits
    inside the step's own noise, and the planner would pass the lean loss over where it is the faster plan
    (docs/activation_offload.md).

    Args:
        rows, vocab: the flattened logits' shape (``LeanLoss.last_logits``).
        dtype, device: the logits' dtype and device.
        reps: timed repetitions of each; the median, after one untimed run of each.

    Example::

        extra = lean_loss_overhead_ms(8192, 32000, torch.bfloat16, torch.device("cuda"))
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, dtype=dtype, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=device, generator=g)
    chunk_rows = max(1, CHUNK_BYTES // (4 * vocab))

    def plain() -> None:
        torch.autograd.grad(F.cross_entropy(logits.float(), targets), logits)

    def lean() -> None:
        torch.autograd.grad(_LeanCrossEntropy.apply(logits, targets, -100, None, chunk_rows), logits)

    with torch.autocast(device.type, enabled=False):
        return hardware.median_cuda_ms(lean, reps) - hardware.median_cuda_ms(plain, reps)


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM inside ``model`` whose loss :func:`lean_causal_lm_loss` can stand in for.

    It is the first module with transformers' ``loss_function`` hook whose loss type is ``"ForCausalLM"`` and that
    has no loss function of the user's own (``model.loss_function = ...``), or ``None``.
    """
    for m in model.modules():
        cls = type(m)
        if not isinstance(getattr(cls, "loss_function", None), property) or not hasattr(m, "config"):
            continue
        if "_loss_function" in vars(m) or getattr(m, "loss_type", None) != "ForCausalLM":
            continue
        return m
    return None


class LeanLoss:
    """Install :func:`lean_causal_lm_loss` as ``causal_lm.loss_function`` for the forwards inside the ``with``.

    The backward needs nothing installed: the loss keeps what it needs in the autograd graph.

    Args:
        causal_lm: a module :func:`find_causal_lm` returned.

    Example::

        lean = LeanLoss(find_causal_lm(model))
        with lean:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        if not isinstance(getattr(type(causal_lm), "loss_function", None), property):
            raise TypeError(f"causal_lm={type(causal_lm).__name__} has no transformers loss_function hook; pass what "
                            "find_causal_lm() returned (a transformers *ForCausalLM model).")
        self.causal_lm = causal_lm
        self._on = False
        self._hook: Any = None  # the forward hook that marks the logits for a loss of the user's own
        self._mode: _OwnLossMode | None = None  # pushed by that hook once it marked logits, removed on exit
        self._depth = 0  # the torch-function mode stack's depth on entry: where that hook puts the mode
        # (rows, vocab, dtype, device) of the logits the last lean forward saw: the budget planner times the lean
        # loss against Hugging Face's on that shape in isolation (:func:`lean_loss_overhead_ms`)
        self.last_logits: tuple[int, int, torch.dtype, torch.device] | None = None

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        """:func:`lean_causal_lm_loss`, noting the logits' shape; what ``causal_lm.loss_function`` is while on."""
        self.last_logits = (logits.numel() // vocab_size, vocab_size, logits.dtype, logits.device)
        return lean_causal_lm_loss(logits, labels, vocab_size, **kwargs)

    def __enter__(self) -> LeanLoss:
        if not self._on:
            self.causal_lm.loss_function = self.loss
            self._hook = self.causal_lm.register_forward_hook(self._mark_logits)
            self._depth = torch._C._len_torch_function_stack()
            self._on = True
        return self

    def _mark_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        """After the causal LM's forward: mark its logits and follow them into the user's loss (Note [A loss of the
        user's own over the logits])."""
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            logits = output[0]
        if not isinstance(logits, torch.Tensor) or getattr(output, "loss", None) is not None:
            return  # a loss computed with labels= went through loss_function already
        mode = self._mode or _OwnLossMode(self)
        if mode.mark(logits) and self._mode is None:
            self._mode = mode
            _insert_mode(mode, self._depth)  # below any mode the step entered since: theirs exit first

    def __exit__(self, *exc: Any) -> bool:
        if self._on:
            # Back to transformers' lookup by loss type: the model had no loss function of its own.
            vars(self.causal_lm).pop("_loss_function", None)
            self._hook.remove()
            self._hook, self._on = None, False
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _remove_mode(mode)
        return False
