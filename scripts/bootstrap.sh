#!/usr/bin/env bash
# Create .venv and install otel-rl with everything it needs. Idempotent.
#   bash scripts/bootstrap.sh          # the package, torch, the example's needs
#   bash scripts/bootstrap.sh --test   # + test dependencies and the Prometheus binary
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch pinned: the CPU wheel on this machine; an unpinned torch pulls a multi-GB CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
  if ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null \
        || echo "warning: could not install prometheus; tests that need it will be skipped" >&2
    fi
  fi
else
  .venv/bin/python -m pip install -q -e ".[otlp,prometheus]"
fi
