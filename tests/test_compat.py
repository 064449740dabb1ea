"""The one table of which parts combine (lightning_gh/compat.py), the README's copy of it, and its check at setup."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from lightning_gh import compat

README = Path(__file__).resolve().parents[1] / "README.md"


def test_verdicts_are_symmetric_and_unlisted_pairs_combine():
    for r in compat.RULES:
        assert compat.verdict(r.a, r.b) == compat.verdict(r.b, r.a) == r
        assert r.why
    assert compat.verdict("SelectiveProfiler", "NVTXRangeCallback").combine
    with pytest.raises(ValueError, match=r"compat.verdict\(b='Nope'\): not a lightning_gh part"):
        compat.verdict("fp8", "Nope")


def test_readme_shows_the_same_table():
    assert compat.markdown_table() in README.read_text(), "README's table of combinations is out of date"


class CUDAGraphCapture(L.Callback):  # a stand-in, recognised by name as users' subclasses are
    pass


class ActivationOffload(L.Callback):
    lgh_part = "ActivationOffload"


def test_check_names_both_parts_and_why():
    trainer = L.Trainer(accelerator="cpu", callbacks=[CUDAGraphCapture(), ActivationOffload()], logger=False)
    assert set(compat.parts_in(trainer)) == {"CUDAGraphCapture", "ActivationOffload"}
    with pytest.raises(compat.IncompatiblePartsError,
                       match="CUDAGraphCapture and ActivationOffload cannot be used together: a replayed graph"):
        compat.check(trainer, "ActivationOffload")
    # the same message from the other side
    with pytest.raises(compat.IncompatiblePartsError, match="CUDAGraphCapture and ActivationOffload"):
        compat.check(trainer, "CUDAGraphCapture")
    alone = L.Trainer(accelerator="cpu", callbacks=[ActivationOffload()], logger=False)
    compat.check(alone, "ActivationOffload")
    with pytest.raises(ValueError, match="compat.check\\(part='offload'\\)"):
        compat.check(alone, "offload")


def test_the_demo_consults_the_same_table():
    from lightning_gh.demo.parts import Part, resolve_conflicts

    for rule in compat.RULES:
        parts = resolve_conflicts([Part(rule.a, True, parts=(rule.a,)), Part(rule.b, True, parts=(rule.b,))])
        assert parts[1].enabled is rule.combine, rule
        if not rule.combine:
            assert parts[1].reason == f"off because {rule.a} is on: {rule.why}"
