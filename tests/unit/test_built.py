"""What this build and machine can do, in Horovod's words (issue 35, item 8): ``cuda_built()``,
``rocm_built()`` and ``nccl_built()`` follow torch's build and the GPUs it sees, with Horovod's
return types (``nccl_built()`` is NCCL's version code or 0); torch's answers are replaced here,
so every case runs on any machine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commlayer as hvd


def _machine(
    monkeypatch: pytest.MonkeyPatch,
    *,
    cuda: str | None = None,
    hip: str | None = None,
    gpu: bool = False,
    nccl: tuple[int, ...] | None = None,
) -> None:
    """torch built with CUDA ``cuda`` / ROCm ``hip`` (versions, or None), a GPU seen or not,
    torch.distributed with NCCL ``nccl`` (its version, or None: no NCCL)."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl is not None)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)


@pytest.mark.parametrize(
    ("machine", "cuda", "rocm", "nccl"),
    [
        ({}, False, False, 0),  # torch's CPU build
        ({"cuda": "12.8"}, False, False, 0),  # CUDA build, no GPU seen
        ({"cuda": "12.8", "nccl": (2, 27, 3)}, False, False, 0),  # NCCL built, no GPU to use it
        ({"cuda": "12.8", "gpu": True}, True, False, 0),  # a GPU, torch without NCCL
        ({"cuda": "12.8", "gpu": True, "nccl": (2, 27, 3)}, True, False, 22703),
        ({"cuda": "11.0", "gpu": True, "nccl": (2, 7, 8)}, True, False, 2708),  # old code scheme
        ({"cuda": "11.8", "gpu": True, "nccl": (2, 19, 3, "+cuda11.8")}, True, False, 21903),
        ({"hip": "6.2", "gpu": True, "nccl": (2, 20, 5)}, False, True, 22005),  # RCCL
        ({"hip": "6.2"}, False, False, 0),
    ],
)
def test_built_follows_torch_and_the_gpus(
    monkeypatch: pytest.MonkeyPatch, machine: dict, cuda: bool, rocm: bool, nccl: int
) -> None:
    _machine(monkeypatch, **machine)
    assert hvd.cuda_built() is cuda and hvd.rocm_built() is rocm
    assert type(hvd.nccl_built()) is int and hvd.nccl_built() == nccl


def test_the_rest_is_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPI (mpi4py, a dependency) and gloo are built; no DDL, no oneCCL; nothing is enabled
    before init()."""
    assert hvd.mpi_built() is True and hvd.gloo_built() is True
    assert hvd.ddl_built() is False and hvd.ccl_built() is False
    assert (hvd.mpi_enabled(), hvd.gloo_enabled()) == (False, False)
    monkeypatch.setattr(hvd, "_find_spec", lambda name: None)
    assert hvd.mpi_built() is False  # mpi4py missing


def test_this_machine() -> None:
    """The real answers agree with torch's here (the CPU build on CI: all False, 0)."""
    gpu = torch.cuda.is_available()
    assert hvd.cuda_built() is (torch.version.cuda is not None and gpu)
    assert hvd.rocm_built() is (torch.version.hip is not None and gpu)
    assert bool(hvd.nccl_built()) is (dist.is_nccl_available() and gpu)
