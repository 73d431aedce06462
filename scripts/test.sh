#!/usr/bin/env bash
# Set up and run the tests. This is THE test command (README; CI runs it through .ci/run).
#
#   bash scripts/test.sh           every test: lint, types, the docs site (scripts/docs.sh), unit
#                                  and system tests, the parallel suite under mpiexec at 1, 2, 3
#                                  and 4 ranks, then under torchrun (commlayer over gloo) at 1, 2,
#                                  3 and 4 processes, and the optimizer's suites at 3 ranks with
#                                  COMMLAYER_PLANNED_SKIP_NEGOTIATION=on and with
#                                  COMMLAYER_WINDOW_BUCKETS=on
#   bash scripts/test.sh --quick   the fast tier: lint, types, the docs site, unit tests and the
#                                  parallel suite at 2 ranks under mpiexec and under torchrun,
#                                  without the tests marked slow (a few minutes)
#
# On 2 cores, single-process stages share the time: mypy and the docs build run beside the unit
# tests, and the 1-rank parallel runs under mpiexec and torchrun side by side (``lanes``).
#
# Every full run installs into a virtual environment made anew (no system site packages, only
# what pyproject.toml declares), so a dependency nothing installs fails here as on a fresh
# machine. --quick reuses that environment while pyproject.toml, the torch pin and the Python
# are those it was made for, and makes it anew otherwise.
# TEST_VENV: where the environment lives (default: .venv-test in the checkout; not a COMMLAYER_*
# name, since commlayer refuses COMMLAYER_* variables it does not know).
# TORCH_INDEX_URL: where torch's CPU build comes from (scripts/install-torch.sh).
# Needs python3 >= 3.10 with venv and pip; runs from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
case "${1:-}" in
"") ;;
--quick) QUICK=1 ;;
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
    ;;
*)
    echo "scripts/test.sh: unknown argument '$1' (none for every test, or --quick)" >&2
    exit 2
    ;;
esac

VENV="${TEST_VENV:-$PWD/.venv-test}"
# Per mpiexec run; the 4-rank suite takes a fraction of this on 2 cores, a hang does not.
PARALLEL_TIMEOUT_S=600
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# One BLAS/OpenMP thread per rank: 4 ranks on 2 cores must not each spawn a thread per core.
export OMP_NUM_THREADS=1

# Everything this script prints is also kept in RUN_LOG, so that a failure's summary (the last
# lines, which is what CI keeps of a run) can name the failing tests and timeouts.
RUN_LOG="$(mktemp)"
exec > >(tee -a "$RUN_LOG") 2>&1

START_S=$SECONDS
STAGE="setup"
STAGE_HEADER=""
DONE=()

stage() {
    STAGE="$1"
    STAGE_START_S=$SECONDS
    STAGE_HEADER="==================== $STAGE ===================="
    printf '\n%s\n' "$STAGE_HEADER"
}

stage_done() {
    local result="$1"
    DONE+=("$STAGE: $result ($((SECONDS - STAGE_START_S)) s)")
    echo "---- $STAGE: $result"
}

# MPICH's shared-memory files of ranks this run killed (the fault tests SIGKILL ranks): MPICH
# unlinks them in MPI_Finalize, which a killed rank never reaches, and they would fill /dev/shm
# run after run. Those made since the run began and mapped by no process are removed at the end.
SHM_MARK="$(mktemp)"
clean_shm() {
    local mapped removed=0 f
    mapped="$(cat /proc/[0-9]*/maps 2>/dev/null | grep -o '/dev/shm/mpich_shm_[^ ]*' | sort -u || true)"
    while IFS= read -r f; do
        [[ -n "$f" ]] || continue
        if grep -qxF "$f" <<<"$mapped"; then
            continue
        fi
        rm -f "$f" && removed=$((removed + 1))
    done < <(find /dev/shm -maxdepth 1 -name 'mpich_shm_*' -newer "$SHM_MARK" 2>/dev/null)
    rm -f "$SHM_MARK"
    [[ $removed -eq 0 ]] || echo "removed $removed MPICH shared-memory file(s) left by killed ranks"
}

summary() {
    local rc=$?
    clean_shm
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
        what_failed
        echo "scripts/test.sh: FAILED at stage '$STAGE' after ${elapsed_s} s"
    fi
    rm -f "$RUN_LOG"
}

