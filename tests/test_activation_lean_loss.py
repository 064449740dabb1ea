"""The lean causal-LM loss: Hugging Face's numbers, less memory, and the budget planner's use of it (CPU)."""

from __future__ import annotations

import contextlib
import copy
import weakref

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from test_activation_budget import HFModule  # the plain LightningModule around an HF causal LM
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_gh.activation_offload import ActivationOffload, offload_activations
from lightning_gh.activation_offload import lean_loss as ll
from lightning_gh.activation_offload.lean_loss import LeanLoss, find_causal_lm, lean_causal_lm_loss

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

KINDS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def _hf(kind="llama", vocab=96, hidden=32, layers=2, seed=0):
    cfg_name, model_name = KINDS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return getattr(transformers, model_name)(cfg)


def _step(model, x, labels, lean, autocast):
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        if lean:
            with LeanLoss(find_causal_lm(model)):
                loss = model(input_ids=x, labels=labels).loss
        else:
            loss = model(input_ids=x, labels=labels).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("chunk_rows", [None, 5], ids=["one-chunk", "chunks-of-5-rows"])
def test_equal_to_hf_loss_and_gradients(kind, autocast, chunk_rows, monkeypatch):
    """Gradients bitwise (each element is computed by the same ops on the same row); the loss bitwise in one chunk
    and within the order of an fp32 sum over several."""
    if chunk_rows is not None:
        monkeypatch.setattr(ll, "CHUNK_BYTES", chunk_rows * 4 * 96)
    plain = _hf(kind)
    lean = copy.deepcopy(plain)
    x = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    labels = x.clone()
    labels[0, :5] = -100  # ignored targets count for nothing in either
    a, ga = _step(plain, x, labels, False, autocast)
    b, gb = _step(lean, x, labels, True, autocast)
    for p, q in zip(ga, gb):
        assert torch.equal(p, q), (p - q).abs().max()
    if chunk_rows is None:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0)
    assert "_loss_function" not in vars(lean)  # transformers' own lookup is back after the forward


