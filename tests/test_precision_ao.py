"""fp8 through torchao on the CPU: conversion, the setup-time refusal, emulated training parity, checkpoints, DDP.

The CPU has no fp8 tensor cores, so the plugin refuses to train there; ``emulate=True`` (torchao's own switch for
numerics checks) lets the same code path train, which is what the parity, checkpoint and DDP tests use.
"""

from __future__ import annotations

import copy
import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_gh import hardware
from lightning_gh.demo import Llama, LlamaLM, MarkovDataModule
from lightning_gh.precision import FP8UnavailableError, TorchAOFloat8Precision, export_bf16_state_dict, precision

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

NO_FP8 = hardware.detect().fp8_unsupported_reason() is not None
# Regional compilation is on by default; these CPU tests compile the blocks with a light backend.
AOT = {"backend": "eager"}  # dynamo only: the regional path, without Inductor's minutes on a CPU


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(model, steps, cpu_trainer_kwargs, **kwargs):
    rec = LossRecorder()
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = L.Trainer(max_steps=steps, callbacks=[rec, *kwargs.pop("callbacks", [])], **cpu_trainer_kwargs, **kwargs)
    trainer.fit(model, MarkovDataModule.for_model(model), ckpt_path=ckpt_path)
    return trainer, rec.losses


def test_conversion_runs_on_cpu_and_keeps_weights_and_keys():
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny")
    before = copy.deepcopy(model.state_dict())
    plugin = precision("fp8-ao-tensorwise", min_dim=0)
    plan = plugin.convert_layers(model)
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == plan.converted and len(converted) == 2 * 7 - 3
    assert type(model.model.head) is torch.nn.Linear and type(model.model.layers[0].attn.wq) is torch.nn.Linear
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # Converting again is a no-op: already converted layers are kept, not wrapped twice.
    again = plugin.convert_layers(model)
    assert again.converted == plan.converted
    assert {d.reason for d in again.decisions.values() if d.convert} == {"converted earlier"}


@pytest.mark.skipif(not NO_FP8, reason="this machine has an fp8 GPU")
def test_plugin_refuses_at_setup_on_cpu_naming_device_and_capability(cpu_trainer_kwargs):
    model = LlamaLM.from_preset("tiny")
    plugin = precision("fp8-ao-tensorwise", min_dim=0)
    with pytest.raises(FP8UnavailableError) as err:
        fit(model, 2, cpu_trainer_kwargs, plugins=[plugin])
    msg = str(err.value)
    assert "'fp8-ao-tensorwise'" in msg and "device 'cpu'" in msg and "compute capability >= 8.9" in msg
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # refused before touching the model
    assert plugin.plan is None


def test_tokens_not_multiple_of_16_fail_with_a_clear_error():
    lin = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    plugin = precision("fp8-ao-tensorwise", min_dim=0)
    plugin.convert_layers(lin)
    assert isinstance(lin[1], Float8Linear)
    with pytest.raises(ValueError, match=r"layer '1' got 10 tokens .* multiple of 16"):
        lin(torch.randn(2, 5, 32))


def test_emulated_fp8_training_tracks_bf16(cpu_trainer_kwargs):
    """Same seed, same batches: per-step losses of fp8 (emulated) within 1% of bf16-mixed on the CPU."""
    curves = {}
    for name in ("bf16-mixed", "fp8-ao-tensorwise"):
        L.seed_everything(0)
        model = LlamaLM.from_preset("tiny", lr=3e-3)
        # eager fp8 here (tracing is slow on this CPU); tests/test_precision_hf.py checks the compiled blocks
        opts = dict(min_dim=0, emulate=True, compile_blocks=False) if name.startswith("fp8") else {}
        with pytest.warns(UserWarning, match="compile_blocks=False") if name.startswith("fp8") else _nothing():
            trainer, curves[name] = fit(model, 10, cpu_trainer_kwargs, plugins=[precision(name, **opts)])
        if name.startswith("fp8"):
            assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 11
    ref, fp8 = curves["bf16-mixed"], curves["fp8-ao-tensorwise"]
    assert ref[-1] < ref[0] - 0.3  # it learns
    rel = [abs(a - b) / a for a, b in zip(ref, fp8)]
    assert max(rel) < 0.01, rel
    assert max(rel) > 0  # the fp8 path really ran: its numbers differ from bf16


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_not_compiled_auto_mode_keeps_bf16(cpu_trainer_kwargs):
    model = LlamaLM.from_preset("tiny")
    plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True, convert_only_if_compiled=True,
                       compile_blocks=False)
    with pytest.warns(UserWarning, match="trains in bf16-mixed instead"):
        fit(model, 2, cpu_trainer_kwargs, plugins=[plugin])
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_compiled_model_is_converted_without_the_eager_warning():
    model = LlamaLM.from_preset("tiny", compile=True)
    model.configure_model()  # wraps the decoder in torch.compile (lazily: nothing is compiled here)
    from lightning_gh._lightning import is_compiled

    assert is_compiled(model) and not is_compiled(LlamaLM.from_preset("tiny"))
    plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True)
    plan = plugin.convert_layers(model)
    assert "model.layers.1.mlp.w2" in plan.converted
    assert isinstance(model.model._orig_mod.layers[1].mlp.w2, Float8Linear)


