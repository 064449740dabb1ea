"""The predicted step memory: a step traced on fake tensors against the same step run for real on the CPU, the pure
pieces as tables, and the plan's predicted peak (or its reason) in a Lightning run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_gh.memory import MemoryReport
from lightning_gh.memory import forecast as forecast_mod
from lightning_gh.memory.forecast import compiled_part, trace_training_step, why_not
from lightning_gh.memory.optim import forecast, implementation, state_buffers, step_temporaries
from lightning_gh.memory.predict import Peak, block_bytes, peak_from_parts, trace_step
from lightning_gh.memory.tail import TailForecast, read_tail, settle_tail, tail_target

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def decoder(family: str, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


@pytest.mark.parametrize(("family", "checkpointing", "autocast"),
                         [("Llama", False, False), ("Llama", True, False), ("Llama", False, True),
                          ("Llama", True, True), ("Qwen2", False, True), ("Qwen2", True, True)])
def test_the_fake_trace_predicts_what_the_real_step_holds(family, checkpointing, autocast):
    model = decoder(family, checkpointing)
    ids = torch.randint(0, 512, (2, 32))

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=x, labels=x).loss

    fake = trace_step(step, ids, device_type="cpu", module=model)
    assert all(p.grad is None for p in model.parameters())  # the trace's gradients went to the fake twins
    real = trace_step(step, ids, device_type="cpu", fake=False)  # the same hooks on real tensors
    assert fake.saved == real.saved > 0
    assert fake.grads == real.grads == sum(block_bytes(p.numel() * p.element_size()) for p in model.parameters())
    for name in ("retained", "forward_peak", "backward_peak"):  # to the allocator block (Note [Real small ops])
        assert getattr(fake, name) == getattr(real, name), name


def test_checkpointing_keeps_less_and_recomputes_a_block_in_backward():
    ids = torch.randint(0, 512, (2, 32))
    plain, ckpt = (trace_step(lambda x, m=m: m(input_ids=x, labels=x).loss, ids, device_type="cpu", module=m)
                   for m in (decoder("Llama", False), decoder("Llama", True)))
    assert ckpt.retained < plain.retained / 2 and ckpt.saved < plain.saved / 2
    assert ckpt.ops > plain.ops  # the backward recomputes each block's forward


def test_saved_bytes_count_activations_once_and_never_parameters():
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    # relu saves its output (64 x 256 fp32); the linear saves x and the weight: neither is born in the step
    trace = trace_step(lambda a: layer(a).relu().sum(), x, device_type="cpu", module=layer)
    assert trace.saved == 64 * 256 * 4
    assert trace.grads == block_bytes(256 * 256 * 4) + block_bytes(256 * 4)


@pytest.mark.parametrize(("n", "blocks"), [(0, 0), (1, 512), (512, 512), (513, 1024), (10**6, 1000448)])
def test_block_bytes_rounds_like_the_caching_allocator(n, blocks):
    assert block_bytes(n) == blocks


@pytest.mark.parametrize(
    ("kw", "peak"),
    [
        # the forward with last step's gradients: weights 10 + grads 4 + state 8 + forward 30
        (dict(forward_peak=30, backward_peak=25), Peak(52, "forward", {"forward": 52, "backward": 43,
                                                                      "optimizer step": 26})),
        # a large backward (the logits' gradients): gradients were freed before it, its own are in backward_peak
        (dict(forward_peak=10, backward_peak=40), Peak(58, "backward", {"forward": 32, "backward": 58,
                                                                       "optimizer step": 26})),
        # a tiny step: the optimizer's temporaries decide
        (dict(forward_peak=1, backward_peak=5, step_temp=20), Peak(42, "optimizer step",
                                                                  {"forward": 23, "backward": 23,
                                                                   "optimizer step": 42})),
        # gradient accumulation: the gradients stay through backward, which adds into them
        (dict(forward_peak=10, backward_peak=40, grads_kept=True), Peak(58, "backward",
                                                                       {"forward": 32, "backward": 58,
                                                                        "optimizer step": 26})),
    ],
)
def test_peak_from_parts(kw, peak):
    parts = dict(base=10, grads=4, state=8, step_temp=4, grads_made=4) | kw
    assert peak_from_parts(**parts) == peak


@pytest.mark.parametrize(("name", "group", "n"),
                         [("AdamW", {}, 2), ("Adam", {"amsgrad": True}, 3), ("SGD", {"momentum": 0.0}, 0),
                          ("SGD", {"momentum": 0.9}, 1), ("RMSprop", {"momentum": 0.9, "centered": True}, 3),
                          ("Adagrad", {}, 1), ("Lion", {}, None)])
def test_state_buffers(name, group, n):
    assert state_buffers(name, group) == n


@pytest.mark.parametrize(("impl", "temp"), [("fused", 0), ("foreach", 400), ("single", 600)])
def test_step_temporaries(impl, temp):
    assert step_temporaries(impl, group_bytes=[400, 100], largest=300) == temp


def test_step_temporaries_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="impl='jit'"):
        step_temporaries("jit", [], 0)


@pytest.mark.parametrize(("group", "cuda", "impl"),
                         [({"fused": True}, True, "fused"), ({"foreach": None}, True, "foreach"),
                          ({"foreach": None}, False, "single"), ({"foreach": False}, True, "single"),
                          ({"foreach": None, "differentiable": True}, True, "single")])
def test_implementation(group, cuda, impl):
    assert implementation(group, all_cuda=cuda) == impl


def test_the_forecast_matches_the_state_adamw_creates():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    fc = forecast([opt], "cpu")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    made = {id(t): block_bytes(t.untyped_storage().nbytes()) for s in opt.state.values() for t in s.values()}
    assert fc.state == sum(made.values())
    assert fc.grads == sum(block_bytes(p.grad.nbytes) for p in model.parameters())
    assert fc.step_temp == 2 * 64 * 64 * 4 and fc.unknown == ()  # single-tensor on the CPU: the largest, twice


@pytest.mark.parametrize(
    ("kw", "reason"),
    [({}, None), ({"automatic_optimization": False}, "manual optimization"), ({"compiled": True}, "torch.compile"),
     ({"compiled": "submodule 'model.layers.0' (LlamaDecoderLayer, compiled in place)"},
      "submodule 'model.layers.0' (LlamaDecoderLayer, compiled in place): the compiler decides"),
     ({"sharded": True}, "DTensor"), ({"activation_offload": True}, "ActivationOffload"),
     ({"stateful": "submodule 'acc' (MeanMetric, a torchmetrics Metric)"}, "submodule 'acc' (MeanMetric")],
)
def test_why_not(kw, reason):
    got = why_not(**kw)
    assert got is None if reason is None else reason in got and len(got.splitlines()) == 1


def test_a_module_with_a_torchmetrics_metric_is_not_traced():
    """A traced step would feed fake tensors to the metric's update: the plan says why, and the metric's state is
    left alone."""
    torchmetrics = pytest.importorskip("torchmetrics")
    from lightning_gh.memory.forecast import stateful_part

    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert stateful_part(net) is None
    net.acc = torchmetrics.MeanMetric()
    assert stateful_part(net) == "submodule 'acc' (MeanMetric, a torchmetrics Metric)"


def _in_place(m):
    m[1].compile(backend="eager")
    return m


def _wrapped(m):
    m[1] = torch.compile(m[1], backend="eager")
    return m


@pytest.mark.parametrize(("make", "part"),
                         [(lambda m: m, None), (_in_place, "submodule '1' (Linear, compiled in place)"),
                          (_wrapped, "submodule '1' (Linear, torch.compile)"),
                          (lambda m: torch.compile(m, backend="eager"), "the model (torch.compile)")])
def test_compiled_part_sees_any_submodule_compiled(make, part):
    model = make(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    assert compiled_part(model) == part


# ------------------------------------------------------------------------------------------- SuperOffload's GPU tail
GIB = 2**30


@pytest.mark.parametrize(
    ("args", "kw", "want", "case"),
    [
        # auto: the tail grows until the step's peak reaches the target
        ((30, 0, 100, 60), {}, TailForecast(60, 30, ""), "grows until the step's peak reaches its target"),
        # auto: the whole state fits below the target: weights, gradients in flight, the whole state, activations
        ((30, 0, 20, 60), {}, TailForecast(50, 20, ""), "the whole state (20 B) fits below"),
        # auto: max_gpu_fraction caps the tail below the target
        ((30, 0, 100, 60), {"max_gpu_fraction": 0.1}, TailForecast(40, 10, ""), "max_gpu_fraction=0.1 (10 B) fits"),
        ((30, 20, 100, 60), {"max_gpu_fraction": 0.1}, TailForecast(30, 0, ""), "stays as it is: max_gpu_fraction"),
        # auto: the host plan's minimum tail already puts the step above the target: it stays, nothing grows
        ((70, 25, 100, 60), {}, TailForecast(70, 0, ""), "the host plan's minimum tail (25 B) stays as it is"),
        ((65, 0, 100, 60), {}, TailForecast(65, 0, ""), "no tail stays as it is: the step already reaches"),
        # auto: a minimum tail below the target grows from there
        ((40, 25, 100, 60), {}, TailForecast(60, 20, ""), "45 B of the state's 100 B on the GPU"),
        ((30, 100, 100, 60), {}, TailForecast(30, 0, ""), "is on the GPU from the start"),
        # no GPU memory reading (off CUDA): the auto tail does not grow
        ((30, 0, 100, None), {}, TailForecast(30, 0, ""), "without a GPU memory reading: no tail"),
        # several ranks: all or nothing
        ((30, 0, 100, 60), {"whole_only": True}, TailForecast(30, 0, ""), "each rank keeps its share on the host"),
        ((30, 0, 20, 60), {"whole_only": True}, TailForecast(50, 20, ""), "the whole state (20 B) fits below"),
    ],
)
def test_settle_tail_auto(args, kw, want, case):
    peak, on_gpu, state, target = args
    got = settle_tail("auto", peak=peak, on_gpu=on_gpu, state=state, target=target, **kw)
    assert (got.peak, got.added) == (want.peak, want.added) and case in got.case
    assert got.peak == peak + got.added


@pytest.mark.parametrize(("fraction", "on_gpu", "peak", "added"),
                         [(0.25, 0, 55, 25), (0.25, 25, 30, 0), (0.0, 0, 30, 0), (1.0, 0, 130, 100)])
def test_settle_tail_fixed_fraction_puts_that_share_of_the_state_on_the_gpu(fraction, on_gpu, peak, added):
    got = settle_tail(fraction, peak=30, on_gpu=on_gpu, state=100, target=60)  # a fixed tail ignores the target
    assert (got.peak, got.added) == (peak, added) and got.case.startswith(f"gpu_fraction={fraction}: ")


@pytest.mark.parametrize(("free", "reserved", "limit"),
                         [(60 * GIB, 20 * GIB, 80 * GIB), (3 * GIB, 0, 4 * GIB), (GIB, 5 * GIB, 80 * GIB)])
def test_tail_target_is_where_the_movers_budget_runs_out(monkeypatch, free, reserved, limit):
    """The target is the peak at which the mover's own budget (free memory less its margin) reaches zero."""
    from lightning_gh.superoffload import HeterogeneousAdamW
    from lightning_gh.superoffload import memory as superoffload_memory

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = HeterogeneousAdamW(model.parameters(), module=model, bucket_size=64)
    try:
        monkeypatch.setattr(superoffload_memory, "device_memory_room", lambda dev: (free, limit))
        budget, _ = opt.tail.budget()  # on the CPU: nothing reserved, no step's peak beyond it
        assert tail_target(free, 0, limit) == budget + opt.tail.cast_chunk_bytes()
        assert tail_target(free, reserved, limit) == reserved + budget + opt.tail.cast_chunk_bytes()
    finally:
        opt.close()


