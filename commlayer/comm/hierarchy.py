"""Hosts: a process set's ranks grouped by host, so that a bucket is compressed once per host.

On the flat path (communicator.py 1.-3.) every rank compresses its own gradients and every
rank's payload crosses the network: with g ranks a host, g compressions a bucket per host and,
for a gathered payload, g times the bytes on the host's link and g times the records for every
rank to decode. The per-host path (communicator.py 4.), for a process set whose ranks span
several hosts with more than one on some, does instead, per bucket:

1. the ranks of a host sum the bucket uncompressed (``<name>.host``: an allreduce over the
   host's process set, which the engine runs through the shared-memory window, or the
   backend's own path inside a node);
2. one of them, the bucket's leader, compresses the sum: error feedback's residual,
   PowerSGD's warm start and random-k's step counter of the bucket live on the leader only,
   one state a host, under the names the flat path uses;
3. the leaders of all hosts move their payloads as the compressor declares (allreduce,
   allgather or a sparse algorithm), over the process set of the ranks that hold the
   leader's index on their host, ``Average`` dividing by the whole set's ranks (a float16
   payload divided before its sum, as on the flat path), and decompress into the bucket;
4. the leader broadcasts the result inside its host (``<name>.share.<j>``, a broadcast a
   tensor): within a node MPI's broadcast moves each byte once, where an allreduce of the
   result and the others' zeros through the window moved it twice (12 tensors of 2.4 MB at 2
   ranks: 23-32 ms against 49-61 ms, measured on the loaded 2-core VM).

Leaders rotate by bucket, so no rank does every compression: ``assign`` gives each bucket of
the optimizer's plan (the same on every rank) to the local index that leads the fewest bytes
so far; a bucket it was not told of goes by a hash of its name. Only indices below the smallest
host's rank count lead (``HostLayout.leaders``), so every host has every bucket's leader.

State: a rank's ``state_dict`` (DistributedOptimizer's, CommState's) holds the residuals of
the buckets it leads, saved and restored on that rank as on the flat path. A residual is a
rank's delayed part of the sum on either path, so one that a rank keeps but will not apply
(the flat path's from before the plan under ``auto``; one kept as the leader of a bucket
another rank leads since the plan, or since a checkpoint restored on another layout) is added
to its gradient before its host's sum (error feedback's ``take_residual``): delayed, not lost.
Random-k and PowerSGD keep their state under the same names as on the flat path, so a bucket
whose leader never changes draws the positions the flat path draws (``groups=`` fixes buckets,
and so leaders, from the first step).

Process sets: the hosts' sets (of more than one rank) and one set per leading index, made once
per process set for the engine's life and shared by every optimizer on it. Registering a set is
collective over every rank of the job, so ``engine_levels`` is called at DistributedOptimizer
construction, on every rank (the global set: every rank constructs it anyway; another set:
with ``hierarchy`` ``host``, ranks outside it must construct it too, as Horovod's examples do;
``auto`` keeps such a set flat). The sets are not re-registered after an elastic re-formation:
the optimizer then goes flat. The DDP hook makes torch.distributed groups of the same ranks
(integrations/ddp.py).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

from commlayer.comm.communicator import EngineTransport, Transport
from commlayer.compression import AutoCompressor, CompressorBase
from commlayer.compression.base import hierarchy_of, stable_seed
from commlayer.core import runtime
from commlayer.core.process_sets import ProcessSet, global_process_set
from commlayer.core.submit import register_process_set, topology

FLAT, HOST, AUTO = "flat", "host", "auto"


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The ranks of each host (global ranks, ascending), hosts in order of their lowest rank."""

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, ranks: Sequence[int], node_of: Sequence[int]) -> HostLayout:
        """``ranks`` grouped by ``node_of`` (the node of every rank of the job)."""
        by_node: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_node.setdefault(node_of[rank], []).append(rank)
        return cls(tuple(tuple(members) for members in by_node.values()))

    @property
    def size(self) -> int:
        return sum(len(host) for host in self.hosts)

    @property
    def leaders(self) -> int:
        """How many local indices lead buckets: the smallest host's rank count."""
        return min(len(host) for host in self.hosts)

    def pays(self) -> bool:
        """Whether the per-host path differs from the flat one: several hosts, one of them
        with several ranks (one rank a host: each is its host's leader, as on the flat path)."""
        return len(self.hosts) > 1 and any(len(host) > 1 for host in self.hosts)

    def where(self, rank: int) -> tuple[int, int]:
        """(host, index on it) of ``rank``."""
        for h, host in enumerate(self.hosts):
            if rank in host:
                return h, host.index(rank)
        raise ValueError(f"rank {rank} is not in {self.hosts}")

    def host_sets(self) -> list[tuple[int, ...]]:
        """The ranks of each host that has more than one (1. and 4.)."""
        return [host for host in self.hosts if len(host) > 1]

    def leader_sets(self) -> list[tuple[int, ...]]:
        """Per leading index i, the ranks with index i on their host (3.)."""
        return [tuple(sorted(host[i] for host in self.hosts)) for i in range(self.leaders)]