# The failing stage's failed tests (on any rank), errors, timeouts, aborts, pytest's
# failure locations (tests/...:line:) and the frames of test files in the stacks
# a timeout dumps (pytest-timeout's on rank 0, conftest's on the others), at most 40 lines.
FAILED_LINES='^(\[rank [0-9]+\] )?(FAILED|ERROR) |TIMEOUT:|ABORT during|[+]{5} Timeout'
FAILED_LINES+='|^E   |^tests/[^ ]+:[0-9]+: |File "[^"]*/tests/'
what_failed() {
    local lines
    lines="$(awk -v header="$STAGE_HEADER" \
        '$0 == header { n = 0 } { kept[++n] = $0 } END { for (i = 1; i <= n; i++) print kept[i] }' \
        "$RUN_LOG" |
        grep -E "$FAILED_LINES" |
        grep -vE 'in (_write_stacks|_dump_stacks_and_exit)$' | awk '!seen[$0]++' | head -n 40 ||
        true)"
    [[ -n "$lines" ]] || return 0
    echo "  what failed, from the stage's output:"
    sed 's/^/    | /' <<<"$lines"
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

# What the environment was made from: made anew when any of it changes.
fingerprint() {
    cat pyproject.toml scripts/install-torch.sh
    python3 -c 'import sys; print(sys.version)'
}

stage "install"
want="$(fingerprint | sha256sum | cut -d' ' -f1)"
PY="$VENV/bin/python"
if [[ $QUICK -eq 1 && -f "$VENV/.commlayer-fingerprint" && "$(cat "$VENV/.commlayer-fingerprint")" == "$want" ]]; then
    echo "reusing $VENV (made for this pyproject.toml; a full run makes it anew)"
else
    rm -f "$VENV/.commlayer-fingerprint"
    python3 -m venv --clear "$VENV"
    bash scripts/install-torch.sh "$PY"
    # test: pytest, ruff, mypy, numba, pillow...; mpich: mpi4py and an MPI with mpiexec;
    # demo: the demo system test; docs: scripts/docs.sh
    "$PY" -m pip install -q -e ".[test,mpich,demo,docs]"
    echo "$want" >"$VENV/.commlayer-fingerprint"
fi
# mpiexec (from the mpich wheel) and torchrun live next to this python; put them first so that
# neither a system MPI's mpiexec nor a stale shim is picked up.
PATH="$VENV/bin:$PATH"
export PATH
unset PYTHONPATH
echo "python: $PY ($("$PY" -c 'import torch, mpi4py; print("torch", torch.__version__, "mpi4py", mpi4py.__version__)'))"
echo "mpiexec: $(command -v mpiexec)"
if [[ $QUICK -eq 0 ]]; then
    # SimGrid's smpicc/smpirun for `commlayer simulate` (tests/system/test_simulate.py); where
    # it cannot be installed the script says why and those tests skip with that reason.
    bash scripts/install-simgrid.sh
fi
stage_done "ok"

stage "ruff"
lint_paths=()
for path in commlayer tests benchmarks examples integrations scripts; do
    [[ -e "$path" ]] && lint_paths+=("$path")
done
"$PY" -m ruff check "${lint_paths[@]}"
stage_done "ok"


if [[ $QUICK -eq 1 ]]; then
    ranks=(2)
    select=(-m "not slow")
else
    ranks=(1 2 3 4)
    select=()
fi

# Two single-process lanes at once, one core each (this machine has 2): each lane's output is
# kept in a file and printed when both have ended; the stage fails naming the lane that failed.
# Usage: lanes "<stage name>" <function of lane 1> <function of lane 2>
lanes() {
    stage "$1"
    local logs rc1=0 rc2=0 pid1 pid2
    logs="$(mktemp -d)"
    "$2" >"$logs/1" 2>&1 &
    pid1=$!
    "$3" >"$logs/2" 2>&1 &
    pid2=$!
    wait "$pid1" || rc1=$?
    wait "$pid2" || rc2=$?
    printf -- '-------- %s\n' "$2"
    cat "$logs/1"
    printf -- '-------- %s\n' "$3"
    cat "$logs/2"
    rm -rf "$logs"
    if [[ $rc1 -ne 0 ]]; then
        STAGE="$1: $2"
        return "$rc1"
    fi
    if [[ $rc2 -ne 0 ]]; then
        STAGE="$1: $3"
        return "$rc2"
    fi
    stage_done "ok"
}

mypy_then_docs() {
    "$PY" -m mypy
    # the site, warnings as errors (broken links, pages the code generates)
    TEST_VENV="$VENV" bash scripts/docs.sh
}

# -rfEs: each failed or erroring test on a line of its own (what_failed lists them), why a test
# skipped; --durations: where the time goes, for keeping the suite short
unit_tests() {
    run_pytest tests/unit "$PY" -m pytest tests/unit -q -rfEs --durations=25 -p no:cacheprovider \
        "${select[@]+"${select[@]}"}"
}

parallel_mpiexec() { # $1: ranks
    run_pytest tests/parallel timeout -k 30 "$PARALLEL_TIMEOUT_S" \
        mpiexec -n "$1" "$PY" -m pytest tests/parallel -q -p no:cacheprovider -x --durations=10 \
        "${select[@]+"${select[@]}"}" </dev/null
}

