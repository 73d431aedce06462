#!/usr/bin/env bash
# Set up and run every test: lint, types, unit and system tests, and the parallel suite under
# mpiexec at 1, 2, 3 and 4 ranks, then under torchrun (commlayer over torch.distributed's gloo)
# at 1, 2, 3 and 4 processes. This is THE test command (README, and CI via .ci/run).
# Usage: bash scripts/test.sh   (from anywhere; needs python3 >= 3.10 and pip)
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: 2.13.0 is a local CPU wheel on our machines; an unpinned torch pulls GBs of CUDA.
TORCH_VERSION="2.13.0"
# Per mpiexec run; the 4-rank suite takes a fraction of this on 2 cores, a hang does not.
PARALLEL_TIMEOUT_S=600
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# One BLAS/OpenMP thread per rank: 4 ranks on 2 cores must not each spawn a thread per core.
export OMP_NUM_THREADS=1

START_S=$SECONDS
STAGE="setup"
DONE=()

stage() {
    STAGE="$1"
    STAGE_START_S=$SECONDS
    printf '\n==================== %s ====================\n' "$STAGE"
}

stage_done() {
    local result="$1"
    DONE+=("$STAGE: $result ($((SECONDS - STAGE_START_S)) s)")
    echo "---- $STAGE: $result"
}

summary() {
    local rc=$?
    local elapsed_s=$((SECONDS - START_S))
    printf '\n==================== summary ====================\n'
    local line
    for line in "${DONE[@]+"${DONE[@]}"}"; do
        echo "  ok   $line"
    done
    if [[ $rc -eq 0 ]]; then
        echo "scripts/test.sh: ALL PASSED in ${elapsed_s} s"
    else
        echo "  FAIL $STAGE (exit code $rc)"
        echo "scripts/test.sh: FAILED at stage '$STAGE' after ${elapsed_s} s"
    fi
}
trap summary EXIT

# Test files pytest would collect under the given directories (0 if none or missing).
count_test_files() {
    local dir count=0
    for dir in "$@"; do
        [[ -d "$dir" ]] || continue
        count=$((count + $(find "$dir" -name 'test_*.py' -o -name '*_test.py' | wc -l)))
    done
    echo "$count"
}

# Run pytest; exit code 5 (no tests collected) passes only when there are no test files at all.
# Usage: run_pytest "<dirs>" <command...>
run_pytest() {
    local dirs="$1"
    shift
    local rc=0
    "$@" || rc=$?
    # shellcheck disable=SC2086  # $dirs is a space-separated list of directories
    if [[ $rc -eq 5 && $(count_test_files $dirs) -eq 0 ]]; then
        rc=0
    fi
    return "$rc"
}

stage "install"
python3 -m pip install -q "torch==${TORCH_VERSION}"
python3 -m pip install -q -e ".[test,mpich,demo]"  # demo: the demo system test
PY="$(python3 -c 'import sys; print(sys.executable)')"
# mpiexec (from the mpich wheel) lives next to this python; put it first so that neither a
# system MPI's mpiexec nor a stale pyenv shim is picked up.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
echo "python: $PY ($("$PY" -c 'import torch, mpi4py; print("torch", torch.__version__, "mpi4py", mpi4py.__version__)'))"
echo "mpiexec: $(command -v mpiexec)"
# SimGrid's smpicc/smpirun for `commlayer simulate` (tests/system/test_simulate.py); where it
# cannot be installed the script says why and those tests skip with that reason.
bash scripts/install-simgrid.sh
stage_done "ok"

stage "ruff"
lint_paths=()
for path in commlayer tests benchmarks; do
    [[ -e "$path" ]] && lint_paths+=("$path")
done
"$PY" -m ruff check "${lint_paths[@]}"
stage_done "ok"

stage "mypy"
"$PY" -m mypy
stage_done "ok"

stage "pytest unit + system"
test_dirs=()
for dir in tests/unit tests/system; do
    [[ -d "$dir" ]] && test_dirs+=("$dir")
done
run_pytest "${test_dirs[*]}" "$PY" -m pytest "${test_dirs[@]}" -q -rs  # -rs: print why a test skipped
stage_done "ok"

for n in 1 2 3 4; do
    stage "pytest parallel, mpiexec -n $n"
    if [[ $(count_test_files tests/parallel) -eq 0 ]]; then
        stage_done "skipped (no test files in tests/parallel)"
        continue
    fi
    run_pytest tests/parallel timeout -k 30 "$PARALLEL_TIMEOUT_S" \
        mpiexec -n "$n" "$PY" -m pytest tests/parallel -q -p no:cacheprovider -x </dev/null
    stage_done "ok"
done

for n in 1 2 3 4; do
    stage "pytest parallel, torchrun --nproc_per_node $n"
    if [[ $(count_test_files tests/parallel) -eq 0 ]]; then
        stage_done "skipped (no test files in tests/parallel)"
        continue
    fi
    # --standalone: a rendezvous on a free local port (two runs never share one)
    run_pytest tests/parallel timeout -k 30 "$PARALLEL_TIMEOUT_S" \
        "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" \
        -m pytest tests/parallel -q -p no:cacheprovider -x </dev/null
    stage_done "ok"
done
