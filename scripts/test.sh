#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
