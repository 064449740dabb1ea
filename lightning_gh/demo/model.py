"""A Llama-style decoder and its LightningModule: the reference workload for every part and benchmark.

RMSNorm, rotary position embeddings, grouped-query attention through
``torch.nn.functional.scaled_dot_product_attention``, a SwiGLU MLP, and a tied or untied output head.
Presets name the sizes the project measures against (see ``PRESETS``).

Example::

    >>> import lightning as L
    >>> from lightning_gh.demo import LlamaLM, MarkovDataModule
    >>> model = LlamaLM.from_preset("tiny")
    >>> dm = MarkovDataModule.for_model(model)
    >>> L.Trainer(max_steps=10, logger=False, enable_checkpointing=False).fit(model, dm)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "PRESETS", "Llama", "LlamaLM", "preset"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model and of one training batch.

    Args:
        vocab_size: tokens in the vocabulary.
        dim: model width.
        n_layers: transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention when fewer than ``n_heads``).
        ffn_dim: hidden width of the SwiGLU MLP.
        seq_len: tokens per sequence.
        batch_size: sequences per micro-batch.
        tie_embeddings: share the input embedding with the output head.
        rope_theta: base of the rotary frequencies.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    seq_len: int
    batch_size: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "seq_len", "batch_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"LlamaConfig.{f} must be a positive int, got {v!r}.")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig.n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}.")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig head_dim={self.dim // self.n_heads} must be even for rotary embeddings.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no allocation)."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv * 2
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head

    def matmul_params(self) -> int:
        """Parameters that take part in matrix products (everything but norms and the embedding lookup)."""
        kv = self.n_kv_heads * self.head_dim
        per_block = self.dim * self.dim * 2 + self.dim * kv * 2 + 3 * self.dim * self.ffn_dim
        return self.n_layers * per_block + self.vocab_size * self.dim

    def train_flops_per_batch(self) -> float:
        """Model FLOPs of one forward+backward over a batch: 6*N*T for the matrix products plus causal
        attention (QK^T and AV, half the square under the causal mask) at three times its forward cost."""
        t = self.tokens_per_batch
        attention = 3 * 2 * 2 * self.n_layers * self.dim * self.seq_len * t / 2
        return 6.0 * self.matmul_params() * t + attention

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, LlamaConfig] = {
    # Trains in seconds on a CPU; used by the tests and the CPU demo.
    "tiny": LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, seq_len=64, batch_size=8),
    # Launch-bound on a Hopper GPU: many small kernels per step.
    "small": LlamaConfig(vocab_size=8192, dim=512, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=1408, seq_len=128, batch_size=4),
    # 542M parameters, the shape of the activation-offload anchors (full multi-head attention, untied head).
    "medium": LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=16, ffn_dim=5632, seq_len=2048, batch_size=4),
    # Llama-3-8B-wide layers, 4 of them; the shape of the fp8 anchors (full multi-head attention, untied head).
    "large": LlamaConfig(vocab_size=32000, dim=4096, n_layers=4, n_heads=32, n_kv_heads=32, ffn_dim=14336, seq_len=4096, batch_size=2),
}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    """The named preset, with any field overridden (``preset("small", n_layers=2)``)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; choose one of {sorted(PRESETS)}.")
    known = {f.name for f in fields(LlamaConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"preset overrides {bad} are not LlamaConfig fields; allowed: {sorted(known)}.")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim of ``x`` (B, H, S, D) by position."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos = cos[: x.shape[-2]].to(x.dtype)
    sin = sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, layer_idx: int,
                       start: int) -> torch.Tensor:
        """Attention for tokens at positions ``start..start+s-1``, with earlier keys/values from ``cache``
        (anything with ``update(k, v, layer_idx) -> (all_k, all_v)``, e.g. ``OffloadedKVCache``)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[start:start + s], sin[start:start + s]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = cache.update(k, v, layer_idx)
        gqa = self.n_kv_heads != self.n_heads
        if start == 0 or s == 1:  # prefill: plain causal; one new token: it sees every cached one
            out = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and s > 1, enable_gqa=gqa)
        else:  # a chunk after a prefix: query i sees keys 0..start+i
            mask = torch.ones(s, start + s, dtype=torch.bool, device=x.device).tril(start)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLUGate(nn.Module):
    """``silu(gate) * up``. A module of its own (no parameters) so that memory tools can recompute it:
    ``ActivationOffload(recompute="norm-act")`` checkpoints it instead of keeping its SiLU output."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.gate = SwiGLUGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(self.w1(x), self.w3(x)))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, layer_idx: int,
                       start: int) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin, cache, layer_idx, start)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The decoder: token ids (B, S) -> logits (B, S, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints stay portable across seq_len.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Scale the residual projections by depth (GPT-2 style) so deep stacks start stable.
                s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
                nn.init.normal_(p, mean=0.0, std=s)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's seq_len={self.cfg.seq_len}.")
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))

    def forward_cached(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits (B, 1, vocab) of the last position of ``tokens``, which continue what ``cache`` holds."""
        start = int(cache.get_seq_length())
        if start + tokens.shape[1] > self.rope_cos.shape[0]:
            raise ValueError(f"generation reaches {start + tokens.shape[1]} tokens, beyond the model's "
                             f"seq_len={self.cfg.seq_len} (its rotary tables).")
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, self.rope_cos, self.rope_sin, cache, i, start)
        return self.head(self.norm(x[:, -1:]))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, past_key_values: Any = None) -> torch.Tensor:
        """Greedy decoding with a KV cache: ``input_ids`` (B, S) -> (B, S + max_new_tokens).

        Args:
            input_ids: prompt token ids, one length for the whole batch.
            max_new_tokens: tokens to append.
            past_key_values: an empty (or ``reset()``) KV cache to fill, e.g. ``lightning_gh.OffloadedKVCache(model)``;
                ``None`` uses a plain growing cache.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1.")
        cache = past_key_values if past_key_values is not None else _ConcatCache()
        out = [input_ids]
        logits = self.forward_cached(input_ids, cache)
        for i in range(max_new_tokens):
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = self.forward_cached(nxt, cache)
        return torch.cat(out, dim=1)


class _ConcatCache:
    """The plainest KV cache (like transformers' DynamicCache): concatenate each step's keys and values."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv[layer_idx][0].shape[-2] if layer_idx < len(self.kv) else 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.kv):
            self.kv.append((k, v))
        else:
            pk, pv = self.kv[layer_idx]
            self.kv[layer_idx] = (torch.cat([pk, k], dim=-2), torch.cat([pv, v], dim=-2))
        return self.kv[layer_idx]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LlamaLM(L.LightningModule):
    """The reference LightningModule: next-token cross-entropy with AdamW and a linear warm-up.

    Args:
        config: model and batch shape (``LlamaLM.from_preset("small")`` picks a named one).
        lr: peak learning rate.
        weight_decay: AdamW weight decay (not applied to norms and biases).
        warmup_steps: linear warm-up of the learning rate over this many optimizer steps.
        betas: AdamW betas.
        fused_adamw: use the fused AdamW kernel on CUDA (ignored on the CPU).
        compile: wrap the decoder in ``torch.compile`` in ``configure_model``.
        compile_loss: also compile the loss (logits upcast + cross-entropy) so the fp32 logits are never
            materialised; with a 32k vocabulary that is a few ms and ~1 GB per 8k tokens.

    Example::

        model = LlamaLM.from_preset("small", lr=3e-4)
        trainer = L.Trainer(precision="bf16-mixed", max_steps=100)
        trainer.fit(model, MarkovDataModule.for_model(model))
    """

    def __init__(
        self,
        config: LlamaConfig | dict[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        betas: tuple[float, float] = (0.9, 0.95),
        fused_adamw: bool = True,
        compile: bool = False,
        compile_loss: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = LlamaConfig(**config)
        if lr <= 0:
            raise ValueError(f"lr={lr!r} must be > 0.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0.")
        self.save_hyperparameters({"config": config.to_dict(), "lr": lr, "weight_decay": weight_decay,
                                   "warmup_steps": warmup_steps, "betas": tuple(betas),
                                   "fused_adamw": fused_adamw, "compile": compile,
                                   "compile_loss": compile_loss})
        self.config = config
        self.model = Llama(config)
        self._compile = compile
        self._compile_loss = compile_loss
        self._cross_entropy = _cross_entropy

    @classmethod
    def from_preset(cls, name: str, overrides: dict[str, Any] | None = None, **kwargs: Any) -> LlamaLM:
        return cls(preset(name, **(overrides or {})), **kwargs)

    def configure_model(self) -> None:
        if self._compile and not getattr(self, "_compiled", False):
            self.model = torch.compile(self.model)
            self._compiled = True
        if self._compile_loss and self._cross_entropy is _cross_entropy:
            self._cross_entropy = torch.compile(_cross_entropy)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, past_key_values: Any = None) -> torch.Tensor:
        """Greedy decoding with a KV cache (see :meth:`Llama.generate`); works on a compiled decoder too."""
        return getattr(self.model, "_orig_mod", self.model).generate(input_ids, max_new_tokens, past_key_values)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return self._cross_entropy(self(tokens), targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        hp = self.hparams
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        on_cuda = next(self.parameters()).is_cuda
        opt = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), fused=bool(hp.fused_adamw and on_cuda) or None)
        warmup = max(int(hp.warmup_steps), 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
