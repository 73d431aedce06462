"""compression="auto" through DistributedOptimizer at any number of ranks (issue 39).

A linear regression, each rank its own seeded data, SGD: training with ``auto`` must end where
uncompressed training ends (within the tolerance of what auto chose), every rank must use the
same compressor for every bucket, and the decisions must be visible on the first rank. Over
shared memory the link is fast and ``auto`` keeps ``none``; ``margin=1000`` makes any cheaper
candidate win, which forces a cast (``auto``) or a lossy compressor (``auto:lossy=1``) here.

Collectives first, asserts last, as in test_optimizer.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import commlayer as cl

STEPS = 30
TRUE_W = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))


def _train(spec: str) -> tuple[nn.Linear, torch.optim.Optimizer, float]:
    torch.manual_seed(0)  # the same start on every rank
    model = nn.Linear(64, 16)  # weight 1024 elements: compressible; bias 16: small
    opt = cl.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        compression=spec,
    )
    data = torch.Generator().manual_seed(100 + cl.rank())
    loss = torch.zeros(())
    for _ in range(STEPS):
        x = torch.randn(32, 64, generator=data)
        opt.zero_grad()
        loss = ((model(x) - x @ TRUE_W.t()) ** 2).mean()
        loss.backward()
        opt.step()
    final = cl.allreduce(loss.detach(), name=f"final_loss.{spec}")
    return model, opt, float(final)


def _used(opt: torch.optim.Optimizer) -> list[str]:
    return [c.name for b in opt._commlayer.bucketer.buckets for c in b.compressors]  # type: ignore[attr-defined]


def test_auto_trains_as_uncompressed_and_every_rank_decides_alike() -> None:
    if cl.size() == 1:
        pytest.skip("over one rank DistributedOptimizer is the identity: nothing to decide")
    base, _, base_loss = _train("none")
    plain, plain_opt, _ = _train("auto")
    cast, cast_opt, _ = _train("auto:margin=1000")
    lossy, lossy_opt, lossy_loss = _train("auto:lossy=1,margin=1000")
    # the stored calibration where this machine has one for the job, else the link measured now
    _, calibrated_opt, calibrated_loss = _train("auto:link=calibration")
    used = cl.allgather_object([_used(o) for o in (plain_opt, cast_opt, lossy_opt)])
    decisions = [o.compression_decisions() for o in (plain_opt, cast_opt, lossy_opt)]  # type: ignore[attr-defined]

    assert all(u == used[0] for u in used), used  # every rank, every bucket, alike
    plain_used, cast_used, lossy_used = used[0]
    assert set(cast_used) <= {"fp16", "bf16"} and cast_used, cast_used
    assert {"powersgd", "topk"} & set(lossy_used), lossy_used
    assert "none" in lossy_used  # the bias: under min_numel, lossy candidates leave it alone
    if cl.rank() == 0:
        assert [d["choice"] for d in decisions[1]] and all(
            d["choice"] in ("fp16", "bf16") for d in decisions[1]
        )
        assert decisions[0] and all("none" in d["predicted_s"] for d in decisions[0])
    else:
        assert decisions == [[], [], []]  # rank 0 decides and keeps them
    # the same end as uncompressed: exactly as close as what was chosen allows
    tolerance = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}
    for name in ("weight", "bias"):
        want = getattr(base, name).detach()
        worst = max(tolerance.get(n, 2e-2) for n in plain_used)
        torch.testing.assert_close(getattr(plain, name).detach(), want, rtol=worst, atol=worst)
        torch.testing.assert_close(getattr(cast, name).detach(), want, rtol=2e-2, atol=2e-2)
    assert calibrated_opt.compression_decisions() or cl.rank() != 0  # type: ignore[attr-defined]
    assert abs(calibrated_loss - base_loss) <= 0.05 * base_loss + 1e-3
    # lossy with error feedback still learns the regression (uncompressed: ~1e-3 of the start)
    assert lossy_loss < max(10 * base_loss, 0.05), (lossy_loss, base_loss)
    del lossy
