#!/usr/bin/env bash
# Install SimGrid's SMPI (smpicc, smpirun) for `commlayer simulate` and its system tests
# (tests/system/test_simulate.py). Idempotent: nothing to do when both are on PATH.
#
#   bash scripts/install-simgrid.sh     # Debian/Ubuntu: apt-get install libsimgrid-dev (~1 min)
#
# Where it cannot install (no apt-get, not root and no sudo, no network) it says why and exits
# 0: the simulation tests then skip, printing that reason. scripts/test.sh runs it.
set -uo pipefail
if command -v smpicc >/dev/null && command -v smpirun >/dev/null; then
    echo "install-simgrid: $(smpirun -version 2>/dev/null | head -1 || echo SimGrid) already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install-simgrid: no apt-get here; install SimGrid (smpicc, smpirun) by hand" >&2
    exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-simgrid: not root and no passwordless sudo; cannot apt-get install libsimgrid-dev" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libsimgrid-dev >/dev/null; }; then
    echo "install-simgrid: apt-get install libsimgrid-dev failed (see above)" >&2
    exit 0
fi
echo "install-simgrid: $(smpirun -version 2>/dev/null | head -1 || echo SimGrid) installed"
