#!/usr/bin/env bash
# Build Horovod 0.28.1 (CPU, MPI controller and operations) against this environment's torch and
# MPI, so that benchmarks/train.py measures it in the same run as commlayer and DDP.
#
#   bash scripts/install-horovod.sh        # ~5 minutes on 2 cores
#
# Horovod 0.28.1 (its last release) compiles with -std=c++14, which torch >= 2.1 headers refuse
# ("C++17 or later compatible compiler is required"): the sdist is patched to C++17. The MPI is
# the one beside this Python (the mpich wheel's mpicxx), else the system's. Not part of the
# test command: Horovod is a baseline for the benchmark, not a dependency.
set -euo pipefail
PY="${PYTHON:-python3}"
BIN="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
export PATH="$BIN:$PATH"
command -v mpicxx >/dev/null || { echo "install-horovod: no mpicxx (pip install mpich, or a system MPI)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
tar xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
src="$work/horovod-0.28.1"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
"$PY" -m pip install -q psutil cloudpickle pyyaml packaging
command -v cmake >/dev/null || "$PY" -m pip install -q "cmake<4"  # 0.28.1 predates CMake 4
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI \
    MAKEFLAGS="-j$(nproc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip install -q --no-build-isolation --no-deps "$src"
"$PY" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "mpi built:", hvd.mpi_built())'
