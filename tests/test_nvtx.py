"""NVTXRangeCallback, verified without a GPU through an NVTX injection library.

NVTX calls go nowhere unless a tool is injected through ``NVTX_INJECTION64_PATH``. The test compiles
``tests/nvtx_inject/inject.c`` (a tool that records every range to a text file) with the system C
compiler, runs short Lightning fits in a subprocess with it injected, and asserts the exact ranges.
The same tests run unchanged on a GPU machine with CUDA torch (where the torch.cuda.nvtx backend is
checked too). Per-range costs are measured and printed (``pytest -s`` or ``-rP``), never asserted.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_gh._util import count_tokens as _count_tokens
from lightning_gh.demo import LlamaLM, MarkovDataModule
from lightning_gh.profiling import _nvtx_backend
from lightning_gh.profiling.nvtx import (
    PHASES,
    NVTXOptions,
    NVTXRangeCallback,
    _default_modules,
    _matching_modules,
    _without_compiled,
)

ROOT = Path(__file__).resolve().parents[1]
INJECT_SRC = ROOT / "tests" / "nvtx_inject" / "inject.c"
TINY = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=16, batch_size=2)
TOKENS = TINY["seq_len"] * TINY["batch_size"]
TORCH_NVTX = hasattr(torch._C, "_nvtx")


# ---------------------------------------------------------------------------- the injected tool


@pytest.fixture(scope="session")
def inject_lib(tmp_path_factory) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler to build the NVTX injection library")
    out = tmp_path_factory.mktemp("nvtx_inject") / "libnvtx_inject.so"
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(out), str(INJECT_SRC), "-lpthread"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"compiling {INJECT_SRC} failed:\n{r.stderr}"
    return out


CHILD = textwrap.dedent(
    r'''
    import gc, json, os, sys, time
    import lightning as L, torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_gh.demo import LlamaLM, MarkovDataModule
    from lightning_gh.profiling.nvtx import NVTXRangeCallback
    from lightning_gh.profiling._nvtx_backend import push_pop_cost_us, select_backend

    TINY = json.loads(sys.argv[1]); out = sys.argv[2]; scenarios = sys.argv[3].split(",")
    accel = "gpu" if torch.cuda.is_available() else "cpu"

    class Boom(LlamaLM):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                raise RuntimeError("boom at step 2")
            return super().training_step(batch, batch_idx)

    class RankPid(L.Callback):
        def setup(self, trainer, pl_module, stage):
            with open(os.path.join(os.path.dirname(out), f"rank{trainer.global_rank}.pid"), "w") as f:
                f.write(str(os.getpid()))

    class Collects(LlamaLM):
        def training_step(self, batch, batch_idx):
            gc.collect()
            return super().training_step(batch, batch_idx)

    def fit(name, cls=LlamaLM, cb_kwargs=None, max_steps=4, val_every=2, ckpt_every=2, accumulate=1):
        torch.manual_seed(0)
        model = cls.from_preset("tiny", overrides=TINY)
        dm = MarkovDataModule.for_model(model, num_train_samples=256, num_val_samples=4)
        cb = NVTXRangeCallback(domain=f"lgh_{name}", **(cb_kwargs or {}))
        callbacks = [cb]
        if ckpt_every:
            callbacks.append(ModelCheckpoint(dirpath=os.path.join(os.path.dirname(out), name), save_top_k=-1,
                                             every_n_train_steps=ckpt_every))
        trainer = L.Trainer(accelerator=accel, devices=1, max_steps=max_steps, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=1 if val_every else 0, val_check_interval=val_every or 1, limit_val_batches=1 if val_every else 0,
                            enable_checkpointing=bool(ckpt_every), accumulate_grad_batches=accumulate,
                            default_root_dir=os.path.dirname(out), callbacks=callbacks)
        t0 = time.perf_counter()
        try:
            trainer.fit(model, dm)
            error = None
        except RuntimeError as e:
            error = str(e)
        return {"backend": cb.backend, "error": error, "wall_s": time.perf_counter() - t0,
                "steps": trainer.global_step}

    results = {}
    for s in scenarios:
        if s == "basic":
            results[s] = fit("basic")
        elif s == "accum":
            results[s] = fit("accum", max_steps=2, val_every=0, ckpt_every=0, accumulate=3)
        elif s == "window":
            results[s] = fit("window", cb_kwargs=dict(steps="1-2"))
        elif s == "modules":
            gc.disable()  # only the collection training_step asks for, so the sequence is exact
            try:
                results[s] = fit("modules", cls=Collects, max_steps=2, val_every=0, ckpt_every=0,
                                 cb_kwargs=dict(module_ranges=["Block", "model.head"], gc_ranges=True))
            finally:
                gc.enable()
        elif s == "raises":
            results[s] = fit("raises", cls=Boom, val_every=0, ckpt_every=0)
        elif s == "cost":
            b = select_backend("lgh_cost")
            results[s] = {"backend": b.name, "tool_attached": b.tool_attached, "push_pop_us": push_pop_cost_us(b)}
        elif s == "ddp":  # two forked ranks; only rank 0 selected (test_ddp_ranks_select_processes)
            torch.manual_seed(0)
            model = LlamaLM.from_preset("tiny", overrides=TINY)
            dm = MarkovDataModule.for_model(model, num_train_samples=256)
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=3, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                limit_val_batches=0, default_root_dir=os.path.dirname(out),
                                callbacks=[NVTXRangeCallback(ranks="0", domain="lgh_ddp"), RankPid()])
            trainer.fit(model, dm)
            results[s] = {"pids": {r: open(os.path.join(os.path.dirname(out), f"rank{r}.pid")).read() for r in (0, 1)}}
    with open(out, "w") as f:
        json.dump(results, f)
    '''
)


def run_child(tmp: Path, scenarios: list[str], inject: Path | None, backend: str | None = None,
              timeout: int = 300) -> tuple[dict, Path]:
    script = tmp / "child.py"
    script.write_text(CHILD)
    out = tmp / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "LGH_NVTX_BACKEND",
                                                             "LGH_NVTX_STEPS", "LGH_NVTX_LOG")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    log = tmp / "nvtx.%p.log"
    if inject is not None:
        env["NVTX_INJECTION64_PATH"] = str(inject)
        env["LGH_NVTX_LOG"] = str(log)
    if backend:
        env["LGH_NVTX_BACKEND"] = backend
    r = subprocess.run([sys.executable, str(script), json.dumps(TINY), str(out), ",".join(scenarios)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text()), tmp


def read_events(tmp: Path) -> list[dict]:
    """Every event the tool recorded in ``tmp``'s logs, as dicts, in file order."""
    events = []
    for path in sorted(tmp.glob("nvtx.*.log")):
        for line in path.read_text().splitlines():
            f = line.split("\t")
            kind, ts, tid = f[0], int(f[1]), int(f[2])
            e = {"kind": kind, "ts": ts, "tid": tid, "domain": f[3], "file": path.name}
            if kind in ("push", "start", "mark"):
                e.update(msg=f[4], msgtype=f[5], category=int(f[6]), color=f[7], payload=f[8])
                if kind == "push":
                    e["depth"] = int(f[9])
                if kind == "start":
                    e["id"] = int(f[9])
            elif kind == "pop":
                e.update(msg=f[4], depth=int(f[5]))
            elif kind == "end":
                e["id"] = int(f[4])
            elif kind == "S":
                e["text"] = f[4]
            elif kind == "C":
                e.update(id=int(f[4]), name=f[5])
            events.append(e)
    return events


