"""The lean loss's fused cross-entropy: which path a call takes (a table, CPU), the process-wide override and its
errors, and on a GPU that the two Triton kernels give the chunked path's loss and gradients (to a unit in the last
place of the logits' dtype) for every reduction, ignored and out-of-range targets, dtypes and vocabulary sizes."""

import pytest
import torch
import torch.nn.functional as F

from lightning_gh.activation_offload import fused_ce
from lightning_gh.activation_offload.lean_loss import _LeanCrossEntropy, lean_causal_lm_loss

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF16 = torch.bfloat16

_CUDA = dict(device_type="cuda", dtype=BF16, dims=2, last_stride=1, compiling=False, triton_ok=True)


@pytest.mark.parametrize(("setting", "changes", "expected"), [
    ("auto", {}, "triton"),
    ("triton", {}, "triton"),
    ("torch", {}, "torch"),
    ("auto", {"device_type": "cpu"}, "torch"),
    ("triton", {"device_type": "cpu"}, "torch"),  # Triton runs on GPUs only: CPU logits take the chunks
    ("auto", {"triton_ok": False}, "torch"),
    ("auto", {"dtype": torch.float16}, "triton"),
    ("auto", {"dtype": torch.float32}, "triton"),
    ("auto", {"dtype": torch.float64}, "torch"),
    ("auto", {"dims": 3}, "torch"),
    ("auto", {"last_stride": 2}, "torch"),
    ("auto", {"compiling": True}, "torch"),
    ("auto", {"fake": True}, "torch"),  # a step traced on fake tensors for its memory: no kernel runs
    ("triton", {"fake": True}, "torch"),
])
def test_choose_kernel_table(setting, changes, expected):
    assert fused_ce.choose_kernel(setting, **{**_CUDA, **changes}) == expected


@pytest.mark.parametrize(("changes", "why"), [
    ({"triton_ok": False}, "Triton does not import"),
    ({"dtype": torch.float64}, "torch.float64"),
    ({"last_stride": 3}, "unit stride"),
    ({"compiling": True}, "torch.compile"),
])
def test_a_forced_triton_that_cannot_run_is_an_error(changes, why):
    with pytest.raises(RuntimeError, match=why) as err:
        fused_ce.choose_kernel("triton", **{**_CUDA, **changes})
    assert "LGH_LEAN_LOSS_KERNEL='triton'" in str(err.value)


def test_the_setting_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv("LGH_LEAN_LOSS_KERNEL", raising=False)
    assert fused_ce.setting() == "auto"
    monkeypatch.setenv("LGH_LEAN_LOSS_KERNEL", " Torch ")
    assert fused_ce.setting() == "torch"
    monkeypatch.setenv("LGH_LEAN_LOSS_KERNEL", "cuda")
    with pytest.raises(ValueError, match=r"LGH_LEAN_LOSS_KERNEL='cuda' is not valid; use one of \('auto', "):
        fused_ce.setting()
    with pytest.raises(ValueError, match="'fast' is not valid"):
        fused_ce.choose_kernel("fast", **_CUDA)


def test_cpu_logits_take_the_chunks_even_when_triton_is_forced(monkeypatch):
    """A CPU run never reaches Triton: the loss and gradient are the chunked path's, bitwise HF's."""
    monkeypatch.setenv("LGH_LEAN_LOSS_KERNEL", "triton")
    x = torch.randn(6, 11, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 5, 10])
    assert fused_ce.kernel_for(x) == "torch"
    lean = _LeanCrossEntropy.apply(x, t, -100, None, 4)
    ref = F.cross_entropy(x.detach().clone().requires_grad_(), t)
    (g,) = torch.autograd.grad(lean, x)
    y = x.detach().clone().requires_grad_()
    (h,) = torch.autograd.grad(F.cross_entropy(y, t), y)
    assert torch.allclose(lean, ref) and torch.equal(g, h)


# ------------------------------------------------------------------------------------------------------ on a GPU

def _reference(x, t, ignore, reduction, divisor=None):
    """The chunked path (bitwise autograd's cross_entropy over the fp32 upcast): loss and gradient."""
    y = x.detach().clone().requires_grad_()
    loss = F.cross_entropy(y.float(), t, ignore_index=ignore, reduction=reduction)
    if divisor is not None:
        loss = loss / divisor
    (g,) = torch.autograd.grad(loss, y)
    return loss.detach(), g


def _fused(x, t, ignore, divisor, monkeypatch):
    monkeypatch.setenv("LGH_LEAN_LOSS_KERNEL", "triton")
    y = x.detach().clone().requires_grad_()
    loss = _LeanCrossEntropy.apply(y, t, ignore, divisor, 1 << 30)
    (g,) = torch.autograd.grad(loss * 1.0, y)
    return loss.detach(), g


