#!/usr/bin/env bash
# Install the tested torch, CPU build, into PYTHON's environment (default: python3).
#   bash scripts/install-torch.sh [PYTHON]
# The pin is the version every test and benchmark here ran with. On PyPI, torch for Linux x86_64
# is the CUDA build (gigabytes); the CPU build comes from PyTorch's own CPU wheel index:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install-torch.sh
# Without TORCH_INDEX_URL pip looks where it is configured to (our machines serve a local CPU
# wheel of this version).
set -euo pipefail
TORCH_VERSION="2.13.0"
PYTHON="${1:-python3}"
index=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && index=(--index-url "$TORCH_INDEX_URL")
"$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" "${index[@]+"${index[@]}"}"
