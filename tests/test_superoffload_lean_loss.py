"""The SuperOffload strategies' lean loss: when it is on (a table), and what it changes in a Lightning run (the
loss goes through the lean loss; the parameters stay bitwise those of the loss as written, on the CPU)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import lightning_gh as lgh
from lightning_gh.superoffload.loss import StepLoss, activation_offload_owns_loss, lean_loss_decision

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("setting", "cuda", "causal_lm", "loss_owner", "on", "why"),
    [
        ("auto", True, True, False, True, "on:"),
        ("auto", False, True, False, False, "not on CUDA"),
        ("auto", True, False, False, False, "no transformers"),
        ("auto", True, True, True, False, "ActivationOffload"),
        (True, False, True, False, True, "on:"),
        (True, True, True, True, False, "ActivationOffload"),
        (False, True, True, False, False, "lean_loss=False"),
        (False, True, False, False, False, "lean_loss=False"),
    ],
)
def test_lean_loss_decision_table(setting, cuda, causal_lm, loss_owner, on, why):
    got, reason = lean_loss_decision(setting, cuda=cuda, causal_lm=causal_lm, loss_owner=loss_owner)
    assert got is on and why in reason


def test_lean_loss_true_without_a_causal_lm_names_the_argument():
    with pytest.raises(ValueError, match=r"lean_loss=True: .*\*ForCausalLM.*'auto' or False"):
        lean_loss_decision(True, cuda=True, causal_lm=False, loss_owner=False)


@pytest.mark.parametrize(("value", "error"), [("yes", ValueError), (1, TypeError), (None, TypeError)])
def test_bad_lean_loss_is_refused_by_both_strategies(value, error):
    for cls in (lgh.SuperOffloadStrategy, lgh.SuperOffloadFSDPStrategy):
        with pytest.raises(error, match="lean_loss"):
            cls(lean_loss=value)


class HFOwnLoss(L.LightningModule):
    """What users write: an HF causal LM, the loss computed from its logits, fused AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                       max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
        self.model = transformers.LlamaForCausalLM(cfg)
        self.losses: list[float] = []
        self.grad_fns: list[str] = []

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self.model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        self.grad_fns.append(type(loss.grad_fn).__name__)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)


def _fit(strategy, callbacks=(), accelerator="cpu"):
    model = HFOwnLoss()
    data = torch.randint(0, 96, (12, 33), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=6, gradient_clip_val=0.5,
                        precision="bf16-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    if accelerator == "cpu":
        with pytest.warns(UserWarning, match="no GPU memory to relieve"):
            trainer.fit(model, loader)
    else:
        trainer.fit(model, loader)
    return model, trainer


def test_lean_loss_runs_the_users_own_loss_lean_with_the_same_parameters():
    plain, _ = _fit(lgh.SuperOffloadStrategy(lean_loss=False))
    lean, trainer = _fit(lgh.SuperOffloadStrategy(lean_loss=True))
    assert trainer.strategy.loss.on and trainer.strategy.loss.why.startswith("on:")
    assert set(lean.grad_fns) == {"_LeanCrossEntropyBackward"}
    assert "_LeanCrossEntropyBackward" not in plain.grad_fns
    # The lean loss computes each logit's gradient as cross_entropy does: the run is the same run; only the order in
    # which the reported loss sums its rows differs.
    assert lean.losses == pytest.approx(plain.losses, rel=1e-6)
    for a, b in zip(plain.parameters(), lean.parameters()):
        assert torch.equal(a, b)
    # Outside the training step nothing is left installed on the model.
    assert "_loss_function" not in vars(lean.model) and not lean.model._forward_hooks


def test_auto_steps_aside_on_the_cpu():
    model, trainer = _fit("superoffload")
    assert not trainer.strategy.loss.on and "not on CUDA" in trainer.strategy.loss.why
    assert "_LeanCrossEntropyBackward" not in model.grad_fns


@pytest.mark.parametrize(("kw", "owns"), [({"budget": "1GiB"}, True), ({"lean_loss": False}, True),
                                          ({"lean_loss": True}, True), ({}, False)])
def test_activation_offload_owns_the_loss_only_where_it_decides_it(kw, owns):
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[lgh.ActivationOffload(**kw)])
    assert activation_offload_owns_loss(trainer) is owns


