"""NUMA binding of each SuperOffload rank's CPU threads: the probes on a fake sysfs tree, the decision as a table,
the binding with the facts and ``os.sched_setaffinity`` replaced, the option, and the strategies' hook."""

from __future__ import annotations

import os
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_gh import _util, hardware
from lightning_gh.superoffload import SuperOffloadOptions, SuperOffloadStrategy, numa


def cpus(text: str) -> frozenset[int]:
    return hardware.parse_cpulist(text)


@pytest.mark.parametrize("text, expected", [
    ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
    ("0", {0}),
    ("5-5", {5}),
    ("0-1,\n", {0, 1}),
    ("", set()),
    ("\n", set()),
    ("0-3, 6-7", {0, 1, 2, 3, 6, 7}),
])
def test_parse_cpulist(text, expected):
    assert hardware.parse_cpulist(text) == frozenset(expected)
    if expected:
        assert hardware.parse_cpulist(numa.format_cpulist(frozenset(expected))) == frozenset(expected)


@pytest.mark.parametrize("text", ["a-b", "3-1", "1-2-3", "-1"])
def test_parse_cpulist_refuses_garbage(text):
    with pytest.raises(ValueError, match="cpulist="):
        hardware.parse_cpulist(text)


TWO = {0: cpus("0-7"), 1: cpus("8-15")}
ALL16 = cpus("0-15")
# two nodes of 4 cores with two threads each, Linux's numbering (thread siblings k and k+8)
SMT_NODES = {0: cpus("0-3,8-11"), 1: cpus("4-7,12-15")}
SMT = {c: frozenset({c % 8, c % 8 + 8}) for c in range(16)}


@pytest.mark.parametrize("nodes, node_of_rank, allowed, rank, kw, expected", [
    # one node (or none): nothing to choose
    ({0: ALL16}, {0: 0}, ALL16, 0, {}, None),
    ({}, {0: 0}, ALL16, 0, {}, None),
    ({0: ALL16, 1: frozenset()}, {0: 0}, ALL16, 0, {}, None),  # a node without CPUs (memory only) does not count
    # two nodes, one rank each: the whole node
    (TWO, {0: 0, 1: 1}, ALL16, 0, {}, "0-7"),
    (TWO, {0: 0, 1: 1}, ALL16, 1, {}, "8-15"),
    # every rank on one node while another node's CPUs would sit idle: "auto" leaves the affinity alone
    (TWO, {0: 0, 1: 0}, ALL16, 0, {}, None),
    (TWO, {0: 0, 1: 0}, ALL16, 1, {}, None),
    # two ranks on one node split it (forced here; or with ranks on the other node too): contiguous, disjoint,
    # in local-rank order
    (TWO, {0: 0, 1: 0}, ALL16, 0, {"force": True}, "0-3"),
    (TWO, {0: 0, 1: 0}, ALL16, 1, {"force": True}, "4-7"),
    (TWO, {0: 1, 1: 0, 2: 1}, ALL16, 0, {}, "8-11"),
    (TWO, {0: 1, 1: 0, 2: 1}, ALL16, 2, {}, "12-15"),
    (TWO, {0: 1, 1: 0, 2: 1}, ALL16, 1, {}, "0-7"),
    # near-equal: 8 CPUs over 3 ranks -> 3, 3, 2
    (TWO, {0: 0, 1: 0, 2: 0, 3: 1}, ALL16, 0, {}, "0-2"),
    (TWO, {0: 0, 1: 0, 2: 0, 3: 1}, ALL16, 1, {}, "3-5"),
    (TWO, {0: 0, 1: 0, 2: 0, 3: 1}, ALL16, 2, {}, "6-7"),
    # the process's mask is intersected with the node
    (TWO, {0: 0, 1: 1}, cpus("2-13"), 0, {}, "2-7"),
    (TWO, {0: 0, 1: 0, 2: 1}, cpus("2-13"), 1, {}, "5-7"),
    # the GPU's node unknown, or not a node with CPUs
    (TWO, {0: None, 1: 1}, ALL16, 0, {}, None),
    (TWO, {0: 3}, ALL16, 0, {}, None),
    (TWO, {}, ALL16, 0, {}, None),
    # nothing left: the mask misses the node, or more ranks than cores
    (TWO, {0: 0, 1: 1}, cpus("8-15,16"), 0, {}, None),
    ({0: cpus("0-1"), 1: cpus("2-3")}, {0: 0, 1: 0, 2: 0}, cpus("0-3"), 2, {}, None),
    # already bound within one node by something else: "auto" leaves it, True binds within the mask
    (TWO, {0: 0, 1: 0}, cpus("0-7"), 1, {}, None),
    (TWO, {0: 0, 1: 0}, cpus("0-7"), 1, {"force": True}, "4-7"),
    # hardware threads of one core go to one rank
    (SMT_NODES, {0: 0, 1: 0, 2: 1}, ALL16, 0, {"siblings": SMT}, "0-1,8-9"),
    (SMT_NODES, {0: 0, 1: 0, 2: 1}, ALL16, 1, {"siblings": SMT}, "2-3,10-11"),
    (SMT_NODES, {0: 0, 1: 1}, ALL16, 1, {"siblings": SMT}, "4-7,12-15"),
])
def test_rank_cpus(nodes, node_of_rank, allowed, rank, kw, expected):
    got = numa.rank_cpus(nodes, node_of_rank, allowed, rank, **kw)
    assert got == (None if expected is None else cpus(expected))


