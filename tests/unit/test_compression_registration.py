"""A compressor is one class and one registration: what it declares (compression/base.py) is
all the communicator, the spec parser, the configuration and the oracle read, so a toy one
registered here is accepted by each of them with no other edit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from commlayer import compression
from commlayer.comm.communicator import Communicator, Loopback
from commlayer.common import config
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import Compressed, Compressor
from commlayer.compression.base import WIRE_BYTES
from commlayer.core.future import Future
from commlayer.oracle import parse_plat
from commlayer.oracle.network import Compression, Network

TOY = "test_strided"


class Strided(compression.CompressorBase):
    """Every ``stride``-th element, sent as (values, int32 indices): a sparse payload."""

    name = TOY
    summable = False
    sparse = True
    wire_parameters = ("stride",)
    capabilities = frozenset({WIRE_BYTES})

    def __init__(self, stride: int = 2) -> None:
        self.stride = stride

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        flat = tensor.detach().reshape(-1)
        indices = torch.arange(0, flat.numel(), self.stride, dtype=torch.int32)
        return Compressed([flat[indices.long()], indices], (tensor.shape, tensor.dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        values, indices = compressed.payload
        out = torch.zeros(shape.numel(), dtype=dtype)
        return out.index_add_(0, indices.long(), values.to(dtype)).view(shape)

    def wire_bytes(self, numel: int, element_bytes: int = 4) -> int:
        return math.ceil(numel / self.stride) * (element_bytes + 4)


@pytest.fixture
def toy() -> Any:
    with compression.registered(TOY, Strided):
        yield


def _kept(tensor: torch.Tensor, stride: int) -> torch.Tensor:
    out = torch.zeros_like(tensor)
    out.view(-1)[::stride] = tensor.reshape(-1)[::stride]
    return out


def test_the_spec_parser_and_the_configuration_accept_a_registered_compressor(toy: Any) -> None:
    assert TOY in compression.available() and TOY in compression.spec_help()
    assert compression.check_spec(f" {TOY}:stride=3 ") == f"{TOY}:stride=3"
    made = compression.create(f"{TOY}:stride=3")
    assert isinstance(made, Strided) and made.stride == 3
    assert config.load(environ={"COMMLAYER_COMPRESSION": TOY}).compression == TOY
    with pytest.raises(ValueError, match="does not take parameter"):
        compression.check_spec(f"{TOY}:ratio=0.1")


def test_unregistered_it_is_refused_again() -> None:
    with compression.registered(TOY, Strided):
        pass
    assert TOY not in compression.available()
    with pytest.raises(ValueError, match=f"unknown compressor '{TOY}'"):
        compression.check_spec(TOY)
    with pytest.raises(ValueError, match="not a registered compressor"):
        compression.unregister(TOY)


class _Recording(Loopback):
    """Loopback that records which payloads the communicator offers for a sparse reduction,
    and reduces those named in ``sparse_names`` itself (their dense sum: the payload x ranks)."""

    def __init__(self, ranks: int, sparse_names: tuple[str, ...] = ()) -> None:
        super().__init__(ranks)
        self.offered: list[str] = []
        self.sparse_names = sparse_names

    def sparse(  # type: ignore[override]
        self, name: str, compressed: Compressed, compressor: Compressor, op: ReduceOp
    ) -> Any:
        self.offered.append(name)
        if name not in self.sparse_names:
            return None
        future = Future(name)
        future.set_result(compressor.decompress(compressed) * self.size)
        return future


def test_the_communicator_moves_it_as_declared(toy: Any) -> None:
    tensors = [torch.arange(1.0, 8.0), torch.arange(10.0, 22.0).view(3, 4)]
    expected = [_kept(t, 2) for t in tensors]
    transport = _Recording(2, sparse_names=("b.1",))
    comm = Communicator(transport, op=ReduceOp.Sum)
    reduced = comm.reduce(
        [t.clone() for t in tensors], compression.create(TOY), "b", ["b.0", "b.1"]
    )
    result = reduced.wait()
    # declared sparse: each payload was offered to the sparse path; b.0 was gathered (two
    # ranks' equal records summed), b.1 reduced by the transport's sparse reduction
    assert transport.offered == ["b.0", "b.1"]
    for got, want in zip(result, expected):
        assert torch.equal(got, 2 * want)
    # a gathered compressor that declares no sparse payload is never offered
    transport.offered.clear()
    comm.reduce([torch.randn(4096)], compression.create("qsgd"), "q").wait()
    assert transport.offered == []


def test_the_oracle_costs_it_from_its_declarations(toy: Any, tmp_path: Path) -> None:
    plat_file = tmp_path / "toy.plat"
    plat_file.write_text(
        "BANDWIDTH|1e9|Bps\nLATENCY|1e-6|second\nMAX_NODE|16|GPUs\nGPU_PER_NODE|2|GPUs\n"
        "MEM_PER_NODE|1e6|Bytes\nNODE_SPEED|1e12|FLOPS\n"
    )
    plat = parse_plat(plat_file)
    with pytest.raises(ValueError, match=f"give its stride, e.g. {TOY}:stride=2"):
        Compression.parse(TOY)
    network = Network(plat, compression=Compression.parse(f"{TOY}:stride=4"))
    # not summable: every rank's (value, index) pairs are allgathered, a quarter of 1e6
    assert network.gradient_s(4_000_000, 4) == network.allgather_s(4 * 250_000 * 8, 4)
    assert f"compression {TOY}:stride=4" in network.describe()


@pytest.mark.parametrize("builtin", compression.BUILTINS, ids=lambda c: c.name)
def test_each_builtin_is_registered_under_its_module_name(builtin: type) -> None:
    name = builtin.name  # type: ignore[attr-defined]
    assert builtin.__module__ == f"commlayer.compression.{name}"
    assert type(compression.create(f"{name}:ef=0")) is builtin
