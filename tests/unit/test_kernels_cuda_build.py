"""The CUDA kernels (ext/cuda/*.cu) compile with nvcc, alone and through CMakeLists.txt, and with
NVRTC as the CuPy loader compiles them when no prebuilt PTX is found, and the PTX exports every
kernel the loader asks for; the loader itself needs CuPy and a GPU."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "ext" / "cuda").glob("*.cu"))
NVCC = shutil.which("nvcc") or next(
    (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin)")
KERNELS = {
    "sparse_kernels": [
        f"{kind}_{v}_{i}"
        for kind in ("scatter_add", "match", "merge_a", "merge_b")
        for v in ("f32", "f64")
        for i in ("i32", "i64")
    ]
    + [f"threshold_mask_{v}" for v in ("f32", "f64")]
    + [f"threshold_scatter_{i}" for i in ("i32", "i64")],
    "quantize_kernels": [
        f"{kind}_{v}"
        for kind in ("qsgd_pack", "qsgd_levels16", "qsgd_unpack", "qsgd_unpack16")
        + ("sign_pack", "sign_decode")
        for v in ("f32", "f64")
    ],
}


def entries(ptx: str) -> set[str]:
    return {line.split("(")[0].split()[-1] for line in ptx.splitlines() if ".entry" in line}


@needs_nvcc
def test_nvcc_compiles_every_kernel(tmp_path: Path) -> None:
    assert SOURCES, "no ext/cuda/*.cu"
    for source in SOURCES:
        out = tmp_path / (source.stem + ".ptx")
        run = subprocess.run(
            [str(NVCC), "-ptx", "--std=c++17", "-o", str(out), str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
    assert sorted(s.stem for s in SOURCES) == sorted(KERNELS), "a .cu file without a test"
    for module, names in KERNELS.items():
        assert set(names) <= entries((tmp_path / f"{module}.ptx").read_text()), module


@needs_nvcc
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_builds_the_ptx(tmp_path: Path) -> None:
    configure = [
        "cmake", "-S", str(ROOT), "-B", str(tmp_path), f"-DCMAKE_CUDA_COMPILER={NVCC}",
    ]  # fmt: skip
    for command in (configure, ["cmake", "--build", str(tmp_path)]):
        run = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
    for module, names in KERNELS.items():
        assert set(names) <= entries((tmp_path / "ext" / "cuda" / f"{module}.ptx").read_text())


def _nvrtc() -> ctypes.CDLL | None:
    """libnvrtc of the nvidia-cuda-nvrtc wheel (the test extra), its builtins loaded first: it
    opens them by name, which the dynamic loader would not find in the wheel's folder."""
    try:
        import nvidia  # the namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for folder in (Path(base) for base in nvidia.__path__):
        for lib in sorted(folder.glob("*/lib/libnvrtc.so.*")):
            for builtins in sorted(lib.parent.glob("libnvrtc-builtins.so.*")):
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(lib))
    return None


def _nvrtc_ptx(nvrtc: ctypes.CDLL, source: Path) -> tuple[int, str, str]:
    """(result code, log, PTX) of NVRTC on ``source`` with the options cupy_cuda.module gives
    (C++17, the sources' folder on the include path), for the oldest architecture we target."""
    program = ctypes.c_void_p()
    text = source.read_bytes()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), text, source.name.encode(), 0,
                                    None, None) == 0  # fmt: skip
    options = [b"--std=c++17", f"-I{source.parent}".encode(), b"-arch=compute_75"]
    code = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * 3)(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    ptx = b""
    if code == 0:
        nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(program, buffer)
        ptx = buffer.value
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return code, log.value.decode(errors="replace"), ptx.decode()


def test_nvrtc_compiles_every_kernel() -> None:
    """The loader's fallback (no nvcc-built PTX): on an H200 every QSGD kernel failed there
    while the nvcc-built PTX of the same source passed; NVRTC has no stdint.h."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc; the test extra has it)")
    for source in SOURCES:
        code, log, ptx = _nvrtc_ptx(nvrtc, source)
        assert code == 0, f"{source.name}: NVRTC result {code}: {log}"
        assert set(KERNELS[source.stem]) <= entries(ptx), source.name


def test_cupy_loader_on_a_gpu() -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy not installed: the CuPy path cannot run here")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device: the CuPy path cannot run here")
    import torch

    from commlayer.kernels import cupy_cuda, reference

    idx_a = torch.arange(0, 1001, 2, dtype=torch.int32, device="cuda")
    idx_b = torch.arange(0, 1001, 3, dtype=torch.int32, device="cuda")
    val_a = torch.ones(idx_a.numel(), device="cuda")
    val_b = torch.full((idx_b.numel(),), 2.0, device="cuda")
    got = cupy_cuda.merge_sum(idx_a, val_a, idx_b, val_b)
    expect = reference.merge_sum(idx_a, val_a, idx_b, val_b)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    x = torch.randn(1001, device="cuda")
    x[::7] = 0.0
    assert torch.equal(cupy_cuda.pack_signs(x), reference.pack_signs(x))
    rows = x[:1000].view(4, 250)
    norms = torch.linalg.vector_norm(rows, dim=1)
    rand = torch.rand(rows.shape, device="cuda")
    for levels, bits in ((7, 4), (127, 8), (1000, 16)):
        packed = cupy_cuda.qsgd_quantize(rows, levels / norms, rand, levels, bits)
        assert torch.equal(packed, reference.qsgd_quantize(rows.clone(), levels / norms, rand,
                                                           levels, bits))  # fmt: skip
        step = norms / levels
        got_v, got_top = cupy_cuda.qsgd_dequantize(packed, step, levels, bits, 250)
        ref_v, ref_top = reference.qsgd_dequantize(packed, step, levels, bits, 250)
        assert torch.equal(got_v, ref_v) and got_top == ref_top
