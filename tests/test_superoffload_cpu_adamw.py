"""The CPU AdamW kernel behind SuperOffload's two-copy rollback: bitwise equal to torch's fused CPU AdamW out of
place (never writing its inputs) and in place, with fp32 or bf16 gradients, and steps aside (``None``) where it
cannot be built or checked."""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_gh.superoffload import HeterogeneousAdamW, SuperOffloadOptions, cpu_adamw

needs_cc = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                              reason="needs a C compiler")


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """A private build directory and no kernel loaded yet in this process."""
    monkeypatch.setenv("LGH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_adamw, "_loaded", {})
    yield tmp_path


def assert_each_parameter_is_torchs(before, grad, after, sizes, step, hp, coef):
    """Each parameter's span of ``after`` equals torch's fused AdamW applied to its span of ``before`` with the
    gradient widened to fp32 (and multiplied by ``coef`` when given), bitwise."""
    off = 0
    for size in sizes:
        sl = slice(off, off + size)
        ref = [t[sl].clone() for t in before]
        rg = grad[sl].to(torch.float32, copy=True)
        if coef is not None:
            rg.mul_(coef)
        torch._fused_adamw_([ref[0]], [rg], [ref[1]], [ref[2]], [], [torch.tensor(step)], amsgrad=False,
                            maximize=False, **hp)
        for r, out in zip(ref, after):
            assert torch.equal(r, out[sl])
        off += size


@needs_cc
@pytest.mark.parametrize("sizes", [[4096], [48, 4, 2304, 13], [65536 + 5, 16, 1]])
@pytest.mark.parametrize("coef", [None, 0.25])
def test_update_spans_equals_fused_adamw_bitwise_and_keeps_inputs(sizes, coef):
    k = cpu_adamw.load()
    assert k is not None
    gen = torch.Generator().manual_seed(len(sizes))
    n = sum(sizes)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen)
    src = (p.clone(), m.clone(), v.clone())
    g0 = g.clone()
    dst = tuple(torch.full((n,), float("nan")) for _ in range(3))
    hp = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}
    coef_t = None if coef is None else torch.tensor(coef)
    cpu_adamw.update_spans(k, src, g, dst, sizes, 5.0, hp, coef_t, threads=2)
    # inputs untouched: they are the undo
    assert torch.equal(src[0], p) and torch.equal(src[1], m) and torch.equal(src[2], v) and torch.equal(g, g0)
    assert_each_parameter_is_torchs((p, m, v), g, dst, sizes, 5.0, hp, coef_t)


@needs_cc
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_in_place_and_bf16_gradients_equal_fused_adamw_on_the_fp32_gradient(grad_dtype, threads):
    """In place (the decided updates) and with bf16 gradients (bf16 parameters): the result is torch's fused AdamW
    given the gradient widened to fp32, bitwise, across several chunks and threads and with tails."""
    k = cpu_adamw.load()
    assert k is not None
    sizes = [3 * (1 << 15) + 16, 7, 4096, 1000]
    n = sum(sizes)
    gen = torch.Generator().manual_seed(7)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-3
    g = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
    g0 = g.clone()
    hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8}
    coef = torch.tensor(0.5)
    state = (p.clone(), m.clone(), v.clone())
    cpu_adamw.update_spans(k, state, g, state, sizes, 3.0, hp, coef, threads=threads)
    assert torch.equal(g, g0)
    assert_each_parameter_is_torchs((p, m, v), g, state, sizes, 3.0, hp, coef)


@needs_cc
def test_other_gradient_dtypes_are_refused():
    k = cpu_adamw.load()
    t = torch.zeros(32)
    with pytest.raises(TypeError, match="grad.dtype=torch.float16 must be torch.float32 or torch.bfloat16"):
        cpu_adamw.update_spans(k, (t, t, t), t.half(), (t, t, t), [32], 1.0,
                               {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8}, None, 1)


@needs_cc
def test_built_once_and_cached(fresh_cache):
    k = cpu_adamw.load()
    assert k is not None and k.path.parent == fresh_cache
    assert cpu_adamw.load() is k  # once per process
    built = sorted(fresh_cache.glob("lgh_adamw-*.so"))
    assert built == [k.path]
    assert not [p for p in fresh_cache.iterdir() if p.suffix == ".tmp"]  # built under a private name, renamed