class HostLevels:
    """This rank's transports of the per-host path and who leads which bucket (the
    communicator's ``Levels``)."""

    __slots__ = ("layout", "intra", "across", "local_index", "_assigned", "_load")

    def __init__(
        self,
        layout: HostLayout,
        rank: int,
        intra: Transport | None,
        across: Transport | None,
    ) -> None:
        """``rank``: this process's global rank; ``intra``: its host's transport (None when
        alone on it); ``across``: its leading index's (None when its index leads nothing)."""
        self.layout = layout
        self.local_index = layout.where(rank)[1]
        self.intra = intra
        self.across = across
        self._assigned: dict[str, int] = {}
        self._load = [0] * layout.leaders  # bytes assigned to each leading index

    def __repr__(self) -> str:
        return f"HostLevels(hosts={self.layout.hosts}, local_index={self.local_index})"

    def leader(self, name: str) -> int:
        """The local index whose rank compresses bucket ``name`` on every host (its rank in the
        host's transport: a host's ranks are in ascending order there too)."""
        found = self._assigned.get(name)
        return found if found is not None else stable_seed(name) % self.layout.leaders

    def assign(self, buckets: Sequence[tuple[str, int]]) -> None:
        """Each (name, bytes), in order, to the index leading the fewest bytes so far (the
        lowest on a tie): call it alike on every rank (the optimizer's plan)."""
        for name, nbytes in buckets:
            if name in self._assigned:
                continue
            index = min(range(len(self._load)), key=lambda i: (self._load[i], i))
            self._assigned[name] = index
            self._load[index] += nbytes


def compresses(compressor: CompressorBase) -> bool:
    """Whether a bucket given ``compressor`` can be compressed (auto may pick a compressor)."""
    return isinstance(compressor, AutoCompressor) or not compressor.identity


def mode(compressor: CompressorBase, setting: str, whole_job: bool) -> str:
    """``flat``, ``host`` or ``auto`` for ``compressor``'s buckets: its spec's ``hierarchy=``,
    else the setting; ``auto`` is ``flat`` on a process set other than the global one (the
    sets would be registered at construction, which ranks outside it may not reach), and for
    a compressor that compresses nothing."""
    if not compresses(compressor):
        return FLAT
    chosen = hierarchy_of(compressor, setting)
    return FLAT if chosen == AUTO and not whole_job else chosen


# Per engine (a new init() makes a new one): the sets registered so far, by their ranks.
_registered: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], ProcessSet]] = (
    weakref.WeakKeyDictionary()
)


def _process_set(ranks: tuple[int, ...]) -> ProcessSet:
    """The registered set of ``ranks`` (collective over every rank the first time)."""
    known = _registered.setdefault(runtime.engine(), {})
    found = known.get(ranks)
    if found is None:
        found = ProcessSet(ranks)
        found.process_set_id = register_process_set(found.ranks)
        known[ranks] = found
    return found


def engine_levels(
    process_set: ProcessSet = global_process_set,
    sparse_algorithm: str = "allgather",
    prefix: str = "",
) -> HostLevels | None:
    """The per-host path's levels of ``process_set`` over commlayer's engine, its hosts from
    the job's topology (COMMLAYER_TOPOLOGY or the detected nodes); None where its layout does
    not pay (``HostLayout.pays``) or this rank is outside it. Collective over every rank of
    the job the first time for a layout (module docstring)."""
    member = process_set.included()  # first: it brings the global set's ranks up to date
    layout = HostLayout.of(process_set.ranks, topology(global_process_set).node_of)
    if not layout.pays():
        return None
    hosts = {ranks: _process_set(ranks) for ranks in layout.host_sets()}
    leaders = {ranks: _process_set(ranks) for ranks in layout.leader_sets()}
    rank = runtime.rank()
    if not member:
        return None
    host = layout.hosts[layout.where(rank)[0]]
    index = layout.where(rank)[1]
    intra = hosts.get(host)
    across = leaders[layout.leader_sets()[index]] if index < layout.leaders else None
    return HostLevels(
        layout,
        rank,
        None if intra is None else EngineTransport(intra, prefix=prefix),
        None if across is None else EngineTransport(across, sparse_algorithm, prefix),
    )
