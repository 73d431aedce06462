#!/usr/bin/env bash
# The GPU checks (issue 25; the GPU parts of issues 6 and 7), for a machine with an NVIDIA GPU,
# CUDA's nvcc, torch with CUDA, CuPy and numba-cuda: the CUDA kernels built with nvcc, tests/gpu,
# the device cases of the parallel suite at 1 and 2 ranks under mpiexec and torchrun (ranks
# share the GPU), and the GPU benchmarks. CI has no GPU and never runs this; run it whenever one
# is lent, and commit what it wrote.
#
# Steps run in order of what is least verified on a GPU first (issue 35's paths without host
# waits, the direct NCCL/CUDA-aware paths, the kernels), then what earlier GPU sessions measured (staged paths, training step); with
# GPU_CHECKS_BUDGET_S set, each step gets at most what is left of that many seconds and the
# steps past it are skipped (listed as such), so a lease's one call returns a complete log;
# GPU_CHECKS_STEPS="name ..." runs only the steps named (env always runs), for a second call.
#
# Usage: [GPU_CHECKS_BUDGET_S=S] [GPU_CHECKS_STEPS="..."] bash scripts/gpu-checks.sh OUT_DIR [WHEEL_DIR]
#   OUT_DIR    gets gpu_checks.log (every step's output) and the benchmark tables (*.md)
#   WHEEL_DIR  optional: wheels to install first with --no-deps (mpi4py and mpich where the
#              machine's Python has no MPI library); installed under /tmp/commlayer-site. On the
#              lent H200 image leave it out: its mpi4py is built against its Open MPI, whose
#              /usr/bin/mpiexec matches (carried MPICH there still made singletons).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash scripts/gpu-checks.sh OUT_DIR [WHEEL_DIR]}"
WHEELS="${2:-}"
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
: >"$LOG"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # Open MPI's mpiexec as root
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
FAILED=()

