#!/usr/bin/env bash
# The main job on embedded defaults: set up .venv (pinned, runtime requirements only), copy the shipped
# demo model if absent, run the whole loop (the gateway with its replicas, the joiner, the learner and the gate).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/flywheel up "$@"