def test_checkpoint_resumes_and_exports_plain_bf16_weights(cpu_trainer_kwargs, tmp_path):
    L.seed_everything(0)
    model = LlamaLM.from_preset("tiny", lr=3e-3)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kw = {**cpu_trainer_kwargs, "enable_checkpointing": True}
    opts = dict(min_dim=0, emulate=True, compile_blocks=AOT)
    trainer, _ = fit(model, 4, kw, plugins=[precision("fp8-ao-tensorwise", **opts)], callbacks=[ckpt])
    path = tmp_path / "last.ckpt"
    assert path.exists()

    # Resume: a fresh, unconverted model loads the checkpoint, is converted at setup and trains on.
    resumed = LlamaLM.from_preset("tiny", lr=3e-3)
    trainer2, losses = fit(resumed, 6, kw, plugins=[precision("fp8-ao-tensorwise", **opts)],
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "b")], ckpt_path=str(path))
    assert trainer2.global_step == 6 and len(losses) == 2
    assert isinstance(resumed.model.layers[1].mlp.w1, Float8Linear)

    # Export: plain bf16 weights that load strictly into the unconverted model for inference.
    exported = export_bf16_state_dict(resumed.model)
    trained = resumed.model.state_dict()
    assert set(exported) == set(trained)
    for key, value in exported.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, trained[key].detach().to(torch.bfloat16)), key
        assert value.data_ptr() != trained[key].data_ptr()
    plain = Llama(resumed.config).to(torch.bfloat16)
    plain.load_state_dict(exported, strict=True)
    tokens = torch.randint(resumed.config.vocab_size, (2, 32))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(plain(tokens).float().flatten(0, 1), tokens.flatten())
    assert torch.isfinite(loss)


class _RankCheck(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        assert sum(isinstance(m, Float8Linear) for m in pl_module.modules()) == 11
        import torch.distributed as dist

        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        # the plain collective: Lightning's all_gather goes through torch's deprecated autograd all_gather, and one
        # CI run saw a rank abort at exit right after it ("terminate called without an active exception")
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        assert torch.equal(gathered[0], gathered[1]), "DDP replicas diverged"


def test_ddp_two_processes(tmp_path):
    # ddp_fork: two ranks without a fresh interpreter each; the pickle round trip is what ddp_spawn does with them.
    plugin = precision("fp8-ao-tensorwise", min_dim=0, emulate=True, compile_blocks=False)
    plugin, check = pickle.loads(pickle.dumps((plugin, _RankCheck())))
    model = LlamaLM.from_preset("tiny")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[check], plugins=[plugin])
    trainer.fit(model, MarkovDataModule.for_model(model))
    assert trainer.state.finished


def test_fsdp2_order_error_names_the_fix():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = LlamaLM.from_preset("tiny")
        fully_shard(model.model)
        plugin = precision("fp8-ao-tensorwise", min_dim=0)
        with pytest.raises(RuntimeError, match="Convert before sharding.*convert_layers"):
            plugin.convert_layers(model)
    finally:
        dist.destroy_process_group()


def test_fsdp_all_gather_option_is_validated():
    with pytest.raises(ValueError, match="needs recipe='tensorwise'"):
        TorchAOFloat8Precision("rowwise", fsdp_float8_all_gather=True)
    plugin = TorchAOFloat8Precision("tensorwise", fsdp_float8_all_gather=True)
    assert plugin.float8_config(fsdp=True).enable_fsdp_float8_all_gather
    with pytest.raises(ValueError, match=r"recipe='blockwise'"):
        TorchAOFloat8Precision("blockwise")
