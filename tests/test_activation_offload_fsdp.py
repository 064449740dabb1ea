"""ActivationOffload under FSDP2 (Lightning's ``ModelParallelStrategy``, ``fully_shard`` per block) on the CPU:
2 processes, gloo, each forked and killed after a timeout.

Under FSDP2 each block's weights are gathered just before its forward into new parameters; the engine must skip
them as weights (Note [FSDP2's gathered weights are parameters]), so a rank offloads exactly what one process
offloads for the same batch, and training with the engine equals training without it, bitwise.
"""

from __future__ import annotations

import contextlib
import types

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from test_activation_offload import CPU, _deterministic  # the engine suite's CPU options and GPU determinism
from test_superoffload_fsdp import run_ranks

from lightning_gh import ActivationOffload
from lightning_gh.demo import LlamaLM, MarkovDataModule

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

STEPS = 18  # the budget's way: warm-up, measuring steps, plan, correction
TIMEOUT_S = 180


class ShardedLlamaLM(LlamaLM):
    """The demo decoder with each block and the whole model under ``fully_shard`` (FSDP2)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class ShardedHFLM(L.LightningModule):
    """A tiny Hugging Face Llama under ``fully_shard``, with the loss of the user's own over the shifted logits (the
    form the lean loss catches: Note [A loss of the user's own over the logits])."""

    def __init__(self) -> None:
        super().__init__()
        from test_activation_budget import _hf

        self.model = _hf("llama", 0, 3)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _options(kind: str) -> dict:
    return {"all": dict(policy="all"), "recompute": dict(policy=1, recompute="full"),
            "budget": dict(budget=0.45, profile_steps=1, bandwidth_gbps=1000.0, min_tensor_bytes=1),
            "hf-lean": dict(policy="all", lean_loss=True, min_tensor_bytes=1),
            "frozen": dict(policy="all"), "mixed-all": dict(policy="all")}[kind]


PLAIN = (None, "hf", "mixed")  # the references: no engine


def _freeze(model: LlamaLM) -> None:
    """Freeze the blocks' matrices (as a LoRA fine-tune does): their gathered copies do not require grad."""
    for block in model.model.layers:
        for p in block.parameters():
            if p.dim() >= 2:
                p.requires_grad_(False)


def _fit(rank: int, world: int, tmp: str, kind: str | None) -> None:
    L.seed_everything(0, verbose=False)
    hf, mixed = kind is not None and kind.startswith("hf"), kind is not None and kind.startswith("mixed")
    model = ShardedHFLM() if hf else ShardedLlamaLM.from_preset("tiny", overrides=dict(n_layers=3), lr=3e-3)
    if kind == "frozen":
        _freeze(model)
    g = torch.Generator().manual_seed(1 + rank)
    dm = torch.utils.data.DataLoader(torch.randint(0, 128, (2 * STEPS, 24), generator=g), batch_size=2) if hf \
        else MarkovDataModule.for_model(model)
    cb = ActivationOffload(**{**CPU, **_options(kind)}) if kind not in PLAIN else None
    # bf16 weights for the HF rows: the lean loss follows low-precision logits only; autocast for the mixed rows:
    # the gathered weights' casts are made again in the backward
    precision = "bf16-true" if hf else "bf16-mixed" if mixed else "32-true"
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, precision=precision,
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, use_distributed_sampler=False, callbacks=[cb] if cb else [])
    trainer.fit(model, dm)
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    stats = cb.engine.stats if cb is not None else None
    torch.save({"params": params, "offloaded": stats.offloaded_tensors if stats else 0,
                "forwards": stats.forwards if stats else 0,
                "recasts": stats.recomputed_param_casts if stats else 0,
                "skipped": dict(stats.skipped) if stats else {},
                "reloaded": (stats.reloaded_bytes, stats.offloaded_bytes) if stats else (0, 0),
                "plan": (list(cb.plan.offloaded_blocks), cb.plan.recompute) if cb and cb.plan else None,
                "lean": cb is not None and cb.engine._lean is not None and cb.engine._lean.last_logits is not None,
                "budget": (cb.engine.budget.achieved_bytes, cb.engine.budget.budget_bytes)
                if cb is not None and cb.engine.budget is not None else None},
               f"{tmp}/{kind}-rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("act-fsdp2"))
    out = {}
    for kind in (None, "all", "recompute", "budget", "frozen", "hf", "hf-lean", "mixed", "mixed-all"):
        run_ranks(_fit, 2, tmp, kind, timeout=TIMEOUT_S)
        out[kind] = [torch.load(f"{tmp}/{kind}-rank{r}.pt") for r in range(2)]
    return out


def _one_process_offloaded(frozen: bool) -> int:
    """What the engine offloads in the same steps on one process without FSDP (same model, same batch shape)."""
    L.seed_everything(0, verbose=False)
    model = LlamaLM.from_preset("tiny", overrides=dict(n_layers=3), lr=3e-3)
    if frozen:
        _freeze(model)
    cb = ActivationOffload(policy="all", **CPU)
    L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, logger=False, callbacks=[cb]).fit(model, MarkovDataModule.for_model(model))
    return cb.engine.stats.offloaded_tensors