def test_read_tail_reads_the_layout():
    from lightning_gh.superoffload import HeterogeneousAdamW
    from lightning_gh.superoffload.tail_mover import tail_bytes

    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4))).to(torch.bfloat16)
    opt = HeterogeneousAdamW(model.parameters(), module=model, bucket_size=32 * 32 + 32, gpu_fraction=0.5)
    try:
        r = read_tail(opt)
        tail = [s for s in opt.layout.slots if s.residency == "device"]
        per_layer = 32 * 32 + 32
        assert sum(s.numel for s in tail) == 2 * per_layer  # the last-arriving half: the first two layers
        assert r.state == tail_bytes(opt.layout.slots) == 4 * per_layer * (8 + 4 + 2)  # moments, master, grad
        assert r.on_gpu == tail_bytes(tail) == r.state // 2
        assert r.tail_grads == r.host_grads == block_bytes(32 * 32 * 2) * 2 + block_bytes(32 * 2) * 2
        host = max(opt.layout.buckets, key=lambda b: b.numel)
        assert r.in_flight >= sum(block_bytes(s.numel * 2) for s in host.slots) > 0
        assert r.step_temp == 4 * 2 * per_layer  # one chunk of fp32 gradient copies: the whole (small) tail
    finally:
        opt.close()


# ---------------------------------------------------------------------------------------------------------- Lightning
class HFModule(L.LightningModule):
    def __init__(self, checkpointing=False, manual=False, data_dependent=False):
        super().__init__()
        self.model = decoder("Llama", checkpointing)
        self.automatic_optimization = not manual
        self.data_dependent = data_dependent
        self.logged = 0

    def training_step(self, batch, batch_idx):
        ids = batch[0][batch[0] > 0].view(batch[0].shape[0], -1)  # reads the batch's values: runs for real
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.data_dependent and loss.item() > 1e9:  # reads an activation's value: no fake tensor can
            loss = loss * 0
        self.log("loss", loss)
        self.logged += 1
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(1, 512, (8, 32))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def fit(tmp_path, module, steps=2, **kw):
    cb = MemoryReport(folder=str(tmp_path), measure_steps=steps, **kw)
    trainer = L.Trainer(max_steps=steps, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        precision="bf16-mixed")
    trainer.fit(module)
    return cb, trainer