@pytest.mark.parametrize("num_items", [None, 37, "tensor"])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_functional_form_matches_for_causal_lm_loss(num_items, chunk_rows):
    """The functions themselves: bf16 logits, shift_labels given or not, ``num_items_in_batch`` (int or tensor)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 11, 50, generator=g).bfloat16()
    labels = torch.randint(0, 50, (2, 11), generator=g)
    labels[1, 3] = -100
    n = torch.tensor(37) if num_items == "tensor" else num_items
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ref = ForCausalLMLoss(a, labels, 50, num_items_in_batch=n)
    got = lean_causal_lm_loss(b, labels, 50, num_items_in_batch=n,
                              chunk_bytes=None if chunk_rows is None else chunk_rows * 4 * 50)
    (ref * 3.0).backward()
    (got * 3.0).backward()
    assert torch.equal(a.grad, b.grad)
    assert b.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ref, got, rtol=2e-6, atol=0)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    c = logits.clone().requires_grad_(True)
    lean_causal_lm_loss(c, None, 50, num_items_in_batch=n, shift_labels=shifted).mul(3.0).backward()
    assert torch.equal(a.grad, c.grad)


def test_bad_chunk_bytes_named():
    with pytest.raises(ValueError, match=r"chunk_bytes=0 must be an int > 0"):
        lean_causal_lm_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 3, chunk_bytes=0)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that the ops inside the mode created and that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def _free(self, n: int) -> None:
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s not in self._seen:
                    self._seen.add(s)
                    self.now += s.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(s, self._free, s.nbytes())
        return out


def test_lean_loss_removes_most_of_the_heads_share_of_the_peak(monkeypatch):
    """Tensor byte accounting over one bf16-autocast step (no CUDA memory statistics on a CPU): the plain loss holds
    about three fp32 copies of the logits at the start of the backward (the saved log-softmax, its gradient and the
    logits' gradient); the lean one the bf16 logits, their bf16 gradient and one chunk's temporaries."""
    batch, seq, vocab = 2, 256, 2000
    fp32_logits = batch * seq * vocab * 4
    monkeypatch.setattr(ll, "CHUNK_BYTES", fp32_logits // 32)  # the GPU default's share on a mid-sized model
    model = _hf("llama", vocab=vocab, hidden=128, layers=4)
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(2))
    peaks = {}
    for lean in (False, True):
        model.zero_grad(set_to_none=False)  # gradients exist before: the peak is the step's own tensors
        with _LiveBytes() as mem:
            _step(model, x, x, lean, autocast=True)
        peaks[lean] = mem.peak
    saved = peaks[False] - peaks[True]
    # Three fp32 copies become two bf16 ones plus ~4/32 of an fp32 copy: ~1.9 fp32 copies less.
    assert saved >= 1.7 * fp32_logits, (peaks, saved / fp32_logits)


def test_find_causal_lm_respects_a_users_own_loss():
    model = _hf("llama")
    assert find_causal_lm(model) is model
    model.loss_function = lambda *a, **k: torch.zeros(())
    assert find_causal_lm(model) is None
    assert find_causal_lm(torch.nn.Linear(2, 2)) is None
    with pytest.raises(TypeError, match=r"causal_lm=Linear has no transformers loss_function hook"):
        LeanLoss(torch.nn.Linear(2, 2))


def test_lean_loss_option_errors_name_the_value():
    with pytest.raises(TypeError,
                       match=r"lean_loss='yes'\): expected None \(the budget planner decides\), True or False"):
        ActivationOffload(lean_loss="yes")
    net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]))
    off = offload_activations(net, policy=0, lean_loss=True, backend="host-copy")
    with pytest.raises(ValueError, match=r"lean_loss=True: Sequential holds no Hugging Face causal LM"):
        off.begin_forward()


def test_lean_loss_true_is_on_in_every_training_forward():
    model = _hf("llama", layers=3)
    ref = copy.deepcopy(model)
    seen = []
    off = offload_activations(model, policy=0, lean_loss=True, backend="host-copy", min_tensor_bytes=1)
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        with off:
            fn = model.loss_function
            seen.append(isinstance(getattr(fn, "__self__", None), LeanLoss) and fn.__func__ is LeanLoss.loss)
            loss = model(input_ids=x, labels=x).loss
        assert "_loss_function" not in vars(model)
        loss.backward()
    ref(input_ids=x, labels=x).loss.backward()
    ref(input_ids=x, labels=x).loss.backward()
    assert seen == [True, True]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def _HFModule(vocab=2000, hidden=64, layers=3):
    return HFModule(model=_hf("llama", vocab=vocab, hidden=hidden, layers=layers))


def _fit(module, callbacks, steps=10, vocab=2000):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(torch.randint(0, vocab, (2 * steps, 64), generator=g), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, deterministic=True)
    trainer.fit(module, data)
    return torch.stack(module.losses)


@pytest.mark.parametrize("module", ["labels", "own-loss"])
def test_budget_planner_takes_the_lean_loss_only_where_the_budget_needs_it(module):
    """A large vocabulary (the head is most of the floor): below the plain head's floor the plan turns the lean loss
    on (gradients bitwise, so the losses of every step equal the plain run's); a generous budget leaves it off. The
    same for a module computing its own loss from the logits (no labels=): the lean loss reaches it too."""
    make = {"labels": _HFModule, "own-loss": _OwnLossModule}[module]
    opts = dict(backend="host-copy", min_tensor_bytes=1, profile_steps=1, bandwidth_gbps=1000.0)
    plain = _fit(make(), [])
    with pytest.raises(ValueError, match=r"below the floor of full recompute plus offload"):
        _fit(make(), [ActivationOffload(budget=0.3, lean_loss=False, **opts)])
    cb = ActivationOffload(budget=0.3, **opts)
    ours = _fit(make(), [cb])
    e, b = cb.engine, cb.engine.budget
    assert e.plan.lean_loss and "lean loss" in e.plan.describe(), e.plan.describe()
    assert b.lean_loss_measured is not None and b.achieved_bytes <= b.budget_bytes * 1.05
    # off CUDA nothing is timed alone: the head's extra time is the measuring step's own
    assert b.lean_loss_measured["head_extra_ms"] == b.lean_loss_measured["head_extra_in_step_ms"]
    assert cb.engine._lean.last_logits is not None and cb.engine._lean.last_logits[1] == 2000
    assert torch.equal(plain, ours), (plain - ours).abs().max()
    loose = ActivationOffload(budget=0.95, **opts)
    _fit(make(), [loose])
    assert not loose.engine.plan.lean_loss, loose.engine.plan.describe()


@pytest.mark.gpu
def test_gpu_lean_loss_matches_hf_and_holds_less_at_the_backward():
    """On CUDA, bf16 autocast, a 32000-token vocabulary in chunks: gradients equal to HF's loss (bitwise where the
    kernels are row-independent), the loss within an fp32 sum's order, and the step's peak lower by most of the
    fp32 copies of the logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    plain = _hf("llama", vocab=32000, hidden=256, layers=2).cuda()
    lean = copy.deepcopy(plain)
    x = torch.randint(0, 32000, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    peaks, out = {}, {}
    for name, model in (("plain", plain), ("lean", lean)):
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16):
            if name == "lean":
                with LeanLoss(find_causal_lm(model)):
                    loss = model(input_ids=x, labels=x).loss
            else:
                loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        out[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    fp32_logits = 4 * 1024 * 32000 * 4
    torch.testing.assert_close(out["plain"][0], out["lean"][0], rtol=1e-5, atol=0)
    worst = max((p - q).abs().max().item() / max(p.abs().max().item(), 1e-30)
                for p, q in zip(out["plain"][1], out["lean"][1]))
    print(f"lean loss on CUDA: peak {peaks['plain'] / 2**20:.0f} -> {peaks['lean'] / 2**20:.0f} MiB "
          f"({(peaks['plain'] - peaks['lean']) / fp32_logits:.2f} x the fp32 logits); largest relative gradient "
          f"difference {worst:.2e}; bitwise: {all(torch.equal(p, q) for p, q in zip(out['plain'][1], out['lean'][1]))}")
    assert worst <= 1e-2  # bf16 gradients: at most a last-bit flip where a kernel summed in another order
    assert peaks["plain"] - peaks["lean"] >= 1.5 * fp32_logits


def test_lean_loss_overhead_is_timed_alone_on_cuda_only():
    from lightning_gh.activation_offload.lean_loss import lean_loss_overhead_ms

    assert lean_loss_overhead_ms(64, 100, torch.float32, torch.device("cpu")) is None
    if not torch.cuda.is_available():
        pytest.skip("the timing needs a CUDA GPU")
    extra = lean_loss_overhead_ms(8192, 32000, torch.bfloat16, torch.device("cuda"))
    assert extra is not None and -1e3 < extra < 1e3  # negative where the lean loss is the faster one


# ------------------------------------------------------------------ a loss of the user's own over the logits

_OWN_LOSSES = {
    "float-then-flatten": lambda lg, x: F.cross_entropy(lg.float().flatten(0, 1), x.flatten()),
    "shift-flatten-float": lambda lg, x: F.cross_entropy(lg[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()),
    "hf-style-contiguous-view-sum": lambda lg, x: torch.nn.CrossEntropyLoss(reduction="sum")(
        lg.float()[..., :-1, :].contiguous().view(-1, lg.shape[-1]), x[:, 1:].reshape(-1)),
    "bf16-view-ignore-index": lambda lg, x: F.cross_entropy(lg.view(-1, lg.shape[-1]), x.view(-1),
                                                            ignore_index=int(x[0, 3])),  # a target that occurs
    "to-float32": lambda lg, x: F.cross_entropy(torch.flatten(lg.to(torch.float32), 0, 1), x.flatten()),
}


def _own_step(model, x, loss_fn, lean, autocast=False):
    ctx = LeanLoss(find_causal_lm(model)) if lean else contextlib.nullcontext()
    with ctx, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = loss_fn(model(input_ids=x).logits, x)
    loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk_rows", [None, 5], ids=["one-chunk", "chunks-of-5-rows"])
@pytest.mark.parametrize("pattern", sorted(_OWN_LOSSES))
def test_own_loss_over_the_logits_runs_lean_with_equal_gradients(pattern, chunk_rows, monkeypatch):
    """Note [A loss of the user's own over the logits]: the user's cross-entropy, reached from the logits through
    shape ops and an upcast, runs as the lean loss; the logits' gradient (hence every parameter's) bitwise, the loss
    bitwise in one chunk."""
    if chunk_rows is not None:
        monkeypatch.setattr(ll, "CHUNK_BYTES", chunk_rows * 4 * 96)
    plain = _hf("llama").to(torch.bfloat16)
    lean = copy.deepcopy(plain)
    x = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    autocast = pattern.startswith("bf16")  # low-precision scores: lean under autocast, which computes in fp32
    a, ga = _own_step(plain, x, _OWN_LOSSES[pattern], False, autocast)
    b, gb = _own_step(lean, x, _OWN_LOSSES[pattern], True, autocast)
    assert type(b.grad_fn).__name__ == "_LeanCrossEntropyBackward", b.grad_fn
    assert type(a.grad_fn).__name__ != "_LeanCrossEntropyBackward"
    if chunk_rows is None:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    assert torch._C._len_torch_function_stack() == 0  # the mode went with the LeanLoss


_NOT_LEAN = {
    "label-smoothing": lambda lg, x: F.cross_entropy(lg.float().flatten(0, 1), x.flatten(), label_smoothing=0.1),
    "class-weights": lambda lg, x: F.cross_entropy(lg.float().flatten(0, 1), x.flatten(), weight=torch.ones(96)),
    "reduction-none": lambda lg, x: F.cross_entropy(lg.float().flatten(0, 1), x.flatten(), reduction="none").mean(),
    "3-d-input": lambda lg, x: F.cross_entropy(lg.float().transpose(1, 2), x),
    "not-a-shape-op": lambda lg, x: F.cross_entropy((lg.float() * 2).flatten(0, 1), x.flatten()),
    "downcast-in-between": lambda lg, x: F.cross_entropy(lg.float().half().float().flatten(0, 1), x.flatten()),
    "bf16-without-autocast": lambda lg, x: F.cross_entropy(lg.flatten(0, 1), x.flatten()),
}


@pytest.mark.parametrize("pattern", sorted(_NOT_LEAN))
def test_own_loss_the_lean_loss_cannot_match_runs_as_written(pattern):
    plain = _hf("llama").to(torch.bfloat16)
    lean = copy.deepcopy(plain)
    x = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    a, ga = _own_step(plain, x, _NOT_LEAN[pattern], False)
    b, gb = _own_step(lean, x, _NOT_LEAN[pattern], True)
    assert type(b.grad_fn).__name__ == type(a.grad_fn).__name__ != "_LeanCrossEntropyBackward"
    assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(ga, gb))


def test_own_loss_under_no_grad_and_after_exit_runs_as_written():
    model = _hf("llama").to(torch.bfloat16)
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    lean = LeanLoss(find_causal_lm(model))
    with lean, torch.no_grad():
        loss = F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), x.flatten())
    assert loss.grad_fn is None
    with lean:
        logits = model(input_ids=x).logits
    assert torch._C._len_torch_function_stack() == 0 and not model._forward_hooks
    loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())  # after the with: as written
    assert type(loss.grad_fn).__name__ == "NllLossBackward0"
    with lean:  # a model called with labels= is left to the loss_function hook
        out = model(input_ids=x, labels=x)
    assert type(out.loss.grad_fn).__name__ == "_LeanCrossEntropyBackward"


