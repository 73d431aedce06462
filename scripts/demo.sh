#!/usr/bin/env bash
# The README's first command: install what the demo needs, then train a small CNN on
# scikit-learn's digits on 2 ranks with commlayer (extra arguments go to the training script).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0      # the CPU wheel; an unpinned torch pulls GBs of CUDA
python3 -m pip install -q -e ".[mpich,demo]"  # mpi4py + the mpich wheel (mpiexec), sklearn, tqdm
export PATH="$(python3 -c 'import sys, os; print(os.path.dirname(sys.executable))'):$PATH"
exec commlayerrun -np "${NP:-2}" python3 examples/train_digits.py "$@"
