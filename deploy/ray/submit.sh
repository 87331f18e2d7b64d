#!/usr/bin/env bash
# Submit an etarl training run to a Ray cluster as a Ray job, from the repository root.
#
#   deploy/ray/submit.sh [--address URL] [--run-root DIR] [--no-wait] [--submission-id ID] [--] [etarl train args ...]
#
#   deploy/ray/submit.sh run.steps=200 buffer.gate.eta=2          # local cluster on 127.0.0.1:8265
#   deploy/ray/submit.sh --address http://127.0.0.1:8265 -- --config deploy/k8s/my-run.yaml
#
# The job's code is this working tree (--working-dir .; .venv, .git, caches and runs are left
# out), so edits run without rebuilding an image. The entrypoint is `etarl train ray.address=auto
# ARGS`: the driver joins the job's cluster instead of starting its own. The cluster's Python
# must have etarl's dependencies (pip install -e ".[cpu]" or ".[gpu]" where `ray start` runs,
# or the image of deploy/docker/Dockerfile).
# Waits for the job and exits 0 only if it SUCCEEDED (--no-wait: exits after submitting).
# Address: --address, else $RAY_ADDRESS, else http://127.0.0.1:8265 (the dashboard's job API).
# Run folders: a run without run.run_dir goes under --run-root (else $ETARL_RUN_ROOT, else ./runs
# of this tree, right for a cluster on this machine only): a folder every node mounts at the same
# path (the run checks it before it starts). The job's ETARL_RUN_ROOT carries it.
set -euo pipefail
cd "$(dirname "$0")/../.."

address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
wait=1
run_root="${ETARL_RUN_ROOT:-$PWD/runs}"
submission_id="etarl-$(date +%Y%m%d-%H%M%S)-$$"
while [ $# -gt 0 ]; do
  case "$1" in
    --address) address="$2"; shift 2 ;;
    --address=*) address="${1#*=}"; shift ;;
    --run-root) run_root="$2"; shift 2 ;;
    --run-root=*) run_root="${1#*=}"; shift ;;
    --no-wait) wait=0; shift ;;
    --submission-id) submission_id="$2"; shift 2 ;;
    --submission-id=*) submission_id="${1#*=}"; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

# Ray >= 2.5x clusters started locally require a token (~/.ray/auth_token, made by the first
# `ray start`); the CLI sends it only in token mode. Use it when one is at hand; remote clusters
# get theirs through RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH.
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
  export RAY_AUTH_MODE=token
fi

RAY="${RAY:-ray}"
command -v "$RAY" >/dev/null 2>&1 || RAY=.venv/bin/ray
case "$run_root" in /*) ;; *) echo "[submit] --run-root must be an absolute path (the same on every node): $run_root" >&2; exit 2 ;; esac
case "$run_root" in *'"'*|*'\\'*) echo "[submit] --run-root must not hold quotes or backslashes: $run_root" >&2; exit 2 ;; esac
runtime_env='{
  "env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "ETARL_RUN_ROOT": "'"$run_root"'"},
  "excludes": [".venv/", ".git/", ".cache/", "runs/", "*.egg-info/", "__pycache__/", "*.pyc", ".pytest_cache/"]
}'

# `ray job submit` quotes each word of the entrypoint for the job's shell: pass them one by one.
entrypoint=(etarl train ray.address=auto "$@")

echo "[submit] $submission_id -> $address: ${entrypoint[*]}"
# A cluster that has just started may not have its job agent yet: retry that case only.
for attempt in $(seq 1 20); do
  if out="$("$RAY" job submit --address "$address" --submission-id "$submission_id" \
      --working-dir . --runtime-env-json "$runtime_env" --no-wait -- "${entrypoint[@]}" 2>&1)"; then
    echo "$out"; break
  fi
  case "$out" in
    *"No available agent"*) echo "[submit] the cluster's job agent is not up yet (try $attempt/20)"; sleep 3 ;;
    *) echo "$out" >&2; exit 1 ;;
  esac
  [ "$attempt" = 20 ] && { echo "$out" >&2; exit 1; }
done

if [ "$wait" = 0 ]; then
  echo "[submit] follow it with: $RAY job logs --address $address --follow $submission_id"
  exit 0
fi
# Stream the logs until the job ends, then judge it by its final status.
"$RAY" job logs --address "$address" --follow "$submission_id" || true
status="$("$RAY" job status --address "$address" "$submission_id" 2>&1 | tail -n 5)"
echo "$status"
if grep -qiE "succeeded" <<<"$status"; then
  exit 0
fi
echo "[submit] job $submission_id did not succeed" >&2
exit 1