@pytest.mark.parametrize("args,kwargs,expected", [
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {}, (-100, "mean")),
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {"reduction": "sum", "ignore_index": 0}, (0, "sum")),
    ((torch.zeros(4, 10),), {"target": torch.zeros(4, dtype=torch.long)}, (-100, "mean")),
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.int32)), {}, None),  # cross_entropy wants int64 targets
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {"reduction": "none"}, None),
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {"weight": torch.ones(10)}, None),
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {"label_smoothing": 0.2}, None),
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {"size_average": False}, None),
    ((torch.zeros(4, 10), torch.zeros(4, 10)), {}, None),  # probabilities as targets
    ((torch.zeros(4, 10), torch.zeros(3, dtype=torch.long)), {}, None),
    ((torch.zeros(2, 4, 10), torch.zeros(2, 10, dtype=torch.long)), {}, None),
    ((torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)), {"bogus": 1}, None),
])
def test_lean_cross_entropy_args_table(args, kwargs, expected):
    assert ll.lean_cross_entropy_args(args, kwargs) == expected


def test_own_loss_lean_holds_less_at_the_backward(monkeypatch):
    """The bytes accounting of the labels test, for a loss of the user's own under bf16 autocast. The user's shifted
    bf16 copy and its fp32 upcast are still made in the forward, where the step's peak now is; the fp32
    log-softmax saved beside them is gone: the peak drops by about one fp32 copy of the logits."""
    batch, seq, vocab = 2, 256, 2000
    fp32_logits = batch * seq * vocab * 4
    monkeypatch.setattr(ll, "CHUNK_BYTES", fp32_logits // 32)
    model = _hf("llama", vocab=vocab, hidden=128, layers=4)
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(2))
    peaks = {}
    for lean in (False, True):
        model.zero_grad(set_to_none=False)
        with _LiveBytes() as mem:
            _own_step(model, x, _OWN_LOSSES["shift-flatten-float"], lean, autocast=True)
        peaks[lean] = mem.peak
    assert peaks[False] - peaks[True] >= 0.85 * fp32_logits, (peaks, (peaks[False] - peaks[True]) / fp32_logits)