def test_the_plan_prints_the_predicted_peak_before_the_first_step(tmp_path, caplog):
    module = HFModule(checkpointing=True)
    with caplog.at_level("INFO", logger="lightning_gh.memory.callback"):
        cb, trainer = fit(tmp_path, module)
    plan = cb.plan
    assert plan.predicted_peak > plan.predicted["activations"] > 0
    assert plan.prediction_note.startswith("peak in the ")
    first = next(r.getMessage() for r in caplog.records if "before the first step" in r.getMessage())
    assert "| CPU | predicted peak |" in first and "| CPU | predicted: activations |" in first
    assert "- predicted peak: peak in the" in first
    data = json.loads((tmp_path / "memory_plan.json").read_text())
    assert data["predicted_peak"] == plan.predicted_peak and data["predicted"]["activations"] > 0
    assert module.logged == 3  # the trace ran training_step once; its self.log did nothing
    assert type(trainer.callback_metrics["loss"]) is torch.Tensor and trainer.global_step == 2


@pytest.mark.parametrize(("kw", "opts", "reason"),
                         [({"manual": True}, {}, "no prediction: manual optimization"),
                          ({"data_dependent": True}, {}, "no prediction: the step does not run on fake tensors: "),
                          ({}, {"predict": False}, "not predicted: MemoryReport(predict=False)")])
