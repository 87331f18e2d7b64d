#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
# Bytecode is written once and read after: where PYTHONDONTWRITEBYTECODE is set, every process the
# suite starts (runs, Ray actors, engines, gloo ranks) compiled etarl's sources again, and each worker
# rewrote every test file's asserts again (collecting the suite: 19 s without, 9 s with).
unset PYTHONDONTWRITEBYTECODE
# Two workers, each taking whole files (a file's module fixtures run once; tests/rollout_workers,
# whose files share one vLLM engine, is taken whole) in the order tests/conftest.py gives them,
# slow ones first. The suite's processes often wait on each other (Ray, engines, restarts): one
# worker kept this machine's 2 cores 68 % busy (35 min), two keep them 96 % busy (24 min). A later
# `-n N` (`-n 0`: no workers) on the command line wins.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "$@"
