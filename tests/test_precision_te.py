"""fp8 through Transformer Engine. The checkpoint-state helpers and argument checks run everywhere; tests that
build TE layers skip where TE is not installed, and the training tests need an fp8 GPU.

On a GPU machine with Transformer Engine installed (``pip install 'lightning-gh[te]'``):
    python3 -m pytest -q tests/test_precision_te.py
"""

from __future__ import annotations

import io
import statistics
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_gh import hardware
from lightning_gh.demo import Llama, LlamaLM, MarkovDataModule
from lightning_gh.precision import FP8UnavailableError, TEFloat8Precision, export_bf16_state_dict, precision
from lightning_gh.precision.checks import te_missing_reason
from lightning_gh.precision.te import fp8_meta_state_dict, load_fp8_meta_state_dict

TE_MISSING = te_missing_reason()
needs_te = pytest.mark.skipif(TE_MISSING is not None, reason=f"{TE_MISSING}")
FP8_GPU = hardware.detect().fp8_unsupported_reason() is None and TE_MISSING is None
needs_fp8 = pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with fp8 tensor cores and Transformer Engine")


@pytest.fixture
def te():
    return pytest.importorskip("transformer_engine.pytorch")
gpu_kwargs = dict(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(model, steps, tmp_path, ckpt_path=None, **kwargs):
    rec = LossRecorder()
    callbacks = [rec, *kwargs.pop("callbacks", [])]
    kw = {**gpu_kwargs, **kwargs}
    trainer = L.Trainer(max_steps=steps, callbacks=callbacks, default_root_dir=tmp_path, **kw)
    trainer.fit(model, MarkovDataModule.for_model(model), ckpt_path=ckpt_path)
    return trainer, rec.losses


# ---- DelayedScaling state as plain tensors: pure Python over fp8_meta, checked here with a stand-in TE layer


def fake_te_layer(history_len: int = 4, num_gemms: int = 1, initialised: bool = True, seed: int = 0):
    """An object shaped like a TE module's fp8 state: fp8_meta["scaling_fwd"|"scaling_bwd"].scale / .amax_history."""
    layer = SimpleNamespace(fp8_meta={"recipe": None, "fp8_checkpoint": False})
    if initialised:
        g = torch.Generator().manual_seed(seed)
        for key, per_gemm in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            n = per_gemm * num_gemms
            layer.fp8_meta[key] = SimpleNamespace(scale=torch.rand(n, generator=g) + 0.5,
                                                  amax_history=torch.rand(history_len, n, generator=g))
        layer.fp8_meta["num_gemms"] = num_gemms
    return layer


def meta(layer, key, field):
    return getattr(layer.fp8_meta[key], field)


def test_fp8_meta_round_trips_as_plain_tensors_copied_in_place():
    src, dst = fake_te_layer(seed=1), fake_te_layer(seed=2)
    state = fp8_meta_state_dict(src)
    assert set(state) == {"scaling_fwd.scale", "scaling_fwd.amax_history", "scaling_bwd.scale",
                          "scaling_bwd.amax_history", "num_gemms"}
    assert state["num_gemms"] == 1 and state["scaling_fwd.amax_history"].shape == (4, 3)
    meta(src, "scaling_fwd", "amax_history").add_(100.0)  # a copy, not a view of the live history
    assert state["scaling_fwd.amax_history"].max() < 100

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # loads without unpickling any class: no unsafe opt-in needed

    live = {(k, f): meta(dst, k, f) for k in ("scaling_fwd", "scaling_bwd") for f in ("scale", "amax_history")}
    quantizer_view = meta(dst, "scaling_fwd", "amax_history")[0]  # TE's quantizers hold views like this one
    assert load_fp8_meta_state_dict(dst, state) is None
    for (k, f), tensor in live.items():
        assert meta(dst, k, f) is tensor  # restored in place, the same tensor object
        assert torch.equal(tensor, state[f"{k}.{f}"])
    assert torch.equal(quantizer_view, state["scaling_fwd.amax_history"][0])


def test_fp8_meta_of_a_layer_without_delayed_state_is_none():
    assert fp8_meta_state_dict(fake_te_layer(initialised=False)) is None  # no fp8 forward yet
    assert fp8_meta_state_dict(torch.nn.Linear(4, 4)) is None  # not a TE layer
    current = SimpleNamespace(fp8_meta={"scaling_fwd": SimpleNamespace(), "scaling_bwd": SimpleNamespace()})
    assert fp8_meta_state_dict(current) is None  # a recipe without amax history (current scaling)


def test_fp8_meta_is_created_by_init_before_the_first_forward():
    state = fp8_meta_state_dict(fake_te_layer(num_gemms=2, seed=3))
    dst = fake_te_layer(initialised=False)
    calls = []

    def init(layer, st):
        calls.append(st["num_gemms"])
        layer.fp8_meta.update(fake_te_layer(num_gemms=st["num_gemms"], seed=4).fp8_meta)

    assert load_fp8_meta_state_dict(dst, state, init) is None
    assert calls == [2]
    assert torch.equal(meta(dst, "scaling_bwd", "amax_history"), state["scaling_bwd.amax_history"])
    assert "no fp8 meta tensors" in load_fp8_meta_state_dict(fake_te_layer(initialised=False), state)


@pytest.mark.parametrize("case", ["history_len", "missing_field", "extra_field", "not_a_tensor", "not_a_dict",
                                  "init_fails"])
def test_fp8_meta_mismatch_is_reported_and_changes_nothing(case):
    state = fp8_meta_state_dict(fake_te_layer(seed=5))
    dst = fake_te_layer(seed=6)
    init = None
    expected = {"history_len": "shape (8, 3) in the checkpoint but (4, 3) here", "missing_field": "this layer has",
                "extra_field": "the checkpoint has", "not_a_tensor": "no fp8 meta tensors",
                "not_a_dict": "expected a dict", "init_fails": "could not create the fp8 meta tensors"}[case]
    if case == "history_len":
        state = fp8_meta_state_dict(fake_te_layer(history_len=8, seed=5))
    elif case == "missing_field":
        del state["scaling_bwd.scale"]
    elif case == "extra_field":
        state["scaling_fwd.scale_inv"] = torch.ones(3)
    elif case == "not_a_tensor":
        state["scaling_fwd.scale"] = [1.0, 1.0, 1.0]
    elif case == "not_a_dict":
        state = b"pickled bytes"
    else:
        dst = fake_te_layer(initialised=False)

        def init(layer, st):
            raise AttributeError("no init_fp8_meta_tensors in this TE")
    before = {k: v.clone() for k, v in (fp8_meta_state_dict(dst) or {}).items() if k != "num_gemms"}
    why = load_fp8_meta_state_dict(dst, state, init)
    assert why is not None and expected in why, why
    after = fp8_meta_state_dict(dst) or {}
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.fixture
def plugin_without_te(monkeypatch):
    """A TEFloat8Precision built where TE is absent, to drive its checkpoint logic over stand-in layers."""
    import importlib

    te_module = importlib.import_module("lightning_gh.precision.te")
    monkeypatch.setattr(te_module, "te_missing_reason", lambda: None)
    monkeypatch.setattr(te_module, "make_recipe", lambda recipe, **options: SimpleNamespace(amax_history_len=4))
    return lambda recipe="delayed", **options: TEFloat8Precision(recipe, **options)


def test_plugin_checkpoint_restores_matching_layers_and_warns_about_the_rest(plugin_without_te):
    saver = plugin_without_te()
    saver._converted = {"a": fake_te_layer(seed=1), "b": fake_te_layer(seed=2), "c": fake_te_layer(seed=3)}
    ckpt = saver.state_dict()
    assert sorted(ckpt["te_fp8_meta"]) == ["a", "b", "c"]
    assert plugin_without_te("current").state_dict() == {}  # no history to keep

    loader = plugin_without_te()
    loader._converted = {"a": fake_te_layer(seed=4), "b": fake_te_layer(history_len=8, seed=5),
                         "d": fake_te_layer(initialised=False)}
    with pytest.warns(UserWarning, match="amax histories of 3 layer.s., which start fresh") as caught:
        loader.load_state_dict(ckpt)
    msg = str(caught[0].message)
    assert "b: scaling_fwd.amax_history has shape (4, 3) in the checkpoint but (8, 3) here" in msg
    assert "d: not in the checkpoint" in msg and "c: not converted in this run" in msg
    assert torch.equal(meta(loader._converted["a"], "scaling_fwd", "amax_history"),
                       meta(saver._converted["a"], "scaling_fwd", "amax_history"))

    early = plugin_without_te()  # loaded before conversion: restored when the layers exist
    early.load_state_dict({"te_fp8_meta": {"a": ckpt["te_fp8_meta"]["a"]}})
    early._converted = {"a": fake_te_layer(seed=6)}
    early._restore_fp8_meta()
    assert torch.equal(meta(early._converted["a"], "scaling_bwd", "scale"),
                       ckpt["te_fp8_meta"]["a"]["scaling_bwd.scale"])

    with pytest.warns(UserWarning, match="which recipe 'current' does not use"):
        plugin_without_te("current").load_state_dict(ckpt)


# ---- the options: TEOptions, taken as options= or as keywords, never both


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(master_weights="yes"), TypeError, r"TEOptions\(master_weights='yes'\): expected True or False"),
    (dict(fused_master_update=1), TypeError, r"fused_master_update=1\): expected True or False"),
    (dict(compile_te_layers=None), TypeError, r"compile_te_layers=None\): expected True or False"),
    (dict(compile_blocks="yes"), ValueError, r"compile_blocks='yes'\): expected 'auto', True, False or a dict"),
    (dict(compile_blocks=3), TypeError, r"compile_blocks=3\): expected 'auto', True, False or a dict"),
    (dict(weights_dtype=torch.float16), ValueError, r"weights_dtype=torch.float16\): expected None"),
    (dict(weights_dtype="bf16"), TypeError, r"weights_dtype='bf16'\): expected None"),
    (dict(recipe_options=[16]), TypeError, r"recipe_options=\[16\]\): expected a dict or None"),
])
def test_te_options_refuse_bad_values_naming_them(kwargs, error, match):
    from lightning_gh.precision import TEOptions

    with pytest.raises(error, match=match):
        TEOptions(**kwargs)


