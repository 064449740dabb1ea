"""The one-GPU job's benchmark script: its arithmetic and its report, on the CPU (the runs themselves need a GPU)."""

from pathlib import Path

import pytest
from _benchmarks import load  # benchmarks/<name>.py as a module

job = load("one_gpu_job")


@pytest.mark.parametrize(
    ("kw", "billions"),
    [({}, 7.24), ({"vocab": 128256}, 8.03), ({"layers": 20}, 4.62), ({"layers": 46}, 10.29)],
)
def test_param_count_matches_the_published_shapes(kw, billions):
    assert job.param_count(job.Job("superoffload", **kw)) / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize(("shape", "billions"), [("mistral7b", 7.24), ("llama3.1-8b", 8.03), ("qwen2.5-7b", 7.62)])
def test_shape_presets_match_the_published_models(shape, billions):
    arch, hidden, ffn, layers, heads, kv, vocab = job.SHAPES[shape]
    j = job.Job("superoffload", arch=arch, layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv,
                vocab=vocab)
    assert job.param_count(j) / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize(("arch", "conf", "cls"), [("llama", "LlamaConfig", "LlamaForCausalLM"),
                                                   ("qwen2", "Qwen2Config", "Qwen2ForCausalLM")])
def test_param_count_equals_transformers_own_count(arch, conf, cls):
    transformers = pytest.importorskip("transformers")
    j = job.Job("superoffload", arch=arch, layers=2, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=100)
    cfg = getattr(transformers, conf)(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      tie_word_embeddings=False)
    model = getattr(transformers, cls)(cfg)
    assert job.param_count(j) == sum(p.numel() for p in model.parameters())
    built_cls, built_cfg = job.hf_decoder(j)  # what the job builds
    assert built_cls.__name__ == cls
    assert job.param_count(j) == sum(p.numel() for p in built_cls(built_cfg).parameters())


def test_table_reports_ratios_against_the_anchor_and_errors_verbatim():
    rows = [job.Outcome("gpu_bf16_ckpt", params=7_240_000_000, step_ms=2000.0, tokens_per_s=8192.0, mfu=0.36),
            job.Outcome("superoffload", params=7_240_000_000, step_ms=1600.0, tokens_per_s=10240.0, mfu=0.45),
            job.Outcome("deepspeed_offload", params=7_240_000_000, error="exit code -9")]
    text = job.table(rows, "gpu_bf16_ckpt")
    assert "| superoffload | 7.24 | 1600 | 10,240 | 45.0% | 1.25x |" in text
    assert "exit code -9" in text


def test_forecast_is_bound_by_its_slowest_part():
    fc = job.gh200_forecast(1000.0, 7_240_000_000)
    assert fc["step_ms"] == max(fc["gpu_ms"], fc["cpu_update_ms"], fc["link_ms_each_way"])
    assert fc["cpu_update_ms"] == pytest.approx(7.24e9 * 26 / 400e9 * 1e3)


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        job.main(["--steps", "3", "--warmup", "4"])
    assert "--steps=3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("knob", "want"),
    [
        ('ActivationOffload(budget="59GiB")', {"knob_budget": "59GiB", "batch": 4, "seq": 4096}),
        ("at most 11,878 tokens per step (now 16,384)", {"knob_budget": None, "batch": 2, "seq": 4096}),
        ("at most 3,000 tokens per step (now 16,384)", {"knob_budget": None, "batch": 1, "seq": 2944}),
        ("at most 100 tokens per step (now 16,384)", None),
        ("SuperOffloadStrategy(max_gpu_fraction=...)", None),
        ('strategy="superoffload"', None),
    ],
)
def test_the_oom_reports_knob_is_applied_to_the_job(knob, want):
    got = job.apply_knob(job.Job("superoffload", batch=4, seq=4096), knob)
    if want is None:
        assert got is None
    else:
        assert {k: getattr(got, k) for k in want} == want and got.knob == knob


@pytest.mark.parametrize(("rows", "gaps"), [
    ([("gpu_bf16_ckpt", [2.0, 1.0]), ("gpu_bf16_budget", [2.0, 1.1, 0.9])], {"gpu_bf16_budget": (2, 0.1)}),
    ([("gpu_bf16_ckpt", [2.0]), ("gpu_bf16_budget", [])], {}),  # no losses recorded: no gap
    ([("gpu_bf16_budget", [2.0])], {}),  # no anchor row
])
def test_loss_gaps_against_the_anchor(rows, gaps):
    out = job.loss_gaps([job.Outcome(v, losses=losses) for v, losses in rows], "gpu_bf16_ckpt")
    assert out.keys() == gaps.keys()
    for v, (n, gap) in gaps.items():
        assert out[v][0] == n and out[v][1] == pytest.approx(gap)


@pytest.mark.parametrize("writes_row", [True, False])
def test_a_child_killed_after_writing_its_row_keeps_it(tmp_path, monkeypatch, writes_row):
    """A 7B child may outlive the timeout while it gives its pinned memory back: its row counts; without one, an
    error row."""
    import dataclasses
    import json
    import subprocess

    j = job.Job("superoffload", layers=2)

    def fake_run(cmd, timeout, **kwargs):
        out_file = Path(cmd[cmd.index("--child-out") + 1])
        if writes_row:
            out_file.write_text(json.dumps(dataclasses.asdict(job.Outcome("superoffload", params=7, step_ms=2140.0))))
        raise subprocess.TimeoutExpired(cmd, timeout, output=b"steps done\n", stderr=b"")

    monkeypatch.setattr(job.subprocess, "run", fake_run)
    res = job.run_variant(j, tmp_path, 5.0)
    log = (tmp_path / "logs.txt").read_text()
    if writes_row:
        assert res.error is None and res.step_ms == 2140.0
        assert "after writing its row" in res.notes["exit"] and "after writing its row" in log
        assert not list(tmp_path.glob("child-*.json"))  # folded in, as for a child that exits in time
    else:
        assert res.error == "timed out after 5 s" and res.step_ms is None
        assert "steps done" in log


def test_a_spent_wall_budget_leaves_the_variant_as_a_row_that_says_so(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(job, "run_variant", lambda j, out, t: ran.append((j.variant, t)) or job.Outcome(j.variant))
    assert job.main(["--variants", "superoffload", "--wall-budget", "10", "--out", str(tmp_path)]) == 0
    assert ran == []
    text = (tmp_path / "one_gpu_job.md").read_text()
    assert "not run: --wall-budget spent" in text
    assert job.main(["--variants", "superoffload", "--wall-budget", "100", "--timeout", "500",
                     "--out", str(tmp_path)]) == 0
    assert ran and ran[0][0] == "superoffload" and 90 < ran[0][1] <= 100
