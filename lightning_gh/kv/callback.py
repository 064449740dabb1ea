"""``GenerationCallback``: generate from fixed prompts during validation, with the offloaded KV cache.

Where users of a training library meet a KV cache: samples and long-context evals at validation time. Every
``every_n_steps`` optimizer steps, at the end of a validation epoch, the prompts are decoded greedily; global rank 0
logs ``gen/tokens_per_s``, ``gen/seconds``, ``gen/new_tokens`` and the cache's GPU share to every logger, and
appends the token ids (and texts, with a tokenizer) to ``generations.jsonl`` in the logger's folder. The cache is
built once and ``reset()`` before each generation, so its pinned host pool is allocated and page-locked once per fit.

Which ranks generate is decided by :func:`ranks_that_generate` from the strategy. Note [Generation under sharded
parameters]: where every rank holds whole parameters (one device, DDP), only rank 0 generates; its forward runs
outside DDP's wrapper and has no collectives, so the other ranks wait for it at the next synchronising step. Where
the parameters are sharded (``ModelParallelStrategy``, i.e. FSDP2), a forward needs all-gathers that every rank must
join, so every rank generates the same prompts in lock step: each FSDP2 module is unsharded before the first token
and resharded after the last (a module whose forward ``generate`` never calls, such as the root, still finds whole
parameters; the others gather and free around each call, as in training), transformers' ``generate`` gets
``synced_gpus=True``, and only rank 0 records, logs and writes. ``FSDPStrategy`` (FSDP1) and
DeepSpeed stage 3 are refused at setup: their gathers run only inside the wrapped module's forward, which
``generate`` does not call.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import time
from typing import Any, Callable, Iterator, Sequence

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info

from lightning_gh import compat
from lightning_gh._options import check_type, resolve
from lightning_gh.kv.cache import OffloadedKVCache
from lightning_gh.kv.options import KVOffloadOptions
from lightning_gh.kv.spec import cache_kwarg, find_generator, vocab_size

__all__ = ["GenerationCallback", "ranks_that_generate"]

CACHES = ("offloaded", "dynamic")


def ranks_that_generate(strategy: str, zero_stage: int | None = None) -> str:
    """``"rank zero"`` or ``"every rank"`` for a strategy class name; a ``MisconfigurationException`` for a
    strategy under which generation cannot run. See Note [Generation under sharded parameters].

    Args:
        strategy: the class name of ``trainer.strategy`` (or of the Lightning strategy it derives from).
        zero_stage: DeepSpeed's ZeRO stage (only read for ``"DeepSpeedStrategy"``).

    Example::

        >>> ranks_that_generate("DDPStrategy"), ranks_that_generate("ModelParallelStrategy")
        ('rank zero', 'every rank')
    """
    if strategy == "ModelParallelStrategy":
        return "every rank"
    if strategy == "FSDPStrategy" or (strategy == "DeepSpeedStrategy" and zero_stage == 3):
        what = "FSDPStrategy (FSDP1)" if strategy == "FSDPStrategy" else "DeepSpeed ZeRO stage 3"
        raise MisconfigurationException(
            f"GenerationCallback cannot generate under {what}: the parameters are sharded and gathered only inside "
            "the wrapped module's forward, which generate() does not call, so generation would fail or hang. "
            "Allowed: ModelParallelStrategy (FSDP2; every rank then generates the same prompts in lock step), DDP, "
            "DeepSpeed stage 1 or 2, or a single device.")
    return "rank zero"


def _strategy_name(strategy: Any) -> str:
    known = ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")
    return next((c.__name__ for c in type(strategy).__mro__ if c.__name__ in known), type(strategy).__name__)


@contextlib.contextmanager
def _gathered(module: torch.nn.Module) -> Iterator[None]:
    """Every FSDP2 module of ``module`` unsharded inside the block (a collective: every rank must enter it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2: nothing can be sharded by it
        yield
        return
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()


def _as_ids(prompts: Any) -> torch.Tensor | None:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts.unsqueeze(0)
        if prompts.dim() != 2 or prompts.numel() == 0 or prompts.is_floating_point():
            raise ValueError(f"prompts must be token ids of shape (batch, length); got {prompts.dtype} "
                             f"{tuple(prompts.shape)}.")
        ids = prompts.long()
        _check_ids(ids, None)
        return ids
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        return None
    if all(isinstance(p, Sequence) and not isinstance(p, str) for p in prompts):
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(f"prompts as lists of token ids must share one non-zero length; got lengths "
                             f"{sorted(lengths)}. Pass strings with a tokenizer for prompts of different lengths.")
        bad = [x for p in prompts for x in p if not isinstance(x, numbers.Integral) or isinstance(x, bool)]
        if bad:
            bad = bad[0]
            raise ValueError(f"prompts must hold integer token ids; got {bad!r} ({type(bad).__name__}). Allowed: "
                             "ints (a float id would be truncated).")
        ids = torch.tensor([[int(x) for x in p] for p in prompts], dtype=torch.long)
        _check_ids(ids, None)
        return ids
    return None


def _check_ids(ids: torch.Tensor, vocab: int | None) -> None:
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(f"prompts hold the token id {low}; allowed: ids >= 0.")
    if vocab is not None and high >= vocab:
        raise ValueError(f"prompts hold the token id {high}, outside the model's vocabulary of {vocab}; allowed: "
                         f"ids in 0..{vocab - 1}.")


def _what_happened(cache: OffloadedKVCache | None, device: torch.device) -> str:
    """One phrase for the log line and the record: where the keys and values really were."""
    if cache is None:
        return "the model's default cache"
    plan = cache.plan
    if plan is None:
        return "OffloadedKVCache, not used"
    if plan.offloaded:
        host = "pinned host memory" if plan.backend == "cuda" else "host memory"
        return (f"OffloadedKVCache: {len(plan.offloaded)}/{plan.num_layers} layers offloaded to {host}, "
                f"{len(plan.resident)} resident on {device}")
    if device.type == "cuda":
        return f"OffloadedKVCache: all {plan.num_layers} layers resident on the GPU, nothing offloaded"
    return f"OffloadedKVCache as a plain cache on {device.type} (no GPU): nothing offloaded"


class GenerationCallback(L.Callback):
    """Generate from ``prompts`` at the end of validation every ``every_n_steps`` optimizer steps, with
    :class:`~lightning_gh.kv.OffloadedKVCache`, and log speed and samples (rank 0; under sharded parameters every
    rank generates, see Note [Generation under sharded parameters]).

    Args:
        prompts: token ids ``(batch, length)`` (tensor or equal-length lists), or strings with ``tokenizer``.
        every_n_steps: generate when at least this many optimizer steps passed since the last generation (the
            first validation after training started always generates; the sanity check never does).
        max_new_tokens: tokens to generate per prompt.
        cache: ``"offloaded"`` (:class:`~lightning_gh.kv.OffloadedKVCache`, sized to prompt + new tokens) or
            ``"dynamic"`` (the model's default cache; the reference to compare against).
        options: the offloaded cache's options, see :class:`~lightning_gh.kv.KVOffloadOptions`; ``max_length``
            defaults here to prompt length + ``max_new_tokens``.
        tokenizer: turns string prompts into ids (padded, with an attention mask) and the new ids into texts.
        generate_fn: ``fn(pl_module, input_ids, cache, max_new_tokens) -> ids`` for models whose ``generate`` is
            neither transformers' nor ``generate(input_ids, max_new_tokens, past_key_values)``.
        filename: the JSON-lines file of samples, in the first logger's ``log_dir`` (else ``trainer.default_root_dir``);
            ``None`` writes none. Not ``""``.
        prefill_chunk_size: passed to transformers' ``generate``: the prompt runs through the model this many
            tokens at a time, so prefill activations are bounded by the chunk instead of the prompt (long prompts
            under a memory cap). ``None`` prefills in one forward. Only for transformers models.

    Example::

        prompts = torch.randint(32000, (8, 1024))
        trainer = L.Trainer(val_check_interval=500, callbacks=[
            lgh.GenerationCallback(prompts, every_n_steps=500, max_new_tokens=64,
                                   options=lgh.KVOffloadOptions(resident_layers="auto"))])
        trainer.fit(model, datamodule)   # metrics: gen/tokens_per_s, ...; samples: <log_dir>/generations.jsonl
    """

    lgh_part = "GenerationCallback"

    def __init__(
        self,
        prompts: torch.Tensor | Sequence[Sequence[int]] | Sequence[str],
        every_n_steps: int = 100,
        max_new_tokens: int = 32,
        *,
        cache: str = "offloaded",
        options: KVOffloadOptions | None = None,
        tokenizer: Any = None,
        generate_fn: Callable[..., torch.Tensor] | None = None,
        filename: str | None = "generations.jsonl",
        prefill_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        # TypeError first; see Note [Wrong type, wrong value] in lightning_gh._options
        for name, value, annotation in (("every_n_steps", every_n_steps, int), ("max_new_tokens", max_new_tokens, int),
                                        ("cache", cache, str), ("prefill_chunk_size", prefill_chunk_size, int | None),
                                        ("filename", filename, str | None)):
            check_type("GenerationCallback", name, value, annotation)
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int >= 1.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1.")
        if cache not in CACHES:
            raise ValueError(f"cache={cache!r} is not known; choose one of {list(CACHES)}.")
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size={prefill_chunk_size!r} must be None or an int >= 1 (prompt tokens "
                             "per prefill forward).")
        ids = _as_ids(prompts)
        if ids is None:
            if not (isinstance(prompts, Sequence) and prompts and all(isinstance(p, str) for p in prompts)):
                raise ValueError("prompts must be token ids (batch, length), equal-length lists of ids, or a non-empty "
                                 f"list of strings; got {type(prompts).__name__}.")
            if tokenizer is None:
                raise ValueError("prompts are strings, so a tokenizer is needed (tokenizer=None).")
        if filename is not None and (not filename.strip() or not os.path.basename(filename)):
            raise ValueError(f"filename={filename!r} must name a file (e.g. 'generations.jsonl'), or be None to "
                             "write no file.")
        self.prompts = prompts
        self.every_n_steps = every_n_steps
        self.max_new_tokens = max_new_tokens
        self.cache = cache
        self.options = resolve(KVOffloadOptions, options, "GenerationCallback")
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.filename = filename
        self.prefill_chunk_size = prefill_chunk_size
        self._ids = ids
        self._last_step: int | None = None
        self._cache_obj: OffloadedKVCache | None = None
        self._cache_key: tuple[Any, ...] | None = None
        self._ranks = "rank zero"
        self.history: list[dict[str, Any]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        compat.check(trainer, self.lgh_part)
        strategy = trainer.strategy
        zero_stage = 3 if getattr(strategy, "zero_stage_3", False) else None
        self._ranks = ranks_that_generate(_strategy_name(strategy), zero_stage)
        if self._ids is not None:
            _check_ids(self._ids, vocab_size(pl_module))

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, max_new_tokens=self.max_new_tokens)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step = state_dict.get("last_step")

    # ------------------------------------------------------------------------------------------ hooks

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        every_rank = self._ranks == "every rank" and trainer.world_size > 1
        if trainer.sanity_checking or not (trainer.is_global_zero or every_rank):
            return
        step = trainer.global_step
        if self._last_step is not None and step < self._last_step + self.every_n_steps:
            return
        self._last_step = step
        record = self.generate(pl_module, every_rank=every_rank)
        if not trainer.is_global_zero:
            return
        record.update(step=step, epoch=trainer.current_epoch)
        self.history.append(record)
        metrics = {k: float(record[k]) for k in ("tokens_per_s", "seconds", "new_tokens") if record.get(k) is not None}
        if record.get("gpu_kv_fraction") is not None:
            metrics["gpu_kv_fraction"] = float(record["gpu_kv_fraction"])
        metrics = {f"gen/{k}": v for k, v in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if record.get("texts") and hasattr(logger, "log_text"):
                logger.log_text(key="gen/samples", columns=["step", "sample", "text"],
                                data=[[step, i, t] for i, t in enumerate(record["texts"])])
        self._write(trainer, record)
        rank_zero_info(f"GenerationCallback step {step}: {record['new_tokens']} tokens in {record['seconds']:.2f} s "
                       f"({record['tokens_per_s']:.1f} tokens/s; {record['kv']})")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._cache_obj is not None:
            self._cache_obj.close()
            self._cache_obj, self._cache_key = None, None

    # ------------------------------------------------------------------------------------- generation

    def _inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._ids is not None:
            return self._ids.to(device), None
        enc = self.tokenizer(list(self.prompts), return_tensors="pt", padding=True)
        mask = enc.get("attention_mask")
        return enc["input_ids"].to(device), (mask.to(device) if mask is not None else None)

    def _get_cache(self, pl_module: L.LightningModule, ids: torch.Tensor) -> OffloadedKVCache | None:
        if self.cache == "dynamic":
            return None
        max_length = self.options.max_length or ids.shape[1] + self.max_new_tokens
        key = (tuple(ids.shape), max_length, ids.device)
        if self._cache_obj is None or self._cache_key != key:
            if self._cache_obj is not None:
                self._cache_obj.close()
            self._cache_obj = OffloadedKVCache(pl_module, self.options.replace(max_length=max_length))
            self._cache_key = key
        else:
            self._cache_obj.reset()
        return self._cache_obj

    def generate(self, pl_module: L.LightningModule, every_rank: bool = False) -> dict[str, Any]:
        """Generate once from the prompts now and return the record that would be logged.

        Args:
            pl_module: the model.
            every_rank: the parameters are sharded and every rank calls this in lock step (see Note [Generation
                under sharded parameters]); otherwise any one rank may call it alone.
        """
        if not every_rank:
            with torch.inference_mode():
                return self._generate(pl_module, every_rank)
        # Collectives on tensors made in inference mode are refused by some backends (gloo): no_grad, as Lightning's
        # own evaluation loop does there.
        with torch.no_grad(), _gathered(pl_module):
            return self._generate(pl_module, every_rank)

    def _generate(self, pl_module: L.LightningModule, every_rank: bool) -> dict[str, Any]:
        ids, mask = self._inputs(pl_module.device)
        cache = self._get_cache(pl_module, ids)
        sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda *a: None)
        sync()
        t0 = time.perf_counter()
        if self.generate_fn is not None:
            out = self.generate_fn(pl_module, ids, cache, self.max_new_tokens)
        else:
            target = find_generator(pl_module)
            if hasattr(target, "generation_config"):  # transformers
                kw: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, do_sample=False)
                if cache is not None:
                    kw[cache_kwarg(target)] = cache
                if mask is not None:
                    kw["attention_mask"] = mask
                pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
                if pad is None:
                    pad = getattr(target.generation_config, "pad_token_id", None)
                    if pad is None:
                        pad = getattr(target.generation_config, "eos_token_id", None)
                if pad is not None:
                    kw["pad_token_id"] = pad
                if self.prefill_chunk_size is not None:
                    kw["prefill_chunk_size"] = self.prefill_chunk_size
                if every_rank:
                    kw["synced_gpus"] = True  # no rank leaves the loop (and its all-gathers) before the others
                out = target.generate(ids, **kw)
            else:
                if self.prefill_chunk_size is not None:
                    raise ValueError(f"prefill_chunk_size={self.prefill_chunk_size} is an option of transformers' "
                                     f"generate, and {type(target).__name__}.generate is not transformers'. Allowed "
                                     "here: None, or a generate_fn that chunks the prompt itself.")
                out = target.generate(ids, max_new_tokens=self.max_new_tokens, past_key_values=cache)
        sync()
        seconds = time.perf_counter() - t0
        new = out[:, ids.shape[1]:]
        plan = cache.plan if cache is not None else None
        # A plain cache off the GPU holds everything where the model runs: there is no GPU share to report.
        no_gpu = plan is not None and plan.backend == "plain" and ids.device.type != "cuda"
        record: dict[str, Any] = {
            "seconds": seconds, "new_tokens": int(new.numel()),
            "tokens_per_s": new.numel() / seconds if seconds > 0 else None,
            "cache": self.cache, "kv": _what_happened(cache, ids.device), "ids": new.tolist(),
            "gpu_kv_fraction": plan.gpu_fraction if plan is not None and not no_gpu else None,
            "plan": cache.describe() if cache is not None else "model default cache",
        }
        if self.tokenizer is not None and hasattr(self.tokenizer, "batch_decode"):
            record["texts"] = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return record

    def _write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        if self.filename is None:
            return
        folder = None
        for logger in trainer.loggers:
            folder = getattr(logger, "log_dir", None)
            if folder:
                break
        folder = folder or trainer.default_root_dir
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, self.filename), "a") as f:
            f.write(json.dumps(record) + "\n")