class _OwnLossModule(L.LightningModule):
    def __init__(self, vocab=2000, hidden=64, layers=3):
        super().__init__()
        self.model = _hf("llama", vocab=vocab, hidden=hidden, layers=layers)
        self.losses = []

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_own_loss_modified_in_place_or_built_without_grad_runs_as_written():
    """An in-place change of the user's copy would not reach the logits the lean loss reads; a copy made under
    no_grad carries no gradient: both run as written."""
    cases = {
        "in-place scale": lambda lg, x: F.cross_entropy(lg.float().flatten(0, 1).div_(2), x.flatten()),
        "view then clamp_": lambda lg, x: F.cross_entropy(_clamped(lg.float()), x.flatten()),
        "recipe under no_grad": lambda lg, x: F.cross_entropy(_no_grad_copy(lg), x.flatten()),
    }
    for name, fn in cases.items():
        plain = _hf("llama").to(torch.bfloat16)
        lean = copy.deepcopy(plain)
        x = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
        a, ga = _own_step(plain, x, lambda lg, x, fn=fn: fn(lg, x) + lg.float().mean(), False)
        b, gb = _own_step(lean, x, lambda lg, x, fn=fn: fn(lg, x) + lg.float().mean(), True)
        assert "_LeanCrossEntropyBackward" not in str(b.grad_fn.next_functions), name
        assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(ga, gb)), name


