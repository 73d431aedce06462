"""One job on the namespace cluster (scripts/cluster.sh, 2 hosts x 2 ranks), started by
tests/system/test_cluster.py through ``commlayerrun -H node1:2,node2:2``, and again through
one ``torchrun`` agent per host (node1's ranks first; commlayer over gloo). It reports:

1. ``topology``: rank, sizes, hostname and the nodes commlayer detected (no override set).
2. ``collectives``: allreduce, grouped allreduce, allgather, broadcast, alltoall, reducescatter
   against references computed here from every rank's input (each input is a function of the
   rank, so every rank knows them all); integer-valued data, so sums are exact.
3. ``algorithm``, once per allreduce algorithm (init(allreduce_algorithm=...) each time): a
   16 MiB allreduce exact on every rank, what the engine ran, the bytes this host's cable
   (eth0) and loopback carried meanwhile, and where the shared-memory windows are: on the
   global communicator (shm), or per level of the two-level hierarchical.
4. ``intra_host``: a 16 MiB allreduce inside each host (a process set per host) and the
   bytes its eth0 and lo carried meanwhile (none: MPI's shared memory, not the network).
5. ``optimizer``: DistributedOptimizer steps against the same model trained in this process on
   the whole batch (float64).
6. ``window_buckets``: the same optimizer with its planned buckets in shared-memory windows
   (under MPI one per host, the slices of each part allreduced across), against buckets in
   process memory, and the bytes eth0 sent a step.

Collectives first, reports after: a failed check is a record, never a rank that leaves the
others waiting.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import _worker
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import commlayer as cl
from commlayer import algorithms
from commlayer.core import runtime

BIG_NUMEL = 4 << 20  # float32: 16 MiB
HOSTS, PER_HOST = 2, 2
SIZE = HOSTS * PER_HOST


def counters() -> dict[str, int]:
    """Bytes this host's interfaces carried so far: eth0 (the cable) and lo. The launcher's
    'ip netns exec' mounted this host's /sys."""
    net = Path("/sys/class/net")
    return {
        f"{dev}_{way}": int((net / dev / "statistics" / f"{way}_bytes").read_text())
        for dev in ("eth0", "lo")
        for way in ("tx", "rx")
    }


