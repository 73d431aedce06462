"""The MPI backend refuses device memory where its MPI is not CUDA-aware (issue 25): a CUDA
tensor's address handed to such an MPI would be read as host memory. Collectives never hand it
one (they stage CUDA tensors through the host, commlayer/core/device.py); a direct backend call is
refused, named."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)


def test_mpi_backend_refuses_a_cuda_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from commlayer.backends import mpi

    monkeypatch.setattr(mpi, "_cuda_aware", False)
    with pytest.raises(ValueError, match=r"MPI backend moves host memory here \(not CUDA-aware"):
        mpi._spec(torch.zeros(4, device="cuda"))
