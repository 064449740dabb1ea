"""Unified memory: how long scopes and pools live (Note [Managed pools are never destroyed] in
lightning_gh/unified/lifetime.py), and the GPU checks that depend on the state of PyTorch's allocator.

CPU: every managed scope is left on every path out (normal, an exception, a refusal turned into ManagedMemoryError,
a generator closed or dropped), on any thread, nested ones in order, and is listed by ``lifetime.open_scopes()``
meanwhile; a pool refused before routing opens nothing; a pool that fails its routing check keeps its MemPool; at
interpreter exit no kept object is destroyed and a scope left open is named. Without CUDA, ``torch.cuda.use_mem_pool``
is a recorder and the pools get fake MemPools.

GPU (skipped without CUDA): a process whose CUDA graph capture was invalidated exits with 0 and its managed tensors
keep working; a fit that fails leaves no scope open and no hooks on the optimizer; GPU-resident memory drops by the
state's size, measured in a fresh process (in one where an allocation-to-pool context was left open,
``torch.cuda.empty_cache()`` keeps every cached block and the measurement means nothing).
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import textwrap
import threading
import weakref

import lightning as L
import pytest
import torch
from test_unified_memory import GIB, MIB, ROOT, _gpu_fit  # the GPU Trainer run of the memory tests

from lightning_gh.demo import LlamaLM, MarkovDataModule, preset
from lightning_gh.unified import (
    ManagedMemoryError,
    ManagedMemoryOptions,
    ManagedMemoryUnavailable,
    ManagedOptimizerState,
    lifetime,
    shim,
)
from lightning_gh.unified import pool as pool_mod

gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------- CPU: scopes and pool lifetime
# Note [Managed pools are never destroyed] (lightning_gh/unified/lifetime.py): every scope is left on every path
# out, and no MemPool of the package is ever destroyed. Without CUDA, torch.cuda.use_mem_pool is replaced by a
# recorder and the pools get fake MemPools that log each enter and exit with the thread.


class _FakeShim:
    """The shim's per-thread settings and refusal, in Python."""

    path = "fake_lgh_managed.so"

    def __init__(self):
        self.config = dict(prefer_host=1, accessed_by=1, allow_oversubscription=0, headroom_bytes=512 * MIB,
                           populate=1)
        self.refusal = None

    def get_config(self):
        return dict(self.config)

    def set_config(self, *, prefer_host, accessed_by, allow_oversubscription, headroom_bytes, populate=True):
        self.config = dict(prefer_host=int(prefer_host), accessed_by=int(accessed_by),
                           allow_oversubscription=int(allow_oversubscription), headroom_bytes=int(headroom_bytes),
                           populate=int(populate))

    def clear_refusal(self):
        self.refusal = None

    def last_refusal(self):
        return self.refusal

    def pointer_kind(self, ptr):
        return "managed", 0


class _FakeMemPool:
    def __init__(self, *args):
        self.events = []


_INFO = dict(managed_memory=True, concurrent_managed_access=True, pageable_memory_access=False,
             pageable_uses_host_page_tables=False, direct_managed_access_from_host=False)


