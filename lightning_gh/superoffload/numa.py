"""Each rank's CPU threads on the NUMA node nearest its GPU (``SuperOffloadOptions.bind_numa``).

:func:`rank_cpus` decides (pure, from the facts); :func:`bind_rank` gathers the facts through
:mod:`lightning_gh.hardware`, decides and applies the result to this process with ``os.sched_setaffinity``.

Note [A rank's CPUs near its GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a host with several NUMA nodes a rank's CPU AdamW reads and writes its host state at memory speed, and the
copies to and from its GPU cross the host bridge of the GPU's node. Both are fastest when the rank's threads run
on the CPUs of the GPU's node and its host buffers sit in that node's memory. Linux places a page on the node of
the CPU that first touches it, so binding the threads is enough, provided it happens first:

* the strategy binds each process once, in ``setup_environment`` (the local rank and its device are known,
  nothing of the optimizer exists yet), before any host buffer is allocated and touched and before the CPU thread
  count is read (``rank_cpu_threads`` in :mod:`.zero` reads the process's affinity mask, so it sees the bound set;
  :func:`bound_cpus` says whether this process was bound, and to what);
* threads started after the binding (the CPU update's worker, torch's pool of that thread) inherit the mask;
  threads started before keep theirs, which is why it is the first thing the strategy does;
* ranks whose GPUs share a node split that node's CPUs (those the process may use) into contiguous, disjoint,
  near-equal slices of whole cores, in local-rank order, so two ranks never compete for a core;
* nothing is changed where it would not help or cannot be known: one NUMA node, a GPU whose node the OS does
  not report, an empty share; under ``"auto"`` also a process that something else (``numactl``, the cluster's
  launcher) already bound within one node, and a host where some node would host no rank (its CPUs and memory
  channels would sit idle, while the CPU update is bound by memory bandwidth).

Example::

    >>> nodes = {0: frozenset(range(0, 8)), 1: frozenset(range(8, 16))}
    >>> sorted(rank_cpus(nodes, {0: 0, 1: 1}, frozenset(range(16)), local_rank=1))
    [8, 9, 10, 11, 12, 13, 14, 15]
    >>> sorted(rank_cpus(nodes, {0: 0, 1: 0, 2: 1, 3: 1}, frozenset(range(16)), local_rank=1))
    [4, 5, 6, 7]
    >>> rank_cpus(nodes, {0: 0, 1: 0}, frozenset(range(16)), local_rank=1) is None  # node 1 would sit idle
    True
    >>> rank_cpus({0: frozenset(range(16))}, {0: 0}, frozenset(range(16)), local_rank=0) is None
    True
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_gh import hardware
from lightning_gh._util import warn_once

__all__ = ["bind_rank", "bind_strategy_rank", "bound_cpus", "format_cpulist", "rank_cpus", "unbind_rank"]

log = logging.getLogger(__name__)

# pid -> what bind_rank decided in that process (None: left alone); keyed by pid so a forked child decides anew.
_BOUND: dict[int, frozenset[int] | None] = {}
# pid -> the affinity mask bind_rank replaced (restored by unbind_rank)
_ORIGINAL: dict[int, frozenset[int]] = {}


def format_cpulist(cpus: frozenset[int] | set[int]) -> str:
    """``cpus`` in the Linux cpulist form.

    >>> format_cpulist({0, 1, 2, 3, 8, 10, 11})
    '0-3,8,10-11'
    """
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def rank_cpus(nodes: Mapping[int, frozenset[int]], node_of_rank: Mapping[int, int | None], allowed: frozenset[int],
              local_rank: int, *, siblings: Mapping[int, frozenset[int]] | None = None,
              force: bool = False) -> frozenset[int] | None:
    """The CPUs local rank ``local_rank`` should run on, or ``None`` to leave its affinity alone (see
    Note [A rank's CPUs near its GPU]).

    Args:
        nodes: each NUMA node's CPUs (:func:`lightning_gh.hardware.numa_nodes`).
        node_of_rank: every local rank's GPU's node, ``None`` where unknown.
        allowed: the CPUs this process may use now (its affinity mask).
        local_rank: the rank to decide for.
        siblings: each CPU's hardware threads on its core (:func:`lightning_gh.hardware.cpu_siblings`); a core's
            threads go to one rank. ``None``: every CPU is its own core.
        force: bind even when ``allowed`` already lies within one node, or when a node would host no rank
            (``bind_numa=True``).
    """
    with_cpus = {n: cpus for n, cpus in nodes.items() if cpus}
    node = node_of_rank.get(local_rank)
    if len(with_cpus) < 2 or node is None or node not in with_cpus:
        return None
    if not force and any(allowed <= cpus for cpus in with_cpus.values()):
        return None  # already bound within one node by something else
    used = {n for n in node_of_rank.values() if n is not None}
    if not force and any(cpus & allowed and n not in used for n, cpus in with_cpus.items()):
        return None  # a node's CPUs (and its memory channels) would sit idle: the CPU update needs them more
    pool = with_cpus[node] & allowed
    cores: dict[int, list[int]] = {}
    for c in sorted(pool):
        key = min((siblings or {}).get(c, frozenset()) | {c})
        cores.setdefault(key, []).append(c)
    order = [cores[k] for k in sorted(cores)]
    peers = sorted(r for r, n in node_of_rank.items() if n == node)
    q, extra = divmod(len(order), len(peers))
    i = peers.index(local_rank)
    start = i * q + min(i, extra)
    mine = frozenset(c for core in order[start:start + q + (i < extra)] for c in core)
    return mine or None


def bound_cpus() -> frozenset[int] | None:
    """The CPUs :func:`bind_rank` bound this process to, or ``None`` when it has not bound it."""
    return _BOUND.get(os.getpid())


def bind_rank(local_rank: int, device_indices: Sequence[int], option: bool | str) -> frozenset[int] | None:
    """Bind this process (local rank ``local_rank``) to the CPUs :func:`rank_cpus` chooses near its GPU, once per
    process; returns them, or ``None`` where it left the affinity alone.

    Args:
        local_rank: this process's rank on its host.
        device_indices: the CUDA device index of every local rank, in local-rank order.
        option: ``SuperOffloadOptions.bind_numa``; ``False`` does nothing.
    """
    pid = os.getpid()
    if option is False:
        return None
    if pid in _BOUND:
        return _BOUND[pid]
    nodes = hardware.numa_nodes()
    allowed = hardware.cpu_affinity()
    cpus = node = None
    if allowed is not None and len([n for n, c in nodes.items() if c]) >= 2:
        node_of_rank = {r: hardware.gpu_numa_node(d) for r, d in enumerate(device_indices)}
        node = node_of_rank.get(local_rank)
        cpus = rank_cpus(nodes, node_of_rank, allowed, local_rank, siblings=hardware.cpu_siblings(),
                         force=option is True)
        if cpus is None and option is True and node is None:
            warn_once("superoffload:numa-node", f"SuperOffload bind_numa=True: the NUMA node of CUDA device "
                      f"{device_indices[local_rank]} is not known (the OS reports none), so local rank {local_rank} "
                      "keeps its CPU affinity.")
    if cpus is not None:
        try:
            _ORIGINAL[pid] = allowed
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as err:
            warn_once("superoffload:numa-affinity", f"SuperOffload bind_numa={option!r}: could not bind local rank "
                      f"{local_rank} to CPUs {format_cpulist(cpus)} of NUMA node {node} ({err}); its threads keep "
                      "their CPU affinity.")
            cpus = None
        else:
            log.info("SuperOffload: local rank %d (CUDA device %d) runs on NUMA node %s, CPUs %s.", local_rank,
                     device_indices[local_rank], node, format_cpulist(cpus))
    _BOUND[pid] = cpus
    return cpus


def unbind_rank() -> None:
    """Give this process back the CPU affinity :func:`bind_rank` replaced, and forget the decision (the strategies
    call it in ``teardown``: a later run in the same process decides anew)."""
    pid = os.getpid()
    _BOUND.pop(pid, None)
    original = _ORIGINAL.pop(pid, None)
    if original is not None:
        try:
            os.sched_setaffinity(0, original)
        except (AttributeError, OSError):
            pass  # the binding stays; nothing else depends on it


def bind_strategy_rank(strategy: Any) -> frozenset[int] | None:
    """:func:`bind_rank` for a SuperOffload strategy's process, from its local rank, its devices and its
    ``options.bind_numa``; nothing off CUDA. The strategies call it first in ``setup_environment``."""
    root = strategy.root_device
    devices = list(strategy.parallel_devices or [root])
    if root.type != "cuda" or any(d.type != "cuda" or d.index is None for d in devices):
        return None
    return bind_rank(strategy.local_rank, [d.index for d in devices], strategy.options.bind_numa)
