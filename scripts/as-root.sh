#!/usr/bin/env bash
# Run a command as root: directly when you are root, through sudo otherwise, keeping your
# environment and PATH (so the python, torchrun and commlayerrun of your virtual environment
# are the ones that run). The namespace cluster needs root; this lets one README line work for
# a root user and for a sudo user alike.
#   bash scripts/as-root.sh CMD [ARGS...]
set -euo pipefail
[[ $# -ge 1 ]] || {
    echo "usage: bash scripts/as-root.sh CMD [ARGS...]" >&2
    exit 2
}
if [[ $EUID -eq 0 ]]; then
    exec "$@"
fi
command -v sudo >/dev/null || {
    echo "as-root: '$1' needs root, you are not (EUID $EUID) and there is no sudo" >&2
    exit 1
}
exec sudo --preserve-env -- env "PATH=$PATH" "$@"
