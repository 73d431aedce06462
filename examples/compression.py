"""Gradient compression: DistributedOptimizer sends each gradient compressed.

    commlayerrun -np 2 python examples/compression.py [--compression fp16]
    COMMLAYER_COMPRESSION="topk:ratio=0.01" commlayerrun -np 2 python examples/compression.py

``compression=`` takes a compressor (``hvd.Compression.fp16``), a spec string
(``"topk:ratio=0.01"``, ``"powersgd:rank=4"``, ``"qsgd:levels=127,bucket=512"``, ...) or a
``commlayer.compression.Policy`` (one compressor a parameter); left unset, it is
``COMMLAYER_COMPRESSION`` (default none). Lossy ones keep the part they dropped (error
feedback) and add it to the next step's gradient. It pays where the network is the limit:
see the documentation's Compression guide. The script prints the bytes reduced per step
with and without compression, and a checksum of the weights, the same on every rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import commlayer as hvd


def train(compression: str | None, steps: int) -> tuple[float, float]:
    """(bytes reduced per step, final loss) of a few steps with ``compression``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )
    data = torch.Generator().manual_seed(hvd.rank())
    before = hvd.communication_stats()["payload_bytes"]
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), x[:, :1])
        loss.backward()
        optimizer.step()
    sent = (hvd.communication_stats()["payload_bytes"] - before) / steps
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {hvd.rank()}: {compression or 'none'}: parameter checksum {checksum:.10f}",
          flush=True)  # fmt: skip
    return sent, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="fp16", help="a spec: fp16, topk:ratio=0.01...")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    hvd.init()
    dense, _ = train("none", args.steps)
    compressed, loss = train(args.compression, args.steps)
    if hvd.rank() == 0:
        print(f"{args.compression}: {compressed:,.0f} bytes reduced a step against "
              f"{dense:,.0f} uncompressed ({dense / compressed:.1f}x less); final loss "
              f"{loss:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