def test_beside_activation_offload_the_strategy_leaves_the_loss_to_it_only_where_it_decides_it():
    _, trainer = _fit(lgh.SuperOffloadStrategy(lean_loss=True), [lgh.ActivationOffload(policy=0, lean_loss=False)])
    assert not trainer.strategy.loss.on and "ActivationOffload" in trainer.strategy.loss.why
    # An ActivationOffload without a budget or lean_loss never touches the loss: the strategy's lean loss runs
    # beside its hooks, and the run is the run with the loss as written.
    plain, _ = _fit(lgh.SuperOffloadStrategy(lean_loss=False), [lgh.ActivationOffload(policy=0)])
    lean, trainer = _fit(lgh.SuperOffloadStrategy(lean_loss=True), [lgh.ActivationOffload(policy=0)])
    assert trainer.strategy.loss.on and set(lean.grad_fns) == {"_LeanCrossEntropyBackward"}
    for a, b in zip(plain.parameters(), lean.parameters()):
        assert torch.equal(a, b)


def test_lean_loss_true_on_a_model_without_a_causal_lm_fails_at_setup():
    loss = StepLoss("SuperOffloadStrategy", True)
    trainer = L.Trainer(accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match="lean_loss=True"):
        loss.setup(trainer, torch.nn.Linear(2, 2), torch.device("cpu"))


class ShardedHFOwnLoss(HFOwnLoss):
    """The same module, its decoder layers and the whole model sharded with FSDP2 in ``configure_model``."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _fit_zero3(rank: int, world: int, tmp: str, lean: bool) -> None:
    model = ShardedHFOwnLoss()
    data = torch.randint(0, 96, (8 * world, 33), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[rank::world]), batch_size=2)
    strategy = lgh.SuperOffloadFSDPStrategy(cpu_threads=1, lean_loss=lean)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4, precision="bf16-true",
                        gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, loader)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    torch.save({"params": [p.detach().clone() for p in full], "grad_fns": model.grad_fns,
                "why": strategy.loss.why}, f"{tmp}/{'lean' if lean else 'plain'}-rank{rank}.pt")


def test_zero3_strategy_runs_the_loss_lean_with_the_same_parameters(tmp_path):
    from test_superoffload_fsdp import run_ranks  # forked gloo ranks with a timeout

    for lean in (False, True):
        run_ranks(_fit_zero3, 2, str(tmp_path), lean)
    for rank in range(2):
        plain, lean = (torch.load(f"{tmp_path}/{tag}-rank{rank}.pt") for tag in ("plain", "lean"))
        assert set(lean["grad_fns"]) == {"_LeanCrossEntropyBackward"} and lean["why"].startswith("on:")
        assert "_LeanCrossEntropyBackward" not in plain["grad_fns"]
        for a, b in zip(plain["params"], lean["params"]):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_default_takes_the_lean_loss_and_trains_as_the_loss_as_written():
    """On CUDA the default (``"auto"``) is on; the fused kernels' logit gradients are within a unit in the last place
    of bf16 of cross_entropy's, so the runs agree closely rather than bitwise."""
    plain, _ = _fit(lgh.SuperOffloadStrategy(lean_loss=False), accelerator="gpu")
    lean, trainer = _fit("superoffload", accelerator="gpu")
    assert trainer.strategy.loss.on and set(lean.grad_fns) == {"_LeanCrossEntropyBackward"}
    assert "_LeanCrossEntropyBackward" not in plain.grad_fns
    assert lean.losses == pytest.approx(plain.losses, rel=2e-3)
    for a, b in zip(plain.parameters(), lean.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