@pytest.mark.parametrize("master_weights, weights_dtype, module_dtype", [
    (True, None, torch.bfloat16),    # masters in the optimizer, bf16 module
    (False, None, None),             # no masters: the model's own dtype
    (False, torch.bfloat16, torch.bfloat16),
    (True, torch.float32, torch.float32),
])
def test_te_options_module_dtype(master_weights, weights_dtype, module_dtype):
    from lightning_gh.precision import TEOptions

    assert TEOptions(master_weights=master_weights, weights_dtype=weights_dtype).module_dtype() == module_dtype


def test_te_plugin_takes_options_or_keywords_never_both(plugin_without_te):
    from lightning_gh.precision import Float8Options, TEOptions

    opts = Float8Options("current", te=TEOptions(master_weights=False, compile_blocks=False))
    plugin = TEFloat8Precision(options=opts)
    assert plugin.fp8_options is opts and plugin.recipe == "current" and plugin.name == "fp8-te-current"
    assert not plugin.master_weights and plugin.compile_blocks is False and plugin.weights_dtype is None
    assert plugin_without_te("current", master_weights=False, compile_blocks=False).fp8_options == opts
    default = plugin_without_te()
    assert default.recipe == "delayed" and default.te_options == TEOptions() and default.fp8_options.te is None
    with pytest.raises(TypeError, match=r"got both options= and te=TEOptions\(.*fused_master_update=False"):
        TEFloat8Precision(options=opts, fused_master_update=False)
    assert TEFloat8Precision(options=opts, master_weights=True).fp8_options is opts  # a default: not counted
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['master_weight'\]"):
        plugin_without_te(master_weight=False)
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['master_weight'\].*'master_weights'"):
        precision("fp8-te-current", master_weight=False)  # through the registry: the allowed names listed
    with pytest.raises(AttributeError):
        default.master_weights = False  # read-only: the options are frozen


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        return x + self.proj(self.norm(x))


