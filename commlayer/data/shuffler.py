"""PartialLocalShuffler: each rank trains on its own shard and, each epoch, exchanges a fraction
Q of it with the other ranks over commlayer (Nguyen et al., IPDPS 2022).

1. Every rank builds it with the same fraction, seed and chunk count; the first collective
   (an allgather of settings and store journals) fails on every rank, naming the ranks that
   differ, instead of letting mismatched plans hang later. It also finishes an exchange a
   previous run left half done (the store's two-phase recovery) and checks that no sample is
   in two stores.
2. ``set_epoch(e)`` ends the exchange of the epoch before (waits for its chunks and its vote,
   then commits: samples sent are deleted only once every receiver has staged them) and plans
   e's: the same plan on every rank, drawn from (seed, e), no message needed.
3. The sampler visits this rank's shard in a local random order. During the epoch it submits
   the chunks of e's exchange at evenly spaced positions within the first ``min(shard sizes)``
   samples (positions every rank reaches, whatever its shard size), so the engine moves them
   while the rank computes; the samples sent still serve this epoch, the ones received serve
   the next. At the end of its shard the sampler waits for any chunk still in flight, so the
   exchange is complete before a rank with fewer samples calls ``commlayer.join()``, journals
   it and starts the vote (an allreduce that set_epoch waits on).
4. Reading, packing, unpacking and writing the exchanged samples happen on the shuffler's I/O
   thread (exchange.py); the training thread only starts each chunk's alltoall in commlayer's
   engine and hands finished chunks over. An error on the I/O thread is raised on the training
   thread at the end of the shard or in ``set_epoch``, naming the rank and the thread.
5. ``stats()``: per committed exchange, what moved and how much of its time was hidden.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.utils.data

from commlayer import ops, state_sync
from commlayer.common.errors import ShardStoreError, ShuffleMismatchError
from commlayer.common.reduce_ops import Sum
from commlayer.core import runtime
from commlayer.data.exchange import Exchange, io_thread
from commlayer.data.plan import Plan, local_order, make_plan
from commlayer.data.store import ShardStore

_instances = itertools.count()  # every rank builds its shufflers in the same order


class ShardDataset(torch.utils.data.Dataset[Any]):
    """The samples of this rank's store, indexed by global sample id (what the sampler yields)."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def __getitem__(self, sample_id: int) -> Any:
        try:
            return self.store.load(sample_id)
        except ShardStoreError as exc:
            if self.store.path is None and torch.utils.data.get_worker_info() is not None:
                raise ShardStoreError(
                    f"{exc}: a DataLoader worker reads a copy of an in-memory store made when "
                    "it started, which persistent_workers=True keeps past the exchange; give "
                    "the store a path or leave persistent_workers off"
                ) from exc
            raise

    def __len__(self) -> int:
        return len(self.store)


class ShuffleSampler(torch.utils.data.Sampler[int]):
    """This rank's sample ids for the current epoch; drives the exchange as it is iterated."""

    def __init__(self, shuffler: PartialLocalShuffler) -> None:
        self.shuffler = shuffler

    def __iter__(self) -> Iterator[int]:
        return self.shuffler._iterate()

    def __len__(self) -> int:
        return len(self.shuffler._order)