@pytest.mark.parametrize("kind", ["all", "frozen"])
def test_a_rank_offloads_what_one_process_offloads_and_skips_the_gathered_weights(runs, kind):
    expected = _one_process_offloaded(frozen=kind == "frozen")
    for out in runs[kind]:
        assert out["forwards"] == STEPS
        assert out["offloaded"] == expected  # a gathered weight taken for an activation would add to this
        assert out["skipped"].get("parameter", 0) > 0
        assert out["reloaded"][0] == out["reloaded"][1] > 0


@pytest.mark.parametrize("kind", ["all", "recompute", "budget", "hf-lean", "mixed-all"])
def test_training_under_fsdp2_equals_training_without_the_engine_bitwise(runs, kind):
    reference = "hf" if kind.startswith("hf") else "mixed" if kind.startswith("mixed") else None
    for ours, plain in zip(runs[kind], runs[reference]):
        assert ours["forwards"] == STEPS
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], plain["params"]))


def test_gathered_weights_cast_by_autocast_are_cast_again_in_the_backward(runs):
    for out in runs["mixed-all"]:
        assert out["recasts"] > 0 and out["offloaded"] > 0


def test_the_lean_loss_catches_a_loss_of_the_users_own_under_fsdp2(runs):
    for out in runs["hf-lean"]:
        assert out["lean"] and out["offloaded"] > 0


def test_the_budget_plans_under_fsdp2(runs):
    for out in runs["budget"]:
        offloaded, recomputed = out["plan"]  # each rank plans from its own measurements
        assert recomputed or offloaded, out["plan"]
        achieved, budget = out["budget"]
        assert achieved is not None and achieved <= budget * 1.05
        assert out["reloaded"][0] == out["reloaded"][1]


class _Sharded:
    """Stands for a DTensor parameter: its local part is a smaller tensor (``to_local``)."""

    def __init__(self, local):
        self.local = local

    def to_local(self):
        return self.local


def test_memory_probe_counts_local_shards_and_the_gradients_a_backward_leaves():
    from lightning_gh.activation_offload.measure import MemoryProbe

    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    probe = MemoryProbe(model, None)
    probe.device = torch.device("cpu")  # the accounting alone; the readings need CUDA
    assert probe._grad_bytes(False) == (64 + 32) * 4  # before any backward: every gradient at full size
    model(torch.randn(2, 8)).sum().backward()
    model[0].weight.grad = None  # as a strategy that moves a gradient off the device during the backward does
    probe.backward_ended()
    assert probe.kept_grad_bytes == 32 * 4 and probe._grad_bytes(False) == 32 * 4
    probe.device = torch.device("meta")  # gradients on another device than the probe's are not counted
    assert probe._grad_bytes(True) == 0

    sharded = types.SimpleNamespace(parameters=lambda: iter([_Sharded(torch.zeros(4, 8, requires_grad=True))]))
    assert MemoryProbe(sharded, None)._grad_bytes(False) == 32 * 4  # a shard's gradient is the shard's size


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fsdp2_offload_and_recompute_match_plain_bitwise():
    """One rank of FSDP2 (NCCL, world size 1) on a small HF Llama in ``bf16-true``: the loss and the first layer's
    gradient with the engine offloading every block, or recomputing all of them, equal the plain step's bitwise,
    and a rank offloads what the unsharded model offloads (the gathered weights stay)."""
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from lightning_gh.activation_offload.engine import offload_activations

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                       tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).cuda()
        ids = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()

        def step(ctx=None):
            with ctx if ctx is not None else contextlib.nullcontext():
                logits = model(input_ids=ids).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            grad = model.model.layers[0].mlp.down_proj.weight.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
            model.zero_grad(set_to_none=True)
            return loss.detach(), grad

        with _deterministic():
            unsharded = offload_activations(model, "all", backend="cuda", min_tensor_bytes=1024)
            step(unsharded)
            unsharded.close()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            loss0, grad0 = step()
            for kw in (dict(policy="all"), dict(policy=0, recompute="full")):
                off = offload_activations(model, backend="cuda", min_tensor_bytes=1024, **kw)
                loss, grad = step(off)
                off.close()
                assert torch.equal(loss, loss0) and torch.equal(grad, grad0), kw
                if kw["policy"] == "all":  # a gathered weight taken for an activation would add to the count
                    assert off.stats.offloaded_tensors == unsharded.stats.offloaded_tensors > 0
            assert off.stats.forwards == 1
    finally:
        dist.destroy_process_group()