if [[ -n "$WHEELS" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/commlayer-site "$WHEELS"/*.whl >>"$LOG" 2>&1 || echo "wheel install failed" >>"$LOG"
    export PYTHONPATH="/tmp/commlayer-site:$PYTHONPATH" PATH="/tmp/commlayer-site/bin:$PATH"
    # mpi4py's wheel loads the first libmpi it finds: point it at the carried MPICH's, which
    # matches the carried mpiexec (a system Open MPI's library under MPICH's launcher makes
    # every rank a job of its own).
    LIBMPI="$(find /tmp/commlayer-site -name 'libmpi.so.12' | head -n 1)"
    if [[ -n "$LIBMPI" ]]; then
        export MPI4PY_LIBMPI="$LIBMPI" LD_LIBRARY_PATH="$(dirname "$LIBMPI")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi

BUDGET="${GPU_CHECKS_BUDGET_S:-0}"
ONLY="${GPU_CHECKS_STEPS:-}"
SKIPPED=()
# step NAME LIMIT_S COMMAND...: run with a time limit (and within the budget), output appended
# to the log
step() {
    local name="$1" limit="$2" start=$SECONDS rc=0
    shift 2
    if [[ -n "$ONLY" && "$name" != env && " $ONLY " != *" $name "* ]]; then
        return
    fi
    if [[ "$BUDGET" -gt 0 ]]; then
        local left=$((BUDGET - SECONDS))
        if [[ $left -lt 20 ]]; then
            SKIPPED+=("$name")
            printf -- '---- %s: skipped (budget of %d s spent)\n' "$name" "$BUDGET" | tee -a "$LOG"
            return
        fi
        [[ $left -lt $limit ]] && limit=$left
    fi
    printf '\n==================== %s ====================\n' "$name" >>"$LOG"
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
    printf -- '---- %s: exit %d after %d s\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$LOG"
    [[ $rc -eq 0 ]] || FAILED+=("$name")
}

step env 60 bash -c '
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nvcc --version | tail -n 2
    python3 -c "import sys, torch; print(sys.version.split()[0], \"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
    python3 -c "import cupy; print(\"cupy\", cupy.__version__)"
    python3 -c "import numba, numba.cuda; print(\"numba\", numba.__version__, \"cuda available:\", numba.cuda.is_available())"
    python3 -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    command -v mpiexec
    python3 -c "import commlayer.kernels as k; print(\"commlayer kernels available:\", k.available())"'
# Issue 35's GPU paths first, the least verified: no host wait on the direct path, the staged
# path's H2D stream and pooled pinned buffers, and the device order of the reduced gradients
# (the same checks run on the CPU with fake streams: tests/parallel/test_stream_order.py)
step no-host-wait 180 "$PY" -m pytest tests/gpu/test_no_host_wait_cuda.py \
    tests/gpu/test_stream_order_cuda.py -q -rs -p no:cacheprovider
step nvcc-build 120 bash -c 'cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null && cmake --build build && ls build/ext/cuda'
step tests-gpu 300 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider \
    --ignore tests/gpu/test_no_host_wait_cuda.py --ignore tests/gpu/test_stream_order_cuda.py
# 1 rank per GPU: the torch backend takes CUDA tensors over NCCL directly (device.py's direct
# path; 2 ranks on one GPU are staged over gloo below); tests/gpu/test_direct_cuda.py (in
# tests-gpu) runs the direct worker at 1 and, with 2 GPUs, 2 ranks
step device-torchrun-1-nccl 120 env COMMLAYER_NCCL=1 "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node 1 -m pytest tests/parallel/test_device.py -q -p no:cacheprovider -x
step detect-cuda-aware-mpi 60 "$PY" -c 'from commlayer.backends import mpi; print("CUDA-aware MPI:", mpi.detect_cuda_aware("auto"))'
# Benchmarks (tables into OUT_DIR; commit them under benchmarks/results/). commlayer over NCCL
# vs torch.distributed.all_reduce alone, one rank per GPU (issue target:
# busbw >= 0.95 from 1 MiB; one GPU gives latency only)
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 1)"
step bench-nccl-allreduce 150 "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node "${GPUS:-1}" benchmarks/gpu_nccl_allreduce.py --max-size 256MiB --reps 3 \
    --out "$OUT/gpu_nccl_allreduce_np${GPUS:-1}.md"
step bench-kernels 120 "$PY" benchmarks/kernels.py --device cuda --out "$OUT/kernels_cuda.md"
# What earlier GPU sessions measured: the staged paths (ranks sharing the GPU), the training step
# mpiexec -n 2 must make one job of 2 ranks (not two singletons)
step mpi-size 60 mpiexec -n 2 "$PY" -c 'from mpi4py import MPI; size = MPI.COMM_WORLD.Get_size(); print("rank", MPI.COMM_WORLD.Get_rank(), "of", size, MPI.Get_library_version().splitlines()[0]); assert size == 2, "mpiexec -n 2 gave singletons"'
for n in 1 2; do
    step "device-mpiexec-$n" 120 mpiexec -n "$n" "$PY" -m pytest tests/parallel/test_device.py \
        -q -p no:cacheprovider -x
done
step device-torchrun-2 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
    -m pytest tests/parallel/test_device.py -q -p no:cacheprovider -x
step bench-allreduce-np1 90 "$PY" benchmarks/gpu_allreduce.py --max-size 64MiB --reps 3 \
    --out "$OUT/gpu_allreduce_np1.md"
step bench-allreduce-np2 120 mpiexec -n 2 "$PY" benchmarks/gpu_allreduce.py --max-size 64MiB \
    --reps 3 --out "$OUT/gpu_allreduce_np2.md"
step bench-train 200 "$PY" benchmarks/gpu_train.py --steps 30 --warmup 20 --budget-s 150 \
    --out "$OUT/gpu_train.md"

echo "failed steps: ${FAILED[*]:-none}; skipped: ${SKIPPED[*]:-none}" | tee -a "$LOG"
[[ ${#FAILED[@]} -eq 0 ]]
