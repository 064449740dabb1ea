"""Every option of activation offload, written and validated once: :class:`ActivationOffloadOptions`.

The engine (:class:`~lightning_gh.activation_offload.engine.ActivationOffloader`), its plain-PyTorch entry point
(:func:`~lightning_gh.activation_offload.engine.offload_activations`) and the Lightning callback
(:class:`~lightning_gh.activation_offload.callback.ActivationOffload`) all take the same frozen dataclass, or the
same keyword arguments, which build it. Bad values fail at construction, naming the argument, the value and
what is allowed.

Example::

    >>> from lightning_gh.activation_offload import ActivationOffloadOptions
    >>> opts = ActivationOffloadOptions(policy="all", min_tensor_bytes=1024, backend="host-copy")
    >>> opts.policy, opts.skip_last_blocks
    ('all', 1)
    >>> ActivationOffloadOptions(margin=-1)
    Traceback (most recent call last):
    ...
    ValueError: margin=-1 must be a number >= 0 (0.25: transfers planned 25% slower than measured).
    >>> ActivationOffloadOptions(margin="0.5")
    Traceback (most recent call last):
    ...
    TypeError: ActivationOffloadOptions(margin='0.5'): expected a float, got str.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from torch import nn

from lightning_gh._options import check_types, resolve
from lightning_gh.activation_offload.budget import parse_budget
from lightning_gh.activation_offload.recompute import RECOMPUTE_MODES

__all__ = ["BACKENDS", "POLICIES", "ActivationOffloadOptions"]

MIB = 2**20
BUDGET_OFFLOAD = "None (decided beside the optimizer), True, 'last' or False"
POLICIES = "'auto', 'all', or an int K >= 0 (offload the first K transformer blocks)"
BACKENDS = ("auto", "cuda", "host-copy")

Blocks = Union[str, Sequence[nn.Module], None]


@dataclass(frozen=True)
class ActivationOffloadOptions:
    """How activation offload chooses, moves and bounds what it offloads.

    Attributes:
        policy: ``"auto"`` measures the first steps (per-block forward/backward time and saved bytes) and the
            link bandwidth, then offloads the blocks whose copies hide under compute with ``margin`` to spare,
            and logs the decision with its predicted memory saving; ``"all"`` offloads every block but the
            last ``skip_last_blocks`` (memory first: the step may wait on the link); an int ``K`` offloads the
            first ``K`` blocks.
        blocks: how to find the transformer blocks (see :func:`~lightning_gh.activation_offload.blocks.find_blocks`):
            ``None`` takes the model's largest ``nn.ModuleList`` of one module type; a submodule name such as
            ``"model.layers"``; or a sequence of modules (kept as a tuple).
        min_tensor_bytes: saved tensors (storages) smaller than this stay on the device: a copy's fixed cost
            outweighs them.
        skip_last_blocks: blocks at the end never offloaded: the backward needs their activations first.
        prefetch_blocks: fixed policies reload block ``i`` when block ``i + prefetch_blocks``'s backward starts.
        max_inflight_blocks: fixed policies make the compute stream wait for block ``i``'s copies when block
            ``i + max_inflight_blocks`` starts (bounds the GPU memory held by unfinished copies); ``None``
            waits only at the forward's end.
        margin: ``"auto"`` plans as if transfers took ``1 + margin`` times their measured time.
        profile_steps: ``"auto"`` measures this many forward/backward passes, after one warm-up pass.
        host_memory_fraction: never hold more than this share of the host's available memory (``MemAvailable``
            plus what the pool already holds); a clear :class:`~lightning_gh._host.HostMemoryError` before
            going over.
        backend: ``"auto"`` (CUDA when the model is on a GPU; otherwise warn once and do nothing), ``"cuda"``,
            or ``"host-copy"`` (synchronous copies through a host buffer on any device: tests).
        bandwidth_gbps: link bandwidth for ``"auto"`` in GB/s, one number or ``(d2h, h2d)``; ``None`` measures
            it (:func:`lightning_gh.hardware.link_bandwidth`; a memcpy in host-copy mode).
        record_timeline: keep the engine's memory events of the latest step (``engine.timeline``).
        dedupe_casts: keep one copy of repeated casts of one tensor within a block (autocast casts a norm's
            output to bf16 once per consuming matmul: q, k and v each save their own identical copy).
        recompute_param_casts: do not keep autocast's low-precision copies of the weights for the backward;
            cast the parameter again when the backward needs it (bitwise the same; a parameter changed in
            place between forward and backward is an error). Frees about 2 bytes per parameter during the
            backward for one extra read of the weights.
        recompute: ``None`` (blocks keep what they save), ``"norm-act"``, ``"selective"`` or ``"full"``: the
            blocks the plan does not offload recompute part of their saved activations in the backward.
            ``"norm-act"`` checkpoints only their normalisation and gated-activation modules (no dispatch mode;
            see :func:`~lightning_gh.activation_offload.recompute.is_norm_act_module`); ``"selective"`` keeps the
            outputs of matmuls and attention and recomputes the memory-bound rest (norms, rotary, SiLU,
            products, casts) through a dispatch mode (its cost is measured in docs/activation_offload.md);
            ``"full"`` keeps only the block inputs. With ``"auto"``: offload what the link hides, recompute in
            the other blocks, and forecast the saving again from the first recomputing forward's measurement.
            Refused for blocks that are already checkpointed, compiled, or run Transformer Engine layers.
        budget: the activation memory to fit in, instead of a technique (see
            :mod:`lightning_gh.activation_offload.budget`): a size string (``"6GiB"``, ``"512MiB"``, ``"6GB"``),
            an int of bytes, or a float in ``(0, 1]``, a fraction of the activation memory the plain step needs
            (``0.5``: half), measured by the engine in one step where it changes nothing (no cast deduplication, no
            weight re-cast, nothing moved). Activation memory is the step's peak allocation minus the model state
            (weights, their gradients, optimizer state). The first steps measure each block under every way of
            saving memory (keep, offload, ``"norm-act"``, ``"selective"`` and ``"full"`` recompute) and a planner
            picks per block the mix that fits at the lowest predicted step time. A size never runs the plain step:
            it measures from the floor (every block at its least memory) and one block in each other mode, then
            relaxes from the floor towards the plan one block per measured step while the prediction fits. A
            fraction measures the plain step (refused, naming the size form, where one measured block predicts it
            would not fit the device) and up to two correction rounds adjust the plan to the measured peak. A budget
            below the floor is a ``ValueError`` naming the floor, raised before any step above the floor. Needs ``policy="auto"`` (the default) and ``recompute=None``:
            the planner chooses both. On a ``torch.compile``'d model it sets the compiler's own
            ``activation_memory_budget`` instead (a fraction is then handed to it as is).
        lean_loss: the loss of a Hugging Face causal LM (its ``loss_function``, or a ``cross_entropy`` of the
            user's own over its logits) computed without fp32 copies of the logits between forward and backward
            (:mod:`lightning_gh.activation_offload.lean_loss`: the logits kept as they come, the fp32
            cross-entropy run and recomputed in row chunks; gradients bitwise, the loss within the order of an
            fp32 sum). ``None``: the budget planner weighs it as one more way to save memory
            (measured in one step) and turns it on only where its plan needs it; off without a budget. ``True``:
            on in every training forward (an error when the model holds no Hugging Face causal LM). ``False``:
            never.
        budget_offload: what a budget's plan may offload. ``True``: whatever is fastest; ``"last"``: nothing
            where recomputing alone fits the budget, else the least offload that fits; ``False``: never (the floor
            is then full recompute with the block inputs kept on the device; the measuring steps that sample one
            block's modes still offload that block). ``None``: ``"last"`` beside an optimizer in the same process that updates
            parameters on the host CPU (SuperOffload's, which say so through ``updates_on_host``), whose update
            streams through host memory every step and slows down beside activation copies into it (said in one
            line); else ``True``.
        causal_sdpa: in budget mode on a ``torch.compile``'d model, keep SDPA's causal path in the Hugging Face
            decoders it holds (:func:`lightning_gh._hf.keep_causal_sdpa`): under ``torch.compile`` some
            transformers releases build an explicit causal mask and repeat the KV heads, which costs attention
            time and saved memory; calls with a mask, positions or a cache keep transformers' own path. ``False``
            leaves the model as it is.

    Example::

        opts = ActivationOffloadOptions(policy="auto", recompute="selective")
        trainer = L.Trainer(callbacks=[ActivationOffload(options=opts)])
    """

    policy: int | str = "auto"  # int first: a command line "3" is the int 3
    blocks: Blocks = None
    min_tensor_bytes: int = MIB
    skip_last_blocks: int = 1
    prefetch_blocks: int = 1
    max_inflight_blocks: int | None = 2
    margin: float = 0.25
    profile_steps: int = 2
    host_memory_fraction: float = 0.5
    backend: str = "auto"
    bandwidth_gbps: float | tuple[float, float] | None = None
    record_timeline: bool = False
    dedupe_casts: bool = True
    recompute_param_casts: bool = True
    recompute: str | None = None
    budget: str | int | float | None = None
    lean_loss: bool | None = None
    budget_offload: bool | str | None = None
    causal_sdpa: bool = True

    def __post_init__(self) -> None:
        # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        check_types(self, skip=("blocks",), allowed={"policy": POLICIES,
                                                     "lean_loss": "None (the budget planner decides), True or False",
                                                     "budget_offload": BUDGET_OFFLOAD})
        policy = self.policy
        if not (policy in ("auto", "all") or (isinstance(policy, int) and policy >= 0)):
            raise ValueError(f"policy={policy!r} is not valid; use {POLICIES}.")
        self._check_blocks()
        for name, lo in (("min_tensor_bytes", 0), ("skip_last_blocks", 0), ("prefetch_blocks", 1),
                         ("profile_steps", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= {lo}.")
        if self.max_inflight_blocks is not None and self.max_inflight_blocks < 1:
            raise ValueError(f"max_inflight_blocks={self.max_inflight_blocks!r} must be an int >= 1 or None.")
        if not self.margin >= 0:
            raise ValueError(f"margin={self.margin!r} must be a number >= 0 (0.25: transfers planned 25% slower than "
                             "measured).")
        if not 0 < self.host_memory_fraction <= 1:
            raise ValueError(f"host_memory_fraction={self.host_memory_fraction!r} must be in (0, 1].")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not valid; use one of {BACKENDS}.")
        rc = self.recompute
        if rc is not None and rc not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={rc!r} is not valid; use None (keep what the blocks save), 'norm-act' "
                             "(recompute the norm and gated-activation modules), 'selective' (recompute all but "
                             "matmul and attention outputs) or 'full' (keep only the block inputs).")
        if self.budget is not None:
            parse_budget(self.budget)  # raises, naming the value and the accepted forms
            if self.policy != "auto" or self.recompute is not None:
                raise ValueError(f"budget={self.budget!r} chooses offload and recompute per block itself; it cannot be "
                                 f"combined with policy={self.policy!r} and recompute={self.recompute!r}. Pass "
                                 "budget alone (policy='auto', recompute=None), or a policy without a budget.")
        if isinstance(self.budget_offload, str) and self.budget_offload != "last":
            raise ValueError(f"budget_offload={self.budget_offload!r} is not valid; use {BUDGET_OFFLOAD}.")
        if self.budget_offload is not None and self.budget is None:
            raise ValueError(f"budget_offload={self.budget_offload!r} decides whether a budget's plan may offload; "
                             "there is no budget. Pass budget=... with it, or leave budget_offload at None.")
        bw = self.bandwidth_gbps
        if bw is not None:
            vals = bw if isinstance(bw, (tuple, list)) else (bw,)
            if len(vals) not in (1, 2) or not all(v > 0 for v in vals):
                raise ValueError(f"bandwidth_gbps={bw!r} must be a positive number or a (d2h, h2d) pair of them.")
            if isinstance(bw, list):
                object.__setattr__(self, "bandwidth_gbps", tuple(bw))

    def _check_blocks(self) -> None:
        blocks = self.blocks
        if blocks is None or isinstance(blocks, str):
            return
        if isinstance(blocks, nn.Module):
            raise ValueError(f"blocks={type(blocks).__name__} must be a submodule name or a list of modules, "
                             "not a single module.")
        if not isinstance(blocks, Sequence):
            raise TypeError(f"blocks={blocks!r} must be None (find the model's largest ModuleList), a submodule "
                            "name such as 'model.layers', or a list of modules; got a "
                            f"{type(blocks).__name__}.")
        mods = tuple(blocks)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise ValueError(f"blocks={blocks!r} must be a module name or a non-empty sequence of nn.Module.")
        object.__setattr__(self, "blocks", mods)

    @classmethod
    def build(cls, options: ActivationOffloadOptions | None, where: str, **given: Any) -> ActivationOffloadOptions:
        """``options``, or the options ``given`` as keyword arguments; both at once is an error.

        Args:
            options: what the caller passed as ``options=``, or ``None``.
            where: the caller, for the error (``"ActivationOffload"``).
            given: the option keyword arguments; for a caller whose signature lists them with their defaults,
                pass all of them: values equal to the default count as not given.
        """
        return resolve(cls, options, where, **given)
