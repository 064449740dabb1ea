"""When HeterogeneousAdamW speculates: the policy (a pure function of the recent clip/skip decisions, tested as a
table) and runs clipped on every step, on alternate steps, rarely and never, each bitwise equal to
clip_grad_norm_ + torch.optim.AdamW(fused=True) (tolerance: none, every comparison is `torch.equal`), with the
worker following the policy step by step.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_gh.superoffload import HeterogeneousAdamW
from lightning_gh.superoffload.step import SPECULATION_WINDOW, should_speculate
from lightning_gh.superoffload.worker import CpuUpdater

STEPS = 10
CLIP = 0.5
T, F = True, False


@pytest.mark.parametrize(("redone", "speculate"), [
    ([], T),  # nothing known yet: speculate
    ([F], T),
    ([T], F),  # the first step was clipped: wait for the next decision
    ([T, F], F),
    ([T, F, F], T),
    ([T, T, T, T, T, T], F),  # clipped on every step
    ([T, F, T, F, T, F], F),  # alternating: half the speculation would be thrown away
    ([F, F, F, T], T),  # a rare clipped step does not stop it
    ([F, T, F, T], F),
    ([T, T, T, T, F, F], F),  # the norm fell under the threshold: resumes within a window
    ([T, T, T, T, F, F, F], T),
    ([T] * 20 + [F] * SPECULATION_WINDOW, T),  # only the last window counts
])
def test_speculation_policy_table(redone, speculate):
    assert should_speculate(redone) is speculate


def test_speculation_policy_window_argument():
    assert should_speculate([T, F, F, F], window=4) and should_speculate([T, F, F, F], window=1)
    assert not should_speculate([F, F, F, T], window=1)  # window=1: pause after each redone step


PATTERNS = {
    "every": lambda s: True,
    "alternating": lambda s: s % 2 == 0,
    "rare": lambda s: s % 6 == 3,
    "never": lambda s: False,
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def batch(step: int, clipped: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 16, generator=g) * (8.0 if clipped else 0.01)


def train_reference(pattern) -> tuple[nn.Module, torch.optim.AdamW, list[bool]]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    clipped = []
    for step in range(STEPS):
        model(batch(step, pattern(step))).square().mean().backward()
        clipped.append(bool(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP) > CLIP))
        opt.step()
        opt.zero_grad()
    return model, opt, clipped


def train_ours(pattern, rollback: str) -> tuple[nn.Module, HeterogeneousAdamW, list[bool]]:
    """Each speculative update finishes before step() posts the decision (so the rollback path runs every time a
    speculating step is clipped); returns whether each step speculated, as the optimizer reports it."""
    model = make_model()
    opt = HeterogeneousAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=CLIP,
                             module=model, bucket_size=100, rollback=rollback)
    speculated = []
    for step in range(STEPS):
        model(batch(step, pattern(step))).square().mean().backward()
        if opt.updater.will_speculate:
            while not opt.updater.settled:
                time.sleep(0.002)
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        speculated.append(opt.stats["last_speculated"])
    return model, opt, speculated


def assert_same(model_a, opt_a, model_b, opt_b) -> None:
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), (pa - pb).abs().max()
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)
        assert float(sa[k]["step"]) == float(sb[k]["step"])


@pytest.mark.parametrize("rollback", ["auto", "copy"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_clipping_patterns_follow_the_policy_bitwise(monkeypatch, name, rollback):
    pattern = PATTERNS[name]
    backups: list[int] = []
    real_backup = CpuUpdater._backup

    def backup(self, b, phase):
        backups.append(b.index)
        return real_backup(self, b, phase)

    monkeypatch.setattr(CpuUpdater, "_backup", backup)
    ref_model, ref_opt, clipped = train_reference(pattern)
    assert clipped == [pattern(s) for s in range(STEPS)]
    model, opt, speculated = train_ours(pattern, rollback)
    assert_same(ref_model, ref_opt, model, opt)

    expected, history = [], []
    for c in clipped:
        expected.append(should_speculate(history))
        history.append(c)
    assert speculated == expected
    n = len(opt.layout.buckets)
    assert n >= 3 and all(b.speculative for b in opt.layout.buckets)
    wasted = sum(s and c for s, c in zip(expected, clipped))
    st = opt.stats
    assert st["speculated_steps"] == sum(expected) and st["clipped_steps"] == sum(clipped)
    assert st["speculative_buckets"] == n * sum(expected)
    assert st["rollbacks"] == n * wasted  # the redone buckets
    assert st["last_cpu_after_step_ms"] >= 0.0
    if opt.layout.two_copies:
        assert backups == []  # the other copy is the rollback
    else:  # a rollback copy only for steps that speculate (made in the update, or ahead while idle)
        assert len(backups) <= n * (sum(expected) + 1)
    if name == "every":  # only the first step speculated: one rollback copy per bucket, then none
        assert speculated == [True] + [False] * (STEPS - 1) and st["rollbacks"] == n
        assert len(backups) == (0 if opt.layout.two_copies else n)
    opt.close()
