#!/usr/bin/env bash
# Run Horovod's own elastic integration tests (test/integration/elastic_common.py of a
# horovod/horovod checkout, all eleven cases, with its elastic_torch_main.py changed only at its
# import line) through commlayerrun. What the tests import of horovod.runner is a shim written
# to a temporary directory: nothing of Horovod is copied into this repository.
#
#   bash scripts/horovod-elastic.sh PATH_TO_HOROVOD_CHECKOUT [--runs N] [-k EXPR]
#
# Prints pytest's report for each run; exit status 0 when every run passed every test. Not part
# of the test command: it needs a Horovod checkout (tests/system/test_elastic_horovod.py runs the
# same scenarios with a worker of our own).
set -euo pipefail
PY="${PYTHON:-python3}"
BIN="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
export PATH="$BIN:$PATH"
# What Horovod's elastic tests import besides horovod: mock, and psutil in its training script.
"$PY" -c 'import mock, psutil' 2>/dev/null || "$PY" -m pip install -q mock psutil
exec "$PY" "$(dirname "$0")/horovod_elastic.py" "$@"
