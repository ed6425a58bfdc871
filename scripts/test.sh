#!/usr/bin/env bash
# The whole test suite: set up .venv (pinned, with the vLLM CPU backend) and run pytest.
# Extra arguments go to pytest. FLYWHEEL_WITH_VLLM=0 skips installing vLLM (its tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
FLYWHEEL_WITH_VLLM=${FLYWHEEL_WITH_VLLM:-1} bash scripts/setup-venv.sh --test
exec .venv/bin/python -m pytest "$@"
