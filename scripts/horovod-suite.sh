#!/usr/bin/env bash
# Run Horovod's own PyTorch test file (test/parallel/test_torch.py of a horovod/horovod checkout)
# against commlayer: `import horovod.torch as hvd` is pointed at `commlayer` by a shim written to a
# temporary directory (nothing of Horovod is copied into this repository).
#
#   bash scripts/horovod-suite.sh PATH_TO_HOROVOD_CHECKOUT [NP] [--one-job] [--torchrun]
#       [--timeout S] [--sync-timeout S] [-k EXPR] [--out DIR]
#
# Default: every test in its own `mpiexec -n NP` job with a timeout (a hang or a crash costs one
# test). --one-job: the whole file in one job, as Horovod's CI runs it (a test that leaves the
# ranks out of step ends the job and a fresh one starts at the next test; --sync-timeout: how
# long the ranks that left a test wait for the others before calling it so, default --timeout).
# --horovod: the installed Horovod instead of commlayer (bash scripts/install-horovod.sh), same
# harness.
# Prints one line a test (passed / failed / skipped / hung) and a summary; exit status 0 when
# no test failed or hung. Not part of the test command: it needs a Horovod checkout.
set -euo pipefail
PY="${PYTHON:-python3}"
BIN="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
export PATH="$BIN:$PATH"
# What Horovod's test/utils/common.py imports.
"$PY" -c 'import mock, cloudpickle, packaging' 2>/dev/null ||
    "$PY" -m pip install -q mock cloudpickle packaging
exec "$PY" "$(dirname "$0")/horovod_suite.py" "$@"