def test_rank_cpus_slices_are_disjoint_and_cover_the_node():
    for ranks in range(1, 9):
        node_of_rank = dict.fromkeys(range(ranks), 1)
        slices = [numa.rank_cpus(SMT_NODES, node_of_rank, ALL16, r, siblings=SMT, force=True) for r in range(ranks)]
        got = [s for s in slices if s is not None]
        assert sum(map(len, got)) == len(frozenset().union(*got)) == 8  # disjoint, the whole node
        assert all(len(s) % 2 == 0 for s in got)  # whole cores
        assert len(got) == min(ranks, 4)  # more ranks than cores: the extra ones are left alone


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_numa_nodes_and_siblings_on_a_fake_tree(tmp_path):
    node_root, cpu_root = tmp_path / "node", tmp_path / "cpu"
    write(node_root / "node0" / "cpulist", "0-3,8-11\n")
    write(node_root / "node1" / "cpulist", "4-7,12-15\n")
    write(node_root / "node2" / "cpulist", "\n")  # memory only
    write(node_root / "node3" / "cpulist", "garbage\n")  # unreadable: left out
    write(node_root / "possible", "0-3\n")
    (node_root / "nodeX").mkdir()
    assert hardware.numa_nodes(str(node_root)) == {0: SMT_NODES[0], 1: SMT_NODES[1], 2: frozenset()}
    assert hardware.numa_nodes(str(tmp_path / "absent")) == {}
    for c in range(4):
        write(cpu_root / f"cpu{c}" / "topology" / "thread_siblings_list", f"{c % 2},{c % 2 + 2}\n")
    (cpu_root / "cpufreq").mkdir()
    assert hardware.cpu_siblings(str(cpu_root)) == {0: cpus("0,2"), 1: cpus("1,3"), 2: cpus("0,2"), 3: cpus("1,3")}
    assert hardware.cpu_siblings(str(tmp_path / "absent")) == {}


@pytest.mark.parametrize("bus_id, files, expected", [
    ("0000:1B:00.0", {"0000:1b:00.0": "1\n"}, 1),
    ("00000000:1B:00.0", {"0000:1b:00.0": "0\n"}, 0),  # torch's 8-digit domain, sysfs's 4
    ("0000:1b:00.0", {"0000:1b:00.0": "-1\n"}, None),  # the OS does not place it
    ("0000:1b:00.0", {"0000:3b:00.0": "1\n"}, None),  # no such device
    ("0000:1b:00.0", {"0000:1b:00.0": "x\n"}, None),
])
def test_gpu_numa_node_on_a_fake_tree(tmp_path, monkeypatch, bus_id, files, expected):
    for name, text in files.items():
        write(tmp_path / name / "numa_node", text)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "_pci_bus_id", lambda i: bus_id)
    assert hardware.gpu_numa_node(0, root=str(tmp_path)) == expected


