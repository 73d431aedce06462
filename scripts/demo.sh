#!/usr/bin/env bash
# The README's first command: install what the demo needs, then train a small CNN on
# scikit-learn's digits on 2 ranks with commlayer (extra arguments go to the training script).
# Installs into the active virtual environment, or else into ./.venv (made here if missing), so
# that a system Python that refuses pip installs (PEP 668) is never touched.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PY="$(command -v python3)"
else
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    PY="$PWD/.venv/bin/python"
fi
bash scripts/install-torch.sh "$PY"            # the tested CPU build (TORCH_INDEX_URL: see there)
"$PY" -m pip install -q -e ".[mpich,demo]"     # mpi4py + the mpich wheel (mpiexec), sklearn, tqdm
PATH="$(dirname "$PY"):$PATH"
export PATH
exec commlayerrun -np "${NP:-2}" "$PY" examples/train_digits.py "$@"
