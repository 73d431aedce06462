"""The compressor contract is declared, not probed (compression/base.py): a compressor with the
minimum (name, summable, compress, decompress) works everywhere with CompressorBase's defaults;
what a built-in declares in ``capabilities`` is what it implements; error feedback forwards
what it may of its inner compressor's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from commlayer import compression
from commlayer.comm.communicator import Communicator, Loopback
from commlayer.common.reduce_ops import ReduceOp
from commlayer.compression import Compressed, CompressorBase, ErrorFeedback, Policy
from commlayer.compression import base as contract
from commlayer.oracle.network import Compression

MINIMAL = "test_minimal"

# Each capability and the members it promises (base.py's protocols).
MEMBERS = {
    contract.WIRE_BYTES: ("wire_bytes",),
    contract.ROUND_BYTES: ("round_bytes",),
    contract.MULTI_ROUND: ("next_round", "next_rounds"),
    contract.DECOMPRESS_INTO: ("decompress_into",),
    contract.DECOMPRESS_ADD: ("check_payload", "decompress_add_"),
    contract.DECOMPRESS_SUM: ("decompress_sum_",),
    contract.STATEFUL: ("state_dict", "load_state_dict"),
    contract.RESIDUALS: ("take_residual", "add_dropped"),
    contract.DROP_SENT: ("drop_sent_",),
    contract.COMPRESS_SUM: ("compress_sum_",),
    contract.LOCAL_ERROR: ("local_error",),
}


class Halving:
    """The minimum and nothing else: payload = tensor / 2, not a subclass of CompressorBase."""

    def __init__(self, summable: bool = True) -> None:
        self.name = MINIMAL
        self.summable = summable

    def compress(self, tensor: torch.Tensor, name: str = "") -> Compressed:
        return Compressed([tensor / 2])

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        return compressed.payload[0] * 2


@pytest.mark.parametrize("summable", [True, False])
def test_a_registered_compressor_with_the_minimum_only_reduces(summable: bool) -> None:
    with compression.registered(MINIMAL, Halving):
        made = compression.create(f"{MINIMAL}:summable={int(summable)}")
    assert isinstance(made, CompressorBase) and made.name == MINIMAL
    # the defaults: nothing optional, no error feedback, small tensors skipped
    assert made.capabilities == frozenset() and not made.sparse and not made.identity
    assert not made.biased and not made.compresses_small_tensors and made.hierarchy is None
    tensors = [torch.arange(6.0), torch.arange(4.0).view(2, 2)]
    # Loopback: a summable payload comes back as it is, a gathered one from each of 3 ranks
    for op, factor in ((ReduceOp.Sum, 1 if summable else 3), (ReduceOp.Average, 1)):
        got = Communicator(Loopback(3), op=op).reduce([t.clone() for t in tensors], made, "m")
        for g, t in zip(got.wait(), tensors):
            torch.testing.assert_close(g, factor * t)
    # an object passed as it is (the optimizer's compression=) is given the same defaults
    direct = Communicator(Loopback(2), op=ReduceOp.Sum).reduce([torch.ones(3)], Halving(False), "d")
    assert torch.equal(direct.wait()[0], torch.full((3,), 2.0))


def test_the_policy_the_spec_and_the_oracle_accept_the_minimum() -> None:
    with compression.registered(MINIMAL, Halving):
        made = compression.create(f"{MINIMAL}:summable=1,hierarchy=host")
        assert made.hierarchy == "host"
        policy = Policy(MINIMAL, min_numel=4)
        assert policy.choose("w", torch.ones(8)).name == MINIMAL
        assert policy.choose("b", torch.ones(2)).name == "none"  # small: sent as it is
        assert policy.state_dict() == {}  # keeps no state
        with pytest.raises(ValueError, match="follows from the element count"):
            Compression.parse(MINIMAL)  # declares no size: the oracle cannot cost it


def test_undeclared_optional_members_are_refused_not_ignored() -> None:
    class Biased(Halving):
        biased = True

        def state_dict(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match=r"declares biased, state_dict, .*subclass it"):
        compression.create(Biased())
    with pytest.raises(TypeError, match="is not a compressor: it lacks compress, decompress"):
        compression.create(type("NoDecompress", (), {"name": "x", "summable": True})())


@pytest.mark.parametrize("builtin", compression.BUILTINS, ids=lambda c: c.name)
def test_a_builtin_declares_exactly_the_capabilities_it_implements(builtin: type) -> None:
    assert issubclass(builtin, CompressorBase)
    implemented = {c for c, members in MEMBERS.items() if all(hasattr(builtin, m) for m in members)}
    assert builtin.capabilities == implemented


@pytest.mark.parametrize(
    ("spec", "capabilities"),
    [
        ("topk", {contract.WIRE_BYTES, contract.DECOMPRESS_ADD}),
        ("randomk", {contract.WIRE_BYTES}),
        ("powersgd", {contract.ROUND_BYTES, contract.MULTI_ROUND, contract.DECOMPRESS_INTO}),
        ("qsgd:ef=1", {contract.WIRE_BYTES, contract.DECOMPRESS_SUM}),
    ],
)
def test_error_feedback_forwards_what_reads_the_reduced_result(
    spec: str, capabilities: set[str]
) -> None:
    """Its inner compressor's fast paths that read the reduced result and its size; never
    those that make the residual (error feedback's own), and it adds its own two."""
    made = compression.create(spec)
    assert isinstance(made, ErrorFeedback)
    assert made.capabilities == capabilities | {contract.RESIDUALS, contract.STATEFUL}
    assert made.sparse == made.inner.sparse and made.wire_parameters == made.inner.wire_parameters
    x = torch.randn(64, 8)
    assert contract.payload_bytes(made, x.shape, 4) == contract.payload_bytes(
        made.inner, x.shape, 4
    )
