"""State synchronization: make every rank start from rank root's parameters, optimizer state and
arbitrary objects (broadcast_parameters, broadcast_optimizer_state, broadcast_object,
allgather_object), as in horovod.torch."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from commlayer import ops
from commlayer.core import runtime
from commlayer.core.process_sets import ProcessSet, global_process_set


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Overwrite, in place, each tensor of ``params`` (a state_dict or named_parameters) with
    root_rank's. All broadcasts are submitted at once, so the engine overlaps them."""
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        handles.append(
            ops.broadcast_async_(
                data, root_rank, name=f"bcast.param.{name}", process_set=process_set
            )
        )
    for handle in handles:
        ops.synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Give every rank root_rank's optimizer state (every torch.optim optimizer: the root's
    whole state_dict travels and is loaded on the others). When the root's optimizer has no
    state yet (none has stepped), every rank creates it first, as Horovod does: each parameter
    that requires grad gets a zero gradient (sparse for SparseAdam) and the optimizer takes one
    local step without reducing, so ``p.grad`` is a tensor afterwards and, with weight decay,
    the parameters move by that step, alike on every rank. A root that has state (a resumed
    checkpoint) sends it as it is: the other ranks take no step."""
    sent = None
    if runtime.rank() == root_rank:
        fresh = not optimizer.state_dict()["state"]
        if fresh:
            _initialize_state(optimizer)
        sent = (fresh, optimizer.state_dict())
    # One broadcast: whether the root was fresh (the others then take the same first step
    # before loading its state) travels with the state.
    fresh, state = broadcast_object(
        sent, root_rank, name="bcast.optimizer_state", process_set=process_set
    )
    if runtime.rank() != root_rank:
        if fresh:
            _initialize_state(optimizer)
        optimizer.load_state_dict(state)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if sparse else zeros
    if hasattr(type(optimizer), "skip_synchronize"):  # a DistributedOptimizer: no reduction
        parent: Any = super(type(optimizer), optimizer)
        parent.step()
    else:
        optimizer.step()


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return root_rank's ``obj`` on every rank (pickled with torch.save; tensors welcome)."""
    base = name or "bcast.object"
    root = runtime.rank() == root_rank
    payload = _to_bytes(obj) if root else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    ops.synchronize(
        ops.broadcast_async_(length, root_rank, name=f"{base}.len", process_set=process_set)
    )
    if not root:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    ops.synchronize(
        ops.broadcast_async_(payload, root_rank, name=f"{base}.data", process_set=process_set)
    )
    return obj if root else _from_bytes(payload)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    base = name or "allgather.object"
    payload = _to_bytes(obj)
    lengths = ops.synchronize(
        ops.allgather_async(
            torch.tensor([payload.numel()]), name=f"{base}.len", process_set=process_set
        )
    )
    data = ops.synchronize(
        ops.allgather_async(payload, name=f"{base}.data", process_set=process_set)
    )
    out, offset = [], 0
    for length in lengths.tolist():
        out.append(_from_bytes(data[offset : offset + length]))
        offset += length
    return out