def test_the_plan_says_why_there_is_no_prediction(tmp_path, kw, opts, reason):
    cb, _ = fit(tmp_path, HFModule(**kw), steps=1, **opts)
    assert cb.plan.predicted_peak is None and cb.plan.prediction_note.startswith(reason)
    assert f"- predicted peak: {reason}" in cb.plan.table()
    assert len(cb.plan.prediction_note.splitlines()) == 1


class CompiledBlock(L.LightningModule):
    """A tiny model with one block compiled in place, as the fp8 plugins compile the blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        self.blocks[1].compile(backend="eager")

    def training_step(self, batch, batch_idx):
        return self.blocks(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 8)), batch_size=2)


def test_a_block_compiled_in_place_is_not_traced(tmp_path, monkeypatch):
    traced = []
    monkeypatch.setattr(forecast_mod, "trace_training_step", lambda *a, **k: traced.append(a))
    cb = MemoryReport(folder=str(tmp_path), measure_steps=1)
    trainer = L.Trainer(max_steps=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(CompiledBlock())
    assert traced == [] and cb.plan.predicted_peak is None
    assert cb.plan.prediction_note == (
        "no prediction: submodule 'blocks.1' (Linear, compiled in place): the compiler decides what the step saves "
        "for backward, and a trace on fake tensors would compile it again")


def test_the_trace_changes_nothing_real(tmp_path):
    module = HFModule()
    trainer = L.Trainer(max_steps=1, logger=False, accelerator="cpu", precision="bf16-mixed",
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    batch = [torch.randint(0, 512, (2, 32))]
    rng = torch.get_rng_state()
    trace = trace_training_step(trainer, module, batch)
    assert trace.saved > 0 and trace.grads > 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters()) and module.logged == 1
    assert torch.equal(rng, torch.get_rng_state()) and "log" not in module.__dict__


def test_the_gpu_check_predicts_on_the_cpu():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_predict
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    line = memory_predict.run_one("tiny", "bf16-mixed+ckpt", steps=1, device="cpu")
    assert line["predicted_peak"] > 0 and line["measured_peak"] is None and line["note"].startswith("peak in the")
    if not torch.cuda.is_available():
        assert memory_predict.main([]) == 0  # says there is no CUDA device and measures nothing


@pytest.mark.parametrize("own_loss", [False, True])
def test_the_trace_runs_the_strategys_lean_loss_and_holds_what_the_real_step_holds(own_loss):
    """Under a strategy with a loss context (the SuperOffload strategies' lean loss) the traced step is the step that
    runs: on fake tensors the lean loss takes its chunks and holds what the real step holds, and it keeps less for
    the backward than the loss as written."""
    import torch.nn.functional as F

    from lightning_gh.superoffload import SuperOffloadStrategy

    module = HFModule()
    module.model.to(torch.bfloat16)
    if own_loss:  # the module's own cross-entropy over the logits, in fp32
        def step(batch, batch_idx):
            ids = batch[0]
            logits = module.model(input_ids=ids).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        module.training_step = step
    batch = [torch.randint(1, 512, (2, 32))]
    traces = {}
    for lean in (False, True):
        trainer = L.Trainer(max_steps=1, logger=False, accelerator="cpu", precision="bf16-true",
                            strategy=SuperOffloadStrategy(lean_loss=lean), enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)
        trainer.strategy.connect(module)
        trainer.strategy.loss.setup(trainer, module, torch.device("cpu"))
        traces[lean] = trace_training_step(trainer, module, batch)
        loss = trainer.strategy.loss

        def real_step(b, loss=loss):  # as the strategy runs it: the forward and the loss inside its context
            with loss.context():
                return module.training_step(b, 0)

        real = trace_step(real_step, batch, device_type="cpu", fake=False)
        module.zero_grad(set_to_none=True)  # the real trace's gradients: the next trace allocates its own
        for name in ("retained", "forward_peak", "backward_peak", "grads"):
            assert getattr(traces[lean], name) == getattr(real, name), (lean, name)
    # What the backward starts from: the bf16 logits instead of an fp32 log-softmax of them. (On the CPU the lean
    # backward recomputes the log-softmax in fp32 chunks, so its own peak is not lower at this size.)
    assert traces[True].retained < traces[False].retained and traces[True].grads == traces[False].grads > 0