def grown(before: dict[str, int]) -> dict[str, int]:
    after = counters()
    return {key: after[key] - before[key] for key in before}


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-50, 50), different on every rank and every element."""
    numel = 1
    for n in shape:
        numel *= n
    values = (torch.arange(numel, dtype=torch.int64) * (7 + 2 * rank) + 13 * rank) % 100 - 50
    return values.reshape(shape).to(dtype)


def equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def check_collectives() -> dict[str, bool]:
    r, n = cl.rank(), cl.size()
    found = {}
    for dtype in (torch.float32, torch.float64, torch.int32):
        shape = (1000, 37)
        inputs = [rank_input(q, shape, dtype) for q in range(n)]
        want = torch.stack(inputs).sum(0, dtype=dtype)
        found[f"allreduce_sum_{dtype}"] = equal(cl.allreduce(inputs[r], op=cl.Sum), want)
        maxed = torch.stack(inputs).amax(0)
        found[f"allreduce_max_{dtype}"] = equal(cl.allreduce(inputs[r], op=cl.Max), maxed)
    floats = [rank_input(q, (513,), torch.float64) for q in range(n)]
    average = cl.allreduce(floats[r], op=cl.Average)
    found["allreduce_average"] = torch.allclose(average, torch.stack(floats).mean(0), rtol=1e-15)
    group = cl.grouped_allreduce([floats[r], 2 * floats[r]], op=cl.Sum)
    total = torch.stack(floats).sum(0)
    found["grouped_allreduce"] = equal(group[0], total) and equal(group[1], 2 * total)
    rows = [rank_input(q, (q + 1, 3), torch.int64) for q in range(n)]
    found["allgather"] = equal(cl.allgather(rows[r]), torch.cat(rows))
    for root in (0, n - 1):  # a root on each host
        sent = rank_input(root, (300, 5), torch.float32)
        mine = sent.clone() if r == root else torch.zeros_like(sent)
        found[f"broadcast_root{root}"] = equal(cl.broadcast(mine, root_rank=root), sent)
    found["alltoall"] = check_alltoall(r, n)
    blocks = [rank_input(q, (10, 4), torch.float64) for q in range(n)]
    summed = torch.stack(blocks).sum(0)
    counts = [10 // n + (1 if q < 10 % n else 0) for q in range(n)]
    start = sum(counts[:r])
    found["reducescatter"] = equal(
        cl.reducescatter(blocks[r], op=cl.Sum), summed[start : start + counts[r]]
    )
    return found


def check_alltoall(r: int, n: int) -> bool:
    """Rank q sends (q + p) % 3 rows to rank p, each row naming (sender, receiver, row)."""

    def rows(sender: int, receiver: int) -> torch.Tensor:
        count = (sender + receiver) % 3
        return torch.tensor([[sender, receiver, i] for i in range(count)], dtype=torch.int64)

    send = torch.cat([rows(r, p).reshape(-1, 3) for p in range(n)])
    splits = [(r + p) % 3 for p in range(n)]
    out, received = cl.alltoall(send, splits=splits)
    want = torch.cat([rows(q, r).reshape(-1, 3) for q in range(n)])
    return equal(out, want) and list(received.tolist()) == [(q + r) % 3 for q in range(n)]


def windows() -> dict[str, object]:
    """Where the global set's backend made shared-memory windows: over all ranks (``shm``), or
    per level of the two-level hierarchical (``nodes``: the hosts of each level's ranks).
    None over torch.distributed (no windows there)."""
    backend = runtime.engine()._global.backend
    if not hasattr(backend, "_levels"):
        return {"global_window": None, "levels": None}
    levels = [
        {
            "node_hosts": sorted(set(node.hosts())),
            "node_window": node._shm is not None,
            "node_size": node.size,
            "cross_hosts": sorted(set(cross.hosts())),
            "cross_window": cross._shm is not None,
        }
        for node, cross in backend._levels.values()
    ]
    return {"global_window": backend._shm is not None, "levels": levels}


def check_algorithm(name: str, inputs: list[torch.Tensor], want: torch.Tensor) -> None:
    """``inputs``: every rank's 16 MiB input (made once: 2.5 s on the loaded 2-core machine),
    ``want`` their sum."""
    cl.init(allreduce_algorithm=name)
    r = cl.rank()
    small = [cl.allreduce_async(inputs[r][: k + 1], op=cl.Sum, name=f"s{k}") for k in range(8)]
    small_ok = all(equal(cl.synchronize(h), want[: k + 1]) for k, h in enumerate(small))
    before = counters()  # before the barrier: no rank has started the big one yet
    cl.barrier()
    got = cl.allreduce(inputs[r], op=cl.Sum, name="big")
    cl.barrier()  # every rank has received everything: every byte crossed
    carried = grown(before)
    engine = runtime.engine()
    ran = engine._allreduce.choose(engine._global.backend, BIG_NUMEL, 4)
    where = windows()
    cl.shutdown()
    _worker.report(
        "algorithm",
        name=name,
        ran=ran,
        exact=equal(got, want) and small_ok,
        nbytes=BIG_NUMEL * 4,
        bytes=carried,
        **where,
    )


def check_intra_host(every_input: list[torch.Tensor]) -> None:
    cl.init()
    r = cl.rank()
    host = r // PER_HOST  # hydra fills node1's slots first
    sets = [cl.add_process_set(list(range(h * PER_HOST, (h + 1) * PER_HOST))) for h in range(HOSTS)]
    mine = sets[host]
    inputs = [every_input[q] for q in mine.ranks]
    before = counters()
    cl.barrier()
    got = cl.allreduce(inputs[mine.ranks.index(r)], op=cl.Sum, process_set=mine)
    cl.barrier()
    carried = grown(before)
    cl.shutdown()
    exact = equal(got, torch.stack(inputs).sum(0))
    _worker.report("intra_host", ranks=list(mine.ranks), exact=exact, bytes=carried)


def check_optimizer(steps: int = 3, rows: int = 4) -> None:
    cl.init()
    r, n = cl.rank(), cl.size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    ref = copy.deepcopy(model)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(rows * n, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(rows * n, 3, generator=gen, dtype=torch.float64)
        F.mse_loss(model(x[r * rows : (r + 1) * rows]), y[r * rows : (r + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = cl.allgather(flat[None])
    cl.shutdown()
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    _worker.report(
        "optimizer",
        max_error=float((flat - want).abs().max()),
        close=torch.allclose(flat, want, rtol=1e-9, atol=1e-10),
        same_on_all_ranks=all(torch.equal(row, everyone[0]) for row in everyone),
        moved=float((want - initial).abs().max()),  # the steps changed something
    )


def check_window_buckets(steps: int = 5, rows: int = 4) -> None:
    """DistributedOptimizer's planned buckets in shared-memory windows across the hosts
    (COMMLAYER_WINDOW_BUCKETS; under MPI a window per host, each rank's slices of a part
    allreduced with the other host's rank of its index): against the same model with buckets
    in process memory, and the bytes this host's eth0 sent over the planned steps."""
    from commlayer.common import config

    cl.init()
    r, n = cl.rank(), cl.size()
    results: dict[str, object] = {}
    flats = []
    for housed in (False, True):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 3))
        opt = cl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
        )
        sent = 0
        for step in range(steps):
            gen = torch.Generator().manual_seed(200 + step)
            x = torch.randn(rows * n, 1024, generator=gen)
            y = torch.randn(rows * n, 3, generator=gen)
            cl.barrier()
            before = counters()  # backward's hooks start the reduction
            F.mse_loss(model(x[r * rows : (r + 1) * rows]), y[r * rows : (r + 1) * rows]).backward()
            with config.override(window_buckets=housed):  # read when the plan is made
                opt.step()
            cl.barrier()
            if step >= 2:  # planned, the window made (step 1)
                sent += grown(before)["eth0_tx"]
            opt.zero_grad()
        window = opt._commlayer.window  # type: ignore[attr-defined]
        key = "window" if housed else "plain"
        results[key] = {"sent_per_step": sent / (steps - 2), **_worker.buckets_housed(opt)}
        flats.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        if window is not None:
            window.close()
    everyone = cl.allgather(flats[1][None])
    cl.shutdown()
    _worker.report(
        "window_buckets",
        grad_bytes=flats[1].numel() * 4,
        close=torch.allclose(flats[0], flats[1], rtol=1e-5, atol=1e-6),
        same_on_all_ranks=all(torch.equal(row, everyone[0]) for row in everyone),
        **results,
    )


def main() -> None:
    _worker.start()
    cl.init()
    backend = runtime.engine()._global.backend
    _worker.report(
        "topology",
        hostname=socket.gethostname(),
        backend=type(backend).__name__,
        size=cl.size(),
        local_rank=cl.local_rank(),
        local_size=cl.local_size(),
        cross_rank=cl.cross_rank(),
        cross_size=cl.cross_size(),
        nodes=backend.nodes(),
        machines=backend.machines(),
        passive=runtime.engine().passive,
        cores=os.cpu_count(),
        override=os.environ.get("COMMLAYER_TOPOLOGY"),
        ucx_tls=os.environ.get("UCX_TLS"),
    )
    found = check_collectives()
    cl.shutdown()
    _worker.report("collectives", results=found)
    inputs = [rank_input(q, (BIG_NUMEL,), torch.float32) for q in range(SIZE)]
    want = torch.stack(inputs).sum(0)
    for name in algorithms.available():
        check_algorithm(name, inputs, want)
    check_intra_host(inputs)
    check_optimizer()
    check_window_buckets()
    _worker.report("done")


main()