def test_steps_aside_without_a_working_compiler(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    assert cpu_adamw.load() is None
    assert not list(fresh_cache.glob("*.so"))  # nothing half-built left behind


def test_can_be_turned_off(fresh_cache, monkeypatch):
    monkeypatch.setenv("LGH_CPU_ADAMW", "0")
    assert cpu_adamw.load() is None


def test_optimizer_falls_back_to_rollback_copies(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    model = torch.nn.Linear(8, 8)
    opt = HeterogeneousAdamW(model.parameters(), max_grad_norm=1.0, module=model, bucket_size=16)
    model(torch.randn(2, 8)).square().mean().backward()
    opt.step()
    opt.synchronize()
    layout = opt.layout
    assert layout.buckets and layout.kernel is None and not layout.two_copies
    assert all(b.alt_master is None for b in layout.buckets)
    opt.close()


@pytest.mark.parametrize("arch, flags, want", [
    ("x86_64", {"avx2", "fma", "sse4_2"}, ["-mavx2", "-mfma"]),
    ("AMD64", {"avx2", "fma"}, ["-mavx2", "-mfma"]),
    ("x86_64", {"avx2"}, []),
    ("x86_64", set(), []),
    ("aarch64", {"avx2", "fma"}, []),
])
def test_isa_flags(arch, flags, want):
    assert cpu_adamw.isa_flags(arch, frozenset(flags)) == want


def test_rollback_option_is_checked():
    with pytest.raises(ValueError, match=r"rollback='flip' must be 'auto' or 'copy'"):
        SuperOffloadOptions(rollback="flip")
    with pytest.raises(TypeError, match=r"rollback=1\): expected a string, got int"):
        HeterogeneousAdamW(torch.nn.Linear(2, 2).parameters(), rollback=1)


@needs_cc
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 3])  # a span that starts off the vector alignment
def test_weights_only_form_writes_the_steps_weights_and_nothing_else(gdtype, start):
    """The weights-only form (the first pass of Note [Weights first, state after]) writes the weights the in-place
    step writes, in fp32 and cast to bf16 as torch casts (infinities included), and leaves its inputs untouched."""
    k = cpu_adamw.load()
    gen = torch.Generator().manual_seed(7)
    n = 70_000 + 5
    scale = torch.pow(10.0, torch.randint(-6, 3, (n,), generator=gen).float())
    p = torch.randn(n, generator=gen) * scale
    p[start + 100] = float("inf")  # stays inf; the cast keeps it
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-4
    g = (torch.randn(n, generator=gen) * scale.flip(0)).to(gdtype)
    consts = cpu_adamw.step_constants(4.0, 1e-3, 0.9, 0.95, 0.1, 1e-8, 0.37)
    src = tuple(t[start:] for t in (p.clone(), m.clone(), v.clone()))
    before = tuple(t.clone() for t in src)
    w32, w16 = torch.empty(n - start), torch.empty(n - start, dtype=torch.bfloat16)
    k.weights(src, g[start:], w32, consts, threads=2)
    k.weights(src, g[start:], w16, consts, threads=3)
    assert all(torch.equal(a, b) for a, b in zip(src, before))
    k.step(src, g[start:], src, consts, threads=2)
    assert torch.equal(w32, src[0]) and torch.isinf(w32[100])
    assert torch.equal(w16, src[0].to(torch.bfloat16))
    with pytest.raises(TypeError, match=r"out.dtype=torch.float16 must be torch.float32 or torch.bfloat16"):
        k.weights(src, g[start:], w32.half(), consts, threads=1)
    with pytest.raises(ValueError, match=r"all must be equal"):
        k.weights(src, g[start:], w32[1:], consts, threads=1)


def test_stage_ring_grows_for_a_larger_bucket():
    """The staging ring is made anew, larger, when a bucket no longer fits (one made larger since)."""
    from lightning_gh.superoffload.weights_first import StageRing

    ring = StageRing(64, pin=False)
    slot, out = ring.take(16, torch.float32)
    assert slot == 0 and out.numel() == 16 and out.dtype == torch.float32
    ring.copied(slot, None)
    slot, out = ring.take(100, torch.bfloat16)  # 200 bytes: the buffers grow
    assert slot == 1 and out.numel() == 100 and all(b.numel == 200 for b in ring.buffers)
    slot, out = ring.take(50, torch.float32)
    assert slot == 0 and out.numel() == 50
    ring.release()
