"""The offload host-cost benchmark's plans and arguments, on the CPU (its runs need a GPU)."""


import pytest
from _benchmarks import load  # benchmarks/<name>.py as a module

bench = load("offload_host_cost")

MIB = 2**20


@pytest.mark.parametrize(
    ("blocks", "budgets", "release_at", "prefetch_at"),
    [
        ((0, 2), (377, 0, 188, 0, 0, 0, 0, 0), (5, 3, 6, 5, 6, 7, 8, 9), (2, 2, 3, 4, 5, 6, 7, 8)),
        ((3, 4), (0, 0, 0, 377, 188, 0, 0, 0), (2, 3, 4, 8, 8, 7, 8, 9), (1, 2, 3, 5, 5, 6, 7, 8)),
    ],
)
def test_fixed_plans_move_the_same_bytes_at_the_budget_plans_points(blocks, budgets, release_at, prefetch_at):
    from lightning_gh.activation_offload.policy import OffloadPlan

    plan = bench.fixed_plan(*blocks, (377, 188))
    assert isinstance(plan, OffloadPlan)
    assert plan.budgets == tuple(b * MIB for b in budgets)
    assert plan.release_at == release_at and plan.prefetch_at == prefetch_at
    assert plan.offloaded_blocks == blocks


def test_without_a_gpu_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--steps", "10"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "names"), [(["--steps", "7"], "--steps=7"), (["--plan-mib", "0", "5"], "--plan-mib")])
def test_bad_arguments_name_the_argument(argv, names, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert names in capsys.readouterr().err
