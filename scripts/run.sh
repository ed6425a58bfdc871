#!/usr/bin/env bash
# The main job on embedded defaults: set up .venv (pinned), bootstrap the demo model if absent, serve it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/flywheel up "$@"
