"""numba-cuda kernels (scatter-add, threshold selection, QSGD quantize/dequantize, sign
packing/decoding) under the CUDA simulator against the torch reference. The simulator must be
chosen before numba.cuda is first imported, so the checks run in a fresh interpreter with
NUMBA_ENABLE_CUDASIM=1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from commlayer import kernels

pytestmark = pytest.mark.skipif(
    not kernels.available()["numba"], reason="numba (and numba-cuda) not installed"
)

CHECKS = textwrap.dedent(
    """
    import torch
    from numba import cuda
    assert cuda.simulator_enabled if hasattr(cuda, "simulator_enabled") else True
    from commlayer.kernels import numba_cuda, reference

    for n in (1, 7, 1001):
        g = torch.Generator().manual_seed(n)
        for dtype in (torch.float32, torch.float64):
            idx = torch.randint(0, n, (2 * n + 1,), generator=g, dtype=torch.int32)
            val = torch.randint(-4, 5, (idx.numel(),), generator=g).to(dtype)
            base = torch.randint(-4, 5, (n,), generator=g).to(dtype)
            got = numba_cuda.scatter_add_(base.clone(), idx, val)
            assert torch.equal(got, reference.scatter_add_(base.clone(), idx, val)), (n, dtype)
            x = torch.randn(n, generator=g, dtype=dtype)
            for threshold in (0.0, 0.5, 1.0 / 3.0, 9.0):
                got = numba_cuda.threshold_select(x, threshold)
                expect = reference.threshold_select(x, threshold)
                assert torch.equal(got, expect), (n, dtype, threshold)
    for n, bucket, levels, bits in ((1, 1, 1, 2), (77, 5, 7, 4), (301, 64, 127, 8),
                                    (130, 50, 1000, 16)):
        g = torch.Generator().manual_seed(n)
        for dtype in (torch.float32, torch.float64):
            buckets = -(-n // bucket)
            x = torch.zeros(buckets * bucket, dtype=dtype)
            x[:n] = torch.randn(n, generator=g, dtype=dtype)
            x = x.view(buckets, bucket)
            norms = torch.linalg.vector_norm(x, dim=1)
            scale = torch.where(norms > 0, levels / norms, torch.zeros_like(norms))
            rand = torch.rand(x.shape, generator=g, dtype=dtype)
            got = numba_cuda.qsgd_quantize(x, scale, rand, levels, bits)
            expect = reference.qsgd_quantize(x.clone(), scale, rand, levels, bits)
            assert torch.equal(got, expect), (n, dtype, bits)
            step = (norms / levels).to(dtype)
            got_v, got_top = numba_cuda.qsgd_dequantize(got, step, levels, bits, bucket)
            ref_v, ref_top = reference.qsgd_dequantize(got, step, levels, bits, bucket)
            assert torch.equal(got_v, ref_v) and got_top == ref_top, (n, dtype, bits)
            x = x.view(-1)[:n]
            x[::3] = 0.0
            words = numba_cuda.pack_signs(x)
            assert torch.equal(words, reference.pack_signs(x)), (n, dtype)
            pos, neg = torch.tensor(0.5, dtype=dtype), torch.tensor(-2.0, dtype=dtype)
            got = numba_cuda.decode_signs(words, n, pos, neg)
            assert torch.equal(got, reference.decode_signs(words, n, pos, neg)), (n, dtype)
    print("cudasim checks passed")
    """
)


def test_numba_cuda_kernels_match_reference_in_simulator() -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    run = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cudasim checks passed" in run.stdout
