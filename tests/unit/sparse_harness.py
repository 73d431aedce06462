"""Sparse schedules run as the engine runs them (comm/sparse_reduction.py), without the engine:
every rank's ``ScheduleRun`` in one thread, round by round (``rounds``), each round's streams
delivered as its alltoall delivers them (all sends of a round, then the receives in posting
order per peer).

``allreduce_in_rounds(inputs, numel, name, k=..., topology=...)`` returns, per rank, (result,
dropped, bytes sent): ``name`` is a schedule algorithm (not a native one, not auto; for auto,
``comm.sparse_reduction.engine_algorithm`` picks the name first, as DistributedOptimizer does).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from commlayer import kernels
from commlayer.algorithms import sparse
from commlayer.algorithms.sparse.executor import (
    ScheduleRun,
    SparseResult,
    Stream,
    check_stream,
    prepare,
)
from commlayer.comm.sparse_reduction import rounds
from commlayer.common.topology import Topology

Inputs = list[tuple[torch.Tensor, torch.Tensor]]
Outcome = tuple[SparseResult, "SparseResult | None", int]


def allreduce_in_rounds(
    inputs: Inputs, numel: int, name: str, *, k: int = 0, topology: Topology | None = None
) -> list[Outcome]:
    size = len(inputs)
    topology = topology or Topology.flat(size)
    policy = sparse.policy(name)
    runs: list[ScheduleRun] = []
    for r, (indices, values) in enumerate(inputs):
        idx, val = prepare(indices, values, numel)
        schedule = sparse.schedule(name, r, size, numel, topology)
        keep = k if k > 0 else max(idx.numel(), 1)
        runs.append(ScheduleRun(schedule, idx, val, numel, policy, keep, kernels.configured()))
    at = rounds(name, size, numel, topology)
    step_of = [{round_: i for i, round_ in enumerate(at[r])} for r in range(size)]
    sent = [0] * size
    for round_ in range(1 + max((x for rank in at for x in rank), default=-1)):
        mail: dict[tuple[int, int], list[Stream]] = defaultdict(list)
        for r, run in enumerate(runs):
            index = step_of[r].get(round_)
            for t, idx, val in run.outgoing(index) if index is not None else []:
                mail[r, t.peer].append((t, idx, val))
                sent[r] += (0 if idx is None else idx.nbytes) + val.nbytes
        for r, run in enumerate(runs):
            index = step_of[r].get(round_)
            if index is None:
                continue
            streams: list[Stream] = []
            for t in run.steps[index].recvs:
                _, idx, val = mail[t.peer, r].pop(0)
                empty = torch.empty(0, dtype=run.vec.index_dtype)
                streams.append((t, *check_stream(t, empty if idx is None else idx, val, r)))
            run.incoming(index, streams)
    return [(run.finish(), run.dropped, sent[r]) for r, run in enumerate(runs)]