def main_ranges(events: list[dict], domain: str) -> list[tuple]:
    """(push, message, payload) / (pop, message) on the thread that pushed the first train_step."""
    ev = [e for e in events if e["domain"] == domain]
    first = next((e for e in ev if e["kind"] == "push" and e["msg"] == "train_step"), None)
    tid = first["tid"] if first else None
    out = []
    for e in ev:
        if e["tid"] != tid:
            continue
        if e["kind"] == "push":
            out.append(("push", e["msg"], e["payload"]))
        elif e["kind"] == "pop":
            out.append(("pop", e["msg"]))
    return out


def pushed(name: str, payload: int | None) -> tuple:
    return ("push", name, "-" if payload is None else f"i64:{payload}")


def rng(name: str, payload: int | None) -> list[tuple]:
    return [pushed(name, payload), ("pop", name)]


def train_step(n: int, accumulate: int = 1, tokens: int = TOKENS, inside_forward: list[tuple] = ()) -> list[tuple]:
    seq = [pushed("train_step", n)]
    for micro in range(accumulate):
        seq += rng("dataloader", n) + [pushed("forward", tokens), *inside_forward, ("pop", "forward")]
        if micro == 0:  # Lightning zeroes the gradients after training_step, on the first micro-batch only
            seq += rng("zero_grad", n)
        seq += rng("backward", n)
    return seq + rng("optimizer_step", n) + [("pop", "train_step")]