def test_gpu_numa_node_reads_the_address_from_torch(tmp_path, monkeypatch):
    write(tmp_path / "0000:41:00.0" / "numa_node", "1\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for props in (SimpleNamespace(pci_bus_id="00000000:41:00.0"),
                  SimpleNamespace(pci_domain_id=0, pci_bus_id=0x41, pci_device_id=0)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, p=props: p)
        assert hardware.gpu_numa_node(0, root=str(tmp_path)) == 1


def test_gpu_numa_node_without_cuda_is_none(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CPU-only check")
    assert hardware.gpu_numa_node(0, root=str(tmp_path)) is None


@pytest.fixture
def host(monkeypatch):
    """Two nodes of 8 CPUs, GPU i on node i % 2, the affinity calls recorded instead of made."""
    monkeypatch.setattr(numa, "_BOUND", {})
    monkeypatch.setattr(numa, "_ORIGINAL", {})
    _util.reset_warnings("superoffload:numa")
    facts = SimpleNamespace(nodes=dict(TWO), allowed=ALL16, gpu_node=lambda i: i % 2, calls=[], fail=False)
    monkeypatch.setattr(hardware, "numa_nodes", lambda: facts.nodes)
    monkeypatch.setattr(hardware, "cpu_affinity", lambda: facts.allowed)
    monkeypatch.setattr(hardware, "cpu_siblings", lambda: {})
    monkeypatch.setattr(hardware, "gpu_numa_node", lambda i: facts.gpu_node(i))

    def setaffinity(pid, cpus):
        if facts.fail:
            raise OSError(22, "Invalid argument")
        facts.calls.append((pid, frozenset(cpus)))

    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    yield facts
    _util.reset_warnings("superoffload:numa")


@pytest.mark.parametrize("option", ["auto", True])
def test_bind_rank_binds_to_the_gpus_node(host, option):
    assert numa.bind_rank(1, [0, 1], option) == cpus("8-15")
    assert host.calls == [(0, cpus("8-15"))]
    assert numa.bound_cpus() == cpus("8-15")
    assert numa.bind_rank(1, [0, 1], option) == cpus("8-15")  # once per process
    assert len(host.calls) == 1


def test_unbind_gives_the_original_mask_back_and_forgets_the_decision(host):
    assert numa.bind_rank(1, [0, 1], "auto") == cpus("8-15")
    numa.unbind_rank()
    assert host.calls == [(0, cpus("8-15")), (0, ALL16)]
    assert numa.bound_cpus() is None
    assert numa.bind_rank(1, [0, 1], False) is None  # a later run decides anew
    numa.unbind_rank()  # nothing bound: nothing to give back
    assert len(host.calls) == 2


def test_bind_rank_splits_a_shared_node(host):
    assert numa.bind_rank(1, [0, 2], True) == cpus("4-7")  # devices 0 and 2 both on node 0
    assert host.calls == [(0, cpus("4-7"))]


def test_bind_rank_auto_keeps_every_node_busy(host):
    assert numa.bind_rank(1, [0, 2], "auto") is None  # node 1 would host no rank
    assert host.calls == []


@pytest.mark.parametrize("change", ["option_false", "one_node", "unknown_node", "already_bound"])
def test_bind_rank_leaves_the_affinity_alone(host, change):
    option = "auto"
    if change == "option_false":
        option = False
    elif change == "one_node":
        host.nodes = {0: ALL16}
    elif change == "unknown_node":
        host.gpu_node = lambda i: None
    else:
        host.allowed = cpus("0-7")
    assert numa.bind_rank(0, [0, 1], option) is None
    assert host.calls == [] and numa.bound_cpus() is None


def test_bind_rank_true_says_when_the_node_is_unknown(host):
    host.gpu_node = lambda i: None
    with pytest.warns(UserWarning, match="NUMA node of CUDA device 0 is not known"):
        assert numa.bind_rank(0, [0, 1], True) is None
    host.allowed = cpus("0-7")  # True re-slices a process already bound within one node
    numa._BOUND.clear()
    host.gpu_node = lambda i: 0
    assert numa.bind_rank(1, [0, 1], True) == cpus("4-7")


def test_bind_rank_warns_once_when_the_os_refuses(host):
    host.fail = True
    with pytest.warns(UserWarning, match="could not bind local rank 0 to CPUs 0-7 of NUMA node 0"):
        assert numa.bind_rank(0, [0, 1], "auto") is None
    assert numa.bound_cpus() is None


@pytest.mark.parametrize("value, error, match", [
    ("yes", ValueError, r"bind_numa='yes' must be True, False or 'auto'"),
    ("Auto", ValueError, r"bind_numa='Auto' must be True, False or 'auto'"),
    (1, TypeError, r"SuperOffloadOptions\(bind_numa=1\): expected"),
    (None, TypeError, r"SuperOffloadOptions\(bind_numa=None\): expected"),
])
def test_bind_numa_option_is_validated(value, error, match):
    with pytest.raises(error, match=match):
        SuperOffloadOptions(bind_numa=value)
    with pytest.raises(error, match=match):  # the strategy builds the same options
        SuperOffloadStrategy(bind_numa=value)


def test_bind_numa_option_values():
    assert SuperOffloadOptions().bind_numa == "auto"
    assert SuperOffloadOptions(bind_numa=False).bind_numa is False
    assert SuperOffloadStrategy(bind_numa=True).options.bind_numa is True


def test_strategy_hook_binds_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(numa, "bind_rank", lambda *a: calls.append(a) or None)
    opts = SuperOffloadOptions(bind_numa=True)
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    numa.bind_strategy_rank(SimpleNamespace(root_device=cuda[1], parallel_devices=cuda, local_rank=1, options=opts))
    assert calls == [(1, [0, 1], True)]
    calls.clear()
    cpu = torch.device("cpu")
    numa.bind_strategy_rank(SimpleNamespace(root_device=cpu, parallel_devices=[cpu], local_rank=0, options=opts))
    assert calls == []


def test_cpu_trainer_never_binds(tmp_path, monkeypatch):
    from lightning_gh.demo import Llama, MarkovDataModule, preset

    def refuse(*args):
        raise AssertionError("bind_rank called off CUDA")

    monkeypatch.setattr(numa, "bind_rank", refuse)
    called = []
    real = numa.bind_strategy_rank
    monkeypatch.setattr(numa, "bind_strategy_rank", lambda s: called.append(s) or real(s))

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.config = preset("tiny")
            self.model = Llama(self.config)

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1).float(), targets.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    model = Tiny()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="superoffload", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="no GPU memory to relieve"):
        trainer.fit(model, MarkovDataModule.for_model(model, num_train_samples=8))
    assert len(called) == 1 and trainer.global_step == 1


def test_a_bound_rank_counts_its_threads_from_its_own_cpus(monkeypatch):
    import os

    from lightning_gh import hardware
    from lightning_gh.superoffload import numa as numa_mod
    from lightning_gh.superoffload.zero import rank_cpu_threads

    monkeypatch.setattr(hardware, "cpus_available", lambda: 16)
    assert rank_cpu_threads(True, 2) == 6  # unbound: a half of the process's CPUs, less two
    monkeypatch.setitem(numa_mod._BOUND, os.getpid(), frozenset(range(8)))
    assert rank_cpu_threads(True, 2) == 6  # bound to its 8: not halved a second time
    monkeypatch.setitem(numa_mod._BOUND, os.getpid(), frozenset(range(16)))
    assert rank_cpu_threads(True, 2) == 14