def _assert_grad_within_an_ulp(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-9), (got - want).abs().max()
        return
    # one unit in the last place of the reference's value (and of the smallest normal, near zero)
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all(), ((got.float() - want.float()).abs() / ulp).max()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "vocab"), [(257, 32000), (64, 151936), (33, 5000), (7, 4096)])
def test_fused_matches_the_chunks_mean_with_ignored_targets(dtype, rows, vocab, monkeypatch):
    g = torch.Generator("cuda").manual_seed(rows + vocab)
    x = (4 * torch.randn(rows, vocab, device="cuda", generator=g)).to(dtype)
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    t[::5] = -100
    want_loss, want_grad = _reference(x, t, -100, "mean")
    got_loss, got_grad = _fused(x, t, -100, None, monkeypatch)
    assert torch.allclose(got_loss, want_loss, rtol=2e-6, atol=0), (got_loss, want_loss)
    _assert_grad_within_an_ulp(got_grad, want_grad)
    assert (got_grad[::5] == 0).all()


@cuda
@pytest.mark.gpu
def test_fused_sum_over_a_divisor_and_a_custom_ignore_index(monkeypatch):
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(100, 32000, device="cuda", generator=g).to(BF16)
    t = torch.randint(0, 32000, (100,), device="cuda", generator=g)
    t[3:9] = 7
    divisor = torch.tensor(37.0, device="cuda")
    want_loss, want_grad = _reference(x, t, 7, "sum", divisor)
    got_loss, got_grad = _fused(x, t, 7, divisor, monkeypatch)
    assert torch.allclose(got_loss, want_loss, rtol=2e-6, atol=0)
    _assert_grad_within_an_ulp(got_grad, want_grad)


@cuda
@pytest.mark.gpu
def test_fused_edge_rows_every_target_ignored_and_a_target_out_of_range(monkeypatch):
    x = torch.randn(4, 1000, device="cuda").to(BF16)
    none = torch.full((4,), -100, device="cuda")
    loss, grad = _fused(x, none, -100, None, monkeypatch)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x.float(), none))  # 0 / 0, as torch's mean
    assert (grad == 0).all()
    bad = torch.tensor([1, 2, 1000, 3], device="cuda")  # torch stops on a device assert here; ours says NaN
    loss, _ = _fused(x, bad, -100, None, monkeypatch)
    assert torch.isnan(loss)
    x[1, :] = float("-inf")
    x[1, 5] = 0.0  # a row of -inf but one entry: the online log-sum-exp stays finite
    loss, grad = _fused(x, torch.tensor([1, 5, 2, 3], device="cuda"), -100, None, monkeypatch)
    want_loss, want_grad = _reference(x, torch.tensor([1, 5, 2, 3], device="cuda"), -100, "mean")
    assert torch.isfinite(loss) and torch.allclose(loss, want_loss, rtol=2e-6)
    _assert_grad_within_an_ulp(grad, want_grad)


@cuda
@pytest.mark.gpu
def test_hf_loss_through_the_fused_path_and_what_it_keeps(monkeypatch):
    """``lean_causal_lm_loss`` (shift, flatten) on bf16 logits: HF's loss and gradient; the backward keeps the
    bf16 logits and four bytes a row, and the forward makes no fp32 copy of the logits."""
    monkeypatch.setenv("LGH_LEAN_LOSS_KERNEL", "triton")
    g = torch.Generator("cuda").manual_seed(2)
    logits = torch.randn(2, 2048, 32000, device="cuda", generator=g).to(BF16).requires_grad_()
    labels = torch.randint(0, 32000, (2, 2048), device="cuda", generator=g)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = lean_causal_lm_loss(logits, labels, 32000)
    peak_fwd = torch.cuda.max_memory_allocated() - base
    (grad,) = torch.autograd.grad(loss, logits)
    fp32 = logits.numel() * 4
    assert peak_fwd < fp32 / 4  # no fp32 copy, nor a bf16 one: the shifted view is already flat rows
    y = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(y[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
    (want,) = torch.autograd.grad(ref, y)
    assert torch.allclose(loss, ref, rtol=2e-6)
    _assert_grad_within_an_ulp(grad, want)


@cuda
@pytest.mark.gpu
def test_fused_takes_strided_rows_and_non_contiguous_targets(monkeypatch):
    """A loss on the last position (``logits[:, -1]``, ``tokens[:, -1]``): rows far apart in memory and targets at a
    stride: the kernels read both where they are (the targets made contiguous first), as the chunks do."""
    monkeypatch.setenv("LGH_LEAN_LOSS_KERNEL", "triton")
    g = torch.Generator("cuda").manual_seed(3)
    big = torch.randn(6, 40, 1000, device="cuda", generator=g).to(BF16)
    tokens = torch.randint(0, 1000, (6, 40), device="cuda", generator=g)
    x, t = big[:, -1], tokens[:, -1]
    assert x.stride() == (40 * 1000, 1) and not t.is_contiguous()
    want_loss, want_grad = _reference(x, t, -100, "mean")
    y = x.detach().requires_grad_()  # the strided view itself, not a contiguous clone
    loss = _LeanCrossEntropy.apply(y, t, -100, None, 1 << 30)
    (grad,) = torch.autograd.grad(loss, y)
    assert torch.allclose(loss, want_loss, rtol=2e-6, atol=0)
    _assert_grad_within_an_ulp(grad, want_grad)
    with pytest.raises(ValueError, match="targets must be contiguous"):
        fused_ce.forward(x, t, -100)
