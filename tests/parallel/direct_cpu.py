"""CPU tensors forced through the direct path (commlayer/core/device.py, **Direct**), for tests."""

from __future__ import annotations

import pytest
import torch

from commlayer.core import device, runtime


def force_direct(monkeypatch: pytest.MonkeyPatch) -> tuple[device.Path, list[object]]:
    """Set ``device.DIRECT_CPU`` for the test: the route a CUDA-aware MPI takes ("host") under
    MPI; under the torch backend the one NCCL takes ("stream"), the data over a second gloo group
    standing for the NCCL one (made here: a collective, every rank in the same order). Returns
    the route and, under torch, [the data group, then the group of every allreduce the backend
    posts from then on]."""
    groups: list[object] = []
    if runtime.backend_name() == "torch":
        import torch.distributed as dist

        backend = runtime.engine()._global.backend
        data = dist.new_group(backend="gloo")  # every rank, in the same order
        monkeypatch.setattr(backend, "_data", {})
        backend.add_data_group("cpu", data)
        real = type(backend)._all_reduce  # every allreduce the backend posts, on any group

        def all_reduce(self: object, tensor: torch.Tensor, op: object, group: object) -> object:
            groups.append(group)
            return real(self, tensor, op, group)  # type: ignore[arg-type]

        monkeypatch.setattr(type(backend), "_all_reduce", all_reduce)
        route = device.Path("stream", "test-data-group")
        groups.append(data)  # groups[0]: the data group
    else:
        route = device.Path("host", "test-direct")
    monkeypatch.setattr(device, "DIRECT_CPU", route)
    return route, groups
