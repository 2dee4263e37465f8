#!/usr/bin/env bash
# Builds the API reference (docs/api, Sphinx + napoleon) into build/docs/api with warnings as errors.
# Sphinx is installed into build/docs-deps when this Python lacks it (nothing is installed system-wide).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
deps=build/docs-deps
if ! "$PY" -c "import sphinx" 2>/dev/null; then
    if ! PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import sphinx" 2>/dev/null; then
        "$PY" -m pip install -q --target "$deps" "sphinx>=7"
    fi
    export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -m sphinx -W --keep-going -q -b html docs/api build/docs/api
echo "API reference: build/docs/api/index.html"