# ---------------------------------------------------------------------------- injected runs


@pytest.fixture(scope="module")
def injected(inject_lib, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nvtx_run")
    # one interpreter for every scenario, the two-rank DDP run (forked) last
    results, tmp = run_child(tmp, ["basic", "accum", "window", "modules", "raises", "cost", "ddp"], inject_lib)
    return results, read_events(tmp)


def test_exact_ranges_with_validation_and_checkpoint(injected):
    results, events = injected
    assert results["basic"] == {**results["basic"], "backend": "nvtx", "error": None, "steps": 4}
    # The sanity check validates before step 0. ModelCheckpoint runs after every other callback in
    # on_train_batch_end, and validation after on_train_batch_end: both follow their train_step, outside it.
    expected = (rng("validation", 0) + train_step(0) + train_step(1) + rng("checkpoint", 2) + rng("validation", 2)
                + train_step(2) + train_step(3) + rng("checkpoint", 4) + rng("validation", 4))
    assert main_ranges(events, "lgh_basic") == expected


def test_nesting_styles_and_registered_strings(injected):
    _, events = injected
    ev = [e for e in events if e["domain"] == "lgh_basic"]
    assert [e["kind"] for e in ev if e["kind"] == "D"] == ["D"]  # one dedicated domain
    categories = {e["id"]: e["name"] for e in ev if e["kind"] == "C"}
    registered = Counter(e["text"] for e in ev if e["kind"] == "S")
    assert set(PHASES) <= set(registered) and all(registered[p] == 1 for p in PHASES)
    for e in (e for e in ev if e["kind"] == "push"):
        style = PHASES[e["msg"]]
        assert e["msgtype"] == "registered", e  # no string copy per event
        assert categories[e["category"]] == style.category, e
        assert e["color"] == f"0x{style.color:08x}", e
        # phases sit inside train_step; validation and checkpoint stand alone
        assert e["depth"] == (0 if e["msg"] in ("train_step", "validation", "checkpoint") else 1), e


def test_gradient_accumulation_repeats_forward_backward_inside_one_step(injected):
    results, events = injected
    assert results["accum"]["steps"] == 2
    assert main_ranges(events, "lgh_accum") == train_step(0, accumulate=3) + train_step(1, accumulate=3)


def test_outside_selected_steps_nothing_is_pushed(injected):
    _, events = injected
    # steps="1-2": the checkpoint and validation after step 1 belong to step 1; those after step 3 do not,
    # nor does the sanity check's validation before step 0
    expected = train_step(1) + rng("checkpoint", 2) + rng("validation", 2) + train_step(2)
    assert main_ranges(events, "lgh_window") == expected
    assert not [e for e in events if e["domain"] == "lgh_window" and e["kind"] == "start"]


def test_module_and_gc_ranges(injected):
    _, events = injected
    inside = rng("gc", 2) + [pushed("model.layers.0", 0), ("pop", "model.layers.0"),
                             pushed("model.head", 0), ("pop", "model.head")]
    step1 = [x if x[0] != "push" or x[1] not in ("model.layers.0", "model.head") else pushed(x[1], 1) for x in inside]
    assert main_ranges(events, "lgh_modules") == (train_step(0, inside_forward=inside)
                                                  + train_step(1, inside_forward=step1))
    # Backward ranges are process ranges (they may run on autograd's own thread): each one started is
    # ended, inside that step's backward range.
    ev = [e for e in events if e["domain"] == "lgh_modules"]
    starts = [e for e in ev if e["kind"] == "start"]
    ends = {e["id"]: e for e in ev if e["kind"] == "end"}
    backward = [(p["ts"], q["ts"]) for p, q in zip(
        [e for e in ev if e["kind"] == "push" and e["msg"] == "backward"],
        [e for e in ev if e["kind"] == "pop" and e["msg"] == "backward"])]
    assert len(backward) == 2
    for step, (t0, t1) in enumerate(backward):
        mine = [s for s in starts if t0 <= s["ts"] <= t1]
        assert sorted(s["msg"] for s in mine) == ["model.head (backward)", "model.layers.0 (backward)"]
        for s in mine:
            assert s["payload"] == f"i64:{step}" and s["id"] in ends and ends[s["id"]]["ts"] <= t1


def test_ranges_balanced_when_a_step_raises(injected):
    results, events = injected
    assert results["raises"]["error"] == "boom at step 2"
    seq = main_ranges(events, "lgh_raises")
    assert seq[: len(train_step(0)) * 2] == train_step(0) + train_step(1)
    assert seq[len(train_step(0)) * 2:] == [pushed("train_step", 2), *rng("dataloader", 2), pushed("forward", TOKENS),
                                            ("pop", "forward"), ("pop", "train_step")]
    depth = 0
    for kind, *_ in seq:
        depth += 1 if kind == "push" else -1
        assert depth >= 0
    assert depth == 0


def test_per_range_cost_report(injected, capsys):
    results, events = injected
    cost = results["cost"]
    assert cost["backend"] == "nvtx" and cost["tool_attached"]
    ev = [e for e in events if e["domain"] == "lgh_basic" and e["kind"] in ("push", "start")]
    per_step = sum(1 for e in ev if e["msg"] not in ("validation", "checkpoint")) / results["basic"]["steps"]
    assert per_step == len([x for x in train_step(0) if x[0] == "push"])
    starts = sorted(e["ts"] for e in ev if e["kind"] == "push" and e["msg"] == "train_step")
    step_ms = sorted(b - a for a, b in zip(starts, starts[1:]))[len(starts) // 2 - 1] / 1e6
    overhead_us = per_step * cost["push_pop_us"]
    with capsys.disabled():
        print(f"\n[nvtx] CPU, injected recording tool: {cost['push_pop_us']:.2f} us per range (push+pop); "
              f"{per_step:.0f} ranges per step -> ~{overhead_us:.0f} us per step "
              f"({100 * overhead_us / 1e3 / step_ms:.2f}% of this tiny CPU step of {step_ms:.1f} ms)")


@pytest.mark.skipif(not TORCH_NVTX, reason="torch.cuda.nvtx needs a CUDA build of torch")
def test_torch_backend_ranges(inject_lib, tmp_path):
    results, tmp = run_child(tmp_path, ["basic"], inject_lib, backend="torch")
    assert results["basic"]["backend"] == "torch"
    events = read_events(tmp)
    # torch.cuda.nvtx: the global domain, ASCII messages, no payloads
    ev = [e for e in events if e["domain"] == "" and e["kind"] == "push"]
    assert ev and all(e["msgtype"] == "ascii" and e["payload"] == "-" for e in ev)
    strip = [x if x[0] == "pop" else ("push", x[1], "-") for x in
             (rng("validation", 0) + train_step(0) + train_step(1) + rng("checkpoint", 2) + rng("validation", 2)
              + train_step(2) + train_step(3) + rng("checkpoint", 4) + rng("validation", 4))]
    got = [x if x[0] == "pop" else ("push", x[1], "-") for x in main_ranges(events, "")]
    # torch's pops carry no message in this tool (ASCII messages are not kept): compare pushes and pop count
    assert [x for x in got if x[0] == "push"] == [x for x in strip if x[0] == "push"]
    assert sum(x[0] == "pop" for x in got) == sum(x[0] == "pop" for x in strip)


def test_ddp_ranks_select_processes(injected):
    results, events = injected
    pids = results["ddp"]["pids"]
    assert pids["0"] != pids["1"]
    by_rank = {rank: [e for e in events if e["file"] == f"nvtx.{pid}.log" and e["domain"] == "lgh_ddp"]
               for rank, pid in pids.items()}
    steps = [e["payload"] for e in by_rank["0"] if e["kind"] == "push" and e["msg"] == "train_step"]
    assert steps == ["i64:0", "i64:1", "i64:2"]
    assert by_rank["1"] == []  # rank 1 did not even create the domain


# ---------------------------------------------------------------------------- no tool attached / no backend


def _tiny_fit(tmp_path, callbacks, **kw):
    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny", overrides=TINY)
    dm = MarkovDataModule.for_model(model, num_train_samples=64)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=callbacks, **kw)
    trainer.fit(model, dm)
    return trainer


class _ProfilerProbe(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.patched = "start" in vars(trainer.profiler)


@pytest.mark.skipif(bool(os.environ.get("NVTX_INJECTION64_PATH")), reason="a tool is attached to this process")
def test_no_tool_attached_is_inert_and_cheap(tmp_path, capsys):
    pytest.importorskip("nvtx")
    cb, probe = NVTXRangeCallback(module_ranges=True, gc_ranges=True), _ProfilerProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _tiny_fit(tmp_path, [cb, probe])
    assert not [w for w in caught if "NVTX" in str(w.message)]  # nothing is wrong, so no warning
    assert cb.backend == "nvtx" and not cb.active
    assert probe.patched is False and "start" not in vars(trainer.profiler)
    assert cb._on_gc not in __import__("gc").callbacks
    # what the callback costs per hook when no tool listens: an attribute test and a return
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        cb.on_train_batch_start(trainer, None, None, 0)
    hook_us = (time.perf_counter() - t0) / n * 1e6
    with capsys.disabled():
        print(f"\n[nvtx] CPU, no tool attached: {hook_us * 1e3:.0f} ns per callback hook, 8 hooks per step "
              f"-> ~{8 * hook_us:.2f} us per step")


def test_no_backend_warns_once_and_imports_lazily(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys, warnings
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == 'nvtx':
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import torch
        import lightning as L
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from lightning_gh.profiling.nvtx import NVTXRangeCallback
        cb = NVTXRangeCallback(gc_ranges=True)
        assert 'nvtx' not in sys.modules
        from test_nvtx import _tiny_fit
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            _tiny_fit({str(tmp_path)!r}, [cb])
            _tiny_fit({str(tmp_path)!r}, [NVTXRangeCallback()])
        mine = [str(x.message) for x in w if 'NVTXRangeCallback' in str(x.message)]
        print(cb.backend, len(mine), mine[:1])
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "LGH_NVTX_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    backend, count, *_ = r.stdout.split()
    if TORCH_NVTX:
        assert (backend, count) == ("torch", "0")
    else:
        assert (backend, count) == ("none", "1"), r.stdout
        assert "pip install nvtx" in r.stdout


# ---------------------------------------------------------------------------- arguments and helpers


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(steps="5-2"), ValueError, r"^NVTXRangeCallback\(steps='5-2'\): window '5-2' is reversed"),
        (dict(steps=7.0), TypeError, r"^NVTXRangeCallback\(steps=7.0\): expected"),  # an int is that single step
        (dict(ranks="first"), ValueError, r"^NVTXRangeCallback\(ranks='first'\): bad item"),
        (dict(domain=""), ValueError, r"^NVTXRangeCallback\(domain=''\): expected a non-empty string"),
        (dict(domain=3), TypeError, r"^NVTXRangeCallback\(domain=3\): expected a non-empty string"),
        (dict(module_ranges="Block"), TypeError, r"write \['Block'\]"),
        (dict(module_ranges=[]), ValueError, r"^NVTXRangeCallback\(module_ranges=\[\]\): expected a non-empty list"),
        (dict(module_ranges=3), TypeError, r"^NVTXRangeCallback\(module_ranges=3\): expected True/False or a list"),
        (dict(module_ranges=["Block", 3]), TypeError, r"expected a list of strings"),
        (dict(gc_ranges="yes"), TypeError, r"^NVTXRangeCallback\(gc_ranges='yes'\): expected True or False"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        NVTXRangeCallback(**kwargs)
    with pytest.raises(error, match=match):  # the options alone say the same
        NVTXOptions(**kwargs)


def test_options_or_keywords_never_both():
    opts = NVTXOptions(steps="3-4", module_ranges=["Block"])
    cb = NVTXRangeCallback(options=opts)
    assert cb.options is opts and cb.module_ranges == ("Block",) and cb.steps == "3-4"
    assert NVTXRangeCallback(steps="3-4", module_ranges=("Block",)).options == opts
    with pytest.raises(TypeError, match="both options= and gc_ranges=True"):
        NVTXRangeCallback(gc_ranges=True, options=opts)
    sig = inspect.signature(NVTXRangeCallback).parameters
    for f in dataclasses.fields(NVTXOptions):  # every default stated once, in the dataclass
        assert sig[f.name].default == f.default, f.name
    restored = pickle.loads(pickle.dumps(cb))  # ddp_spawn pickles the callbacks
    assert restored.options == opts and repr(restored) == repr(cb)


def test_steps_env_overrides_and_is_validated(monkeypatch):
    monkeypatch.setenv("LGH_NVTX_STEPS", "3-4")
    assert NVTXRangeCallback(steps="0")._schedule.windows[0].start == 3
    monkeypatch.setenv("LGH_NVTX_STEPS", "x")
    with pytest.raises(ValueError, match="LGH_NVTX_STEPS"):
        NVTXRangeCallback()


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("LGH_NVTX_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"LGH_NVTX_BACKEND='cuda'.*'auto', 'nvtx', 'torch', 'none'"):
        _nvtx_backend.select_backend("d")
    monkeypatch.setenv("LGH_NVTX_BACKEND", "none")
    assert _nvtx_backend.select_backend("d").name == "none"
    monkeypatch.setenv("LGH_NVTX_BACKEND", "torch")
    assert _nvtx_backend.select_backend("d").name == ("torch" if TORCH_NVTX else "none")


def test_default_module_selection_and_patterns():
    model = LlamaLM.from_preset("tiny")
    names = [n for n, _ in _default_modules(model)]
    assert names == ["model", "model.embed", "model.layers.0", "model.layers.1", "model.norm", "model.head"]
    picked = [n for n, _ in _matching_modules(model, ["Block", "*.head"])]
    assert picked == ["model.layers.0", "model.layers.1", "model.head"]
    with pytest.raises(ValueError, match=r"patterns \['Blok'\] match no module of LlamaLM"):
        _matching_modules(model, ["Block", "Blok"])
    kept, dropped = _without_compiled([("model", model.model), ("model._orig_mod.embed", model.model.embed)])
    assert [n for n, _ in kept] == ["model"] and dropped == ["model._orig_mod.embed"]


def test_pickles_without_run_state(tmp_path):

    cb = NVTXRangeCallback(steps="2-3", ranks="0", domain="d", module_ranges=["Block"], gc_ranges=True)
    _tiny_fit(tmp_path, [cb])  # leaves thread-locals and a backend behind
    copy = pickle.loads(pickle.dumps(cb))  # what ddp_spawn does with every callback
    assert repr(copy) == repr(cb) and copy._schedule.windows == cb._schedule.windows
    assert copy.backend == "none" and not copy.active


def test_count_tokens():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert _count_tokens((ids, ids)) == 64
    assert _count_tokens({"input_ids": ids, "labels": ids}) == 64
    assert _count_tokens(torch.zeros(4, 16)) is None
    assert _count_tokens(None) is None


def test_benchmark_suite_runs_on_cpu(inject_lib, tmp_path):
    # Functional run of benchmarks/suites/nvtx.py (timings are the GPU machine's business): every variant
    # is timed, and the tool's log gives each variant's ranges per step.
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "LGH_NVTX_BACKEND",
                                                             "LGH_NVTX_STEPS", "LGH_NVTX_LOG")}
    r = subprocess.run([sys.executable, "benchmarks/run.py", "--suite", "nvtx", "--preset", "tiny", "--iters", "3",
                        "--warmup", "1", "--rounds", "1", "--device", "cpu", "--out", str(tmp_path),
                        "--nvtx-inject", str(inject_lib)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = {row["variant"]: row for row in json.loads((tmp_path / "bench_nvtx.json").read_text())["results"]}
    assert list(rows) == ["plain", "nvtx", "nvtx+modules+gc", "nvtx outside window"]
    assert all(row["error"] is None and len(row["samples_ms"]) == 3 for row in rows.values())
    assert rows["nvtx"]["ranges_per_step"] == 6.0 and rows["nvtx outside window"]["ranges_per_step"] == 0.0
    # + model, embed, 2 blocks, norm, head forward ranges and 2 blocks + head backward ranges
    assert rows["nvtx+modules+gc"]["ranges_per_step"] >= 6 + 6 + 3
    assert rows["nvtx"]["push_pop_us"] > 0


def test_module_ranges_that_match_nothing_fail_at_setup_without_a_tool(tmp_path):
    """A typo in module_ranges fails the first run (no tool attached), naming the value and the module types."""
    cb = NVTXRangeCallback(module_ranges=["NoSuchModule"])
    with pytest.raises(ValueError) as e:
        _tiny_fit(tmp_path, [cb])
    msg = str(e.value)
    assert "module_ranges=['NoSuchModule']" in msg and "NoSuchModule" in msg
    assert "module types are" in msg and "Block" in msg


class _ListeningBackend:
    """Stands in for an NVTX tool: the callback then wraps the profiler like it does under nsys."""

    name, tool_attached, reason = "nvtx", True, ""

    def prepare(self, message, color, category):
        return message

    def push(self, handle, payload=None):
        pass

    def pop(self):
        pass

    def start(self, handle, payload=None):
        return 1

    def end(self, range_id):
        pass


def test_a_reused_trainer_does_not_stack_profiler_wrappers(tmp_path, monkeypatch):
    """Two fits of one Trainer with DataStallDetector and NVTXRangeCallback (tool attached): one wrapper while a fit
    runs, none after, so no wrapper of an earlier fit (holding its callbacks) stays on the profiler."""
    from lightning_gh.profiling import DataStallDetector, _actions
    from lightning_gh.profiling import nvtx as nvtx_mod

    monkeypatch.setattr(nvtx_mod, "select_backend", lambda domain: _ListeningBackend())
    wrapped: list[tuple[int, bool]] = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            d = _actions._DISPATCHERS.get(trainer.profiler)
            # one wrapper on the profiler (ours, the dispatcher), serving both callbacks' watchers
            wrapped.append((len(d.watchers) if d else 0, d is not None and vars(trainer.profiler)["start"] is d.start))

    torch.manual_seed(0)
    model = LlamaLM.from_preset("tiny", overrides=TINY)
    dm = MarkovDataModule.for_model(model, num_train_samples=64)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path,
                        callbacks=[DataStallDetector(window=1, warmup=0), NVTXRangeCallback(), Count()])
    for max_steps in (2, 4):
        trainer.fit_loop.epoch_loop.max_steps = max_steps
        trainer.fit(model, dm)
        assert "start" not in vars(trainer.profiler) and "stop" not in vars(trainer.profiler)
    assert wrapped and all(w == (2, True) for w in wrapped)


def test_an_int_steps_is_that_single_step(monkeypatch):
    from lightning_gh.profiling.nvtx import STEPS_ENV
    from lightning_gh.profiling.windows import StepSchedule

    monkeypatch.delenv(STEPS_ENV, raising=False)
    assert NVTXRangeCallback(steps=7)._schedule == StepSchedule.parse("7")