def _blocks_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Sequential(_Block(), _Block(), _Block()),
                               torch.nn.Linear(32, 8))


def _prepare(plugin, model, native_te=()):
    """Drive the plugin's setup steps by hand: the blocks' projections stand in for converted TE layers."""
    plugin._before_conversion(model, torch.device("cpu"))
    plugin._converted = {f"1.{i}.proj": block.proj for i, block in enumerate(model[1])}
    plugin.native_te = list(native_te)
    return plugin._compile_regions(model)


def test_blocks_holding_te_layers_are_compiled_in_place_with_compile_blocks_true(plugin_without_te):
    with pytest.raises(ValueError, match=r"compile_blocks='yes'.*expected 'auto', True, False or a dict"):
        precision("fp8-te-current", compile_blocks="yes")

    model = _blocks_model()
    plugin = plugin_without_te(compile_blocks=True)
    note = _prepare(plugin, model)
    assert "compiled 3 blocks of 1 in place" in note and "TE layers running eagerly inside" in note
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model[1])
    assert getattr(model[0], "_compiled_call_impl", None) is None  # the rest of the model stays eager
    assert all(k.startswith(("0.", "1.", "2.")) and "_orig_mod" not in k for k in model.state_dict())

    eager = _blocks_model()
    plugin = plugin_without_te(compile_blocks=False)
    assert _prepare(plugin, eager) == ""
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in eager[1])

    user_compiled = torch.compile(_blocks_model())  # the user's own compile is left alone
    plugin = plugin_without_te()
    plugin._before_conversion(user_compiled, torch.device("cpu"))
    plugin._converted = {f"1.{i}.proj": block.proj for i, block in enumerate(user_compiled._orig_mod[1])}
    plugin.native_te = []
    assert plugin._compile_regions(user_compiled) == ""
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in user_compiled._orig_mod[1])

    native = _blocks_model()
    assert "blocks not compiled: the model has Transformer Engine modules" in _prepare(
        plugin_without_te(), native, native_te=["1.0.te_layer"])
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in native[1])