def _clamped(f):
    flat = f.flatten(0, 1)
    f.clamp_(max=0.0)  # the base changes after the view was taken
    return flat


def _no_grad_copy(lg):
    with torch.no_grad():
        return lg.float().flatten(0, 1)


def test_own_loss_mode_sits_below_modes_the_step_enters_and_only_where_logits_were_marked():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    model = _hf("llama").to(torch.bfloat16)
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    lean = LeanLoss(find_causal_lm(model))
    with lean:
        user = Count()
        with user:  # a mode around the model call that exits before the LeanLoss does
            logits = model(input_ids=x).logits
        assert torch._C._len_torch_function_stack() == 1  # the user's mode exited by popping itself
        assert type(torch._C._get_function_stack_at(0)).__name__ == "_OwnLossMode"
        calls = user.calls
        loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        assert user.calls == calls and type(loss.grad_fn).__name__ == "_LeanCrossEntropyBackward"
    assert torch._C._len_torch_function_stack() == 0
    fp32 = _hf("llama")  # fp32 logits: nothing to follow, no mode
    with LeanLoss(find_causal_lm(fp32)):
        fp32(input_ids=x)
        assert torch._C._len_torch_function_stack() == 0


def test_own_loss_mode_keeps_no_logits_alive():
    model = _hf("llama").to(torch.bfloat16)
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with LeanLoss(find_causal_lm(model)):
        logits = model(input_ids=x).logits
        up = logits.float().flatten(0, 1)
        ref = weakref.ref(logits)
        del logits, up
        assert ref() is None