@pytest.fixture
def recorded_routing(monkeypatch):
    """``torch.cuda.use_mem_pool`` as a recorder: each fake MemPool logs ("enter" | "exit", thread name)."""

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        pool.events.append(("enter", threading.current_thread().name))
        try:
            yield
        finally:
            pool.events.append(("exit", threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert lifetime.open_scopes() == []
    yield
    assert lifetime.open_scopes() == []  # no test leaves a scope behind


def _fake_pool(preferred="cpu"):
    return pool_mod.ManagedPool(torch.device("cuda", 0), preferred, True, _FakeShim(), mempool=_FakeMemPool(),
                                device_info=_INFO)


def _body_normal(pool, opts):
    with pool.scope(opts):
        assert [(s.pool, s.thread_name) for s in lifetime.open_scopes()] == [(repr(pool), "MainThread")]
        assert pool.shim.get_config()["headroom_bytes"] == 7 * MIB  # the scope's settings, for its allocations


def _body_error(pool, opts):
    with pytest.raises(KeyError, match="boom"):
        with pool.scope(opts):
            raise KeyError("boom")


def _body_refused(pool, opts):
    with pytest.raises(ManagedMemoryError, match=r"refused 24.0 MiB"):
        with pool.scope(opts):  # the shim refused a segment inside; PyTorch raised its out-of-memory error
            pool.shim.refusal = shim.Refusal("guard", 24 * MIB, 16 * MIB, 80 * GIB, 0, 7 * MIB, 0, 0, "", False)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")


def _body_generator_closed(pool, opts):
    def gen():
        with pool.scope(opts):
            yield 1

    g = gen()
    next(g)
    assert len(lifetime.open_scopes()) == 1
    g.close()


def _body_generator_dropped(pool, opts):
    def gen():
        with pool.scope(opts):
            yield 1

    g = gen()
    next(g)
    del g  # never resumed: collected, and closed on the way
    gc.collect()


@pytest.mark.parametrize("body", [_body_normal, _body_error, _body_refused, _body_generator_closed,
                                  _body_generator_dropped], ids=lambda f: f.__name__[6:])
def test_a_scope_is_left_on_every_path_out(recorded_routing, body):
    pool = _fake_pool()
    before = pool.shim.get_config()
    body(pool, ManagedMemoryOptions(headroom_bytes=7 * MIB))
    assert pool.mempool.events == [("enter", "MainThread"), ("exit", "MainThread")]
    assert lifetime.open_scopes() == [] and pool.shim.get_config() == before


def test_a_scope_refused_before_routing_opens_nothing(recorded_routing):
    pool = _fake_pool("cpu")
    with pytest.raises(ValueError, match="do not match this pool"):
        with pool.scope(ManagedMemoryOptions(preferred="gpu")):
            pass
    with pytest.raises(ValueError, match="allow_oversubscription=True is honoured only where"):
        with pool.scope(ManagedMemoryOptions(allow_oversubscription=True)):
            pass
    assert pool.mempool.events == [] and pool.shim.get_config()["headroom_bytes"] == 512 * MIB


def test_nested_scopes_unwind_in_order_when_the_inner_one_is_refused(recorded_routing):
    outer, inner = _fake_pool("cpu"), _fake_pool("gpu")
    with pytest.raises(ValueError, match="do not match this pool"):
        with contextlib.ExitStack() as stack:  # how OptimizerStatePlacement enters one scope per device
            stack.enter_context(outer.scope(ManagedMemoryOptions()))
            assert len(lifetime.open_scopes()) == 1
            stack.enter_context(inner.scope(ManagedMemoryOptions()))  # a cpu-pool option on the gpu pool
    assert outer.mempool.events == [("enter", "MainThread"), ("exit", "MainThread")] and inner.mempool.events == []


def test_scopes_are_tracked_per_thread(recorded_routing):
    pool = _fake_pool()
    inside, release = threading.Event(), threading.Event()

    def work():
        with pool.scope(ManagedMemoryOptions()):
            inside.set()
            release.wait(30)

    t = threading.Thread(target=work, name="loader-0")
    t.start()
    assert inside.wait(30)
    assert [(s.pool, s.thread_name) for s in lifetime.open_scopes()] == [(repr(pool), "loader-0")]
    release.set()
    t.join(30)
    assert pool.mempool.events == [("enter", "loader-0"), ("exit", "loader-0")]


def test_a_pool_that_fails_its_routing_check_keeps_its_mempool(monkeypatch, recorded_routing):
    from lightning_gh import hardware

    made = []

    class Allocator:
        def __init__(self, path, alloc, free):
            assert (path, alloc, free) == (_FakeShim.path, "lgh_managed_malloc", "lgh_managed_free")

        def allocator(self):
            return "raw allocator"

    class MemPool(_FakeMemPool):
        def __init__(self, allocator):
            super().__init__()
            made.append(weakref.ref(self))

    @contextlib.contextmanager
    def refusing(pool, device=None):
        raise RuntimeError("MemPool doesn't currently support expandable_segments.")
        yield

    monkeypatch.setattr(hardware, "managed_memory_attributes", lambda index: _INFO)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", Allocator)
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", refusing)
    with pytest.raises(ManagedMemoryUnavailable, match="cannot route allocations to a MemPool while the caching"):
        pool_mod.create_pool(torch.device("cuda", 0), "cpu", True, _FakeShim())
    gc.collect()
    assert len(made) == 1 and made[0]() is not None and any(o is made[0]() for o in lifetime.kept())
    assert isinstance(lifetime.kept()[-2], Allocator)  # the allocator the MemPool points to, kept first
    monkeypatch.setattr(hardware, "managed_memory_attributes", lambda index: dict(_INFO, concurrent_managed_access=False))
    with pytest.raises(ManagedMemoryUnavailable, match="no concurrent managed access"):
        pool_mod.create_pool(torch.device("cuda", 0), "cpu", True, _FakeShim())
    assert len(made) == 1  # refused before any MemPool was made


@pytest.mark.slow
def test_at_exit_no_mempool_is_destroyed_and_open_scopes_are_named():
    code = textwrap.dedent("""
        from lightning_gh.unified import lifetime

        # Loud's methods see their own globals, not __main__'s: the kept object keeps no other object alive.
        ns = {}
        exec("class Loud:\\n"
             "    def __init__(self, name):\\n        self.name = name\\n"
             "    def __del__(self):\\n        print('DESTROYED', self.name, flush=True)\\n", ns)
        lifetime.keep_alive(ns["Loud"]("kept"))
        control = ns["Loud"]("control")  # an ordinary global: destroyed at exit, so the check below can see it
        scope = lifetime.tracked("ManagedPool(fake)")
        scope.__enter__()  # entered by hand, never left
        print("END", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "END" in out.stdout and "DESTROYED control" in out.stdout, out.stdout
    assert "DESTROYED kept" not in out.stdout, out.stdout
    assert ("1 managed_memory() scope(s) still open at exit (ManagedPool(fake) on thread 'MainThread')"
            in out.stderr), out.stderr[-3000:]


# ================================================================================================= GPU


class _MemoryAtTrainEnd(L.Callback):
    """GPU memory in use when training ends, before Lightning's teardown moves the model to the CPU: (driver used,
    allocator allocated, optimizer state bytes, managed pools' allocated bytes)."""

    def on_train_end(self, trainer, pl_module):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        pool_alloc = sum(p.stats().pool_allocated_bytes for p in pool_mod.pools())
        state = sum(t.nbytes for st in trainer.optimizers[0].state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.is_cuda)
        self.figures = (total - free, torch.cuda.memory_allocated(), state, pool_alloc)


def _resident(fit_kwargs, callbacks):
    probe = _MemoryAtTrainEnd()
    model, trainer, _ = _gpu_fit([*callbacks, probe], **fit_kwargs)
    del model, trainer
    gc.collect()
    torch.cuda.empty_cache()
    return probe.figures


def _resident_pair(tmp_path) -> dict:
    """The plain run's and the host-preferred managed run's memory at the end of training, in this process (the
    test below runs it in a fresh one)."""
    # ~110M parameters: 0.9 GB of AdamW moments.
    cfg = preset("small", vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816)
    kw = dict(steps=3, cfg=cfg, tmp_path=tmp_path)
    torch.zeros(1, device="cuda")
    releases = lifetime.empty_cache_releases()
    used_plain, alloc_plain, state_plain, _ = _resident(kw, [])
    used_m, alloc_m, state_m, pool_alloc = _resident(kw, [ManagedOptimizerState("cpu")])
    return dict(empty_cache_releases=releases, used_plain=used_plain, alloc_plain=alloc_plain,
                state_plain=state_plain, used_m=used_m, alloc_m=alloc_m, state_m=state_m, pool_alloc=pool_alloc)


@gpu
def test_gpu_resident_memory_drops_by_the_state_size(tmp_path):
    """Measured in a fresh process: in one where an allocation-to-pool context was left open (a CUDA graph capture
    that CUDA invalidated, earlier in the same pytest run), torch.cuda.empty_cache() keeps every cached block, both
    runs read the same reserved memory and the driver's drop is 0 whatever the pages do (see Note [Managed pools are
    never destroyed] in lightning_gh/unified/lifetime.py)."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import test_unified_lifetime as t
        print("RESULT " + json.dumps(t._resident_pair({str(tmp_path)!r})))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["empty_cache_releases"] is not False, "empty_cache() keeps cached blocks in a fresh process: " + str(r)
    state_plain = r["state_plain"]
    assert r["state_m"] == state_plain and state_plain > 800 * MIB
    drop_driver = r["used_plain"] - r["used_m"]
    counted = r["alloc_m"] - r["alloc_plain"]  # does torch's allocated count include the managed pool's blocks?
    drop_alloc = r["alloc_plain"] - (r["alloc_m"] - r["pool_alloc"] if counted > -state_plain // 2 else r["alloc_m"])
    print(f"state {state_plain / MIB:.0f} MiB; driver used drop {drop_driver / MIB:.0f} MiB; allocator drop "
          f"{drop_alloc / MIB:.0f} MiB; torch counted pool blocks: {counted > -state_plain // 2}; pool allocated "
          f"{r['pool_alloc'] / MIB:.0f} MiB")
    tol = 64 * MIB + state_plain // 50
    assert abs(drop_driver - state_plain) < tol, (drop_driver / MIB, state_plain / MIB)
    assert abs(drop_alloc - state_plain) < tol, (drop_alloc / MIB, state_plain / MIB)


@gpu
def test_the_process_exits_cleanly_after_an_invalidated_capture():
    """A capture that CUDA invalidates (a sync inside it) leaves its allocation-to-pool entry in torch's allocator;
    destroying a MemPool after that aborts the process (INTERNAL ASSERT captures_underway.empty()). The managed
    pools are never destroyed, so the process exits with 0 and the managed tensor still works."""
    code = textwrap.dedent("""
        import torch
        from lightning_gh.unified import is_managed, lifetime, managed_memory

        with managed_memory("cpu"):
            t = torch.ones(1 << 20, device="cuda")
        print("RELEASES_BEFORE", lifetime.empty_cache_releases())
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                (t * 2).sum().item()  # a sync inside the capture: CUDA invalidates it
        except Exception as e:
            print("CAPTURE_FAILED", type(e).__name__)
        print("RELEASES_AFTER", lifetime.empty_cache_releases())
        with managed_memory("gpu"):  # a second pool, made after the failed capture
            u = torch.ones(1 << 20, device="cuda")
        print("SUMS", t.sum().item(), u.sum().item(), is_managed(t), is_managed(u))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "RELEASES_BEFORE False" not in out.stdout and "CAPTURE_FAILED" in out.stdout, out.stdout
    assert "SUMS 1048576.0 1048576.0 True True" in out.stdout, out.stdout
    assert "captures_underway" not in out.stderr and "still open at exit" not in out.stderr, out.stderr[-3000:]


@gpu
def test_a_failed_fit_leaves_no_scope_open_and_no_hooks(tmp_path):
    class Fails(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                raise KeyError("stop here")

    cb = ManagedOptimizerState()
    L.seed_everything(0, verbose=False)
    model = LlamaLM(preset("small", n_layers=2), lr=2e-3, warmup_steps=2)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[cb, Fails()])
    with pytest.raises(KeyError, match="stop here"):
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=4 * 64))
    opt = trainer.optimizers[0]
    assert lifetime.open_scopes() == [] and cb.reports and cb.reports[0].state_bytes > 0
    assert not opt._optimizer_step_post_hooks and "load_state_dict" not in opt.__dict__  # on_exception removed them