def test_compiled_blocks_match_the_eager_blocks(plugin_without_te):
    torch.manual_seed(0)
    model = _blocks_model()
    x = torch.randn(4, 32)
    expected = model(x)
    _prepare(plugin_without_te(), model)
    torch.testing.assert_close(model(x), expected)


def test_ddp_reduces_delayed_scaling_amax_over_the_data_parallel_group(monkeypatch):
    """Runs without TE: the group the plugin passes to TE's autocast under DDP (one gloo process stands in)."""
    import torch.distributed as dist

    from lightning_gh.precision.te import amax_reduction_group

    assert amax_reduction_group("delayed") is None  # no process group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert amax_reduction_group("delayed") is None  # one process: nothing to agree on
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        assert amax_reduction_group("delayed") is dist.group.WORLD and dist.group.WORLD is not None
        for recipe in ("current", "block"):  # scales from the tensor at hand: no history to share
            assert amax_reduction_group(recipe) is None
    finally:
        dist.destroy_process_group()


def test_compile_with_delayed_scaling_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="DelayedScaling cannot be traced by torch.compile.*fp8-te-current"):
        precision("fp8-te-delayed", compile_te_layers=True)
    with pytest.raises(ValueError, match=r"TEFloat8Precision\(recipe='fp9'\)"):
        TEFloat8Precision("fp9")
    with pytest.raises(ValueError, match="weights_dtype"):
        precision("fp8-te-current", weights_dtype=torch.float16)


