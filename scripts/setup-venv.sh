#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the pinned installs.
# Idempotent: a stamp holding the hash of the requirement files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FLYWHEEL_VENV:-.venv}
stamp="$VENV/.flywheel-stamp"
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# torch first and exactly pinned: a looser spec would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
"$VENV/bin/python" -m pip install -q -r requirements.txt -r requirements-dev.txt >&2
"$VENV/bin/python" -m pip install -q --no-deps -e . >&2
echo "$want" > "$stamp"
