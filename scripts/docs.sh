#!/usr/bin/env bash
# Build the documentation site into site/ with MkDocs, warnings as errors (a broken link, a
# missing page, a docstring the API pages cannot render: each fails the build). The
# configuration, CLI and examples pages are generated from the code (scripts/docs_hooks.py).
#
#   bash scripts/docs.sh            build (scripts/test.sh's full run calls this)
#   bash scripts/docs.sh serve      preview at http://127.0.0.1:8000 while editing
#
# Uses the python of TEST_VENV (default .venv-test, made by scripts/test.sh) when it exists,
# else the active one; either needs `pip install -e ".[docs]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TEST_VENV:-$PWD/.venv-test}"
PY=python3
[[ -x "$VENV/bin/python" ]] && PY="$VENV/bin/python"
if ! "$PY" -c 'import mkdocs, mkdocstrings' 2>/dev/null; then
    echo "scripts/docs.sh: $PY lacks mkdocs: pip install -e \".[docs]\"" >&2
    exit 2
fi
case "${1:-build}" in
build) exec "$PY" -m mkdocs build --strict --clean ;;
serve) exec "$PY" -m mkdocs serve --strict ;;
*)
    echo "scripts/docs.sh: unknown argument '$1' (none to build, or serve)" >&2
    exit 2
    ;;
esac