@needs_te
@pytest.mark.gpu
def test_conversion_keeps_weights_and_saves_plain_checkpoints(te):
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny").cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = precision("fp8-te-current", min_dim=0)
    plan = plugin.convert_layers(model, device="cuda")
    converted = [n for n, m in model.named_modules() if isinstance(m, te.Linear)]
    assert converted == plan.converted and len(converted) == 2 * 7 - 3  # all but layers.0 wq/wk/wv
    after = model.state_dict()
    assert list(after) == list(before)  # no TE _extra_state, same names: a plain checkpoint
    assert all(torch.equal(after[k], before[k]) for k in before)
    plain = LlamaLM.from_preset("tiny").cuda()
    plain.load_state_dict(after, strict=True)  # and the converted model loads a plain one
    model.load_state_dict(plain.state_dict(), strict=True)


@needs_te
@pytest.mark.gpu
def test_tied_head_is_not_untied():
    model = LlamaLM.from_preset("tiny", overrides={"tie_embeddings": True}).cuda()
    plan = precision("fp8-te-current", min_dim=0, skip_head=False).convert_layers(model, device="cuda")
    assert plan.decisions["model.head"].reason == "weight shared with another module (tied)"
    assert model.model.head.weight is model.model.embed.weight


def learnable_model():
    # vocab 256: the Markov chain is learnt within tens of steps (the "small" preset's 8192 states need far more
    # tokens); every Linear stays a multiple of 16, so with min_dim=0 all but the first and the head run in fp8.
    return LlamaLM.from_preset("small", overrides=dict(vocab_size=256), lr=1e-3)


STEPS = 60
LOSS_RTOL = 0.03  # mean of the last 10 losses, fp8 vs bf16 (the benchmark checks 1% over >= 100 steps)


@needs_fp8
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8-te-delayed", "fp8-te-current", "fp8-te-block"])
def test_trains_close_to_bf16(name, tmp_path):
    curves = {}
    for which in ("bf16-mixed", name):
        L.seed_everything(0)
        model = learnable_model()
        kwargs = dict(precision="bf16-mixed") if which == "bf16-mixed" else dict(
            plugins=[precision(which, min_dim=0)])
        trainer, curves[which] = fit(model, STEPS, tmp_path, **kwargs)
        if which == name:
            assert len(trainer.precision_plugin.plan.converted) == 6 * 7 - 3  # all but layers.0 wq/wk/wv
    ref, fp8 = curves["bf16-mixed"], curves[name]
    assert len(ref) == len(fp8) == STEPS
    assert abs(ref[0] - fp8[0]) / ref[0] < 0.01  # same data, same initial weights
    ref_end, fp8_end = statistics.fmean(ref[-10:]), statistics.fmean(fp8[-10:])
    assert ref_end < ref[0] - 1.0, ref  # the reference clearly learns, so the comparison means something
    assert abs(fp8_end - ref_end) / ref_end < LOSS_RTOL, (ref_end, fp8_end, fp8)


def amax_histories(plugin):
    return {name: m.fp8_meta["scaling_fwd"].amax_history.detach().cpu().clone()
            for name, m in plugin._converted.items()}