class PartialLocalShuffler:
    """Partial-local shuffling of ``store`` (see the module docstring). ``fraction`` is Q:
    0 keeps every shard as it is (local shuffling), 1 deals all samples anew each epoch
    (global shuffling). ``chunks``: collectives per epoch's exchange (2 by default: each
    chunk's alltoall costs the training thread ~2 ms to start on a loaded 2-core machine, 0.020
    s of exchange time per epoch at 8 chunks against 0.007 s at 2, Q = 0.1, 4 ranks)."""

    def __init__(self, store: ShardStore, fraction: float, seed: int = 0, chunks: int = 2) -> None:
        self.rank, self.size = runtime.rank(), runtime.size()
        if not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"rank {self.rank}: fraction {fraction!r} is not a number in [0, 1]")
        if chunks < 1:
            raise ValueError(f"rank {self.rank}: chunks {chunks!r} must be at least 1")
        self.store, self.fraction, self.seed, self.chunks = store, float(fraction), seed, chunks
        self.name = f"commlayer.data.shuffler{next(_instances)}"
        self.dataset = ShardDataset(store)
        self.sampler = ShuffleSampler(self)
        self._stats: list[dict[str, float]] = []
        self._times = {"busy_s": 0.0, "wait_s": 0.0}
        self._io: ThreadPoolExecutor | None = None
        self._check_settings_and_recover()
        self._ids = store.ids()
        self.shard_sizes = self._check_disjoint()
        self.epoch = store.epoch
        self._exchange: Exchange | None = None
        self._order: list[int] = []
        self._plan_epoch()

    # -- the user's calls --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """End the previous epoch's exchange, then plan ``epoch``'s (collective: every rank)."""
        if epoch == self.epoch:
            return
        t0 = time.perf_counter()
        committed = self._close_exchange()
        self.epoch = epoch
        self._plan_epoch()
        if committed is not None:
            committed["set_epoch_s"] = time.perf_counter() - t0
            committed["waited_s"] += committed["set_epoch_s"]
            self._stats.append(committed)

    def stats(self) -> list[dict[str, float]]:
        """This rank's committed exchanges, oldest first (since this shuffler was built), one
        dict each:

        - ``epoch``; ``sent_samples`` / ``sent_bytes``, ``received_samples`` /
          ``received_bytes``: what this rank moved (bytes as they travel, frames included);
        - ``compacted_bytes``: what the compaction of the store's pack files copied at the
          exchange's start (packs.py: whole packs sent away are unlinked, not copied);
        - ``io_s``: the I/O thread's time on it (compacting, reading, packing, unpacking,
          staging);
        - ``hidden_s``: the part of ``io_s`` the training thread did not wait for;
        - ``waited_s``: the exchange's time on the training thread, the sum of ``busy_s``
          (starting chunks and handing them over between samples), ``wait_s`` (at the end of
          the shard, until every chunk arrived and was staged) and ``set_epoch_s`` (the vote,
          the commit and the next epoch's plan).

        Empty at Q = 0 or on one rank: nothing is exchanged."""
        return [dict(s) for s in self._stats]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "fraction": self.fraction, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["epoch"]`` (call before iterating; the stores are as recovered)."""
        for key in ("fraction", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"rank {self.rank}: state has {key}={state[key]!r}, this shuffler "
                    f"{getattr(self, key)!r}"
                )
        self._exchange = None
        self.epoch = int(state["epoch"])
        self._plan_epoch()

    # -- the epoch ---------------------------------------------------------------------------
    def _plan_epoch(self) -> None:
        self._times = {"busy_s": 0.0, "wait_s": 0.0}
        self._order = local_order(self.seed, self.epoch, self.rank, self._ids)
        if self.fraction == 0.0 or self.size == 1:
            self._exchange = None
            return
        plan = make_plan(
            self.seed,
            self.epoch,
            self.fraction,
            self.rank,
            self._ids,
            self.shard_sizes,
            self.chunks,
            self.store.groups(),
        )
        if self._io is None:
            self._io = io_thread()
        self._exchange = Exchange(
            plan, self.store, self.rank, self.size, f"{self.name}.epoch{self.epoch}", self._io
        )

    def _iterate(self) -> Iterator[int]:
        exchange = self._exchange
        smallest = min(self.shard_sizes)
        # chunk k at the middle of the k-th of `chunks` equal parts: the I/O thread has the first
        # part's samples to prepare chunk 0 in (started at 0, it was waited for: 0.034 s of
        # busy time per epoch at Q = 0.1, 4 ranks, against 0.003 s hidden)
        starts = [(2 * k + 1) * smallest // (2 * self.chunks) for k in range(self.chunks)]
        if exchange is not None:
            exchange.start()
        for position, sample_id in enumerate(list(self._order)):
            while (
                exchange is not None
                and exchange.submitted < self.chunks
                and (position >= starts[exchange.submitted])
            ):
                t0 = time.perf_counter()
                exchange.collect(block=False)
                exchange.submit_next()
                self._times["busy_s"] += time.perf_counter() - t0
            yield sample_id
        if exchange is not None:
            t0 = time.perf_counter()
            try:
                exchange.finish()
            except ShardStoreError:
                self._cast_vote(exchange, failed=True)  # the other ranks learn it in set_epoch
                raise
            self._cast_vote(exchange)
            self._times["wait_s"] += time.perf_counter() - t0

    def _cast_vote(self, exchange: Exchange, failed: bool = False) -> None:
        """Phase 1 ends: journal what the exchange moves, then vote: one allreduce (how many
        ranks miss a sample) started here, at the end of the shard, and waited on in set_epoch,
        so that join() and the last batches hide it. Started in set_epoch as an allgather of
        every rank's counts it took 38 ms, all of set_epoch's median time, at 4 ranks on the
        loaded 2-core machine (Q = 0.1, 512 samples per rank); started here, set_epoch takes
        5 ms."""
        if exchange.vote is not None:
            return
        plan = exchange.plan
        if not failed:
            self.store.prepare(plan.epoch, plan.sent_ids, self.store.staged())
        incomplete = torch.tensor([int(failed or tuple(exchange.received) != plan.receives_from)])
        exchange.vote = ops.allreduce_async(incomplete, op=Sum, name=f"{exchange.name}.vote")

    def _close_exchange(self) -> dict[str, float] | None:
        """Finish, vote on and commit the current exchange (two-phase, see store.py); its
        stats."""
        exchange, self._exchange = self._exchange, None
        if exchange is None:
            return None
        plan: Plan = exchange.plan
        error: ShardStoreError | None = None
        try:
            exchange.finish()
        except ShardStoreError as exc:  # this rank's, or another's that sent an error frame
            error = exc
        except Exception:  # a collective failed (a rank died): no vote can end this exchange
            self.store.abort()
            raise
        self._cast_vote(exchange, failed=error is not None)
        assert exchange.vote is not None
        if int(ops.synchronize(exchange.vote).item()):  # every rank sees it: all gather why
            counts = state_sync.allgather_object(
                (exchange.received, plan.receives_from, None if error is None else str(error)),
                name=f"{exchange.name}.why",
            )
            self.store.abort()
            if error is not None:
                raise error
            errors = [e for _, _, e in counts if e is not None]
            if errors:
                raise ShardStoreError(
                    f"rank {self.rank}: the exchange of epoch {plan.epoch} failed on another "
                    f"rank; the stores are as before it: {'; '.join(errors)}"
                )
            detail = "; ".join(
                f"rank {r} got {got}, expected {want}"
                for r, (got, want, _) in enumerate(counts)
                if tuple(got) != tuple(want)
            )
            raise ShuffleMismatchError(
                f"rank {self.rank}: the exchange of epoch {plan.epoch} is incomplete ({detail}); "
                "the stores are as before it"
            )
        self.store.commit()
        self._ids = self.store.ids()
        return {
            "epoch": plan.epoch,
            "sent_samples": len(plan.sent_ids),
            "sent_bytes": exchange.sent_bytes,
            "received_samples": sum(exchange.received),
            "received_bytes": exchange.received_bytes,
            "compacted_bytes": exchange.compacted_bytes,
            "io_s": exchange.io_s,
            "hidden_s": max(0.0, exchange.io_s - exchange.io_waited_s),
            "waited_s": self._times["busy_s"] + self._times["wait_s"],
            **self._times,
        }

    # -- the first collective ----------------------------------------------------------------
    def _check_settings_and_recover(self) -> None:
        mine = {"fraction": self.fraction, "seed": self.seed, "chunks": self.chunks}
        gathered = state_sync.allgather_object(
            (mine, self.store.journal()), name=f"{self.name}.settings"
        )
        for key in mine:
            values = {r: settings[key] for r, (settings, _) in enumerate(gathered)}
            if len(set(values.values())) > 1:
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in values.items())
                raise ShuffleMismatchError(
                    f"rank {self.rank}: PartialLocalShuffler needs the same {key} on every "
                    f"rank; got {shown}"
                )
        self.store.recover([journal for _, journal in gathered])

    def _check_disjoint(self) -> list[int]:
        """Every rank's shard size, after checking that no sample is in two stores."""
        shards = state_sync.allgather_object(
            torch.tensor(self._ids, dtype=torch.int64), name=f"{self.name}.ids"
        )
        owner: dict[int, int] = {}
        for r, ids in enumerate(shards):
            for sample_id in ids.tolist():
                if owner.setdefault(sample_id, r) != r:
                    raise ShuffleMismatchError(
                        f"rank {self.rank}: sample {sample_id} is in the stores of ranks "
                        f"{owner[sample_id]} and {r}; each sample must be in one store"
                    )
        return [len(ids) for ids in shards]