parallel_torchrun() { # $1: processes
    # --standalone: a rendezvous on a free local port (two runs never share one)
    run_pytest tests/parallel timeout -k 30 "$PARALLEL_TIMEOUT_S" \
        "$PY" -m torch.distributed.run --standalone --nproc_per_node "$1" \
        -m pytest tests/parallel -q -p no:cacheprovider -x --durations=10 \
        "${select[@]+"${select[@]}"}" </dev/null
}

# mypy and the docs site (one process each, in turn) beside the unit tests (one process)
lanes "mypy + docs | pytest tests/unit" mypy_then_docs unit_tests

# The system tests in two lanes: the elastic jobs on this machine (discovery periods,
# cooldowns, timeouts), the examples and the algorithm CLI, none on the namespace cluster,
# beside the rest (the cluster's tests among them, which must not share the cluster with
# another job). Alone, the first lane (before the algorithm CLI joined it) took 421 s and 615 s
# of CPU (1.5 cores). The lanes took 420 s and 815 s: the local elastic driver's and the
# elastic example's tests (gloo, no cluster) joined the first; then 658 s and about 1100 s, and
# the examples (about 200 s of the second) joined the first too; then 733 s and 847 s, and the
# algorithm CLI's tests (MPI jobs on this machine, no cluster: about 70 s) joined the first as
# well; then 698 s and 726 s.
ELASTIC_LOCAL=(
    tests/system/test_elastic_horovod.py tests/system/test_elastic_membership.py
    tests/system/test_elastic_driver.py tests/system/test_elastic_example.py
    tests/system/test_examples.py tests/system/test_algorithms_cli.py
)
system_elastic() {
    run_pytest tests/system "$PY" -m pytest "${ELASTIC_LOCAL[@]}" -q -rfEs --durations=10 \
        -p no:cacheprovider
}
system_rest() {
    local skip=() f
    for f in "${ELASTIC_LOCAL[@]}"; do skip+=(--ignore "$f"); done
    run_pytest tests/system "$PY" -m pytest tests/system "${skip[@]}" -q -rfEs --durations=25 \
        -p no:cacheprovider
}

if [[ $QUICK -eq 0 ]]; then
    lanes "pytest tests/system: elastic and examples | the rest" system_elastic system_rest
fi

for n in "${ranks[@]}"; do
    if [[ $n -eq 1 ]]; then
        # one process each: both 1-rank runs at once
        one_mpiexec() { parallel_mpiexec 1; }
        one_torchrun() { parallel_torchrun 1; }
        lanes "pytest parallel, mpiexec -n 1 | torchrun --nproc_per_node 1" one_mpiexec one_torchrun
        continue
    fi
    stage "pytest parallel, mpiexec -n $n"
    parallel_mpiexec "$n"
    stage_done "ok"
done

# The optimizer's suites again with each opt-in path of its planned buckets (~30 s each, at
# 3 ranks): on their lanes, without negotiation (COMMLAYER_PLANNED_SKIP_NEGOTIATION,
# docs/planned_lanes.md), under mpiexec; in a shared-memory window (COMMLAYER_WINDOW_BUCKETS),
# under torchrun.
OPT_IN=(
    tests/parallel/test_optimizer.py tests/parallel/test_join.py
    tests/parallel/test_optimizer_memory.py tests/parallel/test_planned_lanes.py
    tests/parallel/test_window_buckets.py tests/parallel/test_process_sets.py
    tests/parallel/test_stream_order.py tests/parallel/test_device.py
    tests/parallel/test_elastic.py tests/parallel/test_horovod_dropin.py
)
if [[ $QUICK -eq 0 ]]; then
    stage "pytest parallel, mpiexec -n 3, planned buckets without negotiation"
    COMMLAYER_PLANNED_SKIP_NEGOTIATION=on run_pytest tests/parallel \
        timeout -k 30 "$PARALLEL_TIMEOUT_S" mpiexec -n 3 "$PY" -m pytest "${OPT_IN[@]}" -q \
        -p no:cacheprovider -x </dev/null
    stage_done "ok"
    stage "pytest parallel, torchrun --nproc_per_node 3, planned buckets in a window"
    COMMLAYER_WINDOW_BUCKETS=on run_pytest tests/parallel \
        timeout -k 30 "$PARALLEL_TIMEOUT_S" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node 3 -m pytest "${OPT_IN[@]}" -q -p no:cacheprovider -x </dev/null
    stage_done "ok"
fi

for n in "${ranks[@]}"; do
    [[ $n -eq 1 ]] && continue # ran beside mpiexec -n 1
    stage "pytest parallel, torchrun --nproc_per_node $n"
    parallel_torchrun "$n"
    stage_done "ok"
done