class HistoryAtStart(Callback):
    """Record the plugin's amax histories when training starts, i.e. after Lightning restored the checkpoint."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.histories = amax_histories(trainer.precision_plugin)


@needs_fp8
@pytest.mark.gpu
def test_checkpoint_resume_and_bf16_export(tmp_path, monkeypatch):
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)  # resume must not need the opt-in
    L.seed_everything(0)
    model = learnable_model()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", save_last=True)
    plugin = precision("fp8-te-delayed", min_dim=0)
    fit(model, 5, tmp_path, plugins=[plugin], callbacks=[ckpt], enable_checkpointing=True)
    saved = torch.load(tmp_path / "a" / "last.ckpt", weights_only=False)
    assert not any(k.endswith("_extra_state") for k in saved["state_dict"])
    entry = saved["TEFloat8Precision"]["te_fp8_meta"]  # DelayedScaling's scales and amax histories
    buf = io.BytesIO()
    torch.save(saved["TEFloat8Precision"], buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)  # plain tensors and ints: nothing pickled that needs the unsafe opt-in
    assert sorted(entry) == sorted(plugin._converted)
    history_len = plugin.te_recipe.amax_history_len
    first = next(iter(entry.values()))
    assert first["scaling_fwd.amax_history"].shape == (history_len, 3)
    assert first["scaling_fwd.amax_history"].abs().sum() > 0  # 5 steps recorded

    resumed = learnable_model()
    plugin2 = precision("fp8-te-delayed", min_dim=0)
    at_start = HistoryAtStart()
    trainer, losses = fit(resumed, 8, tmp_path, ckpt_path=str(tmp_path / "a" / "last.ckpt"), plugins=[plugin2],
                          callbacks=[ModelCheckpoint(dirpath=tmp_path / "b"), at_start], enable_checkpointing=True,
                          num_sanity_val_steps=0)  # no fp8 forward between the restore and on_train_start
    assert trainer.global_step == 8 and len(losses) == 3
    assert sorted(at_start.histories) == sorted(entry)
    assert all(torch.equal(at_start.histories[n], entry[n]["scaling_fwd.amax_history"]) for n in entry)
    assert all(l == l for l in losses)  # noqa: E741 - finite after the restored scales were used
    exported = export_bf16_state_dict(resumed.model)
    plain = Llama(resumed.config).to(device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(exported, strict=True)

    # A run whose recipe keeps a shorter history cannot take these histories: it warns and starts fresh.
    other = learnable_model().cuda()
    assert history_len != 16
    plugin3 = precision("fp8-te-delayed", min_dim=0, recipe_options={"amax_history_len": 16})
    plugin3.convert_layers(other, device="cuda")
    with pytest.warns(UserWarning, match=rf"could not restore .* start fresh: .*shape \({history_len}, 3\) in the ch"):
        plugin3.load_state_dict(saved["TEFloat8Precision"])
    with plugin3.forward_context():
        other(torch.randint(256, (2, 128), device="cuda")).float().sum().backward()


@needs_fp8
@pytest.mark.gpu
def test_compiled_model_with_delayed_scaling_runs_te_layers_eagerly(tmp_path):
    L.seed_everything(0)
    model = LlamaLM.from_preset("small", lr=3e-3, compile=True)
    trainer, losses = fit(model, 4, tmp_path, plugins=[precision("fp8-te-delayed", min_dim=0)])
    assert len(losses) == 4 and all(l == l for l in losses)  # noqa: E741 - finite, not NaN


@needs_fp8
@pytest.mark.gpu
def test_blackwell_recipes_are_refused_on_hopper_with_the_reason(tmp_path):
    if hardware.detect().compute_capability >= (10, 0):
        pytest.skip("a Blackwell GPU runs MXFP8")
    model = LlamaLM.from_preset("small")
    with pytest.raises(FP8UnavailableError, match="Blackwell"):
        fit(model, 1, tmp_path, plugins=[precision("fp8-te-mxfp8", min_dim=0)])


@needs_fp8
@pytest.mark.gpu
def test_ragged_batch_fails_with_a_clear_error():
    model = LlamaLM.from_preset("small").cuda()
    plugin = precision("fp8-te-current", min_dim=0)
    plugin.convert_layers(model, device="cuda")
    with plugin.forward_context(), pytest.raises(ValueError, match="multiple of 16"):
        model(torch.randint(100, (1, 10), device="cuda"))


class _ReplicaState(Callback):
    """Each DDP rank writes its weights' checksum and fp8 amax histories, for the parent process to compare."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        weights = sum(p.detach().double().sum().item() for p in pl_module.parameters())
        torch.save({"weights": weights, "amax": amax_histories(trainer.precision_plugin)},
                   self.folder / f"rank{trainer.global_rank}.pt")


@needs_fp8
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ddp_on_two_gpus_shares_delayed_scaling_amax(tmp_path):
    """Ranks see different batches; with the amax reduction over the DDP group their fp8 scales stay identical."""
    L.seed_everything(0)
    model = learnable_model()
    trainer = L.Trainer(max_steps=6, accelerator="gpu", devices=2, strategy="ddp_spawn", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, plugins=[precision("fp8-te-delayed", min_dim=0)],
                        callbacks=[_ReplicaState(tmp_path)])
    trainer.fit(model, MarkovDataModule.for_model(model))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["weights"] == r1["weights"]
    assert r0["amax"].keys() == r1["amax"].keys() and len(r0["amax"]) == 6 * 7 - 3
    for name in r0["amax"]:
        assert torch.equal(r0["amax"][name], r1["amax"][name]), name
        assert r0["amax"][name].abs().sum() > 0, name  # histories were really filled


