"""The step-window and rank grammar: examples, errors, and property-based round trips (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gh.profiling.windows import (
    RANKS_GRAMMAR,
    STEPS_GRAMMAR,
    RankSelection,
    StepSchedule,
    StepWindow,
)


@st.composite
def schedules(draw, max_windows: int = 6) -> list[tuple[int, int]]:
    """Sorted, non-overlapping inclusive windows built from positive gaps and lengths."""
    n = draw(st.integers(1, max_windows))
    out, cursor = [], draw(st.integers(0, 50))
    for _ in range(n):
        start = cursor
        stop = start + draw(st.integers(0, 20))
        out.append((start, stop))
        cursor = stop + 1 + draw(st.integers(0, 30))
    return out


def _fmt(windows, sep=",", dash="-", pad="") -> str:
    return sep.join(f"{pad}{a}{pad}" if a == b else f"{pad}{a}{pad}{dash}{pad}{b}{pad}" for a, b in windows)


@settings(max_examples=200, deadline=None)
@given(schedules(), st.randoms(use_true_random=False), st.sampled_from(["", " ", "  "]))
def test_parse_format_round_trip(windows, rnd, pad):
    shuffled = list(windows)
    rnd.shuffle(shuffled)  # order in the string does not matter
    spec = _fmt(shuffled, pad=pad)
    sched = StepSchedule.parse(spec)
    assert [(w.start, w.stop) for w in sched.windows] == windows
    canonical = str(sched)
    assert canonical == _fmt(windows)
    assert str(StepSchedule.parse(canonical)) == canonical  # format(parse(x)) is a fixed point


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(0, 400))
def test_lookup_matches_brute_force(windows, step):
    sched = StepSchedule.parse(_fmt(windows))
    holding = [w for w in windows if w[0] <= step <= w[1]]
    found = sched.window_for(step)
    assert (found.start, found.stop) == holding[0] if holding else found is None
    assert (step in sched) == bool(holding)
    remaining = [w for w in windows if w[1] >= step]
    nxt = sched.next_window(step)
    assert (nxt.start, nxt.stop) == remaining[0] if remaining else nxt is None
    assert sched.last_step == windows[-1][1]


@settings(max_examples=100, deadline=None)
@given(schedules(max_windows=4), st.data())
def test_any_overlap_is_rejected(windows, data):
    a, b = data.draw(st.sampled_from(windows))
    # A window that shares at least one step with (a, b).
    s = data.draw(st.integers(max(0, a - 5), b))
    t = data.draw(st.integers(max(s, a), b + 5))
    with pytest.raises(ValueError, match="overlap") as e:
        StepSchedule.parse(_fmt(windows) + f",{s}-{t}")
    assert STEPS_GRAMMAR in str(e.value)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10_000))
def test_reversed_window_is_rejected(stop, delta):
    with pytest.raises(ValueError, match="reversed") as e:
        StepSchedule.parse(f"{stop + delta}-{stop}")
    assert f"'{stop + delta}-{stop}'" in str(e.value)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("-3", "negative"),
        ("5,-3", "negative"),
        ("a-b", "bad window 'a-b'"),
        ("1-2-3", "bad window '1-2-3'"),
        ("1,,2", "bad window ''"),
        ("10-14,12", "overlap"),
        ("3-3,3", "overlap"),
    ],
)
def test_bad_specs_name_the_part_and_the_grammar(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        StepSchedule.parse(spec)
    assert STEPS_GRAMMAR in str(e.value) and str(e.value).startswith(f"steps={spec!r}: ")
    with pytest.raises(ValueError) as e:
        StepSchedule.parse(spec, where="SelectiveProfiler")
    assert str(e.value).startswith(f"SelectiveProfiler(steps={spec!r}): ")


@pytest.mark.parametrize("spec", [7.0, True, [7], None])
def test_non_string_spec_is_a_type_error(spec):
    with pytest.raises(TypeError, match="expected a string"):
        StepSchedule.parse(spec)  # type: ignore[arg-type]


def test_an_int_is_that_single_step():
    # `steps=7` in Python or `steps: 3` in YAML (jsonargparse hands an int) means that one step.
    assert StepSchedule.parse(7) == StepSchedule.parse("7") and StepSchedule.parse(7).windows == (StepWindow(7, 7),)
    assert StepSchedule.parse(0).windows == (StepWindow(0, 0),)
    with pytest.raises(ValueError, match="negative steps are not allowed"):
        StepSchedule.parse(-1)


def test_examples_from_the_issue():
    assert [(w.start, w.stop) for w in StepSchedule.parse("10-14,50-52").windows] == [(10, 14), (50, 52)]
    assert StepSchedule.parse("7").windows == (StepWindow(7, 7),)
    sched = StepSchedule.parse("10-14,30")
    assert sched.window_for(30) == StepWindow(30, 30) and sched.window_for(15) is None
    assert len(StepWindow(10, 14)) == 5 and str(StepWindow(7, 7)) == "7"


def test_env_override(monkeypatch):
    monkeypatch.setenv("LGH_PROFILE_START_STOP", "3-4")
    assert str(StepSchedule.resolve("10-14", "LGH_PROFILE_START_STOP")) == "3-4"
    monkeypatch.setenv("LGH_PROFILE_START_STOP", "4-3")
    with pytest.raises(ValueError, match="LGH_PROFILE_START_STOP"):
        StepSchedule.resolve("10-14", "LGH_PROFILE_START_STOP")
    monkeypatch.setenv("LGH_PROFILE_START_STOP", "  ")  # blank means unset
    assert str(StepSchedule.resolve("10-14", "LGH_PROFILE_START_STOP")) == "10-14"
    monkeypatch.delenv("LGH_PROFILE_START_STOP")
    assert StepSchedule.resolve(None, "LGH_PROFILE_START_STOP") is None


@settings(max_examples=150, deadline=None)
@given(st.sets(st.integers(0, 63), min_size=1, max_size=6), st.integers(1, 64), st.integers(1, 8))
def test_rank_selection_global_ranks(ranks, world_size, per_node):
    sel = RankSelection.parse(",".join(map(str, sorted(ranks))))
    for g in range(world_size):
        assert sel.selects(global_rank=g, local_rank=g % per_node, world_size=world_size) == (g in ranks)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(0, 7))
def test_rank_selection_all_last_local(world_size, per_node, local):
    all_, last, loc = RankSelection.parse("all"), RankSelection.parse("last"), RankSelection.parse(f"local{local}")
    for g in range(world_size):
        lr = g % per_node
        assert all_.selects(g, lr, world_size)
        assert last.selects(g, lr, world_size) == (g == world_size - 1)
        assert loc.selects(g, lr, world_size) == (lr == local)


@pytest.mark.parametrize("spec", ["", "x", "0,y", "local", "localA", "-1"])
def test_bad_rank_specs(spec):
    with pytest.raises(ValueError) as e:
        RankSelection.parse(spec)
    assert RANKS_GRAMMAR in str(e.value)


def test_a_selection_that_matches_no_process_says_so():
    assert RankSelection.parse("8").unmatched(world_size=4, local_world_size=4) == (
        "`ranks` selects [8], but this run has global ranks 0..3 and local ranks 0..3: no process is selected, "
        "so nothing will be recorded.")
    assert "local3" in RankSelection.parse("local3").unmatched(world_size=4, local_world_size=2)
    for ok in ("0", "3", "local1", "last", "all", "9,local0"):
        assert RankSelection.parse(ok).unmatched(world_size=4, local_world_size=2) is None, ok


def test_profiler_warns_when_its_ranks_select_nothing(tmp_path):
    import lightning as L
    import pytest

    from lightning_gh.demo import LlamaLM, MarkovDataModule
    from lightning_gh.profiling import SelectiveProfiler

    model = LlamaLM.from_preset("tiny")
    prof = SelectiveProfiler(steps="1", ranks="3", output_dir=tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[prof])
    with pytest.warns(UserWarning, match=r"SelectiveProfiler: `ranks` selects \[3\]"):
        trainer.fit(model, MarkovDataModule.for_model(model))
    assert not list(tmp_path.rglob("*.json.gz"))