class _Clock:
    """Step marks for the compile trial: each call advances by the current period (ms), no GPU needed."""

    def __init__(self) -> None:
        self.t, self.period_ms = 0.0, 10.0

    def __call__(self) -> float:
        self.t += self.period_ms / 1e3
        return self.t


@pytest.mark.parametrize("compiled_ms, kept", [(8.0, True), (9.9, False), (12.0, False)])
def test_compile_blocks_auto_keeps_the_blocks_compiled_only_when_measured_faster(plugin_without_te, monkeypatch,
                                                                                  compiled_ms, kept):
    """By default the blocks run eager for the first steps, then compiled for a few; the faster is kept (2% margin),
    and the decision is one log line with the figures."""
    from lightning_gh.precision.master import MasterWeightsMixin

    model = _blocks_model()
    plugin = plugin_without_te()
    assert plugin.compile_blocks == "auto"
    note = _prepare(plugin, model)
    assert "compile_blocks='auto'" in note
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model[1])  # eager at first
    trial = plugin.block_trial
    clock, logged = _Clock(), []
    trial.clock, trial.log = clock, logged.append
    monkeypatch.setattr(MasterWeightsMixin, "optimizer_step", lambda self, *a, **k: "stepped")
    opt, other = object(), object()
    for step in range(1, 30):  # noqa: B007 (read after the loop)
        if trial.phase == "compiled":
            assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model[1])
            clock.period_ms = compiled_ms
        assert plugin.optimizer_step(opt, model, lambda: None) == "stepped"
        plugin.optimizer_step(other, model, lambda: None)  # a second optimizer's call does not count as a step
        if trial.done:
            break
    assert step == 16 and trial.decision == ("compiled" if kept else "eager")
    assert trial.eager_ms == pytest.approx(10.0) and trial.compiled_ms == pytest.approx(compiled_ms)
    assert all((getattr(b, "_compiled_call_impl", None) is not None) == kept for b in model[1])
    assert getattr(model[0], "_compiled_call_impl", None) is None
    assert len(logged) == 1 and f"{compiled_ms:.1f} ms/step with the blocks compiled" in logged[0]
    assert ("kept them compiled" if kept else "left them eager") in logged[0]
    assert "against 10.0 eager" in logged[0] and "compiled 3 blocks of 1 in place" in logged[0]
    plugin.optimizer_step(opt, model, lambda: None)  # decided: later steps measure nothing
    assert len(logged) == 1


def test_block_compile_trial_takes_the_agreed_decision_and_checks_its_arguments():
    from lightning_gh.precision.block_trial import BlockCompileTrial

    blocks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]

    def compile_fn():
        for b in blocks:
            b.compile()
        return "compiled 2"

    clock = _Clock()
    # this process measured the compiled blocks faster, but the agreed decision (rank 0's) is to stay eager
    trial = BlockCompileTrial(compile_fn, lambda: blocks, warmup=1, steps=2, clock=clock, agree=lambda keep: False,
                              log=lambda line: None)
    for _ in range(3):
        trial.step()
    assert trial.phase == "compiled"
    clock.period_ms = 5.0
    for _ in range(3):
        trial.step()
    assert trial.decision == "eager" and all(b._compiled_call_impl is None for b in blocks)
    # nothing compiled (no blocks found): nothing to decide, no compiled phase
    none = BlockCompileTrial(lambda: "", lambda: [], warmup=1, steps=1, clock=_Clock(), log=lambda line: None)
    none.step(); none.step()
    assert none.decision == "eager" and none.compiled_ms is None
    with pytest.raises(ValueError, match="warmup=0, steps=5"):
        BlockCompileTrial(compile_fn, lambda: blocks, warmup=0)
